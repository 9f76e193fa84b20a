//! Just-in-time access on a real kube-apiserver (RBAC enforced): the chart's webhook stamps the
//! requester, the chart's admission policies guard identity and the operator's Role writes, and
//! the operator (under the chart's RBAC with `access.enabled`) grants, refuses and expires
//! requests. Users are ServiceAccount tokens; whether one may exec into a pod is asked of the
//! API server's own authorizer (SelfSubjectAccessReview as that user), which is the decision
//! `kubectl exec` gets. There is no kubelet: the test creates the target pods and sets their
//! status as the kubelet would. (The node tier execs for real.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use spur_api::access::conditions as cond;
use spur_api::conditions::{READY, find_condition};
use spur_api::{
    ExecAccessRequest, ExecAccessTemplate, PodAccessRequest, PodAccessTemplate,
    TunnelAccessRequest, TunnelAccessTemplate,
};
use spur_e2e::kube::{
    SYSTEM_NAMESPACE, WAIT, chart_document, ensure_namespace, eventually, grant_cluster,
    install_crds, operator_client,
};
use spur_kube_harness::KubeApi;
use spur_operator::{PkiConfig, Webhook, WebhookConfig};
use tokio_util::sync::CancellationToken;

#[path = "kube_access/approval.rs"]
mod approval;
#[path = "kube_access/sweeper.rs"]
mod sweeper;
#[path = "kube_access/tunnel_scope.rs"]
mod tunnel_scope;

const NS: &str = "shop";
/// The namespace of the users' ServiceAccounts: its group is the one templates allow.
const DEVS: &str = "devs";
const DEVS_GROUP: &str = "system:serviceaccounts:devs";
/// The tunnel proxy's token namespace (the chart's default).
const TOKEN_NS: &str = "spur-workstation-tokens";

struct Setup {
    api: KubeApi,
    stop: CancellationToken,
    operator: Option<tokio::task::JoinHandle<()>>,
    webhook: Option<Webhook>,
    operator_client: Client,
    registry: Arc<Registry>,
}

impl Setup {
    async fn start() -> Setup {
        spur_e2e::kube::capture_logs();
        let api = KubeApi::start().await.unwrap();
        install_crds(&api).await.unwrap();
        let client = operator_client(&api).await.unwrap();
        grant_cluster(&api, "spur-operator", "operator-access-rules.yaml")
            .await
            .unwrap();
        spur_e2e::kube::grant_in_namespace(
            &api,
            "spur-operator",
            TOKEN_NS,
            "operator-access-token-rules.yaml",
        )
        .await
        .unwrap();
        let mut registry = Registry::with_prefix("spur_operator");
        let metrics = spur_operator::Metrics::register(&mut registry);
        let stop = CancellationToken::new();
        let mut injection = spur_operator::InjectionConfig {
            sidecar_image: "spur:test".into(),
            init_image: "spur:test".into(),
            routeserver: "spur-routeserver.spur-system.svc:7777".into(),
            ..Default::default()
        };
        injection.system_namespaces.push(SYSTEM_NAMESPACE.into());
        let webhook = Webhook::start(
            client.clone(),
            WebhookConfig {
                addr: "127.0.0.1:0".parse().unwrap(),
                namespace: SYSTEM_NAMESPACE.into(),
                serving_secret: "spur-webhook-tls".into(),
                injection,
            },
            metrics.clone(),
            stop.child_token(),
        )
        .await
        .unwrap();
        // The chart's access webhook alone (the pod injector is kube_webhook's), with a URL.
        let mut mwc: MutatingWebhookConfiguration = serde_yaml_ng::from_str(&chart_document(
            "templates/operator.yaml",
            "kind: MutatingWebhookConfiguration",
        ))
        .unwrap();
        let hooks = mwc.webhooks.as_mut().unwrap();
        hooks.retain(|w| w.name == "accessrequest.spur.dev");
        assert_eq!(hooks.len(), 1, "the chart has the access webhook");
        assert_eq!(hooks[0].failure_policy.as_deref(), Some("Fail"));
        let path = hooks[0]
            .client_config
            .service
            .as_ref()
            .unwrap()
            .path
            .clone();
        assert_eq!(
            path.as_deref(),
            Some(spur_operator::MUTATE_ACCESS_REQUEST_PATH)
        );
        hooks[0].client_config = serde_json::from_value(json!({"url": format!(
            "https://127.0.0.1:{}{}",
            webhook.local_addr().port(),
            spur_operator::MUTATE_ACCESS_REQUEST_PATH
        )}))
        .unwrap();
        Api::<MutatingWebhookConfiguration>::all(api.client())
            .create(&PostParams::default(), &mwc)
            .await
            .unwrap();
        // The chart's exec audit webhook alone, likewise.
        let mut vwc: ValidatingWebhookConfiguration = serde_yaml_ng::from_str(&chart_document(
            "templates/admission.yaml",
            "kind: ValidatingWebhookConfiguration",
        ))
        .unwrap();
        let hooks = vwc.webhooks.as_mut().unwrap();
        hooks.retain(|w| w.name == "connect-audit.spur.dev");
        assert_eq!(hooks.len(), 1, "the chart has the audit webhook");
        hooks[0].client_config = serde_json::from_value(json!({"url": format!(
            "https://127.0.0.1:{}{}",
            webhook.local_addr().port(),
            spur_operator::VALIDATE_POD_CONNECT_PATH
        )}))
        .unwrap();
        Api::<ValidatingWebhookConfiguration>::all(api.client())
            .create(&PostParams::default(), &vwc)
            .await
            .unwrap();
        install_policies(&api).await;

        let mut pki = PkiConfig::new(SYSTEM_NAMESPACE, "spur-webhook");
        pki.serving_names.push("127.0.0.1".into());
        pki.validate().unwrap();
        let ctx = Arc::new(
            spur_operator::Context::new(client.clone(), Some("test".into()), metrics)
                .with_pki(pki)
                .with_access()
                .with_access_tokens(TOKEN_NS),
        );
        let operator = spawn_operator(client.clone(), ctx, stop.clone());
        let setup = Setup {
            api,
            stop,
            operator: Some(operator),
            webhook: Some(webhook),
            operator_client: client,
            registry: Arc::new(registry),
        };
        let mwcs: Api<MutatingWebhookConfiguration> = Api::all(setup.api.client());
        let vwcs: Api<ValidatingWebhookConfiguration> = Api::all(setup.api.client());
        let ready = setup.webhook.as_ref().unwrap().readiness();
        eventually("the webhooks' caBundles and certificate", || {
            let (mwcs, vwcs) = (mwcs.clone(), vwcs.clone());
            let ready = ready();
            async move {
                let m = mwcs.get("spur-sidecar-injector").await.ok()?;
                let v = vwcs.get("spur-envoyconfig-validator").await.ok()?;
                (m.webhooks?.first()?.client_config.ca_bundle.is_some()
                    && v.webhooks?.first()?.client_config.ca_bundle.is_some()
                    && ready)
                    .then_some(())
            }
        })
        .await;
        setup.users().await;
        setup.policies_enforced().await;
        setup
    }

