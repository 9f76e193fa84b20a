//! `spur operator`: the Sandbox, ForkedWorkload, RouteGroup and RoutingConfig controllers, with
//! `/metrics` and `/healthz` on a small HTTP port.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context as _, Result};
use axum::Router;
use axum::response::IntoResponse;
use axum::routing::get;
use clap::Args;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

#[derive(Args)]
pub(crate) struct OperatorArgs {
    /// Kubeconfig file (default: in-cluster config, then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Address of /metrics and /healthz.
    #[arg(long, env = "SPUR_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Name of this replica in events (default: $POD_NAME or the host name).
    #[arg(long, env = "POD_NAME")]
    instance: Option<String>,
}

pub(crate) async fn run(args: OperatorArgs) -> Result<ExitCode> {
    let client = crate::kube_client(args.kubeconfig.as_deref()).await?;
    // Fail fast with a clear message when the API server is unreachable or refuses us.
    client
        .apiserver_version()
        .await
        .context("cannot reach the Kubernetes API server")?;
    let mut registry = Registry::with_prefix("spur_operator");
    let metrics = spur_operator::Metrics::register(&mut registry);
    let instance = args
        .instance
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|s| !s.is_empty());
    let ctx = Arc::new(spur_operator::Context::new(
        client.clone(),
        instance,
        metrics,
    ));

    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("cannot bind the metrics address {}", args.metrics_addr))?;
    let registry = Arc::new(registry);
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    let mut out = String::new();
                    match prometheus_client::encoding::text::encode(&mut out, &registry) {
                        Ok(()) => (
                            [(
                                http::header::CONTENT_TYPE,
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            )],
                            out,
                        )
                            .into_response(),
                        Err(_) => (
                            http::StatusCode::INTERNAL_SERVER_ERROR,
                            "cannot encode metrics\n",
                        )
                            .into_response(),
                    }
                }
            }),
        );
    let stop = CancellationToken::new();
    let http_stop = stop.clone();
    let http = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(http_stop.cancelled_owned())
            .await
    });
    let controllers = tokio::spawn(spur_operator::run(client, ctx, stop.clone()));
    tracing::info!(metrics = %args.metrics_addr, "operator started");
    spur_sidecar::shutdown_signal().await;
    tracing::info!("shutting down: finishing in-flight reconciles");
    stop.cancel();
    controllers.await.context("controllers panicked")?;
    http.await.context("metrics server panicked")??;
    Ok(ExitCode::SUCCESS)
}
