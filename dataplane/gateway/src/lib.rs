//! The Spur L4 gateway (`spur-gateway`): TCP and UDP listeners (`spur-l4`) configured by the
//! route server's L4 listener API (`spur.l4.v1.Listeners`) from the ListenerSets whose selector
//! picks this pod, with DNS endpoints resolved here, endpoint health reported back, and drain.
//!
//! ```text
//! route server ──Watch(namespace, pod)──► ListenersUpdate (L4Config JSON + DNS endpoints)
//!      ▲                                      │ parse, add DNS endpoints, leave out empty
//!      │ Report every 10 s and on change      ▼ clusters, validate
//!      └──── endpoint health ◄──────── spur_l4::ListenerSet (apply; last good kept)
//! ```
//!
//! - An invalid configuration (or one whose port cannot be bound) is logged, counted and
//!   reported; the last good one keeps running.
//! - While the route server is away the gateway keeps serving its last configuration and
//!   reconnects with jittered backoff (100 ms to 10 s), re-reading its token and CA bundle.
//! - DNS names are resolved again when their records expire (their TTL, at least 1 s apart and
//!   at most `dns_interval`), with the system's resolver configuration (`dns`). A name that
//!   fails to resolve keeps its last addresses and is tried again within 5 s; a name never
//!   resolved contributes nothing.
//! - Shutdown drains: listeners stop taking sessions, open UDP sessions and TCP streams run on
//!   for the configuration's `drainGrace`, then close.
//!
//! No Kubernetes client here (a dataplane crate): the pod's identity is its projected token,
//! its name and namespace come from the downward API.

mod admin;
mod assemble;
mod dns;
mod metrics;
mod standalone;

pub use spur_discovery::RouteServerConn;
pub use standalone::{Standalone, StandaloneConfig, load_config_file};

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::registry::Registry;
use spur_l4::{L4Config, ListenerSet};
use spur_proto::l4::listeners_client::ListenersClient;
use spur_proto::l4::{
    DnsEndpoint, EndpointReport, GatewayReport, ListenersUpdate, WatchListenersRequest,
};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::Channel;

use assemble::{Assembled, assemble};
use metrics::Metrics;
use spur_discovery::Connector;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// How often DNS names are looked at for expired answers.
const DNS_TICK: Duration = dns::MIN_REFRESH;
/// How often endpoint health is looked at for changes worth reporting at once.
const REPORT_TICK: Duration = Duration::from_secs(1);
/// Largest configuration message accepted (a big set's JSON).
const MAX_MESSAGE: usize = 64 * 1024 * 1024;
/// Bound on one report call (the route server writes status before it answers).
const REPORT_TIMEOUT: Duration = Duration::from_secs(15);
/// Bound on waiting for the control tasks at shutdown.
const CONTROL_GRACE: Duration = Duration::from_secs(5);

/// Everything the gateway reports.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The route server cannot be reached, refused the stream, or the connection settings
    /// are wrong (an unreadable token or CA bundle).
    #[error("route server {addr}: {reason}")]
    RouteServer { addr: String, reason: String },
    /// The gateway's own settings are invalid.
    #[error("invalid gateway settings: {0}")]
    Settings(String),
    #[error("cannot bind the admin server on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// A configuration from the route server that cannot run (it keeps the last good one).
    #[error("configuration version {version}: {reason}")]
    Config { version: u64, reason: String },
    /// Standalone mode: the file cannot be read, parsed or validated, or its listeners cannot
    /// be bound; the reason names the field (`listeners[0].cluster.lb: …`) or the listener.
    #[error("{}: {reason}", path.display())]
    File {
        path: std::path::PathBuf,
        reason: String,
    },
}

/// The admin server's socket, when one is asked for.
async fn bind_admin(addr: Option<SocketAddr>) -> Result<Option<TcpListener>, Error> {
    match addr {
        Some(addr) => TcpListener::bind(addr)
            .await
            .map(Some)
            .map_err(|source| Error::Bind { addr, source }),
        None => Ok(None),
    }
}

// The connection's errors are the route-server client's (spur-discovery), all of them about
// reaching the route server.
impl From<spur_discovery::Error> for Error {
    fn from(e: spur_discovery::Error) -> Self {
        match e {
            spur_discovery::Error::RouteServer { addr, reason } => {
                Error::RouteServer { addr, reason }
            }
            other => Error::Settings(other.to_string()),
        }
    }
}

