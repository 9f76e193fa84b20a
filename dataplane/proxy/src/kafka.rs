//! Kafka connections relayed frame by frame through a [`spur_kafka::Session`] (issue 44,
//! `docs/async.md`): each direction is read into a buffer, split into frames (a frame above
//! `max_frame` ends the connection), passed through its half of the session and written on.
//!
//! The two directions run concurrently and share only the session's queue of requests awaiting a
//! response, so filtering a large Fetch response never holds up the client's requests. Either side
//! closing ends the relay (a Kafka connection is not half-closed: both sides treat EOF as gone);
//! a refused frame ends it with an error, and nothing of that frame is passed on. There is no idle
//! timeout here: Kafka clients and brokers close idle connections themselves
//! (`connections.max.idle.ms`), and the caller's drain cuts what is left at shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use bytes::BytesMut;
use spur_kafka::frame::{put_frame, split_frame};
use spur_kafka::{BatchHeader, Record, Session, SessionConfig, SessionStats};
use spur_runtime::Drain;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::detect::Protocol;
use crate::pool::Upstream;
use crate::{Error, Shared};

/// Decides, per record of a Fetch response, whether this connection's consumer receives it;
/// told the record's topic (empty when unknown, see [`spur_kafka::TopicNames`]).
pub type Keep = Arc<dyn Fn(&str, &BatchHeader, &Record<'_>) -> bool + Send + Sync>;

/// Receives each frame's counters as they accrue (for metrics).
pub type OnStats = Arc<dyn Fn(&SessionStats) + Send + Sync>;

/// Waits, before the records of a Fetch response read at `at_ms` (wall clock, ms since the
/// epoch) are decided, until they can be decided for good (the route history's watermark is
/// past `at_ms`), or for as long as the waiter bounds it. The records in such a response were
/// all written before it was read, so their timestamps are before `at_ms` unless a producer's
/// clock is ahead.
pub type Hold = Arc<dyn Fn(i64) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// How one Kafka connection is relayed.
#[derive(Clone)]
pub struct KafkaRelay {
    pub session: SessionConfig,
    /// Largest frame accepted either way ([`spur_kafka::frame::DEFAULT_MAX_FRAME`] by default).
    pub max_frame: usize,
    pub keep: Keep,
    pub on_stats: OnStats,
    /// Without: records are decided as soon as they arrive.
    pub hold: Option<Hold>,
}

/// First read buffer per direction; it grows to the largest frame seen.
const READ_BUF: usize = 64 << 10;

/// Relays `client` (the app's connection) to `upstream` (the broker) until either closes, or
/// until a frame is refused (the error says which and why).
pub async fn relay<C, U>(client: C, upstream: U, cfg: &KafkaRelay) -> Result<(), Error>
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let (mut requests, mut responses) = Session::new(cfg.session.clone()).split();
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut ur, mut uw) = tokio::io::split(upstream);
    let max = cfg.max_frame;
    let to_broker = async {
        let mut buf = BytesMut::with_capacity(READ_BUF);
        let mut out = BytesMut::new();
        loop {
            if cr.read_buf(&mut buf).await.map_err(Error::KafkaIo)? == 0 {
                return Ok(());
            }
            while let Some(frame) = split_frame(&mut buf, max)? {
                put_frame(&mut out, &requests.request(frame)?)?;
            }
            (cfg.on_stats)(&requests.take_stats());
            uw.write_all(&out).await.map_err(Error::KafkaIo)?;
            out.clear();
        }
    };
    let to_client = async {
        let mut buf = BytesMut::with_capacity(READ_BUF);
        let mut out = BytesMut::new();
        loop {
            if ur.read_buf(&mut buf).await.map_err(Error::KafkaIo)? == 0 {
                return Ok(());
            }
            // Read only by a relay that holds (the route history).
            let read_at = cfg.hold.as_ref().map_or(0, |_| spur_runtime::unix_ms());
            while let Some(frame) = split_frame(&mut buf, max)? {
                if let Some(hold) = &cfg.hold
                    && responses.answers_fetch(&frame)
                {
                    // What is ready goes first: a held Fetch holds up only what follows it.
                    if !out.is_empty() {
                        cw.write_all(&out).await.map_err(Error::KafkaIo)?;
                        out.clear();
                    }
                    hold(read_at).await;
                }
                let frame = responses.response(frame, |t, h, r| (cfg.keep)(t, h, r))?;
                put_frame(&mut out, &frame)?;
            }
            (cfg.on_stats)(&responses.take_stats());
            cw.write_all(&out).await.map_err(Error::KafkaIo)?;
            out.clear();
        }
    };
    tokio::select! {
        r = to_broker => r,
        r = to_client => r,
    }
}

/// Where a relay's connections go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KafkaUpstream {
    /// Each to its original destination: the listener receives connections that the
    /// interception rules redirected (the pod's own connections to broker ports). A connection
    /// made to the listener itself, not redirected, has no other destination and is closed: the
    /// relay serves the pod's own processes, not whoever reaches its port.
    Redirected,
    /// Each to this broker: an explicit listener that clients bootstrap to, in front of a
    /// cluster of one broker (the session advertises the listener in its place).
    Broker(SocketAddr),
}

/// Accepts connections on `listener` and relays each to its broker (see [`KafkaUpstream`]).
pub(crate) async fn accept_loop(
    shared: Arc<Shared>,
    listener: TcpListener,
    to: KafkaUpstream,
    relay: Arc<KafkaRelay>,
    drain: Drain,
) {
    let local = listener.local_addr().ok();
    while let Some((stream, client)) =
        spur_runtime::accept(&listener, drain.signaled(), "kafka").await
    {
        let shared = shared.clone();
        let relay = relay.clone();
        drain.spawn(async move {
            handle(&shared, stream, client, to, &relay).await;
        });
    }
    tracing::info!(addr = ?local, "Kafka listener stopped accepting");
}

async fn handle(
    shared: &Shared,
    stream: TcpStream,
    client: SocketAddr,
    to: KafkaUpstream,
    relay: &KafkaRelay,
) {
    let Ok(local) = stream.local_addr() else {
        return;
    };
    let broker = match to {
        KafkaUpstream::Broker(broker) => broker,
        KafkaUpstream::Redirected => match crate::listener::original_dst(&stream, local) {
            Ok(dst) if dst != local => dst,
            Ok(_) | Err(_) => {
                tracing::warn!(%client, %local, "Kafka connection closed: it was made to the relay's port itself, not redirected to it, so it has no broker to go to");
                return;
            }
        },
    };
    let _ = stream.set_nodelay(true);
    let _active = shared.metrics.connection(Protocol::Kafka);
    let upstream = match shared.pool.connect_tcp(&Upstream::Original(broker)).await {
        Ok(s) => s,
        Err(e) => {
            // The client sees its connection close, as it would have seen the broker refuse.
            tracing::warn!(%client, %broker, error = %e, "Kafka broker unreachable");
            return;
        }
    };
    match self::relay(stream, upstream, relay).await {
        Ok(()) => tracing::debug!(%client, %broker, "Kafka connection closed"),
        Err(e @ Error::KafkaIo(_)) => {
            tracing::debug!(%client, %broker, error = %e, "Kafka connection ended")
        }
        Err(e) => {
            shared.metrics.kafka_refused();
            tracing::warn!(%client, %broker, error = %e, "Kafka connection closed: a frame was refused, nothing of it was passed on");
        }
    }
}
