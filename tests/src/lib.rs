//! End-to-end test harness: real upstream services, a real sidecar on loopback, real clients.
//!
//! Every test builds an [`Env`]: a baseline and a fork of the demo HTTP (or gRPC) service, a
//! rule file in a temporary directory, and a [`spur_sidecar::Sidecar`] in explicit mode in front
//! of the baseline. Tests talk to `env.addr()` and check which upstream answered.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use spur_demo_apps::CancellationToken;
use spur_proxy::{Inbound, ProxyConfig};
use spur_routing::{BaselineWorkload, ExtractConfig};
use spur_sidecar::{Sidecar, SidecarConfig};
use tokio::net::{TcpListener, TcpStream};

pub use spur_demo_apps as apps;

pub mod kafka;
pub mod kube;
pub mod netns;
pub mod node;
pub mod s3;
pub mod usage;
pub mod xds;

pub const NAMESPACE: &str = "test";
pub const BASELINE_NAME: &str = "app";

/// What kind of upstream a test environment runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppKind {
    Http,
    Grpc,
    TcpEcho,
}

pub struct EnvOptions {
    pub kind: AppKind,
    pub proxy: ProxyConfig,
    pub extract: ExtractConfig,
    /// Extra forks (beyond "fork"), each served by the same kind of app under that name.
    pub extra_forks: Vec<&'static str>,
    /// Rules to start with: (routing key, fork name). Default: `k1` → "fork".
    pub rules: Vec<(&'static str, &'static str)>,
}

impl Default for EnvOptions {
    fn default() -> Self {
        EnvOptions {
            kind: AppKind::Http,
            proxy: ProxyConfig {
                drain_grace: Duration::from_secs(5),
                ..ProxyConfig::default()
            },
            extract: ExtractConfig {
                custom_headers: vec!["x-route-to".into()],
                query_param: Some("sd-routing-key".into()),
            },
            extra_forks: Vec::new(),
            rules: vec![("k1", "fork")],
        }
    }
}

pub struct Env {
    pub sidecar: Option<Sidecar>,
    pub baseline: SocketAddr,
    /// Fork name → address.
    pub forks: Vec<(&'static str, SocketAddr)>,
    pub rules_path: PathBuf,
    pub apps: CancellationToken,
    _dir: tempfile::TempDir,
}

pub async fn spawn_app(kind: AppKind, name: &str, token: CancellationToken) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let name = name.to_string();
    tokio::spawn(async move {
        let res = match kind {
            AppKind::Http => spur_demo_apps::serve_http(l, name, token).await,
            AppKind::Grpc => spur_demo_apps::serve_grpc(l, name, token).await,
            AppKind::TcpEcho => spur_demo_apps::serve_tcp_echo(l, name, token).await,
        };
        if let Err(e) = res {
            eprintln!("app failed: {e}");
        }
    });
    addr
}

pub fn baseline_workload() -> BaselineWorkload {
    BaselineWorkload {
        kind: "Deployment".into(),
        namespace: NAMESPACE.into(),
        name: BASELINE_NAME.into(),
    }
}

/// One rule in the file format: `key` on `workload_port` of the test baseline → `dest`.
pub fn rule_yaml(key: &str, workload_port: u16, dest: SocketAddr) -> String {
    format!(
        "- routingKey: {key}\n  baseline: {{kind: Deployment, namespace: {NAMESPACE}, name: {BASELINE_NAME}}}\n  destinationSandbox: {{name: sb-{key}}}\n  mappings:\n    - workloadPort: {workload_port}\n      destinations: [{{host: {}, port: {}}}]\n",
        dest.ip(),
        dest.port()
    )
}

