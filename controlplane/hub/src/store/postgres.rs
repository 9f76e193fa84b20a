//! The store on an external PostgreSQL server, for several hub replicas sharing one registry.
//!
//! The store's API is synchronous (async callers use `spawn_blocking`, as for SQLite), so this
//! backend drives `tokio-postgres` from a small runtime of its own: the connection's I/O runs on
//! that runtime's one thread, and a call parks its own thread until its answer is in
//! ([`block_on`]). That works from any thread, inside a runtime or not.
//!
//! TLS is required and the server's certificate verified against `--database-ca` (or the
//! system's roots) and its host name, unless the operator opts into plaintext. Writes run as
//! SERIALIZABLE transactions, retried when PostgreSQL reports a serialization failure, so two
//! replicas racing behave as SQLite's single writer does. A lost connection is made again on
//! the next call.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake};
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{GenericClient, IsolationLevel, NoTls, Socket};

use super::sql::{Cell, Row, Sql, Value, dollar_placeholders};
use crate::Error;

/// How the hub reaches its PostgreSQL server.
#[derive(Clone, Default)]
pub struct PostgresSettings {
    /// A libpq-style URL or key=value string (`postgres://hub@db.example:5432/spur`).
    pub url: String,
    /// The password, when not in the URL (from a Secret).
    pub password: Option<String>,
    /// CA certificates (PEM) the server's certificate must chain to; None: the system's roots.
    pub ca: Option<PathBuf>,
    /// Connect without TLS (an explicit opt-in: the registry's hashes and the CA key cross the
    /// network in the clear).
    pub insecure_plaintext: bool,
}

impl std::fmt::Debug for PostgresSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URL (it may hold the password) nor the password.
        f.debug_struct("PostgresSettings")
            .field("ca", &self.ca)
            .field("insecure_plaintext", &self.insecure_plaintext)
            .finish_non_exhaustive()
    }
}

/// A serialization failure is retried this many times before the write fails.
const WRITE_ATTEMPTS: u32 = 10;

/// How long one call (a statement, or a transaction's whole exchange) may take. A server that
/// stops answering without closing the connection (a failover, a partition) would otherwise
/// hold every store call of this replica behind the connection's lock: past this, the call
/// fails and the connection is dropped, and the next call makes a new one.
const CALL_DEADLINE: Duration = Duration::from_secs(15);

pub(crate) struct Pg {
    config: tokio_postgres::Config,
    tls: Option<RustlsConnector>,
    runtime: Option<tokio::runtime::Runtime>,
    client: Mutex<Option<tokio_postgres::Client>>,
}

