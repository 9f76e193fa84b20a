//! `spur-l4-load`: the L4 benchmark's load generator and report (`perf/l4.sh`).
//!
//! - `udp`: N sessions (one socket each, so N distinct source ports) each keep `--window`
//!   datagrams of `--size` bytes in flight to a UDP echo (directly or through a proxy): a reply
//!   frees a slot, a slot with no reply for 100 ms counts as lost and is refilled. After
//!   `--warmup-ms` (sessions established in the proxy) it measures for `--duration-ms` or
//!   `--count` echoed datagrams, whichever comes first, reading the CPU time (utime + stime
//!   from `/proc/<pid>/stat`) of the proxy (`--cpu-pid`, with its child processes), of the
//!   upstream and of itself at both ends of that window.
//! - `tcp`: `--conns` connections read what a TCP source sends (through the proxy or not);
//!   bytes received in the window, bounded by `--duration-ms` and `--max-bytes`.
//! - `wait`: until a UDP echo answers or a TCP source sends, bounded by `--timeout-ms`.
//! - `report FILE`: the markdown report from the JSON lines `udp` and `tcp` printed.
//!
//! Single-threaded (pin it with taskset). Prints one JSON line per run on stdout.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::BufRead as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Args, Parser, Subcommand};
use serde::{Deserialize, Serialize};
use spur_perf::bench::proc::{children_of, cpu_seconds};
use tokio::io::AsyncReadExt as _;
use tokio::net::{TcpStream, UdpSocket};

/// A datagram with no reply for this long is lost; its slot is refilled.
const RECV_TIMEOUT: Duration = Duration::from_millis(100);
const TCP_BUF: usize = 64 * 1024;

#[derive(Parser)]
#[command(
    name = "spur-l4-load",
    about = "L4 benchmark load generator (UDP echo sessions, TCP download) and report"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// UDP sessions to an echo, with a bounded window in flight each.
    Udp(UdpArgs),
    /// TCP connections reading from a source.
    Tcp(TcpArgs),
    /// Wait until a UDP echo answers (--udp) or a TCP source sends (--tcp).
    Wait(WaitArgs),
    /// The markdown report from the JSON lines of `udp` and `tcp` runs.
    Report(ReportArgs),
}

#[derive(Args, Clone)]
struct Common {
    /// Peer name, copied into the result line.
    #[arg(long, default_value = "")]
    peer: String,
    /// Round number, copied into the result line.
    #[arg(long, default_value_t = 0)]
    round: u32,
    /// Process whose CPU time is the proxy's (with its child processes); repeatable.
    #[arg(long = "cpu-pid")]
    cpu_pid: Vec<u32>,
    /// The upstream's process, for the client-core figures.
    #[arg(long)]
    upstream_pid: Option<u32>,
    #[arg(long, default_value_t = 1000)]
    warmup_ms: u64,
    #[arg(long, default_value_t = 5000)]
    duration_ms: u64,
}

#[derive(Args)]
struct UdpArgs {
    /// Echo address (repeatable; session i goes to target i mod n).
    #[arg(long = "target", required = true)]
    target: Vec<SocketAddr>,
    #[arg(long, default_value_t = 64)]
    sessions: usize,
    /// Datagrams in flight per session.
    #[arg(long, default_value_t = 2)]
    window: usize,
    /// Payload bytes per datagram.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Most echoed datagrams measured.
    #[arg(long, default_value_t = 5_000_000)]
    count: u64,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct TcpArgs {
    #[arg(long)]
    target: SocketAddr,
    #[arg(long, default_value_t = 1)]
    conns: usize,
    /// Most bytes measured.
    #[arg(long, default_value_t = 64 << 30)]
    max_bytes: u64,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct WaitArgs {
    #[arg(long, conflicts_with = "tcp", required_unless_present = "tcp")]
    udp: Option<SocketAddr>,
    #[arg(long)]
    tcp: Option<SocketAddr>,
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
}

#[derive(Args)]
struct ReportArgs {
    /// JSON lines of `udp` and `tcp` runs.
    file: PathBuf,
    /// The command that produced them, for the report.
    #[arg(long, default_value = "perf/l4.sh")]
    command: String,
    /// Peer versions and settings, one markdown line each.
    #[arg(long = "note")]
    notes: Vec<String>,
}

/// One run, as printed.
#[derive(Serialize, Deserialize, Clone)]
struct RunResult {
    kind: String,
    peer: String,
    round: u32,
    /// UDP: payload bytes; TCP: connections.
    param: u64,
    seconds: f64,
    /// UDP: datagrams echoed in the window; TCP: bytes received.
    units: u64,
    proxy_cpu_s: f64,
    upstream_cpu_s: f64,
    client_cpu_s: f64,
    /// UDP only: over the whole run (warm-up and tail included).
    sent_total: u64,
    echoed_total: u64,
    timeouts: u64,
    errors: u64,
    mismatched: u64,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Command::Report(a) = &cli.command {
        return report(a);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        match cli.command {
            Command::Udp(a) => print(&udp(a).await?),
            Command::Tcp(a) => print(&tcp(a).await?),
            Command::Wait(a) => wait(a).await,
            Command::Report(_) => Ok(()),
        }
    })
}

fn print(r: &RunResult) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string(r)?);
    Ok(())
}

