//! The load generator behind `spur-load`: HTTP/1.1, h2c and gRPC-over-h2c requests against one
//! URL, in an open loop (fixed arrival rate, latency measured from each request's intended start,
//! as wrk2 does) or a closed loop (every connection × stream sends back to back).
//!
//! Work is spread over `threads` OS threads, each with its own single-threaded tokio runtime and
//! its share of the connections, so no request crosses threads and the threads share nothing but
//! the start signal. Each thread keeps its own HDR histogram; they are merged at the end.
//!
//! Counting (see [`Report`]): a request belongs to the measured window when its intended start
//! (open loop) or its actual start (closed loop) falls in `[warmup, warmup + duration)`. After the
//! window the generator waits up to `drain` for requests of the window that are still queued or in
//! flight; what is left then counts as errors (`unsent` or `timeout`), so a stalled server shows
//! up in the numbers instead of disappearing from them.

mod conn;
mod schedule;
mod worker;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail, ensure};
use hdrhistogram::Histogram;
use http::{HeaderName, HeaderValue, Uri};
use serde::{Deserialize, Serialize};

pub use conn::encode_grpc_echo_request;
pub use schedule::pacer;

/// Quantiles sampled into [`Report::percentiles`] (for plotting latency curves).
pub const PERCENTILES: [f64; 9] = [0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9999, 1.0];
/// Largest latency the histograms hold (one hour, in µs); longer ones are recorded as this.
const MAX_LATENCY_US: u64 = 3_600_000_000;

/// An open-loop request that starts later than this after its intended start counts as `late`.
pub const LATE_AFTER: Duration = Duration::from_secs(1);

/// Wire protocol of the generated requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    /// HTTP/1.1 keep-alive, one request at a time per connection.
    H1,
    /// HTTP/2 over cleartext (prior knowledge), `streams` concurrent streams per connection.
    H2,
    /// gRPC unary calls over h2c.
    Grpc,
}

/// How requests are paced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    /// Constant arrival rate (requests per second) over all connections.
    Open { rate: f64 },
    /// Every connection × stream sends its next request as soon as the previous one completes.
    Closed,
}

/// Name of the mode in the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModeName {
    Open,
    Closed,
}

/// One load run.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// `http://host:port/path`. For gRPC a bare `/` path means [`crate::upstream::GRPC_ECHO_PATH`].
    pub url: Uri,
    pub proto: Proto,
    pub connections: usize,
    /// Concurrent streams per connection (h2 and gRPC); must be 1 for HTTP/1.1.
    pub streams: usize,
    /// Extra headers sent with every request.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// gRPC: size of the `payload` field of each request message. HTTP: informational only.
    pub payload: usize,
    pub duration: Duration,
    pub warmup: Duration,
    /// How long after the window to wait for queued and in-flight requests of the window.
    pub drain: Duration,
    pub mode: Mode,
    /// Worker threads (capped at `connections`).
    pub threads: usize,
    /// For `https://` URLs: the CA certificates (PEM file) the server's chain must reach.
    pub ca_file: Option<std::path::PathBuf>,
    /// Connect here instead of resolving the URL's host (which still names the server in TLS
    /// and Host): a preview host name served on loopback.
    pub connect_to: Option<SocketAddr>,
}

