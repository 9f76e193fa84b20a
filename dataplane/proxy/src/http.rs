//! HTTP/1.1 and HTTP/2 proxying: serve the client side with hyper, route each request, forward
//! it over a pooled upstream connection, stream bodies both ways (trailers included), and splice
//! upgraded connections (WebSocket, CONNECT) once the upstream has agreed.

mod date;
mod h2relay;
mod headers;
mod relay;

use std::convert::Infallible;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, Version as HttpVersion};
use http_body::Body as _;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

use crate::capture::{self, CaptureTag, Direction, TeeBody};
use crate::conn::ConnMeta;
use crate::detect::Protocol;
use crate::io::{Activity, Coalesce, Tracked};
use crate::metrics::Outcome;
use crate::pool::{Body, Upstream, Version};
use crate::router::Route;
use crate::{Error, Shared};
use spur_runtime::Drain;

/// Serves one client connection whose protocol was detected as HTTP/1 or HTTP/2, each with its
/// relay unless it is turned off (the HTTP/1 relay hands what it does not handle to
/// [`serve_hyper`]; the HTTP/2 relay handles every stream).
pub(crate) async fn serve<IO>(
    shared: Arc<Shared>,
    io: IO,
    meta: ConnMeta,
    drain: Drain,
) -> Result<(), &'static str>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if meta.protocol == Protocol::Http1 && shared.config.http1_relay {
        relay::serve(shared, io, meta, drain).await
    } else if meta.protocol == Protocol::Http2 && shared.config.http2_relay {
        h2relay::serve(shared, io, meta, drain).await
    } else {
        serve_hyper(shared, io, meta, drain).await
    }
}

/// Serves a connection with hyper's servers: everything HTTP/2, and every HTTP/1 exchange the
/// relay does not handle.
async fn serve_hyper<IO>(
    shared: Arc<Shared>,
    io: IO,
    meta: ConnMeta,
    drain: Drain,
) -> Result<(), &'static str>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let config = shared.config.clone();
    let activity = Activity::new();
    let protocol = meta.protocol;
    let meta = Arc::new(meta);
    let tunnels = drain.clone();
    let svc = service_fn(move |req| {
        let shared = shared.clone();
        let meta = meta.clone();
        let tunnels = tunnels.clone();
        async move { Ok::<_, Infallible>(handle(&shared, req, &meta, &tunnels).await) }
    });
    match protocol {
        Protocol::Http2 => {
            let mut builder = http2::Builder::new(TokioExecutor::new());
            builder
                .timer(TokioTimer::new())
                .max_header_list_size(u32::try_from(config.max_header_bytes).unwrap_or(u32::MAX))
                .max_concurrent_streams(1024)
                .max_pending_accept_reset_streams(100)
                .max_local_error_reset_streams(1024);
            let io = TokioIo::new(Coalesce::new(Tracked::new(io, activity.clone())));
            let conn = builder.serve_connection(io, svc);
            drive(
                conn,
                |c| c.graceful_shutdown(),
                &drain,
                &activity,
                config.idle_timeout,
            )
            .await
        }
        _ => {
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(config.header_read_timeout)
                .max_buf_size(config.max_header_bytes)
                .max_headers(config.max_headers)
                .keep_alive(true);
            let io = spur_h1guard::Guard::new(io, config.max_header_bytes);
            let io = TokioIo::new(Tracked::new(io, activity.clone()));
            let conn = builder.serve_connection(io, svc).with_upgrades();
            drive(
                conn,
                |c| c.graceful_shutdown(),
                &drain,
                &activity,
                config.idle_timeout,
            )
            .await
        }
    }
}

/// Runs a connection to completion; on drain asks it to finish gracefully (in-flight requests
/// complete, HTTP/2 sends GOAWAY), and cuts it if it stays idle too long.
async fn drive<C, E>(
    conn: C,
    graceful: impl FnOnce(Pin<&mut C>),
    drain: &Drain,
    activity: &Activity,
    idle: std::time::Duration,
) -> Result<(), &'static str>
where
    C: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let mut conn = pin!(conn);
    let res = tokio::select! {
        res = conn.as_mut() => res,
        () = drain.signaled() => {
            graceful(conn.as_mut());
            tokio::select! {
                res = conn.as_mut() => res,
                () = activity.idle_for(idle) => return Err("idle timeout while draining"),
            }
        }
        () = activity.idle_for(idle) => return Err("idle timeout"),
    };
    res.map_err(|e| {
        tracing::debug!(error = %e, "client connection error");
        "client connection error"
    })
}

