//! `spur gateway`: the L4 gateway of ListenerSets (docs/l4.md, "Gateway"): TCP and UDP listeners
//! configured by the route server for this pod, drained on SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use spur_gateway::{Gateway, GatewayConfig, RouteServerConn};
use spur_runtime::parse_duration;

#[derive(Args)]
pub(crate) struct GatewayArgs {
    /// The route server's gRPC address (host:port or http://host:port); the host is the name
    /// its certificate must carry.
    #[arg(long, env = "SPUR_ROUTE_SERVER")]
    route_server: String,
    /// File with the bearer token for the route server (the pod's projected ServiceAccount
    /// token, audience spur-routeserver); re-read for every connection.
    #[arg(long, env = "SPUR_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// CA bundle (PEM) the route server's certificate must chain to; re-read for every
    /// connection. Without it the connection is plaintext.
    #[arg(
        long,
        env = "SPUR_ROUTE_SERVER_CA",
        required_unless_present = "insecure_plaintext"
    )]
    ca: Option<PathBuf>,
    /// Talk plaintext to the route server (a route server on loopback only).
    #[arg(long, env = "SPUR_INSECURE_PLAINTEXT", conflicts_with = "ca")]
    insecure_plaintext: bool,
    /// This pod's name (downward API: metadata.name).
    #[arg(long, env = "POD_NAME")]
    pod_name: String,
    /// This pod's namespace (downward API: metadata.namespace).
    #[arg(long, env = "POD_NAMESPACE")]
    pod_namespace: String,
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

pub(crate) async fn run(args: GatewayArgs) -> Result<ExitCode> {
    // Before anything listens: a SIGTERM from then on drains cleanly.
    let shutdown = spur_runtime::shutdown_signal();
    let config = GatewayConfig {
        admin_addr: Some(args.admin_addr),
        dns_interval: args.dns_interval,
        dns_server: args.dns_server,
        report_interval: args.report_interval,
        ..GatewayConfig::new(
            RouteServerConn {
                addr: args.route_server,
                ca: args.ca,
                token: args.token_file,
            },
            &args.pod_namespace,
            &args.pod_name,
        )
    };
    let gateway = Gateway::start(config)
        .await
        .context("cannot start the gateway")?;
    shutdown.await;
    gateway.shutdown().await;
    Ok(ExitCode::SUCCESS)
}
