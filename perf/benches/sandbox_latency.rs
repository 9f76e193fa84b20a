//! Control-plane benchmark on a real kube-apiserver: time from `Sandbox` create to its routing
//! rule being live at a real sidecar watch client, and reconcile throughput for many sandboxes.
//!
//! Setup: kube-apiserver + etcd (tests/kube-harness), the CRDs from charts/spur/crds, the
//! operator and the route server (Kubernetes store) in this process, one baseline Deployment +
//! Service, one `RouteServerSource` watching that baseline, and a stand-in kubelet that marks
//! every fork Deployment ready as soon as it appears (so the figures are the control plane's own,
//! not a scheduler's or an image pull's).
//!
//! - Latency: `SPUR_BENCH_SANDBOXES` (default 100) sandboxes created one after another; each is
//!   timed from the create call to its rule in the watcher's table; p50/p90/p99/max.
//! - Throughput: `SPUR_BENCH_BULK` (default 1000) sandboxes created by 16 concurrent clients;
//!   time until every rule is live; sandboxes per second.
//!
//! Writes `perf/results/sandbox_latency.md`. Run: `cargo bench -p spur-perf --bench
//! sandbox_latency` (needs Go for the first build of kube-apiserver, see tests/kube/README.md).
//! Without `--bench` (as `cargo test --benches` runs it) it does a smoke run of 3 + 5 sandboxes
//! and writes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use hdrhistogram::Histogram;
use kube::{Api, Client};
use spur_api::Sandbox;
use spur_discovery::{Publisher, RouteServerConn, RouteServerSource};
use spur_kube_harness::KubeApi;
use spur_perf::kube_bench::{
    APP_PORT, NS, cpu_seconds, create_sandbox, create_sandboxes, fake_kubelet, install_crds,
    rss_mib, setup_baselines,
};
use spur_perf::params::env_usize;
use spur_routeserver::{KubeStore, RouteServer, RouteServerConfig};
use spur_routing::{BaselineWorkload, SharedTable};
use tokio_util::sync::CancellationToken;

const BASELINE: &str = "web";
const WAIT: Duration = Duration::from_secs(600);

fn main() -> Result<()> {
    let full = std::env::args().any(|a| a == "--bench");
    let (sequential, bulk) = if full {
        (
            env_usize("SPUR_BENCH_SANDBOXES", 100),
            env_usize("SPUR_BENCH_BULK", 1000),
        )
    } else {
        (3, 5)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(sequential, bulk, full))
}

