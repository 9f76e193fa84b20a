//! The Routes API over REST (camelCase JSON of `routes-openapi.yaml`), a watch endpoint
//! streaming NDJSON, `/healthz` and `/metrics` (the compatibility endpoint: the API alone).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use futures_util::StreamExt;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::auth::{Authenticator, Denied, Grant, Scope};
use crate::index::{Filter, Index};
use crate::metrics::Metrics;
use crate::watch::{self, Op, Reader};

#[derive(Clone)]
pub(crate) struct RestState {
    pub(crate) index: Index,
    pub(crate) metrics: Metrics,
    pub(crate) registry: Arc<Registry>,
    pub(crate) buffer: usize,
    pub(crate) stop: CancellationToken,
    pub(crate) auth: Authenticator,
}

impl RestState {
    /// `Err` is the response refusing the request.
    async fn authorize(&self, headers: &HeaderMap, filter: &Filter) -> Result<Grant, Response> {
        let header = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        self.auth
            .check(header, Scope::Rules(filter))
            .await
            .map_err(|d| {
                self.metrics.refused();
                let (code, challenge) = match &d {
                    Denied::Unauthenticated(_) => (StatusCode::UNAUTHORIZED, true),
                    Denied::Forbidden(_) => (StatusCode::FORBIDDEN, false),
                    Denied::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, false),
                };
                let body = Json(serde_json::json!({ "error": d.to_string() }));
                if challenge {
                    (code, [(header::WWW_AUTHENTICATE, "Bearer")], body).into_response()
                } else {
                    (code, body).into_response()
                }
            })
    }
}

/// The query parameters of `routes-openapi.yaml`; each is an optional filter.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RulesQuery {
    #[serde(default)]
    baseline_kind: String,
    #[serde(default)]
    baseline_namespace: String,
    #[serde(default)]
    baseline_name: String,
    #[serde(default)]
    routing_key: String,
    #[serde(default)]
    destination_sandbox_name: String,
}

impl From<RulesQuery> for Filter {
    fn from(q: RulesQuery) -> Self {
        Filter {
            kind: q.baseline_kind,
            namespace: q.baseline_namespace,
            name: q.baseline_name,
            routing_key: q.routing_key,
            sandbox: q.destination_sandbox_name,
        }
    }
}

pub(crate) fn router(state: RestState) -> Router {
    api()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .layer(axum::middleware::from_fn(spur_serving::http1::front_door))
        .with_state(state)
}

/// The Routes API's paths alone: the compatibility endpoint's router (no metrics, which would
/// say more about the server than its rules do).
pub(crate) fn routes_router(state: RestState) -> Router {
    api()
        .layer(axum::middleware::from_fn(spur_serving::http1::front_door))
        .with_state(state)
}

fn api() -> Router<RestState> {
    Router::new()
        .route("/api/v1/workloads/routing-rules", get(get_rules))
        // The path before the 2024 rename, still used by older clients.
        .route("/api/v1/workloads/routes", get(get_rules))
        .route("/api/v1/workloads/routing-rules/watch", get(watch_rules))
}

async fn get_rules(
    State(s): State<RestState>,
    headers: HeaderMap,
    Query(q): Query<RulesQuery>,
) -> Response {
    let filter = Filter::from(q);
    if let Err(refused) = s.authorize(&headers, &filter).await {
        return refused;
    }
    let snap = s.index.current();
    let rules: Vec<_> = snap.matching(&filter).map(|e| &e.spec).collect();
    Json(serde_json::json!({ "routingRules": rules })).into_response()
}

/// Newline-delimited JSON, one object per op: `{"op":"ADD","route":{…}}`, then `{"op":"SYNCED"}`,
/// then `ADD` / `REPLACE` / `REMOVE` — the gRPC watch contract, in JSON.
async fn watch_rules(
    State(s): State<RestState>,
    headers: HeaderMap,
    Query(q): Query<RulesQuery>,
) -> Response {
    let filter = Filter::from(q);
    let grant = match s.authorize(&headers, &filter).await {
        Ok(g) => g,
        Err(refused) => return refused,
    };
    let ops = watch::Watch::new(
        s.index.subscribe(),
        filter.clone(),
        s.buffer,
        s.metrics.clone(),
        s.stop.clone(),
    );
    let reader = Reader {
        auth: s.auth.clone(),
        authorization: headers
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes().to_vec()),
        filter,
        grant,
        metrics: s.metrics.clone(),
    };
    let lines = watch::guarded(ops, reader).map(|op| {
        let value = match op {
            Ok(Op::Add(e)) => serde_json::json!({"op": "ADD", "route": e.spec}),
            Ok(Op::Replace(e)) => serde_json::json!({"op": "REPLACE", "route": e.spec}),
            Ok(Op::Remove(e)) => serde_json::json!({"op": "REMOVE", "route": e.spec}),
            Ok(Op::Synced) => serde_json::json!({"op": "SYNCED"}),
            // The status line is long gone: the refusal is the last line, then the stream ends.
            Err(refused) => {
                serde_json::json!({"error": refused.to_string(), "code": refused.code()})
            }
        };
        let mut line = value.to_string();
        line.push('\n');
        Ok::<_, std::convert::Infallible>(Bytes::from(line))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(lines))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn healthz(State(s): State<RestState>) -> Response {
    let snap = s.index.current();
    let problems = s.index.problems();
    let status = if snap.version == 0 {
        "starting"
    } else if problems.is_empty() {
        "ok"
    } else {
        "degraded"
    };
    let code = if snap.version == 0 {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    // Probes need no token, so with authentication on /healthz says how many problems there
    // are, not what they are (file names, store errors): those are in the log.
    let problems = if s.auth.enabled() {
        serde_json::json!(problems.len())
    } else {
        serde_json::json!(problems.as_ref())
    };
    let body = serde_json::json!({
        "status": status,
        "tableVersion": snap.version,
        "rules": snap.rules.len(),
        "problems": problems,
    });
    (code, Json(body)).into_response()
}

async fn metrics(State(s): State<RestState>) -> Response {
    let mut out = String::new();
    match prometheus_client::encoding::text::encode(&mut out, &s.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            out,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}
