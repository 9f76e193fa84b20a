//! The HTTP/1.1 relay (dataplane/proxy/src/http/relay.rs) against a scripted upstream that
//! answers with exact bytes: every response framing is relayed to its end and no further,
//! ambiguous responses become 502s, the proxy's header edits reach the upstream, upstream
//! connections are reused (and a closed one is not), bodies of every size arrive whole however
//! they are framed or paced, and what the relay does not forward byte for byte goes to the hyper
//! path, counted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use spur_e2e::{metrics, sample, sidecar_for};
use spur_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

const BOUND: Duration = Duration::from_secs(10);

/// Body sizes around the relay's buffer and write sizes (16 KiB), one that takes one read at
/// most (64 KiB, the largest request body the relay forwards), and one that streams (1 MiB).
const SIZES: [usize; 7] = [
    0,
    1,
    16 * 1024 - 1,
    16 * 1024,
    16 * 1024 + 1,
    64 * 1024,
    1 << 20,
];

/// `n` body bytes whose order shows: a misplaced or repeated piece does not compare equal.
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8 ^ (i >> 8) as u8).collect()
}

/// The `/bytes/N` family: `N` pattern bytes with a length, chunked (in chunks of 10 000 bytes,
/// with an extension and a trailer), or until close.
fn sized(path: &str) -> Option<(Vec<u8>, bool)> {
    let (kind, n) = path.rsplit_once('/')?;
    let body = pattern(n.parse().ok()?);
    let mut r = b"HTTP/1.1 200 OK\r\n".to_vec();
    match kind {
        "/bytes" | "/slow-bytes" => {
            r.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
            r.extend_from_slice(&body);
            Some((r, false))
        }
        "/chunked-bytes" => {
            r.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
            for c in body.chunks(10_000) {
                r.extend_from_slice(format!("{:x};n=1\r\n", c.len()).as_bytes());
                r.extend_from_slice(c);
                r.extend_from_slice(b"\r\n");
            }
            r.extend_from_slice(b"0\r\nX-Trailer: t\r\n\r\n");
            Some((r, false))
        }
        "/close-bytes" => {
            r.extend_from_slice(b"\r\n");
            r.extend_from_slice(&body);
            Some((r, true))
        }
        _ => None,
    }
}

/// What the scripted upstream answers to a request for `path` (the request head is at hand for
/// `/echo-head`, its body for `/echo-body`).
fn script(path: &str, head: &str, body: &[u8]) -> (Vec<u8>, bool) {
    let fixed = |s: &str| (s.as_bytes().to_vec(), false);
    if let Some(r) = sized(path) {
        return r;
    }
    match path {
        "/echo-body" => {
            let mut r =
                format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
            r.extend_from_slice(body);
            (r, false)
        }
        "/chunked" => fixed(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
        ),
        "/close" => ("HTTP/1.1 200 OK\r\nX-A: a\r\n\r\nuntil close".into(), true),
        "/interim" => fixed(
            "HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        ),
        "/both" => fixed(
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ),
        "/two-lengths" => {
            fixed("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd")
        }
        "/bad-chunk" => fixed("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
        "/upgrade" => fixed("HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"),
        "/status-002" => fixed("HTTP/1.1 002 OK\r\nContent-Length: 0\r\n\r\n"),
        "/hop" => fixed(
            "HTTP/1.1 200 OK\r\nConnection: x-secret, keep-alive\r\nX-Secret: s\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\n\r\nok",
        ),
        "/head" => fixed("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"),
        "/204" => fixed("HTTP/1.1 204 No Content\r\n\r\n"),
        "/bye" => (
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbye".into(),
            true,
        ),
        _ => {
            let body = head.replace("\r\n", "\n");
            (
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .into_bytes(),
                false,
            )
        }
    }
}

/// Reads until `buf` holds at least `n` bytes; false at EOF.
async fn read_up_to(s: &mut TcpStream, buf: &mut Vec<u8>, n: usize) -> bool {
    while buf.len() < n {
        let mut chunk = [0u8; 16 * 1024];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
    }
    true
}

/// The value of the field `name` (lower case) in `head`.
fn field<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.split("\r\n").find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Reads until `buf` holds `pat`; the index just past it, or `None` at EOF.
async fn read_past(s: &mut TcpStream, buf: &mut Vec<u8>, pat: &[u8]) -> Option<usize> {
    loop {
        if let Some(i) = buf.windows(pat.len()).position(|w| w == pat) {
            return Some(i + pat.len());
        }
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// The scripted upstream; counts the connections it accepted.
async fn upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let Some(end) = read_past(&mut s, &mut buf, b"\r\n\r\n").await else {
                        return;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    buf.drain(..end);
                    // Chunked request bodies sent here are small ones: skip them.
                    if head
                        .to_ascii_lowercase()
                        .contains("transfer-encoding: chunked")
                    {
                        let Some(end) = read_past(&mut s, &mut buf, b"0\r\n\r\n").await else {
                            return;
                        };
                        buf.drain(..end);
                    }
                    let len = field(&head, "content-length").map_or(0, |v| v.parse().unwrap());
                    if !read_up_to(&mut s, &mut buf, len).await {
                        return;
                    }
                    let body: Vec<u8> = buf.drain(..len).collect();
                    let path = head.split(' ').nth(1).unwrap_or("").to_owned();
                    let (resp, close) = script(&path, &head, &body);
                    // `/slow-…`: the response in eight pieces, 5 ms apart.
                    let piece = if path.starts_with("/slow") {
                        resp.len().div_ceil(8)
                    } else {
                        resp.len().max(1)
                    };
                    for p in resp.chunks(piece) {
                        if s.write_all(p).await.is_err() {
                            return;
                        }
                        if piece < resp.len() {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    }
                    if close {
                        return;
                    }
                }
            });
        }
    });
    (addr, accepted)
}

