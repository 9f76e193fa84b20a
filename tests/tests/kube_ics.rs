//! The io context server against a real kube-apiserver (RBAC enforced, the chart's rules), with
//! the real `spur-io` binary as its client: a step pod reads only its own unit's inputs and
//! writes only its unit's declared outputs, also when its script fails; another pod, another
//! context, another audience and an undeclared output are refused; no value is logged.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use k8s_openapi::ByteString;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use prometheus_client::registry::Registry;
use serde_json::json;
use spur_api::ObjectLifecycleMethods;
use spur_e2e::kube as kt;
use spur_kube_harness::KubeApi;
use tokio_util::sync::CancellationToken;

const STEPS: &str = "spur-resources";
/// Where the io context Secrets live (the chart's `resources.contextNamespace`).
const CONTEXTS: &str = "spur-io-contexts";
const SA: &str = "spur-resource-runner";
const SECRET_A: &str = "first-output-of-context-a";
const SECRET_B: &str = "first-output-of-context-b";

/// A pod object (never run: there is no kubelet here) the token can be bound to.
async fn pod(client: &Client, name: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), STEPS);
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"serviceAccountName": SA, "containers": [{"name": "step", "image": "x"}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &p).await.unwrap()
}

async fn token(api: &KubeApi, audience: &str, pod: Option<&Pod>) -> String {
    api.token_request(
        STEPS,
        SA,
        TokenRequestSpec {
            audiences: vec![audience.into()],
            expiration_seconds: Some(3600),
            bound_object_ref: pod.map(|p| BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(p.name_any()),
                uid: p.uid(),
            }),
        },
    )
    .await
    .unwrap()
}

/// OLM `name` (io context `name`): unit `first` outputs `x`; unit `second` reads `first.x` and a
/// constant, and declares outputs `y` and `z`. Its status records `second`'s pod.
async fn olm(client: &Client, name: &str, second_pod: &Pod) {
    let api: Api<ObjectLifecycleMethods> = Api::all(client.clone());
    let o: ObjectLifecycleMethods = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "ObjectLifecycleMethods",
        "metadata": {"name": name},
        "spec": {"ioContextName": name, "preStart": [
            {"name": "first", "outputs": [{"name": "x"}],
             "execUnitTemplate": {"podTemplate": {}, "script": "#!/bin/sh\n"}},
            {"name": "second",
             "inputs": [
                 {"name": "x", "iocontext": {"name": name, "key": "first.x"}},
                 {"name": "greeting", "value": "hello"}
             ],
             "outputs": [{"name": "y"}, {"name": "z"}],
             "execUnitTemplate": {"podTemplate": {}, "script": "#!/bin/sh\n"}}
        ]}
    }))
    .unwrap();
    api.create(&PostParams::default(), &o).await.unwrap();
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Starting", "preStart": [
            {"name": "first", "phase": "Succeeded", "attempts": 1},
            {"name": "second", "phase": "Running", "attempts": 1, "execUnit": {
                "name": second_pod.name_any(), "namespace": STEPS, "uid": second_pod.uid().unwrap()
            }}
        ]}})),
    )
    .await
    .unwrap();
}

async fn context(client: &Client, name: &str, x: &str) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), CONTEXTS);
    let s = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(format!("spur-io-{name}")),
            ..Default::default()
        },
        data: Some(
            [("first.x".to_string(), ByteString(x.as_bytes().to_vec()))]
                .into_iter()
                .collect(),
        ),
        ..Default::default()
    };
    secrets.create(&PostParams::default(), &s).await.unwrap();
}

async fn context_data(client: &Client, name: &str) -> std::collections::BTreeMap<String, String> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), CONTEXTS);
    secrets
        .get(&format!("spur-io-{name}"))
        .await
        .unwrap()
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8(v.0).unwrap()))
        .collect()
}

