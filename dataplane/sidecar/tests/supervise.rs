//! `spur-sidecar --supervise`: the worker is killed (SIGKILL) while requests keep coming, one
//! after another on new connections; not one connection is refused, because the supervisor holds
//! the listeners and starts another worker on them at once. Only the one request in flight in
//! the killed worker, if there was one, may fail. SIGTERM to the supervisor drains the
//! worker and ends both; the listeners then refuse connections.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

mod common;
use common::{Killed, Log};

/// One request on a new connection: the status and body, or what failed.
async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    let req = http::Request::get(path)
        .header("host", "x")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let resp = send
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let code = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

/// The pids of `parent`'s children (its worker).
fn children(parent: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn signal(pid: u32, sig: &str) {
    assert!(
        std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

/// `spur-sidecar --wait-listening <timeout>` (the injected postStart hook) against `admin`.
fn wait_listening(admin: SocketAddr, timeout: &str) -> bool {
    std::process::Command::new(env!("CARGO_BIN_EXE_spur-sidecar"))
        .args([
            "--wait-listening",
            timeout,
            "--admin-addr",
            &admin.to_string(),
        ])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// A listener that accepts (as a supervisor's held admin listener does before its worker
/// serves) but never answers is not a sidecar that takes traffic.
#[test]
fn wait_listening_needs_an_answer_not_a_listener() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let started = Instant::now();
    assert!(!wait_listening(silent.local_addr().unwrap(), "1s"));
    assert!(started.elapsed() >= Duration::from_secs(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_loses_no_new_connection() {
    let apps = spur_demo_apps::CancellationToken::new();
    let app_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = app_listener.local_addr().unwrap();
    tokio::spawn(spur_demo_apps::serve_http(
        app_listener,
        "baseline".into(),
        apps.clone(),
    ));
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, "[]\n").unwrap();

    let mut child = Killed(
        std::process::Command::new(env!("CARGO_BIN_EXE_spur-sidecar"))
            .args(["--supervise", "--inbound-addr", "127.0.0.1:0"])
            .args(["--app-addr", &app.to_string()])
            .args(["--baseline-namespace", "test", "--baseline-name", "app"])
            .args(["--admin-addr", "127.0.0.1:0", "--drain-grace", "10s"])
            .arg("--rules")
            .arg(&rules)
            .env("SPUR_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let supervisor = child.0.id();
    let mut log = Log::new(child.0.stderr.take().unwrap());
    let (inbound, admin) = log.started();
    assert!(wait_listening(admin, "5s"), "{}", log.text());
    let first = children(supervisor);
    assert_eq!(first.len(), 1, "one worker: {first:?}\n{}", log.text());
    assert_eq!(
        get(inbound, "/").await,
        Ok((200, "hello from baseline\n".into())),
        "{}",
        log.text()
    );

    // Requests one after another, each on a new connection, through the kill and after it.
    let load = tokio::spawn(async move {
        let mut failed = Vec::new();
        let mut sent = 0u32;
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end && sent < 5_000 {
            sent += 1;
            match get(inbound, "/").await {
                Ok((200, b)) if b == "hello from baseline\n" => {}
                other => failed.push(format!("{sent}: {other:?}")),
            }
        }
        (sent, failed)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    signal(first[0], "-KILL");
    let (sent, failed) = load.await.unwrap();
    assert!(sent > 20, "only {sent} requests");
    // One at a time: at most one was in flight in the killed worker, and it was accepted (a
    // refused connection would fail at `connect`).
    assert!(
        failed.len() <= 1 && failed.iter().all(|f| !f.contains("connect:")),
        "{} of {sent} requests failed around the worker's death: {failed:?}\n{}",
        failed.len(),
        log.text()
    );
    let second = children(supervisor);
    assert_eq!(second.len(), 1, "{second:?}\n{}", log.text());
    assert_ne!(second, first, "the worker was not replaced");
    // The restarted worker says so, on the admin listener the supervisor held too.
    let (code, metrics) = get(admin, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(
        metrics
            .lines()
            .any(|l| l == "spur_sidecar_worker_restarts 1"),
        "{metrics}"
    );

    // SIGTERM to the supervisor: passed on, the worker drains, both exit 0; nothing listens.
    signal(supervisor, "-TERM");
    let deadline = Instant::now() + Duration::from_secs(15);
    let exit = loop {
        if let Some(exit) = child.0.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "supervisor still running");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(exit.success(), "exited with {exit}:\n{}", log.text());
    assert!(
        TcpStream::connect(inbound).await.is_err(),
        "the inbound listener outlived the sidecar"
    );
    assert!(
        std::fs::metadata(format!("/proc/{}", second[0])).is_err(),
        "the worker outlived its supervisor"
    );
    apps.cancel();
}

/// A worker whose supervisor died before the worker asked to be stopped with it (the
/// `PR_SET_PDEATHSIG` race) finds its parent is not the supervisor it was started by, and exits
/// at once instead of serving on unsupervised. (The "supervisor" named is a pid above Linux's
/// largest, so never the test's own, the worker's parent.)
#[test]
fn a_worker_whose_supervisor_is_already_gone_does_not_serve() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_spur-sidecar"))
        .args(["--inbound-addr", "127.0.0.1:0", "--app-addr", "127.0.0.1:9"])
        .args(["--baseline-namespace", "test", "--baseline-name", "app"])
        .env("SPUR_SIDECAR_WORKER", "0")
        .env("SPUR_SIDECAR_SUPERVISOR", "4194305")
        .stdout(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the supervisor that started this worker (pid 4194305) is gone"),
        "{err}"
    );
}
