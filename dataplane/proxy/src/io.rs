//! I/O helpers: replaying sniffed bytes, recording activity for idle timeouts, and splicing two
//! streams together.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
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

/// The most [`Coalesce`] holds before it writes without waiting for the next poll.
const COALESCE_MAX: usize = 64 * 1024;
/// Buffer capacity [`Coalesce`] keeps between bursts; a larger one is freed once written, so an
/// idle connection holds little.
const COALESCE_KEEP: usize = 16 * 1024;

pin_project_lite::pin_project! {
    /// Write coalescing for HTTP/2 connections. h2 chains every DATA payload over 256 bytes to
    /// its buffer and then flushes the socket before it takes the next frame: one write system
    /// call per frame, so 16 responses ready at once cost 16 writes (`perf/results/
    /// flamegraphs.md`). Once a poll of the connection flushes more than once (a burst), this
    /// adapter holds what the connection writes and flushes from then on, and sends it in one
    /// write when the connection next reads, at the start of its next poll; it stays in that
    /// mode while the polls keep flushing more than once. A deferred flush wakes the task, so
    /// that poll comes straight after the tasks that are ready now (which may add frames of
    /// their own). A lone flush (one response at a time, the common case at low load) is
    /// written at once, as h2 would: deferring it would cost a task poll and coalesce nothing.
    /// It also writes when it holds [`COALESCE_MAX`] bytes, and before a shutdown. Reads never
    /// wait for that write: if the socket is full, the write waits for writability and the
    /// read goes on.
    #[derive(Debug)]
    pub(crate) struct Coalesce<T> {
        #[pin]
        inner: T,
        buf: Vec<u8>,
        // Bytes of `buf` already written.
        sent: usize,
        // A flush was deferred and the task woken for it.
        owed: bool,
        // Flushes of held data since the connection last read (saturating), and in the poll
        // before that: more than one means a burst.
        flushes: u8,
        last_flushes: u8,
    }
}

impl<T> Coalesce<T> {
    pub(crate) fn new(inner: T) -> Self {
        Coalesce {
            inner,
            buf: Vec::new(),
            sent: 0,
            owed: false,
            flushes: 0,
            last_flushes: 0,
        }
    }
}

impl<T: AsyncWrite> Coalesce<T> {
    /// Writes everything held.
    fn poll_send(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut this = self.project();
        while *this.sent < this.buf.len() {
            let n = ready!(this.inner.as_mut().poll_write(cx, &this.buf[*this.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *this.sent += n;
        }
        if this.buf.capacity() > COALESCE_KEEP {
            *this.buf = Vec::new();
        } else {
            this.buf.clear();
        }
        *this.sent = 0;
        *this.owed = false;
        Poll::Ready(Ok(()))
    }

    /// Makes room for `len` more bytes: writes what is held first if they would not fit.
    /// Ready(false): write these `len` bytes straight through, nothing is held before them.
    /// That is the case for a write of [`COALESCE_KEEP`] or more when nothing is held, since a
    /// bulk transfer gains nothing from the copy.
    fn poll_room(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        len: usize,
    ) -> Poll<io::Result<bool>> {
        let held = self.buf.len() - self.sent;
        if held == 0 {
            return Poll::Ready(Ok(len < COALESCE_KEEP));
        }
        if held + len > COALESCE_MAX {
            ready!(self.as_mut().poll_send(cx))?;
            return Poll::Ready(Ok(len < COALESCE_KEEP));
        }
        Poll::Ready(Ok(true))
    }
}

impl<T: AsyncRead + AsyncWrite> AsyncRead for Coalesce<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.buf.len() > self.sent {
            // Pending: the socket is full and the task will be woken when it drains; an error
            // shows again on the next write.
            let _ = self.as_mut().poll_send(cx);
        }
        let this = self.project();
        // A read starts the connection's next poll (it may read several frames before it
        // writes again).
        if *this.flushes > 0 {
            *this.last_flushes = std::mem::take(this.flushes);
        }
        this.inner.poll_read(cx, buf)
    }
}

impl<T: AsyncWrite> AsyncWrite for Coalesce<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if !ready!(self.as_mut().poll_room(cx, data.len()))? {
            return self.project().inner.poll_write(cx, data);
        }
        self.project().buf.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let len = bufs.iter().map(|b| b.len()).sum();
        if !ready!(self.as_mut().poll_room(cx, len))? {
            return self.project().inner.poll_write_vectored(cx, bufs);
        }
        let buf = self.project().buf;
        for b in bufs {
            buf.extend_from_slice(b);
        }
        Poll::Ready(Ok(len))
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.buf.len() == self.sent {
            return self.project().inner.poll_flush(cx);
        }
        let burst = {
            let this = self.as_mut().project();
            *this.flushes = this.flushes.saturating_add(1);
            *this.flushes > 1 || *this.last_flushes > 1
        };
        if !burst {
            ready!(self.as_mut().poll_send(cx))?;
            return self.project().inner.poll_flush(cx);
        }
        let this = self.project();
        if !*this.owed {
            *this.owed = true;
            cx.waker().wake_by_ref();
        }
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.as_mut().poll_send(cx))?;
        self.project().inner.poll_shutdown(cx)
    }
}

