//! Test peer: an in-process `spur_tunnel::TunnelServer` standing in for the tunnel proxy. It
//! serves a small TunnelApi (its workload list and Service list are set by the test) on
//! `spur-tunnel-api:443` forward streams, and dials other forward streams to loopback
//! upstreams through a name table (cluster names → 127.0.0.1). A throwaway PKI from rcgen.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use spur_proto::tunnel::tunnel_api_server::{TunnelApi, TunnelApiServer};
use spur_proto::tunnel::{
    ClusterService, HelloRequest, HelloResponse, ListServicesRequest, ListServicesResponse,
    LocalMapping, LocalWorkload, LocalWorkloads, ResolveRequest, ResolveResponse, ServicePort,
    WatchLocalWorkloadsRequest, Workload,
};
use spur_tunnel::{
    AuthMethod, ClientConfig, ClientTls, Identity, Keepalive, ServerCert, ServerConfig, ServerTls,
    SessionHandle, StaticAuthenticator, StreamHeader, Token, TunnelServer,
};
use spur_workstation::{ConnectConfig, Event, Workstation};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

pub const WAIT: Duration = Duration::from_secs(10);
pub const TOKEN: &str = "a-workstation-token-of-enough-length";
pub const WORKSTATION: &str = "alice";

pub async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(WAIT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out waiting for {what}"),
    }
}

// === PKI ===

pub struct Pki {
    pub ca: CertificateDer<'static>,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    pub fn new() -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "spur test CA");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Pki {
            ca: issuer.der().clone(),
            issuer,
        }
    }

    pub fn server_tls(&self) -> ServerTls {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        ServerTls {
            cert: ServerCert::Static {
                chain: vec![cert.der().clone()],
                key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            },
            client_ca: vec![],
            require_client_cert: false,
        }
    }
}

fn fast_keepalive() -> Keepalive {
    Keepalive {
        interval: Duration::from_millis(200),
        timeout: Duration::from_secs(2),
    }
}

// === the tunnel API, as a test peer ===

/// What the test peer's tunnel API serves; the test changes it.
#[derive(Clone)]
pub struct ApiState {
    pub workloads: watch::Sender<Vec<LocalWorkload>>,
    pub services: Arc<Mutex<Vec<ClusterService>>>,
}

struct TestApi {
    workstation: String,
    state: ApiState,
}

type WorkloadStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<LocalWorkloads, Status>> + Send>>;

#[tonic::async_trait]
impl TunnelApi for TestApi {
    async fn hello(&self, _: Request<HelloRequest>) -> Result<Response<HelloResponse>, Status> {
        Ok(Response::new(HelloResponse {
            workstation: self.workstation.clone(),
            proxy_pod: "tunnel-proxy-test-0".into(),
            cluster_domain: "cluster.local".into(),
        }))
    }

    async fn resolve(
        &self,
        _: Request<ResolveRequest>,
    ) -> Result<Response<ResolveResponse>, Status> {
        Ok(Response::new(ResolveResponse { addresses: vec![] }))
    }

    async fn list_services(
        &self,
        _: Request<ListServicesRequest>,
    ) -> Result<Response<ListServicesResponse>, Status> {
        Ok(Response::new(ListServicesResponse {
            services: self.state.services.lock().unwrap().clone(),
        }))
    }

    type WatchLocalWorkloadsStream = WorkloadStream;

    async fn watch_local_workloads(
        &self,
        _: Request<WatchLocalWorkloadsRequest>,
    ) -> Result<Response<WorkloadStream>, Status> {
        use tokio_stream::StreamExt;
        let rx = self.state.workloads.subscribe();
        let s = tokio_stream::wrappers::WatchStream::new(rx)
            .map(|workloads| Ok(LocalWorkloads { workloads }));
        Ok(Response::new(Box::pin(s)))
    }
}

// === the cluster ===

pub struct Cluster {
    pub pki: Pki,
    pub server: Arc<TunnelServer>,
    pub api: ApiState,
    /// Cluster names the peer dials, → loopback.
    pub names: Arc<Mutex<HashMap<String, IpAddr>>>,
    sessions: mpsc::Receiver<SessionHandle>,
    accept_loop: JoinHandle<()>,
    _registry: Registry,
}

