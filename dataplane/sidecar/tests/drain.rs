//! The `spur-sidecar` binary drains on SIGTERM: it stops accepting, turns unready, lets every
//! in-flight request finish, and exits 0.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

mod common;
use common::{Killed, Log};

async fn status(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let tcp = TcpStream::connect(addr).await.ok()?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .ok()?;
    tokio::spawn(conn);
    let req = http::Request::get(path)
        .header("host", "x")
        .body(Empty::<Bytes>::new())
        .ok()?;
    let resp = send.send_request(req).await.ok()?;
    let code = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((code, String::from_utf8_lossy(&body).into_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_and_exits_cleanly() {
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

    // Port 0: the ports come from the sidecar's log (tests/common explains why).
    let mut child = Killed(
        std::process::Command::new(env!("CARGO_BIN_EXE_spur-sidecar"))
            .args([
                "--inbound-addr",
                "127.0.0.1:0",
                "--app-addr",
                &app.to_string(),
            ])
            .args(["--baseline-namespace", "test", "--baseline-name", "app"])
            .args(["--admin-addr", "127.0.0.1:0", "--drain-grace", "15s"])
            .arg("--rules")
            .arg(&rules)
            .env("SPUR_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut log = Log::new(child.0.stderr.take().unwrap());
    let (inbound, admin) = log.started();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while status(admin, "/ready").await.map(|s| s.0) != Some(200) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "sidecar never became ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // An idle keep-alive connection must not hold the drain up.
    let idle = TcpStream::connect(inbound).await.unwrap();
    let (mut idle_send, idle_conn) = hyper::client::conn::http1::handshake(TokioIo::new(idle))
        .await
        .unwrap();
    let idle_task = tokio::spawn(idle_conn);
    let r = idle_send
        .send_request(
            http::Request::get("/")
                .header("host", "x")
                .body(Empty::<Bytes>::new())
                .unwrap(),
        )
        .await
        .unwrap();
    r.into_body().collect().await.unwrap();

    let in_flight: Vec<_> = (0..8)
        .map(|_| tokio::spawn(async move { status(inbound, "/slow?ms=2500").await }))
        .collect();
    // Let the requests reach the application before the signal.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let pid = child.0.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );

    // While draining, readiness reports 503 and new connections are refused.
    let mut saw_unready = false;
    let mut saw_refused = false;
    for _ in 0..40 {
        if let Some((503, body)) = status(admin, "/ready").await {
            assert!(body.contains("draining"));
            saw_unready = true;
        }
        if TcpStream::connect(inbound).await.is_err() {
            saw_refused = true;
        }
        if saw_unready && saw_refused {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(saw_unready, "/ready never reported draining");
    assert!(saw_refused, "listener kept accepting after SIGTERM");

    for r in in_flight {
        let got = tokio::time::timeout(Duration::from_secs(20), r)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            got,
            Some((200, "slow baseline\n".to_string())),
            "an in-flight request failed during drain"
        );
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(exit) = child.0.try_wait().unwrap() {
            break exit;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "sidecar still running"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        exit.success(),
        "sidecar exited with {exit}; stderr:\n{}",
        log.text()
    );
    // The idle client saw its connection closed by the drain.
    let closed = tokio::time::timeout(Duration::from_secs(5), idle_task).await;
    assert!(closed.is_ok(), "idle keep-alive connection left open");
    apps.cancel();
}

#[tokio::test]
async fn invalid_flags_exit_2_with_a_clear_message() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_spur-sidecar"))
        .args(["--baseline-namespace", "test", "--baseline-name", "app"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--app-addr") && err.contains("--transparent"),
        "{err}"
    );

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_spur-sidecar"))
        .args([
            "--baseline-namespace",
            "test",
            "--baseline-name",
            "app",
            "--app-addr",
            "127.0.0.1:1",
        ])
        .args(["--routing-header", "bad header"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad header"));

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_spur-sidecar"))
        .arg("--help")
        .output()
        .await
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--inbound-addr",
        "--transparent",
        "--app-addr",
        "--baseline-kind",
        "--baseline-namespace",
        "--baseline-name",
        "--rules",
        "--admin-addr",
        "--routing-header",
        "SPUR_INBOUND_ADDR",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}
