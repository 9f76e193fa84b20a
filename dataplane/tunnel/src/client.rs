//! The workstation end: keeps one session up (QUIC, else HTTP/2 over TLS), reconnects with
//! jittered backoff, re-registers reverse listeners on every new session, and opens forward
//! streams.

use std::hash::{BuildHasher, Hasher};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use prometheus_client::registry::Registry;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::Transport;
use crate::config::{Backoff, ClientConfig, Keepalive, Limits, TransportPolicy};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::session::binds::{BindRegistry, BindStatus};
use crate::session::{
    self, CLOSE_REFUSED, ClientRole, CloseReason, Conn, Phase, Role, SessionParts, Shared, lock,
};
use crate::stream::{H2Recv, Incoming, RawRecv, RawSend, Stream};
use crate::tls::{self, LINGER};
use crate::wire::{
    self, Control, H2_ALPN, H2_CONTROL_PATH, MAX_BIND_META, PROTOCOL_VERSION, StreamHeader, Token,
};

/// What the client's session is doing, published on [`TunnelClient::state`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionState {
    /// Trying to establish a session; `attempt` counts failures since the last success, plus one.
    Connecting { attempt: u32 },
    Connected {
        transport: Transport,
        session_id: u64,
        /// The identity the server authenticated.
        identity: String,
    },
    /// No session; the next attempt starts in `retry_in`.
    Disconnected { reason: String, retry_in: Duration },
    /// Final: closed by the caller, or refused by the server with no point in retrying.
    Closed { reason: String },
}

#[derive(Clone)]
enum Current {
    None,
    Session(Arc<Shared>),
    Closed(String),
}

struct Settings {
    server_name: String,
    quic_addr: Option<String>,
    h2_addr: Option<String>,
    transports: TransportPolicy,
    token: Option<Token>,
    client_name: String,
    connect_timeout: Duration,
    open_wait: Duration,
    backoff: Backoff,
    keepalive: Keepalive,
    limits: Arc<Limits>,
    drain_grace: Duration,
}

struct Inner {
    settings: Settings,
    quic_tls: Arc<quinn::crypto::rustls::QuicClientConfig>,
    quic_transport: Arc<quinn::TransportConfig>,
    h2_tls: Arc<rustls::ClientConfig>,
    metrics: Metrics,
    state: watch::Sender<SessionState>,
    current: watch::Sender<Current>,
    binds: Arc<BindRegistry>,
    /// Stops the supervisor (no more reconnects).
    stop: CancellationToken,
    /// Parent of every session's token.
    kill: CancellationToken,
    sessions: Mutex<Vec<Arc<Shared>>>,
}

/// The tunnel client. Dropping it aborts its sessions; [`TunnelClient::close`] drains first.
pub struct TunnelClient {
    inner: Arc<Inner>,
}

