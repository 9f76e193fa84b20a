//! Route history: the index stamps every change of a (baseline, routing key)'s destination
//! sandbox with a time, and keeps what it stamped, so relays that decide per record by the
//! record's timestamp (the sidecars' Kafka relays, `docs/async.md`) decide alike wherever and
//! whenever they run.
//!
//! - A route that appears is in force from `since = now + grace`; one that goes (or moves to
//!   another sandbox) stops at `until = now + grace`. The grace puts every change in the future,
//!   so the relays hear of it before any record it applies to is stamped.
//! - A store may give a route's `since` itself (the Kubernetes store: the operator writes it into
//!   the RoutingConfig's status, [`SPAN_GRACE`] ahead, so every replica and every restart agrees).
//!   Such a `since` must reach the server before its clock plus the grace passes it, i.e. within
//!   `SPAN_GRACE - GRACE` (3 s) of being written; one that arrives later is used all the same and
//!   reported (records stamped between it and the watermark already sent may have been decided
//!   without it).
//! - A store may give a route's `until` too (the Kubernetes store: the operator fixes it once,
//!   [`SPAN_GRACE`] ahead, when a Sandbox is being deleted, and keeps its fork running a while
//!   past it). The span then ends there, on every replica and after every restart alike. A
//!   given `until` must be after the span's `since`, else it is refused: the route is dropped,
//!   as if its rule had gone (the store reports such a span as invalid). One that arrives after
//!   the watermark already sent has passed it is used all the same and reported, like a late
//!   `since`. The first `until` given is kept; when the rule then goes, the span keeps it
//!   (no second stamp).
//! - Otherwise the end of a route is the server's own stamp.
//! - The **watermark** is `now + grace`, read under the same lock the stamping takes: any change
//!   not yet stamped will be stamped at `now` or later, so it takes effect at the watermark or
//!   later. Whoever holds the spans and a watermark `W` can decide every record stamped before
//!   `W` for good.
//! - Without a given `since`, the first rule set a server loads gets `since = 0`: the server
//!   cannot know since when those routes were in force, and counts them in force since ever.
//! - Closed spans are kept for [`RETENTION`] (at most [`MAX_CLOSED`] per baseline), then
//!   forgotten: records stamped inside a forgotten span then count as the baseline's.
//!
//! The history is kept in memory: a restarted server starts again from its first load (and from
//! the given starts, which survive it).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use spur_runtime::unix_ms;

use spur_routing::{BaselineWorkload, Span};
use tokio::sync::watch;

use crate::key::RuleKey;

/// How far in the future a change takes effect.
pub(crate) const GRACE: Duration = Duration::from_secs(2);
/// How far ahead the operator writes a span's `since` (`SPAN_GRACE_MS` in spur-operator-workloads).
pub(crate) const SPAN_GRACE: Duration = Duration::from_secs(5);
/// How long a closed span is remembered.
pub(crate) const RETENTION: Duration = Duration::from_secs(24 * 3600);
/// Closed spans remembered per baseline at most (the oldest go first).
pub(crate) const MAX_CLOSED: usize = 1024;

/// The spans of every baseline, as published.
#[derive(Debug, Default)]
pub struct HistorySnapshot {
    /// 0 before the first load.
    pub version: u64,
    /// Every baseline that has or had a route, with its spans sorted.
    pub baselines: HashMap<BaselineWorkload, Arc<Vec<Span>>>,
}

impl HistorySnapshot {
    /// The spans of `baseline` (empty if it never had a route).
    pub fn spans(&self, baseline: &BaselineWorkload) -> Arc<Vec<Span>> {
        self.baselines.get(baseline).cloned().unwrap_or_default()
    }
}

#[derive(Debug, Default)]
struct State {
    /// The span of each routed (baseline, key): its sandbox, `since` and given `until` (the
    /// span is open while that is `None`).
    open: BTreeMap<RuleKey, (String, i64, Option<i64>)>,
    closed: HashMap<BaselineWorkload, VecDeque<Span>>,
    /// The latest time read: stamps never go back, even if the wall clock does.
    last_ms: i64,
    /// The highest watermark handed out.
    watermark_ms: i64,
}

/// A route in force, as the store gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Given {
    pub(crate) sandbox: String,
    /// Its start, when the store gives it (else the server stamps it).
    pub(crate) since: Option<i64>,
    /// Its end, when the store gives it (else the server stamps it once the rule goes).
    pub(crate) until: Option<i64>,
}

