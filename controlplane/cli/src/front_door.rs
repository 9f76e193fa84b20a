//! The binaries' plain HTTP servers (metrics, probes) keep the front door's HTTP/1 rules:
//! every connection reads through the bare-LF guard, every request passes the `Host` check.

use std::net::SocketAddr;

use spur_proxy::Http1Guard;
use tokio::net::{TcpListener, TcpStream};

/// Largest request head these servers follow.
const MAX_HEAD: usize = 64 * 1024;

/// A listener for `axum::serve` whose connections read through [`Http1Guard`].
pub(crate) struct Guarded(pub(crate) TcpListener);

impl axum::serve::Listener for Guarded {
    type Io = Http1Guard<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, SocketAddr) {
        // axum stops serving on its own (graceful shutdown); this never stops.
        loop {
            if let Some((tcp, peer)) =
                spur_runtime::accept(&self.0, std::future::pending(), "metrics").await
            {
                return (Http1Guard::new(tcp, MAX_HEAD), peer);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

/// `router` with the `Host` check in front of every route.
pub(crate) fn layer(router: axum::Router) -> axum::Router {
    router.layer(axum::middleware::from_fn(spur_routeserver::front_door))
}
