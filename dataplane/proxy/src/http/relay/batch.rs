//! Socket reads and writes, sized and batched so that a kept-alive exchange costs about the
//! system calls the kernel needs (issue 49): a read asks for what is due, or for what recent
//! reads showed arrives at once, and what has come goes out in one (vectored) write.
//!
//! tokio learns that a socket is drained from a read shorter than its buffer, or from one that
//! would block (`PollEvented::poll_read` clears the readiness then); until the next epoll event
//! a read attempt returns `Pending` without a system call. Two things follow. A read that filled
//! its buffer says the socket probably holds more, so one that does not wait may follow at once
//! ([`RecvBuf::read_now`]): it finds the rest, or costs nothing. And a read that ends a response
//! should be shorter than its buffer, or the socket still looks readable: the pool then drops it
//! as out of step (`pool::readable`), and the next wait for it costs a read that would block
//! ([`due`]).

use std::io::{self, IoSlice};
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::task::coop::unconstrained;
use tokio::time::timeout;

/// The first read of a connection's responses, and the least the adaptive size falls back to
/// (hyper's `INIT_BUFFER_SIZE`).
pub(super) const READ_MIN: usize = 8 * 1024;
/// The most one read asks for, and the most response bytes held before they are written: the
/// smallest power of two above a 64 KiB body and its head, so such a response is read in one
/// call, as hyper does. Larger reads save little (a system call costs about what copying a few
/// KiB does), and 64 connections streaming at once hold at most 8 MiB with it (the RSS goal is
/// 20 MiB at 5 000 rps on 64 connections); hyper allows about 400 KiB.
pub(super) const READ_MAX: usize = 128 * 1024;

pub(super) enum IoFail {
    Client,
    Upstream,
}

/// How much to read when `left` more bytes are due and at most `room` fit: one more than is due,
/// so that the read which completes the body is short (tokio then knows the socket drained, see
/// the module comment) and shows a byte sent past the end if there is one; where that does not
/// fit, less than is due, never exactly it. 0: nothing fits.
pub(super) fn due(left: u64, room: usize) -> usize {
    let want = usize::try_from(left)
        .unwrap_or(usize::MAX)
        .saturating_add(1);
    if want <= room {
        want
    } else {
        // Here `left >= room`: at most `left - 1`.
        room.min(want.saturating_sub(2))
    }
}

/// The size of a read whose length nothing else tells: hyper's adaptive strategy
/// (`ReadStrategy::Adaptive`). A read that fills it doubles it, up to [`READ_MAX`]; two reads in
/// a row under half of it halve it, down to [`READ_MIN`].
#[derive(Debug)]
pub(super) struct ReadSize {
    next: usize,
    shrink: bool,
}

impl ReadSize {
    pub(super) fn new() -> Self {
        ReadSize {
            next: READ_MIN,
            shrink: false,
        }
    }

    pub(super) fn get(&self) -> usize {
        self.next
    }

    /// Learns from a read of `n` bytes.
    pub(super) fn record(&mut self, n: usize) {
        if n >= self.next {
            self.next = (self.next * 2).min(READ_MAX);
            self.shrink = false;
        } else if n < self.next / 2 {
            if self.shrink {
                self.next = (self.next / 2).max(READ_MIN);
            }
            self.shrink = !self.shrink;
        } else {
            self.shrink = false;
        }
    }
}

/// Bytes read from a socket and not yet relayed. Reads ask for room and get exactly that
/// allocated when the buffer has to grow, so the allocation's size is known and bounded by the
/// largest read plus what is held; [`RecvBuf::settle`] gives a large allocation back once
/// exchanges stop needing it.
pub(super) struct RecvBuf {
    bytes: BytesMut,
    /// The size of `bytes`' allocation (`capacity()` leaves out what `advance` skipped).
    alloc: usize,
    /// The last read filled what it asked for: the socket likely holds more.
    full: bool,
    /// The most bytes held plus room asked for since the last `settle`.
    used: usize,
    /// The last `settle` found the allocation more than twice what its exchange used.
    oversized: bool,
}

impl std::ops::Deref for RecvBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl RecvBuf {
    pub(super) fn new() -> Self {
        RecvBuf {
            bytes: BytesMut::new(),
            alloc: 0,
            full: false,
            used: 0,
            oversized: false,
        }
    }

    /// The size of the allocation behind the buffer.
    #[cfg(test)]
    pub(super) fn allocated(&self) -> usize {
        self.alloc
    }

    pub(super) fn full(&self) -> bool {
        self.full
    }

    pub(super) fn advance(&mut self, n: usize) {
        self.bytes.advance(n);
    }

    pub(super) fn truncate(&mut self, n: usize) {
        self.bytes.truncate(n);
    }

    /// Empties the buffer; the next read lands at the start of the allocation (reclaiming what
    /// `advance` skipped copies nothing when nothing is held), so reads that follow it without
    /// a write in between fit in what is allocated.
    pub(super) fn clear(&mut self) {
        self.bytes.clear();
        let _ = self.bytes.try_reclaim(self.alloc);
    }

