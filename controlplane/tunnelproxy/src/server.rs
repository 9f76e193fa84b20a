//! The tunnel proxy at run time: accepts workstation sessions (QUIC or HTTP/2 over TLS,
//! `spur-tunnel`), authenticates them with workstation tokens (or client certificates from the
//! operator's CA), and for each session:
//! - serves the tunnel API on `spur-tunnel-api:443` streams;
//! - dials the cluster for every other forward stream (laptop → cluster);
//! - opens a TCP listener per authorized reverse binding, carries each connection to the
//!   workstation, and reports the listeners in the session's Lease (cluster → laptop).
//!
//! It also serves SOCKS5 (username = workstation, password = its token; `server/socks.rs`).
//! A tunnel grant's sessions dial only their namespace's Services and pods (crate::scope).
//! Every connection ends with one audit line (target `spur_audit`): who, from, to, bytes both
//! ways, duration, outcome.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use kube::Client;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use spur_forward::{DialError, ForwardConfig, Target};
use spur_proto::tunnel::tunnel_api_server::TunnelApiServer;
use spur_tunnel::{
    AuthError, AuthFuture, AuthMethod, AuthRequest, Authenticator, Identity, Incoming,
    ServerConfig, ServerTls, SessionHandle, StreamHeader, Transport, TunnelServer,
};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::api::{Caches, TunnelApiService};
use crate::destinations::{Destinations, dial_cluster};
use crate::scope::Owners;
use crate::sessions::SessionReporter;
use crate::sources::{ReverseSources, ReverseSourcesConfig};

mod reverse;
mod socks;

use crate::tokens::{TokenError, TokenStore};
use reverse::track_binds;
use socks::ClusterDialer;

/// Where and how the tunnel proxy runs.
pub struct TunnelProxyConfig {
    /// Its namespace: session Leases live here.
    pub namespace: String,
    /// Where the workstation token Secrets are: a namespace of their own in the chart, so that
    /// the tunnel proxy, which must list Secrets to find them, cannot read any other Secret
    /// (the CA's key is in `namespace`).
    pub token_namespace: String,
    /// This replica's pod name and IP (the Lease's holder and the EndpointSlices' address).
    pub pod_name: String,
    pub pod_ip: IpAddr,
    /// This replica's pod UID: when known, the pod owns its session Leases.
    pub pod_uid: Option<String>,
    pub quic_addr: Option<SocketAddr>,
    pub h2_addr: Option<SocketAddr>,
    /// SOCKS5 + HTTP CONNECT listener; `None` disables it.
    pub socks_addr: Option<SocketAddr>,
    /// Address reverse listeners bind (their ports are reported in the Lease).
    pub reverse_bind: IpAddr,
    /// Ports reverse listeners take (so that a NetworkPolicy can name them); `None`: ephemeral.
    pub reverse_ports: Option<std::ops::RangeInclusive<u16>>,
    /// Who may connect to reverse listeners besides sidecar pods of the bind's namespace.
    pub reverse_sources: ReverseSourcesConfig,
    pub tls: ServerTls,
    /// Session Leases are valid this long and renewed every third of it.
    pub lease_duration: Duration,
    pub cluster_domain: String,
    /// Time a dial into the cluster may take.
    pub dial_timeout: Duration,
    /// Fixed addresses for `host:port` targets, used instead of DNS (like curl's `--resolve`):
    /// for proxies outside the cluster's DNS, and tests.
    pub resolve: std::collections::HashMap<String, SocketAddr>,
    /// Where workstations may connect through the proxy, checked after name resolution.
    pub destinations: Destinations,
}

impl TunnelProxyConfig {
    /// Parses `FIRST-LAST` (empty: `None`, ephemeral ports).
    pub fn parse_port_range(s: &str) -> Result<Option<std::ops::RangeInclusive<u16>>, Error> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(None);
        }
        let bad = || {
            Error::Config(format!(
                "{s:?} is not a port range FIRST-LAST (like 20000-29999, FIRST <= LAST, FIRST > 0)"
            ))
        };
        let (first, last) = s.split_once('-').ok_or_else(bad)?;
        let first: u16 = first.trim().parse().map_err(|_| bad())?;
        let last: u16 = last.trim().parse().map_err(|_| bad())?;
        if first == 0 || first > last {
            return Err(bad());
        }
        Ok(Some(first..=last))
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Direction {
    direction: &'static str,
}

