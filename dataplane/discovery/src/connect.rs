//! The connection to the route server, for every data-plane client of it (the sidecar's rule
//! watch, the gateway's listener watch): TLS verified against a CA bundle and a bearer token,
//! both re-read from their files for every connection (the kubelet rotates the projected token
//! and the operator the CA bundle).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};

use crate::Error;
use crate::RouteServerConn;

fn error(what: Option<&'static str>, addr: String, reason: String) -> Error {
    match what {
        None => Error::RouteServer { addr, reason },
        Some(what) => Error::Server { what, addr, reason },
    }
}

/// Connects, again and again, to one route server (or another Spur server, [`Connector::named`]).
#[derive(Clone)]
pub struct Connector {
    conn: RouteServerConn,
    /// What the server is, for errors; `None`: the route server.
    what: Option<&'static str>,
    server_name: String,
    endpoint: Endpoint,
}

impl Connector {
    pub fn new(conn: RouteServerConn) -> Result<Self, Error> {
        Self::build(conn, None)
    }

    /// A connector to another Spur server with the same address, CA and token rules (`what`
    /// names it in errors, e.g. "traffic store").
    pub fn named(conn: RouteServerConn, what: &'static str) -> Result<Self, Error> {
        Self::build(conn, Some(what))
    }

    fn build(conn: RouteServerConn, what: Option<&'static str>) -> Result<Self, Error> {
        let invalid = |reason: String| error(what, conn.addr.clone(), reason);
        let url = if conn.addr.contains("://") {
            conn.addr.clone()
        } else {
            format!("http://{}", conn.addr)
        };
        // TLS is ours (see `channel`), so tonic always sees http://.
        let endpoint =
            Endpoint::from_shared(url).map_err(|e| invalid(format!("invalid address: {e}")))?;
        if endpoint.uri().scheme_str() != Some("http") {
            return Err(invalid(
                "the address is host:port or http://host:port (TLS is on when a CA is given)"
                    .into(),
            ));
        }
        let server_name = endpoint
            .uri()
            .host()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string())
            .ok_or_else(|| invalid("no host in the address".into()))?;
        let endpoint = endpoint
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        Ok(Connector {
            conn,
            what,
            server_name,
            endpoint,
        })
    }

    pub fn addr(&self) -> &str {
        &self.conn.addr
    }

    pub fn err(&self, reason: impl std::fmt::Display) -> Error {
        error(self.what, self.conn.addr.clone(), reason.to_string())
    }

    /// A TLS client for the CA bundle in `path`, read now.
    fn tls(&self, path: &PathBuf) -> Result<tokio_rustls::TlsConnector, Error> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let pem = std::fs::read(path)
            .map_err(|e| self.err(format!("cannot read the CA bundle {}: {e}", path.display())))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| self.err(format!("CA bundle {}: {e}", path.display())))?;
            roots
                .add(cert)
                .map_err(|e| self.err(format!("CA bundle {}: {e}", path.display())))?;
        }
        if roots.is_empty() {
            return Err(self.err(format!(
                "the CA bundle {} holds no certificate",
                path.display()
            )));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| self.err(e))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
    }

    /// `Bearer <token>` from the token file, read now.
    pub fn authorization(&self) -> Result<Option<MetadataValue<Ascii>>, Error> {
        let Some(path) = &self.conn.token else {
            return Ok(None);
        };
        let token = std::fs::read_to_string(path)
            .map_err(|e| self.err(format!("cannot read the token {}: {e}", path.display())))?;
        let token = token.trim();
        if token.is_empty() {
            return Err(self.err(format!("the token file {} is empty", path.display())));
        }
        // Never echo the value: it is a credential.
        MetadataValue::try_from(format!("Bearer {token}"))
            .map(Some)
            .map_err(|_| {
                self.err(format!(
                    "the token in {} has characters a header cannot carry",
                    path.display()
                ))
            })
    }

    /// A new connection (one HTTP/2 connection: the Watch and the Reports share it, so both
    /// reach the same route server replica).
    pub async fn channel(&self) -> Result<Channel, Error> {
        let Some(ca) = &self.conn.ca else {
            return self
                .endpoint
                .connect()
                .await
                .map_err(|e| self.err(error_chain(&e)));
        };
        let tls = self.tls(ca)?;
        let name = rustls::pki_types::ServerName::try_from(self.server_name.clone())
            .map_err(|e| self.err(format!("{}: {e}", self.server_name)))?;
        let connector = tower::service_fn(move |uri: http::Uri| {
            let tls = tls.clone();
            let name = name.clone();
            async move {
                let host = uri.host().unwrap_or_default();
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let port = uri.port_u16().unwrap_or(80);
                let tcp = tokio::net::TcpStream::connect((host, port)).await?;
                tcp.set_nodelay(true)?;
                let stream = tls.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        });
        self.endpoint
            .connect_with_connector(connector)
            .await
            .map_err(|e| self.err(error_chain(&e)))
    }
}

/// tonic's transport error says only "transport error"; the cause (a refused certificate, a
/// refused connection) is in its sources.
pub(crate) fn error_chain(e: &tonic::transport::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
