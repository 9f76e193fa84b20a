//! JobRunnerGroups act with their creator's rights (issue 42, point 8): the jobs component
//! creates runner pods from a group's template with its own rights in every namespace, so the
//! chart's policy spur-jobrunnergroup-creator-rights
//! (charts/spur/files/jobrunnergroup-admission-policy.yaml) asks, when a group is created or its
//! spec changed, whether the user could make those pods themselves: create pods in the group's
//! namespace, impersonate the ServiceAccount they run as, get every Secret they read. Against a
//! real kube-apiserver (RBAC enforced), with users who may write JobRunnerGroups in every
//! namespace.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use spur_api::JobRunnerGroup;
use spur_e2e::kube::{self as kt, eventually};
use spur_kube_harness::KubeApi;

fn group(ns: &str, name: &str, pod_spec: Value) -> JobRunnerGroup {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "JobRunnerGroup",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"image": "busybox:1.36", "podTemplate": {"spec": pod_spec}},
    }))
    .unwrap()
}

/// The API server's refusal of `g`, as `user`, or `None` if it was created.
async fn refusal(user: &kube::Client, g: &JobRunnerGroup) -> Option<String> {
    let ns = g.metadata.namespace.clone().unwrap();
    match Api::<JobRunnerGroup>::namespaced(user.clone(), &ns)
        .create(&PostParams::default(), g)
        .await
    {
        Ok(_) => None,
        Err(kube::Error::Api(e)) => Some(format!("{} {}", e.code, e.message)),
        Err(e) => panic!("creating a JobRunnerGroup: {e}"),
    }
}