impl Drop for Pg {
    fn drop(&mut self) {
        // Dropping a runtime blocks; a store may be dropped inside another runtime.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Pg {
    /// Checks the settings and connects once (a wrong URL or password fails at start).
    pub(crate) fn connect(settings: &PostgresSettings) -> Result<Pg, Error> {
        let mut config: tokio_postgres::Config = settings
            .url
            .parse()
            .map_err(|e| Error::Config(format!("the database URL: {e}")))?;
        if let Some(p) = &settings.password {
            config.password(p.as_bytes());
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        // A dead peer is noticed by TCP within seconds, not the kernel's default two hours; a
        // statement that runs away is ended by the server.
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(10))
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3)
            .tcp_user_timeout(CALL_DEADLINE);
        let options = config.get_options().unwrap_or_default().to_owned();
        config.options(format!(
            "{options} -c statement_timeout={}",
            CALL_DEADLINE.as_millis()
        ));
        if config.get_application_name().is_none() {
            config.application_name("spur-hub");
        }
        let tls = if settings.insecure_plaintext {
            config.ssl_mode(SslMode::Disable);
            None
        } else {
            if config.get_ssl_mode() == SslMode::Disable {
                return Err(Error::Config(
                    "the database URL says sslmode=disable: the hub connects to PostgreSQL over \
                     TLS unless --database-insecure-plaintext says otherwise"
                        .into(),
                ));
            }
            config.ssl_mode(SslMode::Require);
            Some(RustlsConnector::new(settings.ca.as_deref())?)
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("spur-hub-db")
            .enable_all()
            .build()
            .map_err(|e| Error::Db(format!("the database runtime: {e}")))?;
        let pg = Pg {
            config,
            tls,
            runtime: Some(runtime),
            client: Mutex::new(None),
        };
        drop(pg.client()?);
        Ok(pg)
    }

    /// The connection, made (again) when there is none or the last one ended.
    fn client(&self) -> Result<MutexGuard<'_, Option<tokio_postgres::Client>>, Error> {
        let mut guard = self.client.lock().unwrap_or_else(|p| p.into_inner());
        if guard.as_ref().is_none_or(tokio_postgres::Client::is_closed) {
            *guard = None;
            let rt = self
                .runtime
                .as_ref()
                .ok_or_else(|| Error::Db("the database runtime is gone".into()))?;
            let (config, tls) = (self.config.clone(), self.tls.clone());
            let made = block_on(
                CALL_DEADLINE,
                rt.spawn(async move {
                    let host = describe_hosts(&config);
                    let connected = match tls {
                        Some(tls) => config.connect(tls).await.map(|(c, conn)| {
                            tokio::spawn(drive(conn, host));
                            c
                        }),
                        None => config.connect(NoTls).await.map(|(c, conn)| {
                            tokio::spawn(drive(conn, host));
                            c
                        }),
                    };
                    connected.map_err(|e| pg_error(&e))
                }),
            )?
            .map_err(|e| Error::Db(format!("connecting: {e}")))??;
            *guard = Some(made);
        }
        Ok(guard)
    }

    /// Runs `f` on the connection, outside a transaction (single statements).
    pub(crate) fn read<T>(
        &self,
        f: impl FnOnce(&mut dyn Sql) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut guard = self.client()?;
        let client = guard
            .as_ref()
            .ok_or_else(|| Error::Db("no connection".into()))?;
        let mut conn = PgConn::new(client);
        let out = f(&mut conn);
        if conn.broken {
            *guard = None;
        }
        out
    }

    /// Runs `f` in one READ ONLY, REPEATABLE READ transaction: several reads that see one
    /// state, without the predicate locks of a SERIALIZABLE one (which would make writers on
    /// other replicas start again).
    pub(crate) fn snapshot<T>(
        &self,
        f: impl FnOnce(&mut dyn Sql) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut guard = self.client()?;
        let (out, drop_connection) = {
            let client = guard
                .as_mut()
                .ok_or_else(|| Error::Db("no connection".into()))?;
            let started = block_on(
                CALL_DEADLINE,
                client
                    .build_transaction()
                    .isolation_level(IsolationLevel::RepeatableRead)
                    .read_only(true)
                    .start(),
            );
            match started {
                Ok(Ok(tx)) => {
                    let mut conn = PgConn::new(&tx);
                    let out = f(&mut conn);
                    // Read only: a rollback (dropping the transaction) is as good as a commit.
                    (out, conn.broken)
                }
                Ok(Err(e)) => (Err(pg_error(&e)), false),
                Err(e) => (Err(e), true),
            }
        };
        if drop_connection {
            *guard = None;
        }
        out
    }

