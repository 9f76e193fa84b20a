//! One established session, shared by both ends: the control channel (reader, writer, RTT
//! pings), opening and accepting data streams over either transport, and the goaway → drain →
//! close sequence.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::Transport;
use crate::auth::{Authenticator, Identity};
use crate::config::{Keepalive, Limits};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::stream::{Active, Incoming, RawRecv, RawSend, Stream};
use crate::tls::LINGER;
use crate::wire::{self, Control, H2_STREAM_PATH, MAX_REASON, Reply, StreamHeader};

pub(crate) mod binds;
mod tasks;

pub(crate) use tasks::{H2Accepted, h2_pinger, h2_server_conn};
use tasks::{control_reader, control_writer, pinger, quic_accept};

use binds::BindRegistry;

/// QUIC application close codes.
pub(crate) const CLOSE_OK: u32 = 0;
pub(crate) const CLOSE_REFUSED: u32 = 1;
pub(crate) const CLOSE_ABORT: u32 = 2;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Which side started a drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Initiator {
    Local,
    Peer,
}

/// Why a session ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// A goaway was exchanged and both sides finished their streams: nothing was cut.
    Drained {
        initiator: Initiator,
        reason: String,
    },
    /// A goaway's grace period ran out; this many streams were still open and were cut.
    GraceExpired { open_streams: usize },
    /// The peer stopped answering keepalives (QUIC idle timeout, HTTP/2 PING timeout).
    KeepaliveTimeout,
    /// The connection failed or was closed without a goaway.
    Lost(String),
    /// Closed locally without a drain (server or client dropped, zero grace).
    Aborted(String),
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseReason::Drained { initiator, reason } => {
                let by = match initiator {
                    Initiator::Local => "local",
                    Initiator::Peer => "peer",
                };
                write!(f, "drained after {by} goaway: {reason}")
            }
            CloseReason::GraceExpired { open_streams } => {
                write!(f, "drain grace expired with {open_streams} streams open")
            }
            CloseReason::KeepaliveTimeout => f.write_str("peer missed keepalives"),
            CloseReason::Lost(r) => write!(f, "connection lost: {r}"),
            CloseReason::Aborted(r) => write!(f, "aborted: {r}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Open,
    Draining,
    Closed(CloseReason),
}

pub(crate) enum Conn {
    Quic {
        conn: quinn::Connection,
        /// The client's own endpoint (one per connection); the server shares its endpoint.
        endpoint: Option<quinn::Endpoint>,
    },
    H2Client {
        send_request: h2::client::SendRequest<Bytes>,
        uri: http::Uri,
    },
    H2Server,
}

/// Reverse listeners registered on a server session: bind id → metadata.
pub type Binds = Arc<BTreeMap<String, String>>;

pub(crate) struct ServerRole {
    pub identity: Identity,
    pub client_name: String,
    pub authenticator: Arc<dyn Authenticator>,
    pub binds: watch::Sender<Binds>,
    pub incoming: mpsc::Sender<Incoming>,
    /// HTTP/2: reverse opens waiting for the client's stream, by open id.
    pub pending: Mutex<HashMap<u64, oneshot::Sender<(RawSend, RawRecv)>>>,
    pub next_open_id: AtomicU64,
}

pub(crate) struct ClientRole {
    pub identity: String,
    pub binds: Arc<BindRegistry>,
}

pub(crate) enum Role {
    Server(ServerRole),
    Client(ClientRole),
}

struct DrainState {
    initiator: Option<Initiator>,
    reason: String,
    local_done: bool,
    peer_done: bool,
}

pub(crate) struct Shared {
    pub id: u64,
    pub transport: Transport,
    pub peer: SocketAddr,
    pub conn: Conn,
    pub role: Role,
    pub control: mpsc::Sender<Control>,
    pub active: Active,
    pub limits: Arc<Limits>,
    pub keepalive: Keepalive,
    pub drain_grace: Duration,
    pub metrics: Metrics,
    pub cancel: CancellationToken,
    phase: watch::Sender<Phase>,
    drain: Mutex<DrainState>,
    rtt: Mutex<Option<Duration>>,
    ping: Mutex<(u64, Option<Instant>)>,
}

