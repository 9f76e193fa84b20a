//! From what the route server sends to what `spur-l4` runs: DNS endpoints added from the
//! resolver's last answers, then every cluster still without an endpoint left out with the
//! listeners and key routes that need it (`spur-l4` refuses empty clusters, and a listener with
//! nowhere to send sessions is better closed than accepting them).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};

use spur_l4::{ClusterConfig, EndpointConfig, L4Config};
use spur_proto::l4::DnsEndpoint;

/// The configuration to run, and what was left out of it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Assembled {
    pub(crate) config: L4Config,
    /// Clusters left out for want of an endpoint (with their listeners).
    pub(crate) empty: BTreeSet<String>,
}

impl Assembled {
    /// Each cluster's endpoints, by name.
    pub(crate) fn endpoints(&self) -> BTreeMap<&str, &[EndpointConfig]> {
        self.config
            .listeners
            .iter()
            .map(|l| &l.cluster)
            .chain(self.config.clusters.iter())
            .map(|c| (c.name.as_str(), c.endpoints.as_slice()))
            .collect()
    }
}

/// `config` with the DNS endpoints `resolved` (name → addresses) gives, and without empty
/// clusters.
pub(crate) fn assemble(
    config: &L4Config,
    dns: &[DnsEndpoint],
    resolved: &HashMap<String, Vec<IpAddr>>,
) -> Assembled {
    let mut config = config.clone();
    for d in dns {
        let Some(ips) = resolved.get(&d.name) else {
            continue;
        };
        let (Ok(port), Ok(hc)) = (u16::try_from(d.port), u16::try_from(d.health_check_port)) else {
            tracing::warn!(cluster = %d.cluster, name = %d.name, "DNS endpoint with a port out of range: left out");
            continue;
        };
        let Some(cluster) = cluster_mut(&mut config, &d.cluster) else {
            continue;
        };
        for ip in ips {
            let address = SocketAddr::new(*ip, port);
            if cluster.endpoints.iter().any(|e| e.address == address) {
                continue;
            }
            cluster.endpoints.push(EndpointConfig {
                id: address.to_string(),
                address,
                health_check_port: (hc != 0).then_some(hc),
            });
        }
    }
    let empty: BTreeSet<String> = config
        .listeners
        .iter()
        .map(|l| &l.cluster)
        .chain(config.clusters.iter())
        .filter(|c| c.endpoints.is_empty())
        .map(|c| c.name.clone())
        .collect();
    config
        .listeners
        .retain(|l| !empty.contains(&l.cluster.name));
    config.clusters.retain(|c| !empty.contains(&c.name));
    for l in &mut config.listeners {
        if let Some(k) = &mut l.key_route {
            k.routes.retain(|r| !empty.contains(&r.cluster));
            if k.routes.is_empty() {
                l.key_route = None;
            }
        }
    }
    Assembled { config, empty }
}

fn cluster_mut<'a>(config: &'a mut L4Config, name: &str) -> Option<&'a mut ClusterConfig> {
    config
        .listeners
        .iter_mut()
        .map(|l| &mut l.cluster)
        .chain(config.clusters.iter_mut())
        .find(|c| c.name == name)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use spur_l4::{KeyRoute, KeyRouteConfig, ListenerConfig, Protocol};

    fn ep(id: &str, addr: &str) -> EndpointConfig {
        EndpointConfig {
            id: id.into(),
            address: addr.parse().unwrap(),
            health_check_port: None,
        }
    }

    #[test]
    fn dns_fills_and_empty_clusters_go() {
        let mut a = ListenerConfig::new(
            "s/a",
            Protocol::Udp,
            "0.0.0.0:5000".parse().unwrap(),
            ClusterConfig::new("s/dns", vec![]),
        );
        a.key_route = Some(KeyRouteConfig {
            offset: 0,
            length: None,
            routes: vec![
                KeyRoute {
                    key: Some("k".into()),
                    key_hex: None,
                    cluster: "s/fork".into(),
                },
                KeyRoute {
                    key: Some("j".into()),
                    key_hex: None,
                    cluster: "s/static".into(),
                },
            ],
        });
        let b = ListenerConfig::new(
            "s/b",
            Protocol::Tcp,
            "0.0.0.0:5001".parse().unwrap(),
            ClusterConfig::new("s/none", vec![]),
        );
        let config = L4Config {
            listeners: vec![a, b],
            clusters: vec![
                ClusterConfig::new("s/fork", vec![]),
                ClusterConfig::new("s/static", vec![ep("x", "10.0.0.9:1")]),
            ],
            ..L4Config::default()
        };
        let dns = vec![DnsEndpoint {
            cluster: "s/dns".into(),
            name: "media.example".into(),
            port: 7000,
            health_check_port: 8080,
        }];
        // Not resolved yet: the DNS-only listener waits.
        let out = assemble(&config, &dns, &HashMap::new());
        assert!(out.config.listeners.is_empty());
        assert_eq!(out.config.clusters.len(), 1);
        assert_eq!(
            out.empty.iter().collect::<Vec<_>>(),
            ["s/dns", "s/fork", "s/none"]
        );
        let resolved = HashMap::from([(
            "media.example".to_owned(),
            vec!["10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()],
        )]);
        let out = assemble(&config, &dns, &resolved);
        assert_eq!(out.config.listeners.len(), 1);
        let l = &out.config.listeners[0];
        let ids: Vec<_> = l.cluster.endpoints.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["10.0.0.1:7000", "10.0.0.2:7000"]);
        assert_eq!(l.cluster.endpoints[0].health_check_port, Some(8080));
        let routes = &l.key_route.as_ref().unwrap().routes;
        assert_eq!(routes.len(), 1, "the route to the empty fork is left out");
        assert_eq!(routes[0].cluster, "s/static");
        assert!(out.config.clone().validate().is_ok());
        assert_eq!(out.endpoints()["s/dns"].len(), 2);
    }
}
