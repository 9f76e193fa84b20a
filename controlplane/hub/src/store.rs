//! The hub's state: registered clusters and API keys (each credential kept only as its
//! SHA-256), users, sessions and the hub's CA. One SQLite file by default: every change is one
//! transaction in WAL mode with `synchronous = FULL`, so a hub killed at any instant reopens with
//! each change either wholly there or wholly absent; the CLI (`spur-hub cluster add`) writes the
//! same file while the hub runs, and the hub notices other writers through `PRAGMA data_version`
//! ([`Store::data_version`]). Several hub replicas share an external PostgreSQL server instead
//! ([`Store::connect`], `store/postgres.rs`). Every query is written once against [`sql::Sql`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;
use rusqlite::Connection;

use crate::Error;
use sql::{Sql, Sqlite};

mod postgres;
mod schema;
mod sessions;
pub(crate) mod sql;
mod users;

pub use postgres::PostgresSettings;
pub use sessions::SessionScope;
pub use users::{Principal, ScopeChange};

/// Prefix of cluster tokens, so that a leaked one is recognisable (secret scanners, logs).
pub const CLUSTER_TOKEN_PREFIX: &str = "spurc_";
/// Prefix of API keys.
pub const API_KEY_PREFIX: &str = "spurk_";
/// Prefix of browser session tokens (cookies).
pub const SESSION_PREFIX: &str = "spurs_";
/// Prefix of one-time login codes (`spur-hub login-link`).
pub const LOGIN_CODE_PREFIX: &str = "spurl_";

/// Longest cluster or API key name: a DNS label, since a cluster name shows up in URLs.
pub const MAX_NAME: usize = 63;

/// A registered cluster, as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cluster {
    pub name: String,
    pub created: SystemTime,
    /// When the current token was issued.
    pub issued: SystemTime,
    pub revoked: Option<SystemTime>,
    /// The last time a session of this cluster was established.
    pub last_seen: Option<SystemTime>,
}

/// An API key, as listed (never the key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiKey {
    pub name: String,
    /// The hub user it belongs to (None: made before users existed, refused until bound).
    pub user: Option<String>,
    pub created: SystemTime,
    pub revoked: Option<SystemTime>,
}

/// Who a presented cluster token belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterIdentity {
    pub name: String,
    pub issued: SystemTime,
}

/// Where the hub keeps its state.
#[derive(Clone, Debug)]
pub enum Database {
    /// One SQLite file (created when missing): one hub replica, and the CLI beside it.
    Sqlite(PathBuf),
    /// An external PostgreSQL server, shared by every hub replica.
    Postgres(PostgresSettings),
}

/// The database. Cheap to clone; calls block (SQLite is synchronous, and PostgreSQL calls wait
/// for the server): async callers go through `spawn_blocking`.
#[derive(Clone)]
pub struct Store {
    db: Arc<Backend>,
    /// Calls that failed in the database (`database_errors_total`, registered by the server).
    errors: Counter,
}

enum Backend {
    Sqlite(Mutex<Connection>),
    Postgres(Box<postgres::Pg>),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match *self.db {
            Backend::Sqlite(_) => "sqlite",
            Backend::Postgres(_) => "postgres",
        };
        f.debug_struct("Store").field("db", &kind).finish()
    }
}

impl Store {
    /// Opens `db`: [`Store::open`] or [`Store::connect`].
    pub fn open_database(db: &Database) -> Result<Store, Error> {
        match db {
            Database::Sqlite(path) => Store::open(path),
            Database::Postgres(settings) => Store::connect(settings),
        }
    }

    /// Opens (creating when missing) the database at `path`. The file holds the hub's CA key
    /// (when the hub issues its own certificate): it is created readable by its owner only, and
    /// an existing file (or its WAL and shared-memory files) readable by others is narrowed to
    /// that first.
    pub fn open(path: &Path) -> Result<Store, Error> {
        owner_only(path)?;
        let conn = Connection::open(path).map_err(|e| db(path, e))?;
        Self::init(conn).map_err(|e| match e {
            Error::Db(m) => Error::Db(format!("{}: {m}", path.display())),
            e => e,
        })
    }

