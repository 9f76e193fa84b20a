//! The report's measurement tables: throughput, latency, CPU, memory, the cross-check of the
//! load generator against the server's own counters, and the runs that failed.

use std::fmt::Write as _;

use super::*;

pub(super) fn throughput(o: &mut String, r: &Results) {
    let _ = writeln!(o, "## Saturation throughput (closed loop, requests/s)\n");
    let mut head = "| Scenario |".to_string();
    let mut sep = "|---|".to_string();
    for p in &r.peers {
        head.push_str(&format!(" {} |", p.name()));
        sep.push_str("---:|");
    }
    head.push_str(" spur ÷ direct | spur ÷ nginx | spur ÷ haproxy | spur-keyed ÷ spur |");
    sep.push_str("---:|---:|---:|---:|");
    let _ = writeln!(o, "{head}\n{sep}");
    for &sc in &r.scenarios {
        let mut row = format!("| {} |", sc.label());
        for &p in &r.peers {
            let cell = r.cell(p, sc);
            let txt = match cell.and_then(Cell::saturation) {
                Some(l) if l.errors > 0 => format!("{} ({} errors)", rps(l.rps), l.errors),
                Some(l) => rps(l.rps),
                None => "failed".into(),
            };
            row.push_str(&format!(" {txt} |"));
        }
        let spur = sat(r, PeerKind::Spur, sc);
        row.push_str(&format!(
            " {} | {} | {} | {} |",
            ratio(spur, sat(r, PeerKind::Direct, sc)),
            ratio(spur, sat(r, PeerKind::Nginx, sc)),
            ratio(spur, sat(r, PeerKind::Haproxy, sc)),
            ratio(sat(r, PeerKind::SpurKeyed, sc), spur),
        ));
        let _ = writeln!(o, "{row}");
    }
    // Who was the bottleneck.
    let _ = writeln!(
        o,
        "\nCPU use during saturation, as a share of one core: proxy core (the peer's processes) / client core (load generator + upstream, which share the other core) / other processes on the machine. A peer is CPU-bound when its share is near 100 %; when neither is, the limit is latency (wake-ups, hand-offs between the cores) rather than CPU:\n"
    );
    let mut head = "| Scenario |".to_string();
    let mut sep = "|---|".to_string();
    for p in &r.peers {
        head.push_str(&format!(" {} |", p.name()));
        sep.push_str("---:|");
    }
    let _ = writeln!(o, "{head}\n{sep}");
    for &sc in &r.scenarios {
        let mut row = format!("| {} |", sc.label());
        for &p in &r.peers {
            let run = r
                .cell(p, sc)
                .and_then(|c| c.run(|k| *k == RunKind::Saturation));
            let txt = match run {
                Some(run) if run.interval_s > 0.0 => {
                    let (px, cl) = core_shares(run);
                    let other = run.other_cpu_s.map(|c| c / run.interval_s);
                    format!("{} / {} / {}", pct(px), pct(cl), pct(other))
                }
                _ => "–".into(),
            };
            row.push_str(&format!(" {txt} |"));
        }
        let _ = writeln!(o, "{row}");
    }
    o.push('\n');
}

