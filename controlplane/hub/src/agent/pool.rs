//! One agent session with every hub replica. A hub serves a cluster's previews and web view only
//! through a session that cluster's agent holds with that same replica. So with several
//! replicas behind one name (a headless Service, or a DNS name with one record per replica), the
//! agent resolves the name again and again and keeps one [`Agent`] per address. Each one
//! verifies the hub's certificate against the name it was resolved from (or the configured
//! server name), never the address. Replicas that appear get a session within one resolution
//! period. A replica whose address has been gone for [`FORGET_AFTER`] resolutions loses its
//! agent. A replica that refuses the agent for good is left alone for [`REFUSED_PAUSE`]; the
//! pool ends with the refusal when no other replica has a session. With one replica this is one
//! agent, as before.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use spur_tunnel::{ClientConfig, ClientMetrics, SessionState};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Agent, Scope};
use crate::Error;

/// Resolutions an address may be missing from before its agent stops (a lookup that fails
/// changes nothing).
pub const FORGET_AFTER: u32 = 3;

/// How long a replica that refused the agent for good (an unknown or revoked token, another
/// protocol version) is not dialled again.
pub const REFUSED_PAUSE: Duration = Duration::from_secs(30);

/// Resolves `host:port` to addresses (the default: the system's resolver).
pub type Resolver = Arc<
    dyn Fn(String) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send>>
        + Send
        + Sync,
>;

/// How the pool finds the hub's replicas.
#[derive(Clone, Debug)]
pub struct PoolSettings {
    /// The hub's tunnel addresses, `host:port` each; every address they resolve to is a
    /// replica (one name for all, or one name per replica).
    pub hubs: Vec<String>,
    /// How often the name is resolved again.
    pub resolve_every: Duration,
    /// The name every replica's certificate must carry; None: the host of the `hubs` entry the
    /// address was resolved from.
    pub server_name: Option<String>,
}

struct Member {
    stop: CancellationToken,
    state: watch::Receiver<SessionState>,
    /// Resolutions in a row that did not return this address.
    missing: u32,
}

/// The agents of one cluster, one per hub replica.
pub struct HubPool {
    settings: PoolSettings,
    /// Each member's client: this, with the replica's address.
    template: ClientConfig,
    kube: Option<kube::Client>,
    scope: Scope,
    traffic: Option<spur_discovery::Connector>,
    metrics: ClientMetrics,
    members: Arc<Mutex<BTreeMap<SocketAddr, Member>>>,
    resolver: Resolver,
}

impl HubPool {
    pub fn new(
        settings: PoolSettings,
        template: ClientConfig,
        kube: Option<kube::Client>,
        scope: Scope,
        traffic: Option<spur_discovery::Connector>,
        registry: &mut prometheus_client::registry::Registry,
    ) -> Result<HubPool, Error> {
        if settings.resolve_every.is_zero() {
            return Err(Error::Config(
                "the hub's name must be resolved at a period above zero".into(),
            ));
        }
        // The addresses are checked here, once, rather than at every resolution.
        if settings.hubs.is_empty() {
            return Err(Error::Config("no hub address".into()));
        }
        for hub in &settings.hubs {
            split_host_port(hub)?;
        }
        Ok(HubPool {
            settings,
            template,
            kube,
            scope,
            traffic,
            metrics: ClientMetrics::new(registry),
            members: Arc::new(Mutex::new(BTreeMap::new())),
            resolver: Arc::new(|hub| {
                Box::pin(async move { Ok(tokio::net::lookup_host(hub).await?.collect()) })
            }),
        })
    }

    /// Resolves the hubs' names with `resolver` instead of the system's (a custom discovery;
    /// tests that move replicas).
    pub fn with_resolver(mut self, resolver: Resolver) -> Self {
        self.resolver = resolver;
        self
    }

