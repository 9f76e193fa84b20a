//! `spur demo app --database-url` against a real PostgreSQL (Debian's postgresql-15 binaries,
//! started on loopback for the test): rows posted through the app are read back from the database
//! the URL names, bad bodies are 400s, a killed connection is made again, a stopped server is a
//! 503, and the password shows up in no answer and no log line. The test fails, rather than
//! skipping, when `initdb`/`postgres` are missing: tests/run.sh installs postgresql-15.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use nix::sys::signal::Signal;
use serde_json::Value;
use tokio::process::Command;

use spur_kube_harness::postgres::{PASSWORD, Postgres, free_port, signal};

async fn request(port: u16, method: Method, path: &str, body: Vec<u8>) -> (StatusCode, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(method)
        .uri(format!("http://127.0.0.1:{port}{path}"))
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("the app did not answer")
        .unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_go_to_the_database_the_url_names() {
    tokio::time::timeout(Duration::from_secs(180), scenario())
        .await
        .expect("the test took longer than 3 minutes");
}

async fn scenario() {
    let mut pg = Postgres::start().await;
    // The app's own role and database, as a sandbox would get them: not a superuser, the owner
    // of its database (since PostgreSQL 15 only the owner may create tables in `public`).
    let admin = pg.admin().await;
    // Two calls: statements in one batch share a transaction, and CREATE DATABASE refuses one.
    admin
        .batch_execute(&format!("CREATE ROLE app LOGIN PASSWORD '{PASSWORD}'"))
        .await
        .unwrap();
    admin
        .batch_execute("CREATE DATABASE sandbox_a OWNER app")
        .await
        .unwrap();

    let port = free_port();
    let url = format!("postgres://app:{PASSWORD}@127.0.0.1:{}/sandbox_a", pg.port);
    let app = Command::new(env!("CARGO_BIN_EXE_spur"))
        .args(["demo", "app", "--name", "rows", "--marker", "v1"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("SPUR_APP_DATABASE_URL", &url)
        .env("POD_NAME", "rows-pod")
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut up = false;
    for _ in 0..300 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up, "spur demo app never listened on {port}");
    let mut answers = String::new();

    // The table is made on first use; no rows yet.
    let (status, body) = request(port, Method::GET, "/rows", vec![]).await;
    answers += &body;
    assert_eq!(status, StatusCode::OK, "{body}");
    let doc = json(&body);
    assert_eq!(doc["database"], "sandbox_a", "{body}");
    assert_eq!(doc["service"], "rows");
    assert_eq!(doc["pod"], "rows-pod");
    assert_eq!(doc["marker"], "v1");
    assert_eq!(doc["rows"], Value::Array(vec![]), "{body}");

    let mut ids = Vec::new();
    for value in ["first row", "zweite Zeile: grüße", &"x".repeat(4096)] {
        let (status, body) = request(port, Method::POST, "/rows", value.into()).await;
        answers += &body;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        let doc = json(&body);
        assert_eq!(doc["database"], "sandbox_a", "{body}");
        assert_eq!(doc["value"], value, "{body}");
        assert_eq!(doc["service"], "rows");
        assert_eq!(doc["pod"], "rows-pod");
        ids.push(doc["id"].as_i64().unwrap());
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");

    // Too large, and not UTF-8: 400, nothing stored.
    for (bad, why) in [
        (vec![b'x'; 4097], "larger than 4096 bytes"),
        (vec![0xff, 0xfe, b'a'], "not UTF-8"),
    ] {
        let (status, body) = request(port, Method::POST, "/rows", bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(
            json(&body)["error"].as_str().unwrap().contains(why),
            "{body}"
        );
    }

    // Read back, newest first, from the database itself as well as through the app.
    let (status, body) = request(port, Method::GET, "/rows", vec![]).await;
    answers += &body;
    assert_eq!(status, StatusCode::OK, "{body}");
    let rows = json(&body)["rows"].as_array().unwrap().clone();
    assert_eq!(rows.len(), 3, "{body}");
    assert_eq!(rows[0]["id"].as_i64(), ids.last().copied());
    assert_eq!(rows[1]["value"], "zweite Zeile: grüße");
    assert_eq!(rows[2]["value"], "first row");
    assert!(rows.iter().all(|r| r["written_by"] == "rows-pod"), "{body}");
    assert!(
        rows.iter()
            .all(|r| r["at"].as_str().unwrap().ends_with('Z')),
        "{body}"
    );
    let (db, conn) = tokio_postgres::connect(
        &format!("postgres://app:{PASSWORD}@127.0.0.1:{}/sandbox_a", pg.port),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let stored: Vec<String> = db
        .query("SELECT value FROM spur_demo_rows ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(stored[..2], ["first row", "zweite Zeile: grüße"]);
    drop(db);

    // Everything else is as without the flag.
    let (status, body) = request(port, Method::GET, "/other", vec![]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(json(&body)["database"], Value::Null, "{body}");
    let (status, _) = request(port, Method::POST, "/other", b"x".to_vec()).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    let (status, _) = request(port, Method::DELETE, "/rows", vec![]).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

    // A connection the server ends (an admin, a restart) is made again: at most one request
    // sees the break.
    admin
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'app'",
        )
        .await
        .unwrap();
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let (status, body) = request(port, Method::GET, "/rows", vec![]).await;
        answers += &body;
        statuses.push(status);
        if status == StatusCode::OK {
            assert_eq!(json(&body)["rows"].as_array().unwrap().len(), 3, "{body}");
            break;
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    }
    assert_eq!(statuses.last(), Some(&StatusCode::OK), "{statuses:?}");

    // A stopped server: 503, naming the database without its password.
    drop(admin);
    pg.stop().await;
    let (status, body) = request(port, Method::POST, "/rows", b"lost".to_vec()).await;
    answers += &body;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let error = json(&body)["error"].as_str().unwrap().to_owned();
    assert!(
        error.contains(&format!("postgres://app@127.0.0.1:{}/sandbox_a", pg.port)),
        "{error}"
    );
    let (status, body) = request(port, Method::GET, "/rows", vec![]).await;
    answers += &body;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let (status, body) = request(port, Method::GET, "/healthz", vec![]).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));

    signal(&app, Signal::SIGTERM);
    let out = tokio::time::timeout(Duration::from_secs(30), app.wait_with_output())
        .await
        .expect("spur demo app did not stop on SIGTERM")
        .unwrap();
    let logs = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{logs}");
    assert!(logs.contains("postgres://app@127.0.0.1:"), "{logs}");
    assert!(!logs.contains(PASSWORD), "the password was logged:\n{logs}");
    assert!(
        !answers.contains(PASSWORD),
        "an answer held the password:\n{answers}"
    );
}
