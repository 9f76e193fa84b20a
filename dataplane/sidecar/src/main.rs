//! `spur-sidecar`: parse flags, start the sidecar, drain on SIGTERM.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use clap::Parser;
use spur_runtime::{init_tracing, shutdown_signal};
use spur_sidecar::{Handover, Sidecar, SidecarArgs, SidecarConfig, intercept, supervise};

#[derive(Parser)]
#[command(
    name = "spur-sidecar",
    version,
    about = "Spur DevMesh sidecar: routes requests that carry a sandbox routing key to the sandbox's fork, everything else to the baseline app.",
    after_help = "Admin endpoints on --admin-addr: /live, /ready (200 once the first routing table is loaded, 503 while draining), /metrics (Prometheus), /config_dump (JSON).\nWith --intercept the sidecar starts as root, programs the interception rules as spur-init would (settings from spur-init's variables SPUR_INIT_MODE, SPUR_PROXY_UID, SPUR_INBOUND_PORTS, SPUR_EXCLUDE_INBOUND_PORTS, SPUR_INIT_IPV6; the redirect port is --inbound-addr's, the admin port is never redirected; with --kafka-ports the pod's connections to those broker ports go to the Kafka relay on --kafka-proxy-port), then runs as SPUR_PROXY_UID with no capabilities (docs/interception.md).\nExit codes: 0 after a clean drain, 1 if connections were cut at the end of the grace period, 2 on invalid configuration, 3 if --intercept could not program the rules or give up root."
)]
struct Cli {
    #[command(flatten)]
    sidecar: SidecarArgs,
    /// Worker threads. Default: the CPUs this process may run on (its affinity mask, so
    /// `taskset` and cgroup cpusets count). With one, a single-threaded runtime runs everything
    /// on the calling thread, which is the cheapest way to use one core.
    #[arg(long, env = "SPUR_THREADS")]
    threads: Option<usize>,
    /// Do not run a sidecar: wait at most this long (e.g. `30s`) until the sidecar of this
    /// container answers on its admin address, then exit 0 (1 on timeout). The injected
    /// container's postStart hook, so the kubelet starts the app only once the sidecar accepts
    /// the traffic the init container redirects to it.
    // Handled by `WaitCli` before this parser runs; declared here for --help.
    #[arg(long, value_name = "TIMEOUT", value_parser = spur_runtime::parse_duration)]
    wait_listening: Option<Duration>,
    /// Program the pod's interception rules before starting, then give up root (see below).
    /// Needs root with NET_ADMIN, NET_RAW, SETUID and SETGID; requires --transparent.
    #[arg(long, env = "SPUR_INTERCEPT")]
    intercept: bool,
    /// After SIGTERM, keep accepting connections this long before draining (a second signal
    /// ends the wait). For a sidecar that receives SIGTERM together with its app, so that it
    /// serves as long as an app that finishes its own requests first.
    #[arg(long, env = "SPUR_DRAIN_DELAY", default_value = "0s", value_parser = spur_runtime::parse_duration)]
    drain_delay: Duration,
    /// Hold the inbound and admin listeners in this process and serve in a worker process that
    /// is started again on the same listeners if it dies: connections that arrive meanwhile wait
    /// instead of being refused (docs/injection.md, "When the sidecar crashes"). SIGTERM and
    /// SIGINT are passed on to the worker.
    #[arg(long, env = "SPUR_SUPERVISE")]
    supervise: bool,
    /// With --supervise: how long a restarted worker keeps inbound connections waiting for its
    /// first routing table; after it, it serves them, and keyed requests reach the baseline
    /// until a table arrives.
    #[arg(long, env = "SPUR_RESTART_TABLE_WAIT", default_value = "5s", value_parser = spur_runtime::parse_duration)]
    restart_table_wait: Duration,
}

/// `--wait-listening` alone: it needs none of the sidecar's required flags.
#[derive(Parser)]
#[command(name = "spur-sidecar")]
struct WaitCli {
    #[arg(long, value_parser = spur_runtime::parse_duration)]
    wait_listening: Duration,
    #[arg(long, env = "SPUR_ADMIN_ADDR", default_value = "127.0.0.1:15020")]
    admin_addr: SocketAddr,
}

