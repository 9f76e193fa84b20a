//! What `spur route explain` concludes, as pure functions: which sandbox or route group a key
//! belongs to and where it sends a Service's port, and, from one baseline sidecar's
//! `/config_dump`, whether that sidecar has the rule live.

use k8s_openapi::api::core::v1::{Pod, Service, ServicePort};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use spur_api::{RouteGroup, Sandbox};

/// A rule of a sidecar's `/config_dump` (`spur_routing::RuleSpec`'s JSON), read without
/// refusing fields this command does not know.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct DumpedRule {
    routing_key: String,
    baseline: DumpedBaseline,
    #[serde(default)]
    mappings: Vec<DumpedMapping>,
}

#[derive(serde::Deserialize)]
struct DumpedBaseline {
    kind: String,
    namespace: String,
    name: String,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct DumpedMapping {
    workload_port: u32,
    #[serde(default)]
    destinations: Vec<DumpedLocation>,
}

#[derive(serde::Deserialize)]
struct DumpedLocation {
    host: String,
    port: u32,
}

/// `NAME[.NAMESPACE][:PORT]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    pub name: String,
    pub namespace: Option<String>,
    pub port: Option<u16>,
}

pub(crate) fn parse_target(s: &str) -> Result<Target, String> {
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) => (
            h,
            Some(
                p.parse::<u16>()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| format!("{s:?}: the port must be 1-65535"))?,
            ),
        ),
        None => (s, None),
    };
    // `svc`, `svc.ns`, `svc.ns.svc`, `svc.ns.svc.cluster.local`.
    let mut parts = host.split('.');
    let name = parts.next().unwrap_or_default();
    let namespace = parts.next();
    let rest: Vec<&str> = parts.collect();
    let dns_label = spur_api::validation::is_dns_label;
    if !dns_label(name) || namespace.is_some_and(|n| !dns_label(n)) {
        return Err(format!(
            "{s:?}: expected SERVICE[.NAMESPACE][:PORT] (a Service name, its namespace, a port)"
        ));
    }
    if !rest.is_empty() && rest.first() != Some(&"svc") {
        return Err(format!(
            "{s:?}: expected SERVICE[.NAMESPACE][.svc[.<cluster domain>]][:PORT]"
        ));
    }
    Ok(Target {
        name: name.to_string(),
        namespace: namespace.map(str::to_string),
        port,
    })
}

/// Who owns a key and where it sends the Service's requests, as the objects' status says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Owner {
    /// `Sandbox x` or `RouteGroup g`.
    pub what: String,
    /// For each sandbox it reaches (one, or a route group's matched ones): the sandbox and the
    /// destinations it gives this Service (`host:port` of its sandbox Service, or how it is served).
    pub sandboxes: Vec<(String, Vec<String>)>,
}

