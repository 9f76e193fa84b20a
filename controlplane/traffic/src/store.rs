//! The exchanges, in one SQLite table: the columns a [`Filter`] asks about, indexed, and the
//! whole [`Exchange`] as a protobuf blob beside them.
//!
//! SQLite is synchronous, so one dedicated thread owns the connection and the async side talks
//! to it through a bounded channel: a burst of pushes waits for room there instead of piling up
//! blocked runtime threads. Retention runs in the same transaction as each insert, from running
//! totals, so it never counts the table.

use std::path::Path;
use std::sync::Arc;
#[cfg(test)]
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prost::Message;
use rusqlite::types::Value;
use rusqlite::{Connection, Transaction, params, params_from_iter};
use spur_proto::traffic::{Exchange, Filter, Routed, StoredExchange};
use tokio::sync::{mpsc, oneshot};

use crate::Error;

/// Schema version in `PRAGMA user_version`; a newer file is refused rather than misread.
const SCHEMA_VERSION: i64 = 1;

const SCHEMA_V1: &str = "
CREATE TABLE exchanges (
    -- Insertion order: retention by count and bytes removes the lowest first.
    seq                 INTEGER PRIMARY KEY,
    id                  TEXT NOT NULL UNIQUE,
    sandbox             TEXT NOT NULL,
    namespace           TEXT NOT NULL,
    workload            TEXT NOT NULL,
    method              TEXT NOT NULL,
    path                TEXT NOT NULL,
    status              INTEGER NOT NULL,
    -- 1: sent to a sandbox destination; 0: answered by the baseline.
    routed              INTEGER NOT NULL,
    start_unix_micros   INTEGER NOT NULL,
    stored_unix_micros  INTEGER NOT NULL,
    -- Bytes of `exchange`: what retention by bytes adds up.
    size                INTEGER NOT NULL,
    exchange            BLOB NOT NULL
) STRICT;
CREATE INDEX exchanges_start ON exchanges (start_unix_micros);
CREATE INDEX exchanges_sandbox ON exchanges (sandbox, start_unix_micros);
CREATE INDEX exchanges_workload ON exchanges (namespace, workload, start_unix_micros);
CREATE INDEX exchanges_stored ON exchanges (stored_unix_micros);
";

/// Most exchanges one Query returns.
pub const MAX_QUERY_LIMIT: u32 = 1000;
/// What a Query with limit 0 returns at most.
pub const DEFAULT_QUERY_LIMIT: u32 = 100;
/// Encoded exchanges one Query reply carries at most (at least one, whatever its size): a reply
/// stays decodable by a client whose limit matches the push limit.
pub const MAX_REPLY_BYTES: usize = 16 * 1024 * 1024;
/// Longest exchange id accepted.
pub const MAX_ID_LEN: usize = 512;
/// Longest filter string accepted (sandbox, namespace, workload, method, path prefix).
const MAX_FILTER_FIELD: usize = 4096;
/// Requests waiting for the database thread; past it, callers wait for room.
const QUEUE: usize = 64;
/// Rows one retention statement removes at most: their sizes come back as one list in memory.
const RETENTION_CHUNK: u64 = 10_000;

/// How much the store keeps. Retention runs after every insert: rows stored longer than
/// `max_age` ago go, then the oldest rows until both the count and the bytes fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Default 24 hours. Measured from when the store received an exchange (its own clock, not
    /// the sidecar's). Zero keeps exchanges regardless of age.
    pub max_age: Duration,
    /// Default 100 000.
    pub max_exchanges: u64,
    /// Encoded exchange bytes; default 256 MiB (the file is somewhat larger: indexes, pages).
    pub max_bytes: u64,
    /// Default true. False is the cluster-wide "no stored bodies" switch: body bytes are
    /// cleared before an exchange is stored (their sizes are kept).
    pub store_bodies: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_age: Duration::from_secs(24 * 3600),
            max_exchanges: 100_000,
            max_bytes: 256 * 1024 * 1024,
            store_bodies: true,
        }
    }
}

/// The traffic database. Cheap to clone; the database thread stops when the last clone is
/// dropped.
#[derive(Clone)]
pub struct Store {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("exchanges", &self.stored_exchanges())
            .field("bytes", &self.stored_bytes())
            .finish_non_exhaustive()
    }
}

/// What the database thread reports as it works (the metrics share these).
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) retention_dropped: Counter,
    pub(crate) exchanges: Gauge,
    pub(crate) bytes: Gauge,
}

