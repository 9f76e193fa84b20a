//! Resources act with their creator's rights too (issue 42, point 9): a Sandbox's resources run
//! a plugin's steps with whatever rights the plugin's author gave them, so the chart's policy
//! spur-sandbox-creator-rights (charts/spur/files/sandbox-admission-policy.yaml) asks, when a
//! Sandbox is created, for the verb `use` on `resourceplugins.spur.dev` named after each plugin.
//! Against a real kube-apiserver: a developer who may fork in namespace `a` cannot make the
//! operator run a plugin it was not given, and can with the chart's ClusterRole. Writes that
//! leave the spec alone (the operator's finalizers) are not checked, so a Sandbox whose
//! baseline namespace is gone can still be deleted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use spur_api::Sandbox;
use spur_e2e::kube::{self as kt, eventually};
use spur_kube_harness::KubeApi;

fn sandbox(name: &str, plugins: &[&str]) -> Sandbox {
    let resources: Vec<Value> = plugins
        .iter()
        .enumerate()
        .map(|(i, p)| json!({"name": format!("r{i}"), "plugin": p, "params": {"db-prefix": "x"}}))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {
            "forks": [{"forkOf": {"kind": "Deployment", "namespace": "a", "name": "app"}}],
            "resources": resources,
        }
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resources_need_the_use_verb_on_their_plugins() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, "a").await.unwrap();
    let text =
        std::fs::read_to_string(kt::chart_path("files/sandbox-admission-policy.yaml")).unwrap();
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
    // The developer may create Sandboxes and fork in namespace `a`.
    kt::grant_dev(
        &admin,
        "dev-sandboxes",
        json!([{"apiGroups": ["spur.dev"], "resources": ["sandboxes"],
                "verbs": ["create", "get", "update", "patch", "delete"]}]),
    )
    .await
    .unwrap();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "dev", "namespace": "a"},
        "rules": [
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["create"]}
        ]
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), "a")
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "dev", "namespace": "a"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "dev"},
        "subjects": [{"kind": "ServiceAccount", "name": "dev", "namespace": kt::SYSTEM_NAMESPACE}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), "a")
        .create(&PostParams::default(), &rb)
        .await
        .unwrap();
    let token = api
        .service_account_token(kt::SYSTEM_NAMESPACE, "dev")
        .await
        .unwrap();
    let dev: Api<Sandbox> = Api::all(api.client_with_token(&token).await.unwrap());
    let admin_sb: Api<Sandbox> = Api::all(admin.clone());
    let pp = PostParams::default();

    // Refused while the developer may not use the plugin (the policy may take a moment).
    let message = eventually("the policy to refuse a plugin", || {
        let (dev, admin_sb) = (dev.clone(), admin_sb.clone());
        async move {
            match dev
                .create(&PostParams::default(), &sandbox("db1", &["postgres@1.0.0"]))
                .await
            {
                Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => Some(e.message),
                Ok(_) => {
                    admin_sb.delete("db1", &DeleteParams::default()).await.ok();
                    None
                }
                Err(_) => None,
            }
        }
    })
    .await;
    assert!(
        message.contains("resourceplugins.spur.dev") && message.ends_with("one of: postgres"),
        "{message}"
    );
    // Without resources, the same developer's Sandbox is fine.
    dev.create(&pp, &sandbox("plain", &[])).await.unwrap();

    // With the verb for postgres only (resourceNames), postgres is allowed and redis is not.
    let mut rules = kt::chart_rules("resource-plugin-user-rules.yaml").unwrap();
    rules[0]["resourceNames"] = json!(["postgres"]);
    kt::grant_dev(&admin, "dev-postgres", rules).await.unwrap();
    eventually("postgres with the verb", || {
        let dev = dev.clone();
        async move {
            dev.create(&PostParams::default(), &sandbox("db1", &["postgres"]))
                .await
                .ok()
        }
    })
    .await;
    let err = dev
        .create(&pp, &sandbox("db2", &["postgres@1.0.0", "redis"]))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("one of: postgres, redis"), "{err}");
    assert!(admin_sb.get_opt("db2").await.unwrap().is_none());
    // An update of a Sandbox with resources is not checked again (resources are immutable):
    // the operator, which has no such verb, can still add and remove finalizers.
    dev.patch(
        "db1",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"description": "still the same resources"}})),
    )
    .await
    .unwrap();

    // Only writes that change the spec are checked. When the rights in a baseline namespace go
    // (its deletion takes the operator's enrolment RoleBinding with it), an update of only the
    // metadata (the operator removing its finalizer) still passes, or such a Sandbox could
    // never be deleted; a spec change is refused.
    Api::<RoleBinding>::namespaced(admin.clone(), "a")
        .delete("dev", &DeleteParams::default())
        .await
        .unwrap();
    let message = eventually("a spec change without the rights to be refused", || {
        let dev = dev.clone();
        async move {
            match dev
                .patch(
                    "plain",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"description": "changed"}})),
                )
                .await
            {
                Err(kube::Error::Api(e)) if e.code == 403 => Some(e.message),
                _ => None,
            }
        }
    })
    .await;
    assert!(message.ends_with("lacks them in one of: a"), "{message}");
    for finalizers in [json!(["spur.dev/cleanup"]), json!(null)] {
        dev.patch(
            "plain",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": finalizers}})),
        )
        .await
        .unwrap();
    }
}
