//! The demo app's database mode (`--database-url`): rows in one PostgreSQL table, so an
//! end-to-end test can tell which database a request's answering pod writes to (a sandbox's fork
//! gets a database of its own).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

/// Bound on connecting to one host, unless the URL sets its own `connect_timeout`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on one database operation, connecting included: a stuck server costs a request 503,
/// not a hung connection.
const OP_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest value `POST /rows` stores, in bytes.
pub(super) const VALUE_LIMIT: usize = 4096;

/// Run on every new connection, so a table dropped (or a database swapped) behind the app's back
/// comes back with the next connection. The advisory lock keeps two replicas starting together
/// from racing in CREATE TABLE (the loser would fail on pg_type's unique index); the existence
/// check comes first because since PostgreSQL 15 a user that is not the database's owner may not
/// create in `public`, and `CREATE TABLE IF NOT EXISTS` checks that right even when the table is
/// there.
const CREATE_TABLE: &str = "BEGIN;
SELECT pg_advisory_xact_lock(7500914553620295025);
DO $$ BEGIN
  IF to_regclass('spur_demo_rows') IS NULL THEN
    CREATE TABLE spur_demo_rows (
      id bigserial PRIMARY KEY,
      value text NOT NULL,
      written_by text NOT NULL,
      at timestamptz DEFAULT now()
    );
  END IF;
END $$;
COMMIT;";

const INSERT: &str = "INSERT INTO spur_demo_rows (value, written_by) VALUES ($1, $2) RETURNING id";
/// The latest 100 rows, newest first; `at` in RFC 3339, UTC.
const LIST: &str = "SELECT id, value, written_by,
    to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
  FROM spur_demo_rows ORDER BY id DESC LIMIT 100";

/// One database, connected on first use and again after the connection breaks.
pub(super) struct Database {
    config: Config,
    /// The URL without its password: what logs and error answers name.
    redacted: String,
    conn: Mutex<Option<Arc<Conn>>>,
}

struct Conn {
    client: Client,
    /// `current_database()`, reported in every answer.
    database: String,
}

