//! `spur traffic tail|query|diff`: read a sandbox's captured exchanges back from the traffic
//! store (proto/traffic.proto) and compare what its forks answered with what the baseline
//! answered to the same requests. This file parses the arguments, talks to the store and
//! prints; pairing, comparing and the text and JSON forms are `spur-traffic-diff`'s.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use spur_proto::traffic::traffic_client::TrafficClient;
use spur_proto::traffic::{Exchange, Filter, QueryRequest, Routed, TailRequest, tail_event};
use spur_traffic_diff::render::{
    exchange_json, exchange_line, pair_json, render_pair, unpaired_line,
};
use spur_traffic_diff::text::rfc3339;
use spur_traffic_diff::{compare, pair_exchanges, workload_key, workload_name};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// A Query reply may carry 1000 exchanges with their bodies: above tonic's 4 MiB default.
const MAX_REPLY_BYTES: usize = 256 << 20;
/// The store's own cap on a Query.
pub(crate) const STORE_LIMIT: u32 = 1000;

#[derive(Args)]
pub(crate) struct TrafficArgs {
    #[command(subcommand)]
    command: TrafficCommand,
    #[command(flatten)]
    conn: Conn,
}

#[derive(Args)]
pub(crate) struct Conn {
    /// The traffic server: http://HOST:PORT or https://HOST:PORT.
    #[arg(long, env = "SPUR_TRAFFIC_SERVER", global = true)]
    server: Option<String>,
    /// CA bundle (PEM) for an https:// server (default: the system's roots).
    #[arg(long, env = "SPUR_TRAFFIC_CA", global = true)]
    ca: Option<PathBuf>,
    /// File holding the bearer token (default: the token itself in $SPUR_TRAFFIC_TOKEN). In a
    /// cluster, a token issued for the store's audience `spur-traffic`
    /// (`kubectl create token NAME --audience spur-traffic`).
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    /// The name the server's certificate must carry, when --server names it otherwise (a
    /// port-forward to 127.0.0.1: spur-traffic.spur-system.svc).
    #[arg(long, env = "SPUR_TRAFFIC_TLS_SERVER_NAME", global = true)]
    tls_server_name: Option<String>,
}

#[derive(Args)]
pub(crate) struct Filters {
    /// Only exchanges captured by this baseline workload: NAMESPACE/NAME (NAME: any namespace).
    #[arg(long, value_name = "NS/NAME")]
    workload: Option<String>,
    /// Only requests whose path starts with this.
    #[arg(long, value_name = "PREFIX")]
    path: Option<String>,
    /// Only requests with this method.
    #[arg(long)]
    method: Option<String>,
    /// Only responses with this status.
    #[arg(long)]
    status: Option<u32>,
}

#[derive(Subcommand)]
enum TrafficCommand {
    /// Print a sandbox's exchanges as they are captured: time, sandbox, destination (or
    /// `baseline`), method, path, status, duration, response body size. Ctrl-C ends it.
    Tail(TailArgs),
    /// Print a sandbox's stored exchanges, oldest first (as `tail` prints them).
    ///
    /// With --json, one object per line: id, time (RFC 3339), startUnixMicros,
    /// storedUnixMicros, sandbox, routingKey, baseline {kind, namespace, name}, pod, routed
    /// ("sandbox" or "baseline"), destination, protocol, method, path, authority, status,
    /// responseMicros, durationMicros, error (null if none), requestHeaders, responseHeaders,
    /// responseTrailers (each a list of [name, value], or [name, base64, "base64"] for a value
    /// that is not UTF-8), requestBody and responseBody ({size, truncated, encoding: "utf8" or
    /// "base64", data}).
    Query(QueryArgs),
    /// Compare what a sandbox's forks answered with what the baseline answered to the same
    /// requests.
    ///
    /// Takes the exchanges of SANDBOX that were sent to a sandbox destination, and the
    /// exchanges the baseline application answered for the same baseline workloads (those
    /// come from virtual workloads of reference sandboxes: any sandbox, or only --against).
    /// Each sandbox exchange is paired with the baseline exchange of the same workload and
    /// method closest to it in time, on the same path and query string, or failing that on the
    /// same path with any query string (the output says so). A pair's status, response headers
    /// and trailers (hop-by-hop and volatile ones ignored), and response bodies are compared:
    /// JSON structurally (paths like $.items[2].name), gRPC message by message, text line by
    /// line. Bodies the capture truncated are compared on the shorter captured prefix. Output
    /// reads baseline → sandbox.
    ///
    /// --json prints one object: sandbox, against, pairs [{workload, method, path, pairedOn
    /// ("pathAndQuery" or "path"), sandboxExchange and baselineExchange {id, time, sandbox,
    /// destination, path}, differences [{kind (status, header, trailer, bodySize, json, grpc,
    /// line, binary), at (header name, JSON path, message index, line or byte offset), baseline,
    /// sandbox (each left out where that side has none)}], notes}], unpaired [{workload,
    /// method, path, id, time}], summary {pairs, differing, unpaired}.
    ///
    /// Exit status: 0 when every sandbox exchange was paired and no pair differs, 1 when a pair
    /// differs or a sandbox exchange has no baseline exchange, 2 on error.
    Diff(DiffArgs),
    /// Turn traffic capture on or off for a sandbox (its `spec.capture.enabled`). Turning it on
    /// needs `update` on `sandboxes/capture` (ClusterRole spur-traffic-capturer): the cluster
    /// refuses it otherwise. Talks to the Kubernetes API, not to the traffic server.
    Capture(CaptureArgs),
}

