//! Connection upgrades through the proxy: WebSocket (routed by key), CONNECT tunnels, and
//! upgrades the upstream declines.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::Request;
use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use spur_e2e::{Env, collect, metrics, sample};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::timeout;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// Upper bound for anything that could hang.
const BOUND: Duration = Duration::from_secs(10);

type Ws = WebSocketStream<TcpStream>;

/// Opens a WebSocket to `/ws` through the proxy, with `headers` on the handshake request; checks
/// the handshake was answered by `expected` (the demo app names itself on every response).
async fn open_ws(
    addr: SocketAddr,
    path: &str,
    headers: &[(&'static str, &'static str)],
    expected: &str,
) -> Ws {
    let mut req = format!("ws://{addr}{path}").into_client_request().unwrap();
    for (k, v) in headers {
        req.headers_mut().insert(*k, v.parse().unwrap());
    }
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (ws, resp) = timeout(BOUND, tokio_tungstenite::client_async(req, tcp))
        .await
        .expect("WebSocket handshake hung")
        .expect("WebSocket handshake failed");
    assert_eq!(resp.status(), 101);
    assert_eq!(
        resp.headers()
            .get("x-served-by")
            .map(|v| v.to_str().unwrap()),
        Some(expected)
    );
    ws
}

async fn next_message(ws: &mut Ws) -> Message {
    timeout(BOUND, ws.next())
        .await
        .expect("no WebSocket message in time")
        .expect("stream ended")
        .expect("WebSocket error")
}

