//! Forward-proxy front ends: SOCKS5 (RFC 1928, `CONNECT` only, optional RFC 1929
//! username/password) and HTTP `CONNECT`, detected on one port by the first byte. The caller's
//! [`Dialer`] decides where a target goes: the tunnel proxy dials cluster addresses, the
//! workstation CLI opens a tunnel stream. Host names are passed through unresolved, so names
//! are resolved where the dialer runs (cluster DNS for the tunnel proxy).
//!
//! Every connection ends with one [`ConnRecord`] handed to the dialer (the tunnel proxy's audit
//! line): who, from, to, bytes each way, duration and outcome.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Empty;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use spur_h1guard::{Guard as Http1Guard, check_host};
use spur_proxy::Drain;

/// Where a client asked to go: a host name (resolved by the dialer) or an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Host(String, u16),
    Addr(SocketAddr),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Host(h, p) => write!(f, "{h}:{p}"),
            Target::Addr(a) => a.fmt(f),
        }
    }
}

/// Why a dial failed, mapped onto SOCKS5 reply codes and HTTP statuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DialError {
    #[error("not allowed: {0}")]
    NotAllowed(String),
    #[error("host not found: {0}")]
    HostNotFound(String),
    #[error("connection refused: {0}")]
    Refused(String),
    #[error("unreachable: {0}")]
    Unreachable(String),
    #[error("timed out: {0}")]
    TimedOut(String),
    #[error("{0}")]
    Other(String),
}

impl DialError {
    fn socks_reply(&self) -> u8 {
        match self {
            DialError::NotAllowed(_) => 0x02,
            DialError::Unreachable(_) => 0x03,
            DialError::HostNotFound(_) => 0x04,
            DialError::Refused(_) => 0x05,
            DialError::TimedOut(_) => 0x06,
            DialError::Other(_) => 0x01,
        }
    }

    fn http_status(&self) -> StatusCode {
        match self {
            DialError::NotAllowed(_) => StatusCode::FORBIDDEN,
            DialError::TimedOut(_) => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::BAD_GATEWAY,
        }
    }

    /// Classifies an I/O error of a TCP connect.
    pub fn from_io(target: &Target, e: &std::io::Error) -> DialError {
        use std::io::ErrorKind as K;
        let what = format!("{target}: {e}");
        match e.kind() {
            K::ConnectionRefused => DialError::Refused(what),
            K::PermissionDenied => DialError::NotAllowed(what),
            K::TimedOut => DialError::TimedOut(what),
            K::HostUnreachable | K::NetworkUnreachable => DialError::Unreachable(what),
            _ => DialError::Other(what),
        }
    }
}

/// How a forward-proxy connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnRecord {
    /// `socks5` or `http-connect`.
    pub protocol: &'static str,
    pub client: SocketAddr,
    /// The authenticated user (SOCKS5 username), if any.
    pub user: Option<String>,
    pub target: Option<Target>,
    /// Bytes client → target and target → client.
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub duration: Duration,
    /// `ok`, or what went wrong (handshake, auth, dial, stream error).
    pub outcome: String,
}

/// Opens connections to targets for the forward proxy.
pub trait Dialer: Send + Sync + 'static {
    type Stream: AsyncRead + AsyncWrite + Send + Unpin + 'static;

    /// Connects to `target` for `client` (authenticated as `user`, if any).
    fn dial(
        &self,
        target: &Target,
        client: SocketAddr,
        user: Option<&str>,
    ) -> impl Future<Output = Result<Self::Stream, DialError>> + Send;

    /// Checks SOCKS5 username/password credentials. Returning `None` (the default) means no
    /// authentication is required; `Some(ok)` requires RFC 1929 and accepts when `ok`.
    fn check_password(&self, _user: &str, _password: &str) -> Option<bool> {
        None
    }

    /// Whether SOCKS5 clients must authenticate (then [`Dialer::check_password`] decides).
    fn requires_auth(&self) -> bool {
        false
    }

    /// Called once per connection when it ends (audit log, metrics).
    fn finished(&self, _record: &ConnRecord) {}
}

