//! Opaque TCP (and TLS passthrough): splice the client to its original destination, both
//! directions, preserving half-close, until both sides are done or nothing moves for the idle
//! timeout.

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::Shared;
use crate::conn::ConnMeta;
use crate::io::splice;
use crate::pool::Upstream;

/// `server`: a connection to the original destination opened already (while detection waited
/// for a silent client), used instead of a new one.
pub(crate) async fn forward<IO>(
    shared: &Shared,
    client: IO,
    meta: &ConnMeta,
    server: Option<TcpStream>,
) -> Result<(), &'static str>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let server = match server {
        Some(s) => s,
        None => match shared
            .pool
            .connect_tcp(&Upstream::Original(meta.original_dst))
            .await
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(client = %meta.client, error = %e, "opaque upstream unreachable");
                return Err("upstream unreachable");
            }
        },
    };
    splice(client, server, shared.config.idle_timeout)
        .await
        .map(|_| ())
}