impl Cluster {
    pub async fn start() -> Self {
        let pki = Pki::new();
        let auth = StaticAuthenticator::new().with_token(
            Token::new(TOKEN),
            Identity::new(WORKSTATION, AuthMethod::Token),
        );
        let mut config = ServerConfig::new(pki.server_tls(), Arc::new(auth));
        config.quic_addr = Some("127.0.0.1:0".parse().unwrap());
        config.h2_addr = Some("127.0.0.1:0".parse().unwrap());
        config.keepalive = fast_keepalive();
        config.drain_grace = Duration::from_secs(2);
        let mut registry = Registry::default();
        let server = Arc::new(TunnelServer::bind(config, &mut registry).await.unwrap());
        let api = ApiState {
            workloads: watch::Sender::new(Vec::new()),
            services: Arc::new(Mutex::new(Vec::new())),
        };
        let names = Arc::new(Mutex::new(HashMap::new()));
        let (tx, sessions) = mpsc::channel(16);
        let accept_loop = tokio::spawn(serve(server.clone(), api.clone(), names.clone(), tx));
        Cluster {
            pki,
            server,
            api,
            names,
            sessions,
            accept_loop,
            _registry: registry,
        }
    }

    pub fn name(&self, host: &str) {
        self.names
            .lock()
            .unwrap()
            .insert(host.to_owned(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    }

    pub fn client_config(&self, token: &str) -> ClientConfig {
        let mut c = ClientConfig::new(
            "localhost",
            ClientTls {
                roots: vec![self.pki.ca.clone()],
                client_cert: None,
            },
        );
        c.quic_addr = Some(self.server.quic_addr().unwrap().to_string());
        c.h2_addr = Some(self.server.h2_addr().unwrap().to_string());
        c.token = Some(Token::new(token));
        c.client_name = "spur-workstation tests".into();
        c.keepalive = fast_keepalive();
        c.drain_grace = Duration::from_secs(2);
        c
    }

    /// Everything on ephemeral loopback ports; no DNS, no state file unless the test asks.
    pub fn connect_config(&self, events: &Events) -> ConnectConfig {
        let mut c = ConnectConfig::new(self.client_config(TOKEN), "test-cluster");
        c.socks_addr = Some("127.0.0.1:0".parse().unwrap());
        c.dns_addr = None;
        c.services_refresh = Duration::from_millis(200);
        c.local_connect_timeout = Duration::from_secs(2);
        c.client_version = "test".into();
        c.on_event = Some(events.sink());
        c
    }

    pub async fn next_session(&mut self) -> SessionHandle {
        within("a tunnel session", self.sessions.recv())
            .await
            .unwrap()
    }

    pub fn set_services(&self, services: Vec<ClusterService>) {
        *self.api.services.lock().unwrap() = services;
    }

    pub fn set_workloads(&self, workloads: Vec<LocalWorkload>) {
        self.api.workloads.send_replace(workloads);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

async fn serve(
    server: Arc<TunnelServer>,
    api: ApiState,
    names: Arc<Mutex<HashMap<String, IpAddr>>>,
    sessions: mpsc::Sender<SessionHandle>,
) {
    while let Some(mut session) = server.accept().await {
        let handle = session.handle();
        let _ = sessions.try_send(handle.clone());
        let (api, names) = (api.clone(), names.clone());
        tokio::spawn(async move {
            while let Some(incoming) = session.accept().await {
                let StreamHeader::Connect { host, port } = incoming.header().clone() else {
                    incoming.reject("only connect").await;
                    continue;
                };
                let (api, names, who) =
                    (api.clone(), names.clone(), handle.identity().name.clone());
                tokio::spawn(async move {
                    if host == spur_proto::TUNNEL_API_HOST && port == spur_proto::TUNNEL_API_PORT {
                        let Ok(stream) = incoming.accept().await else {
                            return;
                        };
                        let svc = TestApi {
                            workstation: who,
                            state: api,
                        };
                        let io = tokio_stream::iter([Ok::<_, std::io::Error>(stream)]);
                        let _ = tonic::transport::Server::builder()
                            .add_service(TunnelApiServer::new(svc))
                            .serve_with_incoming(io)
                            .await;
                        return;
                    }
                    let ip = names.lock().unwrap().get(&host).copied();
                    let Some(ip) = ip.or_else(|| host.parse().ok()) else {
                        incoming.reject(&format!("host not found: {host}")).await;
                        return;
                    };
                    match TcpStream::connect((ip, port)).await {
                        Ok(mut tcp) => {
                            let Ok(mut stream) = incoming.accept().await else {
                                return;
                            };
                            let _ = tokio::io::copy_bidirectional(&mut tcp, &mut stream).await;
                        }
                        Err(e) => incoming.reject(&format!("connection refused: {e}")).await,
                    }
                });
            }
        });
    }
}

// === upstreams ===

/// A TCP echo server (echoes until EOF, then closes its side).
pub async fn echo_server() -> (SocketAddr, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    (addr, task)
}

/// An HTTP/1.1 server answering every request with its method, path and headers, one
/// `name: value` per line.
pub async fn header_echo_server() -> (SocketAddr, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: hyper::Request<hyper::body::Incoming>| async move {
                        let mut text = format!("{} {}\n", req.method(), req.uri());
                        for (k, v) in req.headers() {
                            text.push_str(&format!("{}: {}\n", k, v.to_str().unwrap_or("?")));
                        }
                        Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from(text))))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, task)
}

/// A loopback port nothing listens on.
pub async fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap().port()
}

