//! `spur traffic tail|query|diff`: read a sandbox's captured exchanges back from the traffic
//! store (proto/traffic.proto) and compare what its forks answered with what the baseline
//! answered to the same requests.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use spur_proto::traffic::traffic_client::TrafficClient;
use spur_proto::traffic::{
    Body, Exchange, Filter, Header, Protocol, QueryRequest, Routed, TailRequest, tail_event,
};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// Response headers a diff ignores: hop-by-hop ones and those that differ on every response.
/// `content-length` is ignored too whenever the bodies themselves are compared.
const IGNORED_HEADERS: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "date",
    "x-request-id",
    "traceparent",
    "tracestate",
    "server-timing",
];
/// Body differences shown per pair: past this a person reads the bodies themselves.
const MAX_BODY_DIFFERENCES: usize = 40;
/// A Query reply may carry 1000 exchanges with their bodies: above tonic's 4 MiB default.
const MAX_REPLY_BYTES: usize = 256 << 20;
/// The store's own cap on a Query.
const STORE_LIMIT: u32 = 1000;

#[derive(Args)]
pub(crate) struct TrafficArgs {
    #[command(subcommand)]
    command: TrafficCommand,
    #[command(flatten)]
    conn: Conn,
}

#[derive(Args)]
struct Conn {
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
struct Filters {
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
    fn filter(self, sandbox: String, since: Option<Duration>) -> Result<Filter> {
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

type Client = TrafficClient<InterceptedService<Channel, Auth>>;

/// Adds the bearer token to every call.
#[derive(Clone)]
struct Auth(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            req.metadata_mut().insert("authorization", token.clone());
        }
        Ok(req)
    }
}

async fn connect(conn: &Conn) -> Result<Client> {
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
fn status_error(conn: &Conn, status: &tonic::Status) -> anyhow::Error {
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
        tonic::Code::PermissionDenied => " (reading needs `get` on sandboxes/traffic)",
        _ => "",
    };
    anyhow!(
        "traffic server {server}: {code}: {}{hint}",
        status.message()
    )
}

/// Stored exchanges matching `filter` with their store times, newest first.
async fn query(
    client: &mut Client,
    conn: &Conn,
    filter: Filter,
    limit: u32,
) -> Result<Vec<(Exchange, i64)>> {
    let reply = client
        .query(QueryRequest {
            filter: Some(filter),
            limit,
        })
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PairedOn {
    PathAndQuery,
    Path,
}

struct Pair<'a> {
    sandbox: &'a Exchange,
    baseline: &'a Exchange,
    on: PairedOn,
}

fn workload_key(x: &Exchange) -> (String, String) {
    let w = x.baseline.clone().unwrap_or_default();
    (w.namespace, w.name)
}

fn workload_name(x: &Exchange) -> String {
    let (ns, name) = workload_key(x);
    format!("{ns}/{name}")
}

fn without_query(path: &str) -> &str {
    path.split_once('?').map_or(path, |(p, _)| p)
}

/// Pairs each sandbox exchange with the baseline exchange of the same workload and method
/// closest in time: on the same path and query if there is one, else on the same path. A
/// baseline exchange may serve several sandbox exchanges (one reference request, many tries).
fn pair_exchanges<'a>(
    sandbox: &'a [Exchange],
    baseline: &'a [Exchange],
) -> (Vec<Pair<'a>>, Vec<&'a Exchange>) {
    let mut pairs = Vec::new();
    let mut unpaired = Vec::new();
    for s in sandbox {
        let key = workload_key(s);
        let closest = |same_path: &dyn Fn(&Exchange) -> bool| {
            baseline
                .iter()
                .filter(|b| b.method == s.method && workload_key(b) == key && same_path(b))
                .min_by_key(|b| b.start_unix_micros.abs_diff(s.start_unix_micros))
        };
        let found = closest(&|b| b.path == s.path)
            .map(|b| (b, PairedOn::PathAndQuery))
            .or_else(|| {
                closest(&|b| without_query(&b.path) == without_query(&s.path))
                    .map(|b| (b, PairedOn::Path))
            });
        match found {
            Some((baseline, on)) => pairs.push(Pair {
                sandbox: s,
                baseline,
                on,
            }),
            None => unpaired.push(s),
        }
    }
    (pairs, unpaired)
}

