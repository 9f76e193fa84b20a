//! Traffic capture as a user drives it on one machine (issue #27): `spur-traffic-store serve`
//! with a settings file, a sidecar in front of a baseline app with a fork, and `spur traffic
//! tail`, `query` and `diff` against the store. A keyed request shows up in `tail` with the
//! fork's answer; `diff` shows how the fork's answer differs from the baseline's to the same
//! request (captured through a virtual workload's key).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_util::sync::CancellationToken;

const SPUR: &str = env!("CARGO_BIN_EXE_spur");
#[path = "support/roles.rs"]
mod roles;
use roles::role_bin;
#[path = "support/capture.rs"]
mod capture;
use capture::{capturing_sidecar, free_port, wait_port};
const TOKEN: &str = "traffic-cli-test-token";

async fn app(name: &str, stop: CancellationToken) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let name = name.to_string();
    tokio::spawn(async move { spur_demo_apps::serve_http(l, name, stop).await });
    addr
}

/// One keyed GET through the sidecar; returns who answered.
async fn get(addr: SocketAddr, key: &str) -> String {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get("/")
        .header("host", "backend")
        .header("baggage", format!("sd-routing-key={key}"))
        .header("authorization", "Bearer do-not-store-me")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let by = resp.headers()[spur_demo_apps::SERVED_BY]
        .to_str()
        .unwrap()
        .to_string();
    resp.into_body().collect().await.unwrap();
    by
}

