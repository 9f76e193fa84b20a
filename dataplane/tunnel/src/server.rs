//! The in-cluster end: QUIC and HTTP/2-over-TLS listeners, handshake and authentication, and
//! the sessions handed to the tunnel proxy.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::registry::Registry;
use rustls::pki_types::CertificateDer;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::Transport;
use crate::auth::{AuthError, AuthRequest, Authenticator, Identity};
use crate::config::{Keepalive, Limits, ServerConfig};
use crate::error::Error;
use crate::error::RefusalCode;
use crate::handshakes::Handshakes;
use crate::metrics::Metrics;
use crate::session::{
    Binds, CloseReason, Conn, Phase, Role, ServerRole, SessionParts, Shared, lock,
};
use crate::stream::{Incoming, RawRecv, RawSend, Stream};
use crate::tls::{self, LINGER};
use crate::wire::{self, Control, PROTOCOL_VERSION, StreamHeader};

mod listen;

use listen::{h2_listener, quic_listener};

/// The tunnel server. Dropping it aborts every session at once; [`TunnelServer::shutdown`]
/// drains them first.
pub struct TunnelServer {
    inner: Arc<Inner>,
    sessions: tokio::sync::Mutex<mpsc::Receiver<Session>>,
    quic_addr: Option<SocketAddr>,
    h2_addr: Option<SocketAddr>,
}

struct Inner {
    authenticator: Arc<dyn Authenticator>,
    limits: Arc<Limits>,
    keepalive: Keepalive,
    handshake_timeout: Duration,
    drain_grace: Duration,
    max_sessions: usize,
    metrics: Metrics,
    live: Mutex<HashMap<u64, Arc<Shared>>>,
    next_id: AtomicU64,
    sessions_tx: mpsc::Sender<Session>,
    /// Stops the accept loops.
    stop: CancellationToken,
    /// Parent of every session's token: aborts them all.
    kill: CancellationToken,
    endpoint: Option<quinn::Endpoint>,
    /// The QUIC transport settings, kept for [`TunnelServer::reload_tls`].
    quic_transport: Arc<quinn::TransportConfig>,
    /// The HTTP/2 listener's TLS configuration; each accepted connection takes the current one.
    h2_tls: Mutex<Arc<rustls::ServerConfig>>,
}