#[derive(Args)]
struct CaptureArgs {
    #[arg(value_enum)]
    state: CaptureState,
    /// The sandbox.
    sandbox: String,
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<std::path::PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CaptureState {
    On,
    Off,
}

#[derive(Args)]
struct TailArgs {
    /// The sandbox (or route group) whose exchanges to read.
    sandbox: String,
    #[command(flatten)]
    filters: Filters,
    /// One JSON object per line (the shape `query --json` prints).
    #[arg(long)]
    json: bool,
    /// Exit (0) after this many exchanges.
    #[arg(long)]
    count: Option<u64>,
    /// Exit (1) when no exchange came for this long (e.g. 30s, 2m).
    #[arg(long, value_parser = spur_runtime::parse_duration)]
    timeout: Option<Duration>,
}

#[derive(Args)]
struct QueryArgs {
    /// The sandbox (or route group) whose exchanges to read.
    sandbox: String,
    #[command(flatten)]
    filters: Filters,
    /// Only exchanges that started within this long (e.g. 10m, 1h).
    #[arg(long, value_parser = spur_runtime::parse_duration)]
    since: Option<Duration>,
    /// At most this many, the newest (the store caps it at 1000).
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// JSON instead of text (the shape is in this command's long help).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct DiffArgs {
    /// The sandbox whose forks' answers to compare.
    sandbox: String,
    // The sandbox's exchanges; the baseline's are filtered alike except for --status.
    #[command(flatten)]
    filters: Filters,
    /// Baseline exchanges from this (reference) sandbox only.
    #[arg(long, value_name = "SANDBOX")]
    against: Option<String>,
    /// Only exchanges that started within this long (e.g. 10m, 1h).
    #[arg(long, value_parser = spur_runtime::parse_duration)]
    since: Option<Duration>,
    /// At most this many sandbox exchanges, the newest.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// JSON instead of text (the shape is in this command's long help).
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: TrafficArgs) -> Result<ExitCode> {
    let conn = &args.conn;
    match args.command {
        TrafficCommand::Tail(a) => tail(conn, a).await,
        TrafficCommand::Query(a) => {
            let filter = a.filters.filter(a.sandbox, a.since)?;
            let mut client = connect(conn).await?;
            let found = query(&mut client, conn, filter, a.limit).await?;
            for (x, stored) in found.iter().rev() {
                if !print_exchange(x, *stored, a.json)? {
                    break;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        TrafficCommand::Capture(a) => capture(a).await,
        // Errors exit 2 here: 1 tells a script "differences found".
        TrafficCommand::Diff(a) => Ok(diff(conn, a).await.unwrap_or_else(|e| {
            eprintln!("spur: {e:#}");
            ExitCode::from(2)
        })),
    }
}

/// Sets `spec.capture.enabled` of the sandbox (a merge patch: nothing else changes).
async fn capture(a: CaptureArgs) -> Result<ExitCode> {
    use kube::api::{Api, Patch, PatchParams};
    let on = a.state == CaptureState::On;
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let sandboxes: Api<spur_api::Sandbox> = Api::all(client);
    let patch = Patch::Merge(serde_json::json!({"spec": {"capture": {"enabled": on}}}));
    match sandboxes
        .patch(&a.sandbox, &PatchParams::default(), &patch)
        .await
    {
        Ok(_) => {
            println!(
                "traffic capture {} for sandbox {}",
                if on { "on" } else { "off" },
                a.sandbox
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(kube::Error::Api(e)) if e.code == 404 => {
            bail!("sandbox {:?} not found", a.sandbox)
        }
        // The policy's message says what is missing (the capturer role).
        Err(kube::Error::Api(e)) => bail!("sandbox {}: {}", a.sandbox, e.message),
        Err(e) => Err(e).with_context(|| format!("patching sandbox {}", a.sandbox)),
    }
}

impl Filters {
    pub(crate) fn filter(self, sandbox: String, since: Option<Duration>) -> Result<Filter> {
        let (namespace, workload) = match self.workload.as_deref() {
            None => (String::new(), String::new()),
            Some(w) => match w.split_once('/') {
                Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                    (ns.to_owned(), name.to_owned())
                }
                None if !w.is_empty() => (String::new(), w.to_owned()),
                _ => bail!("--workload {w:?}: expected NAMESPACE/NAME"),
            },
        };
        let since_unix_micros = match since {
            None => 0,
            Some(d) => {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                // 0 would mean "unbounded".
                i64::try_from(now.saturating_sub(d).as_micros())
                    .unwrap_or(i64::MAX)
                    .max(1)
            }
        };
        Ok(Filter {
            sandbox,
            namespace,
            workload,
            path_prefix: self.path.unwrap_or_default(),
            method: self.method.unwrap_or_default(),
            status: self.status.unwrap_or(0),
            routed: Routed::Any.into(),
            since_unix_micros,
            until_unix_micros: 0,
        })
    }
}

// === connection ===

pub(crate) type Client = TrafficClient<InterceptedService<Channel, Auth>>;

/// Adds the bearer token to every call.
#[derive(Clone)]
pub(crate) struct Auth(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            req.metadata_mut().insert("authorization", token.clone());
        }
        Ok(req)
    }
}

pub(crate) async fn connect(conn: &Conn) -> Result<Client> {
    let Some(server) = conn.server.as_deref() else {
        bail!("no traffic server: pass --server URL or set SPUR_TRAFFIC_SERVER");
    };
    let url = if server.contains("://") {
        server.to_owned()
    } else {
        format!("http://{server}")
    };
    let mut endpoint = Endpoint::from_shared(url)
        .map_err(|e| anyhow!("--server {server:?}: {e}"))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    match (endpoint.uri().scheme_str(), &conn.ca) {
        (Some("https"), ca) => {
            let tls = ClientTlsConfig::new();
            let tls = match ca {
                Some(path) => tls.ca_certificate(Certificate::from_pem(read_ca(path)?)),
                None => tls.with_native_roots(),
            };
            let tls = match &conn.tls_server_name {
                Some(name) => tls.domain_name(name.clone()),
                None => tls,
            };
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| anyhow!("TLS for {server}: {}", error_chain(&e)))?;
        }
        (Some("http"), None) if conn.tls_server_name.is_none() => {}
        (Some("http"), None) => {
            bail!("--tls-server-name is for an https:// server; {server} is http")
        }
        (Some("http"), Some(_)) => bail!("--ca is for an https:// server; {server} is http"),
        _ => bail!("--server {server:?}: expected http://HOST:PORT or https://HOST:PORT"),
    }
    let auth = Auth(authorization(conn.token_file.as_deref())?);
    let channel = endpoint.connect().await.map_err(|e| {
        anyhow!(
            "cannot reach the traffic server {server}: {}",
            error_chain(&e)
        )
    })?;
    Ok(TrafficClient::with_interceptor(channel, auth).max_decoding_message_size(MAX_REPLY_BYTES))
}

/// The PEM bundle, checked here: tonic would skip a certificate it cannot parse in silence.
fn read_ca(path: &Path) -> Result<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let pem = std::fs::read(path)
        .with_context(|| format!("cannot read the CA bundle {}", path.display()))?;
    let mut certs = 0;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        cert.with_context(|| format!("CA bundle {}", path.display()))?;
        certs += 1;
    }
    if certs == 0 {
        bail!("the CA bundle {} holds no certificate", path.display());
    }
    Ok(pem)
}

