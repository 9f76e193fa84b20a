//! spur-init for real: three network namespaces joined by veth pairs — "client", "pod" and
//! "fork" — the interception rules applied inside "pod" by the `spur-init` binary, the sidecar in
//! transparent mode running there as uid 15337, and traffic from "client" and from the pod
//! itself. Once with `--mode iptables` (iptables-legacy) and once with `--mode nft`.
//!
//! The sidecar process is this test binary re-executed (`sidecar_child` below) under
//! `ip netns exec … setpriv --reuid 15337`: it runs the same library entry points as the
//! `spur-sidecar` binary, and unlike that binary it is always built, and always current, when
//! this test is (Cargo only offers `CARGO_BIN_EXE_*` for a package's own binaries).
//!
//! Needs root, `ip` (iproute2), `setpriv` (util-linux), iptables-legacy (Debian's iptables) and
//! `nft` (nftables); tests/run.sh installs them. It fails, rather than skipping, when they are
//! missing, so a green suite always means interception was tested.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use spur_demo_apps::CancellationToken;
use spur_sidecar::{Sidecar, SidecarArgs, SidecarConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const INIT: &str = env!("CARGO_BIN_EXE_spur-init");
const PROXY_UID: &str = "15337";
const SIDECAR_ARGS_ENV: &str = "SPUR_INIT_TEST_SIDECAR_ARGS";
const KEYED: (&str, &str) = ("baggage", "sd-routing-key=k1");
/// Upper bound for anything a test waits on.
const PATIENCE: Duration = Duration::from_secs(30);

#[test]
fn iptables_legacy_redirects_inbound_and_hairpin_traffic_through_the_sidecar() {
    scenario("iptables", 'i', 1);
}

#[test]
fn nft_redirects_inbound_and_hairpin_traffic_through_the_sidecar() {
    scenario("nft", 'n', 2);
}

/// Not a test of its own: the sidecar process the scenarios start (see the module docs).
#[test]
#[ignore = "the sidecar child process of the interception tests, started by them"]
fn sidecar_child() {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sidecar: SidecarArgs,
    }
    let Ok(args) = std::env::var(SIDECAR_ARGS_ENV) else {
        return;
    };
    let cli = Cli::parse_from(std::iter::once("spur-sidecar").chain(args.split('\n')));
    spur_runtime::init_tracing("info");
    let config = SidecarConfig::try_from(cli.sidecar).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let sidecar = Sidecar::start(config).await.unwrap();
        spur_runtime::shutdown_signal().await;
        assert_eq!(sidecar.shutdown().await, 0, "connections cut at drain");
    });
}

