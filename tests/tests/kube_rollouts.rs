//! Argo Rollouts as baselines on a real kube-apiserver (issue 45): a Sandbox forks a canary
//! Rollout into a Deployment running the Rollout's pod template, with sandbox Services for every
//! Service that picks the Rollout's pods (Argo's stable and canary Services too), and keyed
//! requests through a sidecar announcing the Rollout reach the fork. The user's Rollout is never
//! written. A Rollout with a `workloadRef` forks the referenced Deployment's template; a missing
//! one is reported; a developer without rights in the Rollout's namespace cannot fork it.
//!
//! The Rollout CRD here is a schemaless stand-in for Argo's (the operator reads it as dynamic
//! JSON); the node tier runs the real Argo controller (tests/argo).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use spur_api::conditions::{READY, find_condition, is_condition_true};
use spur_api::keys::{annotations, labels};
use spur_api::{ExternalWorkload, Sandbox, VirtualWorkload, WorkloadKind, WorkloadRef, names};
use spur_e2e::kube as kube_rbac;
use spur_e2e::kube::control_plane::ControlPlane;
use spur_e2e::kube::eventually;
use spur_e2e::{AppKind, get, spawn_app};
use spur_routing::BaselineWorkload;
use spur_sidecar::Sidecar;
use tokio_util::sync::CancellationToken;

const NS: &str = "shop";
const HASH: &str = "rollouts-pod-template-hash";

const ROLLOUT_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: rollouts.argoproj.io}
spec:
  group: argoproj.io
  scope: Namespaced
  names: {kind: Rollout, listKind: RolloutList, plural: rollouts, singular: rollout, shortNames: [ro]}
  versions:
    - name: v1alpha1
      served: true
      storage: true
      subresources: {status: {}}
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
"#;

fn rollout_resource() -> ApiResource {
    ApiResource {
        group: "argoproj.io".into(),
        version: "v1alpha1".into(),
        api_version: "argoproj.io/v1alpha1".into(),
        kind: "Rollout".into(),
        plural: "rollouts".into(),
    }
}

fn rollouts(client: &Client) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), NS, &rollout_resource())
}

fn container(name: &str, port: u16, origin: &str) -> serde_json::Value {
    json!({"name": name, "image": format!("{name}:1"),
           "ports": [{"name": "http", "containerPort": port}],
           "env": [{"name": "ORIGIN", "value": origin}]})
}

async fn create<K>(api: &Api<K>, v: serde_json::Value) -> K
where
    K: kube::Resource
        + Clone
        + k8s_openapi::serde::de::DeserializeOwned
        + k8s_openapi::serde::Serialize
        + std::fmt::Debug,
{
    let obj: K = serde_json::from_value(v).unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap()
}

fn service(name: &str, selector: serde_json::Value) -> serde_json::Value {
    json!({"metadata": {"name": name, "namespace": NS},
           "spec": {"selector": selector,
                    "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
}

fn sandbox(name: &str, kind: &str, baseline: &str) -> serde_json::Value {
    json!({"apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox", "metadata": {"name": name},
           "spec": {"forks": [{"forkOf": {"kind": kind, "namespace": NS, "name": baseline},
                               "customizations": {"images": [{"image": format!("{baseline}:dev")}]}}]}})
}

fn fork_name(sandbox: &str, rollout: &str) -> String {
    names::fork_name(
        sandbox,
        &WorkloadRef::new(WorkloadKind::Rollout, NS, rollout),
    )
}

/// The fork Deployment of `rollout` in `sandbox`, once it exists.
async fn fork(client: &Client, sandbox: &str, rollout: &str) -> Deployment {
    let name = fork_name(sandbox, rollout);
    let api: Api<Deployment> = Api::namespaced(client.clone(), NS);
    eventually(&format!("fork Deployment {name}"), || async {
        api.get_opt(&name).await.unwrap()
    })
    .await
}

fn env_of(d: &Deployment, name: &str) -> Option<String> {
    d.spec.as_ref()?.template.spec.as_ref()?.containers[0]
        .env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

/// Plays kubelet and Deployment controller for a fork Deployment.
async fn mark_ready(client: &Client, d: &Deployment) {
    Api::<Deployment>::namespaced(client.clone(), NS)
        .patch_status(
            &d.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "observedGeneration": d.metadata.generation, "replicas": 1, "updatedReplicas": 1,
                "readyReplicas": 1, "availableReplicas": 1}})),
        )
        .await
        .unwrap();
}

