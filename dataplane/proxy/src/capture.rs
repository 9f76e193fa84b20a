//! Traffic capture: a copy of selected HTTP exchanges (request and response heads, the first
//! bytes of each body, timings) taken as they stream through the proxy, redacted on the spot and
//! kept in a bounded ring until the component that owns the proxy ships them.
//!
//! Which exchanges are captured is a [`CaptureSelect`](crate::CaptureSelect)'s call, plugged in
//! beside the router ([`crate::Plugins`]); a proxy without one never asks, and the HTTP/1 relay
//! hands captured requests to the full path, so
//! capture costs nothing while it is off. While it is on, a captured exchange never waits for
//! the capture: bodies are copied as their frames pass, the finished record is pushed into the
//! ring under a short lock, and when the ring or the in-flight bound is full a record is dropped
//! and counted instead.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderMap, HeaderName};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Headers whose values never leave the proxy, whatever the settings say.
pub const ALWAYS_REDACTED: [&str; 4] = [
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
];
/// What a redacted header value is replaced with.
pub const REDACTED: &[u8] = b"<redacted>";
/// Bounds on the settings a control plane may send: a body limit larger than this is capped.
pub const MAX_BODY_LIMIT: usize = 1 << 20;

/// Why a captured exchange was labelled as it was: the router's answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureTag {
    pub sandbox: Arc<str>,
    pub routing_key: Arc<str>,
}

/// How much a [`Capture`] may hold. The sidecar's memory for capture stays below
/// `ring_bytes + max_in_flight × 2 × body limit` (plus heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureBounds {
    /// Finished exchanges waiting to be shipped.
    pub ring_exchanges: usize,
    pub ring_bytes: usize,
    /// Exchanges being captured at once; past it, new ones are not captured (and counted).
    pub max_in_flight: usize,
}

impl Default for CaptureBounds {
    fn default() -> Self {
        CaptureBounds {
            ring_exchanges: 4096,
            ring_bytes: 8 << 20,
            max_in_flight: 256,
        }
    }
}

/// Redaction and body limit, replaceable at run time (the control plane's settings).
#[derive(Debug, Clone)]
pub struct CaptureLimits {
    redact: Box<[HeaderName]>,
    max_body: usize,
}

impl CaptureLimits {
    /// `redact` adds to [`ALWAYS_REDACTED`]; names that are not valid header names are ignored
    /// (they could not match a header anyway). `max_body` is capped at [`MAX_BODY_LIMIT`].
    pub fn new<S: AsRef<str>>(redact: &[S], max_body: usize) -> Self {
        let mut names: Vec<HeaderName> = ALWAYS_REDACTED
            .iter()
            .map(|n| HeaderName::from_static(n))
            .collect();
        for n in redact {
            if let Ok(name) = HeaderName::from_bytes(n.as_ref().trim().as_bytes())
                && !names.contains(&name)
            {
                names.push(name);
            }
        }
        CaptureLimits {
            redact: names.into_boxed_slice(),
            max_body: max_body.min(MAX_BODY_LIMIT),
        }
    }

    pub fn max_body(&self) -> usize {
        self.max_body
    }

    pub fn redacts(&self, name: &HeaderName) -> bool {
        self.redact.contains(name)
    }

    fn headers(&self, map: &HeaderMap) -> Vec<(HeaderName, Bytes)> {
        map.iter()
            .map(|(name, value)| {
                let value = if self.redacts(name) {
                    Bytes::from_static(REDACTED)
                } else {
                    Bytes::copy_from_slice(value.as_bytes())
                };
                (name.clone(), value)
            })
            .collect()
    }
}

impl Default for CaptureLimits {
    fn default() -> Self {
        CaptureLimits::new::<&str>(&[], 16 << 10)
    }
}

/// The protocol of a captured exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapturedProtocol {
    Http1,
    Http2,
    Grpc,
    WebSocket,
}

/// One direction's body: its size and its first bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapturedBody {
    pub size: u64,
    pub data: Vec<u8>,
    pub truncated: bool,
}

impl CapturedBody {
    fn push(&mut self, chunk: &[u8], limit: usize) {
        self.size += chunk.len() as u64;
        let room = limit.saturating_sub(self.data.len());
        let take = room.min(chunk.len());
        self.data.extend_from_slice(&chunk[..take]);
        if take < chunk.len() {
            self.truncated = true;
        }
    }
}