    /// Waits until the API server enforces the access policies: it loads a new policy through
    /// an informer a moment after the create, and a test that attacks one must not race that.
    /// The probe is a request filed already approved, which `spur-access-requests` refuses.
    async fn policies_enforced(&self) {
        let requests: Api<ExecAccessRequest> = Api::namespaced(self.api.client(), NS);
        eventually("the access admission policies enforced", || {
            let requests = requests.clone();
            async move {
                let mut probe = exec_request("policy-probe", "policy-probe", None);
                probe.metadata.annotations = Some(
                    spur_api::access::Approver {
                        username: "policy-probe".into(),
                        groups: vec![],
                    }
                    .annotations(),
                );
                match requests.create(&PostParams::default(), &probe).await {
                    Err(e) if e.to_string().contains("cannot be filed approved") => Some(()),
                    Ok(_) => {
                        let _ = requests
                            .delete("policy-probe", &DeleteParams::default())
                            .await;
                        None
                    }
                    Err(_) => None,
                }
            }
        })
        .await;
    }

    /// ServiceAccounts alice and bob (group `system:serviceaccounts:devs`) and carol (another
    /// namespace), each bound to the chart's spur-access-requester rules in [`NS`].
    async fn users(&self) {
        let admin = self.api.client();
        ensure_namespace(&admin, NS).await.unwrap();
        ensure_namespace(&admin, DEVS).await.unwrap();
        ensure_namespace(&admin, "others").await.unwrap();
        let rules: Value = serde_yaml_ng::from_str(
            &std::fs::read_to_string(spur_e2e::kube::chart_path(
                "files/access-requester-rules.yaml",
            ))
            .unwrap(),
        )
        .unwrap();
        let role: Role = serde_json::from_value(json!({
            "metadata": {"name": "spur-access-requester", "namespace": NS},
            "rules": rules,
        }))
        .unwrap();
        Api::<Role>::namespaced(admin.clone(), NS)
            .create(&PostParams::default(), &role)
            .await
            .unwrap();
        let mut subjects = Vec::new();
        for (ns, name) in [(DEVS, "alice"), (DEVS, "bob"), ("others", "carol")] {
            let sa: ServiceAccount =
                serde_json::from_value(json!({"metadata": {"name": name, "namespace": ns}}))
                    .unwrap();
            Api::<ServiceAccount>::namespaced(admin.clone(), ns)
                .create(&PostParams::default(), &sa)
                .await
                .unwrap();
            subjects.push(json!({"kind": "ServiceAccount", "name": name, "namespace": ns}));
        }
        let binding: RoleBinding = serde_json::from_value(json!({
            "metadata": {"name": "requesters", "namespace": NS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "spur-access-requester"},
            "subjects": subjects,
        }))
        .unwrap();
        Api::<RoleBinding>::namespaced(admin, NS)
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }

    async fn user(&self, ns: &str, name: &str) -> Client {
        let token = self.api.service_account_token(ns, name).await.unwrap();
        self.api.client_with_token(&token).await.unwrap()
    }

    fn metric(&self, series: &str) -> f64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        spur_e2e::sample(&text, series)
    }

    async fn stop_operator(&mut self) {
        self.stop.cancel();
        if let Some(o) = self.operator.take() {
            tokio::time::timeout(WAIT, o).await.unwrap().unwrap();
        }
    }

    async fn shutdown(mut self) {
        self.stop_operator().await;
        if let Some(w) = self.webhook.take() {
            tokio::time::timeout(WAIT, w.stopped()).await.unwrap();
        }
    }
}