impl TunnelServer {
    /// Validates `config`, binds the listeners and starts accepting. Metrics are registered
    /// into `registry` (give it a prefix, e.g. `registry.sub_registry_with_prefix("tunnel")`).
    pub async fn bind(config: ServerConfig, registry: &mut Registry) -> Result<Self, Error> {
        config.validate()?;
        let tls = tls::server_configs(&config.tls)?;
        let metrics = Metrics::server(registry);
        let (sessions_tx, sessions) = mpsc::channel(config.session_queue);

        let quic_transport = Arc::new(tls::quic_transport(
            &config.limits,
            &config.keepalive,
            config.congestion,
        )?);
        let endpoint = match config.quic_addr {
            Some(addr) => {
                let mut server = quinn::ServerConfig::with_crypto(Arc::new(tls.quic));
                server.transport_config(quic_transport.clone());
                let endpoint = crate::udp::endpoint(addr, Some(server))
                    .map_err(|source| Error::Bind { addr, source })?;
                Some(endpoint)
            }
            None => None,
        };
        let quic_addr = match &endpoint {
            Some(e) => Some(e.local_addr()?),
            None => None,
        };
        let listener = match config.h2_addr {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| Error::Bind { addr, source })?,
            ),
            None => None,
        };
        let h2_addr = match &listener {
            Some(l) => Some(l.local_addr()?),
            None => None,
        };

        let inner = Arc::new(Inner {
            authenticator: config.authenticator,
            limits: Arc::new(config.limits),
            keepalive: config.keepalive,
            handshake_timeout: config.handshake_timeout,
            drain_grace: config.drain_grace,
            max_sessions: config.max_sessions,
            metrics,
            live: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            sessions_tx,
            stop: CancellationToken::new(),
            kill: CancellationToken::new(),
            endpoint: endpoint.clone(),
            quic_transport,
            h2_tls: Mutex::new(tls.h2),
        });
        let handshakes = Handshakes::new(config.max_handshakes, config.max_handshakes_per_peer);
        if let Some(endpoint) = endpoint {
            tokio::spawn(quic_listener(inner.clone(), endpoint, handshakes.clone()));
        }
        if let Some(listener) = listener {
            tokio::spawn(h2_listener(inner.clone(), listener, handshakes));
        }
        info!(?quic_addr, ?h2_addr, "tunnel server listening");
        Ok(TunnelServer {
            inner,
            sessions: tokio::sync::Mutex::new(sessions),
            quic_addr,
            h2_addr,
        })
    }

    /// Replaces the certificate and client CA of both listeners: connections accepted from now
    /// on use `tls`, established sessions keep theirs. On an error nothing changes.
    pub fn reload_tls(&self, tls: &crate::ServerTls) -> Result<(), Error> {
        let configs = tls::server_configs(tls)?;
        if self.inner.stop.is_cancelled() {
            // Draining: the QUIC endpoint must keep refusing new connections.
            return Ok(());
        }
        if let Some(endpoint) = &self.inner.endpoint {
            let mut server = quinn::ServerConfig::with_crypto(Arc::new(configs.quic));
            server.transport_config(self.inner.quic_transport.clone());
            endpoint.set_server_config(Some(server));
        }
        *lock(&self.inner.h2_tls) = configs.h2;
        Ok(())
    }

    /// The bound QUIC (UDP) address, if QUIC is enabled.
    pub fn quic_addr(&self) -> Option<SocketAddr> {
        self.quic_addr
    }

    /// The bound HTTP/2-over-TLS (TCP) address, if enabled.
    pub fn h2_addr(&self) -> Option<SocketAddr> {
        self.h2_addr
    }

    /// The next authenticated session. `None` once the server is shut down. Concurrent
    /// callers take turns.
    pub async fn accept(&self) -> Option<Session> {
        let mut sessions = self.sessions.lock().await;
        tokio::select! {
            biased;
            s = sessions.recv() => s,
            _ = self.inner.stop.cancelled() => None,
        }
    }

    /// Handles of all established sessions.
    pub fn sessions(&self) -> Vec<SessionHandle> {
        lock(&self.inner.live)
            .values()
            .map(|s| SessionHandle { shared: s.clone() })
            .collect()
    }

    /// Stops accepting, sends goaway to every session, waits up to `grace` for their streams
    /// to finish, then closes whatever is left.
    pub async fn shutdown(&self, grace: Duration) {
        self.inner.stop.cancel();
        if let Some(endpoint) = &self.inner.endpoint {
            // New QUIC connections are refused from here on.
            endpoint.set_server_config(None);
        }
        let live: Vec<_> = lock(&self.inner.live).values().cloned().collect();
        for s in &live {
            s.goaway("server shutting down", grace);
        }
        let all_closed = async {
            for s in &live {
                s.closed().await;
            }
        };
        let _ = tokio::time::timeout(grace + LINGER, all_closed).await;
        self.inner.kill.cancel();
        for s in &live {
            s.finish(CloseReason::Aborted("server shut down".into()));
        }
        if let Some(endpoint) = &self.inner.endpoint {
            endpoint.close(0u8.into(), b"shutdown");
            let _ = tokio::time::timeout(LINGER, endpoint.wait_idle()).await;
        }
    }
}

impl Drop for TunnelServer {
    fn drop(&mut self) {
        self.inner.stop.cancel();
        self.inner.kill.cancel();
        for s in lock(&self.inner.live).values() {
            s.finish(CloseReason::Aborted("server dropped".into()));
        }
        if let Some(endpoint) = &self.inner.endpoint {
            endpoint.close(0u8.into(), b"server dropped");
        }
    }
}

// === sessions ===

/// An authenticated session: accept forward streams from it, open reverse streams to it.
pub struct Session {
    handle: SessionHandle,
    incoming: mpsc::Receiver<Incoming>,
}

impl Session {
    /// The next forward stream the client opened (`StreamHeader::Connect`). Answer it with
    /// [`Incoming::accept`] after connecting to the target, or [`Incoming::reject`] with the
    /// reason. `None` once the session is closed.
    pub async fn accept(&mut self) -> Option<Incoming> {
        let shared = &self.handle.shared;
        tokio::select! {
            biased;
            i = self.incoming.recv() => i,
            _ = shared.cancel.cancelled() => None,
        }
    }

    /// A cheap, cloneable handle for everything but `accept`.
    pub fn handle(&self) -> SessionHandle {
        self.handle.clone()
    }
}

impl std::ops::Deref for Session {
    type Target = SessionHandle;

    fn deref(&self) -> &SessionHandle {
        &self.handle
    }
}

/// Cloneable handle to a server-side session.
#[derive(Clone)]
pub struct SessionHandle {
    shared: Arc<Shared>,
}

impl SessionHandle {
    fn server(&self) -> &ServerRole {
        match &self.shared.role {
            Role::Server(s) => s,
            // Only the server constructs handles, always with a server role.
            Role::Client(_) => unreachable!("server session handle with a client role"),
        }
    }

    pub fn id(&self) -> u64 {
        self.shared.id
    }

    pub fn identity(&self) -> &Identity {
        &self.server().identity
    }

    /// The name the client gave itself (informational).
    pub fn client_name(&self) -> &str {
        &self.server().client_name
    }

    pub fn peer(&self) -> SocketAddr {
        self.shared.peer
    }