/// `Bearer <token>`, marked sensitive so that no log prints it; never part of an error.
fn authorization(file: Option<&Path>) -> Result<Option<MetadataValue<Ascii>>> {
    let token = match file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the token file {}", path.display()))?,
        None => match std::env::var("SPUR_TRAFFIC_TOKEN") {
            Ok(token) => token,
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => bail!("SPUR_TRAFFIC_TOKEN is not UTF-8"),
        },
    };
    let token = token.trim();
    if token.is_empty() {
        bail!("the token (--token-file or SPUR_TRAFFIC_TOKEN) is empty");
    }
    let mut value = MetadataValue::try_from(format!("Bearer {token}"))
        .map_err(|_| anyhow!("the token has characters a header cannot carry"))?;
    value.set_sensitive(true);
    Ok(Some(value))
}

/// tonic's transport error says only "transport error"; the cause is in its sources.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        // hyper's connect errors repeat their cause's text.
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// `permission denied: <the server's message>`, with a hint where one helps.
pub(crate) fn status_error(conn: &Conn, status: &tonic::Status) -> anyhow::Error {
    let mut code = String::new();
    for c in format!("{:?}", status.code()).chars() {
        if c.is_uppercase() && !code.is_empty() {
            code.push(' ');
        }
        code.push(c.to_ascii_lowercase());
    }
    let server = conn.server.as_deref().unwrap_or_default();
    let hint = match status.code() {
        tonic::Code::Unauthenticated => {
            " (pass --token-file or set SPUR_TRAFFIC_TOKEN: a token for the audience spur-traffic, \
             e.g. `kubectl create token NAME --audience spur-traffic`)"
        }
        tonic::Code::PermissionDenied if status.message().contains("sandboxes/traffic") => {
            " (reading needs `get` on sandboxes/traffic)"
        }
        _ => "",
    };
    anyhow!(
        "traffic server {server}: {code}: {}{hint}",
        status.message()
    )
}

