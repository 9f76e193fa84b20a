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

use std::sync::Arc;

use bytes::BytesMut;
use spur_kafka::frame::{put_frame, split_frame};
use spur_kafka::{BatchHeader, Record, Session, SessionConfig, SessionStats};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::Error;

/// Decides, per record of a Fetch response, whether this connection's consumer receives it.
pub type Keep = Arc<dyn Fn(&BatchHeader, &Record<'_>) -> bool + Send + Sync>;

/// Receives each frame's counters as they accrue (for metrics).
pub type OnStats = Arc<dyn Fn(&SessionStats) + Send + Sync>;

/// How one Kafka connection is relayed.
#[derive(Clone)]
pub struct KafkaRelay {
    pub session: SessionConfig,
    /// Largest frame accepted either way ([`spur_kafka::frame::DEFAULT_MAX_FRAME`] by default).
    pub max_frame: usize,
    pub keep: Keep,
    pub on_stats: OnStats,
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
            while let Some(frame) = split_frame(&mut buf, max)? {
                let frame = responses.response(frame, |h, r| (cfg.keep)(h, r))?;
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
