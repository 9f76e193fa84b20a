//! One task per watch stream: initial ADDs, exactly one SYNCED, then ADD / REPLACE / REMOVE for
//! the rules that changed — computed from the index's change log, so a watcher costs only what
//! changes, and a slow watcher simply skips to the latest state when it catches up.
//!
//! The contract the public Go client relies on: nothing but ADDs before SYNCED; every op after
//! it carries a complete rule; a REMOVE or REPLACE only for a rule this stream was sent.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::auth::{Authenticator, Denied, Grant, Scope};
use crate::index::{Entry, Filter, RuleKey, Snapshot};
use crate::metrics::Metrics;

/// How soon a watch is checked again when the API server could not answer the last check.
const RECHECK_RETRY: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub(crate) enum Op {
    Add(Arc<Entry>),
    Replace(Arc<Entry>),
    /// Carries the rule as this stream last saw it.
    Remove(Arc<Entry>),
    Synced,
}

/// Starts a watch; ops arrive on the returned receiver (at most `buffer` queued: a watcher that
/// stops reading stalls only its own task). The stream ends when `stop` fires or the receiver is
/// dropped.
pub(crate) fn spawn(
    snapshots: watch::Receiver<Arc<Snapshot>>,
    filter: Filter,
    buffer: usize,
    metrics: Metrics,
    stop: CancellationToken,
) -> mpsc::Receiver<Op> {
    let (tx, rx) = mpsc::channel(buffer.max(1));
    tokio::spawn(async move {
        metrics.watchers.inc();
        tokio::select! {
            () = run(snapshots, &filter, &tx, &metrics) => {}
            () = stop.cancelled() => {}
        }
        metrics.watchers.dec();
    });
    rx
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

/// The items of `rx` (a watch's ops or updates) until the reader's access lapses: the reader is checked again (without the
/// cache) from time to time and when its token expires; a refusal is the stream's last item.
/// An API server that cannot answer never ends a watch: the check is retried later.
pub(crate) fn guarded<T: Send + 'static>(
    rx: mpsc::Receiver<T>,
    reader: Reader,
) -> impl Stream<Item = Result<T, Denied>> + Send {
    let next = reader
        .auth
        .next_recheck(reader.grant)
        .map(|d| Instant::now() + d);
    futures_util::stream::unfold(
        (rx, reader, next, false),
        |(mut rx, reader, mut next, ended)| async move {
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
                    op = rx.recv() => return op.map(|op| (Ok(op), (rx, reader, next, false))),
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
                        return Some((Err(refused), (rx, reader, next, true)));
                    }
                }
            }
        },
    )
}

async fn run(
    mut snapshots: watch::Receiver<Arc<Snapshot>>,
    filter: &Filter,
    tx: &mpsc::Sender<Op>,
    metrics: &Metrics,
) {
    // Wait for the store's first load so SYNCED means "everything there is".
    let mut snap = loop {
        let s = snapshots.borrow_and_update().clone();
        if s.version > 0 {
            break s;
        }
        if snapshots.changed().await.is_err() {
            return;
        }
    };
    let mut sent: HashMap<RuleKey, Arc<Entry>> = HashMap::new();
    for e in snap.matching(filter) {
        if tx.send(Op::Add(e.clone())).await.is_err() {
            return;
        }
        sent.insert(e.key(), e.clone());
    }
    if tx.send(Op::Synced).await.is_err() {
        return;
    }
    tracing::debug!(
        namespace = %filter.namespace,
        name = %filter.name,
        rules = sent.len(),
        version = snap.version,
        "watch synced"
    );
    let mut version = snap.version;
    loop {
        tokio::select! {
            changed = snapshots.changed() => if changed.is_err() { return },
            () = tx.closed() => return,
        }
        snap = snapshots.borrow_and_update().clone();
        let keys: Vec<RuleKey> = match snap.changed_since(version) {
            Some(keys) => keys.into_iter().collect(),
            None => {
                let mut all: Vec<RuleKey> = sent.keys().cloned().collect();
                all.extend(snap.matching(filter).map(|e| e.key()));
                all.sort();
                all.dedup();
                all
            }
        };
        for key in keys {
            let now = snap.rules.get(&key).filter(|e| filter.matches(e));
            let op = match (sent.get(&key), now) {
                (None, Some(e)) => Op::Add(e.clone()),
                (Some(old), Some(e)) if !Arc::ptr_eq(old, e) && **old != **e => {
                    Op::Replace(e.clone())
                }
                (Some(old), None) => Op::Remove(old.clone()),
                _ => continue,
            };
            match &op {
                Op::Add(e) | Op::Replace(e) => {
                    sent.insert(key, e.clone());
                }
                Op::Remove(_) => {
                    sent.remove(&key);
                }
                Op::Synced => {}
            }
            if tx.send(op).await.is_err() {
                return;
            }
        }
        version = snap.version;
        metrics.pushes.inc();
        metrics
            .push_latency
            .observe(snap.published.elapsed().as_secs_f64());
    }
}
