//! The report: rows printed as they come, and the markdown written at the end.

use std::fmt::Write as _;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Result;
use spur_perf::bench::proc::clk_tck;

/// Rows of the report, printed as they come.
#[derive(Default)]
pub(crate) struct Report(Vec<[String; 3]>);

impl Report {
    pub(crate) fn row(&mut self, phase: &str, what: &str, value: String) {
        println!("[{phase}] {what}: {value}");
        self.0.push([phase.into(), what.into(), value]);
    }
}

pub(crate) fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

pub(crate) fn since(a: Instant, b: Instant) -> String {
    secs(b.saturating_duration_since(a))
}

fn command_output(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "?".into())
}

pub(crate) fn render(
    report: &Report,
    n: usize,
    w: usize,
    version: &str,
    setup: Duration,
) -> Result<String> {
    let commit = command_output("git", &["rev-parse", "--short", "HEAD"]);
    let dirty = !command_output("git", &["status", "--porcelain"]).is_empty();
    let mut out = String::new();
    writeln!(
        out,
        "# Scale: {n} sandboxes with 2 forks each, one cluster (apiserver tier)\n"
    )?;
    writeln!(
        out,
        "Command: `cargo bench -p spur-perf --bench sandbox_scale`. Commit {commit}{}. Machine: {} cores, kernel {}. \
         kube-apiserver {version} + etcd from tests/kube on the same machine. \
         {n} sandboxes (`SPUR_BENCH_SANDBOXES`), each forking two baseline Deployments; {w} watchers (`SPUR_BENCH_WATCHERS`), \
         half on each baseline. Set-up (API server, CRDs, children started, watchers connected): {:.1} s. \
         CPU is utime + stime from `/proc/<pid>/stat` ({} ticks/s), memory VmRSS from `/proc/<pid>/status`.\n",
        if dirty {
            " (with uncommitted changes)"
        } else {
            ""
        },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_or_else(|_| "?".into(), |s| s.trim().to_string()),
        setup.as_secs_f64(),
        clk_tck()
    )?;
    writeln!(out, "| Phase | Measurement | Result |\n|---|---|---|")?;
    for [phase, what, value] in &report.0 {
        writeln!(out, "| {phase} | {what} | {value} |")?;
    }
    out.push_str(METHOD);
    Ok(out)
}

const METHOD: &str = "
## How each figure is taken

- **Processes.** The operator (`spur_operator::run`, all controllers, no leader election, as in
  `sandbox_latency`) and the route server (`RouteServer` with `KubeStore`, plaintext gRPC on
  loopback) each run in a process of their own: the bench binary re-executed with `--role`. The
  API server, etcd, the stand-in kubelet (marks every fork Deployment ready as soon as it
  appears), the creating clients and the watchers (`RouteServerSource`, each with its own table
  and connection; watcher i watches baseline i mod 2) are elsewhere, so each child's CPU and
  memory are its own. API server and etcd share the machine's cores with everything else.
- **Operator passes.** The operator child reads its own `reconciles_total` (passes started) and
  `reconcile_duration_seconds_count` (passes ended) every 50 ms and prints them when they
  change, and at least once a second. The time those reads take is measured in the child and
  taken off every operator CPU figure here.
  *Settled* = at least one ended pass per object the sandboxes make (N Sandboxes, 2N
  ForkedWorkloads, N RoutingConfigs), no pass running, and none started or ended for 2 s; the
  time reported is when the last pass ended (the 2 s of waiting are not counted), while CPU and
  memory are read after the 2 s (that window's idle CPU is included; phase 1 shows its size).
- **1 idle.** After start-up (watchers connected, operator settled), no sandbox: memory, and
  CPU over 3 s.
- **2 create.** N sandboxes created by 16 concurrent clients. *Full table*: polled every 20 ms, a
  watcher holds a rule for every sandbox's routing key on its baseline. *Ready*: a watch on the
  Sandboxes sees every one with `status.observedGeneration` = `metadata.generation` and
  condition Ready=True. CPU per sandbox: from the first create to *settled*, divided by N.
  Memory per sandbox: resident memory growth over idle divided by N (allocator caching
  included).
- **3a operator restart.** SIGTERM to the operator (it stops its controllers, letting passes in
  flight finish), then a new process. A restart that finds everything converged writes nothing,
  so no object shows that it was looked at: the figure is the new process's own count, time
  from its start until it has *settled* (its first full pass: every Sandbox, ForkedWorkload and
  RoutingConfig of its initial lists reconciled at least once, and its queue empty). Pass counts
  do not name objects: a sandbox passed twice while another waits would also count, which the
  requirement of an empty queue for 2 s rules out only in practice. Afterwards every sandbox is
  checked to be still Ready at its generation.
- **3b restart + change.** The same restart, but with `spec.description` of every sandbox changed
  (merge patch, 16 clients) while no operator runs, so every generation is new: the time until
  every sandbox's status shows its new generation and Ready is a per-object proof that the new
  operator reached each. This pass does more than 3a's (each sandbox is checked against its
  baselines again and its status written), so it bounds a plain restart from above.
- **4 route server restart.** SIGTERM to the route server; once every watcher has seen its
  stream end (`routeserver_connected` 0; they keep their last table meanwhile), a new one on the
  same port. *Serving*: the new process printed its address, after `KubeStore`'s first
  complete rule set. *Resynced*: a watcher is connected again (`routeserver_connected` 1: past
  the new stream's SYNCED, table rebuilt from it and published) and holds every rule. The
  watchers reconnect with their own jittered exponential backoff (100 ms doubling, up to
  10 s), which is part of the figure, as it is for a real sidecar.
";
