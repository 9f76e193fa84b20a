//! `spur sandbox` and `spur routegroup` against a real kube-apiserver with the operator binary
//! running: apply (created, unchanged, configured; a bad file refused whole, naming the
//! document and the field), list and get (text, JSON, YAML), `--wait` progress from the
//! Sandbox, its ForkedWorkload and the fork's pods, its failures (the operator's check, the
//! kubelet's reason on a fork pod) and its time limit with their exit codes, delete `--wait`,
//! and a user of another namespace whose progress shows nothing of a namespace not theirs.
//! There is no kubelet here: the test writes the fork pod's status the way a kubelet would; a
//! sandbox that comes up for real is the node tier's (tests/tests/node.rs, docs examples).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use spur_api::{ForkedWorkload, Sandbox, WorkloadKind, WorkloadRef, names};
use spur_kube_harness::KubeApi;

#[path = "support/roles.rs"]
mod roles;
use roles::role_bin;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn spur(kubeconfig: &Path, args: &[&str]) -> Run {
    let out: Output = tokio::process::Command::new(env!("CARGO_BIN_EXE_spur"))
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    let run = Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    eprintln!(
        "$ spur {}\n{}{}(exit {})",
        args.join(" "),
        run.stdout,
        run.stderr,
        run.code
    );
    run
}

async fn apply_yaml(client: &Client, yaml: &str) {
    for doc in yaml.split("\n---\n") {
        let v: Value = serde_yaml_ng::from_str(doc).unwrap();
        let gvk = kube::core::GroupVersionKind::try_from(&kube::core::TypeMeta {
            api_version: v["apiVersion"].as_str().unwrap().into(),
            kind: v["kind"].as_str().unwrap().into(),
        })
        .unwrap();
        let (ar, caps) = kube::discovery::pinned_kind(client, &gvk).await.unwrap();
        let name = v["metadata"]["name"].as_str().unwrap();
        let api: Api<kube::core::DynamicObject> = match v["metadata"]["namespace"].as_str() {
            Some(ns) if caps.scope == kube::discovery::Scope::Namespaced => {
                Api::namespaced_with(client.clone(), ns, &ar)
            }
            _ => Api::all_with(client.clone(), &ar),
        };
        api.patch(name, &PatchParams::apply("test"), &Patch::Apply(&v))
            .await
            .unwrap();
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn sandbox_yaml(name: &str, baseline: &str, description: &str) -> String {
    format!(
        "apiVersion: spur.dev/v1alpha1\nkind: Sandbox\nmetadata:\n  name: {name}\nspec:\n  description: {description}\n  labels: {{team: checkout}}\n  forks:\n    - forkOf: {{kind: Deployment, namespace: shop, name: {baseline}}}\n"
    )
}

const BASELINE: &str = r#"apiVersion: v1
kind: Namespace
metadata: {name: shop}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: api, namespace: shop}
spec:
  selector: {matchLabels: {app: api}}
  template:
    metadata: {labels: {app: api}}
    spec:
      containers: [{name: api, image: "shop/api:1", ports: [{containerPort: 8080}]}]
---
apiVersion: v1
kind: Service
metadata: {name: api, namespace: shop}
spec:
  selector: {app: api}
  ports: [{port: 80, targetPort: 8080}]
"#;

/// A user of namespace `team-b`: Sandboxes and RouteGroups cluster-wide (as the chart's
/// docs suggest for developers), nothing in `shop`.
const DEVELOPER: &str = r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: sandbox-user}
rules:
  - apiGroups: [spur.dev]
    resources: [sandboxes, routegroups]
    verbs: [get, list, watch, create, patch, delete]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: dev-sandbox-user}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: sandbox-user}
subjects: [{kind: ServiceAccount, name: dev, namespace: team-b}]
"#;

/// What `dev` gets later: reading ForkedWorkloads in `shop`, nothing else there.
const FORKED_WORKLOAD_READER: &str = r#"apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: forkedworkload-reader, namespace: shop}
rules:
  - apiGroups: [spur.dev]
    resources: [forkedworkloads]
    verbs: [get]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: dev-forkedworkload-reader, namespace: shop}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: forkedworkload-reader}