/// A captured exchange, already redacted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapturedExchange {
    /// Unique in this process, increasing in capture order.
    pub seq: u64,
    pub tag: CaptureTag,
    /// The sandbox destination it was sent to; `None`: the original destination (the app).
    pub destination: Option<String>,
    pub protocol: CapturedProtocol,
    pub method: String,
    pub path: String,
    pub authority: String,
    /// 0 when no response came.
    pub status: u16,
    pub request_headers: Vec<(HeaderName, Bytes)>,
    pub response_headers: Vec<(HeaderName, Bytes)>,
    pub response_trailers: Vec<(HeaderName, Bytes)>,
    pub request_body: CapturedBody,
    pub response_body: CapturedBody,
    pub start: SystemTime,
    pub response_after: Option<Duration>,
    pub duration: Duration,
    pub error: Option<String>,
}

impl CapturedExchange {
    /// What the record costs in the ring (bodies, heads and a fixed overhead).
    pub fn approx_bytes(&self) -> usize {
        let heads: usize = [
            &self.request_headers,
            &self.response_headers,
            &self.response_trailers,
        ]
        .iter()
        .flat_map(|h| h.iter())
        .map(|(n, v)| n.as_str().len() + v.len() + 16)
        .sum();
        256 + heads
            + self.request_body.data.len()
            + self.response_body.data.len()
            + self.method.len()
            + self.path.len()
            + self.authority.len()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabels {
    reason: &'static str,
}

#[derive(Clone)]
struct CaptureMetrics {
    captured: Counter,
    dropped: Family<DropLabels, Counter>,
    ring_bytes: Gauge,
    in_flight: Gauge,
}

/// Why a record was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The ring was full: the oldest record made room.
    RingFull,
    /// Too many exchanges were being captured at once: this one was not.
    Busy,
    /// Shipping failed (store unreachable or refusing): the batch was dropped.
    ShipFailed,
}

impl DropReason {
    fn label(self) -> &'static str {
        match self {
            DropReason::RingFull => "ring_full",
            DropReason::Busy => "busy",
            DropReason::ShipFailed => "ship_failed",
        }
    }
}

struct Ring {
    records: VecDeque<CapturedExchange>,
    bytes: usize,
}

/// The capture sink of a proxy: its limits, the ring of finished exchanges, and counters.
pub struct Capture {
    limits: ArcSwap<CaptureLimits>,
    bounds: CaptureBounds,
    ring: Mutex<Ring>,
    ready: Notify,
    seq: AtomicU64,
    in_flight: AtomicUsize,
    dropped_total: AtomicU64,
    metrics: CaptureMetrics,
}

impl Capture {
    /// Registers `capture_*` metrics under `registry`.
    pub fn new(bounds: CaptureBounds, registry: &mut Registry) -> Arc<Self> {
        let metrics = CaptureMetrics {
            captured: Counter::default(),
            dropped: Family::default(),
            ring_bytes: Gauge::default(),
            in_flight: Gauge::default(),
        };
        registry.register(
            "capture_exchanges",
            "Exchanges captured (before shipping)",
            metrics.captured.clone(),
        );
        registry.register(
            "capture_dropped",
            "Captured exchanges dropped, by reason (ring_full, busy, ship_failed); traffic is never held back for capture",
            metrics.dropped.clone(),
        );
        registry.register(
            "capture_ring_bytes",
            "Bytes of captured exchanges waiting to be shipped",
            metrics.ring_bytes.clone(),
        );
        registry.register(
            "capture_in_flight",
            "Exchanges being captured",
            metrics.in_flight.clone(),
        );
        Arc::new(Capture {
            limits: ArcSwap::from_pointee(CaptureLimits::default()),
            bounds,
            ring: Mutex::new(Ring {
                records: VecDeque::new(),
                bytes: 0,
            }),
            ready: Notify::new(),
            seq: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            dropped_total: AtomicU64::new(0),
            metrics,
        })
    }

    pub fn set_limits(&self, limits: CaptureLimits) {
        self.limits.store(Arc::new(limits));
    }

    pub fn limits(&self) -> Arc<CaptureLimits> {
        self.limits.load_full()
    }