async fn run(sequential: usize, bulk: usize, write: bool) -> Result<()> {
    let started = Instant::now();
    let api = KubeApi::start().await?;
    install_crds(&api).await?;
    let client = api.client();
    let version = client.apiserver_version().await?.git_version;
    setup_baselines(&client, &[BASELINE]).await?;

    let stop = CancellationToken::new();
    let mut operator_registry = prometheus_client::registry::Registry::default();
    let metrics = spur_operator::Metrics::register(&mut operator_registry);
    let ctx = Arc::new(spur_operator::Context::new(
        client.clone(),
        Some("bench".into()),
        metrics,
    ));
    let operator = tokio::spawn(spur_operator::run(client.clone(), ctx, stop.clone()));
    let kubelet = tokio::spawn(fake_kubelet(client.clone(), stop.clone()));
    let server = RouteServer::start_with(
        RouteServerConfig {
            grpc_addr: "127.0.0.1:0".parse()?,
            http_addr: "127.0.0.1:0".parse()?,
            ..RouteServerConfig::new("")
        },
        KubeStore::new(client.clone()),
    )
    .await?;

    let table = SharedTable::new();
    let mut registry = prometheus_client::registry::Registry::default();
    let publisher = Publisher::new(table.clone(), &mut registry);
    let baseline = BaselineWorkload {
        kind: "Deployment".into(),
        namespace: NS.into(),
        name: BASELINE.into(),
    };
    let source = RouteServerSource::new(
        RouteServerConn::plain(server.grpc_addr.to_string()),
        baseline.clone(),
        publisher,
        &mut registry,
    )?;
    let watcher = tokio::spawn(source.run(stop.clone()));
    let setup = started.elapsed();

    let live = |key: &str| {
        table
            .load()
            .table
            .lookup(&baseline, APP_PORT, key)
            .is_some()
    };
    let sandboxes: Api<Sandbox> = Api::all(client.clone());

    let one = |name: String| {
        let (sandboxes, live) = (&sandboxes, &live);
        async move {
            let t0 = Instant::now();
            let key = create_sandbox(sandboxes, &name, &[BASELINE]).await?;
            while !live(&key) {
                if t0.elapsed() > WAIT {
                    bail!("sandbox {name}: rule not live after {WAIT:?}");
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok(t0.elapsed())
        }
    };
    // The first sandbox after start-up also waits for the operator's watches (right after the
    // CRDs are installed, some back off on 404s first): reported on its own.
    let first = one("first".into()).await?;

    // Latency: one at a time.
    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    for i in 0..sequential {
        let took = one(format!("seq-{i}")).await?;
        hist.record(took.as_micros().try_into().unwrap_or(u64::MAX))?;
    }

    // Throughput: many at once.
    let requests_before = apiserver_requests(&client).await?;
    let rss_before = rss_mib(std::process::id());
    let cpu_before = [
        cpu_seconds(api.apiserver_pid()),
        cpu_seconds(api.etcd_pid()),
        cpu_seconds(std::process::id()),
    ];
    let t0 = Instant::now();
    let keys = create_sandboxes(
        &sandboxes,
        (0..bulk).map(|i| format!("bulk-{i}")),
        &[BASELINE],
        16,
    )
    .await?;
    let created_in = t0.elapsed();
    loop {
        let missing = keys.iter().filter(|k| !live(k)).count();
        if missing == 0 {
            break;
        }
        if t0.elapsed() > WAIT {
            bail!("{missing} of {bulk} rules not live after {WAIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let all_live = t0.elapsed();
    let cpu_after = [
        cpu_seconds(api.apiserver_pid()),
        cpu_seconds(api.etcd_pid()),
        cpu_seconds(std::process::id()),
    ];
    let requests_after = apiserver_requests(&client).await?;
    let rss_growth_kib = (rss_mib(std::process::id()) - rss_before) * 1024.0 / bulk as f64;
    let per_sandbox_cpu: Vec<String> = cpu_before
        .iter()
        .zip(&cpu_after)
        .map(|(b, a)| format!("{:.1}", (a - b) * 1000.0 / bulk as f64))
        .collect();
    let mut calls: Vec<(String, f64, f64)> = requests_after
        .iter()
        .map(|(k, a)| {
            let b = requests_before.get(k).copied().unwrap_or((0.0, 0.0));
            (
                k.clone(),
                (a.0 - b.0) / bulk as f64,
                (a.1 - b.1) * 1000.0 / bulk as f64,
            )
        })
        .filter(|(_, n, _)| *n >= 0.05)
        .collect();
    calls.sort_by(|a, b| b.2.total_cmp(&a.2));
    let total_calls: f64 = calls.iter().map(|(_, n, _)| n).sum();
    let total_ms: f64 = calls.iter().map(|(_, _, t)| t).sum();

    stop.cancel();
    server.shutdown().await;
    let _ = tokio::time::timeout(Duration::from_secs(30), operator).await;
    let _ = watcher.await;
    let _ = kubelet.await;

    let apiserver_rss = rss_mib(api.apiserver_pid());
    let etcd_rss = rss_mib(api.etcd_pid());
    let mut encoded = String::new();
    prometheus_client::encoding::text::encode(&mut encoded, &operator_registry)?;
    let reconciles: Vec<String> = encoded
        .lines()
        .filter(|l| l.starts_with("reconciles_total{") || l.starts_with("reconcile_failures_total"))
        .map(|l| l.replace("reconciles_total", "").replace("_total", ""))
        .collect();
    let ms = |us: u64| us as f64 / 1000.0;
    let mut out = String::new();
    writeln!(
        out,
        "# Control plane: Sandbox create → rule live at a watcher\n"
    )?;
    writeln!(
        out,
        "Command: `cargo bench -p spur-perf --bench sandbox_latency`. Machine: {} cores. \
         kube-apiserver {} + etcd from tests/kube (same machine), operator and route server in the bench process, \
         one `RouteServerSource` watching the baseline, fork Deployments marked ready by a stand-in kubelet as soon as they appear. \
         Set-up (API server start, CRDs, controllers): {:.1} s.\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        version,
        setup.as_secs_f64()
    )?;
    writeln!(out, "| Measurement | Result |\n|---|---|")?;
    writeln!(
        out,
        "| Create → live, {sequential} sandboxes one at a time: p50 / p90 / p99 / max | {:.0} / {:.0} / {:.0} / {:.0} ms |",
        ms(hist.value_at_quantile(0.5)),
        ms(hist.value_at_quantile(0.9)),
        ms(hist.value_at_quantile(0.99)),
        ms(hist.max())
    )?;
    writeln!(
        out,
        "| Create → live of the first sandbox after start-up (operator watches still starting) | {:.0} ms |",
        first.as_secs_f64() * 1000.0
    )?;
    writeln!(
        out,
        "| {bulk} sandboxes created by 16 concurrent clients: create calls done / all rules live | {:.1} s / {:.1} s |",
        created_in.as_secs_f64(),
        all_live.as_secs_f64()
    )?;
    writeln!(
        out,
        "| Reconcile throughput (sandboxes made live per second) | {:.1} /s |",
        bulk as f64 / all_live.as_secs_f64()
    )?;
    writeln!(
        out,
        "| Operator reconcile passes for the {} sandboxes | {} |",
        sequential + bulk,
        reconciles.join(", ")
    )?;
    writeln!(
        out,
        "| CPU per sandbox in the bulk phase: kube-apiserver / etcd / bench process (operator, route server, clients) | {} ms |",
        per_sandbox_cpu.join(" / ")
    )?;
    writeln!(
        out,
        "| API requests per sandbox in the bulk phase (watches excluded): count / API server time | {total_calls:.1} / {total_ms:.0} ms |"
    )?;
    writeln!(
        out,
        "| Resident memory at the end: kube-apiserver / etcd | {apiserver_rss:.0} MiB / {etcd_rss:.0} MiB |"
    )?;
    writeln!(
        out,
        "| Bench-process resident memory growth over the bulk phase, per sandbox (operator stores, route server, watcher; an upper bound for the operator) | {rss_growth_kib:.1} KiB |"
    )?;
    writeln!(
        out,
        "\n## API requests per sandbox in the bulk phase\n\nFrom the API server's `apiserver_request_total` and `apiserver_request_duration_seconds_sum`; time is wall-clock inside the API server (etcd included), most expensive first.\n\n| verb | resource | subresource | requests | time (ms) |\n|---|---|---|---:|---:|"
    )?;
    for (k, n, t) in &calls {
        writeln!(out, "| {k} | {n:.2} | {t:.1} |")?;
    }
    print!("{out}");
    if write {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/sandbox_latency.md");
        std::fs::write(&path, &out).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// The API server's request counters (`apiserver_request_total`, summed over codes) and the
/// time it spent on them (`apiserver_request_duration_seconds_sum`), keyed "verb | resource |
/// subresource"; watches are left out (long-running).
async fn apiserver_requests(client: &Client) -> Result<HashMap<String, (f64, f64)>> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(req).await?;
    let mut out = HashMap::new();
    for line in text.lines() {
        let (rest, is_count) = if let Some(r) = line.strip_prefix("apiserver_request_total{") {
            (r, true)
        } else if let Some(r) = line.strip_prefix("apiserver_request_duration_seconds_sum{") {
            (r, false)
        } else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let verb = label("verb");
        if verb == "WATCH" {
            continue;
        }
        let key = format!("{verb} | {} | {}", label("resource"), label("subresource"));
        let v = value.trim().parse::<f64>().unwrap_or(0.0);
        let e = out.entry(key).or_insert((0.0, 0.0));
        if is_count {
            e.0 += v;
        } else {
            e.1 += v;
        }
    }
    Ok(out)
}
