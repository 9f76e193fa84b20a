//! Fuzzes spur-proxy's HTTP/1 serving end to end, as a sidecar runs it: the relay
//! (`http/relay.rs`) and, for what it hands over, hyper. One proxy for the whole run, in front of
//! a scripted upstream; per input, a client connection sends bytes from the input and the
//! upstream answers every request it reads with a response blob from the input.
//!
//! Input: two bytes (big-endian) give the blob's length, then the blob (at most 4 KiB), then the
//! client's bytes. Client bytes that do not start like an HTTP/1 request line (`[A-Z]+ /`, not
//! `PRI`) follow a fixed first request, so that the connection is always served as HTTP/1 (the
//! proxy passes anything else through as opaque TCP, which these checks are not about).
//!
//! Checked, whatever the bytes:
//! - the upstream only ever receives well-framed requests (read by a strict parser independent of
//!   the proxy's: CRLF line endings, one `Host`, no `Transfer-Encoding` with `Content-Length`, a
//!   chunked body that follows RFC 9112 §7.1), except a last one cut short by a close;
//! - the client only ever receives well-framed responses, read the same way, except a last one
//!   cut short by a close (an upstream that died mid-body), and no interim response other than a
//!   100 Continue (not checked when the client's bytes hold a `HEAD`, whose responses have no
//!   body whatever their framing says);
//! - the connection ends: the proxy neither hangs nor panics.
#![no_main]

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use spur_proxy::{Drain, Inbound, Plugins, Proxy, ProxyConfig};
use spur_sidecar::{KeyRouter, KeyRouterConfig};
use spur_routing::{BaselineWorkload, ExtractConfig, SharedTable};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

struct Rig {
    rt: tokio::runtime::Runtime,
    proxy: SocketAddr,
    /// The response blob the upstream answers with.
    blob: Arc<Mutex<Vec<u8>>>,
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let blob = Arc::new(Mutex::new(Vec::new()));
        let proxy = rt.block_on(async {
            let up = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let app = up.local_addr().expect("addr");
            tokio::spawn(upstream(up, blob.clone()));
            let mut registry = prometheus_client::registry::Registry::default();
            let router = KeyRouter::new(
                KeyRouterConfig {
                    baseline: BaselineWorkload {
                        kind: "Deployment".into(),
                        namespace: "fuzz".into(),
                        name: "app".into(),
                    },
                    extract: ExtractConfig::default(),
                },
                SharedTable::new(),
            )
            .expect("router");
            // The key router also routes the relay's heads (a plug-in beside routing).
            let router = Arc::new(router);
            let plugins = Plugins {
                raw: Some(router.clone()),
                ..Plugins::default()
            };
            let proxy = Proxy::with_plugins(
                ProxyConfig {
                    idle_timeout: Duration::from_secs(2),
                    header_read_timeout: Duration::from_secs(2),
                    connect_timeout: Duration::from_secs(1),
                    ..ProxyConfig::default()
                },
                router,
                plugins,
                &mut registry,
            )
            .expect("proxy");
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            tokio::spawn(async move {
                proxy
                    .serve(listener, Inbound::Explicit { app }, Drain::new())
                    .await
            });
            addr
        });
        Rig { rt, proxy, blob }
    })
}

