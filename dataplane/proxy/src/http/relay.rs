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
//! Reads are sized by what is due or what recent reads brought, and what has come goes out in one
//! write ([`batch`]), so a kept-alive exchange costs about the system calls the kernel needs.

mod batch;
mod forward;
mod framing;
mod request;
#[cfg(test)]
mod tests;
mod wire;

use std::sync::Arc;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::time::{Instant, timeout};

use crate::Shared;
use crate::conn::ConnMeta;
use crate::io::Rewind;
use crate::metrics::Outcome;
use crate::pool::Upstream;
use batch::{ReadSize, RecvBuf};
use spur_runtime::Drain;
use wire::head_end;

/// Request bodies up to this size are relayed: written upstream after the head, then the
/// response is read. A larger body goes to hyper, which streams both directions at once, so an
/// upstream that answers before reading a large upload cannot stall the exchange.
const MAX_RELAY_BODY: u64 = 64 * 1024;
/// Header fields read per head; a head with more goes to hyper (which applies `maxHeaders`).
const MAX_FIELDS: usize = 128;
/// Body bytes copied behind a head into one write; larger bodies go with it as a part of a
/// vectored write.
const COALESCE: usize = 16 * 1024;

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
    let mut conn = Conn::new(&shared, &meta, &drain);
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
    // The rest of the connection's state goes now: a partial move would keep the response
    // buffer (up to 128 KiB) and the last request's carriers for as long as hyper serves it.
    let buf = std::mem::take(&mut conn.buf);
    drop(conn);
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
    /// Bytes read from the upstream, not yet forwarded; also the request body bytes read after
    /// its head (the exchange uses one direction at a time, so one large buffer serves both).
    ubuf: RecvBuf,
    /// The size of the response reads that nothing else sizes.
    reads: ReadSize,
    /// When the current exchange started, until it is counted in the metrics ([`Conn::record`]).
    started: Option<Instant>,
    /// The current request's routing carriers ([`crate::RawRouter::carrier`]), kept from one
    /// request to the next so that a keyed request does not allocate a map.
    carriers: http::HeaderMap,
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

impl<'a> Conn<'a> {
    fn new(shared: &'a Shared, meta: &'a ConnMeta, drain: &'a Drain) -> Self {
        Conn {
            shared,
            meta,
            drain,
            buf: BytesMut::with_capacity(8 * 1024),
            out: Vec::with_capacity(1024),
            ubuf: RecvBuf::new(),
            reads: ReadSize::new(),
            started: None,
            carriers: http::HeaderMap::new(),
        }
    }

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
        let forwarded = self.forward(io, &plan).await;
        self.ubuf.settle();
        match forwarded {
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
}
