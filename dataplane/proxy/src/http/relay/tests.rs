//! The relay's reads and writes counted over an in-memory socket that keeps tokio's readiness
//! as a `TcpStream` on Linux does, so that what would be system calls shows deterministically:
//! how many reads and writes a response costs, that nothing waits for data before writing what
//! has come, that the read ending a response leaves the upstream reusable, and that a large
//! buffer is given back.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::BytesMut;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::batch::{READ_MAX, READ_MIN, ReadSize, RecvBuf, copy_body, due, write_parts};
use super::{Conn, Next, Plan, Stop};
use crate::conn::ConnMeta;
use crate::detect::Protocol;
use crate::metrics::Outcome;
use crate::pool::Upstream;
use crate::router::{Route, Router};
use crate::{Proxy, ProxyConfig};
use spur_runtime::Drain;

const IDLE: Duration = Duration::from_secs(10);

/// One end of an in-memory connection, with what would be system calls counted.
#[derive(Clone, Default)]
struct Sock(Arc<Mutex<State>>);

#[derive(Default)]
struct State {
    inbox: VecDeque<u8>,
    eof: bool,
    /// tokio's read readiness: set when bytes or EOF arrive, cleared by a read shorter than its
    /// buffer or one that would block (`PollEvented::poll_read`), until EOF. A read attempt
    /// without it costs no system call.
    ready: bool,
    waker: Option<Waker>,
    /// Read system calls: those that returned bytes or EOF, and those that would block.
    reads: usize,
    would_block: usize,
    /// Write system calls (`write` or `writev`), those of them that were `writev`, what they
    /// wrote, the most one takes.
    writes: usize,
    writevs: usize,
    written: Vec<u8>,
    write_max: Option<usize>,
    /// Whether writes are vectored (`is_write_vectored`).
    scalar: bool,
    shut: bool,
}

