//! Accept loop shared by the servers.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Waits for the next connection, or `None` once `shutdown` is cancelled.
///
/// Accept errors never end the server: a demo upstream that dies because a client reset
/// mid-handshake or the process briefly ran out of descriptors would make tests flaky.
pub async fn accept(
    listener: &TcpListener,
    shutdown: &CancellationToken,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        let res = tokio::select! {
            biased;
            () = shutdown.cancelled() => return None,
            res = listener.accept() => res,
        };
        match res {
            Ok((stream, peer)) => {
                // Latency matters more than throughput for these small request/response apps.
                let _ = stream.set_nodelay(true);
                return Some((stream, peer));
            }
            Err(e) => {
                tracing::debug!(error = %e, "accept failed");
                if !matches!(
                    e.kind(),
                    ErrorKind::ConnectionAborted
                        | ErrorKind::ConnectionReset
                        | ErrorKind::Interrupted
                ) {
                    // Back off so resource exhaustion (EMFILE) does not turn into a busy loop.
                    tokio::select! {
                        () = shutdown.cancelled() => return None,
                        () = tokio::time::sleep(Duration::from_millis(50)) => {}
                    }
                }
            }
        }
    }
}
