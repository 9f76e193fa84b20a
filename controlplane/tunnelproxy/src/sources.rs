//! Who may connect to a reverse listener (cluster → laptop).
//!
//! A reverse listener carries keyed requests to a developer's laptop. The requests that belong
//! there come from a Spur sidecar in the sandbox's namespace (it routes a keyed request to the
//! sandbox's Service, whose endpoint is this listener) or from a Spur L4 gateway. Any other pod
//! that connects is going around the routing key, so a connection is accepted only when its
//! source address is:
//! - a running pod of the bind's namespace with the injected sidecar (annotation
//!   `sidecar.spur.dev/status: injected` and a container `spur-sidecar`);
//! - a running pod labelled `spur.dev/gateway` in one of the gateway namespaces;
//! - in the extra allowed ranges (`--reverse-allow-cidrs`: a mesh's proxies, tests).
//!
//! The pods come from a cluster-wide pod watch, kept as an index of addresses only: every
//! running pod's addresses with its namespace and whether it is a sidecar or gateway pod (a
//! tunnel grant's sessions may reach the pods of their namespace, crate::scope). Host-network
//! pods are left out: their address is their node's.

use std::future::Future;
use std::net::IpAddr;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::StreamExt;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use spur_api::keys::injection;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::addr::canonical;
use crate::ipindex::{IpIndex, apply_event};

/// The label the chart's L4 gateway pods carry (what a ListenerSet's selector names).
pub const GATEWAY_LABEL: &str = "spur.dev/gateway";

/// How long a connection from an unknown address waits for the pod watch to catch up: a pod
/// that just started may send before its address reached this replica.
const CATCH_UP: Duration = Duration::from_secs(2);

/// Configuration of the source check.
#[derive(Clone, Debug, Default)]
pub struct ReverseSourcesConfig {
    /// Addresses allowed besides the pods (e.g. a mesh's ingress gateways, or loopback in
    /// tests).
    pub allow: Vec<IpNet>,
    /// Namespaces whose pods labelled [`GATEWAY_LABEL`] are Spur L4 gateways.
    pub gateway_namespaces: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Sidecar,
    Gateway,
}

/// What the index keeps of a pod: its namespace and, for a Spur sidecar or gateway pod, which.
/// Every running pod is indexed, not only those: a tunnel grant's sessions may reach the pods
/// of their namespace (crate::scope).
#[derive(Clone, Debug, PartialEq, Eq)]
struct PodEntry {
    namespace: String,
    role: Option<Role>,
}

/// The source check of every reverse listener of a replica.
#[derive(Clone)]
pub struct ReverseSources {
    allow: Arc<Vec<IpNet>>,
    gateway_namespaces: Arc<Vec<String>>,
    index: Arc<RwLock<IpIndex<PodEntry>>>,
    changes: watch::Sender<u64>,
}

impl ReverseSources {
    fn empty(config: ReverseSourcesConfig) -> ReverseSources {
        ReverseSources {
            allow: Arc::new(config.allow),
            gateway_namespaces: Arc::new(config.gateway_namespaces),
            index: Arc::default(),
            changes: watch::Sender::new(0),
        }
    }