/// Connection metrics (the tunnel library counts sessions and streams itself).
#[derive(Clone, Default)]
struct Metrics {
    total: Family<Kind, Counter>,
    active: Family<Kind, Gauge>,
    bytes: Family<Direction, Counter>,
    refused: Counter,
    revoked: Counter,
    reverse_refused: Counter,
}

impl Metrics {
    fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics::default();
        registry.register(
            "connections",
            "Connections carried, by kind (forward, reverse, socks, api)",
            m.total.clone(),
        );
        registry.register(
            "active_connections",
            "Connections open now, by kind",
            m.active.clone(),
        );
        registry.register(
            "bytes",
            "Bytes carried, by direction (to_cluster, to_workstation)",
            m.bytes.clone(),
        );
        registry.register(
            "refused_sessions",
            "Sessions refused by authentication",
            m.refused.clone(),
        );
        registry.register(
            "revoked_sessions",
            "Open sessions closed because their credentials were revoked",
            m.revoked.clone(),
        );
        registry.register(
            "reverse_refused_connections",
            "Connections to reverse listeners refused because their source is neither a sidecar \
             pod of the bind's namespace nor a Spur gateway",
            m.reverse_refused.clone(),
        );
        m
    }
}

/// One audit line per connection (and per refused session).
struct Audit<'a> {
    kind: &'a str,
    who: &'a str,
    from: &'a str,
    to: &'a str,
    to_cluster: u64,
    to_workstation: u64,
    took: Duration,
    outcome: &'a str,
}

fn audit(a: Audit<'_>) {
    tracing::info!(
        target: "spur_audit",
        kind = a.kind,
        who = a.who,
        from = a.from,
        to = a.to,
        bytes_to_cluster = a.to_cluster,
        bytes_to_workstation = a.to_workstation,
        duration_ms = u64::try_from(a.took.as_millis()).unwrap_or(u64::MAX),
        outcome = a.outcome,
        "connection"
    );
}

/// Workstation tokens (and, when the TLS config has a client CA, client certificates) decide
/// who a session is; bindings are authorized against the workstation's ExternalWorkloads.
struct KubeAuthenticator {
    tokens: TokenStore,
    caches: Caches,
    metrics: Metrics,
}

impl KubeAuthenticator {
    /// Who the credentials name, before revocations.
    fn identify(&self, req: &AuthRequest<'_>) -> Result<Identity, AuthError> {
        if let Some(cert) = req.client_cert {
            let identity = spur_tunnel::identity_from_cert(cert)?;
            // The operator's CA signs other client certificates too (xDS clients,
            // `system:spur:xds:<ns>`): only a workstation's name is a session identity.
            // Workstation names are DNS labels, as the workstation signer issues them.
            if !spur_api::validation::is_dns_label(&identity.name) {
                return Err(AuthError::Unauthenticated(format!(
                    "client certificate of {:?} is not a workstation's",
                    identity.name
                )));
            }
            if identity.expires_at.is_some_and(|t| SystemTime::now() >= t) {
                return Err(AuthError::Expired(format!(
                    "client certificate of {} has expired",
                    identity.name
                )));
            }
            return Ok(identity);
        }
        let Some(token) = req.token else {
            return Err(AuthError::Unauthenticated(
                "no token and no client certificate".into(),
            ));
        };
        match self.tokens.lookup(token.expose(), SystemTime::now()) {
            Ok(w) => {
                let mut identity = Identity::new(w.name, AuthMethod::Token);
                if let Some(at) = w.expires_at {
                    identity = identity.expiring_at(at);
                }
                if let Some(at) = w.issued_at {
                    identity = identity.issued(at);
                }
                // A tunnel grant's session reaches only the grant's namespace (crate::scope).
                if let Some(namespace) = w.scope {
                    identity = identity.scoped(namespace);
                }
                Ok(identity)
            }
            Err(TokenError::Unknown) => Err(AuthError::Unauthenticated("unknown token".into())),
            Err(e @ TokenError::Expired(_)) => Err(AuthError::Expired(e.to_string())),
            Err(e @ TokenError::GrantWithoutNamespace(_)) => {
                Err(AuthError::Unauthenticated(e.to_string()))
            }
        }
    }
}