/// Limits of the forward proxy.
#[derive(Debug, Clone)]
pub struct ForwardConfig {
    /// Time a client gets to complete the SOCKS5 or HTTP handshake.
    pub handshake_timeout: Duration,
    /// Time a dial may take.
    pub dial_timeout: Duration,
}

impl Default for ForwardConfig {
    fn default() -> Self {
        ForwardConfig {
            handshake_timeout: Duration::from_secs(10),
            dial_timeout: Duration::from_secs(10),
        }
    }
}

/// Accepts connections until `drain` starts; each is served as SOCKS5 or HTTP CONNECT.
pub async fn serve_forward<D: Dialer>(
    listener: TcpListener,
    dialer: Arc<D>,
    config: ForwardConfig,
    drain: Drain,
) {
    while let Some((stream, client)) =
        spur_runtime::accept(&listener, drain.signaled(), "forward proxy").await
    {
        let _ = stream.set_nodelay(true);
        let (dialer, config) = (dialer.clone(), config.clone());
        drain.spawn(async move { serve_one(stream, client, &*dialer, &config).await });
    }
}

/// Serves one accepted connection.
pub async fn serve_one<D: Dialer>(
    stream: TcpStream,
    client: SocketAddr,
    dialer: &D,
    config: &ForwardConfig,
) {
    let started = Instant::now();
    let mut first = [0u8; 1];
    let peeked = tokio::time::timeout(config.handshake_timeout, stream.peek(&mut first)).await;
    let mut record = ConnRecord {
        protocol: "socks5",
        client,
        user: None,
        target: None,
        bytes_up: 0,
        bytes_down: 0,
        duration: Duration::ZERO,
        outcome: String::new(),
    };
    match peeked {
        Ok(Ok(1)) if first[0] == 0x05 => socks5(stream, dialer, config, &mut record).await,
        Ok(Ok(1)) if first[0].is_ascii_uppercase() => {
            record.protocol = "http-connect";
            http_connect(stream, dialer, config, &mut record).await;
        }
        Ok(Ok(_)) => record.outcome = "not SOCKS5 or HTTP".into(),
        Ok(Err(e)) => record.outcome = format!("read: {e}"),
        Err(_) => record.outcome = "handshake timed out".into(),
    }
    record.duration = started.elapsed();
    dialer.finished(&record);
}

async fn socks5<D: Dialer>(
    mut stream: TcpStream,
    dialer: &D,
    config: &ForwardConfig,
    record: &mut ConnRecord,
) {
    let handshake = tokio::time::timeout(
        config.handshake_timeout,
        socks5_handshake(&mut stream, dialer, record),
    )
    .await;
    let target = match handshake {
        Ok(Ok(t)) => t,
        Ok(Err(why)) => {
            record.outcome = why;
            return;
        }
        Err(_) => {
            record.outcome = "handshake timed out".into();
            return;
        }
    };
    record.target = Some(target.clone());
    let upstream = match dial(dialer, &target, record, config).await {
        Ok(u) => u,
        Err(e) => {
            let _ = stream.write_all(&socks_reply(e.socks_reply())).await;
            record.outcome = format!("dial: {e}");
            return;
        }
    };
    if stream.write_all(&socks_reply(0x00)).await.is_err() {
        record.outcome = "client went away".into();
        return;
    }
    splice(stream, upstream, record).await;
}

