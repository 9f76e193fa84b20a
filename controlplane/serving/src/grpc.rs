//! Serves gRPC services (tonic's [`Routes`]) over HTTP/2 with hyper, running every stream of a
//! connection inside that connection's task.
//!
//! tonic's own server hands each HTTP/2 stream to a task of its own (it hard-codes tokio's
//! executor), so a server push wakes two tasks per connection: the stream's, which produces the
//! message, and the connection's, which writes it. A route server holds one long-lived watch
//! stream per sidecar and pushes every change to all of them, so that second wake-up was paid
//! per watcher per change (`perf/results/push_steps.md`, step 4). Here hyper is given an
//! executor that queues a connection's stream futures into a [`FuturesUnordered`] polled by the
//! connection's own task: a push wakes one task, which produces the message and writes it.
//!
//! What tonic's server did and this one keeps: HTTP/2 only (prior knowledge, or ALPN `h2` over
//! the kit's TLS), keepalive pings, graceful shutdown (GOAWAY, then open streams finish), the
//! connection's [`Peer`] in every request's extensions. Kept as hyper's defaults rather than
//! tonic's: at most 200 concurrent streams and 1 024 locally reset streams per connection (tonic
//! set no limit on either). Not kept: tonic's server-side `grpc-timeout` deadline; clients keep
//! their own deadlines, and every handler here bounds its own waits.

use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::task::AtomicWaker;
use hyper::body::Incoming as Body;
use hyper_util::rt::{TokioIo, TokioTimer};
use spur_runtime::Drain;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic::transport::server::Connected;
use tower::Service;

use crate::tls::{Conn, Incoming};

/// HTTP/2 settings of a gRPC port.
#[derive(Debug, Clone)]
pub struct Settings {
    /// A PING after this much silence from the client; None sends none.
    pub keepalive_interval: Option<Duration>,
    /// How long a PING may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
}

impl Default for Settings {
    /// Detects dead clients within 40 s. Clients' own pings (grpc-go sends one every 5 s when it
    /// is configured to) are answered and never counted against them.
    fn default() -> Self {
        Settings {
            keepalive_interval: Some(Duration::from_secs(30)),
            keepalive_timeout: Duration::from_secs(10),
        }
    }
}

/// Serves `routes` on the connections of `incoming` until `stop`, each connection in a task of
/// `tasks`. When `stop` fires, the accept loop ends and every connection shuts down gracefully:
/// a GOAWAY, then its open streams finish (services end their long-lived streams on the same
/// signal). `what` names the port in logs.
pub async fn serve(
    mut incoming: Incoming,
    routes: Routes,
    settings: Settings,
    tasks: Drain,
    stop: CancellationToken,
    what: &'static str,
) {
    let routes = routes.prepare();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            c = incoming.next() => c,
        };
        let Some((conn, remote)) = accepted else {
            return;
        };
        tasks.spawn(connection(
            conn,
            routes.clone(),
            settings.clone(),
            stop.clone(),
            what,
            remote,
        ));
    }
}

/// One connection: hyper's HTTP/2 server and every stream it starts, in this one task.
async fn connection(
    conn: Conn,
    routes: Routes,
    settings: Settings,
    stop: CancellationToken,
    what: &'static str,
    remote: std::net::SocketAddr,
) {
    let peer = conn.connect_info();
    let service = hyper::service::service_fn(move |mut req: http::Request<Body>| {
        req.extensions_mut().insert(peer.clone());
        // A `Routes` is an axum router behind an `Arc`: cloning it per request is cheap, and
        // `call` needs it mutably. Its `poll_ready` is always ready.
        let mut routes = routes.clone();
        async move {
            let response: Result<_, Infallible> = routes.call(req).await;
            response
        }
    });
    let exec = StreamExec::default();
    let mut builder = hyper::server::conn::http2::Builder::new(exec.clone());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(settings.keepalive_interval)
        .keep_alive_timeout(settings.keepalive_timeout);
    let mut http = pin!(builder.serve_connection(TokioIo::new(conn), service));
    let mut stopped = pin!(stop.cancelled_owned());
    let mut stopping = false;
    let mut streams: FuturesUnordered<BoxFuture<'static, ()>> = FuturesUnordered::new();
    let result = poll_fn(|cx| {
        exec.0.waker.register(cx.waker());
        if !stopping && stopped.as_mut().poll(cx).is_ready() {
            stopping = true;
            http.as_mut().graceful_shutdown();
        }
        loop {
            // Streams first: what they queue, the connection's poll just below writes, in this
            // same wake-up.
            while let Poll::Ready(Some(())) = streams.poll_next_unpin(cx) {}
            if let Poll::Ready(r) = http.as_mut().poll(cx) {
                return Poll::Ready(r);
            }
            // Streams the connection just started run now, not at the next wake-up.
            let started = std::mem::take(&mut *exec.0.lock());
            if started.is_empty() {
                return Poll::Pending;
            }
            streams.extend(started);
        }
    })
    .await;
    // A stream still here when the connection has ended can write nothing more: dropping it
    // ends it (and drops its response body, e.g. a watch).
    drop(streams);
    if let Err(e) = result {
        tracing::debug!(%remote, error = %e, port = what, "gRPC connection ended with an error");
    }
}

/// hyper's executor for one connection's streams: queues them for the connection's task.
#[derive(Clone, Default)]
struct StreamExec(Arc<Started>);

#[derive(Default)]
struct Started {
    futures: Mutex<Vec<BoxFuture<'static, ()>>>,
    /// The connection's task, woken when a stream is queued from outside its poll.
    waker: AtomicWaker,
}

impl Started {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<BoxFuture<'static, ()>>> {
        // Nothing panics while holding it; a poisoned queue is still a valid queue.
        self.futures.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<F> hyper::rt::Executor<F> for StreamExec
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        self.0.lock().push(Box::pin(fut));
        self.0.waker.wake();
    }
}