/// A sidecar configuration in explicit mode in front of `app`: loopback ports chosen by the OS,
/// no rules, default key carriers, a 5 s drain grace.
pub fn sidecar_config(app: SocketAddr) -> SidecarConfig {
    SidecarConfig {
        inject_key_file: None,
        kafka: None,
        capture: None,
        inbound_addr: "127.0.0.1:0".parse().unwrap(),
        inbound: Inbound::Explicit { app },
        baseline: baseline_workload(),
        rules: None,
        rules_poll: Duration::from_millis(20),
        routeserver: None,
        admin_addr: Some("127.0.0.1:0".parse().unwrap()),
        extract: ExtractConfig::default(),
        proxy: ProxyConfig {
            drain_grace: Duration::from_secs(5),
            ..ProxyConfig::default()
        },
    }
}

/// A running sidecar in front of `app`, without rules.
pub async fn sidecar_for(app: SocketAddr, proxy: ProxyConfig) -> Sidecar {
    Sidecar::start(SidecarConfig {
        inject_key_file: None,
        kafka: None,
        proxy,
        ..sidecar_config(app)
    })
    .await
    .unwrap()
}

impl Env {
    pub async fn start(opts: EnvOptions) -> Env {
        let apps = CancellationToken::new();
        let baseline = spawn_app(opts.kind, "baseline", apps.clone()).await;
        let mut forks = vec![("fork", spawn_app(opts.kind, "fork", apps.clone()).await)];
        for name in &opts.extra_forks {
            forks.push((name, spawn_app(opts.kind, name, apps.clone()).await));
        }
        let dir = tempfile::tempdir().unwrap();
        let rules_path = dir.path().join("rules.yaml");
        let mut env = Env {
            sidecar: None,
            baseline,
            forks,
            rules_path,
            apps,
            _dir: dir,
        };
        env.write_rules(&opts.rules);
        let config = SidecarConfig {
            inject_key_file: None,
            kafka: None,
            rules: Some(env.rules_path.clone()),
            extract: opts.extract,
            proxy: opts.proxy,
            ..sidecar_config(baseline)
        };
        env.sidecar = Some(Sidecar::start(config).await.unwrap());
        env
    }

    pub async fn http() -> Env {
        Env::start(EnvOptions::default()).await
    }

    pub fn sidecar(&self) -> &Sidecar {
        self.sidecar.as_ref().unwrap()
    }

    /// The sidecar's inbound address.
    pub fn addr(&self) -> SocketAddr {
        self.sidecar().inbound_addr
    }

    pub fn admin(&self) -> SocketAddr {
        self.sidecar().admin_addr.unwrap()
    }