/// Greeting, optional RFC 1929 authentication and the request; the error is for the record
/// (the client has been answered where the protocol allows).
async fn socks5_handshake<D: Dialer>(
    s: &mut TcpStream,
    dialer: &D,
    record: &mut ConnRecord,
) -> Result<Target, String> {
    let io = |e: std::io::Error| format!("handshake: {e}");
    let mut head = [0u8; 2];
    s.read_exact(&mut head).await.map_err(io)?;
    let mut methods = vec![0u8; usize::from(head[1])];
    s.read_exact(&mut methods).await.map_err(io)?;
    let want = if dialer.requires_auth() { 0x02 } else { 0x00 };
    if !methods.contains(&want) {
        let _ = s.write_all(&[0x05, 0xFF]).await;
        return Err(if want == 0x02 {
            "client offered no username/password authentication".into()
        } else {
            "client offered no acceptable authentication method".into()
        });
    }
    s.write_all(&[0x05, want]).await.map_err(io)?;
    if want == 0x02 {
        let mut ver_len = [0u8; 2];
        s.read_exact(&mut ver_len).await.map_err(io)?;
        let mut user = vec![0u8; usize::from(ver_len[1])];
        s.read_exact(&mut user).await.map_err(io)?;
        let mut plen = [0u8; 1];
        s.read_exact(&mut plen).await.map_err(io)?;
        let mut password = vec![0u8; usize::from(plen[0])];
        s.read_exact(&mut password).await.map_err(io)?;
        let user = String::from_utf8_lossy(&user).into_owned();
        let ok = ver_len[0] == 0x01
            && dialer
                .check_password(&user, &String::from_utf8_lossy(&password))
                .unwrap_or(false);
        let _ = s.write_all(&[0x01, if ok { 0x00 } else { 0x01 }]).await;
        if !ok {
            return Err(format!("authentication failed for user {user:?}"));
        }
        record.user = Some(user);
    }
    let mut req = [0u8; 4];
    s.read_exact(&mut req).await.map_err(io)?;
    if req[0] != 0x05 {
        return Err(format!("bad request version {}", req[0]));
    }
    let target = match req[3] {
        0x01 => {
            let mut a = [0u8; 6];
            s.read_exact(&mut a).await.map_err(io)?;
            let ip = Ipv4Addr::new(a[0], a[1], a[2], a[3]);
            Target::Addr(SocketAddr::new(
                IpAddr::V4(ip),
                u16::from_be_bytes([a[4], a[5]]),
            ))
        }
        0x04 => {
            let mut a = [0u8; 18];
            s.read_exact(&mut a).await.map_err(io)?;
            let mut o = [0u8; 16];
            o.copy_from_slice(&a[..16]);
            let port = u16::from_be_bytes([a[16], a[17]]);
            Target::Addr(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(o)), port))
        }
        0x03 => {
            let mut len = [0u8; 1];
            s.read_exact(&mut len).await.map_err(io)?;
            let mut name = vec![0u8; usize::from(len[0]) + 2];
            s.read_exact(&mut name).await.map_err(io)?;
            let port = u16::from_be_bytes([name[name.len() - 2], name[name.len() - 1]]);
            name.truncate(name.len() - 2);
            let host = String::from_utf8(name)
                .ok()
                .filter(|h| valid_host(h))
                .ok_or("invalid host name")?;
            Target::Host(host, port)
        }
        other => {
            let _ = s.write_all(&socks_reply(0x08)).await;
            return Err(format!("address type {other} not supported"));
        }
    };
    if req[1] != 0x01 {
        let _ = s.write_all(&socks_reply(0x07)).await;
        return Err(format!("command {} not supported (only CONNECT)", req[1]));
    }
    Ok(target)
}

fn socks_reply(code: u8) -> [u8; 10] {
    [0x05, code, 0x00, 0x01, 0, 0, 0, 0, 0, 0]
}

/// A DNS name or an IP literal; nothing that could smuggle other syntax to a dialer.
fn valid_host(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b':'))
}

async fn dial<D: Dialer>(
    dialer: &D,
    target: &Target,
    record: &ConnRecord,
    config: &ForwardConfig,
) -> Result<D::Stream, DialError> {
    match tokio::time::timeout(
        config.dial_timeout,
        dialer.dial(target, record.client, record.user.as_deref()),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => Err(DialError::TimedOut(target.to_string())),
    }
}

