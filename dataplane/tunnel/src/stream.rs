//! Byte streams over either transport: the raw QUIC/HTTP/2 halves, the [`Stream`] handed to
//! callers (metrics, drain accounting, FIN on drop), and [`Incoming`], a stream whose header has
//! arrived and that waits for the application to accept or reject it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::watch;

use crate::Transport;
use crate::error::Error;
use crate::metrics::{Metrics, PerKind};
use crate::tls::LINGER;
use crate::wire::{self, MAX_REASON, Reply, StreamHeader, StreamKind};

/// Largest slice handed to HTTP/2 in one `send_data`; bounds the copy per write.
const H2_WRITE_CHUNK: usize = 64 * 1024;

// === raw halves ===

/// HTTP/2 send half. Ends the stream (END_STREAM) when dropped without shutdown, like closing
/// a TCP socket, so both transports treat a dropped stream the same way.
pub(crate) struct H2Send {
    send: h2::SendStream<Bytes>,
    ended: bool,
}

impl Drop for H2Send {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.send.send_data(Bytes::new(), true);
        }
    }
}

pub(crate) enum RawSend {
    Quic(quinn::SendStream),
    H2(H2Send),
}

impl RawSend {
    pub(crate) fn h2(send: h2::SendStream<Bytes>) -> Self {
        RawSend::H2(H2Send { send, ended: false })
    }

    /// Ends the stream and waits (bounded) until the peer has everything, so a connection
    /// closed right after does not cut the last bytes off.
    pub(crate) async fn finish_and_wait(&mut self) {
        match self {
            RawSend::Quic(s) => {
                let _ = s.finish();
                let _ = tokio::time::timeout(LINGER, s.stopped()).await;
            }
            RawSend::H2(_) => {
                let _ = self.shutdown().await;
            }
        }
    }

    fn abort(&mut self) {
        match self {
            RawSend::Quic(s) => {
                let _ = s.reset(0u8.into());
            }
            RawSend::H2(s) => {
                s.ended = true;
                s.send.send_reset(h2::Reason::CANCEL);
            }
        }
    }
}

fn h2_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        return e
            .into_io()
            .unwrap_or_else(|| io::Error::other("HTTP/2 I/O error"));
    }
    let kind = if e.is_reset() || e.is_go_away() {
        io::ErrorKind::ConnectionReset
    } else {
        io::ErrorKind::Other
    };
    io::Error::new(kind, e)
}

impl H2Send {
    /// Waits until the stream may send at least one byte (of up to `want`, at most
    /// [`H2_WRITE_CHUNK`]) and returns how many.
    fn poll_capacity(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
        if self.ended {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after shutdown",
            )));
        }
        let want = want.min(H2_WRITE_CHUNK);
        self.send.reserve_capacity(want);
        loop {
            let cap = self.send.capacity();
            if cap > 0 {
                return Poll::Ready(Ok(cap.min(want)));
            }
            // Capacity 0 registers the waker; `Ready` means the window grew.
            match ready!(self.send.poll_capacity(cx)) {
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Poll::Ready(Err(h2_io(e))),
                None => {
                    // The stream can no longer send: find out why.
                    return Poll::Ready(Err(match self.send.poll_reset(cx) {
                        Poll::Ready(Ok(reason)) => io::Error::new(
                            io::ErrorKind::ConnectionReset,
                            format!("stream reset by peer: {reason}"),
                        ),
                        Poll::Ready(Err(e)) => h2_io(e),
                        Poll::Pending => io::ErrorKind::BrokenPipe.into(),
                    }));
                }
            }
        }
    }
}

impl RawSend {
    /// Sends all of `data` without copying it (QUIC keeps the buffer until it is
    /// acknowledged; HTTP/2 frames slices of it).
    async fn write_chunk(&mut self, mut data: Bytes) -> io::Result<()> {
        match self {
            RawSend::Quic(s) => s.write_chunk(data).await.map_err(io::Error::from),
            RawSend::H2(s) => {
                while !data.is_empty() {
                    let n = std::future::poll_fn(|cx| s.poll_capacity(cx, data.len())).await?;
                    s.send.send_data(data.split_to(n), false).map_err(h2_io)?;
                }
                Ok(())
            }
        }
    }
}

