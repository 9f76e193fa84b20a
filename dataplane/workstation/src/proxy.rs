//! `spur local proxy`: a local port for one cluster Service. Each connection becomes a tunnel
//! stream to the Service. With a routing key, HTTP/1.x connections are proxied request by
//! request and every request gets the key in the redundant header set
//! ([`spur_routing::inject::inject_key`]: `baggage`, `tracestate`, `ot-baggage-*`,
//! `uberctx-*`), merged with what the client sent; anything else (HTTP/2, TLS, other
//! protocols) is carried as opaque TCP.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use spur_runtime::Drain;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

use crate::Error;
use crate::opener::{BoxStream, Opener, copy_both, splice};

/// Longest first line prefix looked at to recognise an HTTP/1.x request.
const SNIFF: usize = 16;
/// Connections carried at once; beyond that, new ones are reset.
const MAX_CONNECTIONS: usize = 1024;

/// What one `spur local proxy` serves.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub listen: SocketAddr,
    /// Cluster host (e.g. `api.shop.svc`) and port.
    pub host: String,
    pub port: u16,
    /// Injected into HTTP/1.x requests when set.
    pub routing_key: Option<String>,
    /// How long a client may stay silent before the upstream is opened to see who speaks
    /// first: the server's greeting makes it opaque TCP (server-first protocols), the client's
    /// bytes are sniffed as usual (an HTTP pool's spare connection, used later).
    pub sniff_timeout: Duration,
    pub open_timeout: Duration,
}

impl ProxyConfig {
    pub fn new(listen: SocketAddr, host: impl Into<String>, port: u16) -> Self {
        ProxyConfig {
            listen,
            host: host.into(),
            port,
            routing_key: None,
            sniff_timeout: Duration::from_millis(500),
            open_timeout: Duration::from_secs(15),
        }
    }
}

/// `svc.ns[:port]` → (`svc.ns.svc`, port). Names with more dots are taken as written.
pub fn parse_target(s: &str, default_port: u16) -> Result<(String, u16), Error> {
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| Error::Config(format!("bad port in {s:?}")))?,
        ),
        None => (s, default_port),
    };
    let valid = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.'));
    if !valid {
        return Err(Error::Config(format!(
            "{s:?} is not <service>.<namespace>[:port]"
        )));
    }
    let host = host.to_ascii_lowercase();
    match host.matches('.').count() {
        0 => Err(Error::Config(format!(
            "{s:?}: give the namespace too (<service>.<namespace>)"
        ))),
        1 => Ok((format!("{host}.svc"), port)),
        _ => Ok((host, port)),
    }
}

