//! HTTP/2 through the sidecar (h2c prior knowledge on both sides) against a raw `h2` upstream,
//! each test with the HTTP/2 relay and with hyper's path (`http2Relay: false`):
//! trailers-only responses, stream resets in both directions (with their reasons), bodies larger
//! than every flow control window in both directions, an upstream that reads nothing holding
//! the client to the windows, and the SETTINGS limits the sidecar advertises (concurrent
//! streams, header list size).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use h2::Reason;
use spur_e2e::sidecar_for;
use spur_proxy::ProxyConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::timeout;

const BOUND: Duration = Duration::from_secs(10);
const BIG: usize = 4 << 20;
/// The request body `/early` reads after it has answered.
const EARLY_BODY: usize = 256 * 1024;

fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

/// What the upstream saw: request paths, and how `/hold` request bodies ended.
#[derive(Default)]
struct Seen {
    paths: Mutex<Vec<String>>,
}

/// A raw h2 server: `/trailers-only` answers with one HEADERS frame that ends the stream,
/// `/reset` sends headers then RST_STREAM(INTERNAL_ERROR), `/hold` reads the request body and
/// reports how it ended on `held`, `/big` sends 4 MiB, `/echo` reads the body and answers its
/// length and whether every byte matched the pattern, `/with-body` answers every method (HEAD
/// too, as some servers do) with a 5-byte body, `/stall` reads nothing for 30 s, `/early` answers
/// first and then reads the body, reporting on `held` whether all of it came. Its windows are
/// h2's defaults (64 KiB).
async fn upstream(seen: Arc<Seen>, held: mpsc::Sender<&'static str>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                return;
            };
            let (seen, held) = (seen.clone(), held.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                while let Some(Ok((req, respond))) = conn.accept().await {
                    let (seen, held) = (seen.clone(), held.clone());
                    tokio::spawn(serve(req, respond, seen, held));
                }
            });
        }
    });
    addr
}

async fn serve(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    seen: Arc<Seen>,
    held: mpsc::Sender<&'static str>,
) {
    let path = req.uri().path().to_string();
    seen.paths.lock().unwrap().push(path.clone());
    let req_content_length = req
        .headers()
        .get("content-length")
        .map(|v| v.to_str().unwrap().to_string());
    let mut body = req.into_body();
    let ok = || http::Response::builder().status(200);
    match path.as_str() {
        "/trailers-only" => {
            let resp = ok()
                .header("content-type", "application/grpc")
                .header("grpc-status", "7")
                .header("grpc-message", "denied")
                .body(())
                .unwrap();
            let _ = respond.send_response(resp, true);
        }
        "/reset" => {
            if let Ok(mut stream) = respond.send_response(ok().body(()).unwrap(), false) {
                let _ = stream.send_data(Bytes::from_static(b"partial"), false);
                tokio::time::sleep(Duration::from_millis(100)).await;
                stream.send_reset(Reason::INTERNAL_ERROR);
            }
        }
        "/hold" => {
            let outcome = loop {
                match body.data().await {
                    Some(Ok(chunk)) => {
                        let _ = body.flow_control().release_capacity(chunk.len());
                    }
                    Some(Err(_)) => break "reset",
                    None => break "end",
                }
            };
            let _ = held.send(outcome).await;
        }
        "/big" => {
            let Ok(mut stream) = respond.send_response(ok().body(()).unwrap(), false) else {
                return;
            };
            let data: Vec<u8> = (0..BIG).map(pattern).collect();
            let mut sent = 0;
            while sent < BIG {
                stream.reserve_capacity(BIG - sent);
                let cap = match std::future::poll_fn(|cx| stream.poll_capacity(cx)).await {
                    Some(Ok(n)) => n,
                    _ => return,
                };
                let end = (sent + cap).min(BIG);
                if stream
                    .send_data(Bytes::copy_from_slice(&data[sent..end]), end == BIG)
                    .is_err()
                {
                    return;
                }
                sent = end;
            }
        }
        "/early" => {
            // Answers at once, then reads the whole request body (HTTP/2 allows both).
            let _ = respond.send_response(ok().body(()).unwrap(), true);
            let mut len = 0;
            let outcome = loop {
                match body.data().await {
                    Some(Ok(chunk)) => {
                        len += chunk.len();
                        let _ = body.flow_control().release_capacity(chunk.len());
                    }
                    Some(Err(_)) => break "reset",
                    None if len == EARLY_BODY => break "whole",
                    None => break "short",
                }
            };
            let _ = held.send(outcome).await;
        }
        "/stall" => {
            // Reads nothing of the body for longer than the test takes on a loaded machine (the
            // test shuts the sidecar down first): the client is held to the windows. Once it
            // let go (3 s, before), a slow run saw the windows open again and more sent.
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(body);
            let _ = respond.send_response(ok().body(()).unwrap(), true);
        }
        "/content-length" => {
            // Says what `content-length` the request came with.
            let got = req_content_length.unwrap_or_else(|| "none".into());
            let resp = ok().header("x-content-length", got).body(()).unwrap();
            let _ = respond.send_response(resp, true);
        }
        "/with-body" => {
            let resp = ok().header("content-length", "5").body(()).unwrap();
            if let Ok(mut stream) = respond.send_response(resp, false) {
                let _ = stream.send_data(Bytes::from_static(b"hello"), true);
            }
        }
        "/echo" => {
            let (mut len, mut intact) = (0usize, true);
            while let Some(chunk) = body.data().await {
                let Ok(chunk) = chunk else { return };
                for (i, b) in chunk.iter().enumerate() {
                    intact &= *b == pattern(len + i);
                }
                len += chunk.len();
                let _ = body.flow_control().release_capacity(chunk.len());
            }
            if let Ok(mut stream) = respond.send_response(ok().body(()).unwrap(), false) {
                let _ = stream.send_data(Bytes::from(format!("{len} {intact}")), true);
            }
        }
        _ => {
            let resp = http::Response::builder().status(404).body(()).unwrap();
            let _ = respond.send_response(resp, true);
        }
    }
}

