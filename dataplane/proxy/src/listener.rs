//! Accepting connections, recovering their original destination and dispatching them to the
//! handler for their protocol.

use std::net::SocketAddr;
use std::sync::Arc;

use socket2::SockRef;
use tokio::net::{TcpListener, TcpStream};

use crate::Shared;
use crate::conn::ConnMeta;
use crate::detect::{Protocol, detect};
use crate::io::Rewind;
use spur_runtime::Drain;

/// How a listener learns where a connection was headed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inbound {
    /// Clients connect to the proxy's port explicitly; the "original destination" is this fixed
    /// application address.
    Explicit { app: SocketAddr },
    /// Connections were redirected here by iptables/nft (`REDIRECT`); the original destination is
    /// read from the socket (`SO_ORIGINAL_DST` / `IP6T_SO_ORIGINAL_DST`).
    Transparent,
}

pub(crate) async fn accept_loop(
    shared: Arc<Shared>,
    listener: TcpListener,
    inbound: Inbound,
    drain: Drain,
) {
    let local = listener.local_addr().ok();
    while let Some((stream, client)) =
        spur_runtime::accept(&listener, drain.signaled(), "proxy").await
    {
        let shared = shared.clone();
        let conn_drain = drain.clone();
        drain.spawn(async move {
            if let Err(reason) = handle(shared, stream, client, inbound, conn_drain).await {
                tracing::debug!(%client, reason, "connection closed");
            }
        });
    }
    tracing::info!(addr = ?local, "listener stopped accepting");
}

pub(crate) fn original_dst(stream: &TcpStream, local: SocketAddr) -> std::io::Result<SocketAddr> {
    let sock = SockRef::from(stream);
    let addr = if local.is_ipv4() {
        sock.original_dst_v4()?
    } else {
        sock.original_dst_v6()?
    };
    addr.as_socket()
        .ok_or_else(|| std::io::Error::other("original destination is not an inet address"))
}

async fn handle(
    shared: Arc<Shared>,
    mut stream: TcpStream,
    client: SocketAddr,
    inbound: Inbound,
    drain: Drain,
) -> Result<(), &'static str> {
    let local = stream.local_addr().map_err(|_| "no local address")?;
    let original_dst = match inbound {
        Inbound::Explicit { app } => app,
        Inbound::Transparent => {
            let dst = original_dst(&stream, local).map_err(|_| "no original destination")?;
            // Without a redirect the original destination is the proxy itself: forwarding would
            // loop straight back here.
            if dst == local {
                return Err("connection addressed to the proxy port itself");
            }
            dst
        }
    };
    let _ = stream.set_nodelay(true);
    let config = &shared.config;
    let (protocol, prefix) = if config.opaque_ports.contains(&original_dst.port()) {
        (Protocol::Opaque, bytes::Bytes::new())
    } else {
        match detect(&mut stream, config.detect_timeout).await {
            Ok(Some(found)) => found,
            Ok(None) => return Ok(()),
            Err(_) => return Err("read error during detection"),
        }
    };
    let meta = ConnMeta::new(client, local, original_dst, protocol);
    let _active = shared.metrics.connection(protocol);
    let io = Rewind::new(prefix, stream);
    match protocol {
        Protocol::Http1 | Protocol::Http2 => crate::http::serve(shared, io, meta, drain).await,
        Protocol::Tls | Protocol::Opaque | Protocol::Kafka => {
            crate::tcp::forward(&shared, io, &meta).await
        }
    }
}
