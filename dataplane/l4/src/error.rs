use std::io;
use std::net::SocketAddr;

use crate::config::Protocol;

/// Everything the L4 library reports. Per-session failures (an unreachable endpoint, a full
/// session table, an ICMP error) never surface as this type: they end or refuse the one session
/// and count in a metric.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration was refused; the message names the offending field.
    #[error("invalid L4 configuration: {0}")]
    Config(String),
    /// A listener's socket could not be opened; nothing of that update was applied.
    #[error("listener {listener:?}: cannot bind {protocol} {addr}: {source}")]
    Bind {
        listener: String,
        protocol: Protocol,
        addr: SocketAddr,
        source: io::Error,
    },
    /// An endpoint update named a cluster that the running configuration does not have.
    #[error("unknown cluster {0:?}")]
    UnknownCluster(String),
    /// The listener set's shutdown token was cancelled: it takes no more updates.
    #[error("the listener set is shutting down")]
    ShuttingDown,
}