async fn http_connect<D: Dialer>(
    stream: TcpStream,
    dialer: &D,
    config: &ForwardConfig,
    record: &mut ConnRecord,
) {
    // hyper parses the request (bounded) and answers it; the dial happens inside the service so
    // the status can say how it went. The upgraded connection, the target and the upstream come
    // out through `tunnel` once the 200 has been written.
    type Ready<S> = (Target, S, hyper::upgrade::OnUpgrade);
    let tunnel = std::sync::Mutex::new(None::<Ready<D::Stream>>);
    let failure = std::sync::Mutex::new(None::<(Option<Target>, String)>);
    let client = record.client;
    let svc = hyper::service::service_fn(|mut req: Request<hyper::body::Incoming>| {
        let (tunnel, failure) = (&tunnel, &failure);
        async move {
            let fail = |status: StatusCode, target: Option<Target>, why: String| {
                if let Ok(mut f) = failure.lock() {
                    *f = Some((target, why));
                }
                let mut r = Response::new(Empty::<Bytes>::new());
                *r.status_mut() = status;
                // One request per connection: a failed CONNECT closes it.
                r.headers_mut().insert(
                    http::header::CONNECTION,
                    http::HeaderValue::from_static("close"),
                );
                Ok::<_, std::convert::Infallible>(r)
            };
            // The front door's rules hold here too (RFC 9112 §3.2).
            if let Err(why) = check_host(&req) {
                return fail(StatusCode::BAD_REQUEST, None, why.to_string());
            }
            if req.method() != Method::CONNECT {
                return fail(
                    StatusCode::METHOD_NOT_ALLOWED,
                    None,
                    format!("{} is not CONNECT", req.method()),
                );
            }
            let Some(auth) = req.uri().authority().cloned() else {
                return fail(
                    StatusCode::BAD_REQUEST,
                    None,
                    "CONNECT without host:port".into(),
                );
            };
            // RFC 9112 §3.2.3: the authority-form has no user info; `u@h:80` is refused, not
            // silently dialed as `h:80`.
            if auth.as_str().contains('@') {
                return fail(
                    StatusCode::BAD_REQUEST,
                    None,
                    format!("bad CONNECT target {auth}: user info"),
                );
            }
            let host = auth.host().trim_matches(['[', ']']);
            let Some(port) = auth.port_u16().filter(|_| valid_host(host)) else {
                return fail(
                    StatusCode::BAD_REQUEST,
                    None,
                    format!("bad CONNECT target {auth}"),
                );
            };
            let target = match host.parse::<IpAddr>() {
                Ok(ip) => Target::Addr(SocketAddr::new(ip, port)),
                Err(_) => Target::Host(host.to_string(), port),
            };
            let attempt =
                match tokio::time::timeout(config.dial_timeout, dialer.dial(&target, client, None))
                    .await
                {
                    Ok(r) => r,
                    Err(_) => Err(DialError::TimedOut(target.to_string())),
                };
            match attempt {
                Ok(up) => {
                    let on_upgrade = hyper::upgrade::on(&mut req);
                    if let Ok(mut t) = tunnel.lock() {
                        *t = Some((target, up, on_upgrade));
                    }
                    Ok(Response::new(Empty::<Bytes>::new()))
                }
                Err(e) => {
                    let why = format!("dial: {e}");
                    fail(e.http_status(), Some(target), why)
                }
            }
        }
    });
    // Bare LF line endings are refused here as on the data path; the guard stops reading
    // after the CONNECT head, so the tunnel's bytes pass untouched.
    let stream = Http1Guard::new(stream, 64 * 1024);
    let conn = hyper::server::conn::http1::Builder::new()
        .max_buf_size(64 * 1024)
        .serve_connection(TokioIo::new(stream), svc)
        .with_upgrades();
    match tokio::time::timeout(config.handshake_timeout + config.dial_timeout, conn).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => record.outcome = format!("http: {e}"),
        Err(_) => record.outcome = "handshake timed out".into(),
    }
    if let Some((target, why)) = failure.lock().ok().and_then(|mut f| f.take()) {
        record.target = target;
        record.outcome = why;
        return;
    }
    let Some((target, upstream, on_upgrade)) = tunnel.lock().ok().and_then(|mut t| t.take()) else {
        if record.outcome.is_empty() {
            record.outcome = "no CONNECT request".into();
        }
        return;
    };
    record.target = Some(target);
    match on_upgrade.await {
        Ok(upgraded) => splice(TokioIo::new(upgraded), upstream, record).await,
        Err(e) => record.outcome = format!("upgrade: {e}"),
    }
}

/// Copies both ways until both sides are done, half-close preserved; fills in the byte counts
/// and the outcome.
async fn splice<A, B>(mut client: A, mut upstream: B, record: &mut ConnRecord)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        Ok((up, down)) => {
            record.bytes_up = up;
            record.bytes_down = down;
            record.outcome = "ok".into();
        }
        Err(e) => record.outcome = format!("stream: {e}"),
    }
}
