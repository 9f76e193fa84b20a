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
