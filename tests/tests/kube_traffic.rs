//! Traffic capture against a real kube-apiserver (issues #27 and #42): turning capture on is an
//! RBAC-checked action (the chart's policy `spur-sandbox-capture`); the traffic store takes its
//! settings from the Sandboxes, lets only an injected sidecar's pod-bound token watch and push,
//! and only for its own baseline and the sandboxes that capture it, gives every exchange its own
//! id and the token's pod; a reader needs a token for the store's audience and `get` on
//! `sandboxes/traffic`, and loses an open Tail when that right goes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequestSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use spur_api::Sandbox;
use spur_e2e::kube::{self as kt, eventually};
use spur_kube_harness::KubeApi;
use spur_proto::traffic as pb;
use spur_proto::traffic::traffic_client::TrafficClient;
use spur_traffic::ClusterCapture;
use tokio_util::sync::CancellationToken;
use tonic::Code;

#[path = "kube_traffic/runs.rs"]
mod runs;

fn sandbox(name: &str, capture: bool) -> Sandbox {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {
            "forks": [{"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "backend"}}],
            "capture": {"enabled": capture},
        }
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turning_capture_on_needs_the_capturer_role() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    let text =
        std::fs::read_to_string(kt::chart_path("files/sandbox-capture-policy.yaml")).unwrap();
    let mut docs = text.split("\n---\n");
    let policy: ValidatingAdmissionPolicy = serde_yaml_ng::from_str(docs.next().unwrap()).unwrap();
    let binding: ValidatingAdmissionPolicyBinding =
        serde_yaml_ng::from_str(docs.next().unwrap()).unwrap();
    Api::<ValidatingAdmissionPolicy>::all(admin.clone())
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicyBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    kt::grant_dev(
        &admin,
        "dev-sandboxes",
        json!([{"apiGroups": ["spur.dev"], "resources": ["sandboxes"],
                "verbs": ["create", "get", "update", "patch"]}]),
    )
    .await
    .unwrap();
    let token = api
        .service_account_token(kt::SYSTEM_NAMESPACE, "dev")
        .await
        .unwrap();
    let dev: Api<Sandbox> = Api::all(api.client_with_token(&token).await.unwrap());

    // Refused on create (the policy may take a moment to be in force).
    let refused = eventually("the capture policy to refuse", || {
        let dev = dev.clone();
        let admin = admin.clone();
        async move {
            match dev
                .create(&PostParams::default(), &sandbox("sb1", true))
                .await
            {
                Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => Some(e.message),
                Ok(_) => {
                    // Created before the policy was in force: undo, and try again.
                    Api::<Sandbox>::all(admin)
                        .delete("sb1", &Default::default())
                        .await
                        .ok();
                    None
                }
                Err(_) => None,
            }
        }
    })
    .await;
    assert!(refused.contains("sandboxes/capture"), "{refused}");
    // Off is fine; switching it on is refused; anything else on a capturing sandbox is not.
    dev.create(&PostParams::default(), &sandbox("sb1", false))
        .await
        .unwrap();
    let on = Patch::Merge(json!({"spec": {"capture": {"enabled": true}}}));
    let err = dev
        .patch("sb1", &PatchParams::default(), &on)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("sandboxes/capture"), "{err}");

    kt::grant_dev(
        &admin,
        "dev-capture",
        kt::chart_rules("traffic-capturer-rules.yaml").unwrap(),
    )
    .await
    .unwrap();
    eventually("capture on with the capturer role", || {
        let dev = dev.clone();
        let on = on.clone();
        async move { dev.patch("sb1", &PatchParams::default(), &on).await.ok() }
    })
    .await;
    let relabel = Patch::Merge(json!({"spec": {"description": "still capturing"}}));
    dev.patch("sb1", &PatchParams::default(), &relabel)
        .await
        .unwrap();
    dev.create(&PostParams::default(), &sandbox("sb2", true))
        .await
        .unwrap();
}

/// A traffic store in front of the apiserver, with the chart's RBAC, taking its settings from
/// the Sandboxes; open streams re-checked every `recheck`.
struct Store {
    addr: std::net::SocketAddr,
    stop: CancellationToken,
}

impl Store {
    async fn start(api: &KubeApi, recheck: Duration) -> Store {
        Store::start_listing_after(api, recheck, Duration::ZERO).await
    }

    /// A store whose Sandbox watch starts `after` the server (as when the API server is slow
    /// to answer a store that just started).
    async fn start_listing_after(api: &KubeApi, recheck: Duration, after: Duration) -> Store {
        let stop = CancellationToken::new();
        let capture = ClusterCapture {
            redact_headers: vec!["x-api-key".into()],
            max_body_bytes: Some(2048),
        };
        let addr = kt::traffic_store(api, capture, recheck, after, stop.clone())
            .await
            .unwrap();
        Store { addr, stop }
    }

    /// A sidecar's WatchSettings call for `baseline` with `token`.
    async fn watch_settings(
        &self,
        baseline: pb::Workload,
        token: &str,
    ) -> Result<tonic::Streaming<pb::CaptureSettings>, tonic::Status> {
        let request = with(
            pb::WatchSettingsRequest {
                baseline: Some(baseline),
            },
            token,
        );
        Ok(self
            .client()
            .await
            .watch_settings(request)
            .await?
            .into_inner())
    }

    async fn client(&self) -> TrafficClient<tonic::transport::Channel> {
        TrafficClient::new(
            tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))
                .unwrap()
                .connect()
                .await
                .unwrap(),
        )
    }
}

