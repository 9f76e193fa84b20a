//! Opaque TCP (and TLS passthrough): splice the client to its original destination, both
//! directions, preserving half-close, until both sides are done or nothing moves for the idle
//! timeout.

use tokio::io::{AsyncRead, AsyncWrite};

use crate::Proxy;
use crate::io::{Activity, Tracked};
use crate::listener::ConnMeta;
use crate::pool::Upstream;

pub(crate) async fn forward<IO>(
    proxy: &Proxy,
    client: IO,
    meta: &ConnMeta,
) -> Result<(), &'static str>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let upstream = Upstream::Original(meta.original_dst);
    let server = match proxy.inner.pool.connect_tcp(&upstream).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(client = %meta.client, error = %e, "opaque upstream unreachable");
            return Err("upstream unreachable");
        }
    };
    splice(client, server, proxy.inner.config.idle_timeout).await
}

/// Copies both ways until both directions have seen EOF (each EOF is passed on as a write
/// shutdown, so half-closed protocols keep working), an error occurs, or the pair stays idle.
pub(crate) async fn splice<A, B>(a: A, b: B, idle: std::time::Duration) -> Result<(), &'static str>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Activity::new();
    let mut a = Tracked::new(a, activity.clone());
    let mut b = b;
    tokio::select! {
        res = tokio::io::copy_bidirectional(&mut a, &mut b) => match res {
            Ok(_) => Ok(()),
            Err(_) => Err("stream error"),
        },
        () = activity.idle_for(idle) => Err("idle timeout"),
    }
}
