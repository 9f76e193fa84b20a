//! The HTTP/2 relay: serves a client's HTTP/2 connection with `h2` directly and relays every
//! stream over the pooled upstream HTTP/2 connection (`pool/mux.rs`) inside the client
//! connection's own task.
//!
//! hyper's server spawns a task per stream, and its client a task per request body, and each
//! hands frames through its own body types (`perf/results/flamegraphs.md`: about a tenth of an
//! h2c request was spawning and running those tasks). Here each stream is one future of the
//! connection's: it routes the request as the full path does (the same router, header edits,
//! capture and metrics), opens a stream upstream, and pumps the bodies both ways with the
//! peers' flow-control windows passed through (`pump.rs`): bytes received are released to
//! their sender only once the other side's window has taken them. Trailers go on as they came;
//! a reset from either side resets the other with the same reason. What the relay cannot
//! avoid is HPACK: `h2` decodes every header block into a `HeaderMap` and encodes it again, so
//! a header field costs its decode and encode on each side even when nothing changes it.

mod pump;

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use http::{Method, Request, Response, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

use super::headers;
use crate::capture::{self, Direction, Pending};
use crate::conn::ConnMeta;
use crate::io::{Activity, Coalesce, Tracked};
use crate::metrics::Outcome;
use crate::pool::{Upstream, Version};
use crate::router::Route;
use crate::{Error, Shared};
use pump::Pump;
use spur_runtime::Drain;

/// Windows and buffers of client connections: hyper's server defaults, which the full path
/// uses.
const STREAM_WINDOW: u32 = 1024 * 1024;
const CONN_WINDOW: u32 = 1024 * 1024;
const MAX_SEND_BUFFER: usize = 400 * 1024;

/// Serves one HTTP/2 client connection until it closes, drains or idles out.
pub(super) async fn serve<IO>(
    shared: Arc<Shared>,
    io: IO,
    meta: ConnMeta,
    drain: Drain,
) -> Result<(), &'static str>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let config = &shared.config;
    let activity = Activity::new();
    let mut builder = h2::server::Builder::new();
    builder
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .max_header_list_size(u32::try_from(config.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(1024)
        .max_pending_accept_reset_streams(100)
        .max_local_error_reset_streams(Some(1024));
    let io = Coalesce::new(Tracked::new(io, activity.clone()));
    let mut idle = pin!(activity.idle_for(config.idle_timeout));
    let mut drained = pin!(drain.signaled());
    let handshake = builder.handshake::<_, Bytes>(io);
    let mut conn = tokio::select! {
        res = handshake => res.map_err(|e| {
            tracing::debug!(client = %meta.client, error = %e, "HTTP/2 handshake failed");
            "client connection error"
        })?,
        () = idle.as_mut() => return Err("idle timeout"),
        () = drained.as_mut() => return Ok(()),
    };
    let mut exchanges = FuturesUnordered::new();
    let mut draining = false;
    poll_fn(|cx| {
        loop {
            // Streams first: what they queue is written by the connection's poll below.
            while let Poll::Ready(Some(())) = exchanges.poll_next_unpin(cx) {}
            match conn.poll_accept(cx) {
                Poll::Ready(Some(Ok((req, respond)))) => {
                    exchanges.push(exchange(&shared, &meta, req, respond));
                    continue;
                }
                Poll::Ready(Some(Err(e))) => {
                    tracing::debug!(client = %meta.client, error = %e, "client connection error");
                    return Poll::Ready(Err("client connection error"));
                }
                // Closed: after a GOAWAY, once every stream has ended.
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => {}
            }
            if !draining && drained.as_mut().poll(cx).is_ready() {
                // In-flight streams finish; new ones are refused with GOAWAY's last stream id.
                draining = true;
                conn.graceful_shutdown();
                continue;
            }
            if idle.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(if draining {
                    "idle timeout while draining"
                } else {
                    "idle timeout"
                }));
            }
            return Poll::Pending;
        }
    })
    .await
}

/// Relays one stream, and counts it in the request metrics once its response head is sent.
async fn exchange(
    shared: &Shared,
    meta: &ConnMeta,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let start = Instant::now();
    let outcome = relay(shared, meta, req, &mut respond).await;
    if let Some(outcome) = outcome {
        shared
            .metrics
            .request(outcome, start.elapsed().as_secs_f64());
    }
}

/// The parts of a routed request that the relay keeps.
struct Routed {
    upstream: Upstream,
    outcome: Outcome,
    head: bool,
    pending: Option<Arc<Pending>>,
}

