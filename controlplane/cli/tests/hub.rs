//! `spur-hub` and `spur-agent` as shipped binaries, on loopback: an agent started before its hub
//! waits for it, connects with its cluster token and reports ready; a hub killed with SIGKILL and started again is reconnected
//! to without any manual step; a revoked cluster's session closes within seconds and its agent
//! exits with the reason; a wrong token is refused; the registry survives processes killed in
//! the middle of a write. The preview tests (a real kube-apiserver) are the `kube` tier, those in
//! Chromium also the `root` tier: `--features spur-cli/kube,spur-cli/root` (docs/testing.md).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "support/roles.rs"]
mod roles;
#[path = "support/hub.rs"]
mod support;
use roles::role_bin;
use support::*;

#[test]
fn agent_connects_survives_a_hub_restart_and_is_cut_off_by_revocation() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let token = hub_cmd(d, &["cluster", "add", "east"]).stdout;
    std::fs::write(d.join("east.token"), &token).unwrap();
    std::fs::write(d.join("bad.token"), "spurc_0123456789abcdef").unwrap();
    let ca = hub_cmd(d, &["ca"]).stdout;
    std::fs::write(d.join("ca.pem"), ca).unwrap();

    // The agent starts first, with the hub not there yet, and waits past its first
    // registration attempt (3 s): it keeps trying instead of exiting.
    let port = free_port();
    let health = health_addr();
    let health_arg = health.to_string();
    let no_kube = ["--no-kube", "--health-addr", &health_arg];
    let mut agent = start_agent(d, port, "east.token", &no_kube, Stdio::piped());
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        agent.0.try_wait().unwrap().is_none(),
        "the agent gave up on an absent hub"
    );
    assert_eq!(http_status(health, "/readyz"), Some(503));
    let solo = ["--revocation-poll-ms", "200", "--preview-addr", ""];
    let mut hub = start_hub(d, port, &solo);
    let took = wait_until("the agent to be ready", Duration::from_secs(20), || {
        http_status(health, "/readyz") == Some(200)
    });
    eprintln!("agent ready after {took:?}");
    let listed = String::from_utf8(hub_cmd(d, &["cluster", "list"]).stdout).unwrap();
    assert!(
        listed.contains("east") && listed.contains("active"),
        "{listed}"
    );

    // A wrong token: refused, and the agent exits saying so (no retry loop on a bad secret).
    let bad_health = health_addr();
    let bad_arg = bad_health.to_string();
    let bad_flags = ["--no-kube", "--health-addr", &bad_arg];
    let mut bad = start_agent(d, port, "bad.token", &bad_flags, Stdio::piped());
    let exit = wait_for_exit(&mut bad.0, Duration::from_secs(20));
    assert!(!exit.0.success());
    assert!(
        exit.1.contains("unknown or revoked cluster token"),
        "{}",
        exit.1
    );

    // The hub dies without warning and comes back: the agent reconnects on its own.
    hub.0.kill().unwrap();
    hub.0.wait().unwrap();
    wait_until(
        "the agent to notice the hub is gone",
        Duration::from_secs(30),
        || http_status(health, "/readyz") == Some(503),
    );
    let hub2 = start_hub(d, port, &solo);
    let took = wait_until("the agent to reconnect", Duration::from_secs(30), || {
        http_status(health, "/readyz") == Some(200)
    });
    eprintln!("agent reconnected {took:?} after the hub restarted");

    // Revocation from the CLI while both run: the session ends and the agent exits.
    let revoked = Instant::now();
    hub_cmd(d, &["cluster", "revoke", "east"]);
    let exit = wait_for_exit(&mut agent.0, Duration::from_secs(10));
    eprintln!("agent exited {:?} after the revocation", revoked.elapsed());
    assert!(!exit.0.success());
    assert!(exit.1.contains("revoked"), "{}", exit.1);
    drop(hub2);
}

