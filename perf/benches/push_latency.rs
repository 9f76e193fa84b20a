//! Push latency of the route server: from a routing-rule change to the new table being live at N
//! sidecar watchers (N = 1, 100, 1 000) with 10 000 rules in the index, and memory per watcher.
//!
//! Run with `cargo bench -p spur-perf --bench push_latency`; see `perf/README.md`.
//!
//! - The route server runs in its own process (this binary re-executed with `--serve`), so its
//!   resident memory can be read from `/proc/<pid>/status` with and without watchers.
//! - The watchers are N real sidecar clients ([`RouteServerSource`]) in this process, each with
//!   its own table, publisher and HTTP/2 connection, all watching the same baseline (N replicas of
//!   one workload), so every change reaches all N.
//! - A change is a rewrite (write + rename) of the watched baseline's rule file flipping one
//!   destination port. Latency is taken per watcher, from the rename and from the index
//!   publication (the server reports its publication times on stdout, as wall-clock time, which
//!   both processes share), to the moment that watcher stored a table that holds the new port.
//!   The server's own `push_latency_seconds` histogram is read from `/metrics` at the end.
//!
//! Without `--bench` (as under `cargo test --benches`) it runs a small smoke configuration and
//! writes no results. This is a benchmark: nothing here asserts on timing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark with a broken setup should abort loudly"
)]

use std::fmt::Write as _;
use std::hash::{BuildHasher, Hasher};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use futures_util::stream::{BoxStream, SelectAll};
use hdrhistogram::Histogram;
use prometheus_client::registry::Registry;
use spur_discovery::{Publisher, RouteServerConn, RouteServerSource};
use spur_routeserver::{DirStore, Index, Metrics, RouteServer, RouteServerConfig};
use spur_routing::{BaselineWorkload, SharedTable};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout, timeout_at};
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Rules per baseline (the watched one included).
const KEYS: usize = 10;
/// Baselines per rule file (the watched baseline has a file of its own).
const BASELINES_PER_FILE: usize = 100;
const WATCHED_FILE: &str = "watched.yaml";
/// The rule whose destination port every change flips, and the workload port it maps.
const CHANGED_KEY: &str = "web-key-0";
const WORKLOAD_PORT: u16 = 8080;
const INITIAL_PORT: u16 = 8080;
const WATCH_BUFFER: usize = 1024;

const SERVER_START_TIMEOUT: Duration = Duration::from_secs(60);
const SYNC_TIMEOUT: Duration = Duration::from_secs(90);
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);
const LIVE_TIMEOUT: Duration = Duration::from_secs(10);
const SETTLE: Duration = Duration::from_millis(500);
/// Issue 20's goals: publication → live p99 at N watchers, and server memory per watcher.
const GOALS: [(usize, f64); 2] = [(1000, 20.0), (10_000, 100.0)];
const GOAL_WATCHERS: usize = 1000;
const GOAL_KIB_PER_WATCHER: f64 = 16.0;

fn watched_baseline() -> BaselineWorkload {
    BaselineWorkload {
        kind: "Deployment".into(),
        namespace: "bench".into(),
        name: "web".into(),
    }
}

#[derive(Debug, Clone)]
struct Config {
    /// Total baselines, the watched one included; rules = baselines × KEYS.
    baselines: usize,
    watchers: Vec<usize>,
    changes: usize,
    poll: Duration,
    /// A control phase at the largest N with the server's default poll interval (1 s), where
    /// the directory store's polling does not compete with the push path for the CPUs.
    control_poll: Option<Duration>,
    /// Pause after a change is live everywhere (or timed out) before the next one.
    spacing: Duration,
    results: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--serve") {
        return serve(&args[i + 1..]);
    }
    let bench = args.iter().any(|a| a == "--bench");
    let env_num = |name: &str| -> Result<Option<u64>> {
        std::env::var(name)
            .ok()
            .map(|v| {
                v.trim()
                    .parse::<u64>()
                    .with_context(|| format!("{name}={v}"))
            })
            .transpose()
    };
    let mut config = if bench {
        Config {
            baselines: 1000,
            watchers: vec![1, 100, 1000, 10_000],
            changes: 30,
            poll: Duration::from_millis(5),
            control_poll: Some(Duration::from_secs(1)),
            spacing: Duration::from_millis(100),
            results: Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("results/push_latency.md")),
        }
    } else {
        println!(
            "push_latency: smoke run (pass --bench, as `cargo bench` does, for the full benchmark)"
        );
        Config {
            baselines: 100,
            watchers: vec![1, 10],
            changes: 3,
            poll: Duration::from_millis(5),
            control_poll: None,
            spacing: Duration::from_millis(100),
            results: None,
        }
    };
    if let Ok(list) = std::env::var("SPUR_BENCH_WATCHERS") {
        config.watchers = list
            .split(',')
            .map(|n| {
                n.trim()
                    .parse::<usize>()
                    .with_context(|| format!("SPUR_BENCH_WATCHERS={list}"))
            })
            .collect::<Result<_>>()?;
    }
    if let Some(c) = env_num("SPUR_BENCH_CHANGES")? {
        config.changes = usize::try_from(c)?;
    }
    if let Some(ms) = env_num("SPUR_BENCH_POLL_MS")? {
        config.poll = Duration::from_millis(ms);
    }
    if let Some(ms) = env_num("SPUR_BENCH_CONTROL_POLL_MS")? {
        config.control_poll = (ms > 0).then(|| Duration::from_millis(ms));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // On a worker, like the clients it observes: a task woken by a worker runs next on that
    // worker, where `block_on`'s thread would be unparked through a futex per wake-up.
    runtime.block_on(async { tokio::spawn(run(config)).await? })
}