    /// Runs `f` in a SERIALIZABLE transaction and commits it; runs it again (from the start,
    /// after a short random pause) when PostgreSQL reports that a concurrent transaction
    /// conflicted. A transaction in which any statement failed is never committed, even when
    /// `f` made light of the failure.
    pub(crate) fn write<T>(
        &self,
        mut f: impl FnMut(&mut dyn Sql) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut guard = self.client()?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let step = {
                let client = guard
                    .as_mut()
                    .ok_or_else(|| Error::Db("no connection".into()))?;
                serializable(client, &mut f)
            };
            match step {
                Step::Done(v) => return Ok(v),
                Step::Again(e) if attempt < WRITE_ATTEMPTS => {
                    tracing::debug!(attempt, "database write conflicted: {e}; again");
                    backoff(attempt);
                }
                Step::Again(e) => return Err(e),
                Step::Failed {
                    error,
                    drop_connection,
                } => {
                    if drop_connection {
                        *guard = None;
                    }
                    return Err(error);
                }
            }
        }
    }

    /// Runs `f` in one READ COMMITTED transaction that first takes a lock of the whole database
    /// (a transaction-scoped advisory lock): replicas starting together migrate one at a time.
    pub(crate) fn migrate(
        &self,
        f: impl FnOnce(&mut dyn Sql) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut guard = self.client()?;
        let client = guard
            .as_mut()
            .ok_or_else(|| Error::Db("no connection".into()))?;
        let tx = block_on(CALL_DEADLINE, client.transaction())?.map_err(|e| pg_error(&e))?;
        let mut conn = PgConn::new(&tx);
        // "spurhub" as a number: one lock id for every Spur hub schema.
        conn.exec("SELECT pg_advisory_xact_lock(7370757268117098)", &[])?;
        f(&mut conn)?;
        if let Some(e) = conn.failed.take() {
            return Err(e);
        }
        block_on(CALL_DEADLINE, tx.commit())?.map_err(|e| pg_error(&e))
    }
}

/// How one attempt of a write ended.
enum Step<T> {
    Done(T),
    /// A concurrent transaction conflicted: run it again.
    Again(Error),
    Failed {
        error: Error,
        /// The connection's state is unknown (a call passed its deadline).
        drop_connection: bool,
    },
}

fn serializable<T>(
    client: &mut tokio_postgres::Client,
    f: &mut impl FnMut(&mut dyn Sql) -> Result<T, Error>,
) -> Step<T> {
    let started = block_on(
        CALL_DEADLINE,
        client
            .build_transaction()
            .isolation_level(IsolationLevel::Serializable)
            .start(),
    );
    let tx = match started {
        Ok(Ok(tx)) => tx,
        Ok(Err(e)) => {
            return Step::Failed {
                error: pg_error(&e),
                drop_connection: false,
            };
        }
        Err(error) => {
            return Step::Failed {
                error,
                drop_connection: true,
            };
        }
    };
    let mut conn = PgConn::new(&tx);
    let outcome = f(&mut conn);
    let (conflict, failed, broken) = (conn.conflict, conn.failed.take(), conn.broken);
    match (outcome, failed) {
        (Ok(v), None) => match block_on(CALL_DEADLINE, tx.commit()) {
            Ok(Ok(())) => Step::Done(v),
            Ok(Err(e)) if is_conflict(&e) => Step::Again(pg_error(&e)),
            Ok(Err(e)) => Step::Failed {
                error: pg_error(&e),
                drop_connection: false,
            },
            Err(error) => Step::Failed {
                error,
                drop_connection: true,
            },
        },
        // Dropping the transaction rolls it back.
        (Err(error), _) | (Ok(_), Some(error)) => {
            drop(tx);
            if broken {
                Step::Failed {
                    error,
                    drop_connection: true,
                }
            } else if conflict {
                Step::Again(error)
            } else {
                Step::Failed {
                    error,
                    drop_connection: false,
                }
            }
        }
    }
}

fn describe_hosts(config: &tokio_postgres::Config) -> String {
    config
        .get_hosts()
        .iter()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

async fn drive<S, T>(conn: tokio_postgres::Connection<S, T>, host: String)
where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    if let Err(e) = conn.await {
        tracing::warn!(%host, "the PostgreSQL connection ended: {e}; the next call connects again");
    }
}

/// A statement or query on a connection or in a transaction. It notes what went wrong: a
/// serialization failure or deadlock (`conflict`: the transaction may run again), any failed
/// statement (`failed`: the transaction must not commit), a call past its deadline (`broken`:
/// the connection is dropped).
struct PgConn<'a, C> {
    client: &'a C,
    conflict: bool,
    failed: Option<Error>,
    broken: bool,
}

