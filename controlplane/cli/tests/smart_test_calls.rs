//! `spur test run --calls` (docs/smart-tests.md, "Downstream calls") on one machine: the
//! traffic store (standalone, a settings file naming the sandbox), real sidecars in front of a
//! `front` and a `catalog` (`spur demo app`s; the front calls the catalog, propagating baggage),
//! and the sandbox's routing key and Ready condition in a real kube-apiserver. The sandbox forks
//! only the front; the catalog's sidecar captures nothing but the run's keys while a run asks.
//!
//! A fork that no longer calls the catalog is found as `call GET shop/catalog: removed`; one
//! that calls it as the baseline does has no findings (the calls of every pass agree); what
//! each pass caused is read from the store and attributed by the run's marker, not by time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use spur_api::Sandbox;
use spur_kube_harness::KubeApi;
use spur_proto::traffic as pb;
use spur_proto::traffic::traffic_client::TrafficClient;
use tokio::process::{Child, Command};

#[path = "support/roles.rs"]
mod roles;
use roles::role_bin;
#[path = "support/capture.rs"]
mod capture;
use capture::{capturing_sidecar, free_port, wait_port};

const SPUR: &str = env!("CARGO_BIN_EXE_spur");
const TOKEN: &str = "smart-test-calls-token";
const KEY: &str = "callskey7";

