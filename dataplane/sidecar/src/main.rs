//! `spur-sidecar`: parse flags, start the sidecar, drain on SIGTERM.

use clap::Parser;
use spur_sidecar::{Sidecar, SidecarArgs, SidecarConfig, init_tracing, shutdown_signal};

#[derive(Parser)]
#[command(
    name = "spur-sidecar",
    version,
    about = "Spur DevMesh sidecar: routes requests that carry a sandbox routing key to the sandbox's fork, everything else to the baseline app.",
    after_help = "Admin endpoints on --admin-addr: /live, /ready (200 once the first routing table is loaded, 503 while draining), /metrics (Prometheus), /config_dump (JSON).\nExit codes: 0 after a clean drain, 1 if connections were cut at the end of the grace period, 2 on invalid configuration."
)]
struct Cli {
    #[command(flatten)]
    sidecar: SidecarArgs,
    /// Worker threads. Default: the CPUs this process may run on (its affinity mask, so
    /// `taskset` and cgroup cpusets count). With one, a single-threaded runtime runs everything
    /// on the calling thread, which is the cheapest way to use one core.
    #[arg(long, env = "SPUR_THREADS")]
    threads: Option<usize>,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_tracing("info");
    let config = match SidecarConfig::try_from(cli.sidecar) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("spur-sidecar: {e}");
            return std::process::ExitCode::from(2);
        }
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
        let sidecar = match Sidecar::start(config).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("spur-sidecar: {e}");
                return std::process::ExitCode::from(2);
            }
        };
        shutdown_signal().await;
        if sidecar.shutdown().await == 0 {
            std::process::ExitCode::SUCCESS
        } else {
            std::process::ExitCode::FAILURE
        }
    })
}
