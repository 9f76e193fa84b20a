//! `spur-agent`: runs in a cluster, keeps one tunnel session to the hub (dialling out; the
//! cluster accepts nothing inbound) and serves the streams the hub opens on its reverse
//! listener: TCP connections to in-cluster targets, a scoped, read-only proxy to the
//! Kubernetes API and, when given one, reads of the cluster's traffic store (the web view's
//! traffic tab). Reconnects (backoff with jitter) are the tunnel client's.

pub mod access;
pub mod pool;
pub mod targets;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper_util::rt::{TokioIo, TokioTimer};
use spur_tunnel::{ClientMetrics, Incoming, SessionState, TunnelClient};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::protocol::{
    AGENT_BIND, AgentInfo, Answer, KubeIdentity, MAX_FRAME, MAX_TRAFFIC_LIMIT, MAX_TRAFFIC_READS,
    Open, TRAFFIC_BODY_BYTES, TRAFFIC_CONTENT_TYPE, TRAFFIC_PATH,
};
use access::Reviewer;

/// What the agent lets the hub do.
#[derive(Clone, Debug)]
pub struct Scope {
    /// Host suffixes a TCP stream may connect to (in-cluster Service names). An IP address or
    /// any other name is refused, so a hub cannot use the agent to reach arbitrary addresses.
    pub target_suffixes: Vec<String>,
    /// The addresses those names may resolve to ([`targets::AddressPolicy`]). With Kubernetes
    /// access, a `<service>.<namespace>.svc` name must also be a Service that is not of type
    /// ExternalName.
    pub addresses: targets::AddressPolicy,
    /// How long connecting to a target may take (the Service read and lookup included).
    pub connect_timeout: Duration,
    /// How long the hub may take to send a stream's `Open` frame, and a request head on a
    /// Kubernetes or traffic stream (hyper enforces the latter only with a timer set).
    pub header_read_timeout: Duration,
    /// Streams served at once; more are refused until one ends.
    pub max_streams: usize,
}

impl Default for Scope {
    fn default() -> Self {
        Scope {
            target_suffixes: vec![".svc".into(), ".svc.cluster.local".into()],
            addresses: targets::AddressPolicy::default(),
            connect_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(10),
            max_streams: 1024,
        }
    }
}

impl Scope {
    /// Whether `host` may be reached: a DNS name under an allowed suffix. A suffix with a
    /// leading dot (`.svc`) matches names below it only; one without (`localhost`) matches the
    /// name itself as well.
    pub fn allows(&self, host: &str) -> bool {
        let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
        if host.parse::<std::net::IpAddr>().is_ok() {
            return false;
        }
        self.target_suffixes
            .iter()
            .any(|s| match s.strip_prefix('.') {
                Some(_) => host.len() > s.len() && host.ends_with(s.as_str()),
                None => {
                    host == *s
                        || (host.len() > s.len() + 1
                            && host.ends_with(s.as_str())
                            && host.as_bytes()[host.len() - s.len() - 1] == b'.')
                }
            })
    }
}

/// The running agent.
pub struct Agent {
    client: Arc<TunnelClient>,
    kube: Option<kube::Client>,
    /// Checks every read made for a user (none without Kubernetes access: such reads are
    /// refused).
    reviewer: Option<Arc<Reviewer>>,
    scope: Arc<Scope>,
    traffic: Option<TrafficReader>,
    /// Streams being served, at most [`Scope::max_streams`].
    streams: Arc<tokio::sync::Semaphore>,
}

/// The agent's reader of the cluster's traffic store.
#[derive(Clone)]
struct TrafficReader {
    store: spur_discovery::Connector,
    /// Reads in flight, bounded: each one decodes and re-encodes a reply of up to 16 MiB.
    permits: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// Starts the tunnel client (it connects in the background).
    pub fn start(
        client: spur_tunnel::ClientConfig,
        kube: Option<kube::Client>,
        scope: Scope,
        registry: &mut prometheus_client::registry::Registry,
    ) -> Result<Agent, Error> {
        Self::start_with(client, kube, scope, &ClientMetrics::new(registry))
    }

