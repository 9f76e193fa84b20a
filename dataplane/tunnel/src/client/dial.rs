//! Making one session: the transports in policy order, QUIC or HTTP/2 over TLS, the hello
//! exchange, and telling a refused certificate from a network failure.

use super::*;

/// One round over the transports, in policy order, the last one that worked first.
pub(super) async fn connect(
    inner: &Arc<Inner>,
    preferred: Option<Transport>,
) -> Result<Arc<Shared>, Error> {
    let s = &inner.settings;
    let mut order = match s.transports {
        TransportPolicy::QuicThenH2 => vec![Transport::Quic, Transport::H2],
        TransportPolicy::H2ThenQuic => vec![Transport::H2, Transport::Quic],
        TransportPolicy::QuicOnly => vec![Transport::Quic],
        TransportPolicy::H2Only => vec![Transport::H2],
    };
    if let Some(p) = preferred
        && let Some(i) = order.iter().position(|t| *t == p)
    {
        order.remove(i);
        order.insert(0, p);
    }
    let mut errors = Vec::new();
    for transport in order {
        let addr = match transport {
            Transport::Quic => s.quic_addr.as_deref(),
            Transport::H2 => s.h2_addr.as_deref(),
        };
        let Some(addr) = addr else { continue };
        let attempt = match transport {
            Transport::Quic => {
                tokio::time::timeout(s.connect_timeout, connect_quic(inner, addr)).await
            }
            Transport::H2 => tokio::time::timeout(s.connect_timeout, connect_h2(inner, addr)).await,
        };
        let result = attempt.unwrap_or_else(|_| {
            Err(Error::Connect {
                transport,
                addr: addr.to_owned(),
                reason: format!("timed out after {:?}", s.connect_timeout),
            })
        });
        inner.metrics.attempt(transport, result.is_ok());
        let result = result.map_err(|e| certificate_refusal(&e).unwrap_or(e));
        match result {
            Ok(shared) => return Ok(shared),
            // The server answered: another transport would get the same answer.
            Err(e @ Error::Refused { .. }) => return Err(e),
            Err(e) => {
                debug!(%transport, %addr, error = %e, "tunnel transport failed");
                errors.push(e);
            }
        }
    }
    match errors.len() {
        0 => Err(Error::Config("no transport to try".into())),
        1 => Err(errors.remove(0)),
        _ => Err(Error::NotConnected(
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        )),
    }
}

/// A TLS alert from the server that rejects our client certificate (or its absence) is a
/// refusal like a bad token: trying again with the same certificate cannot succeed. With TLS 1.3
/// the client finishes its handshake before the server checks the certificate, so the alert
/// shows up in whatever reads next (QUIC close, HTTP/2 connection, the hello).
fn certificate_refusal(e: &Error) -> Option<Error> {
    use rustls::AlertDescription as A;
    let alert = received_alert(e).or_else(|| alert_in_text(&e.to_string()))?;
    let code = match alert {
        A::CertificateExpired => crate::error::RefusalCode::Expired,
        A::BadCertificate
        | A::UnsupportedCertificate
        | A::CertificateRevoked
        | A::CertificateUnknown
        | A::UnknownCA
        | A::AccessDenied
        | A::CertificateRequired
        // What rustls answers when a certificate names a trusted CA but its signature does not
        // verify with that CA's key.
        | A::DecryptError => crate::error::RefusalCode::Unauthenticated,
        _ => return None,
    };
    Some(Error::Refused {
        code,
        reason: format!("the server rejected the TLS client certificate ({alert:?})"),
        retry: false,
    })
}

/// h2 keeps only the kind and text of an I/O error, so on the HTTP/2 path the alert survives
/// only as rustls's message, "received fatal alert: <name>".
fn alert_in_text(text: &str) -> Option<rustls::AlertDescription> {
    use rustls::AlertDescription as A;
    let (_, rest) = text.split_once("received fatal alert: ")?;
    let name: String = rest
        .chars()
        .take_while(char::is_ascii_alphanumeric)
        .collect();
    [
        A::BadCertificate,
        A::UnsupportedCertificate,
        A::CertificateRevoked,
        A::CertificateExpired,
        A::CertificateUnknown,
        A::UnknownCA,
        A::AccessDenied,
        A::CertificateRequired,
        A::DecryptError,
    ]
    .into_iter()
    .find(|a| format!("{a:?}") == name)
}

