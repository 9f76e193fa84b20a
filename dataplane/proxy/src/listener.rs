//! Accepting connections, recovering their original destination and dispatching them to the
//! handler for their protocol.

use std::net::SocketAddr;
use std::sync::Arc;

use socket2::SockRef;
use tokio::net::{TcpListener, TcpStream};

use bytes::Bytes;

use crate::Shared;
use crate::conn::ConnMeta;
use crate::detect::{Protocol, detect};
use crate::io::Rewind;
use crate::metrics::Silent;
use crate::pool::Upstream;
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
    let (protocol, prefix, server) = if config.opaque_ports.contains(&original_dst.port()) {
        (Protocol::Opaque, Bytes::new(), None)
    } else {
        match detect(&mut stream, config.detect_timeout).await {
            // Silent for the whole window: not yet known (see `first_speaker`).
            Ok(Some((Protocol::Opaque, prefix))) if prefix.is_empty() => {
                match first_speaker(&shared, &stream, original_dst, &drain).await? {
                    First::Opaque(server) => (Protocol::Opaque, prefix, Some(server)),
                    First::Client(server) => {
                        match detect(&mut stream, config.detect_timeout).await {
                            // The connection opened to the application carries it on.
                            Ok(Some((p @ (Protocol::Opaque | Protocol::Tls), prefix))) => {
                                (p, prefix, server)
                            }
                            // Served as HTTP: the HTTP/1 relay may take the connection for
                            // its first request to the application (it is idle, unused).
                            Ok(Some((p, prefix))) => {
                                if let (Protocol::Http1, Some(server), true) =
                                    (p, server, config.http1_relay)
                                {
                                    shared
                                        .pool
                                        .put_raw(Upstream::Original(original_dst), server);
                                }
                                (p, prefix, None)
                            }
                            Ok(None) => return Ok(()),
                            Err(_) => return Err("read error during detection"),
                        }
                    }
                    First::Nobody => return Ok(()),
                }
            }
            Ok(Some((p, prefix))) => (p, prefix, None),
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
            crate::tcp::forward(&shared, io, &meta, server).await
        }
    }
}

/// Who spoke first on a connection whose client sent nothing within `detectTimeout`.
enum First {
    /// The application (a server-first protocol), or a side closed: spliced as opaque TCP on
    /// this connection to the application.
    Opaque(TcpStream),
    /// The client, with the application's connection if one was opened (and nothing came on it).
    Client(Option<TcpStream>),
    /// The client closed without a byte, and there is no application connection to tell.
    Nobody,
}

/// A client silent for the whole detection window is either one of a server-first protocol,
/// waiting for the server's greeting, or one that opened its connection ahead of its first
/// request: HTTP client pools keep a spare connection idle (hyper's legacy client and Go's
/// `net/http` do when another frees up before the dial completes), and its requests come later,
/// routed like any other. Treating every silent client as opaque sent that connection's keyed
/// requests to the baseline for its whole life. So the application's connection is opened now,
/// and whichever side speaks first decides: the server's bytes make the connection opaque, the
/// client's are detected as usual. Bounded by the idle timeout, and ended by a drain.
async fn first_speaker(
    shared: &Shared,
    client: &TcpStream,
    original_dst: SocketAddr,
    drain: &Drain,
) -> Result<First, &'static str> {
    let metrics = &shared.metrics;
    let _waiting = metrics.silent_waiting();
    // Without it no server can greet; the client's first bytes still decide (an opaque client
    // then finds the application unreachable, as before).
    let server = match shared
        .pool
        .connect_tcp(&Upstream::Original(original_dst))
        .await
    {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::debug!(%original_dst, error = %e, "a silent client's application is unreachable");
            None
        }
    };
    let (mut c, mut s) = ([0u8; 1], [0u8; 1]);
    let spoke = async {
        match &server {
            Some(server) => tokio::select! {
                biased;
                // Data, a close or an error from the application: it is not waiting for HTTP.
                r = server.peek(&mut s) => Spoke::Server { data: matches!(r, Ok(n) if n > 0) },
                r = client.peek(&mut c) => Spoke::Client { read: r.ok() },
            },
            None => Spoke::Client {
                read: client.peek(&mut c).await.ok(),
            },
        }
    };
    // Like an idle keep-alive connection, a silent one is closed when the proxy drains.
    let spoke = tokio::select! {
        r = tokio::time::timeout(shared.config.idle_timeout, spoke) => r.map_err(|_| {
            metrics.silent(Silent::Nobody);
            "idle timeout with neither side speaking"
        })?,
        () = drain.signaled() => {
            metrics.silent(Silent::Nobody);
            return Err("draining while neither side spoke");
        }
    };
    let (first, counted) = match (spoke, server) {
        (Spoke::Client { read: Some(n) }, server) if n > 0 => {
            (First::Client(server), Silent::Client)
        }
        // A client that failed (a reset) is gone: nothing to splice.
        (Spoke::Client { read: None }, _) => (First::Nobody, Silent::Nobody),
        // The application spoke, or one side closed (an application timing out an idle
        // connection, a client half-closing without a byte): spliced as any opaque connection,
        // so a close reaches the other side and an answer to a half-close still arrives.
        (Spoke::Server { data: true }, Some(server)) => (First::Opaque(server), Silent::Server),
        (_, Some(server)) => (First::Opaque(server), Silent::Nobody),
        (_, None) => (First::Nobody, Silent::Nobody),
    };
    metrics.silent(counted);
    Ok(first)
}

/// What ended the wait in [`first_speaker`].
enum Spoke {
    /// The application sent bytes (`data`), or closed or failed.
    Server { data: bool },
    /// The client sent bytes (`read` > 0), closed (0) or failed (`None`).
    Client { read: Option<usize> },
}
