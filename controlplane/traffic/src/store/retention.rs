//! Retention: age first, then each namespace's quota, then the store-wide limits — the last
//! taken from the namespace holding the most, so that one namespace's pushes never remove
//! another's exchanges while that other holds less (issue 42). Always oldest first within a
//! namespace. It runs inside each insert's transaction, from running totals, so it never
//! counts the table.

use std::collections::{BTreeMap, BTreeSet};

use rusqlite::Transaction;

use super::{Limits, dbe};
use crate::Error;

/// Rows one retention statement removes at most: their sizes come back as one list in memory.
const CHUNK: u64 = 10_000;

/// Rows and their encoded bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Totals {
    pub(super) count: u64,
    pub(super) bytes: u64,
}

impl Totals {
    fn over(&self, max_count: u64, max_bytes: u64) -> bool {
        self.count > max_count || self.bytes > max_bytes
    }
}

/// What the store holds, in all and per namespace (the baseline's).
#[derive(Debug, Clone, Default)]
pub(super) struct Usage {
    pub(super) total: Totals,
    pub(super) namespaces: BTreeMap<String, Totals>,
}

impl Usage {
    /// The usage as the table has it.
    pub(super) fn read(tx: &rusqlite::Connection) -> Result<Usage, Error> {
        let mut stmt = tx
            .prepare(
                "SELECT namespace, COUNT(*), COALESCE(SUM(size), 0) FROM exchanges \
                 GROUP BY namespace",
            )
            .map_err(dbe)?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })
            .map_err(dbe)?;
        let mut usage = Usage::default();
        for row in rows {
            let (ns, count, bytes) = row.map_err(dbe)?;
            usage.add(&ns, count.max(0) as u64, bytes.max(0) as u64);
        }
        Ok(usage)
    }

    pub(super) fn add(&mut self, namespace: &str, count: u64, bytes: u64) {
        self.total.count += count;
        self.total.bytes += bytes;
        let t = self.namespaces.entry(namespace.to_string()).or_default();
        t.count += count;
        t.bytes += bytes;
    }

    fn remove(&mut self, namespace: &str, bytes: u64) {
        self.total.count = self.total.count.saturating_sub(1);
        self.total.bytes = self.total.bytes.saturating_sub(bytes);
        if let Some(t) = self.namespaces.get_mut(namespace) {
            t.count = t.count.saturating_sub(1);
            t.bytes = t.bytes.saturating_sub(bytes);
            if t.count == 0 {
                self.namespaces.remove(namespace);
            }
        }
    }
}

/// Why rows went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Reason {
    Age,
    /// The namespace was over its own quota.
    NamespaceQuota,
    /// The store was over its limits and the namespace held the most.
    StoreLimit,
}

impl Reason {
    pub(super) fn label(self) -> &'static str {
        match self {
            Reason::Age => "age",
            Reason::NamespaceQuota => "namespace_quota",
            Reason::StoreLimit => "store_limit",
        }
    }
}

/// Rows removed, per namespace and reason.
pub(super) type Evicted = BTreeMap<(String, Reason), u64>;

/// Applies `limits` to the table whose usage is `usage` (updated in place); `touched` are the
/// namespaces the insert added to (only they can be over their quota).
pub(super) fn retain(
    tx: &Transaction<'_>,
    limits: &Limits,
    now: i64,
    usage: &mut Usage,
    touched: &BTreeSet<String>,
) -> Result<Evicted, Error> {
    let mut evicted = Evicted::new();
    let mut removed = |rows: Vec<(String, i64)>, usage: &mut Usage, reason: Reason| {
        let n = rows.len();
        for (ns, size) in rows {
            usage.remove(&ns, size.max(0) as u64);
            *evicted.entry((ns, reason)).or_default() += 1;
        }
        n
    };
    if !limits.max_age.is_zero() {
        let age = i64::try_from(limits.max_age.as_micros()).unwrap_or(i64::MAX);
        let cutoff = now.saturating_sub(age);
        // The index on stored_unix_micros makes this a seek that finds nothing on most
        // batches.
        let rows = deleted(
            tx,
            "DELETE FROM exchanges WHERE stored_unix_micros < ?1 RETURNING namespace, size",
            (cutoff,),
        )?;
        removed(rows, usage, Reason::Age);
    }
    for ns in touched {
        while let Some(t) = usage.namespaces.get(ns).copied() {
            if !t.over(limits.namespace_max_exchanges, limits.namespace_max_bytes) {
                break;
            }
            let n = excess(
                t,
                limits.namespace_max_exchanges,
                limits.namespace_max_bytes,
            );
            let rows = oldest_of(tx, ns, n)?;
            if removed(rows, usage, Reason::NamespaceQuota) == 0 {
                *usage = Usage::read(tx)?;
                break;
            }
        }
    }
    while usage.total.over(limits.max_exchanges, limits.max_bytes) {
        let by_bytes = usage.total.bytes > limits.max_bytes;
        // The namespace holding the most of what is over; on a tie, the first by name.
        let Some((ns, t)) = usage
            .namespaces
            .iter()
            .max_by(|(an, a), (bn, b)| {
                let (a, b) = if by_bytes {
                    (a.bytes, b.bytes)
                } else {
                    (a.count, b.count)
                };
                a.cmp(&b).then_with(|| bn.cmp(an))
            })
            .map(|(ns, t)| (ns.clone(), *t))
        else {
            *usage = Usage::read(tx)?;
            break;
        };
        let n = excess(usage.total, limits.max_exchanges, limits.max_bytes).min(t.count.max(1));
        let rows = oldest_of(tx, &ns, n)?;
        if removed(rows, usage, Reason::StoreLimit) == 0 {
            // The totals disagree with the table: trust the table.
            *usage = Usage::read(tx)?;
            break;
        }
    }
    Ok(evicted)
}

/// Rows to remove from something holding `t` to fit `max_count` and `max_bytes`: enough
/// average-sized rows to cover the excess bytes (the caller loops if the oldest are smaller).
fn excess(t: Totals, max_count: u64, max_bytes: u64) -> u64 {
    let over_count = t.count.saturating_sub(max_count);
    let over_bytes = t.bytes.saturating_sub(max_bytes);
    let average = (t.bytes / t.count.max(1)).max(1);
    over_count.max(over_bytes.div_ceil(average)).clamp(1, CHUNK)
}

/// Deletes the `n` oldest rows of namespace `ns`.
fn oldest_of(tx: &Transaction<'_>, ns: &str, n: u64) -> Result<Vec<(String, i64)>, Error> {
    deleted(
        tx,
        "DELETE FROM exchanges WHERE seq IN \
         (SELECT seq FROM exchanges WHERE namespace = ?1 ORDER BY seq LIMIT ?2) \
         RETURNING namespace, size",
        (ns, i64::try_from(n).unwrap_or(i64::MAX)),
    )
}

fn deleted(
    tx: &Transaction<'_>,
    sql: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<(String, i64)>, Error> {
    let mut stmt = tx.prepare_cached(sql).map_err(dbe)?;
    let rows = stmt
        .query_map(params, |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))
        })
        .map_err(dbe)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(dbe)?;
    Ok(rows)
}