/// The TLS alert the peer sent, wherever it sits in `e`'s chain of causes.
fn received_alert(e: &(dyn std::error::Error + 'static)) -> Option<rustls::AlertDescription> {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if let Some(rustls::Error::AlertReceived(a)) = e.downcast_ref::<rustls::Error>() {
            return Some(*a);
        }
        // QUIC carries TLS alerts as CRYPTO_ERROR close codes, 0x100 + the alert.
        if let Some(quinn::ConnectionError::ConnectionClosed(close)) =
            e.downcast_ref::<quinn::ConnectionError>()
        {
            let code = u64::from(close.error_code);
            if let Some(alert) = code.checked_sub(0x100).and_then(|a| u8::try_from(a).ok()) {
                return Some(rustls::AlertDescription::from(alert));
            }
        }
        // io::Error::source() skips the wrapped error itself; h2 keeps its I/O error aside.
        let wrapped = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|w| w as &(dyn std::error::Error + 'static))
            .or_else(|| {
                e.downcast_ref::<h2::Error>()
                    .and_then(h2::Error::get_io)
                    .map(|io| io as &(dyn std::error::Error + 'static))
            });
        if let Some(a) = wrapped.and_then(received_alert) {
            return Some(a);
        }
        cur = e.source();
    }
    None
}

async fn resolve(transport: Transport, addr: &str) -> Result<SocketAddr, Error> {
    let err = |reason: String| Error::Connect {
        transport,
        addr: addr.to_owned(),
        reason,
    };
    tokio::net::lookup_host(addr)
        .await
        .map_err(|e| err(e.to_string()))?
        .next()
        .ok_or_else(|| err("resolved to no address".into()))
}

async fn connect_quic(inner: &Arc<Inner>, addr_str: &str) -> Result<Arc<Shared>, Error> {
    let s = &inner.settings;
    let addr = resolve(Transport::Quic, addr_str).await?;
    let connect_err = |reason: String| Error::Connect {
        transport: Transport::Quic,
        addr: addr_str.to_owned(),
        reason,
    };
    let local: SocketAddr = if addr.is_ipv6() {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    };
    // One endpoint (UDP socket) per connection: a reconnect after a network change starts
    // from a fresh socket.
    let endpoint = crate::udp::endpoint(local, None).map_err(|e| connect_err(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(inner.quic_tls.clone());
    config.transport_config(inner.quic_transport.clone());
    let conn = endpoint
        .connect_with(config, addr, &s.server_name)
        .map_err(|e| connect_err(e.to_string()))?
        .await
        .map_err(|e| connect_err(e.to_string()))?;
    let (send, recv) = conn.open_bi().await?;
    let (mut send, mut recv) = (RawSend::Quic(send), RawRecv::Quic(recv));
    let (session_id, identity) = match hello(inner, &mut send, &mut recv).await {
        Ok(ok) => ok,
        Err(e) => {
            // The refusal may have arrived as the close reason rather than on the stream.
            if let Some(quinn::ConnectionError::ApplicationClosed(close)) = conn.close_reason()
                && close.error_code == CLOSE_REFUSED.into()
                && let Ok(Control::Refused {
                    code,
                    reason,
                    retry,
                }) = serde_json::from_slice::<Control>(&close.reason)
            {
                return Err(Error::Refused {
                    code,
                    reason,
                    retry,
                });
            }
            conn.close(session::CLOSE_ABORT.into(), b"handshake failed");
            return Err(e);
        }
    };
    let parts = SessionParts {
        id: session_id,
        transport: Transport::Quic,
        peer: addr,
        conn: Conn::Quic {
            conn,
            endpoint: Some(endpoint),
        },
        role: Role::Client(ClientRole {
            identity,
            binds: inner.binds.clone(),
        }),
        limits: s.limits.clone(),
        keepalive: s.keepalive.clone(),
        drain_grace: s.drain_grace,
        metrics: inner.metrics.clone(),
        cancel: inner.kill.child_token(),
        phase: watch::Sender::new(Phase::Open),
    };
    Ok(Shared::start(parts, send, recv))
}

type H2ClientConn = h2::client::Connection<tokio_rustls::client::TlsStream<TcpStream>, Bytes>;

async fn connect_h2(inner: &Arc<Inner>, addr_str: &str) -> Result<Arc<Shared>, Error> {
    let s = &inner.settings;
    let addr = resolve(Transport::H2, addr_str).await?;
    let connect_err = |reason: String| Error::Connect {
        transport: Transport::H2,
        addr: addr_str.to_owned(),
        reason,
    };
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| connect_err(e.to_string()))?;
    let _ = tcp.set_nodelay(true);
    let name = rustls::pki_types::ServerName::try_from(s.server_name.clone())
        .map_err(|e| Error::Config(format!("server_name: {e}")))?;
    let tls = tokio_rustls::TlsConnector::from(inner.h2_tls.clone())
        .connect(name, tcp)
        .await
        .map_err(|e| connect_err(format!("TLS: {e}")))?;
    if tls.get_ref().1.alpn_protocol() != Some(H2_ALPN) {
        return Err(connect_err("server did not negotiate h2".into()));
    }
    let (send_request, mut conn): (_, H2ClientConn) =
        h2_client_builder(&s.limits).handshake(tls).await?;
    let ping_pong = conn.ping_pong();

    let cancel = inner.kill.child_token();
    let phase = watch::Sender::new(Phase::Open);
    let (done_tx, done_rx) = oneshot::channel::<String>();
    {
        let cancel = cancel.clone();
        let phase = phase.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                r = &mut conn => {
                    let _ = done_tx.send(match r {
                        Ok(()) => "HTTP/2 connection closed".into(),
                        Err(e) => format!("HTTP/2: {e}"),
                    });
                }
                _ = cancel.cancelled() => {
                    // After a clean drain the server closes the connection; give it the chance
                    // so our last frames are flushed. Otherwise drop it now.
                    let clean = matches!(&*phase.borrow(), Phase::Closed(CloseReason::Drained { .. }));
                    if clean {
                        let _ = tokio::time::timeout(LINGER, &mut conn).await;
                    }
                }
            }
        });
    }
    // Until the session exists, a failed handshake must stop the connection task.
    let abort_on_error = cancel.clone().drop_guard();

    let host = if s.server_name.contains(':') {
        format!("[{}]", s.server_name)
    } else {
        s.server_name.clone()
    };
    let base: http::Uri = format!("https://{host}/")
        .parse()
        .map_err(|e| Error::Config(format!("server_name: {e}")))?;
    let control_uri: http::Uri = format!("https://{host}{H2_CONTROL_PATH}")
        .parse()
        .map_err(|e| Error::Config(format!("server_name: {e}")))?;
    let mut sr = send_request.clone().ready().await?;
    let request = http::Request::post(control_uri)
        .body(())
        .map_err(|e| Error::Protocol(e.to_string()))?;
    let (response, send) = sr.send_request(request, false)?;
    let (mut send, mut recv) = (RawSend::h2(send), RawRecv::H2(H2Recv::Pending(response)));
    let (session_id, identity) = hello(inner, &mut send, &mut recv).await?;

    let parts = SessionParts {
        id: session_id,
        transport: Transport::H2,
        peer: addr,
        conn: Conn::H2Client {
            send_request,
            uri: base,
        },
        role: Role::Client(ClientRole {
            identity,
            binds: inner.binds.clone(),
        }),
        limits: s.limits.clone(),
        keepalive: s.keepalive.clone(),
        drain_grace: s.drain_grace,
        metrics: inner.metrics.clone(),
        cancel,
        phase,
    };
    abort_on_error.disarm();
    let shared = Shared::start(parts, send, recv);
    tokio::spawn(session::h2_pinger(shared.clone(), ping_pong));
    let watched = shared.clone();
    tokio::spawn(async move {
        tokio::select! {
            r = done_rx => watched.conn_ended(r.unwrap_or_else(|_| "HTTP/2 connection task ended".into())),
            _ = watched.cancel.cancelled() => {}
        }
    });
    Ok(shared)
}