fn spawn_operator(
    client: Client,
    ctx: Arc<spur_operator::Context>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let election = spur_operator::LeaderElection {
        namespace: SYSTEM_NAMESPACE.into(),
        lease: "spur-operator".into(),
        identity: format!("test-{}", std::process::id()),
        duration_secs: 15,
        grace_secs: 5,
        owner: None,
    };
    tokio::spawn(async move {
        spur_operator::run_elected(client, ctx, stop, election)
            .await
            .unwrap();
    })
}

/// The chart's admission policies of `templates/access.yaml`, with their bindings.
/// `spur-access-requests` comes last: the API server loads policies and bindings through
/// informers that deliver them in the order they were written, so once that one is enforced
/// ([`Setup::policies_enforced`] probes it) the others are loaded too.
async fn install_policies(api: &KubeApi) {
    for name in [
        "spur-operator-access-roles",
        "spur-access-templates",
        "spur-access-sweeper",
        "spur-access-requests",
    ] {
        let policy: ValidatingAdmissionPolicy = serde_yaml_ng::from_str(&chart_document(
            "templates/access.yaml",
            &format!("kind: ValidatingAdmissionPolicy\nmetadata:\n  name: {name}\n"),
        ))
        .unwrap();
        Api::<ValidatingAdmissionPolicy>::all(api.client())
            .create(&PostParams::default(), &policy)
            .await
            .unwrap();
        let binding: ValidatingAdmissionPolicyBinding = serde_yaml_ng::from_str(&chart_document(
            "templates/access.yaml",
            &format!("kind: ValidatingAdmissionPolicyBinding\nmetadata:\n  name: {name}\n"),
        ))
        .unwrap();
        Api::<ValidatingAdmissionPolicyBinding>::all(api.client())
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }
}

/// Deployment `name` (selector app=<name>), its ReplicaSet and pod `<name>-1` (owned as the
/// controllers would own them), running and ready as a kubelet would report it; plus a fork
/// pod and a pod of another ReplicaSet carrying the same labels, which no grant on `name` may
/// pick.
async fn workload(client: &Client, name: &str) {
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}, "annotations": {"team": "shop"}},
                "spec": {"containers": [{
                    "name": "app", "image": "spur:test", "command": ["spur", "demo", "serve"],
                    "args": ["--port", "8080"],
                    "readinessProbe": {"tcpSocket": {"port": 8080}},
                    "livenessProbe": {"tcpSocket": {"port": 8080}},
                }]}
            }
        }
    }))
    .unwrap();
    let d = Api::<Deployment>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let rs = replicaset(client, &format!("{name}-6d9c"), name, Some(&d)).await;
    let stray = replicaset(client, &format!("{name}-stray"), name, None).await;
    // Sorted by name, each of these comes before the workload's own pod.
    running_pod(
        client,
        &format!("{name}-0-fork"),
        json!({"app": name, "spur.dev/fork": "x"}),
        &rs,
    )
    .await;
    running_pod(
        client,
        &format!("{name}-0-stray"),
        json!({"app": name}),
        &stray,
    )
    .await;
    running_pod(client, &format!("{name}-1"), json!({"app": name}), &rs).await;
}

/// A ReplicaSet selecting app=<app>, owned by `owner` as the Deployment controller would.
async fn replicaset(
    client: &Client,
    name: &str,
    app: &str,
    owner: Option<&Deployment>,
) -> k8s_openapi::api::apps::v1::ReplicaSet {
    use kube::Resource;
    let mut rs: k8s_openapi::api::apps::v1::ReplicaSet = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "template": {"metadata": {"labels": {"app": app}},
                         "spec": {"containers": [{"name": "app", "image": "spur:test"}]}}
        }
    }))
    .unwrap();
    if let Some(d) = owner {
        rs.metadata.owner_references = Some(vec![d.controller_owner_ref(&()).unwrap()]);
    }
    Api::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &rs)
        .await
        .unwrap()
}

async fn running_pod(
    client: &Client,
    name: &str,
    labels: Value,
    owner: &k8s_openapi::api::apps::v1::ReplicaSet,
) {
    use kube::Resource;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS, "labels": labels,
                     "ownerReferences": [owner.controller_owner_ref(&()).unwrap()]},
        "spec": {"containers": [{"name": "app", "image": "spur:test"}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    mark_running(client, name).await;
}

async fn mark_running(client: &Client, name: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True"}
        ]}})),
    )
    .await
    .unwrap();
}

/// Whether `user` may exec into `pod` of [`NS`], as the API server's authorizer answers.
async fn may_exec(user: &Client, pod: &str) -> bool {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(NS.into()),
                verb: Some("create".into()),
                resource: Some("pods".into()),
                subresource: Some("exec".into()),
                name: Some(pod.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<SelfSubjectAccessReview>::all(user.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap()
        .status
        .unwrap()
        .allowed
}

fn exec_template(name: &str, target: &str, max: &str) -> ExecAccessTemplate {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "ExecAccessTemplate",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "accessConfig": {"allowedGroups": [DEVS_GROUP], "defaultDuration": max, "maxDuration": max},
            "targetRef": {"kind": "Deployment", "name": target},
        }
    }))
    .unwrap()
}

fn exec_request(name: &str, template: &str, duration: Option<&str>) -> ExecAccessRequest {
    let mut spec = json!({"templateName": template});
    if let Some(d) = duration {
        spec["duration"] = json!(d);
    }
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "ExecAccessRequest",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }))
    .unwrap()
}