pub(super) fn latency(o: &mut String, r: &Results) {
    let _ = writeln!(o, "## Latency under open-loop load\n");
    let _ = writeln!(
        o,
        "Per run: achieved rate, latency percentiles (µs, measured from the intended send time, so queueing behind a late request counts), and the latency added over direct at the same rate. At the {} %-of-max rate each peer runs at its own rate, so no \"added\" columns there. *proxy / client core*: CPU share of one core used by the peer's processes / by the load generator plus the upstream (which share the other core). *Flags*: \"late\" = requests started more than 1 s after their intended time; \"queueing\" = a median more than 10× the same peer's median at the lowest rate (the figures then measure a backlog, in the proxy or in the client, not the peer's latency at that rate); \"other processes\" = CPU used by processes outside the benchmark during the run (more than 10 % of a core makes the row suspect).\n",
        r.settings.max_pct
    );
    for &sc in &r.scenarios {
        let _ = writeln!(o, "### {}\n", sc.label());
        let mut kinds: Vec<RunKind> = r.settings.rates.iter().map(|&x| RunKind::Rate(x)).collect();
        kinds.push(RunKind::MaxPct {
            pct: r.settings.max_pct,
            rps: 0,
        });
        for kind in kinds {
            let title = match kind {
                RunKind::Rate(x) => format!("{} rps", thousands(x)),
                _ => format!("{} % of each peer's max", r.settings.max_pct),
            };
            let _ = writeln!(o, "**{title}**\n");
            let _ = writeln!(
                o,
                "| Peer | rate | p50 | p90 | p99 | p99.9 | max | +p50 | +p90 | +p99 | +p99.9 | +max | errors | proxy / client core | flags |"
            );
            let _ = writeln!(
                o,
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
            );
            let pick_run = |c: &Cell| -> Option<RunResult> {
                match kind {
                    RunKind::Rate(x) => c.at_rate(x).cloned(),
                    _ => c.at_max_pct().cloned(),
                }
            };
            let direct = r
                .cell(PeerKind::Direct, sc)
                .and_then(pick_run)
                .filter(|x| x.error.is_none())
                .and_then(|x| x.load);
            for &p in &r.peers {
                let Some(run) = r.cell(p, sc).and_then(pick_run) else {
                    let _ = writeln!(o, "| {} | – | | | | | | | | | | | | | |", p.name());
                    continue;
                };
                let Some(l) = &run.load else {
                    let _ = writeln!(
                        o,
                        "| {} | failed: {} | | | | | | | | | | | | | |",
                        p.name(),
                        run.error.as_deref().unwrap_or("?").replace('|', "/")
                    );
                    continue;
                };
                let mut row = format!("| {} | {} |", p.name(), rps(l.rps));
                for (_, pick) in PCTS {
                    row.push_str(&format!(" {} |", us(pick(&l.latency_us))));
                }
                for (_, pick) in PCTS {
                    let txt = match (&direct, p, kind) {
                        (_, PeerKind::Direct, _) => "".into(),
                        // Each peer ran at its own rate: no like-for-like difference.
                        (_, _, RunKind::MaxPct { .. }) => "".into(),
                        (Some(d), _, _) => signed_us(pick(&l.latency_us) - pick(&d.latency_us)),
                        (None, _, _) => "–".into(),
                    };
                    row.push_str(&format!(" {txt} |"));
                }
                let (px, cl) = core_shares(&run);
                let base = r
                    .cell(p, sc)
                    .and_then(|c| r.settings.rates.iter().min().and_then(|&m| c.at_rate(m)))
                    .and_then(|x| x.load.as_ref())
                    .map(|x| x.latency_us.p50);
                let mut flags: Vec<String> = overload(&run, base).into_iter().collect();
                let x = crate::bench::runner::disturbance(&run);
                if x > r.settings.quiet_threshold.max(0.0) {
                    flags.push(format!("other processes used {:.0} % of a core", x * 100.0));
                }
                if run.attempts > 1 {
                    flags.push(format!("best of {} attempts", run.attempts));
                }
                let flag = if flags.is_empty() {
                    String::new()
                } else {
                    format!("⚠ {}", flags.join("; "))
                };
                row.push_str(&format!(
                    " {} | {} / {} | {flag} |",
                    l.errors,
                    pct(px),
                    pct(cl)
                ));
                let _ = writeln!(o, "{row}");
            }
            o.push('\n');
        }
    }
}