/// Waits for `child` to exit; its status and stderr.
fn wait_for_exit(child: &mut Child, limit: Duration) -> (std::process::ExitStatus, String) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            return (status, err);
        }
        assert!(
            start.elapsed() < limit,
            "the process did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn registry_writes_killed_midway_lose_nothing_committed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    hub_cmd(d, &["cluster", "add", "first"]);
    let mut kept = Vec::new();
    for i in 0..30u64 {
        let mut child = Command::new(role_bin("spur-hub"))
            .current_dir(d)
            .args(["cluster", "add", &format!("c{i}"), "--db", "hub.db"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Kill at a different point of the process's life each time (start-up, open, commit).
        std::thread::sleep(Duration::from_micros(i * 700));
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        let token = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if out.status.success() && !token.is_empty() {
            kept.push((format!("c{i}"), token));
        }
    }
    eprintln!("{} of 30 adds finished before the kill", kept.len());
    let check = rusqlite_check(d);
    assert_eq!(check, "ok");
    // Every add that reported a token is there, and its token works.
    let store = spur_hub::Store::open(&d.join("hub.db")).unwrap();
    for (name, token) in &kept {
        let id = store.cluster_for_token(token).unwrap();
        assert_eq!(id.map(|c| c.name).as_deref(), Some(name.as_str()));
    }
    // And the file still takes writes.
    hub_cmd(d, &["cluster", "add", "last"]);
}

fn rusqlite_check(d: &Path) -> String {
    spur_hub::store::integrity_check(&d.join("hub.db")).unwrap()
}

#[cfg(feature = "kube")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preview_url_injects_the_key_through_the_agent_and_refuses_the_unauthenticated() {
    use kube::Api;
    use kube::api::DeleteParams;
    use spur_api::Sandbox;

    let (app_port, hits) = echo_app();
    let PreviewSetup { api, dir, key } =
        preview_setup(&format!("http://localhost:{app_port}")).await;
    let d = dir.path();
    let sandboxes: Api<Sandbox> = Api::all(api.client());

    let ca = d.join("ca.pem");
    let host = "web--feature-x.preview.test";
    let auth = format!("x-spur-api-key: {key}");
    let PreviewHub {
        port,
        preview,
        metrics,
        process: _hub,
    } = start_preview_hub(d, "4s");
    let agent = start_loopback_agent(d, port, "kubeconfig", "agent.log").process;

    // Unauthenticated: 401, and nothing reached the cluster.
    wait_until("the preview port", Duration::from_secs(20), || {
        curl(&ca, preview, host, "/", &[]).0 == 401
    });
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    let (code, _) = curl(&ca, preview, host, "/", &["x-spur-api-key: spurk_wrong"]);
    assert_eq!(code, 401);

    // Authenticated: the app answers, with the key in every carrier, a spoofed key replaced,
    // and the API key gone.
    let mut last = (0, String::new());
    wait_until("the preview to answer", Duration::from_secs(30), || {
        last = curl(
            &ca,
            preview,
            host,
            "/hello?x=1",
            &[&auth, "baggage: sd-routing-key=someone-else"],
        );
        last.0 == 200
    });
    let (_, body) = last;
    assert!(body.starts_with("get /hello?x=1 http/1.1"), "{body}");
    assert!(body.contains("sd-routing-key=k3y4feature"), "{body}");
    assert!(!body.contains("someone-else"), "{body}");
    assert!(
        body.contains("uberctx-sd-routing-key: k3y4feature"),
        "{body}"
    );
    assert!(
        !body.contains("x-spur-api-key") && !body.contains(&key),
        "{body}"
    );
    assert!(
        body.contains("x-forwarded-host: web--feature-x.preview.test"),
        "{body}"
    );

    // No path form: a preview on the web view's host would run on its origin (issue 42).
    let (code, body) = curl(
        &ca,
        preview,
        "localhost",
        "/p/web--feature-x--east/a/b",
        &[&auth],
    );
    assert_eq!(code, 404, "{body}");
    assert!(!body.contains("get /a/b"), "{body}");
    // The cluster-qualified name.
    let (code, body) = curl(
        &ca,
        preview,
        "web--feature-x--east.preview.test",
        "/a/b",
        &[&auth],
    );
    assert_eq!(code, 200, "{body}");
    assert!(body.starts_with("get /a/b http/1.1"), "{body}");

    // Bad input: a malformed name, an unknown endpoint, an unknown cluster.
    let (code, _) = curl(&ca, preview, "web-feature-x.preview.test", "/", &[&auth]);
    assert_eq!(code, 400);
    let (code, body) = curl(&ca, preview, "api--feature-x.preview.test", "/", &[&auth]);
    assert_eq!(code, 404, "{body}");
    let (code, body) = curl(
        &ca,
        preview,
        "web--feature-x--west.preview.test",
        "/",
        &[&auth],
    );
    assert_eq!(code, 404, "{body}");

    // gRPC (HTTP/2 to a grpc:// target) and WebSocket (an HTTP/1.1 upgrade) through previews.
    let apps = spur_demo_apps::CancellationToken::new();
    let ws_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ws_port = ws_listener.local_addr().unwrap().port();
    tokio::spawn(spur_demo_apps::serve_http(
        ws_listener,
        "ws-app".into(),
        apps.clone(),
    ));
    let grpc_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc_port = grpc_listener.local_addr().unwrap().port();
    let grpc_stop = apps.clone();
    tokio::spawn(async move {
        spur_perf::upstream::serve(vec![grpc_listener], grpc_stop.cancelled_owned()).await
    });
    let endpoints = serde_json::json!([
        {"name": "ws", "target": format!("http://localhost:{ws_port}")},
        {"name": "rpc", "target": format!("grpc://localhost:{grpc_port}")}
    ]);
    sandbox_with(
        &api,
        "protos",
        endpoints,
        serde_json::json!({"routingKey": "protoskey1"}),
    )
    .await;
    wait_until(
        "the protos sandbox at the hub",
        Duration::from_secs(20),
        || curl(&ca, preview, "ws--protos.preview.test", "/", &[&auth]).0 == 200,
    );
    let grpc = {
        let mut cfg = spur_perf::load::LoadConfig::new(
            format!("https://rpc--protos.preview.test:{preview}/")
                .parse()
                .unwrap(),
            spur_perf::load::Proto::Grpc,
            spur_perf::load::Mode::Closed,
        );
        cfg.duration = Duration::from_secs(1);
        cfg.warmup = Duration::ZERO;
        cfg.payload = 100;
        cfg.ca_file = Some(ca.clone());
        cfg.connect_to = Some(std::net::SocketAddr::from(([127, 0, 0, 1], preview)));
        cfg.headers = vec![spur_perf::load::parse_header(&auth).unwrap()];
        tokio::task::spawn_blocking(move || spur_perf::load::run(&cfg))
            .await
            .unwrap()
            .unwrap()
    };
    assert!(
        grpc.requests > 10 && grpc.errors == 0,
        "gRPC through the preview: {}",
        grpc.summary()
    );
    {
        use futures_util::{SinkExt, StreamExt};
        use rustls::pki_types::pem::PemObject;
        use tokio_tungstenite::tungstenite::{Message, client::IntoClientRequest};
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_file_iter(&ca).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let mut tls = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", preview))
            .await
            .unwrap();
        let name = rustls::pki_types::ServerName::try_from("ws--protos.preview.test").unwrap();
        let stream = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
            .connect(name, tcp)
            .await
            .unwrap();
        let mut request = "wss://ws--protos.preview.test/ws"
            .into_client_request()
            .unwrap();
        request
            .headers_mut()
            .insert("x-spur-api-key", key.parse().unwrap());
        let (mut ws, resp) = tokio_tungstenite::client_async(request, stream)
            .await
            .unwrap();
        assert_eq!(resp.status(), 101);
        ws.send(Message::text("hello")).await.unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(reply, Message::text("ws-app: hello"));
        let _ = ws.close(None).await;
    }

    // A stalled agent (stopped, its session still open): a clear gateway error, in bounded
    // time, and the hub keeps serving; once it runs again, previews work.
    let agent_pid = agent.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-STOP", &agent_pid])
            .status()
            .unwrap()
            .success()
    );
    let stalled_at = Instant::now();
    let (code, body) = curl(&ca, preview, host, "/", &[&auth]);
    eprintln!(
        "stalled agent: {code} after {:?}: {}",
        stalled_at.elapsed(),
        body.trim()
    );
    assert!(matches!(code, 502..=504), "{code}: {body}");
    assert_eq!(
        curl(&ca, preview, host, "/", &[]).0,
        401,
        "the hub stopped answering"
    );
    assert!(
        Command::new("kill")
            .args(["-CONT", &agent_pid])
            .status()
            .unwrap()
            .success()
    );
    wait_until(
        "previews after the agent resumed",
        Duration::from_secs(60),
        || curl(&ca, preview, host, "/", &[&auth]).0 == 200,
    );

    // A flood of sessions with a wrong token: each refused, the registration and previews
    // unharmed.
    std::fs::write(d.join("bad.token"), "spurc_00000000").unwrap();
    let flood: Vec<Killed> = (0..20)
        .map(|_| {
            let flags = ["--no-kube", "--health-addr", "127.0.0.1:0"];
            start_agent(d, port, "bad.token", &flags, Stdio::null())
        })
        .collect();
    for mut f in flood {
        let (status, _) = wait_for_exit(&mut f.0, Duration::from_secs(30));
        assert!(!status.success());
    }
    let listed = String::from_utf8(hub_cmd(d, &["cluster", "list"]).stdout).unwrap();
    assert!(
        listed.contains("east") && listed.contains("active"),
        "{listed}"
    );
    assert_eq!(curl(&ca, preview, host, "/", &[&auth]).0, 200);
    // Malformed Host headers (HTTP/1.1, where the client may send anything): 400.
    for bad in [
        "a b",
        "x--y--z--w.preview.test",
        "-x--y.preview.test",
        "a@b",
    ] {
        let out = Command::new("curl")
            .args(["-sS", "--http1.1", "--max-time", "10", "--cacert"])
            .arg(&ca)
            .args(["-o", "/dev/null", "-w", "%{http_code}", "-H", &auth])
            .args(["-H", &format!("host: {bad}")])
            .arg(format!("https://localhost:{preview}/"))
            .output()
            .unwrap();
        let code = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(code, "400", "Host {bad:?}");
    }

    // Multi-cluster: a second cluster's agent ("west", no Kubernetes of its own here); a
    // sandbox of east whose public endpoint names west is served through west's agent (east's is
    // stopped to prove it), without an API key.
    let west_token = hub_cmd(d, &["cluster", "add", "west"]).stdout;
    std::fs::write(d.join("west.token"), &west_token).unwrap();
    let west_flags = [
        "--no-kube",
        "--target-suffix",
        "localhost",
        "--allow-cidrs",
        "127.0.0.0/8",
        "--health-addr",
        "127.0.0.1:0",
    ];
    let _west = start_agent(
        d,
        port,
        "west.token",
        &west_flags,
        log_file(d, "agent-west.log"),
    );
    let endpoints = serde_json::json!([{
        "name": "web", "target": format!("http://localhost:{app_port}"),
        "cluster": "west", "public": true
    }]);
    sandbox_with(
        &api,
        "cross",
        endpoints,
        serde_json::json!({"routingKey": "crosskey01"}),
    )
    .await;
    // The hub learns of the sandbox through east's agent (its watch): wait for that before
    // stopping east, then the request can only be served through west.
    let mut last = (0, String::new());
    wait_until(
        "the public cross-cluster preview",
        Duration::from_secs(30),
        || {
            last = curl(&ca, preview, "web--cross.preview.test", "/x", &[]);
            last.0 == 200
        },
    );
    assert!(
        Command::new("kill")
            .args(["-STOP", &agent_pid])
            .status()
            .unwrap()
            .success()
    );
    last = curl(&ca, preview, "web--cross.preview.test", "/x", &[]);
    assert_eq!(last.0, 200, "{}", last.1);
    assert!(last.1.contains("sd-routing-key=crosskey01"), "{}", last.1);
    // The other sandbox's endpoint is not public: still 401 without a key.
    assert_eq!(curl(&ca, preview, host, "/", &[]).0, 401);
    assert!(
        Command::new("kill")
            .args(["-CONT", &agent_pid])
            .status()
            .unwrap()
            .success()
    );

    // The hub's metrics count what it answered and see both clusters.
    let scraped = http_get(metrics, "/metrics").unwrap_or_default();
    for needle in [
        "spur_hub_preview_requests_total{code=\"200\"}",
        "spur_hub_preview_requests_total{code=\"401\"}",
        "spur_hub_preview_requests_total{code=\"504\"}",
        "spur_hub_clusters_connected 2",
        "spur_hub_preview_upstream_seconds_count",
        "spur_hub_database_errors_total 0",
    ] {
        assert!(scraped.contains(needle), "{needle} not in:\n{scraped}");
    }

    // The sandbox goes: its URL is a 404.
    sandboxes
        .delete("feature-x", &DeleteParams::default())
        .await
        .unwrap();
    wait_until(
        "the deleted sandbox's URL to 404",
        Duration::from_secs(20),
        || curl(&ca, preview, host, "/", &[&auth]).0 == 404,
    );
}