    /// An in-memory database, for tests.
    pub fn in_memory() -> Result<Store, Error> {
        let conn = Connection::open_in_memory().map_err(|e| Error::Db(e.to_string()))?;
        Self::init(conn)
    }

    /// Connects to a PostgreSQL server and brings its schema up to date (under a lock, so
    /// replicas starting together migrate once).
    pub fn connect(settings: &PostgresSettings) -> Result<Store, Error> {
        let pg = postgres::Pg::connect(settings)?;
        pg.migrate(schema::migrate_postgres)?;
        Ok(Store {
            db: Arc::new(Backend::Postgres(Box::new(pg))),
            errors: Counter::default(),
        })
    }

    fn init(conn: Connection) -> Result<Store, Error> {
        let e = |e: rusqlite::Error| Error::Db(e.to_string());
        // Another writer (the CLI) may hold the lock for a moment: wait rather than fail.
        conn.busy_timeout(Duration::from_secs(5)).map_err(e)?;
        // WAL: readers never block the writer; FULL: a commit is on disk before it returns.
        conn.pragma_update(None, "journal_mode", "WAL").map_err(e)?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(e)?;
        conn.pragma_update(None, "foreign_keys", "ON").map_err(e)?;
        schema::migrate_sqlite(&conn)?;
        Ok(Store {
            db: Arc::new(Backend::Sqlite(Mutex::new(conn))),
            errors: Counter::default(),
        })
    }

