//! Workstations belong to their owner (issue 42, point 1), on a real kube-apiserver with RBAC:
//! the operator (under the chart's RBAC) signs workstation certificates and records who asked,
//! and its webhooks (the chart's `sandbox-creator.spur.dev` and `sandbox-workstation.spur.dev`,
//! pointed at loopback) stamp every Sandbox's creator and refuse a Sandbox that names a
//! workstation its creator does not own.
//!
//! Alice and bob are ServiceAccounts with the same cluster-wide Sandbox rights and workload
//! rights only in their own namespace (`a`, `b`). Alice gets a certificate for `alice-laptop`.
//! Bob, who may create Sandboxes, names her workstation (with a local workload of his own
//! namespace): refused, and so is every way around it (a forged creator annotation, moving
//! alice's Sandbox to another workstation, changing its creator, a certificate for her
//! workstation that an approver approves).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use spur_api::ExternalWorkload;
use spur_api::Sandbox;
use spur_api::workstation::{CREATED_BY_ANNOTATION, EXPIRES_ANNOTATION, Owner, owner_record_name};
use spur_e2e::kube::{
    SYSTEM_NAMESPACE, WAIT, chart_document, chart_path, eventually, install_crds, operator_client,
};
use spur_kube_harness::KubeApi;
use spur_operator::{PkiConfig, Webhook, WebhookConfig};
use tokio_util::sync::CancellationToken;

const ALICE: &str = "system:serviceaccount:devs:alice";
const BOB: &str = "system:serviceaccount:devs:bob";

/// The chart's webhook named `name` out of `doc`'s configuration, pointed at `port`.
fn pointed(mut hook: Value, port: u16) -> Value {
    let path = hook["clientConfig"]["service"]["path"].clone();
    hook["clientConfig"] =
        json!({"url": format!("https://127.0.0.1:{port}{}", path.as_str().unwrap())});
    hook
}

fn chart_webhook(file: &str, kind: &str, name: &str) -> Value {
    let doc: Value =
        serde_yaml_ng::from_str(&chart_document(file, &format!("kind: {kind}"))).unwrap();
    let hook = doc["webhooks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["name"] == name)
        .unwrap_or_else(|| panic!("{file} has no webhook {name}"))
        .clone();
    assert_eq!(hook["failurePolicy"], "Fail", "{name}");
    hook
}

/// A user: a ServiceAccount of `devs` that may create Sandboxes anywhere (they are
/// cluster-scoped) and file workstation certificate requests (the chart's `spur-workstation`
/// rules), with workload rights in `namespace` only.
async fn user(api: &KubeApi, name: &str, namespace: &str) -> Client {
    let admin = api.client();
    let token = api.service_account_token("devs", name).await.unwrap();
    spur_e2e::kube::ensure_namespace(&admin, namespace)
        .await
        .unwrap();
    let workstation_rules: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(chart_path("files/workstation-rules.yaml")).unwrap(),
    )
    .unwrap();
    let mut rules = vec![
        json!({"apiGroups": ["spur.dev"], "resources": ["sandboxes"],
        "verbs": ["create", "get", "list", "update", "patch", "delete"]}),
    ];
    rules.extend(workstation_rules.as_array().unwrap().iter().cloned());
    let subject = json!([{"kind": "ServiceAccount", "name": name, "namespace": "devs"}]);
    let role: ClusterRole =
        serde_json::from_value(json!({"metadata": {"name": name}, "rules": rules})).unwrap();
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": subject,
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &crb)
        .await
        .unwrap();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace},
        "rules": [
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "create", "patch"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create"]}
        ]
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": subject,
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin, namespace)
        .create(&PostParams::default(), &rb)
        .await
        .unwrap();
    api.client_with_token(&token).await.unwrap()
}

/// A Sandbox with a local workload of `namespace` served by `workstation`.
fn local_sandbox(
    name: &str,
    namespace: &str,
    workstation: &str,
    created_by: Option<&str>,
) -> Sandbox {
    let mut o = json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {"workstation": workstation, "local": [{"name": "api",
            "from": {"kind": "Deployment", "namespace": namespace, "name": "api"},
            "mappings": [{"port": 8080, "toLocal": "localhost:8080"}]}]}
    });
    if let Some(c) = created_by {
        o["metadata"]["annotations"] = json!({CREATED_BY_ANNOTATION: c});
    }
    serde_json::from_value(o).unwrap()
}

