//! The markdown report.

use std::fmt::Write as _;

use super::load::Latency;
use super::peers::PeerKind;
use super::{Cell, Proto, Results, RunKind, RunResult, Scenario, thousands};

mod tables;

use tables::{cpu, cross_check, failures, latency, memory, throughput};

/// Percentiles of the latency tables: (label, accessor).
type Pick = fn(&Latency) -> f64;
const PCTS: [(&str, Pick); 5] = [
    ("p50", |l| l.p50),
    ("p90", |l| l.p90),
    ("p99", |l| l.p99),
    ("p99.9", |l| l.p999),
    ("max", |l| l.max),
];

fn us(v: f64) -> String {
    if v.is_nan() {
        return "–".into();
    }
    if v.abs() >= 10_000.0 {
        format!("{} ms", fmt_f(v / 1000.0, 1))
    } else {
        format!("{}", v.round() as i64)
    }
}

fn signed_us(v: f64) -> String {
    let s = us(v.abs());
    if v.round() < 0.0 {
        format!("−{s}")
    } else {
        format!("+{s}")
    }
}

fn fmt_f(v: f64, decimals: usize) -> String {
    format!("{v:.decimals$}")
}

fn rps(v: f64) -> String {
    thousands(v.round().max(0.0) as u64)
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".into(),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".into(), |x| format!("{:.0} %", 100.0 * x))
}

/// (proxy core share, client core share) of a run: CPU seconds / interval.
fn core_shares(run: &RunResult) -> (Option<f64>, Option<f64>) {
    if run.interval_s <= 0.0 {
        return (None, None);
    }
    let px = run.proxy_cpu_s.map(|c| c / run.interval_s);
    let cl = match (run.upstream_cpu_s, run.loadgen_cpu_s) {
        (Some(u), Some(l)) => Some((u + l) / run.interval_s),
        _ => None,
    };
    (px, cl)
}

/// Why an open-loop run's latencies describe an overloaded system rather than the peer at that
/// rate, if they do: late requests, or a median far above the same peer's at the lowest rate.
pub fn overload(run: &RunResult, baseline_p50: Option<f64>) -> Option<String> {
    let l = run.load.as_ref()?;
    if matches!(run.kind, RunKind::Saturation) {
        return None;
    }
    let (px, cl) = core_shares(run);
    let mut why = Vec::new();
    if l.late.unwrap_or(0) > 0 {
        why.push(format!("{} late", l.late.unwrap_or(0)));
    }
    if let Some(b) = baseline_p50
        && l.latency_us.p50 > 10.0 * b.max(100.0)
    {
        why.push("queueing".to_string());
    }
    if why.is_empty() {
        return None;
    }
    if cl.is_some_and(|c| c >= 0.9) {
        why.push("client core saturated".into());
    }
    if px.is_some_and(|c| c >= 0.9) {
        why.push("proxy core saturated".into());
    }
    Some(why.join(", "))
}

/// Saturation rps of a peer in a scenario.
fn sat(r: &Results, p: PeerKind, s: Scenario) -> Option<f64> {
    r.cell(p, s).and_then(Cell::saturation).map(|l| l.rps)
}

/// Latency summary of the open-loop run at `rate` (None if missing or failed).
fn lat_at(r: &Results, p: PeerKind, s: Scenario, rate: u64) -> Option<Latency> {
    r.cell(p, s)
        .and_then(|c| c.at_rate(rate))
        .filter(|run| run.error.is_none())
        .and_then(|run| run.load.as_ref())
        .map(|l| l.latency_us.clone())
}

fn cpu_per_10k(run: &RunResult) -> Option<f64> {
    let cpu = run.proxy_cpu_s?;
    let load = run.load.as_ref()?;
    // Requests in the CPU interval: rps over the measured duration × interval length.
    let reqs = load.rps * run.interval_s;
    (reqs > 0.0).then(|| cpu / reqs * 10_000.0)
}

