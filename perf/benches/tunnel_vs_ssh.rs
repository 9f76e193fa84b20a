//! Workstation tunnel against OpenSSH port forwarding (`ssh -L`), over the same lossy link.
//!
//! Topology: this process's network namespace is the "cluster" (a real kube-apiserver + etcd,
//! `spur-tunnel-proxy`, Debian's `sshd`, and the target servers, bound on the veth address); a
//! "laptop" namespace created here, joined by a veth pair, runs `spur local connect` or `ssh -N
//! -L`, and the measuring clients connect from inside it. Each end of the veth drops P % of the
//! packets it receives (nftables `numgen random`; segmentation offloads are off on the veth, so
//! those are wire-sized packets), so each direction loses P %.
//!
//! Paths, measured one after the other with the same clients and servers:
//! - `direct`: the laptop connects to the targets over the veth (the floor for latency);
//! - `ssh -L`: `ssh -N -L` in the laptop to `sshd` in the cluster (Debian's defaults: cipher and
//!   key exchange as negotiated, no compression);
//! - `spur quic`, `spur h2`: `spur local connect --transport quic|h2 --hosts-file`, i.e. the
//!   per-Service loopback listeners of the shipped CLI, through `spur-tunnel-proxy`, which dials
//!   the targets (`--resolve`).
//!
//! For each TCP congestion control of the veth's routes (cubic, the Linux default; bbr), path,
//! loss (0 %, 1 %) and stream count (1, 100):
//! - throughput: cluster → laptop bulk download on N connections at once, bytes received by the
//!   laptop in a fixed window after a warm-up;
//! - latency: open-loop 64-byte pings at a fixed total rate (`SPUR_BENCH_PING_RATE`, default
//!   2,000/s) spread over N established connections (each has carried one echo before the
//!   schedule starts), each echoed by the cluster; p50/p99 of the round trip
//!   from each ping's intended send time (DESIGN.md §8: open-loop with coordinated-omission
//!   correction for latency, closed-loop only for saturation throughput), and the same minus
//!   `direct`'s ("added"). A closed-loop ping-pong would measure how many messages a saturated
//!   2-core machine turns over, not the latency a tunnel adds; at 100 streams it did exactly
//!   that (every path's p99 was the CPU queue, 7–9 ms, with or without loss).
//!
//! The matrix is measured `SPUR_BENCH_ROUNDS` times (default 3), each round going through every
//! path in turn, and the report gives each cell's median, with the throughput range and each
//! round's ratio to ssh: single runs on a shared 2-core machine vary by up to 1.5× (ssh at 1 %
//! loss most of all).
//!
//! Writes `perf/results/tunnel_vs_ssh.md`. Needs root (namespaces, nftables), `ip`, `nft`, `ethtool`, OpenSSH
//! (client and server) and a release build of `spur`: run it with `perf/tunnel.sh`, which
//! installs what is missing. Without `--bench` it does a short smoke run and writes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use hdrhistogram::Histogram;
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use spur_kube_harness::KubeApi;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

const ROOT_IP: Ipv4Addr = Ipv4Addr::new(10, 79, 0, 1);
const LAPTOP_IP: Ipv4Addr = Ipv4Addr::new(10, 79, 0, 2);
const TUNNEL_PORT: u16 = 8443;
const SSH_PORT: u16 = 2222;
const SERVER_NAME: &str = "tunnel.spur.bench";
const NS: &str = "bench";
/// Service ports as the laptop sees them (the hosts-file listeners listen on these).
const SOURCE_PORT: u16 = 9000;
const ECHO_PORT: u16 = 9001;
/// Ports of `ssh -L` in the laptop namespace.
const SSH_SOURCE_PORT: u16 = 19000;
const SSH_ECHO_PORT: u16 = 19001;
const MSG: usize = 64;
const CHUNK: usize = 64 * 1024;
/// Any single round trip or setup step longer than this fails the run instead of hanging it.
const STALL: Duration = Duration::from_secs(30);

struct Plan {
    warmup: Duration,
    window: Duration,
    latency: Duration,
    /// Open-loop pings per second, over all of a cell's connections together.
    ping_rate: f64,
    streams: Vec<usize>,
    losses: Vec<f64>,
    paths: Vec<PathKind>,
    /// TCP congestion controls the whole matrix is run under, one block each.
    tcp_ccs: Vec<String>,
    /// Times the whole matrix is measured; the report gives each cell's median and range.
    rounds: usize,
    write: bool,
}