fn with<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req
}

/// A capturing sandbox forking `namespace/name`, with its routing key (the operator writes the
/// status).
async fn capturing(admin: &kube::Client, name: &str, namespace: &str, workload: &str, key: &str) {
    let sandboxes: Api<Sandbox> = Api::all(admin.clone());
    let mut sb = sandbox(name, true);
    sb.spec.forks[0].fork_of.namespace = namespace.into();
    sb.spec.forks[0].fork_of.name = workload.into();
    sandboxes.create(&PostParams::default(), &sb).await.unwrap();
    sandboxes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"routingKey": key}})),
        )
        .await
        .unwrap();
}

/// A pod of Deployment `namespace/deployment` (through a ReplicaSet, as the Deployment
/// controller would make it; the apiserver tier has no controllers), with the injected
/// `spur-sidecar` container when `injected`, and a token bound to it for the store's audience.
async fn sidecar_pod(
    api: &KubeApi,
    namespace: &str,
    deployment: &str,
    pod: &str,
    injected: bool,
) -> (Pod, String) {
    let admin = api.client();
    kt::ensure_namespace(&admin, namespace).await.unwrap();
    let labels = json!({"app": deployment});
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), namespace);
    let d = match deployments.get_opt(deployment).await.unwrap() {
        Some(d) => d,
        None => deployments
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": deployment},
                    "spec": {"selector": {"matchLabels": labels},
                             "template": {"metadata": {"labels": labels},
                                          "spec": {"containers": [{"name": "app", "image": "app:1"}]}}}
                }))
                .unwrap(),
            )
            .await
            .unwrap(),
    };
    let rs_name = format!("{deployment}-7d9f");
    let replicasets: Api<ReplicaSet> = Api::namespaced(admin.clone(), namespace);
    let rs = match replicasets.get_opt(&rs_name).await.unwrap() {
        Some(rs) => rs,
        None => replicasets
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": rs_name, "ownerReferences": [{
                        "apiVersion": "apps/v1", "kind": "Deployment", "name": deployment,
                        "uid": d.uid().unwrap(), "controller": true}]},
                    "spec": {"selector": {"matchLabels": labels},
                             "template": {"metadata": {"labels": labels},
                                          "spec": {"containers": [{"name": "app", "image": "app:1"}]}}}
                }))
                .unwrap(),
            )
            .await
            .unwrap(),
    };
    let mut containers = vec![json!({"name": "app", "image": "app:1"})];
    if injected {
        containers.insert(0, json!({"name": "spur-sidecar", "image": "spur:1"}));
    }
    let pod: Pod = Api::<Pod>::namespaced(admin.clone(), namespace)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": pod, "labels": labels, "ownerReferences": [{
                    "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs_name,
                    "uid": rs.uid().unwrap(), "controller": true}]},
                "spec": {"serviceAccountName": deployment, "containers": containers}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let token = bound_token(api, &pod).await;
    (pod, token)
}

