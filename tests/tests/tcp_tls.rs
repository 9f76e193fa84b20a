//! L4 paths: opaque TCP with half-close, server-speaks-first protocols, TLS passthrough.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use spur_e2e::{AppKind, Env, EnvOptions, apps, metrics, sample};
use spur_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// Upper bound for anything that could hang.
const BOUND: Duration = Duration::from_secs(10);

async fn read_to_end(stream: &mut (impl AsyncReadExt + Unpin)) -> Vec<u8> {
    let mut out = Vec::new();
    timeout(BOUND, stream.read_to_end(&mut out))
        .await
        .expect("the connection was not closed in time")
        .expect("read error");
    out
}

async fn connections(admin: SocketAddr, protocol: &str) -> f64 {
    sample(
        &metrics(admin).await,
        &format!("spur_connections_total{{protocol=\"{protocol}\"}}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opaque_tcp_echoes_and_propagates_half_close() {
    let env = Env::start(EnvOptions {
        kind: AppKind::TcpEcho,
        rules: vec![],
        ..EnvOptions::default()
    })
    .await;
    let mut stream = TcpStream::connect(env.addr()).await.unwrap();
    let hello = b"\x00\x01hello";
    stream.write_all(hello).await.unwrap();
    let mut echo = [0u8; 7];
    timeout(BOUND, stream.read_exact(&mut echo))
        .await
        .expect("no echo")
        .unwrap();
    assert_eq!(&echo, hello);

    // A second exchange on the same connection: the splice is not a one-shot.
    stream.write_all(b"again").await.unwrap();
    let mut echo = [0u8; 5];
    timeout(BOUND, stream.read_exact(&mut echo))
        .await
        .expect("no second echo")
        .unwrap();
    assert_eq!(&echo, b"again");

    // Our FIN must reach the upstream (it answers EOF with its goodbye), and its FIN must reach us.
    stream.shutdown().await.unwrap();
    let rest = read_to_end(&mut stream).await;
    assert_eq!(String::from_utf8_lossy(&rest), "bye from baseline\n");

    // Both directions have seen EOF, so the proxy's splice is over even though our socket is
    // still open.
    let admin = env.admin();
    let deadline = tokio::time::Instant::now() + BOUND;
    while sample(
        &metrics(admin).await,
        "spur_active_connections{protocol=\"tcp\"}",
    ) != 0.0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the splice did not end after both sides closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(stream);

    assert_eq!(connections(admin, "tcp").await, 1.0);
    assert_eq!(connections(admin, "http1").await, 0.0);
    assert_eq!(env.shutdown().await, 0, "connections left at shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opaque_tcp_streams_a_large_payload_both_ways() {
    let env = Env::start(EnvOptions {
        kind: AppKind::TcpEcho,
        rules: vec![],
        ..EnvOptions::default()
    })
    .await;
    let stream = TcpStream::connect(env.addr()).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    // 4 MiB of a non-HTTP pattern, far more than any socket buffer: only a streaming splice
    // (reading while writing) gets it through.
    let payload: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let expected = payload.clone();
    let writer = tokio::spawn(async move {
        wr.write_all(&payload).await.unwrap();
        wr.shutdown().await.unwrap();
        wr
    });
    let got = timeout(Duration::from_secs(30), async {
        let mut out = Vec::new();
        rd.read_to_end(&mut out).await.unwrap();
        out
    })
    .await
    .expect("payload did not come back in time");
    let _wr = timeout(BOUND, writer).await.unwrap().unwrap();
    let (body, tail) = got.split_at(expected.len().min(got.len()));
    assert!(
        body == expected.as_slice(),
        "echoed payload differs ({} bytes back)",
        got.len()
    );
    assert_eq!(String::from_utf8_lossy(tail), "bye from baseline\n");
    env.shutdown().await;
}

/// An upstream that speaks first: a banner on accept, then `250 <line>` for each line and
/// `221 bye` on `QUIT`.
async fn spawn_banner_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let (rd, mut wr) = stream.into_split();
                if wr.write_all(b"220 hello\r\n").await.is_err() {
                    return;
                }
                let mut lines = tokio::io::BufReader::new(rd);
                let mut line = String::new();
                loop {
                    line.clear();
                    match tokio::io::AsyncBufReadExt::read_line(&mut lines, &mut line).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                    let cmd = line.trim_end();
                    if cmd == "QUIT" {
                        let _ = wr.write_all(b"221 bye\r\n").await;
                        let _ = wr.shutdown().await;
                        return;
                    }
                    if wr
                        .write_all(format!("250 {cmd}\r\n").as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// The client sends nothing until it has read the banner, then holds a short conversation.
async fn banner_conversation(addr: SocketAddr) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut banner = [0u8; 11];
    timeout(BOUND, stream.read_exact(&mut banner))
        .await
        .expect("the server's banner never reached a silent client")
        .unwrap();
    assert_eq!(&banner, b"220 hello\r\n");
    stream.write_all(b"EHLO client\r\n").await.unwrap();
    let mut reply = [0u8; 17];
    timeout(BOUND, stream.read_exact(&mut reply))
        .await
        .expect("no reply")
        .unwrap();
    assert_eq!(&reply, b"250 EHLO client\r\n");
    stream.write_all(b"QUIT\r\n").await.unwrap();
    let rest = read_to_end(&mut stream).await;
    assert_eq!(rest, b"221 bye\r\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_speaks_first_after_detect_timeout() {
    let upstream = spawn_banner_upstream().await;
    let proxy = ProxyConfig {
        detect_timeout: Duration::from_millis(200),
        drain_grace: Duration::from_secs(5),
        ..ProxyConfig::default()
    };
    let sidecar = spur_e2e::sidecar_for(upstream, proxy).await;
    banner_conversation(sidecar.inbound_addr).await;
    assert_eq!(connections(sidecar.admin_addr.unwrap(), "tcp").await, 1.0);
    let m = metrics(sidecar.admin_addr.unwrap()).await;
    assert_eq!(
        sample(&m, "spur_detect_silent_total{first=\"server\"}"),
        1.0,
        "{m}"
    );
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_speaks_first_on_an_opaque_port() {
    let upstream = spawn_banner_upstream().await;
    // Detection would wait far longer than the test's bound: the banner can only arrive in time
    // if the opaque port really skips detection.
    let proxy = ProxyConfig {
        detect_timeout: Duration::from_secs(60),
        opaque_ports: vec![upstream.port()],
        drain_grace: Duration::from_secs(5),
        ..ProxyConfig::default()
    };
    let sidecar = spur_e2e::sidecar_for(upstream, proxy).await;
    banner_conversation(sidecar.inbound_addr).await;

    // On an opaque port even HTTP-looking bytes are not interpreted: they reach the upstream as a
    // line like any other.
    let mut stream = TcpStream::connect(sidecar.inbound_addr).await.unwrap();
    let mut banner = [0u8; 11];
    timeout(BOUND, stream.read_exact(&mut banner))
        .await
        .expect("no banner")
        .unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nQUIT\r\n")
        .await
        .unwrap();
    let rest = read_to_end(&mut stream).await;
    assert_eq!(
        String::from_utf8_lossy(&rest),
        "250 GET / HTTP/1.1\r\n221 bye\r\n"
    );

    drop(stream);

    let admin = sidecar.admin_addr.unwrap();
    assert_eq!(connections(admin, "tcp").await, 2.0);
    assert_eq!(connections(admin, "http1").await, 0.0);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_passed_through_untouched() {
    let tls = apps::test_tls(&["localhost"]).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let token = apps::CancellationToken::new();
    tokio::spawn(apps::serve_tls_echo(
        listener,
        "tls-app".into(),
        tls.server_config.clone(),
        token.clone(),
    ));

    let sidecar = spur_e2e::sidecar_for(
        upstream,
        ProxyConfig {
            drain_grace: Duration::from_secs(5),
            ..ProxyConfig::default()
        },
    )
    .await;

    let mut roots = rustls::RootCertStore::empty();
    roots.add(tls.cert_der.clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(sidecar.inbound_addr).await.unwrap();
    let server_name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    // The handshake only succeeds if the ClientHello reached the upstream byte for byte and its
    // certificate (for which the proxy has no key) came back.
    let mut stream = timeout(BOUND, connector.connect(server_name, tcp))
        .await
        .expect("handshake hung")
        .unwrap();

    stream
        .write_all(b"hello through the proxy\n")
        .await
        .unwrap();
    stream.flush().await.unwrap();
    let expected = b"tls-app: hello through the proxy\n";
    let mut line = vec![0u8; expected.len()];
    timeout(BOUND, stream.read_exact(&mut line))
        .await
        .expect("no echo")
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&line),
        String::from_utf8_lossy(expected)
    );

    stream.write_all(b"second\n").await.unwrap();
    stream.flush().await.unwrap();
    let expected = b"tls-app: second\n";
    let mut line = vec![0u8; expected.len()];
    timeout(BOUND, stream.read_exact(&mut line))
        .await
        .expect("no second echo")
        .unwrap();
    assert_eq!(&line, expected);

    // close_notify and FIN cross the proxy; the upstream answers with its own.
    stream.shutdown().await.unwrap();
    let rest = read_to_end(&mut stream).await;
    assert!(rest.is_empty(), "unexpected bytes after close: {rest:?}");
    drop(stream);

    let admin = sidecar.admin_addr.unwrap();
    assert_eq!(connections(admin, "tls").await, 1.0);
    assert_eq!(connections(admin, "tcp").await, 0.0);
    assert_eq!(sidecar.shutdown().await, 0, "connections left at shutdown");
    token.cancel();
}

/// A client-first protocol whose client waits past detection before its first bytes: carried as
/// opaque TCP on the application connection opened for it at the timeout (one upstream connect),
/// with the echo intact. A client that half-closes without a byte still gets the application's
/// answer to that (as on any opaque connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_that_then_speaks_opaque_uses_the_connection_opened_for_it() {
    let env = Env::start(EnvOptions {
        kind: AppKind::TcpEcho,
        rules: vec![],
        proxy: ProxyConfig {
            detect_timeout: Duration::from_millis(100),
            drain_grace: Duration::from_secs(5),
            ..ProxyConfig::default()
        },
        ..EnvOptions::default()
    })
    .await;
    let admin = env.admin();
    let mut stream = TcpStream::connect(env.addr()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let hello = b"\x00\x01hello";
    stream.write_all(hello).await.unwrap();
    let mut echo = [0u8; 7];
    timeout(BOUND, stream.read_exact(&mut echo))
        .await
        .expect("no echo")
        .unwrap();
    assert_eq!(&echo, hello);
    stream.shutdown().await.unwrap();
    let rest = read_to_end(&mut stream).await;
    assert_eq!(String::from_utf8_lossy(&rest), "bye from baseline\n");
    drop(stream);
    let m = metrics(admin).await;
    assert_eq!(
        sample(&m, "spur_upstream_connects_total{result=\"ok\"}"),
        1.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, "spur_detect_silent_total{first=\"client\"}"),
        1.0,
        "{m}"
    );
    assert_eq!(connections(admin, "tcp").await, 1.0);

    // Silent, then a half-close without a byte: the application sees the FIN and its goodbye
    // comes back. While it waits, the connection is counted as waiting.
    let mut stream = TcpStream::connect(env.addr()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let m = metrics(admin).await;
    assert_eq!(sample(&m, "spur_detect_silent_waiting"), 1.0, "{m}");
    stream.shutdown().await.unwrap();
    let rest = read_to_end(&mut stream).await;
    assert_eq!(String::from_utf8_lossy(&rest), "bye from baseline\n");
    drop(stream);
    let m = metrics(admin).await;
    assert_eq!(
        sample(&m, "spur_detect_silent_total{first=\"nobody\"}"),
        1.0,
        "{m}"
    );
    assert_eq!(sample(&m, "spur_detect_silent_waiting"), 0.0, "{m}");
    assert_eq!(connections(admin, "tcp").await, 2.0);
    assert_eq!(env.shutdown().await, 0, "connections left at shutdown");
}
