//! HTTP/2 conformance of the sidecar's listener: h2spec (github.com/summerwind/h2spec, built from
//! its Go module in `tests/go-h2spec` by `tests/go/build.sh`), every test of its default suite,
//! against a sidecar in explicit mode in front of an h2c-only upstream (hyper's HTTP/2 server):
//! one that answers HEAD without a body, and one that sends the body on HEAD too (as
//! `spur-bench-upstream` and some servers do; the sidecar drops it). h2spec speaks h2c with
//! prior knowledge; the
//! sidecar detects it and serves it with its HTTP/2 server, or, for bytes that are not HTTP at
//! all (h2spec's "invalid connection preface"), passes them to the upstream as opaque TCP, where
//! an HTTP/2-only server closes the connection.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use spur_demo_apps::CancellationToken;
use spur_proxy::ProxyConfig;
use tokio::net::TcpListener;

/// The upstream's answer to everything. h2spec's flow-control tests need a body of at least a
/// few bytes (with less they are skipped).
const BODY: &[u8] = b"hello from an h2c-only upstream, with a body long enough for h2spec's flow-control tests to run\n";

async fn answer(
    req: Request<Incoming>,
    body_on_head: bool,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let head = req.method() == Method::HEAD && !body_on_head;
    // Read the whole request (h2spec sends bodies and trailers) before answering.
    let _ = req.into_body().collect().await;
    let body = if head {
        Bytes::new()
    } else {
        Bytes::from_static(BODY)
    };
    let mut resp = Response::new(Full::new(body));
    resp.headers_mut().insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from(BODY.len()),
    );
    Ok(resp)
}

/// An h2c-only server on loopback until `stop` is cancelled.
async fn h2_upstream(stop: CancellationToken, body_on_head: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(_) => continue,
                },
                () = stop.cancelled() => return,
            };
            let stop = stop.clone();
            tokio::spawn(async move {
                let conn = http2::Builder::new(TokioExecutor::new()).serve_connection(
                    TokioIo::new(tcp),
                    service_fn(move |req| answer(req, body_on_head)),
                );
                tokio::select! {
                    _ = conn => {}
                    () = stop.cancelled() => {}
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2spec_passes_every_test_against_the_sidecar() {
    for body_on_head in [false, true] {
        h2spec_against(body_on_head).await;
    }
}

async fn h2spec_against(body_on_head: bool) {
    let stop = CancellationToken::new();
    let upstream = h2_upstream(stop.clone(), body_on_head).await;
    let sidecar = spur_e2e::sidecar_for(
        upstream,
        ProxyConfig {
            drain_grace: Duration::from_secs(5),
            ..ProxyConfig::default()
        },
    )
    .await;
    let port = sidecar.inbound_addr.port().to_string();
    let h2spec = spur_e2e::go_bin_dir().join("h2spec");
    // -o: seconds h2spec waits for each expected frame.
    let run = tokio::process::Command::new(&h2spec)
        .args(["-h", "127.0.0.1", "-p", &port, "-o", "3"])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(240), run)
        .await
        .expect("h2spec did not finish within 240 s")
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", h2spec.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout
        .lines()
        .rev()
        .find(|l| l.contains(" tests, "))
        .unwrap_or_else(|| {
            panic!(
                "no summary from h2spec:\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    // "145 tests, 145 passed, 0 skipped, 0 failed"
    let numbers: Vec<u32> = summary
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    let [total, passed, skipped, failed] = numbers[..] else {
        panic!("unexpected h2spec summary {summary:?}");
    };
    assert!(total >= 145, "{summary}");
    assert_eq!(
        (passed, skipped, failed),
        (total, 0, 0),
        "h2spec (the upstream sends a body on HEAD: {body_on_head}): {summary}\n{stdout}"
    );
    assert!(out.status.success(), "h2spec exited {}", out.status);
    sidecar.shutdown().await;
    stop.cancel();
}
