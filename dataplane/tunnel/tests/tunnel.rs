//! End-to-end tests of the tunnel on 127.0.0.1, each over both transports.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use spur_tunnel::{
    AuthError, AuthFuture, AuthMethod, AuthRequest, Authenticator, BindStatus, CloseReason, Error,
    Identity, Initiator, SessionState, StaticAuthenticator, StreamHeader, Token, Transport,
    TransportPolicy,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Runs `$name(transport)` as `$name::quic` and `$name::h2`.
macro_rules! both {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn quic() {
                super::$name(spur_tunnel::Transport::Quic).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn h2() {
                super::$name(spur_tunnel::Transport::H2).await
            }
        }
    };
}

both!(auth_ok);
async fn auth_ok(t: Transport) {
    let pki = Pki::new();
    let mut server = TestServer::start(server_config(&pki, Arc::new(authenticator()))).await;
    let (client, _reg) = start_client(client_config(&pki, server.quic(), server.h2(), t));
    let state = connected(&client).await;
    let SessionState::Connected {
        transport,
        identity,
        ..
    } = state
    else {
        unreachable!()
    };
    assert_eq!(transport, t);
    assert_eq!(identity, "alice");
    let session = server.next_session().await;
    assert_eq!(session.identity().name, "alice");
    assert_eq!(session.identity().method, AuthMethod::Token);
    assert_eq!(session.client_name(), "test-laptop");
    assert_eq!(session.transport(), t);
    // Control-channel pings measure the round trip.
    within("an rtt sample", async {
        while client.rtt().is_none() || session.rtt().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let metrics = server.metrics();
    assert!(
        metrics.contains(&format!("sessions_active{{transport=\"{t}\"}} 1")),
        "{metrics}"
    );
}

both!(auth_refused_bad_token);
async fn auth_refused_bad_token(t: Transport) {
    let pki = Pki::new();
    let server = TestServer::start(server_config(&pki, Arc::new(authenticator()))).await;
    let mut config = client_config(&pki, server.quic(), server.h2(), t);
    config.token = Some(Token::new("wrong-token"));
    let (client, _reg) = start_client(config);
    let mut state = client.state();
    let state = wait_state(&mut state, "refusal", |s| {
        matches!(s, SessionState::Closed { .. })
    })
    .await;
    let SessionState::Closed { reason } = state else {
        unreachable!()
    };
    assert!(reason.contains("unauthenticated"), "{reason}");
    assert!(reason.contains("unknown token"), "{reason}");
    assert!(!reason.contains("wrong-token"));
    // Opens fail at once instead of waiting for a session that will never come.
    let err = client.open("echo", 7).await.unwrap_err();
    assert!(matches!(err, Error::Closed(_)), "{err}");
    let metrics = server.metrics();
    assert!(
        metrics.contains("auth_failures_total{reason=\"unauthenticated\"} 1"),
        "{metrics}"
    );
}

/// An authenticator that says `expired` for token `old` and defers to the static one otherwise.
struct ExpiringAuth(StaticAuthenticator);

impl Authenticator for ExpiringAuth {
    fn authenticate<'a>(&'a self, req: AuthRequest<'a>) -> AuthFuture<'a> {
        if req.token.map(Token::expose) == Some("old") {
            return Box::pin(async { Err(AuthError::Expired("token old expired".into())) });
        }
        self.0.authenticate(req)
    }
}

both!(auth_refused_expired);
async fn auth_refused_expired(t: Transport) {
    let pki = Pki::new();
    let auth = ExpiringAuth(authenticator().with_token(
        Token::new("short"),
        expiring("bob", Duration::from_millis(700)),
    ));
    let mut server = TestServer::start(server_config(&pki, Arc::new(auth))).await;

    // Refused outright.
    let mut config = client_config(&pki, server.quic(), server.h2(), t);
    config.token = Some(Token::new("old"));
    let (old, _reg) = start_client(config);
    let mut state = old.state();
    let SessionState::Closed { reason } = wait_state(&mut state, "refusal", |s| {
        matches!(s, SessionState::Closed { .. })
    })
    .await
    else {
        unreachable!()
    };
    assert!(reason.contains("expired"), "{reason}");

    // Accepted until the identity expires; then the server drains the session and the
    // reconnect is refused.
    let mut config = client_config(&pki, server.quic(), server.h2(), t);
    config.token = Some(Token::new("short"));
    let (short, _reg) = start_client(config);
    connected(&short).await;
    let session = server.next_session().await;
    assert_eq!(session.identity().name, "bob");
    let closed = within("expiry goaway", session.closed()).await;
    assert!(
        matches!(closed, CloseReason::Drained { initiator: Initiator::Local, ref reason } if reason.contains("expired")),
        "{closed:?}"
    );
    let mut state = short.state();
    let SessionState::Closed { reason } = wait_state(&mut state, "refusal after expiry", |s| {
        matches!(s, SessionState::Closed { .. })
    })
    .await
    else {
        unreachable!()
    };
    assert!(reason.contains("expired"), "{reason}");
}

both!(forward_echo_half_close);
async fn forward_echo_half_close(t: Transport) {
    let pki = Pki::new();
    let mut server = TestServer::start(server_config(&pki, Arc::new(authenticator()))).await;
    let (client, _reg) = start_client(client_config(&pki, server.quic(), server.h2(), t));
    connected(&client).await;
    let session = server.next_session().await;

    let mut stream = client.open("echo", 7).await.unwrap();
    assert_eq!(stream.transport(), t);
    let header = within("header", server.headers.recv()).await.unwrap();
    assert_eq!(
        header,
        StreamHeader::Connect {
            host: "echo".into(),
            port: 7
        }
    );
    stream.write_all(b"hello, ").await.unwrap();
    stream.write_all(b"cluster").await.unwrap();
    // Half-close: our FIN reaches the echo, which answers everything and then FINs back.
    stream.shutdown().await.unwrap();
    let mut back = Vec::new();
    within("echo", stream.read_to_end(&mut back)).await.unwrap();
    assert_eq!(back, b"hello, cluster");
    drop(stream);

    // The server's reason for refusing reaches the caller.
    let err = client.open("refuse", 80).await.unwrap_err();
    assert!(
        matches!(&err, Error::Rejected(r) if r == "connection refused"),
        "{err}"
    );
    // Invalid headers never leave the client.
    assert!(client.open("bad host", 80).await.is_err());

    // Client-initiated close drains and closes both ends cleanly.
    within("client close", client.close(Duration::from_secs(2))).await;
    let closed = within("session closed", session.closed()).await;
    assert!(
        matches!(
            closed,
            CloseReason::Drained {
                initiator: Initiator::Peer,
                ..
            }
        ),
        "{closed:?}"
    );
    assert!(matches!(
        *client.state().borrow(),
        SessionState::Closed { .. }
    ));
}

both!(reverse_stream);
async fn reverse_stream(t: Transport) {
    let pki = Pki::new();
    let mut server = TestServer::start(server_config(&pki, Arc::new(authenticator()))).await;
    let (client, _reg) = start_client(client_config(&pki, server.quic(), server.h2(), t));
    connected(&client).await;
    let session = server.next_session().await;

    let mut listener = client.bind("web-8080", r#"{"port":8080}"#).await.unwrap();
    assert_eq!(*listener.status().borrow(), BindStatus::Active);
    let binds = session.binds().borrow().clone();
    assert_eq!(
        binds.get("web-8080").map(String::as_str),
        Some(r#"{"port":8080}"#)
    );

    // The workstation side answers like a local workload: echo.
    let local = tokio::spawn(async move {
        let incoming = within("reverse stream", listener.accept()).await.unwrap();
        assert!(
            matches!(incoming.header(), StreamHeader::Reverse { bind, .. } if bind == "web-8080")
        );
        echo(incoming.accept().await.unwrap()).await;
        listener
    });
    let mut stream = within("open_reverse", session.open_reverse("web-8080"))
        .await
        .unwrap();
    stream.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    stream.shutdown().await.unwrap();
    let mut back = Vec::new();
    within("reverse echo", stream.read_to_end(&mut back))
        .await
        .unwrap();
    assert_eq!(back, b"GET / HTTP/1.1\r\n\r\n");
    let listener = local.await.unwrap();

    // Unknown binds fail fast; dropping the listener unbinds it on the server.
    assert!(session.open_reverse("nope").await.is_err());
    drop(listener);
    let mut binds = session.binds();
    within("unbind", binds.wait_for(|b| b.is_empty()))
        .await
        .unwrap();
}

both!(splice_carries_both_ways);
/// `Stream::splice` between a local TCP connection and tunnel streams: every byte arrives in
/// order both ways, a half-close passes through in each direction, and the counts come back.
async fn splice_carries_both_ways(t: Transport) {
    const BYTES: usize = 4 * PATTERN_BYTES + 1;
    let pki = Pki::new();
    let server = TestServer::start(server_config(&pki, Arc::new(authenticator()))).await;
    let (client, _reg) = start_client(client_config(&pki, server.quic(), server.h2(), t));
    connected(&client).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();

    // Echo: the application's FIN goes through, the echo's comes back after everything.
    let mut stream = client.open("echo", 7).await.unwrap();
    let app = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (inner, _) = listener.accept().await.unwrap();
    let splice = tokio::spawn(async move { stream.splice(inner).await });
    let (mut rd, mut wr) = app.into_split();
    let writer = tokio::spawn(async move {
        write_pattern(&mut wr, 3, 0, BYTES).await;
        wr.shutdown().await.unwrap();
    });
    assert_eq!(within("echo back", read_pattern(&mut rd, 3)).await, BYTES);
    within("writer", writer).await.unwrap();
    let counts = within("splice end", splice).await.unwrap().unwrap();
    assert_eq!(counts, (BYTES as u64, BYTES as u64));

    // Source: the peer's FIN reaches the application first; the splice ends at ours.
    let mut stream = client.open("source", 5).await.unwrap();
    let mut app = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (inner, _) = listener.accept().await.unwrap();
    let splice = tokio::spawn(async move { stream.splice(inner).await });
    assert_eq!(
        within("download", read_pattern(&mut app, 5)).await,
        PATTERN_BYTES
    );
    assert!(!splice.is_finished());
    app.shutdown().await.unwrap();
    let counts = within("splice end", splice).await.unwrap().unwrap();
    assert_eq!(counts, (0, PATTERN_BYTES as u64));
}

both!(concurrent_streams);
/// 100 streams at once, each moving 1 MiB with every byte checked where it arrives: even
/// streams upload (the server checks), odd ones download (the client checks).
async fn concurrent_streams(t: Transport) {
    const STREAMS: u16 = 100;
    let pki = Pki::new();
    let server = TestServer::start(server_config(&pki, Arc::new(authenticator()))).await;
    let (client, _reg) = start_client(client_config(&pki, server.quic(), server.h2(), t));
    connected(&client).await;
    let client = Arc::new(client);
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for port in 1..=STREAMS {
        let client = client.clone();
        let i = usize::from(port);
        tasks.push(tokio::spawn(async move {
            if port % 2 == 0 {
                let mut stream = client.open("sink", port).await.unwrap();
                write_pattern(&mut stream, i, 0, PATTERN_BYTES).await;
                stream.shutdown().await.unwrap();
                let mut count = [0u8; 8];
                stream.read_exact(&mut count).await.unwrap();
                assert_eq!(
                    u64::from_be_bytes(count),
                    PATTERN_BYTES as u64,
                    "stream {i}"
                );
            } else {
                let mut stream = client.open("source", port).await.unwrap();
                assert_eq!(
                    read_pattern(&mut stream, i).await,
                    PATTERN_BYTES,
                    "stream {i}"
                );
                stream.shutdown().await.unwrap();
            }
        }));
    }
    for task in tasks {
        within("all streams", task).await.unwrap();
    }
    eprintln!(
        "{t}: {STREAMS} streams × {} KiB in {:?}",
        PATTERN_BYTES / 1024,
        started.elapsed()
    );
}

both!(keepalive_detects_dead_peer);
async fn keepalive_detects_dead_peer(t: Transport) {
    let pki = Pki::new();
    let mut server = TestServer::start(server_config(&pki, Arc::new(authenticator()))).await;
    let relay = match t {
        Transport::Quic => Relay::udp(server.quic()).await,
        Transport::H2 => Relay::tcp(server.h2()).await,
    };
    let (client, _reg) = start_client(client_config(&pki, relay.addr, relay.addr, t));
    connected(&client).await;
    let session = server.next_session().await;
    relay.blackhole();
    let started = std::time::Instant::now();
    let closed = within("server notices", session.closed()).await;
    assert_eq!(closed, CloseReason::KeepaliveTimeout);
    let mut state = client.state();
    wait_state(&mut state, "client notices", |s| {
        !matches!(s, SessionState::Connected { .. })
    })
    .await;
    // Keepalive timeout is 800 ms; both ends must notice well before the test's bound.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

both!(reconnect_rebinds_after_server_restart);
async fn reconnect_rebinds_after_server_restart(t: Transport) {
    let pki = Pki::new();
    let auth: Arc<StaticAuthenticator> = Arc::new(authenticator());
    let mut first = TestServer::start(server_config(&pki, auth.clone())).await;
    let (quic, h2) = (first.quic(), first.h2());
    let (client, registry) = start_client(client_config(&pki, quic, h2, t));
    connected(&client).await;
    let _ = first.next_session().await;
    let mut listener = client.bind("api", "meta").await.unwrap();

    within(
        "first server shutdown",
        first.server.shutdown(Duration::from_secs(1)),
    )
    .await;
    drop(first);
    let mut state = client.state();
    wait_state(&mut state, "disconnect", |s| {
        !matches!(s, SessionState::Connected { .. })
    })
    .await;

    // Same addresses: the server's sockets may take a moment to be released.
    let mut second = None;
    for _ in 0..50 {
        let mut config = server_config(&pki, auth.clone());
        config.quic_addr = Some(quic);
        config.h2_addr = Some(h2);
        let mut registry = prometheus_client::registry::Registry::default();
        if let Ok(server) = spur_tunnel::TunnelServer::bind(config, &mut registry).await {
            second = Some(server);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = second.expect("rebinding the server's addresses");
    let session = within("second session", second.accept()).await.unwrap();
    // The bind comes back without the caller doing anything.
    let mut binds = session.binds();
    within(
        "re-registered bind",
        binds.wait_for(|b| b.contains_key("api")),
    )
    .await
    .unwrap();
    let local = tokio::spawn(async move {
        let incoming = within("reverse after reconnect", listener.accept())
            .await
            .unwrap();
        echo(incoming.accept().await.unwrap()).await;
    });
    let mut stream = session.open_reverse("api").await.unwrap();
    stream.write_all(b"again").await.unwrap();
    stream.shutdown().await.unwrap();
    let mut back = Vec::new();
    within("echo", stream.read_to_end(&mut back)).await.unwrap();
    assert_eq!(back, b"again");
    local.await.unwrap();
    let metrics = encode(&registry);
    assert!(metrics.contains("reconnects_total 1"), "{metrics}");
}

both!(shutdown_drains_in_flight_stream);
async fn shutdown_drains_in_flight_stream(t: Transport) {
    const HALF: usize = 256 * 1024;
    let pki = Pki::new();
    let mut server = TestServer::start(server_config(&pki, Arc::new(authenticator()))).await;
    let mut config = client_config(&pki, server.quic(), server.h2(), t);
    config.open_wait = Duration::from_millis(300);
    let (client, _reg) = start_client(config);
    connected(&client).await;
    let session = server.next_session().await;

    let stream = client.open("echo", 7).await.unwrap();
    let (mut r, mut w) = tokio::io::split(stream);
    write_pattern(&mut w, 9, 0, HALF).await;
    // Shut the server down while the stream is mid-transfer.
    let srv = server.server.clone();
    let shutdown = tokio::spawn(async move { srv.shutdown(Duration::from_secs(5)).await });
    let mut state = client.state();
    wait_state(&mut state, "goaway seen", |s| {
        !matches!(s, SessionState::Connected { .. })
    })
    .await;
    // New streams are not accepted any more; the in-flight one keeps going.
    let err = client.open("echo", 7).await.unwrap_err();
    assert!(matches!(err, Error::NotConnected(_)), "{err}");
    let writer = tokio::spawn(async move {
        write_pattern(&mut w, 9, HALF, HALF).await;
        w.shutdown().await.unwrap();
        w
    });
    let n = within("drained stream", read_pattern(&mut r, 9)).await;
    assert_eq!(n, 2 * HALF);
    let w = writer.await.unwrap();
    drop((r, w));
    within("shutdown", shutdown).await.unwrap();
    let closed = session.closed().await;
    assert!(
        matches!(
            closed,
            CloseReason::Drained {
                initiator: Initiator::Local,
                ..
            }
        ),
        "{closed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn falls_back_to_h2_when_udp_is_unreachable() {
    let pki = Pki::new();
    let mut server = TestServer::start(server_config(&pki, Arc::new(authenticator()))).await;
    // A UDP port where nothing answers.
    let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut config = client_config(
        &pki,
        silent.local_addr().unwrap(),
        server.h2(),
        Transport::Quic,
    );
    config.transports = TransportPolicy::QuicThenH2;
    config.connect_timeout = Duration::from_millis(400);
    let (client, registry) = start_client(config);
    let state = connected(&client).await;
    assert!(
        matches!(
            state,
            SessionState::Connected {
                transport: Transport::H2,
                ..
            }
        ),
        "{state:?}"
    );
    assert_eq!(server.next_session().await.transport(), Transport::H2);
    let mut stream = client.open("echo", 7).await.unwrap();
    stream.write_all(b"over h2").await.unwrap();
    stream.shutdown().await.unwrap();
    let mut back = Vec::new();
    within("echo", stream.read_to_end(&mut back)).await.unwrap();
    assert_eq!(back, b"over h2");
    let metrics = encode(&registry);
    assert!(
        metrics.contains("connect_attempts_total{transport=\"quic\",result=\"error\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("connect_attempts_total{transport=\"h2\",result=\"ok\"} 1"),
        "{metrics}"
    );
}

both!(mtls_identity_from_client_cert);
async fn mtls_identity_from_client_cert(t: Transport) {
    let pki = Pki::new();
    let mut config = server_config(
        &pki,
        Arc::new(StaticAuthenticator::new().with_client_certs()),
    );
    config.tls = pki.server_tls(true);
    let mut server = TestServer::start(config).await;

    let mut config = client_config(&pki, server.quic(), server.h2(), t);
    config.token = None;
    config.tls.client_cert = Some(pki.client_cert("alice", "spiffe://spur.dev/user/alice"));
    let (client, _reg) = start_client(config);
    let state = connected(&client).await;
    assert!(
        matches!(&state, SessionState::Connected { identity, .. } if identity == "spiffe://spur.dev/user/alice"),
        "{state:?}"
    );
    let session = server.next_session().await;
    let identity: &Identity = session.identity();
    assert_eq!(identity.method, AuthMethod::ClientCert);
    assert!(identity.expires_at.is_some());

    // Without a certificate (and without a token) the same server refuses.
    let mut config = client_config(&pki, server.quic(), server.h2(), t);
    config.token = None;
    let (anonymous, _reg) = start_client(config);
    let mut state = anonymous.state();
    let SessionState::Closed { reason } = wait_state(&mut state, "refusal", |s| {
        matches!(s, SessionState::Closed { .. })
    })
    .await
    else {
        unreachable!()
    };
    assert!(reason.contains("unauthenticated"), "{reason}");

    // A certificate from a CA the server does not trust: the server's TLS alert is a final
    // refusal, not a reason to keep reconnecting.
    let mut config = client_config(&pki, server.quic(), server.h2(), t);
    config.token = None;
    config.tls.client_cert =
        Some(Pki::new().client_cert("mallory", "spiffe://spur.dev/user/mallory"));
    let (foreign, _reg) = start_client(config);
    let mut state = foreign.state();
    let SessionState::Closed { reason } = wait_state(&mut state, "refusal", |s| {
        matches!(s, SessionState::Closed { .. })
    })
    .await
    else {
        unreachable!()
    };
    assert!(
        reason.contains("rejected the TLS client certificate"),
        "{reason}"
    );
}

both!(reloaded_certificate_and_client_ca_apply_to_new_connections);
async fn reloaded_certificate_and_client_ca_apply_to_new_connections(t: Transport) {
    let old = Pki::new();
    let mut config = server_config(&old, Arc::new(authenticator().with_client_certs()));
    config.tls = old.server_tls(true);
    let server = TestServer::start(config).await;
    let (before, _reg) = start_client(client_config(&old, server.quic(), server.h2(), t));
    connected(&before).await;

    // A renewed certificate from a new CA, which also vouches for client certificates now.
    let new = Pki::new();
    let mut tls = new.server_tls(true);
    tls.client_ca.push(old.ca.clone());
    server.server.reload_tls(&tls).unwrap();

    let mut config = client_config(&new, server.quic(), server.h2(), t);
    config.token = None;
    config.tls.client_cert = Some(new.client_cert("bob", "spiffe://spur.dev/user/bob"));
    let (after, _reg) = start_client(config);
    let state = connected(&after).await;
    assert!(
        matches!(&state, SessionState::Connected { identity, .. } if identity == "spiffe://spur.dev/user/bob"),
        "{state:?}"
    );
    // A client that trusts only the old CA cannot verify the new certificate; the session
    // opened before the reload carries on.
    let mut config = client_config(&old, server.quic(), server.h2(), t);
    config.connect_timeout = Duration::from_millis(500);
    let (stale, _reg) = start_client(config);
    let mut state = stale.state();
    wait_state(&mut state, "a failed attempt", |s| {
        matches!(s, SessionState::Disconnected { .. })
    })
    .await;
    assert!(matches!(
        before.state().borrow().clone(),
        SessionState::Connected { .. }
    ));
    let mut stream = before.open("echo", 7).await.unwrap();
    stream.write_all(b"still here").await.unwrap();
    stream.shutdown().await.unwrap();
    let mut back = Vec::new();
    within("echo", stream.read_to_end(&mut back)).await.unwrap();
    assert_eq!(back, b"still here");
}
