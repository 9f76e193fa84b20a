//! The HTTP/1.1 relay: forwards plain kept-alive exchanges by copying request and response heads
//! as read, with the proxy's header edits spliced in, over a pooled upstream socket, all within
//! the client connection's own task.
//!
//! hyper parses every head into a `HeaderMap`, encodes it again on the other side, and runs each
//! upstream connection in a task of its own; for a proxy hop that changes three headers, that was
//! most of a request's instructions (`perf/results/profile-h1-2026-11-25.md`). The relay reads a
//! head with `httparse` only, decides whether it can forward it byte for byte, and otherwise hands
//! the connection, with every byte read so far, to the hyper path ([`super::serve_hyper`]), which
//! serves it to the end. What goes to hyper: bodies framed by `Transfer-Encoding` or larger than
//! [`MAX_RELAY_BODY`], upgrades and CONNECT, `Expect`, HTTP/1.0, targets not in plain origin form,
//! `Connection` options other than `keep-alive`/`close`, heads the strict reading refuses (bare
//! LF, obs-fold, invalid bytes, too big, too many fields, a bad `Host`), routing rewrites the
//! router cannot express here. So every refusal and its status code stay hyper's, answered once.
//!
//! Responses are relayed the same way: the status line and fields are re-emitted without
//! hop-by-hop fields, bodies are forwarded as they come, following their framing (RFC 9112 §6.3)
//! so the upstream socket can be reused, and a response framed ambiguously is answered 502.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, timeout};

use crate::conn::ConnMeta;
use crate::io::Rewind;
use crate::metrics::Outcome;
use crate::pool::Upstream;
use crate::router::{RawRoute, Route};
use crate::{Error, Shared};
use spur_h1guard::valid_authority;
use spur_runtime::Drain;

/// Request bodies up to this size are relayed: written upstream after the head, then the
/// response is read. A larger body goes to hyper, which streams both directions at once, so an
/// upstream that answers before reading a large upload cannot stall the exchange.
const MAX_RELAY_BODY: u64 = 64 * 1024;
/// Header fields read per head; a head with more goes to hyper (which applies `maxHeaders`).
const MAX_FIELDS: usize = 128;
/// Body bytes copied behind a head into one write; larger bodies are written on their own.
const COALESCE: usize = 16 * 1024;
/// Read size for response bodies.
const BODY_READ: usize = 32 * 1024;

/// Serves one HTTP/1 connection until it closes, or hands it to hyper.
pub(super) async fn serve<IO>(
    shared: Arc<Shared>,
    mut io: IO,
    meta: ConnMeta,
    drain: Drain,
) -> Result<(), &'static str>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut conn = Conn {
        shared: &shared,
        meta: &meta,
        drain: &drain,
        buf: BytesMut::with_capacity(8 * 1024),
        out: Vec::with_capacity(1024),
        ubuf: BytesMut::with_capacity(8 * 1024),
        started: None,
    };
    {
        let mut drained = std::pin::pin!(drain.signaled());
        loop {
            let head = match conn.read_head(&mut io, drained.as_mut()).await {
                Ok(Some(head)) => head,
                Ok(None) => return Ok(()),
                Err(Stop::HandOver) => break,
                Err(Stop::Close(reason)) => return Err(reason),
            };
            match conn.exchange(&mut io, head).await {
                Ok(Next::KeepAlive) if !drain.is_draining() => {}
                Ok(_) => return Ok(()),
                Err(Stop::HandOver) => break,
                Err(Stop::Close(reason)) => return Err(reason),
            }
        }
    }
    shared.metrics.handovers.inc();
    let Conn { buf, .. } = conn;
    let io = Rewind::new(buf.freeze(), io);
    super::serve_hyper(shared, io, meta, drain).await
}

enum Stop {
    /// Serve the rest of the connection with hyper, from the bytes in `buf` on.
    HandOver,
    /// Close the connection (the reason is logged at debug level).
    Close(&'static str),
}

enum Next {
    KeepAlive,
    Close,
}

/// What `read_head` found: a complete head of `len` bytes at the start of `buf`.
struct Head {
    len: usize,
}

struct Conn<'a> {
    shared: &'a Shared,
    meta: &'a ConnMeta,
    drain: &'a Drain,
    /// Bytes read from the client, not yet forwarded.
    buf: BytesMut,
    /// Heads (and small bodies) being assembled for one write.
    out: Vec<u8>,
    /// Bytes read from the upstream, not yet forwarded.
    ubuf: BytesMut,
    /// When the current exchange started, until it is counted in the metrics ([`Conn::record`]).
    started: Option<Instant>,
}