fn reason_of(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    type_: &str,
) -> Option<String> {
    find_condition(conditions, type_).map(|c| format!("{}/{}", c.status, c.reason))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_grants_are_for_the_requester_alone_and_end_on_time() {
    let setup = Setup::start().await;
    let admin = setup.api.client();
    workload(&admin, "web").await;
    let templates: Api<ExecAccessTemplate> = Api::namespaced(admin.clone(), NS);
    // A grant of at most 6 s: the request below asks for an hour.
    templates
        .create(
            &PostParams::default(),
            &exec_template("web-exec", "web", "6s"),
        )
        .await
        .unwrap();
    eventually("the template is ready", || {
        let templates = templates.clone();
        async move {
            templates
                .get("web-exec")
                .await
                .ok()?
                .status?
                .ready
                .then_some(())
        }
    })
    .await;

    let alice = setup.user(DEVS, "alice").await;
    let bob = setup.user(DEVS, "bob").await;
    assert!(!may_exec(&alice, "web-1").await, "no standing exec rights");

    // Alice files the request, claiming to be bob: the webhook writes who she is.
    let mut request = exec_request("alice-web", "web-exec", Some("1h"));
    request.spec.requester = Some(spur_api::access::Requester {
        username: "system:serviceaccount:devs:bob".into(),
        uid: None,
        groups: vec![DEVS_GROUP.into()],
    });
    let alice_requests: Api<ExecAccessRequest> = Api::namespaced(alice.clone(), NS);
    let created = alice_requests
        .create(&PostParams::default(), &request)
        .await
        .unwrap();
    let requester = created.spec.requester.clone().unwrap();
    assert_eq!(requester.username, "system:serviceaccount:devs:alice");
    assert!(requester.groups.contains(&DEVS_GROUP.to_string()));

    let requests: Api<ExecAccessRequest> = Api::namespaced(admin.clone(), NS);
    let ready = eventually("alice's request is ready", || {
        let requests = requests.clone();
        async move {
            let r = requests.get("alice-web").await.ok()?;
            r.status.as_ref()?.ready.then_some(r)
        }
    })
    .await;
    let status = ready.status.clone().unwrap();
    // The baseline's pod, not the fork's that sorts first.
    assert_eq!(status.pod_name.as_deref(), Some("web-1"));
    assert_eq!(
        status.duration.as_deref(),
        Some("6s"),
        "capped at the maximum"
    );
    assert_eq!(
        reason_of(&status.conditions, cond::ACCESS_DURATIONS_VALID).as_deref(),
        Some("True/Capped")
    );
    assert_eq!(
        status.access_message.as_deref(),
        Some("kubectl exec -ti -n shop web-1 -c app -- /bin/sh")
    );
    let expires = status.expires_at.clone().unwrap().0;
    let created_at = ready.metadata.creation_timestamp.clone().unwrap().0;
    assert_eq!(expires.duration_since(created_at).as_secs(), 6);

    assert!(
        may_exec(&alice, "web-1").await,
        "alice may exec into her pod"
    );
    assert!(!may_exec(&alice, "web-0-fork").await, "and into no other");
    assert!(!may_exec(&alice, "web-0-stray").await);
    assert!(
        !may_exec(&bob, "web-1").await,
        "bob, in the same group, may not use her grant"
    );

    // Bob can neither change nor delete alice's request; nobody can change one.
    let bob_requests: Api<ExecAccessRequest> = Api::namespaced(bob.clone(), NS);
    let e = requests
        .patch(
            "alice-web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"duration": "2s"}})),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot be changed"), "even an admin: {e}");
    let e = bob_requests
        .delete("alice-web", &DeleteParams::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("may delete this request"), "{e}");

    // Until one second after expiry, at the latest, the grant is gone: the RoleBinding, the
    // Role and the request.
    let now = k8s_openapi::jiff::Timestamp::now();
    let left = Duration::try_from(expires.duration_since(now)).unwrap_or_default();
    tokio::time::sleep(left + Duration::from_secs(1)).await;
    assert!(!may_exec(&alice, "web-1").await, "no exec 1 s after expiry");
    eventually("the expired request is deleted", || {
        let requests = requests.clone();
        async move {
            requests
                .get_opt("alice-web")
                .await
                .ok()?
                .is_none()
                .then_some(())
        }
    })
    .await;
    let roles: Api<Role> = Api::namespaced(admin.clone(), NS);
    let labelled = format!("{}=alice-web", spur_api::access::labels::ACCESS_REQUEST);
    assert!(
        roles
            .list(&kube::api::ListParams::default().labels(&labelled))
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert!(
        setup.metric("spur_operator_access_grants_total{kind=\"exec\",event=\"granted\"}") >= 1.0
    );
    assert!(
        setup.metric("spur_operator_access_grants_total{kind=\"exec\",event=\"expired\"}") >= 1.0
    );

    // The requester may revoke early.
    let r = alice_requests
        .create(
            &PostParams::default(),
            &exec_request("again", "web-exec", None),
        )
        .await
        .unwrap();
    assert_eq!(r.spec.duration, None);
    eventually("the second request is ready", || {
        let requests = requests.clone();
        async move {
            requests
                .get("again")
                .await
                .ok()?
                .status?
                .ready
                .then_some(())
        }
    })
    .await;
    alice_requests
        .delete("again", &DeleteParams::default())
        .await
        .unwrap();
    eventually("revoked", || {
        let alice = alice.clone();
        async move { (!may_exec(&alice, "web-1").await).then_some(()) }
    })
    .await;

    // Deleting a template cuts the access it gave, long before the grant's end.
    templates
        .create(
            &PostParams::default(),
            &exec_template("web-hour", "web", "1h"),
        )
        .await
        .unwrap();
    alice_requests
        .create(
            &PostParams::default(),
            &exec_request("hour", "web-hour", None),
        )
        .await
        .unwrap();
    eventually("the hour-long request is ready", || {
        let requests = requests.clone();
        async move { requests.get("hour").await.ok()?.status?.ready.then_some(()) }
    })
    .await;
    assert!(may_exec(&alice, "web-1").await);
    templates
        .delete("web-hour", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the grant withdrawn with its template", || {
        let alice = alice.clone();
        async move { (!may_exec(&alice, "web-1").await).then_some(()) }
    })
    .await;
    // The pass withdraws the grant first and writes the status after it: wait for both.
    eventually("the request says its template is gone", || {
        let requests = requests.clone();
        async move {
            let r = requests.get("hour").await.ok()?.status?;
            (reason_of(&r.conditions, READY).as_deref() == Some("False/TemplateNotFound"))
                .then_some(())
        }
    })
    .await;
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_templates_and_requests_get_conditions_and_the_operator_is_fenced() {
    let setup = Setup::start().await;
    let admin = setup.api.client();
    workload(&admin, "web").await;
    let templates: Api<ExecAccessTemplate> = Api::namespaced(admin.clone(), NS);
    templates
        .create(
            &PostParams::default(),
            &exec_template("ghost", "no-such-deployment", "1h"),
        )
        .await
        .unwrap();
    templates
        .create(
            &PostParams::default(),
            &exec_template("web-exec", "web", "1h"),
        )
        .await
        .unwrap();
    let t = eventually("the ghost template's condition", || {
        let templates = templates.clone();
        async move {
            let t = templates.get("ghost").await.ok()?;
            let s = t.status.clone()?;
            find_condition(&s.conditions, cond::TARGET_REF_EXISTS)?;
            Some(s)
        }
    })
    .await;
    assert!(!t.ready);
    assert_eq!(
        reason_of(&t.conditions, cond::TARGET_REF_EXISTS).as_deref(),
        Some("False/NotFound")
    );
    // The schema refuses what it can: a default above the maximum.
    let mut bad = exec_template("bad", "web", "1h");
    bad.spec.access_config.default_duration = "2h".into();
    let e = templates
        .create(&PostParams::default(), &bad)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("defaultDuration must not exceed maxDuration"),
        "{e}"
    );

    let alice = setup.user(DEVS, "alice").await;
    let carol = setup.user("others", "carol").await;
    let requests: Api<ExecAccessRequest> = Api::namespaced(admin.clone(), NS);
    let condition = |name: &'static str, type_: &'static str| {
        let requests = requests.clone();
        async move {
            eventually(&format!("{name}: {type_}"), || {
                let requests = requests.clone();
                async move {
                    let s = requests.get(name).await.ok()?.status?;
                    reason_of(&s.conditions, type_)
                }
            })
            .await
        }
    };
    for (name, template) in [("missing", "no-such-template"), ("on-ghost", "ghost")] {
        Api::<ExecAccessRequest>::namespaced(alice.clone(), NS)
            .create(&PostParams::default(), &exec_request(name, template, None))
            .await
            .unwrap();
    }
    assert_eq!(
        condition("missing", cond::TARGET_TEMPLATE_EXISTS).await,
        "False/TemplateNotFound"
    );
    assert_eq!(
        condition("on-ghost", cond::TARGET_TEMPLATE_EXISTS).await,
        "False/TemplateNotReady"
    );
    // Carol may file requests (RBAC) but is in none of the template's groups.
    Api::<ExecAccessRequest>::namespaced(carol.clone(), NS)
        .create(
            &PostParams::default(),
            &exec_request("carol", "web-exec", None),
        )
        .await
        .unwrap();
    assert_eq!(
        condition("carol", cond::REQUESTER_ALLOWED).await,
        "False/NotInAllowedGroups"
    );
    assert!(!may_exec(&carol, "web-1").await);
    // The template appearing later grants the waiting request.
    templates
        .create(
            &PostParams::default(),
            &exec_template("no-such-template", "web", "1h"),
        )
        .await
        .unwrap();
    eventually("the request waiting for its template is ready", || {
        let requests = requests.clone();
        async move {
            requests
                .get("missing")
                .await
                .ok()?
                .status?
                .ready
                .then_some(())
        }
    })
    .await;
    // Every exec, attach and port-forward is recorded: alice's exec under her grant, and an
    // admin's attach and port-forward. (No kubelet here: the API server admits the connection,
    // then fails to reach a node; admission is all the audit needs.)
    let connect = |client: Client, query: &'static str| async move {
        let req = http::Request::post(format!("/api/v1/namespaces/{NS}/pods/web-1/{query}"))
            .body(Vec::new())
            .unwrap();
        let _ = client.request_text(req).await;
    };
    connect(
        alice.clone(),
        "exec?container=app&command=cat&command=%2Fetc%2Fos-release&stdout=true",
    )
    .await;
    connect(
        admin.clone(),
        "attach?container=app&stdin=true&tty=true&stdout=true",
    )
    .await;
    connect(admin.clone(), "portforward?ports=8080").await;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(admin.clone(), NS);
    let notes = eventually("three audit events on web-1", || {
        let events = events.clone();
        async move {
            let notes: Vec<String> = events
                .list(&Default::default())
                .await
                .ok()?
                .items
                .into_iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("web-1"))
                .map(|e| {
                    format!(
                        "{} {}",
                        e.reason.unwrap_or_default(),
                        e.note.unwrap_or_default()
                    )
                })
                .collect();
            (notes.len() >= 3).then_some(notes)
        }
    })
    .await;
    let alice_name = "system:serviceaccount:devs:alice";
    assert!(
        notes.contains(&format!(
            "Exec exec by {alice_name} into container app: cat /etc/os-release (tty: false)"
        )),
        "{notes:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("Attach attach by ") && n.contains("tty: true")),
        "{notes:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("PortForward ") && n.contains("[8080]")),
        "{notes:?}"
    );
    let lines = spur_e2e::kube::logged_lines("spur_audit");
    assert!(
        lines.iter().any(|l| l.contains(alice_name)
            && l.contains("/etc/os-release")
            && l.contains("pod=web-1")),
        "{lines:?}"
    );
    // The auditor counts an event once the API server has answered its create, which can be
    // after the event is already listed above: wait for the count rather than read it once.
    let series = "spur_operator_webhook_pod_connect_audits_total{result=\"recorded\"}";
    eventually("three audit events counted", || {
        let n = setup.metric(series);
        async move { (n >= 3.0).then_some(()) }
    })
    .await;

    // A request must name its requester's own identity even when written by an admin straight
    // past the webhook (the policy checks the stamp against the API server's user info).
    let mut forged = exec_request("forged", "web-exec", None);
    forged.spec.requester = Some(spur_api::access::Requester {
        username: "system:serviceaccount:devs:alice".into(),
        uid: None,
        groups: vec![],
    });
    Api::<MutatingWebhookConfiguration>::all(admin.clone())
        .delete("spur-sidecar-injector", &DeleteParams::default())
        .await
        .unwrap();
    // The API server drops the webhook a moment after its configuration is deleted; until then
    // the webhook stamps carol over the forged requester and the request is admitted: take
    // that one away and try again.
    let forged_refused = "spec.requester must be the user filing the request";
    eventually("a forged requester refused past the webhook", || {
        let (carol, admin, forged) = (carol.clone(), admin.clone(), forged.clone());
        async move {
            match Api::<ExecAccessRequest>::namespaced(carol, NS)
                .create(&PostParams::default(), &forged)
                .await
            {
                Err(e) if e.to_string().contains(forged_refused) => Some(()),
                Ok(_) => {
                    let admin = Api::<ExecAccessRequest>::namespaced(admin, NS);
                    let _ = admin.delete("forged", &DeleteParams::default()).await;
                    None
                }
                Err(_) => None,
            }
        }
    })
    .await;

    // Nor claim a group they are not in (templates allow by group).
    let mut forged = exec_request("forged-group", "web-exec", None);
    forged.spec.requester = Some(spur_api::access::Requester {
        username: "system:serviceaccount:others:carol".into(),
        uid: None,
        groups: vec![DEVS_GROUP.into()],
    });
    let e = Api::<ExecAccessRequest>::namespaced(carol.clone(), NS)
        .create(&PostParams::default(), &forged)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("spec.requester must be the user filing the request"),
        "{e}"
    );

    // Writing a template needs the rights it hands out: carol may create templates (RBAC)
    // but may not exec into the namespace's pods.
    let template_writer: Role = serde_json::from_value(json!({
        "metadata": {"name": "template-writer", "namespace": NS},
        "rules": [{"apiGroups": ["spur.dev"], "resources": ["execaccesstemplates"], "verbs": ["create"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &template_writer)
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "template-writer", "namespace": NS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "template-writer"},
        "subjects": [{"kind": "ServiceAccount", "name": "carol", "namespace": "others"}],
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let e = eventually("carol's template refused by the policy", || {
        let carol = carol.clone();
        async move {
            let r = Api::<ExecAccessTemplate>::namespaced(carol, NS)
                .create(&PostParams::default(), &exec_template("mine", "web", "1h"))
                .await;
            // Until the RoleBinding reaches the authorizer, RBAC refuses first.
            match r {
                Err(e) if e.to_string().contains("needs the right to exec") => Some(e.to_string()),
                _ => None,
            }
        }
    })
    .await;
    assert!(e.contains("ExecAccessTemplate"), "{e}");

    // The operator's own rights are fenced: no Role beyond a grant's shape, even labelled as
    // one, and no other Role deleted or taken over.
    let operator_roles: Api<Role> = Api::namespaced(setup.operator_client.clone(), NS);
    let wide: Role = serde_json::from_value(json!({
        "metadata": {"name": "access-wide", "namespace": NS, "labels": {"spur.dev/access-request": "x"}},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
    }))
    .unwrap();
    let e = operator_roles
        .create(&PostParams::default(), &wide)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("an access Role grants get on one pod"), "{e}");
    Api::<Role>::namespaced(admin.clone(), NS)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "theirs", "namespace": NS},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let e = operator_roles
        .delete("theirs", &DeleteParams::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("only the Roles and RoleBindings of access grants"),
        "{e}"
    );
    // A RoleBinding of someone else's, relabelled and rebound by server-side apply.
    let theirs: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "access-theirs", "namespace": NS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "access-theirs"},
        "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "admins"}],
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();
    let takeover = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "access-theirs", "namespace": NS,
                     "labels": {"spur.dev/access-request": "x"}},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "access-theirs"},
        "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": "mallory"}],
    });
    let e = Api::<RoleBinding>::namespaced(setup.operator_client.clone(), NS)
        .patch(
            "access-theirs",
            &PatchParams::apply("spur-operator").force(),
            &Patch::Apply(&takeover),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("only the Roles and RoleBindings of access grants"),
        "{e}"
    );
    // A grant-shaped Role naming two pods.
    let two: Role = serde_json::from_value(json!({
        "metadata": {"name": "access-two", "namespace": NS, "labels": {"spur.dev/access-request": "x"}},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "resourceNames": ["web-1"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["pods/exec"], "resourceNames": ["web-0-stray"], "verbs": ["create"]},
        ]
    }))
    .unwrap();
    let e = operator_roles
        .create(&PostParams::default(), &two)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("an access Role grants get on one pod"), "{e}");
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_pods_are_cloned_unselected_and_expire_across_an_operator_restart() {
    let mut setup = Setup::start().await;
    let admin = setup.api.client();
    workload(&admin, "web").await;
    let template: PodAccessTemplate = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "PodAccessTemplate",
        "metadata": {"name": "web-debug", "namespace": NS},
        "spec": {
            "accessConfig": {"allowedGroups": [DEVS_GROUP], "defaultDuration": "8s", "maxDuration": "8s"},
            "targetRef": {"kind": "Deployment", "name": "web"},
            "mutation": {
                "command": ["sleep", "infinity"],
                "env": [{"name": "DEBUG", "value": "1"}],
                "podLabels": {"purpose": "debug"},
                "keepLivenessProbe": true,
            }
        }
    }))
    .unwrap();
    let templates: Api<PodAccessTemplate> = Api::namespaced(admin.clone(), NS);
    templates
        .create(&PostParams::default(), &template)
        .await
        .unwrap();
    let alice = setup.user(DEVS, "alice").await;
    let request: PodAccessRequest = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "PodAccessRequest",
        "metadata": {"name": "alice-debug", "namespace": NS},
        "spec": {"templateName": "web-debug"}
    }))
    .unwrap();
    Api::<PodAccessRequest>::namespaced(alice.clone(), NS)
        .create(&PostParams::default(), &request)
        .await
        .unwrap();
    let requests: Api<PodAccessRequest> = Api::namespaced(admin.clone(), NS);
    let pod_name = eventually("the debug pod is named", || {
        let requests = requests.clone();
        async move { requests.get("alice-debug").await.ok()?.status?.pod_name }
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let pod = pods.get(&pod_name).await.unwrap();
    let labels = pod.labels();
    assert!(
        !labels.contains_key("app"),
        "no Service selecting app=web selects it: {labels:?}"
    );
    assert_eq!(labels.get("purpose").map(String::as_str), Some("debug"));
    assert!(
        !pod.annotations().contains_key("team"),
        "the template's annotations are dropped"
    );
    let spec = pod.spec.clone().unwrap();
    let c = &spec.containers[0];
    assert_eq!(
        c.command.as_deref(),
        Some(&["sleep".to_string(), "infinity".to_string()][..])
    );
    assert_eq!(
        c.args, None,
        "the workload's arguments went with its command"
    );
    assert!(c.readiness_probe.is_none(), "probes are stripped");
    assert!(c.liveness_probe.is_some(), "unless kept");
    assert!(c.env.iter().flatten().any(|e| e.name == "DEBUG"));
    assert!(
        spec.active_deadline_seconds
            .is_some_and(|d| (1..=8).contains(&d))
    );
    assert_eq!(pod.owner_references()[0].name, "alice-debug");
    // Not ready before the pod runs.
    let r = requests.get("alice-debug").await.unwrap();
    assert!(!r.status.unwrap().ready);
    mark_running(&admin, &pod_name).await;
    let ready = eventually("the debug request is ready", || {
        let requests = requests.clone();
        async move {
            let r = requests.get("alice-debug").await.ok()?;
            r.status.as_ref()?.ready.then_some(r)
        }
    })
    .await;
    assert!(may_exec(&alice, &pod_name).await);
    let expires = ready.status.unwrap().expires_at.unwrap().0;

    // The operator is down across the expiry: the kubelet would end the pod at its deadline,
    // and the first pass of the next operator deletes the rest at once.
    setup.stop_operator().await;
    let left = Duration::try_from(expires.duration_since(k8s_openapi::jiff::Timestamp::now()))
        .unwrap_or_default();
    tokio::time::sleep(left + Duration::from_millis(500)).await;
    assert!(requests.get_opt("alice-debug").await.unwrap().is_some());
    let stop = CancellationToken::new();
    setup.stop = stop.clone();
    let mut registry = Registry::default();
    let metrics = spur_operator::Metrics::register(&mut registry);
    let ctx = Arc::new(
        spur_operator::Context::new(
            setup.operator_client.clone(),
            Some("test-2".into()),
            metrics,
        )
        .with_access(),
    );
    let restarted = Instant::now();
    setup.operator = Some(spawn_operator(setup.operator_client.clone(), ctx, stop));
    eventually("the expired request and its pod are deleted", || {
        let (requests, pods, pod_name) = (requests.clone(), pods.clone(), pod_name.clone());
        async move {
            (requests.get_opt("alice-debug").await.ok()?.is_none()
                && pods.get_opt(&pod_name).await.ok()?.is_none())
            .then_some(())
        }
    })
    .await;
    eprintln!(
        "the restarted operator deleted the expired grant after {:?}",
        restarted.elapsed()
    );
    assert!(!may_exec(&alice, &pod_name).await);
    setup.shutdown().await;
}

fn tunnel_request(
    name: &str,
    template: &str,
    workstation: &str,
    token: &str,
) -> TunnelAccessRequest {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "TunnelAccessRequest",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "templateName": template,
            "workstation": workstation,
            "tokenSha256": spur_tunnelproxy::tokens::token_sha256(token),
        }
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_grants_are_hashed_tokens_that_end_with_the_grant() {
    let setup = Setup::start().await;
    let admin = setup.api.client();
    let templates: Api<TunnelAccessTemplate> = Api::namespaced(admin.clone(), NS);
    for (name, max) in [("laptops", "6s"), ("laptops-hour", "1h")] {
        let t: TunnelAccessTemplate = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "TunnelAccessTemplate",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"accessConfig": {"allowedGroups": [DEVS_GROUP], "defaultDuration": max, "maxDuration": max}}
        }))
        .unwrap();
        templates.create(&PostParams::default(), &t).await.unwrap();
    }
    let alice = setup.user(DEVS, "alice").await;
    let bob = setup.user(DEVS, "bob").await;
    let token = spur_tunnelproxy::tokens::generate_token().unwrap();
    let alice_requests: Api<TunnelAccessRequest> = Api::namespaced(alice.clone(), NS);
    alice_requests
        .create(
            &PostParams::default(),
            &tunnel_request("alice-tunnel", "laptops", "alice-laptop", &token),
        )
        .await
        .unwrap();
    let requests: Api<TunnelAccessRequest> = Api::namespaced(admin.clone(), NS);
    let ready = eventually("alice's tunnel grant is ready", || {
        let requests = requests.clone();
        async move {
            let r = requests.get("alice-tunnel").await.ok()?;
            r.status.as_ref()?.ready.then_some(r)
        }
    })
    .await;
    let status = ready.status.unwrap();
    assert_eq!(
        status.access_message.as_deref(),
        Some("spur local connect --token-file <token file>")
    );
    // The tunnel proxy's view: the token (never stored) names the workstation until the end
    // of the grant.
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(admin.clone(), TOKEN_NS);
    let list = secrets
        .list(&kube::api::ListParams::default().labels("spur.dev/credential=token"))
        .await
        .unwrap()
        .items;
    assert_eq!(list.len(), 1);
    let stored = serde_json::to_string(&list[0]).unwrap();
    assert!(
        !stored.contains(&token),
        "the token itself is not in the cluster"
    );
    let found = spur_tunnelproxy::tokens::lookup(list.iter(), &token, std::time::SystemTime::now())
        .unwrap();
    assert_eq!(found.name, "alice-laptop");
    let expires = status.expires_at.unwrap().0;
    let until = found
        .expires_at
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert_eq!(until as i64, expires.as_second());

    // Bob cannot take alice's workstation while her grant lasts.
    let bob_token = spur_tunnelproxy::tokens::generate_token().unwrap();
    Api::<TunnelAccessRequest>::namespaced(bob.clone(), NS)
        .create(
            &PostParams::default(),
            &tunnel_request("bob-tunnel", "laptops-hour", "alice-laptop", &bob_token),
        )
        .await
        .unwrap();
    let reason = eventually("bob's request refused", || {
        let requests = requests.clone();
        async move {
            let s = requests.get("bob-tunnel").await.ok()?.status?;
            reason_of(&s.conditions, READY).filter(|r| r.contains("WorkstationTaken"))
        }
    })
    .await;
    assert_eq!(reason, "False/WorkstationTaken");

    // At the end of the grant its token Secret goes with the request; then bob's is granted.
    eventually("alice's grant ended", || {
        let (requests, secrets) = (requests.clone(), secrets.clone());
        let name = spur_operator::access::grant_name("tunnel", NS, "alice-tunnel");
        async move {
            (requests.get_opt("alice-tunnel").await.ok()?.is_none()
                && secrets.get_opt(&name).await.ok()?.is_none())
            .then_some(())
        }
    })
    .await;
    eventually("bob's grant once the workstation is free", || {
        let requests = requests.clone();
        async move {
            requests
                .get("bob-tunnel")
                .await
                .ok()?
                .status?
                .ready
                .then_some(())
        }
    })
    .await;

    // Taken back early (bob deletes his request): the Secret goes and the workstation's
    // credentials issued until now are revoked, which closes open tunnels.
    Api::<TunnelAccessRequest>::namespaced(bob.clone(), NS)
        .delete("bob-tunnel", &DeleteParams::default())
        .await
        .unwrap();
    let revocation = eventually("the revocation", || {
        let secrets = secrets.clone();
        async move {
            secrets
                .get_opt(&spur_api::tunnel::credentials::revocation_secret_name(
                    "alice-laptop",
                ))
                .await
                .ok()?
        }
    })
    .await;
    assert!(
        revocation
            .annotations()
            .contains_key(spur_api::tunnel::credentials::REVOKED_BEFORE_ANNOTATION)
    );
    let left = secrets
        .list(&kube::api::ListParams::default().labels("spur.dev/credential=token"))
        .await
        .unwrap()
        .items;
    assert!(left.is_empty(), "{left:?}");
    setup.shutdown().await;
}
