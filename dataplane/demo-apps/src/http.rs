//! HTTP/1.1 + h2c demo service (plain routes, streaming, trailers, WebSocket).

use std::convert::Infallible;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Version, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::{Error, SERVED_BY, net};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = UnsyncBoxBody<Bytes, BoxError>;

/// Upper bound for `/slow` and `/stream` delays, so a typo cannot wedge a test for hours.
const MAX_DELAY_MS: u64 = 30_000;
/// Upper bound for `/stream?chunks=`, for the same reason.
const MAX_CHUNKS: u64 = 100_000;

#[derive(Clone)]
struct Ctx {
    name: Arc<str>,
    /// `POST /order` writes a record with it (see [`serve_http_producing`]).
    producer: Option<crate::kafka::Producer>,
    orders: Arc<std::sync::atomic::AtomicU64>,
    served_by: HeaderValue,
    shutdown: CancellationToken,
    // WebSocket sessions outlive the HTTP connection future that upgraded them; tracking them
    // lets `serve_http` return only after they are closed.
    tasks: TaskTracker,
}

/// HTTP/1.1 + h2c (prior knowledge) server with upgrades enabled.
///
/// Routes: `GET /`, `GET /headers`, `POST /echo`, `GET /slow?ms=N`, `GET /stream?chunks=N&ms=M`
/// and `GET /ws` (WebSocket echo); every response carries `x-served-by: <name>`. (`POST
/// /order`: see [`serve_http_producing`].)
///
/// Runs until `shutdown` is cancelled; then it stops accepting, asks every open connection to
/// finish gracefully (in-flight requests complete, idle keep-alive connections close, WebSocket
/// sessions get a Close frame) and returns once they are all gone.
pub async fn serve_http(
    listener: TcpListener,
    name: String,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    serve_http_producing(listener, name, None, shutdown).await
}

/// [`serve_http`], and with a `producer`, `POST /order` writes one Kafka record per request:
/// value `order-<n>-<name>`, with the request's `traceparent`, `tracestate` and `baggage` headers
/// copied to the record's headers, as OpenTelemetry's Kafka instrumentation propagates them (so a
/// request keyed in `baggage` or `tracestate` makes a record that keeps the request's sandbox; a
/// key in another carrier stays with the request). It answers 202 with the value in `x-record` and the record's
/// partition and offset in the body; 502 when the broker did not take it. Without a producer,
/// `POST /order` is 404.
pub async fn serve_http_producing(
    listener: TcpListener,
    name: String,
    producer: Option<crate::kafka::Producer>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let served_by =
        HeaderValue::try_from(name.as_str()).map_err(|_| Error::InvalidName(name.clone()))?;
    let ctx = Ctx {
        producer,
        orders: Arc::default(),
        name: name.into(),
        served_by,
        shutdown: shutdown.clone(),
        tasks: TaskTracker::new(),
    };
    let builder = auto::Builder::new(TokioExecutor::new());

    while let Some((stream, peer)) = net::accept(&listener, &shutdown).await {
        let builder = builder.clone();
        let ctx = ctx.clone();
        ctx.tasks.clone().spawn(async move {
            let shutdown = ctx.shutdown.clone();
            let svc = hyper::service::service_fn(move |req| handle(req, ctx.clone()));
            let mut conn = pin!(builder.serve_connection_with_upgrades(TokioIo::new(stream), svc));
            let res = tokio::select! {
                res = conn.as_mut() => res,
                () = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = res {
                tracing::debug!(%peer, error = %e, "http connection ended with an error");
            }
        });
    }

    drop(listener);
    ctx.tasks.close();
    ctx.tasks.wait().await;
    Ok(())
}

async fn handle(mut req: Request<Incoming>, ctx: Ctx) -> Result<Response<Body>, Infallible> {
    // HEAD is GET without the body (RFC 9110 §9.3.2). hyper's HTTP/2 server would send the body
    // anyway, which a conforming client (the proxy's, for one) refuses.
    let head = req.method() == Method::HEAD;
    if head {
        *req.method_mut() = Method::GET;
    }
    let mut resp = route(req, &ctx).await;
    resp.headers_mut().insert(SERVED_BY, ctx.served_by.clone());
    if head {
        let (mut parts, body) = resp.into_parts();
        if let Some(len) = hyper::body::Body::size_hint(&body).exact() {
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
        let empty = Full::new(Bytes::new())
            .map_err(|never| match never {})
            .boxed_unsync();
        resp = Response::from_parts(parts, empty);
    }
    Ok(resp)
}

async fn route(req: Request<Incoming>, ctx: &Ctx) -> Response<Body> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/") => text(StatusCode::OK, format!("hello from {}\n", ctx.name)),
        (&Method::GET, "/headers") => headers(&req, &ctx.name),
        (&Method::POST, "/echo") => echo(req),
        (&Method::GET, "/slow") => match query_u64(&req, "ms", 1_000) {
            Ok(ms) => {
                tokio::time::sleep(Duration::from_millis(ms.min(MAX_DELAY_MS))).await;
                text(StatusCode::OK, format!("slow {}\n", ctx.name))
            }
            Err(msg) => text(StatusCode::BAD_REQUEST, msg),
        },
        (&Method::GET, "/stream") => {
            match (query_u64(&req, "chunks", 3), query_u64(&req, "ms", 100)) {
                (Ok(chunks), Ok(ms)) => stream(chunks.min(MAX_CHUNKS), ms.min(MAX_DELAY_MS)),
                (Err(msg), _) | (_, Err(msg)) => text(StatusCode::BAD_REQUEST, msg),
            }
        }
        (&Method::GET, "/ws") => websocket(req, ctx),
        (&Method::POST, "/order") if ctx.producer.is_some() => order(&req, ctx).await,
        _ => text(StatusCode::NOT_FOUND, "not found\n".to_owned()),
    }
}