pub(super) fn cpu(o: &mut String, r: &Results) {
    let _ = writeln!(o, "## Proxy CPU per 10 000 requests (CPU seconds)\n");
    let _ = writeln!(
        o,
        "user + system time of the peer's processes (`/proc/<pid>/stat`; nginx: master + worker, haproxy: its single process) over the measured interval, divided by the requests completed in it. The kernel counts CPU time in ticks of 1/CLK_TCK s (10 ms), so figures from short or low-rate runs are coarse.\n"
    );
    let proxies: Vec<PeerKind> = r.peers.iter().copied().filter(|p| p.is_proxy()).collect();
    let mut head = "| Scenario | run |".to_string();
    let mut sep = "|---|---|".to_string();
    for p in &proxies {
        head.push_str(&format!(" {} |", p.name()));
        sep.push_str("---:|");
    }
    let _ = writeln!(o, "{head}\n{sep}");
    for &sc in &r.scenarios {
        let mut kinds: Vec<(String, RunKind)> = r
            .settings
            .rates
            .iter()
            .map(|&x| (format!("{} rps", thousands(x)), RunKind::Rate(x)))
            .collect();
        kinds.push(("saturation".into(), RunKind::Saturation));
        kinds.push((
            format!("{} % of max", r.settings.max_pct),
            RunKind::MaxPct { pct: 0, rps: 0 },
        ));
        for (label, kind) in kinds {
            let mut row = format!("| {} | {label} |", sc.label());
            for &p in &proxies {
                let run = r.cell(p, sc).and_then(|c| match kind {
                    RunKind::MaxPct { .. } => c.at_max_pct(),
                    k => c.run(|x| *x == k),
                });
                let txt = run
                    .and_then(cpu_per_10k)
                    .map_or("–".into(), |v| format!("{v:.3}"));
                row.push_str(&format!(" {txt} |"));
            }
            let _ = writeln!(o, "{row}");
        }
    }
    o.push('\n');
}

pub(super) fn memory(o: &mut String, r: &Results) {
    let _ = writeln!(o, "## Proxy memory (RSS, MiB)\n");
    let _ = writeln!(
        o,
        "Idle = VmRSS after start-up, before the first request. Peak = the larger of VmHWM (reset with `/proc/<pid>/clear_refs` before each run) and VmRSS sampled every 20 ms during the run. Each peer is started fresh per scenario and runs the open-loop rates before saturation, so the fixed-rate peaks are not inflated by a preceding saturation run. nginx: the worker process (it serves all requests); the master's RSS is shown in parentheses. haproxy and spur: their single process.\n"
    );
    let proxies: Vec<PeerKind> = r.peers.iter().copied().filter(|p| p.is_proxy()).collect();
    let mut head = "| Scenario | Peer | idle |".to_string();
    let mut sep = "|---|---|---:|".to_string();
    for &x in &r.settings.rates {
        head.push_str(&format!(" peak @ {} rps |", thousands(x)));
        sep.push_str("---:|");
    }
    head.push_str(&format!(
        " peak @ saturation | peak @ {} % |",
        r.settings.max_pct
    ));
    sep.push_str("---:|---:|");
    let _ = writeln!(o, "{head}\n{sep}");
    let fmt = |main: Option<u64>, other: Option<u64>| -> String {
        match (main, other) {
            (Some(a), Some(b)) => format!("{} ({})", mib(a), mib(b)),
            (Some(a), None) => mib(a),
            _ => "–".into(),
        }
    };
    for &sc in &r.scenarios {
        for &p in &proxies {
            let Some(c) = r.cell(p, sc) else { continue };
            let mut row = format!(
                "| {} | {} | {} |",
                sc.label(),
                p.name(),
                fmt(c.idle_rss_kib, c.idle_other_rss_kib)
            );
            let mut runs: Vec<Option<&RunResult>> =
                r.settings.rates.iter().map(|&x| c.at_rate(x)).collect();
            runs.push(c.run(|k| *k == RunKind::Saturation));
            runs.push(c.at_max_pct());
            for run in runs {
                let txt = run.map_or("–".into(), |x| fmt(x.peak_rss_kib, x.other_peak_rss_kib));
                row.push_str(&format!(" {txt} |"));
            }
            let _ = writeln!(o, "{row}");
        }
    }
    o.push('\n');
}

