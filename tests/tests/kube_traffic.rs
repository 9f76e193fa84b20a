//! Traffic capture against a real kube-apiserver (issue #27): turning capture on is an
//! RBAC-checked action (the chart's policy `spur-sandbox-capture`), the traffic store takes its
//! settings from the Sandboxes, lets a sidecar's pod-bound token watch and push only for its own
//! namespace, and lets a reader read a sandbox's traffic only with `get` on `sandboxes/traffic`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequestSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use prometheus_client::registry::Registry;
use serde_json::json;
use spur_api::Sandbox;
use spur_e2e::kube::{self as kt, eventually};
use spur_kube_harness::KubeApi;
use spur_proto::traffic as pb;
use spur_proto::traffic::traffic_client::TrafficClient;
use spur_traffic::{
    Authorizer, ClusterCapture, Limits, Server, SettingsIndex, SettingsMap, SettingsSource,
    TrafficServerConfig,
};
use tokio_util::sync::CancellationToken;
use tonic::Code;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_sandboxes_and_scopes_sidecars_and_readers() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, "shop").await.unwrap();
    let store_client = kt::chart_client(&api, "spur-traffic", "traffic-rules.yaml", None)
        .await
        .unwrap();

    let stop = CancellationToken::new();
    let index = SettingsIndex::new(SettingsMap::default());
    tokio::spawn(spur_traffic::watch_sandboxes(
        store_client.clone(),
        index.clone(),
        ClusterCapture {
            redact_headers: vec!["x-api-key".into()],
            max_body_bytes: Some(2048),
        },
        stop.clone(),
    ));
    let mut registry = Registry::default();
    let server = Server::bind(
        TrafficServerConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            db: None,
            limits: Limits::default(),
            tls: None,
            settings: SettingsSource::External,
            auth: Authorizer::kube(store_client),
        },
        index,
        &mut registry,
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    let s = stop.clone();
    tokio::spawn(async move { server.run(s).await.unwrap() });
    let client = || async move {
        TrafficClient::new(
            tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await
                .unwrap(),
        )
    };
    fn with<T>(msg: T, token: &str) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        req
    }

    // A capturing sandbox with its routing key (the operator writes the status).
    let sandboxes: Api<Sandbox> = Api::all(admin.clone());
    sandboxes
        .create(&PostParams::default(), &sandbox("sb1", true))
        .await
        .unwrap();
    sandboxes
        .patch_status(
            "sb1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"routingKey": "key-sb1"}})),
        )
        .await
        .unwrap();

    // The sidecar: a pod-bound token for the store's audience, in namespace shop.
    let pod: Pod = Api::<Pod>::namespaced(admin.clone(), "shop")
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "backend-1"},
                "spec": {"serviceAccountName": "backend", "containers": [{"name": "app", "image": "app:1"}]}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let sidecar_token = api
        .token_request(
            "shop",
            "backend",
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
        .unwrap();
    let backend = pb::Workload {
        kind: "Deployment".into(),
        namespace: "shop".into(),
        name: "backend".into(),
    };
    let mut watch = client()
        .await
        .watch_settings(with(
            pb::WatchSettingsRequest {
                baseline: Some(backend.clone()),
            },
            &sidecar_token,
        ))
        .await
        .unwrap()
        .into_inner();
    let settings = next_settings(&mut watch, |s| !s.keys.is_empty()).await;
    assert_eq!(settings.keys[0].routing_key, "key-sb1");
    assert_eq!(settings.keys[0].sandbox, "sb1");
    assert_eq!(settings.max_body_bytes, 2048);
    assert!(settings.redact_headers.iter().any(|h| h == "x-api-key"));

    // Another namespace's baseline: refused, for watching and for pushing.
    let other = pb::Workload {
        namespace: "billing".into(),
        ..backend.clone()
    };
    let err = client()
        .await
        .watch_settings(with(
            pb::WatchSettingsRequest {
                baseline: Some(other.clone()),
            },
            &sidecar_token,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let exchange = |baseline: pb::Workload, id: &str| pb::Exchange {
        id: id.into(),
        baseline: Some(baseline),
        pod: "backend-1".into(),
        sandbox: "sb1".into(),
        routing_key: "key-sb1".into(),
        destination: "backend-sb1.shop.svc:8080".into(),
        method: "GET".into(),
        path: "/".into(),
        status: 200,
        start_unix_micros: 1,
        ..Default::default()
    };
    let err = client()
        .await
        .push(with(
            pb::PushRequest {
                exchanges: vec![exchange(other, "x/1")],
                dropped: 0,
            },
            &sidecar_token,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let stored = client()
        .await
        .push(with(
            pb::PushRequest {
                exchanges: vec![exchange(backend.clone(), "x/2")],
                dropped: 0,
            },
            &sidecar_token,
        ))
        .await
        .unwrap()
        .into_inner()
        .stored;
    assert_eq!(stored, 1);
    // The sidecar's token does not read.
    let query = |sandbox: &str| pb::QueryRequest {
        filter: Some(pb::Filter {
            sandbox: sandbox.into(),
            ..Default::default()
        }),
        limit: 10,
    };
    let err = client()
        .await
        .query(with(query("sb1"), &sidecar_token))
        .await
        .unwrap_err();
    assert!(
        matches!(err.code(), Code::PermissionDenied | Code::Unauthenticated),
        "{err:?}"
    );

    // A reader: refused until it may `get` sandboxes/traffic, and then only for that sandbox.
    let dev_token = api
        .service_account_token(kt::SYSTEM_NAMESPACE, "dev")
        .await
        .unwrap();
    let err = client()
        .await
        .query(with(query("sb1"), &dev_token))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let mut rules = kt::chart_rules("traffic-reader-rules.yaml").unwrap();
    rules[0]["resourceNames"] = json!(["sb1"]);
    kt::grant_dev(&admin, "dev-read-sb1", rules).await.unwrap();
    let got = eventually("the reader's grant", || async {
        client()
            .await
            .query(with(query("sb1"), &dev_token))
            .await
            .ok()
    })
    .await
    .into_inner();
    assert_eq!(got.exchanges.len(), 1);
    for sandbox in ["sb2", ""] {
        let err = client()
            .await
            .query(with(query(sandbox), &dev_token))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{sandbox:?}: {err:?}");
    }

    // Capture off: the key leaves the settings.
    sandboxes
        .patch(
            "sb1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"capture": {"enabled": false}}})),
        )
        .await
        .unwrap();
    next_settings(&mut watch, |s| s.keys.is_empty()).await;
    stop.cancel();
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