fn unpaired_line(x: &Exchange) -> String {
    format!(
        "no baseline exchange for {} {} (add a virtual workload of {} to a reference sandbox \
         and send the same request with its key)",
        printable(&x.method),
        printable(&x.path),
        workload_name(x)
    )
}

/// One way a sandbox's response differs from the baseline's.
#[derive(Debug, PartialEq)]
struct Difference {
    /// status, header, trailer, bodySize, json, grpc, line or binary.
    kind: &'static str,
    /// Where: a header name, a JSON path, a gRPC message index, a line number (in the side that
    /// has the line), a byte offset; empty for status and bodySize.
    at: String,
    /// What each side has there; None: nothing.
    baseline: Option<Value>,
    sandbox: Option<Value>,
}

impl Difference {
    fn new(kind: &'static str, at: impl ToString, b: Option<Value>, s: Option<Value>) -> Self {
        Difference {
            kind,
            at: at.to_string(),
            baseline: b,
            sandbox: s,
        }
    }

    /// A side it lacks is left out (`null` would be a JSON body's own value).
    fn to_json(&self) -> Value {
        let mut v = json!({"kind": self.kind, "at": self.at});
        for (side, value) in [("baseline", &self.baseline), ("sandbox", &self.sandbox)] {
            if let Some(value) = value {
                v[side] = value.clone();
            }
        }
        v
    }

    fn render(&self) -> String {
        // JSON text: quoted and escaped, so a value cannot drive the terminal.
        let show = |v: &Value| match v {
            Value::String(s) if self.kind == "grpc" => s.clone(),
            v => cap(&v.to_string(), 120),
        };
        let what = match self.kind {
            "status" => "status".to_owned(),
            "bodySize" => "body size".to_owned(),
            "header" | "trailer" => format!("{} {}", self.kind, self.at),
            "grpc" => format!("grpc message {}", self.at),
            "line" => format!("line {}", self.at),
            "binary" => return format!("body: differs from byte {} (binary)", self.at),
            _ => self.at.clone(),
        };
        match (&self.baseline, &self.sandbox) {
            (Some(b), Some(s)) if self.kind == "json" && json_type(b) != json_type(s) => {
                let (bt, st) = (json_type(b), json_type(s));
                format!("{what}: {bt} {} → {st} {}", show(b), show(s))
            }
            (Some(b), Some(s)) => format!("{what}: {} → {}", show(b), show(s)),
            (None, Some(s)) => format!("{what}: added {}", show(s)),
            (Some(b), None) => format!("{what}: removed {}", show(b)),
            (None, None) => what,
        }
    }
}

#[derive(Debug, Default)]
struct Comparison {
    differences: Vec<Difference>,
    notes: Vec<String>,
}

fn compare(baseline: &Exchange, sandbox: &Exchange) -> Comparison {
    let mut c = Comparison::default();
    if baseline.status != sandbox.status {
        let (b, s) = (baseline.status, sandbox.status);
        c.differences.push(Difference::new(
            "status",
            "",
            Some(b.into()),
            Some(s.into()),
        ));
    }
    let (bb, sb) = (body(baseline), body(sandbox));
    // Their lengths are the bodies' business then, with truncation taken into account.
    let skip_length = !bb.data.is_empty() || !sb.data.is_empty();
    let pick = |list: &[Header]| -> Vec<Header> {
        let keep = |h: &&Header| !(skip_length && h.name.eq_ignore_ascii_case("content-length"));
        list.iter().filter(keep).cloned().collect()
    };
    let (bh, sh) = (&baseline.response_headers, &sandbox.response_headers);
    c.differences
        .extend(header_diff(&pick(bh), &pick(sh), "header"));
    let (bt, st) = (&baseline.response_trailers, &sandbox.response_trailers);
    c.differences.extend(header_diff(bt, st, "trailer"));
    let shown = c.differences.len() + MAX_BODY_DIFFERENCES;
    compare_bodies(&bb, &sb, is_grpc(baseline) || is_grpc(sandbox), &mut c);
    if c.differences.len() > shown {
        let more = c.differences.len() - shown;
        c.differences.truncate(shown);
        c.notes
            .push(format!("{more} more body differences not shown"));
    }
    c
}

fn body(x: &Exchange) -> Body {
    x.response_body.clone().unwrap_or_default()
}

