//! `spur-hub`: the self-hosted hub that clusters' agents dial out to (docs/hub.md): `serve`, and
//! the registry commands that edit its database directly, also while it runs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result, bail};
use clap::{Args, Parser, Subcommand};
use prometheus_client::registry::Registry;
use spur_bin_support::Runtime;
use spur_hub::Store;
use spur_hub::server::{Hub, HubConfig, TlsSource};
use spur_hub::store::{Database, PostgresSettings};
use tokio_util::sync::CancellationToken;

/// The self-hosted hub that clusters dial out to: `serve`, and its registry of clusters, users
/// and API keys (docs/hub.md).
#[derive(Parser)]
#[command(name = "spur-hub", version)]
struct HubArgs {
    #[command(subcommand)]
    command: HubCommand,
}

#[derive(Args, Clone)]
struct DbArg {
    /// The hub's database (SQLite; created when missing). Ignored with --database-url.
    #[arg(long, env = "SPUR_HUB_DB", default_value = "spur-hub.db")]
    db: PathBuf,
    /// An external PostgreSQL database instead of the SQLite file, shared by several hub
    /// replicas: postgres://USER@HOST:PORT/DATABASE (or libpq's key=value form). Over TLS,
    /// verified against --database-ca; give the hub a database of its own.
    #[arg(long, env = "SPUR_HUB_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// A file holding the database password (when the URL has none), e.g. a mounted Secret.
    #[arg(
        long,
        env = "SPUR_HUB_DATABASE_PASSWORD_FILE",
        requires = "database_url"
    )]
    database_password_file: Option<PathBuf>,
    /// CA certificates (PEM) the database server's certificate must chain to (default: the
    /// system's roots). The server's certificate must also name the URL's host.
    #[arg(long, env = "SPUR_HUB_DATABASE_CA", requires = "database_url")]
    database_ca: Option<PathBuf>,
    /// Connect to PostgreSQL without TLS (the registry's hashes and the hub's CA key then cross
    /// the network in the clear): only for a server on loopback or in the same pod.
    #[arg(
        long,
        env = "SPUR_HUB_DATABASE_INSECURE_PLAINTEXT",
        requires = "database_url"
    )]
    database_insecure_plaintext: bool,
}

impl DbArg {
    fn database(&self) -> Result<Database> {
        let Some(url) = &self.database_url else {
            return Ok(Database::Sqlite(self.db.clone()));
        };
        let password = match &self.database_password_file {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .with_context(|| format!("--database-password-file {}", path.display()))?
                    .trim_end_matches(['\r', '\n'])
                    .to_owned(),
            ),
            None => None,
        };
        Ok(Database::Postgres(PostgresSettings {
            url: url.clone(),
            password,
            ca: self.database_ca.clone(),
            insecure_plaintext: self.database_insecure_plaintext,
        }))
    }

    /// What the logs may say of the database (never the URL: it may hold a password).
    fn describe(&self) -> String {
        match self.database_url {
            Some(_) => "postgres".into(),
            None => self.db.display().to_string(),
        }
    }
}

#[derive(Subcommand)]
enum HubCommand {
    /// Run the hub: the agents' tunnel listener (QUIC and HTTP/2 over TLS on one port).
    Serve(Box<ServeArgs>),
    /// Register, list and revoke clusters.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Add, list, change and remove hub users: who each API key acts for, and what it may see
    /// (per cluster: which namespaces, and as which Kubernetes user and groups the cluster's
    /// agent checks its reads).
    #[command(subcommand)]
    User(UserCommand),
    /// Create, list, bind and revoke API keys (for previews and the web view); each belongs to
    /// a hub user.
    #[command(subcommand)]
    Apikey(ApiKeyCommand),
    /// Print a one-time login link for the web view, valid for 5 minutes and usable once: it
    /// opens a page that logs the browser in as API key NAME when the user confirms (people can
    /// also paste the key into the login form).
    LoginLink {
        /// The API key the session belongs to (it acts for that key's hub user).
        name: String,
        /// The hub's web address, e.g. https://hub.example.com.
        #[arg(long, env = "SPUR_HUB_URL")]
        url: String,
        #[command(flatten)]
        db: DbArg,
    },
    /// Print the hub's CA certificate (PEM), which agents trust when the hub issues its own
    /// certificate. Made on first use.
    Ca(DbArg),
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Register a cluster and print its token (shown once; only its hash is stored).
    Add {
        /// A DNS label.
        name: String,
        /// Issue a new token for a registered cluster; the old one stops working and its
        /// session is closed.
        #[arg(long)]
        rotate: bool,
        #[command(flatten)]
        db: DbArg,
    },
    List(DbArg),
    /// Revoke a cluster's token; a running hub closes its session within a second.
    Revoke {
        name: String,
        #[command(flatten)]
        db: DbArg,
    },
}