impl Authenticator for KubeAuthenticator {
    fn authenticate<'a>(&'a self, req: AuthRequest<'a>) -> AuthFuture<'a> {
        let result = (|| {
            let identity = self.identify(&req)?;
            if self.tokens.is_revoked(&identity.name, identity.issued_at) {
                return Err(AuthError::Unauthenticated(format!(
                    "the credentials of workstation {} are revoked",
                    identity.name
                )));
            }
            Ok(identity)
        })();
        if let Err(e) = &result {
            self.metrics.refused.inc();
            audit(Audit {
                kind: "session",
                who: "-",
                from: &req.peer.to_string(),
                to: "-",
                to_cluster: 0,
                to_workstation: 0,
                took: Duration::ZERO,
                outcome: &format!("refused: {e}"),
            });
        }
        Box::pin(async move { result })
    }

    fn handshake_failed(&self, peer: SocketAddr, transport: Transport, error: &str) {
        self.metrics.refused.inc();
        audit(Audit {
            kind: "session",
            who: "-",
            from: &peer.to_string(),
            to: "-",
            to_cluster: 0,
            to_workstation: 0,
            took: Duration::ZERO,
            outcome: &format!("refused: {transport}: {error}"),
        });
    }

    fn authorize_bind(
        &self,
        identity: &Identity,
        bind: &str,
        _meta: &str,
    ) -> Result<(), AuthError> {
        self.caches
            .authorize_bind(&identity.name, bind)
            .map(|_| ())
            .map_err(AuthError::Forbidden)
    }
}

