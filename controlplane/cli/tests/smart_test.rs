//! `spur test run` against a real kube-apiserver: the sandbox's routing key read with the user's
//! own credentials, refused before anything is sent when the sandbox is not Ready or the user may
//! not read it (a ServiceAccount with `edit` in its own namespace only), `--key` without the
//! cluster, a bad file refused naming the step, and the exit codes a pipeline reads (0 nothing
//! changed, 1 findings, 2 an error). The services are loopback servers that answer as the
//! baseline or, for requests carrying the key, as the fork, and count what they received; the
//! sandbox's status is written as the operator writes it (no operator or node here: a test that
//! runs through real sidecars is the node tier's).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::api::rbac::v1::{ClusterRole, RoleBinding};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use spur_api::{Sandbox, SmartTest};
use spur_kube_harness::KubeApi;

const KEY: &str = "smartkey42";

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn spur(kubeconfig: &Path, args: &[&str]) -> Run {
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--kubeconfig", kubeconfig.to_str().unwrap()]);
    spur_bare(&all).await
}

async fn spur_bare(args: &[&str]) -> Run {
    let out: Output = tokio::process::Command::new(env!("CARGO_BIN_EXE_spur"))
        .args(args)
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

/// What the service received.
#[derive(Default)]
struct Seen {
    requests: AtomicU64,
    keyed: AtomicU64,
    /// The fork leaves `price` out of its items.
    fork_drops_price: AtomicBool,
}

/// A service that answers as the baseline, or as the fork for requests carrying [`KEY`]; every
/// answer has a fresh id and timestamp.
async fn service(seen: Arc<Seen>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: http::Request<_>| {
                    let n = seen.requests.fetch_add(1, Ordering::SeqCst);
                    let keyed = req
                        .headers()
                        .get("baggage")
                        .and_then(|v| v.to_str().ok())
                        .is_some_and(|v| v.contains(&format!("sd-routing-key={KEY}")));
                    if keyed {
                        seen.keyed.fetch_add(1, Ordering::SeqCst);
                    }
                    let price = !(keyed && seen.fork_drops_price.load(Ordering::SeqCst));
                    let mut item = json!({"id": format!("i{n}"), "name": "tea"});
                    if price {
                        item["price"] = json!(3);
                    }
                    let body = json!({"at": format!("t{n}"), "items": [item]});
                    async move {
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from(body.to_string()),
                        )))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    addr
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const DEVELOPER: &str = r#"{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
 "metadata": {"name": "dev-edit", "namespace": "team-b"},
 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
 "subjects": [{"kind": "ServiceAccount", "name": "dev", "namespace": "team-b"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spur_test_run_reads_the_key_with_the_users_rights_and_reports_what_changed() {
    let api = KubeApi::start().await.unwrap();
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/crds");
    for crd in [
        "sandboxes.spur.dev.yaml",
        "smarttests.spur.dev.yaml",
        "jobs.spur.dev.yaml",
    ] {
        api.install_crd_file(&crds.join(crd)).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let admin = d.join("admin.yaml");
    api.write_kubeconfig(&admin).unwrap();
    let client = api.client();

    let seen = Arc::new(Seen::default());
    let addr = service(seen.clone()).await;
    let test = write(
        d,
        "test.yaml",
        &format!(
            "steps:\n  - name: list\n    http: {{url: \"http://{addr}/items\"}}\n    checks: [{{status: 200}}, {{jsonPath: {{path: \"$.items[0].price\"}}}}]\n"
        ),
    );
    let test = test.to_str().unwrap();

    // The sandbox, with the key its operator would have written but not Ready yet.
    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    let sb: Sandbox = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "feature-x"},
        "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "api"}}]}
    }))
    .unwrap();
    sandboxes.create(&PostParams::default(), &sb).await.unwrap();
    // The status its operator would write: the key, and Ready as given.
    let set_ready = |ready: &'static str| {
        let sandboxes = sandboxes.clone();
        async move {
            let status = json!({"status": {"routingKey": KEY, "conditions": [{
                "type": "Ready", "status": ready, "reason": if ready == "True" { "Ready" } else { "ForksPending" },
                "message": "fork api: 0 of 1 pods ready", "lastTransitionTime": "2026-12-04T10:00:00Z"}]}});
            sandboxes
                .patch_status("feature-x", &PatchParams::default(), &Patch::Merge(status))
                .await
                .unwrap();
        }
    };
    set_ready("False").await;
    let run = spur(
        &admin,
        &["test", "run", "-f", test, "--sandbox", "feature-x"],
    )
    .await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr
            .contains("Sandbox feature-x is not Ready (ForksPending: fork api: 0 of 1 pods ready)"),
        "{}",
        run.stderr
    );
    assert_eq!(seen.requests.load(Ordering::SeqCst), 0, "nothing sent");

    // Ready: the sandbox's request carries the key (once), the baseline's two do not; every
    // answer has a new id and time, and none of that is a finding.
    set_ready("True").await;
    let run = spur(
        &admin,
        &["test", "run", "-f", test, "--sandbox", "feature-x"],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("no findings"), "{}", run.stdout);
    assert_eq!(
        (
            seen.requests.load(Ordering::SeqCst),
            seen.keyed.load(Ordering::SeqCst)
        ),
        (3, 1)
    );

    // The fork drops a field: exit 1, the finding and the failed check in JSON.
    seen.fork_drops_price.store(true, Ordering::SeqCst);
    let run = spur(
        &admin,
        &[
            "test",
            "run",
            "-f",
            test,
            "--sandbox",
            "feature-x",
            "-o",
            "json",
        ],
    )
    .await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    let finding = &report["findings"]["endpoints"][0]["findings"][0];
    assert_eq!(
        (finding["rank"].as_str(), finding["at"].as_str()),
        (Some("schema"), Some("$.items[*].price"))
    );
    assert_eq!(report["checksFailed"], 1);
    assert_eq!(
        report["steps"][0]["checks"][1]["sandbox"]["failed"],
        "absent"
    );
    assert_eq!(report["routingKey"], KEY);

    // A user of another namespace (`edit` in team-b only) may not read the sandbox: refused,
    // with the API server's words, and nothing is sent.
    let token = api.service_account_token("team-b", "dev").await.unwrap();
    let binding: RoleBinding = serde_json::from_str(DEVELOPER).unwrap();
    Api::<RoleBinding>::namespaced(client.clone(), "team-b")
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let dev = d.join("dev.yaml");
    api.write_kubeconfig_with_token(&dev, &token).unwrap();
    let before = seen.requests.load(Ordering::SeqCst);
    let run = spur(&dev, &["test", "run", "-f", test, "--sandbox", "feature-x"]).await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("reading Sandbox feature-x: forbidden"),
        "{}",
        run.stderr
    );
    assert!(!run.stdout.contains(KEY) && !run.stderr.contains(KEY));
    assert_eq!(seen.requests.load(Ordering::SeqCst), before, "nothing sent");

    // SmartTests of the cluster, read with the user's rights: an admin runs shop's; the user of
    // team-b, who may read SmartTests in team-b only (the chart's spur-smarttest-reader, bound
    // there), runs team-b's and is refused shop's, with nothing sent.
    let steps: Value = serde_yaml_ng::from_str::<Value>(&std::fs::read_to_string(test).unwrap())
        .unwrap()["steps"]
        .clone();
    for ns in ["shop", "team-b"] {
        if ns == "shop" {
            let namespace: k8s_openapi::api::core::v1::Namespace =
                serde_json::from_value(json!({"metadata": {"name": "shop"}})).unwrap();
            Api::all(client.clone())
                .create(&PostParams::default(), &namespace)
                .await
                .unwrap();
        }
        let st: SmartTest = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "SmartTest",
            "metadata": {"name": "list-items", "namespace": ns},
            "spec": {"steps": steps}
        }))
        .unwrap();
        Api::<SmartTest>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &st)
            .await
            .unwrap();
    }
    let reader: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": "spur-smarttest-reader"},
        "rules": serde_yaml_ng::from_str::<Value>(&std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/files/smarttest-reader-rules.yaml"),
        ).unwrap()).unwrap(),
    }))
    .unwrap();
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &reader)
        .await
        .unwrap();
    let read_here: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "dev-smarttests", "namespace": "team-b"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "spur-smarttest-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "dev", "namespace": "team-b"}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(client.clone(), "team-b")
        .create(&PostParams::default(), &read_here)
        .await
        .unwrap();

    // `spur test list`: which tests cover a sandbox, from the Services its forks sit behind (as
    // its status lists them). shop's list-items exercises `api`, which the sandbox forks.
    let covering: SmartTest = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "SmartTest",
        "metadata": {"name": "payments", "namespace": "shop"},
        "spec": {"steps": steps, "services": ["payments"]}
    }))
    .unwrap();
    let shop_tests = Api::<SmartTest>::namespaced(client.clone(), "shop");
    shop_tests
        .create(&PostParams::default(), &covering)
        .await
        .unwrap();
    shop_tests
        .patch(
            "list-items",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"services": ["api", "search"]}})),
        )
        .await
        .unwrap();
    let forks = json!({"status": {"forks": [{
        "forkOf": {"kind": "Deployment", "namespace": "shop", "name": "api"},
        "forkedWorkload": "feature-x-api",
        "services": [{"baselineService": "api", "sandboxService": "api-feature-x"}]}]}});
    sandboxes
        .patch_status("feature-x", &PatchParams::default(), &Patch::Merge(forks))
        .await
        .unwrap();
    let run = spur(
        &admin,
        &["test", "list", "-n", "shop", "--sandbox", "feature-x"],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let lines: Vec<Vec<&str>> = run
        .stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        lines,
        [
            vec!["NAME", "STEPS", "SERVICES", "COVERS", "feature-x"],
            vec!["list-items", "1", "api,search", "api"],
            vec!["payments", "1", "payments", "-"],
        ],
        "{}",
        run.stdout
    );
    // The user of team-b lists team-b's tests, and is refused shop's and the sandbox.
    let run = spur(&dev, &["test", "list", "-n", "team-b"]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("list-items"), "{}", run.stdout);
    let run = spur(&dev, &["test", "list", "-n", "shop"]).await;
    assert_ne!(run.code, 0);
    assert!(
        run.stderr
            .contains("listing SmartTests in namespace shop: forbidden"),
        "{}",
        run.stderr
    );
    let run = spur(
        &dev,
        &["test", "list", "-n", "team-b", "--sandbox", "feature-x"],
    )
    .await;
    assert_ne!(run.code, 0);
    assert!(
        run.stderr.contains("reading Sandbox feature-x: forbidden"),
        "{}",
        run.stderr
    );
    assert!(!run.stdout.contains("list-items"), "{}", run.stdout);
    let run = spur(
        &admin,
        &[
            "test",
            "run",
            "list-items",
            "-n",
            "shop",
            "--sandbox",
            "feature-x",
        ],
    )
    .await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(
        run.stdout.contains("schema $.items[*].price: removed 3"),
        "{}",
        run.stdout
    );
    let before = seen.requests.load(Ordering::SeqCst);
    let run = spur(
        &dev,
        &["test", "run", "list-items", "-n", "shop", "--key", KEY],
    )
    .await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr
            .contains("reading SmartTest shop/list-items: forbidden"),
        "{}",
        run.stderr
    );
    assert_eq!(seen.requests.load(Ordering::SeqCst), before, "nothing sent");
    let run = spur(
        &dev,
        &["test", "run", "list-items", "-n", "team-b", "--key", KEY],
    )
    .await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert_eq!(seen.requests.load(Ordering::SeqCst), before + 3);
    let before = before + 3;

    // `--key` reads nothing from the cluster (the kubeconfig here names no server at all).
    let nowhere = write(d, "nowhere.yaml", "apiVersion: v1\nkind: Config\n");
    // With a summary file, as a Job's resultPath: the run's outcome in at most 4096 bytes.
    let summary = d.join("summary.json");
    let run = spur(
        &nowhere,
        &[
            "test",
            "run",
            "-f",
            test,
            "--key",
            KEY,
            "--summary-file",
            summary.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert_eq!(seen.requests.load(Ordering::SeqCst), before + 3);
    let text = std::fs::read_to_string(&summary).unwrap();
    assert!(text.len() <= 4096);
    let s: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (&s["passed"], &s["steps"]),
        (&false.into(), &1.into()),
        "{s}"
    );
    assert!(s["findings"].as_u64().unwrap() > 0, "{s}");
    assert!(!s["top"].as_array().unwrap().is_empty(), "{s}");

    // A bad file: refused naming the step and the field, before the cluster or the service.
    let bad = write(
        d,
        "bad.yaml",
        "steps:\n  - name: list\n    http: {url: \"https://api/\"}\n",
    );
    let run = spur(
        &admin,
        &[
            "test",
            "run",
            "-f",
            bad.to_str().unwrap(),
            "--sandbox",
            "nope",
        ],
    )
    .await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("steps[0] (list): http.url")
            && run.stderr.contains("https is not supported"),
        "{}",
        run.stderr
    );
    let run = spur_bare(&["test", "check", "-f", test]).await;
    assert_eq!(
        (run.code, run.stdout.trim_end()),
        (0, format!("{test}: 1 steps, ready to run").as_str())
    );
    let run = spur(
        &admin,
        &[
            "test",
            "run",
            "-f",
            test,
            "--sandbox",
            "missing",
            "--summary-file",
            summary.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("no Sandbox named missing"),
        "{}",
        run.stderr
    );
    // A run that could not happen says so in its summary, rather than leave the last one.
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert!(
        s["error"]
            .as_str()
            .unwrap()
            .contains("no Sandbox named missing"),
        "{s}"
    );

    // `spur test results`: the automatic runs (Jobs labelled with their test), newest first,
    // with what each found; a summary's control characters are shown escaped.
    let jobs: Api<spur_api::jobs::Job> = Api::namespaced(client.clone(), "shop");
    for (name, generation, result) in [
        (
            "list-items-0001",
            "1",
            r#"{"passed":true,"steps":1,"checksFailed":0,"findings":0}"#,
        ),
        (
            "list-items-0002",
            "2",
            r#"{"passed":false,"steps":1,"checksFailed":0,"findings":1,"byRank":{"schema":1},"top":[{"rank":"schema","endpoint":"GET api/items","what":"$.price\u001b[2J: removed 1","occurrences":1}]}"#,
        ),
    ] {
        let job: spur_api::jobs::Job = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
            "metadata": {"name": name, "namespace": "shop",
                         "labels": {"spur.dev/smarttest": "list-items", "spur.dev/sandbox": "feature-x"},
                         "annotations": {"spur.dev/sandbox-generation": generation}},
            "spec": {"runnerGroup": "smart-tests", "script": "#!/bin/sh\n"}
        }))
        .unwrap();
        jobs.create(&PostParams::default(), &job).await.unwrap();
        jobs.patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"status": {"phase": "Failed", "result": result}})),
        )
        .await
        .unwrap();
    }
    let run = spur(
        &admin,
        &["test", "results", "-n", "shop", "--sandbox", "feature-x"],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", run.stdout);
    assert!(
        lines[0].starts_with("TEST") && lines[0].contains("OUTCOME"),
        "{}",
        run.stdout
    );
    assert!(
        lines[1].contains("list-items-0002")
            && lines[1].contains(
                "1 finding (1 schema): [schema] GET api/items: $.price\\u{1b}[2J: removed 1"
            ),
        "{}",
        run.stdout
    );
    assert!(
        lines[2].contains("list-items-0001") && lines[2].contains("passed (1 steps, no findings)"),
        "{}",
        run.stdout
    );
    assert!(!run.stdout.contains('\u{1b}'));
    // The user of team-b may not list shop's runs.
    let run = spur(&dev, &["test", "results", "-n", "shop"]).await;
    assert_ne!(run.code, 0);
    assert!(
        run.stderr
            .contains("listing the runs (Jobs) in namespace shop: forbidden"),
        "{}",
        run.stderr
    );
    assert!(!run.stdout.contains("list-items"), "{}", run.stdout);
}

