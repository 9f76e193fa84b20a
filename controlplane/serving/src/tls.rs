//! Serving TLS, with the certificate re-read from its files while serving.
//!
//! In the cluster the files are a mounted `kubernetes.io/tls` Secret that the operator renews:
//! the kubelet swaps them in place, and the next handshake presents the new certificate. Open
//! connections (and the watch streams on them) are never cut by a renewal.
//!
//! Handshakes run concurrently, each bounded in time, so a client that opens a connection and
//! sends nothing delays nobody else.
//!
//! Every Spur server in the cluster (route server, io context server, traffic store) serves TLS
//! through this one loop rather than a copy of it.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use spur_runtime::Drain;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::Error;

/// How long a client has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress per listener; beyond it, accepting waits.
const MAX_HANDSHAKES: usize = 512;

/// The serving certificate's files (PEM): re-read every `reload_every`, and used for new
/// connections when their content changes and parses.
#[derive(Debug, Clone)]
pub struct ServingTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub reload_every: Duration,
}

impl ServingTls {
    pub fn new(cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        ServingTls {
            cert: cert.into(),
            key: key.into(),
            reload_every: Duration::from_secs(10),
        }
    }

    fn read(&self) -> Result<(Vec<u8>, Vec<u8>), Error> {
        let file = |p: &PathBuf| {
            std::fs::read(p).map_err(|e| Error::Tls(format!("cannot read {}: {e}", p.display())))
        };
        Ok((file(&self.cert)?, file(&self.key)?))
    }

    fn parse(&self, cert: &[u8], key: &[u8]) -> Result<CertifiedKey, Error> {
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::Tls(format!("{}: {e}", self.cert.display())))?;
        if chain.is_empty() {
            return Err(Error::Tls(format!(
                "{}: no certificate in it",
                self.cert.display()
            )));
        }
        let key = PrivateKeyDer::from_pem_slice(key)
            .map_err(|e| Error::Tls(format!("{}: {e}", self.key.display())))?;
        let key = rustls::crypto::ring::sign::any_supported_type(&key)
            .map_err(|e| Error::Tls(format!("{}: {e}", self.key.display())))?;
        let ck = CertifiedKey::new(chain, key);
        ck.keys_match()
            .map_err(|e| Error::Tls(format!("the key does not match the certificate: {e}")))?;
        Ok(ck)
    }
}

/// The current certificate, swapped whole when the files change.
#[derive(Debug)]
struct Resolver(ArcSwap<CertifiedKey>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

/// Both listeners' TLS configurations, sharing one certificate.
pub struct Tls {
    pub grpc: Arc<rustls::ServerConfig>,
    pub http: Arc<rustls::ServerConfig>,
}

/// Loads the certificate (an error if it is unusable: the server does not start without one)
/// and keeps reloading it until `stop`.
pub fn start(files: &ServingTls, tasks: &Drain, stop: CancellationToken) -> Result<Tls, Error> {
    let resolver = reloading(files, tasks, stop)?;
    let config = |alpn: &[&[u8]]| -> Result<Arc<rustls::ServerConfig>, Error> {
        let mut c = builder()?
            .with_no_client_auth()
            .with_cert_resolver(resolver.clone());
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(Arc::new(c))
    };
    // The REST port speaks HTTP/1.1 only: every connection reads through the HTTP/1 guard.
    Ok(Tls {
        grpc: config(&[b"h2"])?,
        http: config(&[b"http/1.1"])?,
    })
}

/// Like [`start`], for one gRPC port that also requires a client certificate issued by a CA
/// in `client_ca` (PEM bundle), whose subject's common name starts with `cn_prefix` when one is
/// given (the same CA signs other kinds of client certificates, e.g. workstations'). The bundle
/// is re-read like the certificate: during a CA rotation the operator adds the next CA to it
/// before that CA signs anything.
pub fn start_mutual(
    files: &ServingTls,
    client_ca: &std::path::Path,
    cn_prefix: Option<&str>,
    tasks: &Drain,
    stop: CancellationToken,
) -> Result<Arc<rustls::ServerConfig>, Error> {
    let pem = read_file(client_ca)?;
    let verifier = Arc::new(ClientCa {
        current: ArcSwap::from_pointee(client_verifier(client_ca, &pem)?),
        cn_prefix: cn_prefix.map(str::to_owned),
    });
    let resolver = reloading(files, tasks, stop.clone())?;
    let mut c = builder()?
        .with_client_cert_verifier(verifier.clone())
        .with_cert_resolver(resolver);
    c.alpn_protocols = vec![b"h2".to_vec()];

    let path = client_ca.to_path_buf();
    let every = files.reload_every;
    tasks.spawn(async move {
        let mut loaded = pem;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            match read_file(&path) {
                Ok(pem) if pem == loaded => {}
                Ok(pem) => match client_verifier(&path, &pem) {
                    Ok(v) => {
                        verifier.current.store(Arc::new(v));
                        loaded = pem;
                        tracing::info!("client CA bundle changed: new connections are verified with it");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "client CA bundle changed but is unusable; keeping the current one")
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the client CA bundle; keeping the current one")
                }
            }
        }
    });
    Ok(Arc::new(c))
}

