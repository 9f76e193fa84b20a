//! `spur demo app`: a small instrumented-looking service for end-to-end tests. It answers every
//! GET with JSON naming itself (service, pod, marker) and, when told an upstream with `--call`,
//! calls that upstream and nests its answer, propagating the request's routing-context headers
//! (W3C `baggage`/`tracestate`/`traceparent`, the OpenTracing/Jaeger routing-key headers,
//! `x-request-id`) the way an OpenTelemetry-instrumented app does. That propagation is what lets
//! Spur route every hop of a keyed request to the sandbox's forks.
//!
//! With `--database-url` (`SPUR_APP_DATABASE_URL`, a libpq URL such as
//! `postgres://user:password@host:5432/db`) it also keeps rows in PostgreSQL, in table
//! `spur_demo_rows` (created at first use), so a test can see which database a fork writes to:
//!
//! - `POST /rows` with a UTF-8 body of at most 4 KiB (else 400) stores the body as a row written
//!   by the pod (the service name when the pod is unknown) and answers 201 with
//!   `{service, pod, marker, database, id, value}`; `database` is `current_database()`.
//! - `GET /rows` answers `{service, pod, marker, database, rows}`: the latest 100 rows, newest
//!   first, each `{id, value, written_by, at}` (`at` in RFC 3339, UTC).
//! - A database that cannot be reached or fails is a 503 with `{..., error}`; the connection is
//!   made on first use and again after it breaks. Logs and answers name the URL without its
//!   password.
//!
//! `/rows` is then never forwarded to `--call`'s upstream; every other path behaves as without the
//! flag.
//!
//! With `--kafka HOST:PORT --kafka-topic T` (`SPUR_APP_KAFKA`, `SPUR_APP_KAFKA_TOPIC`) it is also
//! a producer, as an event-driven service is: `POST /records` writes one record to `T` per
//! request, value `<service>-<pod>-<n>`, with the request's routing-context headers (the ones
//! `--call` propagates) as record headers, the way OpenTelemetry's Kafka instrumentation carries
//! a request's context into the records it causes; so a keyed request's record reaches the
//! sandbox's fork of the consumer (docs/async.md). It answers 201 with `{service, pod, marker,
//! record, partition, offset}`, or 503 with `{..., error}` when the broker did not take the
//! record. `/records` is never forwarded to `--call`'s upstream.
//!
//! `GET /catalog` answers a small shop's catalog with a fresh request id and time (module
//! `catalog`; `--drop-field` to lose a field), and `--grpc-listen` serves the demo gRPC service
//! beside HTTP (`--grpc-unavailable` to fail every call): the services of the smart-test
//! acceptance on the node (tests/tests/node_smarttests).

mod catalog;
mod rows;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use clap::Args;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Empty, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use spur_demo_apps::CancellationToken;
use spur_runtime::{Drain, shutdown_signal};
use tokio::net::TcpListener;

/// Bound on the whole upstream call (connect, request, response body).
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on the upstream's response body.
const UPSTREAM_BODY_LIMIT: usize = 1 << 20;
/// How long a drain may take after SIGTERM before the remaining connections are dropped.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(20);

/// Routing-context headers copied from the incoming request to the upstream call, every line,
/// unchanged: the W3C trace context, every carrier of docs/routing-keys.md (the OpenTracing and
/// Jaeger ones, and its custom-header example `x-sandbox-key`) and the request id.
fn propagated() -> impl Iterator<Item = &'static str> {
    ["baggage", "tracestate", "traceparent"]
        .into_iter()
        .chain(spur_routing::extract::LEGACY_HEADERS)
        .chain(["x-sandbox-key", "x-request-id"])
}

