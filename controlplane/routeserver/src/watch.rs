//! A watch stream: initial ADDs, exactly one SYNCED, then ADD / REPLACE / REMOVE for the rules
//! that changed — computed from the index's change log, so a watcher costs only what changes.
//!
//! The stream is computed as it is read, in the task that writes it (hyper's, for one HTTP/2
//! stream): a change wakes that task, which diffs, encodes and sends, with no task or queue of
//! its own per watcher. A watcher that stops reading is not polled, so it computes nothing, and
//! when it reads again it diffs its last-sent state against the *latest* index: intermediate
//! versions coalesce away.
//!
//! The contract the public Go client relies on: nothing but ADDs before SYNCED; every op after
//! it carries a complete rule; a REMOVE or REPLACE only for a rule this stream was sent.

use std::borrow::Borrow;
use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::auth::{Authenticator, Denied, Grant, Scope};
use crate::index::{Entry, Filter, RuleKey, Snapshot};
use crate::metrics::Metrics;

/// How soon a watch is checked again when the API server could not answer the last check.
const RECHECK_RETRY: Duration = Duration::from_secs(30);

/// A drained queue keeps at most this much room (ops), so that one large sync does not stay
/// allocated for the life of the stream.
const KEEP_QUEUED: usize = 16;

#[derive(Debug, Clone)]
pub(crate) enum Op {
    Add(Arc<Entry>),
    Replace(Arc<Entry>),
    /// Carries the rule as this stream last saw it.
    Remove(Arc<Entry>),
    Synced,
}

/// A rule as this stream was sent it, found by its key without a copy of the key: a watcher of
/// one baseline keeps a pointer per rule, not four strings (`perf/results/push_steps.md`).
struct Sent(Arc<Entry>);

impl Borrow<RuleKey> for Sent {
    fn borrow(&self) -> &RuleKey {
        self.0.key()
    }
}

// As its key, so that lookups by `&RuleKey` find it.
impl Hash for Sent {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.key().hash(state);
    }
}

impl PartialEq for Sent {
    fn eq(&self, other: &Self) -> bool {
        self.0.key() == other.0.key()
    }
}

impl Eq for Sent {}

/// What a stream still has to compute of the snapshot it is on.
enum Work {
    /// The initial ADDs after `after` (all of them when None), then SYNCED.
    Sync {
        snap: Arc<Snapshot>,
        after: Option<RuleKey>,
    },
    /// The changed keys from `next` on left to diff against `snap`.
    Diff {
        snap: Arc<Snapshot>,
        keys: Arc<[RuleKey]>,
        next: usize,
    },
}

/// One watch's ops. At most `buffer` ops are computed ahead of the reader: a large initial set
/// or a large change is computed in parts as it is read. The stream ends when `stop` fires or
/// the index goes away.
pub(crate) struct Watch {
    snapshots: WatchStream<Arc<Snapshot>>,
    stop: Pin<Box<WaitForCancellationFutureOwned>>,
    filter: Filter,
    buffer: usize,
    metrics: Metrics,
    queued: VecDeque<Op>,
    work: Option<Work>,
    /// What this stream was sent, by key: a REPLACE or REMOVE is only for these.
    sent: HashSet<Sent>,
    /// The index version this stream has sent in full; 0 until SYNCED.
    version: u64,
    ended: bool,
}

