//! `spur-load` against `spur-bench-upstream`, both in process: every protocol in an open and a
//! closed loop, the upstream's routes (also through a real tonic client), reconnects after
//! server-side closes, and a stalled server showing up as errors rather than as missing samples.
//! Each test is bounded to a few seconds; they check behaviour, not performance.

// Test helpers outside `#[test]` functions panic on failure too, as the tests do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use spur_perf::load::{self, LoadConfig, Mode, ModeName, PERCENTILES, Proto, Report};
use spur_perf::upstream::{self, GRPC_ECHO_PATH, MAX_BYTES, UPSTREAM_HEADER};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// The upstream on its own thread and runtime, stopped on drop.
struct Upstream {
    addrs: Vec<SocketAddr>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Upstream {
    fn start(listeners: usize) -> Self {
        let listeners: Vec<_> = (0..listeners)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                l.set_nonblocking(true).unwrap();
                l
            })
            .collect();
        let addrs = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let (shutdown, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listeners = listeners
                    .into_iter()
                    .map(|l| tokio::net::TcpListener::from_std(l).unwrap())
                    .collect();
                upstream::serve(listeners, async move {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
            });
        });
        Self {
            addrs,
            shutdown: Some(shutdown),
            thread: Some(thread),
        }
    }

    fn url(&self, path: &str) -> Uri {
        format!("http://{}{path}", self.addrs[0]).parse().unwrap()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn config(url: Uri, proto: Proto, mode: Mode) -> LoadConfig {
    LoadConfig {
        connections: 4,
        streams: if proto == Proto::H1 { 1 } else { 4 },
        headers: vec![load::parse_header("baggage: sd-routing-key=k1").unwrap()],
        payload: 1024,
        duration: Duration::from_secs(1),
        warmup: Duration::from_millis(200),
        drain: Duration::from_secs(1),
        threads: 2,
        ..LoadConfig::new(url, proto, mode)
    }
}

fn url_for(upstream: &Upstream, proto: Proto) -> Uri {
    match proto {
        Proto::H1 | Proto::H2 => upstream.url("/bytes/1024"),
        Proto::Grpc => upstream.url(GRPC_ECHO_PATH),
    }
}

/// What every healthy run must satisfy.
fn check_healthy(report: &Report) {
    assert!(report.requests > 0, "{report:?}");
    assert_eq!(report.errors, 0, "{report:?}");
    assert_eq!(report.late, 0, "{report:?}");
    let curve: Vec<f64> = report.percentiles.iter().map(|&(q, _)| q).collect();
    assert_eq!(curve, PERCENTILES);
    assert!(
        report.percentiles.windows(2).all(|w| w[0].1 <= w[1].1),
        "percentiles not monotonic: {:?}",
        report.percentiles
    );
    let l = &report.latency_us;
    assert!(l.p50 <= l.p90 && l.p90 <= l.p99 && l.p99 <= l.p999 && l.p999 <= l.max);
    assert!(l.p50 > 0 && l.mean > 0.0, "{l:?}");
    assert_eq!(report.percentiles.last().map(|&(_, v)| v), Some(l.max));
    // The JSON form round-trips and carries the documented keys.
    let json = serde_json::to_value(report).unwrap();
    for key in [
        "proto",
        "mode",
        "target_rps",
        "rps",
        "latency_us",
        "percentiles",
    ] {
        assert!(json.get(key).is_some(), "missing {key}");
    }
    assert_eq!(&serde_json::from_value::<Report>(json).unwrap(), report);
}

fn open_loop(proto: Proto) {
    let upstream = Upstream::start(1);
    let cfg = config(url_for(&upstream, proto), proto, Mode::Open { rate: 500.0 });
    let report = load::run(&cfg).unwrap();
    check_healthy(&report);
    assert_eq!(report.mode, ModeName::Open);
    assert_eq!(report.target_rps, Some(500.0));
    // 500 rps for 1 s: the schedule has exactly 500 requests in the window.
    assert_eq!(report.requests, 500, "{report:?}");
    assert!(
        (250.0..=750.0).contains(&report.rps),
        "rps {} far from 500",
        report.rps
    );
}

fn closed_loop(proto: Proto) {
    let upstream = Upstream::start(1);
    let report = load::run(&config(url_for(&upstream, proto), proto, Mode::Closed)).unwrap();
    check_healthy(&report);
    assert_eq!(report.mode, ModeName::Closed);
    assert_eq!(report.target_rps, None);
    // Back to back on 4 connections for a second: far more than one request per connection.
    assert!(report.requests > 100, "{report:?}");
    assert!(
        (report.rps - report.requests as f64).abs() < 1.0,
        "{report:?}"
    );
}

#[test]
fn h1_open_loop() {
    open_loop(Proto::H1);
}

#[test]
fn h1_closed_loop() {
    closed_loop(Proto::H1);
}

#[test]
fn h2_open_loop() {
    open_loop(Proto::H2);
}

#[test]
fn h2_closed_loop() {
    closed_loop(Proto::H2);
}

#[test]
fn grpc_open_loop() {
    open_loop(Proto::Grpc);
}

#[test]
fn grpc_closed_loop() {
    closed_loop(Proto::Grpc);
}

#[test]
fn grpc_status_and_http_status_errors_count() {
    let upstream = Upstream::start(1);
    // POST to a GET-only route: 405 for every call.
    let mut cfg = config(upstream.url("/bytes/10"), Proto::Grpc, Mode::Closed);
    cfg.duration = Duration::from_millis(300);
    cfg.warmup = Duration::ZERO;
    let report = load::run(&cfg).unwrap();
    assert!(report.requests > 0);
    assert_eq!(report.errors, report.requests, "{report:?}");
    assert!(!report.any_success());
    assert_eq!(report.rps, 0.0);
}

#[test]
fn unreachable_target_fails_before_the_start() {
    // Bound and closed again: nothing listens there now.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cfg = config(
        format!("http://{addr}/bytes/1").parse().unwrap(),
        Proto::H1,
        Mode::Closed,
    );
    let started = Instant::now();
    assert!(load::run(&cfg).is_err());
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn upstream_routes() {
    let upstream = Upstream::start(2);
    for &addr in &upstream.addrs {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (mut h1, conn) = http1::handshake(TokioIo::new(tcp)).await.unwrap();
        tokio::spawn(conn);
        for n in [0, 1, 1024, 65_537, MAX_BYTES] {
            let req = Request::get(format!("/bytes/{n}"))
                .header("host", addr.to_string())
                .body(Full::new(Bytes::new()))
                .unwrap();
            let resp = h1.send_request(req).await.unwrap();
            assert_eq!(resp.status(), 200);
            let served_by = resp.headers()[UPSTREAM_HEADER].clone();
            assert_eq!(served_by, HeaderValue::from(addr.port()));
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body.len(), n);
        }
        let too_big = Request::get(format!("/bytes/{}", MAX_BYTES + 1))
            .header("host", addr.to_string())
            .body(Full::new(Bytes::new()))
            .unwrap();
        assert_eq!(h1.send_request(too_big).await.unwrap().status(), 400);
        h1.ready().await.unwrap();
        let echo = Request::post("/echo")
            .header("host", addr.to_string())
            .body(Full::new(Bytes::from_static(b"hello upstream")))
            .unwrap();
        let resp = h1.send_request(echo).await.unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"hello upstream");
    }

    // The same port speaks h2c (prior knowledge).
    let addr = upstream.addrs[0];
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut h2, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::get(format!("http://{addr}/bytes/3000"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = h2.send_request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), 3000);
    let req = Request::get(format!("http://{addr}/nope"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(h2.send_request(req).await.unwrap().status(), 404);
}

/// `spur.bench.v1.EchoMessage`.
#[derive(Clone, PartialEq, prost::Message)]
struct EchoMessage {
    #[prost(bytes = "vec", tag = "1")]
    payload: Vec<u8>,
}

#[tokio::test]
async fn upstream_grpc_echo_is_valid_for_tonic() {
    let upstream = Upstream::start(1);
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", upstream.addrs[0]))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = tonic::client::Grpc::new(channel);
    for size in [0, 1, 1024, 100_000] {
        client.ready().await.unwrap();
        let request = tonic::Request::new(EchoMessage {
            payload: vec![7; size],
        });
        let response = client
            .unary(
                request,
                http::uri::PathAndQuery::from_static(GRPC_ECHO_PATH),
                tonic_prost::ProstCodec::<EchoMessage, EchoMessage>::default(),
            )
            .await
            .unwrap();
        assert_eq!(response.into_inner().payload, vec![7; size]);
    }
    // The generator's request framing decodes as the same message.
    let framed = load::encode_grpc_echo_request(1024);
    let decoded = <EchoMessage as prost::Message>::decode(&framed[5..]).unwrap();
    assert_eq!(decoded.payload, vec![b'x'; 1024]);
}

#[test]
fn h1_reconnects_when_the_server_closes() {
    // Every response says `Connection: close`.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let (shutdown, stopped) = oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let accept = async {
                loop {
                    let (stream, _) = listener.accept().await.unwrap();
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(|_req| async {
                            Ok::<_, Infallible>(hyper::Response::new(Full::new(
                                Bytes::from_static(b"ok"),
                            )))
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .keep_alive(false)
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            };
            tokio::select! {
                () = accept => {}
                _ = stopped => {}
            }
        });
    });
    let mut cfg = config(
        format!("http://{addr}/").parse().unwrap(),
        Proto::H1,
        Mode::Open { rate: 300.0 },
    );
    cfg.connections = 2;
    cfg.threads = 1;
    let report = load::run(&cfg).unwrap();
    let _ = shutdown.send(());
    server.join().unwrap();
    assert_eq!(report.requests, 300, "{report:?}");
    assert_eq!(report.errors, 0, "{report:?}");
    assert!(report.reconnects >= 300, "{report:?}");
}

