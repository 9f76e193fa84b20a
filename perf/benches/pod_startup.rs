//! Pod start-up on a real one-node cluster (tests/node): create → Ready without sidecar injection,
//! with the default injection and with the init-container layout, and the sidecar's memory
//! inside its pod.
//!
//! Setup: the node of `spur_e2e::node::node()` (`SPUR_NODE_ENV`, or one started for this process),
//! Spur's chart installed with helm (the values of tests/tests/node.rs), two namespaces: one
//! labelled `sidecar.spur.dev/inject=true`, one not.
//!
//! - Start-up: `SPUR_BENCH_PODS` (default 30) 1-replica Deployments per mode, created one at a
//!   time, modes interleaved: `plain` (not injected), `injected` (the defaults: the sidecar
//!   programs the rules and is the first app container) and `init+native` (pod annotations
//!   `interception: initContainer`, `placement: native`). Each is timed from the create request
//!   to the moment a watch on the namespace's pods shows the pod's `Ready` condition `True`
//!   (the bench's own clock, milliseconds; Kubernetes' timestamps are whole seconds), then
//!   deleted, and the next one starts once its pod is gone and a further 0–950 ms (in 50 ms
//!   steps, a different one for each pod of a mode) have passed: the kubelet relists pods once
//!   a second, and a create that always followed a deletion's relist by the same few
//!   milliseconds would measure one phase of that cycle only. The app container (`spur demo
//!   app`) has no readiness probe in any mode: the pod is Ready when its containers run (and
//!   the sidecar's postStart hook has seen it listening). So the differences are what injection
//!   costs (webhook, rules, the sidecar starting before the app), not an app probe's period.
//!   One unmeasured warm-up pod per mode comes first.
//! - Memory: `SPUR_BENCH_MEM_PODS` (default 3) more injected pods; the `spur-sidecar`
//!   container's cgroup (v1) memory and the sidecar process's VmRSS, read from the host, idle
//!   (5 s after Ready) and after 2 000 requests sent through it (inbound, from a client pod to the
//!   pod's IP, 20 curl runs of 100 keep-alive requests).
//!
//! Writes `perf/results/node.md`. Run with `perf/node.sh` (root; release binaries and image, its
//! own node). Without `--bench` (as `cargo test --benches` runs it) it does nothing: it needs a
//! node.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::watcher::Event;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use spur_e2e::node::{CHART_VALUES, Node, SPUR_IMAGE, SPUR_NAMESPACE, node};
use spur_perf::params::env_usize;

const RELEASE: &str = "spur";
const SIDECAR: &str = "spur-sidecar";
const INJECT_LABEL: (&str, &str) = ("sidecar.spur.dev/inject", "true");
const READY_WAIT: Duration = Duration::from_secs(180);
const GONE_WAIT: Duration = Duration::from_secs(120);
const LOAD_RUNS: usize = 20;
const LOAD_PER_RUN: usize = 100;

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() -> Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!("pod_startup: needs a one-node cluster (root); run perf/node.sh. Skipped.");
        return Ok(());
    }
    let pods = env_usize("SPUR_BENCH_PODS", 30);
    let mem_pods = env_usize("SPUR_BENCH_MEM_PODS", 3);
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
    eprintln!("pod_startup: node and chart ready in {setup:.1?}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(run(node, pods, mem_pods))?;
    let report = report(&result, pods, setup, &load_before, &loadavg());
    println!("{report}");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/node.md");
    std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("pod_startup: wrote {}", path.display());
    Ok(())
}

/// What a measured pod gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Plain,
    /// Injected with the defaults.
    Injected,
    /// Injected with `interception: initContainer` and `placement: native`.
    InitNative,
}

const MODES: [Mode; 3] = [Mode::Plain, Mode::Injected, Mode::InitNative];

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Plain => "plain",
            Mode::Injected => "injected",
            Mode::InitNative => "init+native",
        }
    }

    fn annotations(self) -> serde_json::Value {
        match self {
            Mode::InitNative => json!({
                "sidecar.spur.dev/interception": "initContainer",
                "sidecar.spur.dev/placement": "native",
            }),
            Mode::Plain | Mode::Injected => json!({}),
        }
    }
}

struct Results {
    startup: Vec<(Mode, Vec<f64>)>,
    memory: Vec<(Mem, Mem, usize)>,
}

