//! Sidecar injection and EnvoyConfig and ListenerSet validation on a real kube-apiserver: our
//! webhook configurations (URL + caBundle, as the chart's but pointing at loopback) make the API
//! server call the operator's webhook for every pod, EnvoyConfig and ListenerSet. The operator runs under the chart's RBAC, leader-elected, with its
//! certificate manager filling the caBundle. There is no kubelet or ReplicaSet controller: the
//! test creates ReplicaSets and pods the way those controllers would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use prometheus_client::registry::Registry;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde_json::{Value, json};
use spur_api::envoyconfig::{EnvoyResource, EnvoyResourceType, Serialization};
use spur_api::keys::injection as keys;
use spur_api::{EnvoyConfig, EnvoyConfigSpec, ListenerSet, Sandbox};
use spur_e2e::kube::{
    SYSTEM_NAMESPACE, WAIT, chart_document, eventually, install_crds, operator_client,
};
use spur_kube_harness::KubeApi;
use spur_operator::inject::{Baseline, InjectionConfig};
use spur_operator::{PkiConfig, Webhook, WebhookConfig};
use tokio_util::sync::CancellationToken;

const WEBHOOK_CONFIGURATION: &str = "spur-sidecar-injector";
const VALIDATING_CONFIGURATION: &str = "spur-envoyconfig-validator";

fn injection_config() -> InjectionConfig {
    let mut cfg = InjectionConfig {
        sidecar_image: "spur:test".into(),
        init_image: "spur:test".into(),
        routeserver: "spur-routeserver.spur-system.svc:7777".into(),
        ..InjectionConfig::default()
    };
    cfg.system_namespaces.push(SYSTEM_NAMESPACE.into());
    cfg
}

/// The API server, the operator (controllers + certificate manager, leader-elected) and the
/// webhook server, all under the chart's RBAC, and the webhook configuration.
struct Setup {
    api: KubeApi,
    stop: CancellationToken,
    webhook_stop: CancellationToken,
    webhook: Option<Webhook>,
    operator: tokio::task::JoinHandle<()>,
    registry: Arc<Registry>,
    cfg: InjectionConfig,
}

impl Setup {
    async fn start(tune: impl FnOnce(&mut PkiConfig)) -> Setup {
        spur_e2e::kube::capture_logs();
        let api = KubeApi::start().await.unwrap();
        install_crds(&api).await.unwrap();
        let client = operator_client(&api).await.unwrap();
        let mut registry = Registry::with_prefix("spur_operator");
        let metrics = spur_operator::Metrics::register(&mut registry);
        let stop = CancellationToken::new();
        let webhook_stop = stop.child_token();
        let cfg = injection_config();
        let webhook = Webhook::start(
            client.clone(),
            WebhookConfig {
                addr: "127.0.0.1:0".parse().unwrap(),
                namespace: SYSTEM_NAMESPACE.into(),
                serving_secret: "spur-webhook-tls".into(),
                injection: cfg.clone(),
            },
            metrics.clone(),
            webhook_stop.clone(),
        )
        .await
        .unwrap();
        // The chart's webhook configuration, with a URL instead of the Service. No caBundle:
        // the operator fills it in.
        let mut mwc = chart_webhook_configuration();
        for w in mwc.webhooks.iter_mut().flatten() {
            let path = w
                .client_config
                .service
                .as_ref()
                .unwrap()
                .path
                .clone()
                .unwrap();
            w.client_config = serde_json::from_value(json!({"url": format!(
                "https://127.0.0.1:{}{path}",
                webhook.local_addr().port(),
            )}))
            .unwrap();
        }
        Api::<MutatingWebhookConfiguration>::all(api.client())
            .create(&PostParams::default(), &mwc)
            .await
            .unwrap();
        let mut vwc = chart_validating_configuration();
        for w in vwc.webhooks.iter_mut().flatten() {
            let path = w
                .client_config
                .service
                .as_ref()
                .unwrap()
                .path
                .clone()
                .unwrap();
            w.client_config = serde_json::from_value(json!({"url": format!(
                "https://127.0.0.1:{}{path}",
                webhook.local_addr().port(),
            )}))
            .unwrap();
        }
        Api::<ValidatingWebhookConfiguration>::all(api.client())
            .create(&PostParams::default(), &vwc)
            .await
            .unwrap();

        let mut pki = PkiConfig::new(SYSTEM_NAMESPACE, "spur-webhook");
        pki.serving_names.push("127.0.0.1".into());
        tune(&mut pki);
        pki.validate().unwrap();
        let ctx = Arc::new(
            spur_operator::Context::new(client.clone(), Some("test".into()), metrics).with_pki(pki),
        );
        let election = spur_operator::LeaderElection {
            namespace: SYSTEM_NAMESPACE.into(),
            lease: "spur-operator".into(),
            identity: "test".into(),
            duration_secs: 15,
            grace_secs: 5,
            owner: None,
        };
        let operator_stop = stop.clone();
        let operator = tokio::spawn(async move {
            spur_operator::run_elected(client, ctx, operator_stop, election)
                .await
                .unwrap();
        });
        let setup = Setup {
            api,
            stop,
            webhook_stop,
            webhook: Some(webhook),
            operator,
            registry: Arc::new(registry),
            cfg,
        };
        // Ready: the caBundles are in place and the server holds a certificate.
        let mwcs: Api<MutatingWebhookConfiguration> = Api::all(setup.client());
        let vwcs: Api<ValidatingWebhookConfiguration> = Api::all(setup.client());
        eventually("the caBundles and the serving certificate", || {
            let (mwcs, vwcs) = (mwcs.clone(), vwcs.clone());
            let ready = setup.webhook.as_ref().unwrap().ready();
            async move {
                let m = mwcs.get(WEBHOOK_CONFIGURATION).await.ok()?;
                let v = vwcs.get(VALIDATING_CONFIGURATION).await.ok()?;
                let has_bundle = m.webhooks?.first()?.client_config.ca_bundle.is_some()
                    && v.webhooks?
                        .iter()
                        .all(|w| w.client_config.ca_bundle.is_some());
                (has_bundle && ready).then_some(())
            }
        })
        .await;
        setup
    }

    fn client(&self) -> Client {
        self.api.client()
    }

    fn metric(&self, series: &str) -> f64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        spur_e2e::sample(&text, series)
    }

    async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(w) = self.webhook.take() {
            tokio::time::timeout(WAIT, w.stopped()).await.unwrap();
        }
        tokio::time::timeout(WAIT, &mut self.operator)
            .await
            .unwrap()
            .unwrap();
    }
}