/// Stored exchanges matching `filter` with their store times, newest first.
pub(crate) async fn query(
    client: &mut Client,
    conn: &Conn,
    filter: Filter,
    limit: u32,
) -> Result<Vec<(Exchange, i64)>> {
    query_request(
        client,
        conn,
        QueryRequest {
            filter: Some(filter),
            limit,
            without_bodies: false,
        },
    )
    .await
}

/// [`query`] with the whole request given (heads only, say).
pub(crate) async fn query_request(
    client: &mut Client,
    conn: &Conn,
    request: QueryRequest,
) -> Result<Vec<(Exchange, i64)>> {
    let reply = client
        .query(request)
        .await
        .map_err(|s| status_error(conn, &s))?;
    Ok(reply
        .into_inner()
        .exchanges
        .into_iter()
        .filter_map(|s| Some((s.exchange?, s.stored_unix_micros)))
        .collect())
}

async fn tail(conn: &Conn, a: TailArgs) -> Result<ExitCode> {
    let filter = a.filters.filter(a.sandbox, None)?;
    let mut client = connect(conn).await?;
    let request = TailRequest {
        filter: Some(filter),
    };
    let mut stream = client
        .tail(request)
        .await
        .map_err(|s| status_error(conn, &s))?
        .into_inner();
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    let mut seen = 0u64;
    let mut deadline = a.timeout.map(|d| tokio::time::Instant::now() + d);
    loop {
        let next = async {
            match deadline {
                Some(at) => tokio::time::timeout_at(at, stream.message()).await.ok(),
                None => Some(stream.message().await),
            }
        };
        let event = tokio::select! {
            _ = &mut ctrl_c => return Ok(ExitCode::SUCCESS),
            next = next => next,
        };
        match event {
            None => {
                let waited = a.timeout.unwrap_or_default();
                eprintln!("spur: no exchange within {waited:?}");
                return Ok(ExitCode::FAILURE);
            }
            Some(Err(status)) => return Err(status_error(conn, &status)),
            Some(Ok(None)) => bail!("the traffic server ended the stream"),
            Some(Ok(Some(event))) => match event.event {
                Some(tail_event::Event::Exchange(stored)) => {
                    let Some(x) = stored.exchange else { continue };
                    seen += 1;
                    if !print_exchange(&x, stored.stored_unix_micros, a.json)?
                        || a.count.is_some_and(|n| seen >= n)
                    {
                        return Ok(ExitCode::SUCCESS);
                    }
                    deadline = a.timeout.map(|d| tokio::time::Instant::now() + d);
                }
                Some(tail_event::Event::Lagged(n)) => {
                    eprintln!("warning: skipped {n} exchanges: reader too slow");
                }
                None => {}
            },
        }
    }
}