fn scenario(mode: &'static str, tag: char, subnet: u8) {
    assert!(
        is_root(),
        "interception tests need root (CI and tests/run.sh run as root)"
    );
    let started = Instant::now();
    let net = Net::new(tag, subnet);
    let pod_ip = net.pod_ip.clone();
    let pristine = ruleset(mode, &net.pod);

    let _apps = Servers::start(
        &net.pod,
        vec![
            (8080, App::Http, "app"),
            (8081, App::Grpc, "app"),
            (7070, App::Echo, "tcp-app"),
            (7071, App::Echo, "excluded"),
        ],
    );
    let _forks = Servers::start(
        &net.fork,
        vec![(9090, App::Http, "fork"), (9091, App::Grpc, "fork")],
    );

    assert_executable_by("65534", Path::new(INIT));
    let init = |extra: &[&str]| {
        // The flags the injection webhook gives spur-init (docs/injection.md).
        let mut args = vec![
            "--mode",
            mode,
            "--proxy-port",
            "15006",
            "--proxy-uid",
            "15337",
            "--inbound-ports",
            "*",
            "--exclude-inbound-ports",
            "15020,7071",
            "--ipv6",
            "false",
        ];
        args.extend_from_slice(extra);
        run_in(&net.pod, None, INIT, &args)
    };
    let out = init(&[]);
    assert!(out.status.success(), "spur-init failed: {}", stderr(&out));
    let installed = ruleset(mode, &net.pod);
    // `table inet spur`, or `table ip spur` on a kernel without IPv6.
    let marker = if mode == "nft" {
        " spur {"
    } else {
        "SPUR_INBOUND"
    };
    assert!(
        installed.contains(marker),
        "{mode} rules not found:\n{installed}"
    );
    // The other backend was left alone.
    let other = if mode == "nft" { "iptables" } else { "nft" };
    assert!(
        !ruleset(other, &net.pod).to_lowercase().contains("spur"),
        "--mode {mode} must not touch {other}"
    );

    let dir = tempfile::tempdir().unwrap();
    let mut sidecar = net.start_sidecar(dir.path());
    let admin = addr(&pod_ip, 15020);
    wait_ready(&net, admin, &mut sidecar);
    let m0 = metrics(&net, admin);

    // --- From the client namespace: keyed traffic to the fork, the rest to the app. ---
    let app = addr(&pod_ip, 8080);
    let grpc_port = addr(&pod_ip, 8081);
    let served = in_ns(&net.client, move || async move {
        [
            http1(app, &[]).await,
            http1(app, &[KEYED]).await,
            h2c(app, &[]).await,
            h2c(app, &[KEYED]).await,
            grpc(grpc_port, &[]).await,
            grpc(grpc_port, &[KEYED]).await,
        ]
    });
    assert_eq!(
        served,
        ["app", "fork", "app", "fork", "app", "fork"].map(String::from),
        "HTTP/1.1, h2c and gRPC, unkeyed then keyed"
    );
    let m1 = metrics(&net, admin);
    assert_eq!(
        delta(&m0, &m1, "spur_requests_total{outcome=\"baseline\"}"),
        3
    );
    assert_eq!(
        delta(&m0, &m1, "spur_requests_total{outcome=\"sandbox\"}"),
        3
    );

    // Opaque TCP goes through the sidecar to the original destination.
    let echo = in_ns(&net.client, {
        let pod_ip = pod_ip.clone();
        move || async move { tcp_echo(addr(&pod_ip, 7070)).await }
    });
    assert_eq!(echo, b"\x00\x01opaquebye from tcp-app\n");
    let m2 = metrics(&net, admin);
    assert_eq!(
        delta(&m1, &m2, "spur_connections_total{protocol=\"tcp\"}"),
        1
    );

    // An excluded port bypasses it.
    let echo = in_ns(&net.client, {
        let pod_ip = pod_ip.clone();
        move || async move { tcp_echo(addr(&pod_ip, 7071)).await }
    });
    assert_eq!(echo, b"\x00\x01opaquebye from excluded\n");
    assert_eq!(
        traffic(&metrics(&net, admin)),
        traffic(&m2),
        "the excluded port 7071 went through the sidecar"
    );

    // --- Hairpin: the pod calling its own address (as root, not the proxy uid) is inbound
    // traffic too; the sidecar's own connection to pod-ip:8080 is not looped back to it. ---
    let served = in_ns(&net.pod, move || async move {
        [http1(app, &[]).await, http1(app, &[KEYED]).await]
    });
    assert_eq!(served, ["app", "fork"].map(String::from), "hairpin");
    let m3 = metrics(&net, admin);
    assert_eq!(
        delta(&m2, &m3, "spur_requests_total{outcome=\"baseline\"}"),
        1
    );
    assert_eq!(
        delta(&m2, &m3, "spur_requests_total{outcome=\"sandbox\"}"),
        1
    );

    // --- A second run leaves exactly the same ruleset. ---
    let out = init(&[]);
    assert!(
        out.status.success(),
        "second spur-init failed: {}",
        stderr(&out)
    );
    assert_eq!(
        ruleset(mode, &net.pod),
        installed,
        "second run changed the ruleset"
    );

    // --- Without the capabilities: the documented exit code, the capability named, nothing
    // changed (applying, and cleaning up). ---
    for extra in [&[][..], &["--cleanup"]] {
        // The flags the injection webhook gives spur-init (docs/injection.md).
        let mut args = vec![
            "--mode",
            mode,
            "--proxy-port",
            "15006",
            "--proxy-uid",
            "15337",
            "--inbound-ports",
            "*",
            "--exclude-inbound-ports",
            "15020,7071",
            "--ipv6",
            "false",
        ];
        args.extend_from_slice(extra);
        let out = run_in(&net.pod, Some("65534"), INIT, &args);
        assert_eq!(
            out.status.code(),
            Some(i32::from(spur_init::exit::MISSING_CAPABILITY)),
            "unprivileged spur-init {extra:?}: {}",
            stderr(&out)
        );
        assert!(stderr(&out).contains("CAP_NET_ADMIN"), "{}", stderr(&out));
        assert_eq!(
            ruleset(mode, &net.pod),
            installed,
            "unprivileged run changed rules"
        );
    }

    // --- Cleanup removes it all: the app is reached directly, keyed or not. ---
    let before_cleanup = metrics(&net, admin);
    let out = init(&["--cleanup"]);
    assert!(out.status.success(), "cleanup failed: {}", stderr(&out));
    assert_eq!(
        ruleset(mode, &net.pod),
        pristine,
        "cleanup left rules behind"
    );
    let served = in_ns(&net.client, move || async move {
        [http1(app, &[]).await, http1(app, &[KEYED]).await]
    });
    assert_eq!(served, ["app", "app"].map(String::from), "after cleanup");
    assert_eq!(
        traffic(&metrics(&net, admin)),
        traffic(&before_cleanup),
        "after cleanup, traffic still went through the sidecar"
    );
    let out = init(&["--cleanup"]);
    assert!(
        out.status.success(),
        "second cleanup failed: {}",
        stderr(&out)
    );
    assert_eq!(ruleset(mode, &net.pod), pristine);

    sidecar.stop();
    eprintln!("{mode}: scenario took {:?}", started.elapsed());
}