/// Reads requests strictly and answers each with the blob; closes when the peer pauses.
async fn upstream(listener: TcpListener, blob: Arc<Mutex<Vec<u8>>>) {
    while let Ok((mut s, _)) = listener.accept().await {
        let blob = blob.clone();
        tokio::spawn(async move {
            let mut r = Reader::default();
            loop {
                match tokio::time::timeout(Duration::from_millis(50), r.request(&mut s)).await {
                    Ok(Ok(())) => {}
                    // A close or a pause: done with this connection.
                    Ok(Err(Cut)) | Err(_) => return,
                }
                let resp = blob.lock().await.clone();
                if s.write_all(&resp).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// The stream ended (or paused) inside or before a message.
#[derive(Debug)]
struct Cut;

#[derive(Default)]
struct Reader {
    buf: Vec<u8>,
}

impl Reader {
    async fn fill(&mut self, s: &mut TcpStream) -> Result<(), Cut> {
        let mut chunk = [0u8; 8192];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => Err(Cut),
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(())
            }
        }
    }

    /// A complete head, strictly: every line ends in CRLF.
    async fn head(&mut self, s: &mut TcpStream, what: &str) -> Result<Vec<u8>, Cut> {
        loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head: Vec<u8> = self.buf.drain(..i + 4).collect();
                for (j, &b) in head.iter().enumerate() {
                    assert!(
                        b != b'\n' || (j > 0 && head[j - 1] == b'\r'),
                        "{what} with a bare LF: {:?}",
                        String::from_utf8_lossy(&head)
                    );
                    assert!(
                        b != b'\r' || head.get(j + 1) == Some(&b'\n'),
                        "{what} with a bare CR: {:?}",
                        String::from_utf8_lossy(&head)
                    );
                }
                return Ok(head);
            }
            assert!(self.buf.len() < 1 << 20, "{what}: a head over 1 MiB");
            self.fill(s).await?;
        }
    }

    async fn exact(&mut self, s: &mut TcpStream, n: usize) -> Result<(), Cut> {
        while self.buf.len() < n {
            self.fill(s).await?;
        }
        self.buf.drain(..n);
        Ok(())
    }

    async fn line(&mut self, s: &mut TcpStream, what: &str) -> Result<Vec<u8>, Cut> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line: Vec<u8> = self.buf.drain(..i + 2).collect();
                assert!(
                    !line[..i].contains(&b'\n') && !line[..i].contains(&b'\r'),
                    "{what}: a bare LF or CR in {:?}",
                    String::from_utf8_lossy(&line)
                );
                return Ok(line);
            }
            self.fill(s).await?;
        }
    }

    /// A chunked body, strictly.
    async fn chunked(&mut self, s: &mut TcpStream, what: &str) -> Result<(), Cut> {
        loop {
            let line = self.line(s, what).await?;
            let digits: Vec<u8> = line
                .iter()
                .copied()
                .take_while(u8::is_ascii_hexdigit)
                .collect();
            assert!(
                !digits.is_empty() && digits.len() <= 15,
                "{what}: chunk size line {:?}",
                String::from_utf8_lossy(&line)
            );
            let size = usize::from_str_radix(std::str::from_utf8(&digits).unwrap_or("0"), 16)
                .unwrap_or(0);
            if size == 0 {
                // Trailer lines, then the empty line.
                while self.line(s, what).await?.len() > 2 {}
                return Ok(());
            }
            self.exact(s, size).await?;
            let end = self.line(s, what).await?;
            assert_eq!(end, b"\r\n", "{what}: chunk data not followed by CRLF");
        }
    }

    /// One request; the framing checks fail the run, a cut returns `Cut`.
    async fn request(&mut self, s: &mut TcpStream) -> Result<(), Cut> {
        let head = self.head(s, "a forwarded request").await?;
        let mut fields = [httparse::EMPTY_HEADER; 256];
        let mut req = httparse::Request::new(&mut fields);
        let parsed = req.parse(&head);
        assert!(
            matches!(parsed, Ok(httparse::Status::Complete(n)) if n == head.len()),
            "a forwarded request the strict parser refuses ({parsed:?}): {:?}",
            String::from_utf8_lossy(&head)
        );
        let framing = framing(req.headers, "a forwarded request", &head);
        let hosts = req
            .headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("host"))
            .count();
        assert!(
            hosts == 1 || req.version == Some(0) && hosts == 0,
            "a forwarded request with {hosts} Host fields: {:?}",
            String::from_utf8_lossy(&head)
        );
        match framing {
            Framing::Chunked => self.chunked(s, "a forwarded request body").await,
            Framing::Length(n) => self.exact(s, n).await,
            Framing::None => Ok(()),
        }
    }

    /// One response; `Ok(false)` once the stream has ended cleanly between responses.
    async fn response(&mut self, s: &mut TcpStream) -> Result<bool, Cut> {
        if self.buf.is_empty() {
            let mut chunk = [0u8; 8192];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return Ok(false),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
        let head = self.head(s, "a response to the client").await?;
        let mut fields = [httparse::EMPTY_HEADER; 256];
        let mut resp = httparse::Response::new(&mut fields);
        let parsed = resp.parse(&head);
        assert!(
            matches!(parsed, Ok(httparse::Status::Complete(n)) if n == head.len()),
            "a response the strict parser refuses ({parsed:?}): {:?}",
            String::from_utf8_lossy(&head)
        );
        let code = resp.code.unwrap_or(0);
        assert!(
            code == 100 || code >= 200,
            "an interim response reached the client: {:?}",
            String::from_utf8_lossy(&head)
        );
        let framing = framing(resp.headers, "a response to the client", &head);
        if code == 100 || code == 204 || code == 304 {
            return Ok(true);
        }
        match framing {
            Framing::Chunked => self.chunked(s, "a response body").await?,
            Framing::Length(n) => self.exact(s, n).await?,
            Framing::None => {
                // Delimited by the close: the last response of the connection.
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest).await;
                self.buf.clear();
                return Ok(false);
            }
        }
        Ok(true)
    }
}

