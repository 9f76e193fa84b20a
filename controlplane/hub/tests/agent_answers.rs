//! Issue 42, points 3 and 10 (the hub's parts): the hub reads no agent's answer without a
//! bound, and the agent reaches neither an ExternalName Service nor loopback, link-local or
//! metadata addresses however the name is spelled.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use spur_hub::agent::Scope;
use spur_hub::agent::targets::AddressPolicy;
use spur_hub::listener::ListenerLimits;
use spur_hub::protocol::{AGENT_BIND, Answer, MAX_FRAME, Open};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Answers every Kubernetes list of sandboxes with one sandbox carrying `padding` bytes of
/// annotation, every other list with an empty one, and holds watches open.
async fn padded_agent(hub: &TestHub, padding: usize) {
    let mut registry = prometheus_client::registry::Registry::default();
    let client =
        spur_tunnel::TunnelClient::start(agent_client(hub, "east"), &mut registry).unwrap();
    let big = serde_json::json!({
        "metadata": {"resourceVersion": "1"},
        "items": [{
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "big", "annotations": {"pad": " ".repeat(padding)}},
            "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": "default", "name": "web"}}]}
        }]
    })
    .to_string();
    tokio::spawn(async move {
        let mut listener = client.bind(AGENT_BIND, "{}").await.unwrap();
        while let Some(incoming) = listener.accept().await {
            let big = big.clone();
            tokio::spawn(async move {
                let Ok(mut s) = incoming.accept().await else {
                    return;
                };
                let _: Option<Open> = spur_tunnel::read_frame(&mut s, MAX_FRAME).await.unwrap();
                spur_tunnel::write_frame(&mut s, &Answer::Ok, MAX_FRAME)
                    .await
                    .unwrap();
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if s.read(&mut b).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(b[0]);
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let body = if head.contains("watch=1") {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                        .await;
                    tokio::time::sleep(Duration::from_secs(600)).await;
                    return;
                } else if head.starts_with("GET /apis/spur.dev/v1alpha1/sandboxes ") {
                    big
                } else {
                    r#"{"metadata":{"resourceVersion":"1"},"items":[]}"#.to_owned()
                };
                let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(body.as_bytes()).await;
                tokio::time::sleep(Duration::from_secs(600)).await;
            });
        }
    });
}

/// A list over the catalog's bound is refused (the hub's own catalog, bound at 64 MiB, takes the
/// same list, so the list itself was deliverable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_over_the_bound_is_refused() {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    let bounded = spur_hub::catalog::Catalog::default().with_max_list(1 << 20);
    let (clusters, stop, run) = (
        hub.clusters.clone(),
        hub.stop.child_token(),
        bounded.clone(),
    );
    tokio::spawn(async move { run.run(clusters, stop).await });
    padded_agent(&hub, 3 << 20).await;
    let has_big = |c: &spur_hub::catalog::Catalog| {
        c.snapshot()
            .get("east")
            .is_some_and(|v| v.sandboxes.contains_key("big"))
    };
    wait_for(
        "the hub's own catalog to take the list",
        Duration::from_secs(30),
        || has_big(&hub.catalog),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!has_big(&bounded), "a list over the 1 MiB bound was taken");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_name_service_is_refused() {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    let kube = FakeKube::start().await;
    kube.services
        .lock()
        .unwrap()
        .push(("shop/web".into(), "ExternalName".into()));
    start_agent(&hub, "east", Some(kube.client()), Scope::default(), None).await;
    for host in [
        "web.shop.svc",
        "web.shop.svc.cluster.local",
        "pod-0.web.shop.svc",
    ] {
        let err = hub
            .clusters
            .open(
                "east",
                &Open::Tcp {
                    host: host.into(),
                    port: 80,
                },
                Duration::from_secs(10),
            )
            .await
            .expect_err(host)
            .to_string();
        assert!(err.contains("ExternalName"), "{host}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_resolving_to_loopback_is_refused_unless_named() {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    let app = html_app("hello", &[]).await;
    let local = |allow: &[&str]| Scope {
        target_suffixes: vec!["localhost".into()],
        addresses: AddressPolicy {
            allow_cidrs: allow.iter().map(|c| c.parse().unwrap()).collect(),
        },
        ..Scope::default()
    };
    start_agent(&hub, "east", None, local(&[]), None).await;
    let open = Open::Tcp {
        host: "localhost".into(),
        port: app,
    };
    let err = hub
        .clusters
        .open("east", &open, Duration::from_secs(10))
        .await
        .expect_err("the agent connected to its own loopback")
        .to_string();
    assert!(err.contains("loopback"), "{err}");
    // A wide range does not open loopback; a loopback range does.
    start_agent(&hub, "west", None, local(&["0.0.0.0/0"]), None).await;
    assert!(
        hub.clusters
            .open("west", &open, Duration::from_secs(10))
            .await
            .is_err()
    );
    start_agent(&hub, "north", None, local(&["127.0.0.0/8"]), None).await;
    hub.clusters
        .open("north", &open, Duration::from_secs(10))
        .await
        .unwrap();
}
