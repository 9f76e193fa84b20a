//! An in-process hub, agents (real or hostile), a stand-in Kubernetes API and TLS clients, for
//! the tests that attack the hub's listeners, origins and agents (issue 42).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use spur_hub::Store;
use spur_hub::agent::targets::AddressPolicy;
use spur_hub::agent::{Agent, Scope};
use spur_hub::listener::ListenerLimits;
use spur_hub::server::{Hub, HubConfig, PreviewSettings, TlsSource};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

pub(crate) const WEB_HOST: &str = "localhost";
pub(crate) const DOMAIN: &str = "preview.test";

/// A running hub: its addresses, store, CA and what stops it.
pub(crate) struct TestHub {
    pub(crate) store: Store,
    pub(crate) clusters: spur_hub::clusters::Clusters,
    pub(crate) catalog: spur_hub::catalog::Catalog,
    pub(crate) tunnel: SocketAddr,
    pub(crate) preview: SocketAddr,
    pub(crate) ca_pem: String,
    pub(crate) stop: CancellationToken,
}

impl Drop for TestHub {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

pub(crate) fn settings(limits: ListenerLimits) -> PreviewSettings {
    PreviewSettings {
        addr: "127.0.0.1:0".parse().unwrap(),
        domain: DOMAIN.into(),
        web_host: WEB_HOST.into(),
        limits,
        response_timeout: Duration::from_secs(5),
        allow_public: false,
        carriers: spur_hub::preview::default_carriers(),
        more_query_params: Vec::new(),
    }
}

pub(crate) async fn start_hub(preview: PreviewSettings) -> TestHub {
    start_hub_with(preview, |_| {}).await
}

/// A hub; `with` sees its catalog's clusters before it runs (to start another catalog).
pub(crate) async fn start_hub_with(
    preview: PreviewSettings,
    with: impl FnOnce(&spur_hub::clusters::Clusters),
) -> TestHub {
    start_hub_on(Store::in_memory().unwrap(), preview, with).await
}

/// A hub on `store` (replicas share one).
pub(crate) async fn start_hub_on(
    store: Store,
    preview: PreviewSettings,
    with: impl FnOnce(&spur_hub::clusters::Clusters),
) -> TestHub {
    let mut registry = prometheus_client::registry::Registry::default();
    let hub = Hub::start(
        HubConfig {
            tunnel_quic: None,
            tunnel_h2: Some("127.0.0.1:0".parse().unwrap()),
            tls: TlsSource::OwnCa {
                names: vec![WEB_HOST.into()],
            },
            revocation_poll: Duration::from_millis(200),
            preview: Some(preview),
        },
        store.clone(),
        &mut registry,
    )
    .await
    .unwrap();
    let stop = CancellationToken::new();
    with(hub.clusters());
    let t = TestHub {
        store,
        clusters: hub.clusters().clone(),
        catalog: hub.catalog().clone(),
        tunnel: hub.tunnel_h2_addr().unwrap(),
        preview: hub.preview_addr().unwrap(),
        ca_pem: hub.ca_pem().unwrap().to_owned(),
        stop: stop.clone(),
    };
    tokio::spawn(hub.run(stop, Duration::from_millis(100)));
    t
}

/// An API key of a new hub user `name` who may see every namespace of every cluster.
pub(crate) fn admin_key(hub: &TestHub, name: &str) -> String {
    hub.store.add_user(name).unwrap();
    hub.store
        .set_user_scope(
            name,
            &spur_hub::store::ScopeChange {
                cluster: "*".into(),
                namespaces: spur_hub::users::Namespaces::ALL,
                kube_user: None,
                kube_groups: vec![],
            },
        )
        .unwrap();
    hub.store.add_api_key(name, name).unwrap()
}

/// The tunnel client settings of a cluster's agent: its token is registered now.
pub(crate) fn agent_client(hub: &TestHub, cluster: &str) -> spur_tunnel::ClientConfig {
    let token = hub.store.add_cluster(cluster, false).unwrap();
    let roots = CertificateDer::pem_slice_iter(hub.ca_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let mut c = spur_tunnel::ClientConfig::new(
        WEB_HOST,
        spur_tunnel::ClientTls {
            roots,
            client_cert: None,
        },
    );
    c.h2_addr = Some(hub.tunnel.to_string());
    c.transports = spur_tunnel::TransportPolicy::H2Only;
    c.token = Some(spur_tunnel::Token::new(token));
    c.open_wait = Duration::from_secs(3);
    c
}

/// Starts the real agent for `cluster` and waits until the hub has its session.
pub(crate) async fn start_agent(
    hub: &TestHub,
    cluster: &str,
    kube: Option<kube::Client>,
    scope: Scope,
    traffic: Option<spur_discovery::Connector>,
) -> CancellationToken {
    let mut registry = prometheus_client::registry::Registry::default();
    let agent = Agent::start(agent_client(hub, cluster), kube, scope, &mut registry).unwrap();
    let agent = match traffic {
        Some(t) => agent.with_traffic(t),
        None => agent,
    };
    let stop = hub.stop.child_token();
    let s = stop.clone();
    tokio::spawn(async move { agent.run(s).await });
    // The session comes first, the agent's reverse listener a round trip later: a stream
    // opened in between is rejected ("no reverse listener").
    wait_for(
        "the agent's session and listener",
        Duration::from_secs(20),
        || {
            hub.clusters.get(cluster).is_some_and(|s| {
                s.binds()
                    .borrow()
                    .contains_key(spur_hub::protocol::AGENT_BIND)
            })
        },
    )
    .await;
    stop
}

pub(crate) async fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A TLS connection to the hub's preview port, for `host`, offering `alpn`; from `from` when
/// given (another loopback address: another peer).
pub(crate) async fn tls(
    hub: &TestHub,
    host: &str,
    alpn: &[u8],
    from: Option<std::net::IpAddr>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = tcp_from(hub.preview, from).await?;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(hub.ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut cfg = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![alpn.to_vec()];
    let name = ServerName::try_from(host.to_owned()).unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, tcp)
        .await
}

pub(crate) async fn tcp_from(
    to: SocketAddr,
    from: Option<std::net::IpAddr>,
) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    if let Some(ip) = from {
        socket.bind(SocketAddr::new(ip, 0))?;
    }
    socket.connect(to).await
}

/// Reads until the peer closes (Ok: how long that took) or `limit` passes (Err).
pub(crate) async fn closed_within<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    limit: Duration,
) -> Result<Duration, String> {
    let start = Instant::now();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match tokio::time::timeout_at((start + limit).into(), s.read(&mut buf)).await {
            Err(_) => return Err(format!("still open after {limit:?}")),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(start.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

/// One HTTP/1.1 request over a fresh TLS connection: status, headers and body.
pub(crate) async fn request(
    hub: &TestHub,
    host: &str,
    req: http::Request<Full<Bytes>>,
) -> (http::StatusCode, http::HeaderMap, String) {
    let tls = tls(hub, host, b"http/1.1", None).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let resp = send.send_request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// A GET of `path` on `host` with `headers`.
pub(crate) async fn get(
    hub: &TestHub,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (http::StatusCode, http::HeaderMap, String) {
    // Names the hub's certificate does not cover are asked for over a connection to one it
    // does (the Host header is what the hub reads).
    let sni = if host == WEB_HOST || host.ends_with(&format!(".{DOMAIN}")) {
        host
    } else {
        WEB_HOST
    };
    let mut b = http::Request::get(path).header("host", format!("{host}:{}", hub.preview.port()));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    request(hub, sni, b.body(Full::new(Bytes::new())).unwrap()).await
}

/// A form POST of `body` to `path` on `host` with `headers`.
pub(crate) async fn post(
    hub: &TestHub,
    host: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (http::StatusCode, http::HeaderMap, String) {
    let mut b = http::Request::post(path)
        .header("host", format!("{host}:{}", hub.preview.port()))
        .header("content-type", "application/x-www-form-urlencoded");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
    request(hub, host, req).await
}

type FakeBody = BoxBody<Bytes, Infallible>;

/// A stand-in Kubernetes API: lists the sandboxes it is given, holds every watch open,
/// answers Service reads from `services` (namespace/name → type), and answers
/// SubjectAccessReviews from `grants`: (user, namespace) pairs, each allowing everything in
/// that namespace ("" for the whole cluster).
pub(crate) struct FakeKube {
    pub(crate) addr: SocketAddr,
    pub(crate) sandboxes: Arc<Mutex<Vec<serde_json::Value>>>,
    pub(crate) services: Arc<Mutex<Vec<(String, String)>>>,
    pub(crate) grants: Arc<Mutex<Vec<(String, String)>>>,
    /// Namespaces (JSON objects) of `GET /api/v1/namespaces`.
    pub(crate) namespaces: Arc<Mutex<Vec<serde_json::Value>>>,
}

impl FakeKube {
    pub(crate) async fn start() -> FakeKube {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sandboxes: Arc<Mutex<Vec<serde_json::Value>>> = Arc::default();
        let services: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let grants: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let namespaces: Arc<Mutex<Vec<serde_json::Value>>> = Arc::default();
        let (sb, sv, gr, nss) = (
            sandboxes.clone(),
            services.clone(),
            grants.clone(),
            namespaces.clone(),
        );
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (sb, sv, gr, nss) = (sb.clone(), sv.clone(), gr.clone(), nss.clone());
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let (sb, sv, gr, nss) = (sb.clone(), sv.clone(), gr.clone(), nss.clone());
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let req = http::Request::from_parts(parts, body);
                            Ok::<_, Infallible>(fake_kube_answer(&req, &sb, &sv, &gr, &nss))
                        }
                    });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service),
                );
            }
        });
        FakeKube {
            addr,
            sandboxes,
            services,
            grants,
            namespaces,
        }
    }

    /// A ready sandbox `name` forking a workload in `namespace`, whose endpoint `endpoint`
    /// targets `target`.
    pub(crate) fn add_sandbox_in(&self, name: &str, namespace: &str, endpoint: &str, target: &str) {
        self.sandboxes.lock().unwrap().push(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": name, "resourceVersion": "1"},
            "spec": {
                "forks": [{"forkOf": {"kind": "Deployment", "namespace": namespace, "name": "web"}}],
                "defaultRouteGroup": {"endpoints": [{"name": endpoint, "target": target}]},
                "capture": {"enabled": true}
            },
            "status": {"routingKey": format!("key-{name}")}
        }));
    }

    /// Lets Kubernetes user `user` do everything in `namespace` ("" for the whole cluster).
    pub(crate) fn grant(&self, user: &str, namespace: &str) {
        self.grants
            .lock()
            .unwrap()
            .push((user.to_owned(), namespace.to_owned()));
    }

    pub(crate) fn client(&self) -> kube::Client {
        let config = kube::Config::new(format!("http://{}", self.addr).parse().unwrap());
        kube::Client::try_from(config).unwrap()
    }

    /// A ready sandbox `name` whose endpoint `endpoint` targets `target`.
    pub(crate) fn add_sandbox(&self, name: &str, endpoint: &str, target: &str, public: bool) {
        self.sandboxes.lock().unwrap().push(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": name, "resourceVersion": "1"},
            "spec": {
                "forks": [{"forkOf": {"kind": "Deployment", "namespace": "default", "name": "web"}}],
                "defaultRouteGroup": {"endpoints": [
                    {"name": endpoint, "target": target, "public": public}
                ]}
            },
            "status": {"routingKey": format!("key-{name}")}
        }));
    }
}

