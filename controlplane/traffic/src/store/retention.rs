//! Retention: age first, then each namespace's quota, then the store-wide limits. Those are
//! shared by max-min fairness ("water-filling"): the namespaces holding the most are lowered
//! to one common level, the highest at which the store fits, and a namespace holding no more
//! than that level loses nothing. The level is never below the limit divided by the
//! namespaces holding exchanges, so one namespace's pushes never remove another's exchanges
//! while that other holds no more than its share, and take a namespace below the level only by
//! less than one exchange (rows go whole; issue 42). Always oldest first within a namespace. It runs inside each insert's
//! transaction, from running totals, so it never counts the table.

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
    /// The store was over its limits and the namespace held more than the common level.
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
        removed(rows, usage, Reason::Age, &mut evicted);
    }
    for ns in touched {
        let quota = Totals {
            count: limits.namespace_max_exchanges,
            bytes: limits.namespace_max_bytes,
        };
        if !lower(tx, usage, ns, quota, Reason::NamespaceQuota, &mut evicted)? {
            return Ok(evicted);
        }
    }
    // The limit over by the larger fraction first: the rows that go for it often bring the
    // other under as well, so a namespace over only in the other is not cut for nothing.
    let over = |held: u64, limit: u64| u128::from(held.saturating_sub(limit));
    let bytes_first = over(usage.total.bytes, limits.max_bytes) * u128::from(limits.max_exchanges)
        > over(usage.total.count, limits.max_exchanges) * u128::from(limits.max_bytes);
    let dimensions = if bytes_first {
        [Dimension::Bytes, Dimension::Count]
    } else {
        [Dimension::Count, Dimension::Bytes]
    };
    for dimension in dimensions {
        let limit = dimension.limit(limits);
        if dimension.of(usage.total) <= limit {
            continue;
        }
        let level = level(
            usage
                .namespaces
                .values()
                .map(|t| dimension.of(*t))
                .collect(),
            limit,
        );
        let cap = dimension.cap(level);
        let above: Vec<String> = usage
            .namespaces
            .iter()
            .filter(|(_, t)| dimension.of(**t) > level)
            .map(|(ns, _)| ns.clone())
            .collect();
        for ns in &above {
            if !lower(tx, usage, ns, cap, Reason::StoreLimit, &mut evicted)? {
                return Ok(evicted);
            }
        }
    }
    Ok(evicted)
}

/// One of the two things the store limits.
#[derive(Debug, Clone, Copy)]
enum Dimension {
    Count,
    Bytes,
}

impl Dimension {
    fn of(self, t: Totals) -> u64 {
        match self {
            Dimension::Count => t.count,
            Dimension::Bytes => t.bytes,
        }
    }

    fn limit(self, limits: &Limits) -> u64 {
        self.of(Totals {
            count: limits.max_exchanges,
            bytes: limits.max_bytes,
        })
    }

    /// `level` in this dimension, nothing in the other.
    fn cap(self, level: u64) -> Totals {
        match self {
            Dimension::Count => Totals {
                count: level,
                bytes: u64::MAX,
            },
            Dimension::Bytes => Totals {
                count: u64::MAX,
                bytes: level,
            },
        }
    }
}

/// The highest common level the namespaces holding `held` can be lowered to (those holding
/// less keep all of it) so that together they hold at most `limit`: max-min fairness. It is
/// never below `limit / held.len()` (rounded down), so a namespace holding no more than that
/// share loses nothing. O(n log n) in the namespaces.
fn level(mut held: Vec<u64>, limit: u64) -> u64 {
    held.sort_unstable();
    let n = held.len();
    let mut left = limit;
    for (i, &x) in held.iter().enumerate() {
        let k = (n - i) as u64;
        // The rest (x and larger) cannot all keep x: they share what is left equally.
        if u128::from(x) * u128::from(k) > u128::from(left) {
            return left / k;
        }
        left -= x;
    }
    u64::MAX
}

