//! `spur-tunnel-proxy`: the in-cluster end of workstation tunnels, with `/metrics` and
//! `/healthz` on a small HTTP port. Drains sessions on SIGTERM.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::Parser;
use prometheus_client::registry::Registry;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use spur_bin_support::Runtime;
use tokio_util::sync::CancellationToken;

/// Run the in-cluster end of workstation tunnels (QUIC and HTTP/2-over-TLS sessions, the
/// tunnel API, reverse listeners for local workloads, SOCKS5 and HTTP CONNECT).
#[derive(Parser)]
#[command(name = "spur-tunnel-proxy", version)]
struct TunnelProxyArgs {
    /// Kubeconfig file (default: in-cluster config, then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The tunnel proxy's namespace (tunnel Leases).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    namespace: String,
    /// The namespace of the workstation token Secrets (default: --namespace). The chart gives
    /// them a namespace of their own, where the tunnel proxy may list Secrets, so that it
    /// cannot read the others (the CA's key).
    #[arg(long, env = "SPUR_TOKEN_NAMESPACE")]
    token_namespace: Option<String>,
    /// This replica's pod name (the tunnel Leases' holder).
    #[arg(long, env = "POD_NAME")]
    pod_name: String,
    /// This replica's pod IP (where the sandbox Services' endpoints point).
    #[arg(long, env = "POD_IP")]
    pod_ip: IpAddr,
    /// This replica's pod UID: the pod owns the tunnel Leases it writes, so they go with it
    /// (a replica deleted by a rollout or `helm uninstall`). The chart sets it.
    #[arg(long, env = "POD_UID")]
    pod_uid: Option<String>,
    /// UDP address of the QUIC listener (empty to disable).
    #[arg(long, env = "SPUR_QUIC_ADDR", default_value = "0.0.0.0:8443")]
    quic_addr: String,
    /// TCP address of the HTTP/2-over-TLS listener (empty to disable).
    #[arg(long, env = "SPUR_H2_ADDR", default_value = "0.0.0.0:8443")]
    h2_addr: String,
    /// SOCKS5 listener (default: none; HTTP CONNECT there is refused, it carries no token).
    /// Plaintext, with the workstation as username and its token as password: bind it only
    /// where the network is trusted (e.g. 127.0.0.1, reached through `kubectl port-forward`).
    /// Workstations do not need it: their traffic rides the authenticated, encrypted tunnel.
    #[arg(long, env = "SPUR_SOCKS_ADDR", default_value = "")]
    socks_addr: String,
    /// Serving certificate chain (PEM) of the tunnel listeners.
    #[arg(long, env = "SPUR_TLS_CERT")]
    tls_cert: PathBuf,
    /// Its private key (PEM).
    #[arg(long, env = "SPUR_TLS_KEY")]
    tls_key: PathBuf,
    /// CA (PEM) whose client certificates identify workstations, besides tokens.
    #[arg(long, env = "SPUR_CLIENT_CA")]
    client_ca: Option<PathBuf>,
    /// Seconds a tunnel Lease stays valid without renewal.
    #[arg(long, env = "SPUR_LEASE_DURATION", default_value_t = 15, value_parser = clap::value_parser!(u64).range(3..=3600))]
    lease_duration: u64,
    /// The cluster DNS domain (reported to workstations).
    #[arg(long, env = "SPUR_CLUSTER_DOMAIN", default_value = "cluster.local")]
    cluster_domain: String,
    /// Fixed address for a cluster target, `HOST:PORT=IP:PORT`, used instead of DNS
    /// (repeatable; comma-separated in env). For proxies outside the cluster's DNS.
    #[arg(long = "resolve", env = "SPUR_RESOLVE", value_delimiter = ',', value_parser = spur_sidecar::parse_resolve)]
    resolve: Vec<(String, SocketAddr)>,
    /// The only destinations workstations may reach (comma-separated CIDRs, checked after name
    /// resolution): the cluster's Service and Pod ranges. Empty: any address not refused.
    #[arg(long, env = "SPUR_ALLOW_CIDRS", default_value = "")]
    allow_cidrs: String,
    /// Destinations workstations may not reach (comma-separated CIDRs), besides the
    /// unspecified, loopback, link-local, multicast and broadcast addresses, which are always
    /// refused in every form. Default: cloud metadata services outside link-local.
    #[arg(long, env = "SPUR_DENY_CIDRS", default_value = spur_tunnelproxy::Destinations::DEFAULT_DENY)]
    deny_cidr: String,
    /// Lets workstations reach loopback addresses: only for tests whose cluster is this
    /// machine's loopback. In a pod, loopback is the proxy's own ports.
    #[arg(long, hide = true)]
    allow_loopback_destinations: bool,
    /// Ports reverse listeners take, `FIRST-LAST`, so that a NetworkPolicy can name them
    /// (empty: ephemeral ports).
    #[arg(long, env = "SPUR_REVERSE_PORTS", default_value = "")]
    reverse_ports: String,
    /// Sources (comma-separated CIDRs) that may connect to reverse listeners besides sidecar
    /// pods of the bind's namespace and Spur gateway pods: e.g. a mesh's proxies.
    #[arg(long, env = "SPUR_REVERSE_ALLOW_CIDRS", default_value = "")]
    reverse_allow_cidrs: String,
    /// Namespaces whose pods labelled spur.dev/gateway are Spur L4 gateways, allowed to reach
    /// reverse listeners (comma-separated; default: --namespace).
    #[arg(long, env = "SPUR_GATEWAY_NAMESPACES", value_delimiter = ',')]
    gateway_namespaces: Vec<String>,
    /// Address of /metrics and /healthz.
    #[arg(long, env = "SPUR_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
}