    /// Like [`Agent::start`], counting its tunnel into `metrics` (shared by the agents of a
    /// [`pool::HubPool`], one per hub replica).
    pub fn start_with(
        client: spur_tunnel::ClientConfig,
        kube: Option<kube::Client>,
        scope: Scope,
        metrics: &ClientMetrics,
    ) -> Result<Agent, Error> {
        if scope.max_streams == 0 || scope.header_read_timeout.is_zero() {
            return Err(Error::Config(
                "the agent's stream limit and header read timeout must be above zero".into(),
            ));
        }
        let client = TunnelClient::start_with(client, metrics)?;
        Ok(Agent {
            client: Arc::new(client),
            reviewer: kube.clone().map(|k| Arc::new(Reviewer::new(k))),
            kube,
            streams: Arc::new(tokio::sync::Semaphore::new(scope.max_streams)),
            scope: Arc::new(scope),
            traffic: None,
        })
    }

    /// Lets the hub read the cluster's traffic store through `store` (its address, CA and the
    /// agent's token, which RBAC must let read sandboxes' traffic). Without it the hub's
    /// traffic reads are refused.
    pub fn with_traffic(mut self, store: spur_discovery::Connector) -> Self {
        self.traffic = Some(TrafficReader {
            store,
            permits: Arc::new(tokio::sync::Semaphore::new(MAX_TRAFFIC_READS)),
        });
        self
    }

    /// The tunnel session's state (for readiness).
    pub fn state(&self) -> watch::Receiver<SessionState> {
        self.client.state()
    }

    /// Serves the hub's streams until `stop`, or until the hub refuses the agent for good (an
    /// unknown or revoked token), which is returned as an error.
    pub async fn run(&self, stop: CancellationToken) -> Result<(), Error> {
        let meta = serde_json::to_string(&AgentInfo {
            version: env!("CARGO_PKG_VERSION").into(),
        })
        .map_err(|e| Error::Config(e.to_string()))?;
        let mut state = self.client.state();
        // The hub may be down when the agent starts (both restarted together): keep trying to
        // register rather than exit, until the hub refuses this agent for good.
        let mut wait = Duration::from_secs(1);
        let mut listener = loop {
            let bind = tokio::select! {
                b = self.client.bind(AGENT_BIND, &meta) => b,
                () = stop.cancelled() => return Ok(()),
                r = closed(&mut state) => return Err(r),
            };
            match bind {
                Ok(l) => break l,
                Err(e) => {
                    let now = self.client.state().borrow().clone();
                    tracing::warn!(state = ?now, "not registered with the hub yet: {e}");
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = stop.cancelled() => return Ok(()),
                        r = closed(&mut state) => return Err(r),
                    }
                    wait = (wait * 2).min(Duration::from_secs(15));
                }
            }
        };
        let streams = tokio_util::task::TaskTracker::new();
        let result = loop {
            tokio::select! {
                incoming = listener.accept() => match incoming {
                    Some(incoming) => {
                        let Ok(permit) = self.streams.clone().try_acquire_owned() else {
                            streams.spawn(incoming.reject("the agent is serving as many streams as it may; try again"));
                            continue;
                        };
                        let kube = self.kube.clone();
                        let reviewer = self.reviewer.clone();
                        let scope = self.scope.clone();
                        let traffic = self.traffic.clone();
                        streams.spawn(async move {
                            if let Err(e) = serve_stream(incoming, kube, reviewer, traffic, &scope).await {
                                tracing::debug!("hub stream: {e}");
                            }
                            drop(permit);
                        });
                    }
                    // The listener ends when the client closes for good; its state says why.
                    None => break Err(match &*self.client.state().borrow() {
                        SessionState::Closed { reason } => Error::Refused(reason.clone()),
                        _ => Error::Refused("the hub refused the agent's listener".into()),
                    }),
                },
                () = stop.cancelled() => break Ok(()),
                r = closed(&mut state) => break Err(r),
            }
        };
        drop(listener);
        streams.close();
        // In-flight requests get a moment; the tunnel's own drain bounds the rest.
        let _ = tokio::time::timeout(Duration::from_secs(10), streams.wait()).await;
        self.client.close(Duration::from_secs(5)).await;
        result
    }
}