fn main() -> Result<()> {
    let full = std::env::args().any(|a| a == "--bench");
    let secs = |name: &str, default: f64| -> Duration {
        Duration::from_secs_f64(
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default),
        )
    };
    let all = [
        PathKind::Direct,
        PathKind::Ssh,
        PathKind::SpurQuic,
        PathKind::SpurH2,
    ];
    // A subset (of paths, losses, stream counts or TCP congestion controls: for profiling)
    // never overwrites the report.
    let paths: Vec<PathKind> = match std::env::var("SPUR_BENCH_PATHS") {
        Ok(list) => all
            .into_iter()
            .filter(|p| list.split(',').any(|w| w.trim() == p.label()))
            .collect(),
        Err(_) => all.to_vec(),
    };
    let list = |name: &str| -> Result<Option<Vec<f64>>> {
        let Ok(v) = std::env::var(name) else {
            return Ok(None);
        };
        let parsed: Vec<f64> = v
            .split(',')
            .map(|w| w.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("{name}={v:?}: expected comma-separated numbers"))?;
        Ok(Some(parsed))
    };
    let losses = list("SPUR_BENCH_LOSSES")?;
    let streams = list("SPUR_BENCH_STREAMS")?;
    let tcp_ccs = std::env::var("SPUR_BENCH_TCP_CC").ok().map(|v| {
        v.split(',')
            .map(|w| w.trim().to_owned())
            .filter(|w| !w.is_empty())
            .collect::<Vec<_>>()
    });
    let partial =
        paths.len() < all.len() || losses.is_some() || streams.is_some() || tcp_ccs.is_some();
    let tcp_ccs = tcp_ccs.unwrap_or_else(|| vec!["cubic".into(), "bbr".into()]);
    let ping_rate = std::env::var("SPUR_BENCH_PING_RATE")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|r| r.is_finite() && *r >= 1.0)
        .unwrap_or(2000.0);
    let plan = if full {
        Plan {
            warmup: secs("SPUR_BENCH_WARMUP_S", 1.0),
            window: secs("SPUR_BENCH_WINDOW_S", 5.0),
            latency: secs("SPUR_BENCH_LATENCY_S", 5.0),
            ping_rate,
            streams: streams.map_or(vec![1, 100], |s| {
                s.into_iter().map(|n| (n as usize).max(1)).collect()
            }),
            losses: losses.unwrap_or_else(|| vec![0.0, 1.0]),
            paths,
            tcp_ccs,
            rounds: list("SPUR_BENCH_ROUNDS")?
                .and_then(|r| r.first().copied())
                .map_or(3, |r| (r as usize).max(1)),
            write: !partial,
        }
    } else {
        Plan {
            warmup: Duration::from_millis(200),
            window: Duration::from_millis(500),
            latency: Duration::from_millis(500),
            ping_rate,
            streams: vec![1, 4],
            losses: vec![0.0, 1.0],
            paths,
            tcp_ccs: tcp_ccs.into_iter().take(1).collect(),
            rounds: 1,
            write: false,
        }
    };
    // Fixed, so a TOKIO_WORKER_THREADS in the environment is only seen by the spur children.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get()))
        .enable_all()
        .build()?;
    rt.block_on(run(plan))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PathKind {
    Direct,
    Ssh,
    SpurQuic,
    SpurH2,
}

impl PathKind {
    fn label(self) -> &'static str {
        match self {
            PathKind::Direct => "direct",
            PathKind::Ssh => "ssh -L",
            PathKind::SpurQuic => "spur quic",
            PathKind::SpurH2 => "spur h2",
        }
    }

    /// `spur local connect --transport` of a tunnel path.
    fn transport(self) -> &'static str {
        if self == PathKind::SpurQuic {
            "quic"
        } else {
            "h2"
        }
    }
}

struct Cell {
    round: usize,
    path: PathKind,
    tcp_cc: String,
    loss: f64,
    streams: usize,
    mib_s: f64,
    p50_us: u64,
    p99_us: u64,
    round_trips: u64,
    /// CPU seconds the tunnel's own processes (both ends) spent per GiB of the throughput run.
    cpu_s_per_gib: Option<f64>,
}