/// Binds the port and serves until `drain` starts. Returns the bound address.
pub async fn start(
    config: ProxyConfig,
    opener: Arc<dyn Opener>,
    drain: Drain,
) -> Result<SocketAddr, Error> {
    if let Some(k) = &config.routing_key
        && !spur_routing::extract::is_valid_key(k)
    {
        return Err(Error::Config(format!(
            "routing key {k:?} is not 1-64 characters of [A-Za-z0-9._-]"
        )));
    }
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| Error::Listen {
            what: "local proxy",
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr()?;
    let config = Arc::new(config);
    let d = drain.clone();
    let limit = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    drain.spawn(async move {
        while let Some((tcp, from)) =
            spur_runtime::accept(&listener, d.signaled(), "local proxy").await
        {
            let Ok(permit) = limit.clone().try_acquire_owned() else {
                tracing::warn!(%from, "too many connections at once; resetting a new one");
                crate::services::reset(&tcp);
                continue;
            };
            let (config, opener) = (config.clone(), opener.clone());
            d.spawn(async move {
                let _permit = permit;
                if let Err(e) = serve_one(tcp, &config, opener).await {
                    tracing::warn!(%from, target = %format!("{}:{}", config.host, config.port), error = %e, "local proxy connection failed");
                }
            });
        }
    });
    Ok(addr)
}

async fn serve_one(
    mut tcp: TcpStream,
    config: &ProxyConfig,
    opener: Arc<dyn Opener>,
) -> Result<(), Error> {
    let _ = tcp.set_nodelay(true);
    let Some(key) = config.routing_key.clone() else {
        let up = open(&*opener, config).await?;
        splice(tcp, up).await?;
        return Ok(());
    };
    let mut prefix = sniff(&mut tcp, config.sniff_timeout).await?;
    let mut opened = None;
    if prefix.is_empty() {
        // Silent for the whole window: a server-first protocol waiting for the greeting, or a
        // client that opened its connection ahead of its first request (HTTP pools keep spare
        // connections and use them seconds later; carried as opaque TCP, their requests went
        // without the key). The upstream is opened now and whichever side speaks first decides.
        let mut up = open(&*opener, config).await?;
        let mut greeting = [0u8; 4096];
        let mut one = [0u8; 1];
        let server_first = tokio::select! {
            biased;
            r = up.read(&mut greeting) => Some(r?),
            r = tcp.peek(&mut one) => match r {
                Ok(0) => Some(0),
                Ok(_) => None,
                // Reset: gone.
                Err(_) => return Ok(()),
            },
        };
        if let Some(n) = server_first {
            // The server's greeting (or its close) first: a server-first protocol. Or the
            // client half-closed without a byte: carried on as opaque too, so the server's
            // answer to that still arrives.
            tcp.write_all(&greeting[..n]).await?;
            splice(tcp, up).await?;
            return Ok(());
        }
        prefix = sniff(&mut tcp, config.sniff_timeout).await?;
        opened = Some(up);
    }
    let client = Rewind {
        prefix: prefix.clone(),
        inner: tcp,
    };
    if !looks_like_http1(&prefix) {
        let up = match opened {
            Some(up) => up,
            None => open(&*opener, config).await?,
        };
        splice(client, up).await?;
        return Ok(());
    }
    // Served request by request, each on the proxy's own upstream connection.
    drop(opened);
    http1(client, config, opener, key).await
}

/// The start of the first request line (bounded in size and by `timeout`), to be replayed.
/// Empty: the client sent nothing in time (or closed).
async fn sniff(tcp: &mut TcpStream, timeout: Duration) -> Result<Bytes, Error> {
    let mut head = [0u8; SNIFF];
    let mut len = 0;
    let deadline = tokio::time::Instant::now() + timeout;
    while len < SNIFF
        && !head[..len].contains(&b' ')
        && head[..len].iter().all(u8::is_ascii_uppercase)
    {
        match tokio::time::timeout_at(deadline, tcp.read(&mut head[len..])).await {
            Ok(Ok(0)) | Err(_) => break,
            Ok(Ok(n)) => len += n,
            Ok(Err(e)) => return Err(e.into()),
        }
    }
    Ok(Bytes::copy_from_slice(&head[..len]))
}

/// An HTTP/1.x request line starts with an upper-case method token and a space (`PRI` is the
/// HTTP/2 preface).
fn looks_like_http1(prefix: &[u8]) -> bool {
    let Some(sp) = prefix.iter().position(|b| *b == b' ') else {
        return false;
    };
    let method = &prefix[..sp];
    !method.is_empty() && method.iter().all(u8::is_ascii_uppercase) && method != b"PRI"
}

async fn open(opener: &dyn Opener, config: &ProxyConfig) -> Result<BoxStream, Error> {
    match tokio::time::timeout(config.open_timeout, opener.open(&config.host, config.port)).await {
        Ok(r) => r,
        Err(_) => Err(Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("opening {}:{} timed out", config.host, config.port),
        ))),
    }
}

type Body = BoxBody<Bytes, hyper::Error>;
type Sender = hyper::client::conn::http1::SendRequest<Incoming>;