async fn handle(
    shared: &Shared,
    req: Request<Incoming>,
    meta: &ConnMeta,
    tunnels: &Drain,
) -> Response<Body> {
    let start = Instant::now();
    let (resp, outcome) = forward(shared, req, meta, tunnels).await;
    shared
        .metrics
        .request(outcome, start.elapsed().as_secs_f64());
    resp
}

async fn forward(
    shared: &Shared,
    mut req: Request<Incoming>,
    meta: &ConnMeta,
    tunnels: &Drain,
) -> (Response<Body>, Outcome) {
    let config = &shared.config;
    let uri_len = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if uri_len > config.max_uri_len {
        return error(StatusCode::URI_TOO_LONG, "request target too long");
    }
    let version = match req.version() {
        HttpVersion::HTTP_2 => Version::Http2,
        HttpVersion::HTTP_10 | HttpVersion::HTTP_11 => Version::Http1,
        _ => {
            return error(
                StatusCode::HTTP_VERSION_NOT_SUPPORTED,
                "unsupported HTTP version",
            );
        }
    };
    if version == Version::Http1
        && let Err(reason) = spur_h1guard::check_host(&req)
    {
        return reject(StatusCode::BAD_REQUEST, reason);
    }
    let connect = req.method() == Method::CONNECT;
    if connect && version == Version::Http2 {
        return error(
            StatusCode::NOT_IMPLEMENTED,
            "CONNECT over HTTP/2 is not supported",
        );
    }
    let upgrade = headers::upgrade_protocol(req.headers()).filter(|_| version == Version::Http1);
    let client_upgrade = (connect || upgrade.is_some()).then(|| hyper::upgrade::on(&mut req));

    let (mut parts, body) = req.into_parts();
    let head = parts.method == Method::HEAD;
    let Routed {
        route,
        upstream,
        outcome,
        tag,
    } = route(shared, meta, &mut parts);
    headers::prepare_request(&mut parts, meta, upgrade.as_ref(), config.forwarded_headers);
    if let Err(status) = headers::normalize_target(&mut parts, version) {
        return error(status, "invalid request target");
    }
    let pending = begin_capture(shared, tag, &route, &parts, version == Version::Http2);
    let body = match &pending {
        Some(p) => TeeBody::new(body, p.clone(), Direction::Request).boxed(),
        None => body.boxed(),
    };
    let upstream_req = Request::from_parts(parts, body);

    let mut resp = match shared.pool.send(&upstream, version, upstream_req).await {
        Ok(r) => r,
        // A request body the client framed wrongly (a chunk size that is not hex or
        // overflows) fails while it is forwarded: the client gets a 400 and its connection
        // is closed, not a 502 that blames the upstream.
        Err(e) if client_body_failed(&e) => {
            tracing::debug!(client = %meta.client, error = %e, "invalid request body");
            if let Some(p) = &pending {
                p.fail(400, "invalid request body");
            }
            return reject(StatusCode::BAD_REQUEST, "invalid request body");
        }
        Err(e) => {
            tracing::warn!(client = %meta.client, error = %e, "upstream request failed");
            let status = upstream_status(&e);
            if let Some(p) = &pending {
                p.fail(status.as_u16(), e.to_string());
            }
            return error(status, "upstream unavailable");
        }
    };

    // A 101 to a request that offered no upgrade (or offered only h2c, which is never passed
    // on) would hand the connection to a protocol the proxy does not read: refused.
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS && client_upgrade.is_none() {
        tracing::warn!(client = %meta.client, to = %upstream, "upstream switched protocols without an upgrade request");
        if let Some(p) = &pending {
            p.fail(502, "101 without an upgrade request");
        }
        return error(
            StatusCode::BAD_GATEWAY,
            "upstream switched protocols unasked",
        );
    }
    let switched =
        resp.status() == StatusCode::SWITCHING_PROTOCOLS || (connect && resp.status().is_success());
    if let (Some(client_upgrade), true) = (client_upgrade, switched) {
        let server_upgrade = hyper::upgrade::on(&mut resp);
        let idle = config.idle_timeout;
        let pending = pending.clone();
        tunnels.spawn(async move {
            match tokio::try_join!(client_upgrade, server_upgrade) {
                Ok((client, server)) => {
                    let res =
                        crate::io::splice(TokioIo::new(client), TokioIo::new(server), idle).await;
                    if let Some(p) = pending {
                        p.upgraded(res);
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "upgrade failed");
                    if let Some(p) = pending {
                        p.upgraded(Err("upgrade failed"));
                    }
                }
            }
        });
    }
    let keep_upgrade = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    let (mut parts, mut body) = resp.into_parts();
    headers::prepare_response(&mut parts, version, keep_upgrade);
    if head && !body.is_end_stream() {
        // A response to HEAD has no content (RFC 9110 9.3.2), yet some upstreams send one
        // over HTTP/2: it is dropped here (which resets only the upstream stream), not sent on,
        // which would make the client's stream fail. Its headers, Content-Length included,
        // stay.
        body = Empty::new().map_err(|never| match never {}).boxed();
    }
    let body = match pending {
        Some(p) => {
            p.response(&parts);
            if body.is_end_stream() {
                p.end_response();
            }
            TeeBody::new(body, p, Direction::Response).boxed()
        }
        None => body,
    };
    (Response::from_parts(parts, body), outcome)
}

