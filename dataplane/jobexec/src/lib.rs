//! The job executor (`spur-job-executor`): runs Jobs inside a runner pod of any image, driven
//! by the operator over the mutually authenticated gRPC job-execution API of
//! `proto/jobs.proto` (start, live logs, cancel, time limit, artifacts, release).
//!
//! A runner pod's init container (Spur's image) copies this static binary and the TLS files
//! into a volume (`spur-job-executor install`); the runner container, built from the user's
//! image, runs it (`spur-job-executor serve`), so no custom image is ever built. See
//! docs/jobs.md.

pub mod artifacts;
pub mod attempt;
pub mod client;
mod service;
pub mod tls;

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use spur_proto::jobs::job_executor_server::JobExecutorServer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

pub use attempt::Limits;
pub use service::{Service, status_of};

/// The port the operator dials.
pub const DEFAULT_PORT: u16 = 7447;
/// The longest a TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything that can go wrong before the executor serves.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("TLS: {0}")]
    Tls(String),
    #[error("cannot become a child subreaper: {0}")]
    Subreaper(nix::Error),
    #[error("serving: {0}")]
    Serve(String),
}

/// What `serve` needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where attempts keep their script, log and working directory.
    pub work_dir: PathBuf,
    pub limits: Limits,
}

/// Serves the job-execution API on `listener` with `tls` until `stop`; a running attempt is
/// canceled on the way out (its processes must not outlive the executor).
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    cfg: Config,
    stop: CancellationToken,
) -> Result<(), Error> {
    // Orphans of a job are re-parented to us, so we can find and kill them.
    nix::sys::prctl::set_child_subreaper(true).map_err(Error::Subreaper)?;
    std::fs::create_dir_all(&cfg.work_dir).map_err(|source| Error::Io {
        path: cfg.work_dir.clone(),
        source,
    })?;
    // No key until a job that asked for one runs.
    if let Some(path) = &cfg.limits.routing_key_file {
        attempt::write_key_file(path, "").map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
    }
    let local = listener.local_addr().map_err(|source| Error::Io {
        path: "listener".into(),
        source,
    })?;
    tracing::info!(%local, work_dir = %cfg.work_dir.display(), "job executor listening");
    let service = Arc::new(Service::new(cfg.work_dir.clone(), cfg.limits.clone()));
    let incoming = accept_tls(listener, tls, stop.clone());
    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .add_service(JobExecutorServer::from_arc(service.clone()))
        .serve_with_incoming_shutdown(incoming, stop.cancelled())
        .await
        .map_err(|e| Error::Serve(e.to_string()));
    service.shutdown().await;
    result
}

/// Accepts TCP connections and completes TLS handshakes off the accept loop; failed ones are
/// logged and dropped.
fn accept_tls(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    stop: CancellationToken,
) -> ReceiverStream<io::Result<TlsConn>> {
    let (tx, rx) = mpsc::channel(16);
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    tokio::spawn(async move {
        while let Some((tcp, peer)) =
            spur_runtime::accept(&listener, stop.cancelled(), "job executor").await
        {
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => {
                        let _ = tx.send(Ok(TlsConn(Box::new(s), peer))).await;
                    }
                    Ok(Err(e)) => tracing::warn!(%peer, error = %e, "TLS handshake refused"),
                    Err(_) => tracing::warn!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// An authenticated connection.
pub struct TlsConn(Box<tokio_rustls::server::TlsStream<TcpStream>>, SocketAddr);

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = SocketAddr;
    fn connect_info(&self) -> SocketAddr {
        self.1
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}