    pub fn fork(&self, name: &str) -> SocketAddr {
        self.forks
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, a)| *a)
            .unwrap()
    }

    /// Rewrites the rule file atomically (write + rename, as editors and ConfigMaps do).
    pub fn write_rules(&self, rules: &[(&str, &str)]) {
        let body: String = rules
            .iter()
            .map(|(k, fork)| rule_yaml(k, self.baseline.port(), self.fork(fork)))
            .collect();
        self.write_raw_rules(&body);
    }

    pub fn write_raw_rules(&self, body: &str) {
        let tmp = self.rules_path.with_extension("tmp");
        std::fs::write(&tmp, body).unwrap();
        std::fs::rename(&tmp, &self.rules_path).unwrap();
    }

    /// Waits until the sidecar's table version reaches `version`.
    pub async fn wait_version(&self, version: u64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.sidecar().table().load().version < version {
            assert!(
                tokio::time::Instant::now() < deadline,
                "table never reached version {version}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn version(&self) -> u64 {
        self.sidecar().table().load().version
    }

    pub async fn shutdown(mut self) -> usize {
        let left = self.sidecar.take().unwrap().shutdown().await;
        self.apps.cancel();
        left
    }
}

/// A response, reduced to what tests look at.
#[derive(Debug)]
pub struct Got {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Got {
    pub fn served_by(&self) -> &str {
        self.headers
            .get(spur_demo_apps::SERVED_BY)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap()
    }
}

/// One HTTP/1.1 GET on a fresh connection.
pub async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> anyhow::Result<Got> {
    let tcp = TcpStream::connect(addr).await?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(conn);
    let mut req = Request::get(path).header("host", addr.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = send.send_request(req.body(Empty::<Bytes>::new())?).await?;
    collect(resp).await
}

/// One HTTP/2 (prior knowledge) GET on a fresh connection.
pub async fn get_h2(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> anyhow::Result<Got> {
    let tcp = TcpStream::connect(addr).await?;
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)).await?;
    tokio::spawn(conn);
    let mut req = Request::get(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = send.send_request(req.body(Empty::<Bytes>::new())?).await?;
    collect(resp).await
}

pub async fn collect(resp: http::Response<hyper::body::Incoming>) -> anyhow::Result<Got> {
    let (parts, body) = resp.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok(Got {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Fetches the sidecar's Prometheus text.
pub async fn metrics(admin: SocketAddr) -> String {
    get(admin, "/metrics", &[]).await.unwrap().body
}

/// The value of one sample line (`name{labels} value`) in Prometheus text, 0 when absent.
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

pub use spur_kube_harness::free_port;

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Runs `script` (a build script of tests/) with `bash`, its arguments and environment from
/// `setup`; on failure the message says what it needs (`needs`) and what it printed.
fn run_build_script(
    script: &std::path::Path,
    setup: impl FnOnce(&mut std::process::Command),
    needs: &str,
) -> Result<(), String> {
    let mut cmd = std::process::Command::new("bash");
    cmd.arg(script).stdin(std::process::Stdio::null());
    setup(&mut cmd);
    let res = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !res.status.success() {
        return Err(format!(
            "{} failed ({}); {needs}:\n{}{}",
            script.display(),
            res.status,
            String::from_utf8_lossy(&res.stdout),
            String::from_utf8_lossy(&res.stderr)
        ));
    }
    Ok(())
}

/// The path in `built` (a once-per-process build), or a panic with why there is none.
fn built_path(built: &'static Result<PathBuf, String>) -> &'static std::path::Path {
    match built {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    }
}

/// The real Argo Rollouts controller (`rollouts-controller`) and its manifests under
/// `argo-rollouts/` (tests/argo/README.md): `SPUR_ARGO_DIR` (tests/run.sh builds them before the
/// tests), or else `tests/argo/build.sh` run once per process into the cache it shares with
/// other checkouts (`~/.cache/spur/argo`; a current build is reused without calling Go).
pub fn argo_dir() -> &'static std::path::Path {
    static BUILT: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    built_path(BUILT.get_or_init(|| {
        if let Some(dir) = std::env::var_os("SPUR_ARGO_DIR") {
            return Ok(PathBuf::from(dir));
        }
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .ok_or("neither XDG_CACHE_HOME nor HOME is set")?;
        let out = cache.join("spur").join("argo");
        run_build_script(
            &repo_root().join("tests/argo/build.sh"),
            |cmd| {
                cmd.arg(&out);
            },
            "Go and access to the Go module proxy are required for the node tier's Argo Rollouts step",
        )?;
        Ok(out)
    }))
}

/// The directory holding the Go test tools (`sdroutes`, `routesapi-watch`, `h2spec`):
/// `SPUR_GO_BINDIR` (tests/run.sh builds them before the tests), or else `tests/go/build.sh` run
/// once per process.
pub fn go_bin_dir() -> &'static std::path::Path {
    static BUILT: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    built_path(BUILT.get_or_init(|| {
        if let Some(dir) = std::env::var_os("SPUR_GO_BINDIR") {
            return Ok(PathBuf::from(dir));
        }
        let root = repo_root();
        let out = root.join("target").join("go-bin");
        run_build_script(
            &root.join("tests/go/build.sh"),
            |cmd| {
                cmd.env("OUT", &out);
            },
            "Go (>= 1.24, https://go.dev/doc/install) and access to the Go module proxy are required for the Routes API compatibility and HTTP/2 conformance tests",
        )?;
        Ok(out)
    }))
}
