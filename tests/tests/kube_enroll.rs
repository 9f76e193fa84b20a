//! Components that cannot take over the cluster (issue 42, point 8): the operator and the jobs
//! component write only in namespaces a cluster administrator labelled `spur.dev/enabled=true`
//! (the operator's enroller binds the chart's enrolled ClusterRoles there), and the chart's
//! admission policies (`templates/fences.yaml`, rendered by helm) narrow what they write there
//! to what their code writes. Each component runs under exactly the chart's rules; the attacks
//! are made with their own ServiceAccount tokens, as a compromised component would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret};
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use spur_e2e::kube::{
    self as kt, SYSTEM_NAMESPACE, ensure_namespace, ensure_namespace_unenrolled, eventually,
};
use spur_kube_harness::KubeApi;

/// Labelled: Spur may write here.
const ENROLLED: &str = "shop";
/// Not labelled: an application namespace Spur must not touch.
const OTHER: &str = "payments";

struct Setup {
    _api: KubeApi,
    admin: Client,
    operator: Client,
    jobs: Client,
    /// The chart's image, which the jobs fence requires of the executor.
    image: String,
}

async fn setup() -> Setup {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    let admin = api.client();
    let rendered = kt::helm_template(&[]).await.unwrap();
    for policy in [
        "spur-operator-rolebindings",
        "spur-operator-writes",
        "spur-jobs-writes",
        // The access grants' fence applies to the same RoleBindings at once: the enroller's
        // must pass it too.
        "spur-operator-access-roles",
    ] {
        kt::install_rendered_policy(&admin, &rendered, policy)
            .await
            .unwrap();
    }
    let image = rendered
        .iter()
        .find(|o| {
            o["kind"] == "ValidatingAdmissionPolicy" && o["metadata"]["name"] == "spur-jobs-writes"
        })
        .and_then(|p| {
            p["spec"]["variables"]
                .as_array()?
                .iter()
                .find(|v| v["name"] == "image")?["expression"]
                .as_str()
                .map(|e| e.trim_matches('\'').to_owned())
        })
        .expect("spur-jobs-writes names the chart's image");
    let operator = kt::operator_client(&api).await.unwrap();
    let jobs = kt::jobs_client(&api).await.unwrap();
    ensure_namespace(&admin, ENROLLED).await.unwrap();
    ensure_namespace_unenrolled(&admin, OTHER).await.unwrap();
    // The policies are enforced a moment after they are stored: until a binding RBAC allows
    // is refused.
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let forbidden = |r: Result<(), kube::Error>| {
        r.is_err_and(|e| matches!(e, kube::Error::Api(ref s) if s.code == 403))
    };
    let plain: Secret =
        serde_json::from_value(json!({"metadata": {"name": "probe"}, "type": "Opaque"})).unwrap();
    let mut not_runner = runner_pod(&image, json!({}));
    not_runner.metadata.labels = None;
    eventually("the chart's policies enforced", || async {
        let binding = Api::<RoleBinding>::namespaced(operator.clone(), OTHER)
            .create(
                &dry,
                &enrollment_binding(kt::OPERATOR_ENROLLED, "spur-operator"),
            )
            .await
            .map(drop);
        let secret = Api::<Secret>::namespaced(operator.clone(), ENROLLED)
            .create(&dry, &plain)
            .await
            .map(drop);
        let pod = Api::<Pod>::namespaced(jobs.clone(), ENROLLED)
            .create(&dry, &not_runner)
            .await
            .map(drop);
        (forbidden(binding) && forbidden(secret) && forbidden(pod)).then_some(())
    })
    .await;
    Setup {
        _api: api,
        admin,
        operator,
        jobs,
        image,
    }
}

/// The API server's refusal (403) of `r`, with its message.
fn refused<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>) -> String {
    match r {
        Err(kube::Error::Api(e)) if e.code == 403 => e.message,
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

fn fork_deployment(name: &str) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "spur"}},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "app", "image": "busybox:1"}]}
            }
        }
    }))
    .unwrap()
}

/// A Resource's outputs, as the operator writes them (`resources.rs`, `publish_outputs`).
fn output_secret(name: &str) -> Secret {
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/managed-by": "spur", "spur.dev/sandbox": "sb",
                       "spur.dev/resource": name},
            "ownerReferences": [{"apiVersion": "spur.dev/v1alpha1", "kind": "Resource",
                                 "name": name, "uid": "00000000-0000-0000-0000-000000000001",
                                 "controller": true}]
        },
        "type": "Opaque",
        "data": {"db.url": "cG9zdGdyZXM6Ly8="}
    }))
    .unwrap()
}