    /// Whether at least one replica has a session with this cluster (the agent's readiness).
    pub fn ready(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        let members = self.members.clone();
        move || {
            lock(&members)
                .values()
                .any(|m| matches!(*m.state.borrow(), SessionState::Connected { .. }))
        }
    }

    /// The replicas' addresses with their sessions' states.
    pub fn states(&self) -> Vec<(SocketAddr, SessionState)> {
        lock(&self.members)
            .iter()
            .map(|(a, m)| (*a, m.state.borrow().clone()))
            .collect()
    }

    /// Keeps one agent per replica until `stop`, or until a replica refuses this cluster for
    /// good (an unknown or revoked token) while no other has a session: that refusal is
    /// returned.
    pub async fn run(&self, stop: CancellationToken) -> Result<(), Error> {
        let mut agents: JoinSet<Result<(), Error>> = JoinSet::new();
        let mut tasks: HashMap<tokio::task::Id, SocketAddr> = HashMap::new();
        let mut refused: HashMap<SocketAddr, Instant> = HashMap::new();
        let mut tick = tokio::time::interval(self.settings.resolve_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let result = loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.cancelled() => break Ok(()),
                Some(ended) = agents.join_next_with_id() => {
                    let (id, outcome) = match ended {
                        Ok((id, outcome)) => (id, outcome),
                        Err(e) => (e.id(), Err(Error::Upstream(format!("the agent task failed: {e}")))),
                    };
                    let Some(addr) = tasks.remove(&id) else { continue };
                    // Whatever ended it, the next resolution decides whether it comes back.
                    lock(&self.members).remove(&addr);
                    match outcome {
                        Ok(()) => {}
                        Err(e @ Error::Refused(_)) => {
                            tracing::error!(%addr, "this hub replica refused the agent: {e}");
                            refused.insert(addr, Instant::now());
                            // The refusal ends the agent when no other replica has a session
                            // (a revoked token: every replica refuses it; the process exits
                            // and says why). A replica that refuses while another serves (a
                            // replica of another version, in a rolling upgrade) is only paused.
                            let serving = lock(&self.members).values().any(|m| {
                                matches!(*m.state.borrow(), SessionState::Connected { .. })
                            });
                            if !serving {
                                break Err(e);
                            }
                        }
                        Err(e) => tracing::warn!(%addr, "the agent of this hub replica ended: {e}"),
                    }
                    continue;
                }
            }
            refused.retain(|_, at| at.elapsed() < REFUSED_PAUSE);
            match resolve(&self.resolver, &self.settings.hubs).await {
                Ok(addrs) => {
                    self.reconcile(&addrs, &refused, &mut agents, &mut tasks, &stop);
                }
                Err(e) => tracing::warn!(hub = ?self.settings.hubs, "resolving the hub: {e}"),
            }
        };
        for m in lock(&self.members).values() {
            m.stop.cancel();
        }
        // Each agent drains its streams (bounded by the agent) and closes its session.
        while agents.join_next().await.is_some() {}
        lock(&self.members).clear();
        result
    }

    fn reconcile(
        &self,
        addrs: &BTreeMap<SocketAddr, String>,
        refused: &HashMap<SocketAddr, Instant>,
        agents: &mut JoinSet<Result<(), Error>>,
        tasks: &mut HashMap<tokio::task::Id, SocketAddr>,
        stop: &CancellationToken,
    ) {
        let mut members = lock(&self.members);
        for (addr, m) in members.iter_mut() {
            if addrs.contains_key(addr) {
                m.missing = 0;
            } else {
                m.missing += 1;
                if m.missing == FORGET_AFTER {
                    tracing::info!(%addr, "this hub replica is gone from the hub's name: its session ends");
                    m.stop.cancel();
                }
            }
        }
        for (addr, host) in addrs {
            if members.contains_key(addr) || refused.contains_key(addr) {
                continue;
            }
            let mut client = self.template.clone();
            client.quic_addr = Some(addr.to_string());
            client.h2_addr = Some(addr.to_string());
            client.server_name = self
                .settings
                .server_name
                .clone()
                .unwrap_or_else(|| host.clone());
            let agent = match Agent::start_with(
                client,
                self.kube.clone(),
                self.scope.clone(),
                &self.metrics,
            ) {
                Ok(a) => match &self.traffic {
                    Some(t) => a.with_traffic(t.clone()),
                    None => a,
                },
                Err(e) => {
                    tracing::error!(%addr, "cannot start an agent for this hub replica: {e}");
                    continue;
                }
            };
            let member_stop = stop.child_token();
            let state = agent.state();
            tokio::spawn(log_states(*addr, agent.state(), member_stop.clone()));
            let run_stop = member_stop.clone();
            let task = agents.spawn(async move { agent.run(run_stop).await });
            tasks.insert(task.id(), *addr);
            tracing::info!(%addr, "dialling this hub replica");
            members.insert(
                *addr,
                Member {
                    stop: member_stop,
                    state,
                    missing: 0,
                },
            );
        }
    }
}