/// How a gateway runs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub route_server: RouteServerConn,
    /// The pod this gateway runs in (the downward API's `metadata.namespace` and `.name`).
    pub namespace: String,
    pub pod: String,
    /// `/live`, `/ready`, `/metrics`, `/config_dump`; None serves no admin port.
    pub admin_addr: Option<SocketAddr>,
    /// The longest a DNS answer is used: names are resolved again when their records expire,
    /// and at least this often.
    pub dns_interval: Duration,
    /// The name server for DNS endpoints; None uses the system's configuration
    /// (`/etc/resolv.conf`, `/etc/hosts`).
    pub dns_server: Option<SocketAddr>,
    /// How often endpoint health is reported when nothing changed.
    pub report_interval: Duration,
}

impl GatewayConfig {
    pub fn new(route_server: RouteServerConn, namespace: &str, pod: &str) -> Self {
        GatewayConfig {
            route_server,
            namespace: namespace.to_owned(),
            pod: pod.to_owned(),
            admin_addr: None,
            dns_interval: Duration::from_secs(30),
            dns_server: None,
            report_interval: Duration::from_secs(10),
        }
    }
}

/// A running gateway.
pub struct Gateway {
    /// The bound admin address, if served.
    pub admin_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    control: CancellationToken,
    l4_stop: CancellationToken,
    admin_stop: CancellationToken,
    tasks: TaskTracker,
}

/// What the gateway's tasks share.
pub(crate) struct Shared {
    set: ListenerSet,
    metrics: Metrics,
    pub(crate) registry: Registry,
    connector: Connector,
    dns: dns::Dns,
    namespace: String,
    pod: String,
    /// Serialises applying configurations (updates and DNS changes).
    state: tokio::sync::Mutex<State>,
    ready: AtomicBool,
    draining: AtomicBool,
    applied: AtomicU64,
    /// Why the last configuration received did not run (empty: it runs).
    error: Mutex<String>,
    /// Something worth reporting at once changed (a new configuration).
    changed: Notify,
    /// The connection of the open Watch; Reports go on it, so they reach the same replica.
    channel: watch::Sender<Option<Channel>>,
}

#[derive(Default)]
struct State {
    /// The last configuration that ran, as received.
    received: Option<Received>,
    /// DNS name → its last addresses.
    resolved: HashMap<String, Vec<IpAddr>>,
    /// DNS name → when to look it up again.
    due: HashMap<String, Instant>,
    /// What runs now.
    running: Option<Assembled>,
}

struct Received {
    version: u64,
    config: L4Config,
    dns: Vec<DnsEndpoint>,
}

impl Gateway {
    /// Binds the admin port and starts watching the route server; listeners open when the
    /// first configuration arrives.
    pub async fn start(config: GatewayConfig) -> Result<Gateway, Error> {
        if config.namespace.is_empty() || config.pod.is_empty() {
            return Err(Error::Settings(
                "the pod's namespace and name are required (the downward API's metadata.namespace and metadata.name)".into(),
            ));
        }
        if config.dns_interval.is_zero() || config.report_interval.is_zero() {
            return Err(Error::Settings(
                "the DNS and report intervals must be greater than zero".into(),
            ));
        }
        let connector = Connector::new(config.route_server.clone())?;
        let admin = bind_admin(config.admin_addr).await?;
        let admin_addr = admin.as_ref().and_then(|l| l.local_addr().ok());
        let mut registry = Registry::default();
        let l4_stop = CancellationToken::new();
        let set = ListenerSet::new(registry.sub_registry_with_prefix("spur"), l4_stop.clone());
        let metrics = Metrics::register(registry.sub_registry_with_prefix("spur_gateway"));
        let shared = Arc::new(Shared {
            set,
            metrics,
            registry,
            connector,
            dns: dns::Dns::new(config.dns_server, config.dns_interval),
            namespace: config.namespace.clone(),
            pod: config.pod.clone(),
            state: tokio::sync::Mutex::default(),
            ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            applied: AtomicU64::new(0),
            error: Mutex::default(),
            changed: Notify::new(),
            channel: watch::channel(None).0,
        });
        let control = CancellationToken::new();
        let admin_stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(watch_loop(shared.clone(), control.clone()));
        tasks.spawn(dns_loop(shared.clone(), control.clone()));
        tasks.spawn(report_loop(
            shared.clone(),
            config.report_interval,
            control.clone(),
        ));
        if let Some(l) = admin {
            tokio::spawn(admin::serve(l, shared.clone(), admin_stop.clone()));
        }
        tracing::info!(
            route_server = %shared.connector.addr(),
            namespace = %config.namespace,
            pod = %config.pod,
            admin = ?admin_addr,
            "gateway started"
        );
        Ok(Gateway {
            admin_addr,
            shared,
            control,
            l4_stop,
            admin_stop,
            tasks,
        })
    }

