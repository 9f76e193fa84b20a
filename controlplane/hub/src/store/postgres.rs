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
            let made = block_on(rt.spawn(async move {
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
            }))
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
        let guard = self.client()?;
        let client = guard
            .as_ref()
            .ok_or_else(|| Error::Db("no connection".into()))?;
        f(&mut PgConn {
            client,
            conflict: false,
        })
    }

    /// Runs `f` in a SERIALIZABLE transaction and commits it; runs it again (from the start)
    /// when PostgreSQL reports that a concurrent transaction conflicted.
    pub(crate) fn write<T>(
        &self,
        mut f: impl FnMut(&mut dyn Sql) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut guard = self.client()?;
        let client = guard
            .as_mut()
            .ok_or_else(|| Error::Db("no connection".into()))?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let tx = block_on(
                client
                    .build_transaction()
                    .isolation_level(IsolationLevel::Serializable)
                    .start(),
            )
            .map_err(|e| pg_error(&e))?;
            let mut conn = PgConn {
                client: &tx,
                conflict: false,
            };
            let outcome = f(&mut conn);
            let conflict = conn.conflict;
            let committed = match outcome {
                Ok(v) => block_on(tx.commit()).map(|()| v),
                // Dropping the transaction rolls it back.
                Err(e) if conflict && attempt < WRITE_ATTEMPTS => {
                    drop(tx);
                    tracing::debug!(attempt, "database write conflicted: {e}; again");
                    continue;
                }
                Err(e) => return Err(e),
            };
            match committed {
                Ok(v) => return Ok(v),
                Err(e) if is_conflict(&e) && attempt < WRITE_ATTEMPTS => continue,
                Err(e) => return Err(pg_error(&e)),
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
        let tx = block_on(client.transaction()).map_err(|e| pg_error(&e))?;
        let mut conn = PgConn {
            client: &tx,
            conflict: false,
        };
        // "spurhub" as a number: one lock id for every Spur hub schema.
        conn.exec("SELECT pg_advisory_xact_lock(7370757268117098)", &[])?;
        f(&mut conn)?;
        block_on(tx.commit()).map_err(|e| pg_error(&e))
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

/// A statement or query on a connection or in a transaction; `conflict` notes a serialization
/// failure (or deadlock) so the transaction can be run again.
struct PgConn<'a, C> {
    client: &'a C,
    conflict: bool,
}

impl<C: GenericClient> PgConn<'_, C> {
    fn fail(&mut self, e: &tokio_postgres::Error) -> Error {
        if is_conflict(e) {
            self.conflict = true;
        }
        pg_error(e)
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
        block_on(self.client.execute_typed(&sql, &params)).map_err(|e| self.fail(&e))
    }

    fn rows(&mut self, sql: &str, params: &[Value<'_>]) -> Result<Vec<Row>, Error> {
        let sql = dollar_placeholders(sql);
        let params = typed(params);
        let rows = block_on(self.client.query_typed(&sql, &params)).map_err(|e| self.fail(&e))?;
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

/// Polls `future` on this thread, parking between wake-ups. The futures of a `tokio-postgres`
/// client only exchange messages with the connection task (on the store's own runtime), so they
/// need no runtime here; unlike `Runtime::block_on`, this may run on a runtime's worker thread.
fn block_on<F: Future>(future: F) -> F::Output {
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
    loop {
        if let Poll::Ready(v) = future.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
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