    /// Takes up to `max` finished exchanges, oldest first.
    pub fn take(&self, max: usize) -> Vec<CapturedExchange> {
        let mut ring = self.lock();
        let n = max.min(ring.records.len());
        let out: Vec<_> = ring.records.drain(..n).collect();
        ring.bytes = ring
            .bytes
            .saturating_sub(out.iter().map(CapturedExchange::approx_bytes).sum());
        self.metrics.ring_bytes.set(ring.bytes as i64);
        out
    }

    /// Waits until the ring has something (returns at once if it already has).
    pub async fn ready(&self) {
        let notified = self.ready.notified();
        if !self.lock().records.is_empty() {
            return;
        }
        notified.await;
    }

    /// Finished exchanges waiting in the ring.
    pub fn queued(&self) -> usize {
        self.lock().records.len()
    }

    /// Counts `n` records dropped outside the proxy (shipping).
    pub fn dropped(&self, reason: DropReason, n: u64) {
        self.metrics
            .dropped
            .get_or_create(&DropLabels {
                reason: reason.label(),
            })
            .inc_by(n);
        self.dropped_total.fetch_add(n, Ordering::Relaxed);
    }

    /// Every record dropped so far, for any reason.
    pub fn dropped_total(&self) -> u64 {
        self.dropped_total.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Ring> {
        // A panic while holding the lock leaves a ring that is still consistent enough to use.
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, record: CapturedExchange) {
        let size = record.approx_bytes();
        let mut evicted = 0u64;
        {
            let mut ring = self.lock();
            while !ring.records.is_empty()
                && (ring.records.len() >= self.bounds.ring_exchanges
                    || ring.bytes + size > self.bounds.ring_bytes)
            {
                if let Some(old) = ring.records.pop_front() {
                    ring.bytes = ring.bytes.saturating_sub(old.approx_bytes());
                    evicted += 1;
                }
            }
            ring.bytes += size;
            ring.records.push_back(record);
            self.metrics.ring_bytes.set(ring.bytes as i64);
        }
        self.metrics.captured.inc();
        if evicted > 0 {
            self.dropped(DropReason::RingFull, evicted);
        }
        self.ready.notify_one();
    }

    /// Starts capturing one exchange, unless too many are in flight.
    pub(crate) fn begin(
        self: &Arc<Self>,
        tag: CaptureTag,
        destination: Option<String>,
        protocol: CapturedProtocol,
        req: &http::request::Parts,
    ) -> Option<Arc<Pending>> {
        let n = self.in_flight.fetch_add(1, Ordering::Relaxed);
        if n >= self.bounds.max_in_flight {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            self.dropped(DropReason::Busy, 1);
            return None;
        }
        self.metrics.in_flight.inc();
        let limits = self.limits.load_full();
        let path = req
            .uri
            .path_and_query()
            .map_or_else(|| req.uri.path().to_string(), |pq| pq.as_str().to_string());
        let authority = req
            .uri
            .authority()
            .map(|a| a.as_str().to_string())
            .or_else(|| {
                req.headers
                    .get(http::header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_string)
            })
            .unwrap_or_default();
        let record = CapturedExchange {
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            tag,
            destination,
            protocol,
            method: req.method.as_str().to_string(),
            path,
            authority,
            status: 0,
            request_headers: limits.headers(&req.headers),
            response_headers: Vec::new(),
            response_trailers: Vec::new(),
            request_body: CapturedBody::default(),
            response_body: CapturedBody::default(),
            start: SystemTime::now(),
            response_after: None,
            duration: Duration::ZERO,
            error: None,
        };
        Some(Arc::new(Pending {
            capture: self.clone(),
            limits,
            started: Instant::now(),
            record: Mutex::new(Some(record)),
        }))
    }
}

/// An exchange being captured. Shared by the forwarding code and the body wrappers; the record
/// goes into the ring when the last of them lets go (the exchange is over).
pub(crate) struct Pending {
    capture: Arc<Capture>,
    limits: Arc<CaptureLimits>,
    started: Instant,
    record: Mutex<Option<CapturedExchange>>,
}

/// Which body a [`TeeBody`] copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    Request,
    Response,
}