/// Sends `req` on a new connection and reads until the proxy closes it.
async fn exchange(proxy: SocketAddr, req: &str) -> String {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    timeout(BOUND, s.read_to_end(&mut out))
        .await
        .expect("the proxy closed the connection")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n")
}

async fn setup() -> (spur_sidecar::Sidecar, Arc<AtomicUsize>) {
    let (app, accepted) = upstream().await;
    let sidecar = sidecar_for(
        app,
        ProxyConfig {
            drain_grace: Duration::from_secs(1),
            ..ProxyConfig::default()
        },
    )
    .await;
    (sidecar, accepted)
}

async fn handovers(sidecar: &spur_sidecar::Sidecar) -> f64 {
    let text = metrics(sidecar.admin_addr.unwrap()).await;
    sample(&text, "spur_http1_handovers_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_framing_is_relayed_to_its_end() {
    let (sidecar, _) = setup().await;
    let proxy = sidecar.inbound_addr;

    let r = exchange(proxy, &get("/chunked")).await;
    assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r:?}");
    assert!(r.contains("\r\nvia: 1.1 spur\r\n"), "{r:?}");
    assert!(r.contains("\r\nconnection: close\r\n"), "{r:?}");
    assert!(
        r.ends_with("\r\n\r\n5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"),
        "the chunks and trailer pass through as sent: {r:?}"
    );

    let r = exchange(proxy, &get("/close")).await;
    assert!(r.ends_with("\r\n\r\nuntil close"), "{r:?}");
    assert!(r.contains("X-A: a\r\n"), "{r:?}");

    let r = exchange(proxy, &get("/interim")).await;
    assert!(
        r.starts_with("HTTP/1.1 200 OK\r\n"),
        "interim responses are not forwarded: {r:?}"
    );
    assert!(r.ends_with("\r\n\r\nok"), "{r:?}");

    let r = exchange(proxy, &get("/hop")).await;
    assert!(r.ends_with("\r\n\r\nok"), "{r:?}");
    for gone in ["X-Secret", "Keep-Alive", "x-secret, keep-alive"] {
        assert!(!r.contains(gone), "{gone} is hop-by-hop: {r:?}");
    }

    let r = exchange(
        proxy,
        "HEAD /head HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n",
    )
    .await;
    // No body, and the `Date` the upstream did not send (RFC 9110 §6.6.1) after its fields.
    assert!(r.contains("Content-Length: 10\r\ndate: "), "{r:?}");
    assert!(
        r.ends_with(" GMT\r\nconnection: close\r\nvia: 1.1 spur\r\n\r\n"),
        "{r:?}"
    );

    let r = exchange(proxy, &get("/204")).await;
    assert!(r.starts_with("HTTP/1.1 204 No Content\r\n"), "{r:?}");
    assert!(r.ends_with("\r\n\r\n"), "{r:?}");

    // Several exchanges on one kept-alive client connection, each ending where its framing says.
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let req = "GET /chunked HTTP/1.1\r\nHost: app\r\n\r\nGET /interim HTTP/1.1\r\nHost: app\r\n\r\nGET /close HTTP/1.1\r\nHost: app\r\n\r\n";
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    timeout(BOUND, s.read_to_end(&mut out))
        .await
        .expect("a close-delimited response ends the client connection too")
        .unwrap();
    let text = String::from_utf8_lossy(&out);
    assert_eq!(text.matches("HTTP/1.1 200 OK\r\n").count(), 3, "{text:?}");
    assert!(text.ends_with("until close"), "{text:?}");
    assert_eq!(handovers(&sidecar).await, 0.0, "all of these were relayed");
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_or_broken_responses_are_answered_502() {
    let (sidecar, _) = setup().await;
    let proxy = sidecar.inbound_addr;
    for path in [
        "/both",
        "/two-lengths",
        "/bad-chunk",
        "/upgrade",
        "/status-002",
    ] {
        let r = exchange(proxy, &get(path)).await;
        assert!(
            r.starts_with("HTTP/1.1 502 Bad Gateway\r\n"),
            "{path}: {r:?}"
        );
        assert!(r.ends_with("spur: upstream unavailable\n"), "{path}: {r:?}");
    }
    // Framing fields are checked where no body follows, too.
    let r = exchange(
        proxy,
        "HEAD /both HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 502 Bad Gateway\r\n"), "HEAD: {r:?}");
    assert!(r.ends_with("\r\n\r\n"), "no body answers a HEAD: {r:?}");
    // A 502 leaves a kept-alive client connection usable.
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(b"GET /both HTTP/1.1\r\nHost: app\r\n\r\nGET /x HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    timeout(BOUND, s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 502 "), "{text:?}");
    assert!(text.contains("\nHTTP/1.1 200 OK\r\n"), "{text:?}");
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_sees_the_proxy_edits() {
    let (sidecar, _) = setup().await;
    let r = exchange(
        sidecar.inbound_addr,
        "GET /echo?q=1 HTTP/1.1\r\nHost: app\r\nConnection: keep-alive, close\r\nKeep-Alive: 5\r\nProxy-Authorization: secret\r\nTE: trailers, deflate\r\nX-Forwarded-For: 10.0.0.9\r\nUser-Agent: t\r\n\r\n",
    )
    .await;
    let seen = r.split("\r\n\r\n").nth(1).unwrap_or_default();
    assert!(seen.starts_with("GET /echo?q=1 HTTP/1.1\n"), "{seen:?}");
    for kept in [
        "Host: app\n",
        "User-Agent: t\n",
        "te: trailers\n",
        "X-Forwarded-For: 10.0.0.9, 127.0.0.1\n",
        "via: 1.1 spur\n",
        "x-forwarded-proto: http\n",
    ] {
        assert!(seen.contains(kept), "{kept:?} missing: {seen:?}");
    }
    for gone in ["Connection", "Keep-Alive", "Proxy-Authorization", "deflate"] {
        assert!(!seen.contains(gone), "{gone} forwarded: {seen:?}");
    }
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_reused_and_closed_ones_are_not() {
    let (sidecar, accepted) = setup().await;
    let proxy = sidecar.inbound_addr;
    for _ in 0..20 {
        let r = exchange(proxy, &get("/x")).await;
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r:?}");
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one upstream connection for all"
    );
    // The upstream closes after each of these without saying so: every request still succeeds,
    // on a new connection.
    for _ in 0..10 {
        let r = exchange(proxy, &get("/bye")).await;
        assert!(r.ends_with("\r\n\r\nbye"), "{r:?}");
    }
    assert!(accepted.load(Ordering::SeqCst) >= 10);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_relay_does_not_forward_byte_for_byte_goes_to_hyper() {
    let (sidecar, _) = setup().await;
    let proxy = sidecar.inbound_addr;
    let r = exchange(proxy, &get("/x")).await;
    assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r:?}");
    assert_eq!(handovers(&sidecar).await, 0.0);
    // A chunked request body: the relay forwards the first request, hyper the rest.
    let r = exchange(
        proxy,
        "GET /one HTTP/1.1\r\nHost: app\r\n\r\nPOST /two HTTP/1.1\r\nHost: app\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(r.matches("HTTP/1.1 200 OK\r\n").count(), 2, "{r:?}");
    assert!(r.contains("GET /one HTTP/1.1\n"), "{r:?}");
    assert!(r.contains("POST /two HTTP/1.1\n"), "{r:?}");
    assert_eq!(handovers(&sidecar).await, 1.0);
    sidecar.shutdown().await;
}

/// Reads one response from `s` (`buf` holds what was read past the last one): its head, and its
/// body to the end its framing says (de-chunked), or to EOF.
async fn response(s: &mut TcpStream, buf: &mut Vec<u8>) -> (String, Vec<u8>) {
    let end = read_past(s, buf, b"\r\n\r\n")
        .await
        .expect("a response head");
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    buf.drain(..end);
    if let Some(n) = field(&head, "content-length") {
        let n: usize = n.parse().unwrap();
        assert!(read_up_to(s, buf, n).await, "EOF mid-body: {head}");
        return (head, buf.drain(..n).collect());
    }
    if field(&head, "transfer-encoding") == Some("chunked") {
        let mut body = Vec::new();
        loop {
            let end = read_past(s, buf, b"\r\n").await.expect("a chunk size");
            let line = String::from_utf8_lossy(&buf[..end - 2]).into_owned();
            buf.drain(..end);
            let hex = line.split(';').next().unwrap_or_default();
            let size = usize::from_str_radix(hex, 16).unwrap();
            if size == 0 {
                let end = read_past(s, buf, b"\r\n\r\n")
                    .await
                    .expect("a trailer section");
                assert_eq!(&buf[..end], b"X-Trailer: t\r\n\r\n");
                buf.drain(..end);
                return (head, body);
            }
            assert!(read_up_to(s, buf, size + 2).await);
            body.extend_from_slice(&buf[..size]);
            assert_eq!(&buf[size..size + 2], b"\r\n");
            buf.drain(..size + 2);
        }
    }
    s.read_to_end(buf).await.unwrap();
    (head, std::mem::take(buf))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_of_every_size_arrive_whole_however_framed_or_paced() {
    let (sidecar, accepted) = setup().await;
    let proxy = sidecar.inbound_addr;
    // One kept-alive client connection for all, so each exchange must end exactly where its
    // framing says, on the client side and on the reused upstream connection.
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let mut buf = Vec::new();
    for n in SIZES {
        for kind in ["bytes", "chunked-bytes", "slow-bytes"] {
            let req = format!("GET /{kind}/{n} HTTP/1.1\r\nHost: app\r\n\r\n");
            s.write_all(req.as_bytes()).await.unwrap();
            let (head, body) = timeout(BOUND, response(&mut s, &mut buf))
                .await
                .expect("the response in time");
            assert!(
                head.starts_with("HTTP/1.1 200 OK\r\n"),
                "{kind}/{n}: {head}"
            );
            assert!(body == pattern(n), "{kind}/{n}: {} bytes", body.len());
        }
        // Request bodies the relay forwards (up to 64 KiB): sent with the head, or paced.
        if n > 64 * 1024 {
            continue;
        }
        for paced in [false, true] {
            let mut req =
                format!("POST /echo-body HTTP/1.1\r\nHost: app\r\nContent-Length: {n}\r\n\r\n")
                    .into_bytes();
            let sent = pattern(n);
            if paced {
                s.write_all(&req).await.unwrap();
                for p in sent.chunks(n.div_ceil(4).max(1)) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    s.write_all(p).await.unwrap();
                }
            } else {
                req.extend_from_slice(&sent);
                s.write_all(&req).await.unwrap();
            }
            let (head, body) = timeout(BOUND, response(&mut s, &mut buf))
                .await
                .expect("the response in time");
            assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "POST {n}: {head}");
            assert!(body == sent, "POST {n} paced {paced}: {} bytes", body.len());
        }
    }
    assert!(buf.is_empty(), "nothing past the last response");
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "every exchange left the upstream connection reusable"
    );
    // Close-delimited bodies, each on a connection of its own.
    for n in SIZES {
        let mut s = TcpStream::connect(proxy).await.unwrap();
        s.write_all(get(&format!("/close-bytes/{n}")).as_bytes())
            .await
            .unwrap();
        let mut buf = Vec::new();
        let (head, body) = timeout(BOUND, response(&mut s, &mut buf))
            .await
            .expect("the response in time");
        assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
        assert!(body == pattern(n), "close-bytes/{n}: {} bytes", body.len());
    }
    assert_eq!(handovers(&sidecar).await, 0.0, "all of these were relayed");
    sidecar.shutdown().await;
}
