//! `spur-sidecar --intercept` for real, in a network namespace this test creates: the binary
//! programs the rules as root, then runs as the proxy uid with no capability left; a connection
//! to the namespace's own address is redirected to it; started without root it refuses with a
//! clear message. Also `--drain-delay`: after SIGTERM the sidecar keeps accepting for the delay.
//!
//! Needs root, `ip` (iproute2) and `nft`; tests/run.sh installs them. It fails, rather than
//! skipping, when they are missing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpStream;
use std::process::{Command, Stdio};

mod common;
use common::{Killed, Log};
use std::time::{Duration, Instant};

const SIDECAR: &str = env!("CARGO_BIN_EXE_spur-sidecar");
const UID: u32 = 15337;

/// A network namespace with loopback and a veth holding 10.77.0.1, removed on drop.
struct Netns(String);

impl Netns {
    fn new(name: &str) -> Netns {
        let _ = Command::new("ip")
            .args(["netns", "del", name])
            .stderr(Stdio::null())
            .status();
        let ns = Netns(name.to_string());
        for args in [
            vec!["netns", "add", name],
            vec!["-n", name, "link", "set", "lo", "up"],
            // Both ends of a veth pair stay inside (the kernel may lack the dummy driver).
            vec![
                "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1",
            ],
            vec!["-n", name, "addr", "add", "10.77.0.1/32", "dev", "v0"],
            vec!["-n", name, "link", "set", "v0", "up"],
            vec!["-n", name, "link", "set", "v1", "up"],
        ] {
            let out = Command::new("ip")
                .args(&args)
                .output()
                .expect("ip (iproute2)");
            assert!(out.status.success(), "ip {args:?}: {out:?}");
        }
        ns
    }

    fn exec(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0, program]);
        c
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn sidecar(ns: &Netns, extra: &[&str]) -> Command {
    let mut c = ns.exec(SIDECAR);
    c.args([
        "--transparent",
        "--baseline-namespace",
        "t",
        "--baseline-name",
        "app",
    ])
    .args(["--admin-addr", "0.0.0.0:15020"])
    .args(extra)
    .env("SPUR_INTERCEPT", "true")
    .env("SPUR_INIT_MODE", "nft")
    .env("SPUR_INIT_IPV6", "false")
    .env("SPUR_PROXY_UID", UID.to_string());
    c
}

fn status_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default()
}

/// Runs `f` inside the namespace on a fresh thread (setns changes only the calling thread).
fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        f()
    })
    .join()
    .unwrap()
}

fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn intercept_programs_the_rules_then_runs_without_privileges() {
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "needs root (CI and tests/run.sh run as root)"
    );
    let ns = Netns::new("spur-sc-icpt");
    let child = Killed(
        sidecar(&ns, &[])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // `ip netns exec` execs the sidecar: the child's pid is the sidecar's.
    let pid = child.0.id();
    wait_for("the sidecar to listen", || {
        in_ns("spur-sc-icpt", || {
            TcpStream::connect_timeout(&"127.0.0.1:15020".parse().unwrap(), Duration::from_secs(1))
                .ok()
        })
    });
    let status = status_of(pid);
    for line in ["Uid:", "Gid:"] {
        let ids = status.lines().find_map(|l| l.strip_prefix(line)).unwrap();
        assert!(
            ids.split_whitespace().all(|id| id == UID.to_string()),
            "{line}{ids} in\n{status}"
        );
    }
    for caps in ["CapPrm:", "CapEff:", "CapAmb:"] {
        let hex = status.lines().find_map(|l| l.strip_prefix(caps)).unwrap();
        assert_eq!(hex.trim(), "0000000000000000", "{caps} in\n{status}");
    }
    assert!(status.contains("NoNewPrivs:\t1"), "{status}");

    let rules = ns
        .exec("nft")
        .args(["list", "table", "ip", "spur"])
        .output()
        .unwrap();
    let rules = String::from_utf8_lossy(&rules.stdout);
    assert!(rules.contains("redirect to :15006"), "{rules}");
    assert!(rules.contains("15020"), "admin port excluded: {rules}");
    assert!(rules.contains(&format!("skuid {UID}")), "{rules}");

    // A connection to the namespace's own address on a port nobody listens on is redirected to
    // the sidecar: accepted (without the rule it would be refused).
    let accepted = in_ns("spur-sc-icpt", || {
        TcpStream::connect_timeout(&"10.77.0.1:8080".parse().unwrap(), Duration::from_secs(2))
            .is_ok()
    });
    assert!(accepted, "10.77.0.1:8080 was not redirected to the sidecar");
    drop(child);
}

#[test]
fn intercept_without_root_or_transparent_mode_is_refused_clearly() {
    assert!(nix::unistd::Uid::effective().is_root(), "needs root");
    let ns = Netns::new("spur-sc-noroot");
    // As uid 15337 (setpriv drops root before exec): exit 3, the message names the fix.
    let out = ns
        .exec("setpriv")
        .args([
            "--reuid",
            "15337",
            "--regid",
            "15337",
            "--clear-groups",
            SIDECAR,
        ])
        .args([
            "--transparent",
            "--baseline-namespace",
            "t",
            "--baseline-name",
            "app",
        ])
        .env("SPUR_INTERCEPT", "true")
        .output()
        .expect("setpriv (util-linux)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("runAsUser: 0") && err.contains("NET_ADMIN"),
        "{err}"
    );
    let rules = ns.exec("nft").args(["list", "ruleset"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&rules.stdout).contains("spur"),
        "rules installed by a refused sidecar"
    );

    let out = sidecar(&ns, &[])
        .env_remove("SPUR_INTERCEPT")
        .args(["--intercept", "--app-addr", "127.0.0.1:1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let out = sidecar(&ns, &[])
        .env("SPUR_PROXY_UID", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("non-root uid"), "{err}");
}

#[test]
fn drain_delay_keeps_accepting_after_sigterm() {
    // Port 0: the ports come from the sidecar's log (tests/common explains why).
    let mut child = Killed(
        Command::new(SIDECAR)
            .args([
                "--inbound-addr",
                "127.0.0.1:0",
                "--admin-addr",
                "127.0.0.1:0",
            ])
            .args(["--app-addr", "127.0.0.1:1", "--baseline-namespace", "t"])
            .args(["--baseline-name", "app", "--drain-delay", "2s"])
            .env("SPUR_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut log = Log::new(child.0.stderr.take().unwrap());
    let (inbound, admin) = log.started();
    assert!(TcpStream::connect(admin).is_ok(), "admin {admin} refused");
    let pid = child.0.id().to_string();
    let signalled = Instant::now();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    std::thread::sleep(Duration::from_millis(500));
    let accepted = TcpStream::connect(inbound);
    let exit = wait_for("the sidecar to exit", || child.0.try_wait().unwrap());
    let log = log.text();
    assert!(
        accepted.is_ok(),
        "inbound {inbound} refused within the drain delay: {accepted:?}; stderr:\n{log}"
    );
    assert!(exit.success(), "{exit}; stderr:\n{log}");
    assert!(
        signalled.elapsed() >= Duration::from_secs(2),
        "exited {:?} after SIGTERM, before the 2 s delay",
        signalled.elapsed()
    );
}