subjects: [{kind: ServiceAccount, name: dev, namespace: team-b}]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_and_routegroup_verbs_against_the_apiserver() {
    let api = KubeApi::start().await.unwrap();
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/crds");
    for entry in std::fs::read_dir(&crds).unwrap() {
        api.install_crd_file(&entry.unwrap().path()).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let admin = d.join("admin.yaml");
    api.write_kubeconfig(&admin).unwrap();
    let client = api.client();
    apply_yaml(&client, BASELINE).await;
    let log = std::fs::File::create(d.join("operator.log")).unwrap();
    let _operator = tokio::process::Command::new(role_bin("spur-operator"))
        .arg("--kubeconfig")
        .arg(&admin)
        .args([
            "--metrics-addr",
            "127.0.0.1:0",
            "--webhook-addr",
            "127.0.0.1:0",
        ])
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    // Apply: created, unchanged, configured, as kubectl says it.
    let file = write(d, "sb.yaml", &sandbox_yaml("feature-x", "api", "first"));
    let f = file.to_str().unwrap();
    let run = spur(&admin, &["sandbox", "apply", "-f", f]).await;
    assert_eq!(
        (run.code, run.stdout.as_str()),
        (0, "sandbox feature-x created\n")
    );
    let run = spur(&admin, &["sandbox", "apply", "-f", f]).await;
    assert_eq!(
        (run.code, run.stdout.as_str()),
        (0, "sandbox feature-x unchanged\n")
    );
    write(d, "sb.yaml", &sandbox_yaml("feature-x", "api", "second"));
    let run = spur(&admin, &["sandbox", "apply", "-f", f]).await;
    assert_eq!(
        (run.code, run.stdout.as_str()),
        (0, "sandbox feature-x configured\n")
    );
    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    let sb = sandboxes.get("feature-x").await.unwrap();
    assert_eq!(sb.spec.description.as_deref(), Some("second"));
    assert!(
        sb.metadata
            .managed_fields
            .unwrap_or_default()
            .iter()
            .any(|m| m.manager.as_deref() == Some("spur")),
        "applied under the field manager spur"
    );

    // A file with one bad document applies nothing.
    let bad = write(
        d,
        "bad.yaml",
        &format!(
            "{}---\n{}",
            sandbox_yaml("good-one", "api", "x"),
            sandbox_yaml("Bad_Name", "api", "x")
        ),
    );
    let run = spur(&admin, &["sandbox", "apply", "-f", bad.to_str().unwrap()]).await;
    assert_eq!(run.code, 1);
    assert!(
        run.stderr.contains("document 2 (Sandbox Bad_Name)")
            && run.stderr.contains("metadata.name"),
        "{}",
        run.stderr
    );
    assert!(sandboxes.get_opt("good-one").await.unwrap().is_none());
    // The API server's own refusal reaches the user with the field it names (here the
    // schema's: no webhook runs in this tier; the node tier has the webhook's).
    let unknown = write(
        d,
        "unknown.yaml",
        &sandbox_yaml("strict", "api", "x").replace("  description: x\n", "  descripton: x\n"),
    );
    let run = spur(
        &admin,
        &["sandbox", "apply", "-f", unknown.to_str().unwrap()],
    )
    .await;
    assert_eq!(run.code, 1);
    assert!(
        run.stderr
            .contains(".spec.descripton: field not declared in schema"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("ERROR"), "said once: {}", run.stderr);
    // A file whose second document the server refuses applies neither (a dry run of all first).
    let half = write(
        d,
        "half.yaml",
        &format!(
            "{}---\n{}",
            sandbox_yaml("first-half", "api", "x"),
            sandbox_yaml("second-half", "api", "x")
                .replace("  description: x\n", "  descripton: x\n")
        ),
    );
    let run = spur(&admin, &["sandbox", "apply", "-f", half.to_str().unwrap()]).await;
    assert_eq!(run.code, 1);
    assert!(
        run.stderr.contains("applying Sandbox second-half"),
        "{}",
        run.stderr
    );
    assert!(sandboxes.get_opt("first-half").await.unwrap().is_none());

    // List and get, for people and for scripts.
    let run = spur(&admin, &["sandbox", "list"]).await;
    assert_eq!(run.code, 0);
    let mut lines = run.stdout.lines();
    assert!(lines.next().unwrap().starts_with("NAME"), "{}", run.stdout);
    assert!(
        lines.next().unwrap().starts_with("feature-x "),
        "{}",
        run.stdout
    );
    let run = spur(&admin, &["sandbox", "list", "-o", "json"]).await;
    let list: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(list["items"][0]["metadata"]["name"], "feature-x");
    let run = spur(&admin, &["sandbox", "get", "feature-x", "-o", "yaml"]).await;
    let got: Value = serde_yaml_ng::from_str(&run.stdout).unwrap();
    assert_eq!(got["spec"]["description"], "second");
    let run = spur(&admin, &["sandbox", "get", "nope"]).await;
    assert_eq!(run.code, 1);
    assert!(
        run.stderr.contains("no Sandbox named nope"),
        "{}",
        run.stderr
    );

    // --wait with no kubelet: progress up to the fork's Deployment, then the time limit.
    let run = spur(
        &admin,
        &["sandbox", "apply", "-f", f, "--wait", "--timeout", "4s"],
    )
    .await;
    assert_eq!(run.code, 4, "timed out");
    let fw = names::fork_name(
        "feature-x",
        &WorkloadRef::new(WorkloadKind::Deployment, "shop", "api"),
    );
    for line in [
        "sandbox feature-x unchanged".to_string(),
        "] sandbox: applied".to_string(),
        "] sandbox: routing key ".to_string(),
        format!("] shop/api: ForkedWorkload shop/{fw} created"),
        format!("] shop/api: Deployment shop/{fw} created"),
    ] {
        assert!(run.stdout.contains(&line), "{line:?} in\n{}", run.stdout);
    }
    assert!(
        run.stderr
            .contains("sandbox feature-x is not ready after 4.0s: waiting for"),
        "{}",
        run.stderr
    );
    // A fork pod whose image cannot be pulled: the kubelet's reason.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "fork-pod", "labels": {"spur.dev/fork": fw}},
        "spec": {"containers": [{"name": "api", "image": "shop/api:does-not-exist"}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    pods.patch_status(
        "fork-pod",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "api", "image": "shop/api:does-not-exist", "imageID": "",
                "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": "ErrImagePull",
                    "message": "failed to pull and unpack image \"shop/api:does-not-exist\": not found"}}}]
        }})),
    )
    .await
    .unwrap();
    // The kubelet retries a pull: trouble first, not yet a failure (here the time limit ends
    // the wait before the trouble has lasted 20 s)...
    let run = spur(
        &admin,
        &["sandbox", "apply", "-f", f, "--wait", "--timeout", "8s"],
    )
    .await;
    assert_eq!(run.code, 4, "timed out, not failed");
    assert!(
        run.stdout.contains(
            "] pod shop/fork-pod, container api: ErrImagePull: failed to pull and unpack image \"shop/api:does-not-exist\": not found (the kubelet retries; a failure if it lasts 20s)"
        ),
        "{}",
        run.stdout
    );
    // ... and a failure once it has lasted.
    let started = std::time::Instant::now();
    let run = spur(
        &admin,
        &["sandbox", "apply", "-f", f, "--wait", "--timeout", "60s"],
    )
    .await;
    assert_eq!(run.code, 3, "failed");
    assert!(started.elapsed() >= std::time::Duration::from_secs(20));
    assert!(
        run.stdout.contains("] shop/api: pod fork-pod created\n"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("] shop/api: scheduled\n"),
        "{}",
        run.stdout
    );
    assert!(
        run.stderr
            .contains("sandbox feature-x failed: ErrImagePull: failed to pull and unpack image")
            && run
                .stderr
                .contains("look at: pod shop/fork-pod, container api"),
        "{}",
        run.stderr
    );
    // -o json keeps stdout for the objects: progress and the failure go to stderr.
    let run = spur(
        &admin,
        &["sandbox", "apply", "-f", f, "--wait", "-o", "json"],
    )
    .await;
    assert_eq!(run.code, 3);
    assert!(run.stdout.is_empty(), "{}", run.stdout);
    assert!(run.stderr.contains("] sandbox: applied"), "{}", run.stderr);

    // The operator's check fails: its reason and the Sandbox to look at.
    let missing = write(d, "missing.yaml", &sandbox_yaml("missing", "nope", "x"));
    let run = spur(
        &admin,
        &[
            "sandbox",
            "apply",
            "-f",
            missing.to_str().unwrap(),
            "--wait",
        ],
    )
    .await;
    assert_eq!(run.code, 3);
    assert!(
        run.stderr
            .contains("sandbox missing failed: BaselineNotFound: ")
            && run.stderr.contains("look at: Sandbox missing"),
        "{}",
        run.stderr
    );

    // A user of another namespace: may apply Sandboxes, reads nothing of `shop` through the
    // command (it acts with the user's rights, not a component's), and is told so.
    apply_yaml(&client, DEVELOPER).await;
    let token = api.service_account_token("team-b", "dev").await.unwrap();
    let dev = d.join("dev.yaml");
    api.write_kubeconfig_with_token(&dev, &token).unwrap();
    let theirs = write(d, "theirs.yaml", &sandbox_yaml("dev-x", "api", "dev"));
    let theirs = theirs.to_str().unwrap();
    // Then given `get` on ForkedWorkloads in `shop` (not pods): the fork's steps from it, and
    // its pods still not shown.
    for (grant, unreadable) in [
        (None, "its ForkedWorkload is"),
        (Some(FORKED_WORKLOAD_READER), "its pods are"),
    ] {
        if let Some(grant) = grant {
            apply_yaml(&client, grant).await;
        }
        let args = [
            "sandbox",
            "apply",
            "-f",
            theirs,
            "--wait",
            "--timeout",
            "4s",
        ];
        let run = spur(&dev, &args).await;
        assert_eq!(run.code, 4, "{}", run.stderr);
        let line = format!("] shop/api: ({unreadable} not readable: forbidden to you");
        assert!(run.stdout.contains(&line), "{line:?} in {}", run.stdout);
        assert!(!run.stdout.contains("pod fork-pod"), "{}", run.stdout);
    }
    // Nor may they read pods through `get`, or delete what RBAC does not give them.
    let nobody = d.join("nobody.yaml");
    let token = api.service_account_token("team-c", "nobody").await.unwrap();
    api.write_kubeconfig_with_token(&nobody, &token).unwrap();
    for args in [
        &["sandbox", "list"][..],
        &["sandbox", "get", "feature-x"],
        &["sandbox", "delete", "feature-x"],
        &["sandbox", "apply", "-f", f],
    ] {
        let run = spur(&nobody, args).await;
        assert_eq!(run.code, 1, "{args:?}");
        assert!(run.stderr.contains("forbidden"), "{args:?}: {}", run.stderr);
    }
    assert!(sandboxes.get_opt("feature-x").await.unwrap().is_some());

    // Route groups: the same verbs.
    let rg = write(
        d,
        "rg.yaml",
        "apiVersion: spur.dev/v1alpha1\nkind: RouteGroup\nmetadata: {name: checkout}\nspec:\n  match: {label: {key: team, value: checkout}}\n",
    );
    let rg = rg.to_str().unwrap();
    let run = spur(&admin, &["routegroup", "apply", "-f", rg]).await;
    assert_eq!(
        (run.code, run.stdout.as_str()),
        (0, "route group checkout created\n")
    );
    let run = spur(&admin, &["sandbox", "apply", "-f", rg]).await;
    assert_eq!(run.code, 1);
    assert!(
        run.stderr.contains("document 1 is RouteGroup"),
        "{}",
        run.stderr
    );
    let run = spur(
        &admin,
        &["routegroup", "apply", "-f", rg, "--wait", "--timeout", "3s"],
    )
    .await;
    assert_eq!(run.code, 4, "no matched sandbox is ready");
    assert!(
        run.stdout
            .contains("] route group: matches dev-x, feature-x, missing (0 ready)"),
        "{}",
        run.stdout
    );
    let run = spur(&admin, &["routegroup", "list"]).await;
    assert!(
        run.stdout.lines().nth(1).unwrap().starts_with("checkout "),
        "{}",
        run.stdout
    );
    let run = spur(&admin, &["routegroup", "get", "checkout"]).await;
    assert!(run.stdout.contains("Sandboxes:"), "{}", run.stdout);
    let run = spur(&admin, &["routegroup", "delete", "checkout", "--wait"]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);

    // Delete --wait: until the sandbox and its ForkedWorkload are gone.
    let run = spur(
        &admin,
        &[
            "sandbox",
            "delete",
            "feature-x",
            "missing",
            "dev-x",
            "--wait",
            "--timeout",
            "60s",
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.contains("sandbox feature-x deleted"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout
            .contains(&format!("] feature-x ForkedWorkload shop/{fw}: removed")),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("gone in "), "{}", run.stdout);
    let fws: Api<ForkedWorkload> = Api::namespaced(client.clone(), "shop");
    assert!(fws.get_opt(&fw).await.unwrap().is_none());
    assert!(
        sandboxes
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    let run = spur(&admin, &["sandbox", "delete", "feature-x"]).await;
    assert_eq!(run.code, 1);
    assert!(
        run.stderr.contains("no Sandbox named feature-x"),
        "{}",
        run.stderr
    );
    let run = spur(
        &admin,
        &["sandbox", "delete", "feature-x", "--ignore-not-found"],
    )
    .await;
    assert_eq!(run.code, 0);
}