    /// Starts the pod watch (cluster-wide: sidecars run in every namespace); resolves once the
    /// first list is in.
    pub async fn start(
        client: Client,
        config: ReverseSourcesConfig,
        stop: CancellationToken,
    ) -> Result<ReverseSources, Error> {
        let sources = ReverseSources::empty(config);
        // Finished pods give their addresses back: they leave the watch.
        let selector =
            watcher::Config::default().fields("status.phase!=Succeeded,status.phase!=Failed");
        let stream = watcher(Api::<Pod>::all(client), selector).default_backoff();
        let (ready_tx, mut ready) = watch::channel(None::<Result<(), String>>);
        let s = sources.clone();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream.take_until(stop.cancelled_owned()));
            let mut listing = None;
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(ev) => {
                        let done = matches!(ev, watcher::Event::InitDone);
                        if apply_event(&s.index, &mut listing, ev, |pod| s.entry(pod)) {
                            s.changes.send_modify(|g| *g = g.wrapping_add(1));
                        }
                        if done {
                            ready_tx.send_replace(Some(Ok(())));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "pod watch failed; retrying");
                        if !matches!(*ready_tx.borrow(), Some(Ok(()))) {
                            ready_tx.send_replace(Some(Err(e.to_string())));
                        }
                    }
                }
            }
        });
        // The first list decides; a failure is reported only if no list arrives in time (the
        // watch retries meanwhile).
        let listed = tokio::time::timeout(
            Duration::from_secs(30),
            ready.wait_for(|r| matches!(r, Some(Ok(())))),
        )
        .await
        .is_ok_and(|r| r.is_ok());
        if listed {
            return Ok(sources);
        }
        let last = ready.borrow().clone();
        Err(Error::Kube(match last {
            Some(Err(e)) => format!(
                "timed out listing pods (the tunnel proxy needs list/watch on pods to check \
                 reverse-listener sources); last error: {e}"
            ),
            _ => "timed out listing pods".into(),
        }))
    }

    /// A fixed pod set, for tests.
    #[cfg(test)]
    pub(crate) fn with_pods(
        config: ReverseSourcesConfig,
        pods: impl IntoIterator<Item = Pod>,
    ) -> ReverseSources {
        let s = ReverseSources::empty(config);
        for pod in pods {
            s.apply(&pod);
        }
        s
    }

    fn entry(&self, pod: &Pod) -> (String, Option<(Vec<IpAddr>, PodEntry)>) {
        let namespace = pod.namespace().unwrap_or_default();
        let key = format!("{namespace}/{}", pod.name_any());
        // A host-network pod's address is its node's: indexed, it would let every process and
        // host-network pod on that node (and traffic SNATed to it) through a reverse listener,
        // and let a grant's session dial the node (its kubelet). Such deployments list their
        // nodes in --reverse-allow-cidrs instead.
        let host_network = pod
            .spec
            .as_ref()
            .and_then(|s| s.host_network)
            .unwrap_or(false);
        if host_network {
            return (key, None);
        }
        let role = if is_injected(pod) {
            Some(Role::Sidecar)
        } else if pod.labels().contains_key(GATEWAY_LABEL)
            && self.gateway_namespaces.contains(&namespace)
        {
            Some(Role::Gateway)
        } else {
            None
        };
        (key, Some((pod_ips(pod), PodEntry { namespace, role })))
    }

    #[cfg(test)]
    pub(crate) fn apply(&self, pod: &Pod) {
        let (key, entry) = self.entry(pod);
        if let Ok(mut index) = self.index.write() {
            index.upsert(key, entry);
        }
        self.changes.send_modify(|g| *g = g.wrapping_add(1));
    }

    #[cfg(test)]
    fn delete(&self, pod: &Pod) {
        let (key, _) = self.entry(pod);
        if let Ok(mut index) = self.index.write() {
            index.remove(&key);
        }
    }

    /// The namespaces of the running (not host-network) pods holding `ip` (canonical form).
    /// `None`: the index is unavailable.
    pub(crate) fn pod_namespaces(&self, ip: IpAddr) -> Option<Vec<String>> {
        let index = self.index.read().ok()?;
        Some(index.at(ip).map(|(_, e)| e.namespace.clone()).collect())
    }

    /// Whether `from` may reach a reverse listener of a bind in `namespace`, as of now.
    fn check_now(&self, from: IpAddr, namespace: &str) -> Result<(), String> {
        let from = canonical(from);
        if self.allow.iter().any(|n| n.contains(&from)) {
            return Ok(());
        }
        let Ok(index) = self.index.read() else {
            return Err("the pod index is unavailable".into());
        };
        let mut elsewhere = None;
        for (key, pod) in index.at(from) {
            match pod.role {
                Some(Role::Gateway) => return Ok(()),
                Some(Role::Sidecar) if pod.namespace == namespace => return Ok(()),
                Some(Role::Sidecar) => elsewhere = Some(key.to_string()),
                None => {}
            }
        }
        Err(match elsewhere {
            Some(pod) => {
                format!("{from} is the sidecar pod {pod}, outside the bind's namespace {namespace}")
            }
            None => format!(
                "{from} is neither a pod with the Spur sidecar in {namespace} nor a Spur gateway"
            ),
        })
    }

    /// Whether `from` may reach a reverse listener of a bind in `namespace`. An address the
    /// index does not know gets [`CATCH_UP`] for the pod watch to bring it.
    pub async fn check(&self, from: IpAddr, namespace: &str) -> Result<(), String> {
        let mut changes = self.changes.subscribe();
        let deadline = tokio::time::Instant::now() + CATCH_UP;
        loop {
            let why = match self.check_now(from, namespace) {
                Ok(()) => return Ok(()),
                Err(why) => why,
            };
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => continue,
                _ => return Err(why),
            }
        }
    }
}

