//! Upstream HTTP/2 connections driven with `h2` directly, for the HTTP/2 relay
//! (`http/h2relay.rs`): one shared connection per upstream, each in a task of its own that also
//! pings it, and streams opened on it from the client connections' tasks with no task per
//! request.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use h2::client::{ResponseFuture, SendRequest};
use h2::{Ping, SendStream};
use http::Request;

use super::{Pool, Upstream};
use crate::Error;

/// HTTP/2 windows and buffers of upstream connections: hyper's client defaults, which the full
/// path uses, so both paths move bodies at the same pace.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONN_WINDOW: u32 = 5 * 1024 * 1024;
const MAX_SEND_BUFFER: usize = 1024 * 1024;
/// A connection with streams open is pinged this often; one whose pong does not come within
/// [`PONG_TIMEOUT`] is closed (its streams fail, the next request connects again). As on
/// hyper's full path, an idle connection is not pinged: gRPC servers close connections whose
/// client pings without streams (GOAWAY `too_many_pings`).
const PING_INTERVAL: Duration = Duration::from_secs(30);
const PONG_TIMEOUT: Duration = Duration::from_secs(20);
/// Streams opened on a new connection before the upstream's SETTINGS say how many it allows
/// (hyper's default; h2's own is unbounded).
const INITIAL_MAX_SEND_STREAMS: usize = 100;

/// A shared upstream connection: its sender, and how many of its streams are in flight.
#[derive(Clone)]
pub(super) struct Mux {
    sender: SendRequest<Bytes>,
    in_flight: Arc<AtomicUsize>,
}

impl Mux {
    /// Whether the connection has not failed or gone away, as h2 knows it now (no I/O).
    pub(super) fn is_usable(&mut self) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        !matches!(
            self.sender.poll_ready(&mut cx),
            std::task::Poll::Ready(Err(_))
        )
    }
}