// === route-server process ===

/// `--serve <rules_dir> <addr_file> <poll_ms>`: runs the route server until stdin closes (the
/// parent exited) or the process is killed. Writes "<grpc addr> <http addr>" to `addr_file` once
/// the rules are loaded, and a line "published <version> <unix nanos>" on stdout per index version.
fn serve(args: &[String]) -> Result<()> {
    let [rules_dir, addr_file, poll_ms, ..] = args else {
        bail!("usage: push_latency --serve <rules_dir> <addr_file> <poll_ms>");
    };
    let config = RouteServerConfig {
        rules_dir: rules_dir.into(),
        poll_interval: Duration::from_millis(poll_ms.parse()?),
        grpc_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        watch_buffer: WATCH_BUFFER,
        // Loopback only, like the watchers: what is measured is the push, not TLS.
        ..RouteServerConfig::new(rules_dir)
    };
    // The same runtime and HTTP/2 buffers as `spur-routeserver`.
    spur_routeserver::size_h2_buffers();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let server = RouteServer::start(config).await?;
        let mut snapshots = server.index().subscribe();
        tokio::spawn(async move {
            loop {
                let (version, published) = {
                    let s = snapshots.borrow_and_update();
                    (s.version, SystemTime::now() - s.published.elapsed())
                };
                let nanos = published
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos();
                println!("published {version} {nanos}");
                if snapshots.changed().await.is_err() {
                    return;
                }
            }
        });
        let tmp = format!("{addr_file}.tmp");
        std::fs::write(&tmp, format!("{} {}\n", server.grpc_addr, server.http_addr))?;
        std::fs::rename(&tmp, addr_file)?;
        tokio::task::spawn_blocking(|| {
            std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink())
        })
        .await??;
        server.shutdown().await;
        Ok(())
    })
}

/// The route-server child process; killed on drop (also when the benchmark panics).
struct ServerProcess {
    child: Child,
    grpc: SocketAddr,
    http: SocketAddr,
    /// (index version, wall-clock publication time), as the server reports them.
    published: mpsc::UnboundedReceiver<(u64, SystemTime)>,
}

