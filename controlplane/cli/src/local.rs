//! `spur local connect | status | disconnect | proxy`: the workstation side of local
//! development. Arguments → configuration → `spur_workstation`; progress lines on stderr.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use spur_proxy::Drain;
use spur_workstation::proxy::{self, ProxyConfig};
use spur_workstation::state::{self, Status, Terminated};
use spur_workstation::tunnel::{ClientConfig, ClientTls, Token, TransportPolicy};
use spur_workstation::{ConnectConfig, Event, SocksOpener, Workstation};

#[derive(Args)]
pub(crate) struct LocalArgs {
    #[command(subcommand)]
    command: LocalCommand,
}

#[derive(Subcommand)]
enum LocalCommand {
    /// Connect this workstation to the cluster's tunnel proxy, in the foreground: reverse binds
    /// for your local workloads, a local SOCKS5/HTTP CONNECT proxy, and cluster service names
    /// on loopback (DNS responder, optional hosts-file block). Ctrl-C or `spur local
    /// disconnect` ends it cleanly.
    Connect(Box<ConnectArgs>),
    /// Show the running `spur local connect` (exit status 1 when not connected).
    Status(StatusArgs),
    /// Stop the running `spur local connect` and wait for its clean exit.
    Disconnect(DisconnectArgs),
    /// Serve one cluster Service on a local port through the running `spur local connect`,
    /// injecting a routing key into HTTP/1.x requests.
    Proxy(ProxyArgs),
    /// Create (or replace) a workstation's tunnel token in the cluster (needs permission to
    /// write Secrets in the tunnel proxy's namespace) and print it once on stdout.
    Token(TokenArgs),
}