fn read_file(path: &std::path::Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|e| Error::Tls(format!("cannot read {}: {e}", path.display())))
}

/// A verifier of client certificates issued by a CA of `pem`.
fn client_verifier(path: &std::path::Path, pem: &[u8]) -> Result<Verifier, Error> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| Error::Tls(format!("{}: {e}", path.display())))?;
        roots
            .add(cert)
            .map_err(|e| Error::Tls(format!("{}: {e}", path.display())))?;
    }
    if roots.is_empty() {
        return Err(Error::Tls(format!(
            "{}: no CA certificate in it",
            path.display()
        )));
    }
    rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .map(Verifier)
    .map_err(|e| Error::Tls(format!("client CA {}: {e}", path.display())))
}

#[derive(Debug)]
struct Verifier(Arc<dyn ClientCertVerifier>);

/// The current client verifier, swapped whole when the CA bundle changes, and the common-name
/// prefix a client certificate must have.
#[derive(Debug)]
struct ClientCa {
    current: ArcSwap<Verifier>,
    cn_prefix: Option<String>,
}

impl ClientCertVerifier for ClientCa {
    // No hints: they would have to outlive a swap. Clients then offer their one certificate.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .current
            .load()
            .0
            .verify_client_cert(end_entity, intermediates, now)?;
        if let Some(prefix) = &self.cn_prefix {
            let cn = common_name(end_entity.as_ref());
            if !cn.is_some_and(|cn| cn.starts_with(prefix.as_str())) {
                return Err(rustls::Error::General(format!(
                    "the client certificate is not one of this port's clients (common name must start with {prefix:?})"
                )));
            }
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current
            .load()
            .0
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current
            .load()
            .0
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current.load().0.supported_verify_schemes()
    }
}

fn builder() -> Result<rustls::ConfigBuilder<rustls::ServerConfig, rustls::WantsVerifier>, Error> {
    rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))
}

/// The serving certificate, loaded now and re-read every `reload_every` until `stop`.
fn reloading(
    files: &ServingTls,
    tasks: &Drain,
    stop: CancellationToken,
) -> Result<Arc<Resolver>, Error> {
    let (cert, key) = files.read()?;
    let resolver = Arc::new(Resolver(ArcSwap::from_pointee(files.parse(&cert, &key)?)));
    let files = files.clone();
    let swap = resolver.clone();
    tasks.spawn(async move {
        let resolver = swap;
        let mut loaded = (cert, key);
        let mut tick = tokio::time::interval(files.reload_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let read = match files.read() {
                Ok(r) if r == loaded => continue,
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the serving certificate; keeping the current one");
                    continue;
                }
            };
            // A renewal swaps both files, but not at the same instant: a certificate that does
            // not match its key is retried at the next tick.
            match files.parse(&read.0, &read.1) {
                Ok(ck) => {
                    resolver.0.store(Arc::new(ck));
                    loaded = read;
                    tracing::info!("serving certificate changed: new connections use it");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "serving certificate files changed but are unusable; keeping the current one")
                }
            }
        }
    });
    Ok(resolver)
}