impl Database {
    /// Parses `url` (a libpq URL or key=value string). Connects only when first used: the app
    /// serves its other paths while the database is still starting.
    pub(super) fn new(url: &str) -> Result<Database> {
        const FLAG: &str = "--database-url (SPUR_APP_DATABASE_URL)";
        // A URL of another scheme would be read as key=value pairs, and its parse error quote
        // part of it.
        if let Some((scheme, _)) = url.split_once("://")
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
            && scheme != "postgres"
            && scheme != "postgresql"
        {
            bail!("{FLAG} must be a postgres:// or postgresql:// URL");
        }
        // Of tokio-postgres' parse errors only "invalid value for option `port`" and the like
        // are passed on: others quote a character or a word of the string, which may be the
        // password's.
        let mut config = Config::from_str(url).map_err(|e| {
            match std::error::Error::source(&e)
                .map(|s| s.to_string())
                .filter(|s| s.starts_with("invalid value for option"))
            {
                Some(detail) => anyhow!("{FLAG} is invalid: {detail}"),
                None => anyhow!(
                    "{FLAG} is invalid: expected postgres://user:password@host:5432/db or \
                     key=value pairs"
                ),
            }
        })?;
        if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
            bail!("{FLAG} names no host");
        }
        if config.get_user().is_none() {
            bail!("{FLAG} names no user");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("spur-demo-app");
        }
        let redacted = redact(&config);
        Ok(Database {
            config,
            redacted,
            conn: Mutex::new(None),
        })
    }

    /// The URL without its password.
    pub(super) fn redacted(&self) -> &str {
        &self.redacted
    }

    /// Stores `value`; returns the database's name and the row's id.
    pub(super) async fn insert(&self, value: &str, written_by: &str) -> Result<(String, i64)> {
        self.run(async |c: &Conn| {
            let row = c.client.query_one(INSERT, &[&value, &written_by]).await?;
            row.try_get::<_, i64>(0)
        })
        .await
    }

    /// The latest rows, newest first, as JSON objects; and the database's name.
    pub(super) async fn list(&self) -> Result<(String, Vec<Value>)> {
        self.run(async |c: &Conn| {
            let mut rows = Vec::new();
            for row in c.client.query(LIST, &[]).await? {
                rows.push(json!({
                    "id": row.try_get::<_, i64>(0)?,
                    "value": row.try_get::<_, String>(1)?,
                    "written_by": row.try_get::<_, String>(2)?,
                    "at": row.try_get::<_, Option<String>>(3)?,
                }));
            }
            Ok(rows)
        })
        .await
    }

    /// Runs `op` on the connection (made first if there is none or it broke), under
    /// [`OP_TIMEOUT`]. Any failure drops the connection: the next request starts afresh rather
    /// than find out again that it is gone.
    async fn run<T>(
        &self,
        op: impl AsyncFnOnce(&Conn) -> Result<T, tokio_postgres::Error>,
    ) -> Result<(String, T)> {
        let attempt = async {
            let conn = self.conn().await?;
            match op(&conn).await {
                Ok(v) => Ok((conn.database.clone(), v)),
                Err(e) => {
                    let mut slot = self.conn.lock().await;
                    if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                        *slot = None;
                    }
                    Err(anyhow!(e))
                }
            }
        };
        match tokio::time::timeout(OP_TIMEOUT, attempt).await {
            Ok(res) => res.with_context(|| format!("database {}", self.redacted)),
            Err(_) => {
                // Held only while someone else connects, and then there is nothing to drop.
                if let Ok(mut slot) = self.conn.try_lock() {
                    *slot = None;
                }
                bail!(
                    "database {} did not answer within {OP_TIMEOUT:?}",
                    self.redacted
                )
            }
        }
    }

    /// The live connection, or a new one. Callers wait for one connect rather than each make
    /// their own.
    async fn conn(&self) -> Result<Arc<Conn>> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref()
            && !c.client.is_closed()
        {
            return Ok(c.clone());
        }
        *slot = None;
        let (client, connection) = self.config.connect(NoTls).await.map_err(|e| anyhow!(e))?;
        let redacted = self.redacted.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                let error = format!("{:#}", anyhow!(e));
                tracing::warn!(database = %redacted, error, "database connection ended");
            }
        });
        client.batch_execute(CREATE_TABLE).await?;
        let database: String = client
            .query_one("SELECT current_database()::text", &[])
            .await?
            .try_get(0)?;
        tracing::info!(database = %self.redacted, "connected to the database");
        let conn = Arc::new(Conn { client, database });
        *slot = Some(conn.clone());
        Ok(conn)
    }
}

/// `postgres://user@host:port,…/dbname`: everything but the password (and the options, which
/// may hold one too).
fn redact(config: &Config) -> String {
    let ports = config.get_ports();
    let port = |i: usize| ports.get(i).or(ports.first()).copied().unwrap_or(5432);
    let hosts: Vec<String> = if config.get_hosts().is_empty() {
        config
            .get_hostaddrs()
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{a}:{}", port(i)))
            .collect()
    } else {
        config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, h)| match h {
                Host::Tcp(h) => format!("{h}:{}", port(i)),
                #[cfg(unix)]
                Host::Unix(dir) => format!("[{}]:{}", dir.display(), port(i)),
            })
            .collect()
    };
    let user = config.get_user().unwrap_or_default();
    let db = config.get_dbname().unwrap_or(user);
    format!("postgres://{user}@{}/{db}", hosts.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed_and_redacted() {
        let db = Database::new("postgres://app:s3cret@db.ns:5433/sandbox?sslmode=disable").unwrap();
        assert_eq!(db.redacted(), "postgres://app@db.ns:5433/sandbox");
        let db = Database::new("postgresql://app:p%40ss@db").unwrap();
        assert_eq!(db.redacted(), "postgres://app@db:5432/app");
        let db = Database::new("host=db user=app password=s3cret dbname=x").unwrap();
        assert_eq!(db.redacted(), "postgres://app@db:5432/x");

        for bad in [
            "postgres://db:5432/x",
            "postgres://app:s3cret@/x",
            "postgres://app:s3cret@db:notaport/x",
            "http://app:s3cret@db/x?a=b",
            "host=db s3cret",
            "host=db password=s3cret s3cret=1",
            "host=db password=s3cret://x",
        ] {
            let e = format!("{:#}", Database::new(bad).err().unwrap());
            assert!(!e.contains("s3cret"), "{bad}: {e}");
            assert!(e.contains("--database-url"), "{bad}: {e}");
        }
    }
}
