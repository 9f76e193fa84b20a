//! Issue 42, point 5 against a real kube-apiserver and RBAC: a Kubernetes user with rights only
//! in namespace `a` asks, through the hub and straight at the agent, for namespace `b`'s
//! sandboxes, routing keys and captured traffic, and gets nothing. The agent runs with the
//! chart's rules (`agent-rules.yaml`, plus `spur-traffic-reader` as `agent.traffic.enabled`
//! binds it), reads the real traffic store with a token for the store's audience, and asks the
//! API server with SubjectAccessReviews what the user may read.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../controlplane/hub/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::*;
use http_body_util::BodyExt;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, Patch, PatchParams, PostParams};
use prometheus_client::registry::Registry;
use serde_json::json;
use spur_api::Sandbox;
use spur_e2e::kube::{self as kt};
use spur_hub::agent::Scope;
use spur_hub::listener::ListenerLimits;
use spur_hub::protocol::{Open, READ_PATHS};
use spur_hub::store::ScopeChange;
use spur_hub::users::{KubeIdentity, Namespaces};
use spur_kube_harness::KubeApi;
use spur_proto::traffic as pb;
use spur_traffic::{Authorizer, Limits, Server, SettingsIndex, SettingsMap, TrafficServerConfig};

/// A capturing sandbox forking `namespace/web`, with routing key `key-<name>`.
async fn sandbox(admin: &kube::Client, name: &str, namespace: &str) {
    let sb: Sandbox = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {
            "forks": [{"forkOf": {"kind": "Deployment", "namespace": namespace, "name": "web"}}],
            "capture": {"enabled": true},
        }
    }))
    .unwrap();
    let api: Api<Sandbox> = Api::all(admin.clone());
    api.create(&PostParams::default(), &sb).await.unwrap();
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"routingKey": format!("key-{name}")}})),
    )
    .await
    .unwrap();
}

/// One captured exchange of sandbox `sandbox`, at baseline `namespace/web`.
fn exchange(sandbox: &str, namespace: &str) -> pb::Exchange {
    pb::Exchange {
        id: format!("x-{sandbox}"),
        baseline: Some(pb::Workload {
            kind: "Deployment".into(),
            namespace: namespace.into(),
            name: "web".into(),
        }),
        pod: "web-1".into(),
        sandbox: sandbox.into(),
        routing_key: format!("key-{sandbox}"),
        method: "GET".into(),
        path: format!("/secret-of-{sandbox}"),
        status: 200,
        start_unix_micros: 1,
        ..pb::Exchange::default()
    }
}

