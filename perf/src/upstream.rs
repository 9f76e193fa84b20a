//! The benchmark upstream behind `spur-bench-upstream`: a hyper server (HTTP/1.1 keep-alive and
//! h2c prior knowledge on the same port) cheap enough per request that it is never what limits a
//! proxy benchmark.
//!
//! Routes:
//! - `GET /bytes/N`: 200 with exactly `N` bytes (`N` ≤ [`MAX_BYTES`]), sliced from one
//!   pre-allocated buffer, so serving a response allocates no payload.
//! - `POST /echo`: 200, the request body streamed back as it arrives.
//! - `POST /spur.bench.v1.Bench/Echo` (gRPC unary, `content-type: application/grpc*`): the
//!   length-prefixed request message(s) streamed back unchanged, then trailers `grpc-status: 0`.
//!   The message is `message EchoMessage { bytes payload = 1; }`; echoing the frames needs no
//!   decoding because request and response share the message type.
//!
//! Every response carries `x-upstream: <listen port>` so a runner can tell which instance served.

use std::convert::Infallible;
use std::future::{Future, ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// Largest body `GET /bytes/N` serves: 16 MiB.
pub const MAX_BYTES: usize = 16 * 1024 * 1024;
/// Path of the gRPC echo method.
pub const GRPC_ECHO_PATH: &str = "/spur.bench.v1.Bench/Echo";
/// Response header naming the listen port that served the request.
pub const UPSTREAM_HEADER: HeaderName = HeaderName::from_static("x-upstream");

/// Streams per h2 connection. Far above any `--streams` a benchmark uses, so the upstream never
/// throttles a proxy's (or the load generator's) multiplexing.
const MAX_CONCURRENT_STREAMS: u32 = 4096;
/// h2 flow-control windows: large enough that a 16 MiB body is not paced by WINDOW_UPDATE round
/// trips to the client.
const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
/// Pause after a failed `accept` (e.g. out of file descriptors) so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// Serves the routes above on every listener until `shutdown` completes, then returns; dropping
/// the returned future also stops the server and aborts every connection task.
///
/// # Errors
///
/// No listener was given, a listener's address cannot be read, or an accept loop panicked.
pub async fn serve<F>(listeners: Vec<TcpListener>, shutdown: F) -> anyhow::Result<()>
where
    F: Future<Output = ()>,
{
    anyhow::ensure!(!listeners.is_empty(), "no listener to serve on");
    let payload = Bytes::from(vec![b'x'; MAX_BYTES]);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http2()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW);
    let builder = Arc::new(builder);

    // The accept loops (and through them every connection) live in this set, so returning from
    // here, or dropping this future, aborts them all.
    let mut accept_loops = JoinSet::new();
    for listener in listeners {
        let port = listener.local_addr()?.port();
        let routes = Arc::new(Routes {
            payload: payload.clone(),
            upstream: HeaderValue::from(port),
        });
        accept_loops.spawn(accept_loop(listener, Arc::clone(&builder), routes));
    }
    tokio::select! {
        () = shutdown => Ok(()),
        Some(Err(err)) = accept_loops.join_next() => Err(anyhow::anyhow!("accept loop failed: {err}")),
    }
}

