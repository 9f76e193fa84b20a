//! Where a tunnel grant's sessions may go (issue 42, point 7).
//!
//! A tunnel grant is a namespace admin's: a TunnelAccessTemplate in namespace N lets a user
//! open a tunnel, so its sessions reach only N. On top of the proxy's destination rules
//! ([`crate::Destinations`]), every address a grant's stream dials must be a cluster IP of a
//! Service of N or an address of a running pod of N, as the proxy's watches know them now:
//! - Services: the Service watch of [`crate::Caches`] (`spec.clusterIPs`, every family);
//! - pods: the pod watch of [`crate::ReverseSources`] (`status.podIPs`; host-network pods are
//!   not indexed, their address is their node's).
//!
//! An address held by anything of another namespace is refused even if N holds it too (a pod
//! address reused before the old pod's deletion reached the watch). An address nobody is known
//! to hold is refused: a pod or Service created a moment ago may need a retry. The refusal
//! names the grant's namespace only, never whose address it is. The check runs per stream, so
//! an open session follows the watches.

use std::net::IpAddr;
use std::sync::{Arc, RwLock};

use crate::addr::canonical;
use crate::ipindex::IpIndex;
use crate::sources::ReverseSources;

/// Which namespace's Services and pods hold an address.
#[derive(Clone)]
pub struct Owners {
    services: Arc<RwLock<IpIndex<String>>>,
    pods: ReverseSources,
}

impl Owners {
    pub(crate) fn new(services: Arc<RwLock<IpIndex<String>>>, pods: ReverseSources) -> Owners {
        Owners { services, pods }
    }

    /// Whether a session narrowed to `namespace` may dial `ip`.
    pub fn check(&self, ip: IpAddr, namespace: &str) -> Result<(), String> {
        let ip = canonical(ip);
        let services = self
            .services
            .read()
            .ok()
            .map(|i| i.at(ip).map(|(_, ns)| ns.clone()).collect::<Vec<_>>());
        let (Some(services), Some(pods)) = (services, self.pods.pod_namespaces(ip)) else {
            return Err(format!(
                "cannot tell whose address {ip} is (the proxy's Service or pod index is \
                 unavailable); this tunnel grant reaches only namespace {namespace}"
            ));
        };
        let mut holders = services.iter().chain(&pods).peekable();
        if holders.peek().is_some() && holders.all(|ns| ns == namespace) {
            return Ok(());
        }
        Err(format!(
            "{ip} is not a Service or pod address of namespace {namespace}, the only namespace \
             this tunnel grant reaches"
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::HashMap;
    use std::net::SocketAddr;

    use k8s_openapi::api::core::v1::Service;
    use serde_json::json;

    use super::*;
    use crate::api::service_entry;
    use crate::destinations::{Destinations, dial_cluster};
    use crate::sources::tests::{config, pod};

    fn service(ns: &str, name: &str, ips: &[&str]) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": ips.first(), "clusterIPs": ips},
        }))
        .unwrap()
    }

    /// Services and pods of `a` and `b`, as the watches would index them.
    fn owners() -> Owners {
        let mut services = IpIndex::default();
        for svc in [
            service("a", "api", &["10.96.0.10", "fd00:96::10"]),
            service("b", "api", &["10.96.0.20"]),
            service("b", "headless", &["None"]),
        ] {
            let (key, entry) = service_entry(&svc);
            services.upsert(key, entry);
        }
        let mut on_host = pod("a", "node-agent", "10.244.9.9", false, false);
        on_host.spec.get_or_insert_default().host_network = Some(true);
        let pods = ReverseSources::with_pods(
            config(),
            [
                pod("a", "web", "10.244.0.5", false, false),
                pod("a", "sidecar", "10.244.0.6", true, false),
                pod("b", "db", "10.244.1.5", false, false),
                on_host,
            ],
        );
        Owners::new(Arc::new(RwLock::new(services)), pods)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_grant_reaches_only_its_namespaces_services_and_pods() {
        let o = owners();
        for mine in [
            "10.96.0.10",
            "fd00:96::10",
            "10.244.0.5",
            "10.244.0.6",
            "::ffff:10.96.0.10",
            "::ffff:10.244.0.5",
        ] {
            assert_eq!(o.check(ip(mine), "a"), Ok(()), "{mine}");
        }
        for theirs in [
            "10.96.0.20",
            "10.244.1.5",
            "::ffff:10.96.0.20",
            "::ffff:10.244.1.5",
            "::10.244.1.5",
            // Nobody's: an unknown address in the pod range, and the host-network pod's node.
            "10.244.0.99",
            "10.244.9.9",
        ] {
            let why = o.check(ip(theirs), "a").unwrap_err();
            assert!(
                why.contains("not a Service or pod address of namespace a"),
                "{theirs}: {why}"
            );
            assert!(!why.contains("namespace b"), "{theirs}: {why} names b");
        }
        // The other way round, for b.
        assert_eq!(o.check(ip("10.244.1.5"), "b"), Ok(()));
        assert!(o.check(ip("10.244.0.5"), "b").is_err());
    }

    #[test]
    fn an_address_also_held_by_another_namespace_is_refused() {
        let o = owners();
        // A pod of b holds a's pod address too (an address reused before the old pod's
        // deletion reached the watch): a's grant does not get it.
        o.pods.apply(&pod("b", "late", "10.244.0.5", false, false));
        assert!(o.check(ip("10.244.0.5"), "a").is_err());
    }

    /// The narrowing as a dial sees it: a grant of `a` connects to a's pod listening on
    /// loopback, and is refused b's with the grant's namespace in the reason; a session without
    /// a grant dials both, as before.
    #[tokio::test]
    async fn a_grants_dial_is_narrowed_and_a_workstations_is_not() {
        let mine = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
        let theirs = tokio::net::TcpListener::bind("127.0.0.3:0").await.unwrap();
        let pods = ReverseSources::with_pods(
            config(),
            [
                pod("a", "web", "127.0.0.2", false, false),
                pod("b", "db", "127.0.0.3", false, false),
            ],
        );
        let o = Owners::new(Arc::default(), pods);
        let d = Destinations::default().allowing_loopback();
        let none = HashMap::new();
        let at = |l: &tokio::net::TcpListener| l.local_addr().unwrap();
        let dial = |a: SocketAddr, scope: Option<&'static str>| {
            let (o, d, none) = (o.clone(), d.clone(), none.clone());
            async move {
                let scope = scope.map(|ns| (&o, ns));
                dial_cluster(&none, &d, scope, &a.ip().to_string(), a.port()).await
            }
        };
        dial(at(&mine), Some("a")).await.unwrap();
        let e = dial(at(&theirs), Some("a")).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        assert!(e.to_string().contains("namespace a"), "{e}");
        // The mapped form of b's address is b's address.
        let mapped = SocketAddr::new(ip("::ffff:127.0.0.3"), at(&theirs).port());
        assert!(dial(mapped, Some("a")).await.is_err());
        // Not a grant: today's rules only.
        dial(at(&theirs), None).await.unwrap();
        dial(at(&mine), None).await.unwrap();
    }
}