#[derive(Args)]
pub(crate) struct AppArgs {
    /// The service name the app answers with ("service" in its JSON).
    #[arg(long, env = "SPUR_APP_NAME")]
    name: String,
    /// Address to serve HTTP/1.1 and h2c on.
    #[arg(long, env = "SPUR_APP_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Upstream to call for each request (http:// only). The incoming path and query are
    /// appended to this URL's path; the answer is nested as "upstream".
    #[arg(long, env = "SPUR_APP_CALL")]
    call: Option<String>,
    /// Free-form marker reported as "marker" (e.g. `v2`, set by a fork's changed env).
    #[arg(long, env = "SPUR_APP_MARKER")]
    marker: Option<String>,
    /// Further headers to propagate to the upstream (e.g. a configured custom routing-key
    /// header), comma-separated.
    #[arg(long, env = "SPUR_APP_PROPAGATE", value_delimiter = ',')]
    propagate: Vec<String>,
    /// Headers NOT to propagate, comma-separated: the app then behaves as one whose framework
    /// forwards the trace context but loses `baggage` (`--no-propagate baggage`), for showing
    /// what `spur doctor propagation` finds.
    #[arg(long, env = "SPUR_APP_NO_PROPAGATE", value_delimiter = ',')]
    no_propagate: Vec<String>,
    /// PostgreSQL to keep rows in, a libpq URL (`postgres://user:password@host:5432/db`): adds
    /// `POST /rows` and `GET /rows`. Connected on first use; never logged with its password.
    #[arg(long, env = "SPUR_APP_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Kafka broker to write records to (HOST:PORT, resolved at start): adds `POST /records`.
    #[arg(long, env = "SPUR_APP_KAFKA", requires = "kafka_topic")]
    kafka: Option<String>,
    /// The topic `POST /records` writes to (it must exist).
    #[arg(long, env = "SPUR_APP_KAFKA_TOPIC", requires = "kafka")]
    kafka_topic: Option<String>,
    /// A field `GET /catalog`'s items lack (as a build that lost it would).
    #[arg(long, env = "SPUR_APP_DROP_FIELD")]
    drop_field: Option<String>,
    /// Also serve the demo gRPC service `spur.demo.v1.Demo` (h2c) on this address, answering as
    /// the service (`--name`), not the pod, with gRPC server reflection (`grpcurl -plaintext`).
    #[arg(long, env = "SPUR_APP_GRPC_LISTEN")]
    grpc_listen: Option<SocketAddr>,
    /// Every gRPC call fails with UNAVAILABLE (a broken build, for smart tests to find).
    #[arg(long, env = "SPUR_APP_GRPC_UNAVAILABLE", default_value_t = false)]
    grpc_unavailable: bool,
}

/// What one app instance is.
pub(crate) struct App {
    name: String,
    pod: String,
    marker: Option<String>,
    upstream: Option<Upstream>,
    propagate: Vec<HeaderName>,
    database: Option<rows::Database>,
    /// `POST /records`, with the records written so far (for their values).
    producer: Option<(
        spur_demo_apps::kafka::Producer,
        std::sync::atomic::AtomicU64,
    )>,
    /// The field `GET /catalog`'s items lack.
    drop_field: Option<String>,
}

struct Upstream {
    base: Uri,
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl App {
    pub(crate) fn new(
        name: String,
        pod: String,
        marker: Option<String>,
        call: Option<&str>,
        extra_propagate: &[String],
        database_url: Option<&str>,
    ) -> Result<App> {
        if name.is_empty() {
            bail!("--name (SPUR_APP_NAME) must not be empty");
        }
        let upstream = call.map(Upstream::new).transpose()?;
        let mut propagate = propagated()
            .map(HeaderName::from_static)
            .collect::<Vec<_>>();
        for h in extra_propagate
            .iter()
            .map(|h| h.trim())
            .filter(|h| !h.is_empty())
        {
            let h = HeaderName::try_from(h)
                .with_context(|| format!("--propagate: {h:?} is not a header name"))?;
            if !propagate.contains(&h) {
                propagate.push(h);
            }
        }
        let database = database_url.map(rows::Database::new).transpose()?;
        Ok(App {
            name,
            pod,
            marker,
            upstream,
            propagate,
            database,
            producer: None,
            drop_field: None,
        })
    }

    /// `GET /catalog`'s items lack `field`.
    pub(crate) fn dropping_field(mut self, field: Option<String>) -> App {
        self.drop_field = field;
        self
    }

    /// Stops propagating `names` (any case; empty entries are ignored).
    pub(crate) fn dropping(mut self, names: &[String]) -> Result<App> {
        for n in names.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
            let h = HeaderName::try_from(n)
                .with_context(|| format!("--no-propagate: {n:?} is not a header name"))?;
            self.propagate.retain(|p| *p != h);
        }
        Ok(self)
    }

