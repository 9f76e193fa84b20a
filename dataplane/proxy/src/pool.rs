//! Upstream connections: HTTP/1 keep-alive pools and shared HTTP/2 connections, keyed by
//! upstream, plus plain TCP connects for opaque traffic and upgrades.
//!
//! A connection returns to its pool only once its response body has been consumed (`ready()`),
//! and never if its destination has left the routing table in the meantime.

mod mux;

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Body as _;
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use spur_routing::rules::Location;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::Error;
use crate::config::{ProxyConfig, split_host_port};
use crate::metrics::Metrics;

pub(crate) type Body = BoxBody<Bytes, hyper::Error>;

/// How long a sandbox destination that refuses connections is tried again, at most (and never
/// past the connect timeout). A fork's Service can refuse for a moment after its pod became
/// ready, and so after its Sandbox did: kube-proxy rejects a ClusterIP until the endpoint
/// reaches its rules. Nothing was sent on a refused connection, so any request may be retried.
const REFUSED_BUDGET: Duration = Duration::from_secs(2);
/// The first wait before trying a refused destination again; doubled each time.
const REFUSED_FIRST_WAIT: Duration = Duration::from_millis(50);

/// `connect()` until it does not fail with ECONNREFUSED, or until the next try would start
/// past `budget` (then the last refusal is the answer: a fork that is down is a 502, later).
async fn retry_refused<F, Fut>(connect: F, budget: Duration) -> std::io::Result<TcpStream>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = std::io::Result<TcpStream>>,
{
    let deadline = tokio::time::Instant::now() + budget;
    let mut wait = REFUSED_FIRST_WAIT;
    loop {
        match connect().await {
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionRefused
                    && tokio::time::Instant::now() + wait < deadline =>
            {
                tokio::time::sleep(wait).await;
                wait = wait.saturating_mul(2);
            }
            r => return r,
        }
    }
}

/// Where a connection goes.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub(crate) enum Upstream {
    /// The inbound connection's original destination (the application).
    Original(SocketAddr),
    /// A routing-table destination; subject to purging when it leaves the table.
    Sandbox(Arc<Location>),
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Upstream::Original(a) => a.fmt(f),
            Upstream::Sandbox(l) => l.fmt(f),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Version {
    Http1,
    Http2,
}

/// An idle pooled HTTP/1 connection: a hyper sender (`State::h1`) or, for the HTTP/1.1 relay
/// (`http/relay.rs`), a plain socket between two exchanges with no task attached
/// (`State::raw`).
struct Idle<C> {
    conn: C,
    since: Instant,
}

/// Whether an idle connection can still carry a request.
trait Reusable {
    fn usable(&self) -> bool;
}

impl Reusable for http1::SendRequest<Body> {
    fn usable(&self) -> bool {
        !self.is_closed()
    }
}

/// Judged from the readiness the runtime already knows, without a syscall (see [`readable`]); a
/// close racing this check shows up as an early EOF, which the relay retries where it safely
/// can.
impl Reusable for TcpStream {
    fn usable(&self) -> bool {
        !readable(self)
    }
}

type IdleMap<C> = FastMap<Upstream, Vec<Idle<C>>>;

/// The newest idle connection to `upstream` that is young enough and still usable; older or
/// broken ones met on the way are dropped.
fn take_idle<C: Reusable>(
    map: &mut IdleMap<C>,
    upstream: &Upstream,
    max_age: Duration,
) -> Option<C> {
    let idle = map.get_mut(upstream)?;
    while let Some(entry) = idle.pop() {
        if entry.since.elapsed() < max_age && entry.conn.usable() {
            return Some(entry.conn);
        }
    }
    None
}

/// Drops idle connections past `max_age` or no longer usable.
fn prune<C: Reusable>(map: &mut IdleMap<C>, max_age: Duration) {
    for idle in map.values_mut() {
        idle.retain(|e| e.since.elapsed() < max_age && e.conn.usable());
    }
    map.retain(|_, idle| !idle.is_empty());
}