/// The whole report.
pub fn render(r: &Results, plots: &[(String, String)]) -> String {
    let mut o = String::new();
    let m = &r.meta;
    let s = &r.settings;
    let _ = writeln!(o, "# Spur side-by-side benchmark, {}\n", m.date);
    if s.quick {
        let _ = writeln!(
            o,
            "> **Quick run** (smoke test: short runs, fewer scenarios). Do not quote these numbers; use a default run.\n"
        );
    }
    let _ = writeln!(o, "| | |\n|---|---|");
    let _ = writeln!(o, "| Command | `{}` |", m.command);
    let _ = writeln!(
        o,
        "| Started | {} (took {:.1} min) |",
        m.started,
        m.elapsed_s / 60.0
    );
    let _ = writeln!(
        o,
        "| Machine | `nproc` = {}, {}, Linux {} |",
        m.nproc, m.cpu_model, m.kernel
    );
    let pin = if s.pinned {
        format!(
            "proxy under test on core {} (`taskset -c {}`); upstream and load generator on core {}",
            s.proxy_core.unwrap_or(1),
            s.proxy_core.unwrap_or(1),
            s.client_core.unwrap_or(0)
        )
    } else {
        "**not pinned** (fewer than 2 CPUs, or --no-pin): all processes share the CPUs".into()
    };
    let _ = writeln!(o, "| Pinning | {pin} |");
    let _ = writeln!(o, "| spur | `spur-sidecar` at git {} |", m.spur_rev);
    let _ = writeln!(o, "| nginx | {} |", m.nginx_version);
    let _ = writeln!(o, "| HAProxy | {} |", m.haproxy_version);
    let _ = writeln!(o, "| Cross-check tool | {} |", m.external_tool);
    let _ = writeln!(
        o,
        "| Load | `spur-load`, {} thread(s); h1: {} connections; h2c/gRPC: {} connections × {} streams; each run {} s after {} s warm-up |",
        s.loadgen_threads,
        s.h1_connections,
        s.h2_connections,
        s.h2_streams,
        s.duration_s,
        s.warmup_s
    );
    let _ = writeln!(
        o,
        "| Runs per peer and scenario | fresh peer process; verification request; open loop at {} rps; closed-loop saturation; open loop at {} % of that peer's saturation rate |",
        s.rates
            .iter()
            .map(|r| thousands(*r))
            .collect::<Vec<_>>()
            .join(" / "),
        s.max_pct
    );
    let others: Vec<(f64, String)> = r
        .cells
        .iter()
        .flat_map(|c| {
            c.runs.iter().filter_map(move |run| {
                let o = run.other_cpu_s? / run.interval_s.max(1e-9);
                Some((
                    o,
                    format!(
                        "{} / {} / {}",
                        c.peer.name(),
                        c.scenario.id(),
                        run.kind.label()
                    ),
                ))
            })
        })
        .collect();
    if !others.is_empty() {
        let mean = others.iter().map(|x| x.0).sum::<f64>() / others.len() as f64;
        let worst = others
            .iter()
            .max_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
        let busy = others.iter().filter(|x| x.0 > 0.05).count();
        let steal: f64 = r
            .cells
            .iter()
            .flat_map(|c| c.runs.iter().filter_map(|x| x.steal_s))
            .sum();
        let _ = writeln!(
            o,
            "| Other load | CPU used by other processes during the measured intervals: mean {:.1} % of a core, max {:.1} % ({}); {} of {} runs above 5 %; hypervisor steal {:.2} s in total |",
            mean * 100.0,
            worst.map_or(0.0, |w| w.0 * 100.0),
            worst.map_or("–", |w| w.1.as_str()),
            busy,
            others.len(),
            steal
        );
    }
    if s.quiet_budget_s > 0.0 {
        let waited: f64 = r
            .cells
            .iter()
            .flat_map(|c| c.runs.iter().map(|x| x.quiet_wait_s))
            .sum();
        let busy = r
            .cells
            .iter()
            .flat_map(|c| c.runs.iter())
            .filter(|x| x.busy_before.is_some_and(|b| b > s.quiet_threshold))
            .count();
        let _ = writeln!(
            o,
            "| Quiet-machine wait | before each run, up to {:.0} s (budget {:.0} s in all) until other processes used ≤ {:.0} % of a core; waited {:.0} s in all; {} run(s) started on a busier machine |",
            s.quiet_wait_s,
            s.quiet_budget_s,
            s.quiet_threshold * 100.0,
            waited,
            busy
        );
    }
    let repeated: u32 = r
        .cells
        .iter()
        .flat_map(|c| c.runs.iter().map(|x| x.attempts.saturating_sub(1)))
        .sum();
    if s.retries > 0 {
        let _ = writeln!(
            o,
            "| Disturbed runs | repeated up to {} times (at most {} repetitions in all) when other processes used more than {:.0} % of a core; {} repetition(s) made, the least disturbed attempt is reported |",
            s.retries,
            s.retry_budget,
            s.quiet_threshold * 100.0,
            repeated
        );
    }
    for n in &m.notes {
        let _ = writeln!(o, "| Note | {n} |");
    }
    o.push('\n');
    let _ = writeln!(
        o,
        "Peers: **direct** = load generator straight to the upstream (no proxy); **spur** = `spur-sidecar`, requests without a routing key (→ app listener); **spur-keyed** = `spur-sidecar`, requests with `baggage: sd-routing-key=k1` (→ the second, \"sandbox\" listener of the same upstream process); **nginx**, **haproxy** = reverse proxies to the app listener (configs: `perf/configs/`). Latencies in µs unless marked ms. Method: `perf/README.md`, section \"Side-by-side\".\n"
    );

    headline(&mut o, r);
    goals(&mut o, r);
    throughput(&mut o, r);
    latency(&mut o, r);
    cpu(&mut o, r);
    memory(&mut o, r);
    cross_check(&mut o, r);
    failures(&mut o, r);

    if !plots.is_empty() {
        let _ = writeln!(o, "## Plots\n");
        for (title, file) in plots {
            let _ = writeln!(o, "**{title}**\n\n![{title}]({file})\n");
        }
    }
    o
}

