use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Everything this crate reports. Per-connection failures (a local process that is not
/// listening, a cluster dial that fails) never surface as this type: they become a rejected
/// tunnel stream or a closed connection, a status entry and a log line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("tunnel: {0}")]
    Tunnel(#[from] spur_tunnel::Error),
    #[error("tunnel API: {0}")]
    Api(String),
    #[error("cannot listen on {addr} ({what}): {source}")]
    Listen {
        what: &'static str,
        addr: SocketAddr,
        source: io::Error,
    },
    #[error("{what} {}: {source}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{} is not valid: {reason}", path.display())]
    Invalid { path: PathBuf, reason: String },
    #[error("`spur local connect` is already running (pid {pid}, state file {})", path.display())]
    AlreadyRunning { pid: u32, path: PathBuf },
    #[error("SOCKS5 proxy {addr}: {reason}")]
    Socks { addr: SocketAddr, reason: String },
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
}

impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        Error::Api(format!("{:?}: {}", s.code(), s.message()))
    }
}

impl From<tonic::transport::Error> for Error {
    fn from(e: tonic::transport::Error) -> Self {
        // The transport error's Display is terse ("transport error"); its source says why.
        let mut why = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            why.push_str(": ");
            why.push_str(&s.to_string());
            source = s.source();
        }
        Error::Api(why)
    }
}
