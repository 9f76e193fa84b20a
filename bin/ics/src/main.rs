//! `spur-ics serve`: the io context server of sandbox resources (docs/resources.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, Result, bail};
use clap::{Args, Parser, Subcommand};
use prometheus_client::registry::Registry;
use spur_bin_support::Runtime;
use tokio_util::sync::CancellationToken;

/// The io context server of sandbox resources: the values their workflow steps hand each other
/// (docs/resources.md).
#[derive(Parser)]
#[command(name = "spur-ics", version)]
struct IcsArgs {
    #[command(subcommand)]
    command: IcsCommand,
}

#[derive(Subcommand)]
enum IcsCommand {
    /// Serve the io context API (gRPC over TLS) until SIGTERM.
    Serve(ServeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// The namespace of the io context Secrets (the only Secrets it reads or writes).
    #[arg(
        long,
        env = "SPUR_ICS_CONTEXT_NAMESPACE",
        default_value = "spur-io-contexts"
    )]
    context_namespace: String,
    /// gRPC address.
    #[arg(long, default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// Serving certificate (PEM; re-read while serving, so a renewal needs no restart).
    #[arg(long, env = "SPUR_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    #[arg(long, env = "SPUR_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve plaintext instead of TLS (local tests only: step pods send tokens).
    #[arg(long, conflicts_with = "tls_cert")]
    insecure_plaintext: bool,
    /// The audience step pods' projected tokens are issued for.
    #[arg(long, default_value = spur_ics::AUDIENCE)]
    audience: String,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:9090")]
    metrics_addr: SocketAddr,
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

async fn run(args: IcsArgs) -> Result<ExitCode> {
    let IcsCommand::Serve(args) = args.command;
    let tls = match (&args.tls_cert, &args.tls_key, args.insecure_plaintext) {
        (Some(c), Some(k), false) => Some(spur_serving::ServingTls::new(c, k)),
        (None, None, true) => None,
        _ => bail!(
            "the io context server serves TLS: pass --tls-cert and --tls-key (or --insecure-plaintext for a local test)"
        ),
    };
    let shutdown = spur_runtime::shutdown_signal();
    let client = spur_bin_support::kube_client(args.kubeconfig.as_deref()).await?;
    let mut registry = Registry::default();
    let metrics = spur_ics::Metrics::register(&mut registry);
    let cfg = spur_ics::Config {
        namespace: args.context_namespace.clone(),
        listen: args.listen,
        tls,
        audience: args.audience.clone(),
    };
    let server = spur_ics::Server::bind(cfg, client, metrics)
        .await
        .context("starting the io context server")?;
    let stop = CancellationToken::new();
    let listener = spur_serving::health::bind_health(args.metrics_addr).await?;
    let http = tokio::spawn(spur_serving::health::serve_health(
        listener,
        registry,
        None,
        stop.clone(),
    ));
    tracing::info!(listen = %server.local_addr(), contexts = %args.context_namespace, metrics = %args.metrics_addr, "io context server started");
    let served = tokio::spawn(server.run(stop.clone()));
    shutdown.await;
    tracing::info!("shutting down");
    stop.cancel();
    served.await.context("io context server panicked")??;
    http.await.context("metrics server panicked")??;
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let args = IcsArgs::parse();
    spur_bin_support::run("spur-ics", "info", Runtime::MultiThread, run(args))
}
