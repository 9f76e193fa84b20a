use std::io;
use std::time::Duration;

/// Everything the proxy library reports. Per-request failures never surface as this type: they
/// become HTTP error responses (502/504/…) or closed connections and a metric.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid proxy configuration: {0}")]
    Config(String),
    #[error("routing configuration: {0}")]
    Routing(#[from] spur_routing::Error),
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: io::Error,
    },
    #[error("connecting to {upstream} timed out after {timeout:?}")]
    ConnectTimeout { upstream: String, timeout: Duration },
    #[error("connecting to {upstream}: {source}")]
    Connect { upstream: String, source: io::Error },
    #[error("HTTP handshake with {upstream}: {source}")]
    Handshake {
        upstream: String,
        source: hyper::Error,
    },
    #[error("upstream {upstream}: {source}")]
    Upstream {
        upstream: String,
        source: hyper::Error,
    },
    /// The HTTP/2 relay's upstream connection or stream failed.
    #[error("upstream {upstream}: {source}")]
    Stream { upstream: String, source: h2::Error },
    /// The HTTP/2 relay's upstream connection went away (a GOAWAY, or its end) as a stream was
    /// being opened on it: nothing of the request was sent, so it may be sent again elsewhere.
    #[error("upstream {upstream}: connection went away before the stream was opened: {source}")]
    StreamNotOpened { upstream: String, source: h2::Error },
    #[error("admin server: {0}")]
    Admin(io::Error),
    /// A relayed Kafka connection refused a frame (bad framing, a message that does not decode,
    /// a record batch that is not well-formed): the connection is closed.
    #[error("Kafka connection: {0}")]
    Kafka(#[from] spur_kafka::Error),
    #[error("Kafka connection I/O: {0}")]
    KafkaIo(io::Error),
}