/// Removes namespace `ns`'s oldest rows until it holds at most `cap`, each counted under
/// `reason`. False when the running totals disagreed with the table: they have been re-read,
/// and retention stops for this insert (the next one applies it again).
fn lower(
    tx: &Transaction<'_>,
    usage: &mut Usage,
    ns: &str,
    cap: Totals,
    reason: Reason,
    evicted: &mut Evicted,
) -> Result<bool, Error> {
    while let Some(t) = usage.namespaces.get(ns).copied() {
        if !t.over(cap.count, cap.bytes) {
            break;
        }
        let rows = oldest_of(tx, ns, t, cap)?;
        if removed(rows, usage, reason, evicted) == 0 {
            *usage = Usage::read(tx)?;
            return Ok(false);
        }
    }
    Ok(true)
}

fn removed(
    rows: Vec<(String, i64)>,
    usage: &mut Usage,
    reason: Reason,
    evicted: &mut Evicted,
) -> usize {
    let n = rows.len();
    for (ns, size) in rows {
        usage.remove(&ns, size.max(0) as u64);
        *evicted.entry((ns, reason)).or_default() += 1;
    }
    n
}

/// Deletes the oldest rows of namespace `ns`, which holds `t`, needed to bring it to `cap`,
/// and no more: it reads the sizes of as many rows as an average-sized row predicts (at most
/// [`CHUNK`]) and deletes the shortest prefix of them that covers the excess; the caller
/// loops when the oldest rows were smaller than the average.
fn oldest_of(
    tx: &Transaction<'_>,
    ns: &str,
    t: Totals,
    cap: Totals,
) -> Result<Vec<(String, i64)>, Error> {
    let over_count = t.count.saturating_sub(cap.count);
    let over_bytes = t.bytes.saturating_sub(cap.bytes);
    let average = (t.bytes / t.count.max(1)).max(1);
    let n = over_count.max(over_bytes.div_ceil(average)).clamp(1, CHUNK);
    let mut stmt = tx
        .prepare_cached(
            "SELECT seq, size FROM exchanges WHERE namespace = ?1 ORDER BY seq LIMIT ?2",
        )
        .map_err(dbe)?;
    let oldest = stmt
        .query_map((ns, i64::try_from(n).unwrap_or(i64::MAX)), |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
        })
        .map_err(dbe)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(dbe)?;
    let (mut rows, mut bytes, mut last) = (0u64, 0u64, None);
    for (seq, size) in oldest {
        if rows >= over_count && bytes >= over_bytes {
            break;
        }
        rows += 1;
        bytes = bytes.saturating_add(size.max(0) as u64);
        last = Some(seq);
    }
    let Some(last) = last else {
        return Ok(Vec::new());
    };
    deleted(
        tx,
        "DELETE FROM exchanges WHERE namespace = ?1 AND seq <= ?2 RETURNING namespace, size",
        (ns, last),
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

#[cfg(test)]
mod tests {
    use super::level;

    #[test]
    fn the_level_is_the_highest_at_which_everything_fits() {
        // Everything fits: nobody is lowered.
        assert_eq!(level(vec![10, 20], 30), u64::MAX);
        assert_eq!(level(Vec::new(), 0), u64::MAX);
        // The smallest keeps all; the other two share what is left.
        assert_eq!(level(vec![50, 10, 45], 70), 30);
        // Rounded down: 59 left for two.
        assert_eq!(level(vec![30, 11, 30], 70), 29);
        // One namespace alone gets the whole limit.
        assert_eq!(level(vec![500], 70), 70);
        // Never below the equal share, whoever holds what.
        for held in [
            vec![1000, 1000, 1000],
            vec![34, 34, 34],
            vec![u64::MAX, u64::MAX],
        ] {
            let share = 100 / held.len() as u64;
            assert!(level(held, 100) >= share);
        }
        // A limit of nothing keeps nothing.
        assert_eq!(level(vec![3, 4], 0), 0);
    }
}
