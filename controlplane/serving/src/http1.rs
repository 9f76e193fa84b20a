//! The HTTP/1 front door every Spur HTTP/1 server keeps (RFC 9112): the bare-LF framing
//! [`Guard`] around each connection and [`check_host`] on each request, from `spur-h1guard`,
//! and their axum forms: [`front_door`] (a middleware), [`layer`] and [`Guarded`] (a plain TCP
//! listener whose connections read through the guard).

use std::net::SocketAddr;

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::net::{TcpListener, TcpStream};

pub use spur_h1guard::{Guard, check_host};

/// RFC 9112 §3.2 (one valid `Host`, matching an absolute-form target), as on every Spur HTTP/1
/// server: anything else is a 400 that closes the connection. An axum middleware
/// (`axum::middleware::from_fn(front_door)`), used by every axum server Spur runs.
pub async fn front_door(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if let Err(why) = check_host(&req) {
        return (
            StatusCode::BAD_REQUEST,
            [(header::CONNECTION, "close")],
            format!("{why}\n"),
        )
            .into_response();
    }
    next.run(req).await
}

/// Largest request head the front door follows.
pub(crate) const MAX_HEAD: usize = 64 * 1024;

/// A listener for `axum::serve` whose connections read through [`Guard`].
pub struct Guarded(pub TcpListener);

impl axum::serve::Listener for Guarded {
    type Io = Guard<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, SocketAddr) {
        // axum stops serving on its own (graceful shutdown); this never stops.
        loop {
            if let Some((tcp, peer)) =
                spur_runtime::accept(&self.0, std::future::pending(), "metrics").await
            {
                return (Guard::new(tcp, MAX_HEAD), peer);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

/// `router` with the `Host` check in front of every route.
pub fn layer(router: axum::Router) -> axum::Router {
    router.layer(axum::middleware::from_fn(front_door))
}