/// " ⚠ disturbed: …" when other processes used more than the threshold during any of `runs`.
fn disturbed(r: &Results, sc: Scenario, runs: &[(PeerKind, RunKind)]) -> String {
    let limit = r.settings.quiet_threshold.max(0.0);
    let mut bad = Vec::new();
    for &(p, kind) in runs {
        if let Some(run) = r.cell(p, sc).and_then(|c| c.run(|k| *k == kind)) {
            let d = super::runner::disturbance(run);
            if d > limit {
                bad.push(format!("{} {:.0} %", p.name(), d * 100.0));
            }
        }
    }
    if bad.is_empty() {
        String::new()
    } else {
        format!(
            " ⚠ disturbed (other processes, share of a core: {})",
            bad.join(", ")
        )
    }
}

/// Proxy CPU-µs per request of one run (user + system time of the peer's processes over the
/// measured interval, divided by the requests completed in it).
fn cpu_us(run: &RunResult) -> Option<f64> {
    cpu_per_10k(run).map(|v| v * 100.0)
}

/// CPU-µs per request of `p` in the open-loop run at `rate`.
fn cpu_at(r: &Results, p: PeerKind, s: Scenario, rate: u64) -> Option<f64> {
    r.cell(p, s)
        .and_then(|c| c.at_rate(rate))
        .filter(|run| run.error.is_none())
        .and_then(cpu_us)
}

/// The cheaper of nginx and HAProxy at `rate`, with its name.
fn best_peer_cpu(r: &Results, s: Scenario, rate: u64) -> Option<(PeerKind, f64)> {
    [PeerKind::Nginx, PeerKind::Haproxy]
        .into_iter()
        .filter_map(|p| cpu_at(r, p, s, rate).map(|v| (p, v)))
        .min_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal))
}

