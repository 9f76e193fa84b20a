//! The running listener set: applies configurations (binding new listeners, updating kept ones
//! in place, draining removed ones), endpoint updates, status, and shutdown with drain.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus_client::registry::Registry;
use serde::Serialize;
use spur_runtime::Drain;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::Error;
use crate::cluster::{Cluster, ClusterStatus};
use crate::config::{
    EndpointConfig, ListenerPlan, Protocol, ValidConfig, check_membership, endpoint_plans,
    ports_overlap,
};
use crate::metrics::Metrics;
use crate::route::Settings;
use crate::tcp::TcpServer;
use crate::udp::UdpListener;

/// How long a stopped listener's tasks get to end after the hard stop.
const KILL_GRACE: Duration = Duration::from_secs(5);

/// A running set of L4 listeners. Cheap to clone; every clone drives the same set.
///
/// Stop it by cancelling the token it was built with: listeners stop taking new sessions at
/// once, UDP sessions and TCP streams run on for the configuration's `drainGrace`, then
/// everything closes. [`ListenerSet::closed`] waits for that.
#[derive(Clone)]
pub struct ListenerSet {
    inner: Arc<Inner>,
}

struct Inner {
    metrics: Metrics,
    shutdown: CancellationToken,
    /// Health tasks and listener reapers.
    background: TaskTracker,
    /// Serialises `apply` and `update_endpoints` (apply awaits while replacing a listener).
    apply: tokio::sync::Mutex<()>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    clusters: BTreeMap<String, Arc<Cluster>>,
    listeners: Vec<Running>,
    drain_grace: Duration,
}

struct Running {
    plan: ListenerPlan,
    local_addr: SocketAddr,
    settings: Arc<ArcSwap<Settings>>,
    active: Arc<AtomicUsize>,
    drain: Drain,
    kill: CancellationToken,
    main: JoinHandle<()>,
}

impl Running {
    /// Same socket: the listener keeps running through an update (sessions and all).
    fn same_socket(&self, p: &ListenerPlan) -> bool {
        self.plan.name == p.name
            && self.plan.protocol == p.protocol
            && self.plan.bind == p.bind
            && self.plan.reuse_port == p.reuse_port
    }
}

/// A listener as the status API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListenerStatus {
    pub name: String,
    pub protocol: Protocol,
    /// The bound address (the real port when the configuration asked for port 0).
    pub local_addr: SocketAddr,
    pub cluster: String,
    /// Open UDP sessions or TCP streams.
    pub active_sessions: usize,
}

/// A socket bound ahead of an update, before anything running is touched.
enum Bound {
    Tcp(tokio::net::TcpListener),
    Udp(tokio::net::UdpSocket),
}

impl ListenerSet {
    /// An empty set whose metrics go into `registry` (prefix `l4`) and which drains when
    /// `shutdown` is cancelled. Must be called inside a tokio runtime.
    pub fn new(registry: &mut Registry, shutdown: CancellationToken) -> Self {
        let inner = Arc::new(Inner {
            metrics: Metrics::register(registry),
            shutdown,
            background: TaskTracker::new(),
            apply: tokio::sync::Mutex::new(()),
            state: Mutex::new(State::default()),
        });
        ListenerSet { inner }
    }

    /// [`ListenerSet::new`] then [`ListenerSet::apply`].
    pub async fn start(
        config: ValidConfig,
        registry: &mut Registry,
        shutdown: CancellationToken,
    ) -> Result<Self, Error> {
        let set = ListenerSet::new(registry, shutdown);
        set.apply(config).await?;
        Ok(set)
    }