impl Given {
    /// A route the server stamps both ends of.
    pub(crate) fn stamped(sandbox: String) -> Self {
        Given {
            sandbox,
            since: None,
            until: None,
        }
    }
}

/// The routes in force: (baseline, key) → its sandbox and what the store gives of its span.
pub(crate) type InForce = BTreeMap<RuleKey, Given>;

/// The stamping side and the subscription point of the history. Cheap to clone.
#[derive(Clone)]
pub struct History {
    state: Arc<Mutex<State>>,
    tx: Arc<watch::Sender<Arc<HistorySnapshot>>>,
    grace_ms: i64,
    retention_ms: i64,
}

impl Default for History {
    fn default() -> Self {
        Self::new(GRACE, RETENTION)
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl History {
    pub fn new(grace: Duration, retention: Duration) -> Self {
        History {
            state: Arc::default(),
            tx: Arc::new(watch::channel(Arc::new(HistorySnapshot::default())).0),
            grace_ms: millis(grace),
            retention_ms: millis(retention),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every update is computed before the state is written, so a panic cannot leave it
        // half-changed.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<HistorySnapshot>> {
        self.tx.subscribe()
    }

    pub fn current(&self) -> Arc<HistorySnapshot> {
        self.tx.borrow().clone()
    }

    /// The published spans and a watermark for them (see the module docs).
    pub fn watermark(&self) -> (Arc<HistorySnapshot>, i64) {
        let mut st = self.lock();
        st.last_ms = st.last_ms.max(unix_ms());
        let snap = self.current();
        let watermark = st.last_ms.saturating_add(self.grace_ms);
        st.watermark_ms = st.watermark_ms.max(watermark);
        (snap, watermark)
    }

    /// Stamps what changed between the routes in force last time and `routes` and publishes
    /// the spans if any changed.
    pub(crate) fn observe(&self, routes: &InForce) {
        self.observe_at(routes, unix_ms());
    }

    fn observe_at(&self, routes: &InForce, now_ms: i64) {
        let mut st = self.lock();
        st.last_ms = st.last_ms.max(now_ms);
        let first = self.current().version == 0;
        let stamp = if first {
            0
        } else {
            st.last_ms.saturating_add(self.grace_ms)
        };
        let mut changed: Vec<BaselineWorkload> = Vec::new();
        let mut closed: Vec<(BaselineWorkload, Span)> = Vec::new();
        let mut next: BTreeMap<RuleKey, (String, i64, Option<i64>)> = BTreeMap::new();
        for (key, given) in routes {
            // The span this route continues: an open one of the same sandbox.
            let kept = (st.open.get(key))
                .filter(|(s, ..)| *s == given.sandbox)
                .map(|(_, since, until)| (*since, *until));
            let since = match (kept, given.since) {
                (Some((since, _)), _) => since,
                (None, Some(since)) => since,
                (None, None) => stamp,
            };
            let until = match (kept.and_then(|(_, u)| u), given.until) {
                // The first given end is kept.
                (Some(until), _) => Some(until),
                (None, Some(until)) if until <= since => {
                    tracing::warn!(
                        baseline = %key.baseline,
                        routing_key = %key.routing_key,
                        since,
                        until,
                        "a route's given end is not after its start: the route is dropped"
                    );
                    // Dropped: closed below like a route whose rule went.
                    continue;
                }
                (None, Some(until)) => {
                    if !first && until < st.watermark_ms {
                        tracing::warn!(
                            baseline = %key.baseline,
                            routing_key = %key.routing_key,
                            until,
                            watermark = st.watermark_ms,
                            "a route's end reached the route server after its watermark had passed it: records stamped in between may have been decided without it (the operator's write took longer than {:?} to arrive)",
                            SPAN_GRACE.saturating_sub(GRACE)
                        );
                    }
                    changed.push(key.baseline.clone());
                    Some(until)
                }
                (None, None) => None,
            };
            if kept.is_none() {
                changed.push(key.baseline.clone());
                if let Some(since) = given.since
                    && !first
                    && since < st.watermark_ms
                {
                    tracing::warn!(
                        baseline = %key.baseline,
                        routing_key = %key.routing_key,
                        since,
                        watermark = st.watermark_ms,
                        "a route's start reached the route server after its watermark had passed it: records stamped in between may have been decided without it (the operator's write took longer than {:?} to arrive)",
                        SPAN_GRACE.saturating_sub(GRACE)
                    );
                }
            }
            next.insert(key.clone(), (given.sandbox.clone(), since, until));
        }
        // Spans not continued (their rule went, moved to another sandbox or was dropped) close
        // at their given end, else at the stamp.
        for (key, (s, since, until)) in &st.open {
            if next.get(key).is_none_or(|(n, ..)| n != s) {
                let until = until.unwrap_or(stamp);
                closed.push((key.baseline.clone(), span(key, s, *since, until)));
                changed.push(key.baseline.clone());
            }
        }
        let horizon = st.last_ms.saturating_sub(self.retention_ms);
        for (baseline, spans) in st.closed.iter_mut() {
            let before = spans.len();
            spans.retain(|s| s.until_ms.is_none_or(|u| u >= horizon));
            if spans.len() != before {
                changed.push(baseline.clone());
            }
        }
        for (baseline, s) in closed {
            let list = st.closed.entry(baseline).or_default();
            // An empty span (a route that came and went within one stamp) decides nothing.
            if s.until_ms != Some(s.since_ms) {
                list.push_back(s);
            }
            while list.len() > MAX_CLOSED {
                list.pop_front();
            }
        }
        st.closed.retain(|_, l| !l.is_empty());
        st.open = next;
        if changed.is_empty() && !first {
            return;
        }
        changed.sort();
        changed.dedup();
        let current = self.current();
        let mut baselines = current.baselines.clone();
        for b in changed {
            let mut spans: Vec<Span> = st.closed.get(&b).into_iter().flatten().cloned().collect();
            let start = RuleKey {
                baseline: b.clone(),
                routing_key: String::new(),
            };
            spans.extend(
                (st.open.range(start..))
                    .take_while(|(k, _)| k.baseline == b)
                    .map(|(k, (s, since, until))| Span {
                        routing_key: k.routing_key.clone(),
                        sandbox: s.clone(),
                        since_ms: *since,
                        until_ms: *until,
                    }),
            );
            spans.sort();
            if spans.is_empty() {
                baselines.remove(&b);
            } else {
                baselines.insert(b, Arc::new(spans));
            }
        }
        // Published under the lock: a watermark read after this sees these spans.
        self.tx.send_replace(Arc::new(HistorySnapshot {
            version: current.version + 1,
            baselines,
        }));
    }
}

/// A closed span of `key`.
fn span(key: &RuleKey, sandbox: &str, since_ms: i64, until_ms: i64) -> Span {
    Span {
        routing_key: key.routing_key.clone(),
        sandbox: sandbox.to_owned(),
        since_ms,
        until_ms: Some(until_ms.max(since_ms)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn baseline(name: &str) -> BaselineWorkload {
        BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    /// Routes in force from the rules of a rule directory: (baseline, key, sandbox), no start.
    fn rules(list: &[(&str, &str, &str)]) -> InForce {
        list.iter()
            .map(|(name, key, sandbox)| {
                let k = RuleKey {
                    baseline: baseline(name),
                    routing_key: (*key).into(),
                };
                (k, Given::stamped((*sandbox).into()))
            })
            .collect()
    }

    fn spans(h: &History, name: &str) -> Vec<(String, String, i64, Option<i64>)> {
        h.current()
            .spans(&baseline(name))
            .iter()
            .map(|s| {
                (
                    s.routing_key.clone(),
                    s.sandbox.clone(),
                    s.since_ms,
                    s.until_ms,
                )
            })
            .collect()
    }

    fn sp(k: &str, s: &str, since: i64, until: Option<i64>) -> (String, String, i64, Option<i64>) {
        (k.into(), s.into(), since, until)
    }

    #[test]
    fn changes_are_stamped_a_grace_ahead_and_closed_spans_kept() {
        let h = History::new(Duration::from_millis(2_000), Duration::from_millis(60_000));
        h.observe_at(&rules(&[("orders", "k1", "alice")]), 10_000);
        assert_eq!(
            spans(&h, "orders"),
            [sp("k1", "alice", 0, None)],
            "the first load: in force since ever"
        );
        h.observe_at(
            &rules(&[("orders", "k1", "alice"), ("orders", "k2", "bob")]),
            11_000,
        );
        assert_eq!(
            spans(&h, "orders"),
            [sp("k1", "alice", 0, None), sp("k2", "bob", 13_000, None)]
        );
        let v = h.current().version;
        h.observe_at(
            &rules(&[("orders", "k1", "alice"), ("orders", "k2", "bob")]),
            11_500,
        );
        assert_eq!(h.current().version, v, "nothing changed, nothing published");
        // k1 moves to carol, k2 goes; another baseline gains a route.
        h.observe_at(
            &rules(&[("orders", "k1", "carol"), ("payments", "k2", "bob")]),
            12_000,
        );
        assert_eq!(
            spans(&h, "orders"),
            [
                sp("k1", "alice", 0, Some(14_000)),
                sp("k1", "carol", 14_000, None),
                sp("k2", "bob", 13_000, Some(14_000)),
            ]
        );
        assert_eq!(spans(&h, "payments"), [sp("k2", "bob", 14_000, None)]);
        // A wall clock that steps back does not stamp into the past.
        h.observe_at(&rules(&[("payments", "k2", "bob")]), 5_000);
        // carol's span, opened at 14 000, closes at 14 000: empty, so not kept.
        assert_eq!(
            spans(&h, "orders"),
            [
                sp("k1", "alice", 0, Some(14_000)),
                sp("k2", "bob", 13_000, Some(14_000)),
            ]
        );
        // Past the retention, closed spans are forgotten.
        h.observe_at(&rules(&[]), 100_000);
        assert!(spans(&h, "orders").is_empty());
        assert_eq!(
            spans(&h, "payments"),
            [sp("k2", "bob", 14_000, Some(102_000))]
        );
    }

    #[test]
    fn the_watermark_is_past_every_stamp_to_come() {
        let h = History::new(Duration::from_millis(2_000), RETENTION);
        h.observe_at(&rules(&[]), 1_000);
        let (_, w) = h.watermark();
        let before = unix_ms();
        assert!(
            w >= before + 2_000 - 5_000 && w <= before + 2_000,
            "{w} {before}"
        );
        // Any change observed from now on takes effect at or after that watermark.
        h.observe(&rules(&[("orders", "k1", "alice")]));
        let since = h.current().spans(&baseline("orders"))[0].since_ms;
        assert!(since >= w, "{since} < {w}");
    }

    #[test]
    fn a_store_may_give_a_routes_start() {
        let h = History::new(Duration::from_millis(2_000), RETENTION);
        let key = |name: &str, k: &str| RuleKey {
            baseline: baseline(name),
            routing_key: k.into(),
        };
        let given = |list: &[(&str, &str, &str, i64)]| -> InForce {
            list.iter()
                .map(|(n, k, s, since)| {
                    let g = Given {
                        sandbox: (*s).into(),
                        since: Some(*since),
                        until: None,
                    };
                    (key(n, k), g)
                })
                .collect()
        };
        h.observe_at(&given(&[("orders", "k1", "alice", 7_000)]), 1_000);
        assert_eq!(
            spans(&h, "orders"),
            [sp("k1", "alice", 7_000, None)],
            "even on the first load: the store knows"
        );
        h.observe_at(
            &given(&[
                ("orders", "k1", "alice", 9_999),
                ("orders", "k2", "bob", 8_000),
            ]),
            2_000,
        );
        assert_eq!(
            spans(&h, "orders"),
            [sp("k1", "alice", 7_000, None), sp("k2", "bob", 8_000, None)],
            "an open span keeps its start"
        );
        // The end is the server's own stamp; a route that goes before it started never was.
        h.observe_at(&given(&[("orders", "k2", "bob", 8_000)]), 3_000);
        assert_eq!(spans(&h, "orders"), [sp("k2", "bob", 8_000, None)]);
        h.observe_at(&given(&[]), 7_000);
        assert_eq!(spans(&h, "orders"), [sp("k2", "bob", 8_000, Some(9_000))]);
    }

    /// Routes with a given start and maybe a given end: (baseline, key, sandbox, since, until).
    fn given(list: &[(&str, &str, &str, i64, Option<i64>)]) -> InForce {
        list.iter()
            .map(|(name, k, s, since, until)| {
                let key = RuleKey {
                    baseline: baseline(name),
                    routing_key: (*k).into(),
                };
                let g = Given {
                    sandbox: (*s).into(),
                    since: Some(*since),
                    until: *until,
                };
                (key, g)
            })
            .collect()
    }

    #[test]
    fn a_given_end_closes_the_span_there_and_outlives_the_rule() {
        let h = History::new(Duration::from_millis(2_000), RETENTION);
        h.observe_at(&given(&[("orders", "k1", "alice", 7_000, None)]), 1_000);
        let _ = h.watermark();
        h.observe_at(
            &given(&[("orders", "k1", "alice", 7_000, Some(20_000))]),
            15_000,
        );
        assert_eq!(
            spans(&h, "orders"),
            [sp("k1", "alice", 7_000, Some(20_000))],
            "ended at the given time, not at a stamp"
        );
        // Later passes keep the first end given.
        let v = h.current().version;
        h.observe_at(
            &given(&[("orders", "k1", "alice", 7_000, Some(25_000))]),
            16_000,
        );
        assert_eq!(h.current().version, v, "nothing changed, nothing published");
        // The rule goes: the span keeps its end, no second stamp (which would be 19 000).
        h.observe_at(&given(&[]), 17_000);
        assert_eq!(
            spans(&h, "orders"),
            [sp("k1", "alice", 7_000, Some(20_000))]
        );
        // A restarted server, given both ends, agrees.
        let fresh = History::new(Duration::from_millis(2_000), RETENTION);
        fresh.observe_at(
            &given(&[("orders", "k1", "alice", 7_000, Some(20_000))]),
            16_000,
        );
        assert_eq!(
            spans(&fresh, "orders"),
            [sp("k1", "alice", 7_000, Some(20_000))]
        );
    }

    #[test]
    fn a_given_end_not_after_the_start_is_refused() {
        let h = History::new(Duration::from_millis(2_000), RETENTION);
        h.observe_at(&given(&[("orders", "k1", "alice", 7_000, None)]), 1_000);
        // The store's start moved to 9 000, but the span keeps 7 000: an end of 7 000 is
        // refused, the route dropped like a rule that went (closed at the stamp, 5 000, before
        // it started: nothing remains).
        h.observe_at(
            &given(&[("orders", "k1", "alice", 9_000, Some(7_000))]),
            3_000,
        );
        assert!(spans(&h, "orders").is_empty(), "{:?}", spans(&h, "orders"));
        // A new route whose end is its start is never opened.
        h.observe_at(
            &given(&[("payments", "k2", "bob", 8_000, Some(8_000))]),
            4_000,
        );
        assert!(spans(&h, "payments").is_empty());
        // An open span refused an end closes at the server's stamp.
        h.observe_at(&given(&[("payments", "k2", "bob", 8_000, None)]), 5_000);
        assert_eq!(spans(&h, "payments"), [sp("k2", "bob", 8_000, None)]);
        h.observe_at(
            &given(&[("payments", "k2", "bob", 8_000, Some(8_000))]),
            9_000,
        );
        assert_eq!(
            spans(&h, "payments"),
            [sp("k2", "bob", 8_000, Some(11_000))]
        );
    }

    #[test]
    fn a_late_end_is_used_all_the_same() {
        let h = History::new(Duration::from_millis(2_000), RETENTION);
        h.observe_at(&given(&[("orders", "k1", "alice", 7_000, None)]), 1_000);
        h.observe_at(&given(&[("orders", "k1", "alice", 7_000, None)]), 2_000);
        let (_, w) = h.watermark();
        // An end before the watermark already sent (the wall clock is far past 9 000): relays
        // may have decided records after it for alice; the end is used anyway (and warned of).
        assert!(w > 9_000);
        h.observe_at(
            &given(&[("orders", "k1", "alice", 7_000, Some(9_000))]),
            3_000,
        );
        assert_eq!(spans(&h, "orders"), [sp("k1", "alice", 7_000, Some(9_000))]);
    }

    #[test]
    fn closed_spans_per_baseline_are_bounded() {
        let h = History::new(Duration::from_millis(1), RETENTION);
        h.observe_at(&rules(&[]), 1);
        for i in 0..(MAX_CLOSED as i64 + 10) {
            h.observe_at(&rules(&[("orders", "k1", "alice")]), 10 + 4 * i);
            h.observe_at(&rules(&[]), 12 + 4 * i);
        }
        assert_eq!(h.current().spans(&baseline("orders")).len(), MAX_CLOSED);
    }
}