/// Starts the tunnel proxy; it runs until `stop` and [`RunningProxy::stopped`] returns once
/// it has drained its sessions.
///
/// The tunnel itself (listeners, sessions, dials, copies) runs on the calling task's runtime.
/// The Kubernetes side (the token, Service and ExternalWorkload watches, and the tunnel
/// Leases) runs on `control`, so listing and parsing a large cluster's objects never stalls a
/// tunnel. `spur-tunnel-proxy` gives each a thread of its own; `control` may also be the
/// calling runtime's handle.
pub async fn run(
    client: Client,
    config: TunnelProxyConfig,
    control: tokio::runtime::Handle,
    registry: &mut Registry,
    stop: CancellationToken,
) -> Result<RunningProxy, Error> {
    let joined = |e: tokio::task::JoinError| Error::Kube(format!("watch start-up failed: {e}"));
    let tokens = {
        let (client, namespace, stop) =
            (client.clone(), config.token_namespace.clone(), stop.clone());
        control
            .spawn(async move { TokenStore::start(client, &namespace, stop).await })
            .await
            .map_err(joined)??
    };
    let caches = control
        .spawn(Caches::start(client.clone(), stop.clone()))
        .await
        .map_err(joined)??;
    let sources = control
        .spawn(ReverseSources::start(
            client.clone(),
            config.reverse_sources,
            stop.clone(),
        ))
        .await
        .map_err(joined)??;
    let metrics = Metrics::register(registry.sub_registry_with_prefix("tunnel_proxy"));
    let auth = Arc::new(KubeAuthenticator {
        tokens: tokens.clone(),
        caches: caches.clone(),
        metrics: metrics.clone(),
    });
    let mut server_config = ServerConfig::new(config.tls, auth);
    server_config.quic_addr = config.quic_addr;
    server_config.h2_addr = config.h2_addr;
    let server = Arc::new(
        TunnelServer::bind(server_config, registry.sub_registry_with_prefix("tunnel"))
            .await
            .map_err(|e| Error::Config(format!("tunnel listeners: {e}")))?,
    );
    let shared = Arc::new(Shared {
        client,
        control,
        namespace: config.namespace,
        pod_name: config.pod_name,
        pod_ip: config.pod_ip,
        pod_uid: config.pod_uid,
        reverse_bind: config.reverse_bind,
        reverse_ports: config.reverse_ports,
        next_reverse_port: std::sync::atomic::AtomicU32::new(0),
        owners: Owners::new(caches.service_ips(), sources.clone()),
        sources,
        lease_duration: config.lease_duration,
        cluster_domain: config.cluster_domain,
        dial_timeout: config.dial_timeout,
        caches,
        metrics: metrics.clone(),
        resolve: Arc::new(config.resolve),
        destinations: Arc::new(config.destinations.denying(config.pod_ip)),
        tokens: tokens.clone(),
        live: std::sync::Mutex::new(std::collections::HashMap::new()),
        next_session: std::sync::atomic::AtomicU64::new(0),
    });
    tokio::spawn(close_revoked(shared.clone(), stop.clone()));
    let socks_addr = match config.socks_addr {
        Some(addr) => {
            let l = TcpListener::bind(addr)
                .await
                .map_err(|e| Error::Config(format!("cannot bind SOCKS listener {addr}: {e}")))?;
            let local = l.local_addr().ok();
            let dialer = Arc::new(ClusterDialer {
                tokens,
                resolve: shared.resolve.clone(),
                destinations: shared.destinations.clone(),
                owners: shared.owners.clone(),
                dial_timeout: shared.dial_timeout,
                metrics: metrics.clone(),
            });
            let drain = spur_runtime::Drain::new();
            let d2 = drain.clone();
            let s2 = stop.clone();
            tokio::spawn(async move {
                s2.cancelled().await;
                d2.start();
            });
            tokio::spawn(spur_forward::serve_forward(
                l,
                dialer,
                ForwardConfig::default(),
                drain,
            ));
            local
        }
        None => None,
    };
    let quic = server.quic_addr();
    let h2 = server.h2_addr();
    let accept_server = server.clone();
    let accept_stop = stop.clone();
    let task = tokio::spawn(async move {
        loop {
            let session = tokio::select! {
                () = accept_stop.cancelled() => break,
                s = accept_server.accept() => match s {
                    Some(s) => s,
                    None => break,
                },
            };
            tokio::spawn(serve_session(session, shared.clone()));
        }
        accept_server.shutdown(Duration::from_secs(10)).await;
    });
    tracing::info!(quic = ?quic, h2 = ?h2, socks = ?socks_addr, "tunnel proxy listening");
    Ok(RunningProxy {
        quic_addr: quic,
        h2_addr: h2,
        socks_addr,
        server,
        task,
    })
}