enum Command {
    Insert(
        Vec<Exchange>,
        oneshot::Sender<Result<Vec<StoredExchange>, Error>>,
    ),
    Query(
        Filter,
        u32,
        oneshot::Sender<Result<Vec<StoredExchange>, Error>>,
    ),
}

impl Store {
    /// Opens (creating when missing) the database at `path`, or an in-memory one with None
    /// (tests, and a standalone store that need not outlive its process). Blocks briefly:
    /// call it at start-up.
    pub fn open(path: Option<&Path>, limits: Limits) -> Result<Store, Error> {
        Self::open_with(path, limits, Clock::System)
    }

    fn open_with(path: Option<&Path>, limits: Limits, clock: Clock) -> Result<Store, Error> {
        let where_ = || match path {
            Some(p) => p.display().to_string(),
            None => "in-memory database".into(),
        };
        let conn = match path {
            Some(p) => Connection::open(p),
            None => Connection::open_in_memory(),
        }
        .map_err(|e| Error::Db(format!("{}: {e}", where_())))?;
        let db = Db::init(conn, limits, clock).map_err(|e| match e {
            Error::Db(m) => Error::Db(format!("{}: {m}", where_())),
            e => e,
        })?;
        let shared = Arc::clone(&db.shared);
        let (tx, rx) = mpsc::channel(QUEUE);
        std::thread::Builder::new()
            .name("spur-traffic-db".into())
            .spawn(move || db.run(rx))
            .map_err(|e| Error::Db(format!("cannot start the database thread: {e}")))?;
        Ok(Store { tx, shared })
    }

    /// Stores the exchanges not stored yet (a re-sent id is ignored), in one transaction, then
    /// applies retention. Returns those it stored, as stored (bodies cleared when the limits
    /// say so). An invalid exchange (no id, an id longer than [`MAX_ID_LEN`]) refuses the
    /// whole batch.
    pub async fn insert(&self, exchanges: Vec<Exchange>) -> Result<Vec<StoredExchange>, Error> {
        for e in &exchanges {
            validate_exchange(e)?;
        }
        if exchanges.is_empty() {
            return Ok(Vec::new());
        }
        self.call(|reply| Command::Insert(exchanges, reply)).await
    }

    /// Stored exchanges matching `filter`, newest start first. `limit` 0 means
    /// [`DEFAULT_QUERY_LIMIT`]; it is capped at [`MAX_QUERY_LIMIT`], and a reply stops early
    /// past [`MAX_REPLY_BYTES`].
    pub async fn query(&self, filter: Filter, limit: u32) -> Result<Vec<StoredExchange>, Error> {
        validate_filter(&filter)?;
        self.call(|reply| Command::Query(filter, effective_limit(limit), reply))
            .await
    }

    /// Exchanges removed by retention since the store was opened.
    pub fn retention_dropped(&self) -> u64 {
        self.shared.retention_dropped.get()
    }

    /// Exchanges in the store now.
    pub fn stored_exchanges(&self) -> u64 {
        self.shared.exchanges.get().max(0) as u64
    }

    /// Encoded bytes of the exchanges in the store now.
    pub fn stored_bytes(&self) -> u64 {
        self.shared.bytes.get().max(0) as u64
    }

    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    async fn call<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<Result<T, Error>>) -> Command,
    ) -> Result<T, Error> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(command(reply))
            .await
            .map_err(|_| Error::Closed)?;
        answer.await.map_err(|_| Error::Closed)?
    }
}

/// The limit a Query applies for the limit it asked for.
pub fn effective_limit(limit: u32) -> u32 {
    match limit {
        0 => DEFAULT_QUERY_LIMIT,
        n => n.min(MAX_QUERY_LIMIT),
    }
}

/// Refuses a filter the store cannot apply as asked: an unknown `routed`, negative or inverted
/// time bounds, an over-long field.
pub fn validate_filter(f: &Filter) -> Result<(), Error> {
    if Routed::try_from(f.routed).is_err() {
        return Err(Error::Invalid(format!(
            "filter.routed: unknown value {}",
            f.routed
        )));
    }
    if f.since_unix_micros < 0 || f.until_unix_micros < 0 {
        return Err(Error::Invalid(
            "filter: time bounds are microseconds since the Unix epoch (not negative)".into(),
        ));
    }
    if f.since_unix_micros != 0
        && f.until_unix_micros != 0
        && f.since_unix_micros >= f.until_unix_micros
    {
        return Err(Error::Invalid(
            "filter: since_unix_micros must be before until_unix_micros".into(),
        ));
    }
    for (name, value) in [
        ("sandbox", &f.sandbox),
        ("namespace", &f.namespace),
        ("workload", &f.workload),
        ("path_prefix", &f.path_prefix),
        ("method", &f.method),
    ] {
        if value.len() > MAX_FILTER_FIELD {
            return Err(Error::Invalid(format!(
                "filter.{name}: longer than {MAX_FILTER_FIELD} bytes"
            )));
        }
    }
    if f.status > 999 {
        return Err(Error::Invalid(format!(
            "filter.status: {} is not an HTTP status",
            f.status
        )));
    }
    Ok(())
}

