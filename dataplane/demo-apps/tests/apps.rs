//! Direct (no proxy) checks that every demo service behaves as the end-to-end tests expect.

// clippy's allow-*-in-tests only covers `#[test]` bodies, not the helpers they share here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use spur_demo_apps::{CancellationToken, Error, grpc_client};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;

/// Keeps a test from hanging forever if a service misbehaves.
const DEADLINE: Duration = Duration::from_secs(10);

struct Running {
    addr: SocketAddr,
    shutdown: CancellationToken,
    handle: JoinHandle<Result<(), Error>>,
}

impl Running {
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(DEADLINE, self.handle)
            .await
            .expect("server did not stop")
            .unwrap()
            .unwrap();
    }
}

async fn start<F, Fut>(serve: F) -> Running
where
    F: FnOnce(TcpListener, CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), Error>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(serve(listener, shutdown.clone()));
    Running {
        addr,
        shutdown,
        handle,
    }
}

async fn start_http(name: &str) -> Running {
    let name = name.to_owned();
    start(|l, s| spur_demo_apps::serve_http(l, name, s)).await
}

async fn start_grpc(name: &str) -> Running {
    let name = name.to_owned();
    start(|l, s| spur_demo_apps::serve_grpc(l, name, s)).await
}

type H1 = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn h1(addr: SocketAddr) -> H1 {
    let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
    let (send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
    tokio::spawn(conn.with_upgrades());
    send
}

async fn h2<B>(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
    let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .unwrap();
    tokio::spawn(conn);
    send
}

fn get(path: &str) -> Request<Full<Bytes>> {
    Request::get(path)
        .header("host", "demo.test")
        .body(Full::default())
        .unwrap()
}

async fn body_string(resp: Response<Incoming>) -> String {
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

fn served_by(resp: &Response<Incoming>) -> &str {
    resp.headers()["x-served-by"].to_str().unwrap()
}

#[tokio::test]
async fn http1_get_root() {
    let app = start_http("baseline").await;
    let mut client = h1(app.addr).await;
    let resp = client.send_request(get("/")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(served_by(&resp), "baseline");
    assert_eq!(body_string(resp).await, "hello from baseline\n");

    // Same keep-alive connection, unknown route.
    let resp = client.send_request(get("/nope")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    assert_eq!(served_by(&resp), "baseline");
    drop(client);
    app.stop().await;
}

#[tokio::test]
async fn h2c_get_root() {
    let app = start_http("fork-demo").await;
    let mut client = h2::<Empty<Bytes>>(app.addr).await;
    let req = Request::get(format!("http://{}/", app.addr))
        .body(Empty::new())
        .unwrap();
    let resp = client.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(served_by(&resp), "fork-demo");
    assert_eq!(body_string(resp).await, "hello from fork-demo\n");
    drop(client);
    app.stop().await;
}

#[tokio::test]
async fn headers_reports_what_arrived() {
    let app = start_http("baseline").await;

    let mut client = h1(app.addr).await;
    let req = Request::get("/headers?x=1")
        .header("host", "demo.test")
        .header("x-multi", "a")
        .header("x-multi", "b")
        .header("Baggage", "sd-routing-key=k1")
        .body(Full::default())
        .unwrap();
    let resp = client.send_request(req).await.unwrap();
    assert_eq!(resp.headers()["content-type"], "application/json");
    let doc: serde_json::Value = serde_json::from_str(&body_string(resp).await).unwrap();
    assert_eq!(doc["served_by"], "baseline");
    assert_eq!(doc["method"], "GET");
    assert_eq!(doc["uri"], "/headers?x=1");
    assert_eq!(doc["version"], "HTTP/1.1");
    assert_eq!(doc["authority"], "demo.test");
    assert_eq!(doc["headers"]["x-multi"], serde_json::json!(["a", "b"]));
    assert_eq!(
        doc["headers"]["baggage"],
        serde_json::json!(["sd-routing-key=k1"])
    );

    let mut client = h2::<Empty<Bytes>>(app.addr).await;
    let req = Request::get(format!("http://{}/headers", app.addr))
        .header("x-one", "1")
        .body(Empty::new())
        .unwrap();
    let resp = client.send_request(req).await.unwrap();
    let doc: serde_json::Value = serde_json::from_str(&body_string(resp).await).unwrap();
    assert_eq!(doc["version"], "HTTP/2.0");
    assert_eq!(doc["authority"], app.addr.to_string());
    assert_eq!(doc["headers"]["x-one"], serde_json::json!(["1"]));
    drop(client);
    app.stop().await;
}

type ChannelBody =
    StreamBody<futures_util::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

/// A request body fed frame by frame from the test.
fn channel_body() -> (mpsc::Sender<Frame<Bytes>>, ChannelBody) {
    let (tx, rx) = mpsc::channel::<Frame<Bytes>>(4);
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        let frame = rx.recv().await?;
        Some((Ok(frame), rx))
    });
    (tx, StreamBody::new(frames.boxed()))
}

async fn next_frame(body: &mut Incoming) -> Frame<Bytes> {
    tokio::time::timeout(DEADLINE, body.frame())
        .await
        .expect("frame timed out")
        .expect("body ended")
        .unwrap()
}

#[tokio::test]
async fn h2_echo_streams_body_and_trailers() {
    let app = start_http("baseline").await;
    let mut client = h2::<ChannelBody>(app.addr).await;
    let (tx, body) = channel_body();
    let req = Request::post(format!("http://{}/echo", app.addr))
        .header("content-type", "application/x-test")
        .body(body)
        .unwrap();
    let resp_fut = tokio::spawn(client.send_request(req));

    tx.send(Frame::data(Bytes::from_static(b"one")))
        .await
        .unwrap();
    let resp = resp_fut.await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(served_by(&resp), "baseline");
    assert_eq!(resp.headers()["content-type"], "application/x-test");
    let mut body = resp.into_body();

    // The first chunk comes back while the request body is still open: no buffering.
    let frame = next_frame(&mut body).await;
    assert_eq!(frame.into_data().unwrap(), "one");

    tx.send(Frame::data(Bytes::from_static(b"two")))
        .await
        .unwrap();
    assert_eq!(next_frame(&mut body).await.into_data().unwrap(), "two");

    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("abc"));
    tx.send(Frame::trailers(trailers)).await.unwrap();
    drop(tx);
    let frame = next_frame(&mut body).await;
    assert_eq!(frame.into_trailers().unwrap()["x-checksum"], "abc");
    assert!(body.frame().await.is_none());
    drop(client);
    app.stop().await;
}

#[tokio::test]
async fn h1_echo_returns_body() {
    let app = start_http("baseline").await;
    let mut client = h1(app.addr).await;
    let req = Request::post("/echo")
        .header("host", "demo.test")
        .body(Full::new(Bytes::from_static(b"payload")))
        .unwrap();
    let resp = client.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(body_string(resp).await, "payload");
    drop(client);
    app.stop().await;
}

#[tokio::test]
async fn slow_and_stream() {
    let app = start_http("baseline").await;
    let mut client = h1(app.addr).await;

    let started = Instant::now();
    let resp = client.send_request(get("/slow?ms=50")).await.unwrap();
    assert_eq!(body_string(resp).await, "slow baseline\n");
    assert!(started.elapsed() >= Duration::from_millis(50));

    let resp = client
        .send_request(get("/stream?chunks=3&ms=20"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut chunks = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            chunks.push(String::from_utf8(data.to_vec()).unwrap());
        }
    }
    assert_eq!(chunks.concat(), "chunk 0\nchunk 1\nchunk 2\n");
    assert!(
        chunks.len() >= 2,
        "chunks should arrive separately: {chunks:?}"
    );

    let resp = client.send_request(get("/slow?ms=abc")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    drop(client);
    app.stop().await;
}

#[tokio::test]
async fn websocket_echo() {
    let app = start_http("fork-demo").await;
    let stream = TcpStream::connect(app.addr).await.unwrap();
    let (mut ws, resp) = tokio_tungstenite::client_async(format!("ws://{}/ws", app.addr), stream)
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    assert_eq!(resp.headers()["x-served-by"], "fork-demo");

    for text in ["hi", "there"] {
        ws.send(Message::text(text)).await.unwrap();
        let reply = tokio::time::timeout(DEADLINE, ws.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(reply, Message::text(format!("fork-demo: {text}")));
    }
    ws.close(None).await.unwrap();
    // The server answers the close handshake and then the stream ends.
    while let Some(msg) = ws.next().await {
        assert!(matches!(msg, Ok(Message::Close(_))), "{msg:?}");
    }

    // A plain GET on /ws is refused rather than upgraded.
    let mut client = h1(app.addr).await;
    let resp = client.send_request(get("/ws")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    drop(client);
    app.stop().await;
}

#[tokio::test]
async fn websocket_is_closed_on_shutdown() {
    let app = start_http("baseline").await;
    let stream = TcpStream::connect(app.addr).await.unwrap();
    let (mut ws, _) = tokio_tungstenite::client_async(format!("ws://{}/ws", app.addr), stream)
        .await
        .unwrap();
    app.shutdown.cancel();
    let msg = tokio::time::timeout(DEADLINE, ws.next()).await.unwrap();
    assert!(matches!(msg, Some(Ok(Message::Close(_))) | None), "{msg:?}");
    drop(ws);
    app.stop().await;
}

#[tokio::test]
async fn http_shutdown_stops_accepting() {
    let app = start_http("baseline").await;
    let addr = app.addr;
    app.stop().await;
    assert!(TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn invalid_name_is_rejected() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = spur_demo_apps::serve_http(listener, "bad\nname".into(), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidName(_)), "{err}");
}

#[tokio::test]
async fn grpc_hello() {
    let app = start_grpc("grpc-a").await;
    let (reply, trailer) =
        grpc_client::hello(app.addr, "bob", &[("baggage", "x=1,sd-routing-key=k1")])
            .await
            .unwrap();
    assert_eq!(reply.message, "hello bob from grpc-a");
    assert_eq!(reply.served_by, "grpc-a");
    assert_eq!(reply.routing_key, "k1");
    assert_eq!(trailer.as_deref(), Some("grpc-a"));

    let (reply, _) = grpc_client::hello(app.addr, "amy", &[]).await.unwrap();
    assert_eq!(reply.routing_key, "");
    app.stop().await;
}

#[tokio::test]
async fn grpc_fail_status() {
    let app = start_grpc("grpc-a").await;
    let status = grpc_client::hello(app.addr, "fail", &[]).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert_eq!(status.message(), "asked to fail");
    assert_eq!(status.metadata().get("x-served-by").unwrap(), "grpc-a");
    app.stop().await;
}

#[tokio::test]
async fn grpc_price_and_a_broken_build() {
    let app = start_grpc("grpc-a").await;
    let reply = grpc_client::price(app.addr, "A1").await.unwrap();
    assert_eq!((reply.sku.as_str(), reply.price_cents), ("A1", 300));
    let missing = grpc_client::price(app.addr, "Z9").await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    app.stop().await;

    let behaviour = spur_demo_apps::GrpcBehaviour { unavailable: true };
    let broken =
        start(|l, s| spur_demo_apps::serve_grpc_with(l, "grpc-b".into(), behaviour, s)).await;
    let status = grpc_client::price(broken.addr, "A1").await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    let status = grpc_client::hello(broken.addr, "amy", &[])
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert_eq!(status.metadata().get("x-served-by").unwrap(), "grpc-b");
    broken.stop().await;
}

#[tokio::test]
async fn grpc_chat() {
    let app = start_grpc("grpc-b").await;
    let names = vec!["a".to_owned(), "b".to_owned(), "c".to_owned()];
    let (replies, trailer) =
        grpc_client::chat(app.addr, names, &[("baggage", "sd-routing-key=k2")])
            .await
            .unwrap();
    let messages: Vec<_> = replies.iter().map(|r| r.message.as_str()).collect();
    assert_eq!(
        messages,
        [
            "echo a from grpc-b",
            "echo b from grpc-b",
            "echo c from grpc-b"
        ]
    );
    assert!(
        replies
            .iter()
            .all(|r| r.served_by == "grpc-b" && r.routing_key == "k2")
    );
    assert_eq!(trailer.as_deref(), Some("grpc-b"));

    let (replies, _) = grpc_client::chat(app.addr, Vec::new(), &[]).await.unwrap();
    assert!(replies.is_empty());
    app.stop().await;
}

#[tokio::test]
async fn tcp_echo_half_close() {
    let app = start(|l, s| spur_demo_apps::serve_tcp_echo(l, "tcp-a".into(), s)).await;
    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    stream.write_all(b"ping").await.unwrap();
    let mut buf = [0u8; 4];
    stream.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"ping");

    stream.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rest, b"bye from tcp-a\n");
    app.stop().await;
}

#[tokio::test]
async fn tls_echo() {
    let tls = spur_demo_apps::test_tls(&["localhost", "127.0.0.1"]).unwrap();
    let server_config = Arc::clone(&tls.server_config);
    let app =
        start(|l, s| spur_demo_apps::serve_tls_echo(l, "tls-a".into(), server_config, s)).await;

    let mut roots = rustls::RootCertStore::empty();
    roots.add(tls.cert_der.clone()).unwrap();
    let client_config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config));

    let tcp = TcpStream::connect(app.addr).await.unwrap();
    let server_name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut stream = connector.connect(server_name, tcp).await.unwrap();
    stream.write_all(b"hello\r\nwor").await.unwrap();
    stream.write_all(b"ld\n").await.unwrap();
    stream.flush().await.unwrap();
    let mut buf = vec![0u8; "tls-a: hello\ntls-a: world\n".len()];
    tokio::time::timeout(DEADLINE, stream.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(buf, b"tls-a: hello\ntls-a: world\n");

    stream.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert!(rest.is_empty());
    app.stop().await;
}