fn fake_kube_answer(
    req: &http::Request<Bytes>,
    sandboxes: &Mutex<Vec<serde_json::Value>>,
    services: &Mutex<Vec<(String, String)>>,
    grants: &Mutex<Vec<(String, String)>>,
    namespaces: &Mutex<Vec<serde_json::Value>>,
) -> http::Response<FakeBody> {
    let path = req.uri().path();
    let json = |v: serde_json::Value| {
        http::Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(v.to_string())).boxed())
            .unwrap()
    };
    let not_found = || {
        let mut r = json(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "NotFound", "code": 404, "message": "not found"
        }));
        *r.status_mut() = http::StatusCode::NOT_FOUND;
        r
    };
    if path == "/apis/authorization.k8s.io/v1/subjectaccessreviews" {
        let review: serde_json::Value = serde_json::from_slice(req.body()).unwrap();
        let spec = &review["spec"];
        let user = spec["user"].as_str().unwrap_or_default().to_owned();
        let ns = spec["resourceAttributes"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let allowed = grants
            .lock()
            .unwrap()
            .iter()
            .any(|(u, n)| *u == user && (n.is_empty() || *n == ns));
        let mut answer = review.clone();
        answer["status"] = serde_json::json!({"allowed": allowed});
        return json(answer);
    }
    if let Some(name) = path.strip_prefix("/apis/spur.dev/v1alpha1/sandboxes/") {
        let found = sandboxes
            .lock()
            .unwrap()
            .iter()
            .find(|s| s["metadata"]["name"] == name)
            .cloned();
        return found.map_or_else(not_found, json);
    }
    if req.uri().query().is_some_and(|q| q.contains("watch=1")) {
        // A watch with nothing to say, held open.
        let body = StreamBody::new(tokio_stream::pending::<Result<Frame<Bytes>, Infallible>>());
        return http::Response::new(body.boxed());
    }
    if let Some(rest) = path.strip_prefix("/api/v1/namespaces/") {
        let parts: Vec<&str> = rest.split('/').collect();
        if let [ns, "services", name] = parts.as_slice() {
            let key = format!("{ns}/{name}");
            let found = services
                .lock()
                .unwrap()
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, t)| t.clone());
            return match found {
                Some(kind) => json(serde_json::json!({
                    "apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": name, "namespace": ns},
                    "spec": {"type": kind, "externalName": "metadata.google.internal"}
                })),
                None => not_found(),
            };
        }
    }
    let items = if path.ends_with("/sandboxes") {
        sandboxes.lock().unwrap().clone()
    } else if path == "/api/v1/namespaces" {
        namespaces.lock().unwrap().clone()
    } else {
        Vec::new()
    };
    json(serde_json::json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "List",
        "metadata": {"resourceVersion": "1"}, "items": items
    }))
}

