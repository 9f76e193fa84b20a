//! The route history of one baseline, from the route server (`spur.history.v1.RouteHistory`),
//! for relays that decide per record by the record's timestamp (the sidecar's Kafka relay).
//!
//! - [`SharedHistory`] is what the relay reads: the spans (swapped whole, lock-free) and the
//!   watermark, below which every record can be decided for good. Spans are published before
//!   the watermark that covers them, so a reader that sees a watermark sees the spans it covers.
//! - [`HistorySource`] keeps it current: one stream, reconnected with jittered backoff; while it
//!   is down the spans stay and the watermark stops, so relays notice (they hold, then decide
//!   with what they have: see `docs/async.md`).
//! - Every span is validated on arrival; an invalid one is dropped and counted. Both relays of a
//!   record validate alike, so they drop alike.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use spur_proto::history::route_history_client::RouteHistoryClient;
use spur_proto::history::{self, HistoryUpdate};
use spur_routing::{BaselineWorkload, History, Span};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::connect::Connector;
use crate::{Error, RouteServerConn};

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

struct Inner {
    history: ArcSwap<History>,
    /// Milliseconds since the epoch; 0 until the first update.
    watermark: AtomicI64,
    /// Set once the first complete span set is in.
    loaded: std::sync::atomic::AtomicBool,
    advanced: Notify,
}

/// One baseline's route history as a relay reads it. Cheap to clone.
#[derive(Clone)]
pub struct SharedHistory(Arc<Inner>);

impl Default for SharedHistory {
    fn default() -> Self {
        SharedHistory(Arc::new(Inner {
            history: ArcSwap::from_pointee(History::default()),
            watermark: AtomicI64::new(0),
            loaded: std::sync::atomic::AtomicBool::new(false),
            advanced: Notify::new(),
        }))
    }
}

impl SharedHistory {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn load(&self) -> arc_swap::Guard<Arc<History>> {
        self.0.history.load()
    }

    /// Records stamped before this (ms since the epoch) can be decided for good.
    pub fn watermark(&self) -> i64 {
        self.0.watermark.load(Ordering::Acquire)
    }

    /// Whether a complete span set has arrived.
    pub fn is_loaded(&self) -> bool {
        self.0.loaded.load(Ordering::Acquire)
    }

    /// Waits until the watermark is past `at_ms`, for at most `bound`. Returns whether it is.
    pub async fn wait_past(&self, at_ms: i64, bound: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let advanced = self.0.advanced.notified();
            tokio::pin!(advanced);
            advanced.as_mut().enable();
            if self.watermark() > at_ms {
                return true;
            }
            if tokio::time::timeout_at(deadline, advanced).await.is_err() {
                return self.watermark() > at_ms;
            }
        }
    }

    /// Waits until a complete span set has arrived, or `stop`. Returns whether it has.
    pub async fn wait_loaded(&self, stop: &CancellationToken) -> bool {
        loop {
            let advanced = self.0.advanced.notified();
            tokio::pin!(advanced);
            advanced.as_mut().enable();
            if self.is_loaded() {
                return true;
            }
            tokio::select! {
                () = stop.cancelled() => return self.is_loaded(),
                () = advanced => {}
            }
        }
    }

    /// Publishes `spans` (if given) and then `watermark` (never moved back).
    pub fn publish(&self, spans: Option<Vec<Span>>, watermark: i64) {
        if let Some(spans) = spans {
            self.0.history.store(Arc::new(History::new(spans)));
            self.0.loaded.store(true, Ordering::Release);
        }
        self.0.watermark.fetch_max(watermark, Ordering::AcqRel);
        self.0.advanced.notify_waiters();
    }
}

/// Watches the route server for one baseline's history and publishes it.
pub struct HistorySource {
    connector: Connector,
    baseline: BaselineWorkload,
    shared: SharedHistory,
    connected: Gauge,
    spans: Gauge,
    rejected: Counter,
}