/// An access grant's debug pod, as the operator labels it.
fn debug_pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "spur",
                                              "spur.dev/access-kind": "pod"}},
        "spec": {"containers": [{"name": "debug", "image": "busybox:1"}]}
    }))
    .unwrap()
}

/// A runner pod as `spur_jobs::pods::runner_pod` builds it (the parts the fence looks at).
fn runner_pod(image: &str, spec_extra: Value) -> Pod {
    let mut pod = json!({
        "metadata": {"generateName": "runners-", "labels": {
            "spur.dev/runner-group": "runners", "app.kubernetes.io/managed-by": "spur"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "initContainers": [{"name": "spur-job-init", "image": image,
                "command": ["spur-job-executor", "install", "--to", "/spur-job"],
                "volumeMounts": [{"name": "spur-job", "mountPath": "/spur-job"}]}],
            "containers": [
                {"name": "spur-sidecar", "image": image, "securityContext": {
                    "privileged": false, "allowPrivilegeEscalation": false,
                    "capabilities": {"add": ["NET_ADMIN", "NET_RAW", "SETUID", "SETGID"],
                                     "drop": ["ALL"]}}},
                {"name": "runner", "image": "busybox:1",
                 "command": ["/spur-job/bin/spur-job-executor", "serve"],
                 "volumeMounts": [{"name": "spur-job", "mountPath": "/spur-job"}]}
            ],
            "volumes": [{"name": "spur-job", "emptyDir": {}},
                        {"name": "spur-job-tls", "secret": {"secretName": "spur-job-executor-tls"}}]
        }
    });
    if let (Some(spec), Some(extra)) = (pod["spec"].as_object_mut(), spec_extra.as_object()) {
        for (k, v) in extra {
            spec.insert(k.clone(), v.clone());
        }
    }
    serde_json::from_value(pod).unwrap()
}

fn executor_secret() -> Secret {
    serde_json::from_value(json!({
        "metadata": {"name": "spur-job-executor-tls",
                     "labels": {"app.kubernetes.io/managed-by": "spur"}},
        "type": "Opaque",
        "data": {"tls.crt": "eA==", "tls.key": "eA==", "ca.crt": "eA=="}
    }))
    .unwrap()
}

fn enrollment_binding(name: &str, account: &str) -> RoleBinding {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": SYSTEM_NAMESPACE}]
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlabelled_namespace_is_out_of_the_components_reach() {
    let s = setup().await;
    let pp = PostParams::default();

    // What the operator writes in an enrolled namespace, it may not write in another.
    let deployments = |ns| Api::<Deployment>::namespaced(s.operator.clone(), ns);
    deployments(ENROLLED)
        .create(&pp, &fork_deployment("web-fork"))
        .await
        .unwrap();
    refused(
        "operator: a fork Deployment in an unlabelled namespace",
        deployments(OTHER)
            .create(&pp, &fork_deployment("web-fork"))
            .await,
    );
    let secrets = |ns| Api::<Secret>::namespaced(s.operator.clone(), ns);
    secrets(ENROLLED)
        .create(&pp, &output_secret("sb-db"))
        .await
        .unwrap();
    refused(
        "operator: a Secret in an unlabelled namespace",
        secrets(OTHER).create(&pp, &output_secret("sb-db")).await,
    );
    let pods = |c: &Client, ns| Api::<Pod>::namespaced(c.clone(), ns);
    pods(&s.operator, ENROLLED)
        .create(&pp, &debug_pod("debug"))
        .await
        .unwrap();
    refused(
        "operator: a Pod in an unlabelled namespace",
        pods(&s.operator, OTHER)
            .create(&pp, &debug_pod("debug"))
            .await,
    );
    refused(
        "operator: patching an app's Deployment in an unlabelled namespace",
        deployments(OTHER)
            .patch(
                "payments-api",
                &PatchParams::apply("spur-operator").force(),
                &Patch::Apply(&fork_deployment("payments-api")),
            )
            .await,
    );

    // Binding itself there: RBAC lets it bind its enrolled ClusterRole (it must, anywhere a
    // label may appear), the policy refuses it in a namespace without the label.
    let bindings = |ns| Api::<RoleBinding>::namespaced(s.operator.clone(), ns);
    let msg = refused(
        "operator: binding itself in an unlabelled namespace",
        bindings(OTHER)
            .create(
                &pp,
                &enrollment_binding(kt::OPERATOR_ENROLLED, "spur-operator"),
            )
            .await,
    );
    assert!(msg.contains("spur.dev/enabled=true"), "{msg}");
    refused(
        "operator: binding the jobs component in an unlabelled namespace",
        bindings(OTHER)
            .create(&pp, &enrollment_binding(kt::JOBS_ENROLLED, "spur-jobs"))
            .await,
    );

    // The jobs component: runner pods and the executors' Secret, in enrolled namespaces only.
    pods(&s.jobs, ENROLLED)
        .create(&pp, &runner_pod(&s.image, json!({})))
        .await
        .unwrap();
    refused(
        "jobs: a runner pod in an unlabelled namespace",
        pods(&s.jobs, OTHER)
            .create(&pp, &runner_pod(&s.image, json!({})))
            .await,
    );
    let job_secrets = |ns| Api::<Secret>::namespaced(s.jobs.clone(), ns);
    job_secrets(ENROLLED)
        .create(&pp, &executor_secret())
        .await
        .unwrap();
    refused(
        "jobs: the executor Secret in an unlabelled namespace",
        job_secrets(OTHER).create(&pp, &executor_secret()).await,
    );
    refused(
        "jobs: reading a Secret in an unlabelled namespace",
        job_secrets(OTHER).get("spur-job-executor-tls").await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_labelled_namespace_the_components_write_only_their_own_shapes() {
    let s = setup().await;
    let pp = PostParams::default();

    // Secrets: not a service account token (which the token controller would fill in for any
    // account), not an unlabelled Opaque Secret, not another's Secret taken over by name.
    let secrets = Api::<Secret>::namespaced(s.operator.clone(), ENROLLED);
    let token: Secret = serde_json::from_value(json!({
        "metadata": {"name": "default-token", "labels": {"app.kubernetes.io/managed-by": "spur",
                     "spur.dev/resource": "x"},
                     "annotations": {"kubernetes.io/service-account.name": "default"}},
        "type": "kubernetes.io/service-account-token"
    }))
    .unwrap();
    refused(
        "operator: a service account token Secret",
        secrets.create(&pp, &token).await,
    );
    let plain: Secret =
        serde_json::from_value(json!({"metadata": {"name": "plain"}, "type": "Opaque"})).unwrap();
    refused(
        "operator: an unlabelled Secret",
        secrets.create(&pp, &plain).await,
    );
    Api::<Secret>::namespaced(s.admin.clone(), ENROLLED)
        .create(&pp, &plain)
        .await
        .unwrap();
    refused(
        "operator: taking over an application's Secret by server-side apply",
        secrets
            .patch(
                "plain",
                &PatchParams::apply("spur-operator").force(),
                &Patch::Apply(&output_secret("plain")),
            )
            .await,
    );

    // Deployments: only its own (labelled), and an application's cannot become its own.
    let deployments = Api::<Deployment>::namespaced(s.operator.clone(), ENROLLED);
    let mut app = fork_deployment("app");
    app.metadata.labels = None;
    refused(
        "operator: an unlabelled Deployment",
        deployments.create(&pp, &app).await,
    );
    Api::<Deployment>::namespaced(s.admin.clone(), ENROLLED)
        .create(&pp, &app)
        .await
        .unwrap();
    refused(
        "operator: labelling an application's Deployment as its own",
        deployments
            .patch(
                "app",
                &PatchParams::apply("spur-operator").force(),
                &Patch::Apply(&fork_deployment("app")),
            )
            .await,
    );
    refused(
        "operator: deleting an application's Deployment",
        deployments.delete("app", &DeleteParams::default()).await,
    );

    // Pods: only debug pods of access grants.
    let mut pod = debug_pod("miner");
    pod.metadata.labels = None;
    refused(
        "operator: a pod that is no debug pod",
        Api::<Pod>::namespaced(s.operator.clone(), ENROLLED)
            .create(&pp, &pod)
            .await,
    );

    // ConfigMaps (create is cluster-wide, for the CA bundle): no other name, anywhere.
    ensure_namespace_unenrolled(&s.admin, "kube-system")
        .await
        .unwrap();
    let aws_auth: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "aws-auth", "labels": {"app.kubernetes.io/managed-by": "spur"}},
        "data": {"mapRoles": "- rolearn: x\n  groups: [system:masters]\n"}
    }))
    .unwrap();
    refused(
        "operator: a ConfigMap other than the CA bundle",
        Api::<ConfigMap>::namespaced(s.operator.clone(), "kube-system")
            .create(&pp, &aws_auth)
            .await,
    );

    // RoleBindings: its enrollment binding only to its own account, and no other binding of
    // the enrolled ClusterRoles.
    let bindings = Api::<RoleBinding>::namespaced(s.operator.clone(), ENROLLED);
    let msg = refused(
        "operator: its enrollment binding to another account",
        bindings
            .patch(
                kt::OPERATOR_ENROLLED,
                &PatchParams::apply("spur-operator").force(),
                &Patch::Apply(&enrollment_binding(kt::OPERATOR_ENROLLED, "default")),
            )
            .await,
    );
    assert!(msg.contains("only"), "{msg}");
    let mut other = enrollment_binding(kt::OPERATOR_ENROLLED, "spur-operator");
    other.metadata.name = Some("helper".into());
    refused(
        "operator: another binding of its enrolled ClusterRole",
        bindings.create(&pp, &other).await,
    );
    let mut admin_binding = enrollment_binding(kt::OPERATOR_ENROLLED, "spur-operator");
    admin_binding.role_ref.name = "admin".into();
    refused(
        "operator: binding the admin ClusterRole",
        bindings.create(&pp, &admin_binding).await,
    );

    // The jobs component: runner pods of runner shape only.
    let pods = Api::<Pod>::namespaced(s.jobs.clone(), ENROLLED);
    for (what, extra) in [
        ("hostNetwork", json!({"hostNetwork": true})),
        ("hostPID", json!({"hostPID": true})),
        (
            "a hostPath volume",
            json!({"volumes": [{"name": "spur-job", "emptyDir": {}},
                               {"name": "root", "hostPath": {"path": "/"}}]}),
        ),
        (
            "a privileged container",
            json!({"containers": [{"name": "runner", "image": "busybox:1",
                                   "securityContext": {"privileged": true}}]}),
        ),
        (
            "capabilities for the runner",
            json!({"containers": [{"name": "runner", "image": "busybox:1",
                                   "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}),
        ),
        (
            "an init container of another image",
            json!({"initContainers": [{"name": "spur-job-init", "image": "attacker/tool:1"}]}),
        ),
    ] {
        refused(
            &format!("jobs: a runner pod with {what}"),
            pods.create(&pp, &runner_pod(&s.image, extra)).await,
        );
    }
    let mut not_runner = runner_pod(&s.image, json!({}));
    not_runner.metadata.labels = None;
    refused(
        "jobs: a pod that is no runner",
        pods.create(&pp, &not_runner).await,
    );
    let mut other_secret = executor_secret();
    other_secret.metadata.name = Some("db-password".into());
    refused(
        "jobs: a Secret other than the executors'",
        Api::<Secret>::namespaced(s.jobs.clone(), ENROLLED)
            .create(&pp, &other_secret)
            .await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_enroller_binds_while_the_label_is_there() {
    let s = setup().await;
    let bindings = Api::<RoleBinding>::namespaced(s.admin.clone(), ENROLLED);
    for (role, account) in [
        (kt::OPERATOR_ENROLLED, "spur-operator"),
        (kt::JOBS_ENROLLED, "spur-jobs"),
    ] {
        let rb = bindings.get(role).await.unwrap();
        assert_eq!(rb.role_ref.kind, "ClusterRole");
        assert_eq!(rb.role_ref.name, role);
        let subjects = rb.subjects.unwrap();
        assert_eq!(subjects.len(), 1);
        assert_eq!(subjects[0].name, account);
        assert_eq!(subjects[0].namespace.as_deref(), Some(SYSTEM_NAMESPACE));
    }
    assert!(
        !kt::may(
            &s.admin,
            "spur-operator",
            "apps",
            "deployments",
            "create",
            OTHER
        )
        .await
        .unwrap()
    );
    assert!(
        Api::<RoleBinding>::namespaced(s.admin.clone(), OTHER)
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );

    // Deleted behind its back: made again.
    bindings
        .delete(kt::JOBS_ENROLLED, &DeleteParams::default())
        .await
        .unwrap();
    eventually("the jobs binding made again", || async {
        kt::may(&s.admin, "spur-jobs", "", "pods", "create", ENROLLED)
            .await
            .unwrap()
            .then_some(())
    })
    .await;

    // The label goes: so do the bindings, and with them the components' writes.
    Api::<Namespace>::all(s.admin.clone())
        .patch(
            ENROLLED,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {(kt::ENABLED_LABEL): null}}})),
        )
        .await
        .unwrap();
    eventually("the bindings gone with the label", || async {
        let left = bindings.list(&Default::default()).await.unwrap().items;
        left.is_empty().then_some(())
    })
    .await;
    for (account, group, resource) in [
        ("spur-operator", "apps", "deployments"),
        ("spur-operator", "", "secrets"),
        ("spur-jobs", "", "pods"),
    ] {
        assert!(
            !kt::may(&s.admin, account, group, resource, "create", ENROLLED)
                .await
                .unwrap(),
            "{account} may still create {resource} in {ENROLLED}"
        );
    }
    let names: Vec<String> = bindings
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|b| b.name_any())
        .collect();
    assert!(names.is_empty(), "{names:?}");
}