/// Resolves when the client gives up for good (refused without retry, or closed).
async fn closed(state: &mut watch::Receiver<SessionState>) -> Error {
    loop {
        if let SessionState::Closed { reason } = &*state.borrow_and_update() {
            return Error::Refused(reason.clone());
        }
        if state.changed().await.is_err() {
            return Error::Refused("the tunnel client stopped".into());
        }
    }
}

async fn serve_stream(
    incoming: Incoming,
    kube: Option<kube::Client>,
    reviewer: Option<Arc<Reviewer>>,
    traffic: Option<TrafficReader>,
    scope: &Scope,
) -> Result<(), Error> {
    let mut stream = incoming.accept().await?;
    let open = tokio::time::timeout(
        scope.header_read_timeout,
        spur_tunnel::read_frame::<_, Open>(&mut stream, MAX_FRAME),
    )
    .await
    .map_err(|_| {
        Error::Timeout(format!(
            "the hub sent no Open frame within {:?}",
            scope.header_read_timeout
        ))
    })??;
    let Some(open) = open else {
        return Ok(());
    };
    // The Kubernetes and traffic streams are HTTP/1.1 servers: a request head that does not
    // arrive in time closes the stream (hyper needs the timer for that).
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(scope.header_read_timeout);
    match open {
        Open::Tcp { host, port } => {
            if !scope.allows(&host) {
                let reason = format!(
                    "target {host:?} is outside the agent's scope (names ending in {})",
                    scope.target_suffixes.join(", ")
                );
                answer(&mut stream, Answer::Error { reason }).await?;
                return Ok(());
            }
            let checked = async {
                if let (Some(kube), Some((namespace, name))) =
                    (kube.as_ref(), crate::namespaces::service_of(&host))
                {
                    targets::check_service(kube, &namespace, &name, scope.connect_timeout).await?;
                }
                let addrs = scope
                    .addresses
                    .resolve(&host, port, scope.connect_timeout)
                    .await?;
                targets::connect(&addrs, scope.connect_timeout, &format!("{host}:{port}")).await
            };
            let tcp = match checked.await {
                Ok(tcp) => tcp,
                Err(reason) => {
                    answer(&mut stream, Answer::Error { reason }).await?;
                    return Ok(());
                }
            };
            let _ = tcp.set_nodelay(true);
            answer(&mut stream, Answer::Ok).await?;
            stream.splice(tcp).await?;
            Ok(())
        }
        Open::Kube => {
            let Some(kube) = kube else {
                let reason = crate::protocol::NO_KUBE.to_owned();
                answer(&mut stream, Answer::Error { reason }).await?;
                return Ok(());
            };
            answer(&mut stream, Answer::Ok).await?;
            let service = hyper::service::service_fn(move |req| {
                let kube = kube.clone();
                async move { Ok::<_, Infallible>(kube_proxy(&kube, req).await) }
            });
            http1
                .serve_connection(TokioIo::new(stream), service)
                .await
                .map_err(|e| Error::Upstream(format!("kube proxy stream: {e}")))
        }
        Open::Read { as_user } => {
            let reviewer = match (access::check_identity(&as_user), reviewer) {
                (Err(reason), _) => {
                    answer(&mut stream, Answer::Error { reason }).await?;
                    return Ok(());
                }
                (Ok(()), None) => {
                    let reason = "this agent runs without Kubernetes access, so it cannot check what a user may read".to_owned();
                    answer(&mut stream, Answer::Error { reason }).await?;
                    return Ok(());
                }
                (Ok(()), Some(r)) => r,
            };
            answer(&mut stream, Answer::Ok).await?;
            let as_user = Arc::new(as_user);
            let service = hyper::service::service_fn(move |req| {
                let (reviewer, as_user) = (reviewer.clone(), as_user.clone());
                async move { Ok::<_, Infallible>(user_read(&reviewer, &as_user, req).await) }
            });
            http1
                .serve_connection(TokioIo::new(stream), service)
                .await
                .map_err(|e| Error::Upstream(format!("read stream: {e}")))
        }
        Open::Traffic { as_user } => {
            let refused = match (access::check_identity(&as_user), &reviewer, &traffic) {
                (Err(reason), _, _) => Some(reason),
                (Ok(()), _, None) => Some("this agent does not read the traffic store (spur-agent --traffic-server; the chart's agent.traffic.enabled)".to_owned()),
                (Ok(()), None, Some(_)) => Some("this agent runs without Kubernetes access, so it cannot check what a user may read".to_owned()),
                (Ok(()), Some(_), Some(_)) => None,
            };
            let (Some(reader), Some(reviewer), None) = (traffic, reviewer, refused.clone()) else {
                let reason = refused.unwrap_or_default();
                answer(&mut stream, Answer::Error { reason }).await?;
                return Ok(());
            };
            answer(&mut stream, Answer::Ok).await?;
            let as_user = Arc::new(as_user);
            let service = hyper::service::service_fn(move |req| {
                let (reader, reviewer, as_user) =
                    (reader.clone(), reviewer.clone(), as_user.clone());
                async move { Ok::<_, Infallible>(traffic_read(&reader, &reviewer, &as_user, req).await) }
            });
            http1
                .serve_connection(TokioIo::new(stream), service)
                .await
                .map_err(|e| Error::Upstream(format!("traffic stream: {e}")))
        }
    }
}

