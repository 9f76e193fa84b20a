//! `spur demo`: the standalone demo and the tools around the example apps (`spur-demo`), plus
//! `spur demo app`, the end-to-end demo service the node tier's images run.

use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Subcommand};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct DemoArgs {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    options: spur_demo::Options,
}

#[derive(Subcommand)]
enum Command {
    /// Run the e2e demo service: answers GET with JSON naming itself and, with --call, nests
    /// the answer of an upstream it calls, propagating the routing-context headers (baggage,
    /// tracestate, traceparent, ...). GET /healthz answers "ok".
    App(crate::demo_app::AppArgs),
    #[command(flatten)]
    Tool(spur_demo::DemoCommand),
}

pub(crate) async fn run(args: DemoArgs) -> Result<ExitCode> {
    match args.command {
        Some(Command::App(args)) => crate::demo_app::run(args).await,
        Some(Command::Tool(command)) => spur_demo::run_command(command).await,
        None => {
            let exe = std::env::current_exe()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "spur".into());
            spur_demo::run(args.options, &format!("{exe} demo")).await
        }
    }
}
