//! The store-wide limits are shared fairly between namespaces (issue 42, point 5: "give each
//! namespace a quota so one cannot evict another's data"): when the whole store is over its
//! limits, the namespaces holding the most are lowered to one common level, oldest first, and
//! a namespace holding no more than that level loses nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use prometheus_client::registry::Registry;
use prost::Message;
use spur_proto::traffic::{Body, Exchange, Filter, Workload};
use spur_traffic::{Limits, MAX_QUERY_LIMIT, Metrics, Store};

/// An exchange of `namespace`'s baseline whose pusher's id is `id` (the store gives it its own
/// id, so `authority` carries `id` too) and whose response body is `body` bytes.
fn exchange(id: &str, namespace: &str, body: usize) -> Exchange {
    Exchange {
        id: id.into(),
        authority: id.into(),
        baseline: Some(Workload {
            kind: "Deployment".into(),
            namespace: namespace.into(),
            name: "backend".into(),
        }),
        pod: "backend-1".into(),
        sandbox: "sb1".into(),
        routing_key: "k1".into(),
        destination: "fork:8080".into(),
        method: "GET".into(),
        path: "/items".into(),
        status: 200,
        start_unix_micros: 1_000,
        response_body: (body > 0).then(|| Body {
            size: body as u64,
            data: vec![b'x'; body],
            truncated: false,
        }),
        ..Exchange::default()
    }
}

/// `prefix00`, `prefix01`, ... of `namespace`, numbered from `from`.
fn batch(prefix: &str, namespace: &str, from: usize, n: usize, body: usize) -> Vec<Exchange> {
    (from..from + n)
        .map(|i| exchange(&format!("{prefix}{i:03}"), namespace, body))
        .collect()
}

/// What the store counts for an exchange of `namespace` with a `body`-byte response: the
/// encoded exchange without the pusher's id.
fn stored_size(namespace: &str, body: usize) -> u64 {
    let mut e = exchange("x000", namespace, body);
    e.id.clear();
    e.encode_to_vec().len() as u64
}

struct Harness {
    store: Store,
    registry: Registry,
}

impl Harness {
    fn open(limits: Limits) -> Harness {
        let store = Store::open(None, limits).unwrap();
        let mut registry = Registry::default();
        Metrics::register(&mut registry, &store);
        Harness { store, registry }
    }

    async fn push(&self, pod: &str, exchanges: Vec<Exchange>) {
        self.store.insert(pod, exchanges).await.unwrap();
    }

    /// The pushers' ids `namespace` still holds, sorted.
    async fn kept(&self, namespace: &str) -> Vec<String> {
        let filter = Filter {
            namespace: namespace.into(),
            ..Filter::default()
        };
        let mut ids: Vec<String> = self
            .store
            .query(filter, MAX_QUERY_LIMIT)
            .await
            .unwrap()
            .into_iter()
            .filter_map(|s| s.exchange.map(|e| e.authority))
            .collect();
        ids.sort();
        ids
    }

    /// `spur_traffic_evicted_total` for `namespace` and `reason` (0 when never counted).
    fn evicted(&self, namespace: &str, reason: &str) -> u64 {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).unwrap();
        let prefix =
            format!("spur_traffic_evicted_total{{namespace=\"{namespace}\",reason=\"{reason}\"}} ");
        out.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map_or(0, |n| n.parse().unwrap())
    }
}

fn names(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}{i:03}")).collect()
}

/// Namespace A pushes far more than its share of the store (and over its own quota, which
/// the store's limit undercuts); B, within its share, keeps every exchange through all of it,
/// and when B later grows to exactly its share, A, not B, makes room.
#[tokio::test]
async fn a_namespace_within_its_share_keeps_every_exchange_while_another_floods() {
    let h = Harness::open(Limits {
        max_exchanges: 100,
        // Two quotas add up to more than the store holds: the store's limit must be shared.
        namespace_max_exchanges: 80,
        ..Limits::default()
    });
    h.push("b-pod", batch("b", "team-b", 0, 40, 100)).await;
    for round in 0..10 {
        // Large batches of large exchanges: each one alone overfills A's share.
        h.push("a-pod", batch("a", "team-a", round * 70, 70, 300))
            .await;
        assert_eq!(h.kept("team-b").await, names("b", 0..40), "round {round}");
        // A is lowered to what the store has left beside B, its newest kept.
        assert_eq!(
            h.kept("team-a").await,
            names("a", round * 70 + 10..round * 70 + 70),
            "round {round}"
        );
    }
    assert_eq!(h.store.stored_exchanges(), 100);
    // B grows to exactly its share (100 / 2): A makes room.
    h.push("b-pod", batch("b", "team-b", 40, 10, 100)).await;
    assert_eq!(h.kept("team-b").await, names("b", 0..50));
    assert_eq!(h.kept("team-a").await, names("a", 650..700));
    assert_eq!(h.evicted("team-b", "store_limit"), 0);
    assert_eq!(h.evicted("team-b", "namespace_quota"), 0);
    // All A pushed but its newest 50, counted under its quota or the store's limit.
    assert_eq!(
        h.evicted("team-a", "store_limit") + h.evicted("team-a", "namespace_quota"),
        650
    );
    assert!(h.evicted("team-a", "store_limit") > 0);
}

