//! The probe and metrics server every long-running Spur binary serves. It keeps the front
//! door's HTTP/1 rules: every connection reads through the bare-LF guard, every request passes
//! the `Host` check.

use std::net::SocketAddr;

use tokio::net::TcpListener;

use crate::Error;
use crate::http1::{Guarded, layer};

/// What a readiness probe asks: ready now, and the reason given when not.
pub type Readiness = (std::sync::Arc<dyn Fn() -> bool + Send + Sync>, &'static str);

/// The probe and metrics server every long-running binary serves: `/healthz` (alive),
/// `/readyz` (from `ready`; without one, always ready) and `/metrics` (OpenMetrics text of
/// `registry`), on `listener` with the front door's rules, until `stop`.
pub async fn serve_health(
    listener: TcpListener,
    registry: prometheus_client::registry::Registry,
    ready: Option<Readiness>,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    use axum::response::IntoResponse;
    use axum::routing::get;
    let registry = std::sync::Arc::new(registry);
    let app = axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready.clone();
                async move {
                    match ready {
                        Some((ready, _)) if ready() => (http::StatusCode::OK, "ready\n"),
                        Some((_, why)) => (http::StatusCode::SERVICE_UNAVAILABLE, why),
                        None => (http::StatusCode::OK, "ready\n"),
                    }
                }
            }),
        )
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
    axum::serve(Guarded(listener), layer(app))
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
}

/// Binds the probe and metrics address, with an error that names it.
pub async fn bind_health(addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })
}