fn h2_client_builder(limits: &Limits) -> h2::client::Builder {
    let mut b = h2::client::Builder::new();
    b.initial_window_size(limits.stream_window)
        .initial_connection_window_size(limits.connection_window)
        .max_frame_size(wire::H2_MAX_FRAME)
        .max_header_list_size(16 * 1024)
        .max_send_buffer_size(limits.stream_window as usize)
        .enable_push(false);
    b
}

/// The client's half of the handshake: `hello` out, `welcome` (or `refused`) back.
async fn hello(
    inner: &Inner,
    send: &mut RawSend,
    recv: &mut RawRecv,
) -> Result<(u64, String), Error> {
    let s = &inner.settings;
    let max = s.limits.max_control_bytes;
    let hello = Control::Hello {
        version: PROTOCOL_VERSION,
        client_name: s.client_name.clone(),
        token: s.token.clone(),
    };
    wire::write_frame(send, &hello, max).await?;
    match wire::read_frame::<_, Control>(recv, max).await? {
        Some(Control::Welcome {
            version,
            session_id,
            identity,
        }) => {
            if version != PROTOCOL_VERSION {
                return Err(Error::Protocol(format!(
                    "server answered with protocol version {version}"
                )));
            }
            Ok((session_id, identity))
        }
        Some(Control::Refused {
            code,
            reason,
            retry,
        }) => Err(Error::Refused {
            code,
            reason,
            retry,
        }),
        Some(_) => Err(Error::Protocol(
            "server answered hello with something else".into(),
        )),
        None => Err(Error::Protocol(
            "server closed the control stream during the handshake".into(),
        )),
    }
}
