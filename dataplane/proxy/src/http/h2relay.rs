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
//! a reset from either side resets the other with the same reason. A request the upstream
//! refused without processing it (REFUSED_STREAM, or above a GOAWAY's last stream id) is sent
//! again while nothing of its body has gone upstream, a few times at most (`retry.rs`); else
//! the client's stream is refused the same way, so the client can send it again. What the
//! relay cannot avoid is HPACK: `h2` decodes every header block into a `HeaderMap` and encodes it again, so
//! a header field costs its decode and encode on each side even when nothing changes it.

mod pump;
mod retry;

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
use crate::Shared;
use crate::capture::{Direction, Pending};
use crate::conn::ConnMeta;
use crate::io::{Activity, Coalesce, Tracked};
use crate::metrics::Outcome;
use crate::pool::Version;
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

/// Relays one stream: routes the request, opens its upstream stream and relays both bodies.
/// It is counted in the request metrics once its response head is sent (as on the full path:
/// the latency is the time to the response head).
async fn exchange(
    shared: &Shared,
    meta: &ConnMeta,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let start = Instant::now();
    let respond = &mut respond;
    let count = |outcome: Outcome| {
        shared
            .metrics
            .request(outcome, start.elapsed().as_secs_f64());
    };
    let config = &shared.config;
    let uri_len = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if uri_len > config.max_uri_len {
        return reply_error(
            respond,
            StatusCode::URI_TOO_LONG,
            "request target too long",
            count,
        );
    }
    if req.method() == Method::CONNECT {
        return reply_error(
            respond,
            StatusCode::NOT_IMPLEMENTED,
            "CONNECT over HTTP/2 is not supported",
            count,
        );
    }
    let (mut parts, body) = req.into_parts();
    let head = parts.method == Method::HEAD;
    let super::Routed {
        route,
        upstream,
        outcome,
        tag,
    } = super::route(shared, meta, &mut parts);
    headers::prepare_request(&mut parts, meta, None, config.forwarded_headers);
    let end = body.is_end_stream();
    // As hyper's client does (and so the full path): a request whose method gives content a
    // meaning (POST, PUT, PATCH, …) and that ends with its head says its length is 0, for an
    // upstream, or an HTTP/1.1 hop behind it, that wants a length on such requests.
    if end && !matches!(parts.method, Method::GET | Method::HEAD | Method::DELETE) {
        parts
            .headers
            .entry(http::header::CONTENT_LENGTH)
            .or_insert(http::HeaderValue::from_static("0"));
    }
    let pending = super::begin_capture(shared, tag, &route, &parts, true);
    let tap = pending.as_deref();
    let client_gone = || {
        if let Some(p) = tap {
            p.end(
                Direction::Response,
                Some("client reset the stream before the response".into()),
            );
        }
    };
    if end && let Some(p) = tap {
        p.end(Direction::Request, None);
    }
    let mut request = RequestSide {
        body: (!end).then_some(body),
        pump: Pump::new(Direction::Request),
        upstream_reset: None,
        unsent: None,
        head_pending: true,
    };
    let mut up_head = Request::from_parts(parts, ());
    let mut retries = 0;

    // One attempt per turn: the request goes upstream until the response head comes. It goes
    // again (to the same destination) only when the upstream did not process it and nothing of
    // its body is lost (`retry.rs`).
    let (resp, mut up_send, _in_flight) = loop {
        // h2 takes the head it sends: a copy is kept while the request may be sent again.
        let spare = (retries < retry::MAX_RETRIES).then(|| retry::copy_head(&up_head));
        // Connecting can take a while (up to the connect timeout): a client that resets its
        // stream meanwhile ends the exchange, and the connect with it.
        let opened = {
            let opening = shared.pool.open_h2(&upstream, up_head, end);
            let mut opening = pin!(opening);
            poll_fn(|cx| {
                if respond.poll_reset(cx).is_ready() {
                    return Poll::Ready(None);
                }
                opening.as_mut().poll(cx).map(Some)
            })
            .await
        };
        let (response, mut up_send, in_flight) = match opened {
            None => {
                client_gone();
                return;
            }
            Some(Ok(opened)) => opened,
            Some(Err(e)) => {
                // Nothing was sent on a stream that was not opened: the body, if any, is whole.
                if let (Some(cause), Some(next)) = (retry::not_opened(&e), spare) {
                    tracing::debug!(client = %meta.client, to = %upstream, error = %e, "upstream stream not opened; sending the request again");
                    shared.metrics.stream_retry(cause);
                    (up_head, retries) = (next, retries + 1);
                    continue;
                }
                tracing::warn!(client = %meta.client, error = %e, "upstream request failed");
                let status = super::upstream_status(&e);
                if let Some(p) = tap {
                    p.fail(status.as_u16(), e.to_string());
                }
                return reply_error(respond, status, "upstream unavailable", count);
            }
        };

        // Until the response head: the request body moves, and a reset of the client's stream
        // resets the upstream's.
        let mut response = pin!(response);
        let waited = poll_fn(|cx| {
            if let Poll::Ready(r) = respond.poll_reset(cx) {
                return Poll::Ready(Err(r.unwrap_or(Reason::CANCEL)));
            }
            if request.poll(cx, &mut up_send, tap) == Some(false) {
                // The client's request stream failed: the upstream's was reset with it.
                return Poll::Ready(Err(Reason::CANCEL));
            }
            response.as_mut().poll(cx).map(Ok)
        })
        .await;
        match waited {
            Err(reason) => {
                up_send.send_reset(reason);
                client_gone();
                return;
            }
            Ok(Ok(resp)) => {
                request.settle(tap);
                break (resp, up_send, in_flight);
            }
            Ok(Err(e)) => {
                let Some(cause) = retry::unprocessed(&e) else {
                    tracing::warn!(client = %meta.client, to = %upstream, error = %e, "upstream request failed");
                    if let Some(p) = tap {
                        p.fail(502, format!("upstream {upstream}: {e}"));
                    }
                    return reply_error(
                        respond,
                        StatusCode::BAD_GATEWAY,
                        "upstream unavailable",
                        count,
                    );
                };
                if let Some(next) = spare.filter(|_| request.replayable()) {
                    tracing::debug!(client = %meta.client, to = %upstream, error = %e, "upstream did not process the stream; sending the request again");
                    shared.metrics.stream_retry(cause);
                    request.resend();
                    (up_head, retries) = (next, retries + 1);
                    continue;
                }
                // Not sent again: some of the body went upstream and is not kept, or the tries
                // are spent. Nothing was processed, which the client learns as REFUSED_STREAM
                // (RFC 9113 §8.7): it may send the request again itself, body and all.
                tracing::warn!(client = %meta.client, to = %upstream, error = %e, retries, "upstream did not process the stream; refused to the client");
                request.settle(tap);
                if let Some(p) = tap {
                    p.end(
                        Direction::Response,
                        Some(format!(
                            "upstream {upstream} did not process the request ({e}); refused to the client"
                        )),
                    );
                }
                count(Outcome::Error);
                respond.send_reset(Reason::REFUSED_STREAM);
                return;
            }
        }
    };

    let (mut parts, up_recv) = resp.into_parts();
    headers::prepare_response(&mut parts, Version::Http2, false);
    super::date::add_if_missing(&mut parts.headers);
    // A response to HEAD has no content (RFC 9110 9.3.2): a body an upstream sends anyway is
    // dropped (which resets only the upstream stream), its headers stay.
    let end = head || up_recv.is_end_stream();
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
            return;
        }
    };
    count(outcome);
    // Dropped when it has ended (or at once: a HEAD response's body is not read).
    let mut up_recv = (!end).then_some(up_recv);
    let mut response_body = Pump::new(Direction::Response);
    // The response's body, and what is left of the request's: an upstream may answer before it
    // has read the whole request and go on reading it (HTTP/2 allows it), so the request body
    // is relayed to its end, unless the upstream resets its side.
    let done = poll_fn(|cx| {
        request.poll(cx, &mut up_send, tap);
        if let Some(recv) = up_recv.as_mut() {
            match response_body.poll(cx, recv, &mut down_send, tap) {
                Poll::Ready(Err(pump::Stop::ToReset(reason))) => return Poll::Ready(Err(reason)),
                Poll::Ready(_) => up_recv = None,
                Poll::Pending => return Poll::Pending,
            }
        }
        if request.body.is_some() {
            Poll::Pending
        } else {
            Poll::Ready(Ok(()))
        }
    })
    .await;
    match done {
        // The client reset its stream (or went away): the upstream's is reset too.
        Err(reason) => up_send.send_reset(reason),
        // The upstream reset the request's side after its complete response (NO_ERROR: "stop
        // sending"): the client is told the same.
        Ok(()) => {
            if let Some(reason) = request.upstream_reset {
                respond.send_reset(reason);
            }
        }
    }
}