impl AsyncWrite for RawSend {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            RawSend::Quic(s) => AsyncWrite::poll_write(Pin::new(s), cx, buf),
            RawSend::H2(s) => {
                if buf.is_empty() && !s.ended {
                    return Poll::Ready(Ok(0));
                }
                let n = ready!(s.poll_capacity(cx, buf.len()))?;
                s.send
                    .send_data(Bytes::copy_from_slice(&buf[..n]), false)
                    .map_err(h2_io)?;
                Poll::Ready(Ok(n))
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            RawSend::Quic(s) => AsyncWrite::poll_flush(Pin::new(s), cx),
            // The connection task writes frames as soon as they are queued.
            RawSend::H2(_) => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            RawSend::Quic(s) => match s.finish() {
                Ok(()) => Poll::Ready(Ok(())),
                // Already finished (or reset): shutdown is idempotent.
                Err(_) => Poll::Ready(Ok(())),
            },
            RawSend::H2(s) => {
                if !s.ended {
                    s.ended = true;
                    s.send.send_data(Bytes::new(), true).map_err(h2_io)?;
                }
                Poll::Ready(Ok(()))
            }
        }
    }
}

pub(crate) enum H2Recv {
    /// Client side: the response headers have not arrived yet.
    Pending(h2::client::ResponseFuture),
    Body {
        body: h2::RecvStream,
        buf: Bytes,
    },
    Failed,
}

pub(crate) enum RawRecv {
    Quic(quinn::RecvStream),
    H2(H2Recv),
}

impl RawRecv {
    pub(crate) fn h2_body(body: h2::RecvStream) -> Self {
        RawRecv::H2(H2Recv::Body {
            body,
            buf: Bytes::new(),
        })
    }

    fn abort(&mut self) {
        match self {
            RawRecv::Quic(r) => {
                let _ = r.stop(0u8.into());
            }
            RawRecv::H2(state) => *state = H2Recv::Failed,
        }
    }
}

impl H2Recv {
    /// Waits until data is buffered; `false` at the end of the stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        loop {
            match self {
                H2Recv::Pending(fut) => match ready!(Pin::new(fut).poll(cx)) {
                    Ok(resp) if resp.status() == http::StatusCode::OK => {
                        *self = H2Recv::Body {
                            body: resp.into_body(),
                            buf: Bytes::new(),
                        };
                    }
                    Ok(resp) => {
                        let status = resp.status();
                        *self = H2Recv::Failed;
                        return Poll::Ready(Err(io::Error::other(format!(
                            "tunnel server answered HTTP {status}"
                        ))));
                    }
                    Err(e) => {
                        *self = H2Recv::Failed;
                        return Poll::Ready(Err(h2_io(e)));
                    }
                },
                H2Recv::Body { body, buf } => {
                    if !buf.is_empty() {
                        return Poll::Ready(Ok(true));
                    }
                    match ready!(body.poll_data(cx)) {
                        Some(Ok(data)) => *buf = data,
                        Some(Err(e)) => return Poll::Ready(Err(h2_io(e))),
                        None => return Poll::Ready(Ok(false)),
                    }
                }
                H2Recv::Failed => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "stream aborted",
                    )));
                }
            }
        }
    }

    /// Takes up to `max` buffered bytes. Window credit goes back only for what the reader has
    /// taken, so a slow reader holds the peer to one window.
    fn take(&mut self, max: usize) -> Bytes {
        let H2Recv::Body { body, buf } = self else {
            return Bytes::new();
        };
        let data = buf.split_to(buf.len().min(max));
        let _ = body.flow_control().release_capacity(data.len());
        data
    }
}

impl RawRecv {
    /// The next buffers of the stream, as many as are ready (at most `bufs.len()`), without
    /// copying them; waits for the first. `None` at the end of the stream.
    async fn read_chunks(&mut self, bufs: &mut [Bytes]) -> io::Result<Option<usize>> {
        match self {
            RawRecv::Quic(r) => r.read_chunks(bufs).await.map_err(io::Error::from),
            RawRecv::H2(state) => {
                std::future::poll_fn(|cx| {
                    let mut n = 0;
                    while n < bufs.len() {
                        match state.poll_fill(cx) {
                            Poll::Ready(Ok(true)) => {
                                bufs[n] = state.take(usize::MAX);
                                n += 1;
                            }
                            Poll::Ready(Ok(false)) if n == 0 => return Poll::Ready(Ok(None)),
                            Poll::Ready(Err(e)) if n == 0 => return Poll::Ready(Err(e)),
                            // What was taken goes first; the end or the error comes next call.
                            Poll::Ready(_) => break,
                            Poll::Pending if n == 0 => return Poll::Pending,
                            Poll::Pending => break,
                        }
                    }
                    Poll::Ready(Ok(Some(n)))
                })
                .await
            }
        }
    }
}

