//! Test harness: a throwaway PKI (rcgen), servers and clients on 127.0.0.1 with fast timers,
//! an echo service, and relays that can blackhole a connection.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use prometheus_client::registry::Registry;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use spur_tunnel::{
    AuthMethod, Authenticator, Backoff, ClientConfig, ClientTls, Identity, Incoming, Keepalive,
    ServerCert, ServerConfig, ServerTls, SessionHandle, SessionState, StaticAuthenticator,
    StreamHeader, Token, Transport, TransportPolicy, TunnelClient, TunnelServer,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Upper bound for any single wait in a test.
pub const WAIT: Duration = Duration::from_secs(10);

pub async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(WAIT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out waiting for {what}"),
    }
}

// === PKI ===

pub struct Pki {
    pub ca: CertificateDer<'static>,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    pub fn new() -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "spur test CA");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Pki {
            ca: issuer.der().clone(),
            issuer,
        }
    }

    fn leaf(
        &self,
        params: CertificateParams,
    ) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
    }

    pub fn server_tls(&self, client_ca: bool) -> ServerTls {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let (chain, key) = self.leaf(params);
        ServerTls {
            cert: ServerCert::Static { chain, key },
            client_ca: if client_ca {
                vec![self.ca.clone()]
            } else {
                vec![]
            },
            require_client_cert: false,
        }
    }

    pub fn client_cert(
        &self,
        cn: &str,
        uri: &str,
    ) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params
            .subject_alt_names
            .push(SanType::URI(uri.try_into().unwrap()));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.leaf(params)
    }
}

// === servers ===

pub const GOOD_TOKEN: &str = "good-token";

pub fn authenticator() -> StaticAuthenticator {
    StaticAuthenticator::new().with_token(
        Token::new(GOOD_TOKEN),
        Identity::new("alice", AuthMethod::Token),
    )
}

pub fn fast_keepalive() -> Keepalive {
    Keepalive {
        interval: Duration::from_millis(100),
        timeout: Duration::from_millis(800),
    }
}

pub fn server_config(pki: &Pki, auth: Arc<dyn Authenticator>) -> ServerConfig {
    let mut config = ServerConfig::new(pki.server_tls(false), auth);
    config.quic_addr = Some("127.0.0.1:0".parse().unwrap());
    config.h2_addr = Some("127.0.0.1:0".parse().unwrap());
    config.keepalive = fast_keepalive();
    config.handshake_timeout = Duration::from_secs(3);
    config.drain_grace = Duration::from_secs(3);
    config
}

pub struct TestServer {
    pub server: Arc<TunnelServer>,
    pub registry: Registry,
    /// Sessions as the echo service accepted them.
    pub sessions: mpsc::Receiver<SessionHandle>,
    /// Stream headers the echo service saw.
    pub headers: mpsc::UnboundedReceiver<StreamHeader>,
    accept_loop: JoinHandle<()>,
}

impl TestServer {
    pub async fn start(config: ServerConfig) -> Self {
        let mut registry = Registry::default();
        let server = Arc::new(TunnelServer::bind(config, &mut registry).await.unwrap());
        let (sessions_tx, sessions) = mpsc::channel(16);
        let (headers_tx, headers) = mpsc::unbounded_channel();
        let accept_loop = tokio::spawn(echo_service(server.clone(), sessions_tx, headers_tx));
        TestServer {
            server,
            registry,
            sessions,
            headers,
            accept_loop,
        }
    }

    pub fn quic(&self) -> SocketAddr {
        self.server.quic_addr().unwrap()
    }

    pub fn h2(&self) -> SocketAddr {
        self.server.h2_addr().unwrap()
    }

    pub async fn next_session(&mut self) -> SessionHandle {
        within("a server session", self.sessions.recv())
            .await
            .unwrap()
    }

    pub fn metrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).unwrap();
        out
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