/// Writes the record of one `POST /order` (see [`serve_http_producing`]).
async fn order<B>(req: &Request<B>, ctx: &Ctx) -> Response<Body> {
    let Some(producer) = &ctx.producer else {
        return text(StatusCode::NOT_FOUND, "not found\n".to_owned());
    };
    let n = ctx
        .orders
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        + 1;
    let value = format!("order-{n}-{}", ctx.name);
    // The context OpenTelemetry's propagators carry (W3C trace context and baggage), and only
    // that: an app propagates its trace, not every header it was sent.
    let headers: Vec<(&str, &[u8])> = ["traceparent", "tracestate", "baggage"]
        .into_iter()
        .flat_map(|name| {
            req.headers()
                .get_all(name)
                .iter()
                .map(move |v| (name, v.as_bytes()))
        })
        .collect();
    match producer.send(value.as_bytes(), &headers).await {
        Ok((partition, offset)) => {
            let mut resp = text(
                StatusCode::ACCEPTED,
                format!(
                    "{value} written by {} (partition {partition}, offset {offset})\n",
                    ctx.name
                ),
            );
            if let Ok(v) = HeaderValue::try_from(value) {
                resp.headers_mut().insert("x-record", v);
            }
            resp
        }
        Err(e) => text(
            StatusCode::BAD_GATEWAY,
            format!("{value} not written: {e}\n"),
        ),
    }
}

fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut resp = Response::new(
        Full::new(body.into())
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

fn text(status: StatusCode, body: String) -> Response<Body> {
    full(status, "text/plain; charset=utf-8", body)
}

/// Parses `?key=<u64>`; a missing key yields `default`, a malformed one a 400 message.
fn query_u64<B>(req: &Request<B>, key: &str, default: u64) -> Result<u64, String> {
    let Some(value) = req
        .uri()
        .query()
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|kv| {
            kv.split_once('=')
                .filter(|(k, _)| *k == key)
                .map(|(_, v)| v)
        })
    else {
        return Ok(default);
    };
    value
        .parse()
        .map_err(|_| format!("query parameter {key} must be a non-negative integer\n"))
}