/// A started tunnel proxy.
pub struct RunningProxy {
    pub quic_addr: Option<SocketAddr>,
    pub h2_addr: Option<SocketAddr>,
    pub socks_addr: Option<SocketAddr>,
    server: Arc<TunnelServer>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningProxy {
    /// New serving certificate and client CA for connections accepted from now on (a rotated
    /// Secret); established sessions keep theirs. On an error nothing changes.
    pub fn reload_tls(&self, tls: &spur_tunnel::ServerTls) -> Result<(), Error> {
        self.server
            .reload_tls(tls)
            .map_err(|e| Error::Config(format!("tunnel TLS: {e}")))
    }

    /// Waits until the proxy has drained after its stop token was cancelled.
    pub async fn stopped(self) {
        let _ = self.task.await;
    }
}

struct Shared {
    client: Client,
    /// Where the Kubernetes side runs (see [`run`]).
    control: tokio::runtime::Handle,
    namespace: String,
    pod_name: String,
    pod_ip: IpAddr,
    pod_uid: Option<String>,
    reverse_bind: IpAddr,
    reverse_ports: Option<std::ops::RangeInclusive<u16>>,
    /// Where the next reverse listener starts looking in `reverse_ports`.
    next_reverse_port: std::sync::atomic::AtomicU32,
    sources: ReverseSources,
    /// Whose Service and pod addresses are whose, for tunnel grants' sessions.
    owners: Owners,
    lease_duration: Duration,
    cluster_domain: String,
    dial_timeout: Duration,
    caches: Caches,
    metrics: Metrics,
    resolve: Arc<std::collections::HashMap<String, SocketAddr>>,
    destinations: Arc<Destinations>,
    tokens: TokenStore,
    /// Open sessions, to close those whose credentials get revoked.
    live: std::sync::Mutex<std::collections::HashMap<u64, spur_tunnel::SessionHandle>>,
    next_session: std::sync::atomic::AtomicU64,
}

/// How long a session whose credentials were revoked gets to wind down.
const REVOKED_GRACE: Duration = Duration::from_secs(1);

/// Closes the open sessions whose credentials a revocation covers, whenever the token store
/// changes, until `stop`.
async fn close_revoked(shared: Arc<Shared>, stop: CancellationToken) {
    let mut changes = shared.tokens.changes();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            r = changes.changed() => if r.is_err() { return },
        }
        let revoked: Vec<spur_tunnel::SessionHandle> = match shared.live.lock() {
            Ok(live) => live
                .values()
                .filter(|h| {
                    let id = h.identity();
                    shared.tokens.is_revoked(&id.name, id.issued_at)
                })
                .cloned()
                .collect(),
            Err(_) => continue,
        };
        for handle in revoked {
            shared.metrics.revoked.inc();
            tracing::info!(workstation = %handle.identity().name, peer = %handle.peer(), "credentials revoked: closing the session");
            tokio::spawn(async move {
                handle.close("credentials revoked", REVOKED_GRACE).await;
            });
        }
    }
}

async fn serve_session(mut session: spur_tunnel::Session, shared: Arc<Shared>) {
    let handle = session.handle();
    let id = shared
        .next_session
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if let Ok(mut live) = shared.live.lock() {
        live.insert(id, handle.clone());
    }
    // A revocation that landed between authentication and registration.
    if shared
        .tokens
        .is_revoked(&handle.identity().name, handle.identity().issued_at)
    {
        handle.close("credentials revoked", REVOKED_GRACE).await;
    }
    let who = handle.identity().name.clone();
    let peer = handle.peer();
    tracing::info!(workstation = %who, %peer, transport = %handle.transport(), "workstation connected");
    let reporter = {
        // The Lease task runs on the control runtime, with the watches.
        let _control = shared.control.enter();
        SessionReporter::start(
            shared.client.clone(),
            &shared.namespace,
            &who,
            &shared.pod_name,
            &shared.pod_ip.to_string(),
            shared.pod_uid.as_deref(),
            shared.lease_duration,
        )
    };
    let listeners_stop = CancellationToken::new();
    let binds_task = tokio::spawn(track_binds(
        handle.clone(),
        shared.clone(),
        reporter,
        listeners_stop.clone(),
    ));
    while let Some(incoming) = session.accept().await {
        let shared = shared.clone();
        let handle = handle.clone();
        tokio::spawn(async move { forward(incoming, handle, &shared).await });
    }
    let reason = handle.closed().await;
    if let Ok(mut live) = shared.live.lock() {
        live.remove(&id);
    }
    listeners_stop.cancel();
    if let Ok(reporter) = binds_task.await {
        let _ = reporter.close().await;
    }
    tracing::info!(workstation = %who, %peer, reason = ?reason, "workstation disconnected");
}