/// Three namespaces: A (50) and C (45) over their share of 70, B (10) under it. The 35 over
/// the limit come from A and C, lowering both to a common 30 (B keeps its 10): not all from
/// A, the largest, which would leave it holding 15, less than its share, while C, whose push
/// overfilled the store, kept 45.
#[tokio::test]
async fn the_store_limit_is_taken_from_the_largest_namespaces_down_to_a_common_level() {
    let h = Harness::open(Limits {
        max_exchanges: 70,
        namespace_max_exchanges: 60,
        ..Limits::default()
    });
    h.push("a-pod", batch("a", "team-a", 0, 50, 0)).await;
    h.push("b-pod", batch("b", "team-b", 0, 10, 0)).await;
    assert_eq!(h.store.stored_exchanges(), 60);
    h.push("c-pod", batch("c", "team-c", 0, 45, 0)).await;
    assert_eq!(h.kept("team-a").await, names("a", 20..50));
    assert_eq!(h.kept("team-b").await, names("b", 0..10));
    assert_eq!(h.kept("team-c").await, names("c", 15..45));
    assert_eq!(h.store.stored_exchanges(), 70);
    assert_eq!(h.evicted("team-a", "store_limit"), 20);
    assert_eq!(h.evicted("team-c", "store_limit"), 15);
    assert_eq!(h.evicted("team-b", "store_limit"), 0);

    // B grows by one: the level is (70 - 11) / 2, rounded down, so A and C lose one each.
    h.push("b-pod", batch("b", "team-b", 10, 1, 0)).await;
    assert_eq!(h.kept("team-b").await, names("b", 0..11));
    assert_eq!(h.kept("team-a").await, names("a", 21..50));
    assert_eq!(h.kept("team-c").await, names("c", 16..45));
}

/// A floods the store with many small exchanges (far over the exchange limit, a little over
/// the byte limit); B holds a few large ones, well within its share of exchanges. Lowering A
/// to its share of exchanges brings the bytes under too, so B loses nothing. Before, the
/// whole excess of exchanges was taken from the namespace holding the most bytes: B was
/// emptied by A's flood.
#[tokio::test]
async fn a_flood_of_small_exchanges_does_not_empty_a_namespace_of_large_ones() {
    let small = stored_size("team-a", 0);
    let large = stored_size("team-b", 2000);
    let h = Harness::open(Limits {
        max_exchanges: 100,
        max_bytes: 45 * large + 55 * small,
        ..Limits::default()
    });
    h.push("b-pod", batch("b", "team-b", 0, 45, 2000)).await;
    h.push("a-pod", batch("a", "team-a", 0, 150, 0)).await;
    assert_eq!(h.kept("team-b").await, names("b", 0..45));
    assert_eq!(h.kept("team-a").await, names("a", 95..150));
    assert_eq!(h.store.stored_bytes(), 45 * large + 55 * small);
    assert_eq!(h.evicted("team-b", "store_limit"), 0);
    assert_eq!(h.evicted("team-a", "store_limit"), 95);
}

/// The byte limit alone: the namespaces over the common level lose their oldest exchanges
/// until they are at or under it, and no more than that.
#[tokio::test]
async fn the_byte_limit_is_shared_the_same_way() {
    let size = stored_size("team-a", 1000);
    let h = Harness::open(Limits {
        max_bytes: 30 * size,
        ..Limits::default()
    });
    h.push("b-pod", batch("b", "team-b", 0, 6, 1000)).await;
    h.push("a-pod", batch("a", "team-a", 0, 20, 1000)).await;
    h.push("c-pod", batch("c", "team-c", 0, 20, 1000)).await;
    // 46 over 30: B keeps its 6, A and C share the other 24.
    assert_eq!(h.kept("team-b").await, names("b", 0..6));
    assert_eq!(h.kept("team-a").await, names("a", 8..20));
    assert_eq!(h.kept("team-c").await, names("c", 8..20));
    assert_eq!(h.store.stored_bytes(), 30 * size);
}