/// The filter of a traffic read, from its query string; an error names what is wrong.
pub fn traffic_query(query: &str) -> Result<spur_proto::traffic::QueryRequest, String> {
    let mut filter = spur_proto::traffic::Filter::default();
    let mut limit = 50;
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        match &*k {
            "sandbox" => filter.sandbox = v.into_owned(),
            "path" => filter.path_prefix = v.into_owned(),
            "method" => filter.method = v.into_owned(),
            "status" if v.is_empty() => {}
            "status" => {
                filter.status = v
                    .parse()
                    .ok()
                    .filter(|s| (100..=599).contains(s))
                    .ok_or_else(|| format!("status {v:?}: expected a number from 100 to 599"))?;
            }
            "limit" => {
                limit = v
                    .parse::<u32>()
                    .ok()
                    .filter(|l| (1..=MAX_TRAFFIC_LIMIT).contains(l))
                    .ok_or_else(|| {
                        format!("limit {v:?}: expected a number from 1 to {MAX_TRAFFIC_LIMIT}")
                    })?;
            }
            other => return Err(format!("unknown parameter {other:?}")),
        }
    }
    if filter.sandbox.is_empty() {
        return Err("sandbox is required (a reader may see only sandboxes RBAC lets it)".into());
    }
    Ok(spur_proto::traffic::QueryRequest {
        filter: Some(filter),
        limit,
        without_bodies: false,
    })
}

/// One list read for `as_user` (a GET of one of the read paths, no query: no watch), only what
/// it may see.
async fn user_read(
    reviewer: &Reviewer,
    as_user: &KubeIdentity,
    req: Request<hyper::body::Incoming>,
) -> Response<ProxyBody> {
    if req.method() != Method::GET || req.uri().query().is_some() {
        return status(
            StatusCode::NOT_FOUND,
            "a read stream serves only plain GETs of lists (no watch, no query)",
        );
    }
    match reviewer.list_for(as_user, req.uri().path()).await {
        Ok(body) => {
            let mut resp = Response::new(UnsyncBoxBody::new(
                Full::new(Bytes::from(body)).map_err(|e| match e {}),
            ));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            resp
        }
        Err(e) => {
            let (code, message) = e.status();
            status(code, message)
        }
    }
}

