//! UDP sockets for QUIC endpoints, with socket buffers sized for bulk transfer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};

use socket2::{Domain, Protocol, Socket, Type};

/// Send and receive buffer asked for each QUIC socket. With Linux's default 208 KiB a receiver
/// that is off the CPU for a millisecond overflows at a few hundred MiB/s and the kernel drops
/// what does not fit: measured on the tunnel benchmark, a fifth of all packets at 0 % loss,
/// each one a retransmission and a congestion signal. (quic-go asks for 7 MiB for the same
/// reason.)
pub(crate) const BUFFER: usize = 4 * 1024 * 1024;

static WARNED: AtomicBool = AtomicBool::new(false);

/// A UDP socket bound to `addr` (dual-stack for `[::]`), with [`BUFFER`]-sized buffers where
/// the host allows it. Where `net.core.rmem_max`/`wmem_max` cap them lower, the socket still
/// works and one warning per process says how to lift the cap.
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        // As quinn's own `Endpoint::server` does; not every host supports it.
        let _ = socket.set_only_v6(false);
    }
    let _ = socket.set_recv_buffer_size(BUFFER);
    let _ = socket.set_send_buffer_size(BUFFER);
    // Linux reports twice what it granted (the doubling covers its bookkeeping).
    let granted = |size: std::io::Result<usize>| size.map_or(0, |s| s / 2);
    let (recv, send) = (
        granted(socket.recv_buffer_size()),
        granted(socket.send_buffer_size()),
    );
    if (recv < BUFFER || send < BUFFER) && !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            wanted = BUFFER,
            recv,
            send,
            "QUIC socket buffers capped by the host; bulk transfers may lose packets to overflow. \
             Lift the cap with: sysctl -w net.core.rmem_max={BUFFER} net.core.wmem_max={BUFFER}"
        );
    }
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

/// A QUIC endpoint on a [`bind`] socket at `addr`: a server when `server` is given, else a
/// client endpoint.
pub(crate) fn endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> std::io::Result<quinn::Endpoint> {
    quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        server,
        bind(addr)?,
        std::sync::Arc::new(quinn::TokioRuntime),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_with_buffers_no_smaller_than_the_default() {
        let socket = Socket::from(bind("127.0.0.1:0".parse().unwrap()).unwrap());
        // Whatever the host's cap, never below what an untuned socket gets.
        let untuned = Socket::new(Domain::IPV4, Type::DGRAM, None).unwrap();
        assert!(socket.recv_buffer_size().unwrap() >= untuned.recv_buffer_size().unwrap());
        assert!(socket.send_buffer_size().unwrap() >= untuned.send_buffer_size().unwrap());
        assert_ne!(socket.local_addr().unwrap().as_socket().unwrap().port(), 0);
    }
}
