//! `spur-gateway`: the L4 gateway of ListenerSets (docs/l4.md, "Gateway"): TCP and UDP listeners
//! configured by the route server for this pod, drained on SIGTERM; or, with `--config`, the
//! listeners of a local `L4Config` file, read again on SIGHUP (docs/l4.md, "Standalone").

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use spur_bin_support::Runtime;
use spur_gateway::{Gateway, GatewayConfig, RouteServerConn, Standalone, StandaloneConfig};
use spur_runtime::parse_duration;

/// Run an L4 gateway: the TCP and UDP listeners of the ListenerSets that select this pod,
/// configured by the route server (docs/l4.md, "Gateway").
#[derive(Parser)]
#[command(name = "spur-gateway", version)]
#[command(after_help = "\
Standalone (no cluster): `spur-gateway --config l4.yaml [--admin-addr ADDR]` runs the listeners \
of an L4Config file (YAML, or JSON when the name ends in .json; the schema the route server \
sends, docs/l4.md), endpoints given as addresses. An invalid file is refused at start-up with the \
file and the field named (exit code 1). SIGHUP reads the file again: a valid one is applied \
(unchanged listeners keep their sockets and sessions), an invalid one is logged and counted \
(spur_gateway_config_updates_total{result=\"rejected\"}) and the last good one keeps running. \
SIGTERM drains for the file's drainGrace.")]
struct GatewayArgs {
    /// Standalone mode: run the listeners of this L4Config file (YAML or JSON) instead of
    /// asking a route server; SIGHUP reads it again. Conflicts with the route-server flags.
    #[arg(
        long,
        env = "SPUR_GATEWAY_CONFIG",
        conflicts_with_all = [
            "route_server", "token_file", "ca", "insecure_plaintext", "pod_name",
            "pod_namespace", "dns_interval", "dns_server", "report_interval",
        ]
    )]
    config: Option<PathBuf>,
    /// The route server's gRPC address (host:port or http://host:port); the host is the name
    /// its certificate must carry. Required unless --config.
    #[arg(long, env = "SPUR_ROUTE_SERVER", required_unless_present = "config")]
    route_server: Option<String>,
    /// File with the bearer token for the route server (the pod's projected ServiceAccount
    /// token, audience spur-routeserver); re-read for every connection.
    #[arg(long, env = "SPUR_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// CA bundle (PEM) the route server's certificate must chain to; re-read for every
    /// connection. Without it the connection is plaintext.
    #[arg(
        long,
        env = "SPUR_ROUTE_SERVER_CA",
        required_unless_present_any = ["insecure_plaintext", "config"]
    )]
    ca: Option<PathBuf>,
    /// Talk plaintext to the route server (a route server on loopback only).
    #[arg(long, env = "SPUR_INSECURE_PLAINTEXT", conflicts_with = "ca")]
    insecure_plaintext: bool,
    /// This pod's name (downward API: metadata.name). Required unless --config.
    #[arg(long, env = "POD_NAME", required_unless_present = "config")]
    pod_name: Option<String>,
    /// This pod's namespace (downward API: metadata.namespace). Required unless --config.
    #[arg(long, env = "POD_NAMESPACE", required_unless_present = "config")]
    pod_namespace: Option<String>,
    /// Admin server: /live, /ready, /metrics, /config_dump (loopback clients only).
    #[arg(long, env = "SPUR_ADMIN_ADDR", default_value = "0.0.0.0:15021")]
    admin_addr: SocketAddr,
    /// The longest a DNS endpoint's answer is used: names are resolved again when their
    /// records expire (their TTL, at least 1 s apart) and at least this often.
    #[arg(long, env = "SPUR_DNS_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    dns_interval: Duration,
    /// Resolve DNS endpoints with this name server (ip:port) instead of the system's
    /// configuration (/etc/resolv.conf and /etc/hosts).
    #[arg(long, env = "SPUR_DNS_SERVER")]
    dns_server: Option<SocketAddr>,
    /// How often endpoint health is reported to the route server when nothing changed.
    #[arg(long, env = "SPUR_REPORT_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    report_interval: Duration,
}

async fn run(args: GatewayArgs) -> Result<ExitCode> {
    // Before anything listens: a SIGTERM from then on drains cleanly.
    let shutdown = spur_runtime::shutdown_signal();
    if let Some(file) = args.config {
        let gateway = Standalone::start(StandaloneConfig {
            file,
            admin_addr: Some(args.admin_addr),
        })
        .await
        .context("cannot start the gateway")?;
        gateway.run(shutdown).await;
        return Ok(ExitCode::SUCCESS);
    }
    // clap requires these without --config.
    let (Some(route_server), Some(pod_name), Some(pod_namespace)) =
        (args.route_server, args.pod_name, args.pod_namespace)
    else {
        anyhow::bail!(
            "--route-server, --pod-name and --pod-namespace are required without --config"
        );
    };
    let config = GatewayConfig {
        admin_addr: Some(args.admin_addr),
        dns_interval: args.dns_interval,
        dns_server: args.dns_server,
        report_interval: args.report_interval,
        ..GatewayConfig::new(
            RouteServerConn {
                addr: route_server,
                ca: args.ca,
                token: args.token_file,
            },
            &pod_namespace,
            &pod_name,
        )
    };
    let gateway = Gateway::start(config)
        .await
        .context("cannot start the gateway")?;
    shutdown.await;
    gateway.shutdown().await;
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let args = GatewayArgs::parse();
    spur_bin_support::run("spur-gateway", "info", Runtime::MultiThread, run(args))
}