async fn run(plan: Plan) -> Result<()> {
    ensure!(
        is_root(),
        "this benchmark builds network namespaces and nftables rules: run it as root (perf/tunnel.sh)"
    );
    let spur = spur_binary()?;
    for tool in ["ip", "nft", "ethtool", "ssh", "ssh-keygen"] {
        ensure!(
            which(tool),
            "`{tool}` not found: run perf/tunnel.sh, which installs it"
        );
    }
    ensure!(
        Path::new("/usr/sbin/sshd").exists(),
        "/usr/sbin/sshd not found: run perf/tunnel.sh, which installs openssh-server"
    );
    let started = Instant::now();
    let net = Net::new()?;

    // Targets, in the cluster namespace, on the veth address so the direct path crosses the lossy link.
    let stop = CancellationToken::new();
    let source = TcpListener::bind((ROOT_IP, 0)).await?;
    let echo = TcpListener::bind((ROOT_IP, 0)).await?;
    let (source_addr, echo_addr) = (source.local_addr()?, echo.local_addr()?);
    tokio::spawn(serve_source(source, stop.clone()));
    tokio::spawn(serve_echo(echo, stop.clone()));

    let api = KubeApi::start().await?;
    // The tunnel proxy watches ExternalWorkloads (empty here) besides Services.
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/spur/crds");
    for entry in std::fs::read_dir(&crds)? {
        api.install_crd_file(&entry?.path()).await?;
    }
    let dir = api.dir().join("tunnel-bench");
    std::fs::create_dir_all(&dir)?;
    let kubeconfig = dir.join("kubeconfig.yaml");
    api.write_kubeconfig(&kubeconfig)?;
    let client = api.client();
    for ns in [NS, "spur-system"] {
        let n: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &n)
            .await?;
    }
    for (name, port) in [("source", SOURCE_PORT), ("echo", ECHO_PORT)] {
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": NS},
            "spec": {"ports": [{"name": "tcp", "port": port}]}
        }))?;
        Api::<Service>::namespaced(client.clone(), NS)
            .create(&PostParams::default(), &svc)
            .await?;
    }
    let token = Command::new(&spur)
        .args(["local", "token", "--workstation", "bench"])
        .args(["--namespace", "spur-system", "--kubeconfig"])
        .arg(&kubeconfig)
        .output()
        .await?;
    ensure!(
        token.status.success(),
        "spur local token: {}",
        String::from_utf8_lossy(&token.stderr)
    );
    std::fs::write(dir.join("bench.token"), &token.stdout)?;
    let cert = rcgen::generate_simple_self_signed(vec![SERVER_NAME.into()])?;
    std::fs::write(dir.join("tls.crt"), cert.cert.pem())?;
    std::fs::write(dir.join("tls.key"), cert.signing_key.serialize_pem())?;

    let tp_log = dir.join("tunnel-proxy.log");
    let tp_metrics = free_port()?;
    let tunnel_proxy = spawn_logged(
        Command::new(spur.with_file_name("spur-tunnel-proxy"))
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args([
                "--namespace",
                "spur-system",
                "--pod-name",
                "spur-tunnel-proxy-0",
            ])
            .args(["--pod-ip", "192.0.2.10", "--socks-addr", ""])
            .arg("--quic-addr")
            .arg(format!("{ROOT_IP}:{TUNNEL_PORT}"))
            .arg("--h2-addr")
            .arg(format!("{ROOT_IP}:{TUNNEL_PORT}"))
            .arg("--tls-cert")
            .arg(dir.join("tls.crt"))
            .arg("--tls-key")
            .arg(dir.join("tls.key"))
            .arg("--resolve")
            .arg(format!("source.{NS}.svc:{SOURCE_PORT}={source_addr}"))
            .arg("--resolve")
            .arg(format!("echo.{NS}.svc:{ECHO_PORT}={echo_addr}"))
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{tp_metrics}")),
        &tp_log,
    )?;
    wait_for_port(SocketAddr::from((Ipv4Addr::LOCALHOST, tp_metrics)), &tp_log).await?;
    let tp_pid = tunnel_proxy.id().context("tunnel proxy pid")?;

    let ssh = SshSetup::new(&dir)?;
    let sshd = ssh.start_server()?;
    let sshd_pid = sshd.id().context("sshd pid")?;
    // ssh gives up at once on a refused connection, so sshd must listen before any client starts.
    wait_for_port(
        SocketAddr::from((ROOT_IP, SSH_PORT)),
        &dir.join("ssh/sshd.log"),
    )
    .await?;
    let setup = started.elapsed();

    let mut cells = Vec::new();
    let mut ssh_cipher = String::new();
    // Rounds go through every path in turn, so a slow spell of the shared machine touches one
    // round of each path rather than all rounds of one.
    let mut runs: Vec<(usize, String, PathKind)> = Vec::new();
    for round in 0..plan.rounds {
        for cc in &plan.tcp_ccs {
            runs.extend(plan.paths.iter().map(|&p| (round, cc.clone(), p)));
        }
    }
    for (round, tcp_cc, path) in runs {
        net.set_tcp_cc(&tcp_cc)?;
        // The client end, and where the laptop reaches the source and echo through it.
        let (client, source_at, echo_at) = match path {
            PathKind::Direct => (None, source_addr, echo_addr),
            PathKind::Ssh => {
                let c = ssh.start_client(&net, source_addr, echo_addr)?;
                (
                    Some(c),
                    SocketAddr::from((Ipv4Addr::LOCALHOST, SSH_SOURCE_PORT)),
                    SocketAddr::from((Ipv4Addr::LOCALHOST, SSH_ECHO_PORT)),
                )
            }
            PathKind::SpurQuic | PathKind::SpurH2 => {
                let transport = path.transport();
                let hosts = dir.join(format!("hosts-{transport}"));
                std::fs::write(&hosts, "127.0.0.1 localhost\n")?;
                let c = spawn_logged(
                    net.command(&spur)
                        .args(["local", "connect", "--server"])
                        .arg(ROOT_IP.to_string())
                        .arg("--quic-port")
                        .arg(TUNNEL_PORT.to_string())
                        .arg("--h2-port")
                        .arg(TUNNEL_PORT.to_string())
                        .arg("--token-file")
                        .arg(dir.join("bench.token"))
                        .arg("--ca-file")
                        .arg(dir.join("tls.crt"))
                        .args(["--server-name", SERVER_NAME, "--transport", transport])
                        .args(["--no-dns", "--no-socks", "-n", NS, "--hosts-file"])
                        .arg(&hosts)
                        .arg("--state-dir")
                        .arg(dir.join(format!("state-{transport}"))),
                    &dir.join(format!("connect-{transport}.log")),
                )?;

                let log = dir.join(format!("connect-{transport}.log"));
                let ip = wait_for_host(&hosts, &format!("source.{NS}.svc"), &log).await?;
                let echo_ip = wait_for_host(&hosts, &format!("echo.{NS}.svc"), &log).await?;
                (
                    Some(c),
                    SocketAddr::from((ip, SOURCE_PORT)),
                    SocketAddr::from((echo_ip, ECHO_PORT)),
                )
            }
        };
        // The path works before anything is timed (listeners up, session established).
        if let Err(e) = ping_until_ready(&net, echo_at).await {
            let logs = match path {
                PathKind::Direct => vec![],
                PathKind::Ssh => vec![dir.join("ssh/ssh.log"), dir.join("ssh/sshd.log")],
                _ => vec![
                    dir.join(format!("connect-{}.log", path.transport())),
                    tp_log.clone(),
                ],
            };
            let logs: String = logs
                .iter()
                .map(|l| {
                    let text = std::fs::read_to_string(l).unwrap_or_default();
                    let lines: Vec<&str> = text.lines().collect();
                    let tail = &lines[lines.len().saturating_sub(30)..];
                    format!("\n--- {}:\n{}", l.display(), tail.join("\n"))
                })
                .collect();
            return Err(e.context(format!("{} never answered{logs}", path.label())));
        }
        if path == PathKind::Ssh {
            ssh_cipher = ssh.negotiated();
        }
        let pids: Vec<u32> = match (path, &client) {
            (PathKind::Direct, _) | (_, None) => vec![],
            (PathKind::Ssh, Some(c)) => c.id().into_iter().chain([sshd_pid]).collect(),
            (_, Some(c)) => c.id().into_iter().chain([tp_pid]).collect(),
        };
        for &loss in &plan.losses {
            net.set_loss(loss)?;
            for &streams in &plan.streams {
                let cpu0 = tree_cpu_seconds(&pids);
                let (bytes, window) =
                    throughput(&net, source_at, streams, plan.warmup, plan.window).await?;
                let cpu = tree_cpu_seconds(&pids) - cpu0;
                let hist = latency(&net, echo_at, streams, plan.latency, plan.ping_rate).await?;
                let gib = bytes as f64 / (1u64 << 30) as f64;
                let cell = Cell {
                    round,
                    path,
                    tcp_cc: tcp_cc.clone(),
                    loss,
                    streams,
                    mib_s: bytes as f64 / (1 << 20) as f64 / window.as_secs_f64(),
                    p50_us: hist.value_at_quantile(0.5),
                    p99_us: hist.value_at_quantile(0.99),
                    round_trips: hist.len(),
                    cpu_s_per_gib: (!pids.is_empty() && gib > 0.0).then(|| cpu / gib),
                };
                eprintln!(
                    "round {round} {tcp_cc:<6} {:<10} loss {loss}% streams {streams:>3}: {:>8.1} MiB/s, p50 {} µs, p99 {} µs ({} round trips)",
                    path.label(),
                    cell.mib_s,
                    cell.p50_us,
                    cell.p99_us,
                    cell.round_trips
                );
                cells.push(cell);
            }
        }
        net.set_loss(0.0)?;
        if let Some(c) = client {
            stop_child(c).await;
        }
    }
    stop.cancel();
    stop_child(sshd).await;
    stop_child(tunnel_proxy).await;
    let audit_lines = std::fs::read_to_string(&tp_log)
        .map(|l| {
            l.lines()
                .filter(|l| l.contains("bytes_to_cluster="))
                .count()
        })
        .unwrap_or(0);

    let report = report(&plan, &rows(&cells), setup, &ssh_cipher, audit_lines);
    println!("{report}");
    if plan.write {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/tunnel_vs_ssh.md");
        std::fs::write(&path, &report)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// One cell of the matrix over all rounds: medians, and the throughput of each round.
struct Row {
    path: PathKind,
    tcp_cc: String,
    loss: f64,
    streams: usize,
    /// Throughput of each round, in round order.
    rounds_mib_s: Vec<f64>,
    mib_s: f64,
    p50_us: u64,
    p99_us: u64,
    round_trips: u64,
    cpu_s_per_gib: Option<f64>,
}

fn median<T: Copy + PartialOrd>(mut v: Vec<T>) -> Option<T> {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v.get(v.len() / 2).copied()
}

/// Groups the rounds of each cell (in the order cells were first measured).
fn rows(cells: &[Cell]) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
    for c in cells {
        if rows.iter().any(|r| {
            r.tcp_cc == c.tcp_cc && r.path == c.path && r.loss == c.loss && r.streams == c.streams
        }) {
            continue;
        }
        let mut same: Vec<&Cell> = cells
            .iter()
            .filter(|o| {
                o.tcp_cc == c.tcp_cc
                    && o.path == c.path
                    && o.loss == c.loss
                    && o.streams == c.streams
            })
            .collect();
        same.sort_by_key(|o| o.round);
        rows.push(Row {
            path: c.path,
            tcp_cc: c.tcp_cc.clone(),
            loss: c.loss,
            streams: c.streams,
            rounds_mib_s: same.iter().map(|o| o.mib_s).collect(),
            mib_s: median(same.iter().map(|o| o.mib_s).collect()).unwrap_or(0.0),
            p50_us: median(same.iter().map(|o| o.p50_us).collect()).unwrap_or(0),
            p99_us: median(same.iter().map(|o| o.p99_us).collect()).unwrap_or(0),
            round_trips: same.iter().map(|o| o.round_trips).sum(),
            cpu_s_per_gib: median(same.iter().filter_map(|o| o.cpu_s_per_gib).collect()),
        });
    }
    rows
}