impl LoadConfig {
    /// A configuration with one connection, one stream, one thread, no extra headers, no
    /// payload, 10 s measured after 2 s of warmup, and 2 s of drain.
    pub fn new(url: Uri, proto: Proto, mode: Mode) -> Self {
        Self {
            url,
            proto,
            connections: 1,
            streams: 1,
            headers: Vec::new(),
            payload: 0,
            duration: Duration::from_secs(10),
            warmup: Duration::from_secs(2),
            drain: Duration::from_secs(2),
            mode,
            threads: 1,
            ca_file: None,
            connect_to: None,
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        ensure!(self.connections >= 1, "--connections must be at least 1");
        ensure!(self.streams >= 1, "--streams must be at least 1");
        ensure!(
            self.proto != Proto::H1 || self.streams == 1,
            "HTTP/1.1 sends one request at a time per connection: use --streams 1 (or more --connections)"
        );
        ensure!(self.threads >= 1, "--threads must be at least 1");
        ensure!(!self.duration.is_zero(), "--duration must be positive");
        if let Mode::Open { rate } = self.mode {
            ensure!(
                rate.is_finite() && rate > 0.0,
                "--rate must be a positive number"
            );
        }
        match self.url.scheme_str() {
            Some("http") => {}
            Some("https") => ensure!(self.ca_file.is_some(), "an https:// --url needs --cacert"),
            _ => bail!("--url must be http:// (cleartext; h2 uses prior knowledge) or https://"),
        }
        ensure!(self.url.host().is_some(), "--url has no host");
        Ok(())
    }

    fn resolve(&self) -> anyhow::Result<SocketAddr> {
        if let Some(addr) = self.connect_to {
            return Ok(addr);
        }
        let host = self.url.host().context("--url has no host")?;
        // `Uri::host` keeps the brackets of an IPv6 literal; the resolver wants them off.
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let default = if self.url.scheme_str() == Some("https") {
            443
        } else {
            80
        };
        let port = self.url.port_u16().unwrap_or(default);
        (host, port)
            .to_socket_addrs()
            .with_context(|| format!("resolving {host}:{port}"))?
            .next()
            .with_context(|| format!("{host}:{port} resolves to no address"))
    }
}

/// Latency summary in microseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
    pub mean: f64,
}

/// Failed requests by cause. Their sum is [`Report::errors`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorKinds {
    /// No connection could be (re)established for the request.
    pub connect: u64,
    /// The request or response failed on the connection (reset, protocol error, closed).
    pub io: u64,
    /// A response with a non-2xx status.
    pub status: u64,
    /// gRPC: `grpc-status` missing or not 0.
    pub grpc_status: u64,
    /// Started but not finished by the end of the drain.
    pub timeout: u64,
    /// Open loop: due in the window but never started by the end of the drain (also `late`).
    pub unsent: u64,
}

impl ErrorKinds {
    /// All failed requests.
    pub fn total(&self) -> u64 {
        self.connect + self.io + self.status + self.grpc_status + self.timeout + self.unsent
    }

    fn add(&mut self, other: &Self) {
        self.connect += other.connect;
        self.io += other.io;
        self.status += other.status;
        self.grpc_status += other.grpc_status;
        self.timeout += other.timeout;
        self.unsent += other.unsent;
    }
}

/// Result of a run; `--json` prints exactly this.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub proto: Proto,
    pub mode: ModeName,
    /// Open loop: the configured rate; closed loop: `null`.
    pub target_rps: Option<f64>,
    pub connections: usize,
    pub streams: usize,
    /// Length of the measured window (warmup excluded).
    pub duration_s: f64,
    /// Requests of the measured window: open loop, every request due in it; closed loop, every
    /// request started in it. Successful ones plus `errors`.
    pub requests: u64,
    pub errors: u64,
    /// Open loop: requests that started more than 1 s after their intended start, plus those
    /// never started (`error_kinds.unsent`). Always 0 in a closed loop.
    pub late: u64,
    /// Successful requests per second of the window.
    pub rps: f64,
    /// Latency of successful requests: open loop from intended start, closed loop from actual
    /// start, to the end of the response body.
    pub latency_us: LatencySummary,
    /// `[quantile, µs]` at each of [`PERCENTILES`].
    pub percentiles: Vec<(f64, u64)>,
    pub threads: usize,
    pub warmup_s: f64,
    pub payload: usize,
    /// Connections re-established after the server closed one (not counted as errors).
    pub reconnects: u64,
    pub error_kinds: ErrorKinds,
}