fn main() -> std::process::ExitCode {
    if std::env::args_os().any(|a| {
        a.to_str()
            .is_some_and(|a| a == "--wait-listening" || a.starts_with("--wait-listening="))
    }) {
        let w = WaitCli::parse();
        return wait_listening(w.admin_addr, w.wait_listening);
    }
    let cli = Cli::parse();
    init_tracing("info");
    let config = match SidecarConfig::try_from(cli.sidecar) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("spur-sidecar: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    // A worker of `--supervise`: the supervisor programmed the rules and holds the listeners.
    let worker = match std::env::var(supervise::WORKER_ENV) {
        Ok(v) => match v.parse::<u32>() {
            Ok(n) => Some(n),
            Err(_) => {
                eprintln!(
                    "spur-sidecar: {}={v:?} is not a count",
                    supervise::WORKER_ENV
                );
                return std::process::ExitCode::from(2);
            }
        },
        Err(_) => None,
    };
    if cli.intercept && worker.is_none() {
        if !matches!(config.inbound, spur_proxy::Inbound::Transparent) {
            eprintln!("spur-sidecar: --intercept requires --transparent");
            return std::process::ExitCode::from(2);
        }
        let admin = config.admin_addr.unwrap_or(config.inbound_addr);
        let outbound = config.inject_key_file.is_some();
        let rules =
            intercept::rules_from_env(config.inbound_addr, admin, outbound, config.kafka.as_ref());
        let (rules, uid) = match rules {
            Ok(r) => r,
            Err(e) => {
                eprintln!("spur-sidecar: {e}");
                return std::process::ExitCode::from(2);
            }
        };
        // Before the runtime starts: the ids must change while this is the only thread.
        if let Err(e) = intercept::intercept_then_drop(&rules, uid) {
            eprintln!("spur-sidecar: {e}");
            return std::process::ExitCode::from(3);
        }
        tracing::info!(
            uid,
            "interception rules programmed; running without privileges"
        );
    }
    if cli.supervise && worker.is_none() {
        return supervise(&config);
    }
    let handover = match worker {
        Some(restarts) => {
            // Ends the worker with its supervisor, outside a container as well.
            if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM) {
                tracing::warn!(error = %e, "cannot ask to be stopped with the supervisor");
            }
            // A supervisor that died before that request sends no signal: checked once, after.
            let expected = std::env::var_os(supervise::SUPERVISOR_ENV);
            if supervise::supervisor_gone(expected.as_deref(), nix::unistd::getppid().as_raw()) {
                eprintln!(
                    "spur-sidecar: the supervisor that started this worker (pid {}) is gone; not serving",
                    expected.as_deref().unwrap_or_default().to_string_lossy()
                );
                return std::process::ExitCode::FAILURE;
            }
            match supervise::handover(
                restarts,
                config.admin_addr.is_some(),
                cli.restart_table_wait,
            ) {
                Ok(h) => h,
                Err(e) => {
                    eprintln!("spur-sidecar: {e}");
                    return std::process::ExitCode::from(2);
                }
            }
        }
        None => Handover::default(),
    };
    let threads = cli
        .threads
        .filter(|t| *t > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("spur-sidecar: cannot start runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        // Before the listeners open: a SIGTERM from then on drains.
        let shutdown = shutdown_signal();
        let sidecar = match Sidecar::start_with(config, handover).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("spur-sidecar: {e}");
                return std::process::ExitCode::from(2);
            }
        };
        shutdown.await;
        if !cli.drain_delay.is_zero() {
            tracing::info!(delay = ?cli.drain_delay, "SIGTERM: still accepting before the drain");
            tokio::select! {
                _ = tokio::time::sleep(cli.drain_delay) => {}
                _ = shutdown_signal() => {}
            }
        }
        if sidecar.shutdown().await == 0 {
            std::process::ExitCode::SUCCESS
        } else {
            std::process::ExitCode::FAILURE
        }
    })
}

/// `--supervise`: binds the listeners first (so their descriptors are consecutive), then runs
/// workers on them on a single-threaded runtime.
fn supervise(config: &SidecarConfig) -> std::process::ExitCode {
    let held = match supervise::Held::bind(config.inbound_addr, config.admin_addr) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("spur-sidecar: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("spur-sidecar: --supervise: cannot find this program: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("spur-sidecar: cannot start runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let args = std::env::args_os().skip(1).collect();
    std::process::ExitCode::from(runtime.block_on(supervise::run(held, program, args)))
}

/// Asks the admin address (an unspecified address means this host) for `/live` until it answers
/// or `timeout` passes. The admin server is served after every other listener is bound, so an
/// answer means the sidecar takes traffic. An accepted connection alone would not do: under
/// `--supervise` the supervisor holds the admin listener before its worker has bound the Kafka
/// listeners.
fn wait_listening(admin: SocketAddr, timeout: Duration) -> std::process::ExitCode {
    let target = if admin.ip().is_unspecified() {
        let local: IpAddr = if admin.is_ipv4() {
            Ipv4Addr::LOCALHOST.into()
        } else {
            Ipv6Addr::LOCALHOST.into()
        };
        SocketAddr::new(local, admin.port())
    } else {
        admin
    };
    let deadline = Instant::now() + timeout;
    loop {
        match answers(target) {
            Ok(()) => return std::process::ExitCode::SUCCESS,
            Err(e) if Instant::now() >= deadline => {
                eprintln!("spur-sidecar: no sidecar answers on {target} after {timeout:?}: {e}");
                return std::process::ExitCode::FAILURE;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// One `GET /live` on a new connection: Ok once the first bytes of an HTTP/1 response arrive
/// (any status: the server runs).
fn answers(target: SocketAddr) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let mut tcp = TcpStream::connect_timeout(&target, Duration::from_millis(200))?;
    tcp.set_read_timeout(Some(Duration::from_millis(500)))?;
    tcp.set_write_timeout(Some(Duration::from_millis(500)))?;
    tcp.write_all(b"GET /live HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut head = [0u8; 7];
    tcp.read_exact(&mut head)?;
    if &head == b"HTTP/1." {
        Ok(())
    } else {
        Err(std::io::Error::other("not an HTTP/1 response"))
    }
}
