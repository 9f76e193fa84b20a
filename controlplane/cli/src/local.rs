//! `spur local connect | status | disconnect | proxy`: the workstation side of local
//! development. Arguments → configuration → `spur_workstation`; progress lines on stderr.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use spur_runtime::Drain;
use spur_workstation::proxy::{self, ProxyConfig};
use spur_workstation::state::{self, Status, Terminated};
use spur_workstation::tunnel::{ClientConfig, ClientTls, Token, TransportPolicy};
use spur_workstation::{ConnectConfig, Event, SocksOpener, Workstation};

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
    /// Get a client certificate for this workstation from the operator's CA: makes a key here,
    /// asks the cluster to sign it (a CertificateSigningRequest an administrator approves) and
    /// writes client.crt, client.key and the CA bundle (ca.crt) into the state directory,
    /// where `spur local connect` finds them.
    Cert(CertArgs),
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

#[derive(Args)]
struct CertArgs {
    /// The workstation the certificate names (a DNS label: Sandboxes name it in
    /// `spec.workstation`).
    #[arg(long)]
    workstation: String,
    /// How long the certificate is valid (the operator caps it, 7 days by default).
    #[arg(long, default_value = "24h", value_parser = spur_runtime::parse_duration)]
    lifetime: Duration,
    /// How long to wait for the request to be approved and signed.
    #[arg(long, default_value = "15m", value_parser = spur_runtime::parse_duration)]
    wait: Duration,
    /// The operator's namespace (where the CA bundle ConfigMap `spur-ca-bundle` is).
    #[arg(long, default_value = "spur-system")]
    namespace: String,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    #[command(flatten)]
    state: StateDir,
}

/// Files `spur local cert` writes into the state directory.
const CLIENT_CERT: &str = "client.crt";
const CLIENT_KEY: &str = "client.key";
const CLIENT_CA: &str = "ca.crt";

fn check_workstation(name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if !valid {
        bail!("--workstation {name:?} is not a DNS label");
    }
    Ok(())
}

