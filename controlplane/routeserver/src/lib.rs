//! The route server: an index of routing rules served over the Signadot-compatible Routes API (gRPC) and REST, with watch streams.
//!
//! ```text
//! RuleStore (rule directory, or Kubernetes RoutingConfigs) ──complete rule sets──► Index (snapshots + change log)
//!        ──► gRPC routes.Routes :7777   Get / Watch / GetClusterServices
//!        ──► REST :7778                 /api/v1/workloads/routing-rules[/watch], /healthz, /metrics
//! ListenerSets (Kubernetes store `with_l4`) ──► L4 model ──► gRPC spur.l4.v1.Listeners :7777 (gateways)
//! ```
//!
//! Both ports serve TLS with a certificate re-read from its files ([`spur_serving::ServingTls`]), and every
//! rule request is authenticated ([`AuthConfig`]): a sidecar's pod-bound token reads only its own
//! baseline's rules, other identities what their RBAC allows. Plaintext and unauthenticated
//! serving are explicit opt-ins for the standalone demo.
//!
//! A watch stream is computed from the index's latest snapshot as it is read, in the task that
//! writes it (no task or queue per watcher): a slow watcher lags alone and then skips straight to
//! the current state.

mod auth;
mod grpc;
mod history;
mod history_watch;
mod index;
mod key;
#[cfg(feature = "kubernetes")]
mod kube_store;
#[cfg(feature = "kubernetes")]
pub mod l4;
#[cfg(feature = "kubernetes")]
mod l4_model;
mod metrics;
mod rest;
mod store;
mod watch;
mod wire;
#[cfg(feature = "kubernetes")]
pub mod xds;

pub use auth::AuthConfig;

pub use history::{History, HistorySnapshot};
pub use index::{Entry, Filter, Index, RuleKey, Snapshot};
#[cfg(feature = "kubernetes")]
pub use kube_store::{KubeStore, cluster_services, rules_from};
#[cfg(feature = "kubernetes")]
pub use l4::L4Options;
pub use metrics::Metrics;
pub use store::{DirStore, RuleStore};
#[cfg(feature = "kubernetes")]
pub use xds::{XdsConfig, XdsTls};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use spur_runtime::Drain;
use spur_serving::tls;
use tokio::net::TcpListener;

/// Errors starting the route server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("rules directory {path}: {reason}")]
    RulesDir { path: String, reason: String },
    #[error("rule store: {0}")]
    Store(String),
    #[error(transparent)]
    Serving(#[from] spur_serving::Error),
}

/// Route-server configuration.
#[derive(Debug, Clone)]
pub struct RouteServerConfig {
    /// Directory of rule files (`*.yaml`, `*.yml`, `*.json`); used by [`RouteServer::start`]
    /// only (a server started with another store ignores it).
    pub rules_dir: PathBuf,
    /// How often the directory is checked for changes ([`RouteServer::start`] only).
    pub poll_interval: Duration,
    /// gRPC Routes API (default `0.0.0.0:7777`).
    pub grpc_addr: SocketAddr,
    /// REST API, `/healthz`, `/metrics` (default `0.0.0.0:7778`).
    pub http_addr: SocketAddr,
    /// Ops a watch stream computes ahead of its reader (a larger set is computed in parts).
    pub watch_buffer: usize,
    /// TLS on both ports; None serves plaintext (an explicit opt-in of the binary).
    pub tls: Option<spur_serving::ServingTls>,
    /// Who may read rules.
    pub auth: AuthConfig,
    /// The xDS (ADS) port; None serves no xDS. Its resources come from a store that publishes
    /// an xDS model (the Kubernetes store built `with_xds`).
    #[cfg(feature = "kubernetes")]
    pub xds: Option<XdsConfig>,
    /// The L4 listener API for gateway pods on the gRPC port; None serves none. Its model
    /// comes from a store that publishes one (the Kubernetes store built `with_l4`).
    #[cfg(feature = "kubernetes")]
    pub l4: Option<L4Options>,
    /// Signadot's Routes API a second time, plaintext and without authentication, for clients
    /// that speak only that (`go-routesapi`, `sdroutes`); None serves none (docs/routeserver.md,
    /// "Compatibility endpoint").
    pub compat: Option<CompatConfig>,
}