    /// Makes the running set match `config`.
    ///
    /// - Listeners with the same name, protocol, bind address and `reusePort` keep their socket
    ///   and sessions; their routing, limits and timeouts change in place.
    /// - New listeners are bound first: if any bind fails, nothing is changed (the last good
    ///   configuration keeps running) and the error names the listener.
    /// - Removed listeners stop taking sessions and drain for `drainGrace`. One whose address a
    ///   new listener takes (a rename) is closed at once instead, so the new one can bind; if
    ///   that bind still fails, the error is returned with the old listener already closed and
    ///   the rest of the update not applied.
    /// - Clusters keep the health and ejection state of endpoints whose id and address did not
    ///   change; UDP sessions on endpoints that left move on their next datagram. TCP streams
    ///   already open are never cut by an endpoint update.
    pub async fn apply(&self, config: ValidConfig) -> Result<(), Error> {
        let _serial = self.inner.apply.lock().await;
        if self.inner.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        // 1. What goes, what stays, what is new; bind the new ones.
        let (replaced, mut bound) = {
            let state = self.state();
            let mut replaced = Vec::new();
            let mut bound = Vec::new();
            for p in &config.listeners {
                if state.listeners.iter().any(|r| r.same_socket(p)) {
                    continue;
                }
                // A listener that goes away and holds this address is closed before binding.
                let holder = state.listeners.iter().position(|r| {
                    r.plan.protocol == p.protocol
                        && ports_overlap(r.plan.bind, p.bind)
                        && !config.listeners.iter().any(|q| r.same_socket(q))
                });
                match holder {
                    Some(i) => replaced.push(state.listeners[i].plan.name.clone()),
                    None => bound.push((p.name.clone(), bind(p)?)),
                }
            }
            (replaced, bound)
        };
        // 2. Close listeners whose address is taken over, then bind in their place.
        for name in &replaced {
            let running = {
                let mut state = self.state();
                let i = state.listeners.iter().position(|r| &r.plan.name == name);
                i.map(|i| state.listeners.remove(i))
            };
            if let Some(r) = running {
                r.kill.cancel();
                r.drain.start();
                let _ = r.main.await;
                // Session tasks hold the UDP socket: wait for them too.
                r.drain.wait(KILL_GRACE).await;
            }
        }
        for p in &config.listeners {
            let pending = bound.iter().any(|(n, _)| n == &p.name);
            let running = self.state().listeners.iter().any(|r| r.same_socket(p));
            if !pending && !running {
                bound.push((p.name.clone(), bind(p)?));
            }
        }
        // 3. Clusters: update, create, retire.
        let mut state = self.state();
        state.drain_grace = config.drain_grace;
        let mut clusters = BTreeMap::new();
        for (name, plan) in &config.clusters {
            let cluster = match state.clusters.remove(name) {
                Some(c) => {
                    c.update(plan.clone());
                    c
                }
                None => Cluster::new(plan.clone(), self.inner.metrics.clone()),
            };
            cluster.sync_health(&self.inner.background, &self.inner.shutdown);
            clusters.insert(name.clone(), cluster);
        }
        for (_, gone) in std::mem::replace(&mut state.clusters, clusters) {
            gone.retire();
        }
        // 4. Listeners: update kept ones, stop removed ones, start new ones.
        let mut kept = Vec::new();
        for r in std::mem::take(&mut state.listeners) {
            match config.listeners.iter().find(|p| r.same_socket(p)) {
                Some(p) => {
                    if let Some(s) = Settings::new(p, &state.clusters, config.drain_grace) {
                        r.settings.store(Arc::new(s));
                    }
                    kept.push(Running {
                        plan: p.clone(),
                        ..r
                    });
                }
                None => {
                    tracing::info!(listener = %r.plan.name, "listener removed: draining");
                    r.drain.start();
                }
            }
        }
        state.listeners = kept;
        for (name, socket) in bound {
            let Some(p) = config.listeners.iter().find(|p| p.name == name) else {
                continue;
            };
            let Some(settings) = Settings::new(p, &state.clusters, config.drain_grace) else {
                continue;
            };
            let running = self.spawn_listener(p.clone(), socket, settings);
            state.listeners.push(running);
        }
        // Keep the configuration's order for status.
        let order: Vec<&String> = config.listeners.iter().map(|l| &l.name).collect();
        state
            .listeners
            .sort_by_key(|r| order.iter().position(|n| **n == r.plan.name));
        Ok(())
    }

    /// Replaces one cluster's endpoints, keeping its other settings (what an endpoint watch
    /// calls on every change). Endpoints whose id and address did not change keep their state.
    pub fn update_endpoints(
        &self,
        cluster: &str,
        endpoints: &[EndpointConfig],
    ) -> Result<(), Error> {
        let state = self.state();
        let c = state
            .clusters
            .get(cluster)
            .ok_or_else(|| Error::UnknownCluster(cluster.to_string()))?;
        let mut plan = c.load().plan.clone();
        let invalid = |e| Error::Config(format!("cluster {cluster:?}: {e}"));
        plan.endpoints = endpoint_plans(endpoints).map_err(invalid)?;
        check_membership(&plan.lb, plan.health.is_some(), plan.protocol, endpoints)
            .map_err(invalid)?;
        c.update(plan);
        Ok(())
    }