/// The headline (issue 20): what one request costs in the proxy, at fixed open-loop rates that
/// leave the load generator's core unsaturated, for every peer in the same run.
pub fn headline(o: &mut String, r: &Results) {
    let _ = writeln!(
        o,
        "## Proxy CPU per request (µs) at fixed rates
"
    );
    let _ = writeln!(
        o,
        "The headline: user + system CPU time of the peer's processes (`/proc/<pid>/stat`) over the measured interval of an open-loop run, divided by the requests completed in it. At these rates neither core is saturated, so this is the proxy's cost, not the load generator's limit; it is what a sidecar in every pod costs per request. Lower is better; \"best peer\" is the cheaper of nginx and HAProxy in the same row. The kernel counts CPU in 10 ms ticks: at 1 000 rps a run holds a few dozen ticks, so the higher rate is the more precise. Instructions per request (callgrind) and syscalls per request (strace) are measured by `perf/per_request.sh` (results in `per_request.md`; flame graphs in `flamegraphs.md`).\n"
    );
    let proxies: Vec<PeerKind> = r.peers.iter().copied().filter(|p| p.is_proxy()).collect();
    let mut head = "| Scenario | rate |".to_string();
    let mut sep = "|---|---:|".to_string();
    for p in &proxies {
        head.push_str(&format!(" {} |", p.name()));
        sep.push_str("---:|");
    }
    head.push_str(" spur ÷ best peer | spur-keyed ÷ best peer |");
    sep.push_str("---:|---:|");
    let _ = writeln!(o, "{head}\n{sep}");
    for &sc in &r.scenarios {
        for &rate in &r.settings.rates {
            let mut row = format!("| {} | {} |", sc.label(), thousands(rate));
            for &p in &proxies {
                let txt = cpu_at(r, p, sc, rate).map_or("–".into(), |v| format!("{v:.1}"));
                row.push_str(&format!(" {txt} |"));
            }
            let best = best_peer_cpu(r, sc, rate);
            for p in [PeerKind::Spur, PeerKind::SpurKeyed] {
                let txt = match (cpu_at(r, p, sc, rate), best) {
                    (Some(a), Some((bp, b))) if b > 0.0 => {
                        format!("{:.2}× ({})", a / b, bp.name())
                    }
                    _ => "–".into(),
                };
                row.push_str(&format!(" {txt} |"));
            }
            let _ = writeln!(o, "{row}");
        }
    }
    o.push('\n');
}

fn goal_row(o: &mut String, goal: &str, target: &str, measured: String, met: Option<bool>) {
    let verdict = match met {
        Some(true) => "✅ met",
        Some(false) => "❌ missed",
        None => "– no data",
    };
    let _ = writeln!(o, "| {goal} | {target} | {measured} | {verdict} |");
}

