//! Plain configuration structs for both ends, validated once when a server or client starts.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::ResolvesServerCert;

use crate::auth::Authenticator;
use crate::error::Error;
use crate::wire::Token;

/// Bounds on everything a peer can make this side hold.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Concurrent data streams per session. QUIC: per direction (each side grants the other
    /// this many bidirectional streams). HTTP/2: all streams of the connection, both directions,
    /// since every stream is a client request there.
    pub max_streams: u32,
    /// Receive window per stream, in bytes (QUIC `stream_receive_window`, HTTP/2 initial
    /// window size).
    pub stream_window: u32,
    /// Receive window per connection, in bytes; also QUIC's send buffer.
    pub connection_window: u32,
    /// Largest stream header or reply frame, in bytes.
    pub max_header_bytes: usize,
    /// Largest control message, in bytes.
    pub max_control_bytes: usize,
    /// Streams waiting for the application's `accept` (per session, or per reverse listener).
    /// Beyond that, opens are rejected with "busy".
    pub accept_queue: usize,
    /// HTTP/2 only: reverse opens waiting for the client to open the stream.
    pub max_pending_opens: usize,
    /// Reverse listeners per session.
    pub max_binds: usize,
    /// How long an open waits for the peer's answer (and for HTTP/2 stream capacity).
    pub open_timeout: Duration,
    /// How long an accepted stream may take to send its header.
    pub header_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_streams: 256,
            stream_window: 4 * 1024 * 1024,
            connection_window: 16 * 1024 * 1024,
            max_header_bytes: 4096,
            max_control_bytes: 64 * 1024,
            accept_queue: 128,
            max_pending_opens: 128,
            max_binds: 64,
            open_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(5),
        }
    }
}

impl Limits {
    pub(crate) fn validate(&self) -> Result<(), Error> {
        let bad = |what: &str| Err(Error::Config(what.to_owned()));
        if self.max_streams == 0 {
            return bad("max_streams must be > 0");
        }
        if self.stream_window < 16 * 1024 || self.stream_window > (1 << 30) {
            return bad("stream_window must be within 16 KiB ..= 1 GiB");
        }
        // HTTP/2's largest window is 2^31 - 1.
        if self.connection_window < self.stream_window || self.connection_window > (1 << 30) {
            return bad("connection_window must be within stream_window ..= 1 GiB");
        }
        if self.max_header_bytes < 256 || self.max_control_bytes < 1024 {
            return bad("max_header_bytes must be >= 256 and max_control_bytes >= 1024");
        }
        if self.accept_queue == 0 || self.max_pending_opens == 0 || self.max_binds == 0 {
            return bad("accept_queue, max_pending_opens and max_binds must be > 0");
        }
        if self.open_timeout.is_zero() || self.header_timeout.is_zero() {
            return bad("open_timeout and header_timeout must be > 0");
        }
        Ok(())
    }
}

/// Liveness. The transport decides whether the peer is alive (QUIC keep-alive and idle
/// timeout, HTTP/2 PING frames — neither is subject to flow control, so a stalled stream can
/// never make a live peer look dead); the control channel's ping/pong measures round-trip time.
#[derive(Clone, Debug)]
pub struct Keepalive {
    /// How often to ping.
    pub interval: Duration,
    /// A session that hears nothing for this long is dead.
    pub timeout: Duration,
}

impl Default for Keepalive {
    fn default() -> Self {
        Keepalive {
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(20),
        }
    }
}

impl Keepalive {
    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.interval.is_zero() || self.timeout <= self.interval {
            return Err(Error::Config(
                "keepalive: interval must be > 0 and timeout > interval".into(),
            ));
        }
        Ok(())
    }
}

/// QUIC congestion control. (The HTTP/2 fallback runs on the kernel's TCP, whose algorithm is
/// the host's `net.ipv4.tcp_congestion_control`.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Congestion {
    /// BBR: paces to the measured bottleneck bandwidth and does not read random loss as
    /// congestion. A workstation's path crosses Wi-Fi, VPNs and hotel links where packets are
    /// lost without any queue being full; there, loss-based Cubic keeps halving its window
    /// (at 1 % loss it moved a quarter of BBR's throughput: perf/results/tunnel_vs_ssh.md).
    /// Spur's own BBR v1 with delivery-rate sampling (quinn's experimental one misreads
    /// bandwidth when ACKs cover several packets); Cubic is one setting away.
    #[default]
    Bbr,
    /// Cubic (RFC 9438), quinn's default: loss-based.
    Cubic,
}

