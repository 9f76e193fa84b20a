//! The `spur` command: the standalone demo, the route server and the operator.

mod access;
mod demo;
mod demo_app;
mod gateway;
mod hub;
mod ics;
mod jobs;
mod local;
mod operator;
mod routeserver;
mod sandbox;
mod traffic;
mod traffic_server;
mod tunnelproxy;

use clap::{Parser, Subcommand};

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
    /// Serve the Routes API (gRPC 7777, REST 7778) from a directory of rule files or from the
    /// cluster's RoutingConfigs.
    Routeserver(routeserver::RouteserverArgs),
    /// Run an L4 gateway: the TCP and UDP listeners of the ListenerSets that select this pod,
    /// configured by the route server (docs/l4.md, "Gateway").
    Gateway(gateway::GatewayArgs),
    /// Run the Kubernetes controllers (Sandbox, ForkedWorkload, RouteGroup, RoutingConfig), the
    /// certificate manager and the sidecar-injection webhook.
    // Boxed: its flags make it far larger than the other variants.
    Operator(Box<operator::OperatorArgs>),
    /// Run the in-cluster end of workstation tunnels (QUIC and HTTP/2-over-TLS sessions, the
    /// tunnel API, reverse listeners for local workloads, SOCKS5 and HTTP CONNECT).
    TunnelProxy(Box<tunnelproxy::TunnelProxyArgs>),
    /// The self-hosted hub that clusters dial out to: `serve`, and its registry of clusters
    /// and API keys (docs/hub.md).
    Hub(Box<hub::HubArgs>),
    /// The in-cluster agent: keeps a tunnel to the hub and serves the streams it opens.
    Agent(Box<hub::AgentArgs>),
    /// Just-in-time access: request exec into a workload's pod, or a debug pod, for a bounded
    /// time; list and revoke grants (docs/access.md).
    Access(access::AccessArgs),
    /// Captured traffic of a sandbox: tail it, query it, and diff what its forks answered
    /// against what the baseline answered to the same requests (docs/traffic.md).
    Traffic(traffic::TrafficArgs),
    /// The traffic store: keeps what sidecars capture, serves `spur traffic` (docs/traffic.md).
    TrafficStore(traffic_server::TrafficStoreArgs),
    /// Look at a sandbox: routing key, readiness, forks, expiry, preview URLs.
    Sandbox(sandbox::SandboxArgs),
    /// Open a sandbox's preview URL (served by the hub; docs/hub.md).
    Preview(sandbox::PreviewArgs),
    /// The jobs component: Job and JobRunnerGroup controllers, log and artifact store,
    /// aggregated API (docs/jobs.md).
    Jobs(jobs::JobsArgs),
    /// Submit, list, show, follow and cancel Jobs.
    Job(jobs::JobArgs),
    /// List and download a job's artifacts.
    Artifact(jobs::ArtifactArgs),
    /// List runner groups.
    RunnerGroup(jobs::RunnerGroupArgs),
    /// The io context server of sandbox resources: the values their workflow steps hand each
    /// other (docs/resources.md).
    Ics(ics::IcsArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The demo talks to a person on stdout; only problems go to stderr unless SPUR_LOG says
    // otherwise. Servers log their lifecycle.
    spur_runtime::init_tracing(match cli.command {
        Command::Demo(_) => "warn",
        // `spur local` prints its own progress lines; the tunnel library's would repeat them.
        Command::Local(_) => "warn,spur_tunnel=error",
        Command::Sandbox(_)
        | Command::Access(_)
        | Command::Traffic(_)
        | Command::Preview(_)
        | Command::Job(_)
        | Command::Artifact(_)
        | Command::RunnerGroup(_) => "warn",
        Command::Routeserver(_)
        | Command::Gateway(_)
        | Command::Operator(_)
        | Command::TunnelProxy(_)
        | Command::Hub(_)
        | Command::Agent(_)
        | Command::Jobs(_)
        | Command::Ics(_)
        | Command::TrafficStore(_) => "info",
    });
    // Tunnels run on one thread, at both ends: a tunnel is one QUIC connection, whose driver,
    // endpoint and stream copies hand each packet to one another. On one thread those hand-offs
    // are plain function calls; across a work-stealing pool they are cross-core wake-ups. On
    // the tunnel benchmark one thread moved more per CPU second at both ends (docs/local.md).
    // The tunnel proxy runs its Kubernetes side on a second thread (tunnelproxy.rs). The other
    // servers keep a thread per core.
    let mut builder = match cli.command {
        Command::Local(_) | Command::TunnelProxy(_) | Command::Agent(_) => {
            tokio::runtime::Builder::new_current_thread()
        }
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("spur: cannot start runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            Command::Local(args) => local::run(*args).await,
            Command::Routeserver(args) => routeserver::run(args).await,
            Command::Gateway(args) => gateway::run(args).await,
            Command::Operator(args) => operator::run(*args).await,
            Command::TunnelProxy(args) => tunnelproxy::run(*args).await,
            Command::Hub(args) => hub::run(*args).await,
            Command::Agent(args) => hub::agent(*args).await,
            Command::Sandbox(args) => sandbox::sandbox(args).await,
            Command::Preview(args) => sandbox::preview(args).await,
            Command::Jobs(args) => jobs::jobs(args).await,
            Command::Job(args) => jobs::job(args).await,
            Command::Artifact(args) => jobs::artifact(args).await,
            Command::RunnerGroup(args) => jobs::runner_group(args).await,
            Command::Ics(args) => ics::run(args).await,
            Command::Access(args) => access::run(args).await,
            Command::Traffic(args) => traffic::run(args).await,
            Command::TrafficStore(args) => traffic_server::run(args).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("spur: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A Kubernetes client from `kubeconfig`, or else the in-cluster service account, $KUBECONFIG
/// or ~/.kube/config (kube's inference order).
pub(crate) async fn kube_client(
    kubeconfig: Option<&std::path::Path>,
) -> anyhow::Result<kube::Client> {
    use anyhow::Context;
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("invalid kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no Kubernetes configuration (in-cluster, $KUBECONFIG or ~/.kube/config)")?,
    };
    kube::Client::try_from(config).context("cannot build a Kubernetes client")
}