fn goals(o: &mut String, r: &Results) {
    let _ = writeln!(o, "## Goals\n");
    let _ = writeln!(
        o,
        "| Goal | Target | Measured | Result |\n|---|---|---|---|"
    );
    // CPU per request at the highest fixed rate (the most ticks), every scenario, keyed or not.
    if let Some(&top) = r.settings.rates.iter().max() {
        for &sc in &r.scenarios {
            let best = best_peer_cpu(r, sc, top);
            for p in [PeerKind::Spur, PeerKind::SpurKeyed] {
                let (measured, met) = match (cpu_at(r, p, sc, top), best) {
                    (Some(a), Some((bp, b))) if b > 0.0 => (
                        format!(
                            "{:.2}× ({a:.1} vs {} {b:.1} µs){}",
                            a / b,
                            bp.name(),
                            disturbed(r, sc, &[(p, RunKind::Rate(top)), (bp, RunKind::Rate(top))])
                        ),
                        Some(a / b <= 0.8),
                    ),
                    _ => ("–".into(), None),
                };
                goal_row(
                    o,
                    &format!(
                        "{} CPU per request at {} rps, {} vs the cheaper of nginx and HAProxy",
                        sc.label(),
                        thousands(top),
                        p.name()
                    ),
                    "≤ 0.8×",
                    measured,
                    met,
                );
            }
        }
    }
    let rate = 1000;
    for proto in [Proto::H1, Proto::H2, Proto::Grpc] {
        let sc = Scenario {
            proto,
            payload: 1024,
        };
        if !r.scenarios.contains(&sc) {
            continue;
        }
        let name = sc.label();
        let spur = sat(r, PeerKind::Spur, sc);
        for (peer, min) in [(PeerKind::Haproxy, 1.0), (PeerKind::Nginx, 1.3)] {
            let other = sat(r, peer, sc);
            let (measured, met) = match (spur, other) {
                (Some(a), Some(b)) if b > 0.0 => (
                    format!(
                        "{:.2}× ({} vs {} rps){}",
                        a / b,
                        rps(a),
                        rps(b),
                        disturbed(
                            r,
                            sc,
                            &[
                                (PeerKind::Spur, RunKind::Saturation),
                                (peer, RunKind::Saturation)
                            ]
                        )
                    ),
                    Some(a / b >= min),
                ),
                _ => ("–".into(), None),
            };
            goal_row(
                o,
                &format!("{name} throughput, spur vs {}", peer.name()),
                &format!("≥ {min:.1}×"),
                measured,
                met,
            );
        }
        let direct = lat_at(r, PeerKind::Direct, sc, rate);
        let spur_l = lat_at(r, PeerKind::Spur, sc, rate);
        for (label, pick, limit) in [("p50", PCTS[0].1, 50.0), ("p99", PCTS[2].1, 150.0)] {
            let (measured, met) = match (&spur_l, &direct) {
                (Some(a), Some(d)) => {
                    let added = pick(a) - pick(d);
                    (
                        format!(
                            "{} µs{}",
                            signed_us(added),
                            disturbed(
                                r,
                                sc,
                                &[
                                    (PeerKind::Direct, RunKind::Rate(rate)),
                                    (PeerKind::Spur, RunKind::Rate(rate))
                                ]
                            )
                        ),
                        Some(added <= limit),
                    )
                }
                _ => ("–".into(), None),
            };
            goal_row(
                o,
                &format!("{name} latency added over direct at 1 000 rps, {label}"),
                &format!("≤ {limit:.0} µs"),
                measured,
                met,
            );
        }
        for peer in [PeerKind::Nginx, PeerKind::Haproxy] {
            let other = lat_at(r, peer, sc, rate);
            let (measured, met) = match (&spur_l, &other, &direct) {
                (Some(a), Some(b), Some(d)) => {
                    let mut parts = Vec::new();
                    let mut ok = true;
                    for (label, pick) in PCTS.iter().take(4) {
                        let sa = pick(a) - pick(d);
                        let sb = pick(b) - pick(d);
                        if sa > sb {
                            ok = false;
                        }
                        parts.push(format!("{label} {} vs {}", signed_us(sa), signed_us(sb)));
                    }
                    let note = disturbed(
                        r,
                        sc,
                        &[
                            (PeerKind::Direct, RunKind::Rate(rate)),
                            (PeerKind::Spur, RunKind::Rate(rate)),
                            (peer, RunKind::Rate(rate)),
                        ],
                    );
                    (format!("{}{note}", parts.join("; ")), Some(ok))
                }
                _ => ("–".into(), None),
            };
            goal_row(
                o,
                &format!(
                    "{name} latency added at 1 000 rps ≤ {} at every percentile",
                    peer.name()
                ),
                "spur ≤ peer at p50, p90, p99, p99.9",
                measured,
                met,
            );
        }
        let cell = r.cell(PeerKind::Spur, sc);
        let idle = cell.and_then(|c| c.idle_rss_kib);
        goal_row(
            o,
            &format!("{name}: spur RSS idle"),
            "≤ 10 MiB",
            idle.map_or("–".into(), |k| format!("{} MiB", mib(k))),
            idle.map(|k| k <= 10 * 1024),
        );
        let at5k = cell
            .and_then(|c| c.at_rate(5000))
            .filter(|run| run.error.is_none())
            .and_then(|run| run.peak_rss_kib);
        goal_row(
            o,
            &format!("{name}: spur peak RSS at 5 000 rps"),
            "≤ 20 MiB",
            at5k.map_or("–".into(), |k| format!("{} MiB", mib(k))),
            at5k.map(|k| k <= 20 * 1024),
        );
    }
    let _ = writeln!(
        o,
        "\nA goal measured on runs during which other processes used more than {:.0} % of a core is marked ⚠ disturbed: its verdict is not reliable.",
        r.settings.quiet_threshold * 100.0
    );
    let _ = writeln!(
        o,
        "\n\"Added over direct\" is the peer's percentile minus the direct run's percentile at the same rate; max is left out of the every-percentile comparison (one sample). RSS is that of the spur process; idle = after start-up with the rules loaded, before the first request.\n"
    );
}