impl ServerProcess {
    async fn spawn(rules_dir: &Path, work: &Path, poll: Duration) -> Result<Self> {
        let addr_file = work.join("server.addr");
        let _ = std::fs::remove_file(&addr_file);
        // SPUR_BENCH_SERVER_WRAPPER runs the server under a profiler, e.g.
        // `valgrind --tool=dhat --dhat-out-file=/tmp/rs.dhat`, to see what a watcher costs.
        let exe = std::env::current_exe()?;
        let wrapper = std::env::var("SPUR_BENCH_SERVER_WRAPPER").unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        let mut command = match words.next() {
            Some(program) => {
                let mut c = Command::new(program);
                c.args(words).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let mut child = command
            .arg("--serve")
            .arg(rules_dir)
            .arg(&addr_file)
            .arg(poll.as_millis().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start the route-server process")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (tx, published) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                let mut parts = line.split_whitespace();
                if parts.next() != Some("published") {
                    continue;
                }
                let (Some(Ok(version)), Some(Ok(nanos))) = (
                    parts.next().map(str::parse::<u64>),
                    parts.next().map(str::parse::<u64>),
                ) else {
                    continue;
                };
                if tx
                    .send((version, UNIX_EPOCH + Duration::from_nanos(nanos)))
                    .is_err()
                {
                    return;
                }
            }
        });
        let mut process = ServerProcess {
            child,
            grpc: SocketAddr::from(([0, 0, 0, 0], 0)),
            http: SocketAddr::from(([0, 0, 0, 0], 0)),
            published,
        };
        let deadline = Instant::now() + SERVER_START_TIMEOUT;
        let text = loop {
            if let Ok(text) = std::fs::read_to_string(&addr_file) {
                break text;
            }
            if let Some(status) = process.child.try_wait()? {
                bail!("route-server process exited early: {status}");
            }
            if Instant::now() > deadline {
                bail!("route server not up after {SERVER_START_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let mut addrs = text.split_whitespace();
        process.grpc = addrs.next().context("no gRPC address")?.parse()?;
        process.http = addrs.next().context("no HTTP address")?.parse()?;
        Ok(process)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next publication with a version above `after`.
    async fn next_publication(
        &mut self,
        after: u64,
        deadline: Instant,
    ) -> Option<(u64, SystemTime)> {
        loop {
            match timeout_at(deadline, self.published.recv()).await {
                Ok(Some((v, t))) if v > after => return Some((v, t)),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return None,
            }
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        // Closing stdin asks the server to shut down, so a profiler around it (see
        // SPUR_BENCH_SERVER_WRAPPER) can write its output; kill it if it does not.
        drop(self.child.stdin.take());
        for _ in 0..600 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// === rules ===

fn rule_yaml(out: &mut String, ns: &str, name: &str, key: &str, sandbox: &str, port: u16) {
    let _ = writeln!(
        out,
        "- routingKey: {key}\n  baseline: {{kind: Deployment, namespace: {ns}, name: {name}}}\n  \
         destinationSandbox: {{name: {sandbox}}}\n  mappings: [{{workloadPort: {WORKLOAD_PORT}, \
         destinations: [{{host: {sandbox}.bench.svc, port: {port}}}]}}]"
    );
}

/// The watched baseline's rules, with `port` as the destination port of [`CHANGED_KEY`].
fn watched_yaml(port: u16) -> String {
    let b = watched_baseline();
    let mut out = String::new();
    for k in 0..KEYS {
        let p = if k == 0 { port } else { INITIAL_PORT };
        rule_yaml(
            &mut out,
            &b.namespace,
            &b.name,
            &format!("web-key-{k}"),
            &format!("web-sb-{k}"),
            p,
        );
    }
    out
}

/// Writes `baselines × KEYS` rules: the watched baseline in its own file, the others
/// `BASELINES_PER_FILE` to a file. Returns the number of files.
fn write_rules(dir: &Path, baselines: usize) -> Result<usize> {
    std::fs::write(dir.join(WATCHED_FILE), watched_yaml(INITIAL_PORT))?;
    let mut files = 1;
    let others: Vec<usize> = (1..baselines).collect();
    for chunk in others.chunks(BASELINES_PER_FILE) {
        let mut out = String::new();
        for &b in chunk {
            for k in 0..KEYS {
                let sandbox = format!("sb-{b}-{k}");
                rule_yaml(
                    &mut out,
                    &format!("ns-{}", b % 20),
                    &format!("svc-{b}"),
                    &format!("rk{b:05}k{k:02}"),
                    &sandbox,
                    INITIAL_PORT,
                );
            }
        }
        std::fs::write(dir.join(format!("rules-{files:03}.yaml")), out)?;
        files += 1;
    }
    Ok(files)
}

/// Replaces the watched file atomically (the store skips hidden files, so the temp file is never
/// read) and returns the time of the rename.
fn change_watched(dir: &Path, port: u16) -> Result<SystemTime> {
    let tmp = dir.join(".watched.yaml.tmp");
    std::fs::write(&tmp, watched_yaml(port))?;
    let t = SystemTime::now();
    std::fs::rename(&tmp, dir.join(WATCHED_FILE))?;
    Ok(t)
}

// === watchers ===

/// N sidecar clients and what this process learns of their tables.
struct Watchers {
    stop: CancellationToken,
    tasks: TaskTracker,
    /// Each watcher's table, read when its publisher announces a version.
    tables: Vec<SharedTable>,
    /// Kept for the life of the clients: each publisher's and source's metrics.
    _registries: Vec<Registry>,
    /// The index of a watcher whose publisher announced a version, with the version.
    announced: SelectAll<BoxStream<'static, (usize, u64)>>,
    synced: Vec<bool>,
    synced_count: usize,
}

/// Starts `n` sidecar clients, each with its own table, publisher, registry and connection.
/// Their publishers' announcements are read here, by the task that measures (see
/// [`Watchers::next_live`]), not by a task per client: the observer is not what is measured.
fn start_watchers(n: usize, grpc: SocketAddr) -> Result<Watchers> {
    let stop = CancellationToken::new();
    let tasks = TaskTracker::new();
    let addr = grpc.to_string();
    let mut tables = Vec::with_capacity(n);
    let mut registries = Vec::with_capacity(n);
    let mut announced = SelectAll::new();
    for i in 0..n {
        let table = SharedTable::new();
        let mut registry = Registry::default();
        let publisher = Publisher::new(table.clone(), &mut registry);
        let published = WatchStream::from_changes(publisher.subscribe());
        let source = RouteServerSource::new(
            RouteServerConn::plain(addr.clone()),
            watched_baseline(),
            publisher,
            &mut registry,
        )?;
        tasks.spawn(source.run(stop.clone()));
        announced.push(published.map(move |v| (i, v)).boxed());
        tables.push(table);
        registries.push(registry);
    }
    Ok(Watchers {
        stop,
        tasks,
        tables,
        _registries: registries,
        announced,
        synced: vec![false; n],
        synced_count: 0,
    })
}

impl Watchers {
    /// The next table a publisher announced: (watcher, the changed rule's destination port in
    /// it, when that table was stored). None at `deadline`.
    async fn next_live(&mut self, deadline: Instant) -> Option<(usize, Option<u16>, SystemTime)> {
        let (i, version) = timeout_at(deadline, self.announced.next()).await.ok()??;
        let snapshot = self.tables[i].load();
        // The moment the table was stored, not when this task got to it.
        let at = snapshot.published.unwrap_or_else(SystemTime::now);
        let port = snapshot
            .table
            .lookup(&watched_baseline(), WORKLOAD_PORT, CHANGED_KEY)
            .map(|d| d.location.port);
        if version >= 1 && !self.synced[i] {
            self.synced[i] = true;
            self.synced_count += 1;
        }
        Some((i, port, at))
    }

    async fn wait_synced(&mut self) -> Result<()> {
        let n = self.synced.len();
        let deadline = Instant::now() + SYNC_TIMEOUT;
        while self.synced_count < n {
            if self.next_live(deadline).await.is_none() {
                bail!(
                    "only {} of {n} watchers synced after {SYNC_TIMEOUT:?}",
                    self.synced_count
                );
            }
        }
        Ok(())
    }

    /// When each watcher's table first held `port` (None: not within the deadline).
    async fn wait_live(&mut self, port: u16, deadline: Instant) -> Vec<Option<SystemTime>> {
        let n = self.tables.len();
        let mut live = vec![None; n];
        let mut count = 0;
        while count < n {
            match self.next_live(deadline).await {
                Some((i, Some(p), at)) if p == port && live[i].is_none() => {
                    live[i] = Some(at);
                    count += 1;
                }
                Some(_) => {}
                None => break,
            }
        }
        live
    }

    async fn stop(self) {
        self.stop.cancel();
        self.tasks.close();
        let _ = timeout(Duration::from_secs(10), self.tasks.wait()).await;
    }
}

// === measurements ===

/// Resident set size of a process, in KiB.
fn rss_kib(pid: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("bad VmRSS")?
        .parse()?)
}

/// User + system CPU time of a process, in clock ticks (USER_HZ, 100 on Linux).
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after_comm = stat.rsplit_once(')').context("bad stat")?.1;
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // After "pid (comm)": state is field 3, utime 14, stime 15.
    Ok(fields.get(11).context("no utime")?.parse::<u64>()?
        + fields.get(12).context("no stime")?.parse::<u64>()?)
}

async fn http_get(addr: SocketAddr, path: &str) -> Result<String> {
    let mut stream =
        timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr)).await??;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut body = Vec::new();
    timeout(Duration::from_secs(10), stream.read_to_end(&mut body)).await??;
    let text = String::from_utf8_lossy(&body).into_owned();
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or(text))
}

/// Cumulative buckets `(le, count)` of a histogram in OpenMetrics text.
fn histogram_buckets(text: &str, name: &str) -> Vec<(f64, u64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|l| {
            let (le, rest) = l.strip_prefix(&prefix)?.split_once("\"}")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, rest.split_whitespace().next()?.parse().ok()?))
        })
        .collect()
}

fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(name)?
            .strip_prefix(' ')?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// A quantile estimated from cumulative buckets by linear interpolation within the bucket
/// (as Prometheus' `histogram_quantile` does), with the bucket's bounds. Seconds.
fn bucket_quantile(buckets: &[(f64, u64)], q: f64) -> Option<(f64, f64, f64)> {
    let total = buckets.last()?.1;
    if total == 0 {
        return None;
    }
    #[allow(clippy::cast_precision_loss, reason = "counts far below 2^52")]
    let rank = q * total as f64;
    let (mut lo, mut below) = (0.0, 0u64);
    for &(le, count) in buckets {
        #[allow(clippy::cast_precision_loss, reason = "counts far below 2^52")]
        if count as f64 >= rank && count > below {
            if le.is_infinite() {
                return Some((lo, lo, le));
            }
            #[allow(clippy::cast_precision_loss, reason = "counts far below 2^52")]
            let frac = (rank - below as f64) / (count - below) as f64;
            return Some((lo + (le - lo) * frac, lo, le));
        }
        (lo, below) = (le, count);
    }
    None
}

/// A random duration in [0, max).
fn jitter(max: Duration) -> Duration {
    // RandomState is randomly seeded per instance: a dependency-free source of randomness.
    let r = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    Duration::from_nanos(r % u64::try_from(max.as_nanos()).unwrap_or(u64::MAX).max(1))
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 120_000_000, 3).expect("valid histogram bounds")
}

