//! The admin server: `/live`, `/ready` (200 once a first configuration runs, 503 while
//! draining), `/metrics` (Prometheus text) and `/config_dump` (JSON, loopback clients only).
//! It outlives the listeners' drain, so probes and scrapes answer until the end.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response, StatusCode, header};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::Shared;

pub(crate) async fn serve(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    while let Some((stream, peer)) =
        spur_runtime::accept(&listener, stop.cancelled(), "admin").await
    {
        let shared = shared.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let shared = shared.clone();
                async move {
                    Ok::<_, Infallible>(handle(&shared, req.method(), req.uri().path(), peer).await)
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10));
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!(error = %e, "admin connection error");
                },
                () = stop.cancelled() => {}
            }
        });
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

async fn handle(
    shared: &Shared,
    method: &Method,
    path: &str,
    peer: SocketAddr,
) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match path {
        "/live" => text(StatusCode::OK, "live\n".into()),
        "/ready" if shared.is_draining() => {
            text(StatusCode::SERVICE_UNAVAILABLE, "draining\n".into())
        }
        "/ready" if shared.is_ready() => text(StatusCode::OK, "ready\n".into()),
        "/ready" => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "waiting for a first configuration from the route server\n".into(),
        ),
        "/metrics" => {
            let mut out = String::new();
            match prometheus_client::encoding::text::encode(&mut out, &shared.registry) {
                Ok(()) => {
                    let mut r = text(StatusCode::OK, out);
                    r.headers_mut().insert(
                        header::CONTENT_TYPE,
                        header::HeaderValue::from_static(
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        ),
                    );
                    r
                }
                Err(_) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "metrics encoding failed\n".into(),
                ),
            }
        }
        "/config_dump" if !peer.ip().to_canonical().is_loopback() => text(
            StatusCode::FORBIDDEN,
            "/config_dump is served to loopback clients only (kubectl port-forward or exec)\n"
                .into(),
        ),
        "/config_dump" => {
            let body = serde_json::to_string_pretty(&shared.config_dump().await)
                .unwrap_or_else(|_| "{}".into());
            let mut r = text(StatusCode::OK, body + "\n");
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/json"),
            );
            r
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
    }
}