#[derive(Subcommand)]
enum ApiKeyCommand {
    /// Create an API key for a hub user and print it (shown once).
    Add {
        name: String,
        /// The hub user it acts for (default: a user named like the key); it must exist
        /// (`spur-hub user add`).
        #[arg(long)]
        user: Option<String>,
        #[command(flatten)]
        db: DbArg,
    },
    List(DbArg),
    /// Give an existing key to a hub user (keys made before hub users existed are refused
    /// until they get one).
    Bind {
        name: String,
        #[arg(long)]
        user: String,
        #[command(flatten)]
        db: DbArg,
    },
    Revoke {
        name: String,
        #[command(flatten)]
        db: DbArg,
    },
}

#[derive(Subcommand)]
enum UserCommand {
    /// Add a hub user; with --cluster, also set its scope there (else it sees nothing yet).
    Add {
        /// A DNS label.
        name: String,
        #[command(flatten)]
        scope: ScopeArgs,
        #[command(flatten)]
        db: DbArg,
    },
    /// Set (add or replace) what a user may see in one cluster.
    Set {
        name: String,
        #[command(flatten)]
        scope: ScopeArgs,
        #[command(flatten)]
        db: DbArg,
    },
    /// Take a user's scope in one cluster away.
    Unset {
        name: String,
        /// The cluster (or `*`).
        #[arg(long)]
        cluster: String,
        #[command(flatten)]
        db: DbArg,
    },
    /// Users, their scopes and their keys.
    List(DbArg),
    /// Remove a user: its scopes go and its API keys are revoked.
    Remove {
        name: String,
        #[command(flatten)]
        db: DbArg,
    },
}

#[derive(Args, Clone)]
struct ScopeArgs {
    /// The cluster (its name at the hub), or `*` for every cluster not named on its own.
    #[arg(long)]
    cluster: Option<String>,
    /// A namespace the user may see there (repeatable, or comma-separated).
    #[arg(
        long = "namespace",
        value_delimiter = ',',
        conflicts_with = "all_namespaces"
    )]
    namespaces: Vec<String>,
    /// Every namespace there.
    #[arg(long)]
    all_namespaces: bool,
    /// The Kubernetes user it acts as there (default: the hub user's name); the agent checks
    /// each read with a SubjectAccessReview for this user.
    #[arg(long)]
    kube_user: Option<String>,
    /// A Kubernetes group it acts as there (repeatable).
    #[arg(long = "kube-group")]
    kube_groups: Vec<String>,
}