/// Everything a session needs that is built before the handshake completes.
pub(crate) struct SessionParts {
    pub id: u64,
    pub transport: Transport,
    pub peer: SocketAddr,
    pub conn: Conn,
    pub role: Role,
    pub limits: Arc<Limits>,
    pub keepalive: Keepalive,
    pub drain_grace: Duration,
    pub metrics: Metrics,
    pub cancel: CancellationToken,
    pub phase: watch::Sender<Phase>,
}

impl Shared {
    /// Builds the session and starts its control tasks on the (already handshaken) control
    /// stream.
    pub(crate) fn start(parts: SessionParts, send: RawSend, recv: RawRecv) -> Arc<Self> {
        let (control_tx, control_rx) = mpsc::channel(64);
        parts.metrics.transport(parts.transport).total.inc();
        parts.metrics.transport(parts.transport).active.inc();
        let shared = Arc::new(Shared {
            id: parts.id,
            transport: parts.transport,
            peer: parts.peer,
            conn: parts.conn,
            role: parts.role,
            control: control_tx,
            active: Active::new(),
            limits: parts.limits,
            keepalive: parts.keepalive,
            drain_grace: parts.drain_grace,
            metrics: parts.metrics,
            cancel: parts.cancel,
            phase: parts.phase,
            drain: Mutex::new(DrainState {
                initiator: None,
                reason: String::new(),
                local_done: false,
                peer_done: false,
            }),
            rtt: Mutex::new(None),
            ping: Mutex::new((0, None)),
        });
        tokio::spawn(control_writer(shared.clone(), send, control_rx));
        tokio::spawn(control_reader(shared.clone(), recv));
        tokio::spawn(pinger(shared.clone()));
        if let Conn::Quic { conn, .. } = &shared.conn {
            tokio::spawn(quic_accept(shared.clone(), conn.clone()));
        }
        // A cancelled parent token (server or client dropped) ends the session for real:
        // close reason, QUIC close, metrics.
        let me = shared.clone();
        tokio::spawn(async move {
            me.cancel.cancelled().await;
            me.finish(CloseReason::Aborted("shut down".into()));
        });
        shared
    }

    pub(crate) fn phase(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    pub(crate) fn is_open(&self) -> bool {
        matches!(*self.phase.borrow(), Phase::Open)
    }

    pub(crate) fn close_reason(&self) -> Option<CloseReason> {
        match &*self.phase.borrow() {
            Phase::Closed(r) => Some(r.clone()),
            _ => None,
        }
    }

    pub(crate) async fn closed(&self) -> CloseReason {
        let mut rx = self.phase.subscribe();
        match rx.wait_for(|p| matches!(p, Phase::Closed(_))).await {
            Ok(p) => match &*p {
                Phase::Closed(r) => r.clone(),
                _ => CloseReason::Aborted("session state lost".into()),
            },
            Err(_) => CloseReason::Aborted("session state lost".into()),
        }
    }

    pub(crate) fn rtt(&self) -> Option<Duration> {
        *lock(&self.rtt)
    }

    // === opening ===

    /// Opens a data stream carrying `header` and waits for the acceptor's answer.
    pub(crate) async fn open(self: &Arc<Self>, header: StreamHeader) -> Result<Stream, Error> {
        match &*self.phase.borrow() {
            Phase::Open => {}
            Phase::Draining => return Err(Error::Closed("session is going away".into())),
            Phase::Closed(r) => return Err(Error::Closed(r.to_string())),
        }
        header.validate()?;
        let kind = header.kind();
        let guard = self.active.enter();
        let after = self.limits.open_timeout;
        let result = tokio::select! {
            r = tokio::time::timeout(after, self.open_raw(header)) => match r {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout { what: "stream open", after }),
            },
            _ = self.cancel.cancelled() => Err(Error::Closed("session closed during open".into())),
        };
        match result {
            Ok((send, recv)) => Ok(Stream::new(
                send,
                recv,
                kind,
                self.transport,
                &self.metrics,
                guard,
            )),
            Err(e) => {
                self.metrics.kind(kind).rejected.inc();
                Err(e)
            }
        }
    }