fn report(
    plan: &Plan,
    cells: &[Row],
    setup: Duration,
    ssh_cipher: &str,
    audit_lines: usize,
) -> String {
    let mut r = String::new();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let ssh_version = std::process::Command::new("ssh")
        .arg("-V")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_string())
        .unwrap_or_default();
    let _ = writeln!(
        r,
        "# Workstation tunnel vs `ssh -L`\n\n\
         Command: `perf/tunnel.sh` (`cargo bench -p spur-perf --bench tunnel_vs_ssh`). Machine: {cores} cores, \
         Linux {}. Two network namespaces joined by a veth pair with segmentation \
         offloads off; loss: each end drops P % of the packets it receives (nftables `numgen random`: \
         this kernel has no `sch_netem`). Cluster side: `spur-tunnel-proxy` (release build, kube-apiserver for its \
         token and Service caches) or `sshd` ({ssh_version}, cipher {ssh_cipher}), and the target \
         servers; laptop side: `spur local connect --transport quic|h2` (hosts-file Service \
         listeners) or `ssh -N -L`, and the clients. Everything, the clients included, shares \
         the {cores} cores. Set-up {:.1} s.\n\n\
         - Rounds: the whole matrix was measured {}, each round going through every path; \
         every figure is the median over the rounds, throughput also with its range (min–max).\n\
         - Throughput: cluster → laptop download on N connections at once; bytes received in a \
         {:.0} s window after {:.0} s of warm-up.\n\
         - Latency: open loop, {:.0} pings of {MSG} bytes per second in all, ping i sent on \
         connection i mod N at i / rate whether or not earlier echoes have returned, for {:.0} s, \
         on N connections that have each carried one echo first (established, not set up); \
         round trips are timed from each ping's intended send time, so pings queued behind a \
         stall count their wait (coordinated omission corrected); percentiles over all \
         connections. `direct` includes the load generator's own wake-up delay (this VM's idle \
         vCPUs take up to milliseconds to wake). \"Added\" is the path's percentile minus `direct`'s for \
         the same loss and N (negative where the tunnel recovers a lost packet sooner than \
         direct TCP's 200 ms retransmission timeout).\n\
         - CPU: user + system seconds of the tunnel's own processes (both ends; for ssh, the \
         client and sshd with its session children) per GiB downloaded in the throughput run.\n",
        kernel.trim(),
        setup.as_secs_f64(),
        match plan.rounds {
            1 => "once".to_owned(),
            n => format!("{n} times"),
        },
        plan.window.as_secs_f64(),
        plan.warmup.as_secs_f64(),
        plan.ping_rate,
        plan.latency.as_secs_f64(),
    );
    let find = |cc: &str, path: PathKind, loss: f64, streams: usize| {
        cells
            .iter()
            .find(|c| c.tcp_cc == cc && c.path == path && c.loss == loss && c.streams == streams)
    };
    let host_cc =
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap_or_default();
    for cc in &plan.tcp_ccs {
        let about = match cc.as_str() {
            "cubic" => " (the Linux default, and Debian's, Ubuntu's and RHEL's)".to_owned(),
            c if c == host_cc.trim() => " (this machine's kernel default)".to_owned(),
            _ => String::new(),
        };
        let _ = writeln!(
            r,
            "## TCP congestion control: {cc}{about}\n\n\
             Set on the veth's routes (`congctl`), so it governs the TCP paths: direct, ssh, \
             and spur h2. spur quic runs its own BBR in user space, the same in every block.\n\n\
             | Path | Loss | Streams | Throughput (MiB/s) | × ssh | RTT p50 / p99 (µs) | Added p50 / p99 (µs) | CPU s/GiB |\n\
             |---|---|---|---|---|---|---|---|"
        );
        for c in cells.iter().filter(|c| &c.tcp_cc == cc) {
            let ssh = find(cc, PathKind::Ssh, c.loss, c.streams);
            let direct = find(cc, PathKind::Direct, c.loss, c.streams);
            let ratio = match ssh {
                Some(s) if s.mib_s > 0.0 && c.path != PathKind::Direct => {
                    format!("{:.2}", c.mib_s / s.mib_s)
                }
                _ => "".into(),
            };
            let added = match direct {
                Some(d) if c.path != PathKind::Direct && c.round_trips > 0 && d.round_trips > 0 => {
                    format!(
                        "{} / {}",
                        c.p50_us as i64 - d.p50_us as i64,
                        c.p99_us as i64 - d.p99_us as i64
                    )
                }
                _ => "".into(),
            };
            let rtt = if c.round_trips > 0 {
                format!("{} / {}", c.p50_us, c.p99_us)
            } else {
                "no round trip".into()
            };
            let throughput = if c.rounds_mib_s.len() > 1 {
                let (lo, hi) = c
                    .rounds_mib_s
                    .iter()
                    .fold((f64::INFINITY, 0.0f64), |(lo, hi), &v| {
                        (lo.min(v), hi.max(v))
                    });
                format!("{:.1} ({lo:.0}–{hi:.0})", c.mib_s)
            } else {
                format!("{:.1}", c.mib_s)
            };
            let _ = writeln!(
                r,
                "| {} | {}% | {} | {throughput} | {ratio} | {rtt} | {added} | {} |",
                c.path.label(),
                c.loss,
                c.streams,
                c.cpu_s_per_gib.map_or(String::new(), |v| format!("{v:.2}")),
            );
        }
        let _ = writeln!(
            r,
            "\nAgainst the goal (≥ 2× ssh throughput and a lower p99 at 1 % loss), TCP {cc}:\n"
        );
        for path in [PathKind::SpurQuic, PathKind::SpurH2] {
            for &streams in &plan.streams {
                let loss = plan.losses.iter().copied().fold(0.0, f64::max);
                if let (Some(c), Some(s)) = (
                    find(cc, path, loss, streams),
                    find(cc, PathKind::Ssh, loss, streams),
                ) {
                    let ratio = if s.mib_s > 0.0 {
                        c.mib_s / s.mib_s
                    } else {
                        f64::INFINITY
                    };
                    // Each round's tunnel against the same round's ssh.
                    let per_round: Vec<f64> = c
                        .rounds_mib_s
                        .iter()
                        .zip(&s.rounds_mib_s)
                        .map(|(c, s)| if *s > 0.0 { c / s } else { f64::INFINITY })
                        .collect();
                    let rounds = if per_round.len() > 1 {
                        format!(
                            "; per round {}, met in {} of {}",
                            per_round
                                .iter()
                                .map(|v| format!("{v:.2}×"))
                                .collect::<Vec<_>>()
                                .join(", "),
                            per_round.iter().filter(|&&v| v >= 2.0).count(),
                            per_round.len()
                        )
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        r,
                        "- {} at {loss}% loss, {streams} stream(s): {ratio:.2}× ssh throughput ({}{rounds}), p99 {} vs {} µs ({}).",
                        path.label(),
                        if ratio >= 2.0 { "met" } else { "not met" },
                        c.p99_us,
                        s.p99_us,
                        if c.p99_us < s.p99_us {
                            "lower"
                        } else {
                            "not lower"
                        },
                    );
                }
            }
        }
        let _ = writeln!(r);
    }
    let _ = writeln!(
        r,
        "The tunnel proxy wrote {audit_lines} audit lines (one per forwarded connection)."
    );
    r
}