#[test]
fn stalled_server_shows_as_errors_and_late() {
    // Accepts connections and never answers: an open loop must not just send fewer requests.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut cfg = config(
        format!("http://{addr}/").parse().unwrap(),
        Proto::H1,
        Mode::Open { rate: 100.0 },
    );
    cfg.connections = 2;
    cfg.threads = 1;
    cfg.warmup = Duration::ZERO;
    cfg.drain = Duration::from_millis(1200);
    let started = Instant::now();
    let report = load::run(&cfg).unwrap();
    assert!(started.elapsed() < Duration::from_secs(4));
    drop(listener);
    assert_eq!(report.requests, 100, "{report:?}");
    assert_eq!(report.errors, 100, "{report:?}");
    assert_eq!(report.error_kinds.timeout, 2, "{report:?}");
    assert_eq!(report.error_kinds.unsent, 98, "{report:?}");
    assert!(report.late >= 98, "{report:?}");
}

#[test]
fn custom_header_reaches_the_server() {
    // The upstream ignores headers, so check the template through a capturing server.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let (seen_tx, seen_rx) = std::sync::mpsc::channel::<Option<HeaderValue>>();
    let (shutdown, stopped) = oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let accept = async {
                loop {
                    let (stream, _) = listener.accept().await.unwrap();
                    let seen_tx = seen_tx.clone();
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(move |req: Request<_>| {
                            let _ = seen_tx.send(
                                req.headers()
                                    .get(HeaderName::from_static("baggage"))
                                    .cloned(),
                            );
                            async {
                                Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::new())))
                            }
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            };
            tokio::select! {
                () = accept => {}
                _ = stopped => {}
            }
        });
    });
    for proto in [Proto::H1, Proto::H2] {
        let mut cfg = config(
            format!("http://{addr}/").parse().unwrap(),
            proto,
            Mode::Open { rate: 50.0 },
        );
        cfg.duration = Duration::from_millis(200);
        cfg.warmup = Duration::ZERO;
        let report = load::run(&cfg).unwrap();
        assert_eq!(report.errors, 0, "{report:?}");
    }
    let _ = shutdown.send(());
    server.join().unwrap();
    let seen: Vec<_> = seen_rx.try_iter().collect();
    assert!(!seen.is_empty());
    assert!(
        seen.iter()
            .all(|v| v.as_ref().is_some_and(|v| v == "sd-routing-key=k1")),
        "{seen:?}"
    );
}

