//! Ways to open a byte stream to a cluster address: a forward stream of this process's tunnel
//! session, or a SOCKS5 `CONNECT` through a running `spur local connect`. Names are resolved
//! where the stream ends, i.e. in the cluster.

use std::any::Any;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use spur_forward::{DialError, Dialer, Target};
use spur_tunnel::TunnelClient;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::Error;

/// A bidirectional byte stream with half-close (`shutdown` ends the write side only).
pub trait ByteStream: AsyncRead + AsyncWrite + Send + Unpin + Any {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> ByteStream for T {}

pub type BoxStream = Box<dyn ByteStream>;
pub type OpenFuture<'a> = Pin<Box<dyn Future<Output = Result<BoxStream, Error>> + Send + 'a>>;

/// Opens streams to `host:port` as seen from the cluster.
pub trait Opener: Send + Sync + 'static {
    fn open<'a>(&'a self, host: &'a str, port: u16) -> OpenFuture<'a>;
}

/// Forward streams of a tunnel session.
#[derive(Clone)]
pub struct TunnelOpener(pub Arc<TunnelClient>);

impl Opener for TunnelOpener {
    fn open<'a>(&'a self, host: &'a str, port: u16) -> OpenFuture<'a> {
        Box::pin(async move {
            let s = self.0.open(host, port).await?;
            Ok(Box::new(s) as BoxStream)
        })
    }
}

/// SOCKS5 `CONNECT` (no authentication, host names passed unresolved) through the local proxy
/// of a running `spur local connect`.
#[derive(Clone, Debug)]
pub struct SocksOpener {
    pub addr: SocketAddr,
    pub timeout: Duration,
}

impl SocksOpener {
    pub fn new(addr: SocketAddr) -> Self {
        SocksOpener {
            addr,
            timeout: Duration::from_secs(15),
        }
    }

    async fn connect(&self, host: &str, port: u16) -> Result<TcpStream, Error> {
        let fail = |reason: String| Error::Socks {
            addr: self.addr,
            reason,
        };
        let io = |e: std::io::Error| fail(e.to_string());
        let host_len =
            u8::try_from(host.len()).map_err(|_| fail(format!("host name too long: {host}")))?;
        let mut s = TcpStream::connect(self.addr).await.map_err(|e| {
            fail(format!(
                "{e} (is `spur local connect` running? see `spur local status`)"
            ))
        })?;
        let _ = s.set_nodelay(true);
        s.write_all(&[0x05, 0x01, 0x00]).await.map_err(io)?;
        let mut choice = [0u8; 2];
        s.read_exact(&mut choice).await.map_err(io)?;
        if choice != [0x05, 0x00] {
            return Err(fail(format!(
                "proxy wants authentication method {}",
                choice[1]
            )));
        }
        let mut req = Vec::with_capacity(7 + host.len());
        req.extend_from_slice(&[0x05, 0x01, 0x00, 0x03, host_len]);
        req.extend_from_slice(host.as_bytes());
        req.extend_from_slice(&port.to_be_bytes());
        s.write_all(&req).await.map_err(io)?;
        let mut head = [0u8; 4];
        s.read_exact(&mut head).await.map_err(io)?;
        if head[0] != 0x05 {
            return Err(fail(format!("bad reply version {}", head[0])));
        }
        if head[1] != 0x00 {
            return Err(fail(format!(
                "{host}:{port}: {}",
                socks_reply_text(head[1])
            )));
        }
        // The bound address: skip it.
        let rest = match head[3] {
            0x01 => 4 + 2,
            0x04 => 16 + 2,
            0x03 => {
                let mut len = [0u8; 1];
                s.read_exact(&mut len).await.map_err(io)?;
                usize::from(len[0]) + 2
            }
            other => return Err(fail(format!("bad address type {other} in reply"))),
        };
        let mut skip = [0u8; 258];
        s.read_exact(&mut skip[..rest]).await.map_err(io)?;
        Ok(s)
    }
}

fn socks_reply_text(code: u8) -> &'static str {
    match code {
        0x01 => "general failure",
        0x02 => "not allowed",
        0x03 => "network unreachable",
        0x04 => "host not found",
        0x05 => "connection refused",
        0x06 => "timed out",
        0x07 => "command not supported",
        0x08 => "address type not supported",
        _ => "unknown error",
    }
}