    async fn open_raw(self: &Arc<Self>, header: StreamHeader) -> Result<(RawSend, RawRecv), Error> {
        let max = self.limits.max_header_bytes;
        let (send, mut recv) = match (&self.conn, &self.role) {
            (Conn::Quic { conn, .. }, _) => {
                let (s, r) = conn.open_bi().await?;
                let mut send = RawSend::Quic(s);
                wire::write_frame(&mut send, &header, max).await?;
                (send, RawRecv::Quic(r))
            }
            (Conn::H2Client { send_request, uri }, _) => {
                let (mut send, recv) = h2_open(send_request, uri).await?;
                wire::write_frame(&mut send, &header, max).await?;
                (send, recv)
            }
            (Conn::H2Server, Role::Server(server)) => {
                // HTTP/2 streams are client requests: ask the client to open this one.
                let StreamHeader::Reverse { bind, .. } = header else {
                    return Err(Error::Protocol(
                        "a server opens only reverse streams".into(),
                    ));
                };
                let open_id = server.next_open_id.fetch_add(1, Ordering::Relaxed);
                let (tx, rx) = oneshot::channel();
                {
                    let mut pending = lock(&server.pending);
                    if pending.len() >= self.limits.max_pending_opens {
                        return Err(Error::Limit("too many reverse opens pending".into()));
                    }
                    pending.insert(open_id, tx);
                }
                let _cleanup = PendingCleanup { server, open_id };
                self.control
                    .send(Control::OpenReverse { open_id, bind })
                    .await
                    .map_err(|_| Error::Closed("control channel closed".into()))?;
                rx.await
                    .map_err(|_| Error::Closed("session closed during open".into()))?
            }
            (Conn::H2Server, Role::Client(_)) => {
                return Err(Error::Protocol(
                    "client session on a server connection".into(),
                ));
            }
        };
        match wire::read_frame::<_, Reply>(&mut recv, max).await? {
            Some(Reply::Ok) => Ok((send, recv)),
            Some(Reply::Error { reason }) => Err(Error::Rejected(reason)),
            None => Err(Error::Rejected("stream closed before a reply".into())),
        }
    }

    // === drain and close ===

    /// Sends goaway and drains: no new streams either way, the open ones finish, then the
    /// connection closes. Streams still open after `grace` are cut. Returns at once.
    pub(crate) fn goaway(self: &Arc<Self>, reason: &str, grace: Duration) {
        self.start_drain(Initiator::Local, reason, grace);
    }