/// Drops the idle connections of upstreams `keep` rejects; returns how many.
fn drop_upstreams<C>(map: &mut IdleMap<C>, keep: impl Fn(&Upstream) -> bool) -> u64 {
    let mut closed = 0;
    map.retain(|u, idle| {
        let k = keep(u);
        if !k {
            closed += idle.len() as u64;
        }
        k
    });
    closed
}

/// The pool's keys are the pod's own application address and the routing table's
/// destinations, never chosen by a client, so a fast hasher is safe: SipHash on every
/// `take_h1`/`put_h1` was about 1.7 % of a request's instructions
/// (`perf/results/profile-h1-2026-11-25.md`).
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

#[derive(Default)]
struct State {
    h1: IdleMap<http1::SendRequest<Body>>,
    raw: IdleMap<TcpStream>,
    h2: FastMap<Upstream, http2::SendRequest<Body>>,
    /// The HTTP/2 relay's connections (`mux.rs`).
    mux: FastMap<Upstream, mux::Mux>,
    /// Sandbox locations of the current table; `None` until a table change is first reported.
    live: Option<BTreeSet<Location>>,
}

impl State {
    fn is_live(&self, upstream: &Upstream) -> bool {
        match (upstream, &self.live) {
            (Upstream::Sandbox(loc), Some(live)) => live.contains(&**loc),
            _ => true,
        }
    }
}

/// Cheap to clone (one `Arc`): response bodies carry a handle back to their pool.
#[derive(Clone)]
pub(crate) struct Pool(Arc<PoolInner>);

pub(crate) struct PoolInner {
    state: Mutex<State>,
    connect_timeout: Duration,
    max_idle: usize,
    idle_timeout: Duration,
    max_header_bytes: usize,
    /// `ProxyConfig::resolve`, keyed by lowercase host and port.
    resolve: HashMap<(String, u16), SocketAddr>,
    metrics: Metrics,
}

impl std::ops::Deref for Pool {
    type Target = PoolInner;

    fn deref(&self) -> &PoolInner {
        &self.0
    }
}

impl Pool {
    pub(crate) fn new(config: &ProxyConfig, metrics: Metrics) -> Self {
        let pool = Pool(Arc::new(PoolInner {
            state: Mutex::default(),
            connect_timeout: config.connect_timeout,
            max_idle: config.pool_max_idle_per_upstream,
            idle_timeout: config.pool_idle_timeout,
            max_header_bytes: config.max_header_bytes,
            resolve: config
                .resolve
                .iter()
                .filter_map(|(k, addr)| Some((split_host_port(k).ok()?, *addr)))
                .collect(),
            metrics,
        }));
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(reap(Arc::downgrade(&pool.0), config.pool_idle_timeout));
        }
        pool
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the maps inconsistent (every critical
        // section is a single insert/remove), so a poisoned lock is still safe to use.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) async fn connect_tcp(&self, upstream: &Upstream) -> Result<TcpStream, Error> {
        let connect = async {
            match upstream {
                Upstream::Original(addr) => TcpStream::connect(addr).await,
                Upstream::Sandbox(loc) => {
                    let once = || async {
                        match self.resolve.get(&(loc.host.to_ascii_lowercase(), loc.port)) {
                            Some(addr) => TcpStream::connect(addr).await,
                            None => TcpStream::connect((loc.host.as_str(), loc.port)).await,
                        }
                    };
                    retry_refused(once, self.connect_timeout.min(REFUSED_BUDGET)).await
                }
            }
        };
        let res = match tokio::time::timeout(self.connect_timeout, connect).await {
            Err(_) => Err(Error::ConnectTimeout {
                upstream: upstream.to_string(),
                timeout: self.connect_timeout,
            }),
            Ok(Err(source)) => Err(Error::Connect {
                upstream: upstream.to_string(),
                source,
            }),
            Ok(Ok(s)) => {
                // Latency matters more than packet count for proxied request/response traffic.
                let _ = s.set_nodelay(true);
                Ok(s)
            }
        };
        self.metrics.upstream_connect(res.is_ok());
        res
    }

