//! Connections and requests: one [`Slot`] per concurrent request (an HTTP/1.1 connection, or one
//! stream position of an h2 connection), reconnecting when the server closes the connection.

use std::cell::Cell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::{BufMut, Bytes, BytesMut};
use http::header::{CONTENT_TYPE, HOST, TE};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

use super::{LoadConfig, Proto};
use crate::upstream::GRPC_ECHO_PATH;

pub(crate) type ReqBody = Full<Bytes>;

/// Bound on establishing one connection (TCP connect plus HTTP handshake).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Attempts per request at finding a usable connection, so a server that accepts and closes at
/// once cannot keep a slot reconnecting forever.
const ATTEMPTS: usize = 3;
/// Streams a server may refuse unprocessed per request before the request counts as failed. A
/// new h2 connection refuses the streams a client opens above the server's limit before its
/// SETTINGS arrive, and a graceful GOAWAY refuses those above its last stream; on a busy machine
/// one request can land in several such bursts in a row, and each refusal shows the server alive,
/// so these get a larger budget than connections that close before a request is sent.
const REFUSALS: usize = 16;

/// Why a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    Connect,
    Io,
    Status,
    GrpcStatus,
}

/// Frames a gRPC request message `{ bytes payload = 1; }` with a `payload`-byte payload: the
/// 5-byte gRPC prefix (uncompressed, big-endian length) and the protobuf encoding.
pub fn encode_grpc_echo_request(payload: usize) -> Bytes {
    let mut message = BytesMut::with_capacity(payload + 16);
    if payload > 0 {
        // Field 1, wire type 2 (length-delimited); an empty field is left out, as proto3 does.
        message.put_u8(0x0a);
        let mut len = payload as u64;
        while len >= 0x80 {
            message.put_u8((len as u8 & 0x7f) | 0x80);
            len >>= 7;
        }
        message.put_u8(len as u8);
        message.put_bytes(b'x', payload);
    }
    let mut framed = BytesMut::with_capacity(message.len() + 5);
    framed.put_u8(0);
    framed.put_u32(u32::try_from(message.len()).unwrap_or(u32::MAX));
    framed.extend_from_slice(&message);
    framed.freeze()
}

/// Everything of a request that does not change between requests, built once so that a request
/// costs a header-map clone and reference-count increments.
#[derive(Clone)]
pub(crate) struct RequestTemplate {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    body: Bytes,
    grpc: bool,
}

impl RequestTemplate {
    pub(crate) fn new(cfg: &LoadConfig) -> anyhow::Result<Self> {
        let mut headers = HeaderMap::new();
        let path = cfg
            .url
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let (method, uri, version, body) = match cfg.proto {
            Proto::H1 => {
                // HTTP/1.1 wants origin-form plus Host (absolute-form is for forward proxies).
                let authority = cfg.url.authority().context("--url has no authority")?;
                headers.insert(HOST, HeaderValue::from_str(authority.as_str())?);
                let uri = Uri::builder().path_and_query(path).build()?;
                (Method::GET, uri, Version::HTTP_11, Bytes::new())
            }
            // h2 takes :scheme and :authority from the absolute URI.
            Proto::H2 => (Method::GET, cfg.url.clone(), Version::HTTP_2, Bytes::new()),
            Proto::Grpc => {
                let mut parts = cfg.url.clone().into_parts();
                if path.path() == "/" {
                    parts.path_and_query = Some(PathAndQuery::from_static(GRPC_ECHO_PATH));
                }
                headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
                headers.insert(TE, HeaderValue::from_static("trailers"));
                (
                    Method::POST,
                    Uri::from_parts(parts)?,
                    Version::HTTP_2,
                    encode_grpc_echo_request(cfg.payload),
                )
            }
        };
        for (name, value) in &cfg.headers {
            // A user-supplied Host replaces the default one; other headers add up.
            if name == HOST {
                headers.insert(name.clone(), value.clone());
            } else {
                headers.append(name.clone(), value.clone());
            }
        }
        Ok(Self {
            method,
            uri,
            version,
            headers,
            body,
            grpc: cfg.proto == Proto::Grpc,
        })
    }

    fn build(&self) -> Request<ReqBody> {
        let mut req = Request::new(Full::new(self.body.clone()));
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.version_mut() = self.version;
        *req.headers_mut() = self.headers.clone();
        req
    }
}

/// What a worker's slots share for making connections and requests.
/// TLS to the server: the connector (CA roots, ALPN by protocol) and the name to verify.
#[derive(Clone)]
pub(crate) struct Tls {
    connector: tokio_rustls::TlsConnector,
    name: rustls::pki_types::ServerName<'static>,
}

