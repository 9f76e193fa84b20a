//! `spur-bench-upstream --listen 127.0.0.1:PORT [--listen ...] [--threads N]`: the benchmark's
//! upstream server (see `spur_perf::upstream` for the routes). Prints `ready <addr>` per listener
//! once bound, then serves until SIGTERM or SIGINT.

use std::io::Write as _;
use std::net::SocketAddr;

use anyhow::Context as _;
use clap::Parser;
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser)]
#[command(
    name = "spur-bench-upstream",
    about = "Benchmark upstream: GET /bytes/N, POST /echo, gRPC /spur.bench.v1.Bench/Echo (HTTP/1.1 and h2c)"
)]
struct Args {
    /// Address to listen on (repeatable); port 0 picks a free port, printed on the ready line.
    #[arg(long = "listen", required = true, value_name = "ADDR")]
    listen: Vec<SocketAddr>,
    /// Runtime worker threads; 1 runs everything on the main thread (pin it with taskset).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    threads: u16,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = if args.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(usize::from(args.threads))
            .enable_all()
            .build()?
    };
    runtime.block_on(async {
        let mut listeners = Vec::with_capacity(args.listen.len());
        for addr in &args.listen {
            listeners.push(
                TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding {addr}"))?,
            );
        }
        // Installed before announcing readiness, so a runner's SIGTERM right after `ready` is
        // never lost.
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut stdout = std::io::stdout().lock();
        for listener in &listeners {
            writeln!(stdout, "ready {}", listener.local_addr()?)?;
        }
        stdout.flush()?;
        drop(stdout);
        spur_perf::upstream::serve(listeners, async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
            }
        })
        .await
    })
}