/// CPU seconds of `pid` and its descendants (nginx's worker, socat's forks).
fn tree_cpu(pid: u32) -> f64 {
    let mut total = 0.0;
    let mut todo = vec![pid];
    // Bounded: a process tree deeper or wider than this is not a proxy under test.
    for _ in 0..10_000 {
        let Some(p) = todo.pop() else { break };
        total += cpu_seconds(p).unwrap_or(0.0);
        todo.extend(children_of(p));
    }
    total
}

struct Snapshot {
    at: Instant,
    units: u64,
    proxy: f64,
    upstream: f64,
    client: f64,
}

fn snapshot(c: &Common, units: u64) -> Snapshot {
    Snapshot {
        at: Instant::now(),
        units,
        proxy: c.cpu_pid.iter().map(|&p| tree_cpu(p)).sum(),
        upstream: c.upstream_pid.map_or(0.0, tree_cpu),
        client: cpu_seconds(std::process::id()).unwrap_or(0.0),
    }
}

/// Warm-up, then the measured window: until `duration` or `max` units. Returns (start, end).
async fn measure(c: &Common, units: &Cell<u64>, max: u64) -> (Snapshot, Snapshot) {
    tokio::time::sleep(Duration::from_millis(c.warmup_ms)).await;
    let start = snapshot(c, units.get());
    let deadline = start.at + Duration::from_millis(c.duration_ms);
    loop {
        tokio::time::sleep(Duration::from_millis(10)).await;
        if units.get().saturating_sub(start.units) >= max || Instant::now() >= deadline {
            break;
        }
    }
    let end = snapshot(c, units.get());
    (start, end)
}

#[derive(Default)]
struct Counters {
    stop: Cell<bool>,
    sent: Cell<u64>,
    echoed: Cell<u64>,
    timeouts: Cell<u64>,
    errors: Cell<u64>,
    mismatched: Cell<u64>,
}

fn inc(c: &Cell<u64>) {
    c.set(c.get() + 1);
}

async fn udp(a: UdpArgs) -> anyhow::Result<RunResult> {
    if a.sessions == 0 || a.window == 0 || a.size == 0 || a.size > 65_507 {
        bail!("--sessions and --window must be at least 1, --size 1 to 65507");
    }
    let counters = Rc::new(Counters::default());
    let mut tasks = Vec::with_capacity(a.sessions);
    for i in 0..a.sessions {
        let target = a.target[i % a.target.len()];
        let local: SocketAddr = if target.is_ipv4() {
            "127.0.0.1:0".parse()?
        } else {
            "[::1]:0".parse()?
        };
        let s = UdpSocket::bind(local)
            .await
            .context("binding a session socket")?;
        s.connect(target).await?;
        tasks.push(tokio::task::spawn_local(session(
            s,
            a.size,
            a.window,
            counters.clone(),
        )));
    }
    let (start, end) = measure(&a.common, &counters.echoed, a.count).await;
    counters.stop.set(true);
    for t in tasks {
        let _ = t.await;
    }
    Ok(RunResult {
        kind: "udp".into(),
        peer: a.common.peer.clone(),
        round: a.common.round,
        param: a.size as u64,
        seconds: (end.at - start.at).as_secs_f64(),
        units: end.units - start.units,
        proxy_cpu_s: end.proxy - start.proxy,
        upstream_cpu_s: end.upstream - start.upstream,
        client_cpu_s: end.client - start.client,
        sent_total: counters.sent.get(),
        echoed_total: counters.echoed.get(),
        timeouts: counters.timeouts.get(),
        errors: counters.errors.get(),
        mismatched: counters.mismatched.get(),
    })
}