#[derive(Args)]
struct TokenArgs {
    /// The workstation the token authenticates (a DNS label: Sandboxes name it in
    /// `spec.workstation`).
    #[arg(long)]
    workstation: String,
    /// How long the token is accepted (e.g. 12h); without it, until the Secret is deleted.
    #[arg(long, value_parser = spur_proxy::parse_duration)]
    ttl: Option<std::time::Duration>,
    /// The tunnel proxy's namespace.
    #[arg(long, default_value = "spur-system")]
    namespace: String,
    /// Kubeconfig file (default: in-cluster config, then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

/// Writes the workstation's token Secret (server-side apply, so a new token replaces the old
/// one) and prints the token; nothing else is printed on stdout, so it can be piped to a file.
async fn token_cmd(a: TokenArgs) -> Result<ExitCode> {
    let valid = !a.workstation.is_empty()
        && a.workstation.len() <= 63
        && a.workstation
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !a.workstation.starts_with('-')
        && !a.workstation.ends_with('-');
    if !valid {
        anyhow::bail!("--workstation {:?} is not a DNS label", a.workstation);
    }
    let token = spur_tunnelproxy::tokens::generate_token()?;
    let expires = a.ttl.map(|t| std::time::SystemTime::now() + t);
    let secret =
        spur_tunnelproxy::tokens::token_secret(&a.namespace, &a.workstation, &token, expires)?;
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let api: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(client, &a.namespace);
    let mut body = serde_json::to_value(&secret)?;
    body["apiVersion"] = "v1".into();
    body["kind"] = "Secret".into();
    let name = secret.metadata.name.clone().unwrap_or_default();
    api.patch(
        &name,
        &kube::api::PatchParams::apply("spur-cli").force(),
        &kube::api::Patch::Apply(&body),
    )
    .await
    .with_context(|| format!("cannot write Secret {}/{name}", a.namespace))?;
    say(format!(
        "token for workstation {} stored in Secret {}/{name}{}",
        a.workstation,
        a.namespace,
        match a.ttl {
            Some(t) => format!(", valid for {}s", t.as_secs()),
            None => String::new(),
        }
    ));
    println!("{token}");
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
struct StateDir {
    /// Where the state file of `spur local connect` lives [default: $XDG_STATE_HOME/spur or
    /// ~/.local/state/spur].
    #[arg(long, env = "SPUR_STATE_DIR")]
    state_dir: Option<PathBuf>,
}

impl StateDir {
    fn resolve(&self) -> Result<PathBuf> {
        if let Some(d) = &self.state_dir {
            return Ok(d.clone());
        }
        if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|x| !x.is_empty()) {
            return Ok(PathBuf::from(x).join("spur"));
        }
        match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
            Some(h) => Ok(PathBuf::from(h).join(".local/state/spur")),
            None => bail!("neither --state-dir, $XDG_STATE_HOME nor $HOME is set"),
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum TransportArg {
    /// QUIC, falling back to HTTP/2 over TLS where UDP is blocked.
    Auto,
    Quic,
    H2,
}

#[derive(Args)]
struct ConnectArgs {
    /// The tunnel proxy's host name or IP address.
    #[arg(long, env = "SPUR_TUNNEL_SERVER")]
    server: String,
    /// UDP port of the QUIC listener.
    #[arg(long, env = "SPUR_TUNNEL_QUIC_PORT", default_value_t = 443)]
    quic_port: u16,
    /// TCP port of the HTTP/2-over-TLS listener.
    #[arg(long, env = "SPUR_TUNNEL_H2_PORT", default_value_t = 443)]
    h2_port: u16,
    /// File holding the workstation token (or set SPUR_TUNNEL_TOKEN).
    #[arg(long, env = "SPUR_TUNNEL_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// PEM file of the CA that signed the tunnel proxy's certificate [default: the system's
    /// trust store].
    #[arg(long, env = "SPUR_TUNNEL_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// Name the tunnel proxy's certificate must carry [default: --server].
    #[arg(long, env = "SPUR_TUNNEL_SERVER_NAME")]
    server_name: Option<String>,
    /// Which transport to use.
    #[arg(long, value_enum, default_value = "auto")]
    transport: TransportArg,
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
    #[command(flatten)]
    state: StateDir,
}

#[derive(Args)]
struct StatusArgs {
    /// Print the state file as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    state: StateDir,
}

#[derive(Args)]
struct DisconnectArgs {
    /// How long to wait for the clean exit.
    #[arg(long, default_value = "20s", value_parser = spur_proxy::parse_duration)]
    wait: Duration,
    #[command(flatten)]
    state: StateDir,
}

#[derive(Args)]
struct ProxyArgs {
    /// The Service: <service>.<namespace>[:port] (port 80 if omitted), or a full cluster name.
    target: String,
    /// Local port to listen on.
    #[arg(long)]
    local_port: u16,
    /// Local address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    local_addr: std::net::IpAddr,
    /// Routing key to inject into every HTTP/1.x request (baggage, tracestate, ot-baggage-*,
    /// uberctx-*). Without it, connections are forwarded unchanged.
    #[arg(long, alias = "sandbox-key")]
    routing_key: Option<String>,
    /// SOCKS5 proxy to reach the cluster through [default: the running `spur local connect`'s].
    #[arg(long)]
    socks_addr: Option<SocketAddr>,
    #[command(flatten)]
    state: StateDir,
}

pub(crate) async fn run(args: LocalArgs) -> Result<ExitCode> {
    match args.command {
        LocalCommand::Connect(a) => connect(*a).await,
        LocalCommand::Status(a) => status(a),
        LocalCommand::Disconnect(a) => disconnect(a).await,
        LocalCommand::Proxy(a) => proxy_cmd(a).await,
        LocalCommand::Token(a) => token_cmd(a).await,
    }
}

fn say(line: impl std::fmt::Display) {
    eprintln!("spur local: {line}");
}

fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
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

async fn connect(args: ConnectArgs) -> Result<ExitCode> {
    let state_dir = args.state.resolve()?;
    let roots = spur_workstation::load_roots(args.ca_file.as_deref())?;
    let server = args.server.trim_start_matches('[').trim_end_matches(']');
    let mut tunnel = ClientConfig::new(
        args.server_name
            .clone()
            .unwrap_or_else(|| server.to_owned()),
        ClientTls {
            roots,
            client_cert: None,
        },
    );
    tunnel.quic_addr = Some(host_port(server, args.quic_port));
    tunnel.h2_addr = Some(host_port(server, args.h2_port));
    tunnel.transports = match args.transport {
        TransportArg::Auto => TransportPolicy::QuicThenH2,
        TransportArg::Quic => TransportPolicy::QuicOnly,
        TransportArg::H2 => TransportPolicy::H2Only,
    };
    tunnel.token = Some(read_token(args.token_file.as_deref())?);
    tunnel.client_name = format!(
        "spur {} on {}",
        env!("CARGO_PKG_VERSION"),
        spur_workstation::hostname()
    );

    let mut config = ConnectConfig::new(tunnel, server);
    config.socks_addr = (!args.no_socks).then_some(args.socks_addr);
    config.dns_addr = (!args.no_dns).then_some(args.dns_addr);
    config.hosts_file = args.hosts_file.clone();
    config.state_dir = Some(state_dir.clone());
    config.namespaces = args.namespaces.clone();
    config.max_services = args.max_services;
    config.client_version = env!("CARGO_PKG_VERSION").into();
    config.on_event = Some(Arc::new(|e: &Event| say(e)));
    if config.dns_addr.is_some() || config.hosts_file.is_some() {
        spur_workstation::raise_fd_limit();
    }

    let ws = match Workstation::start(config).await {
        Ok(ws) => ws,
        Err(e @ spur_workstation::Error::AlreadyRunning { .. }) => {
            bail!("{e}; `spur local disconnect` stops it")
        }
        Err(e) => return Err(e.into()),
    };
    say(format_args!(
        "state file {}",
        state::path(&state_dir).display()
    ));
    let code = tokio::select! {
        () = spur_sidecar::shutdown_signal() => {
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

fn status(args: StatusArgs) -> Result<ExitCode> {
    let dir = args.state.resolve()?;
    let Some(st) = state::read(&dir)? else {
        if args.json {
            println!("null");
        } else {
            println!("not connected (no state file in {})", dir.display());
        }
        return Ok(ExitCode::FAILURE);
    };
    let running = state::is_running(&st);
    if args.json {
        println!("{}", st.to_json());
    } else if !running {
        println!(
            "not connected: stale state file {} (pid {} is gone)",
            state::path(&dir).display(),
            st.pid
        );
    } else {
        print!("{}", render(&st));
    }
    Ok(if running && st.connected() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The human view of a state file.
fn render(st: &Status) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let tunnel = match (&st.tunnel.transport, &st.tunnel.detail) {
        (Some(t), _) => format!("{} via {t}", st.tunnel.state),
        (None, Some(d)) => format!("{} ({d})", st.tunnel.state),
        (None, None) => st.tunnel.state.clone(),
    };
    let _ = writeln!(
        o,
        "spur local connect (pid {}) to {}: {tunnel}",
        st.pid, st.server
    );
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let _ = writeln!(
        o,
        "  workstation  {} (proxy pod {}, cluster domain {})",
        dash(st.workstation.clone()),
        dash(st.proxy_pod.clone()),
        dash(st.cluster_domain.clone())
    );
    let _ = writeln!(
        o,
        "  SOCKS5/HTTP  {}",
        dash(st.socks_addr.map(|a| a.to_string()))
    );
    let _ = writeln!(
        o,
        "  DNS          {}",
        dash(st.dns_addr.map(|a| a.to_string()))
    );
    if let Some(h) = &st.hosts_file {
        let _ = writeln!(o, "  hosts file   {}", h.display());
    }
    if st.dns_addr.is_some() || st.hosts_file.is_some() {
        let s = &st.services;
        let _ = write!(
            o,
            "  services     {} name(s), {} port(s) on loopback",
            s.names, s.listeners
        );
        if s.skipped > 0 {
            let _ = write!(o, ", {} left out", s.skipped);
        }
        let _ = writeln!(o);
        if s.listen_error_count > 0 {
            let _ = writeln!(o, "  cannot listen on {} port(s):", s.listen_error_count);
            for e in &s.listen_errors {
                let _ = writeln!(o, "    {e}");
            }
        }
    }
    if st.workloads.is_empty() {
        let _ = writeln!(o, "  no local workloads");
        return o;
    }
    let mut rows = vec![[
        "SANDBOX".to_owned(),
        "WORKLOAD".into(),
        "PORT".into(),
        "TO LOCAL".into(),
        "BIND".into(),
        "NOTE".into(),
    ]];
    for w in &st.workloads {
        for m in &w.mappings {
            let note = m
                .detail
                .clone()
                .or_else(|| m.local_error.clone())
                .unwrap_or_default();
            rows.push([
                w.sandbox.clone(),
                format!("{}/{}", w.namespace, w.name),
                m.port.to_string(),
                m.to_local.clone(),
                m.bind.clone(),
                note,
            ]);
        }
    }
    let mut widths = [0usize; 6];
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let _ = writeln!(o);
    for r in &rows {
        let mut line = String::from(" ");
        for (i, c) in r.iter().enumerate() {
            if i + 1 == r.len() {
                line.push_str(&format!(" {c}"));
            } else {
                line.push_str(&format!(" {c:<w$} ", w = widths[i]));
            }
        }
        let _ = writeln!(o, "{}", line.trim_end());
    }
    o
}

async fn disconnect(args: DisconnectArgs) -> Result<ExitCode> {
    let dir = args.state.resolve()?;
    match state::terminate(&dir, args.wait).await? {
        Terminated::NotRunning => println!("not connected"),
        Terminated::Stale { pid } => {
            println!("not connected (removed the stale state file of pid {pid})")
        }
        Terminated::Stopped { pid } => println!("disconnected (pid {pid} exited)"),
    }
    Ok(ExitCode::SUCCESS)
}

async fn proxy_cmd(args: ProxyArgs) -> Result<ExitCode> {
    let socks = match args.socks_addr {
        Some(a) => a,
        None => {
            let dir = args.state.resolve()?;
            let st = state::read(&dir)?
                .filter(state::is_running)
                .with_context(|| {
                    format!(
                        "no running `spur local connect` (state dir {}); start one first, or pass --socks-addr",
                        dir.display()
                    )
                })?;
            st.socks_addr
                .context("the running `spur local connect` has no SOCKS proxy (--no-socks)")?
        }
    };
    let (host, port) = proxy::parse_target(&args.target, 80)?;
    let mut config = ProxyConfig::new(
        SocketAddr::new(args.local_addr, args.local_port),
        host,
        port,
    );
    config.routing_key = args.routing_key.clone();
    let drain = Drain::new();
    let addr = proxy::start(config, Arc::new(SocksOpener::new(socks)), drain.clone()).await?;
    match &args.routing_key {
        Some(k) => say(format_args!(
            "{addr} → {} (routing key {k} injected into HTTP/1.x requests)",
            args.target
        )),
        None => say(format_args!("{addr} → {}", args.target)),
    }
    spur_sidecar::shutdown_signal().await;
    drain.wait(Duration::from_secs(5)).await;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_workstation::state::{MappingStatus, TunnelStatus, WorkloadStatus};

    #[test]
    fn status_table() {
        let st = Status {
            pid: 42,
            server: "tunnel.example.com".into(),
            tunnel: TunnelStatus {
                state: "connected".into(),
                transport: Some("quic".into()),
                detail: None,
            },
            workstation: Some("alice".into()),
            socks_addr: Some(
                "127.0.0.1:1080"
                    .parse()
                    .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0))),
            ),
            workloads: vec![WorkloadStatus {
                sandbox: "feature-x".into(),
                name: "api".into(),
                namespace: "shop".into(),
                mappings: vec![MappingStatus {
                    port: 8080,
                    to_local: "localhost:8080".into(),
                    bind_id: "shop/ew/8080".into(),
                    bind: "active".into(),
                    local_error: Some("nothing accepts connections".into()),
                    ..MappingStatus::default()
                }],
                ..WorkloadStatus::default()
            }],
            ..Status::default()
        };
        let out = render(&st);
        assert!(
            out.starts_with(
                "spur local connect (pid 42) to tunnel.example.com: connected via quic\n"
            ),
            "{out}"
        );
        assert!(out.contains("  SOCKS5/HTTP  127.0.0.1:1080\n"), "{out}");
        assert!(
            out.contains("  SANDBOX    WORKLOAD  PORT  TO LOCAL        BIND    NOTE\n"),
            "{out}"
        );
        assert!(
            out.contains(
                "  feature-x  shop/api  8080  localhost:8080  active  nothing accepts connections\n"
            ),
            "{out}"
        );
    }
}
