//! Routing through a real sidecar: every key carrier, precedence between several keys, unknown
//! and absent keys, live table swaps under load, and stale pooled connections.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use spur_e2e::{Env, EnvOptions, get, get_h2, metrics, rule_yaml, sample};
use tokio::net::{TcpListener, TcpStream};

async fn served_by(env: &Env, headers: &[(&str, &str)]) -> String {
    let got = get(env.addr(), "/", headers).await.unwrap();
    assert_eq!(got.status, 200, "{got:?}");
    got.served_by().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_carrier_reaches_the_fork() {
    let env = Env::http().await;
    let cases: &[&[(&str, &str)]] = &[
        &[("baggage", "sd-routing-key=k1")],
        &[("baggage", "spur-routing-key=k1")],
        &[("baggage", "sd-sandbox=k1")],
        &[("baggage", "sd-workspace=k1")],
        &[(
            "baggage",
            "userId=alice, sd-routing-key = k1 ;prop=1, other=x",
        )],
        &[
            ("baggage", "userId=alice"),
            ("baggage", "sd-routing-key=k1"),
        ],
        &[("tracestate", "vendor=abc,sd-routing-key=k1")],
        &[("tracestate", "sd-sandbox=k1")],
        &[("ot-baggage-sd-routing-key", "k1")],
        &[("ot-baggage-sd-sandbox", "k1")],
        &[("uberctx-sd-routing-key", "k1")],
        &[("uberctx-sd-sandbox", "k1")],
        &[("x-route-to", "k1")],
    ];
    for headers in cases {
        assert_eq!(
            served_by(&env, headers).await,
            "fork",
            "carrier {headers:?}"
        );
    }
    // The same over HTTP/2.
    let got = get_h2(env.addr(), "/", &[("baggage", "sd-routing-key=k1")])
        .await
        .unwrap();
    assert_eq!(got.served_by(), "fork");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_parameter_is_stripped_and_reinjected_as_headers() {
    let env = Env::http().await;
    let got = get(env.addr(), "/headers?a=1&sd-routing-key=k1&b=2", &[])
        .await
        .unwrap();
    assert_eq!(got.served_by(), "fork");
    let seen = got.json();
    assert_eq!(seen["uri"], "/headers?a=1&b=2", "{seen}");
    let baggage = seen["headers"]["baggage"].to_string();
    assert!(
        baggage.contains("sd-routing-key=k1"),
        "key re-injected into baggage: {seen}"
    );
    assert_eq!(seen["headers"]["uberctx-sd-routing-key"][0], "k1");
    // A query parameter that only shares a prefix is left alone.
    let got = get(env.addr(), "/headers?sd-routing-keyx=k1", &[])
        .await
        .unwrap();
    assert_eq!(got.served_by(), "baseline");
    assert_eq!(got.json()["uri"], "/headers?sd-routing-keyx=k1");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_key_unknown_key_and_other_ports_reach_the_baseline() {
    let env = Env::http().await;
    assert_eq!(served_by(&env, &[]).await, "baseline");
    assert_eq!(
        served_by(&env, &[("baggage", "sd-routing-key=unknown")]).await,
        "baseline"
    );
    assert_eq!(
        served_by(&env, &[("baggage", "sd-routing-key=k1 x")]).await,
        "baseline",
        "invalid key"
    );
    assert_eq!(
        served_by(&env, &[("baggage", "routing-key=k1")]).await,
        "baseline",
        "other member"
    );
    // A rule for another workload port does not apply to this one.
    env.write_raw_rules(&rule_yaml("k1", env.baseline.port() + 1, env.fork("fork")));
    env.wait_version(2).await;
    assert_eq!(
        served_by(&env, &[("baggage", "sd-routing-key=k1")]).await,
        "baseline"
    );
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_keys_first_with_a_rule_wins() {
    let env = Env::start(EnvOptions {
        extra_forks: vec!["fork2"],
        rules: vec![("k1", "fork"), ("k2", "fork2")],
        ..EnvOptions::default()
    })
    .await;
    // Unknown candidates are skipped.
    let h = [("x-route-to", "nope"), ("baggage", "sd-routing-key=k1")];
    assert_eq!(served_by(&env, &h).await, "fork");
    // Custom headers come before baggage.
    let h = [("x-route-to", "k2"), ("baggage", "sd-routing-key=k1")];
    assert_eq!(served_by(&env, &h).await, "fork2");
    // Within baggage, sd-routing-key comes before sd-sandbox whatever the order on the wire.
    let h = [("baggage", "sd-sandbox=k2,sd-routing-key=k1")];
    assert_eq!(served_by(&env, &h).await, "fork");
    // Baggage comes before tracestate and the legacy headers.
    let h = [
        ("uberctx-sd-routing-key", "k2"),
        ("tracestate", "sd-routing-key=k2"),
        ("baggage", "sd-routing-key=k1"),
    ];
    assert_eq!(served_by(&env, &h).await, "fork");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_rerouted_at_most_once() {
    let env = Env::http().await;
    let mark = format!(
        "Deployment/{}/{}",
        spur_e2e::NAMESPACE,
        spur_e2e::BASELINE_NAME
    );
    let h = [
        ("baggage", "sd-routing-key=k1"),
        ("x-spur-routed", mark.as_str()),
    ];
    assert_eq!(
        served_by(&env, &h).await,
        "baseline",
        "already routed by this baseline's sidecar"
    );
    // The fork sees the mark, so a destination that points back here cannot loop.
    let got = get(env.addr(), "/headers", &[("baggage", "sd-routing-key=k1")])
        .await
        .unwrap();
    assert_eq!(got.json()["headers"]["x-spur-routed"][0], mark.as_str());
    // Another baseline's mark does not stop routing here.
    let h = [
        ("baggage", "sd-routing-key=k1"),
        ("x-spur-routed", "Deployment/other/svc"),
    ];
    assert_eq!(served_by(&env, &h).await, "fork");
    env.shutdown().await;
}

/// Clients on kept-alive connections keep sending while the rule file flips the key between two
/// forks; not one request may fail, and each lands on a fork.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_swaps_under_load_lose_no_request() {
    let env = Env::start(EnvOptions {
        extra_forks: vec!["fork2"],
        ..EnvOptions::default()
    })
    .await;
    let addr = env.addr();
    let done = Arc::new(AtomicUsize::new(0));
    // The clients run from before the first swap until after the last one, so the swaps
    // overlap the load by construction (bounded: at most 5 000 requests each).
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let done = done.clone();
        let stop = stop.clone();
        clients.push(tokio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .unwrap();
            tokio::spawn(conn);
            let mut forks = Vec::new();
            while !stop.load(Ordering::Relaxed) && forks.len() < 5_000 {
                let req = http::Request::get("/")
                    .header("host", "app")
                    .header("baggage", "sd-routing-key=k1")
                    .body(Empty::<Bytes>::new())
                    .unwrap();
                send.ready()
                    .await
                    .expect("connection closed during a table swap");
                let resp = send
                    .send_request(req)
                    .await
                    .expect("request failed during a table swap");
                assert_eq!(resp.status(), 200);
                let by = resp.headers()["x-served-by"].to_str().unwrap().to_string();
                resp.into_body().collect().await.unwrap();
                forks.push(by);
                done.fetch_add(1, Ordering::Relaxed);
            }
            forks
        }));
    }
    let started = tokio::time::Instant::now();
    while done.load(Ordering::Relaxed) < 40 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the load never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before_swaps = done.load(Ordering::Relaxed);
    let mut version = env.version();
    for i in 0..10 {
        let to = if i % 2 == 0 { "fork2" } else { "fork" };
        env.write_rules(&[("k1", to)]);
        version += 1;
        env.wait_version(version).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let during_swaps = done.load(Ordering::Relaxed) - before_swaps;
    stop.store(true, Ordering::Relaxed);
    let mut seen = std::collections::BTreeSet::new();
    let mut total = 0;
    for c in clients {
        for by in tokio::time::timeout(Duration::from_secs(60), c)
            .await
            .unwrap()
            .unwrap()
        {
            assert!(by == "fork" || by == "fork2", "keyed request reached {by}");
            seen.insert(by);
            total += 1;
        }
    }
    // Every request was answered, and the load really crossed the swaps: requests completed
    // while they happened, and both tables served some of them.
    assert_eq!(done.load(Ordering::Relaxed), total);
    assert!(
        during_swaps > 0,
        "no request completed while the tables were swapped"
    );
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        ["fork", "fork2"],
        "the keyed load did not see both tables"
    );
    // The last table (k1 → fork, after ten flips) is in force for new requests.
    assert_eq!(
        served_by(&env, &[("baggage", "sd-routing-key=k1")]).await,
        "fork"
    );
    let m = metrics(env.admin()).await;
    assert!(
        sample(&m, "spur_requests_total{outcome=\"error\"}") == 0.0,
        "{m}"
    );
    env.shutdown().await;
}

/// An upstream that counts its open connections; HTTP/1.1, or h2c with prior knowledge.
async fn counting_upstream(
    name: &'static str,
    h2: bool,
) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let open = Arc::new(AtomicUsize::new(0));
    let counter = open.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            counter.fetch_add(1, Ordering::SeqCst);
            let counter = counter.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|_req| async {
                    let mut r =
                        http::Response::new(http_body_util::Full::new(Bytes::from_static(b"ok\n")));
                    r.headers_mut()
                        .insert("x-served-by", http::HeaderValue::from_static(name));
                    Ok::<_, std::convert::Infallible>(r)
                });
                if h2 {
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
                } else {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                }
                counter.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    (addr, open)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_destination_loses_its_pooled_connections() {
    // HTTP/1.1 (idle pooled connections) and HTTP/2 (the relay's shared connection).
    for h2 in [false, true] {
        removed_destination_loses_its_pooled_connection(h2).await;
    }
}

