//! The exchanges, in one SQLite table: the columns a [`Filter`] asks about, indexed, and the
//! whole [`Exchange`] as a protobuf blob beside them. Ids are the store's own (`schema`), and
//! each namespace has a quota (`retention`).
//!
//! SQLite is synchronous, so one dedicated thread owns the connection and the async side talks
//! to it through a bounded channel: a burst of pushes waits for room there instead of piling up
//! blocked runtime threads. Retention runs in the same transaction as each insert, from running
//! totals, so it never counts the table.

mod retention;
mod schema;

use std::path::Path;
use std::sync::Arc;
#[cfg(test)]
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::collections::BTreeSet;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prost::Message;
use rusqlite::types::Value;
use rusqlite::{Connection, params, params_from_iter};
use spur_proto::traffic::{Exchange, Filter, Routed, StoredExchange};
use tokio::sync::{mpsc, oneshot};

use self::retention::{Reason, Usage};
use crate::Error;

/// Most exchanges one Query returns.
pub const MAX_QUERY_LIMIT: u32 = 1000;
/// What a Query with limit 0 returns at most.
pub const DEFAULT_QUERY_LIMIT: u32 = 100;
/// Encoded exchanges one Query reply carries at most (at least one, whatever its size): a reply
/// stays decodable by a client whose limit matches the push limit.
pub const MAX_REPLY_BYTES: usize = 16 * 1024 * 1024;
/// Longest exchange id accepted from a pusher (its own id, used only to ignore a re-send).
pub const MAX_ID_LEN: usize = 512;
/// Longest filter string accepted (sandbox, namespace, workload, method, path prefix).
const MAX_FILTER_FIELD: usize = 4096;
/// Requests waiting for the database thread; past it, callers wait for room.
const QUEUE: usize = 64;

/// How much the store keeps. Retention runs after every insert: rows stored longer than
/// `max_age` ago go; then, in each namespace the insert added to, that namespace's oldest rows
/// until it fits its quota; then, if the store is over `max_exchanges` or `max_bytes`, the
/// namespaces holding the most are lowered, oldest rows first, to the highest common level at
/// which the store fits (never below the limit divided by the namespaces holding exchanges).
/// So one namespace's pushes never remove another's exchanges while that other holds no more
/// than that level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Default 24 hours. Measured from when the store received an exchange (its own clock, not
    /// the sidecar's). Zero keeps exchanges regardless of age.
    pub max_age: Duration,
    /// Default 100 000.
    pub max_exchanges: u64,
    /// Encoded exchange bytes; default 256 MiB (the file is somewhat larger: indexes, pages).
    pub max_bytes: u64,
    /// Exchanges one namespace (the baseline's) keeps; default 25 000.
    pub namespace_max_exchanges: u64,
    /// Encoded exchange bytes one namespace keeps; default 64 MiB.
    pub namespace_max_bytes: u64,
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
            namespace_max_exchanges: 25_000,
            namespace_max_bytes: 64 * 1024 * 1024,
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
    /// Of those, the ones removed for a namespace's quota or the store's limits.
    pub(crate) evicted: Family<EvictedLabels, Counter>,
    pub(crate) exchanges: Gauge,
    pub(crate) bytes: Gauge,
    /// The store's limits (`Limits::max_exchanges`, `max_bytes`): how near retention by size
    /// is, for alerts.
    pub(crate) max_exchanges: Gauge,
    pub(crate) max_bytes: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct EvictedLabels {
    pub(crate) namespace: String,
    /// `namespace_quota` or `store_limit`.
    pub(crate) reason: &'static str,
}

enum Command {
    Insert(
        String,
        Vec<Exchange>,
        oneshot::Sender<Result<Vec<StoredExchange>, Error>>,
    ),
    Query(
        Filter,
        u32,
        Bodies,
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

    /// Stores the exchanges `source` (who pushed them) has not pushed before, in one
    /// transaction, then applies retention. Each exchange's `id` is the pusher's own: an id
    /// `source` has pushed before is ignored (a re-send), and no other pusher's exchanges are
    /// compared with it. Returns those it stored, as stored: with the store's own id (a number,
    /// never given twice) and bodies cleared when the limits say so. An invalid exchange (no id,
    /// an id longer than [`MAX_ID_LEN`]) refuses the whole batch.
    pub async fn insert(
        &self,
        source: impl Into<String>,
        exchanges: Vec<Exchange>,
    ) -> Result<Vec<StoredExchange>, Error> {
        for e in &exchanges {
            validate_exchange(e)?;
        }
        if exchanges.is_empty() {
            return Ok(Vec::new());
        }
        let source = source.into();
        self.call(|reply| Command::Insert(source, exchanges, reply))
            .await
    }

    /// Stored exchanges matching `filter`, newest start first. `limit` 0 means
    /// [`DEFAULT_QUERY_LIMIT`]; it is capped at [`MAX_QUERY_LIMIT`], and a reply stops early
    /// past [`MAX_REPLY_BYTES`].
    pub async fn query(&self, filter: Filter, limit: u32) -> Result<Vec<StoredExchange>, Error> {
        self.query_with(filter, limit, Bodies::Kept).await
    }

    /// [`Store::query`], with the bodies' bytes left out when `bodies` says so.
    pub async fn query_with(
        &self,
        filter: Filter,
        limit: u32,
        bodies: Bodies,
    ) -> Result<Vec<StoredExchange>, Error> {
        validate_filter(&filter)?;
        self.call(|reply| Command::Query(filter, effective_limit(limit), bodies, reply))
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
    /// Rows and their bytes, in all and per namespace, kept in step with every insert and
    /// delete.
    usage: Usage,
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
        schema::migrate(&conn)?;
        // Once at open; afterwards the totals follow each change.
        let usage = Usage::read(&conn)?;
        let shared = Shared::default();
        shared
            .max_exchanges
            .set(i64::try_from(limits.max_exchanges).unwrap_or(i64::MAX));
        shared
            .max_bytes
            .set(i64::try_from(limits.max_bytes).unwrap_or(i64::MAX));
        let db = Db {
            conn,
            limits,
            clock,
            usage,
            shared: Arc::new(shared),
        };
        db.publish();
        Ok(db)
    }

    fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        while let Some(command) = rx.blocking_recv() {
            match command {
                Command::Insert(source, batch, reply) => {
                    let out = self.insert(&source, batch);
                    if let Err(e) = &out {
                        tracing::warn!(error = %e, "cannot store exchanges");
                    }
                    let _ = reply.send(out);
                }
                Command::Query(filter, limit, bodies, reply) => {
                    let out = self.query(&filter, limit, bodies);
                    if let Err(e) = &out {
                        tracing::warn!(error = %e, "cannot query exchanges");
                    }
                    let _ = reply.send(out);
                }
            }
        }
    }