/// Whether a stored exchange matches `f`, as a Query would decide (Tail filters with it).
pub fn matches(f: &Filter, e: &Exchange) -> bool {
    let baseline = e.baseline.as_ref();
    let routed = !e.destination.is_empty();
    (f.sandbox.is_empty() || f.sandbox == e.sandbox)
        && (f.namespace.is_empty() || baseline.is_some_and(|b| b.namespace == f.namespace))
        && (f.workload.is_empty() || baseline.is_some_and(|b| b.name == f.workload))
        && e.path.starts_with(&f.path_prefix)
        && (f.method.is_empty() || f.method == e.method)
        && (f.status == 0 || f.status == e.status)
        && match Routed::try_from(f.routed) {
            Ok(Routed::Sandbox) => routed,
            Ok(Routed::Baseline) => !routed,
            Ok(Routed::Any) | Err(_) => true,
        }
        && (f.since_unix_micros == 0 || e.start_unix_micros >= f.since_unix_micros)
        && (f.until_unix_micros == 0 || e.start_unix_micros < f.until_unix_micros)
}

fn validate_exchange(e: &Exchange) -> Result<(), Error> {
    if e.id.is_empty() {
        return Err(Error::Invalid("an exchange has no id".into()));
    }
    if e.id.len() > MAX_ID_LEN {
        return Err(Error::Invalid(format!(
            "exchange id longer than {MAX_ID_LEN} bytes"
        )));
    }
    Ok(())
}

/// `prefix` as a LIKE pattern that matches it literally (escape character `\`).
fn like_prefix(prefix: &str) -> String {
    let mut pattern = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '\\' | '%' | '_') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push('%');
    pattern
}

// === impl Db ===

/// Where the database thread reads the time: the system clock, or one a test moves.
#[derive(Clone)]
enum Clock {
    System,
    #[cfg(test)]
    Manual(Arc<AtomicI64>),
}

impl Clock {
    fn now_micros(&self) -> i64 {
        match self {
            Clock::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_micros() as i64)
                .unwrap_or(0),
            #[cfg(test)]
            Clock::Manual(t) => t.load(Ordering::SeqCst),
        }
    }
}

/// The database thread's state.
struct Db {
    conn: Connection,
    limits: Limits,
    clock: Clock,
    /// Rows and their bytes, kept in step with every insert and delete.
    count: u64,
    bytes: u64,
    shared: Arc<Shared>,
}

fn dbe(e: rusqlite::Error) -> Error {
    Error::Db(e.to_string())
}

impl Db {
    fn init(conn: Connection, limits: Limits, clock: Clock) -> Result<Db, Error> {
        // Another process reading the file (a backup, sqlite3) may hold a lock for a moment.
        conn.busy_timeout(Duration::from_secs(5)).map_err(dbe)?;
        // WAL: readers never block the writer. NORMAL: a commit may be lost on power loss
        // but never corrupts the file; captured traffic is not worth an fsync per batch.
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(dbe)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(dbe)?;
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(dbe)?;
        if version > SCHEMA_VERSION {
            return Err(Error::Db(format!(
                "schema version {version} is newer than this store understands \
                 ({SCHEMA_VERSION}); run a newer spur"
            )));
        }
        if version < 1 {
            let tx = conn.unchecked_transaction().map_err(dbe)?;
            tx.execute_batch(SCHEMA_V1).map_err(dbe)?;
            tx.pragma_update(None, "user_version", SCHEMA_VERSION)
                .map_err(dbe)?;
            tx.commit().map_err(dbe)?;
        }
        // Once at open; afterwards the totals follow each change.
        let (count, bytes): (i64, i64) = conn
            .query_row(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM exchanges",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(dbe)?;
        let db = Db {
            conn,
            limits,
            clock,
            count: count.max(0) as u64,
            bytes: bytes.max(0) as u64,
            shared: Arc::new(Shared::default()),
        };
        db.publish();
        Ok(db)
    }

    fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        while let Some(command) = rx.blocking_recv() {
            match command {
                Command::Insert(batch, reply) => {
                    let out = self.insert(batch);
                    if let Err(e) = &out {
                        tracing::warn!(error = %e, "cannot store exchanges");
                    }
                    let _ = reply.send(out);
                }
                Command::Query(filter, limit, reply) => {
                    let out = self.query(&filter, limit);
                    if let Err(e) = &out {
                        tracing::warn!(error = %e, "cannot query exchanges");
                    }
                    let _ = reply.send(out);
                }
            }
        }
    }

