//! The schema in both dialects and the migrations that bring a database to it. SQLite keeps its
//! version in `PRAGMA user_version`; PostgreSQL in the one-row table `spur_hub_schema`. Both
//! end at [`SCHEMA_VERSION`] with the same tables and columns (a test compares them), so the
//! store's queries are written once. A database at a newer version is refused, not misread.

use super::sql::{Sql, Value};
use crate::Error;

/// The schema version this hub reads and writes.
pub(crate) const SCHEMA_VERSION: i64 = 4;

/// SQLite migrations, in order: entry `i` takes a file from version `i` to `i + 1`.
pub(crate) const SQLITE_MIGRATIONS: [&str; 4] = [SCHEMA_V1, SESSIONS_V2, LOGIN_CODES_V3, USERS_V4];

pub(crate) const SCHEMA_V1: &str = "
CREATE TABLE clusters (
    name        TEXT PRIMARY KEY NOT NULL,
    token_hash  BLOB NOT NULL UNIQUE,
    -- When the current token was issued (unix ms): a rotated token ends older sessions.
    issued_ms   INTEGER NOT NULL,
    created_ms  INTEGER NOT NULL,
    revoked_ms  INTEGER,
    last_seen_ms INTEGER
) STRICT;
-- The hub's own CA (one row): it signs the serving certificate when the user brings none.
CREATE TABLE ca (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    cert_pem    TEXT NOT NULL,
    key_pem     TEXT NOT NULL
) STRICT;
CREATE TABLE api_keys (
    name        TEXT PRIMARY KEY NOT NULL,
    key_hash    BLOB NOT NULL UNIQUE,
    created_ms  INTEGER NOT NULL,
    revoked_ms  INTEGER
) STRICT;
";

/// Browser sessions (the cookie set at login), each tied to the API key that logged in: revoking
/// the key ends them.
const SESSIONS_V2: &str = "
CREATE TABLE sessions (
    token_hash  BLOB PRIMARY KEY NOT NULL,
    key_name    TEXT NOT NULL REFERENCES api_keys (name),
    created_ms  INTEGER NOT NULL,
    expires_ms  INTEGER NOT NULL
) STRICT;
";

/// One-time login codes get a table of their own (before, a code was a session row and so
/// worked as a cookie), and each session says which cookie it belongs to: the web view's or the
/// previews'. Every older session ends: the web view's cookie has a new name, and an old login
/// code cannot be told from a session.
const LOGIN_CODES_V3: &str = "
CREATE TABLE login_codes (
    code_hash   BLOB PRIMARY KEY NOT NULL,
    key_name    TEXT NOT NULL REFERENCES api_keys (name),
    created_ms  INTEGER NOT NULL,
    expires_ms  INTEGER NOT NULL
) STRICT;
DELETE FROM sessions;
ALTER TABLE sessions ADD COLUMN scope TEXT NOT NULL DEFAULT 'web'
    CHECK (scope IN ('web', 'preview'));
";

/// Users, their per-cluster scopes, and each key's user. Keys made before this version have no
/// user: they are refused (with a message naming `spur-hub apikey bind`) until an admin binds
/// them, rather than given a scope nobody chose. Sessions of such keys end with it.
const USERS_V4: &str = "
CREATE TABLE users (
    name        TEXT PRIMARY KEY NOT NULL,
    created_ms  INTEGER NOT NULL
) STRICT;
CREATE TABLE user_scopes (
    user_name   TEXT NOT NULL REFERENCES users (name) ON DELETE CASCADE,
    -- A cluster's name, or '*' for every cluster not named on its own.
    cluster     TEXT NOT NULL,
    -- JSON: \"*\" (all) or an array of namespace names.
    namespaces  TEXT NOT NULL,
    -- NULL: the hub user's name.
    kube_user   TEXT,
    kube_groups TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (user_name, cluster)
) STRICT;
ALTER TABLE api_keys ADD COLUMN user_name TEXT;
DELETE FROM sessions;
DELETE FROM login_codes;
";

/// PostgreSQL migrations: (the version a step ends at, its SQL). Version 4 is the first on
/// PostgreSQL, whole: the same tables as SQLite's versions 1 to 4 (BIGINT for INTEGER, BYTEA
/// for BLOB). A later version adds one step here and one to [`SQLITE_MIGRATIONS`].
pub(crate) const POSTGRES_MIGRATIONS: [(i64, &str); 1] = [(4, POSTGRES_V4)];