fn micros(later: SystemTime, earlier: SystemTime) -> u64 {
    // A negative difference (clock step) is recorded as the smallest value.
    later.duration_since(earlier).map_or(1, |d| {
        u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
    })
}

#[allow(clippy::cast_precision_loss, reason = "display only")]
fn ms(us: u64) -> String {
    format!("{:.1}", us as f64 / 1000.0)
}

#[allow(clippy::cast_precision_loss, reason = "display only")]
fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// p50 / p90 / p99 / max in ms.
fn quantiles(h: &Histogram<u64>) -> [String; 4] {
    if h.is_empty() {
        return ["–".into(), "–".into(), "–".into(), "–".into()];
    }
    [
        ms(h.value_at_quantile(0.5)),
        ms(h.value_at_quantile(0.9)),
        ms(h.value_at_quantile(0.99)),
        ms(h.max()),
    ]
}

struct PhaseResult {
    n: usize,
    poll: Duration,
    /// Per watcher and change: rename → live, publication → live (µs).
    from_rename: Histogram<u64>,
    from_publish: Histogram<u64>,
    /// Per change: rename → publication, and publication → live at the slowest watcher (µs).
    detection: Histogram<u64>,
    all_live: Histogram<u64>,
    missed_live: usize,
    missed_publish: usize,
    server_pushes: Option<f64>,
    /// Server histogram estimates: (p50, p99) as (estimate, bucket low, bucket high) seconds.
    server_p50: Option<(f64, f64, f64)>,
    server_p99: Option<(f64, f64, f64)>,
    server_idle_cpu_pct: f64,
    server_rss_idle: u64,
    server_rss_watched: u64,
    client_rss_before: u64,
    client_rss_watched: u64,
    connect_secs: f64,
}

/// `pass`: what one directory-store pass costs; the pause between changes gets a random extra
/// of up to one poll cycle (interval + pass), so that changes land at random points of it.
async fn phase(
    config: &Config,
    rules_dir: &Path,
    work: &Path,
    n: usize,
    poll: Duration,
    pass: Duration,
) -> Result<PhaseResult> {
    std::fs::write(rules_dir.join(WATCHED_FILE), watched_yaml(INITIAL_PORT))?;
    let mut server = ServerProcess::spawn(rules_dir, work, poll).await?;
    let pid = server.pid().to_string();

    // Idle server: rules loaded, no watchers. Its CPU here is the directory store's poll loop.
    tokio::time::sleep(SETTLE).await;
    let cpu0 = cpu_ticks(server.pid())?;
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    #[allow(clippy::cast_precision_loss, reason = "display only")]
    let server_idle_cpu_pct = (cpu_ticks(server.pid())? - cpu0) as f64 / t0.elapsed().as_secs_f64();
    let server_rss_idle = rss_kib(&pid)?;
    let client_rss_before = rss_kib("self")?;

    let started = Instant::now();
    let mut watchers = start_watchers(n, server.grpc)?;
    watchers.wait_synced().await?;
    let connect_secs = started.elapsed().as_secs_f64();
    tokio::time::sleep(SETTLE).await;
    let server_rss_watched = rss_kib(&pid)?;
    let client_rss_watched = rss_kib("self")?;

    // Everything published so far (the initial load) is history.
    let mut version = 0;
    while let Ok((v, _)) = server.published.try_recv() {
        version = version.max(v);
    }

    let mut r = PhaseResult {
        n,
        poll,
        from_rename: new_histogram(),
        from_publish: new_histogram(),
        detection: new_histogram(),
        all_live: new_histogram(),
        missed_live: 0,
        missed_publish: 0,
        server_pushes: None,
        server_p50: None,
        server_p99: None,
        server_idle_cpu_pct,
        server_rss_idle,
        server_rss_watched,
        client_rss_before,
        client_rss_watched,
        connect_secs,
    };
    for c in 0..config.changes {
        let port = INITIAL_PORT + 1 + u16::try_from(c % 50_000)?;
        let renamed = change_watched(rules_dir, port)?;
        let deadline = Instant::now() + LIVE_TIMEOUT;
        // Both at once: the watchers' announcements are read by this task.
        let (publication, live) = tokio::join!(
            server.next_publication(version, Instant::now() + PUBLISH_TIMEOUT),
            watchers.wait_live(port, deadline),
        );
        match publication {
            Some((v, at)) => {
                version = v;
                r.detection.record(micros(at, renamed))?;
                let slowest = live.iter().flatten().max();
                if let Some(&slowest) = slowest
                    && live.iter().all(Option::is_some)
                {
                    r.all_live.record(micros(slowest, at))?;
                }
                for &t in live.iter().flatten() {
                    r.from_publish.record(micros(t, at))?;
                }
            }
            None => r.missed_publish += 1,
        }
        for t in &live {
            match t {
                Some(t) => r.from_rename.record(micros(*t, renamed))?,
                None => r.missed_live += 1,
            }
        }
        tokio::time::sleep(config.spacing + jitter(poll + pass)).await;
    }

    match http_get(server.http, "/metrics").await {
        Ok(text) => {
            let buckets = histogram_buckets(&text, "spur_routeserver_push_latency_seconds");
            r.server_p50 = bucket_quantile(&buckets, 0.5);
            r.server_p99 = bucket_quantile(&buckets, 0.99);
            r.server_pushes = metric_value(&text, "spur_routeserver_pushes_total");
        }
        Err(e) => eprintln!("push_latency: cannot read /metrics: {e:#}"),
    }
    watchers.stop().await;
    drop(server);
    Ok(r)
}