async fn run(node: &'static Node, pods: usize, mem_pods: usize) -> Result<Results> {
    let client = node.client().await?;
    let inject_ns = node.namespace("podstart-inject", &[INJECT_LABEL])?;
    let plain_ns = node.namespace("podstart-plain", &[])?;
    let mut res = Results {
        startup: MODES.iter().map(|m| (*m, Vec::new())).collect(),
        memory: Vec::new(),
    };
    // Warm-up (not counted), then the measured pods, modes interleaved.
    for i in 0..=pods {
        for (m, mode) in MODES.into_iter().enumerate() {
            let ns = match mode {
                Mode::Plain => &plain_ns.name,
                Mode::Injected | Mode::InitNative => &inject_ns.name,
            };
            // A different phase of the kubelet's 1 s relist for each pod (see the module docs).
            let offset = ((i * 7 + m * 3) % 20) as u64 * 50;
            tokio::time::sleep(Duration::from_millis(offset)).await;
            let name = format!("p{i}-{}", m);
            let (took, pod) = start_pod(&client, ns, &name, mode).await?;
            check_injection(&pod, mode)?;
            delete_deployment(&client, ns, &name).await?;
            let ms = took.as_secs_f64() * 1e3;
            eprintln!(
                "pod_startup: {} {name}: {ms:.0} ms{}",
                mode.name(),
                if i == 0 { " (warm-up)" } else { "" }
            );
            if i > 0 {
                res.startup[m].1.push(ms);
            }
        }
    }

    // The sidecar's memory, idle and after load.
    let ns = inject_ns.name.as_str();
    let client_pod = node.client_pod(ns)?;
    for i in 0..mem_pods {
        let name = format!("mem{i}");
        let (_, pod) = start_pod(&client, ns, &name, Mode::Injected).await?;
        check_injection(&pod, Mode::Injected)?;
        tokio::time::sleep(Duration::from_secs(5)).await;
        let idle = container_memory(node, &pod, SIDECAR)?;
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .ok_or_else(|| anyhow!("pod of {name} has no IP"))?;
        // URL globbing: LOAD_PER_RUN requests on one keep-alive connection per curl run.
        let script = format!(
            "for i in $(seq {LOAD_RUNS}); do curl -sS --max-time 60 -o /dev/null \
             -w '%{{http_code}}\\n' 'http://{ip}:8080/?n=[1-{LOAD_PER_RUN}]'; done"
        );
        let out = node.kubectl(&["-n", ns, "exec", &client_pod, "--", "sh", "-c", &script])?;
        let ok = out.lines().filter(|l| l.trim() == "200").count();
        if ok != LOAD_RUNS * LOAD_PER_RUN {
            bail!("{ok} of {} requests answered 200", LOAD_RUNS * LOAD_PER_RUN);
        }
        let loaded = container_memory(node, &pod, SIDECAR)?;
        eprintln!(
            "pod_startup: {name}: idle {:.1} MiB working set, after {ok} requests {:.1} MiB",
            idle.working_set_mib(),
            loaded.working_set_mib()
        );
        res.memory.push((idle, loaded, ok));
        delete_deployment(&client, ns, &name).await?;
    }
    Ok(res)
}

fn deployment(ns: &str, name: &str, mode: Mode) -> Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}, "annotations": mode.annotations()},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "app",
                        "image": SPUR_IMAGE,
                        "imagePullPolicy": "IfNotPresent",
                        "args": ["demo", "app", format!("--name={name}"), "--listen=0.0.0.0:8080"],
                        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                        "ports": [{"name": "http", "containerPort": 8080}],
                    }],
                },
            },
        },
    }))?)
}

fn is_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Creates the Deployment `name` and returns the time from the create request to its pod
/// observed Ready (through a watch started, and synced, before the request), and that pod.
async fn start_pod(client: &Client, ns: &str, name: &str, mode: Mode) -> Result<(Duration, Pod)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let config = watcher::Config::default().labels(&format!("app={name}"));
    let mut events = watcher(pods, config).default_backoff().boxed();
    let deadline = tokio::time::Instant::now() + READY_WAIT;
    loop {
        match tokio::time::timeout_at(deadline, events.try_next()).await {
            Ok(Ok(Some(Event::InitDone))) => break,
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => bail!("the watch on {ns} ended"),
            Ok(Err(e)) => eprintln!("pod_startup: watch error (retried): {e}"),
            Err(_) => bail!("the watch on {ns} did not sync"),
        }
    }
    let t0 = Instant::now();
    deployments
        .create(&PostParams::default(), &deployment(ns, name, mode)?)
        .await?;
    loop {
        match tokio::time::timeout_at(deadline, events.try_next()).await {
            Ok(Ok(Some(Event::Apply(p) | Event::InitApply(p)))) if is_ready(&p) => {
                return Ok((t0.elapsed(), p));
            }
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => bail!("the watch on {ns} ended"),
            Ok(Err(e)) => eprintln!("pod_startup: watch error (retried): {e}"),
            Err(_) => bail!("{ns}/{name}: no Ready pod after {READY_WAIT:?}"),
        }
    }
}