/// The MutatingWebhookConfiguration of `charts/spur/templates/operator.yaml`, its few template
/// expressions filled in as Helm would for release namespace spur-system.
fn chart_webhook_configuration() -> MutatingWebhookConfiguration {
    let mwc: MutatingWebhookConfiguration = serde_yaml_ng::from_str(&chart_document(
        "templates/operator.yaml",
        "kind: MutatingWebhookConfiguration",
    ))
    .unwrap();
    assert_eq!(mwc.metadata.name.as_deref(), Some(WEBHOOK_CONFIGURATION));
    let w = &mwc.webhooks.as_ref().unwrap()[0];
    assert_eq!(w.failure_policy.as_deref(), Some("Ignore"));
    mwc
}

/// The ValidatingWebhookConfiguration of `charts/spur/templates/admission.yaml`, likewise.
fn chart_validating_configuration() -> ValidatingWebhookConfiguration {
    let vwc: ValidatingWebhookConfiguration = serde_yaml_ng::from_str(&chart_document(
        "templates/admission.yaml",
        "kind: ValidatingWebhookConfiguration",
    ))
    .unwrap();
    assert_eq!(vwc.metadata.name.as_deref(), Some(VALIDATING_CONFIGURATION));
    let webhooks = vwc.webhooks.as_ref().unwrap();
    let paths = [
        (
            "envoyconfig.spur.dev",
            spur_operator::VALIDATE_ENVOYCONFIG_PATH,
        ),
        (
            "listenerset.spur.dev",
            spur_operator::VALIDATE_LISTENERSET_PATH,
        ),
        (
            "sandbox-workstation.spur.dev",
            spur_operator::VALIDATE_SANDBOX_PATH,
        ),
    ];
    // The exec audit webhook (kube_access tests it) comes last: never refusing, it may
    // record Events.
    let (audit, webhooks) = webhooks.split_last().unwrap();
    assert_eq!(audit.name, "connect-audit.spur.dev");
    assert_eq!(audit.failure_policy.as_deref(), Some("Ignore"));
    assert_eq!(
        audit
            .client_config
            .service
            .as_ref()
            .unwrap()
            .path
            .as_deref(),
        Some(spur_operator::VALIDATE_POD_CONNECT_PATH)
    );
    assert_eq!(webhooks.len(), paths.len());
    for (w, (name, path)) in webhooks.iter().zip(paths) {
        assert_eq!(w.name, name);
        assert_eq!(w.failure_policy.as_deref(), Some("Fail"), "{name}");
        assert_eq!(w.side_effects, "None", "{name}");
        let service = w.client_config.service.as_ref().unwrap();
        assert_eq!(service.path.as_deref(), Some(path), "{name}");
    }
    vwc
}

/// A namespace with `labels` and its `default` ServiceAccount (which pods need; there is no
/// controller manager to create it).
async fn namespace(api: &KubeApi, name: &str, labels: Value) {
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
    let namespaces: Api<Namespace> = Api::all(api.client());
    if namespaces.get_opt(name).await.unwrap().is_none() {
        namespaces
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
    }
    api.service_account_token(name, "default").await.unwrap();
}

/// A Deployment (with `template_annotations`) and one ReplicaSet of it, as the Deployment
/// controller would make it; returns the ReplicaSet's owner reference for pods.
async fn deployment(client: &Client, ns: &str, name: &str, template_annotations: Value) -> Value {
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}, "annotations": template_annotations},
                "spec": {"containers": [{"name": "app", "image": format!("{name}:1"), "ports": [{"name": "http", "containerPort": 8080}]}]}
            }
        }
    }))
    .unwrap();
    let d = Api::<Deployment>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    replicaset(
        client,
        ns,
        name,
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": name, "uid": d.uid().unwrap(), "controller": true}),
    )
    .await
}

async fn replicaset(client: &Client, ns: &str, app: &str, owner: Value) -> Value {
    let rs_name = format!("{app}-5d8f7c");
    let rs: ReplicaSet = serde_json::from_value(json!({
        "metadata": {"name": rs_name, "namespace": ns, "ownerReferences": [owner]},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": app}},
            "template": {"metadata": {"labels": {"app": app}}, "spec": {"containers": [{"name": "app", "image": format!("{app}:1")}]}}
        }
    }))
    .unwrap();
    let rs = Api::<ReplicaSet>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &rs)
        .await
        .unwrap();
    json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs_name, "uid": rs.uid().unwrap(), "controller": true})
}

/// Creates a pod (as a controller would: generateName, owner reference, template metadata) and
/// returns it as admitted.
async fn pod(client: &Client, ns: &str, app: &str, owner: Option<Value>, meta: Value) -> Pod {
    let mut metadata = json!({
        "generateName": format!("{app}-"),
        "namespace": ns,
        "labels": {"app": app},
    });
    if let Some(o) = owner {
        metadata["ownerReferences"] = json!([o]);
    }
    for (k, v) in meta.as_object().cloned().unwrap_or_default() {
        match (metadata.get_mut(&k), v) {
            (Some(Value::Object(m)), Value::Object(add)) => m.extend(add),
            (_, v) => metadata[&k] = v,
        }
    }
    let p: Pod = serde_json::from_value(json!({
        "metadata": metadata,
        "spec": {"containers": [{"name": "app", "image": format!("{app}:1"), "ports": [{"containerPort": 8080}]}]}
    }))
    .unwrap();
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &p)
        .await
        .unwrap()
}

fn annotation<'a>(p: &'a Pod, key: &str) -> Option<&'a str> {
    p.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// The literal env of the pod's first container (the injected sidecar).
fn sidecar_env(p: &Pod) -> std::collections::BTreeMap<String, String> {
    p.spec.as_ref().unwrap().containers[0]
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect()
}