/// `reflection: true`: a gRPC step learns its types from the server's reflection (the demo
/// service serves grpc.reflection.v1): its request is given as JSON, its answers are compared
/// field by field (the routing key the demo echoes is a value finding at its field, not a
/// byte difference) and a JSON-path check reads them. A server that is not gRPC is an error
/// before anything is sent, naming the step (exit 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_steps_learn_their_types_by_server_reflection() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc = listener.local_addr().unwrap();
    let stop = spur_demo_apps::CancellationToken::new();
    tokio::spawn(spur_demo_apps::serve_grpc(
        listener,
        "catalog".into(),
        stop.clone(),
    ));
    let dir = tempfile::tempdir().unwrap();
    let test = write(
        dir.path(),
        "grpc.yaml",
        &format!(
            r#"steps:
- name: price
  grpc:
    target: "{grpc}"
    method: spur.demo.v1.Demo/Price
    reflection: true
    json: {{sku: A1}}
  checks:
  - grpcStatus: 0
  - jsonPath: {{path: $.priceCents, equals: "300"}}
- name: hello
  grpc:
    target: "{grpc}"
    method: spur.demo.v1.Demo/Hello
    reflection: true
    json: {{name: ann}}
- name: chat
  grpc:
    target: "{grpc}"
    method: spur.demo.v1.Demo/Chat
    reflection: true
    json: [{{name: a}}, {{name: b}}]
  checks:
  - jsonPath: {{path: "$[1].message", equals: "echo b from catalog"}}
"#
        ),
    );
    let run = spur_bare(&[
        "test",
        "run",
        "-f",
        test.to_str().unwrap(),
        "--key",
        KEY,
        "-o",
        "json",
    ])
    .await;
    assert_eq!(run.code, 1, "the echoed key is a finding");
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    let checks = &report["steps"][0]["checks"];
    assert_eq!(checks[1]["sandbox"], "passed", "{report}");
    assert_eq!(checks[1]["baseline"], "passed", "{report}");
    let endpoints = report["findings"]["endpoints"].as_array().unwrap();
    let of = |method: &str| {
        endpoints
            .iter()
            .find(|e| e["endpoint"].as_str().unwrap().ends_with(method))
            .unwrap()["findings"]
            .clone()
    };
    assert_eq!(of("/Price"), json!([]), "Price answers alike: {report}");
    let hello = of("/Hello");
    assert_eq!(hello[0]["at"], "$.routingKey", "{report}");
    assert_eq!(hello[0]["rank"], "value", "{report}");
    assert_eq!(hello[0]["sandbox"], KEY, "{report}");
    // A bidirectional stream: both messages sent, both replies compared as a list.
    let chat_checks = &report["steps"][2]["checks"];
    assert_eq!(chat_checks[0]["sandbox"], "passed", "{report}");
    assert_eq!(chat_checks[0]["baseline"], "passed", "{report}");
    let chat = of("/Chat");
    assert_eq!(chat[0]["at"], "$[*].routingKey", "{report}");
    assert_eq!(chat[0]["rank"], "value", "{report}");

    // Not a gRPC server: said before anything is sent, naming the step and the server.
    let http = service(Arc::new(Seen::default())).await;
    let broken = write(
        dir.path(),
        "http.yaml",
        &format!(
            "steps:\n- name: price\n  grpc: {{target: \"{http}\", method: spur.demo.v1.Demo/Price, reflection: true}}\n"
        ),
    );
    let run = spur_bare(&["test", "run", "-f", broken.to_str().unwrap(), "--key", KEY]).await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr
            .contains(&format!("step price: gRPC reflection at {http}")),
        "{}",
        run.stderr
    );
    stop.cancel();
}