impl TunnelClient {
    /// Validates `config` and starts connecting in the background (within the current Tokio
    /// runtime). Progress is visible on [`TunnelClient::state`].
    pub fn start(config: ClientConfig, registry: &mut Registry) -> Result<Self, Error> {
        config.validate()?;
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Config("TunnelClient::start needs a Tokio runtime".into()))?;
        let tls = tls::client_configs(&config.tls)?;
        let quic_transport = Arc::new(tls::quic_transport(
            &config.limits,
            &config.keepalive,
            config.congestion,
        )?);
        let inner = Arc::new(Inner {
            settings: Settings {
                server_name: config.server_name,
                quic_addr: config.quic_addr,
                h2_addr: config.h2_addr,
                transports: config.transports,
                token: config.token,
                client_name: config.client_name,
                connect_timeout: config.connect_timeout,
                open_wait: config.open_wait,
                backoff: config.backoff,
                keepalive: config.keepalive,
                limits: Arc::new(config.limits),
                drain_grace: config.drain_grace,
            },
            quic_tls: Arc::new(tls.quic),
            quic_transport,
            h2_tls: tls.h2,
            metrics: Metrics::client(registry),
            state: watch::Sender::new(SessionState::Connecting { attempt: 1 }),
            current: watch::Sender::new(Current::None),
            binds: Arc::new(BindRegistry::default()),
            stop: CancellationToken::new(),
            kill: CancellationToken::new(),
            sessions: Mutex::new(Vec::new()),
        });
        handle.spawn(supervise(inner.clone()));
        Ok(TunnelClient { inner })
    }

    /// The session state; changes as the client connects, loses and regains its session.
    pub fn state(&self) -> watch::Receiver<SessionState> {
        self.inner.state.subscribe()
    }

    /// Latest control-channel round-trip time of the current session.
    pub fn rtt(&self) -> Option<Duration> {
        match &*self.inner.current.borrow() {
            Current::Session(s) => s.rtt(),
            _ => None,
        }
    }

    /// Opens a forward stream to `host:port` as seen from the cluster, waiting up to
    /// `open_wait` for a session while (re)connecting. Fails with [`Error::Rejected`] when the
    /// server could not connect (its reason is included).
    pub async fn open(&self, host: &str, port: u16) -> Result<Stream, Error> {
        let header = StreamHeader::Connect {
            host: host.to_owned(),
            port,
        };
        header.validate()?;
        let session = self.session().await?;
        session.open(header).await
    }

    async fn session(&self) -> Result<Arc<Shared>, Error> {
        let mut rx = self.inner.current.subscribe();
        let wait = rx.wait_for(|c| match c {
            Current::None => false,
            Current::Session(s) => s.is_open(),
            Current::Closed(_) => true,
        });
        let after = self.inner.settings.open_wait;
        match tokio::time::timeout(after, wait).await {
            Ok(Ok(c)) => match &*c {
                Current::Session(s) => Ok(s.clone()),
                Current::Closed(r) => Err(Error::Closed(r.clone())),
                Current::None => Err(Error::NotConnected("no session".into())),
            },
            Ok(Err(_)) => Err(Error::Closed("client stopped".into())),
            Err(_) => {
                let why = match &*self.inner.state.borrow() {
                    SessionState::Disconnected { reason, .. } => reason.clone(),
                    other => format!("{other:?}"),
                };
                Err(Error::NotConnected(format!(
                    "no session within {after:?}; last: {why}"
                )))
            }
        }
    }

    /// Registers reverse listener `id` (with opaque `meta` for the server, e.g. which port it
    /// stands for). The registration survives reconnects: every new session re-registers all
    /// listeners, so reverse streams resume without the caller doing anything.
    ///
    /// Waits up to `open_wait` for the server's answer: a refusal is an error; still no answer
    /// (disconnected) returns the listener in [`BindStatus::Pending`].
    pub async fn bind(&self, id: &str, meta: &str) -> Result<ReverseListener, Error> {
        wire::validate_bind_id(id).map_err(|e| Error::Config(e.to_string()))?;
        if meta.len() > MAX_BIND_META {
            return Err(Error::Config(format!(
                "bind metadata longer than {MAX_BIND_META} bytes"
            )));
        }
        if let Current::Closed(r) = &*self.inner.current.borrow() {
            return Err(Error::Closed(r.clone()));
        }
        let (tx, rx) = mpsc::channel(self.inner.settings.limits.accept_queue);
        let (status_tx, status) = watch::channel(BindStatus::Pending);
        let generation = self.inner.binds.add(id, meta, tx, status_tx)?;
        let listener = ReverseListener {
            id: id.to_owned(),
            generation,
            rx,
            status: status.clone(),
            inner: self.inner.clone(),
        };
        let current = self.inner.current.borrow().clone();
        if let Current::Session(s) = current {
            let _ = s
                .control
                .send(Control::Bind {
                    id: id.to_owned(),
                    meta: meta.to_owned(),
                })
                .await;
        }
        let mut status = status;
        let decided = tokio::time::timeout(
            self.inner.settings.open_wait,
            status.wait_for(|s| *s != BindStatus::Pending),
        )
        .await;
        if let Ok(Ok(s)) = decided
            && let BindStatus::Rejected(reason) = &*s
        {
            return Err(Error::BindRejected {
                id: id.to_owned(),
                reason: reason.clone(),
            });
        }
        Ok(listener)
    }

    /// Sends goaway, lets open streams finish for up to `grace`, closes, and stops
    /// reconnecting. The state becomes [`SessionState::Closed`].
    pub async fn close(&self, grace: Duration) {
        let inner = &self.inner;
        inner.stop.cancel();
        let sessions: Vec<_> = lock(&inner.sessions).clone();
        for s in &sessions {
            s.goaway("client closing", grace);
        }
        let _ = tokio::time::timeout(grace + LINGER, async {
            for s in &sessions {
                s.closed().await;
            }
        })
        .await;
        inner.kill.cancel();
        for s in &sessions {
            s.finish(CloseReason::Aborted("client closed".into()));
        }
        inner.shut("closed by the client");
        for s in &sessions {
            if let Conn::Quic {
                endpoint: Some(endpoint),
                ..
            } = &s.conn
            {
                let _ =
                    tokio::time::timeout(Duration::from_millis(250), endpoint.wait_idle()).await;
            }
        }
    }
}