/// Kubernetes user `alice` may list Spur's objects and read sandboxes' traffic in `a` only.
async fn alice_in_a(admin: &kube::Client) {
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "spur-reader", "namespace": "a"},
        "rules": [
            {"apiGroups": ["spur.dev"], "resources": ["sandboxes", "routegroups", "routingconfigs", "jobs"],
             "verbs": ["get", "list"]},
            {"apiGroups": ["spur.dev"], "resources": ["sandboxes/traffic"], "verbs": ["get"]}
        ]
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), "a")
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "alice-spur-reader", "namespace": "a"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "spur-reader"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), "a")
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_with_rights_in_a_reads_nothing_of_b() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    for ns in ["a", "b"] {
        kt::ensure_namespace(&admin, ns).await.unwrap();
    }
    sandbox(&admin, "sb-a", "a").await;
    sandbox(&admin, "sb-b", "b").await;
    alice_in_a(&admin).await;

    // The cluster's traffic store, holding one exchange of each sandbox.
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("traffic.db");
    {
        let store = spur_traffic::Store::open(Some(&db), Limits::default()).unwrap();
        store
            .insert("test", vec![exchange("sb-a", "a"), exchange("sb-b", "b")])
            .await
            .unwrap();
    }
    let store_client = kt::chart_client(&api, "spur-traffic", "traffic-rules.yaml", None)
        .await
        .unwrap();
    let server = Server::bind(
        TrafficServerConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            db: Some(db),
            limits: Limits::default(),
            tls: None,
            settings: spur_traffic::SettingsSource::External,
            auth: Authorizer::kube(store_client),
        },
        SettingsIndex::new(SettingsMap::default()),
        &mut Registry::default(),
    )
    .await
    .unwrap();
    let store_addr = server.local_addr();
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move { server.run(s).await.unwrap() });

    // The agent: the chart's rules, the traffic reader's binding, a token for the store.
    let agent_kube = kt::chart_client(&api, "spur-agent", "agent-rules.yaml", None)
        .await
        .unwrap();
    kt::grant_cluster(&api, "spur-agent", "traffic-reader-rules.yaml")
        .await
        .unwrap();
    let store_token = kt::traffic_token(&api, kt::SYSTEM_NAMESPACE, "spur-agent")
        .await
        .unwrap();
    std::fs::write(dir.path().join("store-token"), store_token).unwrap();
    let connector = spur_discovery::Connector::named(
        spur_discovery::RouteServerConn {
            addr: store_addr.to_string(),
            ca: None,
            token: Some(dir.path().join("store-token")),
        },
        "traffic store",
    )
    .unwrap();

    let hub = start_hub(settings(ListenerLimits::default())).await;
    start_agent(
        &hub,
        "east",
        Some(agent_kube),
        Scope::default(),
        Some(connector),
    )
    .await;
    let alice = KubeIdentity {
        user: "alice".into(),
        groups: vec!["system:authenticated".into()],
    };
    let read = |open: Open, path: String| {
        let clusters = hub.clusters.clone();
        async move {
            let resp = clusters
                .http_get("east", &open, &path, Duration::from_secs(15))
                .await
                .unwrap();
            let status = resp.status();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, body)
        }
    };

    // Straight at the agent, as a hub that forgot to filter would ask.
    let (status, body) = read(
        Open::Read {
            as_user: alice.clone(),
        },
        READ_PATHS[0].into(),
    )
    .await;
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("key-sb-a"), "alice does not see sb-a: {text}");
    assert!(
        !text.contains("sb-b") && !text.contains("key-sb-b"),
        "the agent gave alice namespace b's sandbox: {text}"
    );
    let (status, body) = read(
        Open::Traffic {
            as_user: alice.clone(),
        },
        "/exchanges?sandbox=sb-b".into(),
    )
    .await;
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 403, "the agent read b's traffic for alice: {text}");
    assert!(!text.contains("secret-of-sb-b"), "{text}");
    let (status, body) = read(
        Open::Traffic {
            as_user: alice.clone(),
        },
        "/exchanges?sandbox=sb-a".into(),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let reply: pb::QueryReply = prost::Message::decode(body).unwrap();
    assert_eq!(reply.exchanges.len(), 1, "{reply:?}");

    // Through the hub: hub user alice, scoped to every namespace of east (so only RBAC, asked
    // by the agent, keeps b from her), acting as Kubernetes user alice.
    hub.store.add_user("alice").unwrap();
    hub.store
        .set_user_scope(
            "alice",
            &ScopeChange {
                cluster: "east".into(),
                namespaces: Namespaces::ALL,
                kube_user: None,
                kube_groups: vec!["system:authenticated".into()],
            },
        )
        .unwrap();
    let key = hub.store.add_api_key("alice", "alice").unwrap();
    let auth = [("x-spur-api-key", key.as_str())];
    let mut page = String::new();
    for _ in 0..100 {
        page = get(&hub, WEB_HOST, "/", &auth).await.2;
        if page.contains("key-sb-a") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(page.contains("key-sb-a"), "{page}");
    assert!(
        !page.contains("sb-b") && !page.contains("key-sb-b"),
        "the web view showed alice namespace b: {page}"
    );
    let (_, _, page) = get(&hub, WEB_HOST, "/traffic?cluster=east&sandbox=sb-b", &auth).await;
    assert!(!page.contains("secret-of-sb-b"), "{page}");
    assert!(
        page.contains("may not get sandboxes/traffic of sb-b"),
        "{page}"
    );
    let (_, _, page) = get(&hub, WEB_HOST, "/traffic?cluster=east&sandbox=sb-a", &auth).await;
    assert!(page.contains("secret-of-sb-a"), "{page}");
    stop.cancel();
}
