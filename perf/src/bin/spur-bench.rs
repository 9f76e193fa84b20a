//! `spur-bench`: spur-sidecar side by side with nginx, haproxy and no proxy at all.
//! Normally started by `perf/run.sh` (which builds the binaries and installs the peers).
//! Writes `perf/results/<date>.md` (+ `latest.md`, plots, raw JSON). See perf/README.md.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;

use spur_perf::bench::load::{self, which};
use spur_perf::bench::peers::{PeerEnv, PeerKind, parse_nginx_version};
use spur_perf::bench::runner::{Runner, Upstream, cross_check_scenario};
use spur_perf::bench::{Meta, Results, Scenario, Settings, plot, proc, report};

#[derive(Parser, Debug)]
#[command(
    name = "spur-bench",
    about = "Benchmarks spur-sidecar side by side with nginx, haproxy and a direct connection (same upstream, same load generator, pinned cores) and writes a markdown report with plots."
)]
struct Cli {
    /// Smoke run: h1/h2c/gRPC at 1 KiB only, 2 s runs after 1 s warm-up (about 3 minutes).
    #[arg(long)]
    quick: bool,
    /// Peers to run (comma-separated): direct, spur, spur-keyed, nginx, haproxy.
    #[arg(long, value_delimiter = ',')]
    peers: Option<Vec<String>>,
    /// Scenarios (comma-separated <proto>-<size>): default h1-0,h1-1k,h1-64k,h2-1k,grpc-1k.
    #[arg(long, value_delimiter = ',')]
    scenarios: Option<Vec<String>>,
    /// Measured seconds per run (default 8, quick 2).
    #[arg(long)]
    duration: Option<f64>,
    /// Warm-up seconds per run (default 2, quick 1).
    #[arg(long)]
    warmup: Option<f64>,
    /// Fixed open-loop rates (comma-separated rps).
    #[arg(long, value_delimiter = ',', default_value = "1000,5000")]
    rates: Vec<u64>,
    /// Extra open-loop run at this % of each peer's own saturation rate (0 = none).
    #[arg(long, default_value_t = 80)]
    max_pct: u32,
    /// HTTP/1.1 connections.
    #[arg(long, default_value_t = 64)]
    h1_connections: usize,
    /// h2c/gRPC connections.
    #[arg(long, default_value_t = 8)]
    h2_connections: usize,
    /// h2c/gRPC concurrent streams per connection.
    #[arg(long, default_value_t = 16)]
    h2_streams: usize,
    /// spur-load threads.
    #[arg(long, default_value_t = 1)]
    loadgen_threads: usize,
    /// Before each run, wait until other processes use at most this share of one core (0–1)…
    #[arg(long, default_value_t = 0.10)]
    quiet_threshold: f64,
    /// …but at most this many seconds per run (default 20, quick 5)…
    #[arg(long)]
    quiet_wait: Option<f64>,
    /// …and this many seconds in total (default 300, quick 60; 0: never wait).
    #[arg(long)]
    quiet_budget: Option<f64>,
    /// Repeat a run during which other processes used more than --quiet-threshold of a core,
    /// up to this many times (the least disturbed attempt is kept)…
    #[arg(long, default_value_t = 2)]
    retries: u32,
    /// …and at most this many repetitions in all (default 30, quick 5).
    #[arg(long)]
    retry_budget: Option<u32>,
    /// Do not pin processes to cores.
    #[arg(long)]
    no_pin: bool,
    /// Directory with spur-sidecar, spur-load and spur-bench-upstream (default: this binary's).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Where results go.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/results"))]
    out_dir: PathBuf,
    /// File name stem of the results (default: the date, `<date>-quick` for --quick).
    #[arg(long)]
    stem: Option<String>,
    /// TrueType font for plot text.
    #[arg(long, default_value = plot::DEFAULT_FONT)]
    font: PathBuf,
    /// Do not run anything: re-render the report and plots from a saved results JSON.
    #[arg(long)]
    render: Option<PathBuf>,
}