/// The compatibility endpoint: the Routes API (gRPC `routes.Routes` and its REST paths) and
/// nothing else (no history, no L4, no metrics), read-only by construction, plaintext and open
/// to anyone who reaches it: every rule of every namespace. Off unless configured; whoever
/// turns it on limits who reaches it (the chart's NetworkPolicy).
#[derive(Clone, Debug)]
pub struct CompatConfig {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
}

impl RouteServerConfig {
    pub fn new(rules_dir: impl Into<PathBuf>) -> Self {
        RouteServerConfig {
            rules_dir: rules_dir.into(),
            poll_interval: Duration::from_secs(1),
            grpc_addr: SocketAddr::from(([0, 0, 0, 0], 7777)),
            http_addr: SocketAddr::from(([0, 0, 0, 0], 7778)),
            watch_buffer: 1024,
            tls: None,
            auth: AuthConfig::Disabled,
            #[cfg(feature = "kubernetes")]
            xds: None,
            #[cfg(feature = "kubernetes")]
            l4: None,
            compat: None,
        }
    }
}

/// How long [`RouteServer::shutdown`] waits for the store, the servers and the watch streams.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// A running route server.
pub struct RouteServer {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    /// The compatibility endpoint's gRPC and HTTP addresses, if served.
    pub compat_addrs: Option<(SocketAddr, SocketAddr)>,
    /// The xDS port, if served.
    pub xds_addr: Option<SocketAddr>,
    #[cfg(feature = "kubernetes")]
    xds_nodes: xds::Nodes,
    index: Index,
    /// Stops the store, the servers and every watch stream, and tracks their tasks.
    drain: Drain,
}

impl RouteServer {
    /// Serves the rule directory `config.rules_dir`: binds both ports, loads the directory once
    /// (so the first request already sees the rules), then serves in the background.
    pub async fn start(config: RouteServerConfig) -> Result<Self, Error> {
        let store = DirStore::new(&config.rules_dir, config.poll_interval);
        Self::start_with(config, store).await
    }