/// A request's routing decision: where it goes, how it is counted, and whether it is captured.
struct Routed {
    route: Route,
    upstream: Upstream,
    outcome: Outcome,
    tag: Option<CaptureTag>,
}

/// Routes a request (the router may rewrite its head), records it if its trace is sampled, and
/// decides whether it is captured: the same for both HTTP paths (`forward`, `h2relay`).
fn route(shared: &Shared, meta: &ConnMeta, parts: &mut http::request::Parts) -> Routed {
    let route = shared.router.route_http(meta, parts);
    if let Some(trace) = &shared.plugins.trace {
        trace.record(meta, &route, &parts.headers, parts.uri.path());
    }
    let tag = shared.plugins.capture.as_ref().and_then(|c| {
        c.select
            .select(meta, &route, &parts.headers, parts.uri.query())
    });
    let (upstream, outcome) = match &route {
        Route::Original => (Upstream::Original(meta.original_dst), Outcome::Baseline),
        Route::Destination(d) => (Upstream::Sandbox(d.location.clone()), Outcome::Sandbox),
    };
    if let Route::Destination(d) = &route {
        tracing::debug!(client = %meta.client, key = %d.routing_key, sandbox = %d.sandbox, to = %upstream, "routed to sandbox");
    }
    Routed {
        route,
        upstream,
        outcome,
        tag,
    }
}

/// Starts capturing the exchange if [`route()`] selected it (its `tag`), once its head is final (as
/// forwarded).
fn begin_capture(
    shared: &Shared,
    tag: Option<CaptureTag>,
    route: &Route,
    parts: &http::request::Parts,
    http2: bool,
) -> Option<Arc<capture::Pending>> {
    let (tag, capture) = (tag?, shared.plugins.capture.as_ref()?);
    let destination = match route {
        Route::Destination(d) => Some(d.location.to_string()),
        Route::Original => None,
    };
    let protocol = capture::protocol_of(parts, http2);
    capture.sink.begin(tag, destination, protocol, parts)
}

/// Whether forwarding failed because the client's own request body failed: hyper reports a
/// body stream's error as a user error whose source is that (the client side's) error.
fn client_body_failed(e: &Error) -> bool {
    match e {
        Error::Upstream { source, .. } => {
            source.is_user()
                && std::error::Error::source(source).is_some_and(|s| s.is::<hyper::Error>())
        }
        _ => false,
    }
}

/// An error response after which the connection closes (HTTP/1: `Connection: close`; hyper
/// closes once it is written): what follows a malformed request on the same connection cannot
/// be trusted to be framed the way the client meant.
fn reject(status: StatusCode, reason: &'static str) -> (Response<Body>, Outcome) {
    let (mut resp, outcome) = error(status, reason);
    resp.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    (resp, outcome)
}

/// The status answering a request that could not be sent upstream: 504 when connecting timed
/// out, else 502.
fn upstream_status(e: &Error) -> StatusCode {
    match e {
        Error::ConnectTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::BAD_GATEWAY,
    }
}

/// The body of the proxy's own error responses.
fn error_body(reason: &str) -> Bytes {
    Bytes::from(format!("spur: {reason}\n"))
}

fn error(status: StatusCode, reason: &'static str) -> (Response<Body>, Outcome) {
    let body = Full::new(error_body(reason))
        .map_err(|never| match never {})
        .boxed();
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain"),
    );
    (resp, Outcome::Error)
}