async fn removed_destination_loses_its_pooled_connection(h2: bool) {
    let env = Env::start(EnvOptions {
        rules: vec![],
        ..EnvOptions::default()
    })
    .await;
    let (fork, open) = counting_upstream("counted-fork", h2).await;
    let served = |headers: &'static [(&'static str, &'static str)]| {
        let addr = env.addr();
        async move {
            let got = if h2 {
                get_h2(addr, "/", headers).await
            } else {
                get(addr, "/", headers).await
            };
            let got = got.unwrap();
            assert_eq!(got.status, 200, "{got:?}");
            got.served_by().to_string()
        }
    };
    // The version before the write: the sidecar may load the new file before the next line runs.
    let v = env.version() + 1;
    env.write_raw_rules(&rule_yaml("k1", env.baseline.port(), fork));
    env.wait_version(v).await;
    for _ in 0..3 {
        assert_eq!(
            served(&[("baggage", "sd-routing-key=k1")]).await,
            "counted-fork"
        );
    }
    // The sidecar keeps the upstream connection alive in its pool…
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while env.sidecar().proxy().idle_upstream_connections() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "upstream connection never pooled (HTTP/2: {h2})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(open.load(Ordering::SeqCst) >= 1);
    if h2 {
        assert_eq!(
            open.load(Ordering::SeqCst),
            1,
            "three requests, one shared connection"
        );
    }
    // …until the destination leaves the table: then the fork sees it closed.
    env.write_raw_rules("[]\n");
    env.wait_version(v + 1).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while open.load(Ordering::SeqCst) != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "stale upstream connection still open (HTTP/2: {h2})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        served(&[("baggage", "sd-routing-key=k1")]).await,
        "baseline"
    );
    let m = metrics(env.admin()).await;
    assert!(sample(&m, "spur_pool_stale_closed_total") >= 1.0, "{m}");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_rule_file_keeps_the_last_good_table() {
    let env = Env::http().await;
    assert_eq!(
        served_by(&env, &[("baggage", "sd-routing-key=k1")]).await,
        "fork"
    );
    let before = env.version();
    env.write_raw_rules("- routingKey: [broken");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = metrics(env.admin()).await;
        if sample(&m, "spur_route_table_updates_total{result=\"rejected\"}") >= 1.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "rejection never reported: {m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(env.version(), before);
    assert_eq!(
        served_by(&env, &[("baggage", "sd-routing-key=k1")]).await,
        "fork"
    );
    let ready = get(env.admin(), "/ready", &[]).await.unwrap();
    assert_eq!(
        ready.status, 200,
        "a rejected update does not make the sidecar unready"
    );
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_overrides_map_service_names_to_fixed_addresses() {
    // A rule naming a cluster Service (which does not resolve here) reaches the fork through
    // the sidecar's `resolve` table; a Service name missing from the table fails cleanly (502).
    let mut env = Env::start(EnvOptions {
        rules: Vec::new(),
        ..EnvOptions::default()
    })
    .await;
    let fork = env.fork("fork");
    env.sidecar.take().unwrap().shutdown().await;
    let mut proxy = spur_proxy::ProxyConfig {
        drain_grace: Duration::from_secs(5),
        ..Default::default()
    };
    proxy
        .resolve
        .insert("web-sb.demo.svc.cluster.local:8080".into(), fork);
    let mut config = spur_e2e::sidecar_config(env.baseline);
    config.rules = Some(env.rules_path.clone());
    config.proxy = proxy;
    let rule = |key: &str, host: &str| {
        format!(
            "- routingKey: {key}\n  baseline: {{kind: Deployment, namespace: {}, name: {}}}\n  destinationSandbox: {{name: sb}}\n  mappings:\n    - workloadPort: {}\n      destinations: [{{host: {host}, port: 8080}}]\n",
            spur_e2e::NAMESPACE,
            spur_e2e::BASELINE_NAME,
            env.baseline.port()
        )
    };
    env.write_raw_rules(&format!(
        "{}{}",
        rule("k1", "Web-SB.demo.svc.cluster.local"),
        rule("k2", "missing.demo.svc.cluster.local")
    ));
    env.sidecar = Some(spur_sidecar::Sidecar::start(config).await.unwrap());
    env.wait_version(1).await;
    assert_eq!(
        served_by(&env, &[("baggage", "sd-routing-key=k1")]).await,
        "fork"
    );
    assert_eq!(served_by(&env, &[]).await, "baseline");
    let got = get(env.addr(), "/", &[("baggage", "sd-routing-key=k2")])
        .await
        .unwrap();
    assert_eq!(got.status, 502, "{got:?}");
    env.shutdown().await;
}

/// A client that opens its connection well before its first request (HTTP client pools do:
/// hyper's legacy client and Go's `net/http` dial a spare connection while a request waits, and
/// keep it idle when another frees up first) stays silent past `detectTimeout`. Its requests
/// are still HTTP and still routed: issue 47's chaos flake was a frontend's spare connection to
/// a baseline, silent for more than that second, after which every keyed request on it reached
/// the baseline as opaque TCP. The proxy opens the application's connection at the timeout (for
/// a server-first protocol's greeting, tests/tcp_tls.rs), and whichever side speaks first
/// decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_silent_past_detection_is_still_routed_when_it_speaks_http() {
    let env = Env::start(EnvOptions {
        proxy: spur_proxy::ProxyConfig {
            detect_timeout: Duration::from_millis(200),
            drain_grace: Duration::from_secs(5),
            ..spur_proxy::ProxyConfig::default()
        },
        ..EnvOptions::default()
    })
    .await;
    let request = |key: Option<&str>, h2: bool| {
        let mut req = if h2 {
            hyper::Request::get("http://app.test/")
        } else {
            hyper::Request::get("/").header("host", "app.test")
        };
        if let Some(k) = key {
            req = req.header("baggage", format!("sd-routing-key={k}"));
        }
        req.body(Empty::<Bytes>::new()).unwrap()
    };
    let served_by = |resp: &hyper::Response<hyper::body::Incoming>| {
        resp.headers()
            .get(spur_demo_apps::SERVED_BY)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let keys = [Some("k1"), None, Some("k1")];
    let expected = ["fork", "baseline", "fork"];

    // HTTP/1.1: three requests on a connection that was silent for 700 ms.
    let tcp = TcpStream::connect(env.addr()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut served = Vec::new();
    for key in keys {
        send.ready().await.unwrap();
        let resp = send.send_request(request(key, false)).await.unwrap();
        served.push(served_by(&resp));
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(served, expected, "HTTP/1.1");

    // h2c with prior knowledge, likewise.
    let tcp = TcpStream::connect(env.addr()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let mut served = Vec::new();
    for key in keys {
        send.ready().await.unwrap();
        let resp = send.send_request(request(key, true)).await.unwrap();
        served.push(served_by(&resp));
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(served, expected, "h2c");

    // Neither side spoke: each connection opened one to the application, HTTP was detected.
    let m = metrics(env.admin()).await;
    assert_eq!(
        sample(&m, "spur_connections_total{protocol=\"tcp\"}"),
        0.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, "spur_detect_silent_total{first=\"client\"}"),
        2.0,
        "{m}"
    );
    env.shutdown().await;
}