async fn served_by(sidecar: &Sidecar, key: Option<&str>) -> String {
    let baggage = key.map(|k| format!("sd-routing-key={k}"));
    let headers: Vec<(&str, &str)> = baggage.iter().map(|b| ("baggage", b.as_str())).collect();
    let got = get(sidecar.inbound_addr, "/", &headers).await.unwrap();
    assert_eq!(got.status, 200, "{got:?}");
    got.served_by().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollouts_are_forked_as_deployments_and_never_written() {
    let cp = ControlPlane::start_with_crds(&[ROLLOUT_CRD]).await;
    let admin = cp.client();
    kube_rbac::ensure_namespace(&admin, NS).await.unwrap();
    let apps = CancellationToken::new();
    let baseline_app = spawn_app(AppKind::Http, "web-baseline", apps.clone()).await;
    let fork_app = spawn_app(AppKind::Http, "web-fork", apps.clone()).await;
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), NS);
    let services: Api<Service> = Api::namespaced(admin.clone(), NS);
    let ro = rollouts(&admin);

    // The baseline: a canary Rollout as Argo's docs write one, with the Services Argo rewrites
    // (the pod-template hash in their selectors) and one on the canary's ephemeral label.
    let rollout = create(
        &ro,
        json!({"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
            "metadata": {"name": "web", "namespace": NS},
            "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                "template": {"metadata": {"labels": {"app": "web", "team": "shop"}},
                             "spec": {"containers": [container("web", baseline_app.port(), "rollout")]}},
                "strategy": {"canary": {"canaryService": "web-canary", "stableService": "web-stable",
                    "canaryMetadata": {"labels": {"role": "canary"}},
                    "steps": [{"setWeight": 20}, {"pause": {}}]}}}}),
    )
    .await;
    for (name, selector) in [
        ("web", json!({"app": "web"})),
        ("web-canary-role", json!({"app": "web", "role": "canary"})),
        ("legacy", json!({"app": "legacy"})),
    ] {
        create(&services, service(name, selector)).await;
    }
    // As Argo leaves the strategy's Services: its annotation, and a ReplicaSet's hash.
    for (name, hash) in [("web-stable", "5f8c"), ("web-canary", "7d9a")] {
        let mut svc = service(name, json!({"app": "web", HASH: hash}));
        svc["metadata"]["annotations"] =
            json!({"argo-rollouts.argoproj.io/managed-by-rollouts": "web"});
        create(&services, svc).await;
    }
    // Another Rollout's Service on the same app label is not web's.
    let mut theirs = service("api-stable", json!({"app": "web", HASH: "0e1f"}));
    theirs["metadata"]["annotations"] =
        json!({"argo-rollouts.argoproj.io/managed-by-rollouts": "api"});
    create(&services, theirs).await;
    // A Deployment of the same name (another team's, another app): a Rollout baseline is never
    // read as it.
    create(
        &deployments,
        json!({"metadata": {"name": "web", "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": "legacy"}},
                "template": {"metadata": {"labels": {"app": "legacy"}},
                             "spec": {"containers": [container("legacy", 9, "deployment")]}}}}),
    )
    .await;

    let sandboxes: Api<Sandbox> = Api::all(admin.clone());
    create(&sandboxes, sandbox("ro", "Rollout", "web")).await;
    let d = fork(&admin, "ro", "web").await;
    let fork_id = d.name_any();
    assert_eq!(
        d.annotations()
            .get(annotations::BASELINE)
            .map(String::as_str),
        Some("Rollout/shop/web")
    );
    let spec = d.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(1));
    assert_eq!(
        spec.strategy.as_ref().and_then(|s| s.type_.as_deref()),
        Some("Recreate")
    );
    let pod_labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    // Kept out of every Service of the Rollout: no app, role or hash label.
    for k in ["app", "role", HASH] {
        assert!(
            !pod_labels.contains_key(k),
            "{k} on the fork: {pod_labels:?}"
        );
    }
    assert_eq!(pod_labels.get("team").map(String::as_str), Some("shop"));
    assert_eq!(env_of(&d, "ORIGIN").as_deref(), Some("rollout"));
    assert_eq!(env_of(&d, "SIGNADOT_SANDBOX_NAME").as_deref(), Some("ro"));
    assert_eq!(
        spec.template.spec.as_ref().unwrap().containers[0]
            .image
            .as_deref(),
        Some("web:dev")
    );

    // One sandbox Service per Service of the Rollout's pods, Argo's included; none for others.
    let lp = ListParams::default().labels(&format!("{}={fork_id}", labels::FORK));
    let mut made: Vec<String> = eventually("the fork's sandbox Services", || async {
        let got: Vec<String> = services
            .list(&lp)
            .await
            .unwrap()
            .items
            .iter()
            .map(|s| s.name_any())
            .collect();
        (got.len() == 4).then_some(got)
    })
    .await;
    made.sort();
    let mut want: Vec<String> = ["web", "web-canary", "web-canary-role", "web-stable"]
        .iter()
        .map(|s| names::sandbox_service_name("ro", s))
        .collect();
    want.sort();
    assert_eq!(made, want);

    mark_ready(&admin, &d).await;
    let key = eventually("Sandbox ro Ready", || async {
        let st = sandboxes.get("ro").await.unwrap().status?;
        is_condition_true(&st.conditions, READY).then_some(st.routing_key?)
    })
    .await;

    // A sidecar in front of a pod of the Rollout (as the webhook injects it: the Routes API's
    // `ArgoRollout`) sends keyed requests to the fork.
    let mut config = spur_e2e::sidecar_config(baseline_app);
    config.baseline = BaselineWorkload {
        kind: "ArgoRollout".into(),
        namespace: NS.into(),
        name: "web".into(),
    };
    config.routeserver = Some(spur_sidecar::RouteServerConn::plain(cp.routeserver_addr()));
    // Cluster DNS stand-in: every sandbox Service of the fork leads to its pod (the sidecar
    // picks any of them for a pod port that several Services reach).
    for svc in ["web", "web-canary", "web-canary-role", "web-stable"] {
        let host = format!("{}.{NS}.svc:80", names::sandbox_service_name("ro", svc));
        config.proxy.resolve.insert(host, fork_app);
    }
    let sidecar = Sidecar::start(config).await.unwrap();
    eventually("keyed requests reach the fork", || async {
        (served_by(&sidecar, Some(&key)).await == "web-fork").then_some(())
    })
    .await;
    assert_eq!(served_by(&sidecar, None).await, "web-baseline");
    assert_eq!(served_by(&sidecar, Some("other-key")).await, "web-baseline");

    // Forking wrote nothing of the Rollout's (Argo would react to any write).
    assert_eq!(
        ro.get("web").await.unwrap().resource_version(),
        rollout.resource_version()
    );

    // A local and a virtual workload of the Rollout (the objects a Sandbox's `local` and
    // `virtual` make): sandbox Services for its Services, pointing at the tunnel proxy once the
    // workstation connects; the Rollout observed.
    let ews: Api<ExternalWorkload> = Api::namespaced(admin.clone(), NS);
    let local = ews
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "ExternalWorkload",
                "metadata": {"name": "ro-laptop", "namespace": NS},
                "spec": {"sandbox": "ro-local", "routingKey": "k-local", "name": "laptop",
                         "workstation": "alice",
                         "baseline": {"kind": "Rollout", "namespace": NS, "name": "web"},
                         "mappings": [{"port": baseline_app.port(), "toLocal": "localhost:8080"}]}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let observed = eventually("the local workload of the Rollout", || async {
        let st = ews.get(&local.name_any()).await.unwrap().status?;
        let ready = find_condition(&st.conditions, READY)?;
        (ready.reason == "NoTunnel" && st.services.len() == 4).then_some(st)
    })
    .await;
    assert_eq!(
        observed.baseline.map(|b| b.uid),
        rollout.metadata.uid.clone()
    );
    let vws: Api<VirtualWorkload> = Api::namespaced(admin.clone(), NS);
    create(
        &vws,
        json!({"apiVersion": "spur.dev/v1alpha1", "kind": "VirtualWorkload",
            "metadata": {"name": "ro-virtual", "namespace": NS},
            "spec": {"sandbox": "ro-virtual", "routingKey": "k-virtual", "name": "web",
                     "baseline": {"kind": "Rollout", "namespace": NS, "name": "web"}}}),
    )
    .await;
    eventually("the virtual workload of the Rollout", || async {
        let st = vws.get("ro-virtual").await.unwrap().status?;
        let ready = find_condition(&st.conditions, READY)?;
        // No pod of the Rollout runs here (no kubelet): observed, with no sidecar to act.
        (ready.reason == "NoSidecar" && st.baseline?.uid == rollout.uid()?).then_some(())
    })
    .await;
    ews.delete("ro-laptop", &DeleteParams::default())
        .await
        .unwrap();
    vws.delete("ro-virtual", &DeleteParams::default())
        .await
        .unwrap();

    // A new template reaches the fork at once (the Rollout watch; the resync is 5 minutes).
    ro.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"template": {"spec": {"containers": [
            container("web", baseline_app.port(), "rollout-v2")]}}}})),
    )
    .await
    .unwrap();
    let rollout = ro.get("web").await.unwrap();
    eventually("the fork to follow the Rollout's template", || async {
        let d = deployments.get(&fork_id).await.unwrap();
        (env_of(&d, "ORIGIN").as_deref() == Some("rollout-v2")).then_some(())
    })
    .await;

    // A workloadRef Rollout runs the referenced Deployment's template.
    create(
        &deployments,
        json!({"metadata": {"name": "api-src", "namespace": NS},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "api"}},
                "template": {"metadata": {"labels": {"app": "api"}},
                             "spec": {"containers": [container("api", 8080, "referenced")]}}}}),
    )
    .await;
    create(
        &ro,
        json!({"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
            "metadata": {"name": "api", "namespace": NS},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "api"}},
                "workloadRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "api-src"},
                "strategy": {"canary": {"steps": [{"setWeight": 50}]}}}}),
    )
    .await;
    let api_rollout = ro.get("api").await.unwrap();
    create(&sandboxes, sandbox("ref", "Rollout", "api")).await;
    let d = fork(&admin, "ref", "api").await;
    assert_eq!(env_of(&d, "ORIGIN").as_deref(), Some("referenced"));
    assert_eq!(
        d.annotations()
            .get(annotations::BASELINE)
            .map(String::as_str),
        Some("Rollout/shop/api")
    );

    // A Rollout that does not exist is reported, and nothing is made for it.
    create(&sandboxes, sandbox("missing", "Rollout", "nope")).await;
    let ready = eventually("Sandbox missing to say why", || async {
        let st = sandboxes.get("missing").await.unwrap().status?;
        find_condition(&st.conditions, READY).cloned()
    })
    .await;
    assert_eq!(ready.reason, "BaselineNotFound", "{ready:?}");
    assert!(
        ready.message.contains("Rollout shop/nope not found"),
        "{ready:?}"
    );
    assert!(
        deployments
            .get_opt(&fork_name("missing", "nope"))
            .await
            .unwrap()
            .is_none()
    );

    // Deleting the sandboxes removes the forks and leaves the Rollouts as they were.
    for sb in ["ro", "ref", "missing"] {
        sandboxes
            .delete(sb, &DeleteParams::default())
            .await
            .unwrap();
    }
    for (sb, r) in [("ro", "web"), ("ref", "api")] {
        let name = fork_name(sb, r);
        eventually(&format!("fork {name} gone"), || async {
            deployments
                .get_opt(&name)
                .await
                .unwrap()
                .is_none()
                .then_some(())
        })
        .await;
    }
    for before in [rollout, api_rollout] {
        let now = ro.get(&before.name_any()).await.unwrap();
        assert_eq!(
            now.resource_version(),
            before.resource_version(),
            "Rollout {} was written",
            before.name_any()
        );
    }
    let legacy = deployments.get("web").await.unwrap();
    assert_eq!(legacy.metadata.generation, Some(1), "{legacy:?}");

    sidecar.shutdown().await;
    apps.cancel();
    cp.shutdown().await;
}

