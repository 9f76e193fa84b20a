//! What a preview request pays for the hub and the agent's tunnel (issue 21): the same upstream
//! reached directly and through a preview URL, on one machine.
//!
//! Setup: a kube-apiserver + etcd (the agent reads the Sandbox through it), `spur-hub serve`
//! and `spur-agent` (release builds, separate processes, the agent dialling the hub over QUIC),
//! `spur-bench-upstream`, and a Sandbox whose endpoint targets that upstream. The load is
//! `spur_perf::load` in this process: HTTP/1.1 1 KiB GETs, open loop.
//!
//! - Latency at a fixed rate (`SPUR_BENCH_RATE`, default 500 rps, 16 connections, 10 s after 2 s
//!   of warmup): p50/p90/p99/p99.9, direct (cleartext) and preview (TLS to the hub, API key,
//!   key injection, pooled tunnel streams through the agent).
//! - One large download: 16 MiB GETs on one connection, closed loop, 5 s: MB/s.
//! - Preview requests per hub core: closed loop, 32 connections, 10 s; CPU seconds of the hub
//!   and of the agent from /proc; requests per CPU second of each.
//!
//! Writes `perf/results/hub_preview.md`. Run with `perf/hub.sh` (builds the release binaries);
//! `cargo test --benches` runs a short smoke version that writes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use spur_api::Sandbox;
use spur_kube_harness::KubeApi;
use spur_perf::bench::proc::cpu_seconds;
use spur_perf::load::{self, LoadConfig, Mode, Proto, Report};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn release_bin(name: &str) -> Result<PathBuf> {
    let var = format!("SPUR_BENCH_{}", name.to_ascii_uppercase().replace('-', "_"));
    if let Some(p) = std::env::var_os(&var) {
        return Ok(PathBuf::from(p));
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../target/release/{name}"));
    ensure!(
        p.exists(),
        "{} not found: build it (perf/hub.sh does) or set {var}",
        p.display()
    );
    Ok(p)
}

fn run(bin: &Path, dir: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(bin).current_dir(dir).args(args).output()?;
    ensure!(
        out.status.success(),
        "{} {args:?}: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

fn spawn(bin: &Path, dir: &Path, args: &[&str], log: &str) -> Result<Killed> {
    let log = std::fs::File::create(dir.join(log))?;
    Ok(Killed(
        Command::new(bin)
            .current_dir(dir)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?,
    ))
}

fn free_port() -> Result<u16> {
    loop {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = tcp.local_addr()?.port();
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
}

struct Target {
    url: String,
    headers: Vec<String>,
    connect_to: Option<SocketAddr>,
    ca: Option<PathBuf>,
}

fn load(t: &Target, mode: Mode, connections: usize, duration: Duration) -> Result<Report> {
    let mut cfg = LoadConfig::new(t.url.parse()?, Proto::H1, mode);
    cfg.connections = connections;
    cfg.threads = 1;
    cfg.duration = duration;
    cfg.warmup = Duration::from_secs(2).min(duration);
    cfg.headers = t
        .headers
        .iter()
        .map(|h| load::parse_header(h))
        .collect::<Result<_>>()?;
    cfg.connect_to = t.connect_to;
    cfg.ca_file = t.ca.clone();
    let report = load::run(&cfg)?;
    ensure!(report.any_success(), "every request to {} failed", t.url);
    Ok(report)
}

fn main() -> Result<()> {
    let full = std::env::args().any(|a| a == "--bench");
    let rate: f64 = std::env::var("SPUR_BENCH_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500.0);
    let (window, big_window) = if full {
        (Duration::from_secs(10), Duration::from_secs(5))
    } else {
        (Duration::from_secs(1), Duration::from_secs(1))
    };
    let bins = release_bin("spur-hub").and_then(|hub| Ok((hub, release_bin("spur-agent")?)));
    let (hub_bin, agent_bin) = match bins {
        Ok(p) => p,
        Err(e) if !full => {
            eprintln!("hub_preview smoke run skipped: {e}");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let upstream_bin = release_bin("spur-bench-upstream")?;
    let dir = tempfile::tempdir()?;
    let d = dir.path();

    let rt = tokio::runtime::Runtime::new()?;
    let api = rt.block_on(KubeApi::start())?;
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/spur/crds");
    for entry in std::fs::read_dir(&crds)? {
        rt.block_on(api.install_crd_file(&entry?.path()))?;
    }
    api.write_kubeconfig(&d.join("kubeconfig"))?;

    let up_port = free_port()?;
    let _upstream = spawn(
        &upstream_bin,
        d,
        &["--listen", &format!("127.0.0.1:{up_port}")],
        "upstream.log",
    )?;
    rt.block_on(async {
        let sandboxes: Api<Sandbox> = Api::all(api.client());
        let sb: Sandbox = serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "bench"},
            "spec": {
                "forks": [{"forkOf": {"kind": "Deployment", "namespace": "default", "name": "web"}}],
                "defaultRouteGroup": {"endpoints": [{"name": "web", "target": format!("http://localhost:{up_port}")}]}
            }
        }))?;
        sandboxes.create(&PostParams::default(), &sb).await?;
        sandboxes
            .patch_status(
                "bench",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"status": {"routingKey": "benchkey01"}})),
            )
            .await?;
        anyhow::Ok(())
    })?;

    std::fs::write(
        d.join("token"),
        run(&hub_bin, d, &["cluster", "add", "bench", "--db", "hub.db"])?,
    )?;
    let key = run(&hub_bin, d, &["apikey", "add", "bench", "--db", "hub.db"])?
        .trim()
        .to_owned();
    std::fs::write(
        d.join("ca.pem"),
        run(&hub_bin, d, &["ca", "--db", "hub.db"])?,
    )?;
    let (tunnel, preview) = (free_port()?, free_port()?);
    let hub = spawn(
        &hub_bin,
        d,
        &[
            "serve",
            "--db",
            "hub.db",
            "--metrics-addr",
            "127.0.0.1:0",
            "--tunnel-addr",
            &format!("127.0.0.1:{tunnel}"),
            "--preview-addr",
            &format!("127.0.0.1:{preview}"),
            "--preview-domain",
            "preview.test",
        ],
        "hub.log",
    )?;
    let agent = spawn(
        &agent_bin,
        d,
        &[
            "--hub",
            &format!("127.0.0.1:{tunnel}"),
            "--hub-server-name",
            "localhost",
            "--hub-ca",
            "ca.pem",
            "--token-file",
            "token",
            "--kubeconfig",
            "kubeconfig",
            "--target-suffix",
            "localhost",
            // The upstream listens on loopback, which the agent refuses unless named.
            "--allow-cidrs",
            "127.0.0.0/8",
            "--health-addr",
            "127.0.0.1:0",
        ],
        "agent.log",
    )?;

    let direct = Target {
        url: format!("http://127.0.0.1:{up_port}/bytes/1024"),
        headers: vec![],
        connect_to: None,
        ca: None,
    };
    let host = "web--bench.preview.test";
    let via_hub = |path: &str| Target {
        url: format!("https://{host}:{preview}{path}"),
        headers: vec![format!("x-spur-api-key: {key}")],
        connect_to: Some(SocketAddr::from(([127, 0, 0, 1], preview))),
        ca: Some(d.join("ca.pem")),
    };
    // Wait until the hub has the sandbox from the agent and a preview answers.
    let start = Instant::now();
    loop {
        let probe = load(
            &via_hub("/bytes/1"),
            Mode::Closed,
            1,
            Duration::from_millis(200),
        );
        if probe.as_ref().is_ok_and(|r| r.errors == 0) {
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!(
                "the preview never answered ({probe:?}); hub log:\n{}",
                std::fs::read_to_string(d.join("hub.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }

    let mut out = String::new();
    writeln!(
        out,
        "# Hub + agent: what a preview request pays (issue 21)\n"
    )?;
    writeln!(
        out,
        "`cargo bench -p spur-perf --bench hub_preview` (via `perf/hub.sh`), {}. One machine, \
         2 cores, nothing pinned: the load generator, `spur-bench-upstream`, `spur-hub serve` \
         and `spur-agent` (release builds) share them. HTTP/1.1, 1 KiB responses. *direct*: \
         cleartext to the upstream. *preview*: TLS to the hub, API-key check, key injection, \
         then through the agent over pooled tunnel streams (QUIC, loopback) to the upstream.\n",
        date()
    )?;

    writeln!(
        out,
        "## Latency at {rate} rps (open loop, 16 connections, {}s)\n",
        window.as_secs()
    )?;
    writeln!(
        out,
        "| path | p50 µs | p90 µs | p99 µs | p99.9 µs | errors |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|")?;
    for (name, t) in [("direct", &direct), ("preview", &via_hub("/bytes/1024"))] {
        let r = load(t, Mode::Open { rate }, 16, window)?;
        let l = &r.latency_us;
        writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} |",
            l.p50, l.p90, l.p99, l.p999, r.errors
        )?;
    }

    writeln!(
        out,
        "\n## One large download (16 MiB responses, one connection, closed loop, {}s)\n",
        big_window.as_secs()
    )?;
    writeln!(out, "| path | MB/s | requests |")?;
    writeln!(out, "|---|---:|---:|")?;
    let big = 16 * 1024 * 1024;
    let direct_big = Target {
        url: format!("http://127.0.0.1:{up_port}/bytes/{big}"),
        headers: vec![],
        connect_to: None,
        ca: None,
    };
    for (name, t) in [
        ("direct", &direct_big),
        ("preview", &via_hub(&format!("/bytes/{big}"))),
    ] {
        let r = load(t, Mode::Closed, 1, big_window)?;
        writeln!(
            out,
            "| {name} | {:.0} | {} |",
            r.rps * big as f64 / 1e6,
            r.requests
        )?;
    }

    writeln!(
        out,
        "\n## Preview requests per CPU second (closed loop, 32 connections, {}s)\n",
        window.as_secs()
    )?;
    let (hub_pid, agent_pid) = (hub.0.id(), agent.0.id());
    let (hub0, agent0) = (cpu_seconds(hub_pid)?, cpu_seconds(agent_pid)?);
    let r = load(&via_hub("/bytes/1024"), Mode::Closed, 32, window)?;
    let (hub1, agent1) = (cpu_seconds(hub_pid)?, cpu_seconds(agent_pid)?);
    // The counters include the warmup, as the request count does not: scale by the window.
    let total = r.duration_s + r.warmup_s;
    let hub_cpu = (hub1 - hub0) * r.duration_s / total;
    let agent_cpu = (agent1 - agent0) * r.duration_s / total;
    let served = r.rps * r.duration_s;
    writeln!(
        out,
        "| rps | hub CPU s | agent CPU s | requests per hub CPU s | requests per agent CPU s | errors |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|")?;
    writeln!(
        out,
        "| {:.0} | {hub_cpu:.2} | {agent_cpu:.2} | {:.0} | {:.0} | {} |",
        r.rps,
        served / hub_cpu.max(1e-9),
        served / agent_cpu.max(1e-9),
        r.errors
    )?;
    print!("{out}");
    if full {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/hub_preview.md");
        std::fs::write(&path, &out)?;
        eprintln!("wrote {}", path.display());
    }
    drop((hub, agent));
    Ok(())
}

fn date() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}