// --- network --------------------------------------------------------------------------------

/// The laptop namespace and its veth pair to this one; removed on drop.
struct Net {
    ns: String,
    root_dev: String,
    lap_dev: String,
}

impl Net {
    fn new() -> Result<Net> {
        // A run that was killed leaves its namespace and veth (and so a second route to the
        // same /30) behind; they carry the dead run's pid.
        if let Ok(list) = std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
        {
            for line in String::from_utf8_lossy(&list.stdout).lines() {
                let Some(id) = line
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.strip_prefix("spurbench"))
                    .and_then(|id| id.parse::<u32>().ok())
                else {
                    continue;
                };
                if !Path::new(&format!("/proc/{id}")).exists() {
                    let _ = sh(&["ip", "link", "del", &format!("sbr{id}")]);
                    let _ = sh(&["ip", "netns", "del", &format!("spurbench{id}")]);
                    let _ = sh(&["nft", "delete", "table", "inet", &format!("spurbench{id}")]);
                }
            }
        }
        let id = std::process::id() % 100_000;
        let net = Net {
            ns: format!("spurbench{id}"),
            root_dev: format!("sbr{id}"),
            lap_dev: format!("sbl{id}"),
        };
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &net.ns])
            .stderr(Stdio::null())
            .status();
        sh(&["ip", "netns", "add", &net.ns])?;
        sh(&[
            "ip",
            "link",
            "add",
            &net.root_dev,
            "type",
            "veth",
            "peer",
            "name",
            &net.lap_dev,
            "netns",
            &net.ns,
        ])?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{ROOT_IP}/30"),
            "dev",
            &net.root_dev,
        ])?;
        sh(&["ip", "link", "set", &net.root_dev, "up"])?;
        sh(&[
            "ip",
            "-n",
            &net.ns,
            "addr",
            "add",
            &format!("{LAPTOP_IP}/30"),
            "dev",
            &net.lap_dev,
        ])?;
        sh(&["ip", "-n", &net.ns, "link", "set", &net.lap_dev, "up"])?;
        sh(&["ip", "-n", &net.ns, "link", "set", "lo", "up"])?;
        // Segment before the veth, so the peer sees (and loses) wire-sized packets, not
        // 64 KiB TSO/GSO super-packets. The same for every path measured.
        let offloads = [
            "tso",
            "off",
            "gso",
            "off",
            "gro",
            "off",
            "tx-udp-segmentation",
            "off",
        ];
        let mut root = vec!["ethtool", "-K", &net.root_dev];
        root.extend(offloads);
        sh(&root)?;
        let mut lap = vec![
            "ip",
            "netns",
            "exec",
            &net.ns,
            "ethtool",
            "-K",
            &net.lap_dev,
        ];
        lap.extend(offloads);
        sh(&lap)?;
        Ok(net)
    }

    /// Drops `percent` % of the packets arriving on each end of the veth (0: none), with an
    /// nftables `numgen random` rule at prerouting: invisible to the sender, like loss on a
    /// wire. Not `tc netem`: this kernel has no `sch_netem`, and on a veth netem would drop
    /// whole GSO super-packets (up to 64 KiB) rather than packets.
    fn set_loss(&self, percent: f64) -> Result<()> {
        let table = format!("spurbench{}", std::process::id() % 100_000);
        for (ns, dev) in [(None, &self.root_dev), (Some(&self.ns), &self.lap_dev)] {
            let nft = |script: String| -> Result<()> {
                let mut c = match ns {
                    Some(ns) => {
                        let mut c = std::process::Command::new("ip");
                        c.args(["netns", "exec", ns, "nft", "-f", "-"]);
                        c
                    }
                    None => {
                        let mut c = std::process::Command::new("nft");
                        c.args(["-f", "-"]);
                        c
                    }
                };
                let mut child = c
                    .stdin(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .context("cannot run nft")?;
                std::io::Write::write_all(
                    &mut child.stdin.take().context("nft stdin")?,
                    script.as_bytes(),
                )?;
                let out = child.wait_with_output()?;
                ensure!(
                    out.status.success(),
                    "nft: {}\n{script}",
                    String::from_utf8_lossy(&out.stderr)
                );
                Ok(())
            };
            // Recreated from scratch each time, so a rerun never stacks rules.
            nft(format!(
                "table inet {table}\ndelete table inet {table}\n\
                 table inet {table} {{\n  chain loss {{\n    type filter hook prerouting priority -300;\n{}  }}\n}}\n",
                if percent > 0.0 {
                    format!(
                        "    iifname \"{dev}\" numgen random mod 10000 < {} drop\n",
                        (percent * 100.0).round() as u32
                    )
                } else {
                    String::new()
                }
            ))?;
        }
        Ok(())
    }

    /// TCP congestion control of connections across the veth (both directions): a
    /// per-route `congctl`, so the host's sysctl is left alone. QUIC's congestion control is
    /// its own (in user space) and not affected.
    fn set_tcp_cc(&self, cc: &str) -> Result<()> {
        for (ns, dev, src) in [
            (None, &self.root_dev, ROOT_IP),
            (Some(&self.ns), &self.lap_dev, LAPTOP_IP),
        ] {
            let src = src.to_string();
            let mut cmd = vec!["ip"];
            if let Some(ns) = ns {
                cmd.extend(["-n", ns.as_str()]);
            }
            cmd.extend([
                "route",
                "replace",
                "10.79.0.0/30",
                "dev",
                dev,
                "proto",
                "kernel",
                "scope",
                "link",
                "src",
                &src,
                "congctl",
                cc,
            ]);
            sh(&cmd)?;
        }
        Ok(())
    }

    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns]).arg(program);
        c
    }

    /// Opens `n` connections to `addr` from inside the laptop namespace.
    fn connect(&self, addr: SocketAddr, n: usize) -> Result<Vec<TcpStream>> {
        let path = format!("/var/run/netns/{}", self.ns);
        let streams = std::thread::spawn(move || -> Result<Vec<std::net::TcpStream>> {
            let f = std::fs::File::open(&path)?;
            nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)?;
            (0..n)
                .map(|_| {
                    let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(10))
                        .with_context(|| format!("connect {addr}"))?;
                    s.set_nodelay(true)?;
                    s.set_nonblocking(true)?;
                    Ok(s)
                })
                .collect()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("connect thread panicked"))??;
        streams
            .into_iter()
            .map(|s| Ok(TcpStream::from_std(s)?))
            .collect()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let table = format!("spurbench{}", std::process::id() % 100_000);
        let _ = std::process::Command::new("nft")
            .args(["delete", "table", "inet", &table])
            .stderr(Stdio::null())
            .status();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.root_dev])
            .status();
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .status();
    }
}

