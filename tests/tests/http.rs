//! HTTP/1.1 and HTTP/2 semantics through the sidecar: keep-alive with per-request routing,
//! pipelining, streamed bodies, header rewriting, and the admin endpoints.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use spur_e2e::{Env, get, get_h2, metrics, sample};
use spur_sidecar::{Sidecar, SidecarConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_routes_each_request_on_its_own() {
    let env = Env::http().await;
    let tcp = TcpStream::connect(env.addr()).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    for i in 0..20 {
        let mut req = http::Request::get("/").header("host", "app");
        if i % 2 == 1 {
            req = req.header("baggage", "sd-routing-key=k1");
        }
        send.ready().await.unwrap();
        let resp = send
            .send_request(req.body(Empty::<Bytes>::new()).unwrap())
            .await
            .unwrap();
        let by = resp.headers()["x-served-by"].to_str().unwrap().to_string();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let want = if i % 2 == 1 { "fork" } else { "baseline" };
        assert_eq!(by, want, "request {i} on the same connection");
        assert_eq!(body, format!("hello from {want}\n"));
    }
    let m = metrics(env.admin()).await;
    assert_eq!(
        sample(&m, "spur_requests_total{outcome=\"baseline\"}"),
        10.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, "spur_requests_total{outcome=\"sandbox\"}"),
        10.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, "spur_connections_total{protocol=\"http1\"}"),
        1.0,
        "{m}"
    );
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    let env = Env::http().await;
    let mut tcp = TcpStream::connect(env.addr()).await.unwrap();
    let pipeline = "GET / HTTP/1.1\r\nHost: a\r\n\r\n\
                    GET / HTTP/1.1\r\nHost: a\r\nbaggage: sd-routing-key=k1\r\n\r\n\
                    GET / HTTP/1.1\r\nHost: a\r\n\r\n\
                    GET / HTTP/1.1\r\nHost: a\r\nuberctx-sd-routing-key: k1\r\nConnection: close\r\n\r\n";
    tcp.write_all(pipeline.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&out);
    let order: Vec<&str> = text
        .match_indices("hello from ")
        .map(|(i, _)| {
            let rest = &text[i + 11..];
            &rest[..rest.find('\n').unwrap()]
        })
        .collect();
    assert_eq!(order, ["baseline", "fork", "baseline", "fork"], "{text}");
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 4);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_stream_both_ways_without_buffering_whole() {
    let env = Env::http().await;
    for h2 in [false, true] {
        let tcp = TcpStream::connect(env.addr()).await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
        let body = StreamBody::new(tokio_stream_from(rx));
        let req = http::Request::post(format!("http://{}/echo", env.addr()))
            .header("host", "app")
            .header("baggage", "sd-routing-key=k1")
            .body(body)
            .unwrap();
        let resp = if h2 {
            let (mut send, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                    .await
                    .unwrap();
            tokio::spawn(conn);
            send.send_request(req).await.unwrap()
        } else {
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .unwrap();
            tokio::spawn(conn);
            let (mut parts, body) = req.into_parts();
            parts.uri = "/echo".parse().unwrap();
            // Send the first chunk before awaiting the response: the echo must start flowing back
            // while the request body is still open, which only works if nothing buffers it whole.
            let fut = send.send_request(http::Request::from_parts(parts, body));
            tx.send(Ok(Frame::data(Bytes::from_static(b"first chunk;"))))
                .await
                .unwrap();
            let resp = fut.await.unwrap();
            assert_eq!(resp.headers()["x-served-by"], "fork");
            let mut body = resp.into_body();
            let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!(first.into_data().unwrap(), "first chunk;");
            let chunk = Bytes::from(vec![b'x'; 256 * 1024]);
            for _ in 0..16 {
                tx.send(Ok(Frame::data(chunk.clone()))).await.unwrap();
            }
            drop(tx);
            let rest = body.collect().await.unwrap().to_bytes();
            assert_eq!(rest.len(), 16 * 256 * 1024);
            assert!(rest.iter().all(|b| *b == b'x'));
            continue;
        };
        // HTTP/2: same, and the request's trailers come back as response trailers.
        tx.send(Ok(Frame::data(Bytes::from_static(b"first chunk;"))))
            .await
            .unwrap();
        assert_eq!(resp.headers()["x-served-by"], "fork");
        let mut body = resp.into_body();
        let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(first.into_data().unwrap(), "first chunk;");
        tx.send(Ok(Frame::data(Bytes::from(vec![b'y'; 1024 * 1024]))))
            .await
            .unwrap();
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-checksum", http::HeaderValue::from_static("abc"));
        tx.send(Ok(Frame::trailers(trailers))).await.unwrap();
        drop(tx);
        let collected = body.collect().await.unwrap();
        let got_trailers = collected.trailers().cloned();
        assert_eq!(collected.to_bytes().len(), 1024 * 1024);
        assert_eq!(got_trailers.unwrap()["x-checksum"], "abc");
    }
    env.shutdown().await;
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_are_removed_and_proxy_headers_added() {
    let env = Env::http().await;
    let got = get(
        env.addr(),
        "/headers",
        &[
            ("connection", "x-hop-secret"),
            ("x-hop-secret", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic Zm9vOmJhcg=="),
            ("x-forwarded-for", "192.0.2.7"),
            ("x-end-to-end", "kept"),
        ],
    )
    .await
    .unwrap();
    assert_eq!(got.served_by(), "baseline");
    let seen = got.json();
    let h = &seen["headers"];
    for gone in ["x-hop-secret", "keep-alive", "proxy-authorization"] {
        assert!(h.get(gone).is_none(), "{gone} reached the app: {seen}");
    }
    assert_eq!(h["x-end-to-end"][0], "kept");
    assert_eq!(h["via"][0], "1.1 spur");
    assert_eq!(h["x-forwarded-for"][0], "192.0.2.7, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"][0], "http");
    assert_eq!(h["host"][0], env.addr().to_string(), "Host is preserved");
    assert_eq!(got.headers["via"], "1.1 spur", "responses carry Via too");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_report_liveness_readiness_and_the_table() {
    let env = Env::http().await;
    assert_eq!(get(env.admin(), "/live", &[]).await.unwrap().status, 200);
    assert_eq!(get(env.admin(), "/ready", &[]).await.unwrap().status, 200);
    let dump = get(env.admin(), "/config_dump", &[]).await.unwrap().json();
    assert_eq!(dump["tableVersion"], 1);
    let published = dump["tablePublishedUnixMillis"].as_u64().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    assert!(
        u128::from(published) <= now && now - u128::from(published) < 600_000,
        "the table went live during this test: {published} vs now {now}"
    );
    assert_eq!(dump["routingRules"][0]["routingKey"], "k1");
    assert_eq!(
        dump["identity"]["baseline"]["name"],
        spur_e2e::BASELINE_NAME
    );
    let m = metrics(env.admin()).await;
    for series in [
        "spur_route_table_version 1",
        "spur_route_table_rules 1",
        "spur_request_duration_seconds_bucket",
        "spur_active_connections",
    ] {
        assert!(m.contains(series), "missing {series}: {m}");
    }
    assert_eq!(get(env.admin(), "/nope", &[]).await.unwrap().status, 404);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_until_a_valid_table_arrives() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    let app = spur_e2e::spawn_app(
        spur_e2e::AppKind::Http,
        "baseline",
        spur_demo_apps::CancellationToken::new(),
    )
    .await;
    let config = SidecarConfig {
        inject_key_file: None,
        kafka: None,
        rules: Some(rules.clone()),
        ..spur_e2e::sidecar_config(app)
    };
    let sidecar = Sidecar::start(config).await.unwrap();
    let admin = sidecar.admin_addr.unwrap();
    let ready = get(admin, "/ready", &[]).await.unwrap();
    assert_eq!(ready.status, 503, "no rules file yet");
    assert!(ready.body.contains("waiting"));
    // Traffic still flows to the application meanwhile.
    assert_eq!(
        get(sidecar.inbound_addr, "/", &[])
            .await
            .unwrap()
            .served_by(),
        "baseline"
    );
    std::fs::write(&rules, "[]\n").unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while get(admin, "/ready", &[]).await.unwrap().status != 200 {
        assert!(tokio::time::Instant::now() < deadline, "never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_upstream_fork_gets_502_and_baseline_keeps_working() {
    let env = Env::http().await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    env.write_raw_rules(&spur_e2e::rule_yaml("k1", env.baseline.port(), dead));
    env.wait_version(2).await;
    let got = get(env.addr(), "/", &[("baggage", "sd-routing-key=k1")])
        .await
        .unwrap();
    assert_eq!(got.status, 502);
    assert!(got.body.contains("upstream unavailable"));
    assert_eq!(
        get(env.addr(), "/", &[]).await.unwrap().served_by(),
        "baseline"
    );
    env.shutdown().await;
}

/// `/traces` (issue 46, `spur doctor propagation`): requests of a recorded trace are kept with
/// their carriers and keys, whether they came on the HTTP/1 relay (handed to the full path) or
/// over HTTP/2, and routed as any other; requests of other traces are not kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_traces_are_recorded_on_both_paths() {
    use spur_routing::trace::{format_id, recorded_id};
    let env = Env::http().await;
    let id = format_id(recorded_id(0x4bf92f3577b34da6a3ce929d0e0e4736));
    let tp = format!("00-{id}-00f067aa0ba902b7-01");
    let other = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let keyed = get(
        env.addr(),
        "/a",
        &[("traceparent", &tp), ("baggage", "sd-routing-key=k1")],
    )
    .await
    .unwrap();
    assert_eq!(keyed.served_by(), "fork");
    let plain = get(env.addr(), "/b", &[("x-b3-traceid", &id)])
        .await
        .unwrap();
    assert_eq!(plain.served_by(), "baseline");
    let h2 = get_h2(env.addr(), "/c", &[("traceparent", &tp)])
        .await
        .unwrap();
    assert_eq!(h2.served_by(), "baseline");
    let unsampled = get(
        env.addr(),
        "/d",
        &[("traceparent", other), ("baggage", "sd-routing-key=k1")],
    )
    .await
    .unwrap();
    assert_eq!(unsampled.served_by(), "fork");

    let traces = get(env.admin(), "/traces", &[]).await.unwrap().json();
    assert_eq!(
        traces["identity"]["baseline"]["name"],
        spur_e2e::BASELINE_NAME
    );
    let hops = traces["hops"].as_array().unwrap();
    let paths: Vec<&str> = hops.iter().map(|h| h["path"].as_str().unwrap()).collect();
    assert_eq!(paths, ["/a", "/b", "/c"], "{traces}");
    assert!(hops.iter().all(|h| h["traceId"] == id.as_str()));
    assert_eq!(hops[0]["keys"], serde_json::json!(["k1"]));
    assert_eq!(hops[0]["keyCarriers"], serde_json::json!(["baggage"]));
    assert_eq!(hops[0]["route"], "sandbox");
    assert_eq!(hops[0]["traceCarriers"], serde_json::json!(["traceparent"]));
    assert_eq!(hops[1]["keys"], serde_json::json!([]));
    assert_eq!(
        hops[1]["traceCarriers"],
        serde_json::json!(["x-b3-traceid"])
    );
    assert_eq!(hops[2]["route"], "baseline");
    let m = metrics(env.admin()).await;
    assert_eq!(sample(&m, "spur_traces_recorded_total"), 3.0, "{m}");
    env.shutdown().await;
}