    pub fn transport(&self) -> Transport {
        self.shared.transport
    }

    /// Latest control-channel round-trip time.
    pub fn rtt(&self) -> Option<Duration> {
        self.shared.rtt()
    }

    /// Streams open (or opening) on this session.
    pub fn active_streams(&self) -> usize {
        self.shared.active.count()
    }

    /// The client's reverse listeners (bind id → metadata), updated as it binds and unbinds.
    pub fn binds(&self) -> watch::Receiver<Binds> {
        self.server().binds.subscribe()
    }

    /// Opens a reverse stream to the client's listener `bind` and waits for the client's answer
    /// (its local connect). Over HTTP/2 this costs one extra round trip: the server asks on
    /// the control channel and the client opens the stream.
    pub async fn open_reverse(&self, bind: &str) -> Result<Stream, Error> {
        if !self.server().binds.borrow().contains_key(bind) {
            return Err(Error::Rejected(format!("no reverse listener {bind:?}")));
        }
        self.shared
            .open(StreamHeader::Reverse {
                bind: bind.to_owned(),
                open_id: None,
            })
            .await
    }

    /// Starts a drain (goaway; streams finish within `grace`, then the connection closes) and
    /// returns at once; see [`SessionHandle::closed`].
    pub fn goaway(&self, reason: &str, grace: Duration) {
        self.shared.goaway(reason, grace);
    }

    /// Drains like [`SessionHandle::goaway`] and waits until the session is closed.
    pub async fn close(&self, reason: &str, grace: Duration) -> CloseReason {
        self.shared.goaway(reason, grace);
        match tokio::time::timeout(grace + LINGER, self.shared.closed()).await {
            Ok(r) => r,
            Err(_) => {
                self.shared
                    .finish(CloseReason::Aborted("close timed out".into()));
                self.shared.closed().await
            }
        }
    }

    pub fn is_closed(&self) -> bool {
        self.shared.close_reason().is_some()
    }

    /// Resolves when the session has ended, with the reason.
    pub async fn closed(&self) -> CloseReason {
        self.shared.closed().await
    }
}

impl std::fmt::Debug for SessionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionHandle")
            .field("id", &self.shared.id)
            .field("peer", &self.shared.peer)
            .field("transport", &self.shared.transport)
            .field("identity", &self.server().identity.name)
            .finish()
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.handle.fmt(f)
    }
}

// === handshake ===

struct Refusal {
    code: RefusalCode,
    reason: String,
    retry: bool,
    metric: &'static str,
}

impl From<AuthError> for Refusal {
    fn from(e: AuthError) -> Self {
        let metric = match &e {
            AuthError::Unauthenticated(_) => "unauthenticated",
            AuthError::Expired(_) => "expired",
            AuthError::Forbidden(_) => "forbidden",
            AuthError::Unavailable(_) => "unavailable",
        };
        Refusal {
            code: e.code(),
            reason: e.to_string(),
            retry: e.retry(),
            metric,
        }
    }
}