/// One session: keeps `window` datagrams in flight until stopped, then collects the last
/// replies (each wait bounded by [`RECV_TIMEOUT`]).
async fn session(sock: UdpSocket, size: usize, window: usize, c: Rc<Counters>) {
    let payload = vec![0x42u8; size];
    let mut buf = vec![0u8; 65_535];
    let mut inflight = 0;
    loop {
        while !c.stop.get() && inflight < window {
            match sock.send(&payload).await {
                Ok(_) => {
                    inc(&c.sent);
                    inflight += 1;
                }
                Err(_) => {
                    inc(&c.errors);
                    break;
                }
            }
        }
        if inflight == 0 {
            if c.stop.get() {
                return;
            }
            // Every send failed (an ICMP error): try again shortly.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let got = match sock.try_recv(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                tokio::time::timeout(RECV_TIMEOUT, sock.recv(&mut buf))
                    .await
                    .ok()
            }
            r => Some(r),
        };
        match got {
            Some(Ok(n)) => {
                inflight -= 1;
                if n == size {
                    inc(&c.echoed);
                } else {
                    inc(&c.mismatched);
                }
            }
            Some(Err(_)) => {
                // An ICMP error (nothing listens): what was in flight is gone.
                inc(&c.errors);
                inflight = 0;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            None => {
                inc(&c.timeouts);
                inflight = 0;
            }
        }
    }
}

async fn tcp(a: TcpArgs) -> anyhow::Result<RunResult> {
    if a.conns == 0 {
        bail!("--conns must be at least 1");
    }
    let bytes = Rc::new(Cell::new(0u64));
    let stop = Rc::new(Cell::new(false));
    let mut tasks = Vec::with_capacity(a.conns);
    for _ in 0..a.conns {
        let mut s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(a.target))
            .await
            .context("connect timed out")?
            .with_context(|| format!("connecting to {}", a.target))?;
        let (bytes, stop) = (bytes.clone(), stop.clone());
        tasks.push(tokio::task::spawn_local(async move {
            let mut buf = vec![0u8; TCP_BUF];
            while !stop.get() {
                match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
                    Ok(Ok(n)) if n > 0 => bytes.set(bytes.get() + n as u64),
                    _ => return false,
                }
            }
            true
        }));
    }
    let (start, end) = measure(&a.common, &bytes, a.max_bytes).await;
    stop.set(true);
    let mut failed = 0;
    for t in tasks {
        if !t.await.unwrap_or(false) {
            failed += 1;
        }
    }
    Ok(RunResult {
        kind: "tcp".into(),
        peer: a.common.peer.clone(),
        round: a.common.round,
        param: a.conns as u64,
        seconds: (end.at - start.at).as_secs_f64(),
        units: end.units - start.units,
        proxy_cpu_s: end.proxy - start.proxy,
        upstream_cpu_s: end.upstream - start.upstream,
        client_cpu_s: end.client - start.client,
        sent_total: 0,
        echoed_total: 0,
        timeouts: 0,
        errors: failed,
        mismatched: 0,
    })
}

