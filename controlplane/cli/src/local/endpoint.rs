//! Where a workstation dials the tunnel proxy, found in the cluster with the user's own rights
//! when the command line does not say: the Service `spur-tunnel-proxy` (the chart lets every
//! authenticated user read it; it holds addresses and ports, nothing secret) and, for a
//! NodePort Service, a node's address (if the user may list nodes). What the command line
//! gives always wins.

use anyhow::{Result, bail};
use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::ListParams;
use kube::{Api, Client};

/// The tunnel proxy's Service (charts/spur/templates/tunnelproxy.yaml).
pub(crate) const SERVICE: &str = "spur-tunnel-proxy";

/// The port every transport uses when nothing else is known (the Service's port).
const DEFAULT_PORT: u16 = 443;

/// Where to dial and which name the proxy's certificate must carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub host: String,
    pub quic_port: u16,
    pub h2_port: u16,
    pub server_name: String,
    /// Where the address came from, for a progress line.
    pub how: String,
}

/// What the command line said.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Given<'a> {
    pub server: Option<&'a str>,
    pub quic_port: Option<u16>,
    pub h2_port: Option<u16>,
    pub server_name: Option<&'a str>,
}

/// A node's address a workstation can dial: its external address, else its internal one.
fn node_address(nodes: &[Node]) -> Option<(String, String)> {
    let mut nodes: Vec<&Node> = nodes.iter().collect();
    nodes.sort_by_key(|n| n.metadata.name.clone());
    for kind in ["ExternalIP", "ExternalDNS", "InternalIP"] {
        for n in &nodes {
            let addrs = n.status.as_ref().and_then(|s| s.addresses.as_ref());
            if let Some(a) = addrs.into_iter().flatten().find(|a| a.type_ == kind) {
                return Some((
                    a.address.clone(),
                    n.metadata.name.clone().unwrap_or_default(),
                ));
            }
        }
    }
    None
}

/// The load balancer's address (its first ingress with a name or an address).
fn ingress(svc: &Service) -> Option<String> {
    let ingress = svc
        .status
        .as_ref()?
        .load_balancer
        .as_ref()?
        .ingress
        .as_ref()?;
    ingress
        .iter()
        .find_map(|i| i.hostname.clone().or_else(|| i.ip.clone()))
}

/// The name the proxy's certificate always carries (the operator issues it for the Service).
fn service_name(namespace: &str) -> String {
    format!("{SERVICE}.{namespace}.svc")
}

/// Decides the endpoint from what was given, the Service (`Err`: why it is not known) and the
/// nodes (`None`: not read; `Some(Err)`: not readable).
pub(crate) fn decide(
    namespace: &str,
    given: Given<'_>,
    service: Result<&Service, &str>,
    nodes: Option<Result<&[Node], &str>>,
) -> Result<Endpoint> {
    let svc_ref = format!("Service {namespace}/{SERVICE}");
    let spec = service.ok().and_then(|s| s.spec.as_ref());
    let kind = spec.and_then(|s| s.type_.as_deref()).unwrap_or("ClusterIP");
    // A port of the Service by name: its node port for a NodePort or LoadBalancer dialled at
    // a node, else its port.
    let port = |name: &str, node_port: bool| {
        spec.and_then(|s| s.ports.as_ref())
            .into_iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .and_then(|p| {
                if node_port {
                    p.node_port.and_then(|n| u16::try_from(n).ok())
                } else {
                    u16::try_from(p.port).ok()
                }
            })
    };
    let ingress = service.ok().and_then(ingress);
    // Host, whether it is a node's address, and where it came from.
    let (host, at_node, how) = match given.server {
        // A node, unless a load balancer with an address is there to be dialled.
        Some(s) => (
            s.trim_start_matches('[').trim_end_matches(']').to_string(),
            kind == "NodePort" || (kind == "LoadBalancer" && ingress.is_none()),
            match &service {
                Err(why) if given.quic_port.is_none() || given.h2_port.is_none() => {
                    format!("--server; port {DEFAULT_PORT} where none is given: {why}")
                }
                _ => "--server".to_string(),
            },
        ),
        None => match (kind, &service) {
            (_, Err(why)) => bail!(
                "cannot find the tunnel proxy ({why}): pass --server with its address (and --quic-port/--h2-port)"
            ),
            ("LoadBalancer", _) if ingress.is_some() => (
                ingress.clone().unwrap_or_default(),
                false,
                format!("the load balancer of {svc_ref}"),
            ),
            ("LoadBalancer" | "NodePort", _) => match nodes {
                Some(Ok(nodes)) => match node_address(nodes) {
                    Some((addr, node)) => {
                        (addr, true, format!("node {node}, node port of {svc_ref}"))
                    }
                    None => bail!(
                        "{svc_ref} is a {kind} and no node has an address: pass --server with an address of a node"
                    ),
                },
                Some(Err(why)) => bail!(
                    "{svc_ref} is a {kind}{} and the nodes' addresses are not readable to you ({why}): pass --server with an address of a node (the port is found)",
                    if kind == "LoadBalancer" {
                        " without an address yet"
                    } else {
                        ""
                    }
                ),
                None => bail!("{svc_ref} is a {kind}: pass --server with an address of a node"),
            },
            _ => match spec.and_then(|s| s.cluster_ip.clone()) {
                Some(ip) if ip != "None" && !ip.is_empty() => (
                    ip,
                    false,
                    format!(
                        "the cluster IP of {svc_ref} (reachable only from the cluster's network)"
                    ),
                ),
                _ => bail!("{svc_ref} has no address: pass --server"),
            },
        },
    };
    let quic_port = given
        .quic_port
        .or_else(|| port("tunnel-quic", at_node))
        .unwrap_or(DEFAULT_PORT);
    let h2_port = given
        .h2_port
        .or_else(|| port("tunnel-h2", at_node))
        .unwrap_or(DEFAULT_PORT);
    // The Service's name is in every certificate the operator issues for the proxy; an address
    // given for a load balancer is one of `tunnelProxy.certNames`, a node's or a cluster IP
    // never is.
    let server_name = match given.server_name {
        Some(n) => n.to_string(),
        None if given.server.is_some()
            && (service.is_err() || (kind == "LoadBalancer" && ingress.is_some())) =>
        {
            host.clone()
        }
        None => service_name(namespace),
    };
    Ok(Endpoint {
        host,
        quic_port,
        h2_port,
        server_name,
        how,
    })
}