    /// Sends one request upstream over a pooled or new connection of the given version.
    pub(crate) async fn send(
        &self,
        upstream: &Upstream,
        version: Version,
        req: Request<Body>,
    ) -> Result<Response<Body>, Error> {
        match version {
            Version::Http1 => self.send_h1(upstream, req).await,
            Version::Http2 => Ok(self.send_h2(upstream, req).await?.map(BodyExt::boxed)),
        }
    }

    async fn send_h1(
        &self,
        upstream: &Upstream,
        mut req: Request<Body>,
    ) -> Result<Response<Body>, Error> {
        let connect = req.method() == http::Method::CONNECT;
        // A pooled connection may have been closed by the server just as we picked it; hyper
        // hands the request back when it was not written, and we retry on the next one.
        while let Some(mut sender) = self.take_h1(upstream) {
            // Returned to the pool as soon as the previous response body ended, the connection
            // may still be finishing that exchange: wait for it rather than skip it.
            if sender.ready().await.is_err() {
                continue;
            }
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok(self.recycle_h1(upstream, sender, resp, connect)),
                Err(mut e) => match e.take_message() {
                    Some(r) => req = r,
                    None => {
                        return Err(Error::Upstream {
                            upstream: upstream.to_string(),
                            source: e.into_error(),
                        });
                    }
                },
            }
        }
        let mut sender = self.connect_h1(upstream).await?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|source| Error::Upstream {
                upstream: upstream.to_string(),
                source,
            })?;
        Ok(self.recycle_h1(upstream, sender, resp, connect))
    }

    fn take_h1(&self, upstream: &Upstream) -> Option<http1::SendRequest<Body>> {
        take_idle(&mut self.lock().h1, upstream, self.idle_timeout)
    }

    /// Ties the connection's return to the pool to the end of the response body, so reuse costs
    /// nothing per request (no task, no wakeup). Upgraded connections are never returned.
    fn recycle_h1(
        &self,
        upstream: &Upstream,
        sender: http1::SendRequest<Body>,
        resp: Response<Incoming>,
        connect: bool,
    ) -> Response<Body> {
        let upgraded = resp.status() == http::StatusCode::SWITCHING_PROTOCOLS
            || (connect && resp.status().is_success());
        if upgraded {
            return resp.map(BodyExt::boxed);
        }
        let slot = Some(Checkin {
            pool: self.clone(),
            upstream: upstream.clone(),
            sender,
        });
        resp.map(|inner| PooledBody { inner, slot }.boxed())
    }

    fn put_h1(&self, upstream: Upstream, sender: http1::SendRequest<Body>) {
        self.put_idle(upstream, sender, |s| &mut s.h1);
    }

    /// An idle relay connection to `upstream`, if one is left that has not been closed or sent
    /// anything since its last exchange.
    pub(crate) fn take_raw(&self, upstream: &Upstream) -> Option<TcpStream> {
        take_idle(&mut self.lock().raw, upstream, self.idle_timeout)
    }

    /// Returns a relay connection whose last exchange ended cleanly.
    pub(crate) fn put_raw(&self, upstream: Upstream, stream: TcpStream) {
        self.put_idle(upstream, stream, |s| &mut s.raw);
    }

    /// Pools an idle connection, unless its destination has left the routing table or the
    /// upstream already has `max_idle` of them (then it is dropped, which closes it).
    fn put_idle<C>(
        &self,
        upstream: Upstream,
        conn: C,
        map: impl FnOnce(&mut State) -> &mut IdleMap<C>,
    ) {
        let mut state = self.lock();
        if !state.is_live(&upstream) {
            self.metrics.stale_closed.inc();
            return;
        }
        let idle = map(&mut state).entry(upstream).or_default();
        if idle.len() < self.max_idle {
            idle.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    async fn connect_h1(&self, upstream: &Upstream) -> Result<http1::SendRequest<Body>, Error> {
        let tcp = self.connect_tcp(upstream).await?;
        let (sender, conn) = http1::Builder::new()
            .max_buf_size(self.max_header_bytes.max(8192) * 2)
            .handshake(TokioIo::new(crate::io::Coalesce::new(tcp)))
            .await
            .map_err(|source| Error::Handshake {
                upstream: upstream.to_string(),
                source,
            })?;
        let name = upstream.to_string();
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(upstream = %name, error = %e, "upstream HTTP/1 connection ended");
            }
        });
        Ok(sender)
    }

    async fn send_h2(
        &self,
        upstream: &Upstream,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, Error> {
        let existing = {
            let state = self.lock();
            state.h2.get(upstream).filter(|s| !s.is_closed()).cloned()
        };
        let mut req = req;
        if let Some(mut sender) = existing {
            if sender.ready().await.is_ok() {
                match sender.try_send_request(req).await {
                    Ok(resp) => return Ok(resp),
                    Err(mut e) => match e.take_message() {
                        Some(r) => req = r,
                        None => {
                            return Err(Error::Upstream {
                                upstream: upstream.to_string(),
                                source: e.into_error(),
                            });
                        }
                    },
                }
            }
            self.lock().h2.remove(upstream);
        }
        let mut sender = self.connect_h2(upstream).await?;
        {
            let mut state = self.lock();
            if state.is_live(upstream) {
                state.h2.insert(upstream.clone(), sender.clone());
            }
        }
        sender
            .send_request(req)
            .await
            .map_err(|source| Error::Upstream {
                upstream: upstream.to_string(),
                source,
            })
    }

    async fn connect_h2(&self, upstream: &Upstream) -> Result<http2::SendRequest<Body>, Error> {
        let tcp = self.connect_tcp(upstream).await?;
        let header_bytes = u32::try_from(self.max_header_bytes).unwrap_or(u32::MAX);
        let (sender, conn) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_header_list_size(header_bytes)
            .keep_alive_interval(Duration::from_secs(30))
            .handshake(TokioIo::new(crate::io::Coalesce::new(tcp)))
            .await
            .map_err(|source| Error::Handshake {
                upstream: upstream.to_string(),
                source,
            })?;
        let name = upstream.to_string();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(upstream = %name, error = %e, "upstream HTTP/2 connection ended");
            }
        });
        Ok(sender)
    }

    /// Drops idle connections to sandbox upstreams outside `live` (dropping the last sender closes
    /// the connection); connections in use are dropped instead of being returned to the pool.
    pub(crate) fn retain_sandbox_upstreams(&self, live: &BTreeSet<Location>) {
        let mut state = self.lock();
        let keep = |u: &Upstream| match u {
            Upstream::Original(_) => true,
            Upstream::Sandbox(loc) => live.contains(&**loc),
        };
        let mut closed = drop_upstreams(&mut state.h1, keep) + drop_upstreams(&mut state.raw, keep);
        state.h2.retain(|u, _| {
            let k = keep(u);
            if !k {
                closed += 1;
            }
            k
        });
        state.mux.retain(|u, _| {
            let k = keep(u);
            if !k {
                closed += 1;
            }
            k
        });
        state.live = Some(live.clone());
        drop(state);
        self.metrics.stale_closed.inc_by(closed);
    }

    pub(crate) fn idle_count(&self) -> usize {
        let mut state = self.lock();
        state.h1.values().map(Vec::len).sum::<usize>()
            + state.raw.values().map(Vec::len).sum::<usize>()
            + state.h2.values().filter(|s| !s.is_closed()).count()
            + state
                .mux
                .values_mut()
                .map(|m| usize::from(m.is_usable()))
                .sum::<usize>()
    }
}

