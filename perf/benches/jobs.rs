//! Jobs on a real one-node cluster (tests/node): how long from submit to the first log line
//! with an idle runner, and how many jobs per minute one group of two runners gets through.
//!
//! Setup: the node of `spur_e2e::node::node()`, Spur's chart installed with helm (the values of
//! tests/tests/node.rs), a namespace with a JobRunnerGroup of 2 runners
//! (`localhost/spur-test-client:dev`, unchanged).
//!
//! - Latency: `SPUR_BENCH_JOBS` (default 30) jobs one at a time, each with both runners idle:
//!   the Job is created through the API server, then its log is followed through the API
//!   server (`GET .../jobs/NAME/log?follow=true`, the aggregated API, as `spur job submit
//!   --attach` does). Measured on the bench's clock: create request → first byte of output
//!   (`echo first`), → `status.phase` Running seen, → Succeeded seen. One unmeasured warm-up.
//! - Throughput: `SPUR_BENCH_BURST` (default 100) jobs (`true`) created at once; from the first
//!   create to the last Succeeded, in jobs per minute; and the CPU the jobs component
//!   (`spur jobs`, from /proc) and the API server spent per job.
//!
//! Writes `perf/results/jobs.md`. Run with `perf/jobs.sh` (root; release binaries and image, its
//! own node). Without `--bench` (as `cargo test --benches` runs it) it does nothing: it needs a
//! node.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use futures_util::AsyncReadExt;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use spur_api::Job;
use spur_e2e::node::{CHART_VALUES, Node, SPUR_NAMESPACE, node};
use spur_perf::params::env_usize;

const RELEASE: &str = "spur";
const GROUP: &str = "bench";

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() -> Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!("jobs: needs a one-node cluster (root); run perf/jobs.sh. Skipped.");
        return Ok(());
    }
    let jobs = env_usize("SPUR_BENCH_JOBS", 30);
    let burst = env_usize("SPUR_BENCH_BURST", 100);
    let load_before = loadavg();
    let started = Instant::now();
    let node = node();
    let chart = format!("{}/../charts/spur", env!("CARGO_MANIFEST_DIR"));
    let mut args = vec![
        "upgrade",
        "--install",
        RELEASE,
        &chart,
        "--namespace",
        SPUR_NAMESPACE,
        "--create-namespace",
        "--wait",
        "--timeout",
        "5m",
    ];
    args.extend_from_slice(CHART_VALUES);
    node.helm(&args)
        .with_context(|| node.describe(SPUR_NAMESPACE))?;
    let setup = started.elapsed();
    eprintln!("jobs: node and chart ready in {setup:.1?}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(run(node, jobs, burst))?;
    let report = report(&r, setup, &load_before, &loadavg());
    println!("{report}");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/jobs.md");
    std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("jobs: wrote {}", path.display());
    Ok(())
}

struct Sample {
    first_line: f64,
    running: f64,
    done: f64,
}

struct Results {
    samples: Vec<Sample>,
    burst: usize,
    burst_secs: f64,
    jobs_cpu_ms_per_job: f64,
    apiserver_cpu_ms_per_job: f64,
}

fn job(ns: &str, name: &str, script: &str) -> Job {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"runnerGroup": GROUP, "script": script}
    }))
    .unwrap()
}

fn phase(j: &Job) -> &'static str {
    j.status
        .as_ref()
        .and_then(|s| s.phase)
        .map_or("Queued", |p| p.as_str())
}