/// One client connection: requests in order, each with the key injected, over one upstream
/// connection (opened again if the upstream closes between requests).
async fn http1(
    client: Rewind<TcpStream>,
    config: &ProxyConfig,
    opener: Arc<dyn Opener>,
    key: String,
) -> Result<(), Error> {
    let upstream: Arc<Mutex<Option<Sender>>> = Arc::new(Mutex::new(None));
    let config = Arc::new(config.clone());
    let key: Arc<str> = key.into();
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (upstream, config, opener, key) = (
            upstream.clone(),
            config.clone(),
            opener.clone(),
            key.clone(),
        );
        async move {
            Ok::<_, Infallible>(
                match forward(req, &upstream, &config, &*opener, &key).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(target = %format!("{}:{}", config.host, config.port), error = %e, "local proxy request failed");
                        bad_gateway(&e.to_string())
                    }
                },
            )
        }
    });
    hyper::server::conn::http1::Builder::new()
        .max_buf_size(64 * 1024)
        .serve_connection(TokioIo::new(client), svc)
        .with_upgrades()
        .await
        .map_err(|e| Error::Io(std::io::Error::other(e)))
}

async fn forward(
    mut req: Request<Incoming>,
    upstream: &Mutex<Option<Sender>>,
    config: &ProxyConfig,
    opener: &dyn Opener,
    key: &str,
) -> Result<Response<Body>, Error> {
    spur_routing::inject::inject_key(req.headers_mut(), key, &[]);
    let client_upgrade = hyper::upgrade::on(&mut req);
    let mut guard = upstream.lock().await;
    let mut sender = match guard.take() {
        Some(s) if !s.is_closed() => s,
        _ => {
            let stream = open(opener, config).await?;
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| Error::Io(std::io::Error::other(e)))?;
            tokio::spawn(async move {
                if let Err(e) = conn.with_upgrades().await {
                    tracing::debug!(error = %e, "local proxy upstream connection ended");
                }
            });
            sender
        }
    };
    sender
        .ready()
        .await
        .map_err(|e| Error::Io(std::io::Error::other(e)))?;
    let mut resp = sender
        .send_request(req)
        .await
        .map_err(|e| Error::Io(std::io::Error::other(e)))?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        // The upstream connection becomes the upgraded stream; splice both ends.
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            if let (Ok(c), Ok(u)) = (client_upgrade.await, upstream_upgrade.await) {
                let _ = copy_both(TokioIo::new(c), TokioIo::new(u)).await;
            }
        });
    } else {
        *guard = Some(sender);
    }
    Ok(resp.map(BodyExt::boxed))
}

fn bad_gateway(why: &str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(format!("spur local proxy: {why}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    r
}

/// A stream whose first bytes were already read and are replayed first.
struct Rewind<T> {
    prefix: Bytes,
    inner: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for Rewind<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Rewind<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn targets_and_detection() {
        assert_eq!(
            parse_target("api.shop", 80).unwrap(),
            ("api.shop.svc".into(), 80)
        );
        assert_eq!(
            parse_target("API.shop:8080", 80).unwrap(),
            ("api.shop.svc".into(), 8080)
        );
        assert_eq!(
            parse_target("api.shop.svc.cluster.local:9", 80).unwrap(),
            ("api.shop.svc.cluster.local".into(), 9)
        );
        for bad in ["api", "api.shop:0", "api.shop:x", "a b.c", ""] {
            assert!(parse_target(bad, 80).is_err(), "{bad}");
        }
        assert!(looks_like_http1(b"GET / HTTP/1.1\r\n"));
        assert!(looks_like_http1(b"OPTIONS * "));
        assert!(!looks_like_http1(b"PRI * HTTP/2.0"));
        assert!(!looks_like_http1(b"\x16\x03\x01\x02\x00"));
        assert!(!looks_like_http1(b"get / "));
        assert!(!looks_like_http1(b"GETTING"));
    }
}
