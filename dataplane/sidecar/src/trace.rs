//! The record of sampled traces' hops (`spur_routing::trace`): for each request of a recorded
//! trace that reached this sidecar, when, which trace-context carriers it came with, whether it
//! carried a routing key (and in which carriers), and where it was routed. Served on the admin
//! port's `/traces` (loopback clients only: the records hold routing keys), where
//! `spur doctor propagation` reads it to find the service that dropped a key.
//!
//! Bounded: the newest [`CAPACITY`] hops are kept, each of bounded size. A request of a trace
//! that is not recorded costs a length check of each header's name and, for a trace header, a
//! look at four bytes of its value (`TraceCarrier::may_be_recorded`), on the HTTP/1 relay
//! ([`TraceRecorder::is_sampled`]) as on the hyper path ([`TraceRecorder::record`]);
//! perf/results/trace_record.md counts it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use http::HeaderMap;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use serde::Serialize;
use spur_proxy::{ConnMeta, Route, TraceRecord};
use spur_routing::KeyExtractor;
use spur_routing::trace::{TraceCarrier, format_id, is_recorded};

/// Hops kept; the oldest goes first.
pub const CAPACITY: usize = 256;
/// Longest path kept of a recorded request (the rest is cut, marked with `…`).
const MAX_PATH: usize = 200;

/// One request of a recorded trace, as `/traces` lists it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Hop {
    /// Microseconds since the Unix epoch when the sidecar routed it.
    pub at_micros: u64,
    /// 32 lowercase hex digits (a 64-bit id zero-extended).
    pub trace_id: String,
    /// The trace-context headers that carried this trace id.
    pub trace_carriers: Vec<&'static str>,
    /// The routing keys it carried, in the order the router tries them (none: no key).
    pub keys: Vec<String>,
    /// The routing-key carrier headers it had (`baggage`, `tracestate`, ...), whatever they held.
    pub key_carriers: Vec<String>,
    /// `baseline` or `sandbox`.
    pub route: &'static str,
    /// The sandbox it was routed to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    pub path: String,
}

/// The hops, newest last.
#[derive(Default)]
pub struct TraceRing {
    hops: Mutex<VecDeque<Hop>>,
}

impl TraceRing {
    fn push(&self, hop: Hop) {
        // A poisoned lock only means a panic elsewhere mid-push; the ring is still a ring.
        let mut hops = self.hops.lock().unwrap_or_else(PoisonError::into_inner);
        if hops.len() == CAPACITY {
            hops.pop_front();
        }
        hops.push_back(hop);
    }

    /// Every hop kept, oldest first.
    pub fn hops(&self) -> Vec<Hop> {
        let hops = self.hops.lock().unwrap_or_else(PoisonError::into_inner);
        hops.iter().cloned().collect()
    }
}

/// The [`TraceRecord`] plug-in of an inbound sidecar.
pub struct TraceRecorder {
    ring: Arc<TraceRing>,
    extractor: KeyExtractor,
    recorded: Counter,
}

impl TraceRecorder {
    pub fn new(extractor: KeyExtractor, registry: &mut Registry) -> Self {
        let recorded = Counter::default();
        registry.register(
            "traces_recorded",
            "Requests of sampled traces recorded for /traces (spur doctor propagation)",
            recorded.clone(),
        );
        TraceRecorder {
            ring: Arc::new(TraceRing::default()),
            extractor,
            recorded,
        }
    }

    pub fn ring(&self) -> Arc<TraceRing> {
        self.ring.clone()
    }
}

/// The carrier a header name is, by its length first (most names are dismissed by it).
fn carrier_of(name: &[u8]) -> Option<TraceCarrier> {
    match name.len() {
        2 | 11 | 12 | 13 => TraceCarrier::of(name),
        _ => None,
    }
}

/// The id a carrier header holds, when it holds exactly one well-formed value.
fn id_in(headers: &HeaderMap, carrier: TraceCarrier) -> Option<u128> {
    let mut values = headers.get_all(carrier.header_name()).iter();
    let first = values.next()?;
    if values.next().is_some() {
        // Two values of one trace header: which trace the request is in is ambiguous.
        return None;
    }
    carrier.trace_id(first.as_bytes())
}

impl TraceRecord for TraceRecorder {
    fn is_sampled(&self, name: &[u8], value: &[u8]) -> bool {
        carrier_of(name)
            .is_some_and(|c| c.may_be_recorded(value) && c.trace_id(value).is_some_and(is_recorded))
    }