async fn wait_idle(api: &Api<spur_api::JobRunnerGroup>, n: i32) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let g = api.get(GROUP).await?;
        let st = g.status.unwrap_or_default();
        if st.idle_replicas == n && st.ready_replicas == n && st.running == 0 && st.queued == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the runner group never had {n} idle runners: {st:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Create → first output byte, → Running, → Succeeded (ms).
async fn one(client: &Client, ns: &str, name: &str) -> Result<Sample> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    let t0 = Instant::now();
    jobs.create(
        &PostParams::default(),
        &job(ns, name, "#!/bin/sh\necho first\n"),
    )
    .await?;
    // The status, polled from the create on, next to the log stream.
    let poll = {
        let jobs = jobs.clone();
        let name = name.to_owned();
        tokio::spawn(async move {
            let mut running = None;
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let j = jobs.get(&name).await?;
                match phase(&j) {
                    "Running" => {
                        running.get_or_insert(t0.elapsed());
                    }
                    "Succeeded" => return Ok::<_, anyhow::Error>((running, t0.elapsed())),
                    "Queued" => {}
                    other => bail!("{name} ended {other}: {:?}", j.status),
                }
                if Instant::now() > deadline {
                    bail!("{name} did not finish within 2 min");
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let path = format!("/apis/jobs.spur.dev/v1alpha1/namespaces/{ns}/jobs/{name}/log?follow=true");
    let req = http::Request::get(&path).body(Vec::new())?;
    let mut stream = client.request_stream(req).await?;
    let mut b = [0u8; 1];
    let n = stream.read(&mut b).await?;
    if n == 0 {
        bail!("{name}: the log ended without output");
    }
    let first_line = t0.elapsed();
    let (running, done) = poll.await??;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Ok(Sample {
        first_line: ms(first_line),
        // Succeeded before a poll saw Running: it ran between two polls.
        running: ms(running.unwrap_or(done)),
        done: ms(done),
    })
}

fn cpu_ms(prefix: &[&str]) -> f64 {
    spur_perf::bench::proc::cpu_ms_running(prefix)
}

async fn run(node: &'static Node, jobs: usize, burst: usize) -> Result<Results> {
    let client = node.client().await?;
    let ns_guard = node.namespace("jobs-bench", &[])?;
    let ns = ns_guard.name.as_str();
    node.apply(&format!(
        "apiVersion: spur.dev/v1alpha1\nkind: JobRunnerGroup\nmetadata:\n  name: {GROUP}\n  namespace: {ns}\nspec:\n  image: localhost/spur-test-client:dev\n  replicas: 2\n"
    ))?;
    let groups: Api<spur_api::JobRunnerGroup> = Api::namespaced(client.clone(), ns);
    wait_idle(&groups, 2).await?;

    let mut samples = Vec::new();
    for i in 0..=jobs {
        wait_idle(&groups, 2).await?;
        let s = one(&client, ns, &format!("lat-{i}")).await?;
        eprintln!(
            "jobs: lat-{i}: first line {:.0} ms, running {:.0} ms, done {:.0} ms{}",
            s.first_line,
            s.running,
            s.done,
            if i == 0 { " (warm-up)" } else { "" }
        );
        if i > 0 {
            samples.push(s);
        }
    }

    wait_idle(&groups, 2).await?;
    let jobs_api: Api<Job> = Api::namespaced(client.clone(), ns);
    let cpu_jobs0 = cpu_ms(&["spur-jobs", "serve"]);
    let cpu_api0 = cpu_ms(&["kube-apiserver"]);
    let t0 = Instant::now();
    for i in 0..burst {
        jobs_api
            .create(
                &PostParams::default(),
                &job(ns, &format!("burst-{i:03}"), "#!/bin/sh\ntrue\n"),
            )
            .await?;
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let list = jobs_api.list(&ListParams::default()).await?;
        let done = list
            .items
            .iter()
            .filter(|j| {
                j.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with("burst-"))
            })
            .filter(|j| phase(j) == "Succeeded")
            .count();
        if let Some(bad) = list
            .items
            .iter()
            .find(|j| matches!(phase(j), "Failed" | "Canceled"))
        {
            bail!("a burst job failed: {:?}", bad.status);
        }
        if done == burst {
            break;
        }
        if Instant::now() > deadline {
            bail!("{done} of {burst} burst jobs done after 10 min");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let burst_secs = t0.elapsed().as_secs_f64();
    let jobs_cpu = cpu_ms(&["spur-jobs", "serve"]) - cpu_jobs0;
    let api_cpu = cpu_ms(&["kube-apiserver"]) - cpu_api0;
    if jobs_cpu <= 0.0 {
        return Err(anyhow!(
            "no CPU time read for `spur-jobs serve`: is it running on this host?"
        ));
    }
    Ok(Results {
        samples,
        burst,
        burst_secs,
        jobs_cpu_ms_per_job: jobs_cpu / burst as f64,
        apiserver_cpu_ms_per_job: api_cpu / burst as f64,
    })
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

fn report(r: &Results, setup: Duration, load_before: &str, load_after: &str) -> String {
    let mut out = String::new();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let date = Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "# Jobs on a one-node cluster\n\n\
         Date: {date}. Command: `perf/jobs.sh` (`cargo bench -p spur-perf --bench jobs`). \
         Machine: {cores} cores, Linux {}. Node: tests/node (kubelet, containerd, runc, \
         kube-apiserver with etcd, all on the same {cores} cores), Spur's chart installed with \
         helm, release-build image; runners: a JobRunnerGroup of 2 pods of \
         `localhost/spur-test-client:dev` (Debian with curl, unchanged). Set-up (node, image \
         import, chart): {:.0} s. Load average (1/5/15 min) before: {load_before}; after: \
         {load_after}.\n",
        kernel.trim(),
        setup.as_secs_f64()
    );
    let n = r.samples.len();
    let col = |f: fn(&Sample) -> f64| -> Vec<f64> { r.samples.iter().map(f).collect() };
    let _ = writeln!(
        out,
        "## Submit → first log line, with an idle runner\n\n\
         {n} jobs (`echo first`), one at a time, both runners idle before each (after one \
         unmeasured warm-up). Bench clock, from the create request: the first byte of output \
         through the API server (`GET …/jobs/NAME/log?follow=true`, as `spur job submit \
         --attach` reads it); and, from a status poll (every 5 ms, from the create on, next to \
         the log stream), the first `status.phase: Running` and `Succeeded` it saw. Percentiles \
         are nearest-rank.\n\n\
         | | p50 | p90 | p99 | max |\n|---|---|---|---|---|"
    );
    for (what, v) in [
        ("first log line", col(|s| s.first_line)),
        ("Running seen", col(|s| s.running)),
        ("Succeeded seen", col(|s| s.done)),
    ] {
        let _ = writeln!(
            out,
            "| {what} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms |",
            pct(&v, 50.0),
            pct(&v, 90.0),
            pct(&v, 99.0),
            pct(&v, 100.0)
        );
    }
    let _ = writeln!(
        out,
        "\nSamples (first log line, ms): {}\n",
        r.samples
            .iter()
            .map(|s| format!("{:.0}", s.first_line))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        out,
        "## Throughput: one group of 2 runners\n\n\
         {} jobs (`true`) created at once (one create request after another), from the first \
         create to the last `Succeeded`: {:.1} s, **{:.0} jobs per minute**. CPU per job (user + \
         system, /proc, over the burst): `spur jobs` {:.1} ms, kube-apiserver {:.1} ms.\n",
        r.burst,
        r.burst_secs,
        r.burst as f64 / r.burst_secs * 60.0,
        r.jobs_cpu_ms_per_job,
        r.apiserver_cpu_ms_per_job,
    );
    out
}