/// A keyed POST of JSON to `/echo`, then a keyed `GET /?page=1`, through the sidecar and
/// addressed to it (so a test recorded from them can be sent again from here).
async fn post_then_get(addr: SocketAddr, key: &str) {
    for post in [true, false] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = if post {
            http::Request::post("/echo?dry=1")
                .header("content-type", "application/json")
                .header("x-feature", "blue")
                .body(Bytes::from_static(br#"{"name":"lamp"}"#))
        } else {
            http::Request::get("/?page=1").body(Bytes::new())
        };
        let mut req = req.unwrap();
        let h = req.headers_mut();
        h.insert("host", addr.to_string().parse().unwrap());
        h.insert("baggage", format!("sd-routing-key={key}").parse().unwrap());
        h.insert("cookie", "session=do-not-store-me".parse().unwrap());
        let resp = send
            .send_request(req.map(http_body_util::Full::new))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await.unwrap();
    }
}

/// `spur test record`: the sandbox's two newest requests become a test (without the key, its
/// carrier or the cookie), which `spur test run` sends again: the echo is the same on both
/// sides, the fork's greeting differs from the baseline's, a finding. With --name, a SmartTest
/// manifest that `spur test check` takes.
async fn record_and_run_a_test(d: &Path, server: &str, sidecar: SocketAddr) {
    post_then_get(sidecar, "k1").await;
    let file = d.join("recorded.yaml");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = spur(
            d,
            server,
            &[
                "test",
                "record",
                "sb1",
                "--limit",
                "2",
                "-o",
                file.to_str().unwrap(),
            ],
        );
        assert!(out.status.success(), "{out:?}");
        if std::fs::read_to_string(&file).unwrap().contains("page=1") {
            break;
        }
        assert!(Instant::now() < deadline, "the GET was never stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = std::fs::read_to_string(&file).unwrap();
    eprintln!("spur test record wrote:\n{text}");
    assert!(
        text.contains(&format!("url: http://{sidecar}/echo?dry=1"))
            && text.contains(&format!("url: http://{sidecar}/?page=1"))
            && text.contains("method: POST")
            && text.contains("name: lamp")
            && text.contains("x-feature")
            && text.contains("status: 200"),
        "{text}"
    );
    for secret in ["do-not-store-me", "cookie", "baggage", "k1"] {
        assert!(!text.contains(secret), "{secret} in {text}");
    }
    let run = std::process::Command::new(SPUR)
        .args(["test", "run", "-f", file.to_str().unwrap(), "--key", "k1"])
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    assert_eq!(
        run.status.code(),
        Some(1),
        "a finding: {report}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    eprintln!("spur test run -f recorded.yaml:\n{report}");
    assert!(report.contains("fork"), "{report}");

    let out = spur(
        d,
        server,
        &[
            "test", "record", "sb1", "--path", "/echo", "--name", "items", "-n", "demo",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let manifest = String::from_utf8_lossy(&out.stdout);
    assert!(
        manifest.contains("kind: SmartTest") && manifest.contains("namespace: demo"),
        "{manifest}"
    );
    let file = d.join("items.yaml");
    std::fs::write(&file, manifest.as_bytes()).unwrap();
    let check = std::process::Command::new(SPUR)
        .args(["test", "check", "-f", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(check.status.success(), "{check:?}");
}

fn spur(dir: &Path, server: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(SPUR)
        .args(args)
        .args(["--server", server, "--token-file"])
        .arg(dir.join("token"))
        .env_remove("SPUR_TRAFFIC_TOKEN")
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_shows_the_forks_answer_and_diff_shows_what_changed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("token"), TOKEN).unwrap();
    std::fs::write(
        d.join("capture.yaml"),
        "sandboxes:\n\
         - {name: sb1, routingKey: k1, workloads: [{kind: Deployment, namespace: demo, name: backend}]}\n\
         - {name: ref, routingKey: k2, workloads: [{kind: Deployment, namespace: demo, name: backend}]}\n",
    )
    .unwrap();
    let (grpc, metrics) = (free_port(), free_port());
    let _store = tokio::process::Command::new(role_bin("spur-traffic-store"))
        .args(["serve", "--insecure-plaintext"])
        .arg(format!("--listen=127.0.0.1:{grpc}"))
        .arg(format!("--metrics-addr=127.0.0.1:{metrics}"))
        .arg("--db")
        .arg(d.join("traffic.db"))
        .arg("--settings")
        .arg(d.join("capture.yaml"))
        .arg("--token-file")
        .arg(d.join("token"))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_port(grpc).await;
    let server = format!("http://127.0.0.1:{grpc}");

    let apps = CancellationToken::new();
    let baseline = app("baseline", apps.clone()).await;
    let fork = app("fork", apps.clone()).await;
    std::fs::write(
        d.join("rules.yaml"),
        format!(
            "- routingKey: k1\n  baseline: {{kind: Deployment, namespace: demo, name: backend}}\n  destinationSandbox: {{name: sb1}}\n  mappings:\n    - workloadPort: {}\n      destinations: [{{host: 127.0.0.1, port: {}}}]\n",
            baseline.port(),
            fork.port()
        ),
    )
    .unwrap();
    let sidecar = capturing_sidecar(
        &d.join("token"),
        grpc,
        "demo",
        "backend",
        baseline,
        &d.join("rules.yaml"),
    )
    .await;
    let keys = sidecar.capture_keys().unwrap().clone();
    let deadline = Instant::now() + Duration::from_secs(20);
    while keys.load().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "no capture settings at the sidecar"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // `tail` subscribes, then the keyed request is made.
    let mut tail = tokio::process::Command::new(SPUR)
        .args(["traffic", "tail", "sb1", "--json", "--count", "1"])
        .args(["--timeout", "30s", "--server", &server, "--token-file"])
        .arg(d.join("token"))
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = reqwest_metrics(metrics).await;
        if text
            .lines()
            .any(|l| l.starts_with("spur_traffic_tail_subscribers 1"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "tail never subscribed:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sent = Instant::now();
    assert_eq!(get(sidecar.inbound_addr, "k1").await, "fork");
    let mut lines = BufReader::new(tail.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("tail printed the exchange")
        .unwrap()
        .expect("a line");
    eprintln!(
        "tail printed the exchange {:?} after the request",
        sent.elapsed()
    );
    let x: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(x["sandbox"], "sb1", "{x}");
    assert_eq!(x["routed"], "sandbox", "{x}");
    assert_eq!(x["status"], 200, "{x}");
    assert_eq!(x["responseBody"]["data"], "hello from fork\n", "{x}");
    // Read to its last byte by the client: a complete exchange, no error.
    assert_eq!(x["error"], serde_json::Value::Null, "{x}");
    assert!(!line.contains("do-not-store-me"), "{line}");
    let status = tokio::time::timeout(Duration::from_secs(10), tail.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "tail --count 1 exits 0: {status}");

    // The reference sandbox's key: the baseline answers the same request.
    assert_eq!(get(sidecar.inbound_addr, "k2").await, "baseline");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = spur(d, &server, &["traffic", "query", "ref", "--json"]);
        assert!(out.status.success(), "{out:?}");
        if !out.stdout.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the baseline exchange was never stored"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = spur(d, &server, &["traffic", "diff", "sb1", "--json"]);
    assert_eq!(out.status.code(), Some(1), "differences found: {out:?}");
    let diff: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(diff["summary"]["pairs"], 1, "{diff}");
    let differences = diff["pairs"][0]["differences"].as_array().unwrap();
    let text = serde_json::to_string(differences).unwrap();
    assert!(
        text.contains("hello from fork") && text.contains("hello from baseline"),
        "the bodies differ: {diff}"
    );
    assert!(text.contains("x-served-by"), "the header differs: {diff}");
    // Readable text output too.
    let out = spur(d, &server, &["traffic", "diff", "sb1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("spur traffic diff sb1:\n{text}");
    assert!(text.contains("hello from fork"), "{text}");

    record_and_run_a_test(d, &server, sidecar.inbound_addr).await;

    let t = Instant::now();
    hub_web_view_shows_the_traffic(d, grpc).await;
    eprintln!(
        "the hub's traffic tab showed the exchange after {:?}",
        t.elapsed()
    );

    // A wrong token is refused with a clear message.
    std::fs::write(d.join("token"), "wrong").unwrap();
    let out = spur(d, &server, &["traffic", "query", "sb1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unauthenticated"), "{err}");
    let out = spur(d, &server, &["test", "record", "sb1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unauthenticated"), "{err}");

    sidecar.shutdown().await;
    apps.cancel();
}

/// The hub's web view, its traffic tab, through an agent without Kubernetes access: refused,
/// since the agent cannot check the user's rights.
async fn hub_web_view_shows_the_traffic(d: &Path, store_port: u16) {
    let hub_cmd = |args: &[&str]| {
        let out = std::process::Command::new(role_bin("spur-hub"))
            .current_dir(d)
            .args(args)
            .env("SPUR_HUB_DB", d.join("hub.db"))
            .output()
            .unwrap();
        assert!(out.status.success(), "spur-hub {args:?}: {out:?}");
        out.stdout
    };
    std::fs::write(d.join("east.token"), hub_cmd(&["cluster", "add", "east"])).unwrap();
    hub_cmd(&["user", "add", "dev", "--cluster", "*", "--all-namespaces"]);
    let key = String::from_utf8(hub_cmd(&["apikey", "add", "dev"])).unwrap();
    std::fs::write(d.join("ca.pem"), hub_cmd(&["ca"])).unwrap();
    let auth = format!("x-spur-api-key: {}", key.trim());
    let curl = |web: u16, path: &str, headers: &[&str]| -> (u16, String) {
        let mut c = std::process::Command::new("curl");
        c.args(["-sS", "--max-time", "10", "--cacert"])
            .arg(d.join("ca.pem"))
            .args(["-w", "\n%{http_code}"]);
        for h in headers {
            c.args(["-H", h]);
        }
        let out = c
            .arg(format!("https://localhost:{web}{path}"))
            .output()
            .expect("curl (tests/run.sh installs it)");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    };
    // The tunnel port must be free on TCP and UDP (QUIC); both probes are held until known.
    let (tunnel, web) = loop {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = tcp.local_addr().unwrap().port();
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            break (port, free_port());
        }
    };
    let log = |name: &str| std::fs::File::create(d.join(name)).unwrap();
    let _hub = tokio::process::Command::new(role_bin("spur-hub"))
        .current_dir(d)
        .args(["serve", "--db", "hub.db", "--metrics-addr", "127.0.0.1:0"])
        .args(["--tunnel-addr", &format!("127.0.0.1:{tunnel}")])
        .args(["--preview-addr", &format!("127.0.0.1:{web}")])
        .args(["--preview-domain", "preview.test"])
        .stderr(log("hub.log"))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let _agent = tokio::process::Command::new(role_bin("spur-agent"))
        .current_dir(d)
        .args(["--hub", &format!("127.0.0.1:{tunnel}")])
        .args(["--hub-server-name", "localhost", "--hub-ca", "ca.pem"])
        .args([
            "--token-file",
            "east.token",
            "--no-kube",
            "--health-addr",
            "127.0.0.1:0",
        ])
        .args(["--traffic-server", &format!("127.0.0.1:{store_port}")])
        .args([
            "--traffic-insecure-plaintext",
            "--traffic-server-token-file",
            "token",
        ])
        .stderr(log("agent.log"))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // An agent without Kubernetes access cannot check what a hub user may read (issue 42,
    // point 5: every traffic read is a SubjectAccessReview of the user's identity first), so it
    // refuses, and the tab says why; tests/tests/kube_hub_scopes.rs reads through a real one.
    let page = "/traffic?cluster=east&sandbox=sb1";
    let deadline = Instant::now() + Duration::from_secs(30);
    let body = loop {
        let (code, body) = curl(web, page, &[&auth]);
        if code == 200 && body.contains("cannot check what a user may read") {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "no refusal on the traffic tab: {code} {body}\nhub: {}\nagent: {}",
            std::fs::read_to_string(d.join("hub.log")).unwrap_or_default(),
            std::fs::read_to_string(d.join("agent.log")).unwrap_or_default(),
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(!body.contains("hello from fork"), "{body}");
    // Without a login: the login form, never the data.
    let (code, anon) = curl(web, page, &[]);
    assert_eq!(code, 303, "{anon}");
    assert!(!anon.contains("hello from fork"));
}

/// The store's /metrics, over a plain HTTP/1.1 GET.
async fn reqwest_metrics(port: u16) -> String {
    let Ok(tcp) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get("/metrics")
        .header("host", "store")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}
