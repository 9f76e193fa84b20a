//! `spur-agent`: the in-cluster end that dials the hub (docs/hub.md): keeps a tunnel to it and
//! serves the streams it opens, with /healthz, /readyz (connected to the hub) and /metrics.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use prometheus_client::registry::Registry;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use spur_bin_support::Runtime;
use spur_hub::agent::pool::{HubPool, PoolSettings};
use spur_tunnel::{ClientConfig, ClientTls, Token, TransportPolicy};
use tokio_util::sync::CancellationToken;

/// The in-cluster agent: keeps a tunnel to the hub and serves the streams it opens.
#[derive(Parser)]
#[command(name = "spur-agent", version)]
struct AgentArgs {
    /// The hub's tunnel address, HOST:PORT (QUIC and HTTP/2 over TLS); several,
    /// comma-separated, for hub replicas with a name each. The agent keeps a session with every
    /// address these resolve to: one per hub replica (a headless Service, or a DNS name with a
    /// record per replica), so that any replica can reach this cluster.
    #[arg(long, env = "SPUR_HUB_ADDR", value_delimiter = ',', required = true)]
    hub: Vec<String>,
    /// How often HOST of --hub is resolved again (replicas that came or went), e.g. 5s.
    #[arg(long, env = "SPUR_HUB_RESOLVE_EVERY", default_value = "5s", value_parser = spur_runtime::parse_duration)]
    hub_resolve_every: Duration,
    /// The name every hub replica's certificate carries (default: HOST of the --hub entry the
    /// replica's address was resolved from).
    #[arg(long, env = "SPUR_HUB_SERVER_NAME")]
    hub_server_name: Option<String>,
    /// CA certificate(s) (PEM) the hub's certificate chains to (`spur-hub ca`).
    #[arg(long, env = "SPUR_HUB_CA")]
    hub_ca: PathBuf,
    /// File holding the cluster token (`spur-hub cluster add`); the env var SPUR_HUB_TOKEN
    /// is read when this is not given.
    #[arg(long, env = "SPUR_HUB_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// quic-then-h2 (default), h2-then-quic, quic or h2.
    #[arg(long, env = "SPUR_HUB_TRANSPORT", default_value = "quic-then-h2")]
    transport: String,
    /// Host suffixes the hub may reach in the cluster (comma-separated). A leading dot means
    /// names below it only.
    #[arg(
        long,
        env = "SPUR_AGENT_TARGET_SUFFIXES",
        value_delimiter = ',',
        default_value = ".svc,.svc.cluster.local"
    )]
    target_suffix: Vec<String>,
    /// Address ranges (CIDRs, comma-separated) target names may resolve to: the cluster's
    /// Service and Pod ranges. Empty: any address but the ones always refused (unspecified,
    /// link-local and cloud metadata, multicast) and loopback, which is allowed only by a range
    /// inside it (127.0.0.0/8).
    #[arg(long, env = "SPUR_AGENT_ALLOW_CIDRS", value_delimiter = ',')]
    allow_cidrs: Vec<spur_hub::agent::targets::IpNet>,
    /// Let the hub's web view read sandboxes' captured traffic from this cluster's traffic
    /// store, HOST:PORT (the chart's `spur-traffic.<namespace>.svc:7790`). The agent reads with
    /// its own token, so RBAC decides what the hub sees (the ClusterRole spur-traffic-reader).
    #[arg(long, env = "SPUR_AGENT_TRAFFIC_SERVER")]
    traffic_server: Option<String>,
    /// CA bundle (PEM) the traffic store's certificate chains to.
    #[arg(
        long,
        env = "SPUR_AGENT_TRAFFIC_SERVER_CA",
        requires = "traffic_server"
    )]
    traffic_server_ca: Option<PathBuf>,
    /// File holding the token presented to the traffic store (re-read for every connection):
    /// one issued for the store's audience `spur-traffic` (the chart mounts a projected
    /// ServiceAccount token there); the store refuses a token for the API server.
    #[arg(
        long,
        env = "SPUR_AGENT_TRAFFIC_TOKEN_FILE",
        default_value = "/var/run/spur/traffic-token/token"
    )]
    traffic_server_token_file: PathBuf,
    /// Talk to the traffic store without TLS (a store serving loopback only).
    #[arg(
        long,
        requires = "traffic_server",
        conflicts_with = "traffic_server_ca"
    )]
    traffic_insecure_plaintext: bool,
    /// Run without Kubernetes access (only TCP targets); for tests and non-Kubernetes hosts.
    #[arg(long)]
    no_kube: bool,
    /// Kubeconfig file (default: in-cluster config, then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Address of /healthz, /readyz (connected to the hub) and /metrics.
    #[arg(long, env = "SPUR_AGENT_HEALTH_ADDR", default_value = "0.0.0.0:8080")]
    health_addr: SocketAddr,
}