fn headers<B>(req: &Request<B>, name: &str) -> Response<Body> {
    let map = req.headers();
    let headers: serde_json::Map<String, serde_json::Value> = map
        .keys()
        .map(|k| {
            let values = map
                .get_all(k)
                .iter()
                .map(|v| {
                    serde_json::Value::String(String::from_utf8_lossy(v.as_bytes()).into_owned())
                })
                .collect();
            (k.as_str().to_owned(), serde_json::Value::Array(values))
        })
        .collect();
    // HTTP/2 carries the authority as a pseudo-header that never shows up in the header map.
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            map.get(header::HOST)
                .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
        });
    let doc = serde_json::json!({
        "served_by": name,
        "method": req.method().as_str(),
        "uri": req.uri().to_string(),
        "authority": authority,
        "version": format!("{:?}", req.version()),
        "headers": headers,
    });
    let mut body = doc.to_string();
    body.push('\n');
    full(StatusCode::OK, "application/json", body)
}

/// Hands the request body straight back as the response body: frames (data and trailers) are
/// forwarded one by one as they arrive, so the echo is truly streaming, trailers included.
fn echo(req: Request<Incoming>) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let mut resp = Response::new(body.map_err(BoxError::from).boxed_unsync());
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        resp.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
    }
    resp
}

fn stream(chunks: u64, ms: u64) -> Response<Body> {
    let frames = futures_util::stream::unfold(0u64, move |i| async move {
        if i >= chunks {
            return None;
        }
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let frame = Frame::data(Bytes::from(format!("chunk {i}\n")));
        Some((Ok::<_, BoxError>(frame), i + 1))
    });
    let mut resp = Response::new(StreamBody::new(frames).boxed_unsync());
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn has_token(headers: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().any(|v| {
        v.to_str()
            .is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    })
}

fn websocket(mut req: Request<Incoming>, ctx: &Ctx) -> Response<Body> {
    let h = req.headers();
    let key = h.get(header::SEC_WEBSOCKET_KEY);
    let is_upgrade = req.version() == Version::HTTP_11
        && has_token(h, header::CONNECTION, "upgrade")
        && has_token(h, header::UPGRADE, "websocket")
        && h.get(header::SEC_WEBSOCKET_VERSION)
            .is_some_and(|v| v == "13");
    let (true, Some(key)) = (is_upgrade, key) else {
        let mut resp = text(
            StatusCode::BAD_REQUEST,
            "expected a WebSocket upgrade\n".to_owned(),
        );
        resp.headers_mut().insert(
            header::SEC_WEBSOCKET_VERSION,
            HeaderValue::from_static("13"),
        );
        return resp;
    };
    let accept = derive_accept_key(key.as_bytes());
    let on_upgrade = hyper::upgrade::on(&mut req);

    let name = ctx.name.clone();
    let shutdown = ctx.shutdown.clone();
    ctx.tasks.spawn(async move {
        let upgraded = match on_upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(error = %e, "websocket upgrade failed");
                return;
            }
        };
        let ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
        ws_echo(ws, &name, &shutdown).await;
    });

    let mut resp = Response::new(Body::default());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    if let Ok(v) = HeaderValue::try_from(accept) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    resp
}

async fn ws_echo<S>(mut ws: WebSocketStream<S>, name: &str, shutdown: &CancellationToken)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    loop {
        let msg = tokio::select! {
            () = shutdown.cancelled() => {
                let _ = ws.close(None).await;
                return;
            }
            msg = ws.next() => msg,
        };
        let reply = match msg {
            // Close handshake replies and pongs are queued by tungstenite itself and flushed by
            // the next read, which then reports the end of the stream.
            None => return,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "websocket session ended with an error");
                return;
            }
            Some(Ok(Message::Text(t))) => Message::text(format!("{name}: {}", t.as_str())),
            Some(Ok(Message::Binary(b))) => Message::Binary(b),
            Some(Ok(_)) => continue,
        };
        if let Err(e) = ws.send(reply).await {
            tracing::debug!(error = %e, "websocket send failed");
            return;
        }
    }
}
