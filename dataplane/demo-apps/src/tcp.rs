//! Raw TCP and TLS echo services, for the proxy's L4 (passthrough) paths.

use std::sync::Arc;

use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::{Error, net};

/// Longest line the TLS echo accepts; anything longer is treated as abuse and the session ends.
const MAX_LINE: usize = 64 * 1024;

/// TCP echo: echoes bytes back; when the client half-closes (EOF) it writes `bye from <name>\n`
/// and then shuts down its own write side, so tests can prove half-close crosses the proxy.
///
/// Runs until `shutdown` is cancelled, then stops accepting and returns; sessions already open
/// are left to finish on their own (they end when their client closes).
pub async fn serve_tcp_echo(
    listener: TcpListener,
    name: String,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let bye: Arc<[u8]> = format!("bye from {name}\n").into_bytes().into();
    while let Some((stream, peer)) = net::accept(&listener, &shutdown).await {
        let bye = Arc::clone(&bye);
        tokio::spawn(async move {
            if let Err(e) = tcp_echo(stream, &bye).await {
                tracing::debug!(%peer, error = %e, "tcp echo session ended with an error");
            }
        });
    }
    Ok(())
}

async fn tcp_echo<S>(mut stream: S, bye: &[u8]) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        stream.write_all(&buf[..n]).await?;
    }
    stream.write_all(bye).await?;
    stream.shutdown().await
}

/// A self-signed TLS identity for `names`, as a ready rustls server config plus the certificate
/// so clients can trust it.
#[derive(Debug, Clone)]
pub struct TestTls {
    pub server_config: Arc<ServerConfig>,
    pub cert_der: CertificateDer<'static>,
}

/// Generates a self-signed certificate whose subject alternative names are `names` (DNS names
/// or IP addresses). Uses the `ring` provider explicitly rather than a process-wide default.
pub fn test_tls(names: &[&str]) -> Result<TestTls, Error> {
    let names: Vec<String> = names.iter().map(|&n| n.to_owned()).collect();
    let certified = rcgen::generate_simple_self_signed(names)?;
    let cert_der = certified.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        certified.signing_key.serialize_der(),
    ));
    let server_config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![cert_der.clone()], key)?;
    Ok(TestTls {
        server_config: Arc::new(server_config),
        cert_der,
    })
}

/// TLS echo: after the handshake, answers each line with `<name>: <line>`, proving TLS went
/// through the proxy untouched, end to end. On EOF it sends close_notify and closes.
///
/// Runs until `shutdown` is cancelled, then stops accepting and returns; sessions already open
/// are left to finish on their own.
pub async fn serve_tls_echo(
    listener: TcpListener,
    name: String,
    tls: Arc<ServerConfig>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let acceptor = TlsAcceptor::from(tls);
    let name: Arc<str> = name.into();
    while let Some((stream, peer)) = net::accept(&listener, &shutdown).await {
        let acceptor = acceptor.clone();
        let name = Arc::clone(&name);
        tokio::spawn(async move {
            let res = match acceptor.accept(stream).await {
                Ok(tls) => line_echo(tls, &name).await,
                Err(e) => Err(e),
            };
            if let Err(e) = res {
                tracing::debug!(%peer, error = %e, "tls echo session ended with an error");
            }
        });
    }
    Ok(())
}

async fn line_echo<S>(mut stream: S, name: &str) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut pending = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        pending.extend_from_slice(&buf[..n]);
        let mut reply = Vec::new();
        while let Some(pos) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=pos).collect();
            let line = line.strip_suffix(b"\n").unwrap_or(&line);
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            reply.extend_from_slice(name.as_bytes());
            reply.extend_from_slice(b": ");
            reply.extend_from_slice(line);
            reply.push(b'\n');
        }
        if !reply.is_empty() {
            stream.write_all(&reply).await?;
            stream.flush().await?;
        }
        if pending.len() > MAX_LINE {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "line too long",
            ));
        }
    }
    stream.shutdown().await
}