/// What the relay does with a request once its head has been read.
struct Plan {
    upstream: Upstream,
    outcome: Outcome,
    body: u64,
    head: bool,
    close: bool,
    /// Safe to send again on a new connection if a reused one turns out closed.
    idempotent: bool,
}

impl Conn<'_> {
    /// Reads until `buf` starts with a complete head. `None`: the client closed (or went idle, or
    /// the proxy is draining) between requests.
    async fn read_head<IO>(
        &mut self,
        io: &mut IO,
        mut drained: std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<Option<Head>, Stop>
    where
        IO: AsyncRead + Unpin,
    {
        let config = &self.shared.config;
        let mut scanned = 0;
        let mut bare_lf = false;
        let mut deadline = None;
        loop {
            let end = head_end(&self.buf, &mut scanned, &mut bare_lf);
            if bare_lf {
                // hyper's reading of such a head is made strict by `Guard`: let it refuse.
                return Err(Stop::HandOver);
            }
            if let Some(len) = end {
                return Ok(Some(Head { len }));
            }
            if self.buf.len() >= config.max_header_bytes {
                return Err(Stop::HandOver);
            }
            if self.buf.capacity() - self.buf.len() < 1024 {
                self.buf.reserve(8 * 1024);
            }
            let read = if self.buf.is_empty() {
                tokio::select! {
                    biased;
                    r = timeout(config.idle_timeout, io.read_buf(&mut self.buf)) => r,
                    () = drained.as_mut() => return Ok(None),
                }
            } else {
                // A head that has started must be complete within `headerReadTimeout` of its
                // first byte (slowloris guard), as on the hyper path.
                let d =
                    *deadline.get_or_insert_with(|| Instant::now() + config.header_read_timeout);
                tokio::time::timeout_at(d, io.read_buf(&mut self.buf)).await
            };
            match read {
                Ok(Ok(0)) if self.buf.is_empty() => return Ok(None),
                Ok(Ok(0)) => return Err(Stop::Close("client closed mid-head")),
                Ok(Ok(_)) => {}
                Ok(Err(_)) => return Err(Stop::Close("client read error")),
                Err(_) if self.buf.is_empty() => return Err(Stop::Close("idle timeout")),
                Err(_) => return Err(Stop::Close("request head timeout")),
            }
        }
    }

    /// Forwards the request whose head starts `buf`, and its response.
    async fn exchange<IO>(&mut self, io: &mut IO, head: Head) -> Result<Next, Stop>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let start = Instant::now();
        let plan = self.plan(head.len)?;
        self.buf.advance(head.len);
        self.started = Some(start);
        // Counted already unless it failed before a response head was ready.
        match self.forward(io, &plan).await {
            Ok((next, outcome)) => {
                self.record(outcome);
                Ok(next)
            }
            Err(e) => {
                self.record(Outcome::Error);
                Err(e)
            }
        }
    }

    /// Counts the current exchange once, when its response head is ready to be written: the
    /// request-duration metric ends there and, as on the hyper path, the count never lags the
    /// response a client has seen.
    fn record(&mut self, outcome: Outcome) {
        if let Some(start) = self.started.take() {
            self.shared
                .metrics
                .request(outcome, start.elapsed().as_secs_f64());
        }
    }

    /// Reads the head at the start of `buf`, decides whether the relay forwards it, routes it,
    /// and writes the upstream head into `out`.
    fn plan(&mut self, len: usize) -> Result<Plan, Stop> {
        let shared = self.shared;
        let config = &shared.config;
        let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
        let mut req = httparse::Request::new(&mut fields);
        match req.parse(&self.buf[..len]) {
            Ok(httparse::Status::Complete(n)) if n == len => {}
            _ => return Err(Stop::HandOver),
        }
        let (Some(method), Some(target), Some(1)) = (req.method, req.path, req.version) else {
            return Err(Stop::HandOver);
        };
        if req.headers.len() > config.max_headers
            || target.len() > config.max_uri_len
            || method == "CONNECT"
            || !origin_form(target.as_bytes())
        {
            return Err(Stop::HandOver);
        }

        let mut hosts = 0;
        let mut body = None;
        let mut close = false;
        let mut te_trailers = false;
        let mut xff = None;
        let mut xfp = false;
        let mut carriers = HeaderMap::new();
        let mut kinds = [Field::Other; MAX_FIELDS];
        for (i, (f, kind)) in req.headers.iter().zip(kinds.iter_mut()).enumerate() {
            let name = f.name.as_bytes();
            *kind = field(name);
            match *kind {
                Field::Host => {
                    hosts += 1;
                    if !valid_authority(f.value) {
                        return Err(Stop::HandOver);
                    }
                }
                Field::ContentLength => {
                    if body.is_some() {
                        return Err(Stop::HandOver);
                    }
                    match decimal(f.value) {
                        Some(n) if n <= MAX_RELAY_BODY => body = Some(n),
                        _ => return Err(Stop::HandOver),
                    }
                }
                Field::TransferEncoding | Field::Expect => return Err(Stop::HandOver),
                Field::Connection => {
                    for token in tokens(f.value) {
                        if token.eq_ignore_ascii_case(b"close") {
                            close = true;
                        } else if !token.eq_ignore_ascii_case(b"keep-alive") {
                            // It names fields to strip, or asks for an upgrade.
                            return Err(Stop::HandOver);
                        }
                    }
                }
                Field::Te => {
                    te_trailers |= tokens(f.value).any(|t| t.eq_ignore_ascii_case(b"trailers"));
                }
                Field::XForwardedFor => {
                    if xff.replace(i).is_some() {
                        return Err(Stop::HandOver);
                    }
                }
                Field::XForwardedProto => xfp = true,
                Field::HopByHop => {}
                Field::Other => {
                    if shared.router.is_carrier(name) {
                        match (
                            HeaderName::from_bytes(name),
                            HeaderValue::from_bytes(f.value),
                        ) {
                            (Ok(n), Ok(v)) => {
                                carriers.append(n, v);
                            }
                            _ => return Err(Stop::HandOver),
                        }
                    }
                }
            }
        }
        if hosts != 1 {
            return Err(Stop::HandOver);
        }
        let Some(RawRoute { route, set }) = shared.router.route_raw(self.meta, target, &carriers)
        else {
            return Err(Stop::HandOver);
        };
        let (upstream, outcome) = match &route {
            Route::Original => (
                Upstream::Original(self.meta.original_dst),
                Outcome::Baseline,
            ),
            Route::Destination(d) => {
                tracing::debug!(client = %self.meta.client, key = %d.routing_key, sandbox = %d.sandbox, to = %d.location, "routed to sandbox");
                (Upstream::Sandbox(d.location.clone()), Outcome::Sandbox)
            }
        };

        let out = &mut self.out;
        out.clear();
        out.extend_from_slice(method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(target.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        let set_name = set.as_ref().map(|(n, _)| n.as_str().as_bytes());
        for (i, (f, kind)) in req.headers.iter().zip(kinds).enumerate() {
            let name = f.name.as_bytes();
            match kind {
                Field::Connection | Field::Te | Field::HopByHop => continue,
                Field::XForwardedFor if config.forwarded_headers && xff == Some(i) => {
                    out.extend_from_slice(name);
                    out.extend_from_slice(b": ");
                    out.extend_from_slice(f.value);
                    out.extend_from_slice(b", ");
                    out.extend_from_slice(self.meta.client_ip.as_bytes());
                    out.extend_from_slice(b"\r\n");
                    continue;
                }
                _ => {}
            }
            if set_name.is_some_and(|s| s.eq_ignore_ascii_case(name)) {
                continue;
            }
            put_field(out, name, f.value);
        }
        if te_trailers {
            out.extend_from_slice(b"te: trailers\r\n");
        }
        if let Some((name, value)) = &set {
            put_field(out, name.as_str().as_bytes(), value.as_bytes());
        }
        out.extend_from_slice(b"via: 1.1 spur\r\n");
        if config.forwarded_headers {
            if xff.is_none() {
                put_field(out, b"x-forwarded-for", self.meta.client_ip.as_bytes());
            }
            if !xfp {
                out.extend_from_slice(b"x-forwarded-proto: http\r\n");
            }
        }
        out.extend_from_slice(b"\r\n");
        Ok(Plan {
            upstream,
            outcome,
            body: body.unwrap_or(0),
            head: method == "HEAD",
            close,
            idempotent: matches!(
                method,
                "GET" | "HEAD" | "OPTIONS" | "PUT" | "DELETE" | "TRACE"
            ),
        })
    }

    /// Sends the planned request (head in `out`, body from the client) and relays the response.
    /// From here on the request is the relay's: failures are answered, not handed over.
    async fn forward<IO>(&mut self, io: &mut IO, plan: &Plan) -> Result<(Next, Outcome), Stop>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let idle = self.shared.config.idle_timeout;
        let pool = &self.shared.pool;
        // Body bytes read with the head ride in the same write.
        let have = usize::try_from(plan.body)
            .unwrap_or(usize::MAX)
            .min(self.buf.len());
        self.out.extend_from_slice(&self.buf[..have]);
        self.buf.advance(have);
        let body_left = plan.body - have as u64;
        let replayable = body_left == 0 && plan.idempotent;
        let close_client = plan.close || self.drain.is_draining();

        let mut pooled = pool.take_raw(&plan.upstream);
        let mut up = loop {
            let (mut up, reused) = match pooled.take() {
                Some(s) => (s, true),
                None => match pool.connect_tcp(&plan.upstream).await {
                    Ok(s) => (s, false),
                    Err(e) => {
                        tracing::warn!(client = %self.meta.client, error = %e, "upstream request failed");
                        let status = match e {
                            Error::ConnectTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
                            _ => StatusCode::BAD_GATEWAY,
                        };
                        return self
                            .fail(io, status, close_client || body_left > 0, plan.head)
                            .await;
                    }
                },
            };
            self.ubuf.clear();
            let sent = async {
                write(&mut up, &self.out, idle)
                    .await
                    .map_err(|_| IoFail::Upstream)?;
                if body_left > 0 {
                    copy_body(io, &mut self.buf, &mut up, body_left, idle).await?;
                }
                read_some(&mut up, &mut self.ubuf, 8 * 1024, idle)
                    .await
                    .map_err(|_| IoFail::Upstream)
            }
            .await;
            match sent {
                Ok(n) if n > 0 => break up,
                // A kept-alive connection its server closed just before this request: nothing
                // was processed, so a request that can be sent again is, on a new connection.
                Ok(_) | Err(IoFail::Upstream) if reused && replayable => continue,
                Err(IoFail::Client) => return Err(Stop::Close("client failed mid-body")),
                Ok(_) | Err(IoFail::Upstream) => {
                    tracing::warn!(client = %self.meta.client, upstream = %plan.upstream, "upstream closed before responding");
                    return self
                        .fail(
                            io,
                            StatusCode::BAD_GATEWAY,
                            close_client || body_left > 0,
                            plan.head,
                        )
                        .await;
                }
            }
        };

        // The response head, after any interim (1xx) responses, which are not forwarded.
        let max_head = self.shared.config.max_header_bytes * 2;
        let mut scanned = 0;
        let mut bare_lf = false;
        let (mut framing, keep) = loop {
            if let Some(len) = head_end(&self.ubuf, &mut scanned, &mut bare_lf) {
                match self.response_head(len, plan.head, close_client) {
                    Ok(Resp::Interim) => {
                        self.ubuf.advance(len);
                        scanned = 0;
                        continue;
                    }
                    Ok(Resp::Final { framing, keep }) => {
                        self.ubuf.advance(len);
                        break (framing, keep);
                    }
                    Err(why) => {
                        tracing::warn!(upstream = %plan.upstream, why, "invalid response from upstream");
                        return self
                            .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                            .await;
                    }
                }
            }
            if self.ubuf.len() >= max_head {
                tracing::warn!(upstream = %plan.upstream, "response head too large");
                return self
                    .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                    .await;
            }
            match read_some(&mut up, &mut self.ubuf, 8 * 1024, idle).await {
                Ok(n) if n > 0 => {}
                _ => {
                    tracing::warn!(upstream = %plan.upstream, "upstream closed mid-head");
                    return self
                        .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                        .await;
                }
            }
        };

        // The head goes out with as much of the body as is here already.
        let Ok((n, mut done)) = framing.take(&self.ubuf) else {
            tracing::warn!(upstream = %plan.upstream, "invalid response body framing");
            return self
                .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                .await;
        };
        let client_err = |_| Stop::Close("client write error");
        self.record(plan.outcome);
        if n <= COALESCE {
            self.out.extend_from_slice(&self.ubuf[..n]);
            write(io, &self.out, idle).await.map_err(client_err)?;
        } else {
            write(io, &self.out, idle).await.map_err(client_err)?;
            write(io, &self.ubuf[..n], idle).await.map_err(client_err)?;
        }
        self.ubuf.advance(n);
        while !done {
            self.ubuf.clear();
            let n = match read_some(&mut up, &mut self.ubuf, BODY_READ, idle).await {
                Ok(0) if matches!(framing, Framing::UntilClose) => break,
                Ok(0) | Err(_) => return Err(Stop::Close("upstream closed mid-body")),
                Ok(_) => match framing.take(&self.ubuf) {
                    Ok((n, d)) => {
                        done = d;
                        n
                    }
                    Err(()) => return Err(Stop::Close("invalid response body framing")),
                },
            };
            write(io, &self.ubuf[..n], idle).await.map_err(client_err)?;
            self.ubuf.advance(n);
        }
        let until_close = matches!(framing, Framing::UntilClose);
        // Bytes past the response's end were never asked for: that connection is out of step.
        if keep && !until_close && self.ubuf.is_empty() {
            pool.put_raw(plan.upstream.clone(), up);
        }
        if close_client || until_close {
            let _ = io.shutdown().await;
            return Ok((Next::Close, plan.outcome));
        }
        Ok((Next::KeepAlive, plan.outcome))
    }

    /// Reads the response head at the start of `ubuf` and writes the client's version of it into
    /// `out`.
    fn response_head(
        &mut self,
        len: usize,
        head_request: bool,
        close_client: bool,
    ) -> Result<Resp, &'static str> {
        let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
        let mut resp = httparse::Response::new(&mut fields);
        match resp.parse(&self.ubuf[..len]) {
            Ok(httparse::Status::Complete(n)) if n == len => {}
            _ => return Err("unparsable head"),
        }
        let (Some(version), Some(code)) = (resp.version, resp.code) else {
            return Err("unparsable head");
        };
        // httparse reads any three digits; `StatusCode` holds HTTP's, 100 to 999 (RFC 9110 §15).
        let Ok(status) = StatusCode::from_u16(code) else {
            return Err("invalid status code");
        };
        if code == 101 {
            return Err("101 without an upgrade request");
        }
        if (100..200).contains(&code) {
            return Ok(Resp::Interim);
        }
        let mut keep = version == 1;
        let mut named: Vec<&[u8]> = Vec::new();
        let mut chunked = None;
        let mut length = None;
        let mut kinds = [Field::Other; MAX_FIELDS];
        for (f, kind) in resp.headers.iter().zip(kinds.iter_mut()) {
            *kind = field(f.name.as_bytes());
            match *kind {
                Field::Connection => {
                    for t in tokens(f.value) {
                        if t.eq_ignore_ascii_case(b"close") {
                            keep = false;
                        } else if t.eq_ignore_ascii_case(b"keep-alive") {
                            keep |= version == 0;
                        } else {
                            named.push(t);
                        }
                    }
                }
                Field::TransferEncoding => {
                    // The last coding of the last field is the final one.
                    match tokens(f.value).last() {
                        Some(last) => chunked = Some(last.eq_ignore_ascii_case(b"chunked")),
                        None => return Err("empty Transfer-Encoding"),
                    }
                }
                Field::ContentLength => match decimal(f.value) {
                    Some(n) if length.is_none_or(|l| l == n) => length = Some(n),
                    _ => return Err("invalid or conflicting Content-Length"),
                },
                _ => {}
            }
        }
        // Framing fields are checked even where no body follows (HEAD, 204, 304): a response
        // that carries both is refused, not passed on for the next hop to read its own way.
        let framing = match (chunked, length) {
            (Some(_), Some(_)) => return Err("both Transfer-Encoding and Content-Length"),
            _ if head_request || code == 204 || code == 304 => Framing::Empty,
            (Some(true), None) => Framing::Chunked(Chunked::default()),
            (Some(false), None) | (None, None) => Framing::UntilClose,
            (None, Some(n)) => Framing::Fixed(n),
        };

        let out = &mut self.out;
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\n");
        for (f, kind) in resp.headers.iter().zip(kinds) {
            let name = f.name.as_bytes();
            if matches!(kind, Field::Connection | Field::Te | Field::HopByHop)
                || named.iter().any(|n| n.eq_ignore_ascii_case(name))
            {
                continue;
            }
            put_field(out, name, f.value);
        }
        if close_client || matches!(framing, Framing::UntilClose) {
            out.extend_from_slice(b"connection: close\r\n");
        }
        out.extend_from_slice(b"via: 1.1 spur\r\n\r\n");
        Ok(Resp::Final { framing, keep })
    }

    /// Answers an exchange the proxy could not complete (without the body if the request was a
    /// HEAD). The client's connection stays open unless part of its request body is unread.
    async fn fail<IO>(
        &mut self,
        io: &mut IO,
        status: StatusCode,
        close: bool,
        head: bool,
    ) -> Result<(Next, Outcome), Stop>
    where
        IO: AsyncWrite + Unpin,
    {
        const BODY: &[u8] = b"spur: upstream unavailable\n";
        let out = &mut self.out;
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\ncontent-type: text/plain\r\ncontent-length: ");
        out.extend_from_slice(BODY.len().to_string().as_bytes());
        if close {
            out.extend_from_slice(b"\r\nconnection: close");
        }
        out.extend_from_slice(b"\r\n\r\n");
        if !head {
            out.extend_from_slice(BODY);
        }
        self.record(Outcome::Error);
        let idle = self.shared.config.idle_timeout;
        write(io, &self.out, idle)
            .await
            .map_err(|_| Stop::Close("client write error"))?;
        if close {
            let _ = io.shutdown().await;
            return Ok((Next::Close, Outcome::Error));
        }
        Ok((Next::KeepAlive, Outcome::Error))
    }
}