/// What a response body needs to give its connection back.
struct Checkin {
    pool: Pool,
    upstream: Upstream,
    sender: http1::SendRequest<Body>,
}

pin_project_lite::pin_project! {
    /// An upstream HTTP/1 response body that returns its connection to the pool once it has been
    /// read to the end. A body dropped early leaves hyper to close the connection.
    struct PooledBody {
        #[pin]
        inner: Incoming,
        slot: Option<Checkin>,
    }

    impl PinnedDrop for PooledBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            // Empty bodies (204, HEAD, Content-Length: 0) may never be polled at all.
            if this.inner.is_end_stream()
                && let Some(c) = this.slot.take()
            {
                c.pool.put_h1(c.upstream, c.sender);
            }
        }
    }
}

impl http_body::Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        let mut this = self.project();
        let res = this.inner.as_mut().poll_frame(cx);
        let ended = match &res {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
            Poll::Ready(Some(Err(_))) => {
                // A broken body means a broken connection: never reuse it.
                this.slot.take();
                false
            }
            Poll::Pending => false,
        };
        if ended && let Some(c) = this.slot.take() {
            c.pool.put_h1(c.upstream, c.sender);
        }
        res
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Whether the runtime has seen a socket become readable (data or EOF) and not yet drained.
/// An idle keep-alive connection that is readable was closed by its server or sent bytes no
/// request asked for: either way it must not carry another request. The relay's reads leave
/// readiness cleared (tokio clears it on a short read), so a healthy idle socket reads `false`.
/// Looked at outside tokio's per-task budget: a task that spent it would otherwise see every
/// socket as not readable, and reuse one that is.
fn readable(stream: &TcpStream) -> bool {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let ready = std::future::poll_fn(|cx| stream.poll_read_ready(cx));
    std::pin::pin!(tokio::task::coop::unconstrained(ready))
        .poll(&mut cx)
        .is_ready()
}

