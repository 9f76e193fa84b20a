//! The listeners: every connection is accepted at once, takes a slot of the handshake table
//! ([`Handshakes`]) and runs its TLS handshake and `hello` under the handshake timeout, then
//! [`establish`] makes it a session.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use rustls::pki_types::CertificateDer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tracing::debug;

use super::{Inner, establish};
use crate::Transport;
use crate::config::Limits;
use crate::error::Error;
use crate::handshakes::{Handshakes, Shed, Ticket};
use crate::session::{self, CLOSE_REFUSED, Conn, Shared, lock};
use crate::stream::{RawRecv, RawSend};
use crate::tls::LINGER;
use crate::wire::{Control, H2_CONTROL_PATH, H2_MAX_FRAME};

pub(super) async fn quic_listener(
    inner: Arc<Inner>,
    endpoint: quinn::Endpoint,
    handshakes: Arc<Handshakes>,
) {
    loop {
        let incoming = tokio::select! {
            i = endpoint.accept() => i,
            _ = inner.stop.cancelled() => return,
        };
        let Some(incoming) = incoming else { return };
        let peer = incoming.remote_address();
        // Under load a peer first proves it owns its address (a Retry keeps no state here), so
        // spoofed sources cannot use up a real peer's share.
        if handshakes.busy() && !incoming.remote_address_validated() && incoming.may_retry() {
            if incoming.retry().is_err() {
                debug!(%peer, "QUIC retry failed");
            }
            continue;
        }
        let Some(ticket) = admit(&inner, &handshakes, peer, Transport::Quic) else {
            incoming.refuse();
            continue;
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            tokio::select! {
                r = serve_quic(&inner, incoming) => if let Err(e) = r {
                    debug!(%peer, error = %e, "QUIC tunnel handshake failed");
                },
                () = ticket.evicted() => {
                    debug!(%peer, "QUIC tunnel handshake cut short: the handshake table is full and it was the oldest");
                }
            }
            drop(ticket);
        });
    }
}

/// A handshake slot for `peer`, or `None` (counted and logged) when its peer has used up its
/// share.
fn admit(
    inner: &Inner,
    handshakes: &Arc<Handshakes>,
    peer: SocketAddr,
    transport: Transport,
) -> Option<Ticket> {
    match handshakes.admit(peer.ip()) {
        Ok((ticket, evicted)) => {
            for _ in 0..evicted {
                inner.metrics.handshake_shed("evicted_oldest");
            }
            Some(ticket)
        }
        Err(Shed::PeerCap) => {
            inner.metrics.handshake_shed("peer_cap");
            debug!(%peer, %transport, "tunnel connection closed: its peer has too many handshakes in flight");
            None
        }
    }
}

async fn serve_quic(inner: &Arc<Inner>, incoming: quinn::Incoming) -> Result<(), Error> {
    let peer = incoming.remote_address();
    let deadline = tokio::time::Instant::now() + inner.handshake_timeout;
    let handshake = async {
        let conn = match incoming.accept().map_err(Error::Quic)?.await {
            Ok(conn) => conn,
            Err(e) => {
                let e = Error::Quic(e);
                inner
                    .authenticator
                    .handshake_failed(peer, Transport::Quic, &e.to_string());
                return Err(e);
            }
        };
        let (send, recv) = conn.accept_bi().await?;
        Ok::<_, Error>((conn, send, recv))
    };
    let (conn, send, recv) = tokio::time::timeout_at(deadline, handshake)
        .await
        .map_err(|_| Error::Timeout {
            what: "QUIC handshake",
            after: inner.handshake_timeout,
        })??;
    let client_cert = conn
        .peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .and_then(|certs| certs.into_iter().next());
    let session_conn = Conn::Quic {
        conn: conn.clone(),
        endpoint: None,
    };
    let refuse_conn = conn.clone();
    establish(
        inner,
        Transport::Quic,
        peer,
        client_cert,
        session_conn,
        RawSend::Quic(send),
        RawRecv::Quic(recv),
        deadline,
        move |refusal: &Control| {
            let reason = serde_json::to_vec(refusal).unwrap_or_default();
            refuse_conn.close(CLOSE_REFUSED.into(), &reason);
        },
        |_| {},
    )
    .await
}

pub(super) async fn h2_listener(
    inner: Arc<Inner>,
    listener: TcpListener,
    handshakes: Arc<Handshakes>,
) {
    // Accept first, always: a connection's handshake holds a slot of the table, never the
    // accept loop.
    while let Some((tcp, peer)) =
        spur_runtime::accept(&listener, inner.stop.cancelled(), "tunnel").await
    {
        let Some(ticket) = admit(&inner, &handshakes, peer, Transport::H2) else {
            drop(tcp);
            continue;
        };
        let inner = inner.clone();
        let acceptor = tokio_rustls::TlsAcceptor::from(lock(&inner.h2_tls).clone());
        tokio::spawn(async move {
            tokio::select! {
                r = serve_h2(&inner, tcp, peer, acceptor) => if let Err(e) = r {
                    debug!(%peer, error = %e, "HTTP/2 tunnel handshake failed");
                },
                () = ticket.evicted() => {
                    debug!(%peer, "HTTP/2 tunnel handshake cut short: the handshake table is full and it was the oldest");
                }
            }
            drop(ticket);
        });
    }
}

