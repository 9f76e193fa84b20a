//! Preview requests to targets behind agents, over pooled connections: each pooled connection
//! is one tunnel stream to the agent, which carries one TCP connection to the target. Reusing it
//! saves, per request, the round trip that opens a stream and the agent's connect to the target
//! (hyper's pooling client; one per cluster and protocol, keyed by the target's authority).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::Error;
use crate::clusters::Clusters;
use crate::protocol::Open;

/// How long an idle pooled connection is kept.
const IDLE: Duration = Duration::from_secs(30);
/// Idle connections kept per target.
const MAX_IDLE_PER_TARGET: usize = 32;

/// A tunnel stream as hyper's client sees a connection.
pub struct AgentStream(spur_tunnel::Stream);

impl AsyncRead for AgentStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for AgentStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

impl Connection for AgentStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

/// Opens tunnel streams to `cluster`'s agent for the target named by a request URI.
#[derive(Clone)]
pub struct AgentConnector {
    clusters: Clusters,
    cluster: Arc<str>,
    timeout: Duration,
}

impl tower::Service<Uri> for AgentConnector {
    type Response = TokioIo<AgentStream>;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| Error::Invalid(format!("no host in {uri}")))?
                .to_owned();
            let port = uri.port_u16().unwrap_or(80);
            let open = Open::Tcp { host, port };
            let stream = this
                .clusters
                .open(&this.cluster, &open, this.timeout)
                .await?;
            Ok(TokioIo::new(AgentStream(stream)))
        })
    }
}

/// Request bodies as the pooling client sends them: the viewer's, or an empty one when a
/// request is sent again (`crate::preview`).
pub type UpstreamBody = http_body_util::combinators::UnsyncBoxBody<bytes::Bytes, hyper::Error>;

type PreviewClient = Client<AgentConnector, UpstreamBody>;

/// The pooling clients, one per (cluster, HTTP/2).
#[derive(Clone, Default)]
pub struct Upstreams {
    clients: Arc<Mutex<HashMap<(String, bool), PreviewClient>>>,
}

impl Upstreams {
    /// The client for `cluster` (HTTP/2 prior knowledge when `h2`: gRPC targets).
    pub fn client(
        &self,
        clusters: &Clusters,
        cluster: &str,
        h2: bool,
        timeout: Duration,
    ) -> PreviewClient {
        let mut map = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        map.entry((cluster.to_owned(), h2))
            .or_insert_with(|| {
                let connector = AgentConnector {
                    clusters: clusters.clone(),
                    cluster: Arc::from(cluster),
                    timeout,
                };
                let mut b = Client::builder(TokioExecutor::new());
                b.pool_idle_timeout(IDLE)
                    .pool_max_idle_per_host(MAX_IDLE_PER_TARGET)
                    .pool_timer(hyper_util::rt::TokioTimer::new())
                    // The target sees the Host the hub set, not one from the URI.
                    .set_host(false);
                if h2 {
                    b.http2_only(true);
                }
                b.build(connector)
            })
            .clone()
    }

    /// Drops the clients of clusters no longer connected (their pooled streams died with the
    /// session).
    pub fn retain(&self, connected: impl Fn(&str) -> bool) {
        let mut map = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|(c, _), _| connected(c));
    }
}

/// Our error behind a pooling client's error, if the failure was ours (opening the stream).
pub fn hub_error(e: &hyper_util::client::legacy::Error) -> Option<&Error> {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(ours) = s.downcast_ref::<Error>() {
            return Some(ours);
        }
        source = s.source();
    }
    None
}