/// How often the certificate, key and client CA files are checked for changes.
const TLS_RELOAD_EVERY: Duration = Duration::from_secs(10);

/// The listeners' TLS material, as files (a mounted Secret).
struct TlsFiles {
    cert: PathBuf,
    key: PathBuf,
    client_ca: Option<PathBuf>,
}

/// The raw contents of [`TlsFiles`], compared to notice a change.
#[derive(PartialEq, Eq)]
struct TlsRead {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl TlsFiles {
    fn load(&self) -> Result<(spur_tunnel::ServerTls, TlsRead)> {
        let read = self.read()?;
        Ok((self.parse(&read)?, read))
    }

    fn read(&self) -> Result<TlsRead> {
        let file =
            |p: &PathBuf| std::fs::read(p).with_context(|| format!("cannot read {}", p.display()));
        Ok(TlsRead {
            cert: file(&self.cert)?,
            key: file(&self.key)?,
            client_ca: self.client_ca.as_ref().map(file).transpose()?,
        })
    }

    fn parse(&self, read: &TlsRead) -> Result<spur_tunnel::ServerTls> {
        let chain = CertificateDer::pem_slice_iter(&read.cert)
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("cannot read certificates from {}", self.cert.display()))?;
        if chain.is_empty() {
            anyhow::bail!("no certificate in {}", self.cert.display());
        }
        let key = PrivateKeyDer::from_pem_slice(&read.key)
            .with_context(|| format!("cannot read a private key from {}", self.key.display()))?;
        let client_ca = match (&read.client_ca, &self.client_ca) {
            (Some(pem), Some(path)) => {
                let cas = CertificateDer::pem_slice_iter(pem)
                    .collect::<Result<Vec<_>, _>>()
                    .with_context(|| format!("cannot read the client CA {}", path.display()))?;
                if cas.is_empty() {
                    anyhow::bail!("no certificate in the client CA {}", path.display());
                }
                cas
            }
            _ => Vec::new(),
        };
        Ok(spur_tunnel::ServerTls {
            cert: spur_tunnel::ServerCert::Static { chain, key },
            client_ca,
            require_client_cert: false,
        })
    }
}

