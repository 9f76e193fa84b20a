//! Automatic smart-test runs (issue 48, point 4) on a real kube-apiserver with RBAC: the
//! operator (under the chart's rules, with `--smart-tests`) and its webhook (the chart's
//! `smarttest-creator.spur.dev`, pointed at loopback). No kubelet and no jobs component: the
//! test plays the Deployment controller (a fork becomes ready) and the jobs component (a run's
//! Job ends with a summary as its result), and checks what the operator does around them.
//!
//! Ann may fork `api` in `shop` and submit Jobs there (through her group); her SmartTest covers her sandbox, so it
//! runs as a Job when the sandbox is Ready, and again when the sandbox's spec changes; its
//! summary becomes the Sandbox's Tests condition and an Event. Mallory may write SmartTests in
//! `shop` but not create its workloads: her test, which covers the same sandbox, is not run, and
//! the condition says why (she could not have created the sandbox). Bob, of `team-b`, writes a test naming a Service `api` of his own
//! namespace: it covers nothing in `shop`; he cannot write a test in `shop`, nor forge a
//! test's creator, nor pass a Job of his own off as a run of ann's sandbox.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use spur_api::jobs::{InjectRoutingKey, Job};
use spur_api::smarttest::{RUN_SANDBOX_GENERATION, RUN_TEST_LABEL, SmartTest, TESTS_CONDITION};
use spur_api::workstation::CREATED_BY_ANNOTATION;
use spur_api::{Sandbox, WorkloadKind, WorkloadRef, names};
use spur_e2e::kube::{
    SYSTEM_NAMESPACE, chart_document, ensure_namespace, eventually, grant_cluster, install_crds,
    operator_client,
};
use spur_kube_harness::KubeApi;
use spur_operator::{PkiConfig, Webhook, WebhookConfig};
use tokio_util::sync::CancellationToken;

#[path = "kube_smarttests/calls.rs"]
mod calls;

const NS: &str = "shop";
const TEAM_B: &str = "team-b";
const ANN: &str = "system:serviceaccount:shop-devs:ann";
/// Ann's rights in shop come through this group (as most users' do): the runs' access reviews
/// must ask with the creator's groups.
const SHOP_DEVS: &str = "system:serviceaccounts:shop-devs";
const MALLORY: &str = "system:serviceaccount:devs:mallory";

/// A ServiceAccount `name` of `home` with `cluster` rules cluster-wide and `rules` in each
/// namespace, bound to `subject` (the ServiceAccount itself when `None`).
async fn user(
    api: &KubeApi,
    home: &str,
    name: &str,
    subject: Option<Value>,
    cluster: Value,
    rules: &[(&str, Value)],
) -> Client {
    let admin = api.client();
    let token = api.service_account_token(home, name).await.unwrap();
    let subject = subject
        .unwrap_or_else(|| json!([{"kind": "ServiceAccount", "name": name, "namespace": home}]));
    let role: ClusterRole =
        serde_json::from_value(json!({"metadata": {"name": name}, "rules": cluster})).unwrap();
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
    for (ns, rules) in rules {
        let role: Role = serde_json::from_value(
            json!({"metadata": {"name": name, "namespace": ns}, "rules": rules}),
        )
        .unwrap();
        Api::<Role>::namespaced(admin.clone(), ns)
            .create(&PostParams::default(), &role)
            .await
            .unwrap();
        let rb: RoleBinding = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": subject,
        }))
        .unwrap();
        Api::<RoleBinding>::namespaced(admin.clone(), ns)
            .create(&PostParams::default(), &rb)
            .await
            .unwrap();
    }
    api.client_with_token(&token).await.unwrap()
}

fn smart_test(name: &str, ns: &str, services: &[&str]) -> SmartTest {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "SmartTest",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"steps": [{"name": "list", "http": {"url": format!("http://api.{ns}/items")},
                            "checks": [{"status": 200}]}],
                 "services": services}
    }))
    .unwrap()
}