impl Sock {
    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn arrive(&self, data: &[u8]) {
        let mut s = self.state();
        s.inbox.extend(data);
        s.ready = true;
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    fn close(&self) {
        let mut s = self.state();
        s.eof = true;
        s.ready = true;
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    fn holding(data: &[u8]) -> Sock {
        let s = Sock::default();
        s.arrive(data);
        s
    }

    /// Read and write system calls so far, then reset.
    fn calls(&self) -> (usize, usize, usize) {
        let mut s = self.state();
        let c = (s.reads, s.would_block, s.writes);
        (s.reads, s.would_block, s.writes) = (0, 0, 0);
        c
    }

    fn take_written(&self) -> Vec<u8> {
        std::mem::take(&mut self.state().written)
    }
}

impl AsyncRead for Sock {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut s = self.state();
        if !s.ready {
            s.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        s.reads += 1;
        if s.inbox.is_empty() {
            if s.eof {
                return Poll::Ready(Ok(()));
            }
            s.would_block += 1;
            s.ready = false;
            s.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = buf.remaining().min(s.inbox.len());
        let bytes: Vec<u8> = s.inbox.drain(..n).collect();
        buf.put_slice(&bytes);
        // tokio never clears the readiness that EOF brings (`Ready::READ_CLOSED`).
        if buf.remaining() > 0 && !s.eof {
            s.ready = false;
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Sock {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut s = self.state();
        s.writes += 1;
        let n = data.len().min(s.write_max.unwrap_or(usize::MAX));
        s.written.extend_from_slice(&data[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.state().scalar {
            // What `AsyncWrite`'s default does.
            let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| b);
            return self.poll_write(cx, first);
        }
        let mut s = self.state();
        s.writes += 1;
        s.writevs += 1;
        let mut budget = s.write_max.unwrap_or(usize::MAX);
        let mut n = 0;
        for b in bufs {
            let k = b.len().min(budget);
            s.written.extend_from_slice(&b[..k]);
            (n, budget) = (n + k, budget - k);
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        !self.state().scalar
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.state().shut = true;
        Poll::Ready(Ok(()))
    }
}

struct NoRoutes;

impl Router for NoRoutes {
    fn route_http(&self, _: &ConnMeta, _: &mut http::request::Parts) -> Route {
        Route::Original
    }
}

fn proxy() -> Proxy {
    let proxy = Proxy::new(
        ProxyConfig::default(),
        Arc::new(NoRoutes),
        &mut Registry::default(),
    );
    proxy.unwrap_or_else(|e| panic!("{e}"))
}

fn addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8080))
}

fn meta() -> ConnMeta {
    ConnMeta::new(addr(), addr(), addr(), Protocol::Http1)
}

fn plan() -> Plan {
    Plan {
        upstream: Upstream::Original(addr()),
        outcome: Outcome::Baseline,
        body: 0,
        head: false,
        close: false,
        idempotent: true,
    }
}

/// Bytes whose order shows: a misplaced or repeated piece does not compare equal.
fn body(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8 ^ (i >> 8) as u8).collect()
}

fn fixed(body: &[u8]) -> Vec<u8> {
    let mut r = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
    r.extend_from_slice(body);
    r
}

/// `body` in chunks of `size`, then a trailer.
fn chunked(body: &[u8], size: usize) -> Vec<u8> {
    let mut r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for c in body.chunks(size) {
        r.extend_from_slice(format!("{:x};e=1\r\n", c.len()).as_bytes());
        r.extend_from_slice(c);
        r.extend_from_slice(b"\r\n");
    }
    r.extend_from_slice(b"0\r\nX-T: 1\r\n\r\n");
    r
}

fn until_close(body: &[u8]) -> Vec<u8> {
    let mut r = b"HTTP/1.1 200 OK\r\n\r\n".to_vec();
    r.extend_from_slice(body);
    r
}

/// What `Conn::forward` does once the request is sent: the first read, then the response.
async fn relay(
    conn: &mut Conn<'_>,
    client: &mut Sock,
    up: &mut Sock,
) -> Result<(Next, bool), Stop> {
    conn.ubuf.clear();
    let n = conn.read_response(up).await;
    assert!(matches!(n, Ok(n) if n > 0), "{n:?}");
    let r = conn.respond(client, up, &plan(), false).await;
    conn.ubuf.settle();
    r.map(|(next, _, reusable)| (next, reusable))
}

/// How many body bytes the client has got so far.
fn body_written(client: &Sock) -> usize {
    let s = client.state();
    let head = s.written.windows(4).position(|w| w == b"\r\n\r\n");
    head.map_or(0, |i| s.written.len() - i - 4)
}

/// The body the client got, after the head the relay wrote.
fn received(client: &Sock) -> Vec<u8> {
    let out = client.take_written();
    let end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(0, |i| i + 4);
    assert!(out.starts_with(b"HTTP/1.1 200 OK\r\n"), "{:?}", &out[..end]);
    out[end..].to_vec()
}

fn why(r: Result<(Next, bool), Stop>) -> &'static str {
    match r {
        Err(Stop::Close(why)) => why,
        Err(Stop::HandOver) => "handed over",
        Ok(_) => "relayed",
    }
}

#[tokio::test]
async fn a_large_response_here_at_once_costs_two_reads_then_one_and_one_write() {
    let (proxy, meta, drain) = (proxy(), meta(), Drain::new());
    let mut conn = Conn::new(&proxy.shared, &meta, &drain);
    let b = body(64 * 1024);
    let mut client = Sock::default();
    // A new connection reads 8 KiB first; that read is full, so the rest is read at once, and
    // head and body go out in one vectored write (before: reads of 8, 32 and 32 KiB, and a
    // write after each).
    let mut up = Sock::holding(&fixed(&b));
    let r = relay(&mut conn, &mut client, &mut up).await;
    assert!(matches!(r, Ok((Next::KeepAlive, true))), "{}", why(r));
    assert_eq!(received(&client), b);
    assert_eq!(up.calls(), (2, 0, 0), "upstream reads, would-blocks");
    assert_eq!(client.calls(), (0, 0, 1), "client writes");
    assert!(
        !up.state().ready,
        "the last read was short: the socket is known drained"
    );
    // The read size learns; from the fourth response on, one read takes it all.
    for i in 1..6 {
        let mut up = Sock::holding(&fixed(&b));
        let r = relay(&mut conn, &mut client, &mut up).await;
        assert!(matches!(r, Ok((Next::KeepAlive, true))), "{}", why(r));
        assert_eq!(received(&client), b);
        let (reads, would_block, _) = up.calls();
        assert_eq!(would_block, 0);
        assert!(
            reads <= if i < 3 { 2 } else { 1 },
            "response {i}: {reads} reads"
        );
        assert_eq!(client.calls(), (0, 0, 1));
    }
    assert!(conn.ubuf.allocated() <= READ_MAX);
}

#[tokio::test]
async fn every_size_and_framing_is_relayed_whole_at_once_or_in_pieces() {
    let (proxy, meta, drain) = (proxy(), meta(), Drain::new());
    let mut conn = Conn::new(&proxy.shared, &meta, &drain);
    let mut client = Sock::default();
    for size in [
        0,
        1,
        16 * 1024 - 1,
        16 * 1024,
        16 * 1024 + 1,
        64 * 1024,
        1 << 20,
    ] {
        let b = body(size);
        for (kind, resp) in [
            ("fixed", fixed(&b)),
            ("chunked", chunked(&b, 5000)),
            ("until close", until_close(&b)),
        ] {
            for piece in [usize::MAX, 3000] {
                let mut up = Sock::default();
                let feed = up.clone();
                let sent = async {
                    for p in resp.chunks(piece.min(resp.len())) {
                        feed.arrive(p);
                        tokio::task::yield_now().await;
                    }
                    if kind == "until close" {
                        feed.close();
                    }
                };
                let (r, ()) = tokio::join!(relay(&mut conn, &mut client, &mut up), sent);
                let what = format!("{kind} {size} in pieces of {piece}");
                let want = match kind {
                    "until close" => (Next::Close, false),
                    _ => (Next::KeepAlive, true),
                };
                match r {
                    Ok((next, reusable)) => {
                        assert_eq!(
                            (matches!(next, Next::Close), reusable),
                            (matches!(want.0, Next::Close), want.1),
                            "{what}"
                        );
                    }
                    Err(_) => panic!("{what}: {}", why(r)),
                }
                let got = received(&client);
                let want_body = match kind {
                    "chunked" => resp
                        [resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(0) + 4..]
                        .to_vec(),
                    _ => b.clone(),
                };
                assert!(
                    got == want_body,
                    "{what}: {} bytes, want {}",
                    got.len(),
                    want_body.len()
                );
                assert_eq!(up.state().would_block, 0, "{what}");
                assert_eq!(client.state().shut, kind == "until close", "{what}");
                client.state().shut = false;
                // Reads never ask for more than READ_MAX, nor hold more before writing.
                assert!(conn.ubuf.allocated() <= READ_MAX, "{what}");
            }
        }
    }
}

#[tokio::test]
async fn what_has_come_is_written_without_waiting_for_more() {
    let (proxy, meta, drain) = (proxy(), meta(), Drain::new());
    let mut conn = Conn::new(&proxy.shared, &meta, &drain);
    let mut client = Sock::default();
    let b = body(256 * 1024);
    let resp = fixed(&b);
    let head = resp.len() - b.len();
    let mut up = Sock::holding(&resp[..head + 1000]);
    let feed = (up.clone(), client.clone());
    let paced = async {
        let (feed, client) = feed;
        let mut at = head + 1000;
        while at < resp.len() {
            // Everything sent so far reaches the client before anything more is sent.
            tokio::time::timeout(IDLE, async {
                while body_written(&client) < at - head {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await
            .unwrap_or_else(|_| panic!("the relay waited for more than the {at} bytes here"));
            let next = (at + 20_000).min(resp.len());
            feed.arrive(&resp[at..next]);
            at = next;
        }
    };
    let (r, ()) = tokio::join!(relay(&mut conn, &mut client, &mut up), paced);
    assert!(matches!(r, Ok((Next::KeepAlive, true))), "{}", why(r));
    assert_eq!(received(&client), b);
    // One read and one write per piece, none that would block.
    let (reads, would_block, _) = up.calls();
    let pieces = (b.len() - 1000).div_ceil(20_000) + 1;
    assert_eq!((reads, would_block), (pieces, 0));
    assert_eq!(client.calls(), (0, 0, pieces));
}

#[tokio::test]
async fn the_read_ending_a_response_leaves_the_upstream_reusable_or_shows_it_is_not() {
    let (proxy, meta, drain) = (proxy(), meta(), Drain::new());
    let mut conn = Conn::new(&proxy.shared, &meta, &drain);
    let mut client = Sock::default();
    // A response of exactly the first read's size fills it: one read that does not wait
    // learns the socket is drained (and tokio clears its readiness), or finds bytes past it.
    let head = fixed(&body(1000)).len() - 1000;
    let exact = fixed(&body(READ_MIN - head));
    assert_eq!(exact.len(), READ_MIN);
    let mut up = Sock::holding(&exact);
    let r = relay(&mut conn, &mut client, &mut up).await;
    assert!(matches!(r, Ok((Next::KeepAlive, true))), "{}", why(r));
    assert_eq!(up.calls(), (2, 1, 0));
    assert!(!up.state().ready);
    client.take_written();

    // Bytes past the end, in the same read or the next: out of step, not reused.
    let mut conn = Conn::new(&proxy.shared, &meta, &drain);
    for extra in [&b"HTTP/1.1 200 OK\r\n"[..], b"x"] {
        let mut resp = exact.clone();
        resp.extend_from_slice(extra);
        let mut up = Sock::holding(&resp);
        let r = relay(&mut conn, &mut client, &mut up).await;
        assert!(matches!(r, Ok((Next::KeepAlive, false))), "{}", why(r));
        client.take_written();
    }
    // A fixed body is read with one byte to spare: the read ending it is short.
    let mut up = Sock::holding(&fixed(&body(100_000)));
    let r = relay(&mut conn, &mut client, &mut up).await;
    assert!(matches!(r, Ok((Next::KeepAlive, true))), "{}", why(r));
    assert_eq!(up.calls().1, 0);
}

#[tokio::test]
async fn a_broken_body_is_cut_after_what_was_valid() {
    let (proxy, meta, drain) = (proxy(), meta(), Drain::new());
    let mut conn = Conn::new(&proxy.shared, &meta, &drain);
    let mut client = Sock::default();
    // Invalid framing in a read that batches with the head's: what earlier reads brought still
    // goes out first, as when each read was written on its own, and nothing of that read.
    let good = chunked(&body(20_000), 20_000);
    let cut = good.len() - b"0\r\nX-T: 1\r\n\r\n".len();
    let mut resp = good[..cut].to_vec();
    resp.extend_from_slice(b"zz\r\n");
    let mut up = Sock::holding(&resp);
    let r = relay(&mut conn, &mut client, &mut up).await;
    assert_eq!(why(r), "invalid response body framing");
    let head = good.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(0) + 4;
    assert_eq!(received(&client), good[head..READ_MIN]);
    assert!(cut > READ_MIN);

    // The upstream closing mid-body, in a read that batches or in a later one.
    for (first, later) in [(30_000, None), (2000, Some(30_000))] {
        let resp = fixed(&body(100_000));
        let up = Sock::holding(&resp[..first]);
        let feed = up.clone();
        let mut up = up;
        let closer = async {
            tokio::task::yield_now().await;
            if let Some(later) = later {
                feed.arrive(&resp[first..later]);
                tokio::task::yield_now().await;
            }
            feed.close();
        };
        let (r, ()) = tokio::join!(relay(&mut conn, &mut client, &mut up), closer);
        assert_eq!(why(r), "upstream closed mid-body");
        // What came before the close was written.
        let head = resp.len() - 100_000;
        assert_eq!(received(&client), resp[head..later.unwrap_or(first)]);
    }
}

#[tokio::test]
async fn a_large_buffer_is_given_back_when_responses_are_small_again() {
    let (proxy, meta, drain) = (proxy(), meta(), Drain::new());
    let mut conn = Conn::new(&proxy.shared, &meta, &drain);
    let mut client = Sock::default();
    let big = chunked(&body(1 << 20), 64 * 1024);
    let small = fixed(&body(1024));
    for _ in 0..3 {
        let mut up = Sock::holding(&big);
        let r = relay(&mut conn, &mut client, &mut up).await;
        assert!(matches!(r, Ok((_, true))), "{}", why(r));
        client.take_written();
    }
    let grown = conn.ubuf.allocated();
    assert!(grown > 64 * 1024 && grown <= READ_MAX, "{grown}");
    // Sizes that alternate keep the buffer (no allocation per exchange)...
    for resp in [&small, &big, &small, &big] {
        let mut up = Sock::holding(resp);
        let r = relay(&mut conn, &mut client, &mut up).await;
        assert!(matches!(r, Ok((_, true))), "{}", why(r));
        assert_eq!(conn.ubuf.allocated(), grown);
        client.take_written();
    }
    // ...and a run of small ones gives it back.
    let mut given = None;
    for i in 0..16 {
        let mut up = Sock::holding(&small);
        let r = relay(&mut conn, &mut client, &mut up).await;
        assert!(matches!(r, Ok((_, true))), "{}", why(r));
        client.take_written();
        if conn.ubuf.allocated() <= 2 * READ_MIN {
            given = Some(i);
            break;
        }
    }
    assert!(matches!(given, Some(i) if i < 12), "{given:?}");
}

#[test]
fn reads_are_sized_to_what_is_due_and_never_exactly() {
    assert_eq!(due(100, READ_MAX), 101);
    assert_eq!(due(0, READ_MAX), 1);
    assert_eq!(due(READ_MAX as u64 - 1, READ_MAX), READ_MAX);
    // A read of exactly what is left would end full, the socket still deemed readable.
    assert_eq!(due(READ_MAX as u64, READ_MAX), READ_MAX - 1);
    assert_eq!(due(1 << 30, READ_MAX), READ_MAX);
    assert_eq!(due(1, 1), 0);
    assert_eq!(due(0, 0), 0);

    let mut size = ReadSize::new();
    assert_eq!(size.get(), READ_MIN);
    for want in [16, 32, 64, 128, 128] {
        size.record(size.get());
        assert_eq!(size.get(), want * 1024);
    }
    // Halved after two small reads in a row, not one; a read in range cancels it.
    size.record(10);
    assert_eq!(size.get(), READ_MAX);
    size.record(READ_MAX / 2);
    size.record(10);
    assert_eq!(size.get(), READ_MAX);
    size.record(10);
    assert_eq!(size.get(), READ_MAX / 2);
    for _ in 0..20 {
        size.record(0);
    }
    assert_eq!(size.get(), READ_MIN);
}

#[tokio::test]
async fn parts_go_out_in_one_vectored_write_and_partial_writes_go_on() {
    let parts: [&[u8]; 3] = [b"head ", b"", b"body"];
    let mut s = Sock::default();
    write_parts(&mut s, parts, IDLE)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.calls().2, 1);
    assert_eq!(s.take_written(), b"head body");
    for (scalar, max, writes) in [(false, 3, 3), (true, usize::MAX, 2), (true, 3, 4)] {
        let mut s = Sock::default();
        (s.state().scalar, s.state().write_max) = (scalar, Some(max));
        write_parts(&mut s, parts, IDLE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.take_written(), b"head body", "{scalar} {max}");
        assert_eq!(s.calls().2, writes, "{scalar} {max}");
    }
    let mut s = Sock::default();
    write_parts(&mut s, [&b""[..], b""], IDLE)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.calls().2, 0, "nothing to write, no write");
    // One part that is not empty is a plain write (`send`), wherever it is.
    for parts in [[&b"head"[..], b"", b""], [b"", b"", b"head"]] {
        write_parts(&mut s, parts, IDLE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.take_written(), b"head");
        assert_eq!(
            (s.calls().2, std::mem::take(&mut s.state().writevs)),
            (1, 0)
        );
    }
}

#[tokio::test]
async fn a_request_body_here_at_once_is_read_and_written_once() {
    let b = body(64 * 1024);
    let mut next = b"GET /next HTTP/1.1\r\n".to_vec();
    let mut sent = b.clone();
    sent.append(&mut next);
    let mut client = Sock::holding(&sent);
    let mut up = Sock::default();
    let (mut inb, mut rest) = (RecvBuf::new(), BytesMut::new());
    let r = copy_body(
        &mut client,
        &mut inb,
        &mut rest,
        &mut up,
        b.len() as u64,
        IDLE,
    )
    .await;
    assert!(r.is_ok());
    assert_eq!(up.take_written(), b);
    // Before: four 16 KiB reads and four writes.
    assert_eq!((client.calls().0, up.calls().2), (1, 1));
    // One byte past the body was read, and kept for the next head.
    assert_eq!(&rest[..], b"G");
    assert!(client.state().ready, "the next request is still there");
    // With nothing after the body, the read that ends it is short: the socket is known drained.
    let mut client = Sock::holding(&b);
    rest.clear();
    let r = copy_body(
        &mut client,
        &mut inb,
        &mut rest,
        &mut up,
        b.len() as u64,
        IDLE,
    )
    .await;
    assert!(r.is_ok() && rest.is_empty());
    assert_eq!(up.take_written(), b);
    assert!(!client.state().ready);
}

/// The read that settles whether an upstream is drained looks at the socket even when the task
/// spent its tokio budget (a long response relayed without blocking): otherwise it would report
/// "nothing there" for a socket holding bytes, and the pool could take that socket again.
#[tokio::test]
async fn a_read_that_does_not_wait_sees_bytes_after_the_task_spent_its_budget() {
    use std::future::Future as _;
    use tokio::io::AsyncWriteExt;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (mut server, _) = listener.accept().await.unwrap();
    client.write_all(b"stray").await.unwrap();
    server.readable().await.unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    while tokio::task::coop::has_budget_remaining() {
        let _ = std::pin::pin!(tokio::task::coop::consume_budget()).poll(&mut cx);
    }
    let mut buf = RecvBuf::new();
    assert!(matches!(buf.read_now(&mut server, READ_MIN), Some(Ok(5))));
    assert_eq!(&buf[..], b"stray");
}