impl Report {
    /// Human-readable summary (several lines, no trailing newline).
    pub fn summary(&self) -> String {
        let mode = match self.target_rps {
            Some(rate) => format!("open loop at {rate} rps"),
            None => "closed loop".to_owned(),
        };
        let proto = match self.proto {
            Proto::H1 => "HTTP/1.1",
            Proto::H2 => "h2c",
            Proto::Grpc => "gRPC",
        };
        let l = &self.latency_us;
        let e = &self.error_kinds;
        format!(
            "{proto}, {mode}: {} connections x {} streams on {} threads, {:.1} s after {:.1} s warmup\n\
             requests {}  errors {} (connect {}, io {}, status {}, grpc-status {}, timeout {}, unsent {})  late {}  reconnects {}\n\
             throughput {:.1} rps\n\
             latency us: p50 {}  p90 {}  p99 {}  p99.9 {}  max {}  mean {:.1}",
            self.connections,
            self.streams,
            self.threads,
            self.duration_s,
            self.warmup_s,
            self.requests,
            self.errors,
            e.connect,
            e.io,
            e.status,
            e.grpc_status,
            e.timeout,
            e.unsent,
            self.late,
            self.reconnects,
            self.rps,
            l.p50,
            l.p90,
            l.p99,
            l.p999,
            l.max,
            l.mean,
        )
    }

    /// True when the window had requests and at least one succeeded.
    pub fn any_success(&self) -> bool {
        self.requests > self.errors
    }
}

/// Counters of one worker thread (and, merged, of the run).
pub(crate) struct Stats {
    /// Latency of successful requests in µs.
    pub(crate) latency: Histogram<u64>,
    pub(crate) ok: u64,
    /// Requests of the window that started (closed) or were taken off the schedule (open).
    pub(crate) claimed: u64,
    /// Requests of the window that finished, successfully or not.
    pub(crate) finished: u64,
    pub(crate) late: u64,
    pub(crate) reconnects: u64,
    pub(crate) errors: ErrorKinds,
}

impl Stats {
    pub(crate) fn new() -> anyhow::Result<Self> {
        Ok(Self {
            // Three significant digits from 1 µs to an hour. Fixed bounds rather than
            // auto-resizing: `saturating_record` clamps to the current bounds instead of growing.
            latency: Histogram::new_with_bounds(1, MAX_LATENCY_US, 3)?,
            ok: 0,
            claimed: 0,
            finished: 0,
            late: 0,
            reconnects: 0,
            errors: ErrorKinds::default(),
        })
    }

    pub(crate) fn finish(&mut self, outcome: Result<(), conn::Failure>, latency: Duration) {
        self.finished += 1;
        match outcome {
            Ok(()) => {
                self.ok += 1;
                self.latency
                    .saturating_record(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX));
            }
            Err(conn::Failure::Connect) => self.errors.connect += 1,
            Err(conn::Failure::Io) => self.errors.io += 1,
            Err(conn::Failure::Status) => self.errors.status += 1,
            Err(conn::Failure::GrpcStatus) => self.errors.grpc_status += 1,
        }
    }

    fn merge(&mut self, other: &Self) -> anyhow::Result<()> {
        self.latency
            .add(&other.latency)
            .map_err(|e| anyhow!("merging histograms: {e:?}"))?;
        self.ok += other.ok;
        self.claimed += other.claimed;
        self.finished += other.finished;
        self.late += other.late;
        self.reconnects += other.reconnects;
        self.errors.add(&other.errors);
        Ok(())
    }
}

/// Everything a worker thread needs, shared read-only.
pub(crate) struct Plan {
    pub(crate) proto: Proto,
    pub(crate) addr: SocketAddr,
    pub(crate) template: conn::RequestTemplate,
    pub(crate) streams: usize,
    pub(crate) warmup: Duration,
    pub(crate) duration: Duration,
    pub(crate) drain: Duration,
    pub(crate) mode: Mode,
    pub(crate) threads: usize,
    pub(crate) tls: Option<conn::Tls>,
}