impl Tls {
    /// For an `https://` URL; `None` for cleartext.
    pub(crate) fn new(cfg: &LoadConfig) -> anyhow::Result<Option<Tls>> {
        use rustls::pki_types::pem::PemObject;
        if cfg.url.scheme_str() != Some("https") {
            return Ok(None);
        }
        let path = cfg
            .ca_file
            .as_ref()
            .context("an https:// URL needs --cacert")?;
        let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
            roots.add(cert.with_context(|| format!("{}: not PEM", path.display()))?)?;
        }
        let mut config = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = match cfg.proto {
            Proto::H1 => vec![b"http/1.1".to_vec()],
            Proto::H2 | Proto::Grpc => vec![b"h2".to_vec()],
        };
        let host = cfg.url.host().context("--url has no host")?;
        let name =
            rustls::pki_types::ServerName::try_from(host.trim_matches(['[', ']']).to_owned())
                .with_context(|| format!("{host} is not a TLS server name"))?;
        Ok(Some(Tls {
            connector: tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)),
            name,
        }))
    }
}

pub(crate) struct Env {
    pub(crate) tls: Option<Tls>,
    pub(crate) addr: SocketAddr,
    pub(crate) proto: Proto,
    pub(crate) template: RequestTemplate,
    pub(crate) reconnects: Cell<u64>,
}

pub(crate) enum Sender {
    H1(http1::SendRequest<ReqBody>),
    H2(http2::SendRequest<ReqBody>),
}

enum SendError {
    /// The request never reached the connection (it was closing): safe to retry elsewhere.
    NotSent,
    /// h2: the server refused the stream unprocessed (`REFUSED_STREAM`, or a stream above the
    /// last one a graceful GOAWAY accepts, as nginx sends after `keepalive_requests`). Clients
    /// retry these on a new connection, so the generator does too.
    Refused,
    Failed,
}

/// True when `err` is an h2 stream the server never processed (see [`SendError::Refused`]).
fn refused(err: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        if let Some(h2) = cause.downcast_ref::<h2::Error>() {
            return h2.reason() == Some(h2::Reason::REFUSED_STREAM)
                || (h2.is_go_away()
                    && h2.is_remote()
                    && h2.reason() == Some(h2::Reason::NO_ERROR));
        }
        source = cause.source();
    }
    false
}

impl Sender {
    async fn ready(&mut self) -> bool {
        match self {
            Self::H1(s) => s.ready().await.is_ok(),
            Self::H2(s) => s.ready().await.is_ok(),
        }
    }

    fn is_closed(&self) -> bool {
        match self {
            Self::H1(s) => s.is_closed(),
            Self::H2(s) => s.is_closed(),
        }
    }

    async fn send(&mut self, req: Request<ReqBody>) -> Result<Response<Incoming>, SendError> {
        let result = match self {
            Self::H1(s) => s.try_send_request(req).await,
            Self::H2(s) => s.try_send_request(req).await,
        };
        result.map_err(|e| {
            if e.message().is_some()
                // hyper fails requests still queued for a connection that has just ended (after a
                // GOAWAY) with a "dispatch gone" user error: never sent either.
                || (e.error().is_user() && self.is_closed())
            {
                SendError::NotSent
            } else if refused(e.error()) {
                SendError::Refused
            } else {
                SendError::Failed
            }
        })
    }
}

/// Opens a connection and spawns its driver on the current `LocalSet`.
pub(crate) async fn connect(env: &Env) -> anyhow::Result<Sender> {
    let connecting = async {
        let tcp = TcpStream::connect(env.addr)
            .await
            .with_context(|| format!("connecting to {}", env.addr))?;
        // Requests and small responses must not wait for delayed ACKs.
        tcp.set_nodelay(true)?;
        match &env.tls {
            None => handshake(env.proto, TokioIo::new(tcp)).await,
            Some(tls) => {
                let stream = tls
                    .connector
                    .connect(tls.name.clone(), tcp)
                    .await
                    .context("TLS handshake")?;
                handshake(env.proto, TokioIo::new(stream)).await
            }
        }
    };
    tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .with_context(|| format!("connecting to {}: timed out", env.addr))?
}

/// The HTTP handshake on an established connection; its driver runs on the current `LocalSet`.
async fn handshake<I>(proto: Proto, io: I) -> anyhow::Result<Sender>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    {
        Ok(match proto {
            Proto::H1 => {
                let (sender, conn) = http1::handshake(io).await?;
                tokio::task::spawn_local(async move {
                    // A failed connection surfaces through its requests.
                    let _ = conn.await;
                });
                Sender::H1(sender)
            }
            Proto::H2 | Proto::Grpc => {
                let (sender, conn) = http2::Builder::new(TokioExecutor::new())
                    .handshake(io)
                    .await?;
                tokio::task::spawn_local(async move {
                    let _ = conn.await;
                });
                Sender::H2(sender)
            }
        })
    }
}

/// The current h2 connection shared by the stream slots of one connection: a generation number
/// (bumped on every reconnect, so that only the first slot to notice a dead connection replaces
/// it) and its sender.
pub(crate) struct H2Shared {
    state: tokio::sync::Mutex<(u64, http2::SendRequest<ReqBody>)>,
}