/// A token for the store's audience bound to `pod` (what the kubelet projects for a sidecar).
async fn bound_token(api: &KubeApi, pod: &Pod) -> String {
    api.token_request(
        &pod.namespace().unwrap(),
        pod.spec
            .as_ref()
            .unwrap()
            .service_account_name
            .as_ref()
            .unwrap(),
        TokenRequestSpec {
            audiences: vec![spur_traffic::AUDIENCE.into()],
            expiration_seconds: Some(3600),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.name_any()),
                uid: pod.uid(),
            }),
        },
    )
    .await
    .unwrap()
}

/// A token of ServiceAccount dev (spur-system) for the store's audience.
async fn reader_token(api: &KubeApi) -> String {
    kt::traffic_token(api, kt::SYSTEM_NAMESPACE, "dev")
        .await
        .unwrap()
}

fn workload(namespace: &str, name: &str) -> pb::Workload {
    pb::Workload {
        kind: "Deployment".into(),
        namespace: namespace.into(),
        name: name.into(),
    }
}

fn exchange(baseline: pb::Workload, sandbox: &str, key: &str, id: &str) -> pb::Exchange {
    pb::Exchange {
        id: id.into(),
        baseline: Some(baseline),
        pod: "backend-1".into(),
        sandbox: sandbox.into(),
        routing_key: key.into(),
        destination: format!("backend-{sandbox}.shop.svc:8080"),
        method: "GET".into(),
        path: format!("/{id}"),
        status: 200,
        start_unix_micros: 1,
        ..Default::default()
    }
}

fn push(exchanges: Vec<pb::Exchange>) -> pb::PushRequest {
    pb::PushRequest {
        exchanges,
        dropped: 0,
    }
}

fn query(sandbox: &str) -> pb::QueryRequest {
    pb::QueryRequest {
        filter: Some(pb::Filter {
            sandbox: sandbox.into(),
            ..Default::default()
        }),
        limit: 100,
        without_bodies: false,
    }
}

