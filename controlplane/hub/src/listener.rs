//! The hub's HTTPS listener (previews and the web view) and the limits that keep it from being
//! starved: connections are accepted first and counted per peer ([`PeerKey`]: an address, an IPv6 /64) (beyond
//! [`ListenerLimits::max_per_peer`] or [`ListenerLimits::max_total`] a connection is closed at
//! once), the TLS handshake is timed, an HTTP/1 request head must arrive within
//! [`ListenerLimits::header_read_timeout`] (hyper enforces it only with a timer set, which it
//! was not), and a connection with no request in flight for [`ListenerLimits::idle_timeout`]
//! is closed, HTTP/2 included (a trickled HEADERS frame never becomes a request, so it never
//! counts as one).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use spur_runtime::Drain;
use spur_runtime::peer::PeerKey;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

// The limits are part of the preview front end's state (`Preview::limits`); their old path
// stays.
pub use crate::preview::ListenerLimits;
use crate::preview::{Body, Preview};

/// Largest HTTP/1 request head followed by the framing guard.
const MAX_HEAD: usize = 64 * 1024;

/// Connections held, per peer address and in all.
#[derive(Debug)]
pub(crate) struct PeerSlots {
    limits: ListenerLimits,
    held: Mutex<(usize, HashMap<PeerKey, usize>)>,
}

/// One connection's place; given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<PeerSlots>,
    ip: PeerKey,
}

impl PeerSlots {
    pub(crate) fn new(limits: ListenerLimits) -> Arc<Self> {
        Arc::new(PeerSlots {
            limits,
            held: Mutex::new((0, HashMap::new())),
        })
    }

    /// A place for a connection from `ip`, or None when that peer or the listener is full.
    pub(crate) fn take(self: &Arc<Self>, ip: IpAddr) -> Option<Slot> {
        // An IPv4 address (mapped or not) or an IPv6 /64: as every capped listener counts.
        let ip = PeerKey::of(ip);
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let (total, per_peer) = &mut *held;
        let mine = per_peer.entry(ip).or_default();
        if *total >= self.limits.max_total || *mine >= self.limits.max_per_peer {
            if *mine == 0 {
                per_peer.remove(&ip);
            }
            return None;
        }
        *mine += 1;
        *total += 1;
        Some(Slot {
            slots: self.clone(),
            ip,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().unwrap_or_else(|p| p.into_inner());
        let (total, per_peer) = &mut *held;
        *total = total.saturating_sub(1);
        if let Some(n) = per_peer.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                per_peer.remove(&self.ip);
            }
        }
    }
}

/// Requests in flight on one connection, and when the last one ended.
#[derive(Debug)]
struct Activity {
    started: Instant,
    inflight: AtomicUsize,
    /// Milliseconds after `started` when the connection last had no request in flight.
    idle_since_ms: AtomicU64,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Activity {
            started: Instant::now(),
            inflight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
        })
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// How long the connection has had no request in flight (zero while one is).
    fn idle_for(&self) -> Duration {
        if self.inflight.load(Ordering::SeqCst) > 0 {
            return Duration::ZERO;
        }
        let since = Duration::from_millis(self.idle_since_ms.load(Ordering::SeqCst));
        self.started.elapsed().saturating_sub(since)
    }
}

