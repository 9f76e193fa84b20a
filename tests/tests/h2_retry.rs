//! The HTTP/2 relay sends a request upstream again when the upstream did not process it (RFC
//! 9113 §8.7), against an `h2` server that refuses streams: RST_STREAM(REFUSED_STREAM) on a
//! connection's first stream (the retry is answered by the same connection), a GOAWAY whose last
//! stream id is below the stream (a server shutting down, as in a rolling update: the retry is
//! answered by a new connection, and the old one is not used again), a request whose body waits
//! until after the refusal (sent again with it), at most three attempts, and never a request of
//! which some body went upstream already (the client learns REFUSED_STREAM and can send it again
//! itself). Each answer names the connection and stream that gave it; the upstream records every
//! stream it saw; `spur_upstream_stream_retries_total{cause}` counts the retries.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use h2::Reason;
use spur_e2e::{metrics, sample, sidecar_for};
use spur_proxy::ProxyConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

const BOUND: Duration = Duration::from_secs(10);

/// What the upstream does with the streams it is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Script {
    /// Every connection's first stream is reset with REFUSED_STREAM as soon as its head comes;
    /// the others are answered.
    RefuseFirst,
    /// Every stream is reset with REFUSED_STREAM.
    RefuseAll,
    /// The first connection answers its first stream; at its second it stops, writes a GOAWAY
    /// with the first stream's id as the last one processed, and closes. Later connections
    /// answer everything.
    GoAwayAtSecond,
    /// The same with a GOAWAY for an error (PROTOCOL_ERROR): the stream was not processed, but
    /// may be what the upstream refused, so it is not sent again.
    ErrorGoAwayAtSecond,
    /// Every connection's first stream: the first chunk of its body is read, then the stream is
    /// reset with REFUSED_STREAM (the proxy cannot send again what it has forwarded).
    RefuseAfterBody,
}

/// One stream the upstream saw: its connection (1, 2, …), its place on that connection (1, 2,
/// …), its path, and what became of it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stream {
    conn: usize,
    nth: usize,
    path: String,
    fate: &'static str,
}

#[derive(Default)]
struct Seen {
    streams: Mutex<Vec<Stream>>,
    conns: AtomicUsize,
}

impl Seen {
    fn streams(&self) -> Vec<Stream> {
        self.streams.lock().unwrap().clone()
    }

    fn record(&self, conn: usize, nth: usize, path: &str, fate: &'static str) {
        self.streams.lock().unwrap().push(Stream {
            conn,
            nth,
            path: path.to_string(),
            fate,
        });
    }
}

/// An `h2` server playing `script`; answers are 200 with `x-answered-by: c<conn>s<nth>` and the
/// request body's length as their body.
async fn upstream(script: Script, seen: Arc<Seen>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                return;
            };
            let conn_no = seen.conns.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::spawn(connection(script, seen.clone(), conn_no, tcp));
        }
    });
    addr
}

async fn connection(script: Script, seen: Arc<Seen>, conn_no: usize, tcp: TcpStream) {
    // A second handle on the socket, to write a GOAWAY once h2 has let go of it: h2's server
    // sends GOAWAY only with the highest stream id it has read as the last one.
    let std = tcp.into_std().unwrap();
    let raw = std.try_clone().unwrap();
    let tcp = TcpStream::from_std(std).unwrap();
    let Ok(mut conn) = h2::server::handshake(tcp).await else {
        return;
    };
    let mut nth = 0;
    while let Some(Ok((req, mut respond))) = conn.accept().await {
        nth += 1;
        let path = req.uri().path().to_string();
        let first = nth == 1;
        match script {
            Script::RefuseAll => {}
            Script::RefuseFirst if first => {}
            Script::GoAwayAtSecond | Script::ErrorGoAwayAtSecond if conn_no == 1 && nth == 2 => {
                seen.record(conn_no, nth, &path, "goaway");
                // Nothing more from h2: whatever it has not written yet (a reset of this stream
                // when it is dropped) is never written.
                drop((req, respond, conn));
                let code = match script {
                    Script::ErrorGoAwayAtSecond => Reason::PROTOCOL_ERROR,
                    _ => Reason::NO_ERROR,
                };
                goaway_and_close(raw, 1, code);
                return;
            }
            Script::RefuseAfterBody if first => {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut body = req.into_body();
                    let got = body.data().await;
                    let fate = if matches!(got, Some(Ok(_))) {
                        "refused after a body chunk"
                    } else {
                        "refused without a body chunk"
                    };
                    seen.record(conn_no, nth, &path, fate);
                    respond.send_reset(Reason::REFUSED_STREAM);
                });
                continue;
            }
            _ => {
                tokio::spawn(answer(seen.clone(), conn_no, nth, path, req, respond));
                continue;
            }
        }
        seen.record(conn_no, nth, &path, "refused");
        respond.send_reset(Reason::REFUSED_STREAM);
    }
}