    fn start_drain(self: &Arc<Self>, initiator: Initiator, reason: &str, grace: Duration) {
        let started = self.phase.send_if_modified(|p| {
            if *p == Phase::Open {
                *p = Phase::Draining;
                true
            } else {
                false
            }
        });
        if !started {
            return;
        }
        {
            let mut d = lock(&self.drain);
            d.initiator = Some(initiator);
            d.reason = wire::truncate(reason, MAX_REASON);
        }
        info!(session = self.id, peer = %self.peer, ?initiator, reason, "tunnel session draining");
        if initiator == Initiator::Local {
            self.send_later(Control::GoAway {
                reason: wire::truncate(reason, MAX_REASON),
            });
        }
        let me = self.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + grace;
            tokio::select! {
                _ = me.active.wait_zero() => {}
                _ = tokio::time::sleep_until(deadline) => {
                    me.finish(CloseReason::GraceExpired { open_streams: me.active.count() });
                    return;
                }
                _ = me.cancel.cancelled() => return,
            }
            // Done before telling the peer: its close may arrive before this task runs again.
            lock(&me.drain).local_done = true;
            tokio::select! {
                _ = me.control.send(Control::Drained) => {}
                _ = tokio::time::sleep_until(deadline) => {
                    me.finish(CloseReason::GraceExpired { open_streams: me.active.count() });
                    return;
                }
                _ = me.cancel.cancelled() => return,
            }
            me.maybe_close();
            // Wait for the peer's `drained` (or its close) within what is left of the grace.
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {
                    me.finish(CloseReason::GraceExpired { open_streams: me.active.count() });
                }
                _ = me.cancel.cancelled() => {}
            }
        });
    }

    /// Queues a control message that must not be lost to a momentarily full queue, without
    /// blocking the caller (often the control reader itself).
    pub(crate) fn send_later(&self, msg: Control) {
        if let Err(mpsc::error::TrySendError::Full(msg)) = self.control.try_send(msg)
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let control = self.control.clone();
            let cancel = self.cancel.clone();
            rt.spawn(async move {
                tokio::select! {
                    _ = control.send(msg) => {}
                    _ = cancel.cancelled() => {}
                }
            });
        }
    }

    fn maybe_close(&self) {
        let reason = {
            let d = lock(&self.drain);
            if !(d.local_done && d.peer_done) {
                return;
            }
            CloseReason::Drained {
                initiator: d.initiator.unwrap_or(Initiator::Peer),
                reason: d.reason.clone(),
            }
        };
        self.finish(reason);
    }

    /// The connection ended underneath (whichever task noticed first). Clean if our side had
    /// drained, or if the peer closed with code 0 during a drain: it only does that once both
    /// sides are done, and its own last `drained` may have been discarded by that close.
    pub(crate) fn conn_ended(&self, detail: String) {
        let quic = match &self.conn {
            Conn::Quic { conn, .. } => conn.close_reason(),
            _ => None,
        };
        let reason = {
            let d = lock(&self.drain);
            let peer_closed_clean = d.initiator.is_some()
                && matches!(&quic, Some(quinn::ConnectionError::ApplicationClosed(c))
                    if c.error_code == CLOSE_OK.into());
            if d.local_done || peer_closed_clean {
                CloseReason::Drained {
                    initiator: d.initiator.unwrap_or(Initiator::Peer),
                    reason: d.reason.clone(),
                }
            } else if matches!(quic, Some(quinn::ConnectionError::TimedOut)) {
                CloseReason::KeepaliveTimeout
            } else {
                CloseReason::Lost(detail)
            }
        };
        self.finish(reason);
    }

    /// Ends the session now (idempotent; the first reason wins).
    pub(crate) fn finish(&self, reason: CloseReason) {
        let first = self.phase.send_if_modified(|p| {
            if matches!(p, Phase::Closed(_)) {
                false
            } else {
                *p = Phase::Closed(reason.clone());
                true
            }
        });
        if !first {
            return;
        }
        self.cancel.cancel();
        if let Conn::Quic { conn, .. } = &self.conn {
            let code = if matches!(reason, CloseReason::Drained { .. }) {
                CLOSE_OK
            } else {
                CLOSE_ABORT
            };
            conn.close(
                code.into(),
                wire::truncate(&reason.to_string(), MAX_REASON).as_bytes(),
            );
        }
        self.metrics.transport(self.transport).active.dec();
        if let Role::Server(server) = &self.role {
            lock(&server.pending).clear();
        }
        match &reason {
            CloseReason::Drained { .. } => {
                info!(session = self.id, peer = %self.peer, %reason, "tunnel session closed")
            }
            _ => warn!(session = self.id, peer = %self.peer, %reason, "tunnel session closed"),
        }
    }

    fn is_drained_cleanly(&self) -> bool {
        matches!(self.close_reason(), Some(CloseReason::Drained { .. }))
    }

    // === control messages ===

    fn on_control(self: &Arc<Self>, msg: Control) -> Result<(), Error> {
        msg.validate()?;
        match msg {
            Control::Ping { seq } => {
                let _ = self.control.try_send(Control::Pong { seq });
            }
            Control::Pong { seq } => {
                let mut ping = lock(&self.ping);
                if ping.0 == seq
                    && let Some(sent) = ping.1.take()
                {
                    let rtt = sent.elapsed();
                    *lock(&self.rtt) = Some(rtt);
                    self.metrics.rtt.observe(rtt.as_secs_f64());
                }
            }
            Control::GoAway { reason } => {
                self.start_drain(Initiator::Peer, &reason, self.drain_grace);
            }
            Control::Drained => {
                lock(&self.drain).peer_done = true;
                self.maybe_close();
            }
            Control::Unknown => {}
            msg => match &self.role {
                Role::Server(server) => self.on_server_control(server, msg)?,
                Role::Client(client) => self.on_client_control(client, msg)?,
            },
        }
        Ok(())
    }

    fn on_server_control(&self, server: &ServerRole, msg: Control) -> Result<(), Error> {
        match msg {
            Control::Bind { id, meta } => {
                let error = if let Err(e) =
                    server
                        .authenticator
                        .authorize_bind(&server.identity, &id, &meta)
                {
                    Some(e.to_string())
                } else {
                    let mut error = None;
                    server.binds.send_if_modified(|binds| {
                        if !binds.contains_key(&id) && binds.len() >= self.limits.max_binds {
                            error = Some(format!("at most {} binds", self.limits.max_binds));
                            return false;
                        }
                        if binds.get(&id) == Some(&meta) {
                            return false;
                        }
                        Arc::make_mut(binds).insert(id.clone(), meta.clone());
                        true
                    });
                    error
                };
                match &error {
                    None => {
                        info!(session = self.id, identity = %server.identity.name, bind = %id, "reverse bind registered")
                    }
                    Some(e) => {
                        warn!(session = self.id, identity = %server.identity.name, bind = %id, error = %e, "reverse bind refused")
                    }
                }
                self.send_later(Control::BindAck { id, error });
                Ok(())
            }
            Control::Unbind { id } => {
                server.binds.send_if_modified(|binds| {
                    if binds.contains_key(&id) {
                        Arc::make_mut(binds).remove(&id);
                        true
                    } else {
                        false
                    }
                });
                Ok(())
            }
            other => Err(Error::Protocol(format!(
                "unexpected control message from client: {}",
                control_name(&other)
            ))),
        }
    }

    fn on_client_control(self: &Arc<Self>, client: &ClientRole, msg: Control) -> Result<(), Error> {
        match msg {
            Control::BindAck { id, error } => {
                client.binds.acked(&id, error);
                Ok(())
            }
            Control::OpenReverse { open_id, bind } => {
                let me = self.clone();
                tokio::spawn(async move { me.open_reverse_for_server(open_id, bind).await });
                Ok(())
            }
            other => Err(Error::Protocol(format!(
                "unexpected control message from server: {}",
                control_name(&other)
            ))),
        }
    }

    /// HTTP/2 client: the server wants a reverse stream; open it, tag it with the server's
    /// open id, and hand it to the bind's listener like a QUIC reverse stream.
    async fn open_reverse_for_server(self: Arc<Self>, open_id: u64, bind: String) {
        let Conn::H2Client { send_request, uri } = &self.conn else {
            return;
        };
        let Role::Client(client) = &self.role else {
            return;
        };
        let guard = self.active.enter();
        let header = StreamHeader::Reverse {
            bind: bind.clone(),
            open_id: Some(open_id),
        };
        let opened = tokio::time::timeout(self.limits.open_timeout, async {
            let (mut send, recv) = h2_open(send_request, uri).await?;
            wire::write_frame(&mut send, &header, self.limits.max_header_bytes).await?;
            Ok::<_, Error>((send, recv))
        })
        .await;
        let (send, recv) = match opened {
            Ok(Ok(raw)) => raw,
            Ok(Err(e)) => {
                debug!(session = self.id, %bind, error = %e, "reverse open for the server failed");
                return;
            }
            Err(_) => return,
        };
        let incoming = Incoming::new(
            header,
            send,
            recv,
            self.transport,
            self.metrics.clone(),
            guard,
            self.limits.max_header_bytes,
        );
        client.binds.dispatch(&bind, incoming).await;
    }

    // === accepting ===

    /// A data stream the peer opened: read its header and route it.
    pub(crate) async fn on_stream(self: Arc<Self>, send: RawSend, mut recv: RawRecv) {
        let guard = self.active.enter();
        let max = self.limits.max_header_bytes;
        let header = match tokio::time::timeout(
            self.limits.header_timeout,
            wire::read_frame::<_, StreamHeader>(&mut recv, max),
        )
        .await
        {
            Ok(Ok(Some(h))) => h,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                debug!(session = self.id, error = %e, "bad stream header");
                return;
            }
            Err(_) => {
                debug!(session = self.id, "stream header timed out");
                return;
            }
        };
        // HTTP/2: the client's answer to our `open_reverse` request.
        if let (
            Role::Server(server),
            StreamHeader::Reverse {
                open_id: Some(id), ..
            },
        ) = (&self.role, &header)
        {
            let waiter = lock(&server.pending).remove(id);
            if let Some(tx) = waiter {
                let _ = tx.send((send, recv));
            }
            return;
        }
        let incoming = Incoming::new(
            header.clone(),
            send,
            recv,
            self.transport,
            self.metrics.clone(),
            guard,
            max,
        );
        if let Err(e) = header.validate() {
            incoming.reject(&e.to_string()).await;
            return;
        }
        if !self.is_open() {
            incoming.reject("session is going away").await;
            return;
        }
        match (&self.role, &header) {
            (Role::Server(server), StreamHeader::Connect { .. }) => {
                match server.incoming.try_send(incoming) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(i)) => {
                        i.reject("busy: too many streams waiting to be accepted")
                            .await
                    }
                    Err(mpsc::error::TrySendError::Closed(i)) => {
                        i.reject("session is not accepting streams").await
                    }
                }
            }
            (Role::Client(client), StreamHeader::Reverse { bind, .. }) => {
                client.binds.dispatch(bind, incoming).await;
            }
            _ => {
                incoming
                    .reject("stream kind not accepted by this side")
                    .await
            }
        }
    }
}