/// Runs the load described by `cfg` and blocks until it is over: connect, warmup, window, drain.
/// Starts its own threads and runtimes; call it from a plain thread (in async code, through
/// `spawn_blocking`).
///
/// # Errors
///
/// An invalid configuration, a target that cannot be resolved, a connection that cannot be
/// established before the start, or a worker thread that failed. Failed requests during the run
/// are no error: they are counted in the report.
pub fn run(cfg: &LoadConfig) -> anyhow::Result<Report> {
    cfg.validate()?;
    let addr = cfg.resolve()?;
    let threads = cfg.threads.min(cfg.connections);
    let plan = Arc::new(Plan {
        proto: cfg.proto,
        addr,
        template: conn::RequestTemplate::new(cfg)?,
        streams: cfg.streams,
        warmup: cfg.warmup,
        duration: cfg.duration,
        drain: cfg.drain,
        mode: cfg.mode,
        threads,
        tls: conn::Tls::new(cfg)?,
    });

    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let mut starts = Vec::with_capacity(threads);
    let mut handles = Vec::with_capacity(threads);
    for index in 0..threads {
        let connections =
            cfg.connections / threads + usize::from(index < cfg.connections % threads);
        let (start_tx, start_rx) = tokio::sync::oneshot::channel();
        starts.push(start_tx);
        handles.push(worker::spawn(
            Arc::clone(&plan),
            index,
            connections,
            ready_tx.clone(),
            start_rx,
        )?);
    }
    drop(ready_tx);

    // Every worker connects first; the clock starts once all are connected, so connection setup
    // is in neither the warmup nor the window.
    let mut failure = None;
    for _ in 0..threads {
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                failure.get_or_insert(err);
            }
            // Every worker sends exactly once and then drops its sender, so this means one
            // died before reporting; its join below says why.
            Err(_) => break,
        }
    }
    let start = Instant::now();
    for start_tx in starts {
        let _ = start_tx.send(failure.is_none().then_some(start));
    }
    let mut total = Stats::new()?;
    for handle in handles {
        match handle.join() {
            Ok(Ok(stats)) => total.merge(&stats)?,
            Ok(Err(err)) => {
                failure.get_or_insert(err);
            }
            Err(_) => {
                failure.get_or_insert(anyhow!("a load worker thread panicked"));
            }
        }
    }
    if let Some(err) = failure {
        return Err(err);
    }
    Ok(report(cfg, threads, &total))
}

fn report(cfg: &LoadConfig, threads: usize, stats: &Stats) -> Report {
    let h = &stats.latency;
    let duration_s = cfg.duration.as_secs_f64();
    let errors = stats.errors.total();
    Report {
        proto: cfg.proto,
        mode: match cfg.mode {
            Mode::Open { .. } => ModeName::Open,
            Mode::Closed => ModeName::Closed,
        },
        target_rps: match cfg.mode {
            Mode::Open { rate } => Some(rate),
            Mode::Closed => None,
        },
        connections: cfg.connections,
        streams: cfg.streams,
        duration_s,
        requests: stats.ok + errors,
        errors,
        late: stats.late + stats.errors.unsent,
        rps: stats.ok as f64 / duration_s,
        latency_us: LatencySummary {
            p50: h.value_at_quantile(0.5),
            p90: h.value_at_quantile(0.9),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
            mean: h.mean(),
        },
        percentiles: PERCENTILES
            .iter()
            .map(|&q| (q, h.value_at_quantile(q)))
            .collect(),
        threads,
        warmup_s: cfg.warmup.as_secs_f64(),
        payload: cfg.payload,
        reconnects: stats.reconnects,
        error_kinds: stats.errors.clone(),
    }
}

