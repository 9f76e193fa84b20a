//! The traffic store (issue #27): keeps the HTTP exchanges that Spur sidecars capture for each
//! sandbox, serves each sidecar the capture settings of its baseline, and lets the CLI query
//! and tail what was captured (`proto/traffic.proto`, package `spur.traffic.v1`).
//!
//! ```text
//! sidecar ──WatchSettings(baseline)──► SettingsIndex ◄── settings file (poll) / the operator
//!         ──Push(≤1024 exchanges)────► Store (SQLite, retention) ──► Tail readers (broadcast)
//! spur CLI ──Query / Tail(filter)────► Store
//! ```
//!
//! In a cluster every token is for the audience [`AUDIENCE`]: a push is taken only from an
//! injected sidecar of the baseline it names, and only for sandboxes that capture that baseline
//! (`auth`, `service`); ids are the store's own and each namespace has a quota (`store`); open
//! streams are checked again while they stay open (`streams`).
//!
//! Exchanges may carry secrets in bodies and headers the settings did not redact: they are
//! never logged, and [`Limits::store_bodies`] turns stored bodies off cluster-wide.

mod auth;
mod kube_settings;
mod metrics;
mod run_index;
mod run_read;
mod runs;
mod service;
mod settings;
mod store;
mod streams;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use prometheus_client::registry::Registry;
use spur_serving::ServingTls;
use tokio_util::sync::CancellationToken;

pub use auth::{
    ACCEPTED_TTL, AUDIENCE, Authorizer, Caller, Credentials, DEFAULT_RECHECK, KubeAuthorizer,
    MAX_REVIEWS, PodRef, StaticToken,
};
pub use kube_settings::{ClusterCapture, compile as compile_sandboxes, watch_sandboxes};
pub use metrics::{CallLabels, Metrics};
pub use run_index::{NewRun, StartedRun};
pub use run_read::MAX_READ;
pub use runs::{
    DEFAULT_RUN_SECONDS, Delegated, MAX_RUN_SECONDS, MAX_RUNS, MAX_RUNS_PER_SANDBOX,
    MAX_RUNS_PER_USER, Run, SandboxEntry,
};
pub use service::{MAX_BATCH, MAX_MESSAGE_BYTES, TrafficService};
pub use settings::{
    ALWAYS_REDACTED, Baseline, CAPTURE_GRACE, DEFAULT_MAX_BODY_BYTES, MAX_BODY_BYTES,
    MAX_ROUTING_KEY, SandboxSettings, SettingsFile, SettingsIndex, SettingsMap, WorkloadRef,
    is_header_name, is_routing_key, poll_file,
};
pub use store::{
    Bodies, DEFAULT_QUERY_LIMIT, Limits, MAX_ID_LEN, MAX_QUERY_LIMIT, MAX_REPLY_BYTES, Store,
    effective_limit, matches, validate_filter,
};

/// How often a settings file is read again.
pub const SETTINGS_POLL: Duration = Duration::from_secs(1);
/// How often run captures past their time are ended.
const RUN_SWEEP: Duration = Duration::from_secs(1);
/// How long open calls get to finish once the server drains.
const DRAIN_GRACE: Duration = Duration::from_secs(20);

/// Everything that can fail in the traffic store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("database: {0}")]
    Db(String),
    #[error("the database thread has stopped")]
    Closed,
    /// A request the store refuses (a bad filter or exchange).
    #[error("{0}")]
    Invalid(String),
    /// What a request names does not exist.
    #[error("{0}")]
    NotFound(String),
    /// A bound on what may exist at once was reached.
    #[error("{0}")]
    Exhausted(String),
    /// What a request relied on changed meanwhile; retrying may succeed.
    #[error("{0}")]
    Changed(String),
    #[error("capture settings: {0}")]
    Settings(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("serving: {0}")]
    Serve(String),
}

/// Where the capture settings come from.
#[derive(Debug, Clone)]
pub enum SettingsSource {
    /// A [`SettingsFile`], read at start (the server does not start with an invalid one) and
    /// every [`SETTINGS_POLL`] after.
    File(PathBuf),
    /// The caller keeps the [`SettingsIndex`] passed to [`serve`] up to date.
    External,
}

/// How the server runs.
#[derive(Debug, Clone)]
pub struct TrafficServerConfig {
    pub listen: SocketAddr,
    /// The SQLite file; None keeps the exchanges in memory (lost with the process).
    pub db: Option<PathBuf>,
    pub limits: Limits,
    /// The serving certificate, re-read while serving; None serves plaintext (tests, or
    /// behind a TLS-terminating proxy).
    pub tls: Option<ServingTls>,
    pub settings: SettingsSource,
    pub auth: Authorizer,
}