fn is_grpc(x: &Exchange) -> bool {
    x.protocol == i32::from(Protocol::Grpc)
        || x.response_headers.iter().any(|h| {
            h.name.eq_ignore_ascii_case("content-type") && h.value.starts_with(b"application/grpc")
        })
}

/// Differences between two header lists, by lowercase name, ignoring [`IGNORED_HEADERS`]; the
/// values of a repeated name are compared joined with ", ".
fn header_diff(baseline: &[Header], sandbox: &[Header], kind: &'static str) -> Vec<Difference> {
    let group = |list: &[Header]| {
        let mut by_name: BTreeMap<String, String> = BTreeMap::new();
        for h in list {
            let name = h.name.to_ascii_lowercase();
            if !IGNORED_HEADERS.contains(&name.as_str()) {
                let joined = by_name.entry(name).or_default();
                if !joined.is_empty() {
                    joined.push_str(", ");
                }
                joined.push_str(&header_text(&h.value));
            }
        }
        by_name
    };
    let (b, s) = (group(baseline), group(sandbox));
    let names: BTreeSet<&String> = b.keys().chain(s.keys()).collect();
    let value =
        |map: &BTreeMap<String, String>, n: &String| map.get(n).map(|v| Value::from(v.as_str()));
    names
        .into_iter()
        .filter(|n| b.get(*n) != s.get(*n))
        .map(|n| Difference::new(kind, n, value(&b, n), value(&s, n)))
        .collect()
}

/// A header value as text: itself when UTF-8, else marked base64.
fn header_text(value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(text) => text.to_owned(),
        Err(_) => format!("<base64 {}>", base64(value)),
    }
}

fn compare_bodies(b: &Body, s: &Body, grpc: bool, c: &mut Comparison) {
    let size = || Difference::new("bodySize", "", Some(b.size.into()), Some(s.size.into()));
    if b.data.is_empty() && s.data.is_empty() {
        if b.size != s.size {
            c.differences.push(size());
        }
        return;
    }
    let truncated = b.truncated || s.truncated;
    let n = if truncated {
        let n = b.data.len().min(s.data.len());
        c.notes.push(format!(
            "the capture truncated a body: compared the first {n} bytes"
        ));
        if b.size != s.size {
            c.differences.push(size());
        }
        n
    } else {
        b.data.len().max(s.data.len())
    };
    let (bd, sd) = (
        &b.data[..n.min(b.data.len())],
        &s.data[..n.min(s.data.len())],
    );
    if bd == sd {
        return;
    }
    if grpc {
        c.differences.extend(grpc_diff(bd, sd));
        return;
    }
    let parse = |d: &[u8]| serde_json::from_slice::<Value>(d).ok();
    if !truncated && let (Some(bj), Some(sj)) = (parse(bd), parse(sd)) {
        json_diff("$", &bj, &sj, &mut c.differences);
        return;
    }
    match (utf8_prefix(bd, truncated), utf8_prefix(sd, truncated)) {
        (Some(bt), Some(st)) => c.differences.extend(text_diff(bt, st)),
        _ => {
            let offset = bd.iter().zip(sd).take_while(|(x, y)| x == y).count();
            c.differences
                .push(Difference::new("binary", offset, None, None));
        }
    }
}

/// The text of `data`, allowing a character cut in two at the end of a truncated capture.
fn utf8_prefix(data: &[u8], truncated: bool) -> Option<&str> {
    match std::str::from_utf8(data) {
        Ok(text) => Some(text),
        Err(e) if truncated && e.error_len().is_none() => {
            std::str::from_utf8(&data[..e.valid_up_to()]).ok()
        }
        Err(_) => None,
    }
}

/// Structural differences from `b` (baseline) to `s` (sandbox); object key order is ignored,
/// array elements are compared index by index.
fn json_diff(path: &str, b: &Value, s: &Value, out: &mut Vec<Difference>) {
    let mut side = |p: String, bv: Option<&Value>, sv: Option<&Value>| match (bv, sv) {
        (Some(bv), Some(sv)) => json_diff(&p, bv, sv, out),
        (bv, sv) => out.push(Difference::new("json", p, bv.cloned(), sv.cloned())),
    };
    match (b, s) {
        (Value::Object(bo), Value::Object(so)) => {
            let keys: BTreeSet<&String> = bo.keys().chain(so.keys()).collect();
            for k in keys {
                side(format!("{path}{}", json_key(k)), bo.get(k), so.get(k));
            }
        }
        (Value::Array(ba), Value::Array(sa)) => {
            for i in 0..ba.len().max(sa.len()) {
                side(format!("{path}[{i}]"), ba.get(i), sa.get(i));
            }
        }
        _ if b != s => {
            let d = Difference::new("json", path, Some(b.clone()), Some(s.clone()));
            out.push(d);
        }
        _ => {}
    }
}