/// The server's certificate: fixed, or from a resolver (for hot-swapped certificates).
pub enum ServerCert {
    Static {
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    },
    Resolver(Arc<dyn ResolvesServerCert>),
}

impl fmt::Debug for ServerCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServerCert::Static { chain, .. } => f
                .debug_struct("Static")
                .field("chain_len", &chain.len())
                .finish_non_exhaustive(),
            ServerCert::Resolver(_) => f.write_str("Resolver"),
        }
    }
}

#[derive(Debug)]
pub struct ServerTls {
    pub cert: ServerCert,
    /// CA certificates client certificates are verified against. Empty: no client
    /// certificates are requested.
    pub client_ca: Vec<CertificateDer<'static>>,
    /// With `client_ca` set: refuse the TLS handshake without a client certificate (otherwise a
    /// client may still authenticate with a token).
    pub require_client_cert: bool,
}

pub struct ServerConfig {
    /// UDP address of the QUIC listener; `None` disables QUIC.
    pub quic_addr: Option<SocketAddr>,
    /// TCP address of the HTTP/2-over-TLS listener; `None` disables it.
    pub h2_addr: Option<SocketAddr>,
    pub tls: ServerTls,
    pub authenticator: Arc<dyn Authenticator>,
    pub keepalive: Keepalive,
    pub limits: Limits,
    /// QUIC congestion control of the server's sending side.
    pub congestion: Congestion,
    /// TLS handshake plus `hello`/authentication must finish within this time.
    pub handshake_timeout: Duration,
    /// Established sessions; beyond this, new ones are refused (`unavailable`, retry).
    pub max_sessions: usize,
    /// Connections in their handshake (TLS, `hello`, authentication) at once, over both
    /// listeners. Every connection is accepted; when this many are in flight, a new one takes
    /// the slot of the oldest, whose handshake is cut short (idle connections are the oldest).
    pub max_handshakes: usize,
    /// Handshakes in flight from one peer (an IPv4 address, an IPv6 /64); beyond that its new
    /// connections are closed at once. Workstations behind one NAT share an address: each
    /// handshake takes a few round trips, and a refused client reconnects with backoff.
    pub max_handshakes_per_peer: usize,
    /// Sessions established but not yet taken by [`TunnelServer::accept`](crate::TunnelServer).
    pub session_queue: usize,
    /// Grace period of a drain the peer starts with `goaway`.
    pub drain_grace: Duration,
}

impl ServerConfig {
    /// A configuration with defaults for everything but the listeners, TLS and authenticator.
    pub fn new(tls: ServerTls, authenticator: Arc<dyn Authenticator>) -> Self {
        ServerConfig {
            quic_addr: None,
            h2_addr: None,
            tls,
            authenticator,
            keepalive: Keepalive::default(),
            limits: Limits::default(),
            congestion: Congestion::default(),
            handshake_timeout: Duration::from_secs(10),
            max_sessions: 1024,
            max_handshakes: 256,
            max_handshakes_per_peer: 16,
            session_queue: 64,
            drain_grace: Duration::from_secs(10),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.quic_addr.is_none() && self.h2_addr.is_none() {
            return Err(Error::Config("neither quic_addr nor h2_addr is set".into()));
        }
        if self.max_sessions == 0
            || self.max_handshakes == 0
            || self.max_handshakes_per_peer == 0
            || self.session_queue == 0
        {
            return Err(Error::Config(
                "max_sessions, max_handshakes, max_handshakes_per_peer and session_queue must be > 0"
                    .into(),
            ));
        }
        if self.handshake_timeout.is_zero() {
            return Err(Error::Config("handshake_timeout must be > 0".into()));
        }
        self.limits.validate()?;
        self.keepalive.validate()
    }
}

impl fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerConfig")
            .field("quic_addr", &self.quic_addr)
            .field("h2_addr", &self.h2_addr)
            .field("tls", &self.tls)
            .field("keepalive", &self.keepalive)
            .field("limits", &self.limits)
            .field("congestion", &self.congestion)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_sessions", &self.max_sessions)
            .field("max_handshakes", &self.max_handshakes)
            .field("max_handshakes_per_peer", &self.max_handshakes_per_peer)
            .finish_non_exhaustive()
    }
}

