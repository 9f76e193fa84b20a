//! Runs every peer in every scenario: start the peer fresh, verify one request, then the
//! open-loop rates, closed-loop saturation and the open loop at a share of that saturation.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::load::{self, LoadReport, LoadSpec, Mode, pinned};
use super::peers::{self, PeerEnv, PeerKind, RunningPeer, log_tail};
use super::probe;
use super::proc::{self, Child, RssSampler, StdoutMode};
use super::{Cell, CrossCheck, Proto, RunKind, RunResult, Scenario, Settings};

/// Scenario cross-checked with an independent generator (closed loop, direct and spur).
pub fn cross_check_scenario() -> Scenario {
    Scenario {
        proto: Proto::H1,
        payload: 1024,
    }
}

/// The shared upstream: one process, two listeners (app and "sandbox").
pub struct Upstream {
    pub app: SocketAddr,
    pub sandbox: SocketAddr,
    child: Child,
}

impl Upstream {
    pub fn start(bin_dir: &Path, core: Option<u32>, log: &Path) -> Result<Self> {
        let app = peers::free_port()?;
        let sandbox = peers::free_port()?;
        let mut cmd = pinned(core, &bin_dir.join("spur-bench-upstream"));
        cmd.args([
            "--listen",
            &app.to_string(),
            "--listen",
            &sandbox.to_string(),
        ])
        .args(["--threads", "1"]);
        let mut child = Child::spawn("spur-bench-upstream", cmd, StdoutMode::Lines, log)?;
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut ready = 0;
        while ready < 2 {
            let line = child
                .next_line(deadline)
                .with_context(|| format!("upstream not ready: {}", log_tail(log)))?;
            if line.trim_start().starts_with("ready") {
                ready += 1;
            }
        }
        Ok(Self {
            app,
            sandbox,
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(st) = self.child.exited() {
            bail!("the upstream exited ({st})");
        }
        Ok(())
    }
}

/// Fixed inputs of all runs.
pub struct Runner<'a> {
    pub settings: &'a Settings,
    pub env: &'a PeerEnv,
    pub upstream_pid: u32,
    pub bin_dir: PathBuf,
    pub work_dir: PathBuf,
    pub client_core: Option<u32>,
    pub external_tool: Option<&'static str>,
    /// Seconds still available for waiting for a quiet machine (shared by all runs).
    pub quiet_budget_s: std::cell::Cell<f64>,
    /// Repetitions of disturbed runs still available (shared by all runs).
    pub retry_budget: std::cell::Cell<u32>,
}

impl Runner<'_> {
    fn spec(&self, peer: &RunningPeer, scenario: Scenario, mode: Mode) -> LoadSpec {
        let s = self.settings;
        let addr = match scenario.proto {
            Proto::H1 => peer.h1,
            Proto::H2 | Proto::Grpc => peer.h2,
        };
        let (connections, streams) = match scenario.proto {
            Proto::H1 => (s.h1_connections, None),
            Proto::H2 | Proto::Grpc => (s.h2_connections, Some(s.h2_streams)),
        };
        LoadSpec {
            url: format!("http://{addr}{}", scenario.path()),
            proto: scenario.proto,
            connections,
            streams,
            header: peer.kind.header().map(|(k, v)| format!("{k}: {v}")),
            payload: (scenario.proto == Proto::Grpc).then_some(scenario.payload),
            duration: Duration::from_secs_f64(s.duration_s),
            warmup: Duration::from_secs_f64(s.warmup_s),
            mode,
            threads: s.loadgen_threads,
        }
    }

    /// All runs of `kind` in `scenario`, on a freshly started peer.
    pub fn cell(&self, kind: PeerKind, scenario: Scenario, index: usize) -> Cell {
        let mut cell = Cell {
            peer: kind,
            scenario,
            verified: None,
            error: None,
            idle_rss_kib: None,
            idle_other_rss_kib: None,
            runs: Vec::new(),
            cross_check: None,
        };
        let mut peer = match peers::start(kind, self.env, index) {
            Ok(p) => p,
            Err(e) => {
                cell.error = Some(format!("start: {e:#}"));
                return cell;
            }
        };
        if let Err(e) = self.fill_cell(&mut peer, &mut cell) {
            cell.error = Some(format!("{e:#}"));
        }
        peer.stop();
        cell
    }