fn sandbox(name: &str, image: &str) -> Sandbox {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": NS, "name": "api"},
                            "customizations": {"images": [{"image": image}]}}]}
    }))
    .unwrap()
}

/// The baseline: Deployment and Service `api` of `shop`.
async fn baseline(admin: &Client) {
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "api", "namespace": NS},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "api"}},
                 "template": {"metadata": {"labels": {"app": "api"}},
                              "spec": {"containers": [{"name": "api", "image": "api:1",
                                                       "ports": [{"name": "http", "containerPort": 8080}]}]}}}
    }))
    .unwrap();
    Api::<Deployment>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "api", "namespace": NS},
        "spec": {"selector": {"app": "api"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
}

/// Plays the Deployment controller: the fork of `api` for `sandbox`, at its current generation,
/// is ready.
async fn fork_ready(admin: &Client, sandbox: &str, image: &str) {
    let fork = names::fork_name(
        sandbox,
        &WorkloadRef::new(WorkloadKind::Deployment, NS, "api"),
    );
    let api: Api<Deployment> = Api::namespaced(admin.clone(), NS);
    let generation = eventually(&format!("fork {fork} with image {image}"), || async {
        let d = api.get_opt(&fork).await.unwrap()?;
        let c = &d.spec.as_ref()?.template.spec.as_ref()?.containers[0];
        (c.image.as_deref() == Some(image)).then_some(d.metadata.generation?)
    })
    .await;
    api.patch_status(
        &fork,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "observedGeneration": generation, "replicas": 1, "updatedReplicas": 1,
            "readyReplicas": 1, "availableReplicas": 1
        }})),
    )
    .await
    .unwrap();
}

/// The Tests condition of `sandbox` once `done` accepts it.
async fn tests_condition(
    admin: &Client,
    sandbox: &str,
    what: &str,
    done: impl Fn(&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition) -> bool,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    let api: Api<Sandbox> = Api::all(admin.clone());
    eventually(what, || async {
        let sb = api.get_opt(sandbox).await.unwrap()?;
        let c = sb
            .status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == TESTS_CONDITION)?;
        done(&c).then_some(c)
    })
    .await
}

async fn runs(admin: &Client, ns: &str, test: &str) -> Vec<Job> {
    let mut jobs = Api::<Job>::namespaced(admin.clone(), ns)
        .list(&ListParams::default().labels(&format!("{RUN_TEST_LABEL}={test}")))
        .await
        .unwrap()
        .items;
    jobs.sort_by_key(|j| j.creation_timestamp());
    jobs
}

/// Plays the jobs component: the run ends, with `result` as its summary.
async fn finish(admin: &Client, job: &Job, result: &str) {
    Api::<Job>::namespaced(admin.clone(), &job.namespace().unwrap())
        .patch_status(
            &job.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Failed", "exitCode": 1, "result": result}})),
        )
        .await
        .unwrap();
}