impl Opener for SocksOpener {
    fn open<'a>(&'a self, host: &'a str, port: u16) -> OpenFuture<'a> {
        Box::pin(async move {
            match tokio::time::timeout(self.timeout, self.connect(host, port)).await {
                Ok(r) => r.map(|s| Box::new(s) as BoxStream),
                Err(_) => Err(Error::Socks {
                    addr: self.addr,
                    reason: format!("{host}:{port}: timed out after {:?}", self.timeout),
                }),
            }
        })
    }
}

/// The local SOCKS5 / HTTP CONNECT proxy's dialer: every target becomes a forward tunnel
/// stream, so cluster names are resolved in the cluster.
pub(crate) struct TunnelDialer {
    pub(crate) client: Arc<TunnelClient>,
}

impl Dialer for TunnelDialer {
    type Stream = spur_tunnel::Stream;

    async fn dial(
        &self,
        target: &Target,
        _client: SocketAddr,
        _user: Option<&str>,
    ) -> Result<spur_tunnel::Stream, DialError> {
        let (host, port) = match target {
            Target::Host(h, p) => (h.clone(), *p),
            Target::Addr(a) => (a.ip().to_string(), a.port()),
        };
        self.client
            .open(&host, port)
            .await
            .map_err(|e| dial_error(target, e))
    }

    fn finished(&self, record: &spur_forward::ConnRecord) {
        tracing::debug!(
            protocol = record.protocol,
            client = %record.client,
            target = record.target.as_ref().map(|t| t.to_string()).unwrap_or_default(),
            up = record.bytes_up,
            down = record.bytes_down,
            duration_ms = record.duration.as_millis() as u64,
            outcome = %record.outcome,
            "local proxy connection"
        );
    }
}

/// Maps a tunnel open failure onto SOCKS5 reply codes / HTTP statuses. The cluster side's
/// reason text comes from `DialError`'s Display ("connection refused: …").
fn dial_error(target: &Target, e: spur_tunnel::Error) -> DialError {
    use spur_tunnel::Error as E;
    match e {
        E::Rejected(reason) => {
            let r = reason.to_ascii_lowercase();
            if r.contains("refused") {
                DialError::Refused(reason)
            } else if r.contains("not found")
                || r.contains("failed to lookup")
                || r.contains("name or service")
                || r.contains("no such host")
            {
                DialError::HostNotFound(reason)
            } else if r.contains("timed out") {
                DialError::TimedOut(reason)
            } else if r.contains("unreachable") {
                DialError::Unreachable(reason)
            } else if r.contains("not allowed") || r.contains("forbidden") {
                DialError::NotAllowed(reason)
            } else {
                DialError::Other(reason)
            }
        }
        E::Timeout { .. } => DialError::TimedOut(format!("{target}: {e}")),
        other => DialError::Unreachable(format!("{target}: tunnel: {other}")),
    }
}

/// Copies both ways between `a` and an opened stream until both directions ended, preserving
/// half-close. Returns (a→b, b→a). A tunnel stream takes buffers whole
/// ([`spur_tunnel::Stream::splice`]), one copy less each way.
pub(crate) async fn splice<A>(a: A, b: BoxStream) -> std::io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin,
{
    match downcast::<spur_tunnel::Stream>(b) {
        Ok(mut stream) => stream.splice(a).await,
        Err(b) => copy_both(a, b).await,
    }
}

/// The stream as a `T` if that is what it is, else unchanged.
fn downcast<T: ByteStream>(b: BoxStream) -> Result<Box<T>, BoxStream> {
    // `&*b`: the boxed value's type, not the box's.
    if (&*b as &dyn Any).is::<T>() {
        let any: Box<dyn Any + Send> = b;
        if let Ok(t) = any.downcast::<T>() {
            return Ok(t);
        }
        unreachable!("`is` and `downcast` disagree");
    }
    Err(b)
}

/// Copies both ways until both directions ended, preserving half-close. Returns (a→b, b→a).
pub(crate) async fn copy_both<A, B>(mut a: A, mut b: B) -> std::io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    tokio::io::copy_bidirectional_with_sizes(
        &mut a,
        &mut b,
        spur_tunnel::COPY_BUFFER,
        spur_tunnel::COPY_BUFFER,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downcast_finds_the_boxed_type() {
        let (a, _b) = tokio::io::duplex(16);
        let boxed: BoxStream = Box::new(a);
        let boxed = match downcast::<tokio::io::SimplexStream>(boxed) {
            Ok(_) => panic!("a duplex stream is not a simplex stream"),
            Err(b) => b,
        };
        assert!(downcast::<tokio::io::DuplexStream>(boxed).is_ok());
    }
}
