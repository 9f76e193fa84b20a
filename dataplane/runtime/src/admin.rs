//! The admin endpoints of Spur's data-plane servers (feature `admin`): `/live`, `/ready`,
//! `/metrics` (Prometheus text) and `/config_dump` (JSON, loopback clients only). What differs
//! from server to server (when it is ready, its metrics registry, what its configuration dump
//! holds) comes from an [`AdminSource`]; [`respond`] answers one request, [`serve`] runs a plain
//! HTTP/1.1 admin server on it.
//!
//! `/config_dump` can show what the server routes and where (rules, routing keys, endpoints),
//! so it is served only to clients on loopback (the pod itself, `kubectl port-forward`,
//! `kubectl exec`); the port is reachable from the network for the kubelet's probes and
//! metrics scrapes, which reveal none of it.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response, StatusCode, header};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// What `/ready` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// 200 `ready`.
    Ready,
    /// 503 `draining`: load balancers should stop sending new work.
    Draining,
    /// 503 with this reason (e.g. "waiting for a routing table").
    Waiting(&'static str),
}

/// What a server's admin endpoints report on.
pub trait AdminSource: Send + Sync + 'static {
    fn readiness(&self) -> Readiness;
    /// Encoded for `/metrics`.
    fn registry(&self) -> &Registry;
    /// The body of `/config_dump`.
    fn config_dump(&self) -> impl Future<Output = serde_json::Value> + Send;
    /// The body of `/traces` (loopback clients only, like `/config_dump`: it holds routing
    /// keys); `None` where the server records no traces (404).
    fn traces(&self) -> Option<serde_json::Value> {
        None
    }
}

/// The answer to one admin request from `peer`.
pub async fn respond<S: AdminSource + ?Sized>(
    source: &S,
    method: &Method,
    path: &str,
    peer: SocketAddr,
) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match path {
        "/live" => text(StatusCode::OK, "live\n".into()),
        "/ready" => match source.readiness() {
            Readiness::Ready => text(StatusCode::OK, "ready\n".into()),
            Readiness::Draining => text(StatusCode::SERVICE_UNAVAILABLE, "draining\n".into()),
            Readiness::Waiting(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
        },
        "/metrics" => {
            let mut out = String::new();
            match prometheus_client::encoding::text::encode(&mut out, source.registry()) {
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
        "/config_dump" | "/traces" if !peer.ip().to_canonical().is_loopback() => text(
            StatusCode::FORBIDDEN,
            format!("{path} is served to loopback clients only (kubectl port-forward or exec)\n"),
        ),
        "/config_dump" => json(&source.config_dump().await),
        "/traces" => match source.traces() {
            Some(body) => json(&body),
            None => text(
                StatusCode::NOT_FOUND,
                "this server records no traces\n".into(),
            ),
        },
        _ => text(
            StatusCode::NOT_FOUND,
            "endpoints: /live /ready /metrics /config_dump /traces\n".into(),
        ),
    }
}

/// A pretty-printed JSON response.
fn json(body: &serde_json::Value) -> Response<Full<Bytes>> {
    let body = serde_json::to_string_pretty(body).unwrap_or_else(|_| "{}".into());
    let mut r = text(StatusCode::OK, body + "\n");
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// A `text/plain` response.
pub fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Serves the admin endpoints over HTTP/1.1 until `stop`, which also closes open connections.
/// Run it apart from the data path's drain: probes and scrapes must answer until the end.
pub async fn serve<S: AdminSource>(listener: TcpListener, source: Arc<S>, stop: CancellationToken) {
    while let Some((stream, peer)) = crate::accept(&listener, stop.cancelled(), "admin").await {
        let source = source.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let source = source.clone();
                async move {
                    Ok::<_, Infallible>(
                        respond(&*source, req.method(), req.uri().path(), peer).await,
                    )
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    struct Fixed(Readiness, Registry);

    impl AdminSource for Fixed {
        fn readiness(&self) -> Readiness {
            self.0
        }
        fn registry(&self) -> &Registry {
            &self.1
        }
        async fn config_dump(&self) -> serde_json::Value {
            serde_json::json!({"x": 1})
        }
    }

    #[tokio::test]
    async fn answers_by_path_readiness_and_peer() {
        let status = async |s: &Fixed, method: Method, path: &str, peer: &str| {
            respond(s, &method, path, peer.parse().unwrap())
                .await
                .status()
        };
        let ready = Fixed(Readiness::Ready, Registry::default());
        let lo = "127.0.0.1:5000";
        let far = "10.244.0.7:5000";
        assert_eq!(
            status(&ready, Method::GET, "/ready", far).await,
            StatusCode::OK
        );
        assert_eq!(
            status(&ready, Method::POST, "/live", lo).await,
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            status(&ready, Method::GET, "/nope", lo).await,
            StatusCode::NOT_FOUND
        );
        for peer in ["127.0.0.1:5000", "[::1]:5000", "[::ffff:127.0.0.1]:5000"] {
            assert_eq!(
                status(&ready, Method::GET, "/config_dump", peer).await,
                StatusCode::OK,
                "{peer}"
            );
        }
        for peer in [far, "[fd00::7]:5000"] {
            assert_eq!(
                status(&ready, Method::GET, "/config_dump", peer).await,
                StatusCode::FORBIDDEN,
                "{peer}"
            );
        }
        for r in [Readiness::Draining, Readiness::Waiting("waiting")] {
            let s = Fixed(r, Registry::default());
            assert_eq!(
                status(&s, Method::GET, "/ready", lo).await,
                StatusCode::SERVICE_UNAVAILABLE
            );
            assert_eq!(status(&s, Method::GET, "/live", lo).await, StatusCode::OK);
            assert_eq!(
                status(&s, Method::GET, "/metrics", lo).await,
                StatusCode::OK
            );
        }
    }
}
