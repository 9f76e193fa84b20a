//! `spur-load`: HTTP/1.1, h2c and gRPC load generator for the side-by-side proxy benchmark; see
//! `spur_perf::load` for what it measures and how it counts.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{ArgGroup, Parser};
use spur_perf::load::{self, LoadConfig, Mode, Proto};

#[derive(Parser)]
#[command(
    name = "spur-load",
    about = "Open- or closed-loop HTTP/1.1, h2c and gRPC load generator with HDR latency histograms",
    group(ArgGroup::new("mode").required(true).args(["rate", "closed"]))
)]
struct Args {
    /// Target, e.g. http://127.0.0.1:8080/bytes/1024 (gRPC: the method path; `/` means
    /// /spur.bench.v1.Bench/Echo).
    #[arg(long)]
    url: String,
    #[arg(long, value_enum, default_value_t = Proto::H1)]
    proto: Proto,
    /// TCP connections (for h1 also the number of concurrent requests).
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Concurrent streams per connection (h2, grpc).
    #[arg(long, default_value_t = 1)]
    streams: usize,
    /// Header added to every request (repeatable).
    #[arg(long = "header", value_name = "'NAME: VALUE'", value_parser = load::parse_header)]
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
    /// gRPC request payload in bytes; informational for h1/h2 (the URL picks the response size).
    #[arg(long, default_value_t = 0)]
    payload: usize,
    /// Measured window (e.g. 10s, 500ms, 2m).
    #[arg(long, default_value = "10s", value_parser = load::parse_duration)]
    duration: Duration,
    /// Unmeasured lead-in before the window.
    #[arg(long, default_value = "2s", value_parser = load::parse_duration)]
    warmup: Duration,
    /// After the window, how long to wait for its queued and in-flight requests; what is left
    /// counts as errors.
    #[arg(long, default_value = "2s", value_parser = load::parse_duration)]
    drain: Duration,
    /// Open loop: requests per second over all connections (latency from intended start).
    #[arg(long, value_name = "RPS")]
    rate: Option<f64>,
    /// Closed loop: every connection x stream sends back to back (saturation).
    #[arg(long)]
    closed: bool,
    /// Worker threads (connections are spread over them).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// CA certificates (PEM) for an https:// URL.
    #[arg(long)]
    cacert: Option<std::path::PathBuf>,
    /// Connect to this address instead of resolving the URL's host (TLS and Host still use it).
    #[arg(long, value_name = "IP:PORT")]
    connect_to: Option<std::net::SocketAddr>,
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    let url = args
        .url
        .parse()
        .with_context(|| format!("--url {:?}", args.url))?;
    let mode = match args.rate {
        Some(rate) => Mode::Open { rate },
        None => Mode::Closed,
    };
    let cfg = LoadConfig {
        connections: args.connections,
        streams: args.streams,
        headers: args.headers,
        payload: args.payload,
        duration: args.duration,
        warmup: args.warmup,
        drain: args.drain,
        threads: args.threads,
        ca_file: args.cacert,
        connect_to: args.connect_to,
        ..LoadConfig::new(url, args.proto, mode)
    };
    let report = load::run(&cfg)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", report.summary());
    }
    Ok(if report.any_success() {
        ExitCode::SUCCESS
    } else {
        eprintln!("spur-load: every request failed");
        ExitCode::FAILURE
    })
}