impl ScopeArgs {
    /// The scope these flags give, or None when they give none (no flag at all).
    fn change(&self) -> Result<Option<spur_hub::store::ScopeChange>> {
        let Some(cluster) = self.cluster.clone() else {
            if self.all_namespaces
                || !self.namespaces.is_empty()
                || self.kube_user.is_some()
                || !self.kube_groups.is_empty()
            {
                bail!("name the cluster this scope is for: --cluster NAME (or '*')");
            }
            return Ok(None);
        };
        let names = if self.all_namespaces {
            vec!["*".to_owned()]
        } else {
            self.namespaces.clone()
        };
        Ok(Some(spur_hub::store::ScopeChange {
            cluster,
            namespaces: spur_hub::users::Namespaces::parse(&names)?,
            kube_user: self.kube_user.clone(),
            kube_groups: self.kube_groups.clone(),
        }))
    }
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    db: DbArg,
    /// Address of the agents' tunnel listener: QUIC on UDP and HTTP/2 over TLS on TCP.
    #[arg(long, env = "SPUR_HUB_TUNNEL_ADDR", default_value = "0.0.0.0:8443")]
    tunnel_addr: SocketAddr,
    /// Serve QUIC on the tunnel address (agents fall back to HTTP/2 without it).
    #[arg(long, env = "SPUR_HUB_QUIC", default_value_t = true, action = clap::ArgAction::Set)]
    quic: bool,
    /// Names (DNS or IP) of the certificate the hub issues itself from its CA (repeatable).
    /// Ignored with --tls-cert.
    #[arg(
        long = "name",
        env = "SPUR_HUB_NAMES",
        value_delimiter = ',',
        default_value = "localhost"
    )]
    names: Vec<String>,
    /// A serving certificate chain (PEM) to use instead of one from the hub's CA.
    #[arg(long, env = "SPUR_HUB_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "SPUR_HUB_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// How often the database is checked for revocations made by `spur-hub cluster revoke`.
    #[arg(long, env = "SPUR_HUB_REVOCATION_POLL_MS", default_value_t = 500, value_parser = clap::value_parser!(u64).range(50..=60_000))]
    revocation_poll_ms: u64,
    /// Address of /metrics and /healthz.
    #[arg(long, env = "SPUR_HUB_METRICS_ADDR", default_value = "127.0.0.1:9090")]
    metrics_addr: SocketAddr,
    /// HTTPS address of the preview front end and the web view (empty: neither).
    #[arg(long, env = "SPUR_HUB_PREVIEW_ADDR", default_value = "0.0.0.0:443")]
    preview_addr: String,
    /// Preview hosts are `<endpoint>--<sandbox>[--<cluster>].<domain>`; point a wildcard DNS
    /// record at the hub. It must not share a site with --web-host: use another registrable
    /// domain (hub.example.com, example-preview.net).
    #[arg(long, env = "SPUR_HUB_PREVIEW_DOMAIN", default_value = "preview.test")]
    preview_domain: String,
    /// The web view's host name: the web view is served under this name only (default: the
    /// first --name).
    #[arg(long, env = "SPUR_HUB_WEB_HOST")]
    web_host: Option<String>,
    /// How long a browser or client may take to send a request head (and how long a kept-alive
    /// connection may wait for its next one), e.g. 10s.
    #[arg(long, env = "SPUR_HUB_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = spur_runtime::parse_duration)]
    header_read_timeout: Duration,
    /// How long a connection may stay with no request in flight before the hub closes it.
    #[arg(long, env = "SPUR_HUB_IDLE_TIMEOUT", default_value = "120s", value_parser = spur_runtime::parse_duration)]
    idle_timeout: Duration,
    /// Connections one client address may hold on the preview and web view port; more are
    /// closed at accept.
    #[arg(long, env = "SPUR_HUB_MAX_CONNECTIONS_PER_IP", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections_per_ip: u64,
    /// How long a preview target may take to send its response head before the hub answers
    /// 504 (e.g. 60s, 500ms).
    #[arg(long, env = "SPUR_HUB_PREVIEW_TIMEOUT", default_value = "60s", value_parser = spur_runtime::parse_duration)]
    preview_timeout: Duration,
    /// Serve endpoints whose spec says `public: true` to anyone, without an API key or login.
    /// Off by default: anyone who may create a Sandbox could otherwise publish a service.
    #[arg(long, env = "SPUR_HUB_ALLOW_PUBLIC_PREVIEWS")]
    allow_public_previews: bool,
    /// A header the clusters' sidecars read a bare routing key from (their --routing-header;
    /// repeatable, comma-separated in the env var): previews overwrite it with their own key.
    #[arg(
        long = "routing-header",
        env = "SPUR_HUB_ROUTING_HEADERS",
        value_delimiter = ','
    )]
    routing_headers: Vec<String>,
    /// A query parameter the clusters' sidecars read a routing key from (their --query-param;
    /// repeatable, comma-separated in the env var): removed from every preview request. Empty:
    /// none. The clusters' namespaces' own are added through their agents.
    #[arg(
        long = "query-param",
        env = "SPUR_HUB_QUERY_PARAM",
        value_delimiter = ',',
        default_value = spur_hub::preview::DEFAULT_QUERY_PARAM
    )]
    query_params: Vec<String>,
    /// Seconds agents' streams get to finish on SIGTERM.
    #[arg(long, env = "SPUR_HUB_DRAIN_GRACE", default_value_t = 10)]
    drain_grace: u64,
}

fn open_store(db: &DbArg) -> Result<Store> {
    Ok(Store::open_database(&db.database()?)?)
}

fn ago(t: Option<SystemTime>) -> String {
    match t.and_then(|t| SystemTime::now().duration_since(t).ok()) {
        None => "-".into(),
        Some(d) if d.as_secs() < 120 => format!("{}s ago", d.as_secs()),
        Some(d) if d.as_secs() < 7200 => format!("{}m ago", d.as_secs() / 60),
        Some(d) if d.as_secs() < 172_800 => format!("{}h ago", d.as_secs() / 3600),
        Some(d) => format!("{}d ago", d.as_secs() / 86_400),
    }
}

