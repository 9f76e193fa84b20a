//! `spur-traffic-store serve`: the traffic store (docs/traffic.md). In a cluster (`--kube`) it takes
//! capture settings from the Sandboxes and authenticates sidecars and readers with Kubernetes
//! tokens and RBAC; standalone it reads a settings file and takes one static token.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use clap::{Args, Parser, Subcommand};
use prometheus_client::registry::Registry;
use spur_bin_support::Runtime;
use spur_traffic::{
    Authorizer, ClusterCapture, Limits, Server, SettingsIndex, SettingsMap, SettingsSource,
    TrafficServerConfig,
};
use tokio_util::sync::CancellationToken;

/// The traffic store: keeps what sidecars capture, serves `spur traffic` (docs/traffic.md).
#[derive(Parser)]
#[command(name = "spur-traffic-store", version)]
struct TrafficStoreArgs {
    #[command(subcommand)]
    command: TrafficStoreCommand,
}

#[derive(Subcommand)]
enum TrafficStoreCommand {
    /// Serve the traffic API (gRPC, TLS unless --insecure-plaintext) until SIGTERM.
    Serve(ServeArgs),
}

async fn run(args: TrafficStoreArgs) -> Result<ExitCode> {
    let TrafficStoreCommand::Serve(args) = args.command;
    serve(args).await
}

#[derive(Args)]
struct ServeArgs {
    /// gRPC address.
    #[arg(long, env = "SPUR_TRAFFIC_LISTEN", default_value = "0.0.0.0:7790")]
    listen: SocketAddr,
    /// The SQLite database file (created if missing). Without it, exchanges are kept in memory
    /// and lost when the process ends.
    #[arg(long, env = "SPUR_TRAFFIC_DB")]
    db: Option<PathBuf>,
    /// Exchanges older than this are deleted (0s: kept regardless of age).
    #[arg(long, env = "SPUR_TRAFFIC_MAX_AGE", default_value = "24h", value_parser = spur_runtime::parse_duration)]
    max_age: Duration,
    /// At most this many exchanges are kept; past it the oldest are deleted (and counted).
    #[arg(long, env = "SPUR_TRAFFIC_MAX_EXCHANGES", default_value_t = Limits::default().max_exchanges)]
    max_exchanges: u64,
    /// At most this many bytes of exchanges are kept; past it the oldest are deleted.
    #[arg(long, env = "SPUR_TRAFFIC_MAX_BYTES", default_value_t = Limits::default().max_bytes)]
    max_bytes: u64,
    /// At most this many exchanges are kept per namespace (the baseline's); past it that
    /// namespace's oldest are deleted. When the store is over --max-exchanges or --max-bytes,
    /// the namespace holding the most loses its oldest: one namespace never pushes out
    /// another's while that other holds less.
    #[arg(long, env = "SPUR_TRAFFIC_NAMESPACE_MAX_EXCHANGES", default_value_t = Limits::default().namespace_max_exchanges)]
    namespace_max_exchanges: u64,
    /// At most this many bytes of exchanges are kept per namespace.
    #[arg(long, env = "SPUR_TRAFFIC_NAMESPACE_MAX_BYTES", default_value_t = Limits::default().namespace_max_bytes)]
    namespace_max_bytes: u64,
    /// With --kube: how often an open WatchSettings or Tail stream's caller is checked again
    /// (TokenReview, pod lookup or SubjectAccessReview; a random time between half of it and
    /// all of it), besides when its token expires.
    #[arg(long, env = "SPUR_TRAFFIC_RECHECK", default_value = "5m", value_parser = spur_runtime::parse_duration)]
    recheck: Duration,
    /// Store no body bytes at all (sizes are kept): the cluster-wide privacy switch.
    #[arg(long, env = "SPUR_TRAFFIC_NO_BODIES")]
    no_bodies: bool,
    /// Serving certificate (PEM; re-read while serving, so a renewal needs no restart).
    #[arg(long, env = "SPUR_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    #[arg(long, env = "SPUR_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve plaintext instead of TLS (local use only: callers send tokens).
    #[arg(long, conflicts_with = "tls_cert")]
    insecure_plaintext: bool,
    /// In a cluster: capture settings from the Sandboxes, Kubernetes tokens and RBAC for
    /// every caller.
    #[arg(long, conflicts_with_all = ["settings", "token_file"])]
    kube: bool,
    /// Standalone: capture settings from this file (polled; see docs/traffic.md).
    #[arg(long, env = "SPUR_TRAFFIC_SETTINGS", requires = "token_file")]
    settings: Option<PathBuf>,
    /// Standalone: the one token every caller presents.
    #[arg(long, env = "SPUR_TRAFFIC_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// With --kube: headers redacted at every sidecar besides the always-redacted ones
    /// (repeatable; comma-separated in the env var).
    #[arg(
        long = "redact-header",
        env = "SPUR_TRAFFIC_REDACT_HEADERS",
        value_delimiter = ','
    )]
    redact_headers: Vec<String>,
    /// With --kube: body bytes captured per direction (at most 1 MiB).
    #[arg(long, env = "SPUR_TRAFFIC_MAX_BODY_BYTES")]
    max_body_bytes: Option<u32>,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:9090")]
    metrics_addr: SocketAddr,
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

