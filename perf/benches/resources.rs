//! Sandbox resources on a real one-node cluster (tests/node): how long from creating a Sandbox
//! with one database resource (the documented PostgreSQL plugin: two create steps, each a pod)
//! to its fork being Ready, and how long its deletion (fork, then the delete step) takes.
//!
//! Setup: the node of `spur_e2e::node::node()`, Spur's chart installed with helm (the values of
//! tests/tests/node.rs), a PostgreSQL server (`localhost/spur-postgres:dev`) and a baseline
//! `customer` (`spur demo app` writing to it) in namespace `hotrod`, the plugin
//! `postgres.1.0.0` (docs/examples/resourceplugin-postgres.yaml).
//!
//! `SPUR_BENCH_RUNS` (default 10) sandboxes, one at a time, after one unmeasured warm-up. Bench
//! clock, from the Sandbox's create request: the Resource's `Ready` seen, the Sandbox's `Ready`
//! seen (fork available and routed), polled every 20 ms; then from the delete request to the
//! Sandbox gone. Also the CPU the operator, the io context server and the API server spent per
//! sandbox (create and delete), from /proc.
//!
//! Writes `perf/results/resources.md`. Run with `perf/resources.sh` (root; release binaries
//! and images, its own node). Without `--bench` (as `cargo test --benches` runs it) it does
//! nothing: it needs a node.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use spur_api::{Resource, Sandbox};
use spur_e2e::node::{CHART_VALUES, Node, SPUR_NAMESPACE, node};
use spur_perf::params::env_usize;

const RELEASE: &str = "spur";
const NS: &str = "hotrod";
const PASSWORD: &str = "bench-admin-password";

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() -> Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!("resources: needs a one-node cluster (root); run perf/resources.sh. Skipped.");
        return Ok(());
    }
    let runs = env_usize("SPUR_BENCH_RUNS", 10);
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
    setup(node)?;
    let setup_time = started.elapsed();
    eprintln!("resources: node, chart, database and baseline ready in {setup_time:.1?}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(run(node, runs))?;
    let report = report(&r, setup_time, &load_before, &loadavg());
    println!("{report}");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/resources.md");
    std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("resources: wrote {}", path.display());
    Ok(())
}

/// The database server, its admin Secret (next to it and where the steps run), the baseline,
/// the plugin.
fn setup(node: &Node) -> Result<()> {
    node.kubectl_stdin(
        &["apply"],
        &format!(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NS}\n  labels:\n    sidecar.spur.dev/inject: \"true\"\n"
        ),
    )?;
    for ns in [NS, "spur-resources"] {
        let _ = node.kubectl(&[
            "-n",
            ns,
            "delete",
            "secret",
            "postgres-admin",
            "--ignore-not-found",
        ]);
        node.kubectl(&[
            "-n",
            ns,
            "create",
            "secret",
            "generic",
            "postgres-admin",
            &format!("--from-literal=password={PASSWORD}"),
        ])?;
    }
    spur_e2e::node::postgres(node, NS, "postgres-admin")?;
    let url = format!("postgres://postgres:{PASSWORD}@postgres.{NS}.svc:5432/postgres");
    let customer = spur_e2e::node::demo_app(NS, "customer", None).replace(
        "          env:\n            - name: POD_NAME\n",
        &format!(
            "          env:\n            - name: SPUR_APP_DATABASE_URL\n              value: {url:?}\n            - name: POD_NAME\n"
        ),
    );
    node.apply(&customer)?;
    node.rollout(NS, "customer")?;
    let plugin = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/examples/resourceplugin-postgres.yaml"),
    )?;
    node.apply(&plugin)?;
    Ok(())
}

fn sandbox(name: &str) -> Sandbox {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {
            "resources": [{"name": "db", "plugin": "postgres@1.0.0", "params": {"db-prefix": "bench"}}],
            "forks": [{
                "forkOf": {"kind": "Deployment", "namespace": NS, "name": "customer"},
                "customizations": {"env": [{
                    "name": "SPUR_APP_DATABASE_URL",
                    "valueFrom": {"resource": {"name": "db", "outputKey": "user.dsn"}}
                }]}
            }]
        }
    }))
    .unwrap()
}