enum Resp {
    /// A 1xx response other than 101: read past it.
    Interim,
    Final {
        framing: Framing,
        /// The upstream connection may carry another request afterwards.
        keep: bool,
    },
}

enum IoFail {
    Client,
    Upstream,
}

/// Where a head ends: the index after the empty line that closes it, once `buf` holds one.
/// `scanned` carries the position to resume from between calls; `bare_lf` is set when a line
/// ends in LF alone.
fn head_end(buf: &[u8], scanned: &mut usize, bare_lf: &mut bool) -> Option<usize> {
    for i in memchr::memchr_iter(b'\n', &buf[*scanned..]).map(|i| i + *scanned) {
        if i == 0 || buf[i - 1] != b'\r' {
            *bare_lf = true;
        }
        match &buf[i + 1..] {
            [b'\n', ..] => {
                *bare_lf = true;
                return Some(i + 2);
            }
            [b'\r', b'\n', ..] => return Some(i + 3),
            [] | [b'\r'] => {
                // Not yet known whether this line is the last one.
                *scanned = i;
                return None;
            }
            _ => {}
        }
    }
    *scanned = buf.len();
    None
}

/// A request target the relay forwards unchanged: origin form (RFC 9112 §3.2.1), made of
/// characters RFC 3986 allows in a path and query. Anything else (absolute form, `*`, a
/// fragment, characters some parsers accept and others do not) goes to hyper.
fn origin_form(target: &[u8]) -> bool {
    target.first() == Some(&b'/') && target.iter().all(|&b| TARGET[usize::from(b)])
}

