//! The database's schema and its migrations (`PRAGMA user_version`).
//!
//! Version 2 (issue 42) makes ids the store's own: `seq`, never reused, is the id readers see;
//! what a pusher called an exchange is kept only to recognise a re-sent one, and only among
//! that pusher's own exchanges (`source`), so no pusher can choose an id that touches another's
//! record.

use rusqlite::Connection;

use super::dbe;
use crate::Error;

/// Schema version in `PRAGMA user_version`; a newer file is refused rather than misread.
pub(super) const SCHEMA_VERSION: i64 = 2;

/// The table (without its indexes) as version 2 has it.
const TABLE_V2: &str = "
CREATE TABLE exchanges (
    -- The exchange's id as readers see it, and insertion order: retention removes the lowest
    -- first. AUTOINCREMENT: an id is never given twice, even once its row is gone.
    seq                 INTEGER PRIMARY KEY AUTOINCREMENT,
    -- Who pushed it (a pod's uid; standalone, the pod the sidecar named) and the pusher's own
    -- id for it: a re-sent exchange is ignored, among that pusher's exchanges only.
    source              TEXT NOT NULL,
    client_id           TEXT NOT NULL,
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
    exchange            BLOB NOT NULL,
    UNIQUE (source, client_id)
) STRICT;
";

const INDEXES_V2: &str = "
CREATE INDEX exchanges_start ON exchanges (start_unix_micros);
CREATE INDEX exchanges_sandbox ON exchanges (sandbox, start_unix_micros);
CREATE INDEX exchanges_workload ON exchanges (namespace, workload, start_unix_micros);
CREATE INDEX exchanges_stored ON exchanges (stored_unix_micros);
-- A namespace's oldest first: what its quota removes.
CREATE INDEX exchanges_namespace ON exchanges (namespace, seq);
";

/// Version 1 to 2: the pusher's id becomes `client_id` (source unknown: empty), its row's
/// `seq` its id. The v1 table is copied, since SQLite cannot drop its `UNIQUE (id)`.
const V1_TO_V2: &str = "
ALTER TABLE exchanges RENAME TO exchanges_v1;
DROP INDEX exchanges_start;
DROP INDEX exchanges_sandbox;
DROP INDEX exchanges_workload;
DROP INDEX exchanges_stored;
";

const COPY_V1: &str = "
INSERT INTO exchanges (seq, source, client_id, sandbox, namespace, workload, method, path,
    status, routed, start_unix_micros, stored_unix_micros, size, exchange)
SELECT seq, '', id, sandbox, namespace, workload, method, path, status, routed,
    start_unix_micros, stored_unix_micros, size, exchange FROM exchanges_v1;
DROP TABLE exchanges_v1;
";

/// Brings `conn`'s database to [`SCHEMA_VERSION`], in one transaction.
pub(super) fn migrate(conn: &Connection) -> Result<(), Error> {
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(dbe)?;
    if version > SCHEMA_VERSION {
        return Err(Error::Db(format!(
            "schema version {version} is newer than this store understands \
             ({SCHEMA_VERSION}); run a newer spur"
        )));
    }
    if version == SCHEMA_VERSION {
        return Ok(());
    }
    let tx = conn.unchecked_transaction().map_err(dbe)?;
    if version == 1 {
        tx.execute_batch(V1_TO_V2).map_err(dbe)?;
        tx.execute_batch(TABLE_V2).map_err(dbe)?;
        tx.execute_batch(COPY_V1).map_err(dbe)?;
    } else {
        tx.execute_batch(TABLE_V2).map_err(dbe)?;
    }
    tx.execute_batch(INDEXES_V2).map_err(dbe)?;
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)
        .map_err(dbe)?;
    tx.commit().map_err(dbe)
}

/// Version 1's schema, for the migration's test.
#[cfg(test)]
pub(super) const SCHEMA_V1: &str = "
CREATE TABLE exchanges (
    seq                 INTEGER PRIMARY KEY,
    id                  TEXT NOT NULL UNIQUE,
    sandbox             TEXT NOT NULL,
    namespace           TEXT NOT NULL,
    workload            TEXT NOT NULL,
    method              TEXT NOT NULL,
    path                TEXT NOT NULL,
    status              INTEGER NOT NULL,
    routed              INTEGER NOT NULL,
    start_unix_micros   INTEGER NOT NULL,
    stored_unix_micros  INTEGER NOT NULL,
    size                INTEGER NOT NULL,
    exchange            BLOB NOT NULL
) STRICT;
CREATE INDEX exchanges_start ON exchanges (start_unix_micros);
CREATE INDEX exchanges_sandbox ON exchanges (sandbox, start_unix_micros);
CREATE INDEX exchanges_workload ON exchanges (namespace, workload, start_unix_micros);
CREATE INDEX exchanges_stored ON exchanges (stored_unix_micros);
PRAGMA user_version = 1;
";
