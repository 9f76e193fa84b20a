//! `spur-routeserver`: the route server, fed from a rule directory (standalone) or from the
//! RoutingConfigs of a Kubernetes cluster (`--kubernetes`, which also serves gateway pods their
//! L4 listeners from ListenerSets: docs/l4.md, "Gateway").

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use spur_bin_support::Runtime;
use spur_routeserver::{
    AuthConfig, KubeStore, L4Options, RouteServer, RouteServerConfig, XdsConfig, XdsTls,
};
use spur_runtime::parse_duration;
use spur_serving::ServingTls;

/// Serve the Routes API (gRPC 7777, REST 7778) from a directory of rule files or from the
/// cluster's RoutingConfigs.
#[derive(Parser)]
#[command(name = "spur-routeserver", version)]
struct RouteserverArgs {
    /// Directory of rule files (*.yaml, *.yml, *.json), each a list of routing rules; watched.
    #[arg(
        long,
        env = "SPUR_RULES_DIR",
        required_unless_present = "kubernetes",
        conflicts_with = "kubernetes"
    )]
    rules_dir: Option<PathBuf>,
    /// Serve the rules of the cluster's RoutingConfigs (and its Services for
    /// GetClusterServices), using the in-cluster service account or $KUBECONFIG.
    #[arg(long, env = "SPUR_KUBERNETES")]
    kubernetes: bool,
    /// Kubeconfig file for --kubernetes (default: in-cluster config, then $KUBECONFIG, then
    /// ~/.kube/config).
    #[arg(long, env = "SPUR_KUBECONFIG", requires = "kubernetes")]
    kubeconfig: Option<PathBuf>,
    /// gRPC Routes API address (routes.Routes, compatible with Signadot's routesapi clients).
    #[arg(long, env = "SPUR_GRPC_ADDR", default_value = "0.0.0.0:7777")]
    grpc_addr: SocketAddr,
    /// REST API, /healthz and /metrics address.
    #[arg(long, env = "SPUR_HTTP_ADDR", default_value = "0.0.0.0:7778")]
    http_addr: SocketAddr,
    /// Also serve the Routes API (gRPC) here in plaintext without authentication, for
    /// Signadot's clients (go-routesapi, sdroutes): anyone who reaches it reads every rule of
    /// every namespace. Off unless set; with --compat-http-addr.
    #[arg(long, env = "SPUR_COMPAT_GRPC_ADDR", requires = "compat_http_addr")]
    compat_grpc_addr: Option<SocketAddr>,
    /// The compatibility endpoint's REST Routes API address (plaintext, unauthenticated).
    #[arg(long, env = "SPUR_COMPAT_HTTP_ADDR", requires = "compat_grpc_addr")]
    compat_http_addr: Option<SocketAddr>,
    /// How often the rules directory is checked for changes.
    #[arg(long, env = "SPUR_RULES_POLL", default_value = "1s", value_parser = parse_duration)]
    poll_interval: Duration,
    /// Operations a watch stream computes ahead of its reader (a larger set is computed in parts).
    #[arg(long, env = "SPUR_WATCH_BUFFER", default_value_t = 1024)]
    watch_buffer: usize,
    /// Serving certificate (PEM) for both ports; re-read when it changes (a renewed Secret).
    #[arg(long, env = "SPUR_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The serving certificate's private key (PEM).
    #[arg(long, env = "SPUR_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve plaintext instead of TLS: for a route server only local clients reach.
    #[arg(long, env = "SPUR_INSECURE_PLAINTEXT", conflicts_with = "tls_cert")]
    insecure_plaintext: bool,
    /// The audience readers' Kubernetes tokens must be issued for (--kubernetes).
    #[arg(long, env = "SPUR_TOKEN_AUDIENCE", default_value = "spur-routeserver")]
    token_audience: String,
    /// How often an open watch's reader is checked again with the API server (at a random
    /// time between half of it and all of it), besides when its token expires. Each check is a
    /// TokenReview (and a SubjectAccessReview for people): 10 000 sidecars at 10 min cost the
    /// API server about 20 reviews per second.
    #[arg(long, env = "SPUR_WATCH_RECHECK", default_value = "10m", value_parser = parse_duration)]
    watch_recheck: Duration,
    /// Let anyone who reaches the ports read every rule, without a token.
    #[arg(long, env = "SPUR_ALLOW_UNAUTHENTICATED")]
    allow_unauthenticated: bool,
    /// Serve Envoy xDS (ADS) on this address, for proxyless gRPC clients and Envoy
    /// (--kubernetes only: docs/xds.md). Clients need a certificate from --xds-client-ca.
    #[arg(long, env = "SPUR_XDS_ADDR", requires = "kubernetes")]
    xds_addr: Option<SocketAddr>,
    /// CA bundle (PEM) whose client certificates the xDS port accepts (the operator's CA).
    #[arg(long, env = "SPUR_XDS_CLIENT_CA", requires = "xds_addr")]
    xds_client_ca: Option<PathBuf>,
    /// Serve xDS in plaintext, without client certificates: any client that reaches the port
    /// reads the routes of every Service.
    #[arg(
        long,
        env = "SPUR_XDS_INSECURE_PLAINTEXT",
        requires = "xds_addr",
        conflicts_with = "xds_client_ca"
    )]
    xds_insecure_plaintext: bool,
    /// The cluster's DNS domain, accepted at the end of the names xDS clients dial.
    #[arg(long, env = "SPUR_CLUSTER_DOMAIN", default_value = "cluster.local")]
    cluster_domain: String,
    /// This replica's name (the chart passes the pod's), under which it reports what its xDS
    /// clients did with EnvoyConfig revisions; the host name by default.
    #[arg(long, env = "SPUR_REPLICA_NAME")]
    replica_name: Option<String>,
    /// How often a replica refreshes an unchanged EnvoyConfig report; the operator ignores
    /// reports older than three of these.
    #[arg(long, env = "SPUR_XDS_REPORT_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    xds_report_interval: Duration,
    /// Namespaces in which EnvoyConfigs may have Secrets served over SDS (comma-separated): the
    /// route server watches the Secrets labelled spur.dev/envoy-secret=true there, and must be
    /// allowed to read Secrets in each (the chart's xds.sds.namespaces grants exactly that).
    #[arg(
        long,
        env = "SPUR_XDS_SECRET_NAMESPACES",
        value_delimiter = ',',
        requires = "xds_addr"
    )]
    xds_secret_namespaces: Vec<String>,
    /// A header whose whole value is a routing key, matched by the xDS routes besides the
    /// standard carriers (repeatable; the chart's routingKeys.customHeaders). A namespace's
    /// `sidecar.spur.dev/routing-headers` annotation adds its own (docs/routing-keys.md).
    #[arg(
        long = "routing-header",
        env = "SPUR_ROUTING_HEADERS",
        value_delimiter = ',',
        requires = "xds_addr"
    )]
    routing_headers: Vec<String>,
    /// A query parameter carrying a routing key, matched by the xDS routes (the chart's
    /// routingKeys.queryParam); a namespace's `sidecar.spur.dev/query-param` replaces it.
    #[arg(long, env = "SPUR_QUERY_PARAM", requires = "xds_addr")]
    query_param: Option<String>,
}

