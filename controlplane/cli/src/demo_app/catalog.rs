//! `GET /catalog`: the demo shop's catalog, answered the way a service of a HotROD-like chain
//! answers: the items (SKU, name, price) and, as real services' answers do, what no test can
//! predict: a request id and the time it was served. A smart test learns those as noise from the
//! baseline's two answers (docs/smart-tests.md). With `--call`, the catalog is the upstream's,
//! nested as `catalog` (a frontend in front of the catalog service); with `--drop-field F` every
//! item lacks `F`, as a build that lost a field would.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::{Value, json};

use super::{App, call_upstream, reply};

/// `/catalog`'s answer: this app's items, or its upstream's catalog with `--call`.
pub(super) async fn respond(req: &Request<Incoming>, app: &App) -> Response<Full<Bytes>> {
    let mut doc = json!({
        "service": app.name,
        "requestId": request_id(),
        "servedAt": served_at(),
    });
    let status = match &app.upstream {
        None => {
            doc["items"] = items(app.drop_field.as_deref());
            StatusCode::OK
        }
        Some(upstream) => match call_upstream(upstream, &app.propagate, req).await {
            Ok(answer) => {
                doc["catalog"] = answer;
                StatusCode::OK
            }
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "upstream catalog call failed");
                doc["error"] = json!(format!("{e:#}"));
                StatusCode::BAD_GATEWAY
            }
        },
    };
    let mut body = doc.to_string();
    body.push('\n');
    reply(status, "application/json", body)
}

/// The catalog's items (the gRPC `Price` method's prices), without `drop`.
fn items(drop: Option<&str>) -> Value {
    spur_demo_apps::PRICES
        .iter()
        .map(|(sku, name, cents)| {
            let mut item = json!({"sku": sku, "name": name, "price": *cents as f64 / 100.0});
            if let (Some(field), Some(map)) = (drop, item.as_object_mut()) {
                map.remove(field);
            }
            item
        })
        .collect()
}

/// A fresh id per answer: the process's start time mixed with a counter.
fn request_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!(
        "{:016x}",
        nanos.rotate_left(17) ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    )
}

/// Seconds since the epoch, with nanoseconds.
fn served_at() -> String {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}.{:09}", d.as_secs(), d.subsec_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_lose_the_dropped_field_only() {
        let all = items(None);
        assert_eq!(all[0], json!({"sku": "A1", "name": "apple", "price": 3.0}));
        let dropped = items(Some("price"));
        assert!(
            dropped
                .as_array()
                .unwrap()
                .iter()
                .all(|i| i.get("price").is_none())
        );
        assert_eq!(dropped[2]["name"], "cheese");
        assert_ne!(request_id(), request_id());
    }
}
