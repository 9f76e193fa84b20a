//! What an ExternalWorkload consists of, as pure functions: its sandbox Services and their
//! EndpointSlices (pointing at the tunnel proxy while the workstation's tunnel is up).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Container, Service, ServicePort as K8sServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use spur_api::keys::{annotations, labels};
use spur_api::tunnel::Session;
use spur_api::workloads::TunnelPort;
use spur_api::{ExternalWorkload, ServiceMapping, ServicePort, names};

use crate::baseline::Baseline;

/// `endpointslice.kubernetes.io/managed-by` of the slices the operator writes.
const SLICE_MANAGER: &str = "spur-operator.spur.dev";

/// What an ExternalWorkload consists of.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub services: Vec<(Service, ServiceMapping, EndpointSlice)>,
    /// The tunnel's proxy port for every mapped port, when the tunnel is up and has them all.
    pub tunnel_ports: Vec<TunnelPort>,
    pub connected: bool,
}

/// The workstation's tunnel as one ExternalWorkload sees it.
struct Tunnel<'a> {
    /// The session of the ExternalWorkload's own workstation, if any.
    session: Option<&'a Session>,
    connected: bool,
    /// The proxy port of each mapped port, by baseline port.
    proxy_ports: BTreeMap<i32, i32>,
}

/// Plans the sandbox Services and EndpointSlices of `ew` for its `baseline`, the Services of its
/// namespace, and the tunnel `session` (if any) at time `now`.
pub fn plan(
    ew: &ExternalWorkload,
    baseline: &Baseline,
    services: &[Service],
    session: Option<&Session>,
    now: i64,
) -> Plan {
    let ns = ew.namespace().unwrap_or_default();
    let mapped: BTreeSet<i32> = ew.spec.mappings.iter().map(|m| m.port).collect();
    let session = session.filter(|s| s.workstation == ew.spec.workstation);
    let tunnel = Tunnel {
        session,
        connected: session.is_some_and(|s| s.is_fresh(now)),
        proxy_ports: session
            .map(|s| s.ports_of(&ns, &ew.name_any()))
            .unwrap_or_default(),
    };
    let containers = baseline
        .workload
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|s| s.containers.clone())
        .unwrap_or_default();
    let mut out = Vec::new();
    for svc in baseline.selecting(services) {
        let svc_name = svc.name_any();
        let name = names::sandbox_service_name(&ew.spec.sandbox, &svc_name);
        let ports = mapped_ports(svc, &containers, &mapped);
        if ports.is_empty() {
            continue;
        }
        let mapping = ServiceMapping {
            baseline_service: svc_name.clone(),
            sandbox_service: name.clone(),
            ports: ports
                .iter()
                .map(|(p, target)| ServicePort {
                    port: p.port,
                    target_port: *target,
                })
                .collect(),
        };
        let service = sandbox_service(ew, &ns, &svc_name, &name, &ports);
        let slice = endpoint_slice(ew, &ns, &name, &ports, &tunnel);
        out.push((service, mapping, slice));
    }
    let tunnel_ports: Vec<TunnelPort> = ew
        .spec
        .mappings
        .iter()
        .filter_map(|m| {
            Some(TunnelPort {
                port: m.port,
                proxy_port: *tunnel.proxy_ports.get(&m.port)?,
            })
        })
        .collect();
    let all_ports = tunnel_ports.len() == ew.spec.mappings.len();
    Plan {
        services: out,
        tunnel_ports: if tunnel.connected && all_ports {
            tunnel_ports
        } else {
            Vec::new()
        },
        connected: tunnel.connected,
    }
}

/// The ports of `svc` that reach a mapped container port, each with that port. Only these:
/// keyed traffic on any other port stays with the baseline (the routes cover mapped ports only).
fn mapped_ports(
    svc: &Service,
    containers: &[Container],
    mapped: &BTreeSet<i32>,
) -> Vec<(K8sServicePort, i32)> {
    svc.spec
        .as_ref()
        .and_then(|s| s.ports.clone())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|p| {
            let target = crate::fork::resolve_target_port(&p, containers)?;
            mapped.contains(&target).then_some((p, target))
        })
        .collect()
}