const TARGET: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = (b as u8).is_ascii_alphanumeric();
        b += 1;
    }
    let extra = b"-._~%!$&'()*+,;=:@/?";
    let mut i = 0;
    while i < extra.len() {
        t[extra[i] as usize] = true;
        i += 1;
    }
    t
};

/// The header fields the relay acts on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Field {
    Host,
    ContentLength,
    TransferEncoding,
    Connection,
    Te,
    Expect,
    XForwardedFor,
    XForwardedProto,
    /// The rest of the fixed hop-by-hop set (RFC 9110 §7.6.1 and the legacy proxy fields):
    /// never forwarded.
    HopByHop,
    Other,
}

fn field(name: &[u8]) -> Field {
    let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
    match name.len() {
        2 if is(b"te") => Field::Te,
        4 if is(b"host") => Field::Host,
        6 if is(b"expect") => Field::Expect,
        7 if is(b"upgrade") => Field::HopByHop,
        10 if is(b"connection") => Field::Connection,
        10 if is(b"keep-alive") => Field::HopByHop,
        14 if is(b"content-length") => Field::ContentLength,
        15 if is(b"x-forwarded-for") => Field::XForwardedFor,
        16 if is(b"proxy-connection") => Field::HopByHop,
        17 if is(b"transfer-encoding") => Field::TransferEncoding,
        17 if is(b"x-forwarded-proto") => Field::XForwardedProto,
        18 if is(b"proxy-authenticate") => Field::HopByHop,
        19 if is(b"proxy-authorization") => Field::HopByHop,
        _ => Field::Other,
    }
}