/// Opens the store, registers the metrics, then (in the returned future) binds, serves until
/// `shutdown` and drains. `registry` is only borrowed for the call, so the caller can serve it
/// meanwhile; [`Server`] is the same in two steps, for a caller that wants the bound address.
pub fn serve(
    config: TrafficServerConfig,
    settings: SettingsIndex,
    registry: &mut Registry,
    shutdown: CancellationToken,
) -> impl Future<Output = Result<(), Error>> + Send + 'static {
    let prepared = Prepared::new(config, settings, registry);
    async move { prepared?.bind().await?.run(shutdown).await }
}

/// What binding needs, ready before any await (so that no borrow of the registry is held).
struct Prepared {
    config: TrafficServerConfig,
    store: Store,
    settings: SettingsIndex,
    metrics: Metrics,
    /// The settings file's content as loaded, for the poller to compare against.
    loaded: Option<(PathBuf, Vec<u8>)>,
}

impl Prepared {
    fn new(
        config: TrafficServerConfig,
        settings: SettingsIndex,
        registry: &mut Registry,
    ) -> Result<Prepared, Error> {
        let loaded = match &config.settings {
            SettingsSource::File(path) => {
                let bytes = settings::read_bounded(path)?;
                let file = SettingsFile::parse(&bytes)
                    .map_err(|e| Error::Settings(format!("{}: {e}", path.display())))?;
                settings.replace(file.compile());
                Some((path.clone(), bytes))
            }
            SettingsSource::External => None,
        };
        let store = Store::open(config.db.as_deref(), config.limits)?;
        let metrics = Metrics::register(registry, &store);
        Ok(Prepared {
            config,
            store,
            settings,
            metrics,
            loaded,
        })
    }

    async fn bind(self) -> Result<Server, Error> {
        let listen = self.config.listen;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| Error::Config(format!("cannot bind {listen}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Config(e.to_string()))?;
        Ok(Server {
            listener,
            local,
            prepared: self,
        })
    }
}

/// A bound server: [`Server::run`] serves until the token is cancelled, then drains.
pub struct Server {
    listener: tokio::net::TcpListener,
    local: SocketAddr,
    prepared: Prepared,
}

impl Server {
    /// Loads the settings file (if that is the source), opens the store, registers the
    /// metrics and binds the address (an error names it).
    pub async fn bind(
        config: TrafficServerConfig,
        settings: SettingsIndex,
        registry: &mut Registry,
    ) -> Result<Server, Error> {
        Prepared::new(config, settings, registry)?.bind().await
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    pub fn store(&self) -> &Store {
        &self.prepared.store
    }

    /// Serves until `stop`; then open streams end and in-flight calls finish (bounded).
    pub async fn run(self, stop: CancellationToken) -> Result<(), Error> {
        let Prepared {
            config,
            store,
            settings,
            metrics,
            loaded,
        } = self.prepared;
        let tasks = spur_runtime::Drain::under(&stop);
        let inner_stop = tasks.token();
        let tls = match &config.tls {
            Some(files) => Some(
                spur_serving::tls::start(files, &tasks, inner_stop.clone())
                    .map_err(|e| Error::Tls(e.to_string()))?
                    .grpc,
            ),
            None => None,
        };
        if let Some((path, bytes)) = loaded {
            tasks.spawn(poll_file(
                path,
                settings.clone(),
                SETTINGS_POLL,
                bytes,
                inner_stop.clone(),
            ));
        }
        tasks.spawn(sweep_runs(
            settings.clone(),
            metrics.clone(),
            inner_stop.clone(),
        ));
        let incoming =
            spur_serving::tls::incoming(self.listener, self.local, tls, &tasks, inner_stop.clone());
        let service =
            TrafficService::new(store, settings, config.auth, metrics, inner_stop.clone());
        let serve_stop = inner_stop.clone();
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .tcp_nodelay(true)
                .add_service(service.into_server())
                .serve_with_incoming_shutdown(incoming.into_stream(), serve_stop.cancelled())
                .await
        });
        tracing::info!(listen = %self.local, tls = config.tls.is_some(), "traffic store serving");
        stop.cancelled().await;
        let served = tokio::time::timeout(DRAIN_GRACE, server).await;
        tasks.wait(Duration::from_secs(5)).await;
        match served {
            Ok(Ok(Ok(()))) | Err(_) => Ok(()),
            Ok(Ok(Err(e))) => Err(Error::Serve(e.to_string())),
            Ok(Err(e)) => Err(Error::Serve(format!("server task: {e}"))),
        }
    }
}

/// Ends run captures past their time, every second, until `stop`: a runner that died without
/// ending its run leaves no capture behind past the time it asked for.
async fn sweep_runs(settings: SettingsIndex, metrics: Metrics, stop: CancellationToken) {
    let mut tick = tokio::time::interval(RUN_SWEEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let live = settings.sweep_runs();
        metrics
            .run_captures
            .set(i64::try_from(live).unwrap_or(i64::MAX));
    }
}
