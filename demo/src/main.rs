//! `spur-demo`: the standalone demo, the README's first command (no cluster needed).

use std::process::ExitCode;

use clap::Parser;
use spur_demo::{DemoCommand, Options};

#[derive(Parser)]
#[command(
    name = "spur-demo",
    version,
    about = "Spur's standalone demo: two services, their forks and real sidecars on loopback.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<DemoCommand>,
    #[command(flatten)]
    options: Options,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo talks to a person on stdout; only problems go to stderr unless SPUR_LOG says
    // otherwise.
    spur_runtime::init_tracing("warn");
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("spur-demo: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let invoke = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "spur-demo".into());
    let result = runtime.block_on(async move {
        match cli.command {
            Some(command) => spur_demo::run_command(command).await,
            None => spur_demo::run(cli.options, &invoke).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("spur-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}