/// Reads the request body, then answers 200 naming the connection and stream, with the body's
/// length.
async fn answer(
    seen: Arc<Seen>,
    conn: usize,
    nth: usize,
    path: String,
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
) {
    let mut body = req.into_body();
    let mut len = 0;
    while let Some(chunk) = body.data().await {
        let Ok(chunk) = chunk else { return };
        len += chunk.len();
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    seen.record(conn, nth, &path, "answered");
    let resp = http::Response::builder()
        .status(200)
        .header("x-answered-by", format!("c{conn}s{nth}"))
        .body(())
        .unwrap();
    if let Ok(mut send) = respond.send_response(resp, false) {
        let _ = send.send_data(Bytes::from(len.to_string()), true);
    }
}

/// Writes GOAWAY(last stream id `last`, `code`) on the raw socket and closes it.
fn goaway_and_close(mut raw: std::net::TcpStream, last: u32, code: Reason) {
    let mut frame = vec![0, 0, 8, 0x7, 0, 0, 0, 0, 0];
    frame.extend_from_slice(&last.to_be_bytes());
    frame.extend_from_slice(&u32::from(code).to_be_bytes());
    raw.set_nonblocking(false).unwrap();
    raw.write_all(&frame).unwrap();
    let _ = raw.shutdown(std::net::Shutdown::Both);
}

struct Setup {
    client: h2::client::SendRequest<Bytes>,
    sidecar: spur_sidecar::Sidecar,
    seen: Arc<Seen>,
}

async fn setup(script: Script) -> Setup {
    let seen = Arc::new(Seen::default());
    let app = upstream(script, seen.clone()).await;
    let sidecar = sidecar_for(
        app,
        ProxyConfig {
            drain_grace: Duration::from_secs(1),
            http2_relay: true,
            ..ProxyConfig::default()
        },
    )
    .await;
    let tcp = TcpStream::connect(sidecar.inbound_addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    Setup {
        client,
        sidecar,
        seen,
    }
}

fn request(method: &str, path: &str) -> http::Request<()> {
    http::Request::builder()
        .method(method)
        .uri(format!("http://app{path}"))
        .body(())
        .unwrap()
}

/// The status, the `x-answered-by` header and the body of an answer.
async fn answered(resp: h2::client::ResponseFuture) -> (u16, String, String) {
    let resp = timeout(BOUND, resp).await.unwrap().unwrap();
    let status = resp.status().as_u16();
    let by = resp
        .headers()
        .get("x-answered-by")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let mut body = resp.into_body();
    let mut out = Vec::new();
    while let Some(chunk) = timeout(BOUND, body.data()).await.unwrap() {
        let chunk = chunk.unwrap();
        out.extend_from_slice(&chunk);
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    (status, by, String::from_utf8(out).unwrap())
}

async fn get(s: &Setup, path: &str) -> (u16, String, String) {
    let mut client = s.client.clone().ready().await.unwrap();
    let (resp, _) = client.send_request(request("GET", path), true).unwrap();
    answered(resp).await
}

/// `spur_upstream_stream_retries_total{cause}` now; the series must be exported.
async fn retries(s: &Setup, cause: &str) -> f64 {
    let text = metrics(s.sidecar.admin_addr.unwrap()).await;
    let series = format!("spur_upstream_stream_retries_total{{cause=\"{cause}\"}}");
    assert!(text.contains(&series), "{series} missing:\n{text}");
    sample(&text, &series)
}

fn stream(conn: usize, nth: usize, path: &str, fate: &'static str) -> Stream {
    Stream {
        conn,
        nth,
        path: path.to_string(),
        fate,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_stream_is_sent_again_and_answered() {
    let s = setup(Script::RefuseFirst).await;
    let (status, by, body) = get(&s, "/a").await;
    assert_eq!(status, 200, "{body}");
    // The connection's second stream: the refusal did not cost the connection.
    assert_eq!(by, "c1s2");
    assert_eq!(
        s.seen.streams(),
        [
            stream(1, 1, "/a", "refused"),
            stream(1, 2, "/a", "answered")
        ]
    );
    assert_eq!(retries(&s, "refused_stream").await, 1.0);
    assert_eq!(retries(&s, "goaway").await, 0.0);
    s.sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_above_a_goaway_last_stream_id_goes_to_a_new_connection() {
    let s = setup(Script::GoAwayAtSecond).await;
    assert_eq!(get(&s, "/a").await.1, "c1s1");
    // Stream 3 of the first connection is above the GOAWAY's last stream id (1): not processed,
    // so it is sent again, on a new connection.
    let (status, by, body) = get(&s, "/b").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(by, "c2s1");
    // The connection that went away is not used again.
    assert_eq!(get(&s, "/c").await.1, "c2s2");
    assert_eq!(
        s.seen.streams(),
        [
            stream(1, 1, "/a", "answered"),
            stream(1, 2, "/b", "goaway"),
            stream(2, 1, "/b", "answered"),
            stream(2, 2, "/c", "answered"),
        ]
    );
    assert_eq!(s.seen.conns.load(Ordering::SeqCst), 2);
    assert_eq!(retries(&s, "goaway").await, 1.0);
    assert_eq!(retries(&s, "refused_stream").await, 0.0);
    s.sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_above_an_error_goaway_is_not_sent_again() {
    let s = setup(Script::ErrorGoAwayAtSecond).await;
    assert_eq!(get(&s, "/a").await.1, "c1s1");
    // Above the last stream id, so not processed; but a GOAWAY for an error may have been
    // caused by this stream: it is answered as a failed upstream, not tried on a new connection.
    let (status, by, _) = get(&s, "/b").await;
    assert_eq!((status, by.as_str()), (502, ""));
    assert_eq!(s.seen.conns.load(Ordering::SeqCst), 1);
    // The next request connects again.
    assert_eq!(get(&s, "/c").await.1, "c2s1");
    assert_eq!(
        s.seen.streams(),
        [
            stream(1, 1, "/a", "answered"),
            stream(1, 2, "/b", "goaway"),
            stream(2, 1, "/c", "answered"),
        ]
    );
    assert_eq!(retries(&s, "goaway").await, 0.0);
    s.sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_body_comes_after_the_refusal_is_sent_again_with_it() {
    let s = setup(Script::RefuseFirst).await;
    let mut client = s.client.clone().ready().await.unwrap();
    let (resp, mut send) = client
        .send_request(request("POST", "/upload"), false)
        .unwrap();
    // The head alone goes upstream and is refused; the body follows once the request has gone
    // again.
    timeout(BOUND, async {
        while retries(&s, "refused_stream").await < 1.0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the refused request went again");
    send.send_data(Bytes::from_static(b"the whole body"), true)
        .unwrap();
    let (status, by, body) = answered(resp).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(by, "c1s2");
    assert_eq!(body, "14", "the body reached the upstream whole");
    assert_eq!(
        s.seen.streams(),
        [
            stream(1, 1, "/upload", "refused"),
            stream(1, 2, "/upload", "answered")
        ]
    );
    assert_eq!(retries(&s, "refused_stream").await, 1.0);
    s.sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_tried_three_times_at_most_then_refused_to_the_client() {
    let s = setup(Script::RefuseAll).await;
    let mut client = s.client.clone().ready().await.unwrap();
    let (resp, _) = client.send_request(request("GET", "/a"), true).unwrap();
    let err = timeout(BOUND, resp)
        .await
        .unwrap()
        .expect_err("a request refused every time was answered");
    // Nothing processed it: the client may send it again itself.
    assert_eq!(err.reason(), Some(Reason::REFUSED_STREAM), "{err}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        s.seen.streams(),
        [
            stream(1, 1, "/a", "refused"),
            stream(1, 2, "/a", "refused"),
            stream(1, 3, "/a", "refused"),
        ]
    );
    assert_eq!(retries(&s, "refused_stream").await, 2.0);
    s.sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_body_was_partly_forwarded_is_not_sent_again() {
    let s = setup(Script::RefuseAfterBody).await;
    let mut client = s.client.clone().ready().await.unwrap();
    let (resp, mut send) = client
        .send_request(request("POST", "/upload"), false)
        .unwrap();
    // Part of the body; the rest would follow, but the upstream refuses the stream once it has
    // the first part, which the proxy no longer has.
    send.send_data(Bytes::from_static(b"first part"), false)
        .unwrap();
    let err = timeout(BOUND, resp)
        .await
        .unwrap()
        .expect_err("a request refused after some of its body was answered");
    // Nothing processed it, so the client, which still has its body, may send it again.
    assert_eq!(err.reason(), Some(Reason::REFUSED_STREAM), "{err}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        s.seen.streams(),
        [stream(1, 1, "/upload", "refused after a body chunk")],
        "the upstream saw the request once"
    );
    assert_eq!(retries(&s, "refused_stream").await, 0.0);
    // The connection serves on.
    assert_eq!(get(&s, "/after").await.1, "c1s2");
    s.sidecar.shutdown().await;
}