fn ready(v: &Value) -> bool {
    v["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

struct Sample {
    resource_ready: f64,
    sandbox_ready: f64,
    deleted: f64,
}

struct Results {
    samples: Vec<Sample>,
    operator_cpu_ms: f64,
    ics_cpu_ms: f64,
    apiserver_cpu_ms: f64,
}

/// Create → Resource Ready, → Sandbox Ready; delete → gone (ms).
async fn one(client: &Client, name: &str) -> Result<Sample> {
    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    let resources: Api<Resource> = Api::all(client.clone());
    let rname = spur_api::names::resource_name(name, "db");
    let t0 = Instant::now();
    sandboxes
        .create(&PostParams::default(), &sandbox(name))
        .await?;
    let deadline = t0 + Duration::from_secs(300);
    let mut resource_ready = None;
    let sandbox_ready = loop {
        if resource_ready.is_none()
            && let Some(r) = resources.get_opt(&rname).await?
            && ready(&serde_json::to_value(&r)?)
        {
            resource_ready = Some(t0.elapsed().as_secs_f64() * 1e3);
        }
        let s = sandboxes.get(name).await?;
        if ready(&serde_json::to_value(&s)?) {
            break t0.elapsed().as_secs_f64() * 1e3;
        }
        if Instant::now() > deadline {
            bail!("sandbox {name} not Ready after 300 s: {:?}", s.status);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let t1 = Instant::now();
    sandboxes.delete(name, &DeleteParams::default()).await?;
    let deadline = t1 + Duration::from_secs(300);
    while sandboxes.get_opt(name).await?.is_some() {
        if Instant::now() > deadline {
            bail!("sandbox {name} not gone 300 s after its delete");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(Sample {
        resource_ready: resource_ready.unwrap_or(sandbox_ready),
        sandbox_ready,
        deleted: t1.elapsed().as_secs_f64() * 1e3,
    })
}

fn cpu_ms(prefix: &[&str]) -> f64 {
    spur_perf::bench::proc::cpu_ms_running(prefix)
}

async fn run(node: &'static Node, runs: usize) -> Result<Results> {
    let client = node.client().await?;
    one(&client, "bench-warmup").await?;
    let cpu = || {
        (
            cpu_ms(&["spur-operator"]),
            cpu_ms(&["spur-ics"]),
            cpu_ms(&["kube-apiserver"]),
        )
    };
    let before = cpu();
    let mut samples = Vec::with_capacity(runs);
    for i in 0..runs {
        let s = one(&client, &format!("bench-{i}")).await?;
        eprintln!(
            "resources: run {i}: resource Ready {:.0} ms, sandbox Ready {:.0} ms, deleted {:.0} ms",
            s.resource_ready, s.sandbox_ready, s.deleted
        );
        samples.push(s);
    }
    let after = cpu();
    let n = runs.max(1) as f64;
    Ok(Results {
        samples,
        operator_cpu_ms: (after.0 - before.0) / n,
        ics_cpu_ms: (after.1 - before.1) / n,
        apiserver_cpu_ms: (after.2 - before.2) / n,
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
        "# Sandbox resources on a one-node cluster\n\n\
         Date: {date}. Command: `perf/resources.sh` (`cargo bench -p spur-perf --bench \
         resources`). Machine: {cores} cores, Linux {}. Node: tests/node (kubelet, containerd, \
         runc, kube-apiserver with etcd, all on the same {cores} cores), Spur's chart installed \
         with helm, release-build image. A PostgreSQL 15 server (Debian's packages) and a \
         baseline `customer` (`spur demo app` writing to it) in `{NS}`; the plugin \
         `postgres.1.0.0` of docs/examples: two create steps (CREATE DATABASE; CREATE ROLE and \
         the DSN), one delete step, each a pod of `localhost/spur-postgres:dev` with spur-io \
         copied in. Set-up (node, image import, chart, database, baseline): {:.0} s. Load \
         average (1/5/15 min) before: {load_before}; after: {load_after}.\n",
        kernel.trim(),
        setup.as_secs_f64()
    );
    let n = r.samples.len();
    let col = |f: fn(&Sample) -> f64| -> Vec<f64> { r.samples.iter().map(f).collect() };
    let _ = writeln!(
        out,
        "## Create → fork Ready, and deletion\n\n\
         {n} sandboxes (one database resource, one fork reading its DSN), one at a time, after \
         one unmeasured warm-up. Bench clock from the Sandbox's create request, polling every \
         20 ms: the Resource's `Ready` (both create steps done, outputs in the fork namespace's \
         Secret) and the Sandbox's `Ready` (fork Deployment available, routes published). Then \
         from the delete request to the Sandbox gone (fork removed, then the delete step run). \
         Percentiles are nearest-rank.\n\n\
         | | p50 | p90 | max |\n|---|---|---|---|"
    );
    for (what, v) in [
        ("create → Resource Ready", col(|s| s.resource_ready)),
        (
            "create → Sandbox Ready (fork Ready)",
            col(|s| s.sandbox_ready),
        ),
        ("delete → Sandbox gone", col(|s| s.deleted)),
    ] {
        let _ = writeln!(
            out,
            "| {what} | {:.0} ms | {:.0} ms | {:.0} ms |",
            pct(&v, 50.0),
            pct(&v, 90.0),
            pct(&v, 100.0)
        );
    }
    let _ = writeln!(
        out,
        "\nSamples (create → Sandbox Ready, ms): {}\n",
        r.samples
            .iter()
            .map(|s| format!("{:.0}", s.sandbox_ready))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        out,
        "## CPU per sandbox (create and delete)\n\n\
         From /proc, user + system, over the measured runs, divided by their number.\n\n\
         | process | CPU per sandbox |\n|---|---|\n\
         | `spur-operator` | {:.1} ms |\n\
         | `spur-ics serve` | {:.1} ms |\n\
         | kube-apiserver | {:.1} ms |\n",
        r.operator_cpu_ms, r.ics_cpu_ms, r.apiserver_cpu_ms
    );
    out
}