fn lock(
    m: &Mutex<BTreeMap<SocketAddr, Member>>,
) -> std::sync::MutexGuard<'_, BTreeMap<SocketAddr, Member>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn split_host_port(hub: &str) -> Result<(&str, u16), Error> {
    match hub.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() => match port.parse::<u16>() {
            Ok(p) => Ok((host, p)),
            Err(_) => Err(Error::Config(format!(
                "hub address {hub:?}: expected HOST:PORT"
            ))),
        },
        _ => Err(Error::Config(format!(
            "hub address {hub:?}: expected HOST:PORT"
        ))),
    }
}

/// Every address the hubs (`host:port` each) resolve to now, with the host it came from; an
/// error only when none resolves (a name that fails among others that resolve changes nothing
/// for those).
async fn resolve(
    resolver: &Resolver,
    hubs: &[String],
) -> Result<BTreeMap<SocketAddr, String>, Error> {
    let mut addrs = BTreeMap::new();
    let mut failed = None;
    for hub in hubs {
        let host = split_host_port(hub)
            .map(|(h, _)| h.trim_matches(['[', ']']).to_owned())
            .unwrap_or_default();
        match resolver(hub.clone()).await {
            Ok(found) => {
                for a in found {
                    addrs.entry(a).or_insert_with(|| host.clone());
                }
            }
            Err(e) => failed = Some(format!("{hub}: {e}")),
        }
    }
    if addrs.is_empty() {
        return Err(Error::Unavailable(failed.unwrap_or_else(|| {
            format!("{} resolve to no address", hubs.join(","))
        })));
    }
    Ok(addrs)
}

async fn log_states(
    addr: SocketAddr,
    mut state: watch::Receiver<SessionState>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            changed = state.changed() => if changed.is_err() { return },
            () = stop.cancelled() => return,
        }
        let s = state.borrow_and_update().clone();
        match s {
            SessionState::Connected {
                transport,
                identity,
                ..
            } => {
                tracing::info!(%addr, cluster = %identity, transport = transport.as_str(), "connected to the hub")
            }
            SessionState::Disconnected { reason, retry_in } => {
                tracing::warn!(%addr, %reason, ?retry_in, "disconnected from the hub")
            }
            SessionState::Closed { reason } => {
                tracing::warn!(%addr, %reason, "session with this hub replica closed")
            }
            SessionState::Connecting { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn addresses_are_host_and_port() {
        assert_eq!(
            split_host_port("hub.example:8443").unwrap(),
            ("hub.example", 8443)
        );
        assert_eq!(split_host_port("[::1]:8443").unwrap(), ("[::1]", 8443));
        for bad in ["hub", ":8443", "hub:", "hub:99999", "hub:x"] {
            assert!(split_host_port(bad).is_err(), "{bad}");
        }
    }
}
