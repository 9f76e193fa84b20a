//! The DevMesh sidecar: routes each inbound request to its sandbox fork or to the baseline app.
//!
//! This library assembles the proxy core for the sidecar role — a [`KeyRouter`] over
//! a routing table fed by a rule source, the admin server, and drain — so that the `spur-sidecar`
//! binary and `spur demo` run exactly the same thing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use prometheus_client::registry::Registry;
pub use spur_discovery::RouteServerConn;
use spur_discovery::{FileSource, Publisher, RouteServerSource};
use spur_proxy::{AdminState, Drain, Inbound, Proxy, ProxyConfig};
use spur_routing::{BaselineWorkload, ExtractConfig, SharedTable};
use spur_runtime::parse_duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod capture;
pub mod intercept;
pub mod kafka;
pub mod outbound;
mod router;
pub mod supervise;
pub mod trace;

pub use router::{KeyCapture, KeyRouter, KeyRouterConfig, ROUTED_HEADER};

/// Errors while configuring or starting a sidecar.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Config(String),
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Proxy(#[from] spur_proxy::Error),
    /// `--intercept` could not program the rules (the init step's own error).
    #[error("--intercept: {0}")]
    Intercept(spur_init::Error),
    /// Giving up root after `--intercept` failed or left something behind.
    #[error("--intercept: {0}")]
    Privileges(String),
}

/// Command-line flags of `spur-sidecar` (each also settable through the `SPUR_*` variable shown).
#[derive(Debug, Clone, Args)]
pub struct SidecarArgs {
    /// Address the sidecar accepts inbound connections on.
    #[arg(long, env = "SPUR_INBOUND_ADDR", default_value = "0.0.0.0:15006")]
    pub inbound_addr: SocketAddr,
    /// Transparent mode: connections were redirected here by iptables/nft and their original
    /// destination (the app's port) is read from the socket. Excludes --app-addr.
    #[arg(long, env = "SPUR_TRANSPARENT")]
    pub transparent: bool,
    /// Explicit mode: where unrouted traffic goes (the application). Its port is the workload
    /// port that rules are looked up with.
    #[arg(long, env = "SPUR_APP_ADDR")]
    pub app_addr: Option<SocketAddr>,
    /// Kind of the baseline workload this sidecar fronts (Deployment, ArgoRollout, …).
    #[arg(long, env = "SPUR_BASELINE_KIND", default_value = "Deployment")]
    pub baseline_kind: String,
    /// Namespace of the baseline workload.
    #[arg(long, env = "SPUR_BASELINE_NAMESPACE")]
    pub baseline_namespace: String,
    /// Name of the baseline workload.
    #[arg(long, env = "SPUR_BASELINE_NAME")]
    pub baseline_name: String,
    /// Routing rules file (YAML or JSON, Routes API shape), polled for changes. Without it the
    /// sidecar routes everything to the application.
    #[arg(long, env = "SPUR_RULES")]
    pub rules: Option<PathBuf>,
    /// Route server address (host:port) to watch this baseline's rules from, over the Routes
    /// API. Excludes --rules.
    #[arg(long, env = "SPUR_ROUTESERVER")]
    pub routeserver: Option<String>,
    /// CA bundle (PEM) the route server's certificate must chain to: the connection is TLS
    /// with it, plaintext without. Re-read on every connection.
    #[arg(long, env = "SPUR_ROUTESERVER_CA", requires = "routeserver")]
    pub routeserver_ca: Option<PathBuf>,
    /// File with the token presented to the route server (the pod's projected ServiceAccount
    /// token for the route server's audience). Re-read on every connection.
    #[arg(long, env = "SPUR_ROUTESERVER_TOKEN_FILE", requires = "routeserver")]
    pub routeserver_token_file: Option<PathBuf>,
    /// How often the rules file is checked for changes.
    #[arg(long, env = "SPUR_RULES_POLL", default_value = "1s", value_parser = parse_duration)]
    pub rules_poll: Duration,
    /// Admin server address (/live, /ready, /metrics, /config_dump).
    #[arg(long, env = "SPUR_ADMIN_ADDR", default_value = "127.0.0.1:15020")]
    pub admin_addr: SocketAddr,
    /// Extra header whose value is a bare routing key (repeatable; comma-separated in the env var).
    #[arg(
        long = "routing-header",
        env = "SPUR_ROUTING_HEADERS",
        value_delimiter = ','
    )]
    pub routing_headers: Vec<String>,
    /// Query parameter carrying a routing key (e.g. sd-routing-key); stripped from the URL and
    /// re-injected as headers. Off unless set.
    #[arg(long, env = "SPUR_QUERY_PARAM")]
    pub query_param: Option<String>,
    /// Ports that are never sniffed and always proxied as opaque TCP (comma-separated in env).
    #[arg(long = "opaque-port", env = "SPUR_OPAQUE_PORTS", value_delimiter = ',')]
    pub opaque_ports: Vec<u16>,
    /// How long in-flight requests get to finish after SIGTERM.
    #[arg(long, env = "SPUR_DRAIN_GRACE", default_value = "20s", value_parser = parse_duration)]
    pub drain_grace: Duration,
    /// Proxy tunables (timeouts, limits, pools) as YAML/JSON; see ProxyConfig in the docs.
    #[arg(long, env = "SPUR_PROXY_CONFIG")]
    pub proxy_config: Option<PathBuf>,
    /// Fixed address for a sandbox destination, `HOST:PORT=IP:PORT`, used instead of DNS
    /// (repeatable; comma-separated in env). For sidecars outside the cluster's DNS.
    #[arg(long = "resolve", env = "SPUR_RESOLVE", value_delimiter = ',', value_parser = parse_resolve)]
    pub resolve: Vec<(String, SocketAddr)>,
    /// Outbound mode (job runner pods): instead of routing by key, add the routing key in this
    /// file to every HTTP/1, h2 and gRPC request the pod sends, and forward each to its original
    /// destination. With --intercept, the pod's own outbound TCP (not inbound) is redirected
    /// to --inbound-addr. Needs neither --rules nor --routeserver.
    #[arg(long, env = "SPUR_INJECT_KEY_FILE")]
    pub inject_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub capture: capture::CaptureArgs,
    #[command(flatten)]
    pub kafka: kafka::KafkaArgs,
}