/// A forward stream: the tunnel API, or a dial into the cluster.
async fn forward(incoming: Incoming, handle: SessionHandle, shared: &Shared) {
    let started = Instant::now();
    let who = handle.identity().name.clone();
    let from = format!("tunnel:{}", handle.peer());
    let StreamHeader::Connect { host, port } = incoming.header().clone() else {
        incoming.reject("only connect streams are accepted").await;
        return;
    };
    if host == spur_proto::TUNNEL_API_HOST && port == spur_proto::TUNNEL_API_PORT {
        let Ok(stream) = incoming.accept().await else {
            return;
        };
        let service = TunnelApiService {
            workstation: who,
            proxy_pod: shared.pod_name.clone(),
            cluster_domain: shared.cluster_domain.clone(),
            caches: shared.caches.clone(),
            scope: handle.identity().scope.clone(),
        };
        shared
            .metrics
            .total
            .get_or_create(&Kind { kind: "api" })
            .inc();
        let io = futures_util::stream::iter([Ok::<_, std::io::Error>(stream)]);
        if let Err(e) = tonic::transport::Server::builder()
            .add_service(TunnelApiServer::new(service))
            .serve_with_incoming(io)
            .await
        {
            tracing::debug!(error = %e, "tunnel API connection ended");
        }
        return;
    }
    let target = Target::Host(host.clone(), port);
    // Checked per stream, so a grant's open session follows the Service and pod watches.
    let scope = handle
        .identity()
        .scope
        .as_deref()
        .map(|namespace| (&shared.owners, namespace));
    match tokio::time::timeout(
        shared.dial_timeout,
        dial_cluster(&shared.resolve, &shared.destinations, scope, &host, port),
    )
    .await
    {
        Ok(Ok(tcp)) => {
            let _ = tcp.set_nodelay(true);
            let Ok(stream) = incoming.accept().await else {
                return;
            };
            let (up, down, outcome) = carry(tcp, stream, "forward", &shared.metrics).await;
            audit(Audit {
                kind: "forward",
                who: &who,
                from: &from,
                to: &target.to_string(),
                to_cluster: down,
                to_workstation: up,
                took: started.elapsed(),
                outcome: &outcome,
            });
        }
        Ok(Err(e)) => {
            let why = DialError::from_io(&target, &e).to_string();
            incoming.reject(&why).await;
            audit(Audit {
                kind: "forward",
                who: &who,
                from: &from,
                to: &target.to_string(),
                to_cluster: 0,
                to_workstation: 0,
                took: started.elapsed(),
                outcome: &format!("dial: {why}"),
            });
        }
        Err(_) => {
            incoming.reject("dial timed out").await;
            audit(Audit {
                kind: "forward",
                who: &who,
                from: &from,
                to: &target.to_string(),
                to_cluster: 0,
                to_workstation: 0,
                took: started.elapsed(),
                outcome: "dial: timed out",
            });
        }
    }
}

/// Splices a cluster TCP connection and a tunnel stream; returns (bytes the cluster side sent,
/// bytes the workstation sent, outcome).
async fn carry(
    mut tcp: TcpStream,
    mut stream: spur_tunnel::Stream,
    kind: &'static str,
    metrics: &Metrics,
) -> (u64, u64, String) {
    let k = Kind { kind };
    metrics.total.get_or_create(&k).inc();
    metrics.active.get_or_create(&k).inc();
    let r = stream.splice(&mut tcp).await;
    metrics.active.get_or_create(&k).dec();
    match r {
        // The TCP side is always the cluster's: what it sends goes to the workstation.
        Ok((from_tcp, from_tunnel)) => {
            metrics
                .bytes
                .get_or_create(&Direction {
                    direction: "to_workstation",
                })
                .inc_by(from_tcp);
            metrics
                .bytes
                .get_or_create(&Direction {
                    direction: "to_cluster",
                })
                .inc_by(from_tunnel);
            (from_tcp, from_tunnel, "ok".into())
        }
        Err(e) => (0, 0, format!("stream: {e}")),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn port_ranges_parse_or_say_what_they_should_look_like() {
        assert_eq!(
            TunnelProxyConfig::parse_port_range(" 20000-29999 ").unwrap(),
            Some(20000..=29999)
        );
        assert_eq!(TunnelProxyConfig::parse_port_range("").unwrap(), None);
        for bad in ["20000", "0-10", "30000-20000", "a-b", "1-70000"] {
            let e = TunnelProxyConfig::parse_port_range(bad).unwrap_err();
            assert!(e.to_string().contains("FIRST-LAST"), "{bad}: {e}");
        }
    }
}