    /// Serves the rules of `store` (e.g. the Kubernetes store): binds both ports, waits for the
    /// store's first complete rule set, then serves in the background.
    pub async fn start_with<S: RuleStore>(
        config: RouteServerConfig,
        mut store: S,
    ) -> Result<Self, Error> {
        let bind = |what, addr| async move {
            let l = TcpListener::bind(addr)
                .await
                .map_err(|source| Error::Bind { what, addr, source })?;
            let local = l
                .local_addr()
                .map_err(|source| Error::Bind { what, addr, source })?;
            Ok::<_, Error>((l, local))
        };
        let (grpc_listener, grpc_addr) = bind("gRPC", config.grpc_addr).await?;
        let (http_listener, http_addr) = bind("HTTP", config.http_addr).await?;
        let compat_listeners = match &config.compat {
            Some(c) => Some((
                bind("compatibility gRPC", c.grpc_addr).await?,
                bind("compatibility HTTP", c.http_addr).await?,
            )),
            None => None,
        };

        let mut registry = Registry::with_prefix("spur_routeserver");
        let metrics = Metrics::register(&mut registry);
        let index = Index::new();
        let tasks = Drain::new();
        let stop = tasks.token();
        let auth = auth::Authenticator::new(&config.auth);
        let tls = match &config.tls {
            Some(files) => Some(tls::start(files, &tasks, stop.clone())?),
            None => None,
        };
        let grpc_incoming = tls::incoming(
            grpc_listener,
            grpc_addr,
            tls.as_ref().map(|t| t.grpc.clone()),
            &tasks,
            stop.clone(),
        );
        let http_incoming = tls::incoming(
            http_listener,
            http_addr,
            tls.as_ref().map(|t| t.http.clone()),
            &tasks,
            stop.clone(),
        );

        #[cfg(feature = "kubernetes")]
        let xds = match &config.xds {
            Some(x) => Some(xds::start(x, &index, &mut registry, &tasks, stop.clone()).await?),
            None => None,
        };

        #[cfg(feature = "kubernetes")]
        let listeners = config.l4.as_ref().map(|o| {
            l4::service(
                o,
                &index,
                &auth,
                &metrics,
                &mut registry,
                &tasks,
                stop.clone(),
            )
        });

        store.initial(&index, &metrics).await?;
        tasks.spawn(store.run(index.clone(), metrics.clone(), stop.clone()));

        let index_metrics = metrics.clone();
        let mut snapshots = index.subscribe();
        let index_stop = stop.clone();
        tasks.spawn(async move {
            loop {
                let snap = snapshots.borrow_and_update().clone();
                index_metrics.set_index(snap.version, snap.rules.len());
                tokio::select! {
                    () = index_stop.cancelled() => return,
                    r = snapshots.changed() => if r.is_err() { return },
                }
            }
        });

        let service = grpc::RoutesHandler {
            index: index.clone(),
            metrics: metrics.clone(),
            buffer: config.watch_buffer,
            stop: stop.clone(),
            auth: auth.clone(),
        };
        let history = history_watch::HistoryHandler {
            history: index.history().clone(),
            metrics: metrics.clone(),
            stop: stop.clone(),
            auth: auth.clone(),
        };
        let grpc_stop = stop.clone();
        let grpc = grpc_server()
            .add_service(grpc::RoutesService::new(service))
            .add_service(
                spur_proto::history::route_history_server::RouteHistoryServer::new(history),
            );
        #[cfg(feature = "kubernetes")]
        let grpc = grpc.add_optional_service(listeners);
        tasks.spawn(async move {
            let res = grpc
                .serve_with_incoming_shutdown(grpc_incoming.into_stream(), grpc_stop.cancelled())
                .await;
            if let Err(e) = res {
                tracing::error!(error = %e, "gRPC server failed");
            }
        });

        let compat_addrs = match compat_listeners {
            Some(((grpc_l, grpc_a), (http_l, http_a))) => {
                let open = auth::Authenticator::new(&AuthConfig::Disabled);
                let routes = grpc::RoutesHandler {
                    index: index.clone(),
                    metrics: metrics.clone(),
                    buffer: config.watch_buffer,
                    stop: stop.clone(),
                    auth: open.clone(),
                };
                let rest_state = rest::RestState {
                    index: index.clone(),
                    metrics: metrics.clone(),
                    registry: Arc::new(Registry::default()),
                    buffer: config.watch_buffer,
                    stop: stop.clone(),
                    auth: open,
                };
                serve_compat(
                    routes,
                    rest_state,
                    (grpc_l, grpc_a),
                    (http_l, http_a),
                    &tasks,
                );
                Some((grpc_a, http_a))
            }
            None => None,
        };

        let rest_state = rest::RestState {
            index: index.clone(),
            metrics,
            registry: Arc::new(registry),
            buffer: config.watch_buffer,
            stop: stop.clone(),
            auth,
        };
        let http_stop = stop.clone();
        tasks.spawn(async move {
            let res = axum::serve(
                tls::GuardedIncoming(http_incoming),
                rest::router(rest_state),
            )
            .with_graceful_shutdown(http_stop.cancelled_owned())
            .await;
            if let Err(e) = res {
                tracing::error!(error = %e, "HTTP server failed");
            }
        });
        #[cfg(feature = "kubernetes")]
        let (xds_addr, xds_tls, l4) = (
            xds.as_ref().map(|x| x.addr),
            config.xds.as_ref().map(|x| x.tls.is_some()),
            config.l4.is_some(),
        );
        #[cfg(not(feature = "kubernetes"))]
        let (xds_addr, xds_tls, l4): (_, Option<bool>, _) = (None, None, false);
        tracing::info!(
            %grpc_addr,
            %http_addr,
            tls = config.tls.is_some(),
            xds_addr = ?xds_addr,
            xds_tls,
            auth = ?config.auth,
            l4,
            compat = ?compat_addrs,
            // What the store's first complete list gave: what every first watch is sent.
            rules = index.current().rules.len(),
            "route server started"
        );
        Ok(RouteServer {
            grpc_addr,
            http_addr,
            compat_addrs,
            xds_addr,
            #[cfg(feature = "kubernetes")]
            xds_nodes: xds.map(|x| x.nodes).unwrap_or_default(),
            index,
            drain: tasks,
        })
    }