impl Drop for TunnelClient {
    fn drop(&mut self) {
        self.inner.stop.cancel();
        self.inner.kill.cancel();
        self.inner.shut("client dropped");
    }
}

impl Inner {
    /// Final state: no session, no listeners, no reconnects.
    fn shut(&self, reason: &str) {
        self.current
            .send_replace(Current::Closed(reason.to_owned()));
        self.binds.close_all();
        self.state.send_replace(SessionState::Closed {
            reason: reason.to_owned(),
        });
    }
}

// === reverse listeners ===

/// Reverse streams the server opens for one bind id. Dropping it unregisters the bind.
pub struct ReverseListener {
    id: String,
    generation: u64,
    rx: mpsc::Receiver<Incoming>,
    status: watch::Receiver<BindStatus>,
    inner: Arc<Inner>,
}

impl ReverseListener {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The next reverse stream (cluster → workstation). Answer it with
    /// [`Incoming::accept`] once the local connect worked, or [`Incoming::reject`].
    /// `None` once the bind is rejected or the client is closed.
    pub async fn accept(&mut self) -> Option<Incoming> {
        self.rx.recv().await
    }

    pub fn status(&self) -> watch::Receiver<BindStatus> {
        self.status.clone()
    }
}

impl Drop for ReverseListener {
    fn drop(&mut self) {
        if self.inner.binds.remove(&self.id, self.generation)
            && let Current::Session(s) = &*self.inner.current.borrow()
        {
            s.send_later(Control::Unbind {
                id: self.id.clone(),
            });
        }
    }
}

impl std::fmt::Debug for ReverseListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReverseListener")
            .field("id", &self.id)
            .field("status", &*self.status.borrow())
            .finish()
    }
}

// === the supervisor ===

