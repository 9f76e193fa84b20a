//! `spur local connect | status | disconnect | proxy`: the workstation side of local
//! development. Arguments → configuration → `spur_workstation`; progress lines on stderr.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use spur_runtime::Drain;
use spur_workstation::SocksOpener;
use spur_workstation::proxy::{self, ProxyConfig};
use spur_workstation::state::{self, Status, Terminated};

pub(crate) mod cert;
pub(crate) mod connect;
pub(crate) mod endpoint;
mod env;
mod owner;

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
    Connect(Box<connect::ConnectArgs>),
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
    /// Get a client certificate for this workstation from the operator's CA: makes a key here,
    /// asks the cluster to sign it (a CertificateSigningRequest an administrator approves) and
    /// writes client.crt, client.key and the CA bundle (ca.crt) into the state directory,
    /// where `spur local connect` finds them.
    Cert(cert::CertArgs),
    /// Revoke every credential of a workstation issued until now (its tokens and client
    /// certificates): the tunnel proxy refuses them and closes the sessions they opened within
    /// seconds. Credentials issued afterwards work (a certificate's validity starts a minute
    /// before it is issued: issue a new one a minute after revoking).
    Revoke(RevokeArgs),
    /// Print the environment a local workload's process gets (the baseline container's,
    /// resolved, then the Sandbox's spec.local[].env) and, with --files, write its files (the
    /// baseline's mounted ConfigMaps and Secrets, then spec.local[].files). Read with your
    /// kubeconfig's rights: a Secret you may not read stops it, and nothing is written.
    Env(env::EnvArgs),
}

#[derive(Args)]
struct RevokeArgs {
    /// The workstation whose credentials are revoked.
    #[arg(long)]
    workstation: String,
    /// The namespace of the tunnel proxy's token Secrets (the chart's
    /// `tunnelProxy.tokenNamespace`).
    #[arg(long, default_value = "spur-workstation-tokens")]
    namespace: String,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

/// Writes `secret` into `namespace` by server-side apply (replacing what the CLI wrote before);
/// returns its name.
async fn apply_secret(
    kubeconfig: Option<&std::path::Path>,
    namespace: &str,
    secret: &k8s_openapi::api::core::v1::Secret,
) -> Result<String> {
    let client = crate::kube_client(kubeconfig).await?;
    let api: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(client, namespace);
    let mut body = serde_json::to_value(secret)?;
    body["apiVersion"] = "v1".into();
    body["kind"] = "Secret".into();
    let name = secret.metadata.name.clone().unwrap_or_default();
    api.patch(
        &name,
        &kube::api::PatchParams::apply("spur-cli").force(),
        &kube::api::Patch::Apply(&body),
    )
    .await
    .with_context(|| format!("cannot write Secret {namespace}/{name}"))?;
    Ok(name)
}

/// Writes the workstation's revocation Secret (server-side apply: a later revocation moves the
/// instant forward).
async fn revoke_cmd(a: RevokeArgs) -> Result<ExitCode> {
    check_workstation(&a.workstation)?;
    let secret = spur_api::tunnel::credentials::revocation_secret(
        &a.namespace,
        &a.workstation,
        std::time::SystemTime::now(),
    )?;
    let name = apply_secret(a.kubeconfig.as_deref(), &a.namespace, &secret).await?;
    say(format!(
        "credentials of workstation {} issued until now are revoked (Secret {}/{name})",
        a.workstation, a.namespace
    ));
    Ok(ExitCode::SUCCESS)
}

fn check_workstation(name: &str) -> Result<()> {
    if !spur_api::validation::is_dns_label(name) {
        bail!("--workstation {name:?} is not a DNS label");
    }
    Ok(())
}

#[derive(Args)]
struct TokenArgs {
    /// The workstation the token authenticates (a DNS label: Sandboxes name it in
    /// `spec.workstation`).
    #[arg(long)]
    workstation: String,
    /// The Kubernetes user the workstation belongs to (as the API server names them, e.g.
    /// `alice@example.com` or `system:serviceaccount:devs:alice`): only Sandboxes this user
    /// creates may name the workstation. Replaces another user's claim.
    #[arg(long)]
    owner: String,
    /// How long the token is accepted (e.g. 12h); without it, until the Secret is deleted.
    #[arg(long, value_parser = spur_runtime::parse_duration)]
    ttl: Option<std::time::Duration>,
    /// The namespace of the tunnel proxy's token Secrets (the chart's
    /// `tunnelProxy.tokenNamespace`).
    #[arg(long, default_value = "spur-workstation-tokens")]
    namespace: String,
    /// The operator's namespace, where workstation owner records are kept.
    #[arg(long, default_value = "spur-system")]
    owner_namespace: String,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

/// Writes the workstation's token Secret (server-side apply, so a new token replaces the old
/// one) and prints the token; nothing else is printed on stdout, so it can be piped to a file.
async fn token_cmd(a: TokenArgs) -> Result<ExitCode> {
    check_workstation(&a.workstation)?;
    let token = spur_api::tunnel::credentials::generate_token()?;
    let expires = a.ttl.map(|t| std::time::SystemTime::now() + t);
    // The owner first: a token never exists for a workstation nobody owns.
    let until = a
        .ttl
        .map(|t| {
            k8s_openapi::jiff::SignedDuration::try_from(t)
                .ok()
                .and_then(|d| k8s_openapi::jiff::Timestamp::now().checked_add(d).ok())
                .context("--ttl is too long")
        })
        .transpose()?;
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    match owner::record(client, &a.owner_namespace, &a.workstation, &a.owner, until).await? {
        owner::Recorded::Owner => say(format!(
            "workstation {} belongs to {}",
            a.workstation, a.owner
        )),
        owner::Recorded::Reassigned => say(format!(
            "workstation {} now belongs to {}; it was another user's: Sandboxes they created that name it are no longer bound to it (their local workloads report WorkstationNotOwned) until they are deleted or name another workstation",
            a.workstation, a.owner
        )),
    }
    let secret =
        spur_api::tunnel::credentials::token_secret(&a.namespace, &a.workstation, &token, expires)?;
    let name = apply_secret(a.kubeconfig.as_deref(), &a.namespace, &secret).await?;
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
pub(crate) struct StateDir {
    /// Where the state file of `spur local connect` lives [default: $XDG_STATE_HOME/spur or
    /// ~/.local/state/spur].
    #[arg(long, env = "SPUR_STATE_DIR")]
    state_dir: Option<PathBuf>,
}

impl StateDir {
    pub(crate) fn resolve(&self) -> Result<PathBuf> {
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
    #[arg(long, default_value = "20s", value_parser = spur_runtime::parse_duration)]
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
        LocalCommand::Connect(a) => connect::connect(*a).await,
        LocalCommand::Status(a) => status(a),
        LocalCommand::Disconnect(a) => disconnect(a).await,
        LocalCommand::Proxy(a) => proxy_cmd(a).await,
        LocalCommand::Token(a) => token_cmd(a).await,
        LocalCommand::Cert(a) => cert::cert_cmd(a).await,
        LocalCommand::Revoke(a) => revoke_cmd(a).await,
        LocalCommand::Env(a) => env::env_cmd(a).await,
    }
}

pub(crate) fn say(line: impl std::fmt::Display) {
    eprintln!("spur local: {line}");
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
    spur_runtime::shutdown_signal().await;
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