impl Pending {
    fn with(&self, f: impl FnOnce(&mut CapturedExchange, &CaptureLimits)) {
        let mut guard = self.record.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = guard.as_mut() {
            f(r, &self.limits);
        }
    }

    pub(crate) fn response(&self, parts: &http::response::Parts) {
        let after = self.started.elapsed();
        self.with(|r, limits| {
            r.status = parts.status.as_u16();
            r.response_headers = limits.headers(&parts.headers);
            r.response_after = Some(after);
        });
    }

    pub(crate) fn fail(&self, status: u16, error: impl Into<String>) {
        let error = error.into();
        self.with(|r, _| {
            if r.status == 0 {
                r.status = status;
            }
            r.error.get_or_insert(error);
        });
    }

    pub(crate) fn upgraded(&self, result: Result<(u64, u64), &'static str>) {
        let end = self.started.elapsed();
        self.with(|r, _| {
            r.protocol = CapturedProtocol::WebSocket;
            match result {
                Ok((up, down)) => {
                    r.request_body.size += up;
                    r.response_body.size += down;
                }
                Err(e) => {
                    r.error.get_or_insert_with(|| e.to_string());
                }
            }
            r.duration = end;
        });
    }

    /// The response has no body to wait for: the exchange ends with its head.
    pub(crate) fn end_response(&self) {
        self.end(Direction::Response, None);
    }

    pub(crate) fn data(&self, dir: Direction, chunk: &[u8]) {
        self.with(|r, limits| {
            let body = match dir {
                Direction::Request => &mut r.request_body,
                Direction::Response => &mut r.response_body,
            };
            body.push(chunk, limits.max_body);
        });
    }

    pub(crate) fn trailers(&self, dir: Direction, map: &HeaderMap) {
        if dir == Direction::Response {
            self.with(|r, limits| r.response_trailers = limits.headers(map));
        }
    }

    pub(crate) fn end(&self, dir: Direction, error: Option<String>) {
        let at = self.started.elapsed();
        self.with(|r, _| {
            if let Some(e) = error {
                r.error.get_or_insert(e);
            }
            if dir == Direction::Response && r.duration.is_zero() {
                r.duration = at;
            }
        });
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let at = self.started.elapsed();
        let record = self
            .record
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        self.capture.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.capture.metrics.in_flight.dec();
        if let Some(mut r) = record {
            if r.duration.is_zero() {
                // The response body was dropped before its end: the client went away, or an
                // error response was built here.
                r.duration = at;
                if r.status != 0 && r.response_after.is_some() && r.error.is_none() {
                    r.error = Some("response not read to its end".into());
                }
            }
            self.capture.push(r);
        }
    }
}

pin_project_lite::pin_project! {
    /// A body that passes every frame through unchanged and copies what the capture keeps.
    pub(crate) struct TeeBody<B> {
        #[pin]
        inner: B,
        pending: Option<Arc<Pending>>,
        dir: Direction,
    }
}

impl<B> TeeBody<B> {
    pub(crate) fn new(inner: B, pending: Arc<Pending>, dir: Direction) -> Self {
        TeeBody {
            inner,
            pending: Some(pending),
            dir,
        }
    }
}

impl<B> http_body::Body for TeeBody<B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
        let this = self.project();
        let mut inner = this.inner;
        let res = std::task::ready!(inner.as_mut().poll_frame(cx));
        if let Some(p) = this.pending.as_ref() {
            match &res {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        p.data(*this.dir, data);
                    } else if let Some(t) = frame.trailers_ref() {
                        p.trailers(*this.dir, t);
                    }
                    // A body that knows it is complete (its content-length reached) may be
                    // dropped without being polled to its end: hyper stops there.
                    if inner.is_end_stream() {
                        p.end(*this.dir, None);
                        *this.pending = None;
                    }
                }
                Some(Err(e)) => {
                    let what = match this.dir {
                        Direction::Request => "request body",
                        Direction::Response => "response body",
                    };
                    p.end(*this.dir, Some(format!("{what}: {e}")));
                    *this.pending = None;
                }
                None => {
                    p.end(*this.dir, None);
                    *this.pending = None;
                }
            }
        }
        std::task::Poll::Ready(res)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The protocol label of a request about to be forwarded.