    fn publish(&self) {
        self.shared.exchanges.set(self.usage.total.count as i64);
        self.shared.bytes.set(self.usage.total.bytes as i64);
    }

    fn insert(&mut self, source: &str, batch: Vec<Exchange>) -> Result<Vec<StoredExchange>, Error> {
        let now = self.clock.now_micros();
        let store_bodies = self.limits.store_bodies;
        let tx = self.conn.transaction().map_err(dbe)?;
        let mut stored = Vec::with_capacity(batch.len());
        let mut usage = self.usage.clone();
        let mut touched = BTreeSet::new();
        {
            let mut insert = tx
                .prepare_cached(
                    "INSERT OR IGNORE INTO exchanges (source, client_id, sandbox, namespace, \
                     workload, method, path, status, routed, start_unix_micros, \
                     stored_unix_micros, size, exchange) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
                )
                .map_err(dbe)?;
            for mut e in batch {
                if !store_bodies {
                    strip_body(e.request_body.as_mut());
                    strip_body(e.response_body.as_mut());
                }
                // The pusher's id lives in client_id; readers see the row's own.
                let client_id = std::mem::take(&mut e.id);
                let blob = e.encode_to_vec();
                let (namespace, workload) = e
                    .baseline
                    .as_ref()
                    .map(|b| (b.namespace.clone(), b.name.clone()))
                    .unwrap_or_default();
                let added = insert
                    .execute(params![
                        source,
                        client_id,
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
                    e.id = tx.last_insert_rowid().to_string();
                    usage.add(&namespace, 1, blob.len() as u64);
                    touched.insert(namespace);
                    stored.push(StoredExchange {
                        exchange: Some(e),
                        stored_unix_micros: now,
                    });
                }
            }
        }
        let evicted = retention::retain(&tx, &self.limits, now, &mut usage, &touched)?;
        tx.commit().map_err(dbe)?;
        // Only now: a failed commit rolled everything back and the totals still hold.
        self.usage = usage;
        for ((namespace, reason), n) in evicted {
            self.shared.retention_dropped.inc_by(n);
            if reason != Reason::Age {
                self.shared
                    .evicted
                    .get_or_create(&EvictedLabels {
                        namespace,
                        reason: reason.label(),
                    })
                    .inc_by(n);
            }
        }
        self.publish();
        Ok(stored)
    }

    fn query(&self, f: &Filter, limit: u32, bodies: Bodies) -> Result<Vec<StoredExchange>, Error> {
        // Bare `?` parameters number themselves in order: each clause pushes its arguments
        // as it adds them.
        let mut sql =
            String::from("SELECT seq, exchange, stored_unix_micros FROM exchanges WHERE 1");
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
            let seq: i64 = row.get(0).map_err(dbe)?;
            let blob: Vec<u8> = row.get(1).map_err(dbe)?;
            let stored_unix_micros: i64 = row.get(2).map_err(dbe)?;
            match Exchange::decode(blob.as_slice()) {
                // The row's id, whatever the blob says (blobs stored before version 2 carry
                // the pusher's).
                Ok(mut e) => {
                    if bodies == Bodies::Left {
                        strip_body(e.request_body.as_mut());
                        strip_body(e.response_body.as_mut());
                    }
                    // What the reply carries: without bodies, far more fit.
                    let size = e.encoded_len();
                    if !out.is_empty() && reply_bytes + size > MAX_REPLY_BYTES {
                        break;
                    }
                    reply_bytes += size;
                    e.id = seq.to_string();
                    out.push(StoredExchange {
                        exchange: Some(e),
                        stored_unix_micros,
                    });
                }
                // Only this store writes the blobs: a bad one is damage, not a reason to fail
                // every query that meets it.
                Err(e) => tracing::warn!(error = %e, "skipping an undecodable stored exchange"),
            }
        }
        Ok(out)
    }
}

/// Whether a query's exchanges keep their bodies' bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bodies {
    Kept,
    Left,
}

fn strip_body(body: Option<&mut spur_proto::traffic::Body>) {
    if let Some(b) = body {
        b.data = Vec::new();
        b.truncated = b.size > 0;
    }
}

#[cfg(test)]
mod tests;