/// Accepts on a reverse listener of a bind in `namespace` until `stop`. A connection whose
/// source passes the check goes to `admitted`; any other is closed, and `refused` says why.
/// The check runs in the connection's own task: an unknown address waiting for the pod watch
/// never holds up the accept loop.
pub(crate) async fn serve_reverse_listener<A, Fut, R>(
    listener: TcpListener,
    namespace: String,
    sources: ReverseSources,
    stop: CancellationToken,
    admitted: A,
    refused: R,
) where
    A: Fn(TcpStream, SocketAddr) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
    R: Fn(SocketAddr, String) + Send + Sync + 'static,
{
    let (admitted, refused) = (Arc::new(admitted), Arc::new(refused));
    let namespace: Arc<str> = namespace.into();
    // A failed accept used to be retried at once: out of file descriptors, this loop spun.
    while let Some((tcp, from)) =
        spur_runtime::accept(&listener, stop.cancelled(), "reverse bind").await
    {
        let (sources, admitted, refused, namespace) = (
            sources.clone(),
            admitted.clone(),
            refused.clone(),
            namespace.clone(),
        );
        tokio::spawn(async move {
            match sources.check(from.ip(), &namespace).await {
                Ok(()) => admitted(tcp, from).await,
                Err(why) => {
                    drop(tcp);
                    refused(from, why);
                }
            }
        });
    }
}

/// The injector's mark (docs/injection.md) together with the sidecar container itself.
fn is_injected(pod: &Pod) -> bool {
    let marked = pod
        .annotations()
        .get(injection::STATUS)
        .is_some_and(|s| s == "injected");
    let has_sidecar = pod.spec.as_ref().is_some_and(|spec| {
        spec.containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .any(|c| c.name == injection::SIDECAR_CONTAINER)
    });
    marked && has_sidecar
}

fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    let mut ips: Vec<IpAddr> = status
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|p| p.ip.parse().ok())
        .chain(status.pod_ip.as_deref().and_then(|ip| ip.parse().ok()))
        .map(canonical)
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    /// A running pod at `ip`; `sidecar`: injected by Spur; `gateway`: labelled as a gateway.
    pub(crate) fn pod(ns: &str, name: &str, ip: &str, sidecar: bool, gateway: bool) -> Pod {
        let mut containers = vec![json!({"name": "app"})];
        let mut annotations = json!({});
        if sidecar {
            containers.push(json!({"name": injection::SIDECAR_CONTAINER}));
            annotations = json!({(injection::STATUS): "injected"});
        }
        let labels = if gateway {
            json!({(GATEWAY_LABEL): "spur-gateway"})
        } else {
            json!({})
        };
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "annotations": annotations, "labels": labels},
            "spec": {"containers": containers},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
        }))
        .unwrap()
    }

    pub(crate) fn config() -> ReverseSourcesConfig {
        ReverseSourcesConfig {
            allow: Vec::new(),
            gateway_namespaces: vec!["spur-system".into()],
        }
    }

    #[tokio::test]
    async fn only_sidecars_of_the_namespace_and_gateways_get_in() {
        let mut forged = pod("shop", "forged", "10.244.0.9", false, false);
        // The injector's annotation without the sidecar is not enough.
        forged
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(injection::STATUS.into(), "injected".into());
        let s = ReverseSources::with_pods(
            config(),
            [
                pod("shop", "api", "10.244.0.2", true, false),
                pod("other", "api", "10.244.0.3", true, false),
                pod("spur-system", "gw", "10.244.0.4", false, true),
                pod("team-b", "fake-gw", "10.244.0.5", false, true),
                pod("shop", "plain", "10.244.0.6", false, false),
                forged,
            ],
        );
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(s.check_now(ip("10.244.0.2"), "shop").is_ok());
        assert!(s.check_now(ip("::ffff:10.244.0.2"), "shop").is_ok());
        assert!(s.check_now(ip("10.244.0.4"), "shop").is_ok());
        let e = s.check_now(ip("10.244.0.3"), "shop").unwrap_err();
        assert!(e.contains("outside the bind's namespace shop"), "{e}");
        for refused in ["10.244.0.5", "10.244.0.6", "10.244.0.9", "10.244.0.99"] {
            let e = s.check_now(ip(refused), "shop").unwrap_err();
            assert!(
                e.contains("neither a pod with the Spur sidecar"),
                "{refused}: {e}"
            );
        }
        // A pod that goes away takes its address with it.
        s.delete(&pod("shop", "api", "10.244.0.2", true, false));
        assert!(s.check_now(ip("10.244.0.2"), "shop").is_err());
    }

    #[tokio::test]
    async fn an_unknown_address_waits_for_the_watch_then_is_refused() {
        let s = ReverseSources::with_pods(config(), []);
        let ip: IpAddr = "10.244.1.7".parse().unwrap();
        let late = s.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            late.apply(&pod("shop", "new", "10.244.1.7", true, false));
        });
        // The pod reaches the index while the connection waits.
        tokio::time::timeout(Duration::from_secs(1), s.check(ip, "shop"))
            .await
            .unwrap()
            .unwrap();
        let started = tokio::time::Instant::now();
        assert!(
            s.check("10.244.1.8".parse().unwrap(), "shop")
                .await
                .is_err()
        );
        assert!(started.elapsed() >= CATCH_UP);
    }

    /// The attack of issue 42, point 1: a pod without the sidecar connects straight to a
    /// reverse listener, with no routing key. Real sockets on loopback: 127.0.0.2 is a sidecar
    /// pod of the bind's namespace, 127.0.0.3 a pod without one, 127.0.0.4 a sidecar pod of
    /// another namespace.
    #[tokio::test]
    async fn a_connection_from_a_pod_without_the_sidecar_is_refused() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let sources = ReverseSources::with_pods(
            config(),
            [
                pod("shop", "api", "127.0.0.2", true, false),
                pod("shop", "intruder", "127.0.0.3", false, false),
                pod("team-b", "api", "127.0.0.4", true, false),
            ],
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (refused_tx, mut refused_rx) = tokio::sync::mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        tokio::spawn(serve_reverse_listener(
            listener,
            "shop".into(),
            sources,
            stop.clone(),
            |mut tcp: TcpStream, _| async move {
                let _ = tcp.write_all(b"laptop").await;
            },
            move |from, why| {
                let _ = refused_tx.send((from, why));
            },
        ));
        let read_from = |from: &'static str| async move {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
            let mut tcp = socket.connect(addr).await.unwrap();
            let mut got = Vec::new();
            let _ = tokio::time::timeout(CATCH_UP * 2, tcp.read_to_end(&mut got)).await;
            got
        };
        assert_eq!(read_from("127.0.0.2").await, b"laptop");
        for intruder in ["127.0.0.3", "127.0.0.4"] {
            assert_eq!(
                read_from(intruder).await,
                b"",
                "{intruder} reached the laptop"
            );
            let (from, why) = refused_rx.recv().await.unwrap();
            assert_eq!(from.ip().to_string(), intruder);
            assert!(why.contains(intruder), "{why}");
        }
        stop.cancel();
    }

    /// A host-network pod (a gateway with `gateway.hostNetwork`, or a sidecar pod on the host
    /// network) has its node's address: it does not open the reverse listeners to that node.
    #[tokio::test]
    async fn host_network_pods_do_not_open_their_node() {
        let on_host = |mut p: Pod| {
            p.spec.get_or_insert_default().host_network = Some(true);
            p
        };
        let s = ReverseSources::with_pods(
            config(),
            [
                on_host(pod("shop", "api", "192.0.2.10", true, false)),
                on_host(pod("spur-system", "gw", "192.0.2.11", false, true)),
            ],
        );
        for node in ["192.0.2.10", "192.0.2.11"] {
            assert!(
                s.check_now(node.parse().unwrap(), "shop").is_err(),
                "{node} got in"
            );
        }
    }

    #[test]
    fn allowed_ranges_pass_without_a_pod() {
        let s = ReverseSources::with_pods(
            ReverseSourcesConfig {
                allow: vec!["127.0.0.0/8".parse().unwrap()],
                gateway_namespaces: Vec::new(),
            },
            [],
        );
        assert!(s.check_now("127.0.0.1".parse().unwrap(), "shop").is_ok());
        assert!(
            s.check_now("::ffff:127.0.0.1".parse().unwrap(), "shop")
                .is_ok()
        );
        assert!(s.check_now("10.0.0.1".parse().unwrap(), "shop").is_err());
    }
}