/// One read of the traffic store with the agent's credentials, for `as_user`, who must be
/// allowed to read the sandbox's traffic; the reply as protobuf (only exchanges of baselines in
/// the namespaces checked), or an error status whose body says why.
async fn traffic_read(
    reader: &TrafficReader,
    reviewer: &Reviewer,
    as_user: &KubeIdentity,
    req: Request<hyper::body::Incoming>,
) -> Response<ProxyBody> {
    let store = &reader.store;
    if req.method() != Method::GET || req.uri().path() != TRAFFIC_PATH {
        return status(
            StatusCode::NOT_FOUND,
            &format!("the agent serves only GET {TRAFFIC_PATH} on traffic streams"),
        );
    }
    let query = match traffic_query(req.uri().query().unwrap_or_default()) {
        Ok(q) => q,
        Err(e) => return status(StatusCode::BAD_REQUEST, &e),
    };
    let Ok(_permit) = reader.permits.try_acquire() else {
        return status(
            StatusCode::TOO_MANY_REQUESTS,
            &format!("the agent is serving {MAX_TRAFFIC_READS} traffic reads already; try again"),
        );
    };
    let sandbox = query
        .filter
        .as_ref()
        .map(|f| f.sandbox.clone())
        .unwrap_or_default();
    let shown = match reviewer.traffic_allowed(as_user, &sandbox).await {
        Ok(shown) => shown,
        Err(e) => {
            let (code, message) = e.status();
            return status(code, message);
        }
    };
    let reply = async {
        let channel = store
            .channel()
            .await
            .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
        let mut request = tonic::Request::new(query);
        if let Some(auth) = store
            .authorization()
            .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?
        {
            request.metadata_mut().insert("authorization", auth);
        }
        spur_proto::traffic::traffic_client::TrafficClient::new(channel)
            .max_decoding_message_size(MAX_STORE_REPLY)
            .query(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| {
                let code = match s.code() {
                    tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => {
                        StatusCode::FORBIDDEN
                    }
                    tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
                    _ => StatusCode::BAD_GATEWAY,
                };
                (code, format!("traffic store: {}", s.message()))
            })
    };
    match tokio::time::timeout(TRAFFIC_TIMEOUT, reply).await {
        Ok(Ok(mut reply)) => {
            use prost::Message as _;
            // Only exchanges of the namespaces the user was checked in (a sandbox's exchanges
            // are of its own baselines; this holds even if the store says otherwise).
            if let Some(shown) = &shown {
                reply.exchanges.retain(|x| {
                    x.exchange
                        .as_ref()
                        .and_then(|x| x.baseline.as_ref())
                        .is_some_and(|w| shown.contains(&w.namespace))
                });
            }
            cut_bodies(&mut reply);
            let mut resp = Response::new(UnsyncBoxBody::new(
                Full::new(Bytes::from(reply.encode_to_vec())).map_err(|e| match e {}),
            ));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(TRAFFIC_CONTENT_TYPE),
            );
            resp
        }
        Ok(Err((code, message))) => status(code, &message),
        Err(_) => status(
            StatusCode::GATEWAY_TIMEOUT,
            &format!("the traffic store did not answer within {TRAFFIC_TIMEOUT:?}"),
        ),
    }
}

/// How long one traffic read may take, connecting included.
const TRAFFIC_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest reply taken from the store (it caps its own at 16 MiB; framing on top).
const MAX_STORE_REPLY: usize = 17 * 1024 * 1024;

/// Cuts every body to [`TRAFFIC_BODY_BYTES`], marking the cut ones truncated.
pub fn cut_bodies(reply: &mut spur_proto::traffic::QueryReply) {
    for x in reply
        .exchanges
        .iter_mut()
        .filter_map(|s| s.exchange.as_mut())
    {
        for body in [x.request_body.as_mut(), x.response_body.as_mut()]
            .into_iter()
            .flatten()
        {
            if body.data.len() > TRAFFIC_BODY_BYTES {
                body.data.truncate(TRAFFIC_BODY_BYTES);
                body.truncated = true;
            }
        }
    }
}

async fn answer(stream: &mut spur_tunnel::Stream, a: Answer) -> Result<(), Error> {
    let refused = matches!(a, Answer::Error { .. });
    spur_tunnel::write_frame(stream, &a, MAX_FRAME).await?;
    if refused {
        // End the stream cleanly and let the hub read the reason before it goes: over HTTP/2 a
        // stream dropped while the hub's side is open is reset, and the reset overtakes it.
        let _ = tokio::io::AsyncWriteExt::shutdown(stream).await;
        let mut rest = [0u8; 512];
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while matches!(tokio::io::AsyncReadExt::read(stream, &mut rest).await, Ok(n) if n > 0) {
            }
        })
        .await;
    }
    Ok(())
}