async fn wait(a: WaitArgs) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_millis(a.timeout_ms);
    while Instant::now() < deadline {
        let ok = match (a.udp, a.tcp) {
            (Some(addr), _) => {
                let s = UdpSocket::bind("127.0.0.1:0").await?;
                let mut buf = [0u8; 64];
                s.connect(addr).await.is_ok()
                    && s.send(b"probe").await.is_ok()
                    && matches!(
                        tokio::time::timeout(Duration::from_millis(200), s.recv(&mut buf)).await,
                        Ok(Ok(5))
                    )
            }
            (None, Some(addr)) => {
                let mut buf = [0u8; 64];
                match TcpStream::connect(addr).await {
                    Ok(mut s) => matches!(
                        tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await,
                        Ok(Ok(n)) if n > 0
                    ),
                    Err(_) => false,
                }
            }
            (None, None) => bail!("give --udp or --tcp"),
        };
        if ok {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("no answer within {} ms", a.timeout_ms)
}

// ---------------------------------------------------------------------------------------------
// The report.

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Median and range over rounds.
struct Stat {
    median: f64,
    min: f64,
    max: f64,
}

fn stat(v: Vec<f64>) -> Stat {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Stat {
        median: median(v),
        min,
        max,
    }
}

fn ratio(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "–".into()
    }
}

fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_owned())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{model}, {cores} cores, Linux {}", kernel.trim())
}

const PEER_ORDER: [&str; 5] = ["direct", "spur", "nginx", "haproxy", "socat"];

fn peer_rank(p: &str) -> usize {
    PEER_ORDER
        .iter()
        .position(|q| *q == p)
        .unwrap_or(PEER_ORDER.len())
}

/// Runs by (peer's place in the table, peer).
type Peers = BTreeMap<(usize, String), Vec<RunResult>>;