async fn supervise(inner: Arc<Inner>) {
    let mut failures: u32 = 0;
    let mut connected_before = false;
    let mut preferred: Option<Transport> = None;
    loop {
        inner.state.send_replace(SessionState::Connecting {
            attempt: failures + 1,
        });
        let attempt = tokio::select! {
            r = connect(&inner, preferred) => r,
            _ = inner.stop.cancelled() => return,
        };
        match attempt {
            Ok(shared) => {
                if connected_before {
                    inner.metrics.reconnects.inc();
                }
                connected_before = true;
                preferred = Some(shared.transport);
                let started = tokio::time::Instant::now();
                {
                    let mut sessions = lock(&inner.sessions);
                    sessions.retain(|s| s.close_reason().is_none());
                    sessions.push(shared.clone());
                }
                // Publish first, then re-register: a `bind` racing with this sees the
                // session and sends its own registration, so none is missed.
                inner.current.send_replace(Current::Session(shared.clone()));
                inner.binds.reregister(&shared);
                let identity = match &shared.role {
                    Role::Client(c) => c.identity.clone(),
                    Role::Server(_) => String::new(),
                };
                info!(session = shared.id, transport = %shared.transport, %identity, "tunnel connected");
                inner.state.send_replace(SessionState::Connected {
                    transport: shared.transport,
                    session_id: shared.id,
                    identity,
                });
                let mut phase = shared.phase();
                // Stop first: `close` stops the supervisor and then ends the session, and a
                // supervisor woken late sees both; taking the session's end would publish
                // `Disconnected` over the `Closed` that `close` set.
                tokio::select! {
                    biased;
                    _ = inner.stop.cancelled() => return,
                    _ = phase.wait_for(|p| *p != Phase::Open) => {}
                }
                inner.current.send_if_modified(|c| match c {
                    Current::Session(s) if Arc::ptr_eq(s, &shared) => {
                        *c = Current::None;
                        true
                    }
                    _ => false,
                });
                inner.binds.all_pending();
                let reason = match shared.close_reason() {
                    Some(r) => r.to_string(),
                    None => "server is going away".into(),
                };
                // A session that dies right after it started counts as a failure, so a server
                // that accepts and then drops us is not hammered.
                let retry_in = if started.elapsed() < Duration::from_secs(1) {
                    failures += 1;
                    backoff_delay(&inner.settings.backoff, failures)
                } else {
                    failures = 0;
                    Duration::ZERO
                };
                warn!(session = shared.id, %reason, ?retry_in, "tunnel session lost; reconnecting");
                inner
                    .state
                    .send_replace(SessionState::Disconnected { reason, retry_in });
                tokio::select! {
                    _ = tokio::time::sleep(retry_in) => {}
                    _ = inner.stop.cancelled() => return,
                }
            }
            Err(Error::Refused {
                code,
                reason,
                retry: false,
            }) => {
                let reason = format!("refused by the server ({code}): {reason}");
                warn!(%reason, "tunnel client stops");
                inner.shut(&reason);
                return;
            }
            Err(e) => {
                failures += 1;
                let retry_in = backoff_delay(&inner.settings.backoff, failures);
                warn!(error = %e, ?retry_in, "tunnel connect failed");
                inner.state.send_replace(SessionState::Disconnected {
                    reason: e.to_string(),
                    retry_in,
                });
                tokio::select! {
                    _ = tokio::time::sleep(retry_in) => {}
                    _ = inner.stop.cancelled() => return,
                }
            }
        }
    }
}

/// `initial · 2^(failures-1)`, capped at `max`, drawn uniformly from [d/2, d].
fn backoff_delay(b: &Backoff, failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(20);
    let d = b.initial.saturating_mul(1u32 << exp).min(b.max);
    let half = d / 2;
    half + half.mul_f64(random_unit())
}