async fn agent(args: AgentArgs) -> Result<ExitCode> {
    let shutdown = spur_runtime::shutdown_signal();
    let token = match &args.token_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the token file {}", path.display()))?,
        None => std::env::var("SPUR_HUB_TOKEN")
            .context("no cluster token: set --token-file or SPUR_HUB_TOKEN")?,
    };
    let token = token.trim().to_owned();
    if token.is_empty() {
        bail!("the cluster token is empty");
    }
    let ca = std::fs::read(&args.hub_ca)
        .with_context(|| format!("cannot read the hub CA {}", args.hub_ca.display()))?;
    let roots = CertificateDer::pem_slice_iter(&ca)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{}: not PEM certificates", args.hub_ca.display()))?;
    let first = args.hub.first().context("no --hub")?;
    let host = match first.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host.trim_matches(['[', ']']),
        _ => bail!("--hub {first:?}: expected HOST:PORT"),
    };
    let server_name = args
        .hub_server_name
        .clone()
        .unwrap_or_else(|| host.to_owned());
    let mut client = ClientConfig::new(
        server_name,
        ClientTls {
            roots,
            client_cert: None,
        },
    );
    // Each replica's agent dials its own address (the pool sets it).
    client.quic_addr = Some(first.clone());
    client.h2_addr = Some(first.clone());
    client.transports = match args.transport.as_str() {
        "quic-then-h2" => TransportPolicy::QuicThenH2,
        "h2-then-quic" => TransportPolicy::H2ThenQuic,
        "quic" => TransportPolicy::QuicOnly,
        "h2" => TransportPolicy::H2Only,
        other => bail!("--transport {other:?}: expected quic-then-h2, h2-then-quic, quic or h2"),
    };
    client.token = Some(Token::new(token));
    client.client_name = "spur-agent".into();
    // Only the first registration waits on this (later sessions re-register on their own);
    // the agent retries it, so a short wait just means an earlier log line.
    client.open_wait = Duration::from_secs(3);
    let kube = if args.no_kube {
        None
    } else {
        Some(spur_bin_support::kube_client(args.kubeconfig.as_deref()).await?)
    };
    let mut registry = Registry::with_prefix("spur_agent");
    let traffic = match &args.traffic_server {
        None => None,
        Some(addr) => {
            if args.traffic_server_ca.is_none() && !args.traffic_insecure_plaintext {
                bail!(
                    "--traffic-server needs --traffic-server-ca (or --traffic-insecure-plaintext for a store on loopback)"
                );
            }
            let conn = spur_discovery::RouteServerConn {
                addr: addr.clone(),
                ca: args.traffic_server_ca.clone(),
                token: Some(args.traffic_server_token_file.clone()),
            };
            Some(spur_discovery::Connector::named(conn, "traffic store")?)
        }
    };
    let pool = HubPool::new(
        PoolSettings {
            hubs: args.hub.clone(),
            resolve_every: args.hub_resolve_every,
            server_name: args.hub_server_name.clone(),
        },
        client,
        kube,
        spur_hub::agent::Scope {
            target_suffixes: args.target_suffix,
            addresses: spur_hub::agent::targets::AddressPolicy {
                allow_cidrs: args.allow_cidrs,
            },
            ..spur_hub::agent::Scope::default()
        },
        traffic,
        &mut registry,
    )?;
    let ready = pool.ready();
    let stop = CancellationToken::new();
    let listener = spur_serving::health::bind_health(args.health_addr).await?;
    let http = tokio::spawn(spur_serving::health::serve_health(
        listener,
        registry,
        Some((Arc::new(ready), "not connected to any hub replica\n")),
        stop.clone(),
    ));
    let run = pool.run(stop.clone());
    tokio::pin!(run);
    let result = tokio::select! {
        () = shutdown => {
            tracing::info!("shutting down");
            stop.cancel();
            run.await
        }
        r = &mut run => r,
    };
    stop.cancel();
    http.await.context("health server panicked")??;
    result?;
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let args = AgentArgs::parse();
    // One thread: the agent's end of the hub tunnel (see `Runtime::CurrentThread`).
    spur_bin_support::run("spur-agent", "info", Runtime::CurrentThread, agent(args))
}