impl<'a, C: GenericClient> PgConn<'a, C> {
    fn new(client: &'a C) -> Self {
        PgConn {
            client,
            conflict: false,
            failed: None,
            broken: false,
        }
    }

    fn fail(&mut self, e: &tokio_postgres::Error) -> Error {
        if is_conflict(e) {
            self.conflict = true;
        }
        let err = pg_error(e);
        self.failed = Some(Error::Db(err.to_string()));
        err
    }

    fn late(&mut self, e: Error) -> Error {
        self.broken = true;
        self.failed = Some(Error::Db(e.to_string()));
        e
    }
}

fn typed<'a>(params: &'a [Value<'a>]) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    params
        .iter()
        .map(|v| -> (&(dyn ToSql + Sync), Type) {
            match v {
                Value::Int(i) => (i, Type::INT8),
                Value::Text(s) => (s, Type::TEXT),
                Value::NullText => (&None::<&str>, Type::TEXT),
                Value::Blob(b) => (b, Type::BYTEA),
            }
        })
        .collect()
}

impl<C: GenericClient> Sql for PgConn<'_, C> {
    fn exec(&mut self, sql: &str, params: &[Value<'_>]) -> Result<u64, Error> {
        let sql = dollar_placeholders(sql);
        let params = typed(params);
        match block_on(CALL_DEADLINE, self.client.execute_typed(&sql, &params)) {
            Ok(r) => r.map_err(|e| self.fail(&e)),
            Err(e) => Err(self.late(e)),
        }
    }

    fn rows(&mut self, sql: &str, params: &[Value<'_>]) -> Result<Vec<Row>, Error> {
        let sql = dollar_placeholders(sql);
        let params = typed(params);
        let rows = match block_on(CALL_DEADLINE, self.client.query_typed(&sql, &params)) {
            Ok(r) => r.map_err(|e| self.fail(&e))?,
            Err(e) => return Err(self.late(e)),
        };
        rows.iter().map(cells).collect()
    }
}

fn cells(row: &tokio_postgres::Row) -> Result<Row, Error> {
    let get = |i: usize, e: tokio_postgres::Error| Error::Db(format!("column {i}: {e}"));
    let mut out = Vec::with_capacity(row.len());
    for (i, column) in row.columns().iter().enumerate() {
        let ty = column.type_();
        let cell = if *ty == Type::INT8 {
            row.try_get::<_, Option<i64>>(i)
                .map_err(|e| get(i, e))?
                .map_or(Cell::Null, Cell::Int)
        } else if *ty == Type::INT4 {
            row.try_get::<_, Option<i32>>(i)
                .map_err(|e| get(i, e))?
                .map_or(Cell::Null, |v| Cell::Int(v.into()))
        } else if *ty == Type::BOOL {
            row.try_get::<_, Option<bool>>(i)
                .map_err(|e| get(i, e))?
                .map_or(Cell::Null, |v| Cell::Int(v.into()))
        } else if *ty == Type::BYTEA {
            row.try_get::<_, Option<Vec<u8>>>(i)
                .map_err(|e| get(i, e))?
                .map_or(Cell::Null, Cell::Blob)
        } else if *ty == Type::TEXT || *ty == Type::VARCHAR || *ty == Type::NAME {
            row.try_get::<_, Option<String>>(i)
                .map_err(|e| get(i, e))?
                .map_or(Cell::Null, Cell::Text)
        } else if *ty == Type::VOID {
            Cell::Null
        } else {
            return Err(Error::Db(format!(
                "column {i} ({}) has type {ty}, which the store does not read",
                column.name()
            )));
        };
        out.push(cell);
    }
    Ok(Row(out))
}

fn is_conflict(e: &tokio_postgres::Error) -> bool {
    matches!(
        e.code(),
        Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED
    )
}

/// The server's message with its SQLSTATE; tokio-postgres's errors never hold the password.
fn pg_error(e: &tokio_postgres::Error) -> Error {
    match e.as_db_error() {
        Some(db) => Error::Db(format!(
            "PostgreSQL: {} ({})",
            db.message(),
            db.code().code()
        )),
        None => {
            // The cause (a refused certificate, a refused connection) is in the source chain.
            let mut message = format!("PostgreSQL: {e}");
            let mut source = std::error::Error::source(e);
            while let Some(cause) = source {
                message.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            Error::Db(message)
        }
    }
}

/// A pause before a conflicted write runs again: 5 to 10 ms times the attempt, random, so that
/// replicas racing do not meet again at once.
fn backoff(attempt: u32) {
    let mut b = [0u8; 1];
    let jitter = getrandom::fill(&mut b).map_or(0, |()| u64::from(b[0]) * 5 / 255);
    std::thread::sleep(Duration::from_millis((5 + jitter) * u64::from(attempt)));
}

/// Polls `future` on this thread, parking between wake-ups, for at most `deadline`. The futures
/// of a `tokio-postgres` client only exchange messages with the connection task (on the store's
/// own runtime), so they need no runtime here; unlike `Runtime::block_on`, this may run on a
/// runtime's worker thread. Past the deadline the future is dropped: the caller then drops the
/// connection, whose state is unknown.
fn block_on<F: Future>(deadline: Duration, future: F) -> Result<F::Output, Error> {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    let end = std::time::Instant::now() + deadline;
    loop {
        if let Poll::Ready(v) = future.as_mut().poll(&mut cx) {
            return Ok(v);
        }
        let left = end.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(Error::Unavailable(format!(
                "PostgreSQL did not answer within {deadline:?}; the connection is dropped"
            )));
        }
        std::thread::park_timeout(left);
    }
}

/// TLS for the PostgreSQL connection with rustls: the server's certificate must chain to the
/// configured roots and name the host connected to. (tokio-postgres-rustls would do it too, but
/// brings a second major of const-oid; SCRAM's channel binding is left out, the verified
/// certificate already binds the session to the server.)
#[derive(Clone)]
struct RustlsConnector(Arc<rustls::ClientConfig>);

impl RustlsConnector {
    fn new(ca: Option<&std::path::Path>) -> Result<RustlsConnector, Error> {
        let mut roots = rustls::RootCertStore::empty();
        match ca {
            Some(path) => {
                use rustls::pki_types::CertificateDer;
                use rustls::pki_types::pem::PemObject as _;
                let bad =
                    |e: String| Error::Config(format!("--database-ca {}: {e}", path.display()));
                for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(e.to_string()))? {
                    roots
                        .add(cert.map_err(|e| bad(e.to_string()))?)
                        .map_err(|e| bad(e.to_string()))?;
                }
                if roots.is_empty() {
                    return Err(bad("no certificate in it".into()));
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                for cert in found.certs {
                    let _ = roots.add(cert);
                }
                if roots.is_empty() {
                    return Err(Error::Config(
                        "no system CA certificates to verify the database server with; give \
                         --database-ca"
                            .into(),
                    ));
                }
            }
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(RustlsConnector(Arc::new(config)))
    }
}

impl MakeTlsConnect<Socket> for RustlsConnector {
    type Stream = PgTlsStream;
    type TlsConnect = RustlsConnect;
    type Error = rustls::pki_types::InvalidDnsNameError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, Self::Error> {
        Ok(RustlsConnect {
            config: self.0.clone(),
            name: ServerName::try_from(domain.to_owned())?,
        })
    }
}

struct RustlsConnect {
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
}

impl TlsConnect<Socket> for RustlsConnect {
    type Stream = PgTlsStream;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<PgTlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            tokio_rustls::TlsConnector::from(self.config)
                .connect(self.name, stream)
                .await
                .map(PgTlsStream)
        })
    }
}

struct PgTlsStream(tokio_rustls::client::TlsStream<Socket>);

impl tokio_postgres::tls::TlsStream for PgTlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for PgTlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for PgTlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