/// A headless Chromium driven over the DevTools protocol (one page).
#[cfg(all(feature = "kube", feature = "root"))]
struct Browser {
    _child: Killed,
    ws: tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>,
    session: String,
    next: u64,
    _profile: tempfile::TempDir,
}

#[cfg(all(feature = "kube", feature = "root"))]
impl Browser {
    async fn start() -> Browser {
        use std::io::BufRead;
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new("chromium")
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
            ])
            // The hub's certificate comes from its own CA, which this throwaway profile does not
            // trust; what is under test is the page, not the browser's trust store.
            .args(["--ignore-certificate-errors", "--remote-debugging-port=0"])
            // Preview hosts are names under the test's preview domain: all on loopback.
            .arg("--host-resolver-rules=MAP *.preview.test 127.0.0.1")
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("chromium (tests/run.sh installs it)");
        let stderr = child.stderr.take().unwrap();
        let child = Killed(child);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(url) = line.split("DevTools listening on ").nth(1) {
                    let _ = tx.send(url.trim().to_owned());
                }
            }
        });
        let url = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("chromium printed no DevTools address");
        let addr = url
            .strip_prefix("ws://")
            .and_then(|r| r.split('/').next())
            .unwrap()
            .to_owned();
        let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let (ws, _) = tokio_tungstenite::client_async(url.as_str(), tcp)
            .await
            .unwrap();
        let mut b = Browser {
            _child: child,
            ws,
            session: String::new(),
            next: 0,
            _profile: profile,
        };
        let target = b
            .call(
                false,
                "Target.createTarget",
                serde_json::json!({"url": "about:blank"}),
            )
            .await;
        let target = target["targetId"].as_str().unwrap().to_owned();
        let attached = b
            .call(
                false,
                "Target.attachToTarget",
                serde_json::json!({"targetId": target, "flatten": true}),
            )
            .await;
        b.session = attached["sessionId"].as_str().unwrap().to_owned();
        b.call(
            true,
            "Emulation.setDeviceMetricsOverride",
            serde_json::json!({"width": 1280, "height": 720, "deviceScaleFactor": 1, "mobile": false}),
        )
        .await;
        b
    }

    async fn call(
        &mut self,
        on_page: bool,
        method: &str,
        params: serde_json::Value,
    ) -> serde_json::Value {
        use futures_util::{SinkExt, StreamExt};
        use tokio_tungstenite::tungstenite::Message;
        self.next += 1;
        let id = self.next;
        let mut msg = serde_json::json!({"id": id, "method": method, "params": params});
        if on_page {
            msg["sessionId"] = self.session.clone().into();
        }
        self.ws.send(Message::text(msg.to_string())).await.unwrap();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(30), self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("no answer to {method}"))
                .unwrap()
                .unwrap();
            let Message::Text(text) = m else { continue };
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            if v["id"].as_u64() == Some(id) {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    async fn eval(&mut self, expression: &str) -> serde_json::Value {
        let r = self
            .call(
                true,
                "Runtime.evaluate",
                serde_json::json!({"expression": expression, "returnByValue": true}),
            )
            .await;
        r["result"]["value"].clone()
    }

    async fn wait_for_text(&mut self, needle: &str, limit: Duration) -> String {
        let start = Instant::now();
        loop {
            let text = self
                .eval("document.readyState === 'complete' ? document.body.innerText : ''")
                .await;
            let text = text.as_str().unwrap_or_default().to_owned();
            if text.contains(needle) {
                return text;
            }
            assert!(
                start.elapsed() < limit,
                "{needle:?} never appeared; the page says:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A ready Sandbox with one endpoint, `web.shop.svc`.
#[cfg(feature = "kube")]
async fn sandbox_with_endpoint(api: &spur_kube_harness::KubeApi, name: &str) {
    let endpoints = serde_json::json!([{"name": "web", "target": "http://web.shop.svc:8080"}]);
    let status = serde_json::json!({
        "routingKey": format!("key{name}"),
        "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    });
    sandbox_with(api, name, endpoints, status).await;
}

#[cfg(all(feature = "kube", feature = "root"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_view_shows_both_clusters_and_updates_live_in_chromium() {
    let (east, west) = tokio::join!(
        spur_kube_harness::KubeApi::start(),
        spur_kube_harness::KubeApi::start()
    );
    let (east, west) = (east.unwrap(), west.unwrap());
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/crds");
    for api in [&east, &west] {
        for entry in std::fs::read_dir(&crds).unwrap() {
            api.install_crd_file(&entry.unwrap().path()).await.unwrap();
        }
    }
    sandbox_with_endpoint(&east, "checkout-fix").await;
    sandbox_with_endpoint(&west, "search-v2").await;
    // A job in east, with the phase the jobs component would have written.
    {
        use kube::api::{Patch, PatchParams, PostParams};
        create_namespace(&east, "ci").await;
        let jobs: kube::Api<spur_api::Job> = kube::Api::namespaced(east.client(), "ci");
        let job: spur_api::Job = serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
            "metadata": {"name": "smoke-checkout", "namespace": "ci"},
            "spec": {"runnerGroup": "smoke", "command": ["true"],
                     "routingContext": {"sandbox": "checkout-fix"}}
        }))
        .unwrap();
        jobs.create(&PostParams::default(), &job).await.unwrap();
        jobs.patch_status(
            "smoke-checkout",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"phase": "Succeeded", "exitCode": 0}})),
        )
        .await
        .unwrap();
    }
    // The automatic smart-test runs' outcome on checkout-fix, as their controller would write
    // it: the Tests condition and a kept run (its Job, ended with a summary).
    {
        use kube::api::{Patch, PatchParams, PostParams};
        let sandboxes: kube::Api<spur_api::Sandbox> = kube::Api::all(east.client());
        let uid = sandboxes
            .get("checkout-fix")
            .await
            .unwrap()
            .metadata
            .uid
            .unwrap();
        let status = serde_json::json!({"status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "Ready", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
            {"type": "Tests", "status": "False", "reason": "Findings", "observedGeneration": 1,
             "message": "1 test: 1 with findings\ndefault/list-items (job list-items-1): 1 finding (1 schema)",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
        ]}});
        sandboxes
            .patch_status(
                "checkout-fix",
                &PatchParams::default(),
                &Patch::Merge(status),
            )
            .await
            .unwrap();
        let jobs: kube::Api<spur_api::Job> = kube::Api::namespaced(east.client(), "default");
        let run: spur_api::Job = serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
            "metadata": {"name": "list-items-1", "namespace": "default",
                "labels": {"spur.dev/smarttest": "list-items", "spur.dev/sandbox": "checkout-fix"},
                "annotations": {"spur.dev/sandbox-generation": "1"},
                "ownerReferences": [
                    {"apiVersion": "spur.dev/v1alpha1", "kind": "SmartTest", "name": "list-items",
                     "uid": "0b7c9f8e-0000-4000-8000-000000000001", "controller": true},
                    {"apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox", "name": "checkout-fix", "uid": uid}]},
            "spec": {"runnerGroup": "smart-tests", "script": "true",
                     "routingContext": {"sandbox": "checkout-fix"}}
        }))
        .unwrap();
        jobs.create(&PostParams::default(), &run).await.unwrap();
        let summary = r#"{"passed":false,"steps":1,"checksFailed":0,"findings":1,"byRank":{"schema":1},"top":[{"rank":"schema","endpoint":"GET web.default/items","what":"$.items[*].price: removed <3>","occurrences":2}],"failedChecks":[],"omitted":0}"#;
        jobs.patch_status(
            "list-items-1",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"phase": "Failed", "exitCode": 1, "result": summary}})),
        )
        .await
        .unwrap();
    }
    // The route table east's sidecars hold (a RoutingConfig's exported routes, as the operator
    // would write them).
    {
        use kube::api::{Patch, PatchParams, PostParams};
        let rcs: kube::Api<spur_api::RoutingConfig> = kube::Api::all(east.client());
        let rc: spur_api::RoutingConfig = serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "RoutingConfig",
            "metadata": {"name": "checkout-fix-routes"},
            "spec": {"routingKey": "keycheckout-fix", "workloads": [
                {"kind": "ForkedWorkload", "namespace": "shop", "name": "web-fork", "sandbox": "checkout-fix"}
            ]}
        }))
        .unwrap();
        rcs.create(&PostParams::default(), &rc).await.unwrap();
        let status = serde_json::json!({"status": {"routeServer": {"routes": [{
            "fromHost": "web.shop.svc", "fromPort": 8080, "toHost": "checkout-fix-web.shop.svc",
            "toPort": 8080, "workloadPort": 8080, "sandbox": "checkout-fix",
            "baseline": {"kind": "Deployment", "namespace": "shop", "name": "web"}
        }]}}});
        rcs.patch_status(
            "checkout-fix-routes",
            &PatchParams::default(),
            &Patch::Merge(status),
        )
        .await
        .unwrap();
    }

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    east.write_kubeconfig(&d.join("east.kubeconfig")).unwrap();
    west.write_kubeconfig(&d.join("west.kubeconfig")).unwrap();
    for c in ["east", "west"] {
        let token = hub_cmd(d, &["cluster", "add", c]).stdout;
        std::fs::write(d.join(format!("{c}.token")), &token).unwrap();
    }
    add_admin_user(d);
    let key = String::from_utf8(hub_cmd(d, &["apikey", "add", "dev"]).stdout).unwrap();
    let key = key.trim().to_owned();
    // A user of team-b: the hub shows them nothing of default's sandboxes, tests included
    // (their Kubernetes rights are wide; the hub's scope is what is tested).
    hub_cmd(
        d,
        &[
            "user",
            "add",
            "bob",
            "--cluster",
            "*",
            "--namespace",
            "team-b",
            "--kube-group",
            "system:masters",
        ],
    );
    let bob_key = String::from_utf8(hub_cmd(d, &["apikey", "add", "bob"]).stdout).unwrap();
    let bob_key = bob_key.trim().to_owned();
    std::fs::write(d.join("ca.pem"), hub_cmd(d, &["ca"]).stdout).unwrap();

    let (port, web) = (free_port(), free_port());
    let web_addr = format!("127.0.0.1:{web}");
    let _hub = start_hub(
        d,
        port,
        &[
            "--preview-addr",
            &web_addr,
            "--preview-domain",
            "preview.test",
        ],
    );
    let mut agents = Vec::new();
    for c in ["east", "west"] {
        let (kubeconfig, health) = (format!("{c}.kubeconfig"), health_addr().to_string());
        agents.push(start_agent(
            d,
            port,
            &format!("{c}.token"),
            &["--kubeconfig", &kubeconfig, "--health-addr", &health],
            log_file(d, &format!("agent-{c}.log")),
        ));
    }
    let ca = d.join("ca.pem");
    // Without a session the page is a redirect to the login form, never the data (once the
    // hub listens: curl says 0 before).
    let mut first = (0, String::new());
    wait_until("the hub's web port", Duration::from_secs(20), || {
        first = curl(&ca, web, "localhost", "/", &[]);
        first.0 != 0
    });
    assert_eq!(first.0, 303, "{}", first.1);
    // Server-rendered: readable without JavaScript (here with an API key instead of a cookie).
    let auth = format!("x-spur-api-key: {key}");
    wait_until(
        "both clusters' sandboxes in the HTML",
        Duration::from_secs(30),
        || {
            let (code, body) = curl(&ca, web, "localhost", "/", &[&auth]);
            code == 200
                && body.contains("checkout-fix")
                && body.contains("search-v2")
                && body.contains("ci/smoke-checkout")
        },
    );
    let (_, body) = curl(&ca, web, "localhost", "/", &[&auth]);
    assert!(
        body.contains("<td>ci/smoke-checkout</td><td>smoke</td><td>sandbox checkout-fix</td><td>Succeeded</td><td>0</td>"),
        "{body}"
    );
    // The sandbox's test verdict links to its results tab, itself readable without JavaScript:
    // the condition, the run and its finding (escaped).
    assert!(
        body.contains(
            "<a class=bad href=\"/tests?cluster=east&amp;sandbox=checkout-fix\">findings</a>"
        ),
        "{body}"
    );
    let (code, tests) = curl(
        &ca,
        web,
        "localhost",
        "/tests?cluster=east&sandbox=checkout-fix",
        &[&auth],
    );
    assert_eq!(code, 200, "{tests}");
    assert!(
        tests.contains("Tests: <span class=bad>findings</span> (Findings)")
            && tests.contains("<td>default/list-items</td><td>list-items-1</td><td>1</td>")
            && tests.contains("$.items[*].price: removed &lt;3&gt; (×2)"),
        "{tests}"
    );
    assert!(!tests.contains("<script"), "{tests}");
    // Bob, of team-b, sees neither the sandbox nor its runs.
    let bob_auth = format!("x-spur-api-key: {bob_key}");
    let (code, theirs) = curl(
        &ca,
        web,
        "localhost",
        "/tests?cluster=east&sandbox=checkout-fix",
        &[&bob_auth],
    );
    assert_eq!(code, 200, "{theirs}");
    assert!(
        theirs.contains("no sandbox \"checkout-fix\" that you may see in cluster \"east\"")
            || theirs.contains(
                "no sandbox &quot;checkout-fix&quot; that you may see in cluster &quot;east&quot;"
            ),
        "{theirs}"
    );
    assert!(
        !theirs.contains("list-items") && !theirs.contains("removed"),
        "{theirs}"
    );
    let (_, overview) = curl(&ca, web, "localhost", "/", &[&bob_auth]);
    assert!(
        !overview.contains("checkout-fix") && !overview.contains("list-items"),
        "{overview}"
    );

    // The login form: a wrong key is refused; the right one sets a session cookie that then
    // opens the page (and logging out ends it).
    let login = |key: &str| -> String {
        let out = Command::new("curl")
            .args(["-sS", "-i", "--max-time", "10", "--cacert"])
            .arg(&ca)
            .args(["--data-urlencode", &format!("key={key}")])
            .arg(format!("https://localhost:{web}/login"))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let refused = login("spurk_wrong");
    assert!(
        refused.starts_with("HTTP/2 401") || refused.starts_with("HTTP/1.1 401"),
        "{refused}"
    );
    assert!(
        !refused.to_ascii_lowercase().contains("set-cookie"),
        "{refused}"
    );
    let accepted = login(&key);
    let cookie = accepted
        .lines()
        .find_map(|l| {
            l.strip_prefix("set-cookie: ")
                .or_else(|| l.strip_prefix("Set-Cookie: "))
        })
        .and_then(|c| c.split(';').next())
        .unwrap_or_else(|| panic!("no session cookie: {accepted}"))
        .to_owned();
    assert!(cookie.starts_with("__Host-spur_hub=spurs_"), "{cookie}");
    let (code, body) = curl(&ca, web, "localhost", "/", &[&format!("cookie: {cookie}")]);
    assert_eq!(code, 200);
    assert!(body.contains("search-v2"), "{body}");

    let url = format!("https://localhost:{web}");
    let link = String::from_utf8(hub_cmd(d, &["login-link", "dev", "--url", &url]).stdout).unwrap();
    let mut browser = Browser::start().await;
    browser
        .call(
            true,
            "Page.navigate",
            serde_json::json!({"url": link.trim()}),
        )
        .await;
    // The link's page logs in only when the user confirms (a GET logs no one in).
    browser
        .wait_for_text("Log in as dev", Duration::from_secs(30))
        .await;
    browser
        .eval("document.querySelector('form button').click()")
        .await;
    browser
        .wait_for_text("checkout-fix-web.shop.svc:8080", Duration::from_secs(30))
        .await;
    let text = browser
        .wait_for_text("search-v2", Duration::from_secs(30))
        .await;
    assert!(
        text.contains("checkout-fix") && text.contains("east") && text.contains("west"),
        "{text}"
    );
    assert!(text.contains("connected"), "{text}");
    // Wait for the live stream, then mark the page: a reload would lose the mark.
    browser.wait_for_text("live", Duration::from_secs(20)).await;
    browser.eval("window.spurMark = 42").await;
    let shot = browser
        .call(
            true,
            "Page.captureScreenshot",
            serde_json::json!({"format": "png"}),
        )
        .await;
    let png = base64::Engine::decode(
        &base64::engine::general_purpose::STANDARD,
        shot["data"].as_str().unwrap(),
    )
    .unwrap();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hub-web-view.png");
    std::fs::write(&out, &png).unwrap();
    eprintln!("screenshot: {}", out.display());
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );

    // A new sandbox appears without a reload.
    sandbox_with_endpoint(&east, "payments-ab").await;
    let text = browser
        .wait_for_text("payments-ab", Duration::from_secs(20))
        .await;
    assert_eq!(
        browser.eval("window.spurMark").await,
        42,
        "the page reloaded:\n{text}"
    );

    // The verdict's link opens the results tab.
    browser
        .eval("document.querySelector('a[href^=\"/tests?\"]').click()")
        .await;
    let text = browser
        .wait_for_text(
            "Smart tests of checkout-fix in east",
            Duration::from_secs(30),
        )
        .await;
    assert!(
        text.contains("default/list-items")
            && text.contains("1 finding (1 schema)")
            && text.contains("$.items[*].price: removed <3> (×2)"),
        "{text}"
    );
}