/// Sends a close frame and reads until the stream ends: the peer must answer with its own close.
async fn close_cleanly(mut ws: Ws) {
    ws.close(None).await.unwrap();
    let mut saw_close = false;
    for _ in 0..16 {
        match timeout(BOUND, ws.next())
            .await
            .expect("close handshake hung")
        {
            None => break,
            Some(Ok(Message::Close(_))) => saw_close = true,
            Some(Ok(other)) => panic!("unexpected message while closing: {other:?}"),
            Some(Err(tokio_tungstenite::tungstenite::Error::ConnectionClosed)) => break,
            Some(Err(e)) => panic!("WebSocket error while closing: {e}"),
        }
    }
    assert!(
        saw_close,
        "the server's close frame never came back through the proxy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_is_routed_by_the_handshake_key() {
    let env = Env::http().await;
    // Both sessions are open at once and used interleaved: routing is per connection.
    let mut base = open_ws(env.addr(), "/ws", &[], "baseline").await;
    let mut fork = open_ws(
        env.addr(),
        "/ws",
        &[("baggage", "sd-routing-key=k1")],
        "fork",
    )
    .await;

    for i in 0..5 {
        for (ws, name) in [(&mut base, "baseline"), (&mut fork, "fork")] {
            ws.send(Message::text(format!("m{i}"))).await.unwrap();
            match next_message(ws).await {
                Message::Text(t) => assert_eq!(t.as_str(), format!("{name}: m{i}")),
                other => panic!("expected text, got {other:?}"),
            }
        }
    }
    // A binary message larger than one socket read, to exercise the tunnel's streaming.
    let blob: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 253) as u8).collect();
    fork.send(Message::binary(blob.clone())).await.unwrap();
    match next_message(&mut fork).await {
        Message::Binary(b) => assert!(b.as_ref() == blob.as_slice(), "binary echo differs"),
        other => panic!("expected binary, got {other:?}"),
    }

    close_cleanly(base).await;
    close_cleanly(fork).await;

    let text = metrics(env.admin()).await;
    assert_eq!(
        sample(&text, "spur_requests_total{outcome=\"baseline\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "spur_requests_total{outcome=\"sandbox\"}"),
        1.0,
        "{text}"
    );
    // Tunnels end once both sides have closed: nothing is left for the drain to wait for.
    assert_eq!(env.shutdown().await, 0, "tunnels left at shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_with_a_query_parameter_key_goes_to_the_fork() {
    let env = Env::http().await;
    let mut ws = open_ws(env.addr(), "/ws?sd-routing-key=k1", &[], "fork").await;
    ws.send(Message::text("q")).await.unwrap();
    assert_eq!(next_message(&mut ws).await, Message::text("fork: q"));
    close_cleanly(ws).await;
    env.shutdown().await;
}

/// An upstream that accepts `CONNECT`: reports each request line on `seen`, answers 200 and then
/// echoes bytes; on EOF it writes `bye\n` and closes its side. `CONNECT denied:*` gets a 403 and
/// anything else a 405.
async fn spawn_connect_upstream() -> (SocketAddr, mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (seen, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 16 * 1024];
                let head_end = loop {
                    if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break p + 4;
                    }
                    if buf.len() > 64 * 1024 {
                        return;
                    }
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                let line = head.lines().next().unwrap_or("").to_owned();
                let _ = seen.send(head.clone());
                if line.starts_with("CONNECT denied") {
                    let _ = stream
                        .write_all(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 7\r\nConnection: close\r\n\r\ndenied\n")
                        .await;
                    let _ = stream.shutdown().await;
                    return;
                }
                if !line.starts_with("CONNECT ") {
                    let _ = stream
                        .write_all(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                        .await;
                    return;
                }
                if stream
                    .write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                    .await
                    .is_err()
                {
                    return;
                }
                // Bytes that arrived with the head belong to the tunnel.
                if stream.write_all(&buf[head_end..]).await.is_err() {
                    return;
                }
                loop {
                    match stream.read(&mut chunk).await {
                        Ok(0) => break,
                        Err(_) => return,
                        Ok(n) => {
                            if stream.write_all(&chunk[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
                let _ = stream.write_all(b"bye\n").await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (addr, rx)
}

/// Reads a response head; returns it and whatever bytes followed it.
async fn read_head(stream: &mut TcpStream) -> (String, Vec<u8>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    timeout(BOUND, async {
        loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let rest = buf.split_off(p + 4);
                return (String::from_utf8_lossy(&buf).into_owned(), rest);
            }
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(
                n > 0,
                "connection closed before a complete response head: {:?}",
                String::from_utf8_lossy(&buf)
            );
            buf.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .expect("no response head in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_tunnels_bytes_both_ways() {
    let (upstream, mut seen) = spawn_connect_upstream().await;
    let sidecar = spur_e2e::sidecar_for(upstream, spur_e2e::sidecar_config(upstream).proxy).await;

    let mut stream = TcpStream::connect(sidecar.inbound_addr).await.unwrap();
    stream
        .write_all(b"CONNECT target:1 HTTP/1.1\r\nHost: target:1\r\n\r\n")
        .await
        .unwrap();
    let (head, early) = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "head: {head}");
    assert!(
        early.is_empty(),
        "bytes before the client sent any: {early:?}"
    );
    let upstream_head = timeout(BOUND, seen.recv()).await.unwrap().unwrap();
    assert!(
        upstream_head.starts_with("CONNECT target:1 HTTP/1.1\r\n"),
        "upstream saw {upstream_head:?}"
    );

    stream.write_all(b"ping\n").await.unwrap();
    let mut pong = [0u8; 5];
    timeout(BOUND, stream.read_exact(&mut pong))
        .await
        .expect("no echo")
        .unwrap();
    assert_eq!(&pong, b"ping\n");

    // A payload much larger than socket buffers, written while reading.
    let (mut rd, mut wr) = stream.into_split();
    let payload: Vec<u8> = (0..2 * 1024 * 1024u32).map(|i| (i % 249) as u8).collect();
    let expected = payload.clone();
    let writer = tokio::spawn(async move {
        wr.write_all(&payload).await.unwrap();
        // Half-close: the upstream only says bye after seeing our EOF through the tunnel.
        wr.shutdown().await.unwrap();
        wr
    });
    let mut back = Vec::new();
    timeout(Duration::from_secs(30), rd.read_to_end(&mut back))
        .await
        .expect("tunnel hung")
        .unwrap();
    let _wr = writer.await.unwrap();
    let (body, tail) = back.split_at(expected.len().min(back.len()));
    assert!(
        body == expected.as_slice(),
        "tunnelled payload differs ({} bytes back)",
        back.len()
    );
    assert_eq!(tail, b"bye\n");

    let text = metrics(sidecar.admin_addr.unwrap()).await;
    assert_eq!(
        sample(&text, "spur_requests_total{outcome=\"baseline\"}"),
        1.0,
        "{text}"
    );
    drop((rd, _wr));
    assert_eq!(sidecar.shutdown().await, 0, "tunnel left at shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_refused_by_upstream_is_an_ordinary_response() {
    let (upstream, _seen) = spawn_connect_upstream().await;
    let sidecar = spur_e2e::sidecar_for(upstream, spur_e2e::sidecar_config(upstream).proxy).await;
    let mut stream = TcpStream::connect(sidecar.inbound_addr).await.unwrap();

    // The upstream refuses: its answer comes back as an ordinary response, no tunnel.
    stream
        .write_all(b"CONNECT denied:1 HTTP/1.1\r\nHost: denied:1\r\n\r\n")
        .await
        .unwrap();
    let (head, mut body) = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 403"), "head: {head}");
    let mut chunk = [0u8; 64];
    while body.len() < 7 {
        let n = timeout(BOUND, stream.read(&mut chunk))
            .await
            .expect("body hung")
            .unwrap();
        assert!(n > 0, "connection closed mid-body");
        body.extend_from_slice(&chunk[..n]);
    }
    assert_eq!(body, b"denied\n");

    // The same client connection is still plain HTTP: a second CONNECT is tunnelled.
    stream
        .write_all(b"CONNECT target:1 HTTP/1.1\r\nHost: target:1\r\n\r\n")
        .await
        .unwrap();
    let (head, early) = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "head: {head}");
    assert!(early.is_empty());
    stream.write_all(b"after refusal\n").await.unwrap();
    let mut echo = [0u8; 14];
    timeout(BOUND, stream.read_exact(&mut echo))
        .await
        .expect("no echo")
        .unwrap();
    assert_eq!(&echo, b"after refusal\n");

    // A non-CONNECT request to the same upstream is just forwarded.
    let tcp = TcpStream::connect(sidecar.inbound_addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::post("/x")
        .header("host", "x")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let got = collect(
        timeout(BOUND, send.send_request(req))
            .await
            .unwrap()
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 405);
    drop(stream);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declined_upgrade_passes_the_response_back_and_keeps_the_connection() {
    let env = Env::http().await;
    for (headers, name) in [
        (vec![], "baseline"),
        (vec![("baggage", "sd-routing-key=k1")], "fork"),
    ] {
        let tcp = TcpStream::connect(env.addr()).await.unwrap();
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .unwrap();
        let conn = tokio::spawn(conn);
        let upgrade_req = |path: &str, with_key: bool| {
            let mut req = Request::get(path)
                .header("host", "x")
                .header("connection", "Upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-version", "13");
            if with_key {
                req = req.header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==");
            }
            for (k, v) in &headers {
                req = req.header(*k, *v);
            }
            req.body(Empty::<Bytes>::new()).unwrap()
        };

        // 1. A route that is not a WebSocket endpoint ignores the upgrade and answers normally.
        let got = collect(
            timeout(BOUND, send.send_request(upgrade_req("/", true)))
                .await
                .unwrap()
                .unwrap(),
        )
        .await
        .unwrap();
        assert_eq!(
            (got.status.as_u16(), got.body.as_str()),
            (200, format!("hello from {name}\n").as_str())
        );

        // 2. The upgrade intent did reach the application (it chose to decline).
        timeout(BOUND, send.ready())
            .await
            .unwrap()
            .expect("connection closed after a declined upgrade");
        let got = collect(
            timeout(BOUND, send.send_request(upgrade_req("/headers", true)))
                .await
                .unwrap()
                .unwrap(),
        )
        .await
        .unwrap();
        assert_eq!(got.status, 200);
        let json = got.json();
        assert_eq!(json["served_by"], name);
        assert_eq!(json["headers"]["upgrade"][0], "websocket", "{json}");

        // 3. The WebSocket endpoint refuses an incomplete handshake with a 400.
        timeout(BOUND, send.ready())
            .await
            .unwrap()
            .expect("connection closed after a declined upgrade");
        let got = collect(
            timeout(BOUND, send.send_request(upgrade_req("/ws", false)))
                .await
                .unwrap()
                .unwrap(),
        )
        .await
        .unwrap();
        assert_eq!((got.status.as_u16(), got.served_by()), (400, name));
        assert_eq!(got.body, "expected a WebSocket upgrade\n");

        // 4. And the very same connection still serves plain requests.
        timeout(BOUND, send.ready())
            .await
            .unwrap()
            .expect("connection closed after a refused upgrade");
        let mut req = Request::get("/").header("host", "x");
        for (k, v) in &headers {
            req = req.header(*k, *v);
        }
        let got = collect(
            timeout(
                BOUND,
                send.send_request(req.body(Empty::<Bytes>::new()).unwrap()),
            )
            .await
            .unwrap()
            .unwrap(),
        )
        .await
        .unwrap();
        assert_eq!(
            (got.status.as_u16(), got.body.as_str()),
            (200, format!("hello from {name}\n").as_str())
        );
        drop(send);
        let _ = timeout(BOUND, conn).await;
    }
    let text = metrics(env.admin()).await;
    assert_eq!(
        sample(&text, "spur_requests_total{outcome=\"baseline\"}"),
        4.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "spur_requests_total{outcome=\"sandbox\"}"),
        4.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "spur_connections_total{protocol=\"http1\"}"),
        2.0,
        "{text}"
    );
    env.shutdown().await;
}
