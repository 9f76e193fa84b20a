//! Load generators: `spur-load` (the measuring tool) and `wrk` / `h2load --h1` (cross-check).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::Proto;

/// Closed loop (as fast as the connections allow) or open loop at a fixed rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Mode {
    Closed,
    Rate(u64),
}

/// One `spur-load` invocation.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub url: String,
    pub proto: Proto,
    pub connections: usize,
    pub streams: Option<usize>,
    pub header: Option<String>,
    pub payload: Option<usize>,
    pub duration: Duration,
    pub warmup: Duration,
    pub mode: Mode,
    pub threads: usize,
}

impl LoadSpec {
    /// The `spur-load` arguments.
    pub fn args(&self) -> Vec<String> {
        let mut a = vec![
            "--url".to_string(),
            self.url.clone(),
            "--proto".into(),
            self.proto.as_str().into(),
            "--connections".into(),
            self.connections.to_string(),
        ];
        if let Some(s) = self.streams {
            a.extend(["--streams".into(), s.to_string()]);
        }
        if let Some(h) = &self.header {
            a.extend(["--header".into(), h.clone()]);
        }
        if let Some(p) = self.payload {
            a.extend(["--payload".into(), p.to_string()]);
        }
        a.extend([
            "--duration".into(),
            fmt_secs(self.duration),
            "--warmup".into(),
            fmt_secs(self.warmup),
        ]);
        match self.mode {
            Mode::Closed => a.push("--closed".into()),
            Mode::Rate(r) => a.extend(["--rate".into(), r.to_string()]),
        }
        a.extend([
            "--threads".into(),
            self.threads.to_string(),
            "--json".into(),
        ]);
        a
    }
}

/// `1.5s`, `8s`, `500ms`.
pub fn fmt_secs(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// Latency summary in µs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

/// `spur-load --json` output.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadReport {
    pub proto: String,
    pub mode: String,
    pub target_rps: Option<f64>,
    pub connections: u64,
    pub streams: Option<u64>,
    pub duration_s: f64,
    pub requests: u64,
    pub errors: u64,
    pub late: Option<u64>,
    pub rps: f64,
    pub latency_us: Latency,
    /// `[quantile, µs]`, quantile as a fraction (0.99) — normalised on parse.
    pub percentiles: Vec<(f64, f64)>,
    /// Connections re-established after the server closed one.
    pub reconnects: u64,
    /// Failed requests by kind, as reported.
    pub error_kinds: Option<serde_json::Value>,
}

impl LoadReport {
    /// Parses the last JSON object line of `spur-load --json`'s stdout.
    pub fn parse(stdout: &str) -> Result<Self> {
        let text = stdout.trim();
        let mut r: LoadReport = match serde_json::from_str(text) {
            Ok(r) => r,
            Err(_) => {
                let line = text
                    .lines()
                    .rev()
                    .find(|l| l.trim_start().starts_with('{'))
                    .context("no JSON object in spur-load output")?;
                serde_json::from_str(line).context("parse spur-load JSON")?
            }
        };
        // Accept percent (99.9) as well as fraction (0.999) quantiles.
        if r.percentiles.iter().any(|&(q, _)| q > 1.0) {
            for p in &mut r.percentiles {
                p.0 /= 100.0;
            }
        }
        r.percentiles
            .sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
        Ok(r)
    }
}

/// Result of an independent generator run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExternalReport {
    pub tool: String,
    pub command: String,
    pub rps: f64,
    pub p50_us: Option<f64>,
    pub p90_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub errors: u64,
}

/// `wrk` if installed, else `h2load` (its `--h1` mode); None if neither.
pub fn external_tool() -> Option<&'static str> {
    ["wrk", "h2load"].into_iter().find(|t| which(t).is_some())
}

