//! The harness against the real kube-apiserver and etcd it starts: objects round-trip, a CRD from
//! YAML is served and validated, authentication and RBAC are enforced, a kubeconfig written for a
//! child process works, and nothing outlives the harness (drop, or the test process dying).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{ApiResource, DynamicObject, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use spur_kube_harness::KubeApi;

const WIDGET_CRD: &str = r#"
# A leading comment and an empty document, as generated files have.
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.harness.spur.dev
spec:
  group: harness.spur.dev
  scope: Namespaced
  names: { kind: Widget, listKind: WidgetList, plural: widgets, singular: widget }
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              required: [size]
              properties:
                size: { type: integer, minimum: 1 }
"#;

fn named(namespace: Option<&str>, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        ..ObjectMeta::default()
    }
}

fn api_status(result: Result<impl std::fmt::Debug, kube::Error>) -> u16 {
    match result {
        Err(kube::Error::Api(status)) => status.code,
        other => panic!("expected an API error status, got {other:?}"),
    }
}

fn port_of(url: &str) -> SocketAddr {
    let authority = url.rsplit("//").next().unwrap();
    authority.parse().unwrap()
}

/// Whether `pid` is a live process. A zombie counts as gone: a killed child whose parent already
/// died waits for init to reap it, and an init that never reaps is common in containers.
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the parenthesised command name, which may itself contain ") ".
    let state = stat
        .rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next());
    !matches!(state, Some('Z' | 'X') | None)
}

fn widget(name: &str, size: i64) -> DynamicObject {
    let resource = ApiResource {
        group: "harness.spur.dev".into(),
        version: "v1".into(),
        api_version: "harness.spur.dev/v1".into(),
        kind: "Widget".into(),
        plural: "widgets".into(),
    };
    DynamicObject::new(name, &resource).data(serde_json::json!({ "spec": { "size": size } }))
}

fn widgets(client: Client, namespace: &str) -> Api<DynamicObject> {
    let resource = ApiResource {
        group: "harness.spur.dev".into(),
        version: "v1".into(),
        api_version: "harness.spur.dev/v1".into(),
        kind: "Widget".into(),
        plural: "widgets".into(),
    };
    Api::namespaced_with(client, namespace, &resource)
}

#[tokio::test]
async fn serves_objects_and_custom_resources_then_leaves_nothing_behind() {
    let api = KubeApi::start().await.unwrap();
    let client = api.client();

    // Core objects round-trip through etcd.
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: named(None, "harness"),
                ..Namespace::default()
            },
        )
        .await
        .unwrap();
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), "harness");
    config_maps
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: named(Some("harness"), "settings"),
                data: Some(BTreeMap::from([("colour".to_owned(), "blue".to_owned())])),
                ..ConfigMap::default()
            },
        )
        .await
        .unwrap();
    let read = config_maps.get("settings").await.unwrap();
    assert_eq!(read.data.unwrap()["colour"], "blue");
    assert!(read.metadata.uid.is_some(), "the server assigns a uid");

    // A CRD from YAML is served as soon as install returns, with its schema enforced.
    api.install_crd_yaml(WIDGET_CRD).await.unwrap();
    let widgets = widgets(client.clone(), "harness");
    widgets
        .create(&PostParams::default(), &widget("small", 1))
        .await
        .unwrap();
    let listed = widgets.list(&Default::default()).await.unwrap();
    let names: Vec<_> = listed
        .items
        .iter()
        .map(|w| w.metadata.name.clone())
        .collect();
    assert_eq!(names, [Some("small".to_owned())]);
    assert_eq!(listed.items[0].data["spec"]["size"], 1);
    assert_eq!(
        api_status(
            widgets
                .create(&PostParams::default(), &widget("empty", 0))
                .await
        ),
        422,
        "size: 0 breaks the CRD's minimum"
    );
    // Installing the same CRD again is a no-op, not a conflict.
    api.install_crd_yaml(WIDGET_CRD).await.unwrap();

    // A wrong token is refused outright.
    let stranger = api.client_with_token("not-the-token").await.unwrap();
    let stranger_namespaces: Api<Namespace> = Api::all(stranger);
    assert_eq!(
        api_status(stranger_namespaces.list(&Default::default()).await),
        401
    );

    // A kubeconfig written for a child process connects as the admin, through kube's own loader.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    api.write_kubeconfig(&path).unwrap();
    let from_file = Config::from_custom_kubeconfig(
        Kubeconfig::read_from(&path).unwrap(),
        &KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(from_file.cluster_url.to_string(), format!("{}/", api.url()));
    let from_file: Api<ConfigMap> =
        Api::namespaced(Client::try_from(from_file).unwrap(), "harness");
    assert!(from_file.get_opt("settings").await.unwrap().is_some());

    // Drop stops both processes, closes both ports and removes the directory.
    let pids = [api.apiserver_pid(), api.etcd_pid()];
    let ports = [port_of(api.url()), port_of(api.etcd_url())];
    let dir = api.dir().to_path_buf();
    assert!(pids.iter().all(|&pid| alive(pid)));
    drop(api);
    for pid in pids {
        assert!(!alive(pid), "process {pid} outlived the harness");
    }
    for port in ports {
        assert!(
            std::net::TcpStream::connect_timeout(&port, Duration::from_secs(1)).is_err(),
            "{port} still accepts connections"
        );
    }
    assert!(!dir.exists(), "{} was not removed", dir.display());
}