/// An HTTP/1.1 app on loopback answering every request with `body` (as HTML) and `cookies` as
/// `Set-Cookie` headers.
pub(crate) async fn html_app(body: &'static str, cookies: &'static [&'static str]) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let service = hyper::service::service_fn(move |_req| async move {
                let mut b = http::Response::builder().header("content-type", "text/html");
                for c in cookies {
                    b = b.header("set-cookie", *c);
                }
                Ok::<_, Infallible>(
                    b.body(Full::new(Bytes::from_static(body.as_bytes())))
                        .unwrap(),
                )
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service),
            );
        }
    });
    port
}

/// Writes `bytes` and flushes.
pub(crate) async fn send<S: tokio::io::AsyncWrite + Unpin>(s: &mut S, bytes: &[u8]) {
    s.write_all(bytes).await.unwrap();
    s.flush().await.unwrap();
}

/// The agent scope of these tests: targets on loopback, by the name `localhost`.
pub(crate) fn local_scope() -> Scope {
    Scope {
        target_suffixes: vec!["localhost".into()],
        addresses: AddressPolicy {
            allow_cidrs: vec!["127.0.0.0/8".parse().unwrap()],
        },
        ..Scope::default()
    }
}

/// Waits (10 s at most) until preview `host` answers 200 to `key`: the hub's catalog has the
/// sandbox from the agent.
pub(crate) async fn until_preview_answers(hub: &TestHub, host: &str, key: &str) {
    let mut status = None;
    for _ in 0..200 {
        let (s, ..) = get(hub, host, "/", &[("x-spur-api-key", key)]).await;
        status = Some(s);
        if s == http::StatusCode::OK {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the preview never answered: last status {status:?}");
}