// === Network namespaces ===

/// The three namespaces, removed on drop (which also removes their veths and rules).
struct Net {
    client: String,
    pod: String,
    fork: String,
    pod_ip: String,
    fork_ip: String,
}

impl Net {
    /// Names carry the pid and `tag`, so concurrent tests and test processes never share one.
    /// Addresses: 10.234.`subnet`.0/30 between client and pod, .4/30 between pod and fork.
    fn new(tag: char, subnet: u8) -> Net {
        let id = std::process::id() % 100_000;
        let ns = |role: &str| format!("spurinit{id}{tag}{role}");
        let net = Net {
            client: ns("client"),
            pod: ns("pod"),
            fork: ns("fork"),
            pod_ip: format!("10.234.{subnet}.2"),
            fork_ip: format!("10.234.{subnet}.6"),
        };
        net.remove();
        for n in [&net.client, &net.pod, &net.fork] {
            sh(&["ip", "netns", "add", n]);
            sh(&["ip", "-n", n, "link", "set", "lo", "up"]);
        }
        let links = [
            (
                &net.client,
                format!("10.234.{subnet}.1"),
                &net.pod,
                net.pod_ip.clone(),
            ),
            (
                &net.pod,
                format!("10.234.{subnet}.5"),
                &net.fork,
                net.fork_ip.clone(),
            ),
        ];
        for (i, (a, a_ip, b, b_ip)) in links.into_iter().enumerate() {
            let (va, vb) = (format!("si{id}{tag}{i}a"), format!("si{id}{tag}{i}b"));
            sh(&[
                "ip", "link", "add", &va, "netns", a, "type", "veth", "peer", "name", &vb, "netns",
                b,
            ]);
            for (ns, dev, ip) in [(a, &va, a_ip), (b, &vb, b_ip)] {
                sh(&[
                    "ip",
                    "-n",
                    ns,
                    "addr",
                    "add",
                    &format!("{ip}/30"),
                    "dev",
                    dev,
                ]);
                sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
            }
        }
        net
    }

    fn remove(&self) {
        for ns in [&self.client, &self.pod, &self.fork] {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(Stdio::null())
                .status();
        }
    }

    /// The sidecar in "pod", as the proxy uid, routing k1 for ports 8080 and 8081 to "fork".
    fn start_sidecar(&self, dir: &Path) -> Child {
        use std::os::unix::fs::PermissionsExt;
        // The sidecar runs as uid 15337: it must be able to read its rules.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let rules = dir.join("rules.yaml");
        let fork = &self.fork_ip;
        std::fs::write(
            &rules,
            format!(
                "\
- routingKey: k1
  baseline: {{kind: Deployment, namespace: test, name: app}}
  destinationSandbox: {{name: sb}}
  mappings:
    - workloadPort: 8080
      destinations: [{{host: {fork}, port: 9090}}]
    - workloadPort: 8081
      destinations: [{{host: {fork}, port: 9091}}]
"
            ),
        )
        .unwrap();
        std::fs::set_permissions(&rules, std::fs::Permissions::from_mode(0o644)).unwrap();
        let args = [
            "--transparent",
            "--inbound-addr=0.0.0.0:15006",
            "--admin-addr=0.0.0.0:15020",
            "--baseline-namespace=test",
            "--baseline-name=app",
            "--drain-grace=2s",
            &format!("--rules={}", rules.display()),
        ]
        .join("\n");
        let log = dir.join("sidecar.log");
        let exe = std::env::current_exe().unwrap();
        assert_executable_by(PROXY_UID, &exe);
        let child = Command::new("ip")
            .args(["netns", "exec", &self.pod])
            .args(setpriv(PROXY_UID))
            .arg(&exe)
            .args(["--ignored", "--exact", "sidecar_child", "--nocapture"])
            .env(SIDECAR_ARGS_ENV, args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Child { child, log }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.remove();
    }
}

/// A running child process, killed on drop; its log is printed if the test failed.
struct Child {
    child: std::process::Child,
    log: PathBuf,
}

impl Child {
    /// SIGTERM, then a clean exit within the drain grace.
    fn stop(mut self) {
        let pid = self.child.id().to_string();
        sh(&["kill", "-TERM", &pid]);
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "sidecar exited with {status}: {}",
                    self.log()
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "sidecar did not exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- sidecar log ---\n{}", self.log());
        }
    }
}