/// The refusal's message, or a panic if `r` was admitted.
fn refused<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> String {
    match r {
        Err(kube::Error::Api(s)) if s.code == 403 => s.message,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Files a workstation certificate request as `client` and approves it as the admin (what
/// `spur local cert` and `kubectl certificate approve` do).
async fn request_certificate(client: &Client, admin: &Client, name: &str, workstation: &str) {
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name
        .push(rcgen::DnType::CommonName, workstation);
    let pem = p
        .serialize_request(&rcgen::KeyPair::generate().unwrap())
        .unwrap()
        .pem()
        .unwrap();
    let csr: CertificateSigningRequest = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"request": ByteString(pem.into_bytes()), "signerName": "spur.dev/workstation",
                 "usages": ["client auth", "digital signature"], "expirationSeconds": 3600},
    }))
    .unwrap();
    Api::<CertificateSigningRequest>::all(client.clone())
        .create(&PostParams::default(), &csr)
        .await
        .unwrap();
    Api::<CertificateSigningRequest>::all(admin.clone())
        .patch_approval(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": [
                {"type": "Approved", "status": "True", "reason": "KubectlApprove", "message": "test"}
            ]}})),
        )
        .await
        .unwrap();
}

/// `Ok(certificate)` once signed, `Err(reason)` once failed.
async fn outcome(admin: &Client, name: &str) -> Result<String, String> {
    let csrs: Api<CertificateSigningRequest> = Api::all(admin.clone());
    eventually(&format!("request {name} signed or failed"), || {
        let csrs = csrs.clone();
        async move {
            let status = csrs.get(name).await.ok()?.status?;
            if let Some(c) = status.certificate.filter(|c| !c.0.is_empty()) {
                return Some(Ok(String::from_utf8(c.0).unwrap()));
            }
            status
                .conditions?
                .into_iter()
                .find(|c| c.type_ == "Failed" && c.status == "True")
                .map(|c| Err(c.message.unwrap_or_default()))
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_may_name_only_its_creators_workstation() {
    spur_e2e::kube::capture_logs();
    let api = KubeApi::start().await.unwrap();
    install_crds(&api).await.unwrap();
    let operator = operator_client(&api).await.unwrap();
    let admin = api.client();
    let mut registry = Registry::with_prefix("spur_operator");
    let metrics = spur_operator::Metrics::register(&mut registry);
    let stop = CancellationToken::new();
    let webhook = Webhook::start(
        operator.clone(),
        WebhookConfig {
            addr: "127.0.0.1:0".parse().unwrap(),
            namespace: SYSTEM_NAMESPACE.into(),
            serving_secret: "spur-webhook-tls".into(),
            injection: spur_operator::InjectionConfig {
                sidecar_image: "spur:test".into(),
                init_image: "spur:test".into(),
                routeserver: "spur-routeserver.spur-system.svc:7777".into(),
                ..Default::default()
            },
        },
        metrics.clone(),
        stop.child_token(),
    )
    .await
    .unwrap();
    // The chart's two Sandbox webhooks, alone in configurations of the names whose caBundle
    // the operator fills in.
    let port = webhook.local_addr().port();
    let stamp = chart_webhook(
        "templates/operator.yaml",
        "MutatingWebhookConfiguration",
        "sandbox-creator.spur.dev",
    );
    assert_eq!(
        stamp["clientConfig"]["service"]["path"],
        spur_operator::MUTATE_SANDBOX_PATH
    );
    let check = chart_webhook(
        "templates/admission.yaml",
        "ValidatingWebhookConfiguration",
        "sandbox-workstation.spur.dev",
    );
    assert_eq!(
        check["clientConfig"]["service"]["path"],
        spur_operator::VALIDATE_SANDBOX_PATH
    );
    let mwc: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": "spur-sidecar-injector"}, "webhooks": [pointed(stamp, port)]
    }))
    .unwrap();
    Api::<MutatingWebhookConfiguration>::all(admin.clone())
        .create(&PostParams::default(), &mwc)
        .await
        .unwrap();
    let vwc: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": "spur-envoyconfig-validator"}, "webhooks": [pointed(check, port)]
    }))
    .unwrap();
    Api::<ValidatingWebhookConfiguration>::all(admin.clone())
        .create(&PostParams::default(), &vwc)
        .await
        .unwrap();
    let mut pki = PkiConfig::new(SYSTEM_NAMESPACE, "spur-webhook");
    pki.serving_names.push("127.0.0.1".into());
    pki.validate().unwrap();
    let ctx = Arc::new(
        spur_operator::Context::new(operator.clone(), Some("test".into()), metrics).with_pki(pki),
    );
    let running = tokio::spawn(spur_operator::run(operator, ctx, stop.clone()));
    let (mwcs, vwcs) = (
        Api::<MutatingWebhookConfiguration>::all(admin.clone()),
        Api::<ValidatingWebhookConfiguration>::all(admin.clone()),
    );
    eventually("the caBundles and the serving certificate", || {
        let (mwcs, vwcs, ready) = (mwcs.clone(), vwcs.clone(), webhook.ready());
        async move {
            let m = mwcs.get("spur-sidecar-injector").await.ok()?;
            let v = vwcs.get("spur-envoyconfig-validator").await.ok()?;
            let filled = m.webhooks?[0].client_config.ca_bundle.is_some()
                && v.webhooks?[0].client_config.ca_bundle.is_some();
            (filled && ready).then_some(())
        }
    })
    .await;

    let alice = user(&api, "alice", "a").await;
    let bob = user(&api, "bob", "b").await;
    let as_alice: Api<Sandbox> = Api::all(alice.clone());
    let as_bob: Api<Sandbox> = Api::all(bob.clone());

    // Alice's certificate for alice-laptop records her as its owner.
    request_certificate(&alice, &admin, "alice-laptop-1", "alice-laptop").await;
    outcome(&admin, "alice-laptop-1").await.unwrap();
    let records: Api<ConfigMap> = Api::namespaced(admin.clone(), SYSTEM_NAMESPACE);
    let record = records
        .get(&owner_record_name("alice-laptop"))
        .await
        .unwrap();
    assert_eq!(Owner::from_record(&record).unwrap().user, ALICE);

    // Bob names alice's workstation for a workload of his own namespace: refused, with the
    // rule and without alice's username.
    let pp = PostParams::default();
    let message = refused(
        as_bob
            .create(&pp, &local_sandbox("bobs", "b", "alice-laptop", None))
            .await,
    );
    assert!(message.contains("belongs to another user"), "{message}");
    assert!(!message.contains(ALICE), "{message}");
    // Writing alice's name as the creator does not help.
    let message = refused(
        as_bob
            .create(
                &pp,
                &local_sandbox("bobs", "b", "alice-laptop", Some(ALICE)),
            )
            .await,
    );
    assert!(message.contains("set by Spur"), "{message}");
    // A workstation nobody owns: refused with how to get a credential.
    let message = refused(
        as_bob
            .create(&pp, &local_sandbox("bobs", "b", "spare-laptop", None))
            .await,
    );
    assert!(message.contains("spur local cert"), "{message}");

    // Alice's own Sandbox is admitted and stamped with her name, whatever she wrote.
    let created = as_alice
        .create(&pp, &local_sandbox("alices", "a", "alice-laptop", None))
        .await
        .unwrap();
    assert_eq!(
        created
            .annotations()
            .get(CREATED_BY_ANNOTATION)
            .map(String::as_str),
        Some(ALICE)
    );
    // Bob may update Sandboxes, but neither takes alice's creator nor moves her Sandbox to a
    // workstation she does not own.
    request_certificate(&bob, &admin, "bob-laptop-1", "bob-laptop").await;
    outcome(&admin, "bob-laptop-1").await.unwrap();
    let patch = |p: Value| {
        let as_bob = as_bob.clone();
        async move {
            as_bob
                .patch("alices", &PatchParams::default(), &Patch::Merge(&p))
                .await
        }
    };
    let message = refused(patch(json!({"spec": {"workstation": "bob-laptop"}})).await);
    assert!(message.contains("only the Sandbox's creator"), "{message}");
    let message =
        refused(patch(json!({"metadata": {"annotations": {CREATED_BY_ANNOTATION: BOB}}})).await);
    assert!(message.contains("cannot be changed"), "{message}");
    // Nor points her laptop at another of its ports, or adds a local workload to her Sandbox:
    // what her laptop connects to is hers to change.
    let remapped = json!({"spec": {"local": [{"name": "api",
        "from": {"kind": "Deployment", "namespace": "a", "name": "api"},
        "mappings": [{"port": 8080, "toLocal": "localhost:5432"}]}]}});
    let message = refused(patch(remapped.clone()).await);
    assert!(message.contains("only the Sandbox's creator"), "{message}");
    let stored = as_alice.get("alices").await.unwrap();
    assert_eq!(
        stored.spec.local[0].mappings[0].to_local, "localhost:8080",
        "bob's mapping was stored"
    );
    // Alice may.
    as_alice
        .patch("alices", &PatchParams::default(), &Patch::Merge(&remapped))
        .await
        .unwrap();
    // Removing the annotation only brings it back; other changes pass.
    let kept = patch(json!({"metadata": {"annotations": {CREATED_BY_ANNOTATION: null}, "labels": {"team": "a"}}}))
        .await
        .unwrap();
    assert_eq!(
        kept.annotations()
            .get(CREATED_BY_ANNOTATION)
            .map(String::as_str),
        Some(ALICE)
    );
    // Bob's own Sandbox on his own workstation is fine.
    as_bob
        .create(&pp, &local_sandbox("bobs", "b", "bob-laptop", None))
        .await
        .unwrap();

    // An approver approving bob's request for alice's workstation does not hand it over.
    request_certificate(&bob, &admin, "alice-laptop-2", "alice-laptop").await;
    let failed = outcome(&admin, "alice-laptop-2").await.unwrap_err();
    assert!(failed.contains("belongs to another user"), "{failed}");
    let record = records
        .get(&owner_record_name("alice-laptop"))
        .await
        .unwrap();
    assert_eq!(Owner::from_record(&record).unwrap().user, ALICE);

    // ExternalWorkloads (what the tunnel proxy hands a workstation) are the operator's alone:
    // anyone else with rights on them, an administrator here, is refused, so no Sandbox check
    // can be gone around by writing one directly.
    let rendered = spur_e2e::kube::helm_template(&[]).await.unwrap();
    spur_e2e::kube::install_rendered_policy(
        &admin,
        &rendered,
        "spur-externalworkloads-by-operator",
    )
    .await
    .unwrap();
    let direct: ExternalWorkload = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "ExternalWorkload",
        "metadata": {"name": "direct", "namespace": "b"},
        "spec": {"sandbox": "bobs", "routingKey": "k", "name": "api", "workstation": "alice-laptop",
                 "baseline": {"kind": "Deployment", "namespace": "b", "name": "api"},
                 "mappings": [{"port": 8080, "toLocal": "localhost:22"}]}
    }))
    .unwrap();
    let message = eventually("the ExternalWorkload policy to refuse", || {
        let (admin, direct) = (admin.clone(), direct.clone());
        async move {
            let ews: Api<ExternalWorkload> = Api::namespaced(admin, "b");
            match ews.create(&PostParams::default(), &direct).await {
                Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => Some(e.message),
                Ok(_) => {
                    ews.delete("direct", &Default::default()).await.ok();
                    None
                }
                Err(_) => None,
            }
        }
    })
    .await;
    assert!(message.contains("made by the Spur operator"), "{message}");

    // Alice's claim ends (her certificate expired: the record's end is moved into the past).
    // Her Sandbox still names alice-laptop, so bob's certificate for it would hand him her keyed
    // traffic: still refused, and the record stays hers.
    let ended = json!({"metadata": {"annotations": {EXPIRES_ANNOTATION: "2020-01-01T00:00:00Z"}}});
    records
        .patch(
            &owner_record_name("alice-laptop"),
            &PatchParams::default(),
            &Patch::Merge(&ended),
        )
        .await
        .unwrap();
    request_certificate(&bob, &admin, "alice-laptop-3", "alice-laptop").await;
    let failed = outcome(&admin, "alice-laptop-3").await.unwrap_err();
    assert!(failed.contains("still name the workstation"), "{failed}");
    let record = records
        .get(&owner_record_name("alice-laptop"))
        .await
        .unwrap();
    assert_eq!(Owner::from_record(&record).unwrap().user, ALICE);
    // Once her Sandbox is gone the ended claim may be taken over.
    as_alice
        .delete("alices", &Default::default())
        .await
        .unwrap();
    eventually("alice's Sandbox is gone", || {
        let admin = admin.clone();
        async move {
            Api::<Sandbox>::all(admin)
                .get_opt("alices")
                .await
                .ok()?
                .is_none()
                .then_some(())
        }
    })
    .await;
    request_certificate(&bob, &admin, "alice-laptop-4", "alice-laptop").await;
    outcome(&admin, "alice-laptop-4").await.unwrap();
    let record = records
        .get(&owner_record_name("alice-laptop"))
        .await
        .unwrap();
    assert_eq!(Owner::from_record(&record).unwrap().user, BOB);

    stop.cancel();
    tokio::time::timeout(WAIT, webhook.stopped()).await.unwrap();
    tokio::time::timeout(WAIT, running).await.unwrap().unwrap();
}