    fn publish(&self) {
        self.shared.exchanges.set(self.count as i64);
        self.shared.bytes.set(self.bytes as i64);
    }

    fn insert(&mut self, batch: Vec<Exchange>) -> Result<Vec<StoredExchange>, Error> {
        let now = self.clock.now_micros();
        let store_bodies = self.limits.store_bodies;
        let tx = self.conn.transaction().map_err(dbe)?;
        let mut stored = Vec::with_capacity(batch.len());
        let mut added_bytes = 0u64;
        {
            let mut insert = tx
                .prepare_cached(
                    "INSERT OR IGNORE INTO exchanges (id, sandbox, namespace, workload, method, \
                     path, status, routed, start_unix_micros, stored_unix_micros, size, exchange) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
                )
                .map_err(dbe)?;
            for mut e in batch {
                if !store_bodies {
                    strip_body(e.request_body.as_mut());
                    strip_body(e.response_body.as_mut());
                }
                let blob = e.encode_to_vec();
                let (namespace, workload) = e
                    .baseline
                    .as_ref()
                    .map(|b| (b.namespace.as_str(), b.name.as_str()))
                    .unwrap_or_default();
                let added = insert
                    .execute(params![
                        e.id,
                        e.sandbox,
                        namespace,
                        workload,
                        e.method,
                        e.path,
                        e.status,
                        !e.destination.is_empty(),
                        e.start_unix_micros,
                        now,
                        blob.len() as i64,
                        blob,
                    ])
                    .map_err(dbe)?;
                if added == 1 {
                    added_bytes += blob.len() as u64;
                    stored.push(StoredExchange {
                        exchange: Some(e),
                        stored_unix_micros: now,
                    });
                }
            }
        }
        let count = self.count + stored.len() as u64;
        let bytes = self.bytes + added_bytes;
        let (count, bytes, dropped) = retain(&tx, &self.limits, now, count, bytes)?;
        tx.commit().map_err(dbe)?;
        // Only now: a failed commit rolled everything back and the totals still hold.
        self.count = count;
        self.bytes = bytes;
        self.shared.retention_dropped.inc_by(dropped);
        self.publish();
        Ok(stored)
    }

    fn query(&self, f: &Filter, limit: u32) -> Result<Vec<StoredExchange>, Error> {
        // Bare `?` parameters number themselves in order: each clause pushes its arguments
        // as it adds them.
        let mut sql = String::from("SELECT exchange, stored_unix_micros FROM exchanges WHERE 1");
        let mut args: Vec<Value> = Vec::new();
        for (column, value) in [
            ("sandbox", &f.sandbox),
            ("namespace", &f.namespace),
            ("workload", &f.workload),
            ("method", &f.method),
        ] {
            if !value.is_empty() {
                sql.push_str(&format!(" AND {column} = ?"));
                args.push(value.clone().into());
            }
        }
        if !f.path_prefix.is_empty() {
            // LIKE folds ASCII case, and paths are case-sensitive: the substr comparison
            // decides, the LIKE keeps the prefix's `%` and `_` literal either way.
            sql.push_str(" AND path LIKE ? ESCAPE '\\' AND substr(path, 1, length(?)) = ?");
            args.push(like_prefix(&f.path_prefix).into());
            args.push(f.path_prefix.clone().into());
            args.push(f.path_prefix.clone().into());
        }
        if f.status != 0 {
            sql.push_str(" AND status = ?");
            args.push(i64::from(f.status).into());
        }
        match Routed::try_from(f.routed) {
            Ok(Routed::Sandbox) => sql.push_str(" AND routed = 1"),
            Ok(Routed::Baseline) => sql.push_str(" AND routed = 0"),
            Ok(Routed::Any) | Err(_) => {}
        }
        if f.since_unix_micros != 0 {
            sql.push_str(" AND start_unix_micros >= ?");
            args.push(f.since_unix_micros.into());
        }
        if f.until_unix_micros != 0 {
            sql.push_str(" AND start_unix_micros < ?");
            args.push(f.until_unix_micros.into());
        }
        sql.push_str(" ORDER BY start_unix_micros DESC, seq DESC LIMIT ?");
        args.push(i64::from(limit).into());
        let mut stmt = self.conn.prepare(&sql).map_err(dbe)?;
        let mut rows = stmt.query(params_from_iter(args)).map_err(dbe)?;
        let mut out = Vec::new();
        let mut reply_bytes = 0usize;
        while let Some(row) = rows.next().map_err(dbe)? {
            let blob: Vec<u8> = row.get(0).map_err(dbe)?;
            let stored_unix_micros: i64 = row.get(1).map_err(dbe)?;
            if !out.is_empty() && reply_bytes + blob.len() > MAX_REPLY_BYTES {
                break;
            }
            reply_bytes += blob.len();
            match Exchange::decode(blob.as_slice()) {
                Ok(e) => out.push(StoredExchange {
                    exchange: Some(e),
                    stored_unix_micros,
                }),
                // Only this store writes the blobs: a bad one is damage, not a reason to fail
                // every query that meets it.
                Err(e) => tracing::warn!(error = %e, "skipping an undecodable stored exchange"),
            }
        }
        Ok(out)
    }
}