fn enter(ns: &str) {
    let file = std::fs::File::open(format!("/var/run/netns/{ns}")).unwrap();
    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
}

/// Runs `f`'s future to completion (bounded by [`PATIENCE`]) on a fresh thread that entered
/// namespace `ns` and has its own single-threaded runtime: every socket it opens lives there.
fn in_ns<T, F, Fut>(ns: &str, f: F) -> T
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T>,
{
    let ns = ns.to_owned();
    std::thread::spawn(move || {
        enter(&ns);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            tokio::time::timeout(PATIENCE, f())
                .await
                .unwrap_or_else(|_| panic!("no answer within {PATIENCE:?} in {ns}"))
        })
    })
    .join()
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

#[derive(Clone, Copy)]
enum App {
    Http,
    Grpc,
    Echo,
}

/// Demo apps listening in a namespace, each on its port under its name; stopped on drop.
struct Servers {
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Servers {
    fn start(ns: &str, apps: Vec<(u16, App, &'static str)>) -> Servers {
        let ns = ns.to_owned();
        let stop = CancellationToken::new();
        let token = stop.clone();
        let (bound, ready) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            enter(&ns);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let mut tasks = Vec::new();
                for (port, app, name) in apps {
                    let l = tokio::net::TcpListener::bind(("0.0.0.0", port))
                        .await
                        .unwrap();
                    let (name, token) = (name.to_owned(), token.clone());
                    tasks.push(tokio::spawn(async move {
                        let _ = match app {
                            App::Http => spur_demo_apps::serve_http(l, name, token).await,
                            App::Grpc => spur_demo_apps::serve_grpc(l, name, token).await,
                            App::Echo => spur_demo_apps::serve_tcp_echo(l, name, token).await,
                        };
                    }));
                }
                let _ = bound.send(());
                token.cancelled().await;
                for t in tasks {
                    let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
                }
            });
        });
        ready
            .recv_timeout(PATIENCE)
            .expect("demo apps did not start");
        Servers {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// === Commands ===

fn setpriv(uid: &str) -> [String; 4] {
    [
        "setpriv".into(),
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".into(),
    ]
}

/// `program args` inside namespace `ns`, as root or (`as_uid`) without any capabilities.
fn run_in(ns: &str, as_uid: Option<&str>, program: &str, args: &[&str]) -> Output {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]);
    if let Some(uid) = as_uid {
        cmd.args(setpriv(uid));
    }
    cmd.arg(program).args(args).output().unwrap_or_else(|e| {
        panic!("cannot run ip netns exec: {e} (tests/run.sh installs iproute2; run as root)")
    })
}

/// The sidecar and the unprivileged spur-init run under other uids: a target directory they
/// cannot traverse (say, under a 0700 home) would fail them in confusing ways.
fn assert_executable_by(uid: &str, program: &Path) {
    let status = Command::new("setpriv")
        .args(&setpriv(uid)[1..])
        .arg("test")
        .arg("-x")
        .arg(program)
        .status()
        .unwrap_or_else(|e| panic!("cannot run setpriv: {e} (tests/run.sh installs util-linux)"));
    assert!(
        status.success(),
        "uid {uid} cannot execute {} (every directory above it needs o+x)",
        program.display()
    );
}