/// Deletes the Deployment and waits (bounded) until none of its pods is left.
async fn delete_deployment(client: &Client, ns: &str, name: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    deployments
        .delete(name, &DeleteParams::background())
        .await?;
    let deadline = Instant::now() + GONE_WAIT;
    let selector = kube::api::ListParams::default().labels(&format!("app={name}"));
    loop {
        if pods.list(&selector).await?.items.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{ns}/{name}: pods still there {GONE_WAIT:?} after the delete");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The pod has the containers `mode` promises: the measurement is of what it claims.
fn check_injection(pod: &Pod, mode: Mode) -> Result<()> {
    let names = |cs: Option<&Vec<k8s_openapi::api::core::v1::Container>>| -> Vec<String> {
        cs.into_iter().flatten().map(|c| c.name.clone()).collect()
    };
    let spec = pod.spec.as_ref();
    let inits = names(spec.and_then(|s| s.init_containers.as_ref()));
    let containers = names(spec.map(|s| &s.containers));
    let expected: (&[&str], &[&str]) = match mode {
        Mode::Plain => (&[], &["app"]),
        Mode::Injected => (&[], &[SIDECAR, "app"]),
        Mode::InitNative => (&["spur-init", SIDECAR], &["app"]),
    };
    if inits != expected.0 || containers != expected.1 {
        bail!(
            "pod {} ({}) has init containers {inits:?} and containers {containers:?}, expected \
             {expected:?}; annotations {:?}",
            pod.name_any(),
            mode.name(),
            pod.annotations()
        );
    }
    Ok(())
}

/// A container's memory from the host: its cgroup (v1) and its main process.
#[derive(Clone, Copy)]
struct Mem {
    usage: u64,
    inactive_file: u64,
    rss: u64,
    vm_rss: u64,
}

impl Mem {
    /// kubelet's working set: usage minus inactive file pages.
    fn working_set_mib(&self) -> f64 {
        self.usage.saturating_sub(self.inactive_file) as f64 / 1048576.0
    }
}

fn container_memory(node: &Node, pod: &Pod, container: &str) -> Result<Mem> {
    let status = pod
        .status
        .as_ref()
        .ok_or_else(|| anyhow!("no pod status"))?;
    let id = status
        .init_container_statuses
        .iter()
        .chain(status.container_statuses.iter())
        .flatten()
        .find(|s| s.name == container)
        .and_then(|s| s.container_id.as_deref())
        .ok_or_else(|| anyhow!("pod {} has no container {container}", pod.name_any()))?;
    let pid = node.task_pid(id)?;
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let path = cgroups
        .lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
            ctrl.split(',').any(|c| c == "memory").then_some(path)
        })
        .ok_or_else(|| anyhow!("no memory cgroup (v1) for pid {pid}:\n{cgroups}"))?;
    let dir = Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f)).with_context(|| format!("{}/{f}", dir.display()))
    };
    let usage = read("memory.usage_in_bytes")?.trim().parse()?;
    let stat = read("memory.stat")?;
    let stat_of = |key: &str| {
        stat.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0u64)
    };
    let vm_rss = std::fs::read_to_string(format!("/proc/{pid}/status"))?
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kb| kb * 1024);
    Ok(Mem {
        usage,
        inactive_file: stat_of("total_inactive_file"),
        rss: stat_of("total_rss"),
        vm_rss,
    })
}