/// Path of an executable found on PATH.
pub fn which(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Builds the external closed-loop command for `url` (HTTP/1.1, one thread, `connections`).
pub fn external_command(
    tool: &str,
    url: &str,
    connections: usize,
    duration: Duration,
) -> (String, Vec<String>) {
    let secs = duration.as_secs().max(1);
    match tool {
        "wrk" => (
            "wrk".into(),
            vec![
                "-t1".into(),
                format!("-c{connections}"),
                format!("-d{secs}s"),
                "--latency".into(),
                url.into(),
            ],
        ),
        _ => (
            "h2load".into(),
            vec![
                "--h1".into(),
                "-t1".into(),
                format!("-c{connections}"),
                format!("-D{secs}"),
                url.into(),
            ],
        ),
    }
}

/// Parses `wrk --latency` or `h2load` output.
pub fn parse_external(tool: &str, out: &str) -> Result<ExternalReport> {
    let mut r = ExternalReport {
        tool: tool.into(),
        ..Default::default()
    };
    if tool == "wrk" {
        for line in out.lines() {
            let l = line.trim();
            if let Some(v) = l.strip_prefix("Requests/sec:") {
                r.rps = v.trim().parse()?;
            } else if let Some(v) = l.strip_prefix("Non-2xx or 3xx responses:") {
                r.errors += v.trim().parse::<u64>().unwrap_or(0);
            } else if l.starts_with("Socket errors:") {
                r.errors += l
                    .split(|c: char| !c.is_ascii_digit())
                    .filter_map(|n| n.parse::<u64>().ok())
                    .sum::<u64>();
            } else {
                let mut it = l.split_whitespace();
                if let (Some(q), Some(v), None) = (it.next(), it.next(), it.next()) {
                    let val = parse_wrk_time(v);
                    match q {
                        "50%" => r.p50_us = val,
                        "90%" => r.p90_us = val,
                        "99%" => r.p99_us = val,
                        _ => {}
                    }
                }
            }
        }
        if r.rps == 0.0 {
            bail!("no Requests/sec in wrk output: {out}");
        }
    } else {
        // finished in 8.00s, 12345.67 req/s, 14.90MB/s
        // requests: 98765 total, 98765 started, 98765 done, 98765 succeeded, 0 failed, 0 errored, 0 timeout
        for line in out.lines() {
            let l = line.trim();
            if l.starts_with("finished in") {
                r.rps = l
                    .split(',')
                    .nth(1)
                    .and_then(|s| s.trim().strip_suffix("req/s"))
                    .context("h2load req/s")?
                    .trim()
                    .parse()?;
            } else if let Some(rest) = l.strip_prefix("requests:") {
                for part in rest.split(',') {
                    let mut it = part.split_whitespace();
                    if let (Some(n), Some(what)) = (it.next(), it.next())
                        && matches!(what, "failed" | "errored" | "timeout")
                    {
                        r.errors += n.parse::<u64>().unwrap_or(0);
                    }
                }
            }
        }
        if r.rps == 0.0 {
            bail!("no req/s in h2load output: {out}");
        }
    }
    Ok(r)
}

/// `123.45us`, `1.23ms`, `2.00s` → µs.
fn parse_wrk_time(v: &str) -> Option<f64> {
    let (num, mul) = if let Some(n) = v.strip_suffix("us") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1e3)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1e6)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|x| x * mul)
}

/// `taskset -c <core> <program>` (or the program alone when not pinning).
pub fn pinned(core: Option<u32>, program: &Path) -> Command {
    match core {
        Some(c) => {
            let mut cmd = Command::new("taskset");
            cmd.arg("-c").arg(c.to_string()).arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_wrk() {
        let out = "Running 2s test @ http://127.0.0.1:1/bytes/1024\n  1 threads and 64 connections\n  Latency Distribution\n     50%  412.00us\n     75%  1.20ms\n     90%    2.01ms\n     99%    3.50ms\n  100 requests in 2.00s, 1.00MB read\nRequests/sec:  50123.45\nTransfer/sec:      5.00MB\n";
        let r = parse_external("wrk", out).unwrap();
        assert_eq!(r.rps, 50123.45);
        assert_eq!(r.p50_us, Some(412.0));
        assert!((r.p90_us.unwrap() - 2010.0).abs() < 1e-6);
        assert_eq!(r.p99_us, Some(3500.0));
    }

    #[test]
    fn parses_h2load() {
        let out = "finished in 2.00s, 40000.50 req/s, 44.00MB/s\nrequests: 80001 total, 80001 started, 80001 done, 80000 succeeded, 1 failed, 0 errored, 0 timeout\n";
        let r = parse_external("h2load", out).unwrap();
        assert_eq!(r.rps, 40000.50);
        assert_eq!(r.errors, 1);
    }

    #[test]
    fn parses_spur_load() {
        let out = r#"{"proto":"h1","mode":"closed","target_rps":null,"connections":64,"streams":1,"duration_s":8.0,"requests":100,"errors":0,"late":0,"rps":12.5,"latency_us":{"p50":1,"p90":2,"p99":3,"p999":4,"max":5,"mean":1.5},"percentiles":[[50.0,1],[99.0,3]]}"#;
        let r = LoadReport::parse(out).unwrap();
        assert_eq!(r.requests, 100);
        assert_eq!(r.percentiles[1], (0.99, 3.0));
    }
}
