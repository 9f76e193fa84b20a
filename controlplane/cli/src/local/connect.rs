//! `spur local connect`, and the same workstation session started by `spur sandbox apply
//! --local`: where the tunnel proxy is (the command line, else the cluster), which credential
//! this workstation presents, and the `spur_workstation` configuration they make.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use spur_workstation::state;
use spur_workstation::tunnel::{ClientConfig, ClientTls, Token, TransportPolicy};
use spur_workstation::{ConnectConfig, Event, Workstation};

use super::cert::{CLIENT_CA, CLIENT_CERT, CLIENT_KEY};
use super::endpoint::{self, Endpoint, Given};
use super::{StateDir, say};

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum TransportArg {
    /// QUIC, falling back to HTTP/2 over TLS where UDP is blocked.
    Auto,
    Quic,
    H2,
}

/// Where the tunnel proxy is and what this workstation presents to it.
#[derive(Args)]
pub(crate) struct TunnelArgs {
    /// The tunnel proxy's host name or IP address [default: found in the cluster with your
    /// kubeconfig: the load balancer of the Service spur-tunnel-proxy, or for a NodePort a
    /// node's address, when you may list nodes].
    #[arg(long, env = "SPUR_TUNNEL_SERVER")]
    pub(crate) server: Option<String>,
    /// UDP port of the QUIC listener [default: 443 for `spur local connect --server`;
    /// otherwise the Service's (its node port when dialling a node), else 443].
    #[arg(long, env = "SPUR_TUNNEL_QUIC_PORT")]
    quic_port: Option<u16>,
    /// TCP port of the HTTP/2-over-TLS listener [default: as --quic-port].
    #[arg(long, env = "SPUR_TUNNEL_H2_PORT")]
    h2_port: Option<u16>,
    /// File holding the workstation token (or set SPUR_TUNNEL_TOKEN). Without a token, the
    /// client certificate is used: --cert-file/--key-file, else the state directory's
    /// client.crt/client.key from `spur local cert`.
    #[arg(long, env = "SPUR_TUNNEL_TOKEN_FILE")]
    pub(crate) token_file: Option<PathBuf>,
    /// Client certificate (PEM) identifying this workstation.
    #[arg(long, env = "SPUR_TUNNEL_CERT_FILE", requires = "key_file")]
    pub(crate) cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "SPUR_TUNNEL_KEY_FILE", requires = "cert_file")]
    key_file: Option<PathBuf>,
    /// PEM file of the CA that signed the tunnel proxy's certificate [default: the state
    /// directory's ca.crt from `spur local cert`, else the system's trust store].
    #[arg(long, env = "SPUR_TUNNEL_CA_FILE")]
    pub(crate) ca_file: Option<PathBuf>,
    /// Name the tunnel proxy's certificate must carry [default: --server for `spur local
    /// connect --server` and for a load balancer, else spur-tunnel-proxy.<spur namespace>.svc].
    #[arg(long, env = "SPUR_TUNNEL_SERVER_NAME")]
    server_name: Option<String>,
    /// Which transport to use.
    #[arg(long, value_enum, default_value = "auto")]
    transport: TransportArg,
    /// The namespace Spur runs in: the tunnel proxy's Service and the CA bundle are there.
    #[arg(long, default_value = "spur-system")]
    pub(crate) spur_namespace: String,
}

impl TunnelArgs {
    fn given(&self) -> Given<'_> {
        Given {
            server: self.server.as_deref(),
            quic_port: self.quic_port,
            h2_port: self.h2_port,
            server_name: self.server_name.as_deref(),
        }
    }

    /// The endpoint from the command line alone (`--server` given).
    pub(crate) fn endpoint_as_given(&self) -> Result<Endpoint> {
        endpoint::decide(
            &self.spur_namespace,
            self.given(),
            Err("not read: --server is given"),
            None,
        )
    }

    /// The endpoint, what the command line leaves open found in the cluster.
    pub(crate) async fn endpoint_in(&self, client: &kube::Client) -> Result<Endpoint> {
        endpoint::find(client, &self.spur_namespace, self.given()).await
    }

    /// A token was given (rather than a client certificate).
    pub(crate) fn has_token(&self) -> bool {
        self.token_file.is_some() || std::env::var_os("SPUR_TUNNEL_TOKEN").is_some()
    }
}

