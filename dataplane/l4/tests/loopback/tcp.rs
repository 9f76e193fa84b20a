use std::collections::BTreeMap;
use std::time::Duration;

use spur_l4::{
    ClusterConfig, HashKey, HealthCheckConfig, HealthProtocol, KeyRoute, KeyRouteConfig, LbPolicy,
    OutlierConfig, Protocol,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;

fn hashed(name: &str, workers: &[&TcpWorker], lb: LbPolicy) -> ClusterConfig {
    let eps = workers
        .iter()
        .map(|w| endpoint(&w.id, w.addr, None))
        .collect();
    let mut c = ClusterConfig::new(name, eps);
    c.lb = lb;
    c.hash_key = Some(HashKey::FirstBytes {
        offset: 0,
        length: 16,
    });
    c
}

fn key(i: usize) -> Vec<u8> {
    format!("stream-{i:09}|payload").into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_first_bytes_same_worker_and_half_close_keeps_the_echo() {
    let w = [
        tcp_worker("w0").await,
        tcp_worker("w1").await,
        tcp_worker("w2").await,
    ];
    let ws: Vec<&TcpWorker> = w.iter().collect();
    let h = Harness::start(valid(
        vec![listener(
            "t",
            Protocol::Tcp,
            hashed("c", &ws, LbPolicy::RingHash),
        )],
        vec![],
    ))
    .await;
    let addr = h.addr("t");
    for i in 0..20 {
        let a = tcp_exchange(addr, &key(i)).await.unwrap();
        let b = tcp_exchange(addr, &key(i)).await.unwrap();
        assert_eq!(who(&a), who(&b));
        // The client shut down writing first and still read the whole echo.
        let tag = format!("{}|", who(&a)).into_bytes();
        assert_eq!(a, [tag.as_slice(), &key(i)].concat());
    }

    // Half-close the other way round, with a large transfer: the client keeps writing after
    // reading the worker's tag, then shuts down and reads the full echo.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let body: Vec<u8> = (0..1_000_000u32).map(|i| (i % 253) as u8).collect();
    let (mut r, mut wr) = s.split();
    let write = async {
        wr.write_all(&key(1)).await.unwrap();
        wr.write_all(&body).await.unwrap();
        wr.shutdown().await.unwrap();
    };
    let mut got = Vec::new();
    let read = tokio::time::timeout(WAIT, r.read_to_end(&mut got));
    let ((), n) = tokio::join!(write, read);
    n.unwrap().unwrap();
    let tag_len = got.iter().position(|b| *b == b'|').unwrap() + 1;
    assert_eq!(got.len() - tag_len, key(1).len() + body.len());
    assert!(got[tag_len + key(1).len()..] == body[..]);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_streams_spread_evenly_and_a_fourth_worker_takes_about_a_quarter() {
    let w = [
        tcp_worker("w0").await,
        tcp_worker("w1").await,
        tcp_worker("w2").await,
        tcp_worker("w3").await,
    ];
    let three: Vec<&TcpWorker> = w[..3].iter().collect();
    let mut cluster = hashed("c", &three, LbPolicy::Maglev);
    let h = Harness::start(valid(
        vec![listener("t", Protocol::Tcp, cluster.clone())],
        vec![],
    ))
    .await;
    let addr = h.addr("t");
    // A stream open across the update keeps running.
    let mut steady = TcpStream::connect(addr).await.unwrap();
    steady.write_all(&key(999_999)).await.unwrap();
    let mut tag = [0u8; 3];
    steady.read_exact(&mut tag).await.unwrap();

    let mut before = Vec::with_capacity(1000);
    for i in 0..1000 {
        before.push(tcp_who(addr, &key(i)).await);
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for b in &before {
        *counts.entry(b).or_default() += 1;
    }
    for n in counts.values() {
        assert!((283..=383).contains(n), "{counts:?}");
    }

    cluster.endpoints.push(endpoint(&w[3].id, w[3].addr, None));
    h.set.update_endpoints("c", &cluster.endpoints).unwrap();
    let mut moved = 0;
    for (i, b) in before.iter().enumerate() {
        let now = tcp_who(addr, &key(i)).await;
        if &now != b {
            moved += 1;
            assert_eq!(now, "w3");
        }
    }
    eprintln!("tcp Maglev: spread {counts:?}, 3 → 4 moved {moved} of 1000");
    assert!((150..=300).contains(&moved), "{moved} of 1000 moved");

    steady.write_all(b"-still-here").await.unwrap();
    steady.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, steady.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert!(rest.ends_with(b"-still-here"));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_failing_tcp_checks_leaves_rotation_within_two_intervals() {
    let w = [
        tcp_worker("w0").await,
        tcp_worker("w1").await,
        tcp_worker("w2").await,
    ];
    let mut hp = [
        health_port().await,
        health_port().await,
        health_port().await,
    ];
    let eps = w
        .iter()
        .zip(&hp)
        .map(|(w, hp)| endpoint(&w.id, w.addr, Some(hp.port)))
        .collect();
    let mut cluster = ClusterConfig::new("c", eps);
    cluster.lb = LbPolicy::RingHash;
    cluster.hash_key = Some(HashKey::FirstBytes {
        offset: 0,
        length: 16,
    });
    let interval = Duration::from_millis(400);
    let timeout = Duration::from_millis(100);
    cluster.health_check = Some(HealthCheckConfig {
        interval,
        timeout,
        ..HealthCheckConfig::new(HealthProtocol::Tcp)
    });
    let h = Harness::start(valid(vec![listener("t", Protocol::Tcp, cluster)], vec![])).await;
    let addr = h.addr("t");
    let mut before = Vec::new();
    for i in 0..30 {
        before.push(tcp_who(addr, &key(i)).await);
    }
    assert!(before.iter().any(|w| w == "w2"));
    hp[2].close();
    let took = h
        .until(Duration::from_secs(5), |h| !h.healthy("c", "w2"))
        .await;
    assert!(
        took <= 2 * interval + timeout + Duration::from_millis(300),
        "took {took:?}"
    );
    for (i, was) in before.iter().enumerate() {
        let now = tcp_who(addr, &key(i)).await;
        if was == "w2" {
            assert_ne!(now, "w2");
        } else {
            assert_eq!(&now, was);
        }
    }
    assert!(h.metric(r#"l4_health_check_failures_total{cluster="c",endpoint="w2"}"#) >= 2.0);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_retry_the_next_endpoint_and_eject() {
    let live = tcp_worker("live").await;
    let dead = {
        let l = std::net::TcpListener::bind(localhost(0)).unwrap();
        l.local_addr().unwrap()
    };
    let mut cluster = ClusterConfig::new(
        "c",
        vec![
            endpoint("dead", dead, None),
            endpoint("live", live.addr, None),
        ],
    );
    cluster.outlier_detection = OutlierConfig {
        consecutive_failures: 2,
        base_ejection: Duration::from_secs(60),
        max_ejection: Duration::from_secs(60),
    };
    let h = Harness::start(valid(vec![listener("t", Protocol::Tcp, cluster)], vec![])).await;
    let addr = h.addr("t");
    // Round robin alternates; each stream that lands on `dead` is retried on `live`.
    for _ in 0..10 {
        assert_eq!(tcp_who(addr, b"hello").await, "live");
    }
    assert_eq!(
        h.metric(r#"l4_upstream_connect_failures_total{cluster="c",endpoint="dead"}"#),
        2.0,
        "ejected after two failures, then skipped"
    );
    assert_eq!(
        h.metric(r#"l4_endpoint_ejections_total{cluster="c",endpoint="dead"}"#),
        1.0
    );
    let status = h.set.clusters();
    assert!(
        status[0]
            .endpoints
            .iter()
            .any(|e| e.id == "dead" && e.ejected)
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_down_refuses_the_stream() {
    let dead = {
        let l = std::net::TcpListener::bind(localhost(0)).unwrap();
        l.local_addr().unwrap()
    };
    let h = Harness::start(valid(
        vec![listener(
            "t",
            Protocol::Tcp,
            ClusterConfig::new("c", vec![endpoint("dead", dead, None)]),
        )],
        vec![],
    ))
    .await;
    let out = tcp_exchange(h.addr("t"), b"x").await;
    assert!(out.map_or(true, |b| b.is_empty()), "closed without data");
    h.until(WAIT, |h| {
        h.metric(r#"l4_sessions_refused_total{listener="t",reason="connect_failed"}"#) == 1.0
    })
    .await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_routes_send_keyed_streams_to_the_sandbox_cluster() {
    let base = tcp_worker("base").await;
    let sbx = tcp_worker("sandbox").await;
    let mut l = listener(
        "t",
        Protocol::Tcp,
        ClusterConfig::new("base", vec![endpoint("base", base.addr, None)]),
    );
    l.key_route = Some(KeyRouteConfig {
        offset: 4,
        length: Some(6),
        routes: vec![KeyRoute {
            key: Some("sbx-01".into()),
            key_hex: None,
            cluster: "sbx".into(),
        }],
    });
    let h = Harness::start(valid(
        vec![l],
        vec![ClusterConfig::new(
            "sbx",
            vec![endpoint("sandbox", sbx.addr, None)],
        )],
    ))
    .await;
    let addr = h.addr("t");
    assert_eq!(tcp_who(addr, b"HDR:sbx-01 rest").await, "sandbox");
    assert_eq!(tcp_who(addr, b"HDR:sbx-02 rest").await, "base");
    assert_eq!(
        tcp_who(addr, b"sbx-01").await,
        "base",
        "the key must be at its offset"
    );
    // A client that sends fewer bytes than the key needs and ends is routed on what it sent.
    assert_eq!(tcp_who(addr, b"HDR").await, "base");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_stops_accepting_lets_streams_finish_then_cuts_them() {
    let w = tcp_worker("w0").await;
    let h = Harness::start(valid(
        vec![listener(
            "t",
            Protocol::Tcp,
            ClusterConfig::new("c", vec![endpoint("w0", w.addr, None)]),
        )],
        vec![],
    ))
    .await;
    let addr = h.addr("t");
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"one").await.unwrap();
    let mut buf = [0u8; 6];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"w0|one");
    h.shutdown.cancel();
    // The listener closes at once.
    h.until(WAIT, |_| std::net::TcpStream::connect(addr).is_err())
        .await;
    // The open stream still works during the 1 s grace.
    s.write_all(b"two").await.unwrap();
    let mut buf = [0u8; 3];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"two");
    tokio::time::timeout(Duration::from_secs(5), h.set.closed())
        .await
        .unwrap();
    // After the grace it was cut.
    let mut rest = Vec::new();
    let r = tokio::time::timeout(WAIT, s.read_to_end(&mut rest))
        .await
        .unwrap();
    assert!(r.is_err() || rest.is_empty());
}
