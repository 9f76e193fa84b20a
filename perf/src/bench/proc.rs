//! Child processes (killed with their whole process group on drop, on panic and on SIGINT/SIGTERM)
//! and `/proc` readings: CPU ticks, resident memory, children.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// Process groups of the children still running, for the signal handler.
fn registry() -> &'static Mutex<Vec<i32>> {
    static REG: OnceLock<Mutex<Vec<i32>>> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(Vec::new()))
}

fn register(pgid: i32) {
    if let Ok(mut r) = registry().lock() {
        r.push(pgid);
    }
}

fn unregister(pgid: i32) {
    if let Ok(mut r) = registry().lock() {
        r.retain(|&p| p != pgid);
    }
}

/// Kills every registered child process group (SIGTERM, then SIGKILL after up to 2 s).
pub fn kill_all_children() {
    let groups: Vec<i32> = registry().lock().map(|r| r.clone()).unwrap_or_default();
    for &g in &groups {
        let _ = killpg(Pid::from_raw(g), Signal::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline
        && groups
            .iter()
            .any(|&g| killpg(Pid::from_raw(g), None).is_ok())
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    for &g in &groups {
        let _ = killpg(Pid::from_raw(g), Signal::SIGKILL);
    }
}

/// On SIGINT, SIGTERM or SIGHUP: kill all children and exit with 130. Children run in their own
/// process groups, so a terminal's Ctrl-C reaches only this process; this handler passes it on.
pub fn install_signal_handler() -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (tx, rx) = mpsc::channel::<Result<()>>();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            rt.block_on(async move {
                use tokio::signal::unix::{SignalKind, signal};
                let sigs = (
                    signal(SignalKind::interrupt()),
                    signal(SignalKind::terminate()),
                    signal(SignalKind::hangup()),
                );
                let (mut a, mut b, mut c) = match sigs {
                    (Ok(a), Ok(b), Ok(c)) => {
                        let _ = tx.send(Ok(()));
                        (a, b, c)
                    }
                    _ => {
                        let _ = tx.send(Err(anyhow::anyhow!("cannot install signal handlers")));
                        return;
                    }
                };
                tokio::select! {
                    _ = a.recv() => {}
                    _ = b.recv() => {}
                    _ = c.recv() => {}
                }
                eprintln!("spur-bench: interrupted, stopping child processes");
                kill_all_children();
                std::process::exit(130);
            });
        })?;
    rx.recv_timeout(Duration::from_secs(5))
        .context("signal handler thread did not start")?
}

/// A child process in its own process group. Dropping it stops the group: SIGTERM, up to 3 s to
/// exit, then SIGKILL (nginx's workers go with their master).
pub struct Child {
    name: String,
    child: std::process::Child,
    pgid: i32,
    stopped: bool,
    stdout_thread: Option<JoinHandle<Vec<u8>>>,
    lines: Option<mpsc::Receiver<String>>,
}

/// What to do with a child's stdout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StdoutMode {
    /// Discarded.
    Null,
    /// Collected whole; returned by [`Child::wait_output`].
    Collect,
    /// Delivered line by line through [`Child::next_line`].
    Lines,
}