    /// Adds `POST /records`, writing with `producer`.
    pub(crate) fn with_producer(
        mut self,
        producer: Option<spur_demo_apps::kafka::Producer>,
    ) -> App {
        self.producer = producer.map(|p| (p, std::sync::atomic::AtomicU64::new(0)));
        self
    }

    /// The JSON every answer starts with: who answered.
    fn identity(&self) -> Value {
        json!({
            "service": self.name,
            "pod": self.pod,
            "marker": self.marker,
        })
    }
}

impl Upstream {
    fn new(call: &str) -> Result<Upstream> {
        let base: Uri = call
            .parse()
            .with_context(|| format!("--call {call:?} is not a URL"))?;
        if base.scheme_str() != Some("http") {
            bail!("--call {call:?} must be an http:// URL");
        }
        if base.authority().is_none() {
            bail!("--call {call:?} has no host");
        }
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(UPSTREAM_TIMEOUT));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Upstream { base, client })
    }

    /// The call URL with the incoming path appended to its path, and both queries joined.
    fn uri_for(&self, incoming: &Uri) -> Result<Uri> {
        let mut path_and_query = format!(
            "{}{}",
            self.base.path().trim_end_matches('/'),
            incoming.path()
        );
        if path_and_query.is_empty() {
            path_and_query.push('/');
        }
        let queries: Vec<&str> = [self.base.query(), incoming.query()]
            .into_iter()
            .flatten()
            .filter(|q| !q.is_empty())
            .collect();
        if !queries.is_empty() {
            path_and_query.push('?');
            path_and_query.push_str(&queries.join("&"));
        }
        let mut parts = self.base.clone().into_parts();
        parts.path_and_query = Some(
            path_and_query
                .parse()
                .with_context(|| format!("invalid upstream path {path_and_query:?}"))?,
        );
        Uri::from_parts(parts).context("invalid upstream URL")
    }
}