pub(crate) fn protocol_of(req: &http::request::Parts, http2: bool) -> CapturedProtocol {
    let grpc = req
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    match (grpc, http2) {
        (true, _) => CapturedProtocol::Grpc,
        (false, true) => CapturedProtocol::Http2,
        (false, false) => CapturedProtocol::Http1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag() -> CaptureTag {
        CaptureTag {
            sandbox: "sb".into(),
            routing_key: "k".into(),
        }
    }

    fn parts(headers: &[(&str, &str)]) -> http::request::Parts {
        let mut b = http::Request::builder().method("POST").uri("/a?b=1");
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn redaction_covers_the_defaults_and_extra_names() {
        let mut reg = Registry::default();
        let c = Capture::new(CaptureBounds::default(), &mut reg);
        c.set_limits(CaptureLimits::new(&["X-Api-Key", "not a name"], 4));
        let p = c
            .begin(
                tag(),
                None,
                CapturedProtocol::Http1,
                &parts(&[
                    ("authorization", "Bearer s3cret"),
                    ("cookie", "a=s3cret"),
                    ("x-api-key", "s3cret"),
                    ("x-other", "visible"),
                ]),
            )
            .unwrap();
        p.data(Direction::Request, b"0123456789");
        let resp = http::Response::builder()
            .status(201)
            .header("set-cookie", "id=s3cret")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        p.response(&resp);
        p.end(Direction::Response, None);
        drop(p);
        let r = c.take(10).pop().unwrap();
        let all = format!("{r:?}");
        assert!(!all.contains("s3cret"), "{all}");
        assert!(all.contains("visible"));
        assert_eq!(r.status, 201);
        assert_eq!(r.path, "/a?b=1");
        assert_eq!(r.request_body.size, 10);
        assert_eq!(r.request_body.data, b"0123");
        assert!(r.request_body.truncated);
        assert!(r.error.is_none());
    }

    #[tokio::test]
    async fn a_body_complete_by_its_length_ends_the_exchange_without_an_error() {
        use http_body_util::BodyExt as _;
        let mut reg = Registry::default();
        let c = Capture::new(CaptureBounds::default(), &mut reg);
        let p = c
            .begin(tag(), None, CapturedProtocol::Http1, &parts(&[]))
            .unwrap();
        p.response(&http::Response::new(()).into_parts().0);
        let mut body = TeeBody::new(
            http_body_util::Full::new(Bytes::from_static(b"hello")),
            p.clone(),
            Direction::Response,
        );
        drop(p);
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.data_ref().unwrap().as_ref(), b"hello");
        // Dropped after its last byte, never polled to None (as hyper does at content-length).
        drop(body);
        let r = c.take(10).pop().unwrap();
        assert!(r.error.is_none(), "{r:?}");
        assert!(!r.duration.is_zero());
        assert_eq!(r.response_body.data, b"hello");
    }

    #[test]
    fn a_full_ring_drops_the_oldest_and_counts_it() {
        let mut reg = Registry::default();
        let c = Capture::new(
            CaptureBounds {
                ring_exchanges: 3,
                ring_bytes: 1 << 20,
                max_in_flight: 8,
            },
            &mut reg,
        );
        for _ in 0..5 {
            drop(c.begin(tag(), None, CapturedProtocol::Http1, &parts(&[])));
        }
        let seqs: Vec<u64> = c.take(10).iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![2, 3, 4]);
        assert_eq!(c.dropped_total(), 2);
    }

    #[test]
    fn in_flight_is_bounded() {
        let mut reg = Registry::default();
        let c = Capture::new(
            CaptureBounds {
                ring_exchanges: 16,
                ring_bytes: 1 << 20,
                max_in_flight: 2,
            },
            &mut reg,
        );
        let a = c.begin(tag(), None, CapturedProtocol::Http1, &parts(&[]));
        let b = c.begin(tag(), None, CapturedProtocol::Http1, &parts(&[]));
        assert!(a.is_some() && b.is_some());
        assert!(
            c.begin(tag(), None, CapturedProtocol::Http1, &parts(&[]))
                .is_none()
        );
        assert_eq!(c.dropped_total(), 1);
        drop(a);
        assert!(
            c.begin(tag(), None, CapturedProtocol::Http1, &parts(&[]))
                .is_some()
        );
    }
}