/// Counts a stream in flight on its connection until dropped (with the exchange).
pub(crate) struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Pool {
    /// Opens a stream to `upstream` carrying `head` (its body follows on the returned
    /// [`SendStream`] unless `end`), on the shared connection, connecting first if there is none
    /// or it has failed.
    pub(crate) async fn open_h2(
        &self,
        upstream: &Upstream,
        head: Request<()>,
        end: bool,
    ) -> Result<(ResponseFuture, SendStream<Bytes>, InFlight), Error> {
        let existing = self.lock().mux.get(upstream).cloned();
        let mux = match existing {
            // `ready` fails once the connection has gone away (GOAWAY, an I/O error, a missed
            // pong). Streams beyond the upstream's limit are queued by h2 until one ends.
            Some(Mux { sender, in_flight }) => match sender.ready().await {
                Ok(sender) => Mux { sender, in_flight },
                Err(e) => {
                    tracing::debug!(upstream = %upstream, error = %e, "pooled HTTP/2 connection is gone");
                    // Unless another request has replaced it already.
                    self.forget_mux(upstream, &in_flight);
                    Box::pin(self.connect_mux(upstream)).await?
                }
            },
            // Boxed: connecting is rare, and its future (connect, handshake, timers) would
            // otherwise make every stream's future, moved into the connection's set of
            // streams, that much bigger.
            None => Box::pin(self.connect_mux(upstream)).await?,
        };
        let Mux {
            mut sender,
            in_flight,
        } = mux;
        let (response, send) = sender
            .send_request(head, end)
            .map_err(|source| self.not_opened(upstream, &in_flight, source))?;
        in_flight.fetch_add(1, Ordering::Relaxed);
        Ok((response, send, InFlight(in_flight)))
    }

    /// The error of a stream that could not be opened on a connection that was ready a moment
    /// before. A GOAWAY or the connection's end, read by its task in between, fails every new
    /// stream of the connection before h2 creates it: nothing was sent, the connection leaves the
    /// pool, and [`Error::StreamNotOpened`] tells the relay that the request may go again.
    /// Anything else (a head h2 refuses) would fail on any connection.
    fn not_opened(
        &self,
        upstream: &Upstream,
        in_flight: &Arc<AtomicUsize>,
        source: h2::Error,
    ) -> Error {
        let upstream_name = upstream.to_string();
        if source.is_go_away() || source.is_io() {
            self.forget_mux(upstream, in_flight);
            Error::StreamNotOpened {
                upstream: upstream_name,
                source,
            }
        } else {
            Error::Stream {
                upstream: upstream_name,
                source,
            }
        }
    }

    /// Drops the pool's connection to `upstream` if it is still the one counted by
    /// `in_flight`.
    fn forget_mux(&self, upstream: &Upstream, in_flight: &Arc<AtomicUsize>) {
        let mut state = self.lock();
        if state
            .mux
            .get(upstream)
            .is_some_and(|m| Arc::ptr_eq(&m.in_flight, in_flight))
        {
            state.mux.remove(upstream);
        }
    }

    /// A new connection to `upstream`, shared from now on (unless its destination has left the
    /// routing table), ready for a stream.
    async fn connect_mux(&self, upstream: &Upstream) -> Result<Mux, Error> {
        let tcp = self.connect_tcp(upstream).await?;
        let header_bytes = u32::try_from(self.max_header_bytes).unwrap_or(u32::MAX);
        let mut builder = h2::client::Builder::new();
        builder
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONN_WINDOW)
            .max_send_buffer_size(MAX_SEND_BUFFER)
            .max_header_list_size(header_bytes)
            .initial_max_send_streams(INITIAL_MAX_SEND_STREAMS)
            .enable_push(false);
        let handshake = builder.handshake::<_, Bytes>(crate::io::Coalesce::new(tcp));
        let handshake = async {
            match tokio::time::timeout(self.connect_timeout, handshake).await {
                Ok(res) => res.map_err(|source| Error::Stream {
                    upstream: upstream.to_string(),
                    source,
                }),
                Err(_) => Err(Error::ConnectTimeout {
                    upstream: upstream.to_string(),
                    timeout: self.connect_timeout,
                }),
            }
        };
        let (sender, conn) = handshake.await?;
        let in_flight = Arc::new(AtomicUsize::new(0));
        tokio::spawn(run(conn, in_flight.clone(), upstream.to_string()));
        let mux = Mux { sender, in_flight };
        {
            let mut state = self.lock();
            if state.is_live(upstream) {
                state.mux.insert(upstream.clone(), mux.clone());
            }
        }
        // Fails when the upstream's GOAWAY (or the connection's end) came already.
        let sender = match mux.sender.ready().await {
            Ok(sender) => sender,
            Err(source) => return Err(self.not_opened(upstream, &mux.in_flight, source)),
        };
        Ok(Mux {
            sender,
            in_flight: mux.in_flight,
        })
    }
}

/// Drives one upstream connection until it ends: when the upstream closes it, when it fails,
/// when its pong is late, or once the pool and every stream have let go of it (h2 then sends
/// GOAWAY).
async fn run<T>(
    mut conn: h2::client::Connection<T, Bytes>,
    in_flight: Arc<AtomicUsize>,
    name: String,
) where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut pinger = conn.ping_pong();
    let mut conn = std::pin::pin!(conn);
    loop {
        let keepalive = async {
            tokio::time::sleep(PING_INTERVAL).await;
            if in_flight.load(Ordering::Relaxed) == 0 {
                return Ok(());
            }
            let Some(p) = pinger.as_mut() else {
                return std::future::pending().await;
            };
            // An error here means the connection failed, which its own poll reports.
            match tokio::time::timeout(PONG_TIMEOUT, p.ping(Ping::opaque())).await {
                Ok(Err(_)) => std::future::pending().await,
                res => res.map(drop),
            }
        };
        tokio::select! {
            res = conn.as_mut() => {
                if let Err(e) = res {
                    tracing::debug!(upstream = %name, error = %e, "upstream HTTP/2 connection ended");
                }
                return;
            }
            pong = keepalive => {
                if pong.is_err() {
                    tracing::debug!(upstream = %name, "upstream HTTP/2 connection missed its pong; closed");
                    return;
                }
            }
        }
    }
}
