//! What the hub tests (`hub.rs`, `hub_agents.rs`) share: the hub's and agents' processes, ports,
//! an echo app behind previews, curl against the preview port, and Sandboxes written as the
//! operator would.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::roles::role_bin;

pub(crate) struct Killed(pub(crate) Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `spur-hub ARGS` (a registry command) in `dir`, which must succeed.
pub(crate) fn hub_cmd(dir: &Path, args: &[&str]) -> std::process::Output {
    let out = Command::new(role_bin("spur-hub"))
        .current_dir(dir)
        .args(args)
        .env("SPUR_HUB_DB", dir.join("hub.db"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "spur-hub {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Hub user `dev`, who sees every cluster and namespace and acts as a cluster admin there.
#[cfg(feature = "kube")]
pub(crate) fn add_admin_user(d: &Path) {
    hub_cmd(
        d,
        &[
            "user",
            "add",
            "dev",
            "--cluster",
            "*",
            "--all-namespaces",
            "--kube-group",
            "system:masters",
        ],
    );
}

pub(crate) use spur_kube_harness::free_port;

/// `spur-hub serve` with its tunnel on `port`, plus `extra` flags; logs to `hub-PORT.log`.
pub(crate) fn start_hub(dir: &Path, port: u16, extra: &[&str]) -> Killed {
    Killed(
        Command::new(role_bin("spur-hub"))
            .current_dir(dir)
            .args(["serve", "--db", "hub.db"])
            .args(["--tunnel-addr", &format!("127.0.0.1:{port}")])
            .args(if extra.contains(&"--metrics-addr") {
                &[][..]
            } else {
                &["--metrics-addr", "127.0.0.1:0"][..]
            })
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join(format!("hub-{port}.log"))).unwrap())
            .spawn()
            .unwrap(),
    )
}

/// `spur-agent` dialling the hub's tunnel on `port` with `token_file`, plus `extra` flags.
pub(crate) fn start_agent(
    dir: &Path,
    port: u16,
    token_file: &str,
    extra: &[&str],
    stderr: Stdio,
) -> Killed {
    Killed(
        Command::new(role_bin("spur-agent"))
            .current_dir(dir)
            .args(["--hub", &format!("127.0.0.1:{port}")])
            .args(["--hub-server-name", "localhost", "--hub-ca", "ca.pem"])
            .args(["--token-file", token_file])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap(),
    )
}

/// An agent of cluster `east` (token file `east.token`) with its health address (`/readyz`,
/// `/metrics`).
#[cfg(feature = "kube")]
pub(crate) struct LoopbackAgent {
    pub(crate) process: Killed,
    pub(crate) health: SocketAddr,
}

/// Starts a [`LoopbackAgent`] dialling the hub's tunnel on `port`, reading Kubernetes through
/// `kubeconfig` and reaching targets named `localhost` (the test's apps listen on loopback,
/// which the agent refuses unless named); logs to `log`.
#[cfg(feature = "kube")]
pub(crate) fn start_loopback_agent(
    d: &Path,
    port: u16,
    kubeconfig: &str,
    log: &str,
) -> LoopbackAgent {
    let health = health_addr();
    let health_arg = health.to_string();
    let process = start_agent(
        d,
        port,
        "east.token",
        &[
            "--kubeconfig",
            kubeconfig,
            "--target-suffix",
            "localhost",
            "--allow-cidrs",
            "127.0.0.0/8",
            "--health-addr",
            &health_arg,
        ],
        log_file(d, log),
    );
    LoopbackAgent { process, health }
}

#[cfg(feature = "kube")]
pub(crate) fn log_file(dir: &Path, name: &str) -> Stdio {
    std::fs::File::create(dir.join(name)).unwrap().into()
}

/// GET `path` on `addr` with a raw HTTP/1.1 request; the whole response, or None.
pub(crate) fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// GET `path` on `addr`; the status code, or None.
pub(crate) fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    http_get(addr, path)?.split(' ').nth(1)?.parse().ok()
}

pub(crate) fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

pub(crate) fn health_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// An HTTP/1.1 app on loopback that answers every request with its request head (so the test
/// sees exactly what the hub forwarded) and counts requests.
#[cfg(feature = "kube")]
pub(crate) fn echo_app() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    echo_app_closing_every(0)
}

/// [`echo_app`] that closes a connection after its `n`th response (`connection: close`), so
/// the hub's pooled connections to it turn over; 0: never.
#[cfg(feature = "kube")]
pub(crate) fn echo_app_closing_every(
    n: usize,
) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = hits.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let counter = counter.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut answered = 0;
                loop {
                    let mut head = String::new();
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        head.push_str(&line);
                    }
                    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let body = head.to_ascii_lowercase();
                    answered += 1;
                    let last = n > 0 && answered % n == 0;
                    let _ = write!(
                        conn,
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n{}\r\n{body}",
                        body.len(),
                        if last { "connection: close\r\n" } else { "" }
                    );
                    if last {
                        return;
                    }
                }
            });
        }
    });
    (port, hits)
}

