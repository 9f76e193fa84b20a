//! What the xDS server serves, in Spur's terms: every Service port of the cluster, the routing
//! keys that divert its traffic to a sandbox Service, and the endpoints behind each Service port.
//!
//! Built from the same RoutingConfigs that feed the Routes API, plus Services and EndpointSlices,
//! so a proxyless client and a Spur sidecar route one key the same way. Users' own resources
//! ([`NodeConfig`]) are added by [`super::node_config`].

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service, ServicePort};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kube::core::PartialObjectMeta;
use spur_api::RoutingConfig;
use spur_api::carriers::{ExtractConfig, of_namespace};
use spur_api::common::service_host;

use super::kind::KINDS;

/// The label that ties an EndpointSlice to its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The desired xDS state of the whole cluster. Names are `<name>.<namespace>.svc:<port>`, the
/// same for a Service port's listener, route configuration and cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Model {
    pub services: BTreeMap<String, ServiceRoutes>,
    /// Ready endpoints of every Service port, by cluster name.
    pub clusters: BTreeMap<String, Vec<SocketAddr>>,
    /// Users' own Envoy resources (EnvoyConfig), by node id, then by the EnvoyConfig's
    /// namespace: a stream of a node id listed here whose client certificate is of one of
    /// these namespaces is served that namespace's resources instead of the cluster's.
    pub node_configs: BTreeMap<String, BTreeMap<String, Arc<NodeConfig>>>,
}

/// The published revision of an EnvoyConfig, as served to its node id in its namespace.
#[derive(Clone, PartialEq, Eq)]
pub struct NodeConfig {
    /// `namespace/name` of the EnvoyConfigRevision.
    /// Shared with every stream that serves it (each one tags what it sends with it).
    pub revision: Arc<str>,
    /// The revision's namespace: it goes only to clients whose certificate is of it.
    pub namespace: String,
    /// Its version, which every response from it carries.
    pub version: String,
    /// The SDS version: the revision's, and a digest of the secrets' bytes, so that a Secret
    /// that changes under one revision is a new version too.
    pub secrets_version: String,
    /// Resources by type ([`super::kind::Kind::index`]) and name.
    pub types: [BTreeMap<String, Arc<Any>>; KINDS],
    /// Secrets the revision names that cannot be served, each with the reason.
    pub unresolved_secrets: Vec<String>,
}

// By hand: the secrets' bytes hold private keys, which no log line may carry.
impl std::fmt::Debug for NodeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeConfig")
            .field("revision", &self.revision)
            .field("namespace", &self.namespace)
            .field("version", &self.version)
            .field("secrets_version", &self.secrets_version)
            .field(
                "resources",
                &self.types.iter().map(BTreeMap::len).collect::<Vec<_>>(),
            )
            .field("unresolved_secrets", &self.unresolved_secrets)
            .finish()
    }
}

/// The Secrets SDS may serve: those labelled `spur.dev/envoy-secret=true` in the namespaces the
/// route server watches (none unless it is told to).
#[derive(Clone, Copy, Default)]
pub struct TlsSecrets<'a> {
    pub namespaces: &'a [String],
    pub secrets: &'a [Arc<Secret>],
}

/// The routes of one Service port: each key's sandbox cluster, then the baseline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceRoutes {
    /// In routing-key order; at most one entry per key.
    pub keyed: Vec<KeyRoute>,
    /// The carriers the routes match besides the standard ones: the Service's namespace's
    /// ([`Carriers::of`]); left default on a port without keyed routes.
    pub carriers: ExtractConfig,
}

/// The routing-key carriers read in each namespace: the cluster's (`--routing-header`,
/// `--query-param`, the chart's `routingKeys`), changed by a namespace's annotations
/// ([`spur_api::carriers::of_namespace`]), as the sidecars injected there read them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Carriers {
    pub cluster: ExtractConfig,
    /// Only the namespaces whose annotations change the cluster's.
    pub by_namespace: BTreeMap<String, ExtractConfig>,
}

impl Carriers {
    /// The carriers of every namespace in `namespaces`, and a problem for each whose
    /// annotations are malformed (its routes then match the cluster's carriers, and the webhook
    /// injects no sidecar there).
    pub fn build(
        cluster: &ExtractConfig,
        namespaces: &[Arc<PartialObjectMeta<Namespace>>],
    ) -> (Carriers, Vec<String>) {
        let mut out = Carriers {
            cluster: cluster.clone(),
            by_namespace: BTreeMap::new(),
        };
        let mut problems = Vec::new();
        for ns in namespaces {
            match of_namespace(cluster, Some(ns.annotations())) {
                Ok(None) => {}
                Ok(Some(cfg)) => {
                    out.by_namespace.insert(ns.name_any(), cfg);
                }
                Err(e) => problems.push(format!(
                    "namespace {}: {e}; its xDS routes match the cluster's carriers",
                    ns.name_any()
                )),
            }
        }
        (out, problems)
    }

