//! `spur-job-executor`: `install` (the runner pod's init container) and `serve` (its runner
//! container). See the library's documentation and docs/jobs.md.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use spur_job_executor::{Config, Limits, tls};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "spur-job-executor",
    version,
    about = "Runs Spur Jobs inside a runner pod"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Copy this binary and the TLS files into DIR (the pod's shared volume): DIR/bin/ and
    /// DIR/tls/.
    Install {
        /// The shared volume.
        #[arg(long)]
        to: PathBuf,
        /// Directory with ca.crt, tls.crt and tls.key (the mounted Secret).
        #[arg(long)]
        tls_from: PathBuf,
    },
    /// Serve the job-execution API.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0:7447")]
        listen: std::net::SocketAddr,
        /// Directory with ca.crt, tls.crt and tls.key; tls.key is deleted once read.
        #[arg(long)]
        tls_dir: PathBuf,
        /// Keep tls.key after reading it (for tests that reuse the directory).
        #[arg(long)]
        keep_key: bool,
        /// Where attempts keep their script, log and working directory.
        #[arg(long)]
        work_dir: PathBuf,
        /// Output beyond this many bytes per attempt is dropped.
        #[arg(long, default_value_t = 64 * 1024 * 1024)]
        max_log_bytes: u64,
        /// Between SIGTERM and SIGKILL when an attempt is canceled or times out.
        #[arg(long, default_value = "5s", value_parser = spur_runtime::parse_duration)]
        kill_grace: Duration,
        /// Where the pod's outbound sidecar reads the routing key to add (runner pods with
        /// routing-key injection): the running attempt's key when it asked for injection,
        /// empty otherwise.
        #[arg(long)]
        routing_key_file: Option<PathBuf>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    spur_runtime::init_tracing("info");
    match cli.cmd {
        Cmd::Install { to, tls_from } => install(&to, &tls_from),
        Cmd::Serve {
            listen,
            tls_dir,
            keep_key,
            work_dir,
            max_log_bytes,
            kill_grace,
            routing_key_file,
        } => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("tokio runtime")?;
            rt.block_on(async move {
                let tls = tls::server_config(&tls_dir, !keep_key)?;
                let listener = tokio::net::TcpListener::bind(listen)
                    .await
                    .with_context(|| format!("listening on {listen}"))?;
                let stop = CancellationToken::new();
                let signal = spur_runtime::shutdown_signal();
                let s = stop.clone();
                tokio::spawn(async move {
                    signal.await;
                    tracing::info!("SIGTERM: stopping");
                    s.cancel();
                });
                let cfg = Config {
                    work_dir,
                    limits: Limits {
                        max_log_bytes,
                        kill_grace,
                        routing_key_file,
                    },
                };
                spur_job_executor::serve(listener, tls, cfg, stop).await?;
                Ok(())
            })
        }
    }
}

fn install(to: &Path, tls_from: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let bin = to.join("bin");
    let tls_dir = to.join("tls");
    for d in [&bin, &tls_dir] {
        std::fs::create_dir_all(d).with_context(|| d.display().to_string())?;
    }
    let me = std::env::current_exe().context("locating this binary")?;
    let dest = bin.join("spur-job-executor");
    std::fs::copy(&me, &dest).with_context(|| format!("{} -> {}", me.display(), dest.display()))?;
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o555))
        .with_context(|| dest.display().to_string())?;
    for name in [tls::CA_FILE, tls::CERT_FILE, tls::KEY_FILE] {
        let (from, dest) = (tls_from.join(name), tls_dir.join(name));
        std::fs::copy(&from, &dest)
            .with_context(|| format!("{} -> {}", from.display(), dest.display()))?;
        // Readable by any uid: the runner container's user is the image's, unknown here. The
        // executor deletes the key as soon as it has read it.
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o444))
            .with_context(|| dest.display().to_string())?;
    }
    tracing::info!(to = %to.display(), "job executor installed");
    Ok(())
}