fn report(a: &ReportArgs) -> anyhow::Result<()> {
    let f = std::fs::File::open(&a.file).with_context(|| format!("{}", a.file.display()))?;
    let mut runs: Vec<RunResult> = Vec::new();
    for line in std::io::BufReader::new(f).lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        runs.push(serde_json::from_str(&line).with_context(|| format!("bad line {line:?}"))?);
    }
    let rounds = runs.iter().map(|r| r.round).max().map_or(0, |m| m + 1);
    // (kind, param) → peer → runs
    let mut groups: BTreeMap<(String, u64), Peers> = BTreeMap::new();
    for r in runs {
        groups
            .entry((r.kind.clone(), r.param))
            .or_default()
            .entry((peer_rank(&r.peer), r.peer.clone()))
            .or_default()
            .push(r);
    }
    let date = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_default();
    println!(
        "# L4: UDP datagrams and TCP throughput through Spur, nginx stream, HAProxy and socat\n"
    );
    println!("- Machine: {}", machine());
    println!("- Date: {}", date.trim());
    println!("- Command: `{}`", a.command);
    println!("- Rounds: {rounds} (each cell: the median over rounds; ranges are min–max)");
    for n in &a.notes {
        println!("- {n}");
    }
    println!();

    // UDP.
    let udp: Vec<_> = groups.iter().filter(|((k, _), _)| k == "udp").collect();
    if !udp.is_empty() {
        println!("## UDP: echo through the proxy\n");
        println!(
            "Per echoed datagram (one datagram each way through the proxy). Proxy CPU = utime + stime of the proxy's processes over the measured window ÷ datagrams echoed in it; total CPU adds the load generator's and the upstream's (the client core). \"vs nginx\" divides by nginx's figure (below 1: Spur is cheaper), \"added over direct\" is the total CPU per datagram beyond the direct path's.\n"
        );
        println!(
            "| size | peer | datagrams/s | vs direct | proxy CPU-µs / datagram (range) | proxy CPU vs nginx | total CPU-µs / datagram | added over direct | lost |"
        );
        println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
        for ((_, size), peers) in &udp {
            let rate = |runs: &[RunResult]| {
                stat(runs.iter().map(|r| r.units as f64 / r.seconds).collect())
            };
            let per = |runs: &[RunResult], f: &dyn Fn(&RunResult) -> f64| {
                stat(
                    runs.iter()
                        .filter(|r| r.units > 0)
                        .map(|r| f(r) * 1e6 / r.units as f64)
                        .collect(),
                )
            };
            let find = |name: &str| {
                peers
                    .iter()
                    .find(|((_, p), _)| p == name)
                    .map(|(_, v)| v.as_slice())
            };
            let direct_rate = find("direct").map_or(f64::NAN, |r| rate(r).median);
            let direct_total = find("direct").map_or(f64::NAN, |r| {
                per(r, &|x| x.proxy_cpu_s + x.client_cpu_s + x.upstream_cpu_s).median
            });
            let nginx_cpu = find("nginx").map_or(f64::NAN, |r| per(r, &|x| x.proxy_cpu_s).median);
            for ((_, peer), runs) in peers.iter() {
                let rt = rate(runs);
                let cpu = per(runs, &|x| x.proxy_cpu_s);
                let total = per(runs, &|x| x.proxy_cpu_s + x.client_cpu_s + x.upstream_cpu_s);
                let sent: u64 = runs.iter().map(|r| r.sent_total).sum();
                let echoed: u64 = runs.iter().map(|r| r.echoed_total).sum();
                let lost = if sent > 0 {
                    format!(
                        "{:.3} %",
                        100.0 * sent.saturating_sub(echoed) as f64 / sent as f64
                    )
                } else {
                    "–".into()
                };
                let is_direct = peer == "direct";
                println!(
                    "| {size} B | {peer} | {:.0} | {} | {} | {} | {:.1} | {} | {lost} |",
                    rt.median,
                    if is_direct {
                        "1.00×".into()
                    } else {
                        ratio(rt.median, direct_rate)
                    },
                    if is_direct {
                        "–".into()
                    } else {
                        format!("{:.2} ({:.2}–{:.2})", cpu.median, cpu.min, cpu.max)
                    },
                    if is_direct || peer == "nginx" {
                        "–".into()
                    } else {
                        ratio(cpu.median, nginx_cpu)
                    },
                    total.median,
                    if is_direct {
                        "–".into()
                    } else {
                        format!("{:+.1}", total.median - direct_total)
                    },
                );
            }
        }
        println!();
    }

    // TCP.
    let tcp: Vec<_> = groups.iter().filter(|((k, _), _)| k == "tcp").collect();
    if !tcp.is_empty() {
        println!("## TCP: download from a source through the proxy\n");
        println!(
            "MB = 10⁶ bytes received by the client in the measured window. Proxy CPU per GB = the proxy's CPU seconds over the window ÷ GB moved.\n"
        );
        println!(
            "| connections | peer | MB/s (range) | vs direct | proxy CPU-s / GB (range) | proxy CPU vs nginx | failed connections |"
        );
        println!("|---:|---|---:|---:|---:|---:|---:|");
        for ((_, conns), peers) in &tcp {
            let mbps = |runs: &[RunResult]| {
                stat(
                    runs.iter()
                        .map(|r| r.units as f64 / r.seconds / 1e6)
                        .collect(),
                )
            };
            let cpu_gb = |runs: &[RunResult]| {
                stat(
                    runs.iter()
                        .filter(|r| r.units > 0)
                        .map(|r| r.proxy_cpu_s / (r.units as f64 / 1e9))
                        .collect(),
                )
            };
            let find = |name: &str| {
                peers
                    .iter()
                    .find(|((_, p), _)| p == name)
                    .map(|(_, v)| v.as_slice())
            };
            let direct = find("direct").map_or(f64::NAN, |r| mbps(r).median);
            let nginx = find("nginx").map_or(f64::NAN, |r| cpu_gb(r).median);
            for ((_, peer), runs) in peers.iter() {
                let t = mbps(runs);
                let c = cpu_gb(runs);
                let failed: u64 = runs.iter().map(|r| r.errors).sum();
                let is_direct = peer == "direct";
                println!(
                    "| {conns} | {peer} | {:.0} ({:.0}–{:.0}) | {} | {} | {} | {failed} |",
                    t.median,
                    t.min,
                    t.max,
                    if is_direct {
                        "1.00×".into()
                    } else {
                        ratio(t.median, direct)
                    },
                    if is_direct {
                        "–".into()
                    } else {
                        format!("{:.3} ({:.3}–{:.3})", c.median, c.min, c.max)
                    },
                    if is_direct || peer == "nginx" {
                        "–".into()
                    } else {
                        ratio(c.median, nginx)
                    },
                );
            }
        }
        println!();
    }
    Ok(())
}