/// The request body's side of an exchange.
struct RequestSide {
    /// The client's request body while it is being relayed; dropped when it ends or fails,
    /// which gives back to the client whatever of its window was not released.
    body: Option<RecvStream>,
    pump: Pump,
    /// The reason the upstream reset its stream while the request body was still coming.
    upstream_reset: Option<Reason>,
    /// The reason the upstream stream was reset before any of the body went to it, while the
    /// response head was awaited: the body is kept (not polled) until the exchange knows
    /// whether the request goes again.
    unsent: Option<Reason>,
    /// Whether the response head is still awaited (the request may still go again).
    head_pending: bool,
}

impl RequestSide {
    /// Moves the request body on; `Some(false)` once the client's request stream failed (the
    /// upstream's has been reset), `Some(true)` once the body is done otherwise, `None` while it
    /// goes on (or when it was already done, or is held for the request to go again).
    fn poll(
        &mut self,
        cx: &mut std::task::Context<'_>,
        up_send: &mut SendStream<Bytes>,
        tap: Option<&Pending>,
    ) -> Option<bool> {
        if self.unsent.is_some() {
            return None;
        }
        let body = self.body.as_mut()?;
        let Poll::Ready(res) = self.pump.poll(cx, body, up_send, tap) else {
            return None;
        };
        let stop = match res {
            Err(pump::Stop::Unsent(reason)) if self.head_pending => {
                self.unsent = Some(reason);
                return None;
            }
            Err(pump::Stop::Unsent(reason)) => {
                self.pump.settle_unsent(reason, tap);
                Err(pump::Stop::ToReset(reason))
            }
            res => res,
        };
        self.body = None;
        match stop {
            Ok(()) => Some(true),
            Err(pump::Stop::ToReset(reason) | pump::Stop::Unsent(reason)) => {
                self.upstream_reset = Some(reason);
                Some(true)
            }
            Err(pump::Stop::FromFailed) => Some(false),
        }
    }

