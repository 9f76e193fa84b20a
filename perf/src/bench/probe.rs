//! One verification request per peer and scenario (before any measurement): status, the
//! `x-upstream` header the upstream sets, and for gRPC the `grpc-status`.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};

use super::Proto;

/// What the peer answered.
#[derive(Debug, Clone)]
pub struct ProbeReply {
    pub status: u16,
    pub x_upstream: Option<String>,
    pub grpc_status: Option<String>,
    pub body_len: usize,
}

/// A gRPC message frame (uncompressed) around `message`.
pub fn grpc_frame(message: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + message.len());
    b.put_u8(0);
    b.put_u32(u32::try_from(message.len()).unwrap_or(u32::MAX));
    b.put_slice(message);
    b.freeze()
}

/// Protobuf encoding of a message whose field 1 is `bytes` of length `n` (zeros).
pub fn proto_bytes_field(n: usize) -> Vec<u8> {
    if n == 0 {
        return Vec::new();
    }
    let mut v = vec![0x0a];
    let mut len = n as u64;
    loop {
        let byte = (len & 0x7f) as u8;
        len >>= 7;
        if len == 0 {
            v.push(byte);
            break;
        }
        v.push(byte | 0x80);
    }
    v.resize(v.len() + n, 0);
    v
}

/// Sends one request to `addr` (`path`, plus `header` if given) and returns the reply, all within
/// `timeout`.
pub fn probe(
    addr: SocketAddr,
    proto: Proto,
    path: &str,
    grpc_message: &[u8],
    header: Option<(&str, &str)>,
    timeout: Duration,
) -> Result<ProbeReply> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        tokio::time::timeout(
            timeout,
            probe_async(addr, proto, path, grpc_message, header),
        )
        .await
        .with_context(|| format!("no reply from {addr} within {timeout:?}"))?
    })
}

async fn probe_async(
    addr: SocketAddr,
    proto: Proto,
    path: &str,
    grpc_message: &[u8],
    header: Option<(&str, &str)>,
) -> Result<ProbeReply> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect {addr}"))?;
    tcp.set_nodelay(true)?;
    let io = TokioIo::new(tcp);
    let mut builder = Request::builder();
    let body = match proto {
        Proto::H1 | Proto::H2 => {
            builder = builder.method("GET");
            Bytes::new()
        }
        Proto::Grpc => {
            builder = builder
                .method("POST")
                .header("content-type", "application/grpc")
                .header("te", "trailers");
            grpc_frame(grpc_message)
        }
    };
    if let Some((k, v)) = header {
        builder = builder.header(k, v);
    }
    let resp = match proto {
        Proto::H1 => {
            let req = builder
                .uri(path)
                .header("host", addr.to_string())
                .body(Full::new(body))?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(io).await?;
            tokio::spawn(conn);
            send.send_request(req).await?
        }
        Proto::H2 | Proto::Grpc => {
            let req = builder
                .uri(format!("http://{addr}{path}"))
                .body(Full::new(body))?;
            let (mut send, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            tokio::spawn(conn);
            send.send_request(req).await?
        }
    };
    let status = resp.status().as_u16();
    let hv =
        |h: &http::HeaderMap, k: &str| h.get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
    let x_upstream = hv(resp.headers(), "x-upstream");
    let mut grpc_status = hv(resp.headers(), "grpc-status");
    let collected = resp.into_body().collect().await?;
    if let Some(t) = collected.trailers()
        && grpc_status.is_none()
    {
        grpc_status = hv(t, "grpc-status");
    }
    let body_len = collected.to_bytes().len();
    Ok(ProbeReply {
        status,
        x_upstream,
        grpc_status,
        body_len,
    })
}

/// Checks a reply: 200, `x-upstream` naming `expect_port` (required for h1/h2; for gRPC when
/// present), gRPC status 0.
pub fn check(reply: &ProbeReply, proto: Proto, expect_port: u16) -> Result<()> {
    if reply.status != 200 {
        bail!("status {} (expected 200)", reply.status);
    }
    match (&reply.x_upstream, proto) {
        (Some(u), _) => {
            let port = u.rsplit(':').next().unwrap_or(u).trim();
            if port != expect_port.to_string() {
                bail!("x-upstream: {u} (expected port {expect_port})");
            }
        }
        (None, Proto::H1 | Proto::H2) => bail!("no x-upstream header in the reply"),
        (None, Proto::Grpc) => {}
    }
    if proto == Proto::Grpc && reply.grpc_status.as_deref() != Some("0") {
        bail!("grpc-status {:?} (expected 0)", reply.grpc_status);
    }
    Ok(())
}
