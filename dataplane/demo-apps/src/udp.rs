//! UDP echo: answers every datagram with `<name> ` followed by the datagram, so a test can tell
//! which worker a session reached (the L4 listeners' consistent hashing, health checks).

use std::sync::Arc;

use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use crate::Error;

/// Largest UDP payload over IPv4.
const MAX_DATAGRAM: usize = 65_507;

/// Echoes on `socket` until `shutdown` is cancelled. A reply that would exceed the largest UDP
/// payload (the name does not fit in front of a datagram that big) is cut to fit.
pub async fn serve_udp_echo(
    socket: UdpSocket,
    name: String,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let socket = Arc::new(socket);
    let prefix = format!("{name} ").into_bytes();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut reply = Vec::with_capacity(MAX_DATAGRAM);
    loop {
        let (n, peer) = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            r = socket.recv_from(&mut buf) => match r {
                Ok(got) => got,
                // ICMP errors of earlier replies surface here on some systems: not fatal.
                Err(e) => {
                    tracing::debug!(error = %e, "udp echo receive failed");
                    continue;
                }
            },
        };
        reply.clear();
        reply.extend_from_slice(&prefix);
        let room = MAX_DATAGRAM.saturating_sub(reply.len());
        reply.extend_from_slice(&buf[..n.min(room)]);
        if let Err(e) = socket.send_to(&reply, peer).await {
            tracing::debug!(%peer, error = %e, "udp echo reply failed");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn replies_with_its_name() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(serve_udp_echo(server, "w-0".into(), stop.clone()));
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.send_to(b"hello", addr).await.unwrap();
        let mut buf = [0u8; 64];
        let n = client.recv(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"w-0 hello");
        client.send_to(b"", addr).await.unwrap();
        let n = client.recv(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"w-0 ");
        stop.cancel();
    }
}