    /// Whether the request can go upstream again as it came: nothing of its body was sent
    /// (what was read of it and not sent is held by the pump). A body of which a frame went
    /// upstream is not kept anywhere, so such a request is never sent again; keeping bodies
    /// for that would be a buffer per stream for a rare event.
    fn replayable(&self) -> bool {
        self.pump.nothing_sent()
    }

    /// The request goes again: its body, held since the reset, moves to the new stream.
    fn resend(&mut self) {
        self.unsent = None;
    }

    /// The request is not sent again (its response head came, or it is given up): a reset
    /// held for a possible retry is from now on the upstream's reset of the request's side.
    fn settle(&mut self, tap: Option<&Pending>) {
        self.head_pending = false;
        if let Some(reason) = self.unsent.take() {
            self.pump.settle_unsent(reason, tap);
            self.body = None;
            self.upstream_reset = Some(reason);
        }
    }
}

/// Answers the stream with the proxy's own error (`super::error_body`) and counts it; nothing
/// if the client is gone.
fn reply_error(
    respond: &mut SendResponse<Bytes>,
    status: StatusCode,
    reason: &'static str,
    count: impl FnOnce(Outcome),
) {
    let body = super::error_body(reason);
    let Ok(mut resp) = Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "text/plain")
        .header(http::header::CONTENT_LENGTH, body.len())
        .body(())
    else {
        return;
    };
    super::date::add_if_missing(resp.headers_mut());
    let Ok(mut send) = respond.send_response(resp, false) else {
        return;
    };
    count(Outcome::Error);
    // A few bytes: h2 holds them until the window allows, never more.
    let _ = send.send_data(body, true);
}