pub async fn echo_once(stream: &mut (impl AsyncRead + AsyncWrite + Unpin), msg: &[u8]) -> Vec<u8> {
    stream.write_all(msg).await.unwrap();
    stream.shutdown().await.unwrap();
    let mut back = Vec::new();
    within("the echo", stream.read_to_end(&mut back))
        .await
        .unwrap();
    back
}

// === the workstation's events and status ===

/// Records events for assertions.
#[derive(Clone, Default)]
pub struct Events {
    seen: Arc<Mutex<Vec<Event>>>,
    notify: Arc<tokio::sync::Notify>,
}

impl Events {
    pub fn sink(&self) -> spur_workstation::EventSink {
        let (seen, notify) = (self.seen.clone(), self.notify.clone());
        Arc::new(move |e: &Event| {
            seen.lock().unwrap().push(e.clone());
            notify.notify_waiters();
        })
    }

    pub fn all(&self) -> Vec<Event> {
        self.seen.lock().unwrap().clone()
    }

    pub fn count(&self, f: impl Fn(&Event) -> bool) -> usize {
        self.seen.lock().unwrap().iter().filter(|e| f(e)).count()
    }

    pub async fn wait_for(&self, what: &str, f: impl Fn(&Event) -> bool) -> Event {
        within(what, async {
            loop {
                let notified = self.notify.notified();
                if let Some(e) = self.seen.lock().unwrap().iter().find(|e| f(e)) {
                    return e.clone();
                }
                notified.await;
            }
        })
        .await
    }
}

pub async fn wait_status(
    ws: &Workstation,
    what: &str,
    f: impl Fn(&spur_workstation::state::Status) -> bool,
) -> spur_workstation::state::Status {
    let mut rx = ws.status();
    within(what, rx.wait_for(|s| f(s))).await.unwrap().clone()
}

// === builders ===

pub fn service(ns: &str, name: &str, ports: &[u16]) -> ClusterService {
    ClusterService {
        namespace: ns.into(),
        name: name.into(),
        ports: ports
            .iter()
            .map(|p| ServicePort {
                name: format!("p{p}"),
                port: u32::from(*p),
                protocol: "TCP".into(),
            })
            .collect(),
    }
}

pub fn workload(ns: &str, ew: &str, mappings: &[(u16, String)]) -> LocalWorkload {
    LocalWorkload {
        sandbox: "my-sandbox".into(),
        routing_key: "k3y".into(),
        name: "api".into(),
        namespace: ns.into(),
        external_workload: ew.into(),
        baseline: Some(Workload {
            kind: "Deployment".into(),
            namespace: ns.into(),
            name: "api".into(),
        }),
        mappings: mappings
            .iter()
            .map(|(port, to_local)| LocalMapping {
                port: u32::from(*port),
                to_local: to_local.clone(),
                bind_id: format!("{ns}/{ew}/{port}"),
            })
            .collect(),
    }
}

/// An HTTP/1.1 server that answers `Upgrade: echo` with 101 (echoing the request's `baggage`
/// in the response) and then echoes raw bytes on the upgraded connection.
pub async fn upgrade_echo_server() -> (SocketAddr, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |mut req: hyper::Request<hyper::body::Incoming>| async move {
                        let baggage = req.headers().get("baggage").cloned();
                        let on_upgrade = hyper::upgrade::on(&mut req);
                        tokio::spawn(async move {
                            if let Ok(up) = on_upgrade.await {
                                let mut io = TokioIo::new(up);
                                let mut buf = [0u8; 1024];
                                while let Ok(n) = io.read(&mut buf).await {
                                    if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                                        break;
                                    }
                                }
                                let _ = io.shutdown().await;
                            }
                        });
                        let mut resp = hyper::Response::new(Full::new(Bytes::new()));
                        *resp.status_mut() = hyper::StatusCode::SWITCHING_PROTOCOLS;
                        resp.headers_mut()
                            .insert("upgrade", hyper::header::HeaderValue::from_static("echo"));
                        resp.headers_mut().insert(
                            "connection",
                            hyper::header::HeaderValue::from_static("upgrade"),
                        );
                        if let Some(b) = baggage {
                            resp.headers_mut().insert("x-seen-baggage", b);
                        }
                        Ok::<_, Infallible>(resp)
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .with_upgrades()
                    .await;
            });
        }
    });
    (addr, task)
}