    fn fill_cell(&self, peer: &mut RunningPeer, cell: &mut Cell) -> Result<()> {
        let scenario = cell.scenario;
        // Idle memory: started, rules loaded, no request served yet.
        std::thread::sleep(Duration::from_millis(200));
        if let Some(pid) = peer.rss_pid {
            cell.idle_rss_kib = proc::status_kib(pid, "VmRSS").ok();
        }
        if !peer.other_pids.is_empty() {
            cell.idle_other_rss_kib = Some(
                peer.other_pids
                    .iter()
                    .filter_map(|&p| proc::status_kib(p, "VmRSS").ok())
                    .sum(),
            );
        }
        cell.verified = Some(self.verify(peer, scenario)?);

        let rates = self.settings.rates.clone();
        for rate in rates {
            let r = self.measure_quietly(peer, scenario, RunKind::Rate(rate))?;
            cell.runs.push(r);
        }
        let sat = self.measure_quietly(peer, scenario, RunKind::Saturation)?;
        let max_rps = sat.load.as_ref().map(|l| l.rps).filter(|&r| r > 0.0);
        cell.runs.push(sat);
        if let Some(max) = max_rps
            && self.settings.max_pct > 0
        {
            let rps = ((max * f64::from(self.settings.max_pct) / 100.0).floor() as u64).max(1);
            let kind = RunKind::MaxPct {
                pct: self.settings.max_pct,
                rps,
            };
            let r = self.measure_quietly(peer, scenario, kind)?;
            cell.runs.push(r);
        }
        if scenario == cross_check_scenario()
            && matches!(peer.kind, PeerKind::Direct | PeerKind::Spur)
            && let Some(tool) = self.external_tool
        {
            let spur_load_rps = cell.saturation().map(|l| l.rps);
            cell.cross_check = Some(match self.external(peer, scenario, tool) {
                Ok(ext) => CrossCheck {
                    external: Some(ext),
                    error: None,
                    spur_load_rps,
                },
                Err(e) => CrossCheck {
                    external: None,
                    error: Some(format!("{e:#}")),
                    spur_load_rps,
                },
            });
        }
        peer.check_alive()?;
        Ok(())
    }

