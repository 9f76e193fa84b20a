//! `spur-init`: programs (or removes) the pod's inbound interception rules, then exits.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use spur_init::{Config, InitArgs, exit};

#[derive(Parser)]
#[command(
    name = "spur-init",
    version,
    about = "Spur DevMesh init: redirects the pod's inbound TCP to the sidecar (iptables-legacy or nftables), except the sidecar's own connections and excluded ports.",
    after_help = "Needs CAP_NET_ADMIN, and CAP_NET_RAW for iptables-legacy (init container: securityContext.capabilities.add: [NET_ADMIN, NET_RAW]).\nExit codes: 0 done (also a --cleanup with nothing installed, and --dry-run), 1 a rule tool failed, 2 invalid flags or environment, 3 a required capability is missing, 4 a required tool is not installed.\nRules and details: docs/interception.md."
)]
struct Cli {
    #[command(flatten)]
    init: InitArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let config = match Config::try_from(cli.init) {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    if config.dry_run {
        let mut out = std::io::stdout().lock();
        for step in spur_init::plan(&config) {
            if let Err(e) = write!(out, "{step}") {
                eprintln!("spur-init: cannot write to stdout: {e}");
                return ExitCode::from(exit::TOOL_FAILED);
            }
        }
        return ExitCode::SUCCESS;
    }
    match spur_init::run(&config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

fn fail(e: &spur_init::Error) -> ExitCode {
    eprintln!("spur-init: {e}");
    ExitCode::from(e.exit_code())
}

fn init_tracing() {
    let filter = std::env::var("SPUR_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| "info".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .try_init();
}
