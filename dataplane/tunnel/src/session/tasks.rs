//! The tasks a session runs: the control channel's writer and reader, the RTT pinger, and
//! accepting data streams (QUIC streams, or HTTP/2 requests on the server side).

use super::*;

pub(super) async fn control_writer(
    shared: Arc<Shared>,
    mut send: RawSend,
    mut rx: mpsc::Receiver<Control>,
) {
    let max = shared.limits.max_control_bytes;
    loop {
        let msg = tokio::select! {
            m = rx.recv() => m,
            _ = shared.cancel.cancelled() => break,
        };
        let Some(msg) = msg else { break };
        let written = tokio::select! {
            r = wire::write_frame(&mut send, &msg, max) => r,
            _ = shared.cancel.cancelled() => break,
        };
        if let Err(e) = written {
            shared.conn_ended(format!("control stream write: {e}"));
            break;
        }
    }
}

pub(super) async fn control_reader(shared: Arc<Shared>, mut recv: RawRecv) {
    let max = shared.limits.max_control_bytes;
    loop {
        let msg = tokio::select! {
            m = wire::read_frame::<_, Control>(&mut recv, max) => m,
            _ = shared.cancel.cancelled() => return,
        };
        match msg {
            Ok(Some(msg)) => {
                if let Err(e) = shared.on_control(msg) {
                    warn!(session = shared.id, peer = %shared.peer, error = %e, "tunnel control protocol error");
                    shared.finish(CloseReason::Lost(e.to_string()));
                    return;
                }
            }
            Ok(None) => {
                shared.conn_ended("control stream closed by peer".into());
                return;
            }
            Err(e) => {
                shared.conn_ended(format!("control stream: {e}"));
                return;
            }
        }
    }
}

/// Control-channel pings, for round-trip time. Liveness is the transport's job (see
/// [`Keepalive`]).
pub(super) async fn pinger(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(shared.keepalive.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shared.cancel.cancelled() => return,
        }
        seq += 1;
        *lock(&shared.ping) = (seq, Some(Instant::now()));
        if shared.control.try_send(Control::Ping { seq }).is_err() {
            continue;
        }
    }
}

pub(super) async fn quic_accept(shared: Arc<Shared>, conn: quinn::Connection) {
    loop {
        let accepted = tokio::select! {
            a = conn.accept_bi() => a,
            _ = shared.cancel.cancelled() => return,
        };
        match accepted {
            Ok((send, recv)) => {
                tokio::spawn(
                    shared
                        .clone()
                        .on_stream(RawSend::Quic(send), RawRecv::Quic(recv)),
                );
            }
            Err(e) => {
                shared.conn_ended(e.to_string());
                return;
            }
        }
    }
}

/// HTTP/2 PING every keepalive interval; no PONG within the timeout ends the session. PING
/// frames are not flow-controlled, so a connection full of stalled streams still answers.
pub(crate) async fn h2_pinger(shared: Arc<Shared>, ping_pong: Option<h2::PingPong>) {
    let Some(mut ping_pong) = ping_pong else {
        return;
    };
    loop {
        tokio::select! {
            _ = tokio::time::sleep(shared.keepalive.interval) => {}
            _ = shared.cancel.cancelled() => return,
        }
        let pong = tokio::select! {
            r = tokio::time::timeout(shared.keepalive.timeout, ping_pong.ping(h2::Ping::opaque())) => r,
            _ = shared.cancel.cancelled() => return,
        };
        match pong {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                shared.conn_ended(format!("HTTP/2 ping: {e}"));
                return;
            }
            Err(_) => {
                shared.finish(CloseReason::KeepaliveTimeout);
                return;
            }
        }
    }
}

/// A stream the HTTP/2 server accepted: the request and where its response goes.
pub(crate) type H2Accepted = (
    http::Request<h2::RecvStream>,
    h2::server::SendResponse<Bytes>,
);

/// Drives a server-side HTTP/2 connection once its session exists: routes data-stream
/// requests (first `early`, those accepted while the session was being set up), and on close
/// shuts down with GOAWAY (gracefully after a clean drain).
pub(crate) async fn h2_server_conn(
    shared: Arc<Shared>,
    mut conn: h2::server::Connection<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, Bytes>,
    early: Vec<H2Accepted>,
) {
    for (request, respond) in early {
        tokio::spawn(h2_server_stream(shared.clone(), request, respond));
    }
    loop {
        tokio::select! {
            r = conn.accept() => match r {
                Some(Ok((request, respond))) => {
                    tokio::spawn(h2_server_stream(shared.clone(), request, respond));
                }
                Some(Err(e)) => {
                    shared.conn_ended(format!("HTTP/2: {e}"));
                    return;
                }
                None => {
                    shared.conn_ended("HTTP/2 connection closed".into());
                    return;
                }
            },
            _ = shared.cancel.cancelled() => break,
        }
    }
    if shared.is_drained_cleanly() {
        conn.graceful_shutdown();
    } else {
        conn.abrupt_shutdown(h2::Reason::CANCEL);
    }
    let _ = tokio::time::timeout(LINGER, async {
        while let Some(Ok((_, mut respond))) = conn.accept().await {
            respond.send_reset(h2::Reason::REFUSED_STREAM);
        }
    })
    .await;
}

async fn h2_server_stream(
    shared: Arc<Shared>,
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
) {
    if request.method() != http::Method::POST || request.uri().path() != H2_STREAM_PATH {
        let mut response = http::Response::new(());
        *response.status_mut() = http::StatusCode::NOT_FOUND;
        let _ = respond.send_response(response, true);
        return;
    }
    let send = match respond.send_response(http::Response::new(()), false) {
        Ok(send) => send,
        Err(e) => {
            debug!(session = shared.id, error = %e, "HTTP/2 response failed");
            return;
        }
    };
    shared
        .on_stream(RawSend::h2(send), RawRecv::h2_body(request.into_body()))
        .await;
}
