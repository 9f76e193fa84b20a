//! Issue 42, point 6 (the hub's part): slowloris against the hub's HTTPS listener (previews and
//! web view) and against the HTTP servers the agent runs on the hub's streams. hyper enforces
//! its header read timeout only with a timer set, and nothing bounded idle connections or what
//! one peer may hold.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::IpAddr;
use std::time::Duration;

use common::*;
use hyper_util::rt::TokioIo;
use spur_hub::agent::Scope;
use spur_hub::listener::ListenerLimits;
use spur_hub::protocol::{AGENT_BIND, Open};

fn short() -> ListenerLimits {
    ListenerLimits {
        handshake_timeout: Duration::from_secs(1),
        header_read_timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(2),
        max_per_peer: 4,
        max_total: 1000,
    }
}

/// Well above every limit above, well below "never".
const CUT_WITHIN: Duration = Duration::from_secs(6);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_that_never_ends_is_cut_off() {
    let hub = start_hub(settings(short())).await;
    let mut s = tls(&hub, WEB_HOST, b"http/1.1", None).await.unwrap();
    send(
        &mut s,
        b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-slow: a",
    )
    .await;
    let took = closed_within(&mut s, CUT_WITHIN)
        .await
        .expect("a partial request head held the connection");
    eprintln!("partial head closed after {took:?}");
    // Trickled a byte at a time: the deadline is the head's, not each read's.
    let mut s = tls(&hub, WEB_HOST, b"http/1.1", None).await.unwrap();
    send(&mut s, b"GET /healthz HTTP/1.1\r\n").await;
    let start = std::time::Instant::now();
    while start.elapsed() < CUT_WITHIN {
        if tokio::io::AsyncWriteExt::write_all(&mut s, b"x")
            .await
            .is_err()
        {
            break;
        }
        if closed_within(&mut s, Duration::from_millis(300))
            .await
            .is_ok()
        {
            break;
        }
    }
    assert!(
        start.elapsed() < CUT_WITHIN,
        "a trickled head held the connection for {:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_that_sends_nothing_more_is_closed() {
    let hub = start_hub(settings(short())).await;
    let mut s = tls(&hub, WEB_HOST, b"http/1.1", None).await.unwrap();
    send(&mut s, b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    closed_within(&mut s, CUT_WITHIN)
        .await
        .expect("an idle kept-alive connection stayed open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_says_hello_is_closed() {
    let hub = start_hub(settings(short())).await;
    let mut tcp = tcp_from(hub.preview, None).await.unwrap();
    closed_within(&mut tcp, CUT_WITHIN)
        .await
        .expect("a silent TCP client held the connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_without_requests_is_closed() {
    let hub = start_hub(settings(short())).await;
    let mut s = tls(&hub, WEB_HOST, b"h2", None).await.unwrap();
    // The connection preface and an empty SETTINGS frame; then nothing (or a HEADERS frame
    // that never ends, which is no request either).
    send(
        &mut s,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",
    )
    .await;
    closed_within(&mut s, CUT_WITHIN)
        .await
        .expect("an HTTP/2 connection with no request stayed open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_take_every_connection() {
    let mut limits = short();
    limits.handshake_timeout = Duration::from_secs(30);
    let hub = start_hub(settings(limits)).await;
    let mut held = Vec::new();
    for _ in 0..limits.max_per_peer {
        held.push(tcp_from(hub.preview, None).await.unwrap());
    }
    // Give the hub a moment to accept them all.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut excess = tcp_from(hub.preview, None).await.unwrap();
    closed_within(&mut excess, Duration::from_secs(2))
        .await
        .expect("a connection over the peer's limit was kept");
    // Another peer is served meanwhile.
    let other: IpAddr = "127.0.0.2".parse().unwrap();
    let s = tls(&hub, WEB_HOST, b"http/1.1", Some(other)).await.unwrap();
    let (mut send_req, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get("/healthz")
        .header("host", "localhost")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = send_req.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    // The held ones are still open (they were not what was cut).
    for mut h in held {
        assert!(
            closed_within(&mut h, Duration::from_millis(50))
                .await
                .is_err()
        );
    }
}

/// A traffic stream for a user (the agent refuses one without).
fn traffic_open() -> Open {
    Open::Traffic {
        as_user: spur_hub::users::KubeIdentity {
            user: "dev".into(),
            groups: vec![],
        },
    }
}

fn traffic() -> spur_discovery::Connector {
    // Never reached: the streams under test send no complete request.
    spur_discovery::Connector::named(
        spur_discovery::RouteServerConn::plain("127.0.0.1:9"),
        "traffic store",
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_closes_streams_whose_request_never_comes() {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    let scope = Scope {
        header_read_timeout: Duration::from_secs(1),
        ..Scope::default()
    };
    // Traffic streams are served only by an agent that can check its users (Kubernetes).
    let kube = FakeKube::start().await;
    start_agent(&hub, "east", Some(kube.client()), scope, Some(traffic())).await;
    let mut s = hub
        .clusters
        .open("east", &traffic_open(), Duration::from_secs(5))
        .await
        .unwrap();
    send(&mut s, b"GET /exchanges?sandbox=x HTTP/1.1\r\nho").await;
    closed_within(&mut s, CUT_WITHIN)
        .await
        .expect("the agent held a stream with a partial request head");
    // A stream whose Open frame never comes.
    let session = hub.clusters.get("east").unwrap();
    let mut raw = session.open_reverse(AGENT_BIND).await.unwrap();
    closed_within(&mut raw, CUT_WITHIN)
        .await
        .expect("the agent held a stream with no Open frame");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_serves_a_bounded_number_of_streams() {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    let scope = Scope {
        max_streams: 2,
        ..Scope::default()
    };
    // No Kubernetes: the hub's catalog holds no stream for long, and a served traffic stream is
    // answered with the agent's refusal to read without access checks (still served).
    start_agent(&hub, "east", None, scope, Some(traffic())).await;
    let refused = |r: &Result<spur_tunnel::Stream, spur_hub::Error>| {
        r.as_ref()
            .err()
            .is_some_and(|e| e.to_string().contains("as many streams"))
    };
    let session = hub.clusters.get("east").unwrap();
    // The hub's catalog may hold a slot for a moment (its streams, refused): retry until both
    // are ours.
    let mut held = Vec::new();
    for _ in 0..200 {
        if held.len() == 2 {
            break;
        }
        match session.open_reverse(AGENT_BIND).await {
            Ok(s) => held.push(s),
            Err(_) => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
    assert_eq!(held.len(), 2, "two streams were never served");
    let third = hub
        .clusters
        .open("east", &traffic_open(), Duration::from_secs(5))
        .await;
    assert!(
        refused(&third),
        "a third stream was served: {:?}",
        third.err()
    );
    drop(held);
    // Once they end, streams are served again.
    let mut ok = false;
    for _ in 0..100 {
        let r = hub
            .clusters
            .open("east", &traffic_open(), Duration::from_secs(5))
            .await;
        if !refused(&r) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok, "the agent did not serve again after its streams ended");
}