    fn sqlite(m: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite inconsistent (transactions roll
        // back on drop), so a poisoned lock is still usable.
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The count of calls that failed in the database (unreachable, timed out, a conflict that
    /// did not resolve), for the server's `/metrics`: previews, logins and registry commands
    /// fail with them.
    pub fn database_errors(&self) -> Counter {
        self.errors.clone()
    }

    /// Counts a call's database error.
    fn counted<T>(&self, r: Result<T, Error>) -> Result<T, Error> {
        // Unavailable: PostgreSQL did not answer within the call's deadline.
        if let Err(Error::Db(_) | Error::Unavailable(_)) = &r {
            self.errors.inc();
        }
        r
    }

    /// Runs `f` on the connection: for single statements and reads.
    fn read<T>(&self, f: impl FnOnce(&mut dyn Sql) -> Result<T, Error>) -> Result<T, Error> {
        self.counted(match &*self.db {
            Backend::Sqlite(m) => f(&mut Sqlite(&Self::sqlite(m))),
            Backend::Postgres(pg) => pg.read(f),
        })
    }

    /// Runs `f`, which only reads, in one transaction: its reads see one state.
    fn snapshot<T>(&self, f: impl FnOnce(&mut dyn Sql) -> Result<T, Error>) -> Result<T, Error> {
        self.counted(match &*self.db {
            Backend::Sqlite(m) => {
                let mut conn = Self::sqlite(m);
                conn.transaction()
                    .map_err(dbe)
                    .and_then(|tx| f(&mut Sqlite(&tx)))
            }
            Backend::Postgres(pg) => pg.snapshot(f),
        })
    }

    /// Runs `f` in one transaction and commits it. On PostgreSQL `f` may run more than once
    /// (a conflicting concurrent transaction makes it start again), so it only touches the
    /// database.
    fn write<T>(&self, mut f: impl FnMut(&mut dyn Sql) -> Result<T, Error>) -> Result<T, Error> {
        self.counted(match &*self.db {
            Backend::Sqlite(m) => {
                let mut conn = Self::sqlite(m);
                // IMMEDIATE: the write lock is taken at the start (waiting up to the busy
                // timeout for another writer), so a read-then-write never meets a commit of
                // the CLI's in between (SQLITE_BUSY_SNAPSHOT, which no timeout retries).
                conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                    .map_err(dbe)
                    .and_then(|tx| {
                        let v = f(&mut Sqlite(&tx))?;
                        tx.commit().map_err(dbe)?;
                        Ok(v)
                    })
            }
            Backend::Postgres(pg) => pg.write(f),
        })
    }

    /// Registers `name` and returns its token (shown once; only its hash is kept). A revoked
    /// name is registered again with a new token; an active one is refused unless `rotate`, in
    /// which case the old token stops working and sessions made with it are closed.
    pub fn add_cluster(&self, name: &str, rotate: bool) -> Result<String, Error> {
        check_name("cluster", name)?;
        let token = new_secret(CLUSTER_TOKEN_PREFIX)?;
        let hash = sha256(&token);
        let now = now_ms();
        self.write(|tx| {
            let existing = tx.row(
                "SELECT revoked_ms FROM clusters WHERE name = ?1",
                &[name.into()],
            )?;
            match existing {
                None => {
                    tx.exec(
                        "INSERT INTO clusters (name, token_hash, issued_ms, created_ms) \
                         VALUES (?1, ?2, ?3, ?3)",
                        &[name.into(), (&hash).into(), now.into()],
                    )?;
                }
                Some(r) if r.opt_int(0)?.is_none() && !rotate => {
                    return Err(Error::Conflict(format!(
                        "cluster {name:?} is already registered; `spur-hub cluster add {name} \
                         --rotate` issues a new token, `spur-hub cluster revoke {name}` removes it"
                    )));
                }
                Some(_) => {
                    tx.exec(
                        "UPDATE clusters SET token_hash = ?2, issued_ms = ?3, revoked_ms = NULL \
                         WHERE name = ?1",
                        &[name.into(), (&hash).into(), now.into()],
                    )?;
                }
            }
            Ok(())
        })?;
        Ok(token)
    }

    /// Revokes `name`: its token stops working and the hub closes its sessions. Returns whether
    /// it was active.
    pub fn revoke_cluster(&self, name: &str) -> Result<bool, Error> {
        let now = now_ms();
        self.write(|tx| {
            let known = tx.row(
                "SELECT revoked_ms FROM clusters WHERE name = ?1",
                &[name.into()],
            )?;
            match known {
                None => Err(Error::NotFound(format!("no cluster named {name:?}"))),
                Some(r) if r.opt_int(0)?.is_some() => Ok(false),
                Some(_) => {
                    tx.exec(
                        "UPDATE clusters SET revoked_ms = ?2 WHERE name = ?1",
                        &[name.into(), now.into()],
                    )?;
                    Ok(true)
                }
            }
        })
    }

    pub fn clusters(&self) -> Result<Vec<Cluster>, Error> {
        let rows = self.read(|c| {
            c.rows(
                "SELECT name, created_ms, issued_ms, revoked_ms, last_seen_ms FROM clusters \
                 ORDER BY name",
                &[],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(Cluster {
                    name: r.text(0)?,
                    created: at(r.int(1)?),
                    issued: at(r.int(2)?),
                    revoked: r.opt_int(3)?.map(at),
                    last_seen: r.opt_int(4)?.map(at),
                })
            })
            .collect()
    }

    /// The active cluster `token` belongs to, if any.
    pub fn cluster_for_token(&self, token: &str) -> Result<Option<ClusterIdentity>, Error> {
        if !token.starts_with(CLUSTER_TOKEN_PREFIX) {
            return Ok(None);
        }
        let hash = sha256(token);
        let row = self.read(|c| {
            c.row(
                "SELECT name, issued_ms FROM clusters WHERE token_hash = ?1 AND revoked_ms IS NULL",
                &[(&hash).into()],
            )
        })?;
        row.map(|r| {
            Ok(ClusterIdentity {
                name: r.text(0)?,
                issued: at(r.int(1)?),
            })
        })
        .transpose()
    }

    /// Whether a session of `cluster` authenticated with a token issued at `issued` may stay:
    /// the cluster is active and its token has not been rotated since.
    pub fn session_valid(&self, cluster: &str, issued: SystemTime) -> Result<bool, Error> {
        let row = self.read(|c| {
            c.row(
                "SELECT issued_ms FROM clusters WHERE name = ?1 AND revoked_ms IS NULL",
                &[cluster.into()],
            )
        })?;
        Ok(match row {
            Some(r) => at(r.int(0)?) == issued,
            None => false,
        })
    }

    /// Every active cluster with when its current token was issued: what the sessions of
    /// connected clusters are checked against, in one query.
    pub fn active_clusters(&self) -> Result<std::collections::HashMap<String, SystemTime>, Error> {
        let rows = self.read(|c| {
            c.rows(
                "SELECT name, issued_ms FROM clusters WHERE revoked_ms IS NULL",
                &[],
            )
        })?;
        rows.iter()
            .map(|r| Ok((r.text(0)?, at(r.int(1)?))))
            .collect()
    }

    /// Records that `cluster` connected now.
    pub fn touch_cluster(&self, cluster: &str) -> Result<(), Error> {
        let now = now_ms();
        self.read(|c| {
            c.exec(
                "UPDATE clusters SET last_seen_ms = ?2 WHERE name = ?1",
                &[cluster.into(), now.into()],
            )
        })?;
        Ok(())
    }

    /// Creates API key `name` for hub user `user` and returns the key (shown once).
    pub fn add_api_key(&self, name: &str, user: &str) -> Result<String, Error> {
        check_name("API key", name)?;
        let key = new_secret(API_KEY_PREFIX)?;
        let hash = sha256(&key);
        let now = now_ms();
        let inserted = self.write(|tx| {
            users::require_user(tx, user)?;
            tx.exec(
                "INSERT INTO api_keys (name, key_hash, created_ms, user_name) \
                 VALUES (?1, ?2, ?3, ?4) ON CONFLICT (name) DO NOTHING",
                &[name.into(), (&hash).into(), now.into(), user.into()],
            )
        })?;
        if inserted == 0 {
            return Err(Error::Conflict(format!(
                "an API key named {name:?} exists (revoked keys keep their name for the audit)"
            )));
        }
        Ok(key)
    }

    pub fn revoke_api_key(&self, name: &str) -> Result<bool, Error> {
        let now = now_ms();
        self.write(|tx| {
            let n = tx.exec(
                "UPDATE api_keys SET revoked_ms = ?2 WHERE name = ?1 AND revoked_ms IS NULL",
                &[name.into(), now.into()],
            )?;
            if n == 1 {
                return Ok(true);
            }
            if tx.exists("SELECT 1 FROM api_keys WHERE name = ?1", &[name.into()])? {
                Ok(false)
            } else {
                Err(Error::NotFound(format!("no API key named {name:?}")))
            }
        })
    }

    pub fn api_keys(&self) -> Result<Vec<ApiKey>, Error> {
        let rows = self.read(|c| {
            c.rows(
                "SELECT name, created_ms, revoked_ms, user_name FROM api_keys ORDER BY name",
                &[],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(ApiKey {
                    name: r.text(0)?,
                    created: at(r.int(1)?),
                    revoked: r.opt_int(2)?.map(at),
                    user: r.opt_text(3)?,
                })
            })
            .collect()
    }

    /// The name of the active API key `key`, if it is one.
    pub fn api_key_name(&self, key: &str) -> Result<Option<String>, Error> {
        if !key.starts_with(API_KEY_PREFIX) {
            return Ok(None);
        }
        let hash = sha256(key);
        self.read(|c| {
            c.row(
                "SELECT name FROM api_keys WHERE key_hash = ?1 AND revoked_ms IS NULL",
                &[(&hash).into()],
            )
        })?
        .map(|r| r.text(0))
        .transpose()
    }

    /// The hub's CA (certificate and key, PEM), made by `create` on first use. Two hubs
    /// starting at once on one database agree: the insert is conditional and the winner is
    /// read back.
    pub fn ca_or_create(
        &self,
        create: impl FnOnce() -> Result<(String, String), Error>,
    ) -> Result<(String, String), Error> {
        let read = |c: &mut dyn Sql| -> Result<Option<(String, String)>, Error> {
            c.row("SELECT cert_pem, key_pem FROM ca WHERE id = 1", &[])?
                .map(|r| Ok((r.text(0)?, r.text(1)?)))
                .transpose()
        };
        if let Some(ca) = self.read(read)? {
            return Ok(ca);
        }
        let (cert, key) = create()?;
        self.read(|c| {
            c.exec(
                "INSERT INTO ca (id, cert_pem, key_pem) VALUES (1, ?1, ?2) ON CONFLICT DO NOTHING",
                &[(&cert).into(), (&key).into()],
            )?;
            read(c)?.ok_or_else(|| Error::Db("the CA row vanished".into()))
        })
    }

    /// A number that changes whenever another connection (the CLI) commits to a SQLite file;
    /// None on PostgreSQL, where any replica or the CLI may have changed anything at any time:
    /// callers check every time.
    pub fn data_version(&self) -> Result<Option<i64>, Error> {
        match &*self.db {
            Backend::Sqlite(m) => Self::sqlite(m)
                .pragma_query_value(None, "data_version", |r| r.get(0))
                .map(Some)
                .map_err(dbe),
            Backend::Postgres(_) => Ok(None),
        }
    }

    /// Every table of the schema with its columns, in order (both dialects must agree: a test
    /// compares them).
    pub fn schema_columns(&self) -> Result<Vec<(String, Vec<String>)>, Error> {
        let sql = match &*self.db {
            Backend::Sqlite(_) => {
                "SELECT m.name, p.name FROM sqlite_master m, pragma_table_info(m.name) p \
                 WHERE m.type = 'table' ORDER BY m.name, p.cid"
            }
            Backend::Postgres(_) => {
                "SELECT table_name::text, column_name::text FROM information_schema.columns \
                 WHERE table_schema = current_schema() AND table_name <> 'spur_hub_schema' \
                 ORDER BY table_name, ordinal_position"
            }
        };
        let rows = self.read(|c| c.rows(sql, &[]))?;
        let mut out: Vec<(String, Vec<String>)> = Vec::new();
        for r in rows {
            let (table, column) = (r.text(0)?, r.text(1)?);
            match out.last_mut() {
                Some((t, cols)) if *t == table => cols.push(column),
                _ => out.push((table, vec![column])),
            }
        }
        Ok(out)
    }
}

/// Creates `path` with mode 0600 when missing, and takes group and other permissions away from
/// it and its `-wal` and `-shm` files when present (SQLite gives those the main file's mode).
fn owner_only(path: &Path) -> Result<(), Error> {
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let io = |p: &Path, e: std::io::Error| Error::Db(format!("{}: {e}", p.display()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(path, e)),
    }
    let mut name = path.as_os_str().to_owned();
    let mut wal = name.clone();
    wal.push("-wal");
    name.push("-shm");
    for p in [path, Path::new(&wal), Path::new(&name)] {
        let mode = match std::fs::metadata(p) {
            Ok(m) => m.permissions().mode(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(p, e)),
        };
        if mode & 0o077 != 0 {
            tracing::warn!(
                file = %p.display(),
                mode = format!("{:o}", mode & 0o777),
                "the hub's database was readable by others (it holds the CA key): narrowed to 0600"
            );
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode & 0o700))
                .map_err(|e| io(p, e))?;
        }
    }
    Ok(())
}

/// SQLite's `PRAGMA integrity_check` of the file at `path`: `"ok"` when sound.
pub fn integrity_check(path: &Path) -> Result<String, Error> {
    let conn = Connection::open(path).map_err(|e| db(path, e))?;
    conn.pragma_query_value(None, "integrity_check", |r| r.get(0))
        .map_err(|e| db(path, e))
}

fn check_name(what: &str, name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "{what} name {name:?}: use 1 to {MAX_NAME} lowercase letters, digits and '-', \
             not starting or ending with '-'"
        )))
    }
}