const POSTGRES_V4: &str = "
CREATE TABLE clusters (
    name         TEXT PRIMARY KEY NOT NULL,
    token_hash   BYTEA NOT NULL UNIQUE,
    issued_ms    BIGINT NOT NULL,
    created_ms   BIGINT NOT NULL,
    revoked_ms   BIGINT,
    last_seen_ms BIGINT
);
CREATE TABLE ca (
    id          BIGINT PRIMARY KEY CHECK (id = 1),
    cert_pem    TEXT NOT NULL,
    key_pem     TEXT NOT NULL
);
CREATE TABLE api_keys (
    name        TEXT PRIMARY KEY NOT NULL,
    key_hash    BYTEA NOT NULL UNIQUE,
    created_ms  BIGINT NOT NULL,
    revoked_ms  BIGINT,
    user_name   TEXT
);
CREATE TABLE sessions (
    token_hash  BYTEA PRIMARY KEY NOT NULL,
    key_name    TEXT NOT NULL REFERENCES api_keys (name),
    created_ms  BIGINT NOT NULL,
    expires_ms  BIGINT NOT NULL,
    scope       TEXT NOT NULL DEFAULT 'web' CHECK (scope IN ('web', 'preview'))
);
CREATE TABLE login_codes (
    code_hash   BYTEA PRIMARY KEY NOT NULL,
    key_name    TEXT NOT NULL REFERENCES api_keys (name),
    created_ms  BIGINT NOT NULL,
    expires_ms  BIGINT NOT NULL
);
CREATE TABLE users (
    name        TEXT PRIMARY KEY NOT NULL,
    created_ms  BIGINT NOT NULL
);
CREATE TABLE user_scopes (
    user_name   TEXT NOT NULL REFERENCES users (name) ON DELETE CASCADE,
    cluster     TEXT NOT NULL,
    namespaces  TEXT NOT NULL,
    kube_user   TEXT,
    kube_groups TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (user_name, cluster)
);
";

fn newer(version: i64) -> Error {
    Error::Db(format!(
        "schema version {version} is newer than this hub understands ({SCHEMA_VERSION}); run a \
         newer spur"
    ))
}

/// Brings a SQLite file to [`SCHEMA_VERSION`]: each step and its version in one transaction,
/// so a kill in between leaves the file at the previous version and the next start runs the
/// step again.
pub(crate) fn migrate_sqlite(conn: &rusqlite::Connection) -> Result<(), Error> {
    let e = |e: rusqlite::Error| Error::Db(e.to_string());
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(e)?;
    if version > SCHEMA_VERSION {
        return Err(newer(version));
    }
    for (from, migration) in SQLITE_MIGRATIONS
        .iter()
        .enumerate()
        .skip(version.max(0) as usize)
    {
        let tx = conn.unchecked_transaction().map_err(e)?;
        tx.execute_batch(migration).map_err(e)?;
        tx.pragma_update(None, "user_version", from as i64 + 1)
            .map_err(e)?;
        tx.commit().map_err(e)?;
    }
    Ok(())
}

/// Brings a PostgreSQL database to [`SCHEMA_VERSION`], in the one transaction (holding the
/// schema's advisory lock) that `sql` is: replicas starting together migrate once.
pub(crate) fn migrate_postgres(sql: &mut dyn Sql) -> Result<(), Error> {
    sql.exec(
        "CREATE TABLE IF NOT EXISTS spur_hub_schema (
            id      BIGINT PRIMARY KEY CHECK (id = 1),
            version BIGINT NOT NULL
        )",
        &[],
    )?;
    let version = match sql.row("SELECT version FROM spur_hub_schema WHERE id = 1", &[])? {
        Some(r) => r.int(0)?,
        None => 0,
    };
    if version > SCHEMA_VERSION {
        return Err(newer(version));
    }
    for (to, migration) in POSTGRES_MIGRATIONS {
        if to <= version {
            continue;
        }
        // Statements one at a time: the extended protocol runs one per message.
        for statement in migration
            .split(';')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            sql.exec(statement, &[])?;
        }
        sql.exec(
            "INSERT INTO spur_hub_schema (id, version) VALUES (1, ?1) \
             ON CONFLICT (id) DO UPDATE SET version = excluded.version",
            &[Value::Int(to)],
        )?;
    }
    Ok(())
}