/// The selector-less sandbox Service `name` standing for the baseline Service `svc_name`.
fn sandbox_service(
    ew: &ExternalWorkload,
    ns: &str,
    svc_name: &str,
    name: &str,
    ports: &[(K8sServicePort, i32)],
) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            labels: Some(owned_labels(ew)),
            annotations: Some(BTreeMap::from([(
                annotations::BASELINE.to_owned(),
                format!("Service/{ns}/{svc_name}"),
            )])),
            ..ObjectMeta::default()
        },
        // No selector: the EndpointSlice says where traffic goes.
        spec: Some(ServiceSpec {
            ports: Some(
                ports
                    .iter()
                    .map(|(p, _)| K8sServicePort {
                        name: p.name.clone(),
                        port: p.port,
                        protocol: p.protocol.clone(),
                        app_protocol: p.app_protocol.clone(),
                        ..K8sServicePort::default()
                    })
                    .collect(),
            ),
            type_: Some("ClusterIP".into()),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// The EndpointSlice of the sandbox Service `name`: the tunnel proxy's address and ports while
/// the tunnel is up and forwards every port, no endpoint otherwise.
fn endpoint_slice(
    ew: &ExternalWorkload,
    ns: &str,
    name: &str,
    ports: &[(K8sServicePort, i32)],
    tunnel: &Tunnel<'_>,
) -> EndpointSlice {
    let mut meta_labels = owned_labels(ew);
    meta_labels.insert("kubernetes.io/service-name".into(), name.to_owned());
    meta_labels.insert(
        "endpointslice.kubernetes.io/managed-by".into(),
        SLICE_MANAGER.into(),
    );
    let slice_ports: Vec<EndpointPort> = ports
        .iter()
        .filter_map(|(p, target)| {
            Some(EndpointPort {
                name: Some(p.name.clone().unwrap_or_default()),
                port: Some(*tunnel.proxy_ports.get(target)?),
                protocol: Some(p.protocol.clone().unwrap_or_else(|| "TCP".into())),
                app_protocol: p.app_protocol.clone(),
            })
        })
        .collect();
    let complete = slice_ports.len() == ports.len();
    let endpoints = match tunnel.session {
        Some(s) if tunnel.connected && complete => vec![Endpoint {
            addresses: vec![s.address.clone()],
            conditions: Some(EndpointConditions {
                ready: Some(true),
                serving: Some(true),
                terminating: Some(false),
            }),
            ..Endpoint::default()
        }],
        _ => Vec::new(),
    };
    let address_type = match tunnel
        .session
        .map(|s| s.address.parse::<std::net::IpAddr>())
    {
        Some(Ok(std::net::IpAddr::V6(_))) => "IPv6",
        _ => "IPv4",
    };
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            labels: Some(meta_labels),
            ..ObjectMeta::default()
        },
        address_type: address_type.into(),
        endpoints,
        ports: Some(slice_ports),
    }
}