async fn run(args: HubArgs) -> Result<ExitCode> {
    match args.command {
        HubCommand::Serve(args) => serve(*args).await,
        HubCommand::Cluster(ClusterCommand::Add { name, rotate, db }) => {
            let token = open_store(&db)?.add_cluster(&name, rotate)?;
            eprintln!("cluster {name} registered; give this token to its agent (shown once):");
            println!("{token}");
            Ok(ExitCode::SUCCESS)
        }
        HubCommand::Cluster(ClusterCommand::List(db)) => {
            println!(
                "{:<24} {:<10} {:<14} {:<14}",
                "NAME", "STATUS", "CREATED", "LAST SEEN"
            );
            for c in open_store(&db)?.clusters()? {
                let status = if c.revoked.is_some() {
                    "revoked"
                } else {
                    "active"
                };
                println!(
                    "{:<24} {:<10} {:<14} {:<14}",
                    c.name,
                    status,
                    ago(Some(c.created)),
                    ago(c.last_seen)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        HubCommand::Cluster(ClusterCommand::Revoke { name, db }) => {
            if open_store(&db)?.revoke_cluster(&name)? {
                eprintln!("cluster {name} revoked; a running hub closes its session");
            } else {
                eprintln!("cluster {name} was already revoked");
            }
            Ok(ExitCode::SUCCESS)
        }
        HubCommand::Apikey(ApiKeyCommand::Add { name, user, db }) => {
            let user = user.unwrap_or_else(|| name.clone());
            let key = open_store(&db)?.add_api_key(&name, &user)?;
            eprintln!("API key {name} of hub user {user} created (shown once):");
            println!("{key}");
            Ok(ExitCode::SUCCESS)
        }
        HubCommand::Apikey(ApiKeyCommand::Bind { name, user, db }) => {
            open_store(&db)?.bind_api_key(&name, &user)?;
            eprintln!("API key {name} now acts for hub user {user}");
            Ok(ExitCode::SUCCESS)
        }
        HubCommand::Apikey(ApiKeyCommand::List(db)) => {
            println!(
                "{:<24} {:<24} {:<10} {:<14}",
                "NAME", "USER", "STATUS", "CREATED"
            );
            for k in open_store(&db)?.api_keys()? {
                let status = match (&k.revoked, &k.user) {
                    (Some(_), _) => "revoked",
                    (None, None) => "no-user",
                    (None, Some(_)) => "active",
                };
                println!(
                    "{:<24} {:<24} {:<10} {:<14}",
                    k.name,
                    k.user.as_deref().unwrap_or("-"),
                    status,
                    ago(Some(k.created))
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        HubCommand::User(command) => user_command(command),
        HubCommand::Apikey(ApiKeyCommand::Revoke { name, db }) => {
            if open_store(&db)?.revoke_api_key(&name)? {
                eprintln!("API key {name} revoked");
            } else {
                eprintln!("API key {name} was already revoked");
            }
            Ok(ExitCode::SUCCESS)
        }
        HubCommand::LoginLink { name, url, db } => {
            let code = open_store(&db)?.create_login_code(&name, Duration::from_secs(300))?;
            println!("{}/login?code={code}", url.trim_end_matches('/'));
            Ok(ExitCode::SUCCESS)
        }
        HubCommand::Ca(db) => {
            let ca = spur_hub::server::hub_ca(&open_store(&db)?)?;
            print!("{}", ca.cert);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn user_command(command: UserCommand) -> Result<ExitCode> {
    match command {
        UserCommand::Add { name, scope, db } => {
            let store = open_store(&db)?;
            // Checked before anything is written: a bad scope adds no user.
            let change = scope.change()?;
            store.add_user(&name)?;
            match change {
                Some(change) => {
                    store.set_user_scope(&name, &change)?;
                    eprintln!(
                        "hub user {name} added; in cluster {} it sees namespaces {}",
                        change.cluster, change.namespaces
                    );
                }
                None => eprintln!(
                    "hub user {name} added; it sees nothing until `spur-hub user set {name} \
                     --cluster C --namespace N`"
                ),
            }
        }
        UserCommand::Set { name, scope, db } => {
            let change = scope
                .change()?
                .context("name the cluster: --cluster NAME (or '*')")?;
            open_store(&db)?.set_user_scope(&name, &change)?;
            eprintln!(
                "hub user {name}: in cluster {} it sees namespaces {}",
                change.cluster, change.namespaces
            );
        }
        UserCommand::Unset { name, cluster, db } => {
            if open_store(&db)?.unset_user_scope(&name, &cluster)? {
                eprintln!("hub user {name} no longer sees cluster {cluster}");
            } else {
                eprintln!("hub user {name} had no scope in cluster {cluster}");
            }
        }
        UserCommand::List(db) => {
            let store = open_store(&db)?;
            let keys = store.api_keys()?;
            println!(
                "{:<20} {:<16} {:<28} {:<24} {:<20} KEYS",
                "USER", "CLUSTER", "NAMESPACES", "KUBE USER", "KUBE GROUPS"
            );
            for u in store.users()? {
                let mine: Vec<&str> = keys
                    .iter()
                    .filter(|k| k.revoked.is_none() && k.user.as_deref() == Some(&u.name))
                    .map(|k| k.name.as_str())
                    .collect();
                let mine = if mine.is_empty() {
                    "-".to_owned()
                } else {
                    mine.join(",")
                };
                if u.clusters.is_empty() {
                    println!(
                        "{:<20} {:<16} {:<28} {:<24} {:<20} {mine}",
                        u.name, "-", "-", "-", "-"
                    );
                }
                for (cluster, scope) in &u.clusters {
                    let groups = if scope.kube_groups.is_empty() {
                        "-".to_owned()
                    } else {
                        scope.kube_groups.join(",")
                    };
                    println!(
                        "{:<20} {:<16} {:<28} {:<24} {:<20} {mine}",
                        u.name,
                        cluster,
                        scope.namespaces.to_string(),
                        scope.kube_user.as_deref().unwrap_or(&u.name),
                        groups
                    );
                }
            }
            let unbound = store.unbound_api_keys()?;
            if !unbound.is_empty() {
                eprintln!(
                    "API keys of no user (refused until bound: spur-hub apikey bind NAME --user \
                     USER): {}",
                    unbound.join(", ")
                );
            }
        }
        UserCommand::Remove { name, db } => {
            let revoked = open_store(&db)?.remove_user(&name)?;
            eprintln!("hub user {name} removed; {revoked} API key(s) of it revoked");
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn serve(args: ServeArgs) -> Result<ExitCode> {
    let shutdown = spur_runtime::shutdown_signal();
    let store = open_store(&args.db)?;
    let web_host = match &args.web_host {
        Some(h) => h.clone(),
        None => args
            .names
            .first()
            .cloned()
            .context("no --web-host and no --name to take it from")?,
    };
    let tls = match (args.tls_cert, args.tls_key) {
        (Some(cert), Some(key)) => TlsSource::Files { cert, key },
        _ => TlsSource::OwnCa { names: args.names },
    };
    let mut registry = Registry::with_prefix("spur_hub");
    let hub = Hub::start(
        HubConfig {
            tunnel_quic: args.quic.then_some(args.tunnel_addr),
            tunnel_h2: Some(args.tunnel_addr),
            tls,
            revocation_poll: Duration::from_millis(args.revocation_poll_ms),
            preview: match args.preview_addr.trim() {
                "" => None,
                addr => Some(spur_hub::server::PreviewSettings {
                    addr: addr
                        .parse()
                        .with_context(|| format!("--preview-addr {addr:?} is not IP:PORT"))?,
                    domain: args.preview_domain,
                    web_host,
                    limits: spur_hub::listener::ListenerLimits {
                        header_read_timeout: args.header_read_timeout,
                        idle_timeout: args.idle_timeout,
                        max_per_peer: usize::try_from(args.max_connections_per_ip)
                            .unwrap_or(usize::MAX),
                        ..spur_hub::listener::ListenerLimits::default()
                    },
                    response_timeout: args.preview_timeout,
                    allow_public: args.allow_public_previews,
                    carriers: spur_routing::ExtractConfig {
                        custom_headers: args.routing_headers,
                        query_param: None,
                    },
                    more_query_params: args
                        .query_params
                        .iter()
                        .map(|q| q.trim().to_owned())
                        .filter(|q| !q.is_empty())
                        .collect(),
                }),
            },
        },
        store,
        &mut registry,
    )
    .await?;
    tracing::info!(
        quic = ?hub.tunnel_quic_addr(),
        h2 = ?hub.tunnel_h2_addr(),
        preview = ?hub.preview_addr(),
        db = %args.db.describe(),
        "hub started"
    );
    let stop = CancellationToken::new();
    let listener = spur_serving::health::bind_health(args.metrics_addr).await?;
    let http = tokio::spawn(spur_serving::health::serve_health(
        listener,
        registry,
        None,
        stop.clone(),
    ));
    let run = hub.run(stop.clone(), Duration::from_secs(args.drain_grace));
    tokio::pin!(run);
    tokio::select! {
        () = shutdown => {
            tracing::info!("shutting down: agents are told to go away and reconnect");
            stop.cancel();
            run.await;
        }
        () = &mut run => {}
    }
    stop.cancel();
    http.await.context("metrics server panicked")??;
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let args = HubArgs::parse();
    spur_bin_support::run("spur-hub", "info", Runtime::MultiThread, run(args))
}