/// Accepts sessions; answers forward streams: host `echo` echoes until EOF, `refuse` is
/// rejected with "connection refused".
async fn echo_service(
    server: Arc<TunnelServer>,
    sessions: mpsc::Sender<SessionHandle>,
    headers: mpsc::UnboundedSender<StreamHeader>,
) {
    while let Some(mut session) = server.accept().await {
        let _ = sessions.send(session.handle()).await;
        let headers = headers.clone();
        tokio::spawn(async move {
            while let Some(incoming) = session.accept().await {
                let _ = headers.send(incoming.header().clone());
                tokio::spawn(answer(incoming));
            }
        });
    }
}

/// Bytes a `sink`/`source` stream moves.
pub const PATTERN_BYTES: usize = 1024 * 1024;

async fn answer(incoming: Incoming) {
    let StreamHeader::Connect { host, port } = incoming.header().clone() else {
        return incoming.reject("not a connect").await;
    };
    let i = usize::from(port);
    match host.as_str() {
        "echo" => {
            if let Ok(stream) = incoming.accept().await {
                echo(stream).await;
            }
        }
        // Reads pattern `port` to EOF, checking it, then answers with the byte count.
        "sink" => {
            if let Ok(mut stream) = incoming.accept().await {
                let n = read_pattern(&mut stream, i).await as u64;
                stream.write_all(&n.to_be_bytes()).await.unwrap();
                stream.shutdown().await.unwrap();
            }
        }
        // Sends pattern `port`, then waits for the client's FIN.
        "source" => {
            if let Ok(mut stream) = incoming.accept().await {
                write_pattern(&mut stream, i, 0, PATTERN_BYTES).await;
                stream.shutdown().await.unwrap();
                let mut rest = Vec::new();
                let _ = stream.read_to_end(&mut rest).await;
            }
        }
        _ => incoming.reject("connection refused").await,
    }
}

pub async fn echo(stream: spur_tunnel::Stream) {
    let (mut r, mut w) = tokio::io::split(stream);
    let _ = tokio::io::copy(&mut r, &mut w).await;
    let _ = w.shutdown().await;
}

// === clients ===

pub fn client_config(pki: &Pki, quic: SocketAddr, h2: SocketAddr, t: Transport) -> ClientConfig {
    let mut config = ClientConfig::new(
        "localhost",
        ClientTls {
            roots: vec![pki.ca.clone()],
            client_cert: None,
        },
    );
    config.quic_addr = Some(quic.to_string());
    config.h2_addr = Some(h2.to_string());
    config.transports = match t {
        Transport::Quic => TransportPolicy::QuicOnly,
        Transport::H2 => TransportPolicy::H2Only,
    };
    config.token = Some(Token::new(GOOD_TOKEN));
    config.client_name = "test-laptop".into();
    config.connect_timeout = Duration::from_secs(1);
    config.open_wait = Duration::from_secs(3);
    config.backoff = Backoff {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(300),
    };
    config.keepalive = fast_keepalive();
    config.drain_grace = Duration::from_secs(3);
    config
}

pub fn start_client(config: ClientConfig) -> (TunnelClient, Registry) {
    let mut registry = Registry::default();
    let client = TunnelClient::start(config, &mut registry).unwrap();
    (client, registry)
}

pub async fn wait_state(
    state: &mut watch::Receiver<SessionState>,
    what: &str,
    f: impl FnMut(&SessionState) -> bool,
) -> SessionState {
    within(what, state.wait_for(f)).await.unwrap().clone()
}

pub async fn connected(client: &TunnelClient) -> SessionState {
    let mut state = client.state();
    wait_state(&mut state, "connected", |s| {
        matches!(s, SessionState::Connected { .. })
    })
    .await
}

pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
    out
}

// === data ===

/// Pseudo-random bytes; stream `i`'s content at offset `j` is `TABLE[(i * 7919 + j) % len]`, so
/// every stream differs and reordering, loss or duplication shows up.
fn table() -> &'static [u8] {
    static TABLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        (0..(1 << 20) + 13)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    })
}