/// Forking a Rollout makes a Deployment in its namespace, so it takes the rights to create one
/// there: a developer with rights only in another namespace is refused by the API server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_developer_of_another_namespace_cannot_fork_a_rollout() {
    let cp = ControlPlane::start_with_crds(&[ROLLOUT_CRD]).await;
    let admin = cp.client();
    kube_rbac::ensure_namespace(&admin, NS).await.unwrap();
    kube_rbac::ensure_namespace(&admin, "team-b").await.unwrap();
    // A Rollout `web` in both namespaces: the refusal is about whose namespace, not a missing
    // object.
    for ns in [NS, "team-b"] {
        let ro: Api<DynamicObject> = Api::namespaced_with(admin.clone(), ns, &rollout_resource());
        create(
            &ro,
            json!({"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                "metadata": {"name": "web", "namespace": ns},
                "spec": {"selector": {"matchLabels": {"app": "web"}},
                    "template": {"metadata": {"labels": {"app": "web"}},
                                 "spec": {"containers": [container("web", 8080, ns)]}}}}),
        )
        .await;
    }
    let objects = kube_rbac::helm_template(&[]).await.unwrap();
    kube_rbac::install_rendered_policy(&admin, &objects, "spur-sandbox-creator-rights")
        .await
        .unwrap();
    // Sandboxes anywhere, Deployments and Services (and Rollouts) only in team-b.
    kube_rbac::grant_dev(
        &admin,
        "dev-sandboxes",
        json!([{"apiGroups": ["spur.dev"], "resources": ["sandboxes"],
                "verbs": ["create", "get", "list"]}]),
    )
    .await
    .unwrap();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "dev", "namespace": "team-b"},
        "rules": [
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create", "get"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "get"]},
            {"apiGroups": ["argoproj.io"], "resources": ["rollouts"], "verbs": ["get", "list"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), "team-b")
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    create(
        &Api::<RoleBinding>::namespaced(admin.clone(), "team-b"),
        json!({"metadata": {"name": "dev", "namespace": "team-b"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "dev"},
            "subjects": [{"kind": "ServiceAccount", "name": "dev",
                          "namespace": kube_rbac::SYSTEM_NAMESPACE}]}),
    )
    .await;
    let token = cp
        .api
        .service_account_token(kube_rbac::SYSTEM_NAMESPACE, "dev")
        .await
        .unwrap();
    let dev: Api<Sandbox> = Api::all(cp.api.client_with_token(&token).await.unwrap());
    let sb: Sandbox = serde_json::from_value(sandbox("theirs", "Rollout", "web")).unwrap();
    let mut own = sb.clone();
    own.metadata.name = Some("own".into());
    own.spec.forks[0].fork_of.namespace = "team-b".into();
    // The API server loads a new policy asynchronously: probe with dry runs until it refuses.
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    eventually("the policy to be enforced", || async {
        dev.create(&dry, &sb).await.is_err().then_some(())
    })
    .await;
    // Their own namespace's Rollout they may fork.
    dev.create(&dry, &own).await.unwrap();
    let Err(kube::Error::Api(denial)) = dev.create(&PostParams::default(), &sb).await else {
        panic!("a developer of team-b forked a Rollout of {NS}");
    };
    assert_eq!(denial.code, 403, "{denial:?}");
    assert!(
        denial.message.contains("rights of its creator"),
        "{denial:?}"
    );
    assert!(
        Api::<Sandbox>::all(admin.clone())
            .get_opt("theirs")
            .await
            .unwrap()
            .is_none()
    );
    cp.shutdown().await;
}