struct Setup {
    client: h2::client::SendRequest<Bytes>,
    sidecar: spur_sidecar::Sidecar,
    seen: Arc<Seen>,
    held: mpsc::Receiver<&'static str>,
}

/// The sidecar in front of the upstream, with its HTTP/2 relay on or off (hyper's server and
/// client): every test runs against both.
async fn setup(relay: bool) -> Setup {
    // Shown with a failing test's output: which path failed.
    eprintln!("the sidecar's HTTP/2 relay is on: {relay}");
    let seen = Arc::new(Seen::default());
    let (tx, held) = mpsc::channel(8);
    let app = upstream(seen.clone(), tx).await;
    let sidecar = sidecar_for(
        app,
        ProxyConfig {
            drain_grace: Duration::from_secs(1),
            http2_relay: relay,
            ..ProxyConfig::default()
        },
    )
    .await;
    let tcp = TcpStream::connect(sidecar.inbound_addr).await.unwrap();
    let (client, conn) = h2::client::Builder::new()
        // Smaller than the 4 MiB bodies: the windows must be replenished many times.
        .initial_window_size(65_535)
        .initial_connection_window_size(65_535)
        .handshake(tcp)
        .await
        .unwrap();
    tokio::spawn(conn);
    Setup {
        client,
        sidecar,
        seen,
        held,
    }
}

fn request(method: &str, path: &str) -> http::Request<()> {
    http::Request::builder()
        .method(method)
        .uri(format!("http://app{path}"))
        .body(())
        .unwrap()
}

/// Reads a body to its end (releasing flow-control capacity as it goes): the bytes, or the
/// stream error.
async fn read_all(body: &mut h2::RecvStream) -> Result<Vec<u8>, h2::Error> {
    let mut out = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        out.extend_from_slice(&chunk);
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_only_responses_arrive_whole() {
    for relay in [true, false] {
        let mut s = setup(relay).await;
        let client = s.client.clone().ready().await.unwrap();
        let mut client = client;
        let (resp, _) = client
            .send_request(request("POST", "/trailers-only"), true)
            .unwrap();
        let resp = timeout(BOUND, resp).await.unwrap().unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["grpc-status"], "7");
        assert_eq!(resp.headers()["grpc-message"], "denied");
        // The upstream sent no `Date`: the proxy adds one (RFC 9110 §6.6.1).
        let date = resp.headers()["date"].to_str().unwrap();
        let at = httpdate::parse_http_date(date).unwrap();
        assert!(
            std::time::SystemTime::now()
                .duration_since(at)
                .is_ok_and(|d| d.as_secs() <= 5),
            "{date}"
        );
        let mut body = resp.into_body();
        assert_eq!(
            timeout(BOUND, read_all(&mut body)).await.unwrap().unwrap(),
            b""
        );
        s.sidecar.shutdown().await;
        s.held.close();
    }
}