impl Watch {
    pub(crate) fn new(
        snapshots: watch::Receiver<Arc<Snapshot>>,
        filter: Filter,
        buffer: usize,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> Self {
        metrics.watchers.inc();
        Watch {
            snapshots: WatchStream::new(snapshots),
            stop: Box::pin(stop.cancelled_owned()),
            filter,
            buffer: buffer.max(1),
            metrics,
            queued: VecDeque::new(),
            work: None,
            sent: HashSet::new(),
            version: 0,
            ended: false,
        }
    }

    /// Starts on a newer snapshot: the initial set once the store has loaded (so SYNCED means
    /// "everything there is"), afterwards the keys changed since what was sent.
    fn start(&mut self, snap: Arc<Snapshot>) {
        if self.version == 0 {
            if snap.version > 0 {
                self.work = Some(Work::Sync { snap, after: None });
            }
            return;
        }
        let keys = snap.changed_since(self.version).unwrap_or_else(|| {
            let mut all: Vec<RuleKey> = self.sent.iter().map(|s| s.0.key().clone()).collect();
            all.extend(snap.matching(&self.filter).map(|e| e.key().clone()));
            all.sort();
            all.dedup();
            all.into()
        });
        self.work = Some(Work::Diff {
            snap,
            keys,
            next: 0,
        });
    }

    /// Computes up to `buffer` more ops of the current work.
    fn step(&mut self, work: Work) {
        match work {
            Work::Sync { snap, after } => {
                let mut last = None;
                for e in snap
                    .matching_after(&self.filter, after.as_ref())
                    .take(self.buffer)
                {
                    self.queued.push_back(Op::Add(e.clone()));
                    self.sent.insert(Sent(e.clone()));
                    last = Some(e.key());
                }
                if last.is_some() && self.queued.len() >= self.buffer {
                    let after = last.cloned();
                    self.work = Some(Work::Sync { snap, after });
                    return;
                }
                self.queued.push_back(Op::Synced);
                self.version = snap.version;
                tracing::debug!(
                    namespace = %self.filter.namespace,
                    name = %self.filter.name,
                    rules = self.sent.len(),
                    version = snap.version,
                    "watch synced"
                );
            }
            Work::Diff {
                snap,
                keys,
                mut next,
            } => {
                while let Some(key) = keys.get(next) {
                    next += 1;
                    let now = snap.rules.get(key).filter(|e| self.filter.matches(e));
                    let sent = self.sent.get(key).map(|s| &s.0);
                    let op = match (sent, now) {
                        (None, Some(e)) => Op::Add(e.clone()),
                        (Some(old), Some(e)) if !Arc::ptr_eq(old, e) && **old != **e => {
                            Op::Replace(e.clone())
                        }
                        (Some(old), None) => Op::Remove(old.clone()),
                        _ => continue,
                    };
                    match &op {
                        // A REPLACE's entry has the same key: it takes the old one's place.
                        Op::Add(e) | Op::Replace(e) => {
                            self.sent.replace(Sent(e.clone()));
                        }
                        Op::Remove(_) => {
                            self.sent.remove(key);
                        }
                        Op::Synced => {}
                    }
                    self.queued.push_back(op);
                    if self.queued.len() >= self.buffer {
                        break;
                    }
                }
                if next < keys.len() {
                    self.work = Some(Work::Diff { snap, keys, next });
                    return;
                }
                self.version = snap.version;
                self.metrics.pushes.inc();
                self.metrics
                    .push_latency
                    .observe(snap.published.elapsed().as_secs_f64());
            }
        }
    }
}

impl Stream for Watch {
    type Item = Op;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Op>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        if this.stop.as_mut().poll(cx).is_ready() {
            this.ended = true;
            return Poll::Ready(None);
        }
        loop {
            if let Some(op) = this.queued.pop_front() {
                if this.queued.is_empty() && this.queued.capacity() > KEEP_QUEUED {
                    this.queued.shrink_to(KEEP_QUEUED);
                }
                return Poll::Ready(Some(op));
            }
            if let Some(work) = this.work.take() {
                this.step(work);
                continue;
            }
            match ready!(this.snapshots.poll_next_unpin(cx)) {
                Some(snap) => this.start(snap),
                None => {
                    this.ended = true;
                    return Poll::Ready(None);
                }
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.metrics.watchers.dec();
    }
}

/// What [`guarded`] needs to check a watch's reader again.
pub(crate) struct Reader {
    pub(crate) auth: Authenticator,
    /// The `authorization` header the watch was opened with.
    pub(crate) authorization: Option<Vec<u8>>,
    pub(crate) filter: Filter,
    /// What the opening check granted.
    pub(crate) grant: Grant,
    pub(crate) metrics: Metrics,
}

/// The items of `items` (a watch's ops or updates) until the reader's access lapses: the reader is checked again (without the
/// cache) from time to time and when its token expires; a refusal is the stream's last item.
/// An API server that cannot answer never ends a watch: the check is retried later.
pub(crate) fn guarded<T, S>(
    items: S,
    reader: Reader,
) -> impl Stream<Item = Result<T, Denied>> + Send
where
    T: Send + 'static,
    S: Stream<Item = T> + Unpin + Send + 'static,
{
    let next = reader
        .auth
        .next_recheck(reader.grant)
        .map(|d| Instant::now() + d);
    futures_util::stream::unfold(
        (items, reader, next, false),
        |(mut items, reader, mut next, ended)| async move {
            if ended {
                return None;
            }
            loop {
                let due = async {
                    match next {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    item = items.next() => return item.map(|item| (Ok(item), (items, reader, next, false))),
                    () = due => {}
                }
                let scope = Scope::Rules(&reader.filter);
                // Boxed: the check (an API-server call) is rare, and inline its state would sit
                // in every open watch, several KiB per watcher (DHAT, perf/results/push_steps.md).
                match Box::pin(reader.auth.recheck(reader.authorization.as_deref(), scope)).await {
                    Ok(grant) => next = reader.auth.next_recheck(grant).map(|d| Instant::now() + d),
                    Err(Denied::Unavailable(why)) => {
                        tracing::debug!(%why, "cannot check a watch's reader again now");
                        next = Some(Instant::now() + RECHECK_RETRY);
                    }
                    Err(refused) => {
                        reader.metrics.refused();
                        tracing::info!(reason = %refused, "watch ended: its reader may no longer read it");
                        return Some((Err(refused), (items, reader, next, true)));
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;
    use prometheus_client::registry::Registry;
    use spur_routing::RoutingRule;

    use super::*;
    use crate::index::Index;

    fn rule(name: &str, key: &str, port: u16) -> RoutingRule {
        crate::index::tests::rule("ns", name, key, port)
    }

    fn filter(name: &str) -> Filter {
        Filter {
            kind: "Deployment".into(),
            namespace: "ns".into(),
            name: name.into(),
            routing_key: String::new(),
            sandbox: String::new(),
        }
    }

    /// What the stream has ready now, without waiting.
    fn ready(w: &mut Watch) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(Some(op)) = w.next().now_or_never() {
            out.push(match op {
                Op::Add(e) => format!("add {}", e.key().routing_key),
                Op::Replace(e) => format!("replace {}", e.key().routing_key),
                Op::Remove(e) => format!("remove {}", e.key().routing_key),
                Op::Synced => "synced".into(),
            });
        }
        out
    }

    #[tokio::test]
    async fn sends_a_large_set_in_parts_then_only_changes_and_counts_itself() {
        let index = Index::new();
        let metrics = Metrics::register(&mut Registry::default());
        let stop = CancellationToken::new();
        let mut w = Watch::new(
            index.subscribe(),
            filter("web"),
            3,
            metrics.clone(),
            stop.clone(),
        );
        assert_eq!(metrics.watchers.get(), 1);
        assert!(
            ready(&mut w).is_empty(),
            "nothing before the store's first load"
        );

        let mut rules: Vec<_> = (0..10).map(|i| rule("web", &format!("k{i}"), 1)).collect();
        rules.push(rule("other", "k0", 1));
        index.replace_all(rules.clone());
        let mut sync: Vec<String> = (0..10).map(|i| format!("add k{i}")).collect();
        sync.sort();
        sync.push("synced".into());
        assert_eq!(
            ready(&mut w),
            sync,
            "every ADD of this baseline, then one SYNCED"
        );

        rules[3] = rule("web", "k3", 2);
        rules[10] = rule("other", "k0", 2);
        rules.remove(5);
        index.replace_all(rules.clone());
        assert_eq!(ready(&mut w), ["replace k3", "remove k5"]);
        assert_eq!(metrics.pushes.get(), 1);

        // Versions published while the reader is away coalesce: k1 changes twice and back.
        rules[1] = rule("web", "k1", 7);
        index.replace_all(rules.clone());
        rules[1] = rule("web", "k1", 1);
        rules.push(rule("web", "k9b", 1));
        index.replace_all(rules.clone());
        assert_eq!(ready(&mut w), ["add k9b"]);

        // A change larger than the buffer is computed in parts, all of it.
        for r in rules.iter_mut().filter(|r| r.baseline.name == "web") {
            r.mappings[0].destinations[0].port = 9;
        }
        index.replace_all(rules.clone());
        let all: Vec<String> = rules
            .iter()
            .filter(|r| r.baseline.name == "web")
            .map(|r| format!("replace {}", r.routing_key))
            .collect();
        let mut sorted = all.clone();
        sorted.sort();
        assert_eq!(ready(&mut w), sorted);

        stop.cancel();
        assert!(
            matches!(w.next().now_or_never(), Some(None)),
            "stop ends the stream"
        );
        drop(w);
        assert_eq!(metrics.watchers.get(), 0);
    }
}