/// `.name`, or `["a key"]` for a key that is not an identifier.
fn json_key(key: &str) -> String {
    let mut chars = key.chars();
    let ident = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ident {
        format!(".{key}")
    } else {
        format!("[{}]", Value::from(key))
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// One length-prefixed gRPC message: flag byte, 4-byte big-endian length, bytes.
#[derive(Debug, PartialEq)]
struct GrpcFrame<'a> {
    compressed: bool,
    len: u32,
    /// Shorter than `len` when the capture cut the message short.
    data: &'a [u8],
}

/// The messages in a gRPC body, and how many bytes at its end are too few for a frame header.
fn grpc_frames(mut body: &[u8]) -> (Vec<GrpcFrame<'_>>, usize) {
    let mut frames = Vec::new();
    while let Some((&[flag, l0, l1, l2, l3], rest)) = body.split_first_chunk::<5>() {
        let len = u32::from_be_bytes([l0, l1, l2, l3]);
        let n = rest.len().min(len as usize);
        let data = &rest[..n];
        frames.push(GrpcFrame {
            compressed: flag & 1 == 1,
            len,
            data,
        });
        body = &rest[n..];
    }
    (frames, body.len())
}

fn describe_frame(f: &GrpcFrame<'_>) -> Value {
    let mut out = format!("{} bytes", f.len);
    if f.compressed {
        out.push_str(", compressed");
    }
    if f.data.len() < f.len as usize {
        out.push_str(&format!(", {} captured", f.data.len()));
    }
    Value::from(format!("{out}: {}", hex(f.data, 32)))
}

/// Message by message; a message cut short by the capture is compared on what both hold.
fn grpc_diff(b: &[u8], s: &[u8]) -> Vec<Difference> {
    let ((bf, b_rest), (sf, s_rest)) = (grpc_frames(b), grpc_frames(s));
    let mut out = Vec::new();
    for i in 0..bf.len().max(sf.len()) {
        let (bm, sm) = (bf.get(i), sf.get(i));
        if let (Some(x), Some(y)) = (bm, sm) {
            let n = x.data.len().min(y.data.len());
            if x.compressed == y.compressed && x.len == y.len && x.data[..n] == y.data[..n] {
                continue;
            }
        }
        out.push(Difference::new(
            "grpc",
            i,
            bm.map(describe_frame),
            sm.map(describe_frame),
        ));
    }
    if out.is_empty() && b_rest != s_rest {
        // Only the few bytes after the last whole frame header differ.
        let offset = b.iter().zip(s).take_while(|(x, y)| x == y).count();
        out.push(Difference::new("binary", offset, None, None));
    }
    out
}

/// Lines only one side has, from a longest common subsequence; past a size where its table
/// would be too large, every line from the first difference to the last.
fn text_diff(b: &str, s: &str) -> Vec<Difference> {
    let (bl, sl): (Vec<&str>, Vec<&str>) = (b.lines().collect(), s.lines().collect());
    let head = bl.iter().zip(&sl).take_while(|(x, y)| x == y).count();
    let (bl, sl) = (&bl[head..], &sl[head..]);
    let tail = bl
        .iter()
        .rev()
        .zip(sl.iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let (bm, sm) = (&bl[..bl.len() - tail], &sl[..sl.len() - tail]);
    let removed = |i: usize| Difference::new("line", head + i + 1, Some(bm[i].into()), None);
    let added = |j: usize| Difference::new("line", head + j + 1, None, Some(sm[j].into()));
    if bm.len().saturating_mul(sm.len()) > 4_000_000 {
        return (0..bm.len())
            .map(removed)
            .chain((0..sm.len()).map(added))
            .collect();
    }
    // lcs[i * w + j]: the longest common subsequence of bm[i..] and sm[j..].
    let w = sm.len() + 1;
    let mut lcs = vec![0u32; (bm.len() + 1) * w];
    for i in (0..bm.len()).rev() {
        for j in (0..sm.len()).rev() {
            lcs[i * w + j] = if bm[i] == sm[j] {
                lcs[(i + 1) * w + j + 1] + 1
            } else {
                lcs[(i + 1) * w + j].max(lcs[i * w + j + 1])
            };
        }
    }
    let (mut out, mut i, mut j) = (Vec::new(), 0, 0);
    while i < bm.len() || j < sm.len() {
        if i < bm.len() && j < sm.len() && bm[i] == sm[j] {
            (i, j) = (i + 1, j + 1);
        } else if j == sm.len() || (i < bm.len() && lcs[(i + 1) * w + j] >= lcs[i * w + j + 1]) {
            out.push(removed(i));
            i += 1;
        } else {
            out.push(added(j));
            j += 1;
        }
    }
    out
}

// === rendering ===

fn render_pair(out: &mut String, p: &Pair<'_>, c: &Comparison) {
    use std::fmt::Write as _;
    let (b, s) = (p.baseline, p.sandbox);
    let from = if b.sandbox.is_empty() {
        "-"
    } else {
        &b.sandbox
    };
    let mark = if c.differences.is_empty() { '=' } else { '≠' };
    let _ = writeln!(
        out,
        "{mark} {} {}  {}  baseline {} ({from}) → sandbox {}",
        printable(&s.method),
        printable(&s.path),
        workload_name(s),
        rfc3339(b.start_unix_micros),
        rfc3339(s.start_unix_micros),
    );
    if p.on == PairedOn::Path {
        let path = printable(&b.path);
        let _ = writeln!(
            out,
            "    (paired on the path only: the baseline's was {path})"
        );
    }
    for d in &c.differences {
        let _ = writeln!(out, "    {}", d.render());
    }
    for n in &c.notes {
        let _ = writeln!(out, "    ({n})");
    }
}

fn pair_json(p: &Pair<'_>, c: &Comparison) -> Value {
    let side = |x: &Exchange| {
        json!({"id": x.id, "time": rfc3339(x.start_unix_micros), "sandbox": x.sandbox,
               "destination": x.destination, "path": x.path})
    };
    let on = match p.on {
        PairedOn::PathAndQuery => "pathAndQuery",
        PairedOn::Path => "path",
    };
    let differences: Vec<Value> = c.differences.iter().map(Difference::to_json).collect();
    json!({
        "workload": workload_name(p.sandbox),
        "method": p.sandbox.method,
        "path": p.sandbox.path,
        "pairedOn": on,
        "sandboxExchange": side(p.sandbox),
        "baselineExchange": side(p.baseline),
        "differences": differences,
        "notes": c.notes,
    })
}

/// One `tail`/`query` line.
fn exchange_line(x: &Exchange) -> String {
    let routed = if x.destination.is_empty() {
        "baseline"
    } else {
        &x.destination
    };
    let status = match x.status {
        0 => "-".to_owned(),
        n => n.to_string(),
    };
    let mut line = format!(
        "{}  {}  {routed}  {} {}  {status}  {:.1}ms  {}B",
        rfc3339(x.start_unix_micros),
        x.sandbox,
        printable(&x.method),
        printable(&x.path),
        x.duration_micros as f64 / 1000.0,
        body(x).size,
    );
    if !x.error.is_empty() {
        line = format!("{line}  error: {}", printable(&x.error));
    }
    line
}

/// The `--json` shape of an exchange (documented on `spur traffic query --help`).
fn exchange_json(x: &Exchange, stored_unix_micros: i64) -> Value {
    let w = x.baseline.clone().unwrap_or_default();
    let protocol = match Protocol::try_from(x.protocol) {
        Ok(Protocol::Http1) => "http1",
        Ok(Protocol::Http2) => "http2",
        Ok(Protocol::Grpc) => "grpc",
        Ok(Protocol::Websocket) => "websocket",
        _ => "unspecified",
    };
    let error = (!x.error.is_empty()).then_some(&x.error);
    json!({
        "id": x.id,
        "time": rfc3339(x.start_unix_micros),
        "startUnixMicros": x.start_unix_micros,
        "storedUnixMicros": stored_unix_micros,
        "sandbox": x.sandbox,
        "routingKey": x.routing_key,
        "baseline": {"kind": w.kind, "namespace": w.namespace, "name": w.name},
        "pod": x.pod,
        "routed": if x.destination.is_empty() { "baseline" } else { "sandbox" },
        "destination": x.destination,
        "protocol": protocol,
        "method": x.method,
        "path": x.path,
        "authority": x.authority,
        "status": x.status,
        "responseMicros": x.response_micros,
        "durationMicros": x.duration_micros,
        "error": error,
        "requestHeaders": headers_json(&x.request_headers),
        "responseHeaders": headers_json(&x.response_headers),
        "responseTrailers": headers_json(&x.response_trailers),
        "requestBody": body_json(x.request_body.clone().unwrap_or_default()),
        "responseBody": body_json(body(x)),
    })
}

fn headers_json(headers: &[Header]) -> Value {
    headers
        .iter()
        .map(|h| match std::str::from_utf8(&h.value) {
            Ok(v) => json!([h.name, v]),
            Err(_) => json!([h.name, base64(&h.value), "base64"]),
        })
        .collect()
}

fn body_json(b: Body) -> Value {
    let (encoding, data) = match String::from_utf8(b.data) {
        Ok(text) => ("utf8", text),
        Err(e) => ("base64", base64(e.as_bytes())),
    };
    json!({"size": b.size, "truncated": b.truncated, "encoding": encoding, "data": data})
}

/// Control characters escaped: paths and headers come from whoever sent the request, and
/// must not drive the reader's terminal.
fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

fn cap(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_owned(),
    }
}

fn hex(data: &[u8], max: usize) -> String {
    let mut out: String = data.iter().take(max).map(|b| format!("{b:02x}")).collect();
    if data.len() > max {
        out.push('…');
    }
    out
}

/// Standard base64 with padding (no crate for twenty lines).
fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let byte = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = byte(0) << 16 | byte(1) << 8 | byte(2);
        for i in 0..4 {
            let sextet = (n >> (18 - 6 * i)) as usize & 63;
            // One byte makes two characters, two make three; `=` pads to four.
            out.push(if i <= chunk.len() {
                char::from(ALPHABET[sextet])
            } else {
                '='
            });
        }
    }
    out
}

