//! `spur-operator` and `spur-routeserver --kubernetes` as shipped binaries against a real
//! kube-apiserver: they start from a kubeconfig, serve /healthz and /metrics, do their work
//! (a Sandbox gets its routing key), and exit 0 on SIGTERM; a bad kubeconfig is a clear error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use spur_api::Sandbox;
use spur_kube_harness::KubeApi;

#[path = "support/roles.rs"]
mod roles;
use roles::role_bin;

use spur_kube_harness::free_port;

async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let out = tokio::process::Command::new("curl")
        .args([
            "-s",
            "-w",
            "\n%{http_code}",
            &format!("http://127.0.0.1:{port}{path}"),
        ])
        .output()
        .await
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n')?;
    Some((code.parse().ok()?, body.to_string()))
}

async fn wait_healthy(port: u16) -> String {
    for _ in 0..300 {
        if let Some((200, body)) = http_get(port, "/healthz").await {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no healthy /healthz on {port}");
}

fn sigterm(child: &tokio::process::Child) {
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_and_routeserver_binaries_run_against_the_apiserver() {
    let api = KubeApi::start().await.unwrap();
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/crds");
    for entry in std::fs::read_dir(&crds).unwrap() {
        api.install_crd_file(&entry.unwrap().path()).await.unwrap();
    }
    let kubeconfig = api.dir().join("cli-kubeconfig.yaml");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let bin = env!("CARGO_BIN_EXE_spur");

    let (metrics, grpc, http) = (free_port(), free_port(), free_port());
    let mut operator = tokio::process::Command::new(role_bin("spur-operator"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .args(["--webhook-addr", "127.0.0.1:0"])
        .args(["--preview-domain", "preview.test", "--cluster-name", "east"])
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut routeserver = tokio::process::Command::new(role_bin("spur-routeserver"))
        .args(["--kubernetes", "--kubeconfig"])
        .arg(&kubeconfig)
        .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--http-addr", &format!("127.0.0.1:{http}")])
        // Only /healthz is read here, which needs no token; the default token check stays on.
        .arg("--insecure-plaintext")
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_healthy(metrics).await;
    let health = wait_healthy(http).await;
    assert!(health.contains("\"status\":\"ok\""), "{health}");
    // Both binaries' HTTP/1 ports follow the front door's rules: 400 and a closed connection.
    for port in [metrics, http] {
        for (name, req) in [
            (
                "two Host headers",
                &b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"[..],
            ),
            ("no Host", b"GET /healthz HTTP/1.1\r\n\r\n"),
            ("bare LF", b"GET /healthz HTTP/1.1\nHost: a\n\n"),
        ] {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            tcp.write_all(req).await.unwrap();
            let mut out = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut out))
                .await
                .expect("the connection is closed")
                .unwrap();
            let out = String::from_utf8_lossy(&out);
            assert!(out.starts_with("HTTP/1.1 400"), "{port} {name}: {out:?}");
        }
    }

    // The operator works: a Sandbox whose baseline is missing gets its key and a condition.
    let sb: Sandbox = serde_json::from_value(serde_json::json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "cli"},
        "spec": {
            "forks": [{"forkOf": {"kind": "Deployment", "namespace": "default", "name": "web"}}],
            "defaultRouteGroup": {"endpoints": [{"name": "web", "target": "http://web.default.svc:8080"}]}
        }
    }))
    .unwrap();
    let sandboxes: Api<Sandbox> = Api::all(api.client());
    sandboxes.create(&PostParams::default(), &sb).await.unwrap();
    let mut reported = false;
    for _ in 0..300 {
        let st = sandboxes.get("cli").await.unwrap().status;
        if st.is_some_and(|s| s.routing_key.is_some() && !s.conditions.is_empty()) {
            reported = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(reported, "the operator never reported on the sandbox");
    // With a preview domain, the endpoint's preview URL is in status, and the CLI shows it.
    let url = "https://web--cli--east.preview.test/";
    let mut published = Vec::new();
    for _ in 0..300 {
        published = sandboxes
            .get("cli")
            .await
            .unwrap()
            .status
            .unwrap()
            .endpoints;
        if !published.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(published.len(), 1, "{published:?}");
    assert_eq!(published[0].url, url);
    let get = tokio::process::Command::new(bin)
        .args(["sandbox", "get", "cli", "--kubeconfig"])
        .arg(&kubeconfig)
        .output()
        .await
        .unwrap();
    let shown = String::from_utf8_lossy(&get.stdout);
    assert!(
        get.status.success(),
        "{}",
        String::from_utf8_lossy(&get.stderr)
    );
    assert!(
        shown.contains(url) && shown.contains("Routing key:"),
        "{shown}"
    );
    let open = tokio::process::Command::new(bin)
        .args(["preview", "open", "cli", "--print", "--kubeconfig"])
        .arg(&kubeconfig)
        .output()
        .await
        .unwrap();
    assert!(
        open.status.success(),
        "{}",
        String::from_utf8_lossy(&open.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&open.stdout).trim(), url.trim());
    let missing = tokio::process::Command::new(bin)
        .args(["preview", "open", "nope", "--print", "--kubeconfig"])
        .arg(&kubeconfig)
        .output()
        .await
        .unwrap();
    assert!(!missing.status.success());
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("no Sandbox or RouteGroup named nope")
    );
    // The leader's certificate manager issued the webhook's serving certificate (into the
    // kubeconfig namespace's Secrets) and the webhook loaded it: the replica is ready.
    let mut ready = false;
    for _ in 0..300 {
        if let Some((200, _)) = http_get(metrics, "/readyz").await {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ready, "/readyz never turned ready");
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(api.client(), "default");
    let tls = secrets.get("spur-webhook-tls").await.unwrap();
    assert_eq!(tls.type_.as_deref(), Some("kubernetes.io/tls"));
    let (code, text) = http_get(metrics, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(
        text.contains("spur_operator_reconciles_total{kind=\"Sandbox\"}"),
        "{text}"
    );
    assert!(
        text.contains("spur_operator_webhook_serving_certificate_loaded 1"),
        "{text}"
    );

    sigterm(&operator);
    sigterm(&routeserver);
    for child in [&mut operator, &mut routeserver] {
        let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
            .await
            .expect("exits within 20 s of SIGTERM")
            .unwrap();
        assert!(status.success(), "{status}");
    }
}

#[tokio::test]
async fn unreadable_kubeconfig_is_a_clear_error() {
    let out = tokio::process::Command::new(role_bin("spur-operator"))
        .args(["--kubeconfig", "/nonexistent/kubeconfig"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot read kubeconfig /nonexistent/kubeconfig"),
        "{stderr}"
    );
    let out = tokio::process::Command::new(role_bin("spur-routeserver"))
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--rules-dir"), "{stderr}");
}

async fn lease_holder(api: &KubeApi) -> Option<String> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(api.client(), "default");
    leases
        .get_opt("spur-operator")
        .await
        .unwrap()
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty())
}

async fn reported(api: &KubeApi, name: &str) -> bool {
    let sb: Sandbox = serde_json::from_value(serde_json::json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {
            "forks": [{"forkOf": {"kind": "Deployment", "namespace": "default", "name": "web"}}],
            "defaultRouteGroup": {"endpoints": [{"name": "web", "target": "http://web.default.svc:8080"}]}
        }
    }))
    .unwrap();
    let sandboxes: Api<Sandbox> = Api::all(api.client());
    sandboxes.create(&PostParams::default(), &sb).await.unwrap();
    for _ in 0..300 {
        let st = sandboxes.get(name).await.unwrap().status;
        if st.is_some_and(|s| s.routing_key.is_some()) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_and_a_standby_takes_over() {
    let api = KubeApi::start().await.unwrap();
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/crds");
    for entry in std::fs::read_dir(&crds).unwrap() {
        api.install_crd_file(&entry.unwrap().path()).await.unwrap();
    }
    let kubeconfig = api.dir().join("cli-kubeconfig.yaml");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let start = |id: &str, port: u16| {
        tokio::process::Command::new(role_bin("spur-operator"))
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
            .args(["--webhook-addr", "127.0.0.1:0"])
            .args(["--instance", id, "--lease-duration", "4"])
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    let (pa, pb) = (free_port(), free_port());
    let mut a = start("op-a", pa);
    wait_healthy(pa).await;
    let mut holder = None;
    for _ in 0..100 {
        holder = lease_holder(&api).await;
        if holder.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(holder.as_deref(), Some("op-a"));
    let mut b = start("op-b", pb);
    wait_healthy(pb).await;
    assert!(reported(&api, "first").await);
    let leader_gauge = |port| async move {
        http_get(port, "/metrics")
            .await
            .map(|(_, t)| t.lines().any(|l| l == "spur_operator_leader 1"))
    };
    assert_eq!(leader_gauge(pa).await, Some(true));
    assert_eq!(
        leader_gauge(pb).await,
        Some(false),
        "the standby runs no controllers"
    );

    // A graceful stop releases the lease: the standby takes over and does the work.
    sigterm(&a);
    let status = tokio::time::timeout(Duration::from_secs(20), a.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
    let mut took_over = false;
    for _ in 0..150 {
        if lease_holder(&api).await.as_deref() == Some("op-b") {
            took_over = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(took_over, "op-b never took the lease");
    assert!(reported(&api, "second").await);
    assert_eq!(leader_gauge(pb).await, Some(true));
    sigterm(&b);
    let status = tokio::time::timeout(Duration::from_secs(20), b.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
}
