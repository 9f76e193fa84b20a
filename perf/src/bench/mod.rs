//! `spur-bench`: spur-sidecar side by side with nginx and haproxy (and no proxy at all), same
//! upstream, same load generator, same pinned cores. See perf/README.md, "Side-by-side".

pub mod load;
pub mod peers;
pub mod plot;
pub mod probe;
pub mod proc;
pub mod report;
pub mod runner;

use serde::{Deserialize, Serialize};

pub use load::{ExternalReport, LoadReport, Mode};
pub use peers::PeerKind;

/// Wire protocol of a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Proto {
    H1,
    H2,
    Grpc,
}

impl Proto {
    /// The name `spur-load --proto` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::H1 => "h1",
            Proto::H2 => "h2",
            Proto::Grpc => "grpc",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Proto::H1 => "HTTP/1.1",
            Proto::H2 => "h2c",
            Proto::Grpc => "gRPC",
        }
    }
}

/// Path of the gRPC method the upstream serves.
pub const GRPC_PATH: &str = "/spur.bench.v1.Bench/Echo";

/// A protocol and a payload size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Scenario {
    pub proto: Proto,
    /// Response body (h1, h2: `GET /bytes/N`) or echoed message (gRPC) size in bytes.
    pub payload: usize,
}

impl Scenario {
    /// Short id: `h1-1k`, `h1-0`, `grpc-1k`.
    pub fn id(&self) -> String {
        format!("{}-{}", self.proto.as_str(), size_id(self.payload))
    }

    /// `HTTP/1.1 1 KiB`.
    pub fn label(&self) -> String {
        format!("{} {}", self.proto.label(), size_label(self.payload))
    }

    /// Request path on the upstream.
    pub fn path(&self) -> String {
        match self.proto {
            Proto::H1 | Proto::H2 => format!("/bytes/{}", self.payload),
            Proto::Grpc => GRPC_PATH.to_string(),
        }
    }

    pub fn parse(s: &str) -> anyhow::Result<Self> {
        let (p, size) = s.split_once('-').ok_or_else(|| {
            anyhow::anyhow!("scenario {s:?}: expected <proto>-<size>, e.g. h1-1k")
        })?;
        let proto = match p {
            "h1" => Proto::H1,
            "h2" => Proto::H2,
            "grpc" => Proto::Grpc,
            _ => anyhow::bail!("scenario {s:?}: protocol must be h1, h2 or grpc"),
        };
        let payload = if let Some(k) = size.strip_suffix('k') {
            k.parse::<usize>()? * 1024
        } else {
            size.parse::<usize>()?
        };
        Ok(Scenario { proto, payload })
    }
}

fn size_id(n: usize) -> String {
    if n > 0 && n.is_multiple_of(1024) {
        format!("{}k", n / 1024)
    } else {
        n.to_string()
    }
}

pub fn size_label(n: usize) -> String {
    if n > 0 && n.is_multiple_of(1024) {
        format!("{} KiB", n / 1024)
    } else {
        format!("{n} B")
    }
}

/// Which kind of run within a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunKind {
    /// Closed loop.
    Saturation,
    /// Open loop at a fixed rate.
    Rate(u64),
    /// Open loop at `pct` % of this peer's own saturation rate (`rps`).
    MaxPct { pct: u32, rps: u64 },
}

impl RunKind {
    pub fn label(&self) -> String {
        match self {
            RunKind::Saturation => "saturation".into(),
            RunKind::Rate(r) => format!("{} rps", thousands(*r)),
            RunKind::MaxPct { pct, rps } => format!("{pct} % of max ({} rps)", thousands(*rps)),
        }
    }
}