#[tokio::test]
async fn service_account_tokens_are_subject_to_rbac() {
    let api = KubeApi::start().await.unwrap();
    let token = api.service_account_token("team", "reader").await.unwrap();
    let reader: Api<ConfigMap> =
        Api::namespaced(api.client_with_token(&token).await.unwrap(), "team");

    assert_eq!(api_status(reader.list(&Default::default()).await), 403);

    let admin = api.client();
    Api::<Role>::namespaced(admin.clone(), "team")
        .create(
            &PostParams::default(),
            &Role {
                metadata: named(Some("team"), "read-config"),
                rules: Some(vec![PolicyRule {
                    api_groups: Some(vec![String::new()]),
                    resources: Some(vec!["configmaps".to_owned()]),
                    verbs: vec!["get".to_owned(), "list".to_owned()],
                    ..PolicyRule::default()
                }]),
            },
        )
        .await
        .unwrap();
    Api::<RoleBinding>::namespaced(admin, "team")
        .create(
            &PostParams::default(),
            &RoleBinding {
                metadata: named(Some("team"), "reader-reads-config"),
                role_ref: RoleRef {
                    api_group: "rbac.authorization.k8s.io".to_owned(),
                    kind: "Role".to_owned(),
                    name: "read-config".to_owned(),
                },
                subjects: Some(vec![Subject {
                    kind: "ServiceAccount".to_owned(),
                    name: "reader".to_owned(),
                    namespace: Some("team".to_owned()),
                    ..Subject::default()
                }]),
            },
        )
        .await
        .unwrap();

    // The RBAC authorizer serves from an informer cache, so the binding takes effect shortly after.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match reader.list(&Default::default()).await {
            Ok(_) => break,
            Err(kube::Error::Api(status)) if status.code == 403 && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the bound ServiceAccount still cannot list ConfigMaps: {e}"),
        }
    }
    let create = reader
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: named(Some("team"), "nope"),
                ..ConfigMap::default()
            },
        )
        .await;
    assert_eq!(api_status(create), 403, "the Role grants no create");
}

/// Run only as a child of `children_die_with_the_test_process`: starts the harness, prints the
/// pids, and waits to be killed.
#[tokio::test]
#[ignore = "helper: run by children_die_with_the_test_process"]
async fn helper_start_and_wait_for_sigkill() {
    if std::env::var_os("SPUR_KUBE_HARNESS_KILL_HELPER").is_none() {
        return;
    }
    let api = KubeApi::start().await.unwrap();
    println!("pids {} {}", api.apiserver_pid(), api.etcd_pid());
    std::future::pending::<()>().await;
}

/// A test process killed outright (a runner's timeout, the OOM killer) runs no destructor; the
/// watchdogs must still take kube-apiserver and etcd down.
#[test]
fn children_die_with_the_test_process() {
    let mut helper = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "helper_start_and_wait_for_sigkill",
            "--ignored",
            "--nocapture",
        ])
        .env("SPUR_KUBE_HARNESS_KILL_HELPER", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(helper.stdout.take().unwrap());
    let pids: Vec<u32> = stdout
        .lines()
        .map_while(Result::ok)
        .find_map(|line| line.strip_prefix("pids ").map(str::to_owned))
        .expect("the helper printed no pids (its stderr is above)")
        .split(' ')
        .map(|pid| pid.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2);
    assert!(pids.iter().all(|&pid| alive(pid)));

    helper.kill().unwrap();
    helper.wait().unwrap();

    // The watchdogs notice the closed pipe at once; the bound only covers a busy machine.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&pid| alive(pid)) {
        assert!(
            Instant::now() < deadline,
            "kube-apiserver/etcd ({pids:?}) outlived the killed test process"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