/// Applies the limits to a table holding `count` rows of `bytes`; returns the new totals
/// and how many rows went.
fn retain(
    tx: &Transaction<'_>,
    limits: &Limits,
    now: i64,
    mut count: u64,
    mut bytes: u64,
) -> Result<(u64, u64, u64), Error> {
    let mut dropped = 0u64;
    let mut removed = |sizes: Vec<i64>, count: &mut u64, bytes: &mut u64| {
        let n = sizes.len() as u64;
        let b: u64 = sizes.iter().map(|s| (*s).max(0) as u64).sum();
        *count = count.saturating_sub(n);
        *bytes = bytes.saturating_sub(b);
        dropped += n;
        n
    };
    if !limits.max_age.is_zero() {
        let age = i64::try_from(limits.max_age.as_micros()).unwrap_or(i64::MAX);
        let cutoff = now.saturating_sub(age);
        // The index on stored_unix_micros makes this a seek that finds nothing on most
        // batches.
        let sizes = deleted_sizes(
            tx,
            "DELETE FROM exchanges WHERE stored_unix_micros < ?1 RETURNING size",
            cutoff,
        )?;
        removed(sizes, &mut count, &mut bytes);
    }
    while count > limits.max_exchanges || bytes > limits.max_bytes {
        let over_count = count.saturating_sub(limits.max_exchanges);
        let over_bytes = bytes.saturating_sub(limits.max_bytes);
        // Enough average-sized rows to cover the excess bytes; the loop takes more if the
        // oldest rows are smaller than average.
        let average = (bytes / count.max(1)).max(1);
        let n = over_count
            .max(over_bytes.div_ceil(average))
            .clamp(1, RETENTION_CHUNK);
        let sizes = deleted_sizes(
            tx,
            "DELETE FROM exchanges WHERE seq IN \
             (SELECT seq FROM exchanges ORDER BY seq LIMIT ?1) RETURNING size",
            n as i64,
        )?;
        if removed(sizes, &mut count, &mut bytes) == 0 {
            // The totals disagree with an empty table: trust the table.
            let (c, b): (i64, i64) = tx
                .query_row(
                    "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM exchanges",
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .map_err(dbe)?;
            count = c.max(0) as u64;
            bytes = b.max(0) as u64;
            break;
        }
    }
    Ok((count, bytes, dropped))
}

fn deleted_sizes(tx: &Transaction<'_>, sql: &str, arg: i64) -> Result<Vec<i64>, Error> {
    let mut stmt = tx.prepare_cached(sql).map_err(dbe)?;
    let sizes = stmt
        .query_map([arg], |r| r.get::<_, i64>(0))
        .map_err(dbe)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(dbe)?;
    Ok(sizes)
}

fn strip_body(body: Option<&mut spur_proto::traffic::Body>) {
    if let Some(b) = body {
        b.data = Vec::new();
        b.truncated = b.size > 0;
    }
}

#[cfg(test)]
mod tests;