/// Parses a duration: a number with unit `us`, `ms`, `s`, `m` or `h`, or a bare number of
/// seconds (`10s`, `500ms`, `1.5`, `2m`).
///
/// # Errors
///
/// Not a non-negative finite number with a known unit.
pub fn parse_duration(text: &str) -> anyhow::Result<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| c.is_ascii_alphabetic())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .trim()
        .parse()
        .with_context(|| format!("{text:?} is not a duration (like 10s, 500ms, 2m)"))?;
    let scale = match unit {
        "" | "s" => 1.0,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "m" => 60.0,
        "h" => 3600.0,
        _ => bail!("{text:?}: unknown unit {unit:?} (use us, ms, s, m or h)"),
    };
    Duration::try_from_secs_f64(number * scale)
        .map_err(|e| anyhow!("{text:?} is not a duration: {e}"))
}

/// Parses a `name: value` header.
///
/// # Errors
///
/// No colon, or an invalid name or value.
pub fn parse_header(text: &str) -> anyhow::Result<(HeaderName, HeaderValue)> {
    let (name, value) = text
        .split_once(':')
        .with_context(|| format!("header {text:?} is not 'name: value'"))?;
    let name = HeaderName::from_bytes(name.trim().as_bytes())
        .with_context(|| format!("invalid header name in {text:?}"))?;
    let value = HeaderValue::from_str(value.trim())
        .with_context(|| format!("invalid header value in {text:?}"))?;
    Ok((name, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert!(parse_duration("10x").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("s").is_err());
    }

    #[test]
    fn headers() {
        let (name, value) = parse_header("Baggage: sd-routing-key=k1").unwrap();
        assert_eq!(name, "baggage");
        assert_eq!(value, "sd-routing-key=k1");
        let (_, value) = parse_header("x-a:b:c").unwrap();
        assert_eq!(value, "b:c");
        assert!(parse_header("no colon").is_err());
        assert!(parse_header("bad name: v").is_err());
    }

    #[test]
    fn h1_rejects_streams() {
        let mut cfg = LoadConfig::new(
            Uri::from_static("http://127.0.0.1:1/"),
            Proto::H1,
            Mode::Closed,
        );
        cfg.streams = 2;
        assert!(run(&cfg).is_err());
    }

    #[test]
    fn report_json_shape() {
        let mut stats = Stats::new().unwrap();
        for us in [100u64, 200, 300, 400, 5000] {
            stats.finish(Ok(()), Duration::from_micros(us));
        }
        stats.finish(Err(conn::Failure::Status), Duration::ZERO);
        let cfg = LoadConfig::new(
            Uri::from_static("http://127.0.0.1:1/bytes/1024"),
            Proto::H2,
            Mode::Open { rate: 500.0 },
        );
        let report = report(&cfg, 1, &stats);
        let json = serde_json::to_value(&report).unwrap();
        for key in [
            "proto",
            "mode",
            "target_rps",
            "connections",
            "streams",
            "duration_s",
            "requests",
            "errors",
            "late",
            "rps",
            "latency_us",
            "percentiles",
        ] {
            assert!(json.get(key).is_some(), "missing {key}");
        }
        assert_eq!(json["proto"], "h2");
        assert_eq!(json["mode"], "open");
        assert_eq!(json["requests"], 6);
        assert_eq!(json["errors"], 1);
        for key in ["p50", "p90", "p99", "p999", "max", "mean"] {
            assert!(
                json["latency_us"].get(key).is_some(),
                "missing latency_us.{key}"
            );
        }
        let curve = json["percentiles"].as_array().unwrap();
        assert_eq!(curve.len(), PERCENTILES.len());
        assert_eq!(curve[0][0], 0.5);
        assert_eq!(curve[8][1], 5003); // highest equivalent value of 5000 at 3 digits
        let back: Report = serde_json::from_value(json).unwrap();
        assert_eq!(back, report);
        let closed = LoadConfig {
            mode: Mode::Closed,
            ..cfg
        };
        let json = serde_json::to_value(super::report(&closed, 1, &stats)).unwrap();
        assert_eq!(json["mode"], "closed");
        assert!(json["target_rps"].is_null());
    }
}