type ProxyBody = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// Forwards a request the scope allows to the Kubernetes API; anything else is a 403 that never
/// leaves the agent.
async fn kube_proxy(
    kube: &kube::Client,
    req: Request<hyper::body::Incoming>,
) -> Response<ProxyBody> {
    if req.method() != Method::GET || !kube_path_allowed(req.uri().path()) {
        return status(
            StatusCode::FORBIDDEN,
            &format!(
                "the agent allows only reads of Spur's resources; refused {} {}",
                req.method(),
                req.uri().path()
            ),
        );
    }
    let mut builder = Request::get(req.uri().clone());
    if let Some(accept) = req.headers().get(http::header::ACCEPT) {
        builder = builder.header(http::header::ACCEPT, accept);
    }
    let Ok(out) = builder.body(kube::client::Body::empty()) else {
        return status(StatusCode::BAD_REQUEST, "malformed request");
    };
    match kube.send(out).await {
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            let body = body.map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>);
            Response::from_parts(parts, UnsyncBoxBody::new(body))
        }
        Err(e) => status(StatusCode::BAD_GATEWAY, &format!("Kubernetes API: {e}")),
    }
}

/// Reads of Spur's cluster-scoped Sandboxes, RouteGroups and RoutingConfigs (lists, watches and
/// single objects), the cluster-wide list and watch of Jobs (for the web view), and the list and
/// watch of Namespaces (whose carrier annotations previews overwrite).
pub fn kube_path_allowed(path: &str) -> bool {
    if path == crate::catalog::NAMESPACES_PATH {
        return true;
    }
    let Some(rest) = path.strip_prefix("/apis/spur.dev/v1alpha1/") else {
        return false;
    };
    let parts: Vec<&str> = rest.split('/').collect();
    // A DNS subdomain: starts and ends with a letter or digit, so never `.` or `..`.
    let name_ok = |s: &str| {
        let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        s.len() <= 253
            && s.bytes().next().is_some_and(alnum)
            && s.bytes().last().is_some_and(alnum)
            && s.bytes().all(|b| alnum(b) || b == b'-' || b == b'.')
    };
    match parts.as_slice() {
        ["sandboxes" | "routegroups" | "routingconfigs" | "jobs"] => true,
        ["sandboxes" | "routegroups" | "routingconfigs", name] => name_ok(name),
        _ => false,
    }
}

fn status(code: StatusCode, message: &str) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": message, "code": code.as_u16(),
    });
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_string()))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_allows_service_names_only() {
        let s = Scope::default();
        for ok in [
            "web.shop.svc",
            "web.shop.svc.cluster.local",
            "WEB.shop.svc.",
        ] {
            assert!(s.allows(ok), "{ok}");
        }
        for bad in [
            "10.0.0.1",
            "::1",
            "example.com",
            ".svc",
            "svc",
            "evil.svc.example.com",
        ] {
            assert!(!s.allows(bad), "{bad}");
        }
        let local = Scope {
            target_suffixes: vec!["localhost".into()],
            ..Scope::default()
        };
        assert!(local.allows("localhost") && local.allows("a.localhost"));
        assert!(!local.allows("evillocalhost") && !local.allows("127.0.0.1"));
    }

    #[test]
    fn kube_paths() {
        for ok in [
            "/apis/spur.dev/v1alpha1/sandboxes",
            "/apis/spur.dev/v1alpha1/sandboxes/a-b",
            "/apis/spur.dev/v1alpha1/routegroups",
            "/apis/spur.dev/v1alpha1/routingconfigs",
            "/apis/spur.dev/v1alpha1/routingconfigs/sandbox-x-1a2b",
            "/apis/spur.dev/v1alpha1/jobs",
            "/api/v1/namespaces",
        ] {
            assert!(kube_path_allowed(ok), "{ok}");
        }
        for bad in [
            "/api/v1/secrets",
            "/api/v1/namespaces/kube-system/secrets",
            "/api/v1/namespaces/kube-system",
            "/api/v1/namespaces/",
            "/apis/spur.dev/v1alpha1/sandboxes/a/status/x",
            "/apis/spur.dev/v1alpha1/forkedworkloads",
            "/apis/spur.dev/v1alpha1/sandboxes/../../../api/v1/secrets",
            "/apis/spur.dev/v1alpha1/sandboxes/%2e%2e",
            "/apis/spur.dev/v1alpha1/",
            "/apis/spur.dev/v1alpha1/sandboxes/..",
            "/apis/spur.dev/v1alpha1/namespaces/shop/routingconfigs",
            "/apis/spur.dev/v1alpha1/routingconfigs/x/status",
        ] {
            assert!(!kube_path_allowed(bad), "{bad}");
        }
    }
}
