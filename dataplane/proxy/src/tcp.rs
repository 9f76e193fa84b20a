//! Opaque TCP (and TLS passthrough): splice the client to its original destination, both
//! directions, preserving half-close, until both sides are done or nothing moves for the idle
//! timeout.

use tokio::io::{AsyncRead, AsyncWrite};

use crate::Shared;
use crate::conn::ConnMeta;
use crate::io::splice;
use crate::pool::Upstream;

pub(crate) async fn forward<IO>(
    shared: &Shared,
    client: IO,
    meta: &ConnMeta,
) -> Result<(), &'static str>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let upstream = Upstream::Original(meta.original_dst);
    let server = match shared.pool.connect_tcp(&upstream).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(client = %meta.client, error = %e, "opaque upstream unreachable");
            return Err("upstream unreachable");
        }
    };
    splice(client, server, shared.config.idle_timeout)
        .await
        .map(|_| ())
}