struct PendingCleanup<'a> {
    server: &'a ServerRole,
    open_id: u64,
}

impl Drop for PendingCleanup<'_> {
    fn drop(&mut self) {
        lock(&self.server.pending).remove(&self.open_id);
    }
}

fn control_name(msg: &Control) -> &'static str {
    match msg {
        Control::Hello { .. } => "hello",
        Control::Welcome { .. } => "welcome",
        Control::Refused { .. } => "refused",
        Control::Bind { .. } => "bind",
        Control::BindAck { .. } => "bind_ack",
        Control::Unbind { .. } => "unbind",
        Control::OpenReverse { .. } => "open_reverse",
        Control::Ping { .. } => "ping",
        Control::Pong { .. } => "pong",
        Control::GoAway { .. } => "goaway",
        Control::Drained => "drained",
        Control::Unknown => "unknown",
    }
}

/// Opens an HTTP/2 data stream (a POST whose bodies carry the stream), waiting for stream
/// capacity under the server's `max_concurrent_streams`.
pub(crate) async fn h2_open(
    send_request: &h2::client::SendRequest<Bytes>,
    uri: &http::Uri,
) -> Result<(RawSend, RawRecv), Error> {
    let mut sr = send_request.clone().ready().await?;
    let mut path = uri.clone().into_parts();
    path.path_and_query = Some(http::uri::PathAndQuery::from_static(H2_STREAM_PATH));
    let uri = http::Uri::from_parts(path).map_err(|e| Error::Protocol(e.to_string()))?;
    let request = http::Request::post(uri)
        .body(())
        .map_err(|e| Error::Protocol(e.to_string()))?;
    let (response, send) = sr.send_request(request, false)?;
    Ok((
        RawSend::h2(send),
        RawRecv::H2(crate::stream::H2Recv::Pending(response)),
    ))
}