/// Parses a `--resolve` entry, `HOST:PORT=IP:PORT` (like curl's), for every Spur binary that
/// takes fixed addresses instead of DNS.
pub fn parse_resolve(s: &str) -> Result<(String, SocketAddr), String> {
    let (key, addr) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected HOST:PORT=IP:PORT"))?;
    let addr = addr
        .parse()
        .map_err(|_| format!("{s:?}: {addr:?} is not an IP:PORT address"))?;
    Ok((key.to_string(), addr))
}

/// A validated sidecar configuration.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    pub inbound_addr: SocketAddr,
    pub inbound: Inbound,
    pub baseline: BaselineWorkload,
    pub rules: Option<PathBuf>,
    pub rules_poll: Duration,
    /// Route server to watch instead of a rules file.
    pub routeserver: Option<RouteServerConn>,
    pub admin_addr: Option<SocketAddr>,
    pub extract: ExtractConfig,
    pub proxy: ProxyConfig,
    /// Outbound mode: the file with the routing key to add (see [`outbound`]).
    pub inject_key_file: Option<PathBuf>,
    /// Traffic capture (see [`capture`]).
    pub capture: Option<capture::CaptureConfig>,
    /// The Kafka relay (see [`kafka`]), when broker ports or a broker are set.
    pub kafka: Option<kafka::KafkaConfig>,
}

impl TryFrom<SidecarArgs> for SidecarConfig {
    type Error = Error;