/// A request that ends with its head reaches the upstream with `content-length: 0` when its
/// method gives content a meaning, as hyper's client sends it, and without one otherwise; a
/// length the client sent is kept. Both paths agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_less_request_says_its_length_where_its_method_gives_content_a_meaning() {
    for relay in [true, false] {
        let s = setup(relay).await;
        for (method, sent, want) in [
            ("POST", None, "0"),
            ("PUT", None, "0"),
            ("PATCH", None, "0"),
            ("OPTIONS", None, "0"),
            ("GET", None, "none"),
            ("HEAD", None, "none"),
            ("DELETE", None, "none"),
            ("POST", Some("0"), "0"),
        ] {
            let mut req = request(method, "/content-length");
            if let Some(len) = sent {
                req.headers_mut()
                    .insert("content-length", http::HeaderValue::from_static(len));
            }
            let mut client = s.client.clone().ready().await.unwrap();
            let (resp, _) = client.send_request(req, true).unwrap();
            let resp = timeout(BOUND, resp).await.unwrap().unwrap();
            assert_eq!(resp.status(), 200, "{method}");
            assert_eq!(
                resp.headers()["x-content-length"],
                want,
                "{method} {sent:?}, relay {relay}"
            );
        }
        s.sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_an_upstream_sends_on_a_head_response_is_dropped_not_the_stream() {
    for relay in [true, false] {
        let s = setup(relay).await;
        for (method, body) in [("HEAD", &b""[..]), ("GET", &b"hello"[..])] {
            let mut client = s.client.clone().ready().await.unwrap();
            let (resp, _) = client
                .send_request(request(method, "/with-body"), true)
                .unwrap();
            let resp = timeout(BOUND, resp).await.unwrap().unwrap();
            assert_eq!(resp.status(), 200, "{method}");
            assert_eq!(resp.headers()["content-length"], "5", "{method}");
            let mut got = resp.into_body();
            let read = timeout(BOUND, read_all(&mut got)).await.unwrap();
            assert_eq!(read.as_deref().ok(), Some(body), "{method}: {read:?}");
        }
        s.sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_travel_both_ways() {
    for relay in [true, false] {
        let mut s = setup(relay).await;
        // Client → upstream: a request whose body is still open is reset by the client; the
        // upstream's read of it fails instead of waiting forever.
        let mut client = s.client.clone().ready().await.unwrap();
        let (resp, mut send) = client
            .send_request(request("POST", "/hold"), false)
            .unwrap();
        send.send_data(Bytes::from_static(b"some of the body"), false)
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        send.send_reset(Reason::CANCEL);
        drop(resp);
        let outcome = timeout(BOUND, s.held.recv())
            .await
            .expect("the upstream learned how the body ended")
            .unwrap();
        assert_eq!(outcome, "reset");

        // Upstream → client: headers, some data, then RST_STREAM: the client's body read fails,
        // it neither hangs nor ends cleanly.
        let mut client = s.client.clone().ready().await.unwrap();
        let (resp, _) = client.send_request(request("GET", "/reset"), true).unwrap();
        let resp = timeout(BOUND, resp).await.unwrap().unwrap();
        let mut body = resp.into_body();
        let read = timeout(BOUND, read_all(&mut body))
            .await
            .expect("the reset reached the client");
        let err = read.expect_err("a reset stream read as complete");
        // The upstream's reason, not one of the sidecar's own.
        assert_eq!(err.reason(), Some(Reason::INTERNAL_ERROR), "{err}");

        // The connection is still usable after both.
        let mut client = s.client.clone().ready().await.unwrap();
        let (resp, _) = client
            .send_request(request("GET", "/trailers-only"), true)
            .unwrap();
        assert_eq!(timeout(BOUND, resp).await.unwrap().unwrap().status(), 200);
        s.sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_larger_than_every_window_flow_both_ways() {
    for relay in [true, false] {
        let s = setup(relay).await;
        // Download: 4 MiB through 64 KiB windows.
        let mut client = s.client.clone().ready().await.unwrap();
        let (resp, _) = client.send_request(request("GET", "/big"), true).unwrap();
        let resp = timeout(BOUND, resp).await.unwrap().unwrap();
        let mut body = resp.into_body();
        let got = timeout(Duration::from_secs(30), read_all(&mut body))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.len(), BIG);
        assert!(got.iter().enumerate().all(|(i, b)| *b == pattern(i)));

        // Upload: 4 MiB, sent as the sidecar grants capacity.
        let mut client = s.client.clone().ready().await.unwrap();
        let (resp, mut send) = client
            .send_request(request("POST", "/echo"), false)
            .unwrap();
        let data: Vec<u8> = (0..BIG).map(pattern).collect();
        let upload = async {
            let mut sent = 0;
            while sent < BIG {
                send.reserve_capacity(BIG - sent);
                let cap = std::future::poll_fn(|cx| send.poll_capacity(cx))
                    .await
                    .unwrap()
                    .unwrap();
                let end = (sent + cap).min(BIG);
                send.send_data(Bytes::copy_from_slice(&data[sent..end]), end == BIG)
                    .unwrap();
                sent = end;
            }
        };
        timeout(Duration::from_secs(30), upload).await.unwrap();
        let resp = timeout(BOUND, resp).await.unwrap().unwrap();
        let mut body = resp.into_body();
        let answer = timeout(BOUND, read_all(&mut body)).await.unwrap().unwrap();
        assert_eq!(String::from_utf8(answer).unwrap(), format!("{BIG} true"));
        s.sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_limits_are_advertised_and_enforced() {
    for relay in [true, false] {
        let s = setup(relay).await;
        let mut client = s.client.clone().ready().await.unwrap();
        // One exchange first: by its end the sidecar's SETTINGS have been applied.
        let (resp, _) = client
            .send_request(request("GET", "/trailers-only"), true)
            .unwrap();
        timeout(BOUND, resp).await.unwrap().unwrap();
        // The sidecar's SETTINGS: a bounded number of concurrent streams.
        let max = client.current_max_send_streams();
        assert!((1..=1024).contains(&max), "max concurrent streams {max}");
        // A header list over the sidecar's limit (64 KiB by default) is refused: never forwarded.
        let mut client = client.ready().await.unwrap();
        let big = "x".repeat(200 * 1024);
        let req = http::Request::builder()
            .uri("http://app/echo")
            .header("x-big", big)
            .body(())
            .unwrap();
        let refused = match client.send_request(req, true) {
            Err(_) => true,
            Ok((resp, _)) => match timeout(BOUND, resp).await.unwrap() {
                Err(_) => true,
                Ok(r) => r.status() == 431,
            },
        };
        assert!(refused, "an oversized header list was answered");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !s.seen.paths.lock().unwrap().iter().any(|p| p == "/echo"),
            "an oversized header list reached the upstream"
        );
        s.sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_reads_nothing_holds_the_client_to_the_windows() {
    // The sidecar passes the windows through: it takes from the client what its own window
    // for the stream allows (1 MiB) and gives it back only as the upstream's window (64 KiB)
    // takes it, so a stalled upstream stops the client there, with nothing piling up between.
    for relay in [true, false] {
        let s = setup(relay).await;
        let mut client = s.client.clone().ready().await.unwrap();
        let (_resp, mut send) = client
            .send_request(request("POST", "/stall"), false)
            .unwrap();
        let chunk = Bytes::from(vec![7u8; 16 * 1024]);
        let mut sent = 0usize;
        loop {
            send.reserve_capacity(chunk.len());
            let cap = timeout(
                Duration::from_millis(700),
                std::future::poll_fn(|cx| send.poll_capacity(cx)),
            )
            .await;
            let Ok(Some(Ok(cap))) = cap else { break };
            let n = cap.min(chunk.len());
            send.send_data(chunk.slice(..n), false).unwrap();
            sent += n;
            assert!(
                sent <= BIG,
                "the client sent {sent} bytes to an upstream that reads nothing"
            );
        }
        let most = (1 << 20) + 65_535;
        assert!(
            (65_535..=most).contains(&sent),
            "the client could send {sent} bytes to an upstream that reads nothing (at most {most})"
        );
        s.sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_goes_on_after_an_early_response() {
    for relay in [true, false] {
        let mut s = setup(relay).await;
        let mut client = s.client.clone().ready().await.unwrap();
        let (resp, mut send) = client
            .send_request(request("POST", "/early"), false)
            .unwrap();
        let resp = timeout(BOUND, resp).await.unwrap().unwrap();
        assert_eq!(resp.status(), 200);
        let mut sent = 0;
        while sent < EARLY_BODY {
            send.reserve_capacity(EARLY_BODY - sent);
            let cap = timeout(BOUND, std::future::poll_fn(|cx| send.poll_capacity(cx)))
                .await
                .expect("capacity for the rest of the body")
                .unwrap()
                .unwrap();
            let n = cap.min(EARLY_BODY - sent);
            send.send_data(Bytes::from(vec![1u8; n]), sent + n == EARLY_BODY)
                .unwrap();
            sent += n;
        }
        let outcome = timeout(BOUND, s.held.recv()).await.unwrap().unwrap();
        assert_eq!(
            outcome, "whole",
            "the upstream did not get the body sent after its answer"
        );
        s.sidecar.shutdown().await;
    }
}