/// `spur demo app` named `name` on a free port, calling `call` if given.
async fn app(name: &str, call: Option<SocketAddr>) -> (Child, SocketAddr) {
    let port = free_port();
    let mut cmd = Command::new(SPUR);
    cmd.args(["demo", "app", "--name", name])
        .arg(format!("--listen=127.0.0.1:{port}"))
        .kill_on_drop(true);
    if let Some(call) = call {
        cmd.arg(format!("--call=http://{call}"));
    }
    let child = cmd.spawn().unwrap();
    wait_port(port).await;
    (child, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// A sidecar of baseline `shop/<name>` in front of `app`, routing by `<name>-rules.yaml`,
/// capturing to the store at `store`.
async fn sidecar(d: &Path, name: &str, app: SocketAddr, store: u16) -> spur_sidecar::Sidecar {
    let rules = d.join(format!("{name}-rules.yaml"));
    capturing_sidecar(&d.join("token"), store, "shop", name, app, &rules).await
}

/// Routes [`KEY`] at the front's sidecar to `fork`.
fn route_front_to(d: &Path, front: SocketAddr, fork: SocketAddr) {
    std::fs::write(
        d.join("front-rules.yaml"),
        format!(
            "- routingKey: {KEY}\n  baseline: {{kind: Deployment, namespace: shop, name: front}}\n  destinationSandbox: {{name: calls-sb}}\n  mappings:\n    - workloadPort: {}\n      destinations: [{{host: 127.0.0.1, port: {}}}]\n",
            front.port(),
            fork.port()
        ),
    )
    .unwrap();
}

/// A keyed GET through the front's sidecar until `fork`'s name answers (the rules are polled).
async fn until_routed_to(front: SocketAddr, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let body = get(front).await;
        if body.contains(&format!("\"service\":\"{name}\"")) {
            return;
        }
        assert!(Instant::now() < deadline, "never routed to {name}: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One GET of `/` with [`KEY`]; the body.
async fn get(addr: SocketAddr) -> String {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get("/")
        .header("host", "front")
        .header("baggage", format!("sd-routing-key={KEY}"))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// The store's metrics page.
async fn metrics(port: u16) -> String {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get("/metrics")
        .header("host", "store")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn spur(d: &Path, store: u16, kubeconfig: &Path, args: &[&str]) -> Run {
    let out = Command::new(SPUR)
        .args(args)
        .args([
            "--server",
            &format!("http://127.0.0.1:{store}"),
            "--token-file",
        ])
        .arg(d.join("token"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env_remove("SPUR_TRAFFIC_TOKEN")
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

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The calls of one pass of step 0, as `-o json` reports them: `call -> count`.
fn calls(report: &Value, pass: &str, index: Option<usize>) -> Vec<(String, u64)> {
    let mut side = &report["steps"][0]["calls"][pass];
    if let Some(i) = index {
        side = &side[i];
    }
    side.as_array()
        .unwrap_or_else(|| panic!("no calls for {pass}: {report}"))
        .iter()
        .map(|c| {
            (
                c["call"].as_str().unwrap().to_owned(),
                c["count"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_with_calls_finds_a_downstream_call_the_fork_stopped_making() {
    let api = KubeApi::start().await.unwrap();
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/crds");
    api.install_crd_file(&crds.join("sandboxes.spur.dev.yaml"))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let kubeconfig: PathBuf = d.join("admin.yaml");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let sandboxes: Api<Sandbox> = Api::all(api.client());
    let sb: Sandbox = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "calls-sb"},
        "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "front"}}]}
    }))
    .unwrap();
    sandboxes.create(&PostParams::default(), &sb).await.unwrap();
    let status = json!({"status": {"routingKey": KEY, "conditions": [{
        "type": "Ready", "status": "True", "reason": "Ready", "message": "",
        "lastTransitionTime": "2026-12-06T10:00:00Z"}]}});
    sandboxes
        .patch_status("calls-sb", &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap();

    // The store knows the sandbox (and captures its key at the front, as standing capture).
    std::fs::write(d.join("token"), TOKEN).unwrap();
    std::fs::write(
        d.join("capture.yaml"),
        format!(
            "sandboxes:\n- {{name: calls-sb, routingKey: {KEY}, workloads: [{{kind: Deployment, namespace: shop, name: front}}]}}\n"
        ),
    )
    .unwrap();
    let (store, store_metrics) = (free_port(), free_port());
    let _store = Command::new(role_bin("spur-traffic-store"))
        .args(["serve", "--insecure-plaintext"])
        .arg(format!("--listen=127.0.0.1:{store}"))
        .arg(format!("--metrics-addr=127.0.0.1:{store_metrics}"))
        .arg("--db")
        .arg(d.join("traffic.db"))
        .arg("--settings")
        .arg(d.join("capture.yaml"))
        .arg("--token-file")
        .arg(d.join("token"))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_port(store).await;

    let (_catalog, catalog) = app("catalog", None).await;
    std::fs::write(d.join("catalog-rules.yaml"), "[]\n").unwrap();
    let catalog_sidecar = sidecar(d, "catalog", catalog, store).await;
    let catalog_in = catalog_sidecar.inbound_addr;
    let (_front, front) = app("front", Some(catalog_in)).await;
    // The fork that no longer calls the catalog, and one that still does.
    let (_alone, alone) = app("front-alone", None).await;
    let (_same, same) = app("front-same", Some(catalog_in)).await;
    route_front_to(d, front, alone);
    let front_sidecar = sidecar(d, "front", front, store).await;
    let front_in = front_sidecar.inbound_addr;
    until_routed_to(front_in, "front-alone").await;

    let test = d.join("test.yaml");
    std::fs::write(
        &test,
        format!("steps:\n  - name: home\n    http: {{url: \"http://{front_in}/\"}}\n    checks: [{{status: 200}}]\n"),
    )
    .unwrap();
    let test = test.to_str().unwrap();
    let run_args = [
        "test",
        "run",
        "-f",
        test,
        "--sandbox",
        "calls-sb",
        "--calls",
        "-o",
        "json",
    ];

    // Without the catalog's calls in the fork: found, as a schema change of the step's endpoint.
    let run = spur(d, store, &kubeconfig, &run_args).await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(report["calls"]["namespaces"], json!(["shop"]), "{report}");
    assert_eq!(report["calls"]["watchingBaselines"], 2, "{report}");
    // The routing check's keyed requests just before the run are read too (start times have
    // slack for clocks), but carry no marker of the run: counted, not attributed.
    let captured = report["calls"]["captured"].as_u64().unwrap();
    let unmarked = report["calls"]["unmarked"].as_u64().unwrap();
    assert_eq!(
        captured - unmarked,
        5,
        "3 entries and 2 baseline calls: {report}"
    );
    let entry = ("GET shop/front".to_owned(), 1);
    let downstream = ("GET shop/catalog".to_owned(), 1);
    for b in [0, 1] {
        assert_eq!(
            calls(&report, "baseline", Some(b)),
            [downstream.clone(), entry.clone()],
            "baseline pass {b}: the front and, from it, the catalog"
        );
    }
    assert_eq!(
        calls(&report, "sandbox", None),
        std::slice::from_ref(&entry)
    );
    let findings = report["findings"]["endpoints"][0]["findings"].to_string();
    assert!(
        findings.contains(
            r#""at":"GET shop/catalog","baseline":1,"kind":"call","occurrences":1,"rank":"schema""#
        ),
        "{findings}"
    );

    // An automatic run's way: a component (the operator; here the store's static token) starts
    // the capture for the test's creator and gives the run the capture and its own token; the
    // run reads back with that token only its own requests and what they caused.
    let mut client = TrafficClient::connect(format!("http://127.0.0.1:{store}"))
        .await
        .unwrap();
    let mut start = tonic::Request::new(pb::StartRunCaptureRequest {
        sandbox: "calls-sb".into(),
        seconds: 120,
        run_for: Some(pb::RunFor {
            username: "ann".into(),
            groups: Vec::new(),
            job: String::new(),
        }),
    });
    start
        .metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let capture = client.start_run_capture(start).await.unwrap().into_inner();
    assert!(!capture.run_token.is_empty() && !capture.marker_tag.is_empty());
    let given = spur_api::smarttest::RunCaptureEnv {
        id: capture.id.clone(),
        routing_key: capture.routing_key.clone(),
        reference_key: capture.reference_key.clone(),
        marker_tag: capture.marker_tag.clone(),
        namespaces: capture.namespaces.clone(),
        watching_baselines: capture.watching_baselines,
        until_unix_micros: capture.until_unix_micros,
    };
    // Unmarked keyed traffic meanwhile (someone else's) is not the run's.
    get(front_in).await;
    let out = Command::new(SPUR)
        .args(["test", "run", "-f", test, "--key", KEY, "-o", "json"])
        .args(["--run-capture-env", "GIVEN_CAPTURE"])
        .arg("--summary-file")
        .arg(d.join("summary.json"))
        .args(["--server", &format!("http://127.0.0.1:{store}")])
        .env("GIVEN_CAPTURE", serde_json::to_string(&given).unwrap())
        .env("SPUR_TRAFFIC_TOKEN", &capture.run_token)
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["calls"]["captured"], 5, "{report}");
    assert_eq!(report["calls"]["unmarked"], 0, "{report}");
    // The summary an automatic run leaves for its Job says so too.
    let summary: Value =
        serde_json::from_slice(&std::fs::read(d.join("summary.json")).unwrap()).unwrap();
    assert_eq!(
        summary["calls"],
        json!({"watchingBaselines": 2, "captured": 5, "unmarked": 0}),
        "{summary}"
    );
    assert_eq!(
        calls(&report, "sandbox", None),
        std::slice::from_ref(&entry)
    );
    assert!(
        report["findings"]
            .to_string()
            .contains(r#""at":"GET shop/catalog""#),
        "{report}"
    );
    // It ended the capture with its token; the run's token reads nothing of another run, and
    // is no reader's token.
    let mut read = tonic::Request::new(pb::QueryRequest {
        filter: Some(pb::Filter {
            sandbox: "calls-sb".into(),
            ..Default::default()
        }),
        limit: 1,
        without_bodies: true,
    });
    read.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", capture.run_token).parse().unwrap(),
    );
    let err = client.query(read).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    let mut end = tonic::Request::new(pb::EndRunCaptureRequest {
        id: capture.id.clone(),
        job: String::new(),
    });
    end.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let err = client.end_run_capture(end).await.unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::NotFound,
        "ended by the run: {err:?}"
    );

    // Text output names it too.
    let text_args = [
        "test",
        "run",
        "-f",
        test,
        "--sandbox",
        "calls-sb",
        "--calls",
    ];
    let run = spur(d, store, &kubeconfig, &text_args).await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(
        run.stdout
            .contains("schema call GET shop/catalog: removed 1"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout
            .contains("calls downstream: sandbox 1; baseline 2, 2"),
        "{}",
        run.stdout
    );

    // A fork that calls the catalog as the baseline does: its calls are the baseline's.
    route_front_to(d, front, same);
    until_routed_to(front_in, "front-same").await;
    let run = spur(d, store, &kubeconfig, &run_args).await;
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(
        calls(&report, "sandbox", None),
        [downstream.clone(), entry.clone()],
        "{report}"
    );
    let findings = report["findings"].to_string();
    assert!(!findings.contains("\"call"), "{findings}");

    // The capture ended with each run: the catalog's sidecar captures nothing now.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics(store_metrics).await;
        if metric(&text, "spur_traffic_run_captures") == Some(0.0) {
            break;
        }
        assert!(Instant::now() < deadline, "runs still capturing:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let keys = catalog_sidecar.capture_keys().unwrap().clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !keys.load().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the catalog still captures after the run"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // --calls needs a sandbox: the store captures a sandbox's run.
    let run = spur(
        d,
        store,
        &kubeconfig,
        &["test", "run", "-f", test, "--key", KEY, "--calls"],
    )
    .await;
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("--sandbox"), "{}", run.stderr);

    front_sidecar.shutdown().await;
    catalog_sidecar.shutdown().await;
}