fn sh(args: &[&str]) -> Output {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {args:?}: {e} (tests/run.sh installs what the tests need; run as root)"
            )
        });
    assert!(out.status.success(), "{args:?} failed: {}", stderr(&out));
    out
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The nat ruleset of a backend in `ns`, without what changes by itself (counters, timestamps).
fn ruleset(mode: &str, ns: &str) -> String {
    let dumps: Vec<Vec<&str>> = if mode == "nft" {
        vec![vec!["nft", "list", "ruleset"]]
    } else {
        vec![
            vec!["iptables-legacy-save", "-t", "nat"],
            vec!["ip6tables-legacy-save", "-t", "nat"],
        ]
    };
    let mut text = String::new();
    for dump in dumps {
        let out = run_in(ns, None, dump[0], &dump[1..]);
        assert!(out.status.success(), "{dump:?} failed: {}", stderr(&out));
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if line.starts_with('#') {
                continue;
            }
            // `:CHAIN POLICY [packets:bytes]`
            let line = match line.rsplit_once(" [") {
                Some((head, _)) if line.starts_with(':') => head,
                _ => line,
            };
            text.push_str(line);
            text.push('\n');
        }
    }
    text
}

// === Clients ===

fn addr(ip: &str, port: u16) -> SocketAddr {
    format!("{ip}:{port}").parse().unwrap()
}

/// HTTP/1.1 GET `/`; returns who served it.
async fn http1(addr: SocketAddr, headers: &[(&str, &str)]) -> String {
    let (status, by, _) = http1_get(addr, "/", headers).await;
    assert_eq!(status, 200, "GET http://{addr}/");
    by
}

async fn http1_get(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String, String) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::get(path).header("host", addr.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = send
        .send_request(req.body(Empty::<Bytes>::new()).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let by = served_by(resp.headers());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, by, String::from_utf8_lossy(&body).into_owned())
}

/// HTTP/2 with prior knowledge (h2c) GET `/`; returns who served it.
async fn h2c(addr: SocketAddr, headers: &[(&str, &str)]) -> String {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::get(format!("http://{addr}/"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = send
        .send_request(req.body(Empty::<Bytes>::new()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "h2c GET http://{addr}/");
    assert_eq!(resp.version(), http::Version::HTTP_2);
    served_by(resp.headers())
}

/// gRPC unary `Hello`; returns who served it (reply field and trailer must agree).
async fn grpc(addr: SocketAddr, metadata: &[(&str, &str)]) -> String {
    let (reply, trailer) = spur_demo_apps::grpc_client::hello(addr, "spur", metadata)
        .await
        .unwrap();
    assert_eq!(trailer.as_deref(), Some(reply.served_by.as_str()));
    reply.served_by
}

/// Opaque bytes, a half-close, and everything the echo server sends back.
async fn tcp_echo(addr: SocketAddr) -> Vec<u8> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"\x00\x01opaque").await.unwrap();
    tcp.shutdown().await.unwrap();
    let mut out = Vec::new();
    tcp.read_to_end(&mut out).await.unwrap();
    out
}

fn served_by(headers: &http::HeaderMap) -> String {
    headers
        .get(spur_demo_apps::SERVED_BY)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

// === Sidecar admin ===

/// Waits until the sidecar answers /ready with 200 (it has loaded its rules).
fn wait_ready(net: &Net, admin: SocketAddr, sidecar: &mut Child) {
    let deadline = Instant::now() + PATIENCE;
    for _ in 0..1_000 {
        if let Some(status) = sidecar.child.try_wait().unwrap() {
            panic!("sidecar exited with {status}: {}", sidecar.log());
        }
        let ready = in_ns(&net.client, move || async move {
            match tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(admin),
            )
            .await
            {
                Ok(Ok(_)) => http1_get(admin, "/ready", &[]).await.0 == 200,
                _ => false,
            }
        });
        if ready {
            return;
        }
        assert!(Instant::now() < deadline, "sidecar never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("sidecar never became ready");
}

fn metrics(net: &Net, admin: SocketAddr) -> String {
    in_ns(&net.client, move || async move {
        http1_get(admin, "/metrics", &[]).await.2
    })
}

/// The value of a counter series, 0 when absent.
fn counter(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

fn delta(before: &str, after: &str, series: &str) -> u64 {
    counter(after, series) - counter(before, series)
}

/// Every connection and request counter: equal before and after means no traffic went through.
fn traffic(metrics: &str) -> Vec<&str> {
    metrics
        .lines()
        .filter(|l| l.starts_with("spur_connections_total") || l.starts_with("spur_requests_total"))
        .collect()
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}