/// Where the sandboxes in `names` send `service` (in `ns`): their forks' sandbox Services (a
/// local or virtual workload's destination shows only in the sidecars' rules below).
fn destinations(
    sandboxes: &[Sandbox],
    names: &[String],
    ns: &str,
    service: &str,
) -> Vec<(String, Vec<String>)> {
    names
        .iter()
        .map(|n| {
            let dests = sandboxes
                .iter()
                .find(|s| s.metadata.name.as_deref() == Some(n))
                .map(|sb| {
                    let st = sb.status.clone().unwrap_or_default();
                    st.forks
                        .iter()
                        .filter(|f| f.fork_of.namespace == ns)
                        .flat_map(|f| f.services.iter())
                        .filter(|m| m.baseline_service == service)
                        .flat_map(|m| {
                            m.ports.iter().map(move |p| {
                                format!("{}.{ns}.svc:{} (fork)", m.sandbox_service, p.port)
                            })
                        })
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default();
            (n.clone(), dests)
        })
        .collect()
}

/// The sandbox or route group whose key is `key`, from what the user can list.
pub(crate) fn owner(
    key: &str,
    sandboxes: &[Sandbox],
    groups: &[RouteGroup],
    ns: &str,
    service: &str,
) -> Option<Owner> {
    let key_of_sb =
        |s: &&Sandbox| s.status.as_ref().and_then(|st| st.routing_key.as_deref()) == Some(key);
    if let Some(sb) = sandboxes.iter().find(key_of_sb) {
        let name = sb.metadata.name.clone().unwrap_or_default();
        return Some(Owner {
            what: format!("Sandbox {name}"),
            sandboxes: destinations(sandboxes, &[name], ns, service),
        });
    }
    let rg = groups
        .iter()
        .find(|g| g.status.as_ref().and_then(|st| st.routing_key.as_deref()) == Some(key))?;
    let matched = rg
        .status
        .as_ref()
        .map(|st| st.matched_sandboxes.clone())
        .unwrap_or_default();
    Some(Owner {
        what: format!(
            "RouteGroup {}",
            rg.metadata.name.clone().unwrap_or_default()
        ),
        sandboxes: destinations(sandboxes, &matched, ns, service),
    })
}

/// The Service's ports to explain: `port` (which it must have), or all.
pub(crate) fn service_ports(svc: &Service, port: Option<u16>) -> Result<Vec<ServicePort>, String> {
    let ports = svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.clone())
        .unwrap_or_default();
    let chosen: Vec<ServicePort> = ports
        .iter()
        .filter(|p| port.is_none_or(|want| i32::from(want) == p.port))
        .cloned()
        .collect();
    if chosen.is_empty() {
        let have: Vec<String> = ports.iter().map(|p| p.port.to_string()).collect();
        return Err(match port {
            Some(p) => format!("it has no port {p} (it has: {})", have.join(", ")),
            None => "it has no port".into(),
        });
    }
    Ok(chosen)
}

/// The container port each of `ports` reaches on `pod` (a named target port resolved against
/// the pod's containers; one this pod does not name is an error, not left out).
pub(crate) fn workload_ports(ports: &[ServicePort], pod: &Pod) -> Result<Vec<u16>, String> {
    let mut out = Vec::new();
    for p in ports {
        let target = match &p.target_port {
            None => u16::try_from(p.port).ok(),
            Some(IntOrString::Int(n)) => u16::try_from(*n).ok(),
            Some(IntOrString::String(name)) => Some(
                pod.spec
                    .as_ref()
                    .into_iter()
                    .flat_map(|s| s.containers.iter())
                    .flat_map(|c| c.ports.iter().flatten())
                    .find(|cp| cp.name.as_deref() == Some(name.as_str()))
                    .and_then(|cp| u16::try_from(cp.container_port).ok())
                    .ok_or_else(|| {
                        format!(
                            "Service port {} targets the port named {name:?}, which this pod does not have",
                            p.port
                        )
                    })?,
            ),
        };
        out.extend(target);
    }
    Ok(out)
}

/// One baseline sidecar's view of the key, from its `/config_dump`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SidecarView {
    /// The rule for the key is in its table, for every port asked: `host:port` per workload port.
    Live {
        version: u64,
        destinations: Vec<(u16, Vec<String>)>,
    },
    /// No rule for the key (for some of the ports).
    Missing { version: u64, ports: Vec<u16> },
    /// The dump could not be understood.
    Unreadable(String),
}

