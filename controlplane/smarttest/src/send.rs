//! Sending one prepared request, on a connection of its own, and recording the answer as a
//! captured exchange (proto/traffic.proto), so the traffic diff engine compares it as it compares
//! what sidecars capture. A failure to connect, a timeout or a broken answer is the exchange's
//! `error`, never a panic or a lost step.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use spur_proto::traffic::{Body, Exchange, Header, Protocol};
use tokio::net::TcpStream;

use crate::spec::PreparedRequest;

/// Bytes of a response body kept for the diff and the checks; the rest is counted, not kept.
pub const MAX_KEPT: usize = 256 * 1024;
/// Bytes of a response body read at all: past this the answer is cut (and marked truncated).
pub const MAX_READ: usize = 16 * 1024 * 1024;

/// Sends request `r`, carrying routing key `key` (`None`: none, the baseline) and, when the run
/// captures its calls, the `baggage` member `marker` ([`crate::calls::MARKER`]), and returns
/// what came back within `timeout`.
pub async fn send(
    r: &PreparedRequest,
    timeout: Duration,
    key: Option<&str>,
    marker: Option<&str>,
) -> Exchange {
    let started_wall = unix_micros_now();
    let mut headers = HeaderMap::new();
    for (n, v) in &r.headers {
        headers.append(n.clone(), v.clone());
    }
    route(&mut headers, key, marker);
    let mut x = Exchange {
        protocol: i32::from(if r.grpc {
            Protocol::Grpc
        } else {
            Protocol::Http1
        }),
        method: r.method.to_string(),
        path: r.path_and_query.clone(),
        authority: r.authority.clone(),
        start_unix_micros: started_wall,
        routing_key: key.unwrap_or_default().to_owned(),
        request_headers: to_headers(&headers),
        request_body: Some(Body {
            size: r.body.len() as u64,
            data: r.body.iter().copied().take(MAX_KEPT).collect(),
            truncated: r.body.len() > MAX_KEPT,
        }),
        ..Exchange::default()
    };
    let started = Instant::now();
    let outcome = tokio::time::timeout(timeout, exchange(r, headers, &mut x, started)).await;
    x.duration_micros = micros(started.elapsed());
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => x.error = e,
        Err(_) => {
            x.error = format!("no whole answer within {} s", timeout.as_secs());
        }
    }
    x
}

/// Writes routing key `key` and the run's `marker` into `headers` as a request carries them
/// (`baggage`). A test may not set `baggage` itself (spec.rs): the marker is its only member
/// until the key's are written in front of it.
pub(crate) fn route(headers: &mut HeaderMap, key: Option<&str>, marker: Option<&str>) {
    if let Some(marker) = marker
        && let Ok(v) = http::HeaderValue::from_str(&format!("{}={marker}", crate::calls::MARKER))
    {
        headers.insert(http::header::HeaderName::from_static("baggage"), v);
    }
    if let Some(key) = key {
        spur_routing::inject::inject_key(headers, key, &[]);
    }
}

/// The wall clock, as an exchange's `start_unix_micros`.
pub(crate) fn unix_micros_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn to_headers(h: &HeaderMap) -> Vec<Header> {
    h.iter()
        .map(|(n, v)| Header {
            name: n.as_str().to_owned(),
            value: v.as_bytes().to_vec(),
        })
        .collect()
}

async fn exchange(
    r: &PreparedRequest,
    headers: HeaderMap,
    x: &mut Exchange,
    started: Instant,
) -> Result<(), String> {
    let tcp = TcpStream::connect((r.host.as_str(), r.port))
        .await
        .map_err(|e| format!("connecting to {}:{}: {e}", r.host, r.port))?;
    // Small requests, one each: no reason to wait for Nagle.
    let _ = tcp.set_nodelay(true);
    let io = TokioIo::new(tcp);
    // HTTP/1.1 in origin form with a Host header (what every server and sidecar expects);
    // HTTP/2 takes the authority from the URI (`:authority`).
    let uri = if r.grpc {
        format!("http://{}{}", r.authority, r.path_and_query)
    } else {
        r.path_and_query.clone()
    };
    let mut builder = Request::builder().method(r.method.clone()).uri(uri);
    if let Some(h) = builder.headers_mut() {
        *h = headers;
        if !r.grpc {
            let host = http::HeaderValue::from_str(&r.authority)
                .map_err(|e| format!("the Host header {:?}: {e}", r.authority))?;
            h.insert(http::header::HOST, host);
        }
    }
    let request = builder
        .body(Full::new(Bytes::from(r.body.clone())))
        .map_err(|e| format!("building the request: {e}"))?;
    let response = if r.grpc {
        let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .map_err(|e| format!("HTTP/2 handshake with {}: {e}", r.authority))?;
        tokio::spawn(conn);
        send.send_request(request).await
    } else {
        let (mut send, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| format!("HTTP/1.1 handshake with {}: {e}", r.authority))?;
        tokio::spawn(conn);
        send.send_request(request).await
    }
    .map_err(|e| format!("sending the request: {e}"))?;
    x.response_micros = micros(started.elapsed());
    x.status = u32::from(response.status().as_u16());
    x.response_headers = to_headers(response.headers());
    let mut body = response.into_body();
    let (mut kept, mut size, mut cut) = (Vec::new(), 0usize, false);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the answer's body: {e}"))?;
        match frame.into_data() {
            Ok(data) => {
                size += data.len();
                let room = MAX_KEPT.saturating_sub(kept.len());
                kept.extend_from_slice(&data[..data.len().min(room)]);
                if size > MAX_READ {
                    cut = true;
                    break;
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    x.response_trailers = to_headers(&trailers);
                }
            }
        }
    }
    x.response_body = Some(Body {
        size: size as u64,
        truncated: cut || size > kept.len(),
        data: kept,
    });
    Ok(())
}
