//! The UDP listener: one socket, a bounded table of sessions keyed by client address, each
//! session a connected upstream socket to its endpoint.
//!
//! One task owns the listener socket and the table: it forwards client datagrams, opens and
//! evicts sessions and expires idle ones, so the table needs no lock. Each session has a task
//! that forwards its endpoint's replies to the client from the listener socket (the client sees
//! the address it sent to). Datagrams go out with a plain non-blocking send: a full socket
//! buffer drops the datagram (counted) instead of stalling every other session behind it.
//!
//! No allocation per datagram: the listener task reuses one 64 KiB buffer, reply tasks share one
//! per worker thread, and a touch of the session table only relinks two slots.

use std::cell::RefCell;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use arc_swap::ArcSwap;
use socket2::{SockAddr, SockRef};
use spur_runtime::Drain;
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, Endpoint, now_ms};
use crate::config::Overflow;
use crate::lru::Lru;
use crate::metrics::ListenerMetrics;
use crate::route::Settings;

/// Largest UDP payload is 65 507 bytes (IPv4) or 65 527 (IPv6): one buffer holds any datagram.
const BUF_LEN: usize = 65_535;
/// Datagrams handled per wake-up before yielding (the listener, and each reply task).
const BATCH: usize = 64;

thread_local! {
    /// Reply buffer shared by every session task on this worker thread: it is only held between
    /// a receive and the send that follows, never across an await.
    static REPLY_BUF: RefCell<Box<[u8]>> = RefCell::new(vec![0; BUF_LEN].into_boxed_slice());
}

pub(crate) struct UdpListener {
    pub(crate) socket: Arc<UdpSocket>,
    pub(crate) settings: Arc<ArcSwap<Settings>>,
    pub(crate) metrics: ListenerMetrics,
    pub(crate) active: Arc<AtomicUsize>,
    pub(crate) drain: Drain,
    pub(crate) kill: CancellationToken,
}

struct Session {
    cluster: Arc<Cluster>,
    hash: u64,
    endpoint: Arc<Endpoint>,
    /// The cluster's epoch when the endpoint was last (re)chosen.
    epoch: u64,
    upstream: Arc<UdpSocket>,
    /// Last reply from upstream (ms, [`now_ms`]), written by the reply task.
    last_reply: Arc<AtomicU64>,
    replies: AbortHandle,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.replies.abort();
    }
}

type Table = Lru<SocketAddr, Session>;

/// Whether an error on a connected UDP socket is an ICMP error the kernel passed on.
pub(crate) fn is_icmp(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable
    )
}

impl UdpListener {
    /// Serves until killed, or until draining has started and the last session ended.
    pub(crate) async fn run(self) {
        let mut buf = vec![0u8; BUF_LEN].into_boxed_slice();
        let mut table: Table = Lru::new();
        let mut draining = false;
        let mut killed = pin!(self.kill.cancelled());
        let mut drained = pin!(self.drain.signaled());
        let mut sweep = pin!(tokio::time::sleep(self.sweep_period()));
        loop {
            tokio::select! {
                biased;
                () = &mut killed => break,
                () = &mut drained, if !draining => {
                    draining = true;
                    if table.is_empty() {
                        break;
                    }
                }
                () = &mut sweep => {
                    self.expire(&mut table, now_ms());
                    if draining && table.is_empty() {
                        break;
                    }
                    sweep.as_mut().reset(Instant::now() + self.sweep_period());
                }
                r = self.socket.recv_from(&mut buf) => {
                    let mut next = r;
                    for _ in 0..BATCH {
                        match next {
                            Ok((n, client)) => self.on_datagram(&mut table, &buf[..n], client, draining),
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                            Err(e) => {
                                // Not seen on Linux for an unconnected socket; a pause keeps an
                                // unexpected persistent error from spinning.
                                tracing::warn!(error = %e, "udp listener receive failed");
                                tokio::time::sleep(Duration::from_millis(10)).await;
                                break;
                            }
                        }
                        next = self.socket.try_recv_from(&mut buf);
                    }
                }
            }
        }
        let left = table.drain().len();
        self.adjust_active(-(i64::try_from(left).unwrap_or(i64::MAX)));
    }

    fn sweep_period(&self) -> Duration {
        (self.settings.load().idle_timeout / 4)
            .clamp(Duration::from_millis(10), Duration::from_secs(1))
    }