/// One request at a time: an HTTP/1.1 connection, or one stream of an h2 connection.
pub(crate) struct Slot {
    sender: Option<Sender>,
    generation: u64,
    shared: Option<Rc<H2Shared>>,
}

impl Slot {
    /// Opens one connection and returns its slots: one for HTTP/1.1, `streams` for h2.
    pub(crate) async fn open(env: &Env, streams: usize) -> anyhow::Result<Vec<Slot>> {
        Ok(match connect(env).await? {
            sender @ Sender::H1(_) => vec![Slot {
                sender: Some(sender),
                generation: 0,
                shared: None,
            }],
            Sender::H2(sender) => {
                let shared = Rc::new(H2Shared {
                    state: tokio::sync::Mutex::new((0, sender.clone())),
                });
                (0..streams)
                    .map(|_| Slot {
                        sender: Some(Sender::H2(sender.clone())),
                        generation: 0,
                        shared: Some(Rc::clone(&shared)),
                    })
                    .collect()
            }
        })
    }

    /// Sends one request and reads the whole response.
    pub(crate) async fn request(&mut self, env: &Env) -> Result<(), Failure> {
        let (mut unsent, mut refused) = (0, 0);
        loop {
            self.ensure_ready(env).await?;
            let Some(sender) = self.sender.as_mut() else {
                return Err(Failure::Connect);
            };
            // The connection went away between `ready` and the send (a GOAWAY, a keep-alive
            // close), or the server refused the stream unprocessed: not a failed request, try
            // again on a new connection.
            let retries = match sender.send(env.template.build()).await {
                Ok(resp) => return finish(resp, env.template.grpc).await,
                Err(SendError::Failed) => return Err(Failure::Io),
                Err(SendError::NotSent) => (&mut unsent, ATTEMPTS),
                Err(SendError::Refused) => (&mut refused, REFUSALS),
            };
            *retries.0 += 1;
            if *retries.0 >= retries.1 {
                return Err(Failure::Connect);
            }
            self.reconnect(env).await?;
        }
    }

    async fn ensure_ready(&mut self, env: &Env) -> Result<(), Failure> {
        for _ in 0..ATTEMPTS {
            if let Some(sender) = self.sender.as_mut()
                && sender.ready().await
            {
                return Ok(());
            }
            self.reconnect(env).await?;
        }
        Err(Failure::Connect)
    }

    async fn reconnect(&mut self, env: &Env) -> Result<(), Failure> {
        match &self.shared {
            None => {
                self.sender = None;
                self.sender = Some(connect(env).await.map_err(|_| Failure::Connect)?);
                env.reconnects.set(env.reconnects.get() + 1);
            }
            Some(shared) => {
                let mut state = shared.state.lock().await;
                if state.0 == self.generation {
                    let Sender::H2(sender) = connect(env).await.map_err(|_| Failure::Connect)?
                    else {
                        return Err(Failure::Connect);
                    };
                    *state = (state.0 + 1, sender);
                    env.reconnects.set(env.reconnects.get() + 1);
                }
                self.generation = state.0;
                self.sender = Some(Sender::H2(state.1.clone()));
            }
        }
        Ok(())
    }
}

/// Reads the whole response body (so an HTTP/1.1 connection can carry the next request), then
/// judges the response: 2xx, and for gRPC `grpc-status: 0` in the trailers (or in the headers of
/// a trailers-only response).
async fn finish(resp: Response<Incoming>, grpc: bool) -> Result<(), Failure> {
    let (parts, mut body) = resp.into_parts();
    let mut grpc_ok = grpc_status_ok(&parts.headers);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| Failure::Io)?;
        if let Ok(trailers) = frame.into_trailers() {
            grpc_ok = grpc_status_ok(&trailers);
        }
    }
    if !parts.status.is_success() {
        Err(Failure::Status)
    } else if grpc && grpc_ok != Some(true) {
        Err(Failure::GrpcStatus)
    } else {
        Ok(())
    }
}

fn grpc_status_ok(headers: &HeaderMap) -> Option<bool> {
    headers.get("grpc-status").map(|v| v == "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_framing() {
        let empty = encode_grpc_echo_request(0);
        assert_eq!(&empty[..], &[0, 0, 0, 0, 0]);
        let small = encode_grpc_echo_request(3);
        assert_eq!(&small[..], &[0, 0, 0, 0, 5, 0x0a, 3, b'x', b'x', b'x']);
        let kib = encode_grpc_echo_request(1024);
        // 1024 = 0x400: varint 0x80 0x08.
        assert_eq!(&kib[..8], &[0, 0, 0, 4, 3, 0x0a, 0x80, 0x08]);
        assert_eq!(kib.len(), 5 + 3 + 1024);
    }
}