/// Closes idle connections past their idle timeout; ends when the pool is dropped.
async fn reap(pool: Weak<PoolInner>, idle_timeout: Duration) {
    let period = (idle_timeout / 2).max(Duration::from_millis(100));
    loop {
        tokio::time::sleep(period).await;
        let Some(pool) = pool.upgrade() else { return };
        let mut state = pool.state.lock().unwrap_or_else(|p| p.into_inner());
        prune(&mut state.h1, idle_timeout);
        prune(&mut state.raw, idle_timeout);
        state.h2.retain(|_, s| !s.is_closed());
        state.mux.retain(|_, m| m.is_usable());
    }
}

#[cfg(test)]
mod refused_tests {
    use super::*;

    /// A loopback port nothing listens on (for now).
    fn free_port() -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }

    #[tokio::test]
    async fn a_destination_that_starts_listening_within_the_budget_is_reached() {
        let addr = free_port();
        let late = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let l = tokio::net::TcpListener::bind(addr).await.unwrap();
            l.accept().await.unwrap()
        });
        let tries = std::sync::atomic::AtomicUsize::new(0);
        let connect = || {
            tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            TcpStream::connect(addr)
        };
        retry_refused(connect, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(tries.into_inner() > 1, "refused first");
        late.await.unwrap();
    }

    #[tokio::test]
    async fn a_destination_that_keeps_refusing_is_refused_once_the_budget_is_spent() {
        let addr = free_port();
        let tries = std::sync::atomic::AtomicUsize::new(0);
        let connect = || {
            tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            TcpStream::connect(addr)
        };
        let err = retry_refused(connect, Duration::from_millis(400))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
        // 50 + 100 + 200 ms of waiting fit in 400: four tries at most, the next wait (400)
        // does not (fewer when a loaded machine oversleeps), and more than one.
        let tries = tries.into_inner();
        assert!((2..=4).contains(&tries), "{tries} tries");
        // No budget: tried once.
        let once = std::sync::atomic::AtomicUsize::new(0);
        let connect = || {
            once.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            TcpStream::connect(addr)
        };
        assert!(retry_refused(connect, Duration::ZERO).await.is_err());
        assert_eq!(once.into_inner(), 1);
    }
}

#[cfg(test)]
mod readable_tests {
    use super::*;
    use std::future::Future as _;
    use tokio::io::AsyncWriteExt;

    /// Spends the calling task's tokio budget without yielding, as a long run of I/O that never
    /// blocks does.
    fn spend_budget() {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        while tokio::task::coop::has_budget_remaining() {
            let _ = std::pin::pin!(tokio::task::coop::consume_budget()).poll(&mut cx);
        }
    }

    #[tokio::test]
    async fn a_socket_with_bytes_is_readable_after_the_task_spent_its_budget() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        client.write_all(b"stray").await.unwrap();
        server.readable().await.unwrap();
        spend_budget();
        assert!(!tokio::task::coop::has_budget_remaining());
        assert!(readable(&server), "bytes no request asked for");
    }
}
