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

mod dial;

use dial::connect;

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

/// The client metrics, registered once and shared by the clients started with it.
#[derive(Clone, Debug)]
pub struct ClientMetrics(Metrics);

impl ClientMetrics {
    pub fn new(registry: &mut Registry) -> Self {
        ClientMetrics(Metrics::client(registry))
    }
}

/// The tunnel client. Dropping it aborts its sessions; [`TunnelClient::close`] drains first.
pub struct TunnelClient {
    inner: Arc<Inner>,
}

impl TunnelClient {
    /// Validates `config` and starts connecting in the background (within the current Tokio
    /// runtime). Progress is visible on [`TunnelClient::state`].
    pub fn start(config: ClientConfig, registry: &mut Registry) -> Result<Self, Error> {
        Self::start_with(config, &ClientMetrics::new(registry))
    }

    /// Like [`TunnelClient::start`], counting into `metrics`: several clients (one per server
    /// replica) share one set of series, their sums.
    pub fn start_with(config: ClientConfig, metrics: &ClientMetrics) -> Result<Self, Error> {
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
            metrics: metrics.0.clone(),
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