    /// True once a first configuration runs (and until the drain starts).
    pub fn is_ready(&self) -> bool {
        self.shared.is_ready() && !self.shared.is_draining()
    }

    /// The version of the configuration running (0: none yet).
    pub fn applied_version(&self) -> u64 {
        self.shared.applied.load(Ordering::SeqCst)
    }

    /// The running listeners (their bound addresses, their clusters' health).
    pub fn listeners(&self) -> &ListenerSet {
        &self.shared.set
    }

    /// Drains and stops: `/ready` turns 503, the route-server stream closes (which takes this
    /// pod's entries out of ListenerSet status), listeners stop taking sessions, and open
    /// sessions run on for the configuration's `drainGrace`. Returns once everything ended.
    pub async fn shutdown(self) {
        self.shared.draining.store(true, Ordering::SeqCst);
        tracing::info!("gateway draining");
        self.control.cancel();
        self.l4_stop.cancel();
        self.shared.set.closed().await;
        self.tasks.close();
        if tokio::time::timeout(CONTROL_GRACE, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("gateway control tasks still running after the grace period");
        }
        self.admin_stop.cancel();
        tracing::info!("gateway stopped");
    }
}

impl Shared {
    pub(crate) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    fn set_error(&self, e: String) {
        *self.error.lock().unwrap_or_else(|p| p.into_inner()) = e;
    }

    fn error(&self) -> String {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) async fn config_dump(&self) -> serde_json::Value {
        let state = self.state.lock().await;
        serde_json::json!({
            "namespace": self.namespace,
            "pod": self.pod,
            "version": self.applied.load(Ordering::SeqCst),
            "error": self.error(),
            "emptyClusters": state.running.as_ref().map(|r| r.empty.clone()).unwrap_or_default(),
            "dns": state.resolved,
            "listeners": self.set.listeners(),
            "clusters": self.set.clusters(),
        })
    }

    /// Runs `update` unless it is what runs already; on failure the last good configuration
    /// stays and the error is kept for the next report.
    async fn apply_update(&self, update: ListenersUpdate) {
        let mut state = self.state.lock().await;
        if state
            .received
            .as_ref()
            .is_some_and(|r| r.version == update.version)
            && self.error().is_empty()
        {
            return;
        }
        match self.try_apply(&mut state, update).await {
            Ok(version) => {
                self.metrics.update(true);
                self.metrics
                    .version
                    .set(i64::try_from(version >> 1).unwrap_or_default());
                self.applied.store(version, Ordering::SeqCst);
                self.set_error(String::new());
                self.ready.store(true, Ordering::SeqCst);
                tracing::info!(version, "configuration applied");
            }
            Err(e) => {
                self.metrics.update(false);
                tracing::warn!(error = %e, "configuration refused; the last good one keeps running");
                self.set_error(e.to_string());
            }
        }
        self.changed.notify_one();
    }