/// A `Content-Length` value: digits only (no sign, no list), at most 18 of them.
fn decimal(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 18 {
        return None;
    }
    v.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
    })
}

/// The comma-separated, whitespace-trimmed, non-empty elements of a list field.
fn tokens(v: &[u8]) -> impl Iterator<Item = &[u8]> {
    v.split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

fn put_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

async fn write<W: AsyncWrite + Unpin>(
    w: &mut W,
    data: &[u8],
    idle: Duration,
) -> std::io::Result<()> {
    match timeout(idle, w.write_all(data)).await {
        Ok(r) => r,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// One read of up to `size` bytes appended to `buf`; `Ok(0)` is EOF.
async fn read_some<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
    size: usize,
    idle: Duration,
) -> std::io::Result<usize> {
    if buf.capacity() - buf.len() < size / 2 {
        buf.reserve(size);
    }
    match timeout(idle, r.read_buf(buf)).await {
        Ok(r) => r,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// Forwards the `left` request body bytes still to come from the client.
async fn copy_body<R, W>(
    client: &mut R,
    buf: &mut BytesMut,
    up: &mut W,
    mut left: u64,
    idle: Duration,
) -> Result<(), IoFail>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    while left > 0 {
        if buf.is_empty() {
            match read_some(client, buf, 16 * 1024, idle).await {
                Ok(n) if n > 0 => {}
                _ => return Err(IoFail::Client),
            }
        }
        let take = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
        write(up, &buf[..take], idle)
            .await
            .map_err(|_| IoFail::Upstream)?;
        buf.advance(take);
        left -= take as u64;
    }
    Ok(())
}

/// How a response body ends (RFC 9112 §6.3).
enum Framing {
    Empty,
    Fixed(u64),
    Chunked(Chunked),
    UntilClose,
}

impl Framing {
    /// How many bytes at the start of `data` belong to the body, and whether it is then complete.
    fn take(&mut self, data: &[u8]) -> Result<(usize, bool), ()> {
        match self {
            Framing::Empty => Ok((0, true)),
            Framing::Fixed(left) => {
                let n = (*left).min(data.len() as u64);
                *left -= n;
                Ok((n as usize, *left == 0))
            }
            Framing::Chunked(c) => c.feed(data),
            Framing::UntilClose => Ok((data.len(), false)),
        }
    }
}

/// Follows a chunked body (RFC 9112 §7.1) as it passes through, without decoding it: sizes
/// must be hex that fits in 60 bits, every line must end in CRLF, extension and trailer lines
/// are bounded.
#[derive(Default)]
struct Chunked {
    state: ChunkState,
    size: u64,
    /// Bytes of the current size line's extension, or of the trailer section so far.
    line: usize,
}

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    #[default]
    Size,
    SizeDigits,
    Ext,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    Trailer,
    TrailerLf {
        empty: bool,
    },
    TrailerStart,
    Done,
}

/// Longest chunk extension, and largest trailer section, accepted.
const MAX_CHUNK_LINE: usize = 4096;

impl Chunked {
    fn feed(&mut self, data: &[u8]) -> Result<(usize, bool), ()> {
        use ChunkState::*;
        let mut i = 0;
        while i < data.len() {
            match self.state {
                Done => break,
                Data => {
                    let n = self.size.min((data.len() - i) as u64);
                    i += n as usize;
                    self.size -= n;
                    if self.size == 0 {
                        self.state = DataCr;
                    }
                    continue;
                }
                _ => {}
            }
            let b = data[i];
            i += 1;
            self.state = match (self.state, b) {
                (Size | SizeDigits, b) if b.is_ascii_hexdigit() => {
                    if self.size >> 56 != 0 {
                        return Err(());
                    }
                    let d = (b as char).to_digit(16).ok_or(())?;
                    self.size = self.size * 16 + u64::from(d);
                    SizeDigits
                }
                (SizeDigits, b';' | b' ' | b'\t') => {
                    self.line = 0;
                    Ext
                }
                (SizeDigits | Ext, b'\r') => SizeLf,
                (Ext, b) if b == b'\t' || (b >= 0x20 && b != 0x7f) => {
                    self.line += 1;
                    if self.line > MAX_CHUNK_LINE {
                        return Err(());
                    }
                    Ext
                }
                (SizeLf, b'\n') if self.size == 0 => {
                    self.line = 0;
                    TrailerStart
                }
                (SizeLf, b'\n') => Data,
                (DataCr, b'\r') => DataLf,
                (DataLf, b'\n') => Size,
                (TrailerStart, b'\r') => TrailerLf { empty: true },
                (Trailer, b'\r') => TrailerLf { empty: false },
                (TrailerStart | Trailer, b) if b == b'\t' || (b >= 0x20 && b != 0x7f) => {
                    self.line += 1;
                    if self.line > MAX_CHUNK_LINE {
                        return Err(());
                    }
                    Trailer
                }
                (TrailerLf { empty: true }, b'\n') => Done,
                (TrailerLf { empty: false }, b'\n') => TrailerStart,
                _ => return Err(()),
            };
        }
        Ok((i, self.state == Done))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end(buf: &[u8]) -> (Option<usize>, bool) {
        let (mut scanned, mut bare) = (0, false);
        (head_end(buf, &mut scanned, &mut bare), bare)
    }

    #[test]
    fn head_ends() {
        assert_eq!(end(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"), (Some(27), false));
        assert_eq!(end(b"GET / HTTP/1.1\r\n\r\nGET"), (Some(18), false));
        assert_eq!(end(b"GET / HTTP/1.1\r\nHost: a\r\n"), (None, false));
        assert_eq!(end(b"GET / HTTP/1.1\r\nHost: a\r\n\r"), (None, false));
        assert_eq!(end(b"GET / HTTP/1.1\nHost: a\r\n\r\n"), (Some(26), true));
        assert_eq!(end(b"GET / HTTP/1.1\r\nHost: a\r\n\n"), (Some(26), true));
        assert_eq!(end(b"GET / HTTP/1.1\r\nHost: a\n\n"), (Some(25), true));
        // Resuming where the last call stopped finds the same end as one call over everything.
        let head = b"GET / HTTP/1.1\r\nHost: a\r\nX: y\r\n\r\n";
        for cut in 0..head.len() {
            let (mut scanned, mut bare) = (0, false);
            let first = head_end(&head[..cut], &mut scanned, &mut bare);
            assert_eq!(first, None, "cut {cut}");
            assert_eq!(
                head_end(head, &mut scanned, &mut bare),
                Some(head.len()),
                "cut {cut}"
            );
            assert!(!bare);
        }
    }

    #[test]
    fn fields_and_values() {
        assert!(matches!(field(b"Content-Length"), Field::ContentLength));
        assert!(matches!(
            field(b"TRANSFER-ENCODING"),
            Field::TransferEncoding
        ));
        assert!(matches!(field(b"Proxy-Authorization"), Field::HopByHop));
        assert!(matches!(field(b"Keep-Alive"), Field::HopByHop));
        assert!(matches!(field(b"x-forwarded-for"), Field::XForwardedFor));
        assert!(matches!(field(b"Content-Type"), Field::Other));
        assert_eq!(decimal(b"0"), Some(0));
        assert_eq!(decimal(b"65536"), Some(65536));
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b"1,1",
            b" 1",
            b"0x10",
            b"1234567890123456789",
        ] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
        let t: Vec<&[u8]> = tokens(b" keep-alive ,, Close,").collect();
        assert_eq!(t, [&b"keep-alive"[..], b"Close"]);
        assert!(origin_form(b"/a/b?x=1&y=%20"));
        for bad in [
            &b"*"[..],
            b"http://a/",
            b"/a#f",
            b"/a b",
            b"/\"",
            b"/<",
            b"/{",
            b"",
            b"a",
        ] {
            assert!(!origin_form(bad), "{bad:?}");
        }
    }

    /// Feeds `body` to a fresh follower in pieces of `step` bytes.
    fn follow(body: &[u8], step: usize) -> Result<(usize, bool), ()> {
        let mut c = Chunked::default();
        let mut at = 0;
        while at < body.len() {
            let piece = &body[at..(at + step).min(body.len())];
            let (n, done) = c.feed(piece)?;
            at += n;
            if done {
                return Ok((at, true));
            }
            assert_eq!(n, piece.len(), "an unfinished body takes every byte");
        }
        Ok((at, false))
    }

    #[test]
    fn chunked_bodies_are_followed_to_their_end_however_they_arrive() {
        let good: [&[u8]; 4] = [
            b"0\r\n\r\n",
            b"3\r\nabc\r\n0\r\n\r\n",
            b"A;name=v\r\n0123456789\r\n10\r\n0123456789abcdef\r\n0\r\nX-T: 1\r\nY: 2\r\n\r\n",
            b"1 ;x\r\na\r\n0\r\n\r\n",
        ];
        for body in good {
            for step in 1..=body.len() {
                let mut next = body.to_vec();
                next.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
                assert_eq!(
                    follow(&next, step),
                    Ok((body.len(), true)),
                    "{body:?} step {step}"
                );
            }
        }
        let bad: [&[u8]; 8] = [
            b"x\r\n",
            b"\r\n",
            b"3\nabc\r\n0\r\n\r\n",
            b"3\r\nabcd\r\n",
            b"3\r\nabc\n0\r\n\r\n",
            b"10000000000000000\r\n",
            b"0\r\nX: 1\n\r\n",
            b"-1\r\n",
        ];
        for body in bad {
            assert_eq!(follow(body, body.len()), Err(()), "{body:?}");
        }
        assert_eq!(follow(b"5\r\nab", 2), Ok((5, false)));
    }

    #[test]
    fn framing_takes_only_its_own_bytes() {
        let mut f = Framing::Fixed(3);
        assert_eq!(f.take(b"ab"), Ok((2, false)));
        assert_eq!(f.take(b"cdef"), Ok((1, true)));
        assert_eq!(Framing::Empty.take(b"xyz"), Ok((0, true)));
        assert_eq!(Framing::UntilClose.take(b"xyz"), Ok((3, false)));
    }
}