fn init_names(p: &Pod) -> Vec<String> {
    p.spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .map(|c| c.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default()
}

fn container_names(p: &Pod) -> Vec<String> {
    p.spec
        .as_ref()
        .map(|s| s.containers.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default()
}

/// Injected with the default settings: no init container, the sidecar first of the containers.
fn injected_by_default(p: &Pod) -> bool {
    init_names(p).is_empty() && container_names(p) == ["spur-sidecar", "app"]
}

/// Every field of `expected` is in `actual` with the same value (the API server adds defaults).
fn assert_subset(expected: &Value, actual: &Value, path: &str) {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => {
            for (k, v) in e {
                let got = a
                    .get(k)
                    .unwrap_or_else(|| panic!("{path}.{k} missing in {actual}"));
                assert_subset(v, got, &format!("{path}.{k}"));
            }
        }
        (Value::Array(e), Value::Array(a)) => {
            assert_eq!(e.len(), a.len(), "{path}: {expected} vs {actual}");
            for (i, (e, a)) in e.iter().zip(a).enumerate() {
                assert_subset(e, a, &format!("{path}[{i}]"));
            }
        }
        // Quantities come back canonical ("16Mi" stays, "0.5" becomes "500m"): ours are canonical.
        _ => assert_eq!(expected, actual, "{path}"),
    }
}

fn assert_skipped(p: &Pod, reason: &str) {
    assert_eq!(
        annotation(p, keys::STATUS),
        Some("skipped"),
        "{:?}",
        p.metadata.annotations
    );
    let got = annotation(p, keys::REASON).unwrap_or_default();
    assert!(
        got.contains(reason),
        "reason {got:?} should mention {reason:?}"
    );
    assert!(init_names(p).is_empty(), "{:?}", init_names(p));
    assert_eq!(container_names(p), ["app"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_injects_opted_in_pods_and_records_why_others_are_skipped() {
    let setup = Setup::start(|_| {}).await;
    let client = setup.client();
    let api = &setup.api;
    // Labelled spur.dev/enabled=true: the coverage Sandbox forks a baseline here.
    namespace(
        api,
        "shop",
        json!({(spur_e2e::kube::ENABLED_LABEL): "true"}),
    )
    .await;
    spur_e2e::kube::wait_enrolled(&api.client(), "shop")
        .await
        .unwrap();
    namespace(api, "auto", json!({(keys::INJECT): "true"})).await;
    namespace(api, "optout", json!({(keys::INJECT): "false"})).await;
    namespace(api, "kube-system", json!({})).await;
    let on = json!({(keys::INJECT): "true"});
    // Clients that connect to the webhook and never finish a TLS handshake hold up nobody:
    // the API server's calls below (5 s timeout) are answered while these wait out theirs.
    let webhook_addr = setup.webhook.as_ref().unwrap().local_addr();
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(tokio::net::TcpStream::connect(webhook_addr).await.unwrap());
    }

    // An opted-in Deployment's pod gets exactly the documented containers.
    let api_rs = deployment(&client, "shop", "api", on.clone()).await;
    let injected = pod(
        &client,
        "shop",
        "api",
        Some(api_rs.clone()),
        json!({"annotations": on.clone()}),
    )
    .await;
    assert!(injected_by_default(&injected), "{:?}", injected.spec);
    // A fork's pod that relays Kafka and that the injection fails on (here: its ReplicaSet is
    // not there) is refused, where any other pod would be admitted unchanged.
    let orphan: Pod = serde_json::from_value(json!({
        "metadata": {"generateName": "api-fork-", "namespace": "shop",
                     "labels": {"app": "api", (spur_api::keys::labels::FORK): "sb-api"},
                     "annotations": {(keys::INJECT): "true", (keys::KAFKA_PORTS): "9092"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                         "name": "api-fork-gone", "uid": "00000000-0000-0000-0000-000000000044",
                         "controller": true}]},
        "spec": {"containers": [{"name": "app", "image": "api:1"}]}
    }))
    .unwrap();
    let refused = Api::<Pod>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &orphan)
        .await
        .expect_err("a fork's pod the injection failed on is refused");
    assert!(
        refused
            .to_string()
            .contains("is not created without its sidecar"),
        "{refused}"
    );
    // The silent clients leave: each counts as one failed handshake.
    drop(silent);
    eventually(
        "the silent clients' handshakes counted as failed",
        || async {
            (setup.metric("spur_operator_webhook_tls_handshake_errors_total") == 4.0).then_some(())
        },
    )
    .await;
    assert_eq!(annotation(&injected, keys::STATUS), Some("injected"));
    assert_eq!(
        annotation(&injected, keys::BASELINE),
        Some("Deployment/shop/api")
    );
    let baseline = Baseline {
        kind: "Deployment",
        namespace: "shop".into(),
        name: "api".into(),
        fork_of_sandbox: None,
    };
    let expected = spur_operator::inject::containers(&injected, &baseline, &setup.cfg).unwrap();
    assert!(expected.init_containers.is_empty());
    let actual = serde_json::to_value(&injected.spec.as_ref().unwrap().containers[..1]).unwrap();
    assert_subset(&json!(expected.containers), &actual, "containers");
    // The app container is untouched.
    let app = &injected.spec.as_ref().unwrap().containers[1];
    assert_eq!(
        (app.name.as_str(), app.image.as_deref()),
        ("app", Some("api:1"))
    );

    // The per-pod settings: an init container programs the rules, the sidecar is native. (Label
    // app=layout: these pods stay out of the coverage counts of Deployment api below.)
    let p = pod(
        &client,
        "shop",
        "layout",
        Some(api_rs.clone()),
        json!({"annotations": {
            (keys::INJECT): "true",
            (keys::INTERCEPTION): "initContainer",
            (keys::PLACEMENT): "native",
        }}),
    )
    .await;
    assert_eq!(init_names(&p), ["spur-init", "spur-sidecar"]);
    assert_eq!(container_names(&p), ["app"]);
    let expected = spur_operator::inject::containers(&p, &baseline, &setup.cfg).unwrap();
    let actual = serde_json::to_value(p.spec.as_ref().unwrap().init_containers.as_ref()).unwrap();
    assert_subset(&json!(expected.init_containers), &actual, "initContainers");
    // A value the webhook does not know skips the pod, with the reason.
    assert_skipped(
        &pod(
            &client,
            "shop",
            "layout",
            Some(api_rs.clone()),
            json!({"annotations": {(keys::INJECT): "true", (keys::PLACEMENT): "sideways"}}),
        )
        .await,
        "sideways",
    );

    // Opted in through the namespace label; an Argo Rollout's ReplicaSet.
    let rollout_rs = replicaset(
        &client,
        "auto",
        "cart",
        json!({"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "name": "cart", "uid": "00000000-0000-0000-0000-000000000001", "controller": true}),
    )
    .await;
    let p = pod(&client, "auto", "cart", Some(rollout_rs), json!({})).await;
    assert!(injected_by_default(&p), "{:?}", p.spec);
    assert_eq!(
        annotation(&p, keys::BASELINE),
        Some("ArgoRollout/auto/cart")
    );

    // Not opted in, forked, StatefulSet, bare, opted-out namespace, opted-out pod: untouched
    // and annotated with the reason.
    let web_rs = deployment(&client, "shop", "web", json!({})).await;
    assert_skipped(
        &pod(&client, "shop", "web", Some(web_rs), json!({})).await,
        "not opted in",
    );
    let fork = pod(
        &client,
        "shop",
        "api",
        Some(api_rs.clone()),
        json!({"annotations": on.clone(), "labels": {"spur.dev/fork": "sb-api-1234"}}),
    )
    .await;
    assert_skipped(&fork, "forked pod");
    // A fork's pod with Kafka ports gets a sidecar that only relays Kafka, in fork mode, by its
    // baseline's rules (docs/async.md): from the fork's Deployment, which a ForkedWorkload
    // controls, the webhook learns the baseline and the sandbox.
    let kafka_on = json!({(keys::INJECT): "true", (keys::KAFKA_PORTS): "9092"});
    let fork_d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "api-sb1", "namespace": "shop",
            "labels": {"spur.dev/sandbox": "sb1", "spur.dev/fork": "api-sb1"},
            "annotations": {"spur.dev/baseline": "Deployment/shop/api"},
            "ownerReferences": [{"apiVersion": "spur.dev/v1alpha1", "kind": "ForkedWorkload",
                "name": "sb1-api", "uid": "00000000-0000-0000-0000-00000000f0f0", "controller": true}]},
        "spec": {
            "selector": {"matchLabels": {"spur.dev/fork": "api-sb1"}},
            "template": {"metadata": {"labels": {"spur.dev/fork": "api-sb1"}},
                "spec": {"containers": [{"name": "app", "image": "api:1"}]}}
        }
    }))
    .unwrap();
    let fork_d = Api::<Deployment>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &fork_d)
        .await
        .unwrap();
    let fork_rs = replicaset(
        &client,
        "shop",
        "api-sb1",
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "api-sb1", "uid": fork_d.uid().unwrap(), "controller": true}),
    )
    .await;
    let kafka_fork = pod(
        &client,
        "shop",
        "api-sb1",
        Some(fork_rs),
        json!({"annotations": kafka_on.clone(), "labels": {"spur.dev/fork": "api-sb1"}}),
    )
    .await;
    assert_eq!(annotation(&kafka_fork, keys::STATUS), Some("injected"));
    assert!(injected_by_default(&kafka_fork), "{:?}", kafka_fork.spec);
    let fork_baseline = Baseline {
        fork_of_sandbox: Some("sb1".into()),
        ..baseline.clone()
    };
    let expected =
        spur_operator::inject::containers(&kafka_fork, &fork_baseline, &setup.cfg).unwrap();
    let actual = serde_json::to_value(&kafka_fork.spec.as_ref().unwrap().containers[..1]).unwrap();
    assert_subset(&json!(expected.containers), &actual, "containers");
    let env = sidecar_env(&kafka_fork);
    for (k, v) in [
        ("SPUR_FORK_OF_SANDBOX", "sb1"),
        ("SPUR_BASELINE_NAME", "api"),
        ("SPUR_KAFKA_PORTS", "9092"),
        ("SPUR_INBOUND_PORTS", "none"),
    ] {
        assert_eq!(env.get(k).map(String::as_str), Some(v), "{k} in {env:?}");
    }
    // The fork's label on a pod of a Deployment no ForkedWorkload controls names no baseline.
    assert_skipped(
        &pod(
            &client,
            "shop",
            "layout",
            Some(api_rs.clone()),
            json!({"annotations": kafka_on, "labels": {"spur.dev/fork": "sb-api-1234"}}),
        )
        .await,
        "not a fork a ForkedWorkload controls",
    );
    let sts = json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "db", "uid": "00000000-0000-0000-0000-000000000002", "controller": true});
    assert_skipped(
        &pod(
            &client,
            "shop",
            "db",
            Some(sts),
            json!({"annotations": on.clone()}),
        )
        .await,
        "StatefulSet/db",
    );
    assert_skipped(
        &pod(
            &client,
            "shop",
            "bare",
            None,
            json!({"annotations": on.clone()}),
        )
        .await,
        "no controlling owner",
    );
    let opt_rs = deployment(&client, "optout", "api", on.clone()).await;
    assert_skipped(
        &pod(
            &client,
            "optout",
            "api",
            Some(opt_rs),
            json!({"annotations": on.clone()}),
        )
        .await,
        "namespace optout opted out",
    );
    let off = pod(
        &client,
        "shop",
        "api",
        Some(api_rs.clone()),
        json!({"annotations": {(keys::INJECT): "false"}}),
    )
    .await;
    assert_skipped(&off, "pod opted out");
    // System namespaces never reach the webhook (namespaceSelector): no annotation at all.
    let sys = pod(
        &client,
        "kube-system",
        "dns",
        None,
        json!({"annotations": on.clone()}),
    )
    .await;
    assert!(
        sys.metadata
            .annotations
            .as_ref()
            .unwrap()
            .get(keys::STATUS)
            .is_none()
    );
    assert!(init_names(&sys).is_empty());
    assert_eq!(container_names(&sys), ["app"]);
    assert_eq!(
        setup.metric("spur_operator_webhook_admissions_total{result=\"injected\"}"),
        4.0
    );
    assert_eq!(
        setup.metric("spur_operator_webhook_admissions_total{result=\"skipped\"}"),
        8.0
    );

    // Sandbox status: per forked baseline, whether every baseline pod has a ready sidecar.
    // shop/api has two running pods: `injected` (sidecar not ready yet) and `off` (none).
    let sb: Sandbox = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "sb"},
        "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "api"}}]}
    }))
    .unwrap();
    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    sandboxes.create(&PostParams::default(), &sb).await.unwrap();
    let coverage = |want: Value| {
        let sandboxes = sandboxes.clone();
        async move {
            let sb = sandboxes.get("sb").await.ok()?;
            let mut got =
                serde_json::to_value(sb.status?.forks.first()?.baseline_sidecars.clone()?).ok()?;
            // The pods without a sidecar are checked on their own, below.
            got.as_object_mut()?.remove("withoutSidecar");
            (got == want).then_some(())
        }
    };
    eventually("coverage 2 pods, 1 injected, 0 ready", || {
        coverage(json!({"pods": 2, "injected": 1, "ready": 0, "allReady": false}))
    })
    .await;
    // The pod without a sidecar is named, with the webhook's reason, in the Sandbox's
    // condition.
    let sidecars_condition = || {
        let sandboxes = sandboxes.clone();
        async move {
            let st = sandboxes.get("sb").await.ok()?.status?;
            let c = st
                .conditions
                .iter()
                .find(|c| c.type_ == "BaselineSidecars")?;
            Some((c.status.clone(), c.reason.clone(), c.message.clone()))
        }
    };
    let (status, reason, message) = eventually("the BaselineSidecars condition", || async {
        sidecars_condition()
            .await
            .filter(|(s, _, _)| format!("{s:?}").contains("False"))
    })
    .await;
    assert_eq!(reason, "PodsWithoutSidecar", "{status:?}");
    assert!(
        message.contains(&format!(
            "shop/{} (not injected: pod opted out",
            off.name_any()
        )),
        "{message}"
    );
    // The kubelet would report the sidecar container ready.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    pods.patch_status(
        &injected.name_any(),
        &PatchParams::default(),
        &Patch::Merge(
            json!({"status": {"phase": "Running", "containerStatuses": [{
                "name": "spur-sidecar", "ready": true, "started": true, "restartCount": 0,
                "image": "spur:test", "imageID": "", "state": {"running": {}}
            }]}}),
        ),
    )
    .await
    .unwrap();
    eventually("coverage 2 pods, 1 injected, 1 ready", || {
        coverage(json!({"pods": 2, "injected": 1, "ready": 1, "allReady": false}))
    })
    .await;
    // The pod without a sidecar goes away: every baseline pod now has a ready sidecar.
    pods.delete(&off.name_any(), &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    eventually("coverage 1 pod, all ready", || {
        coverage(json!({"pods": 1, "injected": 1, "ready": 1, "allReady": true}))
    })
    .await;
    eventually("BaselineSidecars true", || async {
        sidecars_condition()
            .await
            .filter(|(s, r, _)| format!("{s:?}").contains("True") && r == "AllInjected")
    })
    .await;
    let fw = Api::<spur_api::ForkedWorkload>::namespaced(client.clone(), "shop")
        .get(&spur_api::names::fork_name("sb", &sb.spec.forks[0].fork_of))
        .await
        .unwrap();
    assert!(fw.status.unwrap().baseline_sidecars.unwrap().all_ready);

    // A namespace's own carriers (annotations) reach the sidecars of its pods and no other
    // namespace's; a malformed one leaves the pod without a sidecar, saying why.
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for (name, headers) in [("teamkeys", "x-team-key"), ("badkeys", "not a header")] {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name,
            "annotations": {(keys::ROUTING_HEADERS): headers, (keys::QUERY_PARAM): "team-q"}}}))
        .unwrap();
        namespaces
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        api.service_account_token(name, "default").await.unwrap();
    }
    let team_rs = deployment(&client, "teamkeys", "web", on.clone()).await;
    let team = pod(
        &client,
        "teamkeys",
        "web",
        Some(team_rs),
        json!({"annotations": on.clone()}),
    )
    .await;
    assert_eq!(annotation(&team, keys::STATUS), Some("injected"));
    let env = sidecar_env(&team);
    assert_eq!(
        env.get("SPUR_ROUTING_HEADERS").map(String::as_str),
        Some("x-team-key")
    );
    assert_eq!(
        env.get("SPUR_QUERY_PARAM").map(String::as_str),
        Some("team-q")
    );
    let env = sidecar_env(&injected);
    assert!(
        !env.contains_key("SPUR_ROUTING_HEADERS") && !env.contains_key("SPUR_QUERY_PARAM"),
        "{env:?}"
    );
    let bad_rs = deployment(&client, "badkeys", "web", on.clone()).await;
    assert_skipped(
        &pod(
            &client,
            "badkeys",
            "web",
            Some(bad_rs),
            json!({"annotations": on.clone()}),
        )
        .await,
        keys::ROUTING_HEADERS,
    );
    // With the webhook server down, pods are still created (failurePolicy Ignore), unchanged.
    let mut setup = setup;
    setup.webhook_stop.cancel();
    tokio::time::timeout(WAIT, setup.webhook.take().unwrap().stopped())
        .await
        .unwrap();
    let p = pod(
        &client,
        "shop",
        "api",
        Some(api_rs),
        json!({"annotations": on.clone()}),
    )
    .await;
    assert!(init_names(&p).is_empty());
    assert!(annotation(&p, keys::STATUS).is_none());
    // ... but not a sandbox fork's pod (failurePolicy Fail on label spur.dev/fork): without its
    // sidecar it would consume the baseline's Kafka records with the fork's code.
    let fork_pod: Pod = serde_json::from_value(json!({
        "metadata": {"generateName": "api-fork-", "namespace": "shop",
                     "labels": {"app": "api", (spur_api::keys::labels::FORK): "sb-api"}},
        "spec": {"containers": [{"name": "app", "image": "api:1"}]}
    }))
    .unwrap();
    let refused = Api::<Pod>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &fork_pod)
        .await
        .expect_err("a fork's pod is not created while the webhook is down");
    assert!(
        refused.to_string().contains("fork-sidecar.spur.dev"),
        "{refused}"
    );
    // The operator notices the opted-in pod that has no sidecar: a condition that names it, a
    // metric, and a Warning event on the pod.
    let (_, reason, message) =
        eventually("the uninjected pod in the Sandbox's condition", || async {
            sidecars_condition()
                .await
                .filter(|(_, _, m)| m.contains(&p.name_any()))
        })
        .await;
    assert_eq!(reason, "PodsWithoutSidecar");
    assert!(
        message.contains("opted in, but created without passing the injection webhook"),
        "{message}"
    );
    let fw_name = spur_api::names::fork_name("sb", &sb.spec.forks[0].fork_of);
    assert_eq!(
        setup.metric(&format!(
            "spur_operator_baseline_pods_without_sidecar{{namespace=\"shop\",forked_workload=\"{fw_name}\"}}"
        )),
        1.0
    );
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), "shop");
    let event = eventually("a SidecarMissing event on the pod", || async {
        events
            .list(&Default::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("SidecarMissing")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref())
                        == Some(p.name_any().as_str())
            })
    })
    .await;
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert!(event.note.unwrap_or_default().contains("sandbox sb"));
    // The refused fork pod's, only.
    assert_eq!(
        setup.metric("spur_operator_webhook_admissions_total{result=\"error\"}"),
        1.0
    );
    // Only the four silent clients from the start.
    assert_eq!(
        setup.metric("spur_operator_webhook_tls_handshake_errors_total"),
        4.0
    );

    setup.shutdown().await;
}

