//! Scale figures on the apiserver tier (issue 47, point 5): N `Sandbox`es (default 1 000) with two
//! forks each in one cluster. Operator memory and CPU per sandbox, the operator's convergence
//! after a restart, route server memory and CPU, and the time until every sidecar watcher holds
//! the full rule table, after the creates and after a route server restart.
//!
//! Setup: kube-apiserver + etcd (tests/kube-harness), the CRDs from charts/spur/crds, two baseline
//! Deployments + Services (every sandbox forks both), a stand-in kubelet that marks fork
//! Deployments ready as soon as they appear (as in `sandbox_latency`), and W `RouteServerSource`
//! watchers (default 10; watcher i watches baseline i mod 2) in this process. The operator and the
//! route server (Kubernetes store) each run in a child process of their own (this binary
//! re-executed with `--role operator|routeserver`), so their CPU time (utime + stime of
//! `/proc/<pid>/stat`) and resident memory (VmRSS) are theirs alone.
//!
//! Phases: (1) idle; (2) N sandboxes created by 16 concurrent clients, until every watcher holds
//! all N rules of its baseline and the operator has settled; (3a) operator restart (SIGTERM, a new
//! process) until the new one has made its first full pass; (3b) the same with every sandbox's
//! spec changed while no operator runs, until every sandbox's status shows the new generation;
//! (4) route server restart until every watcher has resynced from the new one.
//!
//! Run: `cargo bench -p spur-perf --bench sandbox_scale` (`SPUR_BENCH_SANDBOXES`,
//! `SPUR_BENCH_WATCHERS`); writes `perf/results/sandbox_scale.md`. Without `--bench` (as
//! `cargo test --benches` runs it) a smoke run of 5 sandboxes and 2 watchers that writes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod component;
mod passes;
mod phases;
mod report;
mod roles;
mod waits;

use std::time::Duration;

use anyhow::{Result, bail};
use spur_perf::params::env_usize;

const BASELINES: [&str; 2] = ["web-a", "web-b"];
const CLIENTS: usize = 16;
/// The operator has settled once no reconcile pass started or ended for this long.
const QUIET: Duration = Duration::from_secs(2);
const IDLE: Duration = Duration::from_secs(3);
const POLL: Duration = Duration::from_millis(20);
/// How often the operator child reads its own pass counters.
const SCRAPE: Duration = Duration::from_millis(50);
const START_WAIT: Duration = Duration::from_secs(90);
const STOP_WAIT: Duration = Duration::from_secs(30);

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--role") {
        return roles::child_main(&args[i + 1..]);
    }
    let full = args.iter().any(|a| a == "--bench");
    let (n, w) = if full {
        (
            env_usize("SPUR_BENCH_SANDBOXES", 1000),
            env_usize("SPUR_BENCH_WATCHERS", 10),
        )
    } else {
        println!(
            "sandbox_scale: smoke run (pass --bench, as `cargo bench` does, for the full run)"
        );
        (5, 2)
    };
    if n == 0 || w == 0 {
        bail!("SPUR_BENCH_SANDBOXES and SPUR_BENCH_WATCHERS must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(phases::run(n, w, full))
}