/// Fills `buf` with stream `i`'s content starting at offset `off` (memcpy, so debug builds
/// spend their time in the tunnel, not here).
fn fill(i: usize, off: usize, buf: &mut [u8]) {
    let t = table();
    let mut pos = (i * 7919 + off) % t.len();
    let mut done = 0;
    while done < buf.len() {
        let n = (t.len() - pos).min(buf.len() - done);
        buf[done..done + n].copy_from_slice(&t[pos..pos + n]);
        done += n;
        pos = 0;
    }
}

/// Writes `len` bytes of stream `i`'s content in 16 KiB chunks.
pub async fn write_pattern<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    i: usize,
    from: usize,
    len: usize,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut off = from;
    let end = from + len;
    while off < end {
        let n = buf.len().min(end - off);
        fill(i, off, &mut buf[..n]);
        w.write_all(&buf[..n]).await.unwrap();
        off += n;
    }
}

/// Reads to EOF, checking every byte against stream `i`'s content; returns the count.
pub async fn read_pattern<R: tokio::io::AsyncRead + Unpin>(r: &mut R, i: usize) -> usize {
    let mut buf = vec![0u8; 16 * 1024];
    let mut expected = vec![0u8; 16 * 1024];
    let mut off = 0;
    loop {
        let n = r.read(&mut buf).await.unwrap();
        if n == 0 {
            return off;
        }
        fill(i, off, &mut expected[..n]);
        assert!(
            buf[..n] == expected[..n],
            "stream {i} corrupt in bytes {off}..{}",
            off + n
        );
        off += n;
    }
}

// === relays ===

/// Forwards one peer's traffic to `upstream` until blackholed; then drops everything while
/// keeping sockets open, so the peers see silence rather than a close.
pub struct Relay {
    pub addr: SocketAddr,
    blackhole: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Relay {
    pub fn blackhole(&self) {
        self.blackhole.store(true, Ordering::SeqCst);
    }

    pub async fn udp(upstream: SocketAddr) -> Self {
        let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let back = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        back.connect(upstream).await.unwrap();
        let addr = front.local_addr().unwrap();
        let blackhole = Arc::new(AtomicBool::new(false));
        let (client_tx, client_rx) = watch::channel(None::<SocketAddr>);
        let up = {
            let (front, back, bh) = (front.clone(), back.clone(), blackhole.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                while let Ok((n, from)) = front.recv_from(&mut buf).await {
                    client_tx.send_replace(Some(from));
                    if !bh.load(Ordering::SeqCst) {
                        let _ = back.send(&buf[..n]).await;
                    }
                }
            })
        };
        let down = {
            let bh = blackhole.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                while let Ok(n) = back.recv(&mut buf).await {
                    let client = *client_rx.borrow();
                    if let (false, Some(c)) = (bh.load(Ordering::SeqCst), client) {
                        let _ = front.send_to(&buf[..n], c).await;
                    }
                }
            })
        };
        Relay {
            addr,
            blackhole,
            tasks: vec![up, down],
        }
    }

    pub async fn tcp(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let blackhole = Arc::new(AtomicBool::new(false));
        let bh = blackhole.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pump(cr, sw, bh.clone()));
                tokio::spawn(pump(sr, cw, bh.clone()));
            }
        });
        Relay {
            addr,
            blackhole,
            tasks: vec![task],
        }
    }
}

async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    blackhole: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 65536];
    loop {
        let Ok(n) = r.read(&mut buf).await else {
            return;
        };
        if n == 0 {
            let _ = w.shutdown().await;
            return;
        }
        if blackhole.load(Ordering::SeqCst) {
            // Hold both sockets open and silent for longer than any test runs.
            tokio::time::sleep(Duration::from_secs(60)).await;
            return;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// An identity that expires `after` from now.
pub fn expiring(name: &str, after: Duration) -> Identity {
    Identity::new(name, AuthMethod::Token).expiring_at(SystemTime::now() + after)
}