    fn record(&self, _conn: &ConnMeta, route: &Route, headers: &HeaderMap, path: &str) {
        // Most requests: no trace header, or one whose id is not recorded (four bytes tell). One
        // pass over the headers, by name length first, is cheaper than four hashed lookups.
        let sampled = headers.iter().find_map(|(name, value)| {
            let c = carrier_of(name.as_str().as_bytes())?;
            if !c.may_be_recorded(value.as_bytes()) {
                return None;
            }
            // Exactly one well-formed value, recorded.
            id_in(headers, c).filter(|id| is_recorded(*id))
        });
        let Some(id) = sampled else {
            return;
        };
        let ids = TraceCarrier::ALL.map(|c| id_in(headers, c));
        let trace_carriers = TraceCarrier::ALL
            .into_iter()
            .zip(ids)
            .filter(|(_, i)| *i == Some(id))
            .map(|(c, _)| c.header())
            .collect();
        let keys = self
            .extractor
            .extract(headers, None)
            .iter()
            .map(str::to_owned)
            .collect();
        let key_carriers = self
            .extractor
            .headers()
            .filter(|h| headers.contains_key(*h))
            .map(|h| h.as_str().to_owned())
            .collect();
        let (route, sandbox) = match route {
            Route::Original => ("baseline", None),
            Route::Destination(d) => ("sandbox", Some(d.sandbox.to_string())),
        };
        let path = if path.len() > MAX_PATH {
            let mut end = MAX_PATH;
            while !path.is_char_boundary(end) {
                end -= 1;
            }
            format!("{}…", &path[..end])
        } else {
            path.to_owned()
        };
        let at_micros = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        self.ring.push(Hop {
            at_micros,
            trace_id: format_id(id),
            trace_carriers,
            keys,
            key_carriers,
            route,
            sandbox,
            path,
        });
        self.recorded.inc();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;

    use http::HeaderValue;
    use spur_routing::trace::recorded_id;
    use spur_routing::{Destination, ExtractConfig, Location};

    use super::*;
    use crate::router::tests::meta;

    fn recorder() -> TraceRecorder {
        TraceRecorder::new(
            KeyExtractor::new(&ExtractConfig::default()).unwrap(),
            &mut Registry::default(),
        )
    }

    fn traceparent(id: u128) -> HeaderValue {
        HeaderValue::from_str(&format!("00-{}-00f067aa0ba902b7-01", format_id(id))).unwrap()
    }

    #[test]
    fn only_recorded_traces_are_kept_with_their_carriers_and_keys() {
        let r = recorder();
        let id = recorded_id(0x4bf92f3577b34da6a3ce929d0e0e4736);
        let mut h = HeaderMap::new();
        h.insert(
            "traceparent",
            traceparent(0x4bf92f3577b34da6a3ce929d0e0e4736),
        );
        h.insert("baggage", HeaderValue::from_static("sd-routing-key=k1"));
        assert!(!r.is_sampled(b"traceparent", h["traceparent"].as_bytes()));
        r.record(&meta(), &Route::Original, &h, "/a");
        assert!(r.ring.hops().is_empty(), "a trace that is not sampled");

        h.insert("traceparent", traceparent(id));
        h.insert(
            "b3",
            HeaderValue::from_str(&format!("{}-00f067aa0ba902b7-1", format_id(id))).unwrap(),
        );
        assert!(r.is_sampled(b"TraceParent", h["traceparent"].as_bytes()));
        assert!(!r.is_sampled(b"x-request-id", h["traceparent"].as_bytes()));
        let d = Destination {
            sandbox: Arc::from("sb1"),
            routing_key: Arc::from("k1"),
            location: Arc::new(Location {
                host: "fork.ns.svc".into(),
                port: 8080,
            }),
        };
        r.record(&meta(), &Route::Destination(Arc::new(d)), &h, "/a");
        let hops = r.ring.hops();
        assert_eq!(hops.len(), 1);
        let hop = &hops[0];
        assert_eq!(hop.trace_id, format_id(id));
        assert_eq!(hop.trace_carriers, ["traceparent", "b3"]);
        assert_eq!(hop.keys, ["k1"]);
        assert_eq!(hop.key_carriers, ["baggage"]);
        assert_eq!(
            (hop.route, hop.sandbox.as_deref()),
            ("sandbox", Some("sb1"))
        );

        // The key dropped, the trace kept: a hop without keys.
        h.remove("baggage");
        h.remove("b3");
        let long = "/x".repeat(300);
        r.record(&meta(), &Route::Original, &h, &long);
        let hop = r.ring.hops().pop().unwrap();
        assert!(hop.keys.is_empty() && hop.key_carriers.is_empty());
        assert_eq!(hop.trace_carriers, ["traceparent"]);
        assert!(
            hop.path.chars().count() <= MAX_PATH + 1,
            "{}",
            hop.path.len()
        );

        // Two traceparents: ambiguous, not recorded.
        h.append("traceparent", traceparent(recorded_id(7)));
        let before = r.ring.hops().len();
        r.record(&meta(), &Route::Original, &h, "/a");
        assert_eq!(r.ring.hops().len(), before);
    }

    #[test]
    fn the_ring_is_bounded() {
        let r = recorder();
        let mut h = HeaderMap::new();
        for i in 0..(CAPACITY as u128 + 10) {
            h.insert("traceparent", traceparent(recorded_id(i << 16 | 1 << 100)));
            r.record(&meta(), &Route::Original, &h, "/");
        }
        let hops = r.ring.hops();
        assert_eq!(hops.len(), CAPACITY);
        // The oldest went first.
        assert_eq!(
            hops[0].trace_id,
            format_id(recorded_id(10 << 16 | 1 << 100))
        );
    }
}