    async fn try_apply(&self, state: &mut State, update: ListenersUpdate) -> Result<u64, Error> {
        let version = update.version;
        let refuse = |reason: String| Error::Config { version, reason };
        let config: L4Config = serde_json::from_str(&update.config_json)
            .map_err(|e| refuse(format!("config_json: {e}")))?;
        // Names not looked up yet are resolved before the first apply, so a DNS-only cluster
        // serves from the start.
        let names: BTreeSet<&str> = update
            .dns_endpoints
            .iter()
            .map(|d| d.name.as_str())
            .filter(|n| !state.resolved.contains_key(*n))
            .collect();
        for name in names {
            let (ips, due) = self.lookup(name).await;
            state.due.insert(name.to_owned(), due);
            if let Some(ips) = ips {
                state.resolved.insert(name.to_owned(), ips);
            }
        }
        let assembled = assemble(&config, &update.dns_endpoints, &state.resolved);
        let valid = assembled
            .config
            .clone()
            .validate()
            .map_err(|e| refuse(e.to_string()))?;
        self.set
            .apply(valid)
            .await
            .map_err(|e| refuse(e.to_string()))?;
        self.note_empty(&assembled);
        // Names no longer used are forgotten.
        let used = |n: &String| update.dns_endpoints.iter().any(|d| &d.name == n);
        state.resolved.retain(|n, _| used(n));
        state.due.retain(|n, _| used(n));
        state.running = Some(assembled);
        state.received = Some(Received {
            version,
            config,
            dns: update.dns_endpoints,
        });
        Ok(version)
    }

    fn note_empty(&self, a: &Assembled) {
        self.metrics
            .empty_clusters
            .set(i64::try_from(a.empty.len()).unwrap_or(i64::MAX));
        if !a.empty.is_empty() {
            tracing::info!(clusters = ?a.empty, "clusters without endpoints left out, with their listeners and key routes");
        }
    }

    /// The addresses of `name` (None when it cannot be resolved now), and when to look again.
    async fn lookup(&self, name: &str) -> (Option<Vec<IpAddr>>, Instant) {
        match self.dns.lookup(name).await {
            Ok(answer) => {
                self.metrics.lookup(true);
                (Some(answer.ips), Instant::now() + answer.refresh_in)
            }
            Err(e) => {
                self.metrics.lookup(false);
                tracing::debug!(name, error = %e, "DNS lookup failed; the last addresses stay");
                (None, Instant::now() + self.dns.retry_in())
            }
        }
    }

    /// Resolves the DNS names whose answers expired and pushes what changed:
    /// `update_endpoints` for a cluster that keeps running, a full apply when a cluster appears
    /// or empties.
    async fn refresh_dns(&self) {
        let mut state = self.state.lock().await;
        let Some(received) = &state.received else {
            return;
        };
        let now = Instant::now();
        let names: BTreeSet<String> = received
            .dns
            .iter()
            .filter(|d| state.due.get(&d.name).is_none_or(|due| *due <= now))
            .map(|d| d.name.clone())
            .collect();
        let mut changed = false;
        for name in names {
            let (ips, due) = self.lookup(&name).await;
            state.due.insert(name.clone(), due);
            if let Some(ips) = ips
                && state.resolved.get(&name) != Some(&ips)
            {
                state.resolved.insert(name, ips);
                changed = true;
            }
        }
        if !changed {
            return;
        }
        let State {
            received: Some(received),
            resolved,
            running,
            ..
        } = &mut *state
        else {
            return;
        };
        let next = assemble(&received.config, &received.dns, resolved);
        let same_shape = running.as_ref().is_some_and(|r| r.empty == next.empty);
        if same_shape && let Some(old) = running.as_ref() {
            let before = old.endpoints();
            for (cluster, endpoints) in next.endpoints() {
                if before.get(cluster) == Some(&endpoints) {
                    continue;
                }
                match self.set.update_endpoints(cluster, endpoints) {
                    Ok(()) => {
                        tracing::info!(
                            cluster,
                            endpoints = endpoints.len(),
                            "DNS endpoints changed"
                        )
                    }
                    Err(e) => tracing::warn!(cluster, error = %e, "cannot apply new DNS endpoints"),
                }
            }
        } else {
            let applied = match next.config.clone().validate() {
                Ok(valid) => self.set.apply(valid).await,
                Err(e) => Err(e),
            };
            if let Err(e) = applied {
                tracing::warn!(error = %e, "cannot apply new DNS endpoints; the last configuration keeps running");
                return;
            }
            self.note_empty(&next);
        }
        *running = Some(next);
        self.changed.notify_one();
    }

