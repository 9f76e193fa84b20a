//! Real third-party clients against the sidecar: curl (HTTP/1.1 and HTTP/2 prior knowledge) and
//! h2load (HTTP/2 multiplexed and HTTP/1.1 keep-alive load).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Output;
use std::time::Duration;

use spur_e2e::{Env, metrics, sample};
use tokio::process::Command;
use tokio::time::timeout;

const INSTALL_HINT: &str = "tests/run.sh installs it (apt-get install -y curl nghttp2-client)";

/// Runs `program args…` with a time limit and returns its output; a missing program fails the
/// test with a hint on how to get it.
async fn run(program: &str, args: &[&str], limit: Duration) -> Output {
    let child = Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    match timeout(limit, child).await {
        Err(_) => panic!("{program} {args:?} did not finish within {limit:?}"),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!("`{program}` is not installed: {INSTALL_HINT}")
        }
        Ok(Err(e)) => panic!("cannot run {program}: {e}"),
        Ok(Ok(out)) => out,
    }
}

/// Runs curl and returns its stdout; curl must succeed.
async fn curl(args: &[&str]) -> String {
    let mut all = vec!["--silent", "--show-error", "--max-time", "10"];
    all.extend_from_slice(args);
    let out = run("curl", &all, Duration::from_secs(20)).await;
    assert!(
        out.status.success(),
        "curl {all:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The counts of h2load's `requests:` summary line.
#[derive(Debug, PartialEq, Eq)]
struct Summary {
    total: u64,
    started: u64,
    done: u64,
    succeeded: u64,
    failed: u64,
    errored: u64,
    /// `status codes: N 2xx, …`
    status_2xx: u64,
}

/// Parses `requests: 2000 total, 2000 started, 2000 done, 2000 succeeded, 0 failed, 0 errored,
/// 0 timeout` and `status codes: 2000 2xx, 0 3xx, 0 4xx, 0 5xx`.
fn parse_h2load(stdout: &str) -> Summary {
    let numbers = |prefix: &str| -> Vec<(u64, String)> {
        let line = stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line in h2load output:\n{stdout}"));
        line.split(',')
            .filter_map(|part| {
                let mut words = part.split_whitespace();
                let n = words.next()?.parse().ok()?;
                Some((n, words.next()?.to_owned()))
            })
            .collect()
    };
    let requests = numbers("requests:");
    let get = |list: &[(u64, String)], what: &str| {
        list.iter()
            .find(|(_, w)| w == what)
            .map(|(n, _)| *n)
            .unwrap_or_else(|| panic!("no `{what}` count in h2load output:\n{stdout}"))
    };
    let codes = numbers("status codes:");
    Summary {
        total: get(&requests, "total"),
        started: get(&requests, "started"),
        done: get(&requests, "done"),
        succeeded: get(&requests, "succeeded"),
        failed: get(&requests, "failed"),
        errored: get(&requests, "errored"),
        status_2xx: get(&codes, "2xx"),
    }
}

async fn h2load(args: &[&str]) -> Summary {
    let out = run("h2load", args, Duration::from_secs(120)).await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "h2load {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_h2load(&stdout)
}

#[test]
fn h2load_summary_parses() {
    let out = "finished in 1.2s, 1000 req/s\nrequests: 2000 total, 2000 started, 1990 done, 1985 succeeded, 15 failed, 10 errored, 0 timeout\nstatus codes: 1985 2xx, 0 3xx, 5 4xx, 0 5xx\n";
    let s = parse_h2load(out);
    assert_eq!(
        s,
        Summary {
            total: 2000,
            started: 2000,
            done: 1990,
            succeeded: 1985,
            failed: 15,
            errored: 10,
            status_2xx: 1985
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_http1_and_h2c_are_routed_by_key() {
    let env = Env::http().await;
    let url = format!("http://{}/", env.addr());

    assert_eq!(curl(&[&url]).await, "hello from baseline\n");
    assert_eq!(
        curl(&["-H", "baggage: sd-routing-key=k1", &url]).await,
        "hello from fork\n"
    );
    // A key for which there is no rule is just the baseline.
    assert_eq!(
        curl(&["-H", "baggage: sd-routing-key=nope", &url]).await,
        "hello from baseline\n"
    );

    // HTTP/2 with prior knowledge; `-w` proves the protocol curl actually spoke.
    let out = curl(&[
        "--http2-prior-knowledge",
        "-w",
        "%{http_version}",
        "-H",
        "tracestate: sd-routing-key=k1",
        &url,
    ])
    .await;
    assert_eq!(out, "hello from fork\n2");
    let out = curl(&["--http2-prior-knowledge", "-w", "%{http_version}", &url]).await;
    assert_eq!(out, "hello from baseline\n2");
    let out = curl(&[
        "--http1.1",
        "-w",
        "%{http_version}",
        "-H",
        "tracestate: sd-routing-key=k1",
        &url,
    ])
    .await;
    assert_eq!(out, "hello from fork\n1.1");

    // A POST body through curl, echoed by the fork.
    let echo = format!("http://{}/echo", env.addr());
    let out = curl(&[
        "-H",
        "baggage: sd-routing-key=k1",
        "--data-binary",
        "payload from curl",
        &echo,
    ])
    .await;
    assert_eq!(out, "payload from curl");

    let text = metrics(env.admin()).await;
    assert_eq!(
        sample(&text, "spur_requests_total{outcome=\"sandbox\"}"),
        4.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "spur_requests_total{outcome=\"baseline\"}"),
        3.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "spur_requests_total{outcome=\"error\"}"),
        0.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "spur_connections_total{protocol=\"http2\"}"),
        2.0,
        "{text}"
    );
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2load_multiplexed_and_keep_alive_all_succeed() {
    let env = Env::http().await;
    let url = format!("http://{}/", env.addr());

    // HTTP/2 (h2c prior knowledge), 4 connections × 10 concurrent streams, all keyed.
    let s = h2load(&[
        "-n",
        "2000",
        "-c",
        "4",
        "-m",
        "10",
        "-H",
        "baggage: sd-routing-key=k1",
        &url,
    ])
    .await;
    assert_eq!(
        (
            s.total,
            s.started,
            s.done,
            s.succeeded,
            s.failed,
            s.errored,
            s.status_2xx
        ),
        (2000, 2000, 2000, 2000, 0, 0, 2000),
        "{s:?}"
    );
    let text = metrics(env.admin()).await;
    assert!(
        sample(&text, "spur_requests_total{outcome=\"sandbox\"}") >= 2000.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "spur_connections_total{protocol=\"http2\"}"),
        4.0,
        "{text}"
    );

    // HTTP/1.1 keep-alive, unkeyed: 4 connections reused for 1000 requests.
    let s = h2load(&["--h1", "-n", "1000", "-c", "4", &url]).await;
    assert_eq!(
        (
            s.total,
            s.started,
            s.done,
            s.succeeded,
            s.failed,
            s.errored,
            s.status_2xx
        ),
        (1000, 1000, 1000, 1000, 0, 0, 1000),
        "{s:?}"
    );
    let text = metrics(env.admin()).await;
    assert!(
        sample(&text, "spur_requests_total{outcome=\"baseline\"}") >= 1000.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "spur_requests_total{outcome=\"error\"}"),
        0.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "spur_connections_total{protocol=\"http1\"}"),
        4.0,
        "{text}"
    );
    env.shutdown().await;
}
