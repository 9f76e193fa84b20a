//! The binaries' plain HTTP servers (metrics, probes) keep the front door's HTTP/1 rules:
//! every connection reads through the bare-LF guard, every request passes the `Host` check.

use std::net::SocketAddr;

use spur_proxy::Http1Guard;
use tokio::net::{TcpListener, TcpStream};

/// Largest request head these servers follow.
const MAX_HEAD: usize = 64 * 1024;

/// A listener for `axum::serve` whose connections read through [`Http1Guard`].
pub(crate) struct Guarded(pub(crate) TcpListener);

impl axum::serve::Listener for Guarded {
    type Io = Http1Guard<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, SocketAddr) {
        // axum stops serving on its own (graceful shutdown); this never stops.
        loop {
            if let Some((tcp, peer)) =
                spur_runtime::accept(&self.0, std::future::pending(), "metrics").await
            {
                return (Http1Guard::new(tcp, MAX_HEAD), peer);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

/// `router` with the `Host` check in front of every route.
pub(crate) fn layer(router: axum::Router) -> axum::Router {
    router.layer(axum::middleware::from_fn(spur_routeserver::front_door))
}

/// What a readiness probe asks: ready now, and the reason given when not.
pub(crate) type Readiness = (std::sync::Arc<dyn Fn() -> bool + Send + Sync>, &'static str);

/// The probe and metrics server every long-running binary serves: `/healthz` (alive),
/// `/readyz` (from `ready`; without one, always ready) and `/metrics` (OpenMetrics text of
/// `registry`), on `listener` with the front door's rules, until `stop`.
pub(crate) async fn serve_health(
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
pub(crate) async fn bind_health(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    use anyhow::Context as _;
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot bind the metrics address {addr}"))
}