fn main() {
    if let Err(e) = real_main() {
        proc::kill_all_children();
        eprintln!("spur-bench: {e:#}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(json) = &cli.render {
        let results: Results = serde_json::from_str(&std::fs::read_to_string(json)?)?;
        let stem = cli.stem.clone().unwrap_or_else(|| {
            json.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "render".into())
        });
        let out_dir = json
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or(cli.out_dir.clone());
        return write_outputs(&results, &out_dir, &stem, &cli.font, false);
    }
    proc::install_signal_handler()?;
    let started_at = Instant::now();

    let nproc = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pin = !cli.no_pin && nproc >= 2 && which("taskset").is_some();
    let (proxy_core, client_core) = if pin {
        (Some(1), Some(0))
    } else {
        (None, None)
    };

    let bin_dir = match &cli.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("binary has no directory")?
            .to_path_buf(),
    };
    let peers: Vec<PeerKind> = match &cli.peers {
        Some(v) => v
            .iter()
            .map(|s| PeerKind::parse(s.trim()))
            .collect::<Result<_>>()?,
        None => PeerKind::ALL.to_vec(),
    };
    let default_scenarios: &[&str] = if cli.quick {
        &["h1-1k", "h2-1k", "grpc-1k"]
    } else {
        &["h1-0", "h1-1k", "h1-64k", "h2-1k", "grpc-1k"]
    };
    let scenarios: Vec<Scenario> = match &cli.scenarios {
        Some(v) => v
            .iter()
            .map(|s| Scenario::parse(s.trim()))
            .collect::<Result<_>>()?,
        None => default_scenarios
            .iter()
            .map(|s| Scenario::parse(s))
            .collect::<Result<_>>()?,
    };
    let settings = Settings {
        quick: cli.quick,
        duration_s: cli.duration.unwrap_or(if cli.quick { 2.0 } else { 8.0 }),
        warmup_s: cli.warmup.unwrap_or(if cli.quick { 1.0 } else { 2.0 }),
        rates: cli.rates.clone(),
        max_pct: cli.max_pct,
        h1_connections: cli.h1_connections,
        h2_connections: cli.h2_connections,
        h2_streams: cli.h2_streams,
        loadgen_threads: cli.loadgen_threads,
        pinned: pin,
        quiet_threshold: cli.quiet_threshold,
        quiet_wait_s: cli.quiet_wait.unwrap_or(if cli.quick { 5.0 } else { 20.0 }),
        quiet_budget_s: cli
            .quiet_budget
            .unwrap_or(if cli.quick { 60.0 } else { 300.0 }),
        retries: cli.retries,
        retry_budget: cli.retry_budget.unwrap_or(if cli.quick { 5 } else { 30 }),
        proxy_core,
        client_core,
    };
    if settings.duration_s <= 0.0 || settings.warmup_s < 0.0 {
        bail!("--duration must be > 0 and --warmup ≥ 0");
    }

    // Everything needed must be there before the first run.
    for b in ["spur-sidecar", "spur-load", "spur-bench-upstream"] {
        if !bin_dir.join(b).is_file() {
            bail!(
                "{} not found; build with: cargo build --release -p spur-sidecar -p spur-perf --bins",
                bin_dir.join(b).display()
            );
        }
    }
    for (peer, tool) in [(PeerKind::Nginx, "nginx"), (PeerKind::Haproxy, "haproxy")] {
        if peers.contains(&peer) && which(tool).is_none() {
            bail!("{tool} is not installed (perf/run.sh installs it)");
        }
    }

    let work = tempfile::Builder::new().prefix("spur-bench-").tempdir()?;
    let work_dir = work.path().to_path_buf();
    let probe_log = work_dir.join("versions.log");

    let mut meta = Meta {
        command: std::env::var("SPUR_BENCH_COMMAND").unwrap_or_else(|_| {
            std::iter::once("spur-bench".to_string())
                .chain(std::env::args().skip(1))
                .collect::<Vec<_>>()
                .join(" ")
        }),
        date: today(),
        started: now_string(),
        nproc,
        cpu_model: cpu_model(),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        spur_rev: spur_rev(),
        ..Default::default()
    };
    let nginx_text = version_text("nginx", &["-v"], &work_dir);
    meta.nginx_version = first_line(&nginx_text).unwrap_or_else(|| "not installed".into());
    meta.haproxy_version = first_line(&version_text("haproxy", &["-v"], &work_dir))
        .unwrap_or_else(|| "not installed".into());
    let external_tool = load::external_tool();
    meta.external_tool = match external_tool {
        Some("wrk") => {
            first_line(&version_text("wrk", &["-v"], &work_dir)).unwrap_or_else(|| "wrk".into())
        }
        Some(t) => {
            first_line(&version_text(t, &["--version"], &work_dir)).unwrap_or_else(|| t.into())
        }
        None => "none installed (cross-check skipped)".into(),
    };
    if !pin {
        meta.notes.push(format!(
            "Processes were not pinned ({}); proxy, upstream and load generator competed for the same CPUs.",
            if cli.no_pin {
                "--no-pin".to_string()
            } else {
                format!("nproc = {nproc}")
            }
        ));
        eprintln!("spur-bench: NOT pinning processes to cores (nproc = {nproc})");
    }
    let _ = std::fs::remove_file(&probe_log);

    eprintln!(
        "spur-bench: {} peers × {} scenarios; work dir {}",
        peers.len(),
        scenarios.len(),
        work_dir.display()
    );
    let mut upstream = Upstream::start(&bin_dir, client_core, &work_dir.join("upstream.log"))?;
    let max_concurrency = settings
        .h1_connections
        .max(settings.h2_connections * settings.h2_streams);
    let env = PeerEnv {
        bin_dir: bin_dir.clone(),
        work_dir: work_dir.clone(),
        proxy_core,
        upstream: upstream.app,
        sandbox: upstream.sandbox,
        max_concurrency,
        nginx_version: parse_nginx_version(&nginx_text),
    };
    let runner = Runner {
        settings: &settings,
        env: &env,
        upstream_pid: upstream.pid(),
        bin_dir: bin_dir.clone(),
        work_dir: work_dir.clone(),
        client_core,
        quiet_budget_s: std::cell::Cell::new(settings.quiet_budget_s),
        retry_budget: std::cell::Cell::new(settings.retry_budget),
        external_tool: if scenarios.contains(&cross_check_scenario()) {
            external_tool
        } else {
            None
        },
    };

    let mut cells = Vec::new();
    let mut index = 0;
    for &sc in &scenarios {
        eprintln!("spur-bench: scenario {}", sc.label());
        for &p in &peers {
            upstream.check_alive()?;
            index += 1;
            let cell = runner.cell(p, sc, index);
            if let Some(e) = &cell.error {
                eprintln!("  {} {}: FAILED: {e}", p.name(), sc.id());
            }
            cells.push(cell);
        }
    }
    drop(upstream);

    meta.elapsed_s = started_at.elapsed().as_secs_f64();
    let results = Results {
        meta,
        settings,
        peers,
        scenarios,
        cells,
    };
    let stem = cli.stem.clone().unwrap_or_else(|| {
        let date = if cli.quick {
            format!("{}-quick", results.meta.date)
        } else {
            results.meta.date.clone()
        };
        unused_stem(&cli.out_dir, date)
    });
    write_outputs(
        &results,
        &cli.out_dir,
        &stem,
        &cli.font,
        !cli.quick && cli.stem.is_none(),
    )?;
    drop(work);
    let mut headline = String::new();
    spur_perf::bench::report::headline(&mut headline, &results);
    println!("{headline}");
    Ok(())
}