/// Pushes until the store has listed the Sandboxes and takes `push` (bounded wait).
async fn pushed(store: &Store, token: &str, exchanges: Vec<pb::Exchange>) -> u32 {
    eventually("the store to take a sidecar's push", || {
        let exchanges = exchanges.clone();
        async move {
            match store
                .client()
                .await
                .push(with(push(exchanges), token))
                .await
            {
                Ok(r) => Some(r.into_inner().stored),
                Err(s) if s.code() == Code::Unavailable || s.code() == Code::PermissionDenied => {
                    None
                }
                Err(s) => panic!("push refused: {s:?}"),
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_sandboxes_and_scopes_sidecars_and_readers() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    let store = Store::start(&api, spur_traffic::DEFAULT_RECHECK).await;
    capturing(&admin, "sb1", "shop", "backend", "key-sb1").await;
    let (_, sidecar_token) = sidecar_pod(&api, "shop", "backend", "backend-1", true).await;
    let backend = workload("shop", "backend");

    let mut watch = store
        .watch_settings(backend.clone(), &sidecar_token)
        .await
        .unwrap();
    let settings = next_settings(&mut watch, |s| !s.keys.is_empty()).await;
    assert_eq!(settings.keys[0].routing_key, "key-sb1");
    assert_eq!(settings.keys[0].sandbox, "sb1");
    assert_eq!(settings.max_body_bytes, 2048);
    assert!(settings.redact_headers.iter().any(|h| h == "x-api-key"));

    // Another baseline, in its namespace or another: refused, for watching and for pushing.
    for other in [workload("shop", "frontend"), workload("billing", "backend")] {
        let err = store
            .watch_settings(other.clone(), &sidecar_token)
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
        let err = store
            .client()
            .await
            .push(with(
                push(vec![exchange(other, "sb1", "key-sb1", "x/1")]),
                &sidecar_token,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    }
    // Its own: stored, under the pod the token names whatever the message says.
    let mut liar = exchange(backend.clone(), "sb1", "key-sb1", "x/2");
    liar.pod = "someone-else".into();
    assert_eq!(pushed(&store, &sidecar_token, vec![liar]).await, 1);
    // The sidecar's token does not read.
    let err = store
        .client()
        .await
        .query(with(query("sb1"), &sidecar_token))
        .await
        .unwrap_err();
    assert!(
        matches!(err.code(), Code::PermissionDenied | Code::Unauthenticated),
        "{err:?}"
    );

    // A reader: refused until it may `get` sandboxes/traffic, and then only for that sandbox.
    let dev_token = reader_token(&api).await;
    let err = store
        .client()
        .await
        .query(with(query("sb1"), &dev_token))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let mut rules = kt::chart_rules("traffic-reader-rules.yaml").unwrap();
    rules[0]["resourceNames"] = json!(["sb1"]);
    kt::grant_dev(&admin, "dev-read-sb1", rules).await.unwrap();
    let got = eventually("the reader's grant", || async {
        store
            .client()
            .await
            .query(with(query("sb1"), &dev_token))
            .await
            .ok()
    })
    .await
    .into_inner();
    assert_eq!(got.exchanges.len(), 1);
    let x = got.exchanges[0].exchange.as_ref().unwrap();
    assert_eq!(x.pod, "backend-1");
    assert!(x.id.parse::<u64>().is_ok(), "the store's own id: {x:?}");
    for sandbox in ["sb2", ""] {
        let err = store
            .client()
            .await
            .query(with(query(sandbox), &dev_token))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{sandbox:?}: {err:?}");
    }
    record_reads_with_the_users_rights(&store, &sidecar_token, &dev_token).await;

    // Capture off: the key leaves the settings.
    Api::<Sandbox>::all(admin.clone())
        .patch(
            "sb1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"capture": {"enabled": false}}})),
        )
        .await
        .unwrap();
    next_settings(&mut watch, |s| s.keys.is_empty()).await;
    store.stop.cancel();
}

/// `spur test record` reads the store as `spur traffic query` does, with the user's token: the
/// sandbox the user may read becomes a test; another user's sandbox (another team's) is refused
/// and nothing is written.
async fn record_reads_with_the_users_rights(store: &Store, sidecar_token: &str, dev_token: &str) {
    let mut items = exchange(workload("shop", "backend"), "sb1", "key-sb1", "items");
    items.protocol = i32::from(pb::Protocol::Http1);
    items.authority = "backend:8080".into();
    items.response_body = Some(pb::Body {
        size: 2,
        data: b"{}".to_vec(),
        truncated: false,
    });
    assert_eq!(pushed(store, sidecar_token, vec![items]).await, 1);
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, dev_token).unwrap();
    let record = |sandbox: &str| {
        let out = dir.path().join(format!("{sandbox}.yaml"));
        let run = std::process::Command::new(spur_e2e::node::spur_bin("spur"))
            .args(["test", "record", sandbox, "--server"])
            .arg(format!("http://{}", store.addr))
            .arg("--token-file")
            .arg(&token)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
        (
            run.status.code(),
            std::fs::read_to_string(&out).ok(),
            stderr,
        )
    };
    let (code, test, stderr) = record("sb1");
    assert_eq!(code, Some(0), "{stderr}");
    let test = test.unwrap_or_default();
    assert!(
        test.contains("http://backend.shop:8080/items"),
        "the granted sandbox's request, its Service qualified: {test}\n{stderr}"
    );
    let (code, test, stderr) = record("sb2");
    assert_ne!(code, Some(0), "another sandbox's traffic: {test:?}");
    assert!(test.is_none(), "nothing written: {test:?}");
    assert!(
        stderr.contains("PermissionDenied") || stderr.contains("may not"),
        "{stderr}"
    );
}

/// A store started (or restarted, as by an upgrade) in a cluster that already has capturing
/// Sandboxes loads their settings, takes pushes, and follows a Sandbox's deletion. (It once
/// never loaded them: its settings watch waited for a complete list without reading the stream
/// that completes it. Found by the node tier's upgrade test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_started_after_its_sandboxes_loads_them_and_follows_deletions() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    capturing(&admin, "sb1", "shop", "backend", "key-sb1").await;
    capturing(&admin, "sb2", "shop", "backend", "key-sb2").await;
    let (_, sidecar_token) = sidecar_pod(&api, "shop", "backend", "backend-1", true).await;
    let store = Store::start(&api, spur_traffic::DEFAULT_RECHECK).await;
    let backend = workload("shop", "backend");
    let mut watch = store
        .watch_settings(backend.clone(), &sidecar_token)
        .await
        .unwrap();
    let settings = next_settings(&mut watch, |s| s.keys.len() == 2).await;
    let mut keys: Vec<&str> = settings
        .keys
        .iter()
        .map(|k| k.routing_key.as_str())
        .collect();
    keys.sort();
    assert_eq!(keys, ["key-sb1", "key-sb2"]);
    assert_eq!(
        pushed(
            &store,
            &sidecar_token,
            vec![exchange(backend.clone(), "sb1", "key-sb1", "x/1")]
        )
        .await,
        1
    );
    // A deletion is a change of the settings too.
    Api::<Sandbox>::all(admin.clone())
        .delete("sb1", &Default::default())
        .await
        .unwrap();
    let settings = next_settings(&mut watch, |s| s.keys.len() == 1).await;
    assert_eq!(settings.keys[0].routing_key, "key-sb2");
    store.stop.cancel();
}

/// Until a store that just started has listed the Sandboxes, a sidecar's settings stream
/// sends nothing and its push waits: the first settings it gets are the cluster's, and the push
/// is taken. (Before, the stream sent the empty defaults, turning a running capture off until
/// the list, and the push was answered UNAVAILABLE at once, so the sidecar dropped the batch.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_not_yet_listed_holds_a_sidecars_settings_and_push() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    capturing(&admin, "sb1", "shop", "backend", "key-sb1").await;
    let (_, sidecar_token) = sidecar_pod(&api, "shop", "backend", "backend-1", true).await;
    let store = Store::start_listing_after(
        &api,
        spur_traffic::DEFAULT_RECHECK,
        Duration::from_millis(1500),
    )
    .await;
    let backend = workload("shop", "backend");
    let mut watch = store
        .watch_settings(backend.clone(), &sidecar_token)
        .await
        .unwrap();
    // One push, not retried: the answer is the store's first.
    let mut client = store.client().await;
    let request = with(
        push(vec![exchange(backend.clone(), "sb1", "key-sb1", "x/1")]),
        &sidecar_token,
    );
    let push = tokio::spawn(async move { client.push(request).await });
    // Held, not answered at once (the store lists the Sandboxes 1.5 s after it started).
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!push.is_finished(), "the push was answered before the list");
    let first = tokio::time::timeout(Duration::from_secs(30), watch.message())
        .await
        .expect("settings in time")
        .unwrap()
        .expect("the settings stream stays open");
    let keys: Vec<&str> = first.keys.iter().map(|k| k.routing_key.as_str()).collect();
    assert_eq!(keys, ["key-sb1"], "the first settings sent: {first:?}");
    let reply = tokio::time::timeout(Duration::from_secs(30), push)
        .await
        .expect("the push answered in time")
        .unwrap()
        .expect("the push held until the list, then taken");
    assert_eq!(reply.into_inner().stored, 1);
    store.stop.cancel();
}

/// Issue 42: the store checked only that a pusher's namespace was the baseline's, so any pod
/// of that namespace (or any sidecar pushing for a sandbox that does not capture it) could add
/// records to any sandbox, and a pusher's id could shadow another's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_sidecars_of_captured_baselines_push_and_ids_are_the_stores() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    let store = Store::start(&api, spur_traffic::DEFAULT_RECHECK).await;
    capturing(&admin, "sb1", "shop", "backend", "key-sb1").await;
    capturing(&admin, "sb2", "billing", "web", "key-sb2").await;
    let (_, backend_1) = sidecar_pod(&api, "shop", "backend", "backend-1", true).await;
    let (_, backend_2) = sidecar_pod(&api, "shop", "backend", "backend-2", true).await;
    let backend = workload("shop", "backend");
    // Wait until the store takes the genuine sidecar's push: settings are loaded.
    let real = exchange(backend.clone(), "sb1", "key-sb1", "backend-1/1700000000/1");
    assert_eq!(pushed(&store, &backend_1, vec![real.clone()]).await, 1);

    // 1. A pod of the baseline's namespace and ReplicaSet with no injected sidecar.
    let (_, plain) = sidecar_pod(&api, "shop", "backend", "backend-plain", false).await;
    // 2. The sidecar of a baseline no sandbox captures, in the same namespace.
    let (_, other) = sidecar_pod(&api, "shop", "orders", "orders-1", true).await;
    // 3. The sidecar of billing/web (captured by sb2), pushing for sb1 in its own namespace.
    let (_, web) = sidecar_pod(&api, "billing", "web", "web-1", true).await;
    let attacks = [
        (
            "a pod without the sidecar",
            &plain,
            exchange(backend.clone(), "sb1", "key-sb1", "p/1"),
        ),
        (
            "a sidecar claiming another baseline",
            &other,
            exchange(backend.clone(), "sb1", "key-sb1", "o/1"),
        ),
        (
            "an uncaptured baseline's sidecar",
            &other,
            exchange(workload("shop", "orders"), "sb1", "key-sb1", "o/2"),
        ),
        (
            "a sidecar pushing for a sandbox that does not capture it",
            &web,
            exchange(workload("billing", "web"), "sb1", "key-sb1", "w/1"),
        ),
        (
            "a captured sidecar with another sandbox's key",
            &backend_1,
            exchange(backend.clone(), "sb1", "key-sb2", "b/9"),
        ),
    ];
    for (what, token, x) in attacks {
        let err = store
            .client()
            .await
            .push(with(push(vec![x]), token))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{what}: {err:?}");
    }
    // billing/web's own exchange for sb2 is fine.
    assert_eq!(
        pushed(
            &store,
            &web,
            vec![exchange(
                workload("billing", "web"),
                "sb2",
                "key-sb2",
                "w/2"
            )]
        )
        .await,
        1
    );

    // Another sidecar of the same baseline re-using backend-1's id: its own record, and
    // backend-1's is untouched. backend-1 re-sending is still ignored.
    let mut copy = real.clone();
    copy.path = "/forged".into();
    assert_eq!(pushed(&store, &backend_2, vec![copy]).await, 1);
    assert_eq!(pushed(&store, &backend_1, vec![real]).await, 0);

    let dev_token = reader_token(&api).await;
    kt::grant_dev(
        &admin,
        "dev-read",
        kt::chart_rules("traffic-reader-rules.yaml").unwrap(),
    )
    .await
    .unwrap();
    let got = eventually("the reader's grant", || async {
        store
            .client()
            .await
            .query(with(query("sb1"), &dev_token))
            .await
            .ok()
    })
    .await
    .into_inner();
    let mut seen: Vec<(String, String)> = got
        .exchanges
        .iter()
        .map(|s| {
            let x = s.exchange.as_ref().unwrap();
            (x.path.clone(), x.pod.clone())
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            (
                "/backend-1/1700000000/1".to_string(),
                "backend-1".to_string()
            ),
            ("/forged".to_string(), "backend-2".to_string()),
        ],
        "only the genuine sidecars' exchanges"
    );
    store.stop.cancel();
}

/// Issue 42: readers presented any token the API server accepted (a token the store could
/// replay against it), and Tail and WatchSettings were authorized only when they opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_need_the_stores_audience_and_lose_open_streams_with_their_rights() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    let store = Store::start(&api, Duration::from_secs(2)).await;
    capturing(&admin, "sb1", "shop", "backend", "key-sb1").await;
    let (pod, sidecar_token) = sidecar_pod(&api, "shop", "backend", "backend-1", true).await;
    let mut rules = kt::chart_rules("traffic-reader-rules.yaml").unwrap();
    rules[0]["resourceNames"] = json!(["sb1"]);
    kt::grant_dev(&admin, "dev-read-sb1", rules).await.unwrap();

    // A token for the API server, with the rights: refused.
    let api_token = api
        .service_account_token(kt::SYSTEM_NAMESPACE, "dev")
        .await
        .unwrap();
    let err = store
        .client()
        .await
        .query(with(query("sb1"), &api_token))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert!(err.message().contains("spur-traffic"), "{err:?}");
    let err = store
        .client()
        .await
        .tail(with(
            pb::TailRequest {
                filter: query("sb1").filter,
            },
            &api_token,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");

    // The store's audience: a Tail that sees what is pushed...
    let dev_token = reader_token(&api).await;
    let mut tail = eventually("the reader's grant", || async {
        store
            .client()
            .await
            .tail(with(
                pb::TailRequest {
                    filter: query("sb1").filter,
                },
                &dev_token,
            ))
            .await
            .ok()
    })
    .await
    .into_inner();
    let mut watch = store
        .watch_settings(workload("shop", "backend"), &sidecar_token)
        .await
        .unwrap();
    pushed(
        &store,
        &sidecar_token,
        vec![exchange(
            workload("shop", "backend"),
            "sb1",
            "key-sb1",
            "t/1",
        )],
    )
    .await;
    let first = tokio::time::timeout(kt::WAIT, tail.message())
        .await
        .expect("an event in time")
        .unwrap()
        .expect("the stream stays open");
    assert!(
        matches!(first.event, Some(pb::tail_event::Event::Exchange(_))),
        "{first:?}"
    );

    // ...until the reader's binding goes: the open stream ends.
    Api::<ClusterRoleBinding>::all(admin.clone())
        .delete("dev-read-sb1", &Default::default())
        .await
        .unwrap();
    let end = tokio::time::timeout(kt::WAIT, async {
        loop {
            match tail.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the Tail ends once the reader may no longer read");
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");

    // A sidecar's WatchSettings ends when its pod goes (its token with it).
    Api::<Pod>::namespaced(admin.clone(), "shop")
        .delete(&pod.name_any(), &Default::default())
        .await
        .unwrap();
    let end = tokio::time::timeout(kt::WAIT, async {
        loop {
            match watch.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the WatchSettings stream ends once its pod is gone");
    let status = end.unwrap_err();
    assert!(
        matches!(
            status.code(),
            Code::Unauthenticated | Code::PermissionDenied
        ),
        "{status:?}"
    );
    store.stop.cancel();
}

/// The first settings on `watch` that satisfy `want` (bounded wait).
async fn next_settings(
    watch: &mut tonic::Streaming<pb::CaptureSettings>,
    want: impl Fn(&pb::CaptureSettings) -> bool,
) -> pb::CaptureSettings {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let s = tokio::time::timeout_at(deadline, watch.message())
            .await
            .expect("settings in time")
            .unwrap()
            .expect("the settings stream stays open");
        if want(&s) {
            return s;
        }
    }
}