// --- OpenSSH --------------------------------------------------------------------------------

struct SshSetup {
    dir: PathBuf,
}

impl SshSetup {
    fn new(dir: &Path) -> Result<SshSetup> {
        let dir = dir.join("ssh");
        std::fs::create_dir_all(&dir)?;
        for key in ["host", "client"] {
            sh(&[
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-f",
                dir.join(key).to_str().context("path")?,
            ])?;
        }
        std::fs::copy(dir.join("client.pub"), dir.join("authorized_keys"))?;
        // Debian's sshd refuses to start without its privilege-separation directory.
        std::fs::create_dir_all("/run/sshd")?;
        std::fs::write(
            dir.join("sshd_config"),
            format!(
                "Port {SSH_PORT}\nListenAddress {ROOT_IP}\nHostKey {host}\n\
                 AuthorizedKeysFile {auth}\nPermitRootLogin prohibit-password\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n\
                 AllowTcpForwarding yes\nStrictModes no\nPidFile {pid}\nLogLevel VERBOSE\n",
                host = dir.join("host").display(),
                auth = dir.join("authorized_keys").display(),
                pid = dir.join("sshd.pid").display(),
            ),
        )?;
        Ok(SshSetup { dir })
    }

    fn start_server(&self) -> Result<Child> {
        spawn_logged(
            Command::new("/usr/sbin/sshd")
                .args(["-D", "-e", "-f"])
                .arg(self.dir.join("sshd_config")),
            &self.dir.join("sshd.log"),
        )
    }