/// A TLS handshake with the webhook, trusting only the bundle the API server has; returns the
/// certificate served (DER).
async fn served_certificate(addr: std::net::SocketAddr, bundle: &[u8]) -> Vec<u8> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(bundle) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect("127.0.0.1".try_into().unwrap(), tcp)
        .await
        .expect("the served certificate verifies against the caBundle");
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_with_no_failed_admission() {
    // Shortened lifetimes: the serving certificate renews every ~6 s, the CA at ~24 s (then
    // the next CA is trusted for 3 s before it signs).
    let setup = Setup::start(|pki| {
        pki.ca_lifetime = Duration::from_secs(30);
        pki.serving_lifetime = Duration::from_secs(8);
        pki.propagation = Duration::from_secs(3);
    })
    .await;
    let client = setup.client();
    namespace(&setup.api, "shop", json!({})).await;
    let on = json!({(keys::INJECT): "true"});
    let rs = deployment(&client, "shop", "api", on.clone()).await;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let addr = setup.webhook.as_ref().unwrap().local_addr();

    let text =
        |s: &Secret, k: &str| String::from_utf8(s.data.as_ref().unwrap()[k].0.clone()).unwrap();
    let (mut serving, mut cas, mut bundle_sizes) =
        (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    let mut served = BTreeSet::new();
    let (mut created, mut uninjected) = (0, Vec::new());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    // Bounded: at most 400 pods and 40 s.
    while tokio::time::Instant::now() < deadline && created < 400 {
        let p = pod(
            &client,
            "shop",
            "api",
            Some(rs.clone()),
            json!({"annotations": on.clone()}),
        )
        .await;
        created += 1;
        if !injected_by_default(&p) {
            uninjected.push(p.name_any());
        }
        let tls = secrets.get("spur-webhook-tls").await.unwrap();
        let leaf = text(&tls, "tls.crt");
        serving.insert(
            CertificateDer::from_pem_slice(leaf.as_bytes())
                .unwrap()
                .to_vec(),
        );
        let ca = secrets.get("spur-ca").await.unwrap();
        cas.insert(spur_serving::pki::fingerprint(&text(&ca, "ca.crt")));
        let mwc = mwcs.get(WEBHOOK_CONFIGURATION).await.unwrap();
        let bundle = mwc.webhooks.unwrap()[0]
            .client_config
            .ca_bundle
            .clone()
            .unwrap()
            .0;
        bundle_sizes
            .insert(spur_serving::pki::split_bundle(std::str::from_utf8(&bundle).unwrap()).len());
        if created % 10 == 0 {
            // What the server presents verifies against what the API server trusts.
            served.insert(served_certificate(addr, &bundle).await);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        uninjected.is_empty(),
        "{} of {created} pods not injected: {uninjected:?}",
        uninjected.len()
    );
    assert!(
        serving.len() >= 4,
        "serving certificates seen: {}",
        serving.len()
    );
    assert!(cas.len() >= 2, "the CA was not rotated: {cas:?}");
    assert!(
        bundle_sizes.contains(&2),
        "the bundle never held two CAs: {bundle_sizes:?}"
    );
    // The server swapped certificates in place: several served over its one lifetime, each one
    // a certificate the manager issued.
    assert!(served.len() >= 2, "served {} certificates", served.len());
    assert!(served.is_subset(&serving));
    assert_eq!(
        setup.metric("spur_operator_webhook_tls_handshake_errors_total"),
        0.0
    );
    assert_eq!(
        setup.metric("spur_operator_webhook_admissions_total{result=\"error\"}"),
        0.0
    );
    assert_eq!(
        setup.metric("spur_operator_webhook_admissions_total{result=\"injected\"}"),
        f64::from(created)
    );
    let issued = setup.metric("spur_operator_certificates_issued_total{certificate=\"serving\"}");
    assert!(issued >= 4.0, "{issued}");
    // The CA's and the serving certificate's keys, as stored, never reach a log line.
    let ca = secrets.get("spur-ca").await.unwrap();
    let tls = secrets.get("spur-webhook-tls").await.unwrap();
    let body = |pem: &str| -> String {
        pem.lines()
            .filter(|l| !l.starts_with("-----") && l.len() >= 16)
            .collect::<Vec<_>>()
            .join("\n")
    };
    let keys = [body(&text(&ca, "ca.key")), body(&text(&tls, "tls.key"))];
    let key_lines: Vec<&str> = keys.iter().flat_map(|k| k.lines()).collect();
    setup.shutdown().await;
    spur_e2e::kube::assert_no_secret_logged(&key_lines);
}

// === EnvoyConfig validation ===

const HCM: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

/// A proxyless gRPC client's listener: its connection manager (an `Any`) takes routes over RDS
/// and ends in the router filter (another `Any`).
fn api_listener(filter_config: Value) -> Value {
    json!({
        "name": "echo.default.svc:8080",
        "api_listener": {"api_listener": {
            "@type": HCM,
            "stat_prefix": "echo",
            "rds": {"route_config_name": "echo", "config_source": {"ads": {}, "resource_api_version": "V3"}},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": filter_config}]
        }}
    })
}

fn router() -> Value {
    json!({"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"})
}

/// EnvoyConfig `name` for node id `<name>-client` (one config per node id in a namespace).
fn envoy_config(name: &str, serialization: Serialization, values: &[String]) -> EnvoyConfig {
    let types = [EnvoyResourceType::Cluster, EnvoyResourceType::Listener];
    EnvoyConfig::new(
        name,
        EnvoyConfigSpec {
            node_id: format!("{name}-client"),
            serialization,
            resources: values
                .iter()
                .enumerate()
                .map(|(i, v)| EnvoyResource {
                    type_: types[i.min(1)],
                    value: v.clone(),
                    generate_from_tls_secret: None,
                    blueprint: None,
                })
                .collect(),
        },
    )
}

/// The API server's refusal of `r`: its code and message.
fn refusal<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> (u16, String) {
    match r {
        Err(kube::Error::Api(s)) => (s.code, s.message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_refuses_envoyconfigs_that_do_not_decode() {
    let setup = Setup::start(|_| {}).await;
    let client = setup.client();
    spur_e2e::kube::ensure_namespace(&client, "xds")
        .await
        .unwrap();
    let configs: Api<EnvoyConfig> = Api::namespaced(client.clone(), "xds");
    let cluster =
        json!({"name": "echo", "type": "EDS", "eds_cluster_config": {"eds_config": {"ads": {}}}})
            .to_string();
    let good = api_listener(router()).to_string();

    // Refused, each with the resource's index, the field path and what is wrong there.
    let mut bogus = router();
    bogus["bogus_field"] = json!(true);
    let cases = [
        (
            "syntax",
            vec![cluster.clone(), r#"{"name": "echo", "api_listener": {"#.to_string()],
            "spec.resources[1].value: EOF while parsing an object at line 1 column",
        ),
        (
            "unknown-field",
            vec![cluster.clone(), api_listener(bogus).to_string()],
            "spec.resources[1].value: api_listener.api_listener.http_filters[0].typed_config.bogus_field: unrecognized field name 'bogus_field'",
        ),
        (
            "unknown-type",
            vec![
                cluster.clone(),
                api_listener(json!({"@type": "type.googleapis.com/envoy.extensions.filters.http.nope.v3.Nope"}))
                    .to_string(),
            ],
            "spec.resources[1].value: api_listener.api_listener.http_filters[0].typed_config.@type: message 'envoy.extensions.filters.http.nope.v3.Nope' not found",
        ),
        (
            "wrong-type",
            vec![json!({"name": "echo", "connect_timeout": 5}).to_string()],
            "spec.resources[0].value: connect_timeout: ",
        ),
        // A data source that reads the Envoy's own pod: its service account token as a
        // direct response anyone may fetch.
        (
            "local-file",
            vec![
                cluster.clone(),
                json!({
                    "name": "leak",
                    "api_listener": {"api_listener": {
                        "@type": HCM,
                        "stat_prefix": "leak",
                        "route_config": {"name": "r", "virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": ""}, "direct_response": {
                                "status": 200,
                                "body": {"filename": "/var/run/secrets/kubernetes.io/serviceaccount/token"}}}]
                        }]},
                        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": router()}]
                    }}
                })
                .to_string(),
            ],
            "spec.resources[1].value: api_listener.api_listener.route_config.virtual_hosts[0].routes[0].direct_response.body.filename: a data source may not read a file of the Envoy's own pod",
        ),
    ];
    for (name, values, want) in cases {
        let ec = envoy_config(name, Serialization::Json, &values);
        let (code, message) = refusal(configs.create(&PostParams::default(), &ec).await);
        assert_eq!(code, 422, "{name}: {message}");
        assert!(
            message.contains("admission webhook \"envoyconfig.spur.dev\" denied the request")
                && message.contains(want),
            "{name}: {message}"
        );
        assert!(configs.get_opt(name).await.unwrap().is_none(), "{name}");
    }

    // A secret is never written inline (its key would be readable by whoever reads
    // EnvoyConfigs): it names a Secret, which is served over SDS.
    let mut inline = envoy_config(
        "inline-secret",
        Serialization::Json,
        std::slice::from_ref(&cluster),
    );
    inline.spec.resources.push(EnvoyResource {
        type_: EnvoyResourceType::Secret,
        value: json!({"name": "tls", "tls_certificate": {"private_key": {"inline_string": "KEY"}}})
            .to_string(),
        generate_from_tls_secret: None,
        blueprint: None,
    });
    let (code, message) = refusal(configs.create(&PostParams::default(), &inline).await);
    assert_eq!(code, 422, "{message}");
    assert!(
        message.contains("spec.resources[1].value: a secret is not written inline")
            && !message.contains("KEY"),
        "{message}"
    );
    let mut by_ref = envoy_config(
        "secret-ref",
        Serialization::Json,
        std::slice::from_ref(&cluster),
    );
    by_ref.spec.resources.push(EnvoyResource {
        type_: EnvoyResourceType::Secret,
        value: String::new(),
        generate_from_tls_secret: Some("edge-cert".into()),
        blueprint: None,
    });
    configs
        .create(&PostParams::default(), &by_ref)
        .await
        .unwrap();

    // Valid, in JSON and in YAML.
    let json_ec = envoy_config(
        "json",
        Serialization::Json,
        &[cluster.clone(), good.clone()],
    );
    let created = configs
        .create(&PostParams::default(), &json_ec)
        .await
        .unwrap();
    // A second config for the same node id in the namespace would take the node over (the
    // latest published is served): refused, naming the config that has it. Another
    // namespace may use the node id: the route server keeps namespaces apart.
    let mut twin = envoy_config("twin", Serialization::Json, std::slice::from_ref(&cluster));
    twin.spec.node_id = json_ec.spec.node_id.clone();
    let (code, message) = refusal(configs.create(&PostParams::default(), &twin).await);
    assert_eq!(code, 422, "{message}");
    assert!(
        message.contains(
            "spec.nodeID: node id \"json-client\" is already used by EnvoyConfig xds/json"
        ),
        "{message}"
    );
    spur_e2e::kube::ensure_namespace(&client, "xds-b")
        .await
        .unwrap();
    Api::<EnvoyConfig>::namespaced(client.clone(), "xds-b")
        .create(&PostParams::default(), &twin)
        .await
        .unwrap();
    // Nor may an existing config move onto a node id in use, even one older than the config
    // that has it.
    let (code, message) = refusal(
        configs
            .patch(
                "secret-ref",
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"nodeID": "json-client"}})),
            )
            .await,
    );
    assert_eq!(code, 422, "{message}");
    assert!(message.contains("EnvoyConfig xds/json"), "{message}");
    let yaml =
        |v: &str| serde_yaml_ng::to_string(&serde_json::from_str::<Value>(v).unwrap()).unwrap();
    let yaml_ec = envoy_config("yaml", Serialization::Yaml, &[yaml(&cluster), yaml(&good)]);
    configs
        .create(&PostParams::default(), &yaml_ec)
        .await
        .unwrap();
    // YAML is checked the same way, paths and all.
    let mut bogus = router();
    bogus["bogus_field"] = json!(true);
    let bad_yaml = envoy_config(
        "yaml-bad",
        Serialization::Yaml,
        &[yaml(&cluster), yaml(&api_listener(bogus).to_string())],
    );
    let (code, message) = refusal(configs.create(&PostParams::default(), &bad_yaml).await);
    assert_eq!(code, 422);
    assert!(
        message.contains(
            "spec.resources[1].value: api_listener.api_listener.http_filters[0].typed_config.bogus_field"
        ),
        "{message}"
    );

    // An update that breaks it (the listener's own stat_prefix, as a number) is refused, and
    // what is stored stays as it was.
    let mut broken = good.clone();
    broken.insert_str(1, r#""stat_prefix": 7, "#);
    let patch = json!({"spec": {"resources": [
        {"type": "cluster", "value": cluster},
        {"type": "listener", "value": broken},
    ]}});
    let (code, message) = refusal(
        configs
            .patch("json", &PatchParams::default(), &Patch::Merge(&patch))
            .await,
    );
    assert_eq!(code, 422);
    assert!(
        message.contains(
            "spec.resources[1].value: stat_prefix: invalid type: integer `7`, expected a string"
        ),
        "{message}"
    );
    let stored = configs.get("json").await.unwrap();
    assert_eq!(stored.spec, created.spec);
    // A change that leaves the spec alone (a label, as a controller's finalizer would) is
    // allowed without decoding the spec again.
    let before =
        setup.metric("spur_operator_webhook_envoyconfig_admissions_total{result=\"allowed\"}");
    configs
        .patch(
            "json",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": {"team": "a"}}})),
        )
        .await
        .unwrap();
    // A valid change is allowed.
    let mut renamed: Value = serde_json::from_str(&good).unwrap();
    renamed["api_listener"]["api_listener"]["stat_prefix"] = json!("echo2");
    let patch = json!({"spec": {"resources": [
        {"type": "cluster", "value": cluster},
        {"type": "listener", "value": renamed.to_string()},
    ]}});
    configs
        .patch("json", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    assert!(
        setup.metric("spur_operator_webhook_envoyconfig_admissions_total{result=\"allowed\"}")
            >= before + 2.0
    );
    // At least the ten refusals above (each checked by its message): the API server calls a
    // webhook again when a connection drops before the answer came, which a loaded machine
    // sees now and then.
    assert!(
        setup.metric("spur_operator_webhook_envoyconfig_admissions_total{result=\"denied\"}")
            >= 10.0
    );
    assert_eq!(
        setup.metric("spur_operator_webhook_envoyconfig_admissions_total{result=\"error\"}"),
        0.0
    );
    // Deleting never asks.
    configs
        .delete("yaml", &DeleteParams::default())
        .await
        .unwrap();
    setup.shutdown().await;
}

// === ListenerSet validation ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_refuses_invalid_listenersets_naming_the_field() {
    let setup = Setup::start(|_| {}).await;
    let client = setup.client();
    spur_e2e::kube::ensure_namespace(&client, "l4")
        .await
        .unwrap();
    let sets: Api<ListenerSet> = Api::namespaced(client.clone(), "l4");
    let good = || {
        json!({
            "selector": {"matchLabels": {"app": "gw"}},
            "listeners": [
                {"name": "dns", "protocol": "udp", "port": 53, "cluster": {"name": "dns",
                    "endpoints": [{"selector": {"matchLabels": {"app": "dns"}}, "port": 5353}]}},
                {"name": "dns-tcp", "protocol": "tcp", "port": 53, "cluster": {"name": "dns-tcp",
                    "endpoints": [{"address": "10.0.0.53", "port": 53}]}},
            ],
        })
    };
    let create = |name: &str, spec: Value| {
        let sets = sets.clone();
        let body: ListenerSet = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ListenerSet",
            "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap();
        async move { sets.create(&PostParams::default(), &body).await }
    };

    let mut dup_port = good();
    dup_port["listeners"][1]["protocol"] = json!("udp");
    let mut clash = good();
    clash["listeners"][1]["cluster"]["name"] = json!("dns");
    let mut bad_selector = good();
    bad_selector["listeners"][0]["cluster"]["endpoints"][0]["selector"] =
        json!({"matchExpressions": [{"key": "app", "operator": "Exists"}]});
    let mut bad_label = good();
    bad_label["selector"]["matchLabels"] = json!({"app": "gw!"});
    let cases = [
        (
            "dup-port",
            dup_port,
            vec![
                "spec.listeners[1].port: udp port 53 is already taken by spec.listeners[0] (\"dns\")",
            ],
        ),
        (
            "clash",
            clash,
            vec![
                "spec.listeners[1].cluster.name: cluster name \"dns\" is already used by spec.listeners[0].cluster",
            ],
        ),
        (
            "bad-selector",
            bad_selector,
            vec![
                "spec.listeners[0].cluster.endpoints[0].selector.matchExpressions: must be empty",
                "spec.listeners[0].cluster.endpoints[0].selector.matchLabels: must not be empty",
            ],
        ),
        (
            "bad-label",
            bad_label,
            vec!["spec.selector.matchLabels[app]: the value must be a label value"],
        ),
    ];
    for (name, spec, wants) in cases {
        let (code, message) = refusal(create(name, spec).await);
        assert_eq!(code, 422, "{name}: {message}");
        assert!(
            message.contains("admission webhook \"listenerset.spur.dev\" denied the request"),
            "{name}: {message}"
        );
        for want in wants {
            assert!(message.contains(want), "{name}: {message}");
        }
        assert!(sets.get_opt(name).await.unwrap().is_none(), "{name}");
    }

    // Valid: created; an update that breaks it is refused and leaves it as it was; a change
    // that leaves the spec alone is allowed.
    let created = create("dns", good()).await.unwrap();
    let patch = json!({"spec": {"listeners": [
        {"name": "dns", "protocol": "udp", "port": 53, "cluster": {"name": "dns",
            "endpoints": [{"address": "10.0.0.53", "dnsName": "dns.example.com", "port": 53}]}},
    ]}});
    let (code, message) = refusal(
        sets.patch("dns", &PatchParams::default(), &Patch::Merge(&patch))
            .await,
    );
    assert_eq!(code, 422, "{message}");
    assert!(
        message.contains("spec.listeners[0].cluster.endpoints[0]: set exactly one of selector, address and dnsName"),
        "{message}"
    );
    assert_eq!(sets.get("dns").await.unwrap().spec, created.spec);
    sets.patch(
        "dns",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"labels": {"team": "a"}}})),
    )
    .await
    .unwrap();
    // At least the five refusals above (the API server may call again after a dropped
    // connection); none answered as unreadable.
    assert!(
        setup.metric("spur_operator_webhook_listenerset_admissions_total{result=\"denied\"}")
            >= 5.0
    );
    assert!(
        setup.metric("spur_operator_webhook_listenerset_admissions_total{result=\"allowed\"}")
            >= 2.0
    );
    assert_eq!(
        setup.metric("spur_operator_webhook_listenerset_admissions_total{result=\"invalid\"}"),
        0.0
    );
    setup.shutdown().await;
}