pub(crate) async fn run(args: AppArgs) -> Result<ExitCode> {
    let non_empty = |v: Option<String>| v.filter(|s| !s.is_empty());
    let pod = non_empty(std::env::var("POD_NAME").ok())
        .or_else(|| non_empty(std::env::var("HOSTNAME").ok()))
        .unwrap_or_default();
    let call = non_empty(args.call);
    let database_url = non_empty(args.database_url);
    let app = App::new(
        args.name,
        pod,
        non_empty(args.marker),
        call.as_deref(),
        &args.propagate,
        database_url.as_deref(),
    )?
    .dropping(&args.no_propagate)?;
    let producer = match (non_empty(args.kafka), non_empty(args.kafka_topic)) {
        (Some(broker), Some(topic)) => {
            let addr = tokio::net::lookup_host(broker.as_str())
                .await
                .with_context(|| format!("--kafka {broker:?}: not a HOST:PORT that resolves"))?
                .next()
                .with_context(|| format!("--kafka {broker:?}: resolves to no address"))?;
            Some((
                spur_demo_apps::kafka::Producer::new(addr, &topic),
                broker,
                topic,
            ))
        }
        (None, None) => None,
        _ => bail!("--kafka and --kafka-topic go together"),
    };
    let kafka = producer.as_ref().map(|(_, b, t)| format!("{t} on {b}"));
    let app = app
        .with_producer(producer.map(|(p, ..)| p))
        .dropping_field(non_empty(args.drop_field));
    let grpc_name = app.name.clone();
    let database = app.database.as_ref().map(|d| d.redacted().to_owned());
    // Before the listener opens: a SIGTERM from then on shuts down cleanly.
    let shutdown = shutdown_signal();
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot bind {}", args.listen))?;
    let grpc_listener = match args.grpc_listen {
        Some(addr) => Some((
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot bind {addr} (--grpc-listen)"))?,
            addr,
        )),
        None => None,
    };
    let token = CancellationToken::new();
    let server = tokio::spawn(serve(listener, Arc::new(app), token.clone()));
    let mut serving = format!("serving on {}", args.listen);
    let grpc = grpc_listener.map(|(listener, addr)| {
        serving.push_str(&format!(" (gRPC on {addr}"));
        if args.grpc_unavailable {
            serving.push_str(", every call UNAVAILABLE");
        }
        serving.push(')');
        let behaviour = spur_demo_apps::GrpcBehaviour {
            unavailable: args.grpc_unavailable,
        };
        tokio::spawn(spur_demo_apps::serve_grpc_with(
            listener,
            grpc_name,
            behaviour,
            token.clone(),
        ))
    });
    if let Some(call) = &call {
        serving.push_str(&format!(" (calling {call})"));
    }
    if let Some(database) = &database {
        serving.push_str(&format!(" (rows in {database})"));
    }
    if let Some(kafka) = &kafka {
        serving.push_str(&format!(" (records to {kafka})"));
    }
    println!("{serving}");
    shutdown.await;
    token.cancel();
    server.await.context("server task failed")?;
    if let Some(grpc) = grpc {
        grpc.await
            .context("gRPC server task failed")?
            .context("the gRPC server failed")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Serves HTTP/1.1 and h2c until `shutdown` is cancelled, then stops accepting, lets in-flight
/// requests finish (idle connections close at once) and returns once every connection is gone
/// or after [`DRAIN_TIMEOUT`].
pub(crate) async fn serve(listener: TcpListener, app: Arc<App>, shutdown: CancellationToken) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    let drain = Drain::under(&shutdown);
    while let Some((stream, peer)) = spur_demo_apps::accept(&listener, &shutdown).await {
        let builder = builder.clone();
        let app = app.clone();
        let conn_drain = drain.clone();
        drain.spawn(async move {
            let svc = hyper::service::service_fn(move |req| handle(req, app.clone()));
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            let res = conn_drain
                .run_graceful(conn, |c| c.graceful_shutdown())
                .await;
            if let Err(e) = res {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let left = drain.wait(DRAIN_TIMEOUT).await;
    if left > 0 {
        tracing::warn!(
            connections = left,
            "drain timed out; dropping the remaining connections"
        );
    }
}

async fn handle(
    req: Request<Incoming>,
    app: Arc<App>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let head = req.method() == Method::HEAD;
    let resp = respond(req, app).await?;
    if !head {
        return Ok(resp);
    }
    // HEAD gets GET's head without the body (RFC 9110 §9.3.2); hyper's HTTP/2 server would
    // send the body anyway, and a conforming client (the sidecar's) refuses that.
    let (mut parts, body) = resp.into_parts();
    let len = hyper::body::Body::size_hint(&body).exact().unwrap_or(0);
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    Ok(Response::from_parts(parts, Full::new(Bytes::new())))
}

async fn respond(
    req: Request<Incoming>,
    app: Arc<App>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.uri().path() == "/rows"
        && let Some(database) = &app.database
    {
        return Ok(respond_rows(req, &app, database).await);
    }
    if req.uri().path() == "/records"
        && let Some((producer, written)) = &app.producer
    {
        return Ok(respond_record(&req, &app, producer, written).await);
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut resp = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "only GET\n",
        );
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Ok(resp);
    }
    if req.uri().path() == "/healthz" {
        return Ok(reply(StatusCode::OK, "text/plain; charset=utf-8", "ok"));
    }
    if req.uri().path() == "/catalog" {
        return Ok(catalog::respond(&req, &app).await);
    }
    let baggage = joined(req.headers(), "baggage");
    let mut doc = json!({
        "service": app.name,
        "pod": app.pod,
        "marker": app.marker,
        "baggage": baggage,
    });
    // The `--propagate` headers as received (a configured custom routing-key header, say), so
    // a caller can see what reached the app in them.
    let extra: serde_json::Map<String, Value> = app
        .propagate
        .iter()
        .filter(|h| !propagated().any(|p| p == h.as_str()))
        .filter_map(|h| Some((h.to_string(), json!(joined(req.headers(), h.as_str())?))))
        .collect();
    if !extra.is_empty() {
        doc["headers"] = Value::Object(extra);
    }
    let status = match &app.upstream {
        None => {
            doc["upstream"] = Value::Null;
            StatusCode::OK
        }
        Some(upstream) => match call_upstream(upstream, &app.propagate, &req).await {
            Ok(answer) => {
                doc["upstream"] = answer;
                StatusCode::OK
            }
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "upstream call failed");
                doc = json!({
                    "service": app.name,
                    "pod": app.pod,
                    "marker": app.marker,
                    "baggage": baggage,
                    "error": format!("{e:#}"),
                });
                StatusCode::BAD_GATEWAY
            }
        },
    };
    let mut body = doc.to_string();
    body.push('\n');
    Ok(reply(status, "application/json", body))
}

/// `/records` with a producer: one record per `POST`.
async fn respond_record(
    req: &Request<Incoming>,
    app: &App,
    producer: &spur_demo_apps::kafka::Producer,
    written: &std::sync::atomic::AtomicU64,
) -> Response<Full<Bytes>> {
    if req.method() != Method::POST {
        let mut resp = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "only POST\n",
        );
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return resp;
    }
    let n = written.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    let who = if app.pod.is_empty() {
        &app.name
    } else {
        &app.pod
    };
    let value = format!("{}-{who}-{n}", app.name);
    let headers: Vec<(&str, &[u8])> = app
        .propagate
        .iter()
        .flat_map(|name| {
            req.headers()
                .get_all(name)
                .iter()
                .map(move |v| (name.as_str(), v.as_bytes()))
        })
        .collect();
    let mut doc = app.identity();
    doc["record"] = json!(value);
    match producer.send(value.as_bytes(), &headers).await {
        Ok((partition, offset)) => {
            doc["partition"] = json!(partition);
            doc["offset"] = json!(offset);
            json_reply(StatusCode::CREATED, &doc)
        }
        Err(e) => {
            tracing::warn!(error = %e, record = %value, "record not written");
            doc["error"] = json!(e.to_string());
            json_reply(StatusCode::SERVICE_UNAVAILABLE, &doc)
        }
    }
}

/// `/rows` in database mode.
async fn respond_rows(
    req: Request<Incoming>,
    app: &App,
    database: &rows::Database,
) -> Response<Full<Bytes>> {
    let mut doc = app.identity();
    let result = match *req.method() {
        Method::POST => {
            let value = match read_value(req.into_body()).await {
                Ok(value) => value,
                Err(e) => {
                    doc["error"] = Value::String(e);
                    return json_reply(StatusCode::BAD_REQUEST, &doc);
                }
            };
            let written_by = if app.pod.is_empty() {
                &app.name
            } else {
                &app.pod
            };
            database.insert(&value, written_by).await.map(|(name, id)| {
                doc["database"] = Value::String(name);
                doc["id"] = Value::from(id);
                doc["value"] = Value::String(value);
                StatusCode::CREATED
            })
        }
        Method::GET | Method::HEAD => database.list().await.map(|(name, rows)| {
            doc["database"] = Value::String(name);
            doc["rows"] = Value::Array(rows);
            StatusCode::OK
        }),
        _ => {
            let mut resp = reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain; charset=utf-8",
                "only GET and POST\n",
            );
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD, POST"));
            return resp;
        }
    };
    match result {
        Ok(status) => json_reply(status, &doc),
        Err(e) => {
            // The error names the database by its redacted URL only.
            tracing::warn!(error = format!("{e:#}"), "database request failed");
            doc["error"] = Value::String(format!("{e:#}"));
            json_reply(StatusCode::SERVICE_UNAVAILABLE, &doc)
        }
    }
}