/// RFC 3339 in UTC with milliseconds (days to civil date: Howard Hinnant's algorithm).
fn rfc3339(unix_micros: i64) -> String {
    let secs = unix_micros.div_euclid(1_000_000);
    let millis = unix_micros.rem_euclid(1_000_000) / 1000;
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let (era, doe) = (z.div_euclid(146_097), z.rem_euclid(146_097));
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = (sod / 3600, sod % 3600 / 60, sod % 60);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{millis:03}Z")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use spur_proto::traffic::Workload;

    fn exchange(workload: &str, method: &str, path: &str, start: i64) -> Exchange {
        Exchange {
            id: format!("{workload}{method}{path}@{start}"),
            baseline: Some(Workload {
                kind: "Deployment".into(),
                namespace: "default".into(),
                name: workload.into(),
            }),
            method: method.into(),
            path: path.into(),
            start_unix_micros: start,
            status: 200,
            ..Exchange::default()
        }
    }

    fn header(name: &str, value: &[u8]) -> Header {
        Header {
            name: name.into(),
            value: value.to_vec(),
        }
    }

    fn rendered(differences: &[Difference]) -> Vec<String> {
        differences.iter().map(Difference::render).collect()
    }

    #[test]
    fn json_diff_nested_arrays_and_types() {
        let b = json!({"a": 1, "items": [{"name": "a"}, {"name": "x"}], "gone": true,
                       "o": {"k": "v"}, "a key": 1});
        let s = json!({"o": {"k": "v"}, "items": [{"name": "b"}, {"name": "x"}, 3], "a": "1",
                       "new": null, "a key": 2});
        let mut out = Vec::new();
        json_diff("$", &b, &s, &mut out);
        assert_eq!(
            rendered(&out),
            [
                r#"$.a: number 1 → string "1""#,
                r#"$["a key"]: 1 → 2"#,
                "$.gone: removed true",
                r#"$.items[0].name: "a" → "b""#,
                "$.items[2]: added 3",
                "$.new: added null",
            ]
        );
        // An added null keeps its side; the missing side is left out.
        assert_eq!(
            out[5].to_json(),
            json!({"kind": "json", "at": "$.new", "sandbox": null})
        );
    }

    #[test]
    fn json_diff_ignores_key_order() {
        let b: Value = serde_json::from_str(r#"{"a": {"x": 1, "y": [1, 2]}, "b": 2}"#).unwrap();
        let s: Value = serde_json::from_str(r#"{"b": 2, "a": {"y": [1, 2], "x": 1}}"#).unwrap();
        let mut out = Vec::new();
        json_diff("$", &b, &s, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    fn frame(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend((message.len() as u32).to_be_bytes());
        out.extend(message);
        out
    }

    #[test]
    fn grpc_frames_whole_cut_and_compressed() {
        let mut body = frame(0, b"\x0a\x01a");
        body.extend(frame(1, b"zz"));
        body.extend(frame(0, b"0123456789"));
        body.truncate(body.len() - 4);
        let (frames, rest) = grpc_frames(&body);
        assert_eq!(rest, 0);
        assert_eq!(
            frames,
            [
                GrpcFrame {
                    compressed: false,
                    len: 3,
                    data: b"\x0a\x01a"
                },
                GrpcFrame {
                    compressed: true,
                    len: 2,
                    data: b"zz"
                },
                GrpcFrame {
                    compressed: false,
                    len: 10,
                    data: b"012345"
                },
            ]
        );
        assert_eq!(
            describe_frame(&frames[2]),
            "10 bytes, 6 captured: 303132333435"
        );
        assert_eq!(describe_frame(&frames[1]), "2 bytes, compressed: 7a7a");
        // A header cut short is left over, not a frame.
        assert_eq!(grpc_frames(&[0, 0, 0]), (vec![], 3));
    }

    #[test]
    fn grpc_diff_message_by_message() {
        let b = [frame(0, b"same"), frame(0, b"old"), frame(0, b"x")].concat();
        let s = [frame(0, b"same"), frame(0, b"new")].concat();
        assert_eq!(
            rendered(&grpc_diff(&b, &s)),
            [
                "grpc message 1: 3 bytes: 6f6c64 → 3 bytes: 6e6577",
                "grpc message 2: removed 1 bytes: 78",
            ]
        );
    }

    #[test]
    fn truncated_bodies_compare_the_shorter_prefix() {
        let b = [frame(0, b"same"), frame(0, b"0123456789")].concat();
        let s = [frame(0, b"same"), frame(0, b"0123456789abcdef")].concat();
        let body = |data: &[u8], size: usize| Body {
            size: size as u64,
            data: data[..data.len().min(19)].to_vec(),
            truncated: data.len() > 19,
        };
        let mut c = Comparison::default();
        compare_bodies(&body(&b, b.len()), &body(&s, s.len()), true, &mut c);
        // The cut second message agrees as far as both were captured; only the lengths differ.
        assert_eq!(
            rendered(&c.differences),
            [
                "body size: 24 → 30",
                "grpc message 1: 10 bytes, 5 captured: 3031323334 → 16 bytes, 5 captured: 3031323334"
            ]
        );
        assert_eq!(
            c.notes,
            ["the capture truncated a body: compared the first 19 bytes"]
        );
    }

    #[test]
    fn pairs_closest_in_time_then_without_query() {
        let baseline = [
            exchange("api", "GET", "/items?page=1", 100),
            exchange("api", "GET", "/items?page=1", 900),
            exchange("api", "GET", "/items?page=2", 1000),
            exchange("api", "POST", "/orders", 1000),
            exchange("web", "GET", "/about", 1000),
        ];
        let sandbox = [
            exchange("api", "GET", "/items?page=1", 1000),
            exchange("api", "GET", "/items?page=3", 1000),
            exchange("api", "GET", "/orders", 1000),
            exchange("api", "GET", "/about", 1000),
        ];
        let (pairs, unpaired) = pair_exchanges(&sandbox, &baseline);
        let got: Vec<_> = pairs
            .iter()
            .map(|p| (p.baseline.id.as_str(), p.on))
            .collect();
        assert_eq!(
            got,
            [
                ("apiGET/items?page=1@900", PairedOn::PathAndQuery),
                ("apiGET/items?page=2@1000", PairedOn::Path),
            ]
        );
        let unpaired: Vec<_> = unpaired.iter().map(|x| x.path.as_str()).collect();
        assert_eq!(unpaired, ["/orders", "/about"]);
        assert_eq!(
            unpaired_line(&sandbox[2]),
            "no baseline exchange for GET /orders (add a virtual workload of default/api to a \
             reference sandbox and send the same request with its key)"
        );
    }

    #[test]
    fn header_diff_ignores_volatile_headers() {
        let mut b = exchange("api", "GET", "/", 0);
        let mut s = b.clone();
        b.response_headers = vec![
            header("Date", b"Mon, 01 Jan 2024 00:00:00 GMT"),
            header("x-request-id", b"1"),
            header("content-length", b"2"),
            header("content-type", b"application/json"),
            header("vary", b"a"),
            header("vary", b"b"),
        ];
        s.response_headers = vec![
            header("date", b"Tue, 02 Jan 2024 00:00:00 GMT"),
            header("X-Request-Id", b"2"),
            header("content-length", b"3"),
            header("content-type", b"text/plain"),
            header("vary", b"a, b"),
            header("x-new", b"\xff\x00"),
        ];
        b.response_trailers = vec![header("grpc-status", b"0")];
        s.response_trailers = vec![header("grpc-status", b"13")];
        b.response_body = Some(Body {
            size: 2,
            data: b"{}".to_vec(),
            truncated: false,
        });
        s.response_body = Some(Body {
            size: 3,
            data: b"{ }".to_vec(),
            truncated: false,
        });
        let c = compare(&b, &s);
        assert_eq!(
            rendered(&c.differences),
            [
                r#"header content-type: "application/json" → "text/plain""#,
                r#"header x-new: added "<base64 /wA=>""#,
                r#"trailer grpc-status: "0" → "13""#,
            ]
        );
        // Without captured bodies, content-length is all there is to compare.
        b.response_body = Some(Body {
            size: 2,
            data: vec![],
            truncated: true,
        });
        s.response_body = Some(Body {
            size: 3,
            data: vec![],
            truncated: true,
        });
        let c = compare(&b, &s);
        assert_eq!(
            c.differences[0].render(),
            r#"header content-length: "2" → "3""#
        );
        assert_eq!(
            c.differences.last().map(Difference::render).as_deref(),
            Some("body size: 2 → 3")
        );
    }

    #[test]
    fn non_utf8_header_values_are_marked() {
        let headers = [
            header("x-bin", b"\x80abc"),
            header("x-text", b"caf\xc3\xa9"),
        ];
        assert_eq!(
            headers_json(&headers),
            json!([["x-bin", "gGFiYw==", "base64"], ["x-text", "café"]])
        );
        assert_eq!(header_text(b"\x80abc"), "<base64 gGFiYw==>");
        let body = Body {
            size: 2,
            data: vec![0xff, 0x01],
            truncated: false,
        };
        assert_eq!(body_json(body)["encoding"], "base64");
    }

    #[test]
    fn text_diff_lines() {
        let b = "a\nb\nc\nd\n";
        let s = "a\nc\nX\nd\n";
        assert_eq!(
            rendered(&text_diff(b, s)),
            [r#"line 2: removed "b""#, r#"line 3: added "X""#]
        );
        let mut c = Comparison::default();
        let body = |t: &str| Body {
            size: t.len() as u64,
            data: t.into(),
            truncated: false,
        };
        compare_bodies(&body("x\u{1b}[2J"), &body("y"), false, &mut c);
        assert_eq!(
            rendered(&c.differences)[0],
            r#"line 1: removed "x\u001b[2J""#
        );
    }

    #[test]
    fn encodings() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_700_000_000_123_456), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339(951_782_400_000_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(printable("/a\nb"), "/a\\nb");
    }

    #[test]
    fn exchange_line_and_json() {
        let mut x = exchange("api", "GET", "/items", 1_700_000_000_000_000);
        x.sandbox = "sb".into();
        x.destination = "10.0.0.7:8080".into();
        x.duration_micros = 12_345;
        x.response_body = Some(Body {
            size: 42,
            data: b"ok".to_vec(),
            truncated: true,
        });
        assert_eq!(
            exchange_line(&x),
            "2023-11-14T22:13:20.000Z  sb  10.0.0.7:8080  GET /items  200  12.3ms  42B"
        );
        let j = exchange_json(&x, 7);
        assert_eq!(j["routed"], "sandbox");
        assert_eq!(j["error"], Value::Null);
        assert_eq!(
            j["responseBody"],
            json!({"size": 42, "truncated": true, "encoding": "utf8", "data": "ok"})
        );
    }

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