async fn run(args: RouteserverArgs) -> Result<ExitCode> {
    // Before the listeners open: a SIGTERM from then on shuts down cleanly.
    let shutdown = spur_runtime::shutdown_signal();
    let tls = match (&args.tls_cert, &args.tls_key, args.insecure_plaintext) {
        (Some(cert), Some(key), _) => Some(ServingTls::new(cert, key)),
        (_, _, true) => None,
        _ => anyhow::bail!(
            "the route server serves TLS: pass --tls-cert and --tls-key, or --insecure-plaintext if only local clients reach it"
        ),
    };
    let client = if args.kubernetes {
        Some(spur_bin_support::kube_client(args.kubeconfig.as_deref()).await?)
    } else {
        None
    };
    let auth = match (&client, args.allow_unauthenticated) {
        (_, true) => AuthConfig::Disabled,
        (Some(client), false) => AuthConfig::Kubernetes {
            client: client.clone(),
            audience: args.token_audience.clone(),
            watch_recheck: args.watch_recheck,
        },
        (None, false) => anyhow::bail!(
            "without --kubernetes there is no API server to check readers' tokens: pass --allow-unauthenticated to let anyone who reaches the ports read every rule"
        ),
    };
    let xds = match (
        args.xds_addr,
        &args.xds_client_ca,
        args.xds_insecure_plaintext,
    ) {
        (None, _, _) => None,
        (Some(addr), Some(ca), false) => {
            let Some(serving) = tls.clone() else {
                anyhow::bail!(
                    "--xds-client-ca needs the serving certificate (--tls-cert, --tls-key) for the xDS port too"
                );
            };
            Some(XdsConfig {
                addr,
                cluster_domain: args.cluster_domain.clone(),
                ..XdsConfig::new(Some(XdsTls {
                    serving,
                    client_ca: ca.clone(),
                    client_cn_prefix: Some(spur_routeserver::xds::CLIENT_CN_PREFIX.into()),
                }))
            })
        }
        (Some(addr), None, true) => Some(XdsConfig {
            addr,
            cluster_domain: args.cluster_domain.clone(),
            ..XdsConfig::new(None)
        }),
        (Some(_), _, _) => anyhow::bail!(
            "the xDS port requires client certificates: pass --xds-client-ca (the operator's CA bundle), or --xds-insecure-plaintext if only trusted clients reach it"
        ),
    };
    let mut xds = xds;
    if let (Some(x), Some(client)) = (xds.as_mut(), &client) {
        let replica = match &args.replica_name {
            Some(r) => r.clone(),
            None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .context("no --replica-name and cannot read the host name")?,
        };
        anyhow::ensure!(
            !replica.is_empty() && replica.len() <= 120,
            "--replica-name must have 1 to 120 bytes (it becomes a field manager name)"
        );
        x.reports = Some(spur_routeserver::xds::Reports {
            client: client.clone(),
            replica,
            interval: args.xds_report_interval,
        });
    }
    spur_routeserver::size_h2_buffers();
    let config = RouteServerConfig {
        rules_dir: args.rules_dir.clone().unwrap_or_default(),
        poll_interval: args.poll_interval,
        grpc_addr: args.grpc_addr,
        http_addr: args.http_addr,
        watch_buffer: args.watch_buffer,
        tls,
        auth,
        xds,
        l4: client.clone().map(L4Options::new),
        compat: match (args.compat_grpc_addr, args.compat_http_addr) {
            (Some(grpc_addr), Some(http_addr)) => {
                tracing::warn!(
                    %grpc_addr,
                    %http_addr,
                    "compatibility endpoint on: the Routes API in plaintext, without authentication, to anyone who reaches these ports"
                );
                Some(spur_routeserver::CompatConfig {
                    grpc_addr,
                    http_addr,
                })
            }
            _ => None,
        },
    };
    let mut secret_namespaces: Vec<String> = args
        .xds_secret_namespaces
        .iter()
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .collect();
    secret_namespaces.sort();
    secret_namespaces.dedup();
    if let Some(bad) = secret_namespaces
        .iter()
        .find(|n| !spur_api::validation::is_dns_label(n))
    {
        anyhow::bail!("--xds-secret-namespaces: {bad:?} is not a namespace name");
    }
    let server = if let Some(client) = client {
        let mut store = KubeStore::new(client).with_l4();
        if config.xds.is_some() {
            store = store
                .with_xds()
                .with_secret_namespaces(secret_namespaces)
                .with_carriers(spur_api::carriers::ExtractConfig {
                    custom_headers: args.routing_headers.clone(),
                    query_param: args.query_param.clone().filter(|q| !q.is_empty()),
                })
                .context("--routing-header, --query-param")?;
        }
        RouteServer::start_with(config, store).await
    } else {
        RouteServer::start(config).await
    }
    .context("cannot start the route server")?;
    shutdown.await;
    tracing::info!("shutting down");
    server.shutdown().await;
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let args = RouteserverArgs::parse();
    spur_bin_support::run("spur-routeserver", "info", Runtime::MultiThread, run(args))
}