/// One measured run: load-generator report plus the proxy's resources.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    pub kind: RunKind,
    pub load: Option<LoadReport>,
    pub error: Option<String>,
    /// CPU seconds of the peer's processes during the measured interval.
    pub proxy_cpu_s: Option<f64>,
    /// CPU seconds of the upstream during the measured interval.
    pub upstream_cpu_s: Option<f64>,
    /// CPU seconds of the load generator during the measured interval.
    #[serde(default)]
    pub loadgen_cpu_s: Option<f64>,
    /// CPU seconds used during the interval by processes outside the benchmark's process tree
    /// (kernel threads excluded).
    #[serde(default)]
    pub other_cpu_s: Option<f64>,
    /// CPU time stolen by the hypervisor during the interval (all cores), seconds.
    #[serde(default)]
    pub steal_s: Option<f64>,
    /// Seconds spent waiting for the machine to be quiet before the run.
    #[serde(default)]
    pub quiet_wait_s: f64,
    /// Machine CPU use (share of one core) just before the run, when nothing of ours was busy.
    #[serde(default)]
    pub busy_before: Option<f64>,
    /// Runs made for this one (more than 1 when earlier attempts were disturbed).
    #[serde(default = "one")]
    pub attempts: u32,
    /// Length of the CPU-measuring interval, seconds.
    pub interval_s: f64,
    /// Peak RSS of the request-serving process during the run (VmHWM after a reset, and the
    /// largest sampled VmRSS), KiB.
    pub peak_rss_kib: Option<u64>,
    /// Same for the peer's other processes (nginx master), summed.
    pub other_peak_rss_kib: Option<u64>,
}

/// Cross-check of one closed-loop figure with an independent generator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CrossCheck {
    pub external: Option<ExternalReport>,
    pub error: Option<String>,
    /// spur-load's closed-loop rps for the same peer and scenario.
    pub spur_load_rps: Option<f64>,
}

/// All runs of one peer in one scenario (one fresh peer process).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    pub peer: PeerKind,
    pub scenario: Scenario,
    /// What the verification request saw.
    pub verified: Option<String>,
    /// Why the cell could not be (fully) measured.
    pub error: Option<String>,
    pub idle_rss_kib: Option<u64>,
    pub idle_other_rss_kib: Option<u64>,
    pub runs: Vec<RunResult>,
    pub cross_check: Option<CrossCheck>,
}

impl Cell {
    pub fn run(&self, pred: impl Fn(&RunKind) -> bool) -> Option<&RunResult> {
        self.runs.iter().find(|r| pred(&r.kind))
    }

    pub fn saturation(&self) -> Option<&LoadReport> {
        self.run(|k| *k == RunKind::Saturation)
            .and_then(|r| r.load.as_ref())
    }

    pub fn at_rate(&self, rate: u64) -> Option<&RunResult> {
        self.run(|k| *k == RunKind::Rate(rate))
    }

    pub fn at_max_pct(&self) -> Option<&RunResult> {
        self.run(|k| matches!(k, RunKind::MaxPct { .. }))
    }
}

fn one() -> u32 {
    1
}

/// How the runs were made.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Settings {
    pub quick: bool,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub rates: Vec<u64>,
    pub max_pct: u32,
    pub h1_connections: usize,
    pub h2_connections: usize,
    pub h2_streams: usize,
    pub loadgen_threads: usize,
    pub pinned: bool,
    /// Before each run, wait until other processes use at most this share of one core…
    #[serde(default)]
    pub quiet_threshold: f64,
    /// …for at most this many seconds per run…
    #[serde(default)]
    pub quiet_wait_s: f64,
    /// …and this many seconds over the whole benchmark.
    #[serde(default)]
    pub quiet_budget_s: f64,
    /// Repeat a run disturbed by other processes (more than `quiet_threshold` of a core) up to
    /// this many times…
    #[serde(default)]
    pub retries: u32,
    /// …and at most this many repetitions in all.
    #[serde(default)]
    pub retry_budget: u32,
    pub proxy_core: Option<u32>,
    pub client_core: Option<u32>,
}

/// Machine and software facts for the report header.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Meta {
    pub command: String,
    pub date: String,
    pub started: String,
    pub elapsed_s: f64,
    pub nproc: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub spur_rev: String,
    pub nginx_version: String,
    pub haproxy_version: String,
    pub external_tool: String,
    pub notes: Vec<String>,
}

/// Everything a report is made from (also saved as JSON next to it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    pub meta: Meta,
    pub settings: Settings,
    pub peers: Vec<PeerKind>,
    pub scenarios: Vec<Scenario>,
    pub cells: Vec<Cell>,
}

impl Results {
    pub fn cell(&self, peer: PeerKind, scenario: Scenario) -> Option<&Cell> {
        self.cells
            .iter()
            .find(|c| c.peer == peer && c.scenario == scenario)
    }
}

/// `12345` → `12 345`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push('\u{202f}');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenario_ids() {
        for id in ["h1-0", "h1-1k", "h1-64k", "h2-1k", "grpc-1k"] {
            assert_eq!(Scenario::parse(id).unwrap().id(), id);
        }
        assert_eq!(Scenario::parse("h1-64k").unwrap().payload, 65536);
    }
}
