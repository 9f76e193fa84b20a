//! Route history: when each route of one baseline workload was in force, so that relays that
//! decide at different moments (a baseline's sidecar and a fork's) decide the same for a record
//! stamped at a given time (issue 44, `docs/async.md`).
//!
//! A [`Span`] says: records for the baseline whose routing key is `routing_key` and whose
//! timestamp `t` satisfies `since_ms <= t < until_ms` belong to `sandbox`. Times are milliseconds
//! since the Unix epoch, as Kafka stamps records. Spans of one key never overlap: the route
//! server closes a key's span before it opens the next.

use std::collections::HashMap;
use std::sync::Arc;

use crate::Error;
use crate::extract::{MAX_KEY_LEN, is_valid_key};
use crate::rules::check_dns_label;

/// One route's time in force, validated ([`Span::new`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Span {
    pub routing_key: String,
    pub sandbox: String,
    /// First millisecond the route is in force.
    pub since_ms: i64,
    /// First millisecond it is no longer in force; `None` while it still is.
    pub until_ms: Option<i64>,
}

impl Span {
    /// A span from the wire: a valid routing key and sandbox name, `0 <= since <= until`.
    pub fn new(
        routing_key: String,
        sandbox: String,
        since_ms: i64,
        until_ms: Option<i64>,
    ) -> Result<Span, Error> {
        let invalid = |reason: String| Error::InvalidSpan {
            routing_key: routing_key.chars().take(MAX_KEY_LEN).collect(),
            reason,
        };
        if !is_valid_key(&routing_key) {
            return Err(invalid(format!(
                "routingKey must be 1-{MAX_KEY_LEN} characters of [A-Za-z0-9._-]"
            )));
        }
        check_dns_label(&sandbox, 63).map_err(|e| invalid(format!("sandbox: {e}")))?;
        if since_ms < 0 {
            return Err(invalid(format!("since {since_ms} is before the epoch")));
        }
        if let Some(until) = until_ms
            && until < since_ms
        {
            return Err(invalid(format!("until {until} is before since {since_ms}")));
        }
        Ok(Span {
            routing_key,
            sandbox,
            since_ms,
            until_ms,
        })
    }

    /// Whether the span covers `at_ms`.
    pub fn covers(&self, at_ms: i64) -> bool {
        self.since_ms <= at_ms && self.until_ms.is_none_or(|u| at_ms < u)
    }
}

/// One key's spans, as `(since, until, sandbox)` with `until = i64::MAX` while open; a handful
/// per key, so a scanned slice.
type KeySpans = Box<[(i64, i64, Arc<str>)]>;
/// [`KeySpans`] under construction.
type Grouped = HashMap<Box<str>, Vec<(i64, i64, Arc<str>)>>;

/// The spans of one baseline workload, indexed by routing key. Immutable; lookups do not
/// allocate.
#[derive(Debug, Default)]
pub struct History {
    by_key: HashMap<Box<str>, KeySpans>,
    spans: Vec<Span>,
}

impl History {
    pub fn new(mut spans: Vec<Span>) -> Self {
        spans.sort();
        spans.dedup();
        let mut grouped = Grouped::new();
        for s in &spans {
            grouped
                .entry(Box::from(s.routing_key.as_str()))
                .or_default()
                .push((
                    s.since_ms,
                    s.until_ms.unwrap_or(i64::MAX),
                    Arc::from(s.sandbox.as_str()),
                ));
        }
        let by_key = grouped
            .into_iter()
            .map(|(k, v)| (k, v.into_boxed_slice()))
            .collect();
        History { by_key, spans }
    }

    /// The sandbox `key` routes to at `at_ms`, if a span covers it. Were spans of a key ever to
    /// overlap (a route server bug), the one that started first wins, on every relay alike.
    pub fn owner(&self, key: &str, at_ms: i64) -> Option<&Arc<str>> {
        self.by_key
            .get(key)?
            .iter()
            .find(|(since, until, _)| *since <= at_ms && at_ms < *until)
            .map(|(_, _, s)| s)
    }

    /// The first candidate key (in precedence order) that routes somewhere at `at_ms` decides,
    /// as the first candidate with a rule does for a request.
    pub fn route<'k>(
        &self,
        candidates: impl IntoIterator<Item = &'k str>,
        at_ms: i64,
    ) -> Option<&Arc<str>> {
        candidates.into_iter().find_map(|k| self.owner(k, at_ms))
    }

    /// The spans, sorted.
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn span(key: &str, sandbox: &str, since: i64, until: Option<i64>) -> Span {
        Span::new(key.into(), sandbox.into(), since, until).unwrap()
    }

    #[test]
    fn a_span_covers_since_up_to_but_not_including_until() {
        let h = History::new(vec![
            span("k1", "alice", 1_000, Some(2_000)),
            span("k1", "bob", 2_000, None),
            span("k2", "carol", 1_500, None),
        ]);
        assert_eq!(h.owner("k1", 999), None);
        assert_eq!(h.owner("k1", 1_000).map(|s| &**s), Some("alice"));
        assert_eq!(h.owner("k1", 1_999).map(|s| &**s), Some("alice"));
        assert_eq!(h.owner("k1", 2_000).map(|s| &**s), Some("bob"));
        assert_eq!(h.owner("k1", i64::MAX - 1).map(|s| &**s), Some("bob"));
        assert_eq!(h.owner("k3", 2_000), None);
        // Precedence: the first candidate with a span in force at that time.
        assert_eq!(h.route(["k2", "k1"], 1_200).map(|s| &**s), Some("alice"));
        assert_eq!(h.route(["k2", "k1"], 1_600).map(|s| &**s), Some("carol"));
        assert_eq!(h.spans().len(), 3);
    }

    #[test]
    fn invalid_spans_are_refused_with_the_reason() {
        for (key, sandbox, since, until, why) in [
            ("", "a", 0, None, "routingKey"),
            ("k 1", "a", 0, None, "routingKey"),
            ("k", "A_b", 0, None, "sandbox"),
            ("k", "a", -1, None, "before the epoch"),
            ("k", "a", 10, Some(9), "before since"),
        ] {
            let e = Span::new(key.into(), sandbox.into(), since, until)
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{e}");
        }
        assert!(
            span("k", "a", 5, Some(5)).until_ms == Some(5),
            "empty is fine"
        );
        assert!(!span("k", "a", 5, Some(5)).covers(5));
    }
}