/// A request in flight until dropped (with its response body).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let now = u64::try_from(self.0.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.idle_since_ms.store(now, Ordering::SeqCst);
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request in flight until it ends or is dropped.
struct Tracked {
    inner: Body,
    _inflight: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Preview {
    /// Accepts TLS connections on `listener` until the drain starts.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, tls: TlsAcceptor, drain: Drain) {
        let slots = PeerSlots::new(self.limits);
        loop {
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: back off rather than spin.
                        tracing::warn!("preview listener: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                () = drain.signaled() => return,
            };
            let Some(slot) = slots.take(peer.ip()) else {
                // Closed at once: a peer holding its share cannot queue more.
                self.metrics.connection_refused();
                tracing::debug!(%peer, "preview listener: connection limit reached, closed");
                drop(tcp);
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let conn_drain = drain.clone();
            drain.spawn(serve_conn(
                self.clone(),
                tcp,
                peer,
                tls.clone(),
                conn_drain,
                slot,
            ));
        }
    }
}

async fn serve_conn(
    this: Arc<Preview>,
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    tls: TlsAcceptor,
    drain: Drain,
    _slot: Slot,
) {
    let limits = this.limits;
    let Ok(Ok(tls)) = tokio::time::timeout(limits.handshake_timeout, tls.accept(tcp)).await else {
        return;
    };
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let activity = Activity::new();
    let conn_activity = activity.clone();
    let service = hyper::service::service_fn(move |req| {
        let this = this.clone();
        let inflight = conn_activity.begin();
        let fut: Pin<Box<dyn Future<Output = _> + Send>> = Box::pin(async move {
            let resp = this.handle(req, peer).await;
            this.metrics.preview(resp.status().as_u16());
            Ok::<_, Infallible>(resp.map(|inner| {
                Tracked {
                    inner,
                    _inflight: inflight,
                }
                .boxed_unsync()
            }))
        });
        fut
    });
    // hyper's connection futures are Send, but the drain's generic helper (a closure over a
    // pinned borrow) trips a higher-ranked lifetime limitation here: the same select, inline,
    // with the idle check.
    macro_rules! drive {
        ($conn:expr) => {{
            let mut conn = std::pin::pin!($conn);
            let mut tick =
                tokio::time::interval((limits.idle_timeout / 4).max(Duration::from_millis(50)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = conn.as_mut() => return,
                    () = drain.signaled() => break,
                    _ = tick.tick() => if activity.idle_for() >= limits.idle_timeout {
                        tracing::debug!(%peer, "preview listener: idle connection closed");
                        break;
                    },
                }
            }
            // Drained or idle: finish what is in flight (HTTP/2 says GOAWAY), then close.
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(limits.idle_timeout, conn).await;
        }};
    }
    if h2 {
        let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            // A peer that stops answering pings is gone: its streams are failed.
            .keep_alive_interval(Duration::from_secs(20))
            .keep_alive_timeout(Duration::from_secs(20))
            .max_header_list_size(u32::try_from(MAX_HEAD).unwrap_or(u32::MAX))
            .max_concurrent_streams(256)
            .max_pending_accept_reset_streams(100)
            .max_local_error_reset_streams(1024);
        drive!(builder.serve_connection(TokioIo::new(tls), service));
    } else {
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .max_buf_size(MAX_HEAD)
            .keep_alive(true);
        let io = TokioIo::new(spur_serving::http1::Guard::new(tls, MAX_HEAD));
        drive!(builder.serve_connection(io, service).with_upgrades());
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn slots_per_peer_and_in_all() {
        let slots = PeerSlots::new(ListenerLimits {
            max_per_peer: 2,
            max_total: 3,
            ..ListenerLimits::default()
        });
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let c: IpAddr = "192.0.2.3".parse().unwrap();
        let a1 = slots.take(a).unwrap();
        let _a2 = slots.take(mapped).unwrap();
        assert!(slots.take(a).is_none(), "a third connection from one peer");
        let _b1 = slots.take(b).unwrap();
        assert!(slots.take(c).is_none(), "over the listener's total");
        drop(a1);
        assert!(slots.take(c).is_some());
    }

    #[test]
    fn an_ipv6_host_counts_once_across_its_64() {
        let slots = PeerSlots::new(ListenerLimits {
            max_per_peer: 2,
            ..ListenerLimits::default()
        });
        let one: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let two: IpAddr = "2001:db8:1:2::2".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        let _held_one = slots.take(one).unwrap();
        let _held_two = slots.take(two).unwrap();
        assert!(
            slots
                .take("2001:db8:1:2:abcd::9".parse().unwrap())
                .is_none(),
            "a third address of the same /64"
        );
        assert!(slots.take(other).is_some());
    }
}