/// What the sidecar of `dump` does with `key` for `workload_ports` of its own baseline.
pub(crate) fn sidecar_view(
    dump: &serde_json::Value,
    key: &str,
    workload_ports: &[u16],
) -> SidecarView {
    let version = dump["tableVersion"].as_u64().unwrap_or_default();
    let baseline = &dump["identity"]["baseline"];
    let (Some(kind), Some(ns), Some(name)) = (
        baseline["kind"].as_str(),
        baseline["namespace"].as_str(),
        baseline["name"].as_str(),
    ) else {
        return SidecarView::Unreadable("its config dump names no baseline".into());
    };
    let Some(listed) = dump["routingRules"].as_array() else {
        return SidecarView::Unreadable("its config dump has no routing rules list".into());
    };
    // Each rule on its own and leniently: a sidecar of another version may add fields.
    let rules: Vec<DumpedRule> = listed
        .iter()
        .filter_map(|r| serde_json::from_value(r.clone()).ok())
        .collect();
    let rule = rules.iter().find(|r| {
        r.routing_key == key
            && r.baseline.kind == kind
            && r.baseline.namespace == ns
            && r.baseline.name == name
    });
    let mut live = Vec::new();
    let mut missing = Vec::new();
    for &wp in workload_ports {
        let m = rule.and_then(|r| r.mappings.iter().find(|m| m.workload_port == u32::from(wp)));
        match m {
            Some(m) => live.push((
                wp,
                m.destinations
                    .iter()
                    .map(|d| format!("{}:{}", d.host, d.port))
                    .collect(),
            )),
            None => missing.push(wp),
        }
    }
    if missing.is_empty() {
        SidecarView::Live {
            version,
            destinations: live,
        }
    } else {
        SidecarView::Missing {
            version,
            ports: missing,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn targets_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_target("route.hotrod:8080").unwrap(),
            Target {
                name: "route".into(),
                namespace: Some("hotrod".into()),
                port: Some(8080)
            }
        );
        assert_eq!(parse_target("route").unwrap().namespace, None);
        assert_eq!(
            parse_target("route.hotrod.svc.cluster.local")
                .unwrap()
                .namespace
                .as_deref(),
            Some("hotrod")
        );
        for bad in [
            "",
            "Route",
            "route:0",
            "route:http",
            "route.hotrod.example.com",
            "a..b",
        ] {
            assert!(parse_target(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_sidecar_has_the_rule_or_says_which_port_it_lacks() {
        let dump = json!({
            "identity": {"role": "sidecar", "baseline": {"kind": "Deployment", "namespace": "hotrod", "name": "route"}},
            "tableVersion": 7,
            "routingRules": [
                {"routingKey": "k1", "baseline": {"kind": "Deployment", "namespace": "hotrod", "name": "route"},
                 "destinationSandbox": {"name": "pr-42"},
                 "mappings": [{"workloadPort": 8080, "destinations": [{"host": "pr-42-route.hotrod.svc", "port": 8080}]}]},
                {"routingKey": "k2", "baseline": {"kind": "Deployment", "namespace": "hotrod", "name": "other"},
                 "destinationSandbox": {"name": "x"}, "mappings": [{"workloadPort": 8080, "destinations": []}]}
            ]
        });
        assert_eq!(
            sidecar_view(&dump, "k1", &[8080]),
            SidecarView::Live {
                version: 7,
                destinations: vec![(8080, vec!["pr-42-route.hotrod.svc:8080".into()])]
            }
        );
        assert_eq!(
            sidecar_view(&dump, "k1", &[8080, 9090]),
            SidecarView::Missing {
                version: 7,
                ports: vec![9090]
            }
        );
        // Another baseline's rule for the key does not count here.
        assert!(matches!(
            sidecar_view(&dump, "k2", &[8080]),
            SidecarView::Missing { .. }
        ));
        assert!(matches!(
            sidecar_view(&json!({"routingRules": []}), "k1", &[8080]),
            SidecarView::Unreadable(_)
        ));
        // A sidecar of a later version may add fields to its rules.
        let mut newer = dump.clone();
        newer["routingRules"][0]["weight"] = json!(5);
        assert!(matches!(
            sidecar_view(&newer, "k1", &[8080]),
            SidecarView::Live { .. }
        ));
    }

    #[test]
    fn ports_are_the_services_and_named_ones_must_resolve() {
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": "route"},
            "spec": {"ports": [{"port": 80, "targetPort": "http"}, {"port": 9090, "targetPort": 9091}]}
        }))
        .unwrap();
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}]}
        }))
        .unwrap();
        let all = service_ports(&svc, None).unwrap();
        assert_eq!(workload_ports(&all, &pod).unwrap(), [8080, 9091]);
        assert_eq!(
            service_ports(&svc, Some(8080)).unwrap_err(),
            "it has no port 8080 (it has: 80, 9090)"
        );
        let bare: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}
        }))
        .unwrap();
        assert!(
            workload_ports(&all, &bare)
                .unwrap_err()
                .contains("targets the port named \"http\", which this pod does not have")
        );
    }

    #[test]
    fn the_owner_of_a_key_and_its_destinations() {
        let sb: Sandbox = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox", "metadata": {"name": "pr-42"},
            "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": "hotrod", "name": "route"}}]},
            "status": {"routingKey": "k1", "forks": [{
                "forkOf": {"kind": "Deployment", "namespace": "hotrod", "name": "route"},
                "forkedWorkload": "fw", "ready": true,
                "services": [{"baselineService": "route", "sandboxService": "pr-42-route",
                              "ports": [{"port": 8080, "targetPort": 8080}]}]}]}
        }))
        .unwrap();
        let rg: RouteGroup = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "RouteGroup", "metadata": {"name": "team"},
            "spec": {"match": {"label": {"key": "team", "value": "x"}}},
            "status": {"routingKey": "g1", "matchedSandboxes": ["pr-42"]}
        }))
        .unwrap();
        let sbs = [sb];
        let groups = [rg];
        let own = owner("k1", &sbs, &groups, "hotrod", "route").unwrap();
        assert_eq!(own.what, "Sandbox pr-42");
        assert_eq!(
            own.sandboxes,
            [(
                "pr-42".to_string(),
                vec!["pr-42-route.hotrod.svc:8080 (fork)".to_string()]
            )]
        );
        assert_eq!(
            owner("g1", &sbs, &groups, "hotrod", "route").unwrap().what,
            "RouteGroup team"
        );
        assert!(
            owner("k1", &sbs, &groups, "hotrod", "frontend")
                .unwrap()
                .sandboxes[0]
                .1
                .is_empty()
        );
        assert!(owner("nope", &sbs, &groups, "hotrod", "route").is_none());
    }
}