    fn try_from(a: SidecarArgs) -> Result<Self, Error> {
        let inbound = match (a.transparent, a.app_addr) {
            (true, None) => Inbound::Transparent,
            (false, Some(app)) => Inbound::Explicit { app },
            (true, Some(_)) => {
                return Err(Error::Config(
                    "--transparent and --app-addr exclude each other".into(),
                ));
            }
            (false, None) => {
                return Err(Error::Config(
                    "either --app-addr (explicit mode) or --transparent is required".into(),
                ));
            }
        };
        if a.inject_key_file.is_some() && (a.rules.is_some() || a.routeserver.is_some()) {
            return Err(Error::Config(
                "--inject-key-file (outbound mode) routes by nothing: it excludes --rules and --routeserver".into(),
            ));
        }
        let capture = a.capture.validate()?;
        let kafka = a.kafka.validate(a.transparent)?;
        if a.inject_key_file.is_some() && kafka.is_some() {
            return Err(Error::Config(
                "--inject-key-file (outbound mode, job runners) relays no Kafka: it excludes --kafka-ports".into(),
            ));
        }
        if a.inject_key_file.is_some() && capture.is_some() {
            return Err(Error::Config(
                "--inject-key-file (outbound mode) captures nothing: it excludes --traffic-server"
                    .into(),
            ));
        }
        if a.rules.is_some() && a.routeserver.is_some() {
            return Err(Error::Config(
                "--rules and --routeserver exclude each other".into(),
            ));
        }
        let mut proxy = match &a.proxy_config {
            None => ProxyConfig::default(),
            Some(path) => {
                let bytes = std::fs::read(path)
                    .map_err(|e| Error::Config(format!("cannot read {}: {e}", path.display())))?;
                serde_yaml_ng::from_slice(&bytes).map_err(|e| {
                    Error::Config(format!("invalid proxy config {}: {e}", path.display()))
                })?
            }
        };
        proxy.drain_grace = a.drain_grace;
        proxy.opaque_ports.extend(a.opaque_ports.iter().copied());
        proxy.resolve.extend(a.resolve.iter().cloned());
        proxy.validate()?;
        let baseline = BaselineWorkload {
            kind: a.baseline_kind,
            namespace: a.baseline_namespace,
            name: a.baseline_name,
        };
        for (what, v) in [
            ("kind", &baseline.kind),
            ("namespace", &baseline.namespace),
            ("name", &baseline.name),
        ] {
            if v.is_empty()
                || !v
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
            {
                return Err(Error::Config(format!(
                    "baseline {what} {v:?} must be non-empty [A-Za-z0-9.-]"
                )));
            }
        }
        Ok(SidecarConfig {
            inbound_addr: a.inbound_addr,
            inbound,
            baseline,
            rules: a.rules,
            rules_poll: a.rules_poll,
            routeserver: a.routeserver.map(|addr| RouteServerConn {
                addr,
                ca: a.routeserver_ca,
                token: a.routeserver_token_file,
            }),
            admin_addr: Some(a.admin_addr),
            extract: ExtractConfig {
                custom_headers: a.routing_headers,
                query_param: a.query_param,
            },
            proxy,
            inject_key_file: a.inject_key_file,
            capture,
            kafka,
        })
    }
}

/// What a supervising process ([`supervise`]) hands the worker it starts: the listening sockets
/// it holds across the worker's restarts, and, for a restarted worker, how long inbound
/// connections wait in the listen queue for the first routing table (so a keyed request that
/// arrives right after a crash is not sent to the baseline for want of routes).
#[derive(Debug, Default)]
pub struct Handover {
    /// The inbound listener (else [`SidecarConfig::inbound_addr`] is bound).
    pub inbound: Option<std::net::TcpListener>,
    /// The admin listener (else [`SidecarConfig::admin_addr`] is bound).
    pub admin: Option<std::net::TcpListener>,
    /// Zero: serve at once (a sidecar's first start: the app has not started yet).
    pub table_wait: Duration,
    /// How many times the supervisor started a worker again (`spur_sidecar_worker_restarts`).
    pub restarts: u32,
}

