//! The HTTP server settings every Spur server without a framing guard of its own shares
//! (feature `serve`): hyper enforces a request head's deadline only when a timer is set, and its
//! HTTP/2 keep-alive likewise, so a server built from `Builder::new` alone lets a client that
//! sends half a request head, or nothing at all, hold its connection forever.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio_util::sync::CancellationToken;

/// How long an HTTP/1 request head may take to arrive once the connection waits for one (on a
/// kept-alive connection too).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2: a PING after this long without a frame from the client...
pub const H2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// ...that must be answered within this long, or the connection is closed.
pub const H2_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 streams one connection may have open at once.
pub const H2_MAX_STREAMS: u32 = 256;

/// Serves one connection with [`http_server`] until it ends, or until `stop` (then gracefully,
/// for at most `grace`). A connection whose first request has not arrived within
/// [`HEADER_READ_TIMEOUT`] is dropped: the builder tells HTTP/1 from HTTP/2 by reading the
/// first bytes, with no deadline of its own, so a client that sends nothing would otherwise
/// keep the connection for good.
pub async fn serve_connection<I, S, B>(io: I, svc: S, stop: &CancellationToken, grace: Duration)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let seen = Arc::new(AtomicBool::new(false));
    let first = FirstRequest {
        inner: svc,
        seen: seen.clone(),
    };
    let builder = http_server();
    let conn = builder.serve_connection(io, first);
    tokio::pin!(conn);
    let deadline = tokio::time::sleep(HEADER_READ_TIMEOUT);
    tokio::pin!(deadline);
    let mut deadline_passed = false;
    loop {
        tokio::select! {
            r = &mut conn => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            // The guard is read when the select starts: a request that arrived meanwhile is
            // seen here, and the connection goes on.
            () = &mut deadline, if !deadline_passed => {
                if !seen.load(Ordering::Relaxed) {
                    tracing::debug!("no request within {HEADER_READ_TIMEOUT:?}: connection closed");
                    return;
                }
                deadline_passed = true;
            }
            () = stop.cancelled() => {
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(grace, conn).await;
                return;
            }
        }
    }
}

/// A service that notes its first call.
struct FirstRequest<S> {
    inner: S,
    seen: Arc<AtomicBool>,
}

impl<S, R> hyper::service::Service<R> for FirstRequest<S>
where
    S: hyper::service::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn call(&self, req: R) -> Self::Future {
        self.seen.store(true, Ordering::Relaxed);
        self.inner.call(req)
    }
}

/// An HTTP/1.1 and HTTP/2 server builder with the limits above. Serve with
/// [`serve_connection`] unless the first bytes are known to arrive (they are not for a client
/// that connects and sends nothing).
pub fn http_server() -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(H2_KEEP_ALIVE_INTERVAL))
        .keep_alive_timeout(H2_KEEP_ALIVE_TIMEOUT)
        .max_concurrent_streams(H2_MAX_STREAMS);
    builder
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::convert::Infallible;

    use http_body_util::Full;
    use hyper_util::rt::TokioIo;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    async fn server() -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|_req| async {
                        Ok::<_, Infallible>(hyper::Response::new(Full::new(
                            bytes::Bytes::from_static(b"ok"),
                        )))
                    });
                    let stop = CancellationToken::new();
                    serve_connection(TokioIo::new(stream), svc, &stop, Duration::ZERO).await;
                });
            }
        });
        addr
    }

    /// Reads until the server closes (bounded); how long that took and what came.
    async fn until_closed(mut s: TcpStream) -> (Duration, Vec<u8>) {
        let start = Instant::now();
        let mut out = Vec::new();
        let read = tokio::time::timeout(HEADER_READ_TIMEOUT * 3, s.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "the server never closed a slow connection");
        (start.elapsed(), out)
    }

    /// A slowloris client (half a request head, then nothing; or nothing at all) loses its
    /// connection once the head's deadline passes; a client that sends its request is served.
    /// Real time (10 s): paused time would advance past the deadline before the server has
    /// even read the bytes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_request_heads_lose_their_connection() {
        let addr = server().await;
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET / HTTP/1.1\r\nHost: a\r\nX-Slow: ")
            .await
            .unwrap();
        let silent = TcpStream::connect(addr).await.unwrap();
        let ((half_took, _), (silent_took, _)) =
            tokio::join!(until_closed(half), until_closed(silent));
        for took in [half_took, silent_took] {
            assert!(
                took >= HEADER_READ_TIMEOUT - Duration::from_millis(500)
                    && took < HEADER_READ_TIMEOUT * 2,
                "{took:?}"
            );
        }

        // A connection that sent its first request in time is not cut at that deadline: a
        // second request after it is served.
        let mut kept = TcpStream::connect(addr).await.unwrap();
        kept.write_all(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = kept.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        tokio::time::sleep(HEADER_READ_TIMEOUT / 2 + Duration::from_secs(1)).await;
        kept.write_all(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(HEADER_READ_TIMEOUT / 2).await;
        kept.write_all(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let (_, out) = until_closed(kept).await;
        assert_eq!(
            out.windows(12).filter(|w| w == b"HTTP/1.1 200").count(),
            2,
            "{}",
            String::from_utf8_lossy(&out)
        );

        let mut ok = TcpStream::connect(addr).await.unwrap();
        ok.write_all(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let (_, out) = until_closed(ok).await;
        assert!(out.starts_with(b"HTTP/1.1 200"), "{out:?}");
    }
}