/// Routes the request, opens its upstream stream and relays both bodies; the outcome is
/// `None` when no response head was sent (the client went away first).
async fn relay(
    shared: &Shared,
    meta: &ConnMeta,
    req: Request<RecvStream>,
    respond: &mut SendResponse<Bytes>,
) -> Option<Outcome> {
    let config = &shared.config;
    let uri_len = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if uri_len > config.max_uri_len {
        return reply_error(respond, StatusCode::URI_TOO_LONG, "request target too long");
    }
    if req.method() == Method::CONNECT {
        return reply_error(
            respond,
            StatusCode::NOT_IMPLEMENTED,
            "CONNECT over HTTP/2 is not supported",
        );
    }
    let (mut parts, mut body) = req.into_parts();
    let routed = route(shared, meta, &mut parts);
    let tap = routed.pending.as_deref();
    let end = body.is_end_stream();
    let (response, mut up_send) = match shared
        .pool
        .open_h2(&routed.upstream, Request::from_parts(parts, ()), end)
        .await
    {
        Ok(opened) => opened,
        Err(e) => {
            tracing::warn!(client = %meta.client, error = %e, "upstream request failed");
            let status = match e {
                Error::ConnectTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
                _ => StatusCode::BAD_GATEWAY,
            };
            if let Some(p) = tap {
                p.fail(status.as_u16(), e.to_string());
            }
            return reply_error(respond, status, "upstream unavailable");
        }
    };
    if end && let Some(p) = tap {
        p.end(Direction::Request, None);
    }
    let mut request = if end {
        Pump::finished(Direction::Request)
    } else {
        Pump::new(Direction::Request)
    };

    // Until the response head: the request body moves, and a reset of the client's stream
    // resets the upstream's.
    let mut response = pin!(response);
    let waited = poll_fn(|cx| {
        if let Poll::Ready(r) = respond.poll_reset(cx) {
            return Poll::Ready(Err(r.unwrap_or(Reason::CANCEL)));
        }
        if !request.is_done()
            && let Poll::Ready(Err(pump::Stop::FromFailed)) =
                request.poll(cx, &mut body, &mut up_send, tap)
        {
            // The client's request stream failed: the upstream's was reset with it.
            return Poll::Ready(Err(Reason::CANCEL));
        }
        response.as_mut().poll(cx).map(Ok)
    })
    .await;
    let resp = match waited {
        Err(reason) => {
            up_send.send_reset(reason);
            if let Some(p) = tap {
                p.end(
                    Direction::Response,
                    Some("client reset the stream before the response".into()),
                );
            }
            return None;
        }
        Ok(Err(e)) => {
            tracing::warn!(client = %meta.client, to = %routed.upstream, error = %e, "upstream request failed");
            if let Some(p) = tap {
                p.fail(502, format!("upstream {}: {e}", routed.upstream));
            }
            return reply_error(respond, StatusCode::BAD_GATEWAY, "upstream unavailable");
        }
        Ok(Ok(resp)) => resp,
    };

    let (mut parts, mut up_recv) = resp.into_parts();
    headers::prepare_response(&mut parts, Version::Http2, false);
    // A response to HEAD has no content (RFC 9110 9.3.2): a body an upstream sends anyway is
    // dropped (which resets only the upstream stream), its headers stay.
    let end = routed.head || up_recv.is_end_stream();
    if let Some(p) = tap {
        p.response(&parts);
        if end {
            p.end_response();
        }
    }
    let mut down_send = match respond.send_response(Response::from_parts(parts, ()), end) {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(client = %meta.client, error = %e, "client stream gone before the response");
            up_send.send_reset(pump::reason_of(&e));
            return None;
        }
    };
    if end {
        return Some(routed.outcome);
    }
    let mut response_body = Pump::new(Direction::Response);
    let done = poll_fn(|cx| {
        if !request.is_done() {
            // An upstream that answers before it has read the whole request may reset its
            // stream; the response (its end or its reset) still decides the exchange.
            let _ = request.poll(cx, &mut body, &mut up_send, tap);
        }
        response_body.poll(cx, &mut up_recv, &mut down_send, tap)
    })
    .await;
    if let Err(pump::Stop::ToReset(reason)) = done {
        // The client reset its stream (or went away): the upstream's is reset too.
        up_send.send_reset(reason);
    }
    Some(routed.outcome)
}

/// Routes a request and makes the full path's edits to its head (`super::forward`).
fn route(shared: &Shared, meta: &ConnMeta, parts: &mut http::request::Parts) -> Routed {
    let head = parts.method == Method::HEAD;
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
    headers::prepare_request(parts, meta, None, shared.config.forwarded_headers);
    let pending = match (tag, &shared.plugins.capture) {
        (Some(tag), Some(capture)) => {
            let destination = match &route {
                Route::Destination(d) => Some(d.location.to_string()),
                Route::Original => None,
            };
            let protocol = capture::protocol_of(parts, true);
            capture.sink.begin(tag, destination, protocol, parts)
        }
        _ => None,
    };
    Routed {
        upstream,
        outcome,
        head,
        pending,
    }
}

/// Answers the stream with the proxy's own error (`super::error`'s body); `None` if the client
/// is gone.
fn reply_error(
    respond: &mut SendResponse<Bytes>,
    status: StatusCode,
    reason: &'static str,
) -> Option<Outcome> {
    let resp = Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "text/plain")
        .body(())
        .ok()?;
    let mut send: SendStream<Bytes> = respond.send_response(resp, false).ok()?;
    // A few bytes: h2 holds them until the window allows, never more.
    let _ = send.send_data(Bytes::from(format!("spur: {reason}\n")), true);
    Some(Outcome::Error)
}