/// A current-thread runtime on a thread of its own. Dropping it cancels what still runs there
/// and joins the thread.
struct ControlThread {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ControlThread {
    fn start() -> Result<ControlThread> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the control runtime")?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("spur-control".into())
            .spawn(move || {
                let _ = runtime.block_on(stopped);
                // Name lookups of the Kubernetes client run on blocking threads; do not wait
                // for a hung one.
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .context("cannot start the control thread")?;
        Ok(ControlThread {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

impl Drop for ControlThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn optional_addr(flag: &str, s: &str) -> Result<Option<SocketAddr>> {
    if s.trim().is_empty() {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .with_context(|| format!("--{flag} {s:?} is not an address (IP:PORT)"))
}

async fn run(args: TunnelProxyArgs) -> Result<ExitCode> {
    // Before anything listens: a SIGTERM from then on shuts down cleanly.
    let shutdown = spur_runtime::shutdown_signal();
    let quic_addr = optional_addr("quic-addr", &args.quic_addr)?;
    let h2_addr = optional_addr("h2-addr", &args.h2_addr)?;
    let socks_addr = optional_addr("socks-addr", &args.socks_addr)?;
    let mut destinations = spur_tunnelproxy::Destinations::new(
        spur_tunnelproxy::Destinations::parse_cidrs(&args.allow_cidrs).context("--allow-cidrs")?,
        spur_tunnelproxy::Destinations::parse_cidrs(&args.deny_cidr).context("--deny-cidr")?,
    );
    if args.allow_loopback_destinations {
        destinations = destinations.allowing_loopback();
    }
    let reverse_ports = spur_tunnelproxy::TunnelProxyConfig::parse_port_range(&args.reverse_ports)
        .context("--reverse-ports")?;
    let mut gateway_namespaces: Vec<String> = args
        .gateway_namespaces
        .into_iter()
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .collect();
    if gateway_namespaces.is_empty() {
        gateway_namespaces.push(args.namespace.clone());
    }
    let reverse_sources = spur_tunnelproxy::ReverseSourcesConfig {
        allow: spur_tunnelproxy::Destinations::parse_cidrs(&args.reverse_allow_cidrs)
            .context("--reverse-allow-cidrs")?,
        gateway_namespaces,
    };
    let tls_files = TlsFiles {
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
        client_ca: args.client_ca.clone(),
    };
    let (tls, mut tls_read) = tls_files.load()?;
    // This task's thread carries the tunnels; the Kubernetes client, watches and Leases, and
    // the metrics server run on a thread of their own.
    let control = ControlThread::start()?;
    let kubeconfig = args.kubeconfig.clone();
    let client = control
        .handle()
        .spawn(async move {
            let client = spur_bin_support::kube_client(kubeconfig.as_deref()).await?;
            client
                .apiserver_version()
                .await
                .context("cannot reach the Kubernetes API server")?;
            anyhow::Ok(client)
        })
        .await
        .context("Kubernetes client start-up failed")??;
    let mut registry = Registry::with_prefix("spur");
    let stop = CancellationToken::new();
    let proxy = spur_tunnelproxy::run(
        client,
        spur_tunnelproxy::TunnelProxyConfig {
            token_namespace: args
                .token_namespace
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| args.namespace.clone()),
            namespace: args.namespace,
            pod_name: args.pod_name,
            pod_ip: args.pod_ip,
            pod_uid: args.pod_uid.filter(|u| !u.is_empty()),
            quic_addr,
            h2_addr,
            socks_addr,
            reverse_bind: IpAddr::from([0, 0, 0, 0]),
            reverse_ports,
            reverse_sources,
            tls,
            lease_duration: Duration::from_secs(args.lease_duration),
            cluster_domain: args.cluster_domain,
            dial_timeout: Duration::from_secs(10),
            resolve: args.resolve.into_iter().collect(),
            destinations,
        },
        control.handle().clone(),
        &mut registry,
        stop.clone(),
    )
    .await?;

    let listener = spur_serving::health::bind_health(args.metrics_addr).await?;
    let http = control.handle().spawn(spur_serving::health::serve_health(
        listener,
        registry,
        None,
        stop.clone(),
    ));
    // The mounted Secret changes under us when the certificate is renewed (the kubelet swaps
    // the files): new connections get the new certificate and client CA.
    let mut reload = tokio::time::interval(TLS_RELOAD_EVERY);
    reload.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = reload.tick() => {}
        }
        match tls_files.read() {
            Ok(read) if read == tls_read => {}
            Ok(read) => match tls_files
                .parse(&read)
                .and_then(|tls| Ok(proxy.reload_tls(&tls)?))
            {
                Ok(()) => {
                    tracing::info!(
                        "TLS files changed: new connections use the new certificate and client CA"
                    );
                    tls_read = read;
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "TLS files changed but cannot be used; keeping the current ones")
                }
            },
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "cannot read the TLS files; keeping the current ones")
            }
        }
    }
    tracing::info!("shutting down: draining workstation sessions");
    stop.cancel();
    proxy.stopped().await;
    http.await.context("metrics server panicked")??;
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let args = TunnelProxyArgs::parse();
    // The tunnels on this thread; the Kubernetes side runs on a second one (`ControlThread`).
    spur_bin_support::run(
        "spur-tunnel-proxy",
        "info",
        Runtime::CurrentThread,
        run(args),
    )
}