/// Report, JSON and plots; `latest` also copies the report to latest.md.
/// `stem`, or `stem-2`, `stem-3`, … if results of that name exist already: a second run on the
/// same day keeps the first one's files.
fn unused_stem(out_dir: &Path, stem: String) -> String {
    let taken = |s: &str| {
        out_dir.join(format!("{s}.md")).exists() || out_dir.join(format!("{s}.json")).exists()
    };
    if !taken(&stem) {
        return stem;
    }
    (2u32..)
        .map(|n| format!("{stem}-{n}"))
        .find(|s| !taken(s))
        .unwrap_or(stem)
}

fn write_outputs(r: &Results, out_dir: &Path, stem: &str, font: &Path, latest: bool) -> Result<()> {
    std::fs::create_dir_all(out_dir)?;
    let json = out_dir.join(format!("{stem}.json"));
    std::fs::write(&json, serde_json::to_string_pretty(r)?)?;
    let text = plot::load_font(font);
    if !text {
        eprintln!(
            "spur-bench: font {} not usable; plots are drawn without text",
            font.display()
        );
    }
    let mut plots = Vec::new();
    let name = format!("{stem}-throughput.png");
    match plot::throughput_bars(r, &out_dir.join(&name), text) {
        Ok(true) => plots.push(("Saturation throughput".to_string(), name)),
        Ok(false) => {}
        Err(e) => eprintln!("spur-bench: {name}: {e:#}"),
    }
    let rate = 1000;
    for &sc in &r.scenarios {
        let name = format!("{stem}-latency-{}.png", sc.id());
        match plot::latency_curves(r, sc, rate, &out_dir.join(&name), text) {
            Ok(true) => plots.push((
                format!("{}: latency percentiles at 1 000 rps", sc.label()),
                name,
            )),
            Ok(false) => {}
            Err(e) => eprintln!("spur-bench: {name}: {e:#}"),
        }
    }
    let md = report::render(r, &plots);
    let path = out_dir.join(format!("{stem}.md"));
    std::fs::write(&path, &md)?;
    eprintln!("spur-bench: wrote {}", path.display());
    if latest {
        let l = out_dir.join("latest.md");
        std::fs::write(&l, &md)?;
        eprintln!("spur-bench: wrote {}", l.display());
    }
    Ok(())
}

