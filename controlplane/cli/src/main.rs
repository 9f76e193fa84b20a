//! The `spur` command: the tools people run (the standalone demo, `spur local`, sandboxes,
//! previews, access, traffic, jobs). The server roles are binaries of their own (`bin/`, one per
//! role); their old `spur <role>` commands remain, hidden, only to name the new binary.

/// `print!` that does not panic when stdout is closed (`spur sandbox list | head`); any other
/// write error is the command's error (`?` in a function returning `anyhow::Result`).
macro_rules! out {
    ($($t:tt)*) => { $crate::write_out(format_args!($($t)*))? };
}
/// `println!`, as [`out!`].
macro_rules! outln {
    ($($t:tt)*) => { $crate::write_out(format_args!("{}\n", format_args!($($t)*)))? };
}

mod access;
mod demo;
mod demo_app;
mod doctor;
mod jobs;
mod local;
mod moved;
mod route;
mod sandbox;
mod sidecar_admin;
mod smarttest;
mod text;
mod traffic;

use clap::{Parser, Subcommand};
use spur_bin_support::Runtime;

/// Shared with the role binaries: a Kubernetes client from `--kubeconfig` or kube's inference.
pub(crate) use spur_bin_support::kube_client;

#[derive(Parser)]
#[command(
    name = "spur",
    version,
    about = "Spur: request-level sandboxes for Kubernetes, data plane first."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run example baseline and forked services behind Spur sidecars on loopback and show
    /// keyed requests reaching the fork while everything else reaches the baseline.
    Demo(demo::DemoArgs),
    /// Work on a sandbox from this workstation: connect to the cluster's tunnel proxy (reverse
    /// binds for local workloads, SOCKS5/HTTP CONNECT, cluster DNS names on loopback), show the
    /// connection, disconnect, or proxy one Service with a routing key.
    Local(Box<local::LocalArgs>),
    /// Just-in-time access: request exec into a workload's pod, or a debug pod, for a bounded
    /// time; list and revoke grants (docs/access.md).
    Access(access::AccessArgs),
    /// Captured traffic of a sandbox: tail it, query it, and diff what its forks answered
    /// against what the baseline answered to the same requests (docs/traffic.md).
    Traffic(traffic::TrafficArgs),
    /// Sandboxes: apply a file and watch it come up (--wait), list, get, delete
    /// (docs/cli.md).
    Sandbox(sandbox::SandboxArgs),
    /// Route groups: apply, list, get, delete, as for sandboxes.
    #[command(alias = "route-group")]
    Routegroup(sandbox::RouteGroupArgs),
    /// Where a request with a routing key goes, and whether each baseline sidecar has the
    /// rule live (`spur route explain --key K SERVICE[.NS][:PORT]`).
    Route(route::RouteArgs),
    /// Which service dropped a routing key: send a traced, keyed request and show the hops
    /// Spur's sidecars recorded (`spur doctor propagation --key K TARGET`).
    Doctor(doctor::DoctorArgs),
    /// Open a sandbox's preview URL (served by the hub; docs/hub.md).
    Preview(sandbox::PreviewArgs),
    /// Smart tests: send a test's requests to a sandbox and twice to its baseline, check the
    /// answers and report what the sandbox changed, noise left out (docs/smart-tests.md).
    Test(smarttest::TestArgs),
    /// Submit, list, show, follow and cancel Jobs.
    Job(jobs::JobArgs),
    /// List and download a job's artifacts.
    Artifact(jobs::ArtifactArgs),
    /// List runner groups.
    RunnerGroup(jobs::RunnerGroupArgs),
    /// Print a shell completion script: `spur completions bash > /etc/bash_completion.d/spur`,
    /// `spur completions zsh > "${fpath[1]}/_spur"`, `spur completions fish >
    /// ~/.config/fish/completions/spur.fish`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// A server role that is now a binary of its own (`spur routeserver` is `spur-routeserver`).
    #[command(flatten)]
    Moved(moved::Moved),
}

/// What [`out!`] writes with.
pub(crate) fn write_out(args: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    use std::io::Write as _;
    match std::io::stdout().write_fmt(args) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing to standard output"))
        }
        _ => Ok(()),
    }
}

/// Writes the script through a buffer: clap_complete panics on a write error (`| head`).
fn completions(shell: clap_complete::Shell) -> anyhow::Result<std::process::ExitCode> {
    use clap::CommandFactory as _;
    use std::io::Write as _;
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "spur", &mut script);
    match std::io::stdout().write_all(&script) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing the completion script"))
        }
        _ => Ok(std::process::ExitCode::SUCCESS),
    }
}

/// Parses the command line, with the checks clap's derive cannot say.
fn parse() -> Cli {
    use clap::{CommandFactory as _, FromArgMatches as _};
    let matches = Cli::command().get_matches();
    if let Some(("sandbox", m)) = matches.subcommand()
        && let Some(("apply", m)) = m.subcommand()
        && let Some(why) = sandbox::local_flags_alone(m)
    {
        let mut cmd = Cli::command();
        // Built, so that the usage line names `spur sandbox apply`.
        cmd.build();
        if let Some(apply) = cmd
            .find_subcommand_mut("sandbox")
            .and_then(|c| c.find_subcommand_mut("apply"))
        {
            apply
                .error(clap::error::ErrorKind::ArgumentConflict, why)
                .exit();
        }
    }
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

fn main() -> std::process::ExitCode {
    let cli = parse();
    // The demo talks to a person on stdout; only problems go to stderr unless SPUR_LOG says
    // otherwise.
    let log = match cli.command {
        // `spur local` prints its own progress lines; the tunnel library's would repeat them.
        Command::Local(_) => "warn,spur_tunnel=error",
        Command::Sandbox(ref args) if args.joins_locally() => {
            "warn,spur_tunnel=error,kube_client=off"
        }
        // The API server's refusals are printed once, as the command's error.
        Command::Sandbox(_)
        | Command::Routegroup(_)
        | Command::Route(_)
        | Command::Doctor(_)
        | Command::Test(_) => "warn,kube_client=off",
        _ => "warn",
    };
    // `spur local` and `spur sandbox apply --local` carry a tunnel: one thread (see
    // `Runtime::CurrentThread`).
    let runtime = match cli.command {
        Command::Local(_) => Runtime::CurrentThread,
        Command::Sandbox(ref args) if args.joins_locally() => Runtime::CurrentThread,
        _ => Runtime::MultiThread,
    };
    spur_bin_support::run("spur", log, runtime, async move {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            Command::Local(args) => local::run(*args).await,
            Command::Sandbox(args) => sandbox::sandbox(args).await,
            Command::Routegroup(args) => sandbox::route_group(args).await,
            Command::Route(args) => route::run(args).await,
            Command::Doctor(args) => doctor::run(args).await,
            Command::Preview(args) => sandbox::preview(args).await,
            Command::Test(args) => smarttest::run(args).await,
            Command::Job(args) => jobs::job(args).await,
            Command::Artifact(args) => jobs::artifact(args).await,
            Command::RunnerGroup(args) => jobs::runner_group(args).await,
            Command::Access(args) => access::run(args).await,
            Command::Traffic(args) => traffic::run(args).await,
            Command::Completions { shell } => completions(shell),
            Command::Moved(moved) => Ok(moved.refuse()),
        }
    })
}