    /// One request through the peer; status and upstream must be right.
    fn verify(&self, peer: &RunningPeer, scenario: Scenario) -> Result<String> {
        let addr = match scenario.proto {
            Proto::H1 => peer.h1,
            _ => peer.h2,
        };
        let message = probe::proto_bytes_field(scenario.payload);
        let mut last = None;
        for _ in 0..3 {
            match probe::probe(
                addr,
                scenario.proto,
                &scenario.path(),
                &message,
                peer.kind.header(),
                Duration::from_secs(5),
            ) {
                Ok(reply) => {
                    probe::check(&reply, scenario.proto, peer.expect_port).with_context(|| {
                        format!("{} {}: wrong reply", peer.kind.name(), scenario.id())
                    })?;
                    if matches!(scenario.proto, Proto::H1 | Proto::H2)
                        && reply.body_len != scenario.payload
                    {
                        bail!(
                            "{} {}: body of {} bytes, expected {}",
                            peer.kind.name(),
                            scenario.id(),
                            reply.body_len,
                            scenario.payload
                        );
                    }
                    let mut s = format!("{}", reply.status);
                    if let Some(u) = &reply.x_upstream {
                        s.push_str(&format!(", x-upstream {u}"));
                    }
                    if let Some(g) = &reply.grpc_status {
                        s.push_str(&format!(", grpc-status {g}"));
                    }
                    return Ok(s);
                }
                Err(e) => {
                    last = Some(e);
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("verification failed"))).with_context(|| {
            format!(
                "verify {} {}: {}",
                peer.kind.name(),
                scenario.id(),
                log_tail(&peer.log)
            )
        })
    }

    /// One load-generator run with CPU and memory readings of the peer.
    fn measure(
        &self,
        peer: &mut RunningPeer,
        scenario: Scenario,
        kind: RunKind,
    ) -> Result<RunResult> {
        peer.check_alive()?;
        eprintln!(
            "  {:<10} {:<8} {:<26}",
            peer.kind.name(),
            scenario.id(),
            kind.label()
        );
        let (quiet_wait_s, busy_before) = self.wait_quiet();
        let mode = match kind {
            RunKind::Saturation => Mode::Closed,
            RunKind::Rate(r) | RunKind::MaxPct { rps: r, .. } => Mode::Rate(r),
        };
        let spec = self.spec(peer, scenario, mode);
        let mut result = RunResult {
            kind,
            load: None,
            error: None,
            proxy_cpu_s: None,
            upstream_cpu_s: None,
            loadgen_cpu_s: None,
            other_cpu_s: None,
            steal_s: None,
            quiet_wait_s,
            busy_before,
            attempts: 1,
            interval_s: spec.duration.as_secs_f64(),
            peak_rss_kib: None,
            other_peak_rss_kib: None,
        };
        let hwm_reset = peer
            .rss_pid
            .into_iter()
            .chain(peer.other_pids.iter().copied())
            .all(proc::reset_peak_rss);
        let mut watched: Vec<u32> = peer.rss_pid.into_iter().collect();
        watched.extend(peer.other_pids.iter().copied());
        let sampler = RssSampler::start(watched);

        let log = self.work_dir.join("spur-load.log");
        let mut cmd = pinned(self.client_core, &self.bin_dir.join("spur-load"));
        cmd.args(spec.args());
        let start = Instant::now();
        let mut child = Child::spawn("spur-load", cmd, StdoutMode::Collect, &log)?;
        // CPU is read over the measured interval only (after the warm-up).
        sleep_until(start + spec.warmup);
        let p0 = proc::cpu_seconds_sum(&peer.cpu_pids);
        let u0 = proc::cpu_seconds(self.upstream_pid).ok();
        let l0 = proc::cpu_seconds(child.pid()).ok();
        let m0 = proc::machine_cpu();
        let f0 = proc::ForeignSnapshot::take();
        let t0 = Instant::now();
        sleep_until(start + spec.warmup + spec.duration);
        let p1 = proc::cpu_seconds_sum(&peer.cpu_pids);
        let u1 = proc::cpu_seconds(self.upstream_pid).ok();
        let l1 = proc::cpu_seconds(child.pid()).ok();
        let m1 = proc::machine_cpu();
        let f1 = proc::ForeignSnapshot::take();
        result.interval_s = t0.elapsed().as_secs_f64();
        let waited = child.wait_output(Duration::from_secs(30));
        let peaks = sampler.finish();

        if peer.kind.is_proxy() {
            result.proxy_cpu_s = Some(p1 - p0);
        }
        if let (Some(a), Some(b)) = (u0, u1) {
            result.upstream_cpu_s = Some(b - a);
        }
        if let (Some(a), Some(b)) = (l0, l1) {
            result.loadgen_cpu_s = Some(b - a);
        }
        result.other_cpu_s = Some(f0.cpu_since(&f1));
        if let (Some(a), Some(b)) = (m0, m1) {
            result.steal_s = Some((b.1 - a.1).max(0.0));
        }
        let peak = |pid: u32| {
            let hwm = if hwm_reset {
                proc::status_kib(pid, "VmHWM").ok()
            } else {
                None
            };
            hwm.into_iter().chain(peaks.get(&pid).copied()).max()
        };
        result.peak_rss_kib = peer.rss_pid.and_then(peak);
        if !peer.other_pids.is_empty() {
            result.other_peak_rss_kib = Some(peer.other_pids.iter().filter_map(|&p| peak(p)).sum());
        }
        match waited {
            Ok((status, out)) => {
                let text = String::from_utf8_lossy(&out);
                if !status.success() {
                    result.error = Some(format!(
                        "spur-load exited with {status}: {}",
                        log_tail(&log)
                    ));
                } else {
                    match LoadReport::parse(&text) {
                        Ok(r) => {
                            if r.requests == 0 {
                                result.error = Some("no request completed".into());
                            }
                            result.load = Some(r);
                        }
                        Err(e) => result.error = Some(format!("{e:#}: {}", text.trim())),
                    }
                }
            }
            Err(e) => result.error = Some(format!("{e:#}")),
        }
        if let Some(l) = &result.load {
            eprintln!(
                "             → {:.0} rps, p50 {:.0} µs, p99 {:.0} µs, errors {}, proxy CPU {:.2} s, peak RSS {} KiB",
                l.rps,
                l.latency_us.p50,
                l.latency_us.p99,
                l.errors,
                result.proxy_cpu_s.unwrap_or(0.0),
                result.peak_rss_kib.unwrap_or(0)
            );
        }
        if let Some(e) = &result.error {
            eprintln!("             → error: {e}");
        }
        Ok(result)
    }

    /// Closed loop with the independent generator, same connections and duration.
    fn external(
        &self,
        peer: &RunningPeer,
        scenario: Scenario,
        tool: &str,
    ) -> Result<load::ExternalReport> {
        let url = format!("http://{}{}", peer.h1, scenario.path());
        let log = self.work_dir.join(format!("{tool}.log"));
        let run = |d: Duration| -> Result<(String, String)> {
            let (prog, args) = load::external_command(tool, &url, self.settings.h1_connections, d);
            let path = load::which(&prog).with_context(|| format!("{prog} not found"))?;
            let mut cmd = pinned(self.client_core, &path);
            cmd.args(&args);
            let shown = format!("{prog} {}", args.join(" "));
            let out = proc::run_capture(&prog, cmd, d + Duration::from_secs(30), &log)?;
            Ok((shown, out))
        };
        eprintln!(
            "  {:<10} {:<8} cross-check with {tool}",
            peer.kind.name(),
            scenario.id()
        );
        // Warm-up run, discarded, then the measured run.
        run(Duration::from_secs_f64(self.settings.warmup_s.max(1.0)))?;
        let (shown, out) = run(Duration::from_secs_f64(self.settings.duration_s.max(1.0)))?;
        let mut r = load::parse_external(tool, &out)?;
        r.command = shown;
        eprintln!("             → {:.0} rps", r.rps);
        Ok(r)
    }
}

/// Share of one core used by other processes during a run (0 if unknown).
pub fn disturbance(run: &RunResult) -> f64 {
    run.other_cpu_s
        .map_or(0.0, |c| c / run.interval_s.max(1e-9))
}

impl Runner<'_> {
    /// [`Self::measure`], repeated (up to `retries` times, within the shared budget) while other
    /// processes used more than `quiet_threshold` of a core during the run; keeps the least
    /// disturbed attempt.
    fn measure_quietly(
        &self,
        peer: &mut RunningPeer,
        scenario: Scenario,
        kind: RunKind,
    ) -> Result<RunResult> {
        let limit = self.settings.quiet_threshold;
        let mut best = self.measure(peer, scenario, kind)?;
        let mut attempts = 1;
        while disturbance(&best) > limit
            && attempts <= self.settings.retries
            && self.retry_budget.get() > 0
        {
            self.retry_budget.set(self.retry_budget.get() - 1);
            eprintln!(
                "             (other processes used {:.0} % of a core during the run; repeating it)",
                disturbance(&best) * 100.0
            );
            let next = self.measure(peer, scenario, kind)?;
            attempts += 1;
            if disturbance(&next) < disturbance(&best) || best.load.is_none() {
                best = next;
            }
        }
        best.attempts = attempts;
        Ok(best)
    }