    fn adjust_active(&self, by: i64) {
        self.metrics.active.inc_by(by);
        if by >= 0 {
            self.active
                .fetch_add(usize::try_from(by).unwrap_or(0), Relaxed);
        } else {
            self.active
                .fetch_sub(usize::try_from(-by).unwrap_or(0), Relaxed);
        }
    }

    fn on_datagram(&self, table: &mut Table, data: &[u8], client: SocketAddr, draining: bool) {
        self.metrics.datagrams_in.inc();
        self.metrics.bytes_in.inc_by(data.len() as u64);
        let now = now_ms();
        if let Some(slot) = table.find(&client) {
            // A draining listener (shut down, or removed with its clusters) keeps its sessions
            // where they are until they end: no new sessions, no moves.
            if draining || self.keep_current(table, slot, now) {
                table.touch(slot, now);
                if let Some(s) = table.value(slot) {
                    self.forward(&s.upstream, data);
                }
                return;
            }
            // Its cluster has no endpoint left: the session ends and this datagram starts a new
            // one, routed from scratch.
            table.remove(slot);
            self.adjust_active(-1);
        }
        self.open(table, data, client, draining, now);
    }

    /// Keeps an existing session on an endpoint in rotation: moves it if its endpoint left
    /// rotation and the cluster has another. False: the session should end.
    fn keep_current(&self, table: &mut Table, slot: usize, now: u64) -> bool {
        let Some(s) = table.value_mut(slot) else {
            return false;
        };
        if s.endpoint.available(now) {
            return true;
        }
        let epoch = s.cluster.epoch.load(Relaxed);
        if epoch == s.epoch {
            // Nothing changed since we last looked: stay (the endpoint may come back, or every
            // endpoint is out and this one is as good as any).
            return true;
        }
        s.epoch = epoch;
        let Some(next) = s.cluster.pick(s.hash, now) else {
            return false;
        };
        if Arc::ptr_eq(&next, &s.endpoint) {
            return true;
        }
        let upstream = match open_upstream(next.addr) {
            Ok(u) => Arc::new(u),
            Err(e) => {
                tracing::debug!(error = %e, endpoint = %next.id, "cannot open upstream socket; session stays");
                return true;
            }
        };
        let Some(client) = table.key(slot).copied() else {
            return false;
        };
        let Some(s) = table.value_mut(slot) else {
            return false;
        };
        s.replies.abort();
        s.replies = self.spawn_replies(upstream.clone(), client, s.last_reply.clone());
        s.upstream = upstream;
        tracing::debug!(from = %s.endpoint.id, to = %next.id, "udp session moved");
        s.endpoint = next;
        self.metrics.rerouted.inc();
        true
    }

    fn open(&self, table: &mut Table, data: &[u8], client: SocketAddr, draining: bool, now: u64) {
        if draining {
            self.metrics.refused_draining.inc();
            return;
        }
        let settings = self.settings.load();
        let (cluster, hash) = settings.route(data, client);
        let epoch = cluster.epoch.load(Relaxed);
        let Some(endpoint) = cluster.pick(hash, now) else {
            self.metrics.refused_no_endpoint.inc();
            return;
        };
        while table.len() >= settings.max_sessions {
            match settings.overflow {
                Overflow::Refuse => {
                    self.metrics.refused_full.inc();
                    return;
                }
                Overflow::EvictOldest => {
                    if !self.evict_one(table) {
                        break;
                    }
                }
            }
        }
        let upstream = match open_upstream(endpoint.addr) {
            Ok(u) => Arc::new(u),
            Err(e) => {
                tracing::warn!(error = %e, endpoint = %endpoint.id, "cannot open upstream socket");
                self.metrics.refused_socket.inc();
                return;
            }
        };
        let last_reply = Arc::new(AtomicU64::new(now));
        let replies = self.spawn_replies(upstream.clone(), client, last_reply.clone());
        self.forward(&upstream, data);
        table.insert(
            client,
            Session {
                cluster,
                hash,
                endpoint,
                epoch,
                upstream,
                last_reply,
                replies,
            },
            now,
        );
        self.metrics.created.inc();
        self.adjust_active(1);
    }

    /// Evicts the least recently active session: by client datagrams, and by replies as far as
    /// the last expiry sweep folded them in.
    fn evict_one(&self, table: &mut Table) -> bool {
        let Some(slot) = table.oldest() else {
            return false;
        };
        table.remove(slot);
        self.metrics.evicted.inc();
        self.adjust_active(-1);
        true
    }