    pub fn index(&self) -> &Index {
        &self.index
    }

    /// The xDS streams open now, each with what its node accepted and rejected.
    #[cfg(feature = "kubernetes")]
    pub fn xds_nodes(&self) -> Vec<xds::NodeStatus> {
        self.xds_nodes.list()
    }

    /// Ends every watch stream, stops both servers and the store, and waits (bounded) for them.
    pub async fn shutdown(self) {
        let left = self.drain.wait(SHUTDOWN_GRACE).await;
        if left > 0 {
            tracing::warn!(
                tasks = left,
                grace = ?SHUTDOWN_GRACE,
                "route server tasks still running after the grace period; abandoning them"
            );
        }
    }
}

/// Initial HTTP/2 buffer capacities of every connection a route-server process accepts: each
/// sidecar holds one connection that is idle between pushes, so at 10 000 watchers h2's defaults
/// (16 KiB write, 8 KiB read, 4 KiB HPACK) were about 11 KiB of resident memory per watcher
/// (`perf/results/push_steps.md`). Buffers still grow to whatever a frame needs.
pub const H2_BUFFERS: (usize, usize) = (1024, 1024);

/// Sets [`H2_BUFFERS`] for every HTTP/2 server connection this process accepts from now on (a
/// process-wide setting of the patched h2, `vendor/h2`). For a process that serves route watches
/// (the `spur-routeserver` binary); a process that proxies traffic keeps h2's defaults.
pub fn size_h2_buffers() {
    h2::server::set_buffer_capacities(H2_BUFFERS.0, H2_BUFFERS.1);
}

/// The gRPC server settings of both listeners (the main one and the compatibility endpoint).
fn grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        // Detect dead watchers; clients' own pings (grpc-go sends one every 5 s) are answered
        // and never counted against them.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .tcp_nodelay(true)
}

/// Serves the compatibility endpoint (see [`CompatConfig`]): plaintext, the Routes API only.
fn serve_compat(
    routes: grpc::RoutesHandler,
    rest_state: rest::RestState,
    (grpc_l, grpc_a): (TcpListener, SocketAddr),
    (http_l, http_a): (TcpListener, SocketAddr),
    tasks: &Drain,
) {
    let stop = rest_state.stop.clone();
    let grpc_incoming = tls::incoming(grpc_l, grpc_a, None, tasks, stop.clone());
    let http_incoming = tls::incoming(http_l, http_a, None, tasks, stop.clone());
    let grpc = grpc_server().add_service(grpc::RoutesService::new(routes));
    let grpc_stop = stop.clone();
    tasks.spawn(async move {
        let res = grpc
            .serve_with_incoming_shutdown(grpc_incoming.into_stream(), grpc_stop.cancelled())
            .await;
        if let Err(e) = res {
            tracing::error!(error = %e, "compatibility gRPC server failed");
        }
    });
    tasks.spawn(async move {
        let res = axum::serve(
            tls::GuardedIncoming(http_incoming),
            rest::routes_router(rest_state),
        )
        .with_graceful_shutdown(stop.cancelled_owned())
        .await;
        if let Err(e) = res {
            tracing::error!(error = %e, "compatibility HTTP server failed");
        }
    });
}
