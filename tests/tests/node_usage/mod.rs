//! What Spur's containers used through the node run (issue 47, point 2: requests and limits
//! measured, not guessed). The sampler (`spur_e2e::usage`) read every container's cgroup from
//! the start of the run (the previous release's install, the upgrade under load, chaos, the CA
//! rotation, the HA steps) to here. Checked:
//!
//! - every component of the chart and the injected sidecars were seen (the sampler works);
//! - no container was killed for memory;
//! - every container's peak working set stayed under [`HEADROOM`] of its memory limit, and
//!   within its memory request (a pod over its request is among the first evicted when the
//!   node runs short: a request below what the component uses is a guess, not a measurement).
//!
//! The table is printed, and written to `$SPUR_USAGE_OUT` when set (perf/results/
//! requests-limits.md is made from it).

use spur_e2e::node::SPUR_NAMESPACE;
use spur_e2e::usage::{Figures, Report};

/// The share of its memory limit a container may reach in this run. A component at more than
/// this under the suite's modest load is one burst away from an OOM kill in a real cluster.
const HEADROOM: f64 = 0.75;
/// Components the run must have seen (their `app.kubernetes.io/name`).
const EXPECTED: &[&str] = &[
    "spur-operator",
    "spur-routeserver",
    "spur-tunnel-proxy",
    "spur-traffic",
    "spur-ics",
    "spur-jobs",
    "spur-hub",
    "spur-agent",
];
const SIDECAR: &str = "spur-sidecar";
const MIB: f64 = 1048576.0;

pub(crate) fn within_limits(report: Report) {
    let rows = report.select(SPUR_NAMESPACE, SIDECAR);
    let table = Report::table(&rows);
    eprintln!(
        "usage: {} samples over {:.0} s\n{table}",
        report.samples,
        report.duration.as_secs_f64()
    );
    match report.least_disk_free {
        Some(least) => eprintln!(
            "usage: the node's disk had {:.1} GiB free at the least ({:.1} GiB to root), {:.0} s into the run",
            least.available as f64 / (1024.0 * MIB),
            least.free_to_root as f64 / (1024.0 * MIB),
            least.at.as_secs_f64()
        ),
        None => eprintln!("usage: the node's disk could not be read"),
    }
    if let Some(out) = std::env::var_os("SPUR_USAGE_OUT") {
        std::fs::write(&out, &table).unwrap();
    }
    for app in EXPECTED {
        assert!(
            rows.iter()
                .any(|(c, f)| c.namespace == SPUR_NAMESPACE && c.app == *app && f.instances > 0),
            "no container of {app} was sampled:\n{table}"
        );
    }
    assert!(
        rows.iter()
            .any(|(c, f)| c.container == SIDECAR && f.instances > 0),
        "no injected sidecar was sampled:\n{table}"
    );
    let killed: Vec<_> = rows
        .iter()
        .filter(|(_, f)| f.oom_killed > 0)
        .map(|(c, f)| {
            format!(
                "{}/{} {}: {}",
                c.namespace, c.app, c.container, f.oom_killed
            )
        })
        .collect();
    assert!(killed.is_empty(), "killed for memory: {killed:?}\n{table}");
    // Containers whose peak working set is over `bound(figures)`, said as `what`.
    let over = |what: &str, bound: &dyn Fn(&Figures) -> Option<f64>| -> Vec<String> {
        rows.iter()
            .filter_map(|(c, f)| {
                let bound = bound(f)?;
                let peak = f.peak_working_set as f64;
                (peak > bound).then(|| {
                    format!(
                        "{}/{} {}: {:.1} MiB, {what} {:.1} MiB",
                        c.namespace,
                        c.app,
                        c.container,
                        peak / MIB,
                        bound / MIB
                    )
                })
            })
            .collect()
    };
    let near = over(&format!("{:.0} % of the limit", HEADROOM * 100.0), &|f| {
        Some(HEADROOM * f.resources.memory_limit? as f64)
    });
    assert!(
        near.is_empty(),
        "too near the memory limit: {near:?}\n{table}"
    );
    let over_request = over("requests", &|f| Some(f.resources.memory_request? as f64));
    assert!(
        over_request.is_empty(),
        "used more memory than requested: {over_request:?}\n{table}"
    );
}