/// Most bytes read and dropped while closing after a refused handshake.
const LINGER_BYTES: usize = 64 << 10;

/// Closes a connection whose TLS handshake failed so that the alert rustls wrote reaches the
/// client. With TLS 1.3 the client finishes its side, and sends its HTTP/2 preface, before the
/// server has checked its certificate; a socket closed with that data unread is reset by the
/// kernel, and a reset can destroy the alert at the client, which then retries (a network
/// error) instead of stopping (a refused certificate). So: FIN after the alert, then read and
/// drop what the client still sends until it closes, bounded by [`LINGER`] and
/// [`LINGER_BYTES`].
async fn close_after_alert(mut tcp: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tcp.shutdown().await;
    let mut buf = [0u8; 4096];
    let mut left = LINGER_BYTES;
    let _ = tokio::time::timeout(LINGER, async {
        while left > 0 {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

type H2ServerConn = h2::server::Connection<tokio_rustls::server::TlsStream<TcpStream>, Bytes>;

async fn serve_h2(
    inner: &Arc<Inner>,
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
) -> Result<(), Error> {
    let _ = tcp.set_nodelay(true);
    let deadline = tokio::time::Instant::now() + inner.handshake_timeout;
    let limits = inner.limits.clone();
    let handshake = async {
        let tls = match acceptor.accept(tcp).into_fallible().await {
            Ok(tls) => tls,
            Err((e, tcp)) => {
                // A bare connect and close (a load balancer's TCP health check) is no client.
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    inner.authenticator.handshake_failed(
                        peer,
                        Transport::H2,
                        &format!("TLS handshake failed: {e}"),
                    );
                }
                close_after_alert(tcp).await;
                return Err(e.into());
            }
        };
        let client_cert = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .cloned();
        let mut conn: H2ServerConn = h2_server_builder(&limits).handshake(tls).await?;
        let ping_pong = conn.ping_pong();
        let Some(first) = conn.accept().await else {
            return Err(Error::Protocol(
                "connection closed before the control stream".into(),
            ));
        };
        let (request, mut respond) = first?;
        if request.method() != http::Method::POST || request.uri().path() != H2_CONTROL_PATH {
            let mut response = http::Response::new(());
            *response.status_mut() = http::StatusCode::NOT_FOUND;
            let _ = respond.send_response(response, true);
            return Err(Error::Protocol(format!(
                "first request was {} {}, not the control stream",
                request.method(),
                request.uri().path()
            )));
        }
        let send = respond.send_response(http::Response::new(()), false)?;
        Ok::<_, Error>((conn, ping_pong, client_cert, send, request.into_body()))
    };
    let (mut conn, ping_pong, client_cert, send, body) =
        tokio::time::timeout_at(deadline, handshake)
            .await
            .map_err(|_| Error::Timeout {
                what: "TLS/HTTP/2 handshake",
                after: inner.handshake_timeout,
            })??;

    // Someone has to drive the connection while the handshake reads `hello`: this task until
    // the session exists, then the session's own task.
    let (ready_tx, ready_rx) = oneshot::channel::<Option<Arc<Shared>>>();
    tokio::spawn(async move {
        let mut ready_rx = ready_rx;
        // The client may open streams as soon as it reads `welcome`, which is written just
        // before the session is handed over here: those wait for it. The peer's
        // max_concurrent_streams (the server's SETTINGS) bounds how many can.
        let mut early: Vec<session::H2Accepted> = Vec::new();
        let shared = loop {
            tokio::select! {
                r = &mut ready_rx => match r {
                    Ok(Some(shared)) => break shared,
                    // Refused: let the refusal reach the client, then close.
                    _ => {
                        for (_, mut respond) in early {
                            respond.send_reset(h2::Reason::REFUSED_STREAM);
                        }
                        conn.graceful_shutdown();
                        let _ = tokio::time::timeout(LINGER, async {
                            while let Some(Ok(_)) = conn.accept().await {}
                        })
                        .await;
                        return;
                    }
                },
                r = conn.accept() => match r {
                    Some(Ok(stream)) => early.push(stream),
                    _ => return,
                },
            }
        };
        session::h2_server_conn(shared, conn, early).await;
    });

    let ready = Arc::new(Mutex::new(Some(ready_tx)));
    let ready_refused = ready.clone();
    let ready_ok = ready;
    establish(
        inner,
        Transport::H2,
        peer,
        client_cert,
        Conn::H2Server,
        RawSend::h2(send),
        RawRecv::h2_body(body),
        deadline,
        move |_| {
            if let Some(tx) = lock(&ready_refused).take() {
                let _ = tx.send(None);
            }
        },
        move |shared: &Arc<Shared>| {
            if let Some(tx) = lock(&ready_ok).take() {
                let _ = tx.send(Some(shared.clone()));
            }
            tokio::spawn(session::h2_pinger(shared.clone(), ping_pong));
        },
    )
    .await
}

fn h2_server_builder(limits: &Limits) -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(limits.stream_window)
        .initial_connection_window_size(limits.connection_window)
        .max_concurrent_streams(limits.max_streams)
        .max_frame_size(H2_MAX_FRAME)
        .max_header_list_size(16 * 1024)
        .max_send_buffer_size(limits.stream_window as usize);
    b
}