/// An app whose page is hostile: its script, running on the preview's origin in the browser of
/// a user logged in to the web view, tries to read the hub (the web view, its live events and
/// the traffic tab, with the user's cookies) and the hub's cookies, and shows what it got.
#[cfg(all(feature = "kube", feature = "root"))]
fn hostile_app(hub: &str) -> u16 {
    use std::io::{BufRead, BufReader, Write};
    let page = format!(
        r#"<!doctype html><html><head><title>hostile</title></head><body>working<script>
(async () => {{
  const out = {{}};
  // Labelled by index: a sandbox name in a label would look like a leak.
  const paths = ["/", "/events", "/traffic?cluster=east&sandbox=" + "checkout" + "-fix", "/login"];
  for (const [i, path] of paths.entries()) {{
    const label = "p" + i;
    try {{
      const r = await fetch("{hub}" + path, {{credentials: "include", mode: "cors"}});
      out[label] = "read " + r.status + ": " + (await r.text()).slice(0, 400);
    }} catch (e) {{
      out[label] = "blocked: " + e;
    }}
    try {{
      const r = await fetch("{hub}" + path, {{credentials: "include", mode: "no-cors"}});
      out[label + " no-cors"] = "type " + r.type + ", " + (await r.text()).length + " bytes readable";
    }} catch (e) {{
      out[label + " no-cors"] = "blocked: " + e;
    }}
  }}
  const frame = document.createElement("iframe");
  frame.src = "{hub}/";
  document.body.appendChild(frame);
  await new Promise(r => setTimeout(r, 1500));
  try {{
    out.frame = "read: " + frame.contentDocument.body.innerText.slice(0, 400);
  }} catch (e) {{
    out.frame = "blocked: " + e;
  }}
  out.cookie = "cookies: " + document.cookie;
  document.body.innerText = "HOSTILE-DONE " + JSON.stringify(out);
}})();
</script></body></html>"#
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let page = page.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                loop {
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let _ = write!(
                        conn,
                        "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\n\r\n{page}",
                        page.len()
                    );
                }
            });
        }
    });
    port
}