    /// Ends sessions idle in both directions for the idle timeout. The walk starts at the least
    /// recently active and stops at the first recent one; a session whose endpoint replied
    /// recently moves to the front with that time. (So a session only its endpoint talks on
    /// ends between one and two timeouts after it went quiet.)
    fn expire(&self, table: &mut Table, now: u64) {
        let idle = u64::try_from(self.settings.load().idle_timeout.as_millis()).unwrap_or(u64::MAX);
        for _ in 0..table.len() {
            let Some(slot) = table.oldest() else {
                return;
            };
            if now.saturating_sub(table.stamp(slot)) < idle {
                return;
            }
            let reply = table.value(slot).map_or(0, |s| s.last_reply.load(Relaxed));
            if now.saturating_sub(reply) < idle {
                table.touch(slot, reply);
                continue;
            }
            table.remove(slot);
            self.metrics.expired.inc();
            self.adjust_active(-1);
        }
    }

    fn forward(&self, upstream: &UdpSocket, data: &[u8]) {
        // A direct send, not tokio's `try_send`: tokio answers WouldBlock without trying until
        // it has seen the new socket's first writable event, which would drop first datagrams.
        match SockRef::from(upstream).send(data) {
            Ok(_) => {}
            Err(e) if is_icmp(&e) => {
                // An earlier datagram's ICMP error, reported on this send; this one is lost too.
                self.metrics.icmp_errors.inc();
                self.metrics.dropped_upstream.inc();
            }
            Err(e) => {
                if e.kind() != io::ErrorKind::WouldBlock {
                    tracing::debug!(error = %e, "udp send upstream failed");
                }
                self.metrics.dropped_upstream.inc();
            }
        }
    }

    fn spawn_replies(
        &self,
        upstream: Arc<UdpSocket>,
        client: SocketAddr,
        last_reply: Arc<AtomicU64>,
    ) -> AbortHandle {
        let task = replies(
            upstream,
            self.socket.clone(),
            client,
            last_reply,
            self.metrics.clone(),
            self.kill.clone(),
        );
        self.drain.spawn(task).abort_handle()
    }
}

/// A connected socket to `endpoint` from an ephemeral port.
fn open_upstream(endpoint: SocketAddr) -> io::Result<UdpSocket> {
    let local: SocketAddr = match endpoint {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let s = std::net::UdpSocket::bind(local)?;
    s.connect(endpoint)?;
    s.set_nonblocking(true)?;
    UdpSocket::from_std(s)
}

/// Forwards one session's replies to its client until aborted (by the table) or killed.
async fn replies(
    upstream: Arc<UdpSocket>,
    listener: Arc<UdpSocket>,
    client: SocketAddr,
    last_reply: Arc<AtomicU64>,
    metrics: ListenerMetrics,
    kill: CancellationToken,
) {
    let to = SockAddr::from(client);
    let mut killed = pin!(kill.cancelled());
    loop {
        let ready = tokio::select! {
            biased;
            () = &mut killed => return,
            r = upstream.ready(Interest::READABLE | Interest::ERROR) => r,
        };
        let Ok(ready) = ready else { return };
        if ready.is_error() {
            // An ICMP error (the endpoint's port is closed, its host unreachable) is pending on
            // the socket: reading SO_ERROR clears it, and the WouldBlock that follows clears
            // tokio's error readiness, so the session carries on.
            let taken = upstream.try_io(Interest::ERROR, || match upstream.take_error() {
                Ok(Some(e)) => Ok(e),
                Ok(None) => Err(io::ErrorKind::WouldBlock.into()),
                Err(e) => Err(e),
            });
            if let Ok(e) = taken
                && is_icmp(&e)
            {
                metrics.icmp_errors.inc();
            }
        }
        if !ready.is_readable() {
            continue;
        }
        for _ in 0..BATCH {
            let r = REPLY_BUF.with_borrow_mut(|buf| {
                let n = upstream.try_recv(buf)?;
                let data = buf.get(..n).unwrap_or_default();
                match SockRef::from(&*listener).send_to(data, &to) {
                    Ok(_) => {
                        metrics.datagrams_out.inc();
                        metrics.bytes_out.inc_by(n as u64);
                    }
                    Err(_) => {
                        metrics.dropped_client.inc();
                    }
                }
                Ok::<_, io::Error>(())
            });
            match r {
                Ok(()) => last_reply.store(now_ms(), Relaxed),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if is_icmp(&e) => {
                    metrics.icmp_errors.inc();
                }
                Err(e) => {
                    // Readiness stays set after an unexpected error: pause instead of spinning.
                    tracing::debug!(error = %e, "udp receive from upstream failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    break;
                }
            }
        }
    }
}