/// Output (stdout + stderr) of a short version command, bounded to 10 s; empty if it fails.
fn version_text(tool: &str, args: &[&str], work_dir: &Path) -> String {
    let Some(path) = which(tool) else {
        return String::new();
    };
    let log = work_dir.join(format!("{tool}-version.log"));
    let _ = std::fs::remove_file(&log);
    let mut cmd = Command::new(path);
    cmd.args(args);
    // wrk -v exits non-zero; keep whatever it printed.
    let out = match proc::Child::spawn(tool, cmd, proc::StdoutMode::Collect, &log)
        .and_then(|mut c| c.wait_output(Duration::from_secs(10)))
    {
        Ok((_, out)) => String::from_utf8_lossy(&out).into_owned(),
        Err(_) => String::new(),
    };
    let err = std::fs::read_to_string(&log).unwrap_or_default();
    format!("{out}{err}")
}

fn first_line(s: &str) -> Option<String> {
    s.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn git(args: &[&str]) -> Option<String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let mut cmd = Command::new("git");
    cmd.arg("-C").arg(dir).args(args);
    let log = std::env::temp_dir().join("spur-bench-git.log");
    let mut c = proc::Child::spawn("git", cmd, proc::StdoutMode::Collect, &log).ok()?;
    let res = c.wait_output(Duration::from_secs(10));
    let _ = std::fs::remove_file(&log);
    let (st, out) = res.ok()?;
    st.success()
        .then(|| String::from_utf8_lossy(&out).trim().to_string())
}

fn spur_rev() -> String {
    let Some(rev) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        return "unknown".into();
    };
    let dirty = git(&[
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        "dataplane",
        "proto",
    ])
    .is_some_and(|s| !s.is_empty());
    if dirty {
        format!("{rev} + uncommitted changes in dataplane/ or proto/")
    } else {
        rev
    }
}

/// Local date and time via `date` (bounded), falling back to UTC computed here.
fn date_fmt(fmt: &str) -> Option<String> {
    let mut cmd = Command::new("date");
    cmd.arg(fmt);
    let log = std::env::temp_dir().join("spur-bench-date.log");
    let mut c = proc::Child::spawn("date", cmd, proc::StdoutMode::Collect, &log).ok()?;
    let res = c.wait_output(Duration::from_secs(5));
    let _ = std::fs::remove_file(&log);
    let (st, out) = res.ok()?;
    st.success()
        .then(|| String::from_utf8_lossy(&out).trim().to_string())
        .filter(|s| !s.is_empty())
}

fn today() -> String {
    date_fmt("+%F").unwrap_or_else(utc_date)
}

fn now_string() -> String {
    date_fmt("+%F %T %Z").unwrap_or_else(utc_date)
}

fn utc_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = (secs / 86_400) as i64;
    // Civil-from-days (H. Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}