    pub fn of(&self, namespace: &str) -> &ExtractConfig {
        self.by_namespace.get(namespace).unwrap_or(&self.cluster)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRoute {
    pub key: String,
    pub sandbox: String,
    pub cluster: String,
}

/// `host:port`, the one naming scheme of every resource.
pub fn resource_name(host: &str, port: i32) -> String {
    format!("{host}:{port}")
}

impl Model {
    /// The model of a cluster. RoutingConfigs must come in a stable order: when two give one
    /// Service port a route for the same key, the first wins, as in the Routes API's index.
    pub fn build(
        services: &[Arc<Service>],
        configs: &[Arc<RoutingConfig>],
        slices: &[Arc<EndpointSlice>],
        carriers: &Carriers,
    ) -> Model {
        let mut by_service: BTreeMap<(String, String), Vec<&EndpointSlice>> = BTreeMap::new();
        for s in slices {
            let (Some(ns), Some(svc)) = (s.namespace(), s.labels().get(SERVICE_NAME_LABEL)) else {
                continue;
            };
            by_service.entry((ns, svc.clone())).or_default().push(s);
        }
        let mut model = Model::default();
        for svc in services {
            let (Some(ns), Some(spec)) = (svc.namespace(), svc.spec.as_ref()) else {
                continue;
            };
            // An ExternalName Service has no endpoints to balance over.
            if spec.type_.as_deref() == Some("ExternalName") {
                continue;
            }
            let host = service_host(&svc.name_any(), &ns);
            let svc_slices = by_service
                .get(&(ns.clone(), svc.name_any()))
                .map_or(&[][..], |v| &v[..]);
            for port in spec.ports.iter().flatten() {
                // UDP and SCTP ports carry no gRPC.
                if port.protocol.as_deref().is_some_and(|p| p != "TCP") {
                    continue;
                }
                let name = resource_name(&host, port.port);
                model
                    .clusters
                    .insert(name.clone(), endpoints(port, svc_slices));
                model.services.insert(name, ServiceRoutes::default());
            }
        }
        let mut seen: BTreeSet<(String, String)> = BTreeSet::new();
        for rc in configs {
            let key = &rc.spec.routing_key;
            let routes = rc
                .status
                .as_ref()
                .and_then(|s| s.route_server.as_ref())
                .map_or(&[][..], |r| &r.routes[..]);
            for r in routes {
                let from = resource_name(&r.from_host, r.from_port);
                let to = resource_name(&r.to_host, r.to_port);
                // The first config to claim a key for a Service port keeps it, as in the Routes
                // API's index, even while its sandbox Service does not exist yet: until then the
                // baseline keeps the key's calls (they would go nowhere).
                if !seen.insert((from.clone(), key.clone())) || !model.clusters.contains_key(&to) {
                    continue;
                }
                if let Some(s) = model.services.get_mut(&from) {
                    if s.keyed.is_empty() {
                        // The baseline Service is in its workload's namespace.
                        s.carriers = carriers.of(&r.baseline.namespace).clone();
                    }
                    s.keyed.push(KeyRoute {
                        key: key.clone(),
                        sandbox: r.sandbox.clone(),
                        cluster: to,
                    });
                }
            }
        }
        for s in model.services.values_mut() {
            s.keyed.sort_by(|a, b| a.key.cmp(&b.key));
        }
        model
    }
}

/// The ready addresses behind one Service port: the slices' port of the same name (the
/// Service's target port, resolved by the EndpointSlice controller per pod).
fn endpoints(port: &ServicePort, slices: &[&EndpointSlice]) -> Vec<SocketAddr> {
    let want = port.name.as_deref().unwrap_or("");
    let mut out = BTreeSet::new();
    for s in slices {
        if !matches!(s.address_type.as_str(), "IPv4" | "IPv6") {
            continue;
        }
        let Some(target) = s
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref().unwrap_or("") == want)
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok())
        else {
            continue;
        };
        for e in &s.endpoints {
            // No condition means ready (the API's own reading of an unset field).
            if e.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            for a in &e.addresses {
                if let Ok(ip) = a.parse::<IpAddr>() {
                    out.insert(SocketAddr::new(ip, target));
                }
            }
        }
    }
    out.into_iter().collect()
}