/// A short form of an API error.
fn why(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 403 => "forbidden".into(),
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        e => e.to_string(),
    }
}

/// Reads what [`decide`] needs (the nodes only when it needs them) and decides.
pub(crate) async fn find(client: &Client, namespace: &str, given: Given<'_>) -> Result<Endpoint> {
    let complete = given.server.is_some() && given.quic_port.is_some() && given.h2_port.is_some();
    let service = if complete && given.server_name.is_some() {
        Err("not read: --server, the ports and --server-name are given".to_string())
    } else {
        match Api::<Service>::namespaced(client.clone(), namespace)
            .get_opt(SERVICE)
            .await
        {
            Ok(Some(s)) => Ok(s),
            Ok(None) => Err(format!("no Service {namespace}/{SERVICE}")),
            Err(e) => Err(format!(
                "cannot read Service {namespace}/{SERVICE}: {}",
                why(&e)
            )),
        }
    };
    let kind = service
        .as_ref()
        .ok()
        .and_then(|s| s.spec.as_ref()?.type_.clone());
    let has_ingress = service.as_ref().ok().is_some_and(|s| ingress(s).is_some());
    let needs_nodes = given.server.is_none()
        && (kind.as_deref() == Some("NodePort")
            || (kind.as_deref() == Some("LoadBalancer") && !has_ingress));
    let nodes = if needs_nodes {
        Some(
            Api::<Node>::all(client.clone())
                .list(&ListParams::default().limit(50))
                .await
                .map(|l| l.items)
                .map_err(|e| why(&e)),
        )
    } else {
        None
    };
    decide(
        namespace,
        given,
        service.as_ref().map_err(String::as_str),
        nodes
            .as_ref()
            .map(|n| n.as_ref().map(Vec::as_slice).map_err(String::as_str)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(kind: &str, node_port: Option<i32>, ingress: Option<&str>) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": SERVICE, "namespace": "spur-system"},
            "spec": {
                "type": kind,
                "clusterIP": "10.96.7.7",
                "ports": [
                    {"name": "tunnel-quic", "port": 443, "protocol": "UDP", "nodePort": node_port},
                    {"name": "tunnel-h2", "port": 443, "protocol": "TCP", "nodePort": node_port},
                ],
            },
            "status": {"loadBalancer": {"ingress": ingress.map(|i| vec![serde_json::json!({"hostname": i})])}},
        }))
        .unwrap()
    }

    fn node(name: &str, addrs: &[(&str, &str)]) -> Node {
        let addresses: Vec<serde_json::Value> = addrs
            .iter()
            .map(|(t, a)| serde_json::json!({"type": t, "address": a}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "status": {"addresses": addresses},
        }))
        .unwrap()
    }

    #[test]
    fn the_address_ports_and_certificate_name_come_from_the_cluster_unless_given() {
        let ns = "spur-system";
        let np = svc("NodePort", Some(31443), None);
        let nodes = [
            node("b", &[("InternalIP", "10.0.0.2")]),
            node("a", &[("InternalIP", "10.0.0.1"), ("Hostname", "a")]),
        ];
        // A NodePort: a node's address (sorted by name), the node port, the Service's name.
        let e = decide(ns, Given::default(), Ok(&np), Some(Ok(&nodes))).unwrap();
        assert_eq!(
            (
                e.host.as_str(),
                e.quic_port,
                e.h2_port,
                e.server_name.as_str()
            ),
            (
                "10.0.0.1",
                31443,
                31443,
                "spur-tunnel-proxy.spur-system.svc"
            )
        );
        assert_eq!(
            e.how,
            "node a, node port of Service spur-system/spur-tunnel-proxy"
        );
        // An external address wins over an internal one.
        let ext = [nodes[0].clone(), node("c", &[("ExternalIP", "192.0.2.9")])];
        let e = decide(ns, Given::default(), Ok(&np), Some(Ok(&ext))).unwrap();
        assert_eq!(e.host, "192.0.2.9");
        // Nodes not readable: the user is told to name one; the port is still found.
        let err = decide(ns, Given::default(), Ok(&np), Some(Err("forbidden")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not readable to you (forbidden): pass --server"),
            "{err}"
        );
        let given = Given {
            server: Some("172.30.254.1"),
            ..Given::default()
        };
        let e = decide(ns, given, Ok(&np), None).unwrap();
        assert_eq!(
            (e.host.as_str(), e.quic_port, e.server_name.as_str()),
            ("172.30.254.1", 31443, "spur-tunnel-proxy.spur-system.svc")
        );
        // A load balancer: its name, the Service port, and that name for TLS only if given.
        let lb = svc("LoadBalancer", Some(30001), Some("tunnel.example.com"));
        let e = decide(ns, Given::default(), Ok(&lb), None).unwrap();
        assert_eq!(
            (e.host.as_str(), e.quic_port, e.server_name.as_str()),
            (
                "tunnel.example.com",
                443,
                "spur-tunnel-proxy.spur-system.svc"
            )
        );
        let given = Given {
            server: Some("tunnel.example.com"),
            ..Given::default()
        };
        let e = decide(ns, given, Ok(&lb), None).unwrap();
        assert_eq!(e.server_name, "tunnel.example.com");
        // A load balancer still pending, dialled at a node named on the command line: its
        // node port and the Service's name.
        let pending = svc("LoadBalancer", Some(30001), None);
        let given = Given {
            server: Some("172.30.254.1"),
            ..Given::default()
        };
        let e = decide(ns, given, Ok(&pending), None).unwrap();
        assert_eq!(
            (e.quic_port, e.server_name.as_str()),
            (30001, "spur-tunnel-proxy.spur-system.svc")
        );
        // A load balancer still pending: dialled at a node's port.
        let pending = svc("LoadBalancer", Some(30001), None);
        let e = decide(ns, Given::default(), Ok(&pending), Some(Ok(&nodes))).unwrap();
        assert_eq!((e.host.as_str(), e.quic_port), ("10.0.0.1", 30001));
        // ClusterIP: the cluster IP, said to be reachable only in the cluster's network.
        let cip = svc("ClusterIP", None, None);
        let e = decide(ns, Given::default(), Ok(&cip), None).unwrap();
        assert_eq!((e.host.as_str(), e.quic_port), ("10.96.7.7", 443));
        assert!(
            e.how.contains("only from the cluster's network"),
            "{}",
            e.how
        );
        // No Service: everything from the command line, or a clear refusal.
        let err = decide(ns, Given::default(), Err("forbidden"), None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "cannot find the tunnel proxy (forbidden): pass --server with its address (and --quic-port/--h2-port)"
        );
        let given = Given {
            server: Some("[2001:db8::1]"),
            quic_port: Some(8443),
            h2_port: None,
            server_name: None,
        };
        let e = decide(ns, given, Err("forbidden"), None).unwrap();
        assert_eq!(
            (
                e.host.as_str(),
                e.quic_port,
                e.h2_port,
                e.server_name.as_str()
            ),
            ("2001:db8::1", 8443, 443, "2001:db8::1")
        );
        assert_eq!(e.how, "--server; port 443 where none is given: forbidden");
    }
}