/// What one pass of the directory store costs, measured in this process: the first (loading
/// everything) and the median of later passes over unchanged files, which the server repeats
/// every poll interval.
struct PollCost {
    load: Duration,
    unchanged: Duration,
}

fn poll_cost(rules_dir: &Path, rules: usize) -> Result<PollCost> {
    let index = Index::new();
    let metrics = Metrics::register(&mut Registry::default());
    let mut store = DirStore::new(rules_dir, Duration::from_secs(1));
    let t = std::time::Instant::now();
    let problems = store.poll_once(&index, &metrics);
    let load = t.elapsed();
    if !problems.is_empty() || index.current().rules.len() != rules {
        bail!(
            "generated rules do not load cleanly ({} rules): {problems:?}",
            index.current().rules.len()
        );
    }
    let mut passes: Vec<Duration> = (0..9)
        .map(|_| {
            let t = std::time::Instant::now();
            store.poll_once(&index, &metrics);
            t.elapsed()
        })
        .collect();
    passes.sort();
    Ok(PollCost {
        load,
        unchanged: passes[passes.len() / 2],
    })
}

async fn run(config: Config) -> Result<()> {
    let work = tempfile::tempdir()?;
    let rules_dir = work.path().join("rules");
    std::fs::create_dir(&rules_dir)?;
    let files = write_rules(&rules_dir, config.baselines)?;
    let rules = config.baselines * KEYS;
    let cost = poll_cost(&rules_dir, rules)?;
    let mut phases: Vec<(usize, Duration)> =
        config.watchers.iter().map(|&n| (n, config.poll)).collect();
    if let (Some(poll), Some(&n)) = (config.control_poll, config.watchers.iter().max()) {
        phases.push((n, poll));
    }
    println!(
        "push_latency: {rules} rules in {files} files; one directory-store pass: load {:.1} ms, unchanged {:.1} ms; \
         phases (watchers, poll) {phases:?}, {} changes each",
        cost.load.as_secs_f64() * 1000.0,
        cost.unchanged.as_secs_f64() * 1000.0,
        config.changes
    );
    let mut results = Vec::new();
    for &(n, poll) in &phases {
        let r = phase(&config, &rules_dir, work.path(), n, poll, cost.unchanged)
            .await
            .with_context(|| format!("N = {n}, poll {poll:?}"))?;
        println!(
            "  N = {n:>5}, poll {:>4} ms: rename→live p50 {} p99 {} max {} ms; publication→live p99 {} ms; missed {}",
            poll.as_millis(),
            ms(r.from_rename.value_at_quantile(0.5)),
            ms(r.from_rename.value_at_quantile(0.99)),
            ms(r.from_rename.max()),
            ms(r.from_publish.value_at_quantile(0.99)),
            r.missed_live
        );
        results.push(r);
    }
    let report = report(&config, rules, files, &cost, &results);
    println!("\n{report}");
    if let Some(path) = &config.results {
        std::fs::create_dir_all(path.parent().context("results path")?)?;
        std::fs::write(path, &report)?;
        println!("written to {}", path.display());
    }
    Ok(())
}

// === report ===