enum Framing {
    None,
    Length(usize),
    Chunked,
}

fn framing(headers: &[httparse::Header<'_>], what: &str, head: &[u8]) -> Framing {
    let show = || String::from_utf8_lossy(head).into_owned();
    let te: Vec<&[u8]> = headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("transfer-encoding"))
        .map(|h| h.value)
        .collect();
    let cl: Vec<&[u8]> = headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("content-length"))
        .map(|h| h.value)
        .collect();
    if !te.is_empty() {
        assert!(cl.is_empty(), "{what} with Transfer-Encoding and Content-Length: {:?}", show());
        let last = te
            .last()
            .and_then(|v| v.split(|&b| b == b',').next_back())
            .map(<[u8]>::trim_ascii)
            .unwrap_or_default();
        if last.eq_ignore_ascii_case(b"chunked") {
            return Framing::Chunked;
        }
        return Framing::None;
    }
    match cl.as_slice() {
        [] => Framing::None,
        [v, rest @ ..] => {
            assert!(rest.iter().all(|r| r == v), "{what} with differing lengths: {:?}", show());
            let n = std::str::from_utf8(v)
                .ok()
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse().ok());
            match n {
                Some(n) => Framing::Length(n),
                None => panic!("{what} with Content-Length {:?}: {:?}", String::from_utf8_lossy(v), show()),
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((len, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let len = usize::from(u16::from_be_bytes(*len)).min(4096).min(rest.len());
    let (blob, client) = rest.split_at(len);
    if client.is_empty() {
        return;
    }
    let method = client.iter().take_while(|b| b.is_ascii_uppercase()).count();
    let client = if (1..=10).contains(&method)
        && client[method..].starts_with(b" /")
        && !client.starts_with(b"PRI ")
    {
        client.to_vec()
    } else {
        [&b"GET /first HTTP/1.1\r\nHost: a\r\n\r\n"[..], client].concat()
    };
    let client = client.as_slice();
    let rig = rig();
    rig.rt.block_on(async {
        *rig.blob.lock().await = blob.to_vec();
        let mut s = TcpStream::connect(rig.proxy).await.expect("connect");
        let _ = s.write_all(client).await;
        let _ = s.shutdown().await;
        let check = !client.windows(4).any(|w| w.eq_ignore_ascii_case(b"HEAD"));
        let run = async {
            let mut r = Reader::default();
            loop {
                match r.response(&mut s).await {
                    Ok(true) if check => {}
                    Ok(true) => {
                        let mut rest = Vec::new();
                        let _ = s.read_to_end(&mut rest).await;
                        return;
                    }
                    Ok(false) | Err(Cut) => return,
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("the proxy neither answered nor closed within 10 s");
    });
});