impl Child {
    /// Spawns `cmd` in a new process group; stderr goes to `stderr_log` (appended).
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        stdout: StdoutMode,
        stderr_log: &Path,
    ) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(stderr_log)
            .with_context(|| format!("open {}", stderr_log.display()))?;
        cmd.stdin(Stdio::null())
            .stderr(Stdio::from(log))
            .stdout(match stdout {
                StdoutMode::Null => Stdio::null(),
                _ => Stdio::piped(),
            })
            .process_group(0);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawn {name}: {cmd:?}"))?;
        let pgid = i32::try_from(child.id()).context("pid out of range")?;
        register(pgid);
        let mut stdout_thread = None;
        let mut lines = None;
        if let Some(mut out) = child.stdout.take() {
            match stdout {
                StdoutMode::Collect => {
                    stdout_thread = Some(std::thread::spawn(move || {
                        let mut buf = Vec::new();
                        let _ = out.read_to_end(&mut buf);
                        buf
                    }));
                }
                StdoutMode::Lines => {
                    let (tx, rx) = mpsc::channel();
                    std::thread::spawn(move || {
                        for line in BufReader::new(out).lines() {
                            let Ok(line) = line else { break };
                            if tx.send(line).is_err() {
                                // Nobody listens any more: keep draining so the child never blocks.
                                continue;
                            }
                        }
                    });
                    lines = Some(rx);
                }
                StdoutMode::Null => {}
            }
        }
        Ok(Self {
            name: name.to_string(),
            child,
            pgid,
            stopped: false,
            stdout_thread,
            lines,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The next stdout line (for [`StdoutMode::Lines`]), waiting at most until `deadline`.
    pub fn next_line(&mut self, deadline: Instant) -> Result<String> {
        let Some(rx) = &self.lines else {
            bail!("{}: stdout is not read line by line", self.name)
        };
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => Ok(l),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                bail!("{}: no output within the time limit", self.name)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                bail!("{}: stdout closed (process exited?)", self.name)
            }
        }
    }

    /// Has the process exited? (Non-blocking.)
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits for the process to exit by itself, at most `timeout` (then kills it and fails);
    /// returns its exit status and collected stdout.
    pub fn wait_output(&mut self, timeout: Duration) -> Result<(ExitStatus, Vec<u8>)> {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait()? {
                break s;
            }
            if Instant::now() >= deadline {
                self.stop();
                bail!("{} did not finish within {:?}; killed", self.name, timeout);
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        self.stopped = true;
        unregister(self.pgid);
        // The group may hold grandchildren; make sure none outlives the child.
        let _ = killpg(Pid::from_raw(self.pgid), Signal::SIGKILL);
        let out = match self.stdout_thread.take() {
            Some(t) => t.join().unwrap_or_default(),
            None => Vec::new(),
        };
        Ok((status, out))
    }

    /// Stops the process group: SIGTERM, up to 3 s, then SIGKILL. Idempotent.
    pub fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let pg = Pid::from_raw(self.pgid);
        let _ = killpg(pg, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut leader_done = false;
        while Instant::now() < deadline {
            if !leader_done {
                leader_done = matches!(self.child.try_wait(), Ok(Some(_)));
            }
            if leader_done && killpg(pg, None).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = killpg(pg, Signal::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
        unregister(self.pgid);
        if let Some(t) = self.stdout_thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Clock ticks per second (`getconf CLK_TCK`, 100 if that fails).
pub fn clk_tck() -> f64 {
    static TCK: OnceLock<f64> = OnceLock::new();
    *TCK.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|&t| t > 0.0)
            .unwrap_or(100.0)
    })
}

/// Fields of `/proc/<pid>/stat` after the command name (index 0 = state, field 3).
fn stat_fields(pid: u32) -> Result<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("read /proc/{pid}/stat"))?;
    let rest = s
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc/pid/stat")?;
    Ok(rest.split_whitespace().map(str::to_string).collect())
}

/// User + system CPU time of the process (all its threads, live and dead), in seconds.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let f = stat_fields(pid)?;
    let utime: u64 = f.get(11).context("utime")?.parse()?;
    let stime: u64 = f.get(12).context("stime")?.parse()?;
    Ok((utime + stime) as f64 / clk_tck())
}

/// Sum of [`cpu_seconds`] over `pids` (processes that vanished count 0).
/// Pids of every process whose command line starts with `prefix` (each argument equal, or a
/// path ending in `/<argument>`): the node's components, found by what they run.
pub fn pids_running(prefix: &[&str]) -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let matches = prefix.iter().enumerate().all(|(i, p)| {
            args.get(i)
                .is_some_and(|a| a == p || a.ends_with(&format!("/{p}")))
        });
        if matches {
            pids.push(pid);
        }
    }
    pids
}

/// User + system CPU time (ms) of every process [`pids_running`] `prefix`.
pub fn cpu_ms_running(prefix: &[&str]) -> f64 {
    cpu_seconds_sum(&pids_running(prefix)) * 1e3
}

pub fn cpu_seconds_sum(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|&p| cpu_seconds(p).ok()).sum()
}

/// A `kB` field of `/proc/<pid>/status` (VmRSS, VmHWM, …), in KiB.
pub fn status_kib(pid: u32, field: &str) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    for line in s.lines() {
        if let Some(v) = line.strip_prefix(field).and_then(|r| r.strip_prefix(':')) {
            let num = v.split_whitespace().next().context("empty field")?;
            return Ok(num.parse()?);
        }
    }
    bail!("{field} not in /proc/{pid}/status")
}