/// ServiceAccount `name` of spur-system, allowed to write JobRunnerGroups in every namespace.
async fn group_writer(api: &KubeApi, name: &str) -> kube::Client {
    let admin = api.client();
    let sa: ServiceAccount = serde_json::from_value(
        json!({"metadata": {"name": name, "namespace": kt::SYSTEM_NAMESPACE}}),
    )
    .unwrap();
    Api::<ServiceAccount>::namespaced(admin.clone(), kt::SYSTEM_NAMESPACE)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": format!("{name}-groups")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "runner-group-writer"},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": kt::SYSTEM_NAMESPACE}]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin)
        .create(&PostParams::default(), &crb)
        .await
        .unwrap();
    let token = api
        .service_account_token(kt::SYSTEM_NAMESPACE, name)
        .await
        .unwrap();
    api.client_with_token(&token).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_groups_need_their_creators_rights_to_the_runner_pods() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    for ns in ["a", "b", kt::SYSTEM_NAMESPACE] {
        kt::ensure_namespace(&admin, ns).await.unwrap();
    }
    let text =
        std::fs::read_to_string(kt::chart_path("files/jobrunnergroup-admission-policy.yaml"))
            .unwrap();
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
    // The chart includes the file.
    let jobs = std::fs::read_to_string(kt::chart_path("templates/jobs.yaml")).unwrap();
    assert!(jobs.contains(r#"{{ .Files.Get "files/jobrunnergroup-admission-policy.yaml" }}"#));

    // Both users may write JobRunnerGroups in every namespace; `dev` may also create pods in
    // namespace a, read its Secret runner-token and act as its ServiceAccount runner. `nopods`
    // may do nothing else.
    let writer: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": "runner-group-writer"},
        "rules": [{"apiGroups": ["spur.dev"], "resources": ["jobrunnergroups"],
                   "verbs": ["create", "get", "update", "patch", "delete"]}]
    }))
    .unwrap();
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &writer)
        .await
        .unwrap();
    let dev = group_writer(&api, "dev").await;
    let nopods = group_writer(&api, "nopods").await;
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "runners", "namespace": "a"},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]},
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["runner-token"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["serviceaccounts"], "resourceNames": ["runner"], "verbs": ["impersonate"]}
        ]
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), "a")
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "runners", "namespace": "a"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "runners"},
        "subjects": [{"kind": "ServiceAccount", "name": "dev", "namespace": kt::SYSTEM_NAMESPACE}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), "a")
        .create(&PostParams::default(), &rb)
        .await
        .unwrap();

    let container = json!({"name": "runner", "image": "busybox:1.36"});
    // A user of namespace a cannot have runner pods made in namespace b (the policy may take a
    // moment to be in force).
    let message = eventually("the policy to refuse a group in namespace b", || {
        let (dev, admin) = (dev.clone(), admin.clone());
        let g = group("b", "elsewhere", json!({"containers": [container.clone()]}));
        async move {
            match refusal(&dev, &g).await {
                Some(m) => Some(m),
                None => {
                    Api::<JobRunnerGroup>::namespaced(admin, "b")
                        .delete("elsewhere", &Default::default())
                        .await
                        .ok();
                    None
                }
            }
        }
    })
    .await;
    assert!(
        message.starts_with("403 ")
            && message.contains("create pods in namespace b")
            && message.contains("system:serviceaccount:spur-system:dev"),
        "{message}"
    );
    // A user who may write groups but not create pods, in namespace a.
    let message = refusal(
        &nopods,
        &group("a", "nopods", json!({"containers": [container.clone()]})),
    )
    .await
    .expect("a group of a user who may not create pods is refused");
    assert!(message.contains("create pods in namespace a"), "{message}");

    // With the pod right, dev's plain group in a is fine, and so are the Secret and the
    // ServiceAccount dev may use.
    assert_eq!(
        refusal(
            &dev,
            &group("a", "plain", json!({"containers": [container.clone()]}))
        )
        .await,
        None
    );
    let allowed = json!({
        "serviceAccountName": "runner",
        "containers": [{"name": "runner", "image": "busybox:1.36",
                        "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "runner-token", "key": "t"}}}]}],
        "volumes": [{"name": "t", "secret": {"secretName": "runner-token"}}],
    });
    assert_eq!(refusal(&dev, &group("a", "allowed", allowed)).await, None);

    // Every way of reading a Secret dev may not read is refused, naming it.
    let reads = [
        json!({"containers": [container.clone()],
               "volumes": [{"name": "db", "secret": {"secretName": "db-password"}}]}),
        json!({"containers": [container.clone()],
               "volumes": [{"name": "p", "projected": {"sources": [
                   {"secret": {"name": "runner-token"}}, {"secret": {"name": "db-password"}}]}}]}),
        json!({"containers": [{"name": "runner", "image": "busybox:1.36",
               "env": [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "p"}}}]}]}),
        json!({"containers": [container.clone()],
               "initContainers": [{"name": "init", "image": "busybox:1.36",
                                   "envFrom": [{"secretRef": {"name": "db-password"}}]}]}),
        // Used rather than read, still the creator's to give: a registry credential and a CSI
        // driver's secret.
        json!({"containers": [container.clone()],
               "imagePullSecrets": [{"name": "db-password"}]}),
        json!({"containers": [container.clone()],
               "volumes": [{"name": "c", "csi": {"driver": "secrets-store.csi.k8s.io",
                                                  "nodePublishSecretRef": {"name": "db-password"}}}]}),
    ];
    for (i, spec) in reads.into_iter().enumerate() {
        let message = refusal(&dev, &group("a", &format!("reads-{i}"), spec))
            .await
            .unwrap_or_else(|| panic!("template {i} reads db-password and was allowed"));
        assert!(
            message.starts_with("403 ") && message.contains("db-password"),
            "{i}: {message}"
        );
    }
    // In-tree volume types with storage credentials of their own are refused outright.
    let cephfs = json!({"containers": [container.clone()],
        "volumes": [{"name": "fs", "cephfs": {"monitors": ["10.0.0.1:6789"],
                                              "secretRef": {"name": "db-password"}}}]});
    let message = refusal(&dev, &group("a", "cephfs", cephfs))
        .await
        .expect("a cephfs volume with its own Secret was allowed");
    assert!(
        message.starts_with("403 ") && message.contains("cephfs"),
        "{message}"
    );
    // A ServiceAccount dev may not act as.
    let message = refusal(
        &dev,
        &group(
            "a",
            "admin-sa",
            json!({"serviceAccountName": "admin", "containers": [container.clone()]}),
        ),
    )
    .await
    .expect("a group running as a ServiceAccount its creator may not use is refused");
    assert!(
        message.contains("ServiceAccount admin") && message.contains("impersonate"),
        "{message}"
    );
    // More Secrets than the policy can check.
    let many: Vec<Value> = (0..7)
        .map(|i| json!({"name": format!("s{i}"), "secret": {"secretName": format!("s{i}")}}))
        .collect();
    let message = refusal(
        &dev,
        &group(
            "a",
            "many",
            json!({"containers": [container.clone()], "volumes": many}),
        ),
    )
    .await
    .expect("seven Secrets are refused");
    assert!(message.contains("at most 6 distinct Secrets"), "{message}");

    // A spec change is checked too: dev cannot make the plain group read db-password later.
    let e = Api::<JobRunnerGroup>::namespaced(dev.clone(), "a")
        .patch(
            "plain",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"podTemplate": {"spec": {
                "containers": [container.clone()],
                "volumes": [{"name": "db", "secret": {"secretName": "db-password"}}]}}}})),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("db-password"), "{e}");
    // Updates that leave the spec alone need nothing (nopods may label a group).
    Api::<JobRunnerGroup>::namespaced(nopods.clone(), "a")
        .patch(
            "plain",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "x"}}})),
        )
        .await
        .unwrap();
}
