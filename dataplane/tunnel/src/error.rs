//! The library's error type, and the code a server refuses a session with (sent on the wire,
//! carried by [`Error::Refused`]).

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::Transport;

/// Everything the tunnel library reports. Stream I/O errors surface as [`std::io::Error`] from
/// the [`Stream`](crate::Stream)'s `AsyncRead`/`AsyncWrite`; this type covers setup, handshakes,
/// opens and binds.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid tunnel configuration: {0}")]
    Config(String),
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error("cannot bind {addr}: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
    #[error("connecting over {transport} to {addr}: {reason}")]
    Connect {
        transport: Transport,
        addr: String,
        reason: String,
    },
    /// The server refused the session (authentication, version, capacity). `retry` is the
    /// server's hint whether trying again later can succeed.
    #[error("refused by the tunnel server ({code}): {reason}")]
    Refused {
        code: RefusalCode,
        reason: String,
        retry: bool,
    },
    /// The peer sent something this version does not accept (malformed or unexpected frame).
    #[error("tunnel protocol error: {0}")]
    Protocol(String),
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge { len: usize, max: usize },
    /// The peer answered a stream open with an error (e.g. the cluster-side connect failed, or
    /// no local listener for that bind).
    #[error("stream rejected by the peer: {0}")]
    Rejected(String),
    #[error("{what} timed out after {after:?}")]
    Timeout { what: &'static str, after: Duration },
    /// The client has no usable session (disconnected for longer than `open_wait`).
    #[error("not connected: {0}")]
    NotConnected(String),
    /// The session or client is closed or going away.
    #[error("closed: {0}")]
    Closed(String),
    #[error("limit reached: {0}")]
    Limit(String),
    #[error("bind {id:?} rejected: {reason}")]
    BindRejected { id: String, reason: String },
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    #[error("QUIC connection: {0}")]
    Quic(#[from] quinn::ConnectionError),
    #[error("HTTP/2: {0}")]
    H2(#[from] h2::Error),
}

/// Why the server refused a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalCode {
    /// No or unknown credentials.
    Unauthenticated,
    /// The credentials were valid once and have expired.
    Expired,
    /// Authenticated, but not allowed.
    Forbidden,
    /// The server cannot decide or accept now (authenticator down, too many sessions).
    Unavailable,
    /// The client speaks a protocol version the server does not.
    UnsupportedVersion,
    /// The client broke the handshake protocol.
    Protocol,
    /// A code from a newer peer.
    #[serde(other)]
    Other,
}

impl fmt::Display for RefusalCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RefusalCode::Unauthenticated => "unauthenticated",
            RefusalCode::Expired => "expired",
            RefusalCode::Forbidden => "forbidden",
            RefusalCode::Unavailable => "unavailable",
            RefusalCode::UnsupportedVersion => "unsupported_version",
            RefusalCode::Protocol => "protocol",
            RefusalCode::Other => "other",
        })
    }
}