/// Writes all of `bufs` with as few (vectored) writes as possible.
async fn write_all_vectored<W>(w: &mut W, bufs: &mut [Bytes]) -> io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    let mut first = 0;
    while first < bufs.len() {
        if bufs[first].is_empty() {
            first += 1;
            continue;
        }
        let slices: Vec<io::IoSlice<'_>> =
            bufs[first..].iter().map(|b| io::IoSlice::new(b)).collect();
        let mut n = w.write_vectored(&slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let b = &mut bufs[first];
            let k = n.min(b.len());
            bytes::Buf::advance(b, k);
            n -= k;
            if b.is_empty() {
                first += 1;
            }
        }
    }
    Ok(())
}

impl AsyncRead for RawRecv {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            RawRecv::Quic(r) => AsyncRead::poll_read(Pin::new(r), cx, out),
            RawRecv::H2(state) => {
                if ready!(state.poll_fill(cx))? {
                    out.put_slice(&state.take(out.remaining()));
                }
                Poll::Ready(Ok(()))
            }
        }
    }
}

// === drain accounting ===

/// Streams (and stream opens in progress) of one session; a drain waits for zero.
#[derive(Clone, Debug)]
pub(crate) struct Active(Arc<watch::Sender<usize>>);

impl Active {
    pub(crate) fn new() -> Self {
        Active(Arc::new(watch::Sender::new(0)))
    }

    pub(crate) fn enter(&self) -> ActiveGuard {
        self.0.send_modify(|c| *c += 1);
        ActiveGuard(self.0.clone())
    }

    pub(crate) fn count(&self) -> usize {
        *self.0.borrow()
    }

    pub(crate) async fn wait_zero(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|c| *c == 0).await;
    }
}

#[derive(Debug)]
pub(crate) struct ActiveGuard(Arc<watch::Sender<usize>>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.send_modify(|c| *c = c.saturating_sub(1));
    }
}

struct StreamGuard {
    _session: ActiveGuard,
    active: Gauge,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.active.dec();
    }
}

// === Stream ===

/// One tunnelled connection: a byte stream in both directions with half-close.
///
/// `shutdown()` sends FIN (QUIC) / END_STREAM (HTTP/2); the other direction keeps flowing until
/// the peer ends it too. Dropping the stream without `shutdown()` ends it the same way, like
/// closing a TCP socket; use [`Stream::abort`] to reset it instead (the peer sees an error, not
/// a clean end). Reading stops at the peer's FIN (`read` returns 0).
pub struct Stream {
    send: Option<RawSend>,
    recv: RawRecv,
    kind: StreamKind,
    transport: Transport,
    counters: PerKind,
    guard: Option<StreamGuard>,
    aborted: bool,
}

impl Stream {
    pub(crate) fn new(
        send: RawSend,
        recv: RawRecv,
        kind: StreamKind,
        transport: Transport,
        metrics: &Metrics,
        session: ActiveGuard,
    ) -> Self {
        let counters = metrics.kind(kind).clone();
        counters.total.inc();
        counters.active.inc();
        Stream {
            send: Some(send),
            recv,
            kind,
            transport,
            guard: Some(StreamGuard {
                _session: session,
                active: counters.active.clone(),
            }),
            counters,
            aborted: false,
        }
    }

    pub fn kind(&self) -> StreamKind {
        self.kind
    }

    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Carries bytes between `io` and this stream, both ways, until both directions have
    /// ended, as [`tokio::io::copy_bidirectional`] does: the end of one direction (EOF from
    /// `io`, FIN from the peer) is passed on as a half-close and the other keeps flowing; the
    /// first error ends both. Returns the bytes carried (io → tunnel, tunnel → io).
    ///
    /// Unlike copying through `AsyncRead`/`AsyncWrite`, the tunnel side takes and gives whole
    /// buffers: what is read from `io` goes into the stream without a copy, and what arrives
    /// is written to `io` straight from the transport's buffer, one copy less each way.
    pub async fn splice<T>(&mut self, io: T) -> io::Result<(u64, u64)>
    where
        T: AsyncRead + AsyncWrite,
    {
        let (mut rd, mut wr) = tokio::io::split(io);
        let Stream {
            send,
            recv,
            counters,
            ..
        } = self;
        let up = async {
            let send = send.as_mut().ok_or_else(closed_send)?;
            let mut buf = BytesMut::new();
            let mut total = 0u64;
            loop {
                // A small remainder would make small reads; start a new buffer instead (the
                // old one is freed once the transport is done with what it holds).
                if buf.capacity() < crate::COPY_BUFFER / 4 {
                    buf = BytesMut::with_capacity(crate::COPY_BUFFER);
                }
                let n = rd.read_buf(&mut buf).await?;
                if n == 0 {
                    send.shutdown().await?;
                    return Ok(total);
                }
                send.write_chunk(buf.split().freeze()).await?;
                total += n as u64;
                counters.bytes_out.inc_by(n as u64);
            }
        };
        let down = async {
            // A QUIC chunk is one packet's worth: write what has arrived in one go.
            let mut chunks = vec![Bytes::new(); 64];
            let mut total = 0u64;
            while let Some(n) = recv.read_chunks(&mut chunks).await? {
                let len: usize = chunks[..n].iter().map(Bytes::len).sum();
                write_all_vectored(&mut wr, &mut chunks[..n]).await?;
                total += len as u64;
                counters.bytes_in.inc_by(len as u64);
            }
            wr.shutdown().await?;
            Ok::<_, io::Error>(total)
        };
        tokio::try_join!(up, down)
    }