    fn start_client(&self, net: &Net, source: SocketAddr, echo: SocketAddr) -> Result<Child> {
        spawn_logged(
            net.command("ssh")
                .args(["-N", "-v", "-F", "/dev/null", "-i"])
                .arg(self.dir.join("client"))
                .args([
                    "-o",
                    "StrictHostKeyChecking=no",
                    "-o",
                    "UserKnownHostsFile=/dev/null",
                    "-o",
                    "ExitOnForwardFailure=yes",
                    "-o",
                    "BatchMode=yes",
                    "-L",
                    &format!("127.0.0.1:{SSH_SOURCE_PORT}:{source}"),
                    "-L",
                    &format!("127.0.0.1:{SSH_ECHO_PORT}:{echo}"),
                    "-p",
                    &SSH_PORT.to_string(),
                    &format!("root@{ROOT_IP}"),
                ]),
            &self.dir.join("ssh.log"),
        )
    }

    /// The cipher ssh negotiated, from its `-v` log.
    fn negotiated(&self) -> String {
        std::fs::read_to_string(self.dir.join("ssh.log"))
            .ok()
            .and_then(|log| {
                log.lines()
                    .find_map(|l| l.split("server->client cipher: ").nth(1))
                    .and_then(|rest| rest.split_whitespace().next())
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| "unknown".into())
    }
}

// --- targets and measurements ---------------------------------------------------------------

/// Writes 64 KiB chunks to every connection until it goes away.
async fn serve_source(listener: TcpListener, stop: CancellationToken) {
    let chunk: Arc<[u8]> = vec![0x5a; CHUNK].into();
    loop {
        let (mut s, _) = tokio::select! {
            a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
            () = stop.cancelled() => return,
        };
        let (chunk, stop) = (chunk.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = async { while s.write_all(&chunk).await.is_ok() {} } => {}
                () = stop.cancelled() => {}
            }
        });
    }
}

/// Echoes `MSG`-byte messages.
async fn serve_echo(listener: TcpListener, stop: CancellationToken) {
    loop {
        let (mut s, _) = tokio::select! {
            a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
            () = stop.cancelled() => return,
        };
        let _ = s.set_nodelay(true);
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; MSG];
            tokio::select! {
                _ = async {
                    while s.read_exact(&mut buf).await.is_ok() {
                        if s.write_all(&buf).await.is_err() {
                            break;
                        }
                    }
                } => {}
                () = stop.cancelled() => {}
            }
        });
    }
}

/// Bytes downloaded on `n` connections during `window`, after `warmup`.
async fn throughput(
    net: &Net,
    addr: SocketAddr,
    n: usize,
    warmup: Duration,
    window: Duration,
) -> Result<(u64, Duration)> {
    let received = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for mut s in net.connect(addr, n)? {
        let (received, stop) = (received.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0u8; CHUNK];
            loop {
                tokio::select! {
                    r = s.read(&mut buf) => match r {
                        Ok(0) => return Err(anyhow::anyhow!("the source closed the connection")),
                        Ok(k) => { received.fetch_add(k as u64, Ordering::Relaxed); }
                        Err(e) => return Err(e.into()),
                    },
                    () = stop.cancelled() => return Ok(()),
                }
            }
        }));
    }
    tokio::time::sleep(warmup).await;
    let (b0, t0) = (received.load(Ordering::Relaxed), Instant::now());
    tokio::time::sleep(window).await;
    let (b1, took) = (received.load(Ordering::Relaxed), t0.elapsed());
    stop.cancel();
    for t in tasks {
        t.await?.context("download")?;
    }
    // Let the tunnels retire the closed streams before the next measurement.
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(b1 > b0, "nothing was downloaded through {addr}");
    Ok((b1 - b0, took))
}