/// Reads `hello`, authenticates, and answers `welcome` (then the session runs) or `refused`
/// (then the connection closes).
#[allow(clippy::too_many_arguments)]
async fn establish(
    inner: &Arc<Inner>,
    transport: Transport,
    peer: SocketAddr,
    client_cert: Option<CertificateDer<'static>>,
    conn: Conn,
    mut send: RawSend,
    mut recv: RawRecv,
    deadline: tokio::time::Instant,
    on_refused: impl FnOnce(&Control),
    on_established: impl FnOnce(&Arc<Shared>),
) -> Result<(), Error> {
    let decided = tokio::time::timeout_at(deadline, async {
        let hello =
            match wire::read_frame::<_, Control>(&mut recv, inner.limits.max_control_bytes).await {
                Ok(Some(hello)) => hello,
                Ok(None) => return Err(None),
                Err(e) => {
                    return Err(Some(Refusal {
                        code: RefusalCode::Protocol,
                        reason: e.to_string(),
                        retry: false,
                        metric: "protocol",
                    }));
                }
            };
        let protocol = |reason: String| Refusal {
            code: RefusalCode::Protocol,
            reason,
            retry: false,
            metric: "protocol",
        };
        let Control::Hello {
            version,
            client_name,
            token,
        } = hello
        else {
            return Err(Some(protocol(
                "the first control message must be hello".into(),
            )));
        };
        if version != PROTOCOL_VERSION {
            return Err(Some(Refusal {
                code: RefusalCode::UnsupportedVersion,
                reason: format!("server speaks version {PROTOCOL_VERSION}, client {version}"),
                retry: false,
                metric: "version",
            }));
        }
        if client_name.len() > wire::MAX_CLIENT_NAME || client_name.chars().any(char::is_control) {
            return Err(Some(protocol("invalid client name".into())));
        }
        let identity = inner
            .authenticator
            .authenticate(AuthRequest {
                token: token.as_ref(),
                client_cert: client_cert.as_ref(),
                peer,
                client_name: &client_name,
                transport,
            })
            .await
            .map_err(|e| Some(Refusal::from(e)))?;
        if lock(&inner.live).len() >= inner.max_sessions {
            return Err(Some(Refusal {
                code: RefusalCode::Unavailable,
                reason: "too many sessions".into(),
                retry: true,
                metric: "capacity",
            }));
        }
        Ok((client_name, identity))
    })
    .await;
    let (client_name, identity) = match decided {
        Ok(Ok(ok)) => ok,
        Ok(Err(refusal)) => {
            let refusal = refusal.unwrap_or(Refusal {
                code: RefusalCode::Protocol,
                reason: "no hello".into(),
                retry: false,
                metric: "protocol",
            });
            return Err(refuse(inner, transport, peer, send, refusal, on_refused).await);
        }
        Err(_) => {
            let refusal = Refusal {
                code: RefusalCode::Protocol,
                reason: "handshake timed out".into(),
                retry: true,
                metric: "timeout",
            };
            return Err(refuse(inner, transport, peer, send, refusal, on_refused).await);
        }
    };

    let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
    let welcome = Control::Welcome {
        version: PROTOCOL_VERSION,
        session_id: id,
        identity: identity.name.clone(),
    };
    wire::write_frame(&mut send, &welcome, inner.limits.max_control_bytes).await?;

    let (incoming_tx, incoming_rx) = mpsc::channel(inner.limits.accept_queue);
    let expires_at = identity.expires_at;
    let parts = SessionParts {
        id,
        transport,
        peer,
        conn,
        role: Role::Server(ServerRole {
            identity: identity.clone(),
            client_name: client_name.clone(),
            authenticator: inner.authenticator.clone(),
            binds: watch::Sender::new(Arc::default()),
            incoming: incoming_tx,
            pending: Mutex::new(HashMap::new()),
            next_open_id: AtomicU64::new(1),
        }),
        limits: inner.limits.clone(),
        keepalive: inner.keepalive.clone(),
        drain_grace: inner.drain_grace,
        metrics: inner.metrics.clone(),
        cancel: inner.kill.child_token(),
        phase: watch::Sender::new(Phase::Open),
    };
    let shared = Shared::start(parts, send, recv);
    on_established(&shared);
    lock(&inner.live).insert(id, shared.clone());
    info!(
        session = id,
        %peer,
        %transport,
        identity = %identity.name,
        method = ?identity.method,
        client = %client_name,
        "tunnel session established"
    );

    // Housekeeping: forget the session when it ends; end it when its credentials expire.
    let weak = Arc::downgrade(inner);
    let watched = shared.clone();
    tokio::spawn(async move {
        let expiry = async {
            match expires_at.and_then(|at| at.duration_since(std::time::SystemTime::now()).ok()) {
                Some(left) => tokio::time::sleep(left).await,
                None if expires_at.is_some() => {}
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = watched.closed() => {}
            _ = expiry => {
                watched.goaway("credentials expired", watched.drain_grace);
                watched.closed().await;
            }
        }
        if let Some(inner) = weak.upgrade() {
            lock(&inner.live).remove(&watched.id);
        }
    });

    let session = Session {
        handle: SessionHandle { shared },
        incoming: incoming_rx,
    };
    if let Err(e) = inner.sessions_tx.try_send(session) {
        let session = match e {
            mpsc::error::TrySendError::Full(s) | mpsc::error::TrySendError::Closed(s) => s,
        };
        warn!(session = id, "no one is accepting tunnel sessions; closing");
        session
            .handle
            .shared
            .finish(CloseReason::Aborted("server not accepting sessions".into()));
    }
    Ok(())
}

async fn refuse(
    inner: &Arc<Inner>,
    transport: Transport,
    peer: SocketAddr,
    mut send: RawSend,
    refusal: Refusal,
    on_refused: impl FnOnce(&Control),
) -> Error {
    inner.metrics.auth_failure(refusal.metric);
    // Never log credentials: only the code and the authenticator's reason.
    warn!(
        %peer,
        %transport,
        code = %refusal.code,
        reason = %refusal.reason,
        "tunnel session refused"
    );
    let msg = Control::Refused {
        code: refusal.code,
        reason: wire::truncate(&refusal.reason, wire::MAX_REASON),
        retry: refusal.retry,
    };
    if wire::write_frame(&mut send, &msg, inner.limits.max_control_bytes)
        .await
        .is_ok()
    {
        send.finish_and_wait().await;
    }
    on_refused(&msg);
    Error::Refused {
        code: refusal.code,
        reason: refusal.reason,
        retry: refusal.retry,
    }
}