#[test]
fn h2_retries_streams_refused_by_goaway() {
    // The server allows 4 streams per connection, and the client opens 8 before it has seen that
    // setting: the extra ones are refused (REFUSED_STREAM), unprocessed. Every connection ends
    // gracefully after 50 requests (as nginx's does after `keepalive_requests`), so every new
    // connection starts with such a burst again. Refused streams are retried, not errors.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let (shutdown, stopped) = oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let accept = async {
                loop {
                    let (stream, _) = listener.accept().await.unwrap();
                    tokio::spawn(async move {
                        let Ok(mut conn) = h2::server::Builder::new()
                            .max_concurrent_streams(4)
                            .handshake::<_, Bytes>(stream)
                            .await
                        else {
                            return;
                        };
                        let mut served = 0;
                        while let Some(Ok((req, mut respond))) = conn.accept().await {
                            // The request body is read to its end before the response, as a
                            // proxy buffering requests does (nginx's default): a response
                            // racing the request body is another test's subject.
                            tokio::spawn(async move {
                                let mut body = req.into_body();
                                while let Some(Ok(chunk)) = body.data().await {
                                    let _ = body.flow_control().release_capacity(chunk.len());
                                }
                                let _ = respond.send_response(http::Response::new(()), true);
                            });
                            served += 1;
                            if served == 50 {
                                conn.graceful_shutdown();
                            }
                        }
                    });
                }
            };
            tokio::select! {
                () = accept => {}
                _ = stopped => {}
            }
        });
    });
    let mut cfg = config(
        format!("http://{addr}/").parse().unwrap(),
        Proto::H2,
        Mode::Closed,
    );
    cfg.connections = 2;
    cfg.streams = 8;
    cfg.threads = 1;
    cfg.duration = Duration::from_millis(500);
    cfg.warmup = Duration::ZERO;
    let report = load::run(&cfg).unwrap();
    let _ = shutdown.send(());
    server.join().unwrap();
    assert!(report.requests > 200, "{report:?}");
    assert_eq!(report.errors, 0, "{report:?}");
    assert!(report.reconnects >= 4, "{report:?}");
}