/// The body of `POST /rows`: UTF-8, at most [`rows::VALUE_LIMIT`] bytes, read within
/// [`UPSTREAM_TIMEOUT`] (a client trickling its body must not hold the request forever).
async fn read_value(body: Incoming) -> Result<String, String> {
    let limit = rows::VALUE_LIMIT;
    let read = Limited::new(body, limit).collect();
    let bytes = match tokio::time::timeout(UPSTREAM_TIMEOUT, read).await {
        Err(_) => {
            return Err(format!(
                "the body did not arrive within {UPSTREAM_TIMEOUT:?}"
            ));
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(format!("the body is larger than {limit} bytes"));
        }
        Ok(Err(e)) => return Err(format!("reading the body failed: {e}")),
        Ok(Ok(collected)) => collected.to_bytes(),
    };
    String::from_utf8(bytes.into()).map_err(|_| "the body is not UTF-8".to_owned())
}

fn json_reply(status: StatusCode, doc: &Value) -> Response<Full<Bytes>> {
    let mut body = doc.to_string();
    body.push('\n');
    reply(status, "application/json", body)
}

/// Every line of header `name`, joined with "," (one list, as W3C baggage defines it).
fn joined(headers: &HeaderMap, name: &str) -> Option<String> {
    let values: Vec<String> = headers
        .get_all(name)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    (!values.is_empty()).then(|| values.join(","))
}

fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

async fn call_upstream(
    upstream: &Upstream,
    propagate: &[HeaderName],
    incoming: &Request<Incoming>,
) -> Result<Value> {
    let uri = upstream.uri_for(incoming.uri())?;
    let mut req = Request::get(uri.clone())
        .header(header::ACCEPT, "application/json")
        .body(Empty::<Bytes>::new())
        .context("cannot build the upstream request")?;
    for name in propagate {
        for value in incoming.headers().get_all(name) {
            req.headers_mut().append(name.clone(), value.clone());
        }
    }
    let call = async {
        let resp = upstream
            .client
            .request(req)
            .await
            .map_err(|e| anyhow!(e))
            .with_context(|| format!("upstream {uri} failed"))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), UPSTREAM_BODY_LIMIT)
            .collect()
            .await
            .map_err(|e| anyhow!(e))
            .with_context(|| {
                format!("reading the answer of upstream {uri} failed (limit {UPSTREAM_BODY_LIMIT} bytes)")
            })?
            .to_bytes();
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body[..body.len().min(512)]);
            bail!("upstream {uri} answered {status}: {}", text.trim_end());
        }
        serde_json::from_slice::<Value>(&body)
            .with_context(|| format!("upstream {uri} answered invalid JSON"))
    };
    tokio::time::timeout(UPSTREAM_TIMEOUT, call)
        .await
        .map_err(|_| anyhow!("upstream {uri} did not answer within {UPSTREAM_TIMEOUT:?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn start(app: App) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let token = CancellationToken::new();
        let task = tokio::spawn(serve(listener, Arc::new(app), token.clone()));
        (addr, token, task)
    }

    async fn get(
        addr: SocketAddr,
        path: &str,
        headers: &[(&str, &str)],
        h2: bool,
    ) -> (StatusCode, String) {
        let client = Client::builder(TokioExecutor::new())
            .http2_only(h2)
            .build_http::<Empty<Bytes>>();
        let mut req = Request::get(format!("http://{addr}{path}"));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = client
            .request(req.body(Empty::new()).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    fn app(name: &str, marker: Option<&str>, call: Option<&str>) -> App {
        App::new(
            name.into(),
            format!("{name}-pod"),
            marker.map(str::to_owned),
            call,
            &[],
            None,
        )
        .unwrap()
    }

    #[tokio::test]
    async fn frontend_propagates_routing_context_to_backend() {
        let (backend, b_stop, b_task) = start(app("backend", Some("v2"), None)).await;
        let call = format!("http://{backend}");
        let (frontend, f_stop, f_task) = start(app("frontend", None, Some(&call))).await;

        for h2 in [false, true] {
            let (status, body) = get(
                frontend,
                "/some/path?x=1",
                &[("baggage", "sd-routing-key=abc")],
                h2,
            )
            .await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let doc: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(doc["service"], "frontend");
            assert_eq!(doc["pod"], "frontend-pod");
            assert_eq!(doc["marker"], Value::Null);
            assert_eq!(doc["baggage"], "sd-routing-key=abc");
            assert_eq!(doc["upstream"]["service"], "backend");
            assert_eq!(doc["upstream"]["marker"], "v2");
            assert_eq!(doc["upstream"]["baggage"], "sd-routing-key=abc");
            assert_eq!(doc["upstream"]["upstream"], Value::Null);
        }

        // Unkeyed: the backend sees no baggage.
        let (_, body) = get(frontend, "/", &[], false).await;
        let doc: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(doc["upstream"]["baggage"], Value::Null);

        // Health checks never call upstream.
        b_stop.cancel();
        b_task.await.unwrap();
        let (status, body) = get(frontend, "/healthz", &[], false).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));

        // A dead upstream is a 502 with a message.
        let (status, body) = get(frontend, "/", &[], false).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
        let doc: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(doc["service"], "frontend");
        assert!(doc["error"].as_str().unwrap().contains(&call), "{body}");

        f_stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), f_task)
            .await
            .unwrap()
            .unwrap();
    }

    /// Every carrier header reaches the upstream unchanged (all lines), and the incoming path and
    /// query are appended to the call URL's. The upstream here is the demo HTTP app's /headers.
    #[tokio::test]
    async fn every_carrier_header_and_the_path_reach_the_upstream() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = listener.local_addr().unwrap();
        let echo_stop = CancellationToken::new();
        let echo = tokio::spawn(spur_demo_apps::serve_http(
            listener,
            "echo".into(),
            echo_stop.clone(),
        ));
        let call = format!("http://{echo_addr}/");
        let (frontend, f_stop, f_task) = start(
            App::new(
                "frontend".into(),
                String::new(),
                None,
                Some(&call),
                &["x-custom-key".into()],
                None,
            )
            .unwrap(),
        )
        .await;

        let mut sent: Vec<(&str, &str)> = propagated().map(|h| (h, "k1")).collect();
        sent.push(("baggage", "other=1"));
        sent.push(("x-custom-key", "k2"));
        sent.push(("x-not-propagated", "no"));
        let (status, body) = get(frontend, "/headers?a=b", &sent, false).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let doc: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(doc["baggage"], "k1,other=1");
        // The extra propagated header is reported as received; the standard ones are not.
        assert_eq!(doc["headers"], json!({"x-custom-key": "k2"}), "{body}");
        let up = &doc["upstream"];
        assert_eq!(up["uri"], "/headers?a=b", "{body}");
        for h in propagated().filter(|h| *h != "baggage") {
            assert_eq!(up["headers"][h], json!(["k1"]), "{h}: {body}");
        }
        assert_eq!(up["headers"]["baggage"], json!(["k1", "other=1"]));
        assert_eq!(up["headers"]["x-custom-key"], json!(["k2"]));
        assert_eq!(up["headers"]["x-not-propagated"], Value::Null);
        f_stop.cancel();
        f_task.await.unwrap();

        // `--no-propagate baggage`: the trace context goes on, the key does not.
        let (frontend, f_stop, f_task) = start(
            App::new(
                "frontend".into(),
                String::new(),
                None,
                Some(&call),
                &[],
                None,
            )
            .unwrap()
            .dropping(&["Baggage".into(), " ".into()])
            .unwrap(),
        )
        .await;
        let (status, body) = get(frontend, "/headers", &sent, false).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let up = &serde_json::from_str::<Value>(&body).unwrap()["upstream"];
        assert_eq!(up["headers"]["baggage"], Value::Null, "{body}");
        assert_eq!(up["headers"]["traceparent"], json!(["k1"]), "{body}");
        assert!(
            App::new("a".into(), String::new(), None, None, &[], None)
                .unwrap()
                .dropping(&["bad header".into()])
                .is_err()
        );

        f_stop.cancel();
        f_task.await.unwrap();
        echo_stop.cancel();
        echo.await.unwrap().unwrap();
    }

    #[test]
    fn upstream_urls() {
        let up = Upstream::new("http://backend:8080").unwrap();
        let uri = |s: &str| s.parse::<Uri>().unwrap();
        assert_eq!(
            up.uri_for(&uri("/a/b?c=d")).unwrap(),
            "http://backend:8080/a/b?c=d"
        );
        assert_eq!(up.uri_for(&uri("/")).unwrap(), "http://backend:8080/");
        let up = Upstream::new("http://backend:8080/api/?v=1").unwrap();
        assert_eq!(
            up.uri_for(&uri("/x?y=2")).unwrap(),
            "http://backend:8080/api/x?v=1&y=2"
        );
        assert!(Upstream::new("https://backend").is_err());
        assert!(Upstream::new("backend:8080").is_err());
        assert!(Upstream::new("/path").is_err());
    }
}