pub(super) fn cross_check(o: &mut String, r: &Results) {
    let cells: Vec<&Cell> = r.cells.iter().filter(|c| c.cross_check.is_some()).collect();
    if cells.is_empty() {
        return;
    }
    let _ = writeln!(o, "## Cross-check with an independent load generator\n");
    let _ = writeln!(
        o,
        "Closed loop, same scenario, connections, core and duration (after a discarded warm-up run of the same tool), right after the spur-load runs on the same peer process. wrk's latency percentiles are not comparable to spur-load's open-loop figures (closed loop: coordinated omission); they are shown for orientation only.\n"
    );
    let _ = writeln!(
        o,
        "| Peer | Scenario | spur-load rps | independent rps | independent ÷ spur-load | independent p50 / p90 / p99 | spur-load closed-loop p50 / p90 / p99 | command |"
    );
    let _ = writeln!(o, "|---|---|---:|---:|---:|---|---|---|");
    for c in cells {
        let Some(x) = &c.cross_check else { continue };
        let sl = c.saturation();
        let sl_lat = sl.map_or("–".into(), |l| {
            format!(
                "{} / {} / {}",
                us(l.latency_us.p50),
                us(l.latency_us.p90),
                us(l.latency_us.p99)
            )
        });
        match (&x.external, &x.error) {
            (Some(e), _) => {
                let lat = |v: Option<f64>| v.map_or("–".into(), us);
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} ({}) | {} | {} / {} / {} | {} | `{}` |",
                    c.peer.name(),
                    c.scenario.label(),
                    x.spur_load_rps.map_or("–".into(), rps),
                    rps(e.rps),
                    e.tool,
                    ratio(Some(e.rps), x.spur_load_rps),
                    lat(e.p50_us),
                    lat(e.p90_us),
                    lat(e.p99_us),
                    sl_lat,
                    e.command
                );
            }
            (None, err) => {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | failed: {} | | | | |",
                    c.peer.name(),
                    c.scenario.label(),
                    x.spur_load_rps.map_or("–".into(), rps),
                    err.as_deref().unwrap_or("?").replace('|', "/")
                );
            }
        }
    }
    o.push('\n');
}

pub(super) fn failures(o: &mut String, r: &Results) {
    let mut lines = Vec::new();
    for c in &r.cells {
        if let Some(e) = &c.error {
            lines.push(format!(
                "- {} / {}: {}",
                c.peer.name(),
                c.scenario.label(),
                e
            ));
        }
        for run in &c.runs {
            if let Some(e) = &run.error {
                lines.push(format!(
                    "- {} / {} / {}: {}",
                    c.peer.name(),
                    c.scenario.label(),
                    run.kind.label(),
                    e
                ));
            }
        }
    }
    let _ = writeln!(o, "## Verification and failures\n");
    let _ = writeln!(
        o,
        "Before measuring, one request per peer and scenario: status, the `x-upstream` port of the listener that served it (spur-keyed must reach the sandbox listener, all others the app listener), gRPC status.\n"
    );
    let mut head = "| Scenario |".to_string();
    let mut sep = "|---|".to_string();
    for p in &r.peers {
        head.push_str(&format!(" {} |", p.name()));
        sep.push_str("---|");
    }
    let _ = writeln!(o, "{head}\n{sep}");
    for &sc in &r.scenarios {
        let mut row = format!("| {} |", sc.label());
        for &p in &r.peers {
            let txt = match r.cell(p, sc) {
                Some(c) => match (&c.verified, &c.error) {
                    (Some(v), _) => format!("✓ {v}"),
                    (None, Some(_)) => "✗ (see below)".into(),
                    (None, None) => "–".into(),
                },
                None => "–".into(),
            };
            row.push_str(&format!(" {txt} |"));
        }
        let _ = writeln!(o, "{row}");
    }
    if lines.is_empty() {
        let _ = writeln!(o, "\nNo failures.\n");
    } else {
        let _ = writeln!(o, "\nFailures:\n");
        for l in lines {
            let _ = writeln!(o, "{l}");
        }
        o.push('\n');
    }
}