/// Round-trip times (µs) of `MSG`-byte pings sent open-loop: `rate` pings per second in all,
/// ping `i` intended at `i / rate` after the start and sent on connection `i mod n` whether or
/// not earlier echoes have come back, for `duration`. Each round trip is timed from its ping's
/// intended send time, so pings held up behind a lost packet or a busy tunnel count their wait
/// (no coordinated omission), as in the proxy benchmarks (DESIGN.md §8).
async fn latency(
    net: &Net,
    addr: SocketAddr,
    n: usize,
    duration: Duration,
    rate: f64,
) -> Result<Histogram<u64>> {
    // Connecting may take seconds at 1 % loss (a lost SYN waits 1 s), and a tunnel opens its
    // stream to the far end after the local accept: the schedule starts once every connection
    // has carried one echo, so it measures established connections, not their set-up.
    let mut streams = net.connect(addr, n)?;
    let opened = futures_util::future::try_join_all(streams.iter_mut().map(|s| async move {
        let mut buf = [0x41u8; MSG];
        s.write_all(&buf).await?;
        s.read_exact(&mut buf).await?;
        Ok::<_, std::io::Error>(())
    }));
    tokio::time::timeout(STALL, opened)
        .await
        .context("a connection's first echo stalled")??;
    let total = (duration.as_secs_f64() * rate).round() as u64;
    let interval_ns = 1e9 / rate;
    let start = Instant::now() + Duration::from_millis(20);
    let intended = move |i: u64| start + Duration::from_nanos((i as f64 * interval_ns) as u64);
    let gates: Arc<Vec<Gate>> = Arc::new((0..n).map(|_| Gate::default()).collect());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pacer = {
        let (gates, stop) = (gates.clone(), stop.clone());
        std::thread::Builder::new()
            .name("ping-pacer".into())
            .spawn(move || {
                // Ping i goes to gate i mod n.
                let n = gates.len() as u64;
                let intended = |i| (i < total).then(|| intended(i));
                spur_perf::load::pacer(intended, &stop, |due| {
                    for i in due {
                        let gate = &gates[(i % n) as usize];
                        gate.released.fetch_add(1, Ordering::Release);
                        gate.notify.notify_one();
                    }
                })
            })?
    };
    let mut tasks = Vec::new();
    for (idx, s) in streams.into_iter().enumerate() {
        let gates = gates.clone();
        tasks.push(tokio::spawn(async move {
            let (mut rd, mut wr) = s.into_split();
            // This connection's pings: i < total with i mod n == idx.
            let mine = (total + (n - 1 - idx) as u64) / n as u64;
            let send = async {
                let gate = &gates[idx];
                let pings = [0x42u8; MSG * 16];
                let mut sent = 0u64;
                while sent < mine {
                    let due = gate.released.load(Ordering::Acquire).min(mine);
                    if sent < due {
                        // Pings that fell due together leave together, as an application's would.
                        let k = (due - sent).min(16);
                        wr.write_all(&pings[..k as usize * MSG]).await?;
                        sent += k;
                    } else {
                        gate.notify.notified().await;
                    }
                }
                Ok::<_, anyhow::Error>(())
            };
            let receive = async {
                let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
                let mut buf = [0u8; MSG];
                for k in 0..mine {
                    tokio::time::timeout(STALL, rd.read_exact(&mut buf))
                        .await
                        .context("an echo stalled")??;
                    let i = k * n as u64 + idx as u64;
                    let rtt = Instant::now().saturating_duration_since(intended(i));
                    h.record(rtt.as_micros().max(1) as u64)?;
                }
                Ok::<_, anyhow::Error>(h)
            };
            let ((), h) = tokio::try_join!(send, receive)?;
            Ok::<_, anyhow::Error>(h)
        }));
    }
    let mut all = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut failed = None;
    for t in tasks {
        match t.await.context("ping task panicked").and_then(|r| r) {
            Ok(h) => all.add(h)?,
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    stop.store(true, Ordering::Relaxed);
    tokio::task::spawn_blocking(move || pacer.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the ping pacer panicked"))?;
    match failed {
        Some(e) => Err(e.context("open-loop pings")),
        None => Ok(all),
    }
}

/// How many of one connection's pings have fallen due.
#[derive(Default)]
struct Gate {
    released: AtomicU64,
    notify: tokio::sync::Notify,
}

/// Waits until one ping-pong through `addr` works.
async fn ping_until_ready(net: &Net, addr: SocketAddr) -> Result<()> {
    let deadline = Instant::now() + STALL;
    loop {
        let attempt = async {
            let mut s = net.connect(addr, 1)?.pop().context("no stream")?;
            let mut buf = [7u8; MSG];
            s.write_all(&buf).await?;
            tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut buf)).await??;
            Ok::<_, anyhow::Error>(())
        };
        match attempt.await {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Waits until something listens on `addr` (a child's metrics port, bound once it is serving).
async fn wait_for_port(addr: SocketAddr, log: &Path) -> Result<()> {
    let deadline = Instant::now() + STALL + STALL;
    while TcpStream::connect(addr).await.is_err() {
        if Instant::now() >= deadline {
            bail!(
                "nothing listens on {addr}; {}:\n{}",
                log.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// The address `spur local connect` wrote for `name` into its hosts-file block.
async fn wait_for_host(hosts: &Path, name: &str, log: &Path) -> Result<Ipv4Addr> {
    let deadline = Instant::now() + STALL;
    loop {
        let text = std::fs::read_to_string(hosts).unwrap_or_default();
        let found = text.lines().find_map(|l| {
            let mut words = l.split_whitespace();
            let ip = words.next()?;
            words.any(|w| w == name).then(|| ip.parse().ok()).flatten()
        });
        if let Some(ip) = found {
            return Ok(ip);
        }
        if Instant::now() >= deadline {
            bail!(
                "{name} never appeared in {}; {}:\n{}",
                hosts.display(),
                log.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// --- processes ------------------------------------------------------------------------------

fn spur_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("SPUR_BIN") {
        return Ok(PathBuf::from(p));
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/spur");
    ensure!(
        p.exists(),
        "{} not found: build it (cargo build --release -p spur-cli -p spur-tunnel-proxy-bin) or set SPUR_BIN (spur-tunnel-proxy is taken from its directory); perf/tunnel.sh does both",
        p.display()
    );
    Ok(p)
}

fn spawn_logged(cmd: &mut Command, log: &Path) -> Result<Child> {
    let file = std::fs::File::create(log)?;
    cmd.env("SPUR_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(file)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("spawn {cmd:?}"))
}

/// SIGTERM, then SIGKILL after 10 s.
async fn stop_child(mut child: Child) {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    if tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

/// User + system CPU seconds of these processes and all their descendants alive now.
fn tree_cpu_seconds(roots: &[u32]) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let ticks = 100.0; // USER_HZ on Linux
    let mut procs = Vec::new();
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command name (which may contain spaces) start at ") ".
        let Some(rest) = stat.rsplit_once(") ").map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let (Some(ppid), Some(utime), Some(stime)) = (
            f.get(1).and_then(|v| v.parse::<u32>().ok()),
            f.get(11).and_then(|v| v.parse::<u64>().ok()),
            f.get(12).and_then(|v| v.parse::<u64>().ok()),
        ) else {
            continue;
        };
        procs.push((pid, ppid, (utime + stime) as f64 / ticks));
    }
    let mut members: Vec<u32> = roots.to_vec();
    let mut grew = true;
    while grew {
        grew = false;
        for &(pid, ppid, _) in &procs {
            if members.contains(&ppid) && !members.contains(&pid) {
                members.push(pid);
                grew = true;
            }
        }
    }
    procs
        .iter()
        .filter(|(pid, ..)| members.contains(pid))
        .map(|(.., cpu)| cpu)
        .sum()
}

fn sh(args: &[&str]) -> Result<()> {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("cannot run {args:?}"))?;
    ensure!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn which(tool: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .is_some_and(|l| l.split_whitespace().nth(2) == Some("0"))
    })
}