/// Copies both ways until both directions have seen EOF (each EOF is passed on as a write
/// shutdown, so half-closed protocols keep working), an error occurs, or the pair stays idle.
/// On success, the bytes copied from `a` to `b` and from `b` to `a`.
pub(crate) async fn splice<A, B>(a: A, b: B, idle: Duration) -> Result<(u64, u64), &'static str>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Activity::new();
    let mut a = Tracked::new(a, activity.clone());
    let mut b = b;
    tokio::select! {
        res = tokio::io::copy_bidirectional(&mut a, &mut b) => match res {
            Ok(counts) => Ok(counts),
            Err(_) => Err("stream error"),
        },
        () = activity.idle_for(idle) => Err("idle timeout"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::task::Wake;

    use super::*;

    /// A socket that records each write it gets and has `input` to read.
    #[derive(Default)]
    struct Wire {
        writes: Arc<Mutex<Vec<Vec<u8>>>>,
        input: Vec<u8>,
        shut: bool,
    }

    impl AsyncRead for Wire {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let n = self.input.len().min(buf.remaining());
            buf.put_slice(&self.input[..n]);
            self.input.drain(..n);
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for Wire {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            data: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.writes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(data.to_vec());
            Poll::Ready(Ok(data.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.shut = true;
            Poll::Ready(Ok(()))
        }
    }

    #[derive(Default)]
    struct CountWakes(AtomicU64);

    impl Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn write(c: &mut Coalesce<Wire>, cx: &mut Context<'_>, data: &[u8]) {
        let r = Pin::new(&mut *c).poll_write(cx, data);
        assert!(matches!(r, Poll::Ready(Ok(n)) if n == data.len()), "{r:?}");
    }

    fn flush(c: &mut Coalesce<Wire>, cx: &mut Context<'_>) {
        assert!(matches!(
            Pin::new(&mut *c).poll_flush(cx),
            Poll::Ready(Ok(()))
        ));
    }

    /// One poll of a connection as h2 makes it: a read, then per frame a write of its head, a
    /// vectored write of head and payload, and a flush.
    fn poll_cycle(c: &mut Coalesce<Wire>, cx: &mut Context<'_>, frames: &[&[u8]]) {
        let mut space = [0u8; 16];
        let mut rb = ReadBuf::new(&mut space);
        assert!(matches!(
            Pin::new(&mut *c).poll_read(cx, &mut rb),
            Poll::Ready(Ok(()))
        ));
        for frame in frames {
            write(c, cx, frame);
            let iov = [io::IoSlice::new(b"+")];
            assert!(matches!(
                Pin::new(&mut *c).poll_write_vectored(cx, &iov),
                Poll::Ready(Ok(1))
            ));
            flush(c, cx);
        }
    }

    #[test]
    fn a_lone_flush_writes_at_once_and_a_burst_goes_out_in_one_write_at_the_next_read() {
        let wakes = Arc::new(CountWakes::default());
        let waker = std::task::Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let wire = Wire::default();
        let writes = wire.writes.clone();
        let mut c = Coalesce::new(wire);
        let written = || writes.lock().unwrap().clone();
        let woken = || wakes.0.load(Ordering::Relaxed);

        // One response per poll (low load): written at once, as h2 alone would, no wake.
        poll_cycle(&mut c, &mut cx, &[b"a"]);
        poll_cycle(&mut c, &mut cx, &[b"b"]);
        assert_eq!(written(), vec![b"a+".to_vec(), b"b+".to_vec()]);
        assert_eq!(woken(), 0);

        // A burst: the first frame goes out, the rest are held, and the task is woken once.
        poll_cycle(&mut c, &mut cx, &[b"one", b"two", b"three"]);
        assert_eq!(written().len(), 3);
        assert_eq!(written()[2], b"one+");
        assert_eq!(woken(), 1, "one wake for the deferred flush");

        // The next poll starts with a read: what is held goes out first, in one write. After a
        // burst, that poll's frames are held from the first one.
        poll_cycle(&mut c, &mut cx, &[b"four", b"five"]);
        assert_eq!(written().len(), 4);
        assert_eq!(written()[3], b"two+three+");
        assert_eq!(woken(), 2);

        // A poll with a single flush ends the burst mode for the one after it.
        poll_cycle(&mut c, &mut cx, &[b"six"]);
        assert_eq!(written()[4], b"four+five+");
        assert_eq!(woken(), 3);
        poll_cycle(&mut c, &mut cx, &[b"seven"]);
        assert_eq!(written()[5], b"six+");
        assert_eq!(written()[6], b"seven+");
        assert_eq!(woken(), 3);

        // Nothing held: a flush goes straight through and wakes nobody.
        flush(&mut c, &mut cx);
        assert_eq!(woken(), 3);
    }

    #[test]
    fn shutdown_a_full_buffer_and_bulk_writes_write_what_is_held() {
        let waker = std::task::Waker::from(Arc::new(CountWakes::default()));
        let mut cx = Context::from_waker(&waker);
        let wire = Wire::default();
        let writes = wire.writes.clone();
        let mut c = Coalesce::new(wire);
        let written = || writes.lock().unwrap().clone();

        // A bulk write with nothing held goes straight through, uncopied.
        let bulk = vec![5u8; COALESCE_KEEP];
        write(&mut c, &mut cx, &bulk);
        assert_eq!(written(), vec![bulk.clone()]);

        // Small writes are held until they would pass the maximum.
        let small = vec![7u8; COALESCE_KEEP - 1];
        for _ in 0..4 {
            write(&mut c, &mut cx, &small);
        }
        assert_eq!(written().len(), 1);
        write(&mut c, &mut cx, &small);
        assert_eq!(written().len(), 2);
        assert_eq!(written()[1], small.repeat(4));

        // A bulk write while something is held: held and bulk go out together if they fit.
        write(&mut c, &mut cx, &bulk);
        assert_eq!(written().len(), 2);

        write(&mut c, &mut cx, b"bye");
        assert!(matches!(
            Pin::new(&mut c).poll_shutdown(&mut cx),
            Poll::Ready(Ok(()))
        ));
        let mut last = small.clone();
        last.extend_from_slice(&bulk);
        last.extend_from_slice(b"bye");
        assert_eq!(written()[2], last);
        assert_eq!(written().len(), 3);
        assert!(c.inner.shut);
    }
}