/// Which transports the client tries, in which order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportPolicy {
    /// QUIC first, HTTP/2 if QUIC fails. After a success, reconnects try the transport that
    /// worked last first, so a network that blocks UDP does not pay the QUIC timeout each time.
    #[default]
    QuicThenH2,
    H2ThenQuic,
    QuicOnly,
    H2Only,
}

#[derive(Debug)]
pub struct ClientTls {
    /// CA certificates the server's certificate must chain to.
    pub roots: Vec<CertificateDer<'static>>,
    /// A client certificate (chain, key) for mTLS.
    pub client_cert: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
}

impl Clone for ClientTls {
    /// A key is cloned on purpose only (`clone_key`): one client per server replica.
    fn clone(&self) -> Self {
        ClientTls {
            roots: self.roots.clone(),
            client_cert: self
                .client_cert
                .as_ref()
                .map(|(chain, key)| (chain.clone(), key.clone_key())),
        }
    }
}

/// Reconnect backoff: `initial`, doubling up to `max`, each delay drawn uniformly from
/// [delay/2, delay] so that many clients restarted together do not reconnect in lockstep.
#[derive(Clone, Debug)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(15),
        }
    }
}

#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Name the server certificate must carry (SNI and verification).
    pub server_name: String,
    /// `host:port` of the server's QUIC listener (resolved at each attempt).
    pub quic_addr: Option<String>,
    /// `host:port` of the server's HTTP/2-over-TLS listener.
    pub h2_addr: Option<String>,
    pub transports: TransportPolicy,
    pub tls: ClientTls,
    pub token: Option<Token>,
    /// Shown in the server's logs and audit.
    pub client_name: String,
    /// One transport attempt (connect, TLS, `hello`/`welcome`) must finish within this time.
    pub connect_timeout: Duration,
    /// How long `open` and `bind` wait for a session while the client is (re)connecting.
    pub open_wait: Duration,
    pub backoff: Backoff,
    pub keepalive: Keepalive,
    pub limits: Limits,
    /// QUIC congestion control of the client's sending side.
    pub congestion: Congestion,
    /// Grace period of a drain the server starts with `goaway`.
    pub drain_grace: Duration,
}

impl ClientConfig {
    pub fn new(server_name: impl Into<String>, tls: ClientTls) -> Self {
        ClientConfig {
            server_name: server_name.into(),
            quic_addr: None,
            h2_addr: None,
            transports: TransportPolicy::default(),
            tls,
            token: None,
            client_name: String::new(),
            connect_timeout: Duration::from_secs(5),
            open_wait: Duration::from_secs(10),
            backoff: Backoff::default(),
            keepalive: Keepalive::default(),
            limits: Limits::default(),
            congestion: Congestion::default(),
            drain_grace: Duration::from_secs(10),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.quic_addr.is_none() && self.h2_addr.is_none() {
            return Err(Error::Config("neither quic_addr nor h2_addr is set".into()));
        }
        let wants_quic = !matches!(self.transports, TransportPolicy::H2Only);
        let wants_h2 = !matches!(self.transports, TransportPolicy::QuicOnly);
        if (!wants_quic || self.quic_addr.is_none()) && (!wants_h2 || self.h2_addr.is_none()) {
            return Err(Error::Config(
                "the transport policy leaves no transport with an address".into(),
            ));
        }
        if self.tls.roots.is_empty() {
            return Err(Error::Config("tls.roots is empty".into()));
        }
        if self.connect_timeout.is_zero() || self.open_wait.is_zero() {
            return Err(Error::Config(
                "connect_timeout and open_wait must be > 0".into(),
            ));
        }
        if self.backoff.initial.is_zero() || self.backoff.max < self.backoff.initial {
            return Err(Error::Config("backoff: 0 < initial <= max".into()));
        }
        if crate::wire::validate_host(&self.server_name).is_err() {
            return Err(Error::Config("invalid server_name".into()));
        }
        if self.client_name.len() > crate::wire::MAX_CLIENT_NAME
            || self.client_name.chars().any(char::is_control)
        {
            return Err(Error::Config("invalid client_name".into()));
        }
        self.limits.validate()?;
        self.keepalive.validate()
    }
}
