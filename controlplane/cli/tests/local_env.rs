//! `spur local env` against a real kube-apiserver (issue 45, point 3): a local workload's
//! process gets its baseline container's resolved environment and mounted files, and the
//! Sandbox's own env and files on top, read with the kubeconfig's user's rights only. A
//! developer with rights in the baseline's namespace gets them; one whose rights are in another
//! namespace gets a clear refusal and nothing on disk, though the Sandbox (cluster-scoped) is
//! readable to them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::Api;
use kube::api::{DynamicObject, PostParams};
use serde_json::json;
use spur_api::Sandbox;
use spur_kube_harness::KubeApi;

/// Creates `v` as a `K` in `ns` (cluster-scoped objects: through [`DynamicObject`]).
async fn create<K>(client: &kube::Client, ns: Option<&str>, v: serde_json::Value)
where
    K: kube::Resource<DynamicType = ()>,
{
    let ar = kube::api::ApiResource::erase::<K>(&());
    let api: Api<DynamicObject> = match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let mut v = v;
    v["apiVersion"] = json!(ar.api_version);
    v["kind"] = json!(ar.kind);
    api.create(&PostParams::default(), &serde_json::from_value(v).unwrap())
        .await
        .unwrap();
}

/// A kubeconfig for ServiceAccount `dev/<name>`, which may read Sandboxes and, in `ns`, `get`
/// `resources`.
async fn developer(api: &KubeApi, name: &str, ns: &str, resources: &[&str]) -> std::path::PathBuf {
    let admin = api.client();
    let token = api.service_account_token("dev", name).await.unwrap();
    let subject = json!([{"kind": "ServiceAccount", "name": name, "namespace": "dev"}]);
    create::<ClusterRoleBinding>(&admin, None, json!({
        "metadata": {"name": format!("{name}-sandboxes")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "sandbox-reader"},
        "subjects": subject,
    }))
    .await;
    create::<Role>(
        &admin,
        Some(ns),
        json!({
            "metadata": {"name": format!("{name}-reads")},
            "rules": [{"apiGroups": ["", "apps"], "resources": resources, "verbs": ["get"]}],
        }),
    )
    .await;
    create::<RoleBinding>(&admin, Some(ns), json!({
        "metadata": {"name": format!("{name}-reads")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": format!("{name}-reads")},
        "subjects": subject,
    }))
    .await;
    let path = api.dir().join(format!("{name}.kubeconfig"));
    api.write_kubeconfig_with_token(&path, &token).unwrap();
    path
}

fn spur_local_env(kubeconfig: &Path, files: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_spur"))
        .args(["local", "env", "--sandbox", "sb", "--kubeconfig"])
        .arg(kubeconfig)
        .arg("--files")
        .arg(files)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_env_and_files_come_with_the_users_own_rights() {
    let api = KubeApi::start().await.unwrap();
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/crds");
    for entry in std::fs::read_dir(&crds).unwrap() {
        api.install_crd_file(&entry.unwrap().path()).await.unwrap();
    }
    let admin = api.client();
    for ns in ["shop", "team-b"] {
        create::<Namespace>(&admin, None, json!({"metadata": {"name": ns}})).await;
    }
    create::<ConfigMap>(
        &admin,
        Some("shop"),
        json!({
            "metadata": {"name": "api-config"},
            "data": {"level": "debug", "app.yaml": "port: 8080\n"},
        }),
    )
    .await;
    create::<Secret>(
        &admin,
        Some("shop"),
        json!({
            "metadata": {"name": "api-db"},
            "stringData": {"password": "pw-of-shop"},
        }),
    )
    .await;
    create::<Deployment>(&admin, Some("shop"), json!({
        "metadata": {"name": "api"},
        "spec": {
            "selector": {"matchLabels": {"app": "api"}},
            "template": {
                "metadata": {"labels": {"app": "api"}},
                "spec": {
                    "containers": [{
                        "name": "app", "image": "api:1",
                        "env": [
                            {"name": "DB_HOST", "value": "db.shop"},
                            {"name": "DB_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "api-db", "key": "password"}}},
                            {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "api-config", "key": "level"}}}
                        ],
                        "volumeMounts": [
                            {"name": "config", "mountPath": "/etc/api"},
                            {"name": "db", "mountPath": "/var/run/db", "readOnly": true}
                        ]
                    }],
                    "volumes": [
                        {"name": "config", "configMap": {"name": "api-config", "items": [{"key": "app.yaml", "path": "app.yaml"}]}},
                        {"name": "db", "secret": {"secretName": "api-db"}}
                    ]
                }
            }
        }
    }))
    .await;
    create::<Sandbox>(
        &admin,
        None,
        json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "sb"},
            "spec": {
                "workstation": "ws-1",
                "local": [{
                    "name": "api",
                    "from": {"kind": "Deployment", "namespace": "shop", "name": "api"},
                    "mappings": [{"port": 8080, "toLocal": "localhost:8080"}],
                    "env": [{"name": "LEVEL", "value": "trace"}],
                    "files": [{"path": "/etc/api/extra.txt", "value": "from the sandbox"}]
                }]
            }
        }),
    )
    .await;
    create::<ClusterRole>(
        &admin,
        None,
        json!({
            "metadata": {"name": "sandbox-reader"},
            "rules": [{"apiGroups": ["spur.dev"], "resources": ["sandboxes"], "verbs": ["get"]}],
        }),
    )
    .await;

    // Shop's developer: the baseline's environment, the Sandbox's LEVEL over it, the files.
    let shop = developer(
        &api,
        "shop-dev",
        "shop",
        &["deployments", "configmaps", "secrets"],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let files = dir.path().join("files");
    let out = spur_local_env(&shop, &files);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout,
        "DB_HOST=\"db.shop\"\nDB_PASSWORD=\"pw-of-shop\"\nLEVEL=\"trace\"\n"
    );
    let read = |p: &str| std::fs::read_to_string(files.join(p)).unwrap();
    assert_eq!(read("etc/api/app.yaml"), "port: 8080\n");
    assert_eq!(read("etc/api/extra.txt"), "from the sandbox");
    assert_eq!(read("var/run/db/password"), "pw-of-shop");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(files.join("var/run/db/password"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    // Someone who may read shop's Deployments and ConfigMaps but not its Secrets: refused at
    // the Secret, saying so; nothing written, no secret printed.
    let peek = developer(&api, "peek", "shop", &["deployments", "configmaps"]).await;
    let files_p = dir.path().join("files-p");
    let out = spur_local_env(&peek, &files_p);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot read Secret shop/api-db") && stderr.contains("forbidden"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("pw-of-shop") && out.stdout.is_empty(),
        "{stderr}"
    );
    assert!(!files_p.exists(), "files written for a refused user");

    // Another namespace's developer reads the Sandbox but none of shop's objects: refused too.
    let other = developer(
        &api,
        "b-dev",
        "team-b",
        &["deployments", "configmaps", "secrets"],
    )
    .await;
    let files_b = dir.path().join("files-b");
    let out = spur_local_env(&other, &files_b);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot read") && stderr.contains("forbidden"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("pw-of-shop") && out.stdout.is_empty(),
        "{stderr}"
    );
    assert!(!files_b.exists(), "files written for a refused user");
}