/// Resets the process's peak RSS (VmHWM) to its current RSS (`echo 5 > /proc/<pid>/clear_refs`).
/// Returns false where that is not permitted.
pub fn reset_peak_rss(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// Pids whose parent is `pid`.
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Ok(f) = stat_fields(p)
            && f.get(1).and_then(|pp| pp.parse::<u32>().ok()) == Some(pid)
        {
            out.push(p);
        }
    }
    out.sort_unstable();
    out
}

/// Samples VmRSS of some processes every 20 ms on a thread until stopped; keeps the maximum.
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<HashMap<u32, u64>>>,
}

impl RssSampler {
    pub fn start(pids: Vec<u32>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut max: HashMap<u32, u64> = HashMap::new();
            loop {
                for &p in &pids {
                    if let Ok(kib) = status_kib(p, "VmRSS") {
                        let e = max.entry(p).or_insert(0);
                        *e = (*e).max(kib);
                    }
                }
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            max
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling; the largest VmRSS seen per pid, in KiB.
    pub fn finish(mut self) -> HashMap<u32, u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs a command to completion with a time limit and returns its stdout+stderr as text.
pub fn run_capture(name: &str, cmd: Command, timeout: Duration, log: &Path) -> Result<String> {
    let mut child = Child::spawn(name, cmd, StdoutMode::Collect, log)?;
    let (status, out) = child.wait_output(timeout)?;
    let text = String::from_utf8_lossy(&out).into_owned();
    if !status.success() {
        bail!("{name} exited with {status}: {}", text.trim());
    }
    Ok(text)
}

/// Whole-machine CPU time from the `cpu` line of `/proc/stat`: (busy, steal) in seconds, where
/// busy = user + nice + system (all cores; interrupt and softirq time, which on loopback is mostly
/// our own traffic's network processing, is left out).
pub fn machine_cpu() -> Option<(f64, f64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let line = s.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let get = |i: usize| v.get(i).copied().unwrap_or(0);
    let busy = get(0) + get(1) + get(2);
    Some((busy as f64 / clk_tck(), get(7) as f64 / clk_tck()))
}

/// CPU time of every process outside the benchmark, for measuring what else ran on the machine.
/// (`/proc/stat` is no good for this: on tickless and virtualised kernels its per-CPU busy time can
/// lag the per-process accounting by seconds.)
#[derive(Debug, Clone, Default)]
pub struct ForeignSnapshot {
    /// (pid, start time) → utime + stime + cutime + cstime, in ticks.
    procs: HashMap<(u32, u64), u64>,
}

impl ForeignSnapshot {
    /// Every user-space process except this one and its descendants (the peers, the upstream, the
    /// load generator) and kernel threads. A process's reaped children count through its
    /// cutime/cstime, so short-lived compiler processes of a build are seen as they finish.
    pub fn take() -> Self {
        let me = std::process::id();
        let mut info: HashMap<u32, (u32, u64, u64)> = HashMap::new();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for e in dir.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                    continue;
                };
                let Ok(f) = stat_fields(pid) else { continue };
                let num = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
                let ppid = num(1) as u32;
                let flags = num(6);
                // PF_KTHREAD
                if flags & 0x0020_0000 != 0 || pid == 2 || ppid == 2 {
                    continue;
                }
                let ticks = num(11) + num(12) + num(13) + num(14);
                let start = num(19);
                info.insert(pid, (ppid, start, ticks));
            }
        }
        let ours = |mut pid: u32| {
            for _ in 0..64 {
                if pid == me {
                    return true;
                }
                match info.get(&pid) {
                    Some(&(pp, _, _)) if pp != 0 && pp != pid => pid = pp,
                    _ => return false,
                }
            }
            false
        };
        let procs = info
            .iter()
            .filter(|(pid, _)| !ours(**pid))
            .map(|(&pid, &(_, start, ticks))| ((pid, start), ticks))
            .collect();
        Self { procs }
    }

    /// CPU seconds used by other processes between `self` and `later`.
    pub fn cpu_since(&self, later: &ForeignSnapshot) -> f64 {
        let mut ticks: i64 = 0;
        for (k, &t) in &later.procs {
            match self.procs.get(k) {
                Some(&t0) => ticks += t as i64 - t0 as i64,
                // Started during the interval: all of it.
                None => ticks += t as i64,
            }
        }
        // Exited during the interval: its whole time moved into its parent's cutime/cstime,
        // counted above; take off the part from before the interval.
        for (k, &t0) in &self.procs {
            if !later.procs.contains_key(k) {
                ticks -= t0 as i64;
            }
        }
        ticks.max(0) as f64 / clk_tck()
    }
}
