//! The README's demo with records: `spur-demo --check --kafka BROKER` against a real Apache
//! Kafka broker. The web app writes a record per `POST /order` with the request's baggage; the
//! worker's baseline and fork read the topic through their sidecars' Kafka relays (explicit
//! mode); the check fails unless the unkeyed request's record is handled by the baseline alone
//! and the keyed one's by the fork alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::ExitCode;

use spur_e2e::kafka::Broker;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_check_sends_a_keyed_requests_record_to_the_fork() {
    let broker = Broker::start().await.unwrap();
    let rules = tempfile::tempdir().unwrap();
    let options = spur_demo::Options {
        port_base: 0,
        rules_dir: Some(rules.path().to_path_buf()),
        check: true,
        kafka: Some(broker.bootstrap()),
    };
    let code = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        spur_demo::run(options, "spur-demo"),
    )
    .await
    .expect("the demo check ran for 120 s")
    .unwrap();
    assert!(
        code == ExitCode::SUCCESS,
        "demo check failed (its report is above); broker log:\n{}",
        broker.log_tail()
    );
}

/// A sidecar whose Kafka relay fronts `broker` in explicit mode (`--kafka-broker`), in `role`,
/// for baseline `shop/orders`, with its rules from `rules` (a file: the table in force decides).
async fn explicit_sidecar(
    broker: std::net::SocketAddr,
    rules: &std::path::Path,
    role: spur_kafka::Role,
) -> spur_sidecar::Sidecar {
    let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let sidecar = spur_sidecar::Sidecar::start(spur_sidecar::SidecarConfig {
        inject_key_file: None,
        kafka: Some(spur_sidecar::kafka::KafkaConfig {
            ports: Default::default(),
            broker: Some(broker),
            listen_port: 0,
            role,
        }),
        capture: None,
        inbound_addr: loopback,
        inbound: spur_proxy::Inbound::Explicit {
            app: std::net::SocketAddr::from(([127, 0, 0, 1], 9)),
        },
        baseline: spur_routing::BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "shop".into(),
            name: "orders".into(),
        },
        rules: Some(rules.to_path_buf()),
        rules_poll: std::time::Duration::from_secs(1),
        routeserver: None,
        admin_addr: None,
        extract: Default::default(),
        proxy: Default::default(),
    })
    .await
    .unwrap();
    assert!(sidecar.table().load().version > 0, "the rules file loaded");
    sidecar
}

/// The values a `Probe consume` printed ("record PARTITION OFFSET VALUE"), sorted.
fn printed(out: &str) -> Vec<String> {
    let mut v: Vec<String> = out
        .lines()
        .filter_map(|l| l.strip_prefix("record "))
        .filter_map(|l| l.splitn(3, ' ').nth(2))
        .map(str::to_string)
        .collect();
    v.sort();
    v
}

/// Consumer groups through the sidecar's explicit relay: the clients find their group
/// coordinator through it (FindCoordinator v4+ from the Java client, v2 from librdkafka), and a
/// baseline's and a fork's consumers of one `group.id` each receive exactly their records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_consumers_work_through_the_explicit_relay() {
    let broker = Broker::start().await.unwrap();
    let bs = broker.bootstrap();
    broker.probe(&["create", &bs, "grp", "3"]).await.unwrap();
    let unkeyed: Vec<String> = (0..30).map(|i| format!("u-{i:02}")).collect();
    let keyed: Vec<String> = (0..10).map(|i| format!("k-{i:02}")).collect();
    broker
        .kcat_produce("grp", "none", &unkeyed, None)
        .await
        .unwrap();
    broker
        .kcat_produce(
            "grp",
            "none",
            &keyed,
            Some(("baggage", "sd-routing-key=k1")),
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(
        &rules,
        "- routingKey: k1\n  baseline: {kind: Deployment, namespace: shop, name: orders}\n  destinationSandbox: {name: s1}\n  mappings:\n    - workloadPort: 8080\n      destinations: [{host: 127.0.0.1, port: 9}]\n",
    )
    .unwrap();
    let baseline = explicit_sidecar(broker.addr, &rules, spur_kafka::Role::Baseline).await;
    let fork = explicit_sidecar(
        broker.addr,
        &rules,
        spur_kafka::Role::Fork {
            sandbox: "s1".into(),
        },
    )
    .await;
    let via_baseline = baseline.kafka_addr.unwrap().to_string();
    let via_fork = fork.kafka_addr.unwrap().to_string();
    // The Java client: one group, a member behind each relay, one after the other.
    let out = broker
        .probe(&["consume", &via_baseline, "grp", "workers", "30", "60000"])
        .await
        .unwrap();
    assert_eq!(printed(&out), unkeyed, "the baseline's Java consumer");
    let out = broker
        .probe(&["consume", &via_fork, "grp", "workers", "10", "60000"])
        .await
        .unwrap();
    assert_eq!(printed(&out), keyed, "the fork's Java consumer");
    // librdkafka's balanced consumer.
    let mut got = broker
        .kcat_group(baseline.kafka_addr.unwrap(), "workers-kcat", "grp")
        .await
        .unwrap();
    got.sort();
    assert_eq!(got, unkeyed, "kcat -G behind the baseline's relay");
    baseline.shutdown().await;
    fork.shutdown().await;
}
