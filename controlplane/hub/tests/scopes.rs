//! Issue 42, point 5 (the hub's part): a hub user scoped to namespace `a` asks for namespace
//! `b`'s sandboxes, routing keys, previews and captured traffic, through the hub (web view,
//! previews) and straight at the agent (as a hub that forgot to filter would), and gets
//! nothing. The agent checks every read with SubjectAccessReviews (answered by the stand-in
//! API from its grants), so a user whose hub scope is wider than its Kubernetes rights still
//! sees only what RBAC allows; a read that names no user is refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use http_body_util::BodyExt;
use spur_hub::listener::ListenerLimits;
use spur_hub::protocol::{Open, READ_PATHS};
use spur_hub::store::ScopeChange;
use spur_hub::users::{KubeIdentity, Namespaces};

/// Never reached: the agent refuses before it asks the store.
fn dead_store() -> spur_discovery::Connector {
    spur_discovery::Connector::named(
        spur_discovery::RouteServerConn::plain("127.0.0.1:9"),
        "traffic store",
    )
    .unwrap()
}

/// A hub with cluster `east` (sandbox `sb-a` in namespace `a`, `sb-b` in `b`, both previewable),
/// its agent, and hub user `alice` whose key is returned: hub scope `namespaces` in east,
/// Kubernetes rights (the stand-in's grants) in `a` only.
async fn setup(namespaces: &[&str]) -> (TestHub, String) {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    let app = html_app("hello", &[]).await;
    let kube = FakeKube::start().await;
    let target = format!("http://localhost:{app}");
    kube.add_sandbox_in("sb-a", "a", "web", &target);
    kube.add_sandbox_in("sb-b", "b", "web", &target);
    kube.grant("alice", "a");
    start_agent(
        &hub,
        "east",
        Some(kube.client()),
        local_scope(),
        Some(dead_store()),
    )
    .await;
    hub.store.add_user("alice").unwrap();
    hub.store
        .set_user_scope(
            "alice",
            &ScopeChange {
                cluster: "east".into(),
                namespaces: Namespaces::parse(
                    &namespaces.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                )
                .unwrap(),
                kube_user: None,
                kube_groups: vec![],
            },
        )
        .unwrap();
    let key = hub.store.add_api_key("alice", "alice").unwrap();
    wait_for("the catalog", Duration::from_secs(20), || {
        hub.catalog
            .snapshot()
            .get("east")
            .is_some_and(|v| v.sandboxes.len() == 2)
    })
    .await;
    (hub, key)
}

fn alice() -> KubeIdentity {
    KubeIdentity {
        user: "alice".into(),
        groups: vec![],
    }
}

/// The web view, the previews and the traffic tab show alice only namespace `a`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_of_namespace_a_sees_nothing_of_b_through_the_hub() {
    let (hub, key) = setup(&["a"]).await;
    let auth = [("x-spur-api-key", key.as_str())];
    let (status, _, page) = get(&hub, WEB_HOST, "/", &auth).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("sb-a") && page.contains("key-sb-a"),
        "alice does not see her own sandbox: {page}"
    );
    assert!(
        !page.contains("sb-b") && !page.contains("key-sb-b"),
        "alice sees namespace b's sandbox or key: {page}"
    );
    // Previews: b's sandbox is unknown to her, a's answers.
    let (status, _, body) = get(&hub, &format!("web--sb-b.{DOMAIN}"), "/", &auth).await;
    assert_eq!(status, 404, "a preview of b's sandbox: {body}");
    let (status, _, body) = get(&hub, &format!("web--sb-a.{DOMAIN}"), "/", &auth).await;
    assert_eq!(status, 200, "{body}");
    // Traffic: refused by the hub before any agent is asked.
    let (status, _, page) = get(&hub, WEB_HOST, "/traffic?cluster=east&sandbox=sb-b", &auth).await;
    assert_eq!(status, 200);
    assert!(
        page.contains("Cannot read this sandbox") && page.contains("that you may see"),
        "{page}"
    );
    // Another cluster's name is as unknown.
    let (_, _, page) = get(&hub, WEB_HOST, "/traffic?cluster=west&sandbox=sb-a", &auth).await;
    assert!(page.contains("that you may see"), "{page}");
}

/// A hub scope wider than the user's Kubernetes rights: the agent's reviews still hide `b`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_hides_what_rbac_does_not_allow_whatever_the_hub_scope() {
    let (hub, key) = setup(&["*"]).await;
    let auth = [("x-spur-api-key", key.as_str())];
    let (status, _, page) = get(&hub, WEB_HOST, "/", &auth).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("key-sb-a"), "{page}");
    assert!(
        !page.contains("sb-b") && !page.contains("key-sb-b"),
        "the agent let alice read namespace b: {page}"
    );
    // The traffic tab passes the hub's scope; the agent refuses it.
    let (_, _, page) = get(&hub, WEB_HOST, "/traffic?cluster=east&sandbox=sb-b", &auth).await;
    assert!(
        page.contains("may not get sandboxes/traffic of sb-b"),
        "{page}"
    );
}

/// Straight at the agent, as a hub that forgot to filter: lists for alice hold only `a`; her
/// traffic read of `b` is refused; a request naming no user is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_answers_a_user_only_what_it_may_see() {
    let (hub, _) = setup(&["a"]).await;
    let read = |open: Open, path: &'static str| {
        let clusters = hub.clusters.clone();
        async move {
            let resp = clusters
                .http_get("east", &open, path, Duration::from_secs(10))
                .await?;
            let status = resp.status();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            Ok::<_, spur_hub::Error>((status, String::from_utf8_lossy(&body).into_owned()))
        }
    };
    let (status, body) = read(Open::Read { as_user: alice() }, READ_PATHS[0])
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("sb-a"), "{body}");
    assert!(
        !body.contains("sb-b") && !body.contains("key-sb-b"),
        "the agent listed b's sandbox for alice: {body}"
    );
    // Someone with no rights at all gets an empty list.
    let mallory = KubeIdentity {
        user: "mallory".into(),
        groups: vec!["system:authenticated".into()],
    };
    let (_, body) = read(Open::Read { as_user: mallory }, READ_PATHS[0])
        .await
        .unwrap();
    assert!(!body.contains("sb-a") && !body.contains("sb-b"), "{body}");
    let (status, body) = read(
        Open::Traffic { as_user: alice() },
        "/exchanges?sandbox=sb-b",
    )
    .await
    .unwrap();
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("sandboxes/traffic"), "{body}");
    // No identity: refused at the Open frame, for lists and traffic alike.
    for open in [
        Open::Read {
            as_user: KubeIdentity::default(),
        },
        Open::Traffic {
            as_user: KubeIdentity::default(),
        },
    ] {
        let err = hub
            .clusters
            .open("east", &open, Duration::from_secs(10))
            .await
            .expect_err("a read without a user was served")
            .to_string();
        assert!(err.contains("names no user"), "{err}");
    }
    // A watch on a user's stream is not served (it would outlive the review).
    let (status, _) = read(
        Open::Read { as_user: alice() },
        "/apis/spur.dev/v1alpha1/sandboxes?watch=1",
    )
    .await
    .unwrap();
    assert_eq!(status, 404);
}
