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
    /// Name of this replica in events and as lease holder (default: $POD_NAME, else the host
    /// name and process id).
    #[arg(long, env = "POD_NAME")]
    instance: Option<String>,
    /// Run the controllers without holding the lease (only for a single replica).
    #[arg(long, env = "SPUR_NO_LEADER_ELECT")]
    no_leader_elect: bool,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, env = "SPUR_LEASE_NAME", default_value = "spur-operator")]
    lease_name: String,
    /// Seconds the lease stays valid without renewal; a crashed leader is replaced after it.
    #[arg(long, env = "SPUR_LEASE_DURATION", default_value_t = 15, value_parser = clap::value_parser!(u64).range(2..=3600))]
    lease_duration: u64,
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
    let instance = args.instance.filter(|s| !s.is_empty()).unwrap_or_else(|| {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "spur-operator".into());
        format!("{host}-{}", std::process::id())
    });
    let ctx = Arc::new(spur_operator::Context::new(
        client.clone(),
        Some(instance.clone()),
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
    let stop_controllers = stop.clone();
    let http_stop = stop.clone();
    let http = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(http_stop.cancelled_owned())
            .await
    });
    let controllers = if args.no_leader_elect {
        tokio::spawn(async move {
            spur_operator::run(client, ctx, stop_controllers).await;
            Ok(())
        })
    } else {
        let election = spur_operator::LeaderElection {
            namespace: args.lease_namespace,
            lease: args.lease_name,
            identity: instance,
            duration_secs: args.lease_duration,
            grace_secs: (args.lease_duration / 3).max(1),
        };
        tokio::spawn(spur_operator::run_elected(
            client,
            ctx,
            stop_controllers,
            election,
        ))
    };
    tracing::info!(metrics = %args.metrics_addr, "operator started");
    let mut controllers = controllers;
    let early = tokio::select! {
        () = spur_sidecar::shutdown_signal() => None,
        r = &mut controllers => Some(r),
    };
    tracing::info!("shutting down: finishing in-flight reconciles");
    stop.cancel();
    let result = match early {
        Some(r) => r,
        None => controllers.await,
    };
    result
        .context("controllers panicked")?
        .context("the controllers stopped")?;
    http.await.context("metrics server panicked")??;
    Ok(ExitCode::SUCCESS)
}