/// The acceptance check of issue 42: a preview page cannot read the web view. In headless
/// Chromium, logged in to the web view, a public preview whose page runs a hostile script gets
/// no hub data: not the web view, not its events, not the traffic tab (by fetch, with or without
/// CORS, nor through a frame), and no hub cookie.
#[cfg(all(feature = "kube", feature = "root"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_preview_reads_nothing_of_the_hub_in_chromium() {
    let api = spur_kube_harness::KubeApi::start().await.unwrap();
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/crds");
    for entry in std::fs::read_dir(&crds).unwrap() {
        api.install_crd_file(&entry.unwrap().path()).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    api.write_kubeconfig(&d.join("east.kubeconfig")).unwrap();
    // A sandbox whose name the web view shows (what the script looks for), and the hostile one.
    sandbox_with_endpoint(&api, "checkout-fix").await;
    let token = hub_cmd(d, &["cluster", "add", "east"]).stdout;
    std::fs::write(d.join("east.token"), &token).unwrap();
    add_admin_user(d);
    hub_cmd(d, &["apikey", "add", "dev"]);
    std::fs::write(d.join("ca.pem"), hub_cmd(d, &["ca"]).stdout).unwrap();
    let (port, web) = (free_port(), free_port());
    let hub_origin = format!("https://localhost:{web}");
    let app = hostile_app(&hub_origin);
    let endpoints = serde_json::json!([{"name": "web", "public": true,
                                        "target": format!("http://localhost:{app}")}]);
    sandbox_with(
        &api,
        "hostile",
        endpoints,
        serde_json::json!({"routingKey": "k3yhostile"}),
    )
    .await;
    let web_addr = format!("127.0.0.1:{web}");
    let _hub = start_hub(
        d,
        port,
        &[
            "--preview-addr",
            &web_addr,
            "--preview-domain",
            "preview.test",
            "--allow-public-previews",
        ],
    );
    let _agent = start_loopback_agent(d, port, "east.kubeconfig", "agent-east.log");
    let ca = d.join("ca.pem");
    let preview_host = "web--hostile.preview.test";
    wait_until(
        "the hostile preview to answer",
        Duration::from_secs(30),
        || {
            let (code, body) = curl(&ca, web, preview_host, "/", &[]);
            code == 200 && body.contains("working")
        },
    );

    // The user logs in to the web view in the browser, and sees their sandboxes.
    let link =
        String::from_utf8(hub_cmd(d, &["login-link", "dev", "--url", &hub_origin]).stdout).unwrap();
    let mut browser = Browser::start().await;
    browser
        .call(
            true,
            "Page.navigate",
            serde_json::json!({"url": link.trim()}),
        )
        .await;
    browser
        .wait_for_text("Log in as dev", Duration::from_secs(30))
        .await;
    browser
        .eval("document.querySelector('form button').click()")
        .await;
    browser
        .wait_for_text("checkout-fix", Duration::from_secs(30))
        .await;

    // Then opens the hostile preview in the same browser.
    let url = format!("https://{preview_host}:{web}/");
    browser
        .call(true, "Page.navigate", serde_json::json!({"url": url}))
        .await;
    let text = browser
        .wait_for_text("HOSTILE-DONE", Duration::from_secs(60))
        .await;
    eprintln!("the hostile script got: {text}");
    // Nothing of the hub's data: no sandbox name, key, route or cookie.
    for secret in [
        "checkout-fix",
        "keycheckout-fix",
        "web.shop.svc",
        "spur_hub",
        "spurs_",
    ] {
        assert!(
            !text.contains(secret),
            "the preview's script read {secret:?}: {text}"
        );
    }
    // And every read was refused or opaque, not merely empty.
    assert!(!text.contains("\"read "), "a CORS read succeeded: {text}");
    assert!(text.contains("\"frame\":\"blocked"), "{text}");
    assert!(text.contains("\"cookie\":\"cookies: \""), "{text}");
}

#[cfg(feature = "kube")]
async fn create_namespace(api: &spur_kube_harness::KubeApi, name: &str) {
    use kube::api::PostParams;
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
    kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(api.client())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
}