/// `spur-io <args>` as unit `second` of `olm`, with `token`; (exit code, stderr).
fn spur_io(
    dir: &Path,
    server: &str,
    ca: &Path,
    token: &str,
    olm: &str,
    args: &[&str],
) -> (i32, String) {
    let token_file = dir.join("token");
    std::fs::write(&token_file, token).unwrap();
    let out = Command::new(spur_e2e::node::spur_bin("spur-io"))
        .args(args)
        .env("SPUR_IO_SERVER", server)
        .env("SPUR_IO_CA_FILE", ca)
        .env("SPUR_IO_TOKEN_FILE", &token_file)
        .env("SPUR_IO_OLM", olm)
        .env("SPUR_IO_WORKFLOW", "preStart")
        .env("SPUR_IO_UNIT", "second")
        .env("SPUR_IO_DIR", dir.join("io"))
        .output()
        .expect("run spur-io (cargo build --bin spur-io)");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_pod_reads_and_writes_only_its_own_unit() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, STEPS).await.unwrap();
    kt::ensure_namespace(&admin, CONTEXTS).await.unwrap();
    // The ServiceAccount exists before its pods (no ServiceAccount admission here).
    let _ = api.service_account_token(STEPS, SA).await.unwrap();
    let pod_a = pod(&admin, "a-second-1").await;
    let pod_b = pod(&admin, "b-second-1").await;
    olm(&admin, "a", &pod_a).await;
    olm(&admin, "b", &pod_b).await;
    context(&admin, "a", SECRET_A).await;
    context(&admin, "b", SECRET_B).await;

    // The server, as the chart runs it: its ServiceAccount, its rules, TLS.
    let ics_client = kt::chart_client(&api, "spur-ics", "ics-rules.yaml", None)
        .await
        .unwrap();
    kt::grant_in_namespace(&api, "spur-ics", CONTEXTS, "ics-namespace-rules.yaml")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    std::fs::write(dir.path().join("tls.crt"), cert.pem()).unwrap();
    std::fs::write(dir.path().join("tls.key"), key.serialize_pem()).unwrap();
    let ca = dir.path().join("ca.crt");
    std::fs::write(&ca, cert.pem()).unwrap();
    let server = spur_ics::Server::bind(
        spur_ics::Config {
            namespace: CONTEXTS.into(),
            listen: "127.0.0.1:0".parse().unwrap(),
            tls: Some(spur_serving::ServingTls::new(
                dir.path().join("tls.crt"),
                dir.path().join("tls.key"),
            )),
            audience: spur_ics::AUDIENCE.into(),
        },
        ics_client,
        spur_ics::Metrics::register(&mut Registry::default()),
    )
    .await
    .unwrap();
    let url = format!("https://localhost:{}", server.local_addr().port());
    let stop = CancellationToken::new();
    let served = tokio::spawn(server.run(stop.clone()));

    let token_a = token(&api, spur_ics::AUDIENCE, Some(&pod_a)).await;
    let work = dir.path().join("a");
    std::fs::create_dir_all(&work).unwrap();
    let run = |args: Vec<String>, olm: &'static str, token: String| {
        let work = work.clone();
        let url = url.clone();
        let ca = ca.clone();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            spur_io(&work, &url, &ca, &token, olm, &args)
        })
    };
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();

    // Its own unit: both inputs, the earlier unit's output among them.
    let (code, err) = run(
        s(&["init", "--script", "#!/bin/sh\necho hi\n"]),
        "a",
        token_a.clone(),
    )
    .await
    .unwrap();
    assert_eq!(code, 0, "{err}");
    let io = work.join("io");
    assert_eq!(std::fs::read_to_string(io.join("in/x")).unwrap(), SECRET_A);
    assert_eq!(
        std::fs::read_to_string(io.join("in/greeting")).unwrap(),
        "hello"
    );
    assert!(io.join("bin/spur-io").exists());

    // Another context's unit, with this pod's token: refused, nothing fetched.
    let (code, err) = run(s(&["init"]), "b", token_a.clone()).await.unwrap();
    assert_eq!(code, 1);
    assert!(err.contains("PermissionDenied"), "{err}");
    // An OLM that does not exist looks the same as one that is not yours.
    let (code, err) = run(s(&["init"]), "nope", token_a.clone()).await.unwrap();
    assert!(code == 1 && err.contains("PermissionDenied"), "{err}");
    // A token for another audience (the pod's API token, say) and a token not bound to a pod.
    let other_audience = token(&api, "https://kubernetes.default.svc", Some(&pod_a)).await;
    let (code, err) = run(s(&["init"]), "a", other_audience).await.unwrap();
    assert!(code == 1 && err.contains("Unauthenticated"), "{err}");
    let unbound = token(&api, spur_ics::AUDIENCE, None).await;
    let (code, err) = run(s(&["init"]), "a", unbound).await.unwrap();
    assert!(code == 1 && err.contains("not a pod-bound token"), "{err}");

    // The step: inputs as env and file; a failing script still stores what it left behind.
    let y_file = work.join("out-y");
    let z_file = work.join("out-z");
    let script = format!(
        "#!/bin/sh\nprintf '%s' \"$X\" > {y}\ncat {f} > /dev/null\necho partial\nexit 3\n",
        y = y_file.display(),
        f = work.join("in-file").display()
    );
    std::fs::write(io.join("script"), script).unwrap();
    let (code, err) = run(
        vec![
            "run".into(),
            "--env=X=x".into(),
            format!("--file={}=greeting", work.join("in-file").display()),
            format!("--export=y={}", y_file.display()),
            format!("--export=z={}", z_file.display()),
        ],
        "a",
        token_a.clone(),
    )
    .await
    .unwrap();
    assert_eq!(code, 3, "the script's exit code: {err}");
    assert!(
        err.contains("output z"),
        "the missing output is reported: {err}"
    );
    let data = context_data(&admin, "a").await;
    assert_eq!(data.get("second.y").map(String::as_str), Some(SECRET_A));
    assert!(!data.contains_key("second.z"));
    // The file input is there, private to its user.
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(work.join("in-file"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);

    // An output the unit does not declare: refused, nothing stored.
    std::fs::write(io.join("script"), "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::write(&z_file, "zz").unwrap();
    let (code, err) = run(
        s(&["run", "--export=undeclared=/etc/hostname"]),
        "a",
        token_a.clone(),
    )
    .await
    .unwrap();
    assert_eq!(
        code, 1,
        "a succeeded script whose outputs were refused fails: {err}"
    );
    assert!(err.contains("InvalidArgument"), "{err}");
    assert!(
        !context_data(&admin, "a")
            .await
            .contains_key("second.undeclared")
    );

    // Once the unit has finished, its outputs can no longer change.
    Api::<ObjectLifecycleMethods>::all(admin.clone())
        .patch_status(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"preStart": [
                {"name": "first", "phase": "Succeeded", "attempts": 1},
                {"name": "second", "phase": "Succeeded", "attempts": 1, "execUnit": {
                    "name": pod_a.name_any(), "namespace": STEPS, "uid": pod_a.uid().unwrap()
                }}
            ]}})),
        )
        .await
        .unwrap();
    let (code, err) = run(
        vec!["run".into(), format!("--export=z={}", z_file.display())],
        "a",
        token_a,
    )
    .await
    .unwrap();
    assert!(code == 1 && err.contains("FailedPrecondition"), "{err}");
    assert!(!context_data(&admin, "a").await.contains_key("second.z"));
    // Context b was never touched.
    assert_eq!(context_data(&admin, "b").await.len(), 1);

    stop.cancel();
    served.await.unwrap().unwrap();
    kt::assert_no_secret_logged(&[SECRET_A, SECRET_B]);
}
