use std::collections::BTreeMap;
use std::time::Duration;

use spur_l4::{
    ClusterConfig, HashKey, HealthCheckConfig, HealthProtocol, KeyRoute, KeyRouteConfig, LbPolicy,
    Overflow, Protocol,
};

use crate::common::*;

fn hashed(name: &str, workers: &[&UdpWorker], lb: LbPolicy, key: HashKey) -> ClusterConfig {
    let eps = workers
        .iter()
        .map(|w| endpoint(&w.id, w.addr, None))
        .collect();
    let mut c = ClusterConfig::new(name, eps);
    c.lb = lb;
    c.hash_key = Some(key);
    c
}

fn first16() -> HashKey {
    HashKey::FirstBytes {
        offset: 0,
        length: 16,
    }
}

fn key(i: usize) -> Vec<u8> {
    format!("session-{i:08}|payload").into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_hash_key_from_two_source_ports_reaches_one_worker() {
    let w = [
        udp_worker("w0").await,
        udp_worker("w1").await,
        udp_worker("w2").await,
    ];
    let ws: Vec<&UdpWorker> = w.iter().collect();
    let h = Harness::start(valid(
        vec![
            listener(
                "bytes",
                Protocol::Udp,
                hashed("bytes", &ws, LbPolicy::RingHash, first16()),
            ),
            listener(
                "constant",
                Protocol::Udp,
                hashed(
                    "constant",
                    &ws,
                    LbPolicy::Maglev,
                    HashKey::Constant("k".into()),
                ),
            ),
        ],
        vec![],
    ))
    .await;
    let bytes = h.addr("bytes");
    // Every client stays open to the end: a dropped client's port can come back for a later one
    // and find the dropped one's session, sticky to another key's worker (a cold run's flake).
    let mut open = Vec::new();
    for i in 0..20 {
        let a = udp_client(bytes).await;
        let b = udp_client(bytes).await;
        assert_ne!(a.local_addr().unwrap(), b.local_addr().unwrap());
        let first = who(&udp_ask(&a, &key(i), WAIT).await.unwrap());
        assert_eq!(who(&udp_ask(&b, &key(i), WAIT).await.unwrap()), first);
        // The session sticks: later datagrams with other bytes go to the same worker.
        assert_eq!(
            who(&udp_ask(&a, b"anything else", WAIT).await.unwrap()),
            first
        );
        open.extend([a, b]);
    }
    let constant = h.addr("constant");
    let first = udp_who(constant, b"x").await;
    for i in 0..20 {
        assert_eq!(udp_who(constant, &key(i)).await, first);
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_sessions_spread_evenly_and_a_fourth_worker_takes_about_a_quarter() {
    raise_open_files();
    let w = [
        udp_worker("w0").await,
        udp_worker("w1").await,
        udp_worker("w2").await,
        udp_worker("w3").await,
    ];
    for lb in [LbPolicy::Maglev, LbPolicy::RingHash] {
        let three: Vec<&UdpWorker> = w[..3].iter().collect();
        let mut cluster = hashed("c", &three, lb, first16());
        // Small table: the 1000 sessions run through it, evicting as they go (bounded sockets).
        cluster.max_sessions = 100;
        let h = Harness::start(valid(
            vec![listener("u", Protocol::Udp, cluster.clone())],
            vec![],
        ))
        .await;
        let addr = h.addr("u");
        // One session that stays open across the update: it must keep its worker.
        let steady = udp_client(addr).await;
        let steady_worker = who(&udp_ask(&steady, &key(999_999), WAIT).await.unwrap());

        let mut clients = Clients::default();
        let mut before = Vec::with_capacity(1000);
        for i in 0..1000 {
            before.push(clients.who(addr, &key(i)).await);
            if i % 50 == 0 {
                // Keep the steady session the most recently active: it is never the one evicted.
                let _ = udp_ask(&steady, b"ping", WAIT).await.unwrap();
            }
        }
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for b in &before {
            *counts.entry(b).or_default() += 1;
        }
        assert_eq!(counts.len(), 3, "{lb:?}: {counts:?}");
        for (id, n) in &counts {
            // ±15 % of 333.
            assert!(
                (283..=383).contains(n),
                "{lb:?}: {id} got {n} of 1000: {counts:?}"
            );
        }
        assert_eq!(
            h.metric(r#"l4_sessions_evicted_total{listener="u"}"#),
            901.0
        );

        // 3 → 4 workers at run time.
        cluster.endpoints.push(endpoint(&w[3].id, w[3].addr, None));
        h.set.update_endpoints("c", &cluster.endpoints).unwrap();
        let _ = udp_ask(&steady, b"ping", WAIT).await.unwrap();
        let mut moved = 0;
        for (i, b) in before.iter().enumerate() {
            let now = clients.who(addr, &key(i)).await;
            if &now != b {
                moved += 1;
                assert_eq!(now, "w3", "{lb:?}: a key moved between old workers");
            }
            if i % 50 == 0 {
                let _ = udp_ask(&steady, b"ping", WAIT).await.unwrap();
            }
        }
        eprintln!("udp {lb:?}: spread {counts:?}, 3 → 4 moved {moved} of 1000");
        assert!(
            (150..=300).contains(&moved),
            "{lb:?}: {moved} of 1000 moved"
        );
        let still = who(&udp_ask(&steady, b"after", WAIT).await.unwrap());
        assert_eq!(still, steady_worker, "{lb:?}: an unaffected session moved");
        h.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_worker_leaves_rotation_within_two_intervals_and_its_sessions_move() {
    let w = [
        udp_worker("w0").await,
        udp_worker("w1").await,
        udp_worker("w2").await,
    ];
    let hp = [
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
    cluster.hash_key = Some(first16());
    let interval = Duration::from_millis(400);
    let timeout = Duration::from_millis(100);
    cluster.health_check = Some(HealthCheckConfig {
        path: Some("/ready".into()),
        interval,
        timeout,
        healthy_threshold: 1,
        unhealthy_threshold: 2,
        ..HealthCheckConfig::new(HealthProtocol::Http)
    });
    let h = Harness::start(valid(vec![listener("u", Protocol::Udp, cluster)], vec![])).await;
    let addr = h.addr("u");
    let mut clients = Vec::new();
    for i in 0..30 {
        let c = udp_client(addr).await;
        let worker = who(&udp_ask(&c, &key(i), WAIT).await.unwrap());
        clients.push((c, worker));
    }
    assert!(
        clients.iter().any(|(_, w)| w == "w1"),
        "some sessions on w1"
    );
    assert!(h.healthy("c", "w1"));

    // w1's health endpoint starts answering 503; its UDP port still works, so only the health
    // check can take it out.
    hp[1].set(false);
    let took = h
        .until(Duration::from_secs(5), |h| !h.healthy("c", "w1"))
        .await;
    // Two intervals (the second failing check) plus one check's timeout, plus polling slack.
    assert!(
        took <= 2 * interval + timeout + Duration::from_millis(300),
        "took {took:?}"
    );
    assert_eq!(
        h.metric(r#"l4_endpoint_healthy{cluster="c",endpoint="w1"}"#),
        0.0
    );
    let status = h.set.clusters();
    let w1 = &status[0].endpoints[1];
    assert_eq!(w1.last_health_error.as_deref(), Some("status 503"));
    assert_eq!(status[0].available(), 2);

    for (c, was) in &clients {
        let now = who(&udp_ask(c, b"again", WAIT).await.unwrap());
        if was == "w1" {
            assert_ne!(now, "w1");
        } else {
            assert_eq!(&now, was, "a session of a healthy worker moved");
        }
    }
    assert!(h.metric(r#"l4_sessions_rerouted_total{listener="u"}"#) >= 1.0);
    // New sessions for w1's keys go elsewhere too.
    let mut fresh = Clients::default();
    for i in 0..30 {
        assert_ne!(fresh.who(addr, &key(i)).await, "w1");
    }

    // Back in rotation once it passes again (healthy threshold 1).
    hp[1].set(true);
    h.until(Duration::from_secs(5), |h| h.healthy("c", "w1"))
        .await;
    for (i, (_, was)) in clients.iter().enumerate() {
        assert_eq!(&fresh.who(addr, &key(i)).await, was, "keys come back to w1");
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_and_largest_datagrams_pass_both_ways() {
    let w = udp_worker("w0").await;
    let h = Harness::start(valid(
        vec![listener(
            "u",
            Protocol::Udp,
            ClusterConfig::new("c", vec![endpoint("w0", w.addr, None)]),
        )],
        vec![],
    ))
    .await;
    let c = udp_client(h.addr("u")).await;
    // 0 bytes: the worker tags it, so the answer is exactly the tag.
    assert_eq!(udp_ask(&c, b"", WAIT).await.unwrap(), b"w0|");
    let big: Vec<u8> = (0..65_507u32).map(|i| (i % 251) as u8).collect();
    let back = udp_ask(&c, &big, WAIT).await.unwrap();
    assert_eq!(back.len(), 65_507);
    assert!(back == big);
    // An exact-size datagram from a fresh session too (the first datagram takes another path).
    let c2 = udp_client(h.addr("u")).await;
    assert!(udp_ask(&c2, &big, WAIT).await.unwrap() == big);
    assert_eq!(
        h.metric(r#"l4_bytes_total{listener="u",direction="in"}"#),
        (2 * 65_507) as f64
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_new_sessions_stays_within_max_sessions() {
    let w = udp_worker("w0").await;
    let mut evicting = ClusterConfig::new("evict", vec![endpoint("w0", w.addr, None)]);
    evicting.max_sessions = 50;
    let mut refusing = ClusterConfig::new("refuse", vec![endpoint("w0", w.addr, None)]);
    refusing.max_sessions = 10;
    refusing.overflow = Overflow::Refuse;
    let h = Harness::start(valid(
        vec![
            listener("evict", Protocol::Udp, evicting),
            listener("refuse", Protocol::Udp, refusing),
        ],
        vec![],
    ))
    .await;
    let addr = h.addr("evict");
    let mut clients = Clients::default();
    for i in 0..300 {
        // Every newcomer is served: the least recently active session makes room.
        assert!(clients.answered(addr, &key(i)).await, "session {i}");
        let active = h.set.listeners()[0].active_sessions;
        assert!(active <= 50, "{active} sessions");
    }
    assert_eq!(
        h.metric(r#"l4_sessions_evicted_total{listener="evict"}"#),
        250.0
    );
    assert_eq!(h.metric(r#"l4_sessions_active{listener="evict"}"#), 50.0);

    let addr = h.addr("refuse");
    let mut held = Vec::new();
    for i in 0..10 {
        let c = udp_client(addr).await;
        assert!(udp_ask(&c, &key(i), WAIT).await.is_some());
        held.push(c);
    }
    let mut refused = Vec::new();
    for i in 10..40 {
        let c = udp_client(addr).await;
        c.send(&key(i)).await.unwrap();
        refused.push(c);
    }
    h.until(WAIT, |h| {
        h.metric(r#"l4_sessions_refused_total{listener="refuse",reason="full"}"#) == 30.0
    })
    .await;
    // The sessions that were in keep working.
    for c in &held {
        assert!(udp_ask(c, b"still", WAIT).await.is_some());
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_counts_icmp_errors_and_the_listener_keeps_serving() {
    let w = udp_worker("w0").await;
    // A port with nothing behind it: the kernel answers with ICMP port unreachable.
    let dead = {
        let s = std::net::UdpSocket::bind(localhost(0)).unwrap();
        s.local_addr().unwrap()
    };
    let mut l = listener(
        "u",
        Protocol::Udp,
        ClusterConfig::new("live", vec![endpoint("w0", w.addr, None)]),
    );
    l.key_route = Some(KeyRouteConfig {
        offset: 0,
        length: None,
        routes: vec![KeyRoute {
            key: Some("dead".into()),
            key_hex: None,
            cluster: "dead".into(),
        }],
    });
    let h = Harness::start(valid(
        vec![l],
        vec![ClusterConfig::new(
            "dead",
            vec![endpoint("gone", dead, None)],
        )],
    ))
    .await;
    let addr = h.addr("u");
    let doomed = udp_client(addr).await;
    for i in 0..5 {
        assert!(
            udp_ask(
                &doomed,
                format!("dead-{i}").as_bytes(),
                Duration::from_millis(100)
            )
            .await
            .is_none()
        );
    }
    h.until(WAIT, |h| {
        h.metric(r#"l4_icmp_errors_total{listener="u"}"#) >= 2.0
    })
    .await;
    // The listener and its other sessions are unaffected.
    for i in 0..5 {
        assert_eq!(udp_who(addr, &key(i)).await, "w0");
    }
    // The doomed session is still there and still counted on each try, not wedged.
    let before = h.metric(r#"l4_icmp_errors_total{listener="u"}"#);
    let _ = udp_ask(&doomed, b"dead again", Duration::from_millis(100)).await;
    let _ = udp_ask(&doomed, b"dead again", Duration::from_millis(100)).await;
    h.until(WAIT, |h| {
        h.metric(r#"l4_icmp_errors_total{listener="u"}"#) > before
    })
    .await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_serves_existing_sessions_refuses_new_ones_then_closes() {
    let w = udp_worker("w0").await;
    let mut cluster = ClusterConfig::new("c", vec![endpoint("w0", w.addr, None)]);
    cluster.idle_timeout = Some(Duration::from_secs(60));
    let h = Harness::start(valid(vec![listener("u", Protocol::Udp, cluster)], vec![])).await;
    let addr = h.addr("u");
    let old = udp_client(addr).await;
    assert!(udp_ask(&old, b"hi", WAIT).await.is_some());
    h.shutdown.cancel();
    let cancelled = tokio::time::Instant::now();
    // Grace is 1 s (see `valid`): the old session still works, a new one is refused.
    assert!(udp_ask(&old, b"still there", WAIT).await.is_some());
    let new = udp_client(addr).await;
    assert!(
        udp_ask(&new, b"hello", Duration::from_millis(200))
            .await
            .is_none()
    );
    assert_eq!(
        h.metric(r#"l4_sessions_refused_total{listener="u",reason="draining"}"#),
        1.0
    );
    tokio::time::timeout(Duration::from_secs(5), h.set.closed())
        .await
        .unwrap();
    // The open session kept the listener until the grace ran out.
    assert!(cancelled.elapsed() >= Duration::from_secs(1));
    assert!(
        udp_ask(&old, b"after", Duration::from_millis(200))
            .await
            .is_none(),
        "closed after the grace"
    );
    assert_eq!(h.metric(r#"l4_sessions_active{listener="u"}"#), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_expire() {
    let w = udp_worker("w0").await;
    let mut cluster = ClusterConfig::new("c", vec![endpoint("w0", w.addr, None)]);
    cluster.idle_timeout = Some(Duration::from_millis(200));
    let h = Harness::start(valid(vec![listener("u", Protocol::Udp, cluster)], vec![])).await;
    let c = udp_client(h.addr("u")).await;
    assert!(udp_ask(&c, b"hi", WAIT).await.is_some());
    assert_eq!(h.set.listeners()[0].active_sessions, 1);
    h.until(WAIT, |h| h.set.listeners()[0].active_sessions == 0)
        .await;
    assert_eq!(h.metric(r#"l4_sessions_expired_total{listener="u"}"#), 1.0);
    // The client comes back as a new session.
    assert!(udp_ask(&c, b"again", WAIT).await.is_some());
    assert_eq!(h.metric(r#"l4_sessions_created_total{listener="u"}"#), 2.0);
    h.stop().await;
}

/// The thousand-session test holds about 2000 sockets: the soft open-files limit goes up to the
/// hard one, since a normal user's soft default (1024) is too low and any user may raise it.
fn raise_open_files() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        eprintln!("cannot raise the open-files limit from {soft} to {hard}: {e}");
    }
}
