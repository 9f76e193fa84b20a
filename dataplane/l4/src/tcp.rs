//! The TCP listener: accept, read the first bytes when the routing needs them (bounded in size
//! and time), connect to an endpoint of the chosen cluster (the next one on failure), forward
//! the bytes read, then splice both ways with half-close preserved.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use spur_runtime::Drain;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, now_ms};
use crate::metrics::ListenerMetrics;
use crate::route::Settings;

pub(crate) struct TcpServer {
    pub(crate) listener: TcpListener,
    pub(crate) name: String,
    pub(crate) settings: Arc<ArcSwap<Settings>>,
    pub(crate) metrics: ListenerMetrics,
    pub(crate) active: Arc<AtomicUsize>,
    pub(crate) drain: Drain,
    pub(crate) kill: CancellationToken,
}

impl TcpServer {
    /// Accepts until the drain starts (or a kill); the listening socket closes on return, and
    /// streams carry on under the drain.
    pub(crate) async fn run(self) {
        let stop = async {
            tokio::select! {
                () = self.drain.signaled() => {}
                () = self.kill.cancelled() => {}
            }
        };
        let mut stop = std::pin::pin!(stop);
        while let Some((stream, peer)) =
            spur_runtime::accept(&self.listener, stop.as_mut(), &self.name).await
        {
            let settings = self.settings.load_full();
            if self.active.load(Relaxed) >= settings.max_sessions {
                // TCP streams are not evicted: the newcomer is refused (closed at once).
                self.metrics.refused_full.inc();
                continue;
            }
            let guard = Active::new(self.active.clone(), self.metrics.active.clone());
            self.drain.spawn(serve(
                stream,
                peer,
                settings,
                self.metrics.clone(),
                self.kill.clone(),
                guard,
            ));
        }
    }
}

/// Counts a stream as active while it lives.
struct Active {
    count: Arc<AtomicUsize>,
    gauge: Gauge,
}

impl Active {
    fn new(count: Arc<AtomicUsize>, gauge: Gauge) -> Self {
        count.fetch_add(1, Relaxed);
        gauge.inc();
        Active { count, gauge }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Relaxed);
        self.gauge.dec();
    }
}

async fn serve(
    mut client: TcpStream,
    peer: SocketAddr,
    settings: Arc<Settings>,
    metrics: ListenerMetrics,
    kill: CancellationToken,
    _active: Active,
) {
    let _ = client.set_nodelay(true);
    let work = async {
        let first = if settings.first_bytes > 0 {
            match read_first(
                &mut client,
                settings.first_bytes,
                settings.first_bytes_timeout,
            )
            .await
            {
                Ok(b) => b,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "reading first bytes failed");
                    return None;
                }
            }
        } else {
            Vec::new()
        };
        metrics.bytes_in.inc_by(first.len() as u64);
        let (cluster, hash) = settings.route(&first, peer);
        let Some(mut upstream) = connect(&cluster, hash).await else {
            tracing::debug!(%peer, cluster = %cluster.name, "no endpoint accepted the connection");
            metrics.refused_connect.inc();
            return None;
        };
        metrics.created.inc();
        let _ = upstream.set_nodelay(true);
        if !first.is_empty() && upstream.write_all(&first).await.is_err() {
            return None;
        }
        Some(upstream)
    };
    let upstream = tokio::select! {
        u = work => u,
        () = kill.cancelled() => None,
    };
    let Some(upstream) = upstream else { return };
    splice(client, upstream, settings.idle_timeout, &metrics, &kill).await;
}

/// Reads up to `need` bytes: fewer if the client stops sending (EOF) or the deadline passes.
async fn read_first(s: &mut TcpStream, need: usize, timeout: Duration) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; need];
    let mut len = 0;
    let deadline = Instant::now() + timeout;
    while len < need {
        match tokio::time::timeout_at(deadline, s.read(&mut buf[len..])).await {
            Err(_) | Ok(Ok(0)) => break,
            Ok(Ok(n)) => len += n,
            Ok(Err(e)) => return Err(e),
        }
    }
    buf.truncate(len);
    Ok(buf)
}

/// Connects to the endpoint for `hash`, trying the next one (ring successor, Maglev probe, next
/// in turn) after a failure, up to `connectAttempts` distinct endpoints. Failures count towards
/// outlier ejection.
async fn connect(cluster: &Cluster, hash: u64) -> Option<TcpStream> {
    let snap = cluster.load_full();
    let attempts = snap.plan.connect_attempts.min(snap.endpoints.len());
    let mut tried: Vec<usize> = Vec::with_capacity(attempts);
    for _ in 0..attempts {
        let i = snap.pick(hash, &cluster.rr, now_ms(), |i| tried.contains(&i))?;
        tried.push(i);
        let e = &snap.endpoints[i];
        match tokio::time::timeout(snap.plan.connect_timeout, TcpStream::connect(e.addr)).await {
            Ok(Ok(s)) => {
                e.connect_succeeded();
                return Some(s);
            }
            Ok(Err(err)) => {
                tracing::debug!(endpoint = %e.id, addr = %e.addr, error = %err, "connect failed");
                e.connect_failed(&snap.plan.outlier, now_ms());
            }
            Err(_) => {
                tracing::debug!(endpoint = %e.id, addr = %e.addr, "connect timed out");
                e.connect_failed(&snap.plan.outlier, now_ms());
            }
        }
    }
    None
}

/// Both directions until both ended (an EOF on one side shuts down writing on the other, and
/// the other direction goes on: half-close is preserved), nothing moved for `idle`, or a kill.
async fn splice(
    client: TcpStream,
    upstream: TcpStream,
    idle: Duration,
    metrics: &ListenerMetrics,
    kill: &CancellationToken,
) {
    let activity = Arc::new(AtomicU64::new(0));
    let mut client = Metered {
        inner: client,
        activity: activity.clone(),
        bytes: metrics.bytes_in.clone(),
    };
    let mut upstream = Metered {
        inner: upstream,
        activity: activity.clone(),
        bytes: metrics.bytes_out.clone(),
    };
    tokio::select! {
        r = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "tcp stream ended with an error");
            }
        }
        () = idle_for(&activity, idle) => tracing::debug!("tcp stream idle: closed"),
        () = kill.cancelled() => {}
    }
}

/// Resolves once a whole `idle` period passes with no byte read on either side. The data path
/// only bumps a counter; this samples it once per period, so a stream closes between one and
/// two periods after it went quiet.
async fn idle_for(activity: &AtomicU64, idle: Duration) {
    loop {
        let before = activity.load(Relaxed);
        tokio::time::sleep(idle).await;
        if activity.load(Relaxed) == before {
            return;
        }
    }
}

/// A stream that counts the bytes read from it and marks activity.
struct Metered<T> {
    inner: T,
    activity: Arc<AtomicU64>,
    bytes: Counter,
}

impl<T: AsyncRead + Unpin> AsyncRead for Metered<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            // Only a change matters to the idle check: a plain store is enough.
            let v = this.activity.load(Relaxed);
            this.activity.store(v.wrapping_add(1), Relaxed);
            this.bytes.inc_by(n as u64);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Metered<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