/// An accepted connection, plain or TLS.
pub enum Conn {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// What a gRPC handler can learn about its connection.
#[derive(Debug, Clone)]
pub struct Peer {
    pub remote: Option<SocketAddr>,
    /// The common name of the client certificate the handshake verified (None over plaintext
    /// or without one).
    pub client_cn: Option<Arc<str>>,
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = Peer;
    fn connect_info(&self) -> Peer {
        match self {
            Conn::Plain(t) => Peer {
                remote: t.peer_addr().ok(),
                client_cn: None,
            },
            Conn::Tls(t) => {
                let (tcp, session) = t.get_ref();
                Peer {
                    remote: tcp.peer_addr().ok(),
                    client_cn: session
                        .peer_certificates()
                        .and_then(|chain| chain.first())
                        .and_then(|c| common_name(c.as_ref()))
                        .map(Arc::from),
                }
            }
        }
    }
}

/// The first common name of a DER certificate's subject.
fn common_name(der: &[u8]) -> Option<String> {
    let (_, c) = x509_parser::parse_x509_certificate(der).ok()?;
    c.subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_owned)
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(t) => Pin::new(t).poll_read(cx, buf),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(t) => Pin::new(t).poll_write(cx, buf),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(t) => Pin::new(t).poll_write_vectored(cx, bufs),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(t) => t.is_write_vectored(),
            Conn::Tls(t) => t.is_write_vectored(),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(t) => Pin::new(t).poll_flush(cx),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(t) => Pin::new(t).poll_shutdown(cx),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Connections ready to serve (handshake done), from one listener.
pub struct Incoming {
    rx: mpsc::Receiver<(Conn, SocketAddr)>,
    local: SocketAddr,
}

/// Accepts on `listener` until `stop`, completing TLS handshakes (with `tls`) off the accept
/// loop; failed or slow handshakes are logged at debug level and dropped.
pub fn incoming(
    listener: TcpListener,
    local: SocketAddr,
    tls: Option<Arc<rustls::ServerConfig>>,
    tasks: &Drain,
    stop: CancellationToken,
) -> Incoming {
    let (tx, rx) = mpsc::channel(64);
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    let inner = tasks.clone();
    tasks.spawn(async move {
        loop {
            let permit = tokio::select! {
                () = stop.cancelled() => return,
                p = handshakes.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => return,
                },
            };
            let Some((tcp, peer)) =
                spur_runtime::accept(&listener, stop.cancelled(), "route server").await
            else {
                return;
            };
            let _ = tcp.set_nodelay(true);
            let Some(acceptor) = acceptor.clone() else {
                if tx.send((Conn::Plain(tcp), peer)).await.is_err() {
                    return;
                }
                continue;
            };
            let tx = tx.clone();
            let stop = stop.clone();
            inner.spawn(async move {
                let _permit = permit;
                let tls = tokio::select! {
                    () = stop.cancelled() => return,
                    r = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)) => r,
                };
                match tls {
                    Ok(Ok(tls)) => {
                        let _ = tx.send((Conn::Tls(Box::new(tls)), peer)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    Incoming { rx, local }
}

impl Incoming {
    /// For tonic: a stream that ends when the accept loop does.
    pub fn into_stream(
        self,
    ) -> impl futures_util::Stream<Item = Result<Conn, io::Error>> + Send + 'static {
        futures_util::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(self.rx), |c| {
            Ok(c.0)
        })
    }
}

/// An HTTP/1 port's connections, each read through the front door's HTTP/1 guard.
pub struct GuardedIncoming(pub Incoming);

impl axum::serve::Listener for GuardedIncoming {
    type Io = spur_h1guard::Guard<Conn>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, SocketAddr) {
        let (conn, peer) = self.0.accept().await;
        (spur_h1guard::Guard::new(conn, crate::http1::MAX_HEAD), peer)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

impl axum::serve::Listener for Incoming {
    type Io = Conn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Conn, SocketAddr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept loop ended (shutdown): axum's graceful shutdown is already under way,
            // so never hand it another connection.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}
