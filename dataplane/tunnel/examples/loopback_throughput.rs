//! One stream, one direction, on 127.0.0.1: how fast each transport moves bytes, next to plain
//! TCP. `cargo run --release -p spur-tunnel --example loopback_throughput [MiB]`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use prometheus_client::registry::Registry;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use spur_tunnel::{
    AuthMethod, ClientConfig, ClientTls, Identity, ServerCert, ServerConfig, ServerTls,
    SessionState, StaticAuthenticator, Token, Transport, TransportPolicy, TunnelClient,
    TunnelServer,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const CHUNK: usize = 64 * 1024;

#[tokio::main]
async fn main() -> Result<()> {
    let mib: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(512);
    let bytes = mib * 1024 * 1024;

    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
    let mut leaf = CertificateParams::new(vec!["localhost".to_owned()])?;
    leaf.subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse()?));
    let key = KeyPair::generate()?;
    let cert = leaf.signed_by(&key, &ca)?;

    let auth = StaticAuthenticator::new()
        .with_token(Token::new("t"), Identity::new("bench", AuthMethod::Token));
    let mut config = ServerConfig::new(
        ServerTls {
            cert: ServerCert::Static {
                chain: vec![cert.der().clone()],
                key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            },
            client_ca: vec![],
            require_client_cert: false,
        },
        Arc::new(auth),
    );
    config.quic_addr = Some("127.0.0.1:0".parse()?);
    config.h2_addr = Some("127.0.0.1:0".parse()?);
    let server = Arc::new(TunnelServer::bind(config, &mut Registry::default()).await?);
    let (quic, h2) = (server.quic_addr(), server.h2_addr());
    let srv = server.clone();
    tokio::spawn(async move {
        while let Some(mut session) = srv.accept().await {
            tokio::spawn(async move {
                while let Some(incoming) = session.accept().await {
                    tokio::spawn(async move {
                        if let Ok(mut s) = incoming.accept().await {
                            let n = sink(&mut s).await;
                            let _ = s.write_all(&n.to_be_bytes()).await;
                            let _ = s.shutdown().await;
                        }
                    });
                }
            });
        }
    });

    // Baseline: plain TCP on loopback, same chunking.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let tcp_addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let n = sink(&mut s).await;
                let _ = s.write_all(&n.to_be_bytes()).await;
            });
        }
    });
    let mut s = tokio::net::TcpStream::connect(tcp_addr).await?;
    let tcp = run(&mut s, bytes).await?;
    println!(
        "tcp   {mib} MiB: {:>7.0} MiB/s",
        mib as f64 / tcp.as_secs_f64()
    );

    for t in [Transport::Quic, Transport::H2] {
        let mut config = ClientConfig::new(
            "localhost",
            ClientTls {
                roots: vec![ca.der().clone()],
                client_cert: None,
            },
        );
        config.quic_addr = quic.map(|a| a.to_string());
        config.h2_addr = h2.map(|a| a.to_string());
        config.transports = match t {
            Transport::Quic => TransportPolicy::QuicOnly,
            Transport::H2 => TransportPolicy::H2Only,
        };
        config.token = Some(Token::new("t"));
        let client = TunnelClient::start(config, &mut Registry::default())?;
        let mut state = client.state();
        tokio::time::timeout(
            Duration::from_secs(10),
            state.wait_for(|s| matches!(s, SessionState::Connected { .. })),
        )
        .await??;
        let mut stream = client.open("sink", 9).await?;
        let took = run(&mut stream, bytes).await?;
        println!(
            "{:<5} {mib} MiB: {:>7.0} MiB/s ({:.2}× TCP)",
            t.as_str(),
            mib as f64 / took.as_secs_f64(),
            tcp.as_secs_f64() / took.as_secs_f64()
        );
        client.close(Duration::from_secs(1)).await;
    }
    server.shutdown(Duration::from_secs(1)).await;
    Ok(())
}

async fn sink<S: AsyncRead + Unpin>(s: &mut S) -> u64 {
    let mut buf = vec![0u8; CHUNK];
    let mut n = 0u64;
    while let Ok(k) = s.read(&mut buf).await {
        if k == 0 {
            break;
        }
        n += k as u64;
    }
    n
}

/// Sends `bytes`, half-closes, and waits for the receiver's count: the time covers delivery.
async fn run<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, bytes: usize) -> Result<Duration> {
    let buf = vec![0xa5u8; CHUNK];
    let started = Instant::now();
    let mut sent = 0;
    while sent < bytes {
        let n = CHUNK.min(bytes - sent);
        s.write_all(&buf[..n]).await?;
        sent += n;
    }
    s.shutdown().await?;
    let mut count = [0u8; 8];
    s.read_exact(&mut count).await?;
    anyhow::ensure!(u64::from_be_bytes(count) == bytes as u64, "short count");
    Ok(started.elapsed())
}