impl HistorySource {
    /// Registers `routeserver_history_connected`, `routeserver_history_spans` and
    /// `routeserver_history_spans_rejected_total`.
    pub fn new(
        conn: RouteServerConn,
        baseline: BaselineWorkload,
        shared: SharedHistory,
        registry: &mut Registry,
    ) -> Result<Self, Error> {
        let source = HistorySource {
            connector: Connector::new(conn)?,
            baseline,
            shared,
            connected: Gauge::default(),
            spans: Gauge::default(),
            rejected: Counter::default(),
        };
        registry.register(
            "routeserver_history_connected",
            "1 while a route-history stream to the route server is up",
            source.connected.clone(),
        );
        registry.register(
            "routeserver_history_spans",
            "Route-history spans in force for this baseline",
            source.spans.clone(),
        );
        registry.register(
            "routeserver_history_spans_rejected",
            "Route-history spans from the route server that failed validation",
            source.rejected.clone(),
        );
        Ok(source)
    }

    /// Watches until `stop` is cancelled, reconnecting as needed.
    pub async fn run(self, stop: CancellationToken) {
        let mut backoff = BACKOFF_MIN;
        loop {
            let res = tokio::select! {
                () = stop.cancelled() => return,
                r = self.session(&mut backoff) => r,
            };
            self.connected.set(0);
            match res {
                Ok(()) => {
                    tracing::info!(addr = %self.connector.addr(), "route server closed the route-history stream; reconnecting")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "route-history stream failed; keeping the last history (its watermark stops)")
                }
            }
            let delay = spur_runtime::jitter(backoff);
            backoff = (backoff * 2).min(BACKOFF_MAX);
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    async fn session(&self, backoff: &mut Duration) -> Result<(), Error> {
        let err = |s: tonic::Status| self.connector.err(s);
        let authorization = self.connector.authorization()?;
        let mut client = RouteHistoryClient::new(self.connector.channel().await?);
        let mut request = tonic::Request::new(history::WatchHistoryRequest {
            baseline: Some(history::Baseline {
                kind: self.baseline.kind.clone(),
                namespace: self.baseline.namespace.clone(),
                name: self.baseline.name.clone(),
            }),
        });
        if let Some(value) = authorization {
            request.metadata_mut().insert("authorization", value);
        }
        let mut stream = client.watch(request).await.map_err(err)?.into_inner();
        let mut first = true;
        while let Some(update) = stream.message().await.map_err(err)? {
            if first && update.spans.is_none() {
                return Err(self
                    .connector
                    .err("protocol violation: the first route-history update has no spans"));
            }
            self.apply(update);
            if first {
                first = false;
                self.connected.set(1);
                *backoff = BACKOFF_MIN;
            }
        }
        Ok(())
    }

    fn apply(&self, update: HistoryUpdate) {
        let spans = update.spans.map(|set| {
            let mut out = Vec::with_capacity(set.spans.len());
            for s in &set.spans {
                match spur_routing::wire::span_from_proto(s) {
                    Ok(span) => out.push(span),
                    Err(e) => {
                        self.rejected.inc();
                        tracing::warn!(error = %e, "invalid route-history span ignored");
                    }
                }
            }
            self.spans.set(i64::try_from(out.len()).unwrap_or(i64::MAX));
            out
        });
        self.shared.publish(spans, update.watermark_ms);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn waits_end_when_the_watermark_passes_or_the_bound_does() {
        let h = SharedHistory::new();
        assert!(!h.is_loaded());
        assert!(
            !h.wait_past(1_000, Duration::from_millis(50)).await,
            "nothing known: the bound ends the wait"
        );
        let waiter = {
            let h = h.clone();
            tokio::spawn(async move { h.wait_past(1_000, Duration::from_secs(60)).await })
        };
        tokio::task::yield_now().await;
        h.publish(None, 1_000);
        tokio::task::yield_now().await;
        assert!(
            !waiter.is_finished(),
            "a watermark equal to the time is not past it"
        );
        h.publish(
            Some(vec![
                Span::new("k1".into(), "alice".into(), 500, None).unwrap(),
            ]),
            1_001,
        );
        assert!(waiter.await.unwrap());
        assert!(h.is_loaded());
        assert_eq!(h.load().owner("k1", 600).map(|s| &**s), Some("alice"));
        h.publish(None, 10);
        assert_eq!(h.watermark(), 1_001, "a watermark never goes back");
        assert!(h.wait_loaded(&CancellationToken::new()).await);
    }
}