/// A uniform draw from [0, 1) from std's randomly keyed hasher: enough for jitter.
fn random_unit() -> f64 {
    let x = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// One round over the transports, in policy order, the last one that worked first.
async fn connect(inner: &Arc<Inner>, preferred: Option<Transport>) -> Result<Arc<Shared>, Error> {
    let s = &inner.settings;
    let mut order = match s.transports {
        TransportPolicy::QuicThenH2 => vec![Transport::Quic, Transport::H2],
        TransportPolicy::H2ThenQuic => vec![Transport::H2, Transport::Quic],
        TransportPolicy::QuicOnly => vec![Transport::Quic],
        TransportPolicy::H2Only => vec![Transport::H2],
    };
    if let Some(p) = preferred
        && let Some(i) = order.iter().position(|t| *t == p)
    {
        order.remove(i);
        order.insert(0, p);
    }
    let mut errors = Vec::new();
    for transport in order {
        let addr = match transport {
            Transport::Quic => s.quic_addr.as_deref(),
            Transport::H2 => s.h2_addr.as_deref(),
        };
        let Some(addr) = addr else { continue };
        let attempt = match transport {
            Transport::Quic => {
                tokio::time::timeout(s.connect_timeout, connect_quic(inner, addr)).await
            }
            Transport::H2 => tokio::time::timeout(s.connect_timeout, connect_h2(inner, addr)).await,
        };
        let result = attempt.unwrap_or_else(|_| {
            Err(Error::Connect {
                transport,
                addr: addr.to_owned(),
                reason: format!("timed out after {:?}", s.connect_timeout),
            })
        });
        inner.metrics.attempt(transport, result.is_ok());
        let result = result.map_err(|e| certificate_refusal(&e).unwrap_or(e));
        match result {
            Ok(shared) => return Ok(shared),
            // The server answered: another transport would get the same answer.
            Err(e @ Error::Refused { .. }) => return Err(e),
            Err(e) => {
                debug!(%transport, %addr, error = %e, "tunnel transport failed");
                errors.push(e);
            }
        }
    }
    match errors.len() {
        0 => Err(Error::Config("no transport to try".into())),
        1 => Err(errors.remove(0)),
        _ => Err(Error::NotConnected(
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        )),
    }
}

/// A TLS alert from the server that rejects our client certificate (or its absence) is a
/// refusal like a bad token: trying again with the same certificate cannot succeed. With TLS 1.3
/// the client finishes its handshake before the server checks the certificate, so the alert
/// shows up in whatever reads next (QUIC close, HTTP/2 connection, the hello).
fn certificate_refusal(e: &Error) -> Option<Error> {
    use rustls::AlertDescription as A;
    let alert = received_alert(e).or_else(|| alert_in_text(&e.to_string()))?;
    let code = match alert {
        A::CertificateExpired => crate::error::RefusalCode::Expired,
        A::BadCertificate
        | A::UnsupportedCertificate
        | A::CertificateRevoked
        | A::CertificateUnknown
        | A::UnknownCA
        | A::AccessDenied
        | A::CertificateRequired
        // What rustls answers when a certificate names a trusted CA but its signature does not
        // verify with that CA's key.
        | A::DecryptError => crate::error::RefusalCode::Unauthenticated,
        _ => return None,
    };
    Some(Error::Refused {
        code,
        reason: format!("the server rejected the TLS client certificate ({alert:?})"),
        retry: false,
    })
}

/// h2 keeps only the kind and text of an I/O error, so on the HTTP/2 path the alert survives
/// only as rustls's message, "received fatal alert: <name>".
fn alert_in_text(text: &str) -> Option<rustls::AlertDescription> {
    use rustls::AlertDescription as A;
    let (_, rest) = text.split_once("received fatal alert: ")?;
    let name: String = rest
        .chars()
        .take_while(char::is_ascii_alphanumeric)
        .collect();
    [
        A::BadCertificate,
        A::UnsupportedCertificate,
        A::CertificateRevoked,
        A::CertificateExpired,
        A::CertificateUnknown,
        A::UnknownCA,
        A::AccessDenied,
        A::CertificateRequired,
        A::DecryptError,
    ]
    .into_iter()
    .find(|a| format!("{a:?}") == name)
}

/// The TLS alert the peer sent, wherever it sits in `e`'s chain of causes.
fn received_alert(e: &(dyn std::error::Error + 'static)) -> Option<rustls::AlertDescription> {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if let Some(rustls::Error::AlertReceived(a)) = e.downcast_ref::<rustls::Error>() {
            return Some(*a);
        }
        // QUIC carries TLS alerts as CRYPTO_ERROR close codes, 0x100 + the alert.
        if let Some(quinn::ConnectionError::ConnectionClosed(close)) =
            e.downcast_ref::<quinn::ConnectionError>()
        {
            let code = u64::from(close.error_code);
            if let Some(alert) = code.checked_sub(0x100).and_then(|a| u8::try_from(a).ok()) {
                return Some(rustls::AlertDescription::from(alert));
            }
        }
        // io::Error::source() skips the wrapped error itself; h2 keeps its I/O error aside.
        let wrapped = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|w| w as &(dyn std::error::Error + 'static))
            .or_else(|| {
                e.downcast_ref::<h2::Error>()
                    .and_then(h2::Error::get_io)
                    .map(|io| io as &(dyn std::error::Error + 'static))
            });
        if let Some(a) = wrapped.and_then(received_alert) {
            return Some(a);
        }
        cur = e.source();
    }
    None
}

async fn resolve(transport: Transport, addr: &str) -> Result<SocketAddr, Error> {
    let err = |reason: String| Error::Connect {
        transport,
        addr: addr.to_owned(),
        reason,
    };
    tokio::net::lookup_host(addr)
        .await
        .map_err(|e| err(e.to_string()))?
        .next()
        .ok_or_else(|| err("resolved to no address".into()))
}

async fn connect_quic(inner: &Arc<Inner>, addr_str: &str) -> Result<Arc<Shared>, Error> {
    let s = &inner.settings;
    let addr = resolve(Transport::Quic, addr_str).await?;
    let connect_err = |reason: String| Error::Connect {
        transport: Transport::Quic,
        addr: addr_str.to_owned(),
        reason,
    };
    let local: SocketAddr = if addr.is_ipv6() {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    };
    // One endpoint (UDP socket) per connection: a reconnect after a network change starts
    // from a fresh socket.
    let endpoint = crate::udp::endpoint(local, None).map_err(|e| connect_err(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(inner.quic_tls.clone());
    config.transport_config(inner.quic_transport.clone());
    let conn = endpoint
        .connect_with(config, addr, &s.server_name)
        .map_err(|e| connect_err(e.to_string()))?
        .await
        .map_err(|e| connect_err(e.to_string()))?;
    let (send, recv) = conn.open_bi().await?;
    let (mut send, mut recv) = (RawSend::Quic(send), RawRecv::Quic(recv));
    let (session_id, identity) = match hello(inner, &mut send, &mut recv).await {
        Ok(ok) => ok,
        Err(e) => {
            // The refusal may have arrived as the close reason rather than on the stream.
            if let Some(quinn::ConnectionError::ApplicationClosed(close)) = conn.close_reason()
                && close.error_code == CLOSE_REFUSED.into()
                && let Ok(Control::Refused {
                    code,
                    reason,
                    retry,
                }) = serde_json::from_slice::<Control>(&close.reason)
            {
                return Err(Error::Refused {
                    code,
                    reason,
                    retry,
                });
            }
            conn.close(session::CLOSE_ABORT.into(), b"handshake failed");
            return Err(e);
        }
    };
    let parts = SessionParts {
        id: session_id,
        transport: Transport::Quic,
        peer: addr,
        conn: Conn::Quic {
            conn,
            endpoint: Some(endpoint),
        },
        role: Role::Client(ClientRole {
            identity,
            binds: inner.binds.clone(),
        }),
        limits: s.limits.clone(),
        keepalive: s.keepalive.clone(),
        drain_grace: s.drain_grace,
        metrics: inner.metrics.clone(),
        cancel: inner.kill.child_token(),
        phase: watch::Sender::new(Phase::Open),
    };
    Ok(Shared::start(parts, send, recv))
}

type H2ClientConn = h2::client::Connection<tokio_rustls::client::TlsStream<TcpStream>, Bytes>;

async fn connect_h2(inner: &Arc<Inner>, addr_str: &str) -> Result<Arc<Shared>, Error> {
    let s = &inner.settings;
    let addr = resolve(Transport::H2, addr_str).await?;
    let connect_err = |reason: String| Error::Connect {
        transport: Transport::H2,
        addr: addr_str.to_owned(),
        reason,
    };
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| connect_err(e.to_string()))?;
    let _ = tcp.set_nodelay(true);
    let name = rustls::pki_types::ServerName::try_from(s.server_name.clone())
        .map_err(|e| Error::Config(format!("server_name: {e}")))?;
    let tls = tokio_rustls::TlsConnector::from(inner.h2_tls.clone())
        .connect(name, tcp)
        .await
        .map_err(|e| connect_err(format!("TLS: {e}")))?;
    if tls.get_ref().1.alpn_protocol() != Some(H2_ALPN) {
        return Err(connect_err("server did not negotiate h2".into()));
    }
    let (send_request, mut conn): (_, H2ClientConn) =
        h2_client_builder(&s.limits).handshake(tls).await?;
    let ping_pong = conn.ping_pong();

    let cancel = inner.kill.child_token();
    let phase = watch::Sender::new(Phase::Open);
    let (done_tx, done_rx) = oneshot::channel::<String>();
    {
        let cancel = cancel.clone();
        let phase = phase.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                r = &mut conn => {
                    let _ = done_tx.send(match r {
                        Ok(()) => "HTTP/2 connection closed".into(),
                        Err(e) => format!("HTTP/2: {e}"),
                    });
                }
                _ = cancel.cancelled() => {
                    // After a clean drain the server closes the connection; give it the chance
                    // so our last frames are flushed. Otherwise drop it now.
                    let clean = matches!(&*phase.borrow(), Phase::Closed(CloseReason::Drained { .. }));
                    if clean {
                        let _ = tokio::time::timeout(LINGER, &mut conn).await;
                    }
                }
            }
        });
    }
    // Until the session exists, a failed handshake must stop the connection task.
    let abort_on_error = cancel.clone().drop_guard();

    let host = if s.server_name.contains(':') {
        format!("[{}]", s.server_name)
    } else {
        s.server_name.clone()
    };
    let base: http::Uri = format!("https://{host}/")
        .parse()
        .map_err(|e| Error::Config(format!("server_name: {e}")))?;
    let control_uri: http::Uri = format!("https://{host}{H2_CONTROL_PATH}")
        .parse()
        .map_err(|e| Error::Config(format!("server_name: {e}")))?;
    let mut sr = send_request.clone().ready().await?;
    let request = http::Request::post(control_uri)
        .body(())
        .map_err(|e| Error::Protocol(e.to_string()))?;
    let (response, send) = sr.send_request(request, false)?;
    let (mut send, mut recv) = (RawSend::h2(send), RawRecv::H2(H2Recv::Pending(response)));
    let (session_id, identity) = hello(inner, &mut send, &mut recv).await?;

    let parts = SessionParts {
        id: session_id,
        transport: Transport::H2,
        peer: addr,
        conn: Conn::H2Client {
            send_request,
            uri: base,
        },
        role: Role::Client(ClientRole {
            identity,
            binds: inner.binds.clone(),
        }),
        limits: s.limits.clone(),
        keepalive: s.keepalive.clone(),
        drain_grace: s.drain_grace,
        metrics: inner.metrics.clone(),
        cancel,
        phase,
    };
    abort_on_error.disarm();
    let shared = Shared::start(parts, send, recv);
    tokio::spawn(session::h2_pinger(shared.clone(), ping_pong));
    let watched = shared.clone();
    tokio::spawn(async move {
        tokio::select! {
            r = done_rx => watched.conn_ended(r.unwrap_or_else(|_| "HTTP/2 connection task ended".into())),
            _ = watched.cancel.cancelled() => {}
        }
    });
    Ok(shared)
}

fn h2_client_builder(limits: &Limits) -> h2::client::Builder {
    let mut b = h2::client::Builder::new();
    b.initial_window_size(limits.stream_window)
        .initial_connection_window_size(limits.connection_window)
        .max_frame_size(wire::H2_MAX_FRAME)
        .max_header_list_size(16 * 1024)
        .max_send_buffer_size(limits.stream_window as usize)
        .enable_push(false);
    b
}

/// The client's half of the handshake: `hello` out, `welcome` (or `refused`) back.
async fn hello(
    inner: &Inner,
    send: &mut RawSend,
    recv: &mut RawRecv,
) -> Result<(u64, String), Error> {
    let s = &inner.settings;
    let max = s.limits.max_control_bytes;
    let hello = Control::Hello {
        version: PROTOCOL_VERSION,
        client_name: s.client_name.clone(),
        token: s.token.clone(),
    };
    wire::write_frame(send, &hello, max).await?;
    match wire::read_frame::<_, Control>(recv, max).await? {
        Some(Control::Welcome {
            version,
            session_id,
            identity,
        }) => {
            if version != PROTOCOL_VERSION {
                return Err(Error::Protocol(format!(
                    "server answered with protocol version {version}"
                )));
            }
            Ok((session_id, identity))
        }
        Some(Control::Refused {
            code,
            reason,
            retry,
        }) => Err(Error::Refused {
            code,
            reason,
            retry,
        }),
        Some(_) => Err(Error::Protocol(
            "server answered hello with something else".into(),
        )),
        None => Err(Error::Protocol(
            "server closed the control stream during the handshake".into(),
        )),
    }
}