    /// Makes room for `room` more bytes: in what is allocated if it can be reclaimed cheaply,
    /// otherwise in a new allocation of exactly what is held plus `room`.
    fn make_room(&mut self, room: usize) {
        let len = self.bytes.len();
        self.used = self.used.max(len + room);
        if self.bytes.capacity() - len >= room || self.bytes.try_reclaim(room) {
            return;
        }
        let mut grown = BytesMut::with_capacity(len + room);
        grown.extend_from_slice(&self.bytes);
        self.alloc = grown.capacity();
        self.bytes = grown;
    }

    /// One read of at most `size` bytes, appended; `Ok(0)` is EOF. Waits at most `idle`.
    pub(super) async fn read<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        size: usize,
        idle: Duration,
    ) -> io::Result<usize> {
        // A read of 0 bytes would look like EOF.
        let size = size.max(1);
        self.make_room(size);
        let read = timeout(idle, r.read_buf(&mut (&mut self.bytes).limit(size))).await;
        let n = match read {
            Ok(r) => r?,
            Err(_) => return Err(io::ErrorKind::TimedOut.into()),
        };
        self.full = n == size;
        Ok(n)
    }

    /// A read of at most `size` bytes that does not wait: `None` if nothing is there yet. On a
    /// socket tokio knows to be drained that costs no system call; the task is not woken for
    /// what comes later (the noop waker), since it waits for something else meanwhile.
    pub(super) fn read_now<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        size: usize,
    ) -> Option<io::Result<usize>> {
        let size = size.max(1);
        self.make_room(size);
        let mut limited = (&mut self.bytes).limit(size);
        let mut cx = Context::from_waker(Waker::noop());
        // Outside tokio's per-task budget: a spent budget would make the read `Pending` without
        // looking at the socket, and `None` would then claim a drained socket that may hold bytes.
        let polled = pin!(unconstrained(r.read_buf(&mut limited))).poll(&mut cx);
        let n = match polled {
            Poll::Pending => {
                self.full = false;
                return None;
            }
            Poll::Ready(Err(e)) => {
                self.full = false;
                return Some(Err(e));
            }
            Poll::Ready(Ok(n)) => n,
        };
        self.full = n == size;
        Some(Ok(n))
    }

    /// Ends an exchange: an allocation more than twice what each of the last two exchanges used
    /// (bytes held plus room asked for, which follows [`ReadSize`]) is given back, and the next
    /// read allocates what it asks for. So a connection does not keep the buffer of one large
    /// response for its life, and sizes that alternate do not allocate every time. What is held
    /// is kept.
    pub(super) fn settle(&mut self) {
        let used = std::mem::take(&mut self.used)
            .max(self.bytes.len())
            .max(READ_MIN);
        if self.alloc <= 2 * used {
            self.oversized = false;
            return;
        }
        if !std::mem::replace(&mut self.oversized, true) {
            return;
        }
        self.oversized = false;
        let mut kept = BytesMut::new();
        if !self.bytes.is_empty() {
            kept = BytesMut::with_capacity(self.bytes.len());
            kept.extend_from_slice(&self.bytes);
        }
        self.alloc = kept.capacity();
        self.bytes = kept;
    }
}

/// Writes `parts` in order, in one vectored write where the stream takes them (a head and a
/// body cost one system call); a partial write goes on from where it stopped. Empty parts are
/// left out, so that a lone part is a plain write (`send`, as before there were parts). A stream
/// that does not write vectors (`is_write_vectored`, e.g. TLS) takes the parts in turn: its
/// default `poll_write_vectored` writes the first non-empty one. Waits at most `idle` in all.
pub(super) async fn write_parts<W: AsyncWrite + Unpin, const N: usize>(
    w: &mut W,
    parts: [&[u8]; N],
    idle: Duration,
) -> io::Result<()> {
    let mut iov = parts.map(IoSlice::new);
    // The non-empty parts to the front, in order.
    let mut k = 0;
    for i in 0..N {
        if !iov[i].is_empty() {
            iov.swap(k, i);
            k += 1;
        }
    }
    let all = async {
        let mut rest = &mut iov[..k];
        while let Some(first) = rest.first() {
            let n = if rest.len() == 1 {
                w.write(first).await?
            } else {
                w.write_vectored(rest).await?
            };
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut rest, n);
        }
        Ok(())
    };
    match timeout(idle, all).await {
        Ok(r) => r,
        Err(_) => Err(io::ErrorKind::TimedOut.into()),
    }
}

/// Forwards the `left` request body bytes still to come from the client, read into `inb` in
/// reads sized by what is left (one read takes all the socket holds of it) and each written
/// upstream as it comes. Bytes read past the body begin the client's next request: they go to
/// `rest` (empty here: all it held was body).
pub(super) async fn copy_body<R, W>(
    client: &mut R,
    inb: &mut RecvBuf,
    rest: &mut BytesMut,
    up: &mut W,
    mut left: u64,
    idle: Duration,
) -> Result<(), IoFail>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    while left > 0 {
        inb.clear();
        match inb.read(client, due(left, READ_MAX), idle).await {
            Ok(n) if n > 0 => {}
            _ => return Err(IoFail::Client),
        }
        let take = usize::try_from(left).unwrap_or(usize::MAX).min(inb.len());
        write_parts(up, [&inb[..take]], idle)
            .await
            .map_err(|_| IoFail::Upstream)?;
        left -= take as u64;
        rest.extend_from_slice(&inb[take..]);
    }
    Ok(())
}