/// A running sidecar.
pub struct Sidecar {
    /// The bound inbound address (useful with port 0).
    pub inbound_addr: SocketAddr,
    /// The bound admin address, if an admin server runs.
    pub admin_addr: Option<SocketAddr>,
    /// The Kafka relay's bound IPv4 address, if it runs (in explicit mode, what apps bootstrap
    /// to).
    pub kafka_addr: Option<SocketAddr>,
    proxy: Proxy,
    table: SharedTable,
    capture_keys: Option<capture::CaptureKeys>,
    drain: Drain,
    stop: CancellationToken,
    grace: Duration,
}

impl Sidecar {
    /// Binds the listeners, loads the rules once (so a valid file is in force before the first
    /// connection), then serves in the background.
    pub async fn start(config: SidecarConfig) -> Result<Self, Error> {
        Self::start_with(config, Handover::default()).await
    }

    /// [`Sidecar::start`] on the listeners a supervisor hands over (see [`Handover`]).
    pub async fn start_with(config: SidecarConfig, handover: Handover) -> Result<Self, Error> {
        let mut registry = Registry::with_prefix("spur");
        let restarts = prometheus_client::metrics::gauge::Gauge::<i64>::default();
        restarts.set(i64::from(handover.restarts));
        registry.register(
            "sidecar_worker_restarts",
            "Times the supervisor (--supervise) started this container's sidecar worker again after it died",
            restarts,
        );
        let table = SharedTable::new();
        let publisher = Publisher::new(table.clone(), &mut registry);
        let mut changes = publisher.subscribe();
        let capturer = match &config.capture {
            Some(c) => Some(capture::Capturer::new(
                c.clone(),
                config.baseline.clone(),
                &mut registry,
            )?),
            None => None,
        };
        // The Kafka relay reads record headers with the same carriers as the router.
        let kafka_extractor = spur_routing::KeyExtractor::new(&config.extract)
            .map_err(|e| Error::Config(e.to_string()))?;
        let mut plugins = spur_proxy::Plugins::default();
        // The hops of sampled traces, for the admin port's /traces (an inbound sidecar's only).
        let mut traces = None;
        let router: Arc<dyn spur_proxy::Router> = match &config.inject_key_file {
            // The key goes out in the configured custom headers too, for apps that propagate
            // only those (`--routing-header`, the same carriers an inbound sidecar reads).
            Some(path) => Arc::new(outbound::InjectRouter::new(
                path.clone(),
                kafka_extractor.custom_headers().to_vec(),
            )),
            None => {
                let router = Arc::new(KeyRouter::new(
                    KeyRouterConfig {
                        baseline: config.baseline.clone(),
                        extract: config.extract,
                    },
                    table.clone(),
                )?);
                plugins.capture = capturer.as_ref().map(|c| spur_proxy::CapturePlugin {
                    select: Arc::new(router.capture(c.keys.clone())),
                    sink: c.sink.clone(),
                });
                plugins.raw = Some(router.clone());
                let recorder = trace::TraceRecorder::new(kafka_extractor.clone(), &mut registry);
                traces = Some(recorder.ring());
                plugins.trace = Some(Arc::new(recorder));
                router
            }
        };
        let proxy = Proxy::with_plugins(config.proxy.clone(), router, plugins, &mut registry)?;

        let listener =
            bind_or_take(handover.inbound, config.inbound_addr, "inbound listener").await?;
        let inbound_addr = listener.local_addr().map_err(|source| Error::Bind {
            what: "inbound listener",
            addr: config.inbound_addr,
            source,
        })?;
        // With the route server, the Kafka relay decides by the route history (see [`kafka`]).
        let history = match (&config.kafka, &config.routeserver) {
            (Some(_), Some(_)) => Some(spur_discovery::SharedHistory::new()),
            _ => None,
        };
        let kafka = match &config.kafka {
            Some(k) => Some(
                kafka::KafkaListeners::bind(
                    k,
                    match &history {
                        Some(h) => kafka::Decider::History(h.clone()),
                        None => kafka::Decider::Table(table.clone()),
                    },
                    config.baseline.clone(),
                    kafka_extractor,
                    &mut registry,
                )
                .await?,
            ),
            None => None,
        };
        let first_table = publisher.subscribe();
        let admin = match config.admin_addr {
            Some(addr) => Some(bind_or_take(handover.admin, addr, "admin server").await?),
            None => None,
        };
        let admin_addr = admin.as_ref().and_then(|l| l.local_addr().ok());

        let stop = CancellationToken::new();
        let drain = Drain::new();
        let requires_table = config.rules.is_some() || config.routeserver.is_some();
        if let Some(conn) = &config.routeserver {
            // Ready only after the first SYNCED: the source publishes nothing before it.
            let source = RouteServerSource::new(
                conn.clone(),
                config.baseline.clone(),
                publisher,
                &mut registry,
            )
            .map_err(|e| Error::Config(e.to_string()))?;
            tokio::spawn(source.run(stop.clone()));
            if let Some(h) = &history {
                let source = spur_discovery::HistorySource::new(
                    conn.clone(),
                    config.baseline.clone(),
                    h.clone(),
                    &mut registry,
                )
                .map_err(|e| Error::Config(e.to_string()))?;
                tokio::spawn(source.run(stop.clone()));
            }
        } else if let Some(path) = &config.rules {
            let mut source = FileSource::new(path, config.rules_poll, publisher);
            // Errors are reported by the source; the sidecar starts unready and keeps polling.
            let _ = source.poll_once().await;
            tokio::spawn(source.run(stop.clone()));
        } else {
            drop(publisher);
        }
        let capture_keys = capturer.as_ref().map(|c| c.keys.clone());
        if let Some(c) = capturer {
            c.spawn(config.rules_poll, stop.clone());
        }
        // Single consumer of table swaps: close pooled connections to destinations that left.
        let pool_proxy = proxy.clone();
        let pool_table = table.clone();
        let pool_stop = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = pool_stop.cancelled() => return,
                    changed = changes.changed() => if changed.is_err() { return },
                }
                pool_proxy.on_table_change(&pool_table);
            }
        });
        if let Some(l) = admin {
            let state = AdminState {
                registry: Arc::new(registry),
                table: table.clone(),
                drain: drain.clone(),
                requires_table,
                traces: traces.map(|ring| -> Arc<dyn Fn() -> serde_json::Value + Send + Sync> {
                    Arc::new(move || serde_json::json!({ "hops": ring.hops() }))
                }),
                identity: serde_json::json!({
                    "role": "sidecar",
                    "baseline": {
                        "kind": config.baseline.kind,
                        "namespace": config.baseline.namespace,
                        "name": config.baseline.name,
                    },
                    "inbound": inbound_addr.to_string(),
                    "mode": match config.inbound { Inbound::Transparent => "transparent", Inbound::Explicit { .. } => "explicit" },
                    "direction": if config.inject_key_file.is_some() { "outbound" } else { "inbound" },
                    "capture": config.capture.as_ref().map(|c| c.server.addr.clone()),
                    "kafka": config.kafka.as_ref().map(|k| serde_json::json!({
                        "brokerPorts": k.ports,
                        "broker": k.broker.map(|b| b.to_string()),
                        "relayPort": k.listen_port,
                        "role": match &k.role {
                            spur_kafka::Role::Baseline => serde_json::json!("baseline"),
                            spur_kafka::Role::Fork { sandbox } => serde_json::json!({ "forkOf": sandbox }),
                        },
                    })),
                }),
            };
            tokio::spawn(spur_proxy::serve_admin(l, state, stop.clone()));
        }
        let kafka_addr = kafka.as_ref().map(|k| k.addr);
        let serve_proxy = proxy.clone();
        let serve_drain = drain.clone();
        let inbound = config.inbound;
        let (table_wait, mut first) = (handover.table_wait, first_table.clone());
        drain.spawn(async move {
            // A restarted worker: connections wait in the listen queue (the supervisor held it
            // while no worker ran) until the routes are known, within a bound, since the route
            // server may be the thing that is away; after it the baseline serves them all.
            if requires_table && !table_wait.is_zero() {
                tokio::select! {
                    loaded = tokio::time::timeout(table_wait, first.wait_for(|v| *v > 0)) => {
                        if !matches!(loaded, Ok(Ok(_))) {
                            tracing::warn!(?table_wait, "no routing table yet: serving inbound connections; keyed requests reach the baseline until one arrives");
                        }
                    }
                    () = serve_drain.signaled() => return,
                }
            }
            serve_proxy.serve(listener, inbound, serve_drain).await
        });
        if let Some(k) = kafka {
            let to = k.to;
            for listener in k.listeners {
                let (proxy, drain_k, relay) = (proxy.clone(), drain.clone(), k.relay.clone());
                let stop_k = stop.clone();
                let mut first_table = first_table.clone();
                let history = history.clone();
                drain.spawn(async move {
                    // Connections wait in the listen queue until the routes are known (see
                    // [`kafka`]); without a rule source there is nothing to wait for.
                    if let Some(h) = history {
                        tokio::select! {
                            loaded = h.wait_loaded(&stop_k) => if !loaded { return },
                            () = drain_k.signaled() => return,
                        }
                    } else if requires_table {
                        tokio::select! {
                            loaded = first_table.wait_for(|v| *v > 0) => {
                                // The rule source is gone without a table: relaying with none
                                // would hand the baseline every fork's records.
                                if loaded.is_err() {
                                    tracing::error!("Kafka relay not started: the rule source ended before the first routing table");
                                    return;
                                }
                            }
                            () = drain_k.signaled() => return,
                            () = stop_k.cancelled() => return,
                        }
                    }
                    proxy.serve_kafka(listener, to, relay, drain_k).await
                });
            }
        }
        tracing::info!(%inbound_addr, admin = ?admin_addr, baseline = %config.baseline, "sidecar started");
        Ok(Sidecar {
            inbound_addr,
            admin_addr,
            kafka_addr,
            proxy,
            table,
            capture_keys,
            drain,
            stop,
            grace: config.proxy.drain_grace,
        })
    }

    pub fn proxy(&self) -> &Proxy {
        &self.proxy
    }

    pub fn table(&self) -> &SharedTable {
        &self.table
    }

    /// The routing keys being captured, when the sidecar captures.
    pub fn capture_keys(&self) -> Option<&capture::CaptureKeys> {
        self.capture_keys.as_ref()
    }

    /// Stops accepting, lets in-flight work finish within the grace period, then stops the rule
    /// source and the admin server. Returns how many tasks were still running at the deadline.
    pub async fn shutdown(self) -> usize {
        tracing::info!(grace = ?self.grace, in_flight = self.drain.in_flight(), "draining");
        let left = self.drain.wait(self.grace).await;
        self.stop.cancel();
        if left > 0 {
            tracing::warn!(left, "grace period over; closing remaining connections");
        } else {
            tracing::info!("drained");
        }
        left
    }
}

/// Takes over a listener a supervisor bound, or binds `addr`.
async fn bind_or_take(
    held: Option<std::net::TcpListener>,
    addr: SocketAddr,
    what: &'static str,
) -> Result<TcpListener, Error> {
    let bound = match held {
        Some(l) => l
            .set_nonblocking(true)
            .and_then(|()| TcpListener::from_std(l)),
        None => TcpListener::bind(addr).await,
    };
    bound.map_err(|source| Error::Bind { what, addr, source })
}