    /// Every endpoint of every cluster, for a report.
    fn endpoint_reports(&self) -> Vec<EndpointReport> {
        let mut out = Vec::new();
        for c in self.set.clusters() {
            let (set, cluster) = c.name.split_once('/').unwrap_or(("", c.name.as_str()));
            for e in &c.endpoints {
                out.push(EndpointReport {
                    listener_set: set.to_owned(),
                    cluster: cluster.to_owned(),
                    id: e.id.clone(),
                    address: e.address.to_string(),
                    healthy: e.healthy,
                    ejected: e.ejected,
                    message: e.last_health_error.clone().unwrap_or_default(),
                });
            }
        }
        out
    }
}

/// Watches the route server until `stop`, reconnecting with backoff; the last configuration
/// keeps running meanwhile.
async fn watch_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let mut backoff = BACKOFF_MIN;
    loop {
        let res = tokio::select! {
            () = stop.cancelled() => return,
            r = session(&shared, &mut backoff) => r,
        };
        shared.channel.send_replace(None);
        shared.metrics.connected.set(0);
        shared.metrics.reconnects.inc();
        match res {
            Ok(()) => tracing::info!("the route server ended the Watch stream; reconnecting"),
            Err(e) => {
                tracing::warn!(error = %e, "route server Watch failed; the last configuration keeps running")
            }
        }
        let delay = spur_runtime::jitter(backoff);
        backoff = (backoff * 2).min(BACKOFF_MAX);
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

async fn session(shared: &Shared, backoff: &mut Duration) -> Result<(), Error> {
    let c = &shared.connector;
    let authorization = c.authorization()?;
    let channel = c.channel().await?;
    let mut client = ListenersClient::new(channel.clone()).max_decoding_message_size(MAX_MESSAGE);
    let mut request = tonic::Request::new(WatchListenersRequest {
        namespace: shared.namespace.clone(),
        pod: shared.pod.clone(),
    });
    if let Some(v) = authorization {
        request.metadata_mut().insert("authorization", v);
    }
    let mut stream = client
        .watch(request)
        .await
        .map_err(|s| c.err(s))?
        .into_inner();
    shared.channel.send_replace(Some(channel));
    shared.metrics.connected.set(1);
    loop {
        let Some(update) = stream.message().await.map_err(|s| c.err(s))? else {
            return Ok(());
        };
        *backoff = BACKOFF_MIN;
        shared.apply_update(update).await;
    }
}

async fn dns_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(DNS_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate; the first configuration resolves its own names.
    tick.tick().await;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = shared.refresh_dns() => {}
        }
    }
}

/// Reports endpoint health every `interval`, and at once when it or the configuration
/// changes, on the Watch's connection.
async fn report_loop(shared: Arc<Shared>, interval: Duration, stop: CancellationToken) {
    let mut channels = shared.channel.subscribe();
    let mut last: Option<GatewayReport> = None;
    let mut last_at = Instant::now();
    let mut tick = tokio::time::interval(REPORT_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
            () = shared.changed.notified() => {}
        }
        if channels.has_changed().unwrap_or(false) {
            // A new connection (maybe another replica): report everything again.
            last = None;
        }
        let Some(channel) = channels.borrow_and_update().clone() else {
            continue;
        };
        let report = GatewayReport {
            namespace: shared.namespace.clone(),
            pod: shared.pod.clone(),
            endpoints: shared.endpoint_reports(),
            applied_version: shared.applied.load(Ordering::SeqCst),
            config_error: shared.error(),
        };
        if last.as_ref() == Some(&report) && last_at.elapsed() < interval {
            continue;
        }
        let mut request = tonic::Request::new(report.clone());
        // A route server that hangs must not hold reports back past the next connection.
        request.set_timeout(REPORT_TIMEOUT);
        match shared.connector.authorization() {
            Ok(Some(v)) => {
                request.metadata_mut().insert("authorization", v);
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(error = %e, "cannot report");
                continue;
            }
        }
        let mut client = ListenersClient::new(channel);
        let sent = tokio::select! {
            () = stop.cancelled() => return,
            r = client.report(request) => r,
        };
        match sent {
            Ok(_) => {
                shared.metrics.report(true);
                last = Some(report);
                last_at = Instant::now();
            }
            Err(s) => {
                shared.metrics.report(false);
                tracing::debug!(status = %s, "health report refused; retrying");
            }
        }
    }
}