fn report(
    config: &Config,
    rules: usize,
    files: usize,
    cost: &PollCost,
    results: &[PhaseResult],
) -> String {
    let mut s = String::new();
    let cpus = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "?".into(), |k| k.trim().to_string());
    let secs_ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let _ = writeln!(s, "# Route server push latency\n");
    let _ = writeln!(s, "- Date: {}", utc_now());
    let _ = writeln!(
        s,
        "- Machine: {cpus} CPUs (`nproc`), {model}, Linux {kernel}; shared and noisy; one run"
    );
    let _ = writeln!(
        s,
        "- Command: `cargo bench -p spur-perf --bench push_latency` (bench profile: release, thin LTO)"
    );
    let _ = writeln!(
        s,
        "- Index: {rules} rules ({} baselines × {KEYS} routing keys) in {files} YAML files, served by `RouteServer` \
         (directory store, watch buffer {WATCH_BUFFER}, HTTP/2 buffers {} B write / {} B read as in \
         `spur-routeserver`) in its own process",
        config.baselines,
        spur_routeserver::H2_BUFFERS.0,
        spur_routeserver::H2_BUFFERS.1
    );
    let _ = writeln!(
        s,
        "- Rule directory poll interval: {} ms (so that detection adds little), plus one control run at the \
         server's default of 1 000 ms (last row). One directory-store pass over these files costs {:.1} ms when \
         nothing changed ({:.1} ms for the first load), measured in the bench process",
        config.poll.as_millis(),
        secs_ms(cost.unchanged),
        secs_ms(cost.load)
    );
    let _ = writeln!(
        s,
        "- Watchers: N real sidecar clients (`RouteServerSource`, one HTTP/2 connection each) in the bench process, \
         all watching `Deployment/bench/web` ({KEYS} rules); server and clients share the same {cpus} CPUs"
    );
    let _ = writeln!(
        s,
        "- Changes: {} per row, each a rewrite (write + rename) of that baseline's file flipping one destination \
         port; the next change {} ms plus a random 0 to one poll cycle (interval + one pass) after the previous one \
         is live everywhere, so that changes land at random points of the poll cycle\n",
        config.changes,
        config.spacing.as_millis()
    );

    let _ = writeln!(
        s,
        "## Latency until the new table is live, per watcher and change (ms)\n"
    );
    let _ = writeln!(
        s,
        "| watchers | poll | samples | rename→live p50 | p90 | p99 | max | publication→live p50 | p90 | p99 | max \
         | all N live p50 / max | missed |"
    );
    let _ = writeln!(
        s,
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in results {
        let [a50, a90, a99, amax] = quantiles(&r.from_rename);
        let [b50, b90, b99, bmax] = quantiles(&r.from_publish);
        let all = if r.all_live.is_empty() {
            "–".into()
        } else {
            format!(
                "{} / {}",
                ms(r.all_live.value_at_quantile(0.5)),
                ms(r.all_live.max())
            )
        };
        let _ = writeln!(
            s,
            "| {} | {} ms | {} | {a50} | {a90} | {a99} | {amax} | {b50} | {b90} | {b99} | {bmax} | {all} | {} |",
            r.n,
            r.poll.as_millis(),
            r.from_rename.len(),
            if r.missed_publish == 0 {
                r.missed_live.to_string()
            } else {
                format!(
                    "{} ({} publications not seen)",
                    r.missed_live, r.missed_publish
                )
            }
        );
    }

    let _ = writeln!(s, "\n## Where the time goes\n");
    let _ = writeln!(
        s,
        "| watchers | poll | rename→publication p50 / max (ms) | server `push_latency_seconds` p50 ≈ (ms) \
         | p99 ≈ (bucket) (ms) | server pushes | server CPU, idle (poll loop) | connect + sync N |"
    );
    let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|---:|");
    let est = |q: Option<(f64, f64, f64)>, bucket: bool| match q {
        None => "–".to_string(),
        Some((v, lo, hi)) if hi.is_infinite() => format!("> {:.1}", lo.max(v) * 1000.0),
        Some((v, lo, hi)) if bucket => {
            format!("{:.1} ({:.1}–{:.1})", v * 1000.0, lo * 1000.0, hi * 1000.0)
        }
        Some((v, _, _)) => format!("{:.1}", v * 1000.0),
    };
    for r in results {
        let detection = if r.detection.is_empty() {
            "–".into()
        } else {
            format!(
                "{} / {}",
                ms(r.detection.value_at_quantile(0.5)),
                ms(r.detection.max())
            )
        };
        let _ = writeln!(
            s,
            "| {} | {} ms | {detection} | {} | {} | {} | {:.0} % of a CPU | {:.1} s |",
            r.n,
            r.poll.as_millis(),
            est(r.server_p50, false),
            est(r.server_p99, true),
            r.server_pushes
                .map_or_else(|| "–".into(), |p| format!("{p:.0}")),
            r.server_idle_cpu_pct,
            r.connect_secs
        );
    }

    let _ = writeln!(s, "\n## Memory per watcher\n");
    let _ = writeln!(
        s,
        "| watchers | poll | server RSS, 0 watchers (MiB) | server RSS, N watchers (MiB) | server KiB / watcher \
         | bench process (clients) KiB / watcher |"
    );
    let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|");
    for r in results {
        let per = |after: u64, before: u64| {
            #[allow(clippy::cast_precision_loss, reason = "display only")]
            let v = (after as f64 - before as f64) / r.n as f64;
            format!("{v:.1}")
        };
        let _ = writeln!(
            s,
            "| {} | {} ms | {} | {} | {} | {} |",
            r.n,
            r.poll.as_millis(),
            mib(r.server_rss_idle),
            mib(r.server_rss_watched),
            per(r.server_rss_watched, r.server_rss_idle),
            per(r.client_rss_watched, r.client_rss_before)
        );
    }

    let goal_rows: Vec<(&PhaseResult, f64)> = results
        .iter()
        .filter_map(|r| {
            GOALS
                .iter()
                .find(|(n, _)| *n == r.n)
                .map(|(_, ms)| (r, *ms))
        })
        .collect();
    if !goal_rows.is_empty() {
        let goals: Vec<String> = GOALS
            .iter()
            .map(|(n, ms)| format!("p99 ≤ {ms:.0} ms at {n} watchers"))
            .collect();
        let _ = writeln!(
            s,
            "\n## Goals: {}, ≤ {GOAL_KIB_PER_WATCHER:.0} KiB of server memory per watcher\n",
            goals.join(", ")
        );
    }
    for (r, goal_ms) in goal_rows {
        #[allow(clippy::cast_precision_loss, reason = "display only")]
        let p99 = |h: &Histogram<u64>| h.value_at_quantile(0.99) as f64 / 1000.0;
        let verdict = |v: f64| {
            if v <= goal_ms && r.missed_live == 0 {
                "met"
            } else {
                "missed"
            }
        };
        let (e2e, publ) = (p99(&r.from_rename), p99(&r.from_publish));
        let server = r.server_p99.map_or_else(
            || "not available".into(),
            |(v, _, hi)| format!("≈ {:.1} ms (bucket ≤ {:.1} ms)", v * 1000.0, hi * 1000.0),
        );
        #[allow(clippy::cast_precision_loss, reason = "display only")]
        let kib = r.server_rss_watched.saturating_sub(r.server_rss_idle) as f64 / r.n.max(1) as f64;
        let _ = writeln!(
            s,
            "- {} watchers, poll {} ms: **{}** from index publication (p99 {publ:.1} ms against {goal_ms:.0} ms); \
             {} end to end from the file rename (p99 {e2e:.1} ms, file detection included). The server's own \
             share, publication → operations queued on the stream, has p99 {server}. Memory: **{}** \
             ({kib:.1} KiB per watcher).",
            r.n,
            r.poll.as_millis(),
            verdict(publ),
            verdict(e2e),
            if kib <= GOAL_KIB_PER_WATCHER {
                "met"
            } else {
                "missed"
            },
        );
    }

    let fast = results
        .iter()
        .find(|r| r.n == GOAL_WATCHERS && r.poll == config.poll);
    let control = results
        .iter()
        .find(|r| r.n == GOAL_WATCHERS && Some(r.poll) == config.control_poll);
    if let (Some(f), Some(c)) = (fast, control) {
        let server = |r: &PhaseResult| r.server_p99.map_or(f64::NAN, |(v, _, _)| v * 1000.0);
        #[allow(clippy::cast_precision_loss, reason = "display only")]
        let p99 = |h: &Histogram<u64>| h.value_at_quantile(0.99) as f64 / 1000.0;
        let _ = writeln!(
            s,
            "- The two rows differ only in the poll interval. At {} ms the directory store keeps {:.0} % of a CPU \
             busy with no change at all (every pass re-reads all files and rebuilds the {rules}-rule set, \
             {:.1} ms here, on a runtime worker), against {:.0} % at {} ms. With that polling, the server's own \
             p99 is ≈ {:.1} ms instead of ≈ {:.1} ms, and publication→live p99 {:.1} ms instead of {:.1} ms.",
            f.poll.as_millis(),
            f.server_idle_cpu_pct,
            secs_ms(cost.unchanged),
            c.server_idle_cpu_pct,
            c.poll.as_millis(),
            server(f),
            server(c),
            p99(&f.from_publish),
            p99(&c.from_publish),
        );
    }

    let _ = writeln!(
        s,
        "\n## How to read this\n\n\
         Each sample is one watcher seeing one change: the time from the rule file's rename, or from the index \
         publication (the server process reports it as wall-clock time, which both processes share), until that \
         watcher stored a table holding the new destination (the moment its requests started using it). *rename→live* adds file detection: \
         up to one poll interval plus one directory-store pass (*rename→publication*). *publication→live* is the \
         route server's push path and the client: the watch stream computing the change (in its HTTP/2 stream's \
         task), gRPC encoding, HTTP/2 over \
         loopback, decoding, validation, the table swap. *all N live* is, per change, the time from publication \
         until the last of the N watchers had it. The server's own histogram covers only publication → operations \
         queued on each watch stream; its quantiles are bucket estimates (buckets double from 0.1 ms). The N \
         clients run in the bench process on the same CPUs as the server, so at large N their work (N connections \
         decoding and swapping tables) and the server's directory polling compete with the push path; N sidecars \
         on N pods would not. Memory is resident-set growth from 0 to N synced watchers divided by N, so the \
         N = 1 row is dominated by one-off allocations; the bench-process figure can be understated for later rows \
         because memory freed by earlier rows is reused. With {} changes per row, p99 is close to the maximum for \
         N = 1.",
        config.changes
    );
    s
}

/// The current UTC time as `YYYY-MM-DD HH:MM UTC`.
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Howard Hinnant's days-from-civil inverse.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}