/// Nearest-rank percentile of sorted values.
fn pct(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn report(
    r: &Results,
    pods: usize,
    setup: Duration,
    load_before: &str,
    load_after: &str,
) -> String {
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
        "# Pod start-up and sidecar memory on a one-node cluster\n\n\
         Date: {date}. Command: `perf/node.sh` (`cargo bench -p spur-perf --bench pod_startup`). \
         Machine: {cores} cores, Linux {}. Node: tests/node (kubelet, containerd 1.6, runc, \
         kube-apiserver v1.33.13 with etcd, all on the same {cores} cores), Spur's chart \
         installed with helm, release-build image. Set-up (node, image import, chart): {:.0} s. \
         Load average (1/5/15 min) before: {load_before}; after: {load_after}.\n",
        kernel.trim(),
        setup.as_secs_f64()
    );
    if let Ok(images) = std::env::var("SPUR_BENCH_IMAGES") {
        let _ = writeln!(
            out,
            "Images (tests/node/image.sh; compressed = the OCI archive's gzip layers + config, \
             uncompressed = buildah's size):\n"
        );
        for l in images.lines().filter(|l| !l.trim().is_empty()) {
            let f: Vec<&str> = l.split_whitespace().collect();
            let sizes = f.get(2..).map(|s| s.join(" ")).unwrap_or_default();
            let _ = writeln!(out, "- `{}`: {sizes}", f.first().unwrap_or(&""));
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(
        out,
        "## Start-up: Deployment create → pod Ready\n\n\
         {pods} 1-replica Deployments per mode (after one unmeasured warm-up each), created one \
         at a time, modes interleaved; each timed from the create request to the watch event \
         showing the pod Ready (bench clock, ms), then deleted and gone, and the next created \
         after a further 0–950 ms offset (a different phase of the kubelet's 1 s relist for \
         each pod). Modes: `plain` (not injected); `injected` (the defaults: the sidecar \
         programs the interception rules, drops root and is the first app container; the app \
         starts once its postStart hook has seen it listening); `init+native` (pod annotations \
         `sidecar.spur.dev/interception: initContainer`, `sidecar.spur.dev/placement: native`: \
         spur-init, then a native sidecar, then the app). The app (`spur demo app`) has no \
         readiness probe in any mode, the sidecar no startup or readiness probe. Percentiles are \
         nearest-rank: with {pods} samples p99 is the maximum.\n\n\
         With the create's phase spread evenly over the relist cycle, the mean shifts by what a \
         mode adds to the work before the relist that sees the pod Ready; single samples and \
         percentiles are quantized by it.\n\n\
         | Mode | Pods | mean | p50 | p90 | p99 | max | mean − plain | p50 − plain |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    let mut plain = (0.0, 0.0);
    for (mode, v) in &r.startup {
        let mut s = v.clone();
        s.sort_by(f64::total_cmp);
        let mean = s.iter().sum::<f64>() / s.len().max(1) as f64;
        let (p50, p90, p99) = (pct(&s, 0.5), pct(&s, 0.9), pct(&s, 0.99));
        let max = s.last().copied().unwrap_or(0.0);
        if *mode == Mode::Plain {
            plain = (mean, p50);
        }
        let _ = writeln!(
            out,
            "| {} | {} | {mean:.0} ms | {p50:.0} ms | {p90:.0} ms | {p99:.0} ms | {max:.0} ms | {:+.0} ms | {:+.0} ms |",
            mode.name(),
            s.len(),
            mean - plain.0,
            p50 - plain.1,
        );
    }
    let _ = writeln!(
        out,
        "\nGoal: injection adds ≤ 200 ms.\n\nSamples in order (ms):\n"
    );
    for (mode, v) in &r.startup {
        let _ = writeln!(
            out,
            "- {}: {}",
            mode.name(),
            v.iter()
                .map(|v| format!("{v:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "## Sidecar memory (`spur-sidecar` container)\n\n\
         Read from the host: the container's memory cgroup (v1; working set = \
         `memory.usage_in_bytes` − `total_inactive_file`, as the kubelet computes it; RSS = \
         `total_rss` of `memory.stat`) and the `spur-sidecar` process's VmRSS. Idle: 5 s after the \
         pod is Ready. Loaded: after {} requests from a client pod to the pod's IP (inbound through \
         the sidecar; {LOAD_RUNS} curl runs of {LOAD_PER_RUN} keep-alive requests). The chart's \
         sidecar limit is 128 MiB.\n\n\
         | Pod | Idle: working set / cgroup RSS / VmRSS | After load: working set / cgroup RSS / VmRSS |\n|---|---|---|",
        LOAD_RUNS * LOAD_PER_RUN
    );
    let mib = |b: u64| b as f64 / 1048576.0;
    for (i, (idle, loaded, _)) in r.memory.iter().enumerate() {
        let _ = writeln!(
            out,
            "| mem{i} | {:.1} / {:.1} / {:.1} MiB | {:.1} / {:.1} / {:.1} MiB |",
            idle.working_set_mib(),
            mib(idle.rss),
            mib(idle.vm_rss),
            loaded.working_set_mib(),
            mib(loaded.rss),
            mib(loaded.vm_rss)
        );
    }
    out
}