/// Makes a key, files a CertificateSigningRequest for it, waits for the signed certificate and
/// writes it with the key and the CA bundle. The key never leaves this machine.
async fn cert_cmd(a: CertArgs) -> Result<ExitCode> {
    use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
    use k8s_openapi::api::core::v1::ConfigMap;

    check_workstation(&a.workstation)?;
    let expiration = i32::try_from(a.lifetime.as_secs())
        .ok()
        .filter(|s| *s >= 600)
        .context("--lifetime must be between 10m and about 68 years")?;
    let dir = a.state.resolve()?;
    let key = rcgen::KeyPair::generate().context("cannot make a key")?;
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, a.workstation.as_str());
    let request = params
        .serialize_request(&key)
        .and_then(|r| r.pem())
        .context("cannot make the certificate signing request")?;

    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let csrs: kube::Api<CertificateSigningRequest> = kube::Api::all(client.clone());
    let csr: CertificateSigningRequest = serde_json::from_value(serde_json::json!({
        "metadata": {
            "generateName": format!("spur-workstation-{}-", a.workstation),
            "labels": {(spur_api::tunnel::WORKSTATION_LABEL): a.workstation},
        },
        "spec": {
            "request": k8s_openapi::ByteString(request.into_bytes()),
            "signerName": spur_api::workstation::WORKSTATION_SIGNER,
            "usages": ["client auth", "digital signature"],
            "expirationSeconds": expiration,
        },
    }))?;
    let created = csrs
        .create(&kube::api::PostParams::default(), &csr)
        .await
        .context("cannot create the CertificateSigningRequest")?;
    let name = created.metadata.name.clone().unwrap_or_default();
    say(format_args!(
        "certificate request {name} for workstation {} filed; waiting for approval (an administrator runs: kubectl certificate approve {name})",
        a.workstation
    ));
    let deadline = tokio::time::Instant::now() + a.wait;
    let cert = loop {
        let csr = csrs
            .get(&name)
            .await
            .with_context(|| format!("cannot read CertificateSigningRequest {name}"))?;
        let status = csr.status.unwrap_or_default();
        if let Some(c) = status.certificate.filter(|c| !c.0.is_empty()) {
            break String::from_utf8(c.0).context("the issued certificate is not PEM text")?;
        }
        if let Some(c) = status
            .conditions
            .unwrap_or_default()
            .into_iter()
            .find(|c| (c.type_ == "Denied" || c.type_ == "Failed") && c.status == "True")
        {
            bail!(
                "certificate request {name} {}: {}",
                c.type_.to_lowercase(),
                c.message.or(c.reason).unwrap_or_default()
            );
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "certificate request {name} was not signed within {}s; it stays pending (delete it with kubectl delete csr {name}) and its key is gone: run spur local cert again",
                a.wait.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    use rustls::pki_types::pem::PemObject as _;
    let identity = rustls::pki_types::CertificateDer::from_pem_slice(cert.as_bytes())
        .map_err(anyhow::Error::from)
        .and_then(|der| Ok(spur_tunnel::identity_from_cert(&der)?))
        .context("the issued certificate cannot be read")?;

    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_private(&dir.join(CLIENT_KEY), key.serialize_pem().as_bytes())?;
    std::fs::write(dir.join(CLIENT_CERT), &cert)
        .with_context(|| format!("cannot write {}", dir.join(CLIENT_CERT).display()))?;
    let bundle = kube::Api::<ConfigMap>::namespaced(client, &a.namespace)
        .get_opt("spur-ca-bundle")
        .await;
    match bundle {
        Ok(Some(cm)) => match cm.data.as_ref().and_then(|d| d.get("ca.crt")) {
            Some(pem) => std::fs::write(dir.join(CLIENT_CA), pem)
                .with_context(|| format!("cannot write {}", dir.join(CLIENT_CA).display()))?,
            None => say(
                "ConfigMap spur-ca-bundle has no ca.crt: pass the tunnel proxy's CA to spur local connect with --ca-file",
            ),
        },
        Ok(None) => say(format_args!(
            "no ConfigMap {}/spur-ca-bundle: pass the tunnel proxy's CA to spur local connect with --ca-file",
            a.namespace
        )),
        Err(e) => say(format_args!(
            "cannot read ConfigMap {}/spur-ca-bundle ({e}): pass the tunnel proxy's CA to spur local connect with --ca-file",
            a.namespace
        )),
    }
    let until = identity
        .expires_at
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or_else(|| "-".into(), |d| d.as_secs().to_string());
    say(format_args!(
        "certificate for workstation {} (valid until Unix time {until}) written to {}; spur local connect uses it",
        identity.name,
        dir.display()
    ));
    Ok(ExitCode::SUCCESS)
}

/// Writes a file only its owner can read (a private key).
fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
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
    /// File holding the workstation token (or set SPUR_TUNNEL_TOKEN). Without a token, the
    /// client certificate is used: --cert-file/--key-file, else the state directory's
    /// client.crt/client.key from `spur local cert`.
    #[arg(long, env = "SPUR_TUNNEL_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Client certificate (PEM) identifying this workstation.
    #[arg(long, env = "SPUR_TUNNEL_CERT_FILE", requires = "key_file")]
    cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "SPUR_TUNNEL_KEY_FILE", requires = "cert_file")]
    key_file: Option<PathBuf>,
    /// PEM file of the CA that signed the tunnel proxy's certificate [default: the state
    /// directory's ca.crt from `spur local cert`, else the system's trust store].
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
    /// Let reverse binds connect to any `toLocal` a Sandbox names. Without it only this
    /// machine's loopback addresses (localhost, 127.0.0.0/8, ::1) are connected to, so a
    /// Sandbox cannot reach other machines on your network through this workstation.
    #[arg(long)]
    allow_remote_targets: bool,
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
        LocalCommand::Connect(a) => connect(*a).await,
        LocalCommand::Status(a) => status(a),
        LocalCommand::Disconnect(a) => disconnect(a).await,
        LocalCommand::Proxy(a) => proxy_cmd(a).await,
        LocalCommand::Token(a) => token_cmd(a).await,
        LocalCommand::Cert(a) => cert_cmd(a).await,
        LocalCommand::Revoke(a) => revoke_cmd(a).await,
        LocalCommand::Env(a) => env::env_cmd(a).await,
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

type ClientCert = (
    Vec<rustls::pki_types::CertificateDer<'static>>,
    rustls::pki_types::PrivateKeyDer<'static>,
);

/// A token if one is given (--token-file, SPUR_TUNNEL_TOKEN), else a client certificate
/// (--cert-file/--key-file, else the state directory's from `spur local cert`).
fn credentials(
    args: &ConnectArgs,
    state_dir: &Path,
) -> Result<(Option<Token>, Option<ClientCert>)> {
    if args.token_file.is_some() || std::env::var_os("SPUR_TUNNEL_TOKEN").is_some() {
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

async fn connect(args: ConnectArgs) -> Result<ExitCode> {
    let state_dir = args.state.resolve()?;
    let state_ca = state_dir.join(CLIENT_CA);
    let ca_file = args
        .ca_file
        .clone()
        .or_else(|| state_ca.is_file().then_some(state_ca));
    let roots = spur_workstation::load_roots(ca_file.as_deref())?;
    let (token, client_cert) = credentials(&args, &state_dir)?;
    let server = args.server.trim_start_matches('[').trim_end_matches(']');
    let mut tunnel = ClientConfig::new(
        args.server_name
            .clone()
            .unwrap_or_else(|| server.to_owned()),
        ClientTls { roots, client_cert },
    );
    tunnel.quic_addr = Some(host_port(server, args.quic_port));
    tunnel.h2_addr = Some(host_port(server, args.h2_port));
    tunnel.transports = match args.transport {
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

    let mut config = ConnectConfig::new(tunnel, server);
    config.socks_addr = (!args.no_socks).then_some(args.socks_addr);
    config.dns_addr = (!args.no_dns).then_some(args.dns_addr);
    config.hosts_file = args.hosts_file.clone();
    config.state_dir = Some(state_dir.clone());
    config.namespaces = args.namespaces.clone();
    config.max_services = args.max_services;
    config.allow_remote_targets = args.allow_remote_targets;
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