fn refused<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> String {
    match r {
        Err(kube::Error::Api(s)) if s.code == 403 => s.message,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

const FINDINGS: &str = r#"{"passed":false,"steps":1,"checksFailed":0,"findings":1,"byRank":{"schema":1},"top":[{"rank":"schema","endpoint":"GET api.shop/items","what":"$.items[*].price: removed 3","shape":"$.items[*].price: removed","occurrences":1}],"failedChecks":[],"omitted":0}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_covering_test_runs_with_its_creators_rights_and_its_outcome_lands_on_the_sandbox() {
    spur_e2e::kube::capture_logs();
    let api = KubeApi::start().await.unwrap();
    install_crds(&api).await.unwrap();
    let admin = api.client();
    ensure_namespace(&admin, NS).await.unwrap();
    ensure_namespace(&admin, TEAM_B).await.unwrap();
    let operator = operator_client(&api).await.unwrap();
    grant_cluster(&api, "spur-operator", "operator-smarttests-rules.yaml")
        .await
        .unwrap();
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
    // The chart's stamps, Sandboxes' and SmartTests', alone in the configuration whose
    // caBundle the operator fills in.
    let doc: Value = serde_yaml_ng::from_str(&chart_document(
        "templates/operator.yaml",
        "kind: MutatingWebhookConfiguration",
    ))
    .unwrap();
    let port = webhook.local_addr().port();
    let hooks: Vec<Value> = doc["webhooks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| {
            w["name"] == "sandbox-creator.spur.dev" || w["name"] == "smarttest-creator.spur.dev"
        })
        .map(|w| {
            assert_eq!(w["failurePolicy"], "Fail");
            let mut w = w.clone();
            let path = w["clientConfig"]["service"]["path"]
                .as_str()
                .unwrap()
                .to_owned();
            w["clientConfig"] = json!({"url": format!("https://127.0.0.1:{port}{path}")});
            w
        })
        .collect();
    assert_eq!(hooks.len(), 2, "the chart stamps Sandboxes and SmartTests");
    let mwc: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": "spur-sidecar-injector"}, "webhooks": hooks
    }))
    .unwrap();
    Api::<MutatingWebhookConfiguration>::all(admin.clone())
        .create(&PostParams::default(), &mwc)
        .await
        .unwrap();
    let mut pki = PkiConfig::new(SYSTEM_NAMESPACE, "spur-webhook");
    pki.serving_names.push("127.0.0.1".into());
    pki.validate().unwrap();
    // The traffic store tests with `calls` capture through (calls.rs).
    let store = calls::start_store(&api, stop.child_token()).await;
    let dir = tempfile::tempdir().unwrap();
    let ctx = Arc::new(
        spur_operator::Context::new(operator.clone(), Some("test".into()), metrics)
            .with_pki(pki)
            .with_smart_tests()
            .with_smart_test_calls(calls::store_config(&api, store, dir.path()).await),
    );
    let running = tokio::spawn(spur_operator::run(operator, ctx, stop.clone()));
    let mwcs = Api::<MutatingWebhookConfiguration>::all(admin.clone());
    eventually("the caBundle and the serving certificate", || {
        let (mwcs, ready) = (mwcs.clone(), webhook.ready());
        async move {
            let m = mwcs.get("spur-sidecar-injector").await.ok()?;
            (m.webhooks?[0].client_config.ca_bundle.is_some() && ready).then_some(())
        }
    })
    .await;
    baseline(&admin).await;

    let sandboxes = json!({"apiGroups": ["spur.dev"], "resources": ["sandboxes"],
                           "verbs": ["create", "get", "list", "patch", "update"]});
    let tests_rw = json!({"apiGroups": ["spur.dev"], "resources": ["smarttests"],
                          "verbs": ["create", "get", "list", "patch", "delete"]});
    let ann = user(
        &api,
        "shop-devs",
        "ann",
        Some(json!([{"kind": "Group", "name": SHOP_DEVS, "apiGroup": "rbac.authorization.k8s.io"}])),
        json!([sandboxes]),
        &[(NS, json!([
            tests_rw,
            {"apiGroups": ["spur.dev"], "resources": ["jobs"], "verbs": ["create", "get", "list"]},
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create", "get"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "get"]}
        ]))],
    )
    .await;
    // Mallory may read sandboxes, and write SmartTests and submit Jobs in shop, but not create
    // its workloads: she could not have created the sandbox.
    let mallory = user(
        &api,
        "devs",
        "mallory",
        None,
        json!([{"apiGroups": ["spur.dev"], "resources": ["sandboxes"], "verbs": ["get", "list"]}]),
        &[(NS, json!([
            tests_rw,
            {"apiGroups": ["spur.dev"], "resources": ["jobs"], "verbs": ["create", "get", "list"]}
        ]))],
    )
    .await;
    let bob = user(
        &api,
        "devs",
        "bob",
        None,
        json!([]),
        &[(TEAM_B, json!([
            tests_rw,
            {"apiGroups": ["spur.dev"], "resources": ["jobs"], "verbs": ["create", "get", "list"]}
        ]))],
    )
    .await;

    let pp = PostParams::default();
    Api::<Sandbox>::all(ann.clone())
        .create(&pp, &sandbox("pr-1", "api:dev"))
        .await
        .unwrap();
    let mine = Api::<SmartTest>::namespaced(ann.clone(), NS)
        .create(&pp, &smart_test("list-items", NS, &["api"]))
        .await
        .unwrap();
    assert_eq!(
        mine.annotations()
            .get(CREATED_BY_ANNOTATION)
            .map(String::as_str),
        Some(ANN),
        "the creator is stamped"
    );
    let groups = mine
        .annotations()
        .get(spur_api::smarttest::CREATED_BY_GROUPS_ANNOTATION)
        .unwrap();
    assert!(groups.contains(SHOP_DEVS), "{groups}");
    let hers = Api::<SmartTest>::namespaced(mallory.clone(), NS)
        .create(&pp, &smart_test("mallorys", NS, &["api"]))
        .await
        .unwrap();
    assert_eq!(
        hers.annotations()
            .get(CREATED_BY_ANNOTATION)
            .map(String::as_str),
        Some(MALLORY)
    );
    // Bob: a test of his own namespace (it covers nothing of shop's), none in shop, and no
    // borrowed creator.
    Api::<SmartTest>::namespaced(bob.clone(), TEAM_B)
        .create(&pp, &smart_test("bobs", TEAM_B, &["api"]))
        .await
        .unwrap();
    let message = refused(
        Api::<SmartTest>::namespaced(bob.clone(), NS)
            .create(&pp, &smart_test("bobs", NS, &["api"]))
            .await,
    );
    assert!(message.contains("smarttests"), "{message}");
    let mut forged = smart_test("forged", TEAM_B, &["api"]);
    forged
        .annotations_mut()
        .insert(CREATED_BY_ANNOTATION.into(), ANN.into());
    let message = refused(
        Api::<SmartTest>::namespaced(bob.clone(), TEAM_B)
            .create(&pp, &forged)
            .await,
    );
    assert!(message.contains("set by Spur"), "{message}");

    // Ready: ann's test runs, as a Job of shop on its runner group, with the sandbox's
    // routing context; mallory's does not.
    fork_ready(&admin, "pr-1", "api:dev").await;
    let first = eventually("the run of list-items", || async {
        runs(&admin, NS, "list-items").await.into_iter().next()
    })
    .await;
    assert_eq!(first.spec.runner_group, "smart-tests");
    assert_eq!(
        first
            .spec
            .routing_context
            .as_ref()
            .unwrap()
            .sandbox
            .as_deref(),
        Some("pr-1")
    );
    assert_eq!(first.spec.inject_routing_key, InjectRoutingKey::Disabled);
    let script = first.spec.script.as_deref().unwrap();
    assert!(
        script.contains("spur test run -f - --key \"$SPUR_ROUTING_KEY\"")
            && script.contains("http://api.shop/items"),
        "{script}"
    );
    assert_eq!(
        first
            .annotations()
            .get(RUN_SANDBOX_GENERATION)
            .map(String::as_str),
        Some("1")
    );
    let c = tests_condition(&admin, "pr-1", "a Running Tests condition", |c| {
        c.reason == "Running" && c.message.contains("shop/mallorys: not run")
    })
    .await;
    assert_eq!(c.status, "Unknown");
    assert!(
        c.message.contains(&format!(
            "its creator {MALLORY} may not create deployments.apps in shop"
        )),
        "{}",
        c.message
    );
    assert!(!c.message.contains("bobs"), "{}", c.message);
    assert!(runs(&admin, NS, "mallorys").await.is_empty());

    // The jobs controller refuses the run's Job (its runner group went): the condition says
    // so, and not "Running" for ever. Accepted again, it is running again.
    let accepted = |status: &str, reason: &str, message: &str| {
        json!({"status": {"phase": "Queued", "conditions": [{"type": "Accepted",
            "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-12-05T00:00:00Z"}]}})
    };
    let jobs = Api::<Job>::namespaced(admin.clone(), NS);
    let gone = "runner group smart-tests does not exist in namespace shop";
    jobs.patch_status(
        &first.name_any(),
        &PatchParams::default(),
        &Patch::Merge(accepted("False", "RunnerGroupNotFound", gone)),
    )
    .await
    .unwrap();
    let c = tests_condition(&admin, "pr-1", "a NotAccepted Tests condition", |c| {
        c.reason == "NotAccepted"
    })
    .await;
    assert_eq!(c.status, "False");
    assert!(
        c.message.contains(&format!("not accepted: {gone}")),
        "{}",
        c.message
    );
    jobs.patch_status(
        &first.name_any(),
        &PatchParams::default(),
        &Patch::Merge(accepted(
            "True",
            "Accepted",
            "queued on runner group smart-tests",
        )),
    )
    .await
    .unwrap();
    tests_condition(&admin, "pr-1", "a Running Tests condition again", |c| {
        c.reason == "Running"
    })
    .await;
    assert!(runs(&admin, TEAM_B, "bobs").await.is_empty());

    // Bob forges a run: a Job of his namespace with a run's labels, owned by ann's sandbox and
    // controlled by ann's test (uids are no secret), which ends with a finding of his making.
    // The operator must not take it for a run of the sandbox (the test is not of the Job's
    // namespace): no Event, nothing in the condition. Nor does it delete it: it is no run of
    // any test, and bob's to keep.
    let sb_uid = Api::<Sandbox>::all(admin.clone())
        .get("pr-1")
        .await
        .unwrap()
        .uid()
        .unwrap();
    let mut forged_run: Job = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
        "metadata": {
            "name": "forged-run", "namespace": TEAM_B,
            "labels": {RUN_TEST_LABEL: "list-items", spur_api::keys::labels::SANDBOX: "pr-1"},
            "ownerReferences": [
                {"apiVersion": "spur.dev/v1alpha1", "kind": "SmartTest", "name": "list-items",
                 "uid": mine.uid().unwrap(), "controller": true},
                {"apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox", "name": "pr-1", "uid": sb_uid}
            ]
        },
        "spec": {"runnerGroup": "smart-tests", "script": "true"}
    }))
    .unwrap();
    forged_run = Api::<Job>::namespaced(bob.clone(), TEAM_B)
        .create(&pp, &forged_run)
        .await
        .unwrap();
    finish(
        &admin,
        &forged_run,
        &FINDINGS.replace("removed", "forged by bob"),
    )
    .await;

    // The run ends with a finding: the condition says which, and so does an Event.
    finish(&admin, &first, FINDINGS).await;
    let c = tests_condition(&admin, "pr-1", "a Findings Tests condition", |c| {
        c.reason == "Findings"
    })
    .await;
    assert_eq!(c.status, "False");
    assert!(
        c.message.contains("shop/list-items")
            && c.message.contains("1 finding (1 schema)")
            && c.message
                .contains("[schema] GET api.shop/items: $.items[*].price: removed"),
        "{}",
        c.message
    );
    // The value the service answered stays in the run's Job (shop's), out of the
    // cluster-scoped Sandbox and its Events.
    assert!(!c.message.contains("removed 3"), "{}", c.message);
    let events: Api<Event> = Api::all(admin.clone());
    eventually("the SmartTestFindings Event", || async {
        let list = events.list(&ListParams::default()).await.unwrap();
        list.items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("SmartTestFindings")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("pr-1")
            })
            .map(|e| {
                let note = e.note.unwrap_or_default();
                assert!(
                    note.contains("price: removed") && !note.contains("removed 3"),
                    "{note}"
                );
            })
    })
    .await;
    let list = events.list(&ListParams::default()).await.unwrap();
    for e in &list.items {
        let note = e.note.as_deref().unwrap_or_default();
        assert!(!note.contains("forged") && !note.contains("bobs"), "{note}");
    }
    // Mallory's refusal was said once, though the sandbox changed and was looked at since.
    let refusals: Vec<&Event> = list
        .items
        .iter()
        .filter(|e| {
            e.reason.as_deref() == Some("SmartTestRefused")
                && e.note.as_deref().unwrap_or_default().contains("mallorys")
        })
        .collect();
    assert_eq!(refusals.len(), 1, "{refusals:?}");
    assert!(
        refusals[0].series.as_ref().is_none_or(|s| s.count <= 1),
        "repeated: {refusals:?}"
    );
    assert!(!c.message.contains("forged"), "{}", c.message);
    eventually("the run marked reported", || async {
        let j = Api::<Job>::namespaced(admin.clone(), NS)
            .get(&first.name_any())
            .await
            .unwrap();
        j.annotations()
            .contains_key(spur_operator::smarttests::REPORTED_ANNOTATION)
            .then_some(())
    })
    .await;

    // The fork's image changes: a new generation, run again once Ready; the first run is kept.
    Api::<Sandbox>::all(ann.clone())
        .patch(
            "pr-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": NS, "name": "api"},
                                         "customizations": {"images": [{"image": "api:dev2"}]}}]}})),
        )
        .await
        .unwrap();
    fork_ready(&admin, "pr-1", "api:dev2").await;
    let second = eventually("the second run of list-items", || async {
        let all = runs(&admin, NS, "list-items").await;
        let second = all.iter().find(|j| {
            j.annotations()
                .get(RUN_SANDBOX_GENERATION)
                .map(String::as_str)
                == Some("2")
        });
        (all.len() == 2).then(|| second.cloned()).flatten()
    })
    .await;
    assert_ne!(second.name_any(), first.name_any());
    assert_eq!(
        second
            .annotations()
            .get(RUN_SANDBOX_GENERATION)
            .map(String::as_str),
        Some("2")
    );
    finish(
        &admin,
        &second,
        r#"{"passed":true,"steps":1,"checksFailed":0,"findings":0}"#,
    )
    .await;
    let c = tests_condition(&admin, "pr-1", "list-items passed", |c| {
        c.message.contains("passed (1 steps, no findings)")
    })
    .await;
    // Mallory's refusal still stands, so the whole is not a pass.
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "Refused"));

    // Mallory's test goes: the condition is ann's alone, and passes.
    Api::<SmartTest>::namespaced(mallory.clone(), NS)
        .delete("mallorys", &Default::default())
        .await
        .unwrap();
    let c = tests_condition(&admin, "pr-1", "a Passed Tests condition", |c| {
        c.reason == "Passed"
    })
    .await;
    assert_eq!(c.status, "True");
    assert!(c.message.starts_with("1 test: 1 passed"), "{}", c.message);
    assert!(
        Api::<Job>::namespaced(admin.clone(), TEAM_B)
            .get_opt("forged-run")
            .await
            .unwrap()
            .is_some(),
        "bob's Job was deleted by the operator"
    );

    // Mallory may edit shop's tests but could not have created the sandbox: when she rewrites
    // ann's test, she becomes its creator, and its new generation is not run with ann's rights.
    let edited = Api::<SmartTest>::namespaced(mallory.clone(), NS)
        .patch(
            "list-items",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"steps": [
                {"name": "admin", "http": {"url": format!("http://api.{NS}/admin")}}]}})),
        )
        .await
        .unwrap();
    assert_eq!(
        edited
            .annotations()
            .get(CREATED_BY_ANNOTATION)
            .map(String::as_str),
        Some(MALLORY),
        "whoever changes a test's spec is its creator"
    );
    let c = tests_condition(
        &admin,
        "pr-1",
        "ann's test refused after mallory's edit",
        |c| c.reason == "Refused",
    )
    .await;
    assert!(
        c.message.contains("shop/list-items: not run")
            && c.message
                .contains(&format!("its creator {MALLORY} may not")),
        "{}",
        c.message
    );
    assert_eq!(
        runs(&admin, NS, "list-items").await.len(),
        2,
        "the rewritten test ran"
    );

    calls::a_test_comparing_calls_runs_with_a_capture_its_creator_may_start(&admin, &ann, store)
        .await;

    stop.cancel();
    tokio::time::timeout(spur_e2e::kube::WAIT, running)
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(spur_e2e::kube::WAIT, webhook.stopped())
        .await
        .unwrap();
}