/// The Service-port name a client's listener name stands for: `<svc>.<ns>[.svc[.<domain>]][:port]`
/// (trailing dot allowed). Without a port, a Service with a single port is meant.
pub fn canonical_listener(model: &Model, requested: &str, cluster_domain: &str) -> Option<String> {
    let (host, port) = match requested.rsplit_once(':') {
        // Digits only, no leading zero: one spelling per port, so a client cannot make the
        // server render the same listener under endless names.
        Some((h, p)) if !p.starts_with('0') && p.bytes().all(|b| b.is_ascii_digit()) => {
            (h, Some(p.parse::<u16>().ok()?))
        }
        Some(_) => return None,
        None => (requested, None),
    };
    let host = host.strip_suffix('.').unwrap_or(host);
    let host = host
        .strip_suffix(cluster_domain)
        .and_then(|h| h.strip_suffix('.'))
        .unwrap_or(host);
    let host = host.strip_suffix(".svc").unwrap_or(host);
    let (name, ns) = host.split_once('.')?;
    if name.is_empty() || ns.is_empty() || ns.contains('.') {
        return None;
    }
    let base = service_host(name, ns);
    match port {
        Some(p) => {
            let n = resource_name(&base, i32::from(p));
            model.services.contains_key(&n).then_some(n)
        }
        None => {
            let prefix = format!("{base}:");
            let mut ports = model.services.range(prefix.clone()..).map(|(k, _)| k);
            let first = ports.next().filter(|k| k.starts_with(&prefix))?;
            let more = ports.next().is_some_and(|k| k.starts_with(&prefix));
            (!more).then(|| first.clone())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(ns: &str, name: &str, ports: &[(&str, i32)]) -> Arc<Service> {
        let ports: Vec<_> = ports
            .iter()
            .map(|(n, p)| json!({"name": n, "port": p, "protocol": "TCP"}))
            .collect();
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": ns},
                "spec": {"ports": ports},
            }))
            .unwrap(),
        )
    }

    fn slice(ns: &str, svc: &str, port: (&str, i32), ips: &[(&str, bool)]) -> Arc<EndpointSlice> {
        let endpoints: Vec<_> = ips
            .iter()
            .map(|(ip, ready)| json!({"addresses": [ip], "conditions": {"ready": ready}}))
            .collect();
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": format!("{svc}-x"), "namespace": ns,
                             "labels": {SERVICE_NAME_LABEL: svc}},
                "addressType": "IPv4",
                "ports": [{"name": port.0, "port": port.1}],
                "endpoints": endpoints,
            }))
            .unwrap(),
        )
    }

    fn config(key: &str, sandbox: &str, from: (&str, i32), to: (&str, i32)) -> Arc<RoutingConfig> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": sandbox},
                "spec": {"routingKey": key, "workloads": []},
                "status": {"routeServer": {"routes": [{
                    "fromHost": from.0, "fromPort": from.1, "toHost": to.0, "toPort": to.1,
                    "workloadPort": 8080, "sandbox": sandbox,
                    "baseline": {"kind": "Deployment", "namespace": "default", "name": "api"},
                }]}},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn services_endpoints_and_keyed_routes() {
        let services = [
            svc("default", "api", &[("grpc", 80), ("metrics", 9090)]),
            svc("default", "sb1-api", &[("grpc", 80)]),
        ];
        let slices = [
            slice(
                "default",
                "api",
                ("grpc", 8080),
                &[("10.0.0.1", true), ("10.0.0.2", false)],
            ),
            slice("default", "sb1-api", ("grpc", 8081), &[("10.0.0.3", true)]),
        ];
        let configs = [
            config(
                "k1",
                "sb1",
                ("api.default.svc", 80),
                ("sb1-api.default.svc", 80),
            ),
            // Same key again: the first config keeps it.
            config(
                "k1",
                "sb2",
                ("api.default.svc", 80),
                ("api.default.svc", 9090),
            ),
            // A sandbox Service that does not exist yet: no route.
            config(
                "k3",
                "sb3",
                ("api.default.svc", 80),
                ("sb3-api.default.svc", 80),
            ),
        ];
        let m = Model::build(&services, &configs, &slices, &Carriers::default());
        assert_eq!(
            m.clusters["api.default.svc:80"],
            vec!["10.0.0.1:8080".parse().unwrap()]
        );
        assert!(m.clusters["api.default.svc:9090"].is_empty());
        assert_eq!(
            m.services["api.default.svc:80"].keyed,
            vec![KeyRoute {
                key: "k1".into(),
                sandbox: "sb1".into(),
                cluster: "sb1-api.default.svc:80".into()
            }]
        );
        assert!(m.services["sb1-api.default.svc:80"].keyed.is_empty());
    }

    #[test]
    fn listener_names_clients_may_use() {
        let services = [
            svc("default", "api", &[("grpc", 80), ("metrics", 9090)]),
            svc("ns2", "one", &[("", 50051)]),
        ];
        let m = Model::build(&services, &[], &[], &Carriers::default());
        let c = |n: &str| canonical_listener(&m, n, "cluster.local");
        for n in [
            "api.default:80",
            "api.default.svc:80",
            "api.default.svc.cluster.local:80",
            "api.default.svc.cluster.local.:80",
        ] {
            assert_eq!(c(n).as_deref(), Some("api.default.svc:80"), "{n}");
        }
        assert_eq!(c("one.ns2").as_deref(), Some("one.ns2.svc:50051"));
        // Two ports: which one is ambiguous.
        assert_eq!(c("api.default"), None);
        for n in [
            "api:80",
            "api.default:81",
            "api.default:x",
            "a.b.c.d:80",
            ".default:80",
            "",
        ] {
            assert_eq!(c(n), None, "{n}");
        }
    }
}