async fn accept_loop(
    listener: TcpListener,
    builder: Arc<auto::Builder<TokioExecutor>>,
    routes: Arc<Routes>,
) {
    // Connections live in this set so that aborting the accept loop aborts them too.
    let mut connections = JoinSet::new();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        // Responses go out in one write; without this a small response could wait for the
        // client's delayed ACK.
        let _ = stream.set_nodelay(true);
        // Reap finished connections so the set does not grow with every connection ever served.
        while connections.try_join_next().is_some() {}
        let builder = Arc::clone(&builder);
        let routes = Arc::clone(&routes);
        connections.spawn(async move {
            let service = service_fn(move |req| ready(Ok::<_, Infallible>(routes.handle(req))));
            // A connection error concerns that client only.
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

struct Routes {
    /// `MAX_BYTES` of payload; `/bytes/N` responses are slices of it (reference-counted, no copy).
    payload: Bytes,
    /// `x-upstream` value: this listener's port.
    upstream: HeaderValue,
}

enum Route {
    Bytes(Option<usize>),
    Echo,
    GrpcEcho,
    NotFound,
}

impl Routes {
    fn handle(&self, req: Request<Incoming>) -> Response<RespBody> {
        let path = req.uri().path();
        let route = if let Some(n) = path.strip_prefix("/bytes/") {
            Route::Bytes(n.parse().ok().filter(|&n| n <= MAX_BYTES))
        } else if path == "/echo" {
            Route::Echo
        } else if path == GRPC_ECHO_PATH {
            Route::GrpcEcho
        } else {
            Route::NotFound
        };
        let method = req.method();
        let mut resp = match route {
            Route::Bytes(_) if method != Method::GET && method != Method::HEAD => {
                status(StatusCode::METHOD_NOT_ALLOWED)
            }
            Route::Bytes(None) => status(StatusCode::BAD_REQUEST),
            Route::Bytes(Some(n)) => {
                let mut resp = Response::new(RespBody::full(self.payload.slice(..n)));
                resp.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("application/octet-stream"),
                );
                resp
            }
            Route::Echo | Route::GrpcEcho if method != Method::POST => {
                status(StatusCode::METHOD_NOT_ALLOWED)
            }
            Route::Echo => {
                let content_type = req.headers().get(CONTENT_TYPE).cloned();
                let mut resp = Response::new(RespBody::Echo {
                    inner: req.into_body(),
                    trailers: None,
                });
                if let Some(content_type) = content_type {
                    resp.headers_mut().insert(CONTENT_TYPE, content_type);
                }
                resp
            }
            Route::GrpcEcho => {
                let is_grpc = req
                    .headers()
                    .get(CONTENT_TYPE)
                    .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
                if is_grpc {
                    let mut trailers = HeaderMap::with_capacity(1);
                    trailers.insert(
                        HeaderName::from_static("grpc-status"),
                        HeaderValue::from_static("0"),
                    );
                    let mut resp = Response::new(RespBody::Echo {
                        inner: req.into_body(),
                        trailers: Some(trailers),
                    });
                    resp.headers_mut()
                        .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
                    resp
                } else {
                    status(StatusCode::UNSUPPORTED_MEDIA_TYPE)
                }
            }
            Route::NotFound => status(StatusCode::NOT_FOUND),
        };
        resp.headers_mut()
            .insert(UPSTREAM_HEADER, self.upstream.clone());
        resp
    }
}

fn status(code: StatusCode) -> Response<RespBody> {
    let mut resp = Response::new(RespBody::Full(None));
    *resp.status_mut() = code;
    resp
}

/// Response body: a whole buffer, or the request body streamed back, optionally followed by
/// trailers. A hand-written body avoids boxing one per request.
enum RespBody {
    Full(Option<Bytes>),
    Echo {
        inner: Incoming,
        /// Sent after the request body ends (gRPC status); request trailers are not echoed.
        trailers: Option<HeaderMap>,
    },
}

impl RespBody {
    fn full(data: Bytes) -> Self {
        // An empty buffer is no frame at all, so the end of stream goes out with the headers.
        Self::Full(Some(data).filter(|d| !d.is_empty()))
    }
}

impl Body for RespBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            Self::Full(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            Self::Echo { inner, trailers } => loop {
                match std::task::ready!(Pin::new(&mut *inner).poll_frame(cx)) {
                    Some(Ok(frame)) if frame.is_data() => return Poll::Ready(Some(Ok(frame))),
                    Some(Ok(_request_trailers)) => {}
                    Some(Err(err)) => return Poll::Ready(Some(Err(err))),
                    None => return Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t)))),
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Full(data) => data.is_none(),
            Self::Echo { inner, trailers } => trailers.is_none() && inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(Some(data)) => SizeHint::with_exact(data.len() as u64),
            Self::Full(None) => SizeHint::with_exact(0),
            // The echo is exactly as long as the request body, so a request with a
            // content-length gets a response with one (no chunked encoding on HTTP/1.1).
            Self::Echo { inner, .. } => inner.size_hint(),
        }
    }
}