/// False once stdout is closed (`| head`), which ends the output quietly.
fn print_exchange(x: &Exchange, stored_unix_micros: i64, json: bool) -> Result<bool> {
    if json {
        emit(&exchange_json(x, stored_unix_micros).to_string())
    } else {
        emit(&exchange_line(x))
    }
}

fn emit(text: &str) -> Result<bool> {
    match writeln!(std::io::stdout().lock(), "{text}") {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e).context("writing to stdout"),
    }
}

// === diff ===

async fn diff(conn: &Conn, a: DiffArgs) -> Result<ExitCode> {
    let mut client = connect(conn).await?;
    let mut filter = a.filters.filter(a.sandbox.clone(), a.since)?;
    filter.routed = Routed::Sandbox.into();
    let mut forked: Vec<Exchange> = query(&mut client, conn, filter.clone(), a.limit)
        .await?
        .into_iter()
        .map(|(x, _)| x)
        .collect();
    forked.sort_by_key(|x| x.start_unix_micros);
    let workloads: BTreeSet<(String, String)> = forked.iter().map(workload_key).collect();
    let mut baseline = Vec::new();
    for (namespace, workload) in workloads {
        let f = Filter {
            sandbox: a.against.clone().unwrap_or_default(),
            namespace,
            workload,
            status: 0,
            routed: Routed::Baseline.into(),
            ..filter.clone()
        };
        let found = query(&mut client, conn, f, STORE_LIMIT).await?;
        baseline.extend(found.into_iter().map(|(x, _)| x));
    }
    if forked.is_empty() {
        eprintln!(
            "spur: no exchange of {} was sent to a sandbox destination",
            a.sandbox
        );
    }
    let (pairs, unpaired) = pair_exchanges(&forked, &baseline);
    let compared: Vec<_> = pairs
        .iter()
        .map(|p| (p, compare(p.baseline, p.sandbox)))
        .collect();
    let differing = compared
        .iter()
        .filter(|(_, c)| !c.differences.is_empty())
        .count();
    let out = if a.json {
        let unpaired: Vec<Value> = unpaired
            .iter()
            .map(|x| {
                json!({"workload": workload_name(x), "method": x.method, "path": x.path,
                       "id": x.id, "time": rfc3339(x.start_unix_micros)})
            })
            .collect();
        let summary =
            json!({"pairs": pairs.len(), "differing": differing, "unpaired": unpaired.len()});
        let pairs: Vec<Value> = compared.iter().map(|(p, c)| pair_json(p, c)).collect();
        json!({"sandbox": a.sandbox, "against": a.against, "pairs": pairs, "unpaired": unpaired,
               "summary": summary})
        .to_string()
    } else {
        let mut out = String::new();
        for (p, c) in &compared {
            render_pair(&mut out, p, c);
        }
        for x in &unpaired {
            out.push_str(&unpaired_line(x));
            out.push('\n');
        }
        out + &format!(
            "pairs: {}, with differences: {differing}, without a baseline exchange: {}",
            pairs.len(),
            unpaired.len()
        )
    };
    emit(&out)?;
    Ok(if differing == 0 && unpaired.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Top,
    }

    #[derive(clap::Subcommand)]
    enum Top {
        Traffic(TrafficArgs),
    }

    #[test]
    fn command_lines() {
        use clap::CommandFactory as _;
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "spur",
            "traffic",
            "diff",
            "sb",
            "--workload",
            "ns/api",
            "--against",
            "ref",
            "--since",
            "1h",
            "--server",
            "http://127.0.0.1:7790",
            "--json",
        ])
        .unwrap();
        let Top::Traffic(args) = cli.command;
        assert_eq!(args.conn.server.as_deref(), Some("http://127.0.0.1:7790"));
        let TrafficCommand::Diff(d) = args.command else {
            panic!("not diff")
        };
        assert_eq!(d.against.as_deref(), Some("ref"));
        let f = d.filters.filter("sb".into(), d.since).unwrap();
        assert_eq!((f.namespace.as_str(), f.workload.as_str()), ("ns", "api"));
        assert!(f.since_unix_micros > 0);
        let bad = Filters {
            workload: Some("a/b/c".into()),
            path: None,
            method: None,
            status: None,
        };
        assert!(bad.filter("sb".into(), None).is_err());
    }
}