async fn serve(args: ServeArgs) -> Result<ExitCode> {
    let tls = match (&args.tls_cert, &args.tls_key, args.insecure_plaintext) {
        (Some(c), Some(k), false) => Some(spur_serving::ServingTls::new(c, k)),
        (None, None, true) => None,
        _ => bail!(
            "the traffic store serves TLS: pass --tls-cert and --tls-key (or --insecure-plaintext for local use)"
        ),
    };
    for h in &args.redact_headers {
        if !spur_traffic::is_header_name(h) {
            bail!("--redact-header {h:?} is not a lowercase header name");
        }
    }
    if let Some(max) = args.max_body_bytes
        && max > spur_traffic::MAX_BODY_BYTES
    {
        bail!(
            "--max-body-bytes {max} is above {}",
            spur_traffic::MAX_BODY_BYTES
        );
    }
    let shutdown = spur_runtime::shutdown_signal();
    let stop = CancellationToken::new();
    let (settings, auth, index) = if args.kube {
        // Until the Sandboxes are listed, settings streams send nothing and pushes wait (then
        // "retry"), rather than capture being turned off and pushes refused as not captured.
        let index = SettingsIndex::pending();
        let client = spur_bin_support::kube_client(args.kubeconfig.as_deref()).await?;
        tokio::spawn(spur_traffic::watch_sandboxes(
            client.clone(),
            index.clone(),
            ClusterCapture {
                redact_headers: args.redact_headers.clone(),
                max_body_bytes: args.max_body_bytes,
            },
            stop.clone(),
        ));
        (
            SettingsSource::External,
            Authorizer::kube_with_recheck(client, args.recheck),
            index,
        )
    } else {
        let (Some(path), Some(token_file)) = (&args.settings, &args.token_file) else {
            bail!("pass --kube (in a cluster) or --settings and --token-file (standalone)");
        };
        let token = std::fs::read_to_string(token_file)
            .with_context(|| format!("reading {}", token_file.display()))?;
        (
            SettingsSource::File(path.clone()),
            Authorizer::static_token(token.trim()).context("--token-file")?,
            SettingsIndex::new(SettingsMap::default()),
        )
    };
    let mut registry = Registry::default();
    let server = Server::bind(
        TrafficServerConfig {
            listen: args.listen,
            db: args.db.clone(),
            limits: Limits {
                max_age: args.max_age,
                max_exchanges: args.max_exchanges,
                max_bytes: args.max_bytes,
                namespace_max_exchanges: args.namespace_max_exchanges,
                namespace_max_bytes: args.namespace_max_bytes,
                store_bodies: !args.no_bodies,
            },
            tls,
            settings,
            auth,
        },
        index,
        &mut registry,
    )
    .await
    .context("starting the traffic store")?;
    let listener = spur_serving::health::bind_health(args.metrics_addr).await?;
    let http = tokio::spawn(spur_serving::health::serve_health(
        listener,
        registry,
        None,
        stop.clone(),
    ));
    tracing::info!(listen = %server.local_addr(), db = ?args.db, kube = args.kube, bodies = !args.no_bodies, metrics = %args.metrics_addr, "traffic store started");
    let served = tokio::spawn(server.run(stop.clone()));
    shutdown.await;
    tracing::info!("shutting down");
    stop.cancel();
    served.await.context("traffic store panicked")??;
    http.await.context("metrics server panicked")??;
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let args = TrafficStoreArgs::parse();
    spur_bin_support::run(
        "spur-traffic-store",
        "info",
        Runtime::MultiThread,
        run(args),
    )
}