    /// Every listener, in configuration order.
    pub fn listeners(&self) -> Vec<ListenerStatus> {
        self.state()
            .listeners
            .iter()
            .map(|r| ListenerStatus {
                name: r.plan.name.clone(),
                protocol: r.plan.protocol,
                local_addr: r.local_addr,
                cluster: r.plan.cluster.clone(),
                active_sessions: r.active.load(Relaxed),
            })
            .collect()
    }

    /// The bound address of a listener (the real port when it asked for port 0).
    pub fn local_addr(&self, listener: &str) -> Option<SocketAddr> {
        self.state()
            .listeners
            .iter()
            .find(|r| r.plan.name == listener)
            .map(|r| r.local_addr)
    }

    /// Health and ejection state of every endpoint of every cluster, by cluster name.
    pub fn clusters(&self) -> Vec<ClusterStatus> {
        self.state().clusters.values().map(|c| c.status()).collect()
    }

    /// Waits until everything the set started has ended: call after cancelling the shutdown
    /// token. Bounded by `drainGrace` plus a few seconds.
    pub async fn closed(&self) {
        self.inner.shutdown.cancelled().await;
        let _serial = self.inner.apply.lock().await;
        self.inner.background.close();
        self.inner.background.wait().await;
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn spawn_listener(&self, plan: ListenerPlan, socket: Bound, settings: Settings) -> Running {
        let settings = Arc::new(ArcSwap::from_pointee(settings));
        let drain = Drain::under(&self.inner.shutdown);
        let kill = CancellationToken::new();
        let active = Arc::new(AtomicUsize::new(0));
        let metrics = self.inner.metrics.listener(&plan.name);
        let (local_addr, main) = match socket {
            Bound::Tcp(listener) => {
                let local = listener.local_addr().unwrap_or(plan.bind);
                let server = TcpServer {
                    listener,
                    name: plan.name.clone(),
                    settings: settings.clone(),
                    metrics,
                    active: active.clone(),
                    drain: drain.clone(),
                    kill: kill.clone(),
                };
                (local, drain.spawn(server.run()))
            }
            Bound::Udp(socket) => {
                let local = socket.local_addr().unwrap_or(plan.bind);
                let server = UdpListener {
                    socket: Arc::new(socket),
                    settings: settings.clone(),
                    metrics,
                    active: active.clone(),
                    drain: drain.clone(),
                    kill: kill.clone(),
                };
                (local, drain.spawn(server.run()))
            }
        };
        tracing::info!(listener = %plan.name, protocol = %plan.protocol, addr = %local_addr, cluster = %plan.cluster, "listener started");
        // The reaper: once the drain starts (shutdown or removal), the grace period runs; what
        // is still open then is cut.
        let (d, k, s) = (drain.clone(), kill.clone(), settings.clone());
        let name = plan.name.clone();
        self.inner.background.spawn(async move {
            d.signaled().await;
            let grace = s.load().drain_grace;
            let left = d.wait(grace).await;
            if left > 0 {
                tracing::info!(listener = %name, left, "drain grace over: closing the rest");
                k.cancel();
                d.wait(KILL_GRACE).await;
            }
        });
        Running {
            plan,
            local_addr,
            settings,
            active,
            drain,
            kill,
            main,
        }
    }
}

fn bind(p: &ListenerPlan) -> Result<Bound, Error> {
    let err = |source| Error::Bind {
        listener: p.name.clone(),
        protocol: p.protocol,
        addr: p.bind,
        source,
    };
    let domain = socket2::Domain::for_address(p.bind);
    match p.protocol {
        Protocol::Tcp => {
            let s =
                socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP))
                    .map_err(err)?;
            // A restarted listener binds again while its old streams sit in TIME_WAIT.
            s.set_reuse_address(true).map_err(err)?;
            if p.reuse_port {
                s.set_reuse_port(true).map_err(err)?;
            }
            s.set_nonblocking(true).map_err(err)?;
            s.bind(&p.bind.into()).map_err(err)?;
            s.listen(1024).map_err(err)?;
            tokio::net::TcpListener::from_std(s.into())
                .map(Bound::Tcp)
                .map_err(err)
        }
        Protocol::Udp => {
            // No SO_REUSEADDR: on UDP it lets a second socket bind the same port silently.
            let s =
                socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))
                    .map_err(err)?;
            if p.reuse_port {
                s.set_reuse_port(true).map_err(err)?;
            }
            s.set_nonblocking(true).map_err(err)?;
            s.bind(&p.bind.into()).map_err(err)?;
            tokio::net::UdpSocket::from_std(s.into())
                .map(Bound::Udp)
                .map_err(err)
        }
    }
}