fn owned_labels(ew: &ExternalWorkload) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            labels::MANAGED_BY.to_owned(),
            labels::MANAGED_BY_VALUE.to_owned(),
        ),
        (labels::SANDBOX.to_owned(), ew.spec.sandbox.clone()),
        (labels::ROUTING_KEY.to_owned(), ew.spec.routing_key.clone()),
        (labels::EXTERNAL_WORKLOAD.to_owned(), ew.name_any()),
    ])
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;
    use spur_api::tunnel::PortAssignment;

    use super::*;

    pub(in crate::external) fn ew() -> ExternalWorkload {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ExternalWorkload",
            "metadata": {"name": "sb-api", "namespace": "shop"},
            "spec": {"sandbox": "sb", "routingKey": "k1", "name": "api", "workstation": "alice",
                     "baseline": {"kind": "Deployment", "namespace": "shop", "name": "api"},
                     "mappings": [{"port": 8080, "toLocal": "localhost:3000"}]}
        }))
        .unwrap()
    }

    pub(in crate::external) fn baseline() -> Baseline {
        Baseline::deployment(serde_json::from_value(json!({
            "metadata": {"name": "api", "namespace": "shop"},
            "spec": {"selector": {"matchLabels": {"app": "api"}},
                     "template": {"metadata": {"labels": {"app": "api"}},
                                  "spec": {"containers": [{"name": "api", "image": "api", "ports": [{"name": "http", "containerPort": 8080}, {"name": "admin", "containerPort": 9000}]}]}}}
        }))
        .unwrap())
    }

    pub(in crate::external) fn services() -> Vec<Service> {
        vec![
            serde_json::from_value(json!({
                "metadata": {"name": "api", "namespace": "shop"},
                "spec": {"selector": {"app": "api"}, "ports": [
                    {"name": "http", "port": 80, "targetPort": "http"},
                    {"name": "admin", "port": 9000, "targetPort": 9000}]}
            }))
            .unwrap(),
            serde_json::from_value(json!({
                "metadata": {"name": "other", "namespace": "shop"},
                "spec": {"selector": {"app": "other"}, "ports": [{"port": 80}]}
            }))
            .unwrap(),
        ]
    }

    pub(in crate::external) fn session(renewed: i64) -> Session {
        Session {
            workstation: "alice".into(),
            proxy_pod: "tp-0".into(),
            address: "10.0.0.7".into(),
            ports: vec![PortAssignment {
                namespace: "shop".into(),
                external_workload: "sb-api".into(),
                port: 8080,
                proxy_port: 31001,
            }],
            renewed,
            duration: 10,
            started_micros: 0,
        }
    }

    #[test]
    fn selectorless_services_with_mapped_ports_and_tunnel_endpoints() {
        let p = plan(&ew(), &baseline(), &services(), Some(&session(100)), 105);
        assert!(p.connected);
        assert_eq!(
            p.tunnel_ports,
            vec![TunnelPort {
                port: 8080,
                proxy_port: 31001
            }]
        );
        assert_eq!(
            p.services.len(),
            1,
            "only the Service selecting the baseline"
        );
        let (svc, mapping, slice) = &p.services[0];
        let spec = svc.spec.as_ref().unwrap();
        assert!(spec.selector.is_none());
        let ports = spec.ports.as_ref().unwrap();
        assert_eq!(ports.len(), 1, "the unmapped admin port is left out");
        assert_eq!(
            (ports[0].port, ports[0].name.as_deref()),
            (80, Some("http"))
        );
        assert_eq!(
            mapping.ports,
            vec![ServicePort {
                port: 80,
                target_port: 8080
            }]
        );
        assert_eq!(slice.endpoints[0].addresses, vec!["10.0.0.7".to_string()]);
        let sp = &slice.ports.as_ref().unwrap()[0];
        assert_eq!((sp.name.as_deref(), sp.port), (Some("http"), Some(31001)));
        assert_eq!(
            slice.metadata.labels.as_ref().unwrap()["kubernetes.io/service-name"],
            svc.name_any()
        );
    }

    #[test]
    fn stale_missing_or_foreign_tunnels_leave_no_endpoints() {
        for (s, now) in [
            (Some(session(100)), 110),
            (None, 105),
            (
                Some(Session {
                    workstation: "bob".into(),
                    ..session(100)
                }),
                105,
            ),
        ] {
            let p = plan(&ew(), &baseline(), &services(), s.as_ref(), now);
            assert!(!p.connected);
            assert!(p.tunnel_ports.is_empty());
            assert!(p.services[0].2.endpoints.is_empty());
        }
        // Up, but not forwarding the mapped port yet.
        let mut s = session(100);
        s.ports.clear();
        let p = plan(&ew(), &baseline(), &services(), Some(&s), 105);
        assert!(p.connected && p.tunnel_ports.is_empty());
        assert!(p.services[0].2.endpoints.is_empty());
    }

    #[test]
    fn the_slice_takes_the_address_family_of_the_tunnel_proxy() {
        let v6 = Session {
            address: "fd00::7".into(),
            ..session(100)
        };
        let p = plan(&ew(), &baseline(), &services(), Some(&v6), 105);
        let slice = &p.services[0].2;
        assert_eq!(slice.address_type, "IPv6");
        assert_eq!(slice.endpoints[0].addresses, vec!["fd00::7".to_string()]);
        let p = plan(&ew(), &baseline(), &services(), None, 105);
        assert_eq!(p.services[0].2.address_type, "IPv4");
    }

    #[test]
    fn services_reaching_no_mapped_port_get_no_sandbox_service() {
        let mut ew = ew();
        ew.spec.mappings[0].port = 7000;
        let p = plan(&ew, &baseline(), &services(), Some(&session(100)), 105);
        assert!(p.services.is_empty());
        assert!(p.connected, "the tunnel is up, it forwards nothing of use");
        assert!(p.tunnel_ports.is_empty());
    }

    #[test]
    fn sandbox_objects_carry_the_workloads_labels_and_the_baseline() {
        let p = plan(&ew(), &baseline(), &services(), None, 105);
        let (svc, mapping, slice) = &p.services[0];
        assert_eq!(svc.name_any(), mapping.sandbox_service);
        assert_eq!(mapping.baseline_service, "api");
        assert_eq!(
            svc.annotations()[annotations::BASELINE],
            "Service/shop/api".to_string()
        );
        for l in [svc.labels(), slice.labels()] {
            assert_eq!(l[labels::EXTERNAL_WORKLOAD], "sb-api");
            assert_eq!(l[labels::SANDBOX], "sb");
            assert_eq!(l[labels::ROUTING_KEY], "k1");
        }
        assert_eq!(
            slice.labels()["endpointslice.kubernetes.io/managed-by"],
            SLICE_MANAGER
        );
        // Without a session the slice still lists no port: there is nothing to point at.
        assert_eq!(slice.ports.as_deref(), Some(&[][..]));
    }
}