/// `prefix` + 32 random bytes as lowercase hex.
fn new_secret(prefix: &str) -> Result<String, Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| Error::Invalid(format!("no randomness: {e}")))?;
    let mut s = String::with_capacity(prefix.len() + 64);
    s.push_str(prefix);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    Ok(s)
}

pub(crate) fn sha256(secret: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, secret.as_bytes()).as_ref());
    out
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn at(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

fn dbe(e: rusqlite::Error) -> Error {
    Error::Db(e.to_string())
}

fn db(path: &Path, e: rusqlite::Error) -> Error {
    Error::Db(format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn clusters_register_authenticate_rotate_and_revoke() {
        let s = Store::in_memory().unwrap();
        let t1 = s.add_cluster("east", false).unwrap();
        assert!(t1.starts_with(CLUSTER_TOKEN_PREFIX) && t1.len() == 6 + 64);
        let id = s.cluster_for_token(&t1).unwrap().unwrap();
        assert_eq!(id.name, "east");
        assert!(s.session_valid("east", id.issued).unwrap());
        assert!(matches!(
            s.add_cluster("east", false),
            Err(Error::Conflict(_))
        ));
        assert_eq!(s.cluster_for_token("spurc_00").unwrap(), None);
        assert_eq!(s.cluster_for_token("").unwrap(), None);

        std::thread::sleep(Duration::from_millis(2));
        let t2 = s.add_cluster("east", true).unwrap();
        assert_eq!(
            s.cluster_for_token(&t1).unwrap(),
            None,
            "rotated token still works"
        );
        assert!(!s.session_valid("east", id.issued).unwrap());
        let id2 = s.cluster_for_token(&t2).unwrap().unwrap();

        assert!(s.revoke_cluster("east").unwrap());
        assert!(!s.revoke_cluster("east").unwrap());
        assert_eq!(s.cluster_for_token(&t2).unwrap(), None);
        assert!(!s.session_valid("east", id2.issued).unwrap());
        assert!(matches!(s.revoke_cluster("west"), Err(Error::NotFound(_))));
        let listed = s.clusters().unwrap();
        assert_eq!(listed.len(), 1);
        assert!(listed[0].revoked.is_some());
        // A revoked name can be registered again.
        let t3 = s.add_cluster("east", false).unwrap();
        assert!(s.cluster_for_token(&t3).unwrap().is_some());
    }

    #[test]
    fn names_are_dns_labels() {
        let s = Store::in_memory().unwrap();
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", &"a".repeat(64), "ä"] {
            assert!(
                matches!(s.add_cluster(bad, false), Err(Error::Invalid(_))),
                "{bad}"
            );
            assert!(
                matches!(s.add_api_key(bad, "u"), Err(Error::Invalid(_))),
                "{bad}"
            );
            assert!(matches!(s.add_user(bad), Err(Error::Invalid(_))), "{bad}");
        }
    }

    #[test]
    fn api_keys() {
        let s = Store::in_memory().unwrap();
        s.add_user("ci").unwrap();
        let k = s.add_api_key("ci", "ci").unwrap();
        assert_eq!(s.api_key_name(&k).unwrap().as_deref(), Some("ci"));
        assert!(matches!(s.add_api_key("ci", "ci"), Err(Error::Conflict(_))));
        // A cluster token is not an API key, even with a matching hash table.
        let t = s.add_cluster("c", false).unwrap();
        assert_eq!(s.api_key_name(&t).unwrap(), None);
        assert!(s.revoke_api_key("ci").unwrap());
        assert_eq!(s.api_key_name(&k).unwrap(), None);
        assert!(!s.revoke_api_key("ci").unwrap());
        assert!(matches!(s.revoke_api_key("x"), Err(Error::NotFound(_))));
    }

    #[test]
    fn state_survives_reopen_and_other_writers_are_seen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub.db");
        let hub = Store::open(&path).unwrap();
        let cli = Store::open(&path).unwrap();
        let v0 = hub.data_version().unwrap().unwrap();
        let token = cli.add_cluster("east", false).unwrap();
        assert_ne!(
            hub.data_version().unwrap().unwrap(),
            v0,
            "the hub does not see the CLI's write"
        );
        assert!(hub.cluster_for_token(&token).unwrap().is_some());
        drop((hub, cli));
        let again = Store::open(&path).unwrap();
        assert_eq!(again.clusters().unwrap()[0].name, "east");
    }

    #[test]
    fn a_version_1_file_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub.db");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(schema::SCHEMA_V1).unwrap();
            conn.pragma_update(None, "user_version", 1).unwrap();
            conn.execute(
                "INSERT INTO api_keys (name, key_hash, created_ms) VALUES ('old', x'00', 1)",
                [],
            )
            .unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.api_keys().unwrap()[0].name, "old");
        assert!(
            s.create_session("old", Duration::from_secs(5), SessionScope::Web)
                .is_ok()
        );
    }

    /// Issue 42, point 5: a key made before hub users existed belongs to nobody after the
    /// migration, and sees nothing until an admin binds it; its old sessions end.
    #[test]
    fn a_version_3_key_belongs_to_nobody_until_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub.db");
        let key = "spurk_0123";
        {
            let conn = Connection::open(&path).unwrap();
            for m in &schema::SQLITE_MIGRATIONS[..3] {
                conn.execute_batch(m).unwrap();
            }
            conn.pragma_update(None, "user_version", 3).unwrap();
            conn.execute(
                "INSERT INTO api_keys (name, key_hash, created_ms) VALUES ('old', ?1, 1)",
                [sha256(key)],
            )
            .unwrap();
            conn.execute(
                "INSERT INTO sessions (token_hash, key_name, created_ms, expires_ms) \
                 VALUES (x'00', 'old', 1, 99999999999999)",
                [],
            )
            .unwrap();
        }
        let s = Store::open(&path).unwrap();
        let p = s.principal_for_key(key).unwrap().unwrap();
        assert_eq!((p.key.as_str(), p.user), ("old", None));
        assert_eq!(s.unbound_api_keys().unwrap(), vec!["old".to_string()]);
        let sessions = s
            .read(|c| c.row("SELECT count(*) FROM sessions", &[]))
            .unwrap()
            .unwrap()
            .int(0)
            .unwrap();
        assert_eq!(sessions, 0);
        s.add_user("ops").unwrap();
        s.bind_api_key("old", "ops").unwrap();
        let p = s.principal_for_key(key).unwrap().unwrap();
        assert_eq!(p.user.unwrap().name, "ops");
        assert!(s.unbound_api_keys().unwrap().is_empty());
    }

    /// Issue 42, point 2: the file holds the CA key, and was created with the umask's mode
    /// (0644 under the usual 022): readable by every local user.
    #[test]
    fn the_file_is_readable_by_its_owner_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub.db");
        let s = Store::open(&path).unwrap();
        s.ca_or_create(|| Ok(("cert".into(), "key".into())))
            .unwrap();
        s.add_user("dev").unwrap();
        s.add_api_key("dev", "dev").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        let wal = dir.path().join("hub.db-wal");
        assert!(!wal.exists() || mode(&wal) == 0o600, "{:o}", mode(&wal));
        drop(s);
        // A file made readable by others (an old hub, a copy) is narrowed when opened.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        drop(Store::open(&path).unwrap());
        assert_eq!(mode(&path), 0o600);
    }

    #[test]
    fn the_ca_is_made_once() {
        let s = Store::in_memory().unwrap();
        let a = s.ca_or_create(|| Ok(("c1".into(), "k1".into()))).unwrap();
        let b = s.ca_or_create(|| Ok(("c2".into(), "k2".into()))).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.0, "c1");
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub.db");
        drop(Store::open(&path).unwrap());
        Connection::open(&path)
            .unwrap()
            .pragma_update(None, "user_version", 99)
            .unwrap();
        let err = Store::open(&path).unwrap_err().to_string();
        assert!(err.contains("newer"), "{err}");
    }
}
