//! A bare HTTP/2-to-HTTP/2 relay on the `h2` crate alone (issue 49): it does nothing a proxy
//! must do besides relaying (no routing, no header edits, no metrics, no timeouts, no retries,
//! no limits), so what it costs per request is `h2`'s own work on two connections, the yardstick
//! `perf/per_request_h2.sh h2-bare` holds spur-sidecar's HTTP/2 relay against. Each client
//! connection gets its own upstream connection, and both, with every stream, are driven by the
//! client connection's one task: no wake-up crosses tasks. Not a proxy to deploy.

use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::pin;
use std::task::Poll;

use anyhow::Context as _;
use bytes::Bytes;
use clap::Parser;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use http::{Request, Response};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
#[command(about = "Bare h2c relay on the h2 crate alone: h2's own cost per relayed request")]
struct Args {
    /// Address to accept h2c (prior knowledge) on.
    #[arg(long)]
    listen: SocketAddr,
    /// h2c upstream each client connection is relayed to.
    #[arg(long)]
    upstream: SocketAddr,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (sock, _) = accepted?;
                let upstream = args.upstream;
                tokio::spawn(async move {
                    if let Err(e) = serve(sock, upstream).await {
                        eprintln!("spur-h2-bare: connection: {e:#}");
                    }
                });
            }
            _ = term.recv() => return Ok(()),
        }
    }
}

/// One client connection and its upstream connection, with all their streams, in one task.
async fn serve(sock: TcpStream, upstream: SocketAddr) -> anyhow::Result<()> {
    sock.set_nodelay(true)?;
    let mut conn = h2::server::handshake(sock).await?;
    let up = TcpStream::connect(upstream).await?;
    up.set_nodelay(true)?;
    let (client, up_conn) = h2::client::handshake(up).await?;
    let mut up_conn = pin!(up_conn);
    let mut streams = FuturesUnordered::new();
    poll_fn(|cx| {
        loop {
            while let Poll::Ready(Some(())) = streams.poll_next_unpin(cx) {}
            match conn.poll_accept(cx) {
                Poll::Ready(Some(Ok((req, respond)))) => {
                    streams.push(exchange(req, respond, client.clone()));
                    continue;
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e.into())),
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => {}
            }
            if let Poll::Ready(res) = up_conn.as_mut().poll(cx) {
                return Poll::Ready(res.context("upstream connection"));
            }
            return Poll::Pending;
        }
    })
    .await
}

/// Relays one stream: the request head as it came, then both bodies and the trailers.
async fn exchange(
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    client: h2::client::SendRequest<Bytes>,
) {
    let (parts, body) = req.into_parts();
    let end = body.is_end_stream();
    let sent = async {
        let mut client = client.ready().await?;
        client.send_request(Request::from_parts(parts, ()), end)
    };
    let (response, send) = match sent.await {
        Ok(pair) => pair,
        Err(_) => return respond.send_reset(Reason::REFUSED_STREAM),
    };
    let request_body = async {
        if !end {
            let _ = pump(body, send).await;
        }
    };
    let response_side = async {
        let Ok(response) = response.await else {
            return respond.send_reset(Reason::INTERNAL_ERROR);
        };
        let (parts, body) = response.into_parts();
        let end = body.is_end_stream();
        if let Ok(send) = respond.send_response(Response::from_parts(parts, ()), end)
            && !end
        {
            let _ = pump(body, send).await;
        }
    };
    tokio::join!(request_body, response_side);
}

/// Moves a body's frames and trailers from one stream to the other, releasing each received
/// frame's window once it is handed on; the frame that ends the body ends it on the other side
/// too (no extra empty frame).
async fn pump(mut from: RecvStream, mut to: SendStream<Bytes>) -> Result<(), h2::Error> {
    while let Some(chunk) = from.data().await {
        let chunk = chunk?;
        let n = chunk.len();
        let last = from.is_end_stream();
        to.send_data(chunk, last)?;
        from.flow_control().release_capacity(n)?;
        if last {
            return Ok(());
        }
    }
    match from.trailers().await? {
        Some(trailers) => to.send_trailers(trailers),
        None => to.send_data(Bytes::new(), true),
    }
}