    /// Resets both directions: the peer's reads and writes fail instead of seeing a clean end.
    pub fn abort(&mut self) {
        self.aborted = true;
        if let Some(send) = &mut self.send {
            send.abort();
        }
        self.recv.abort();
    }
}

/// With the `tonic` feature: a stream can be handed to `Server::serve_with_incoming`, as the
/// tunnel API is served over one.
#[cfg(feature = "tonic")]
impl tonic::transport::server::Connected for Stream {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("kind", &self.kind)
            .field("transport", &self.transport)
            .finish_non_exhaustive()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.aborted {
            return;
        }
        if let Some(RawSend::Quic(mut send)) = self.send.take() {
            // QUIC forgets unacknowledged stream data when its connection closes. Keeping the
            // session busy until the peer has acknowledged our FIN lets a drain close the
            // connection without cutting off the last bytes.
            let _ = send.finish();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let guard = self.guard.take();
                rt.spawn(async move {
                    let _ = tokio::time::timeout(LINGER, send.stopped()).await;
                    drop(guard);
                });
            }
        }
    }
}

fn closed_send() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "stream send side gone")
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.recv).poll_read(cx, buf))?;
        let n = buf.filled().len() - before;
        this.counters.bytes_in.inc_by(n as u64);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let Some(send) = &mut this.send else {
            return Poll::Ready(Err(closed_send()));
        };
        let n = ready!(Pin::new(send).poll_write(cx, buf))?;
        this.counters.bytes_out.inc_by(n as u64);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().send {
            Some(send) => Pin::new(send).poll_flush(cx),
            None => Poll::Ready(Err(closed_send())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().send {
            Some(send) => Pin::new(send).poll_shutdown(cx),
            None => Poll::Ready(Err(closed_send())),
        }
    }
}

// === Incoming ===

/// A stream the peer opened, with its header read and validated. The opener waits until it is
/// accepted or rejected; dropping it unanswered rejects it.
pub struct Incoming {
    header: StreamHeader,
    send: RawSend,
    recv: RawRecv,
    transport: Transport,
    metrics: Metrics,
    session: ActiveGuard,
    max_header: usize,
}

impl Incoming {
    pub(crate) fn new(
        header: StreamHeader,
        send: RawSend,
        recv: RawRecv,
        transport: Transport,
        metrics: Metrics,
        session: ActiveGuard,
        max_header: usize,
    ) -> Self {
        Incoming {
            header,
            send,
            recv,
            transport,
            metrics,
            session,
            max_header,
        }
    }

    pub fn header(&self) -> &StreamHeader {
        &self.header
    }

    pub fn kind(&self) -> StreamKind {
        self.header.kind()
    }

    /// Tells the opener the stream is accepted; raw bytes flow from here on.
    pub async fn accept(mut self) -> Result<Stream, Error> {
        wire::write_frame(&mut self.send, &Reply::Ok, self.max_header).await?;
        Ok(Stream::new(
            self.send,
            self.recv,
            self.header.kind(),
            self.transport,
            &self.metrics,
            self.session,
        ))
    }

    /// Tells the opener why the stream is refused (e.g. "connection refused" from the
    /// cluster-side connect) and ends it.
    pub async fn reject(mut self, reason: &str) {
        self.metrics.kind(self.header.kind()).rejected.inc();
        let reply = Reply::Error {
            reason: wire::truncate(reason, MAX_REASON),
        };
        if wire::write_frame(&mut self.send, &reply, self.max_header)
            .await
            .is_ok()
        {
            self.send.finish_and_wait().await;
            // Over HTTP/2, dropping the receiving half resets the stream, and the reset can
            // overtake the reply: read the opener's side to its end first (bounded), so the
            // reason arrives. QUIC delivers the reply before a STOP_SENDING anyway.
            if matches!(self.recv, RawRecv::H2(_)) {
                let _ = tokio::time::timeout(
                    LINGER,
                    tokio::io::copy(&mut self.recv, &mut tokio::io::sink()),
                )
                .await;
            }
        }
    }
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("header", &self.header)
            .field("transport", &self.transport)
            .finish_non_exhaustive()
    }
}