    /// Measures other processes' CPU use (everything outside our process tree). Waits (in
    /// 300 ms samples, at most `quiet_wait_s` per run and the shared budget overall) until it is
    /// below `quiet_threshold` of one core. Returns the time waited and the last sample.
    fn wait_quiet(&self) -> (f64, Option<f64>) {
        let s = self.settings;
        let start = Instant::now();
        let window = Duration::from_millis(300);
        loop {
            let a = proc::ForeignSnapshot::take();
            std::thread::sleep(window);
            let b = proc::ForeignSnapshot::take();
            let busy = a.cpu_since(&b) / window.as_secs_f64();
            let last = Some(busy);
            let waited = start.elapsed().as_secs_f64();
            let quiet = busy <= s.quiet_threshold;
            let budget = self.quiet_budget_s.get() - waited;
            if quiet || waited >= s.quiet_wait_s || budget <= 0.0 {
                let extra = (waited - window.as_secs_f64()).max(0.0);
                self.quiet_budget_s
                    .set((self.quiet_budget_s.get() - extra).max(0.0));
                if !quiet {
                    eprintln!(
                        "             (machine busy: {:.0} % of a core used by other processes; running anyway)",
                        busy * 100.0
                    );
                }
                return (extra, last);
            }
        }
    }
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}