/// What the workstation offers on this machine.
#[derive(Args)]
pub(crate) struct SideArgs {
    /// Local SOCKS5 and HTTP CONNECT proxy (cluster names are resolved in the cluster).
    #[arg(long, default_value = "127.0.0.1:1080", conflicts_with = "no_socks")]
    socks_addr: SocketAddr,
    /// No local SOCKS5/HTTP CONNECT proxy.
    #[arg(long)]
    no_socks: bool,
    /// Local DNS responder for cluster service names (<svc>.<ns>, <svc>.<ns>.svc,
    /// <svc>.<ns>.svc.<cluster domain>), answered with per-Service loopback addresses on which
    /// the Service's ports are forwarded through the tunnel.
    #[arg(long, default_value = "127.0.0.1:5353", conflicts_with = "no_dns")]
    dns_addr: SocketAddr,
    /// No DNS responder (and no Service listeners unless --hosts-file is given).
    #[arg(long)]
    no_dns: bool,
    /// Also write the service names into this hosts file between `# spur begin` and
    /// `# spur end` (removed on exit). /etc/hosts needs root.
    #[arg(long)]
    hosts_file: Option<PathBuf>,
    /// Only Services of this namespace get names and listeners (repeatable; default: all).
    #[arg(long = "namespace", short = 'n')]
    namespaces: Vec<String>,
    /// At most this many Services get names and listeners.
    #[arg(long, default_value_t = 2000)]
    max_services: usize,
    /// Let reverse binds connect to any `toLocal` a Sandbox names. Without it only this
    /// machine's loopback addresses (localhost, 127.0.0.0/8, ::1) are connected to, so a
    /// Sandbox cannot reach other machines on your network through this workstation.
    #[arg(long)]
    allow_remote_targets: bool,
}

#[derive(Args)]
pub(crate) struct ConnectArgs {
    #[command(flatten)]
    tunnel: TunnelArgs,
    #[command(flatten)]
    side: SideArgs,
    /// Kubeconfig file, read only to find the tunnel proxy when --server is not given
    /// (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    #[command(flatten)]
    state: StateDir,
}

fn read_token(file: Option<&Path>) -> Result<Token> {
    let token = match file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read token file {}", path.display()))?,
        None => std::env::var("SPUR_TUNNEL_TOKEN")
            .context("no workstation token: pass --token-file or set SPUR_TUNNEL_TOKEN")?,
    };
    let token = token.trim();
    if token.is_empty() {
        bail!("the workstation token is empty");
    }
    Ok(Token::new(token))
}

type ClientCert = (
    Vec<rustls::pki_types::CertificateDer<'static>>,
    rustls::pki_types::PrivateKeyDer<'static>,
);

/// A token if one is given (--token-file, SPUR_TUNNEL_TOKEN), else a client certificate
/// (--cert-file/--key-file, else the state directory's from `spur local cert`).
fn credentials(args: &TunnelArgs, state_dir: &Path) -> Result<(Option<Token>, Option<ClientCert>)> {
    if args.has_token() {
        return Ok((Some(read_token(args.token_file.as_deref())?), None));
    }
    let (cert, key) = match (&args.cert_file, &args.key_file) {
        (Some(c), Some(k)) => (c.clone(), k.clone()),
        _ => (state_dir.join(CLIENT_CERT), state_dir.join(CLIENT_KEY)),
    };
    if args.cert_file.is_none() && !(cert.is_file() && key.is_file()) {
        bail!(
            "no workstation credentials: pass --token-file (or set SPUR_TUNNEL_TOKEN), or get a client certificate with `spur local cert` (looked for {})",
            cert.display()
        );
    }
    Ok((None, Some(read_client_cert(&cert, &key)?)))
}

fn read_client_cert(cert: &Path, key: &Path) -> Result<ClientCert> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("cannot read the client certificate {}", cert.display()))?;
    let first = chain
        .first()
        .with_context(|| format!("no certificate in {}", cert.display()))?;
    let identity = spur_tunnel::identity_from_cert(first)
        .with_context(|| format!("cannot read the client certificate {}", cert.display()))?;
    if let Some(at) = identity.expires_at
        && at <= std::time::SystemTime::now()
    {
        let ago = std::time::SystemTime::now()
            .duration_since(at)
            .unwrap_or_default()
            .as_secs();
        bail!(
            "the client certificate {} of workstation {} expired {ago}s ago: get a new one with `spur local cert`",
            cert.display(),
            identity.name
        );
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("cannot read a private key from {}", key.display()))?;
    Ok((chain, key))
}

pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The workstation's configuration: the tunnel to `endpoint` with this machine's credential,
/// the local side, the state directory; `on_event` hears what happens.
pub(crate) fn config(
    endpoint: &Endpoint,
    tunnel_args: &TunnelArgs,
    side: &SideArgs,
    state_dir: &Path,
    on_event: Arc<dyn Fn(&Event) + Send + Sync>,
) -> Result<ConnectConfig> {
    let state_ca = state_dir.join(CLIENT_CA);
    let ca_file = tunnel_args
        .ca_file
        .clone()
        .or_else(|| state_ca.is_file().then_some(state_ca));
    let roots = spur_workstation::load_roots(ca_file.as_deref())?;
    let (token, client_cert) = credentials(tunnel_args, state_dir)?;
    let mut tunnel = ClientConfig::new(
        endpoint.server_name.clone(),
        ClientTls { roots, client_cert },
    );
    tunnel.quic_addr = Some(host_port(&endpoint.host, endpoint.quic_port));
    tunnel.h2_addr = Some(host_port(&endpoint.host, endpoint.h2_port));
    tunnel.transports = match tunnel_args.transport {
        TransportArg::Auto => TransportPolicy::QuicThenH2,
        TransportArg::Quic => TransportPolicy::QuicOnly,
        TransportArg::H2 => TransportPolicy::H2Only,
    };
    tunnel.token = token;
    tunnel.client_name = format!(
        "spur {} on {}",
        env!("CARGO_PKG_VERSION"),
        spur_workstation::hostname()
    );

    let mut config = ConnectConfig::new(tunnel, &endpoint.host);
    config.socks_addr = (!side.no_socks).then_some(side.socks_addr);
    config.dns_addr = (!side.no_dns).then_some(side.dns_addr);
    config.hosts_file = side.hosts_file.clone();
    config.state_dir = Some(state_dir.to_path_buf());
    config.namespaces = side.namespaces.clone();
    config.max_services = side.max_services;
    config.allow_remote_targets = side.allow_remote_targets;
    config.client_version = env!("CARGO_PKG_VERSION").into();
    config.on_event = Some(on_event);
    if config.dns_addr.is_some() || config.hosts_file.is_some() {
        spur_workstation::raise_fd_limit();
    }
    Ok(config)
}

/// Starts the workstation (one per state directory).
pub(crate) async fn start(config: ConnectConfig) -> Result<Workstation> {
    match Workstation::start(config).await {
        Ok(ws) => Ok(ws),
        Err(e @ spur_workstation::Error::AlreadyRunning { .. }) => {
            bail!("{e}; `spur local disconnect` stops it")
        }
        Err(e) => Err(e.into()),
    }
}

pub(crate) async fn connect(args: ConnectArgs) -> Result<ExitCode> {
    let state_dir = args.state.resolve()?;
    let endpoint = if args.tunnel.server.is_some() {
        args.tunnel.endpoint_as_given()?
    } else {
        let client = crate::kube_client(args.kubeconfig.as_deref())
            .await
            .context("without --server, the tunnel proxy is looked up in the cluster")?;
        let endpoint = args.tunnel.endpoint_in(&client).await?;
        // The CA that signed the proxy's certificate, unless one is named or saved already.
        if args.tunnel.ca_file.is_none() && !state_dir.join(CLIENT_CA).is_file() {
            match super::cert::save_ca_bundle(&client, &args.tunnel.spur_namespace, &state_dir)
                .await
            {
                Ok(path) => say(format_args!("CA bundle saved to {}", path.display())),
                Err(why) => say(format_args!("{why}; using the system's trust store")),
            }
        }
        say(format_args!(
            "tunnel proxy at {} ({}), certificate name {}",
            host_port(&endpoint.host, endpoint.quic_port),
            endpoint.how,
            endpoint.server_name
        ));
        endpoint
    };
    let config = config(
        &endpoint,
        &args.tunnel,
        &args.side,
        &state_dir,
        Arc::new(|e: &Event| say(e)),
    )?;
    let ws = start(config).await?;
    say(format_args!(
        "state file {}",
        state::path(&state_dir).display()
    ));
    let code = tokio::select! {
        () = spur_runtime::shutdown_signal() => {
            say("disconnecting…");
            ExitCode::SUCCESS
        }
        reason = ws.closed() => {
            say(format_args!("giving up: {reason}"));
            ExitCode::FAILURE
        }
    };
    ws.shutdown(Duration::from_secs(5)).await;
    say("disconnected");
    Ok(code)
}
