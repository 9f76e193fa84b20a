//! Slowloris against the tunnel server's listeners (issue 42, point 6): connections that never
//! finish their handshake must neither stop the accept loop nor keep a real client out, and
//! each one is closed when the handshake timeout ends.
//!
//! The attackers connect from 127.0.0.2 (or 127.0.0.2–101), the real client from 127.0.0.1:
//! on Linux the whole 127.0.0.0/8 is loopback, so these are distinct peers of one listener.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use spur_tunnel::{SessionState, Transport};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};

/// More than the 64 handshake permits the listeners used to share.
const IDLE: usize = 200;

/// How long a real client may take to connect while the attack goes on. Far below the
/// handshake timeout below, so waiting for an idle connection's slot to time out fails.
const BOUND: Duration = Duration::from_secs(3);

fn slow_server_config(pki: &Pki) -> spur_tunnel::ServerConfig {
    let mut config = server_config(pki, Arc::new(authenticator()));
    // The default: an idle connection would hold its slot this long.
    config.handshake_timeout = Duration::from_secs(10);
    config
}

async fn idle_tcp(from: Ipv4Addr, to: SocketAddr) -> Option<TcpStream> {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(IpAddr::V4(from), 0)).unwrap();
    socket.connect(to).await.ok()
}

/// Connects a real client and says how long it took (panics beyond [`BOUND`]).
async fn real_client_connects(pki: &Pki, server: &TestServer, t: Transport) -> Duration {
    let started = Instant::now();
    let (client, _reg) = start_client(client_config(pki, server.quic(), server.h2(), t));
    let mut state = client.state();
    tokio::time::timeout(
        BOUND,
        state.wait_for(|s| matches!(s, SessionState::Connected { .. })),
    )
    .await
    .unwrap_or_else(|_| panic!("a real {t} client did not connect within {BOUND:?} under attack"))
    .unwrap();
    started.elapsed()
}

fn shed(server: &TestServer, reason: &str) -> u64 {
    let metrics = server.metrics();
    let key = format!("handshakes_shed_total{{reason=\"{reason}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_tcp_connections_from_one_peer_do_not_lock_out_clients() {
    let pki = Pki::new();
    let server = TestServer::start(slow_server_config(&pki)).await;
    let mut idle = Vec::new();
    for _ in 0..IDLE {
        idle.extend(idle_tcp(Ipv4Addr::new(127, 0, 0, 2), server.h2()).await);
    }
    assert!(idle.len() > 64, "only {} idle connections", idle.len());
    let took = real_client_connects(&pki, &server, Transport::H2).await;
    eprintln!("connected in {took:?} past {} idle connections", idle.len());
    // Beyond its share, the attacking peer's connections were closed at once.
    assert!(shed(&server, "peer_cap") > 0, "{}", server.metrics());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_tcp_connections_from_many_peers_do_not_lock_out_clients() {
    let pki = Pki::new();
    let mut config = slow_server_config(&pki);
    config.max_handshakes = 64;
    let server = TestServer::start(config).await;
    let mut idle = Vec::new();
    // 100 peers, 3 connections each: within every peer's share, over the table's size.
    for _ in 0..3 {
        for host in 2..102u8 {
            idle.extend(idle_tcp(Ipv4Addr::new(127, 0, 0, host), server.h2()).await);
        }
    }
    assert!(idle.len() > 64);
    real_client_connects(&pki, &server, Transport::H2).await;
    assert!(shed(&server, "evicted_oldest") > 0, "{}", server.metrics());
}

/// A QUIC client that finishes TLS but never sends `hello` (`None` if the server does not
/// let it finish TLS within 5 s).
async fn idle_quic(endpoint: &quinn::Endpoint, to: SocketAddr) -> Option<quinn::Connection> {
    let connecting = endpoint.connect(to, "localhost").ok()?;
    tokio::time::timeout(Duration::from_secs(5), connecting)
        .await
        .ok()?
        .ok()
}

fn quic_endpoint(pki: &Pki, from: Ipv4Addr) -> quinn::Endpoint {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(pki.ca.clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    tls.alpn_protocols = vec![spur_tunnel::QUIC_ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    // An attacker keeps its connections alive past the server's idle timeout.
    let mut transport = quinn::TransportConfig::default();
    transport.keep_alive_interval(Some(Duration::from_millis(100)));
    config.transport_config(Arc::new(transport));
    let mut endpoint = quinn::Endpoint::client(SocketAddr::new(IpAddr::V4(from), 0)).unwrap();
    endpoint.set_default_client_config(config);
    endpoint
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_quic_connections_do_not_lock_out_clients() {
    let pki = Pki::new();
    let server = TestServer::start(slow_server_config(&pki)).await;
    // 10 peers, 10 connections each, all at once; each finishes TLS and then idles.
    let mut attackers = Vec::new();
    let mut endpoints = Vec::new();
    for host in 2..12u8 {
        let endpoint = quic_endpoint(&pki, Ipv4Addr::new(127, 0, 0, host));
        for _ in 0..10 {
            let (endpoint, to) = (endpoint.clone(), server.quic());
            attackers.push(tokio::spawn(async move { idle_quic(&endpoint, to).await }));
        }
        endpoints.push(endpoint);
    }
    // The attack is under way (and far from the handshake timeout) when the client comes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let took = real_client_connects(&pki, &server, Transport::Quic).await;
    let mut idle = Vec::new();
    for a in attackers {
        idle.extend(a.await.unwrap());
    }
    eprintln!(
        "connected in {took:?}; {} idle QUIC connections",
        idle.len()
    );
    assert!(idle.len() > 64, "only {} idle QUIC connections", idle.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_finishes_tls_is_closed_after_the_timeout() {
    let pki = Pki::new();
    let mut config = server_config(&pki, Arc::new(authenticator()));
    config.handshake_timeout = Duration::from_millis(500);
    let server = TestServer::start(config).await;
    let started = Instant::now();
    let mut tcp = TcpStream::connect(server.h2()).await.unwrap();
    let mut buf = [0u8; 64];
    // Nothing sent: the server closes the connection (EOF or reset) once the timeout ends.
    let n = tokio::time::timeout(Duration::from_secs(3), tcp.read(&mut buf))
        .await
        .expect("the server kept a connection without a TLS handshake open");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(400), "closed after {took:?}");

    // Half a ClientHello, then silence: closed the same way.
    let started = Instant::now();
    let mut tcp = TcpStream::connect(server.h2()).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut tcp, &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(3), tcp.read(&mut buf))
        .await
        .expect("the server kept a half-finished TLS handshake open");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    assert!(started.elapsed() >= Duration::from_millis(400));
}
