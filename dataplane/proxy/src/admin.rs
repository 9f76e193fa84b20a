//! The admin server: `/live`, `/ready`, `/metrics` (Prometheus text), `/config_dump` and, where
//! the proxy records sampled traces, `/traces` (answered by `spur_runtime::admin`, shared with
//! the L4 gateway).
//!
//! `/config_dump` lists every rule in force, routing keys included, so it is served only to
//! clients on loopback (the pod itself, `kubectl port-forward`, `kubectl exec`); the port is
//! reachable from the network for the kubelet's probes and metrics scrapes, which reveal no rule.
//! Unlike the gateway's admin server, this one holds requests to the front door's rules (Host
//! header, bare LF line endings).

use std::convert::Infallible;
use std::sync::Arc;

use http::{StatusCode, header};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use spur_routing::SharedTable;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use spur_runtime::Drain;
use spur_runtime::admin::{AdminSource, Readiness, respond, text};

/// What the admin endpoints report on.
#[derive(Clone)]
pub struct AdminState {
    pub registry: Arc<Registry>,
    pub table: SharedTable,
    /// Draining flips `/ready` to 503 so load balancers stop sending new work.
    pub drain: Drain,
    /// When true, `/ready` stays 503 until a first routing table has been published.
    pub requires_table: bool,
    /// Extra identity shown at the top of `/config_dump` (e.g. the sidecar's baseline).
    pub identity: serde_json::Value,
    /// The body of `/traces` (the hops of sampled traces), when this proxy records them.
    pub traces: Option<Arc<dyn Fn() -> serde_json::Value + Send + Sync>>,
}

impl AdminState {
    pub fn is_ready(&self) -> bool {
        !self.drain.is_draining() && (!self.requires_table || self.table.load().version > 0)
    }

    fn dump(&self) -> serde_json::Value {
        let snapshot = self.table.load_full();
        let rules: Vec<_> = snapshot.table.rules().iter().map(|r| r.to_spec()).collect();
        serde_json::json!({
            "identity": self.identity,
            "tableVersion": snapshot.version,
            // When this sidecar started routing by that version (Unix milliseconds).
            "tablePublishedUnixMillis": snapshot.published.map(|t| {
                t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
            }),
            "routingRules": rules,
        })
    }
}

impl AdminSource for AdminState {
    fn readiness(&self) -> Readiness {
        if self.is_ready() {
            Readiness::Ready
        } else if self.drain.is_draining() {
            Readiness::Draining
        } else {
            Readiness::Waiting("waiting for a routing table")
        }
    }

    fn registry(&self) -> &Registry {
        &self.registry
    }

    async fn config_dump(&self) -> serde_json::Value {
        self.dump()
    }

    fn traces(&self) -> Option<serde_json::Value> {
        let traces = self.traces.as_ref()?;
        let mut body = traces();
        if let Some(map) = body.as_object_mut() {
            map.insert("identity".into(), self.identity.clone());
        }
        Some(body)
    }
}

/// Serves the admin endpoints until `stop` is cancelled. The admin server outlives the data-plane
/// drain on purpose: probes and metrics must keep answering while connections finish.
pub async fn serve_admin(listener: TcpListener, state: AdminState, stop: CancellationToken) {
    while let Some((stream, peer)) =
        spur_runtime::accept(&listener, stop.cancelled(), "admin").await
    {
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let state = state.clone();
                async move {
                    if let Err(reason) = spur_h1guard::check_host(&req) {
                        // The front door's Host rules hold here too; the connection closes.
                        let mut r = text(StatusCode::BAD_REQUEST, format!("{reason}\n"));
                        r.headers_mut().insert(
                            header::CONNECTION,
                            header::HeaderValue::from_static("close"),
                        );
                        return Ok::<_, Infallible>(r);
                    }
                    Ok::<_, Infallible>(respond(&state, req.method(), req.uri().path(), peer).await)
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10));
            // Bare LF line endings are refused here as on the data path.
            let io = spur_h1guard::Guard::new(stream, 64 * 1024);
            if let Err(e) = builder.serve_connection(TokioIo::new(io), svc).await {
                tracing::debug!(error = %e, "admin connection error");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn config_dump_only_for_loopback_peers() {
        let state = AdminState {
            registry: Arc::new(Registry::default()),
            table: SharedTable::default(),
            drain: Drain::new(),
            requires_table: false,
            identity: serde_json::json!({"role": "test"}),
            traces: Some(Arc::new(|| serde_json::json!({"hops": []}))),
        };
        let status = async |path: &str, peer: &str| {
            respond(&state, &http::Method::GET, path, peer.parse().unwrap())
                .await
                .status()
        };
        assert_eq!(
            status("/config_dump", "127.0.0.1:5000").await,
            StatusCode::OK
        );
        assert_eq!(status("/config_dump", "[::1]:5000").await, StatusCode::OK);
        assert_eq!(
            status("/config_dump", "[::ffff:127.0.0.1]:5000").await,
            StatusCode::OK
        );
        assert_eq!(
            status("/config_dump", "10.244.0.7:5000").await,
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            status("/config_dump", "[fd00::7]:5000").await,
            StatusCode::FORBIDDEN
        );
        // /traces holds routing keys too.
        assert_eq!(status("/traces", "127.0.0.1:5000").await, StatusCode::OK);
        assert_eq!(
            status("/traces", "10.244.0.7:5000").await,
            StatusCode::FORBIDDEN
        );
        let body = respond(
            &state,
            &http::Method::GET,
            "/traces",
            "[::1]:1".parse().unwrap(),
        )
        .await
        .into_body();
        use http_body_util::BodyExt as _;
        let body = body.collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["identity"]["role"], "test", "{body}");
        let without = AdminState {
            traces: None,
            ..state.clone()
        };
        assert_eq!(
            respond(
                &without,
                &http::Method::GET,
                "/traces",
                "[::1]:1".parse().unwrap()
            )
            .await
            .status(),
            StatusCode::NOT_FOUND
        );
        for path in ["/live", "/ready", "/metrics"] {
            assert_eq!(
                status(path, "10.244.0.7:5000").await,
                StatusCode::OK,
                "{path}"
            );
        }
    }
}
