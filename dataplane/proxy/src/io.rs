//! I/O helpers: replaying sniffed bytes, recording activity for idle timeouts, and splicing two
//! streams together.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pin_project_lite::pin_project! {
    /// A stream whose first bytes were already read (for protocol detection) and are replayed
    /// before reading from the socket again.
    #[derive(Debug)]
    pub(crate) struct Rewind<T> {
        prefix: Bytes,
        #[pin]
        inner: T,
    }
}

impl<T> Rewind<T> {
    pub(crate) fn new(prefix: Bytes, inner: T) -> Self {
        Rewind { prefix, inner }
    }
}

impl<T: AsyncRead> AsyncRead for Rewind<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        this.inner.poll_read(cx, buf)
    }
}

/// `AsyncWrite` for a read-side adapter (a pin-projected struct with a pinned field `inner`):
/// every write goes straight to `inner`.
macro_rules! write_through {
    ($adapter:ident) => {
        impl<T: tokio::io::AsyncWrite> tokio::io::AsyncWrite for $adapter<T> {
            fn poll_write(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                self.project().inner.poll_write(cx, buf)
            }
            fn poll_write_vectored(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                self.project().inner.poll_write_vectored(cx, bufs)
            }
            fn is_write_vectored(&self) -> bool {
                self.inner.is_write_vectored()
            }
            fn poll_flush(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                self.project().inner.poll_flush(cx)
            }
            fn poll_shutdown(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                self.project().inner.poll_shutdown(cx)
            }
        }
    };
}
pub(crate) use write_through;

write_through!(Rewind);

/// Whether bytes moved on a connection. The data path only bumps a counter (no clock read per
/// read or write); the idle watcher samples it once per idle period, so a connection is closed
/// after between one and two idle periods without traffic.
#[derive(Debug, Clone, Default)]
pub(crate) struct Activity {
    moved: Arc<AtomicU64>,
}

impl Activity {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    fn touch(&self) {
        // Only change matters, not the count: a plain load/store is enough and cheaper than an
        // atomic read-modify-write; a lost increment still leaves the value changed.
        let v = self.moved.load(Ordering::Relaxed);
        self.moved.store(v.wrapping_add(1), Ordering::Relaxed);
    }

    /// Resolves once a whole `idle` period passes with nothing moving.
    pub(crate) async fn idle_for(&self, idle: Duration) {
        loop {
            let before = self.moved.load(Ordering::Relaxed);
            tokio::time::sleep(idle).await;
            if self.moved.load(Ordering::Relaxed) == before {
                return;
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// Records read and write activity on the wrapped stream.
    #[derive(Debug)]
    pub(crate) struct Tracked<T> {
        #[pin]
        inner: T,
        activity: Activity,
    }
}

impl<T> Tracked<T> {
    pub(crate) fn new(inner: T, activity: Activity) -> Self {
        Tracked { inner, activity }
    }
}

impl<T: AsyncRead> AsyncRead for Tracked<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let res = this.inner.poll_read(cx, buf);
        if buf.filled().len() != before {
            this.activity.touch();
        }
        res
    }
}

impl<T: AsyncWrite> AsyncWrite for Tracked<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        let res = this.inner.poll_write(cx, buf);
        if matches!(res, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        res
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        let res = this.inner.poll_write_vectored(cx, bufs);
        if matches!(res, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        res
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

/// Copies both ways until both directions have seen EOF (each EOF is passed on as a write
/// shutdown, so half-closed protocols keep working), an error occurs, or the pair stays idle.
pub(crate) async fn splice<A, B>(a: A, b: B, idle: Duration) -> Result<(), &'static str>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Activity::new();
    let mut a = Tracked::new(a, activity.clone());
    let mut b = b;
    tokio::select! {
        res = tokio::io::copy_bidirectional(&mut a, &mut b) => match res {
            Ok(_) => Ok(()),
            Err(_) => Err("stream error"),
        },
        () = activity.idle_for(idle) => Err("idle timeout"),
    }
}
