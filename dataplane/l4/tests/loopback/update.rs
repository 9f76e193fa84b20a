use std::time::Duration;

use spur_l4::{ClusterConfig, Error, HashKey, L4Config, LbPolicy, ListenerConfig, Protocol};

use crate::common::*;

fn cluster(name: &str, workers: &[&UdpWorker]) -> ClusterConfig {
    let mut c = ClusterConfig::new(
        name,
        workers
            .iter()
            .map(|w| endpoint(&w.id, w.addr, None))
            .collect(),
    );
    c.lb = LbPolicy::RingHash;
    c.hash_key = Some(HashKey::SourceIpPort);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_keeps_unaffected_sessions_and_starts_and_drains_listeners() {
    let w = [
        udp_worker("w0").await,
        udp_worker("w1").await,
        udp_worker("w2").await,
    ];
    let a = listener("a", Protocol::Udp, cluster("ca", &[&w[0], &w[1]]));
    let b = listener("b", Protocol::Udp, cluster("cb", &[&w[2]]));
    let h = Harness::start(valid(vec![a.clone(), b], vec![])).await;
    let (addr_a, addr_b) = (h.addr("a"), h.addr("b"));
    let mut sessions = Vec::new();
    for i in 0..10 {
        let c = udp_client(addr_a).await;
        let worker = who(&udp_ask(&c, format!("{i}").as_bytes(), WAIT).await.unwrap());
        sessions.push((c, worker));
    }
    let on_b = udp_client(addr_b).await;
    assert_eq!(who(&udp_ask(&on_b, b"b", WAIT).await.unwrap()), "w2");

    // Next configuration: `a` gains w2 and a longer idle timeout; `b` goes; `c` comes.
    let mut a2 = a.clone();
    a2.cluster = cluster("ca", &[&w[0], &w[1], &w[2]]);
    a2.cluster.idle_timeout = Some(Duration::from_secs(120));
    let c = listener("c", Protocol::Udp, cluster("cc", &[&w[1]]));
    h.set.apply(valid(vec![a2, c], vec![])).await.unwrap();

    assert_eq!(h.addr("a"), addr_a, "same socket");
    for (c, was) in &sessions {
        assert_eq!(&who(&udp_ask(c, b"again", WAIT).await.unwrap()), was);
    }
    assert_eq!(udp_who(h.addr("c"), b"new").await, "w1");
    let names: Vec<String> = h.set.listeners().into_iter().map(|l| l.name).collect();
    assert_eq!(names, ["a", "c"]);
    // `b` drains: its open session is served for the grace (1 s), new ones are not, then it
    // is gone.
    assert!(h.set.local_addr("b").is_none());
    assert_eq!(who(&udp_ask(&on_b, b"b", WAIT).await.unwrap()), "w2");
    let newcomer = udp_client(addr_b).await;
    assert!(
        udp_ask(&newcomer, b"x", Duration::from_millis(200))
            .await
            .is_none()
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        udp_ask(&on_b, b"b", Duration::from_millis(200))
            .await
            .is_none()
    );
    // Cluster `cb` left with its listener: its endpoint series are gone.
    assert!(h.set.clusters().iter().all(|c| c.name != "cb"));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_bind_changes_nothing() {
    let w = udp_worker("w0").await;
    let a = listener("a", Protocol::Udp, cluster("ca", &[&w]));
    let h = Harness::start(valid(vec![a.clone()], vec![])).await;
    let taken = std::net::UdpSocket::bind(localhost(0)).unwrap();
    let port = taken.local_addr().unwrap();
    let mut a2 = a.clone();
    a2.cluster = cluster("ca-renamed", &[&w]);
    let clash = ListenerConfig::new("clash", Protocol::Udp, port, cluster("cx", &[&w]));
    let err = h
        .set
        .apply(valid(vec![a2, clash], vec![]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Bind { ref listener, .. } if listener == "clash"),
        "{err}"
    );
    // Still the old configuration.
    let clusters: Vec<String> = h.set.clusters().into_iter().map(|c| c.name).collect();
    assert_eq!(clusters, ["ca"]);
    assert_eq!(udp_who(h.addr("a"), b"x").await, "w0");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_listener_takes_over_its_port() {
    let w = udp_worker("w0").await;
    let port = {
        let s = std::net::UdpSocket::bind(localhost(0)).unwrap();
        s.local_addr().unwrap()
    };
    let a = ListenerConfig::new("old", Protocol::Udp, port, cluster("c", &[&w]));
    let h = Harness::start(valid(vec![a.clone()], vec![])).await;
    assert_eq!(udp_who(port, b"x").await, "w0");
    let renamed = ListenerConfig {
        name: "new".into(),
        ..a
    };
    h.set.apply(valid(vec![renamed], vec![])).await.unwrap();
    assert_eq!(h.addr("new"), port);
    assert_eq!(udp_who(port, b"y").await, "w0");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_are_refused_after_shutdown_and_bad_endpoints_are_refused() {
    let w = udp_worker("w0").await;
    let config = L4Config {
        listeners: vec![listener("a", Protocol::Udp, cluster("ca", &[&w]))],
        ..Default::default()
    };
    let h = Harness::start(config.clone().validate().unwrap()).await;
    assert!(matches!(
        h.set
            .update_endpoints("nope", &[endpoint("x", w.addr, None)]),
        Err(Error::UnknownCluster(_))
    ));
    let err = h.set.update_endpoints("ca", &[]).unwrap_err();
    assert!(
        err.to_string().contains("endpoints must not be empty"),
        "{err}"
    );
    h.shutdown.cancel();
    let err = h.set.apply(config.validate().unwrap()).await.unwrap_err();
    assert!(matches!(err, Error::ShuttingDown));
    tokio::time::timeout(Duration::from_secs(5), h.set.closed())
        .await
        .unwrap();
}
