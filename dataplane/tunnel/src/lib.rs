//! The workstation ⇄ cluster tunnel: multiplexed, authenticated byte streams between
//! `spur local connect` (client) and the in-cluster tunnel proxy (server), over QUIC, with
//! HTTP/2 over TLS as the fallback where UDP is blocked.
//!
//! ```text
//! TunnelClient ── session (one QUIC connection, or one TLS+HTTP/2 connection) ── TunnelServer
//!   control stream: hello/welcome|refused, bind/bind_ack/unbind, ping/pong, goaway/drained,
//!                   open_reverse (HTTP/2 only)
//!   forward streams:  client opens  {"kind":"connect","host":…,"port":…}  → server accepts
//!   reverse streams:  server opens  {"kind":"reverse","bind":…}           → client's listener
//! ```
//!
//! Every data stream starts with a header frame from its opener and a reply frame
//! (`ok` | `error` with a reason) from its acceptor; raw bytes follow. Over QUIC either side
//! opens bidirectional streams natively. HTTP/2 streams are client requests only, so for a
//! reverse stream the server sends `open_reverse` on the control stream and the client opens
//! the request for it (one extra round trip, HTTP/2 only).
//!
//! The client keeps a session up: it tries the transports in policy order (the one that
//! worked last first), reconnects with jittered exponential backoff, and re-registers every
//! reverse listener on each new session. Both ends drain on goaway: no new streams, open ones
//! finish within a grace period, then the connection closes. See `docs/tunnel.md`.

mod auth;
mod bbr;
mod client;
mod config;
mod error;
mod handshakes;
mod metrics;
mod server;
mod session;
mod stream;
mod tls;
mod udp;
mod wire;

use std::fmt;

pub use auth::{
    AuthError, AuthFuture, AuthMethod, AuthRequest, Authenticator, Identity, StaticAuthenticator,
    identity_from_cert,
};
pub use client::{ClientMetrics, ReverseListener, SessionState, TunnelClient};
pub use config::{
    Backoff, ClientConfig, ClientTls, Congestion, Keepalive, Limits, ServerCert, ServerConfig,
    ServerTls, TransportPolicy,
};
pub use error::{Error, RefusalCode};

/// Buffer size for copying between a TCP socket and a tunnel stream (each direction). Eight
/// times tokio's default: one read fills a QUIC packet train or an HTTP/2 frame of 16 KiB four
/// times over, so the per-byte cost of syscalls and frame headers drops (measured in
/// perf/results/tunnel_vs_ssh.md); 128 KiB per carried connection.
pub const COPY_BUFFER: usize = 64 * 1024;
pub use server::{Session, SessionHandle, TunnelServer};
pub use session::binds::BindStatus;
pub use session::{Binds, CloseReason, Initiator};
pub use stream::{Incoming, Stream};
pub use wire::{
    H2_ALPN, H2_CONTROL_PATH, H2_STREAM_PATH, MAX_BIND_ID, MAX_BIND_META, PROTOCOL_VERSION,
    QUIC_ALPN, StreamHeader, StreamKind, Token, read_frame, write_frame,
};

/// The transport a session runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// QUIC (UDP), the default.
    Quic,
    /// HTTP/2 over TLS (TCP), the fallback.
    H2,
}

impl Transport {
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Quic => "quic",
            Transport::H2 => "h2",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