/// curl against the hub's preview port with the hub's CA; status and body.
#[cfg(feature = "kube")]
pub(crate) fn curl(
    ca: &Path,
    preview: u16,
    host: &str,
    path: &str,
    headers: &[&str],
) -> (u16, String) {
    let mut c = Command::new("curl");
    c.args(["-sS", "--max-time", "10", "--cacert"])
        .arg(ca)
        .args(["--resolve", &format!("{host}:{preview}:127.0.0.1")])
        .args(["-w", "\n%{http_code}"]);
    for h in headers {
        c.args(["-H", h]);
    }
    c.arg(format!("https://{host}:{preview}{path}"));
    let out = c.output().expect("curl (tests/run.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// Creates Sandbox `name` (a fork of `default/web`) with `endpoints`, and writes `status` as the
/// operator would: no operator runs in these tests.
#[cfg(feature = "kube")]
pub(crate) async fn sandbox_with(
    api: &spur_kube_harness::KubeApi,
    name: &str,
    endpoints: serde_json::Value,
    status: serde_json::Value,
) {
    use kube::Api;
    use kube::api::{Patch, PatchParams, PostParams};
    let sandboxes: Api<spur_api::Sandbox> = Api::all(api.client());
    let sb: spur_api::Sandbox = serde_json::from_value(serde_json::json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {
            "forks": [{"forkOf": {"kind": "Deployment", "namespace": "default", "name": "web"}}],
            "defaultRouteGroup": {"endpoints": endpoints}
        }
    }))
    .unwrap();
    sandboxes.create(&PostParams::default(), &sb).await.unwrap();
    let status = serde_json::json!({ "status": status });
    sandboxes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap();
}

/// A hub serving previews (domain `preview.test`, public previews allowed).
#[cfg(feature = "kube")]
pub(crate) struct PreviewHub {
    /// The tunnel port agents dial.
    pub(crate) port: u16,
    /// The preview port (HTTPS).
    pub(crate) preview: u16,
    /// The metrics address.
    pub(crate) metrics: SocketAddr,
    pub(crate) process: Killed,
}

/// Starts a [`PreviewHub`] in `d` whose previews wait `timeout` (`--preview-timeout`, e.g.
/// `4s`) for a target's response. The ports are probed free and then bound by the hub: another
/// process may take one in between. A hub that exits at start (its bind failed) is started
/// again on other ports, with its log shown if it never comes up.
#[cfg(feature = "kube")]
pub(crate) fn start_preview_hub(d: &Path, timeout: &str) -> PreviewHub {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let metrics = health_addr();
        let metrics_arg = metrics.to_string();
        let port = free_port();
        let preview = free_port();
        let preview_addr = format!("127.0.0.1:{preview}");
        let mut hub = start_hub(
            d,
            port,
            &[
                "--preview-addr",
                &preview_addr,
                "--preview-domain",
                "preview.test",
                "--preview-timeout",
                timeout,
                "--allow-public-previews",
                "--metrics-addr",
                &metrics_arg,
            ],
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut exited = false;
        while Instant::now() < deadline {
            if hub.0.try_wait().ok().flatten().is_some() {
                exited = true;
                break;
            }
            if TcpStream::connect(("127.0.0.1", preview)).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if !exited && TcpStream::connect(("127.0.0.1", preview)).is_ok() {
            return PreviewHub {
                port,
                preview,
                metrics,
                process: hub,
            };
        }
        let log = std::fs::read_to_string(d.join(format!("hub-{port}.log"))).unwrap_or_default();
        assert!(attempt < 3, "the hub never served its preview port:\n{log}");
        eprintln!("hub start {attempt} failed (retrying on other ports):\n{log}");
    }
}

/// What both preview tests start from: a kube-apiserver with Spur's CRDs; a directory holding
/// its `kubeconfig`; Sandbox `feature-x` (key `k3y4feature`) whose endpoint `web` is `app`
/// (`http://localhost:PORT`), its status written as the operator would (no operator runs);
/// cluster `east` registered (token in `east.token`), hub user `dev` (an admin) and its API
/// key, and the hub's CA in `ca.pem`.
#[cfg(feature = "kube")]
pub(crate) struct PreviewSetup {
    pub(crate) api: spur_kube_harness::KubeApi,
    pub(crate) dir: tempfile::TempDir,
    /// The API key of hub user `dev`.
    pub(crate) key: String,
}

#[cfg(feature = "kube")]
pub(crate) async fn preview_setup(app: &str) -> PreviewSetup {
    let api = spur_kube_harness::KubeApi::start().await.unwrap();
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/crds");
    for entry in std::fs::read_dir(&crds).unwrap() {
        api.install_crd_file(&entry.unwrap().path()).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    api.write_kubeconfig(&d.join("kubeconfig")).unwrap();
    sandbox_with(
        &api,
        "feature-x",
        serde_json::json!([{"name": "web", "target": app}]),
        serde_json::json!({"routingKey": "k3y4feature"}),
    )
    .await;
    let token = hub_cmd(d, &["cluster", "add", "east"]).stdout;
    std::fs::write(d.join("east.token"), &token).unwrap();
    add_admin_user(d);
    let key = String::from_utf8(hub_cmd(d, &["apikey", "add", "dev"]).stdout).unwrap();
    std::fs::write(d.join("ca.pem"), hub_cmd(d, &["ca"]).stdout).unwrap();
    PreviewSetup {
        api,
        dir,
        key: key.trim().to_owned(),
    }
}
