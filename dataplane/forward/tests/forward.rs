//! The forward proxy (SOCKS5 and HTTP CONNECT on one port) with real clients: curl through
//! `--socks5-hostname`, `--socks5` and `--proxytunnel`, and hand-written handshakes for the
//! edge cases curl never produces. Targets are loopback servers reached through a name map,
//! the way the tunnel proxy resolves cluster names.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use spur_forward::{ConnRecord, DialError, Dialer, ForwardConfig, Target, serve_forward};
use spur_runtime::Drain;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Resolves names through a fixed map and connects over loopback; records every connection.
#[derive(Default)]
struct MapDialer {
    names: HashMap<String, SocketAddr>,
    password: Option<(String, String)>,
    records: Mutex<Vec<ConnRecord>>,
}

impl Dialer for MapDialer {
    type Stream = TcpStream;

    async fn dial(
        &self,
        target: &Target,
        _client: SocketAddr,
        _user: Option<&str>,
    ) -> Result<TcpStream, DialError> {
        let addr = match target {
            Target::Addr(a) => *a,
            Target::Host(h, p) => {
                let a = self
                    .names
                    .get(h)
                    .ok_or_else(|| DialError::HostNotFound(h.clone()))?;
                SocketAddr::new(a.ip(), *p)
            }
        };
        if addr.ip().is_unspecified() {
            return Err(DialError::NotAllowed(addr.to_string()));
        }
        TcpStream::connect(addr)
            .await
            .map_err(|e| DialError::from_io(target, &e))
    }

    fn requires_auth(&self) -> bool {
        self.password.is_some()
    }

    fn check_password(&self, user: &str, password: &str) -> Option<bool> {
        self.password
            .as_ref()
            .map(|(u, p)| u == user && p == password)
    }

    fn finished(&self, record: &ConnRecord) {
        self.records.lock().unwrap().push(record.clone());
    }
}

/// An HTTP/1.1 server that answers every request with `hello from <name>` and closes.
async fn http_server(name: &'static str) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let body = format!("hello from {name}");
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

async fn start(dialer: Arc<MapDialer>) -> (SocketAddr, Drain) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let drain = Drain::new();
    let config = ForwardConfig {
        handshake_timeout: Duration::from_secs(2),
        dial_timeout: Duration::from_secs(2),
    };
    tokio::spawn(serve_forward(l, dialer, config, drain.clone()));
    (addr, drain)
}

async fn curl(args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .args(args)
        .output()
        .await
        .expect("curl runs (tests/run.sh installs it)");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test]
async fn curl_through_socks5_and_http_connect_reaches_named_targets() {
    let api = http_server("api").await;
    let dialer = Arc::new(MapDialer {
        names: HashMap::from([("api.shop.svc".to_string(), api)]),
        ..MapDialer::default()
    });
    let (proxy, _drain) = start(dialer.clone()).await;
    let url = format!("http://api.shop.svc:{}/", api.port());

    // The name travels to the dialer unresolved (socks5h), as for cluster names.
    let (ok, out) = curl(&["--socks5-hostname", &proxy.to_string(), &url]).await;
    assert!(ok && out == "hello from api", "{out}");
    // By address (curl resolves; here: a literal).
    let by_ip = format!("http://{api}/");
    let (ok, out) = curl(&["--socks5", &proxy.to_string(), &by_ip]).await;
    assert!(ok && out == "hello from api", "{out}");
    // HTTP CONNECT on the same port.
    let (ok, out) = curl(&["--proxytunnel", "-x", &format!("http://{proxy}"), &url]).await;
    assert!(ok && out == "hello from api", "{out}");
    // Unknown names and refused ports are answered, not hung.
    let (ok, out) = curl(&[
        "--socks5-hostname",
        &proxy.to_string(),
        "http://nope.svc:80/",
    ])
    .await;
    assert!(!ok, "{out}");
    let (ok, out) = curl(&[
        "--proxytunnel",
        "-x",
        &format!("http://{proxy}"),
        "http://nope.svc:80/",
    ])
    .await;
    assert!(!ok && out.contains("502"), "{out}");

    let records = dialer.records.lock().unwrap().clone();
    assert_eq!(records.len(), 5, "{records:#?}");
    let ok_records: Vec<_> = records.iter().filter(|r| r.outcome == "ok").collect();
    assert_eq!(ok_records.len(), 3, "{records:#?}");
    for r in &ok_records {
        assert!(r.bytes_up > 0 && r.bytes_down > 0, "{r:?}");
        assert_eq!(r.client.ip(), proxy.ip());
    }
    assert!(
        records
            .iter()
            .any(|r| r.protocol == "http-connect" && r.outcome.contains("host not found"))
    );
    assert!(records.iter().any(|r| r.protocol == "socks5"
        && r.target == Some(Target::Host("nope.svc".into(), 80))
        && r.outcome.contains("host not found")));
}

#[tokio::test]
async fn socks5_password_authentication() {
    let api = http_server("api").await;
    let dialer = Arc::new(MapDialer {
        names: HashMap::from([("api".to_string(), api)]),
        password: Some(("alice".into(), "s3cret".into())),
        ..MapDialer::default()
    });
    let (proxy, _drain) = start(dialer.clone()).await;
    let url = format!("http://api:{}/", api.port());
    let (ok, out) = curl(&["--socks5-hostname", &format!("alice:s3cret@{proxy}"), &url]).await;
    assert!(ok && out == "hello from api", "{out}");
    let (ok, out) = curl(&["--socks5-hostname", &format!("alice:wrong@{proxy}"), &url]).await;
    assert!(!ok, "{out}");
    let (ok, out) = curl(&["--socks5-hostname", &proxy.to_string(), &url]).await;
    assert!(!ok, "{out}");
    let records = dialer.records.lock().unwrap().clone();
    assert_eq!(records[0].user.as_deref(), Some("alice"));
    assert!(
        records[1].outcome.contains("authentication failed"),
        "{:?}",
        records[1]
    );
    // The password never appears in what is recorded (and so logged).
    assert!(!format!("{records:?}").contains("s3cret"));
    assert!(
        records[2].outcome.contains("no username/password"),
        "{:?}",
        records[2]
    );
}

/// Sends `bytes`, returns everything the proxy answers before closing (bounded by time).
async fn exchange(proxy: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    out
}

#[tokio::test]
async fn hostile_and_unsupported_handshakes_get_clear_answers() {
    let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let echo_addr = echo.local_addr().unwrap();
    let dialer = Arc::new(MapDialer::default());
    let (proxy, _drain) = start(dialer.clone()).await;

    // BIND (2) and UDP ASSOCIATE (3): "command not supported".
    for cmd in [2u8, 3] {
        let mut req = vec![5, 1, 0, 5, cmd, 0, 1, 127, 0, 0, 1];
        req.extend_from_slice(&echo_addr.port().to_be_bytes());
        let out = exchange(proxy, &req).await;
        assert_eq!(&out[..2], &[5, 0]);
        assert_eq!(out[3], 7, "reply code for command {cmd}: {out:?}");
    }
    // Unknown address type: 8.
    let out = exchange(proxy, &[5, 1, 0, 5, 1, 0, 9, 0, 0]).await;
    assert_eq!(out[3], 8, "{out:?}");
    // A host name with bytes no DNS name has: refused without dialing.
    let mut req = vec![5, 1, 0, 5, 1, 0, 3, 9];
    req.extend_from_slice(b"a b\r\nc/d");
    req.extend_from_slice(&[0, 80]);
    let out = exchange(proxy, &req).await;
    assert_eq!(out, vec![5, 0], "no reply to an invalid name, just a close");
    // No acceptable method.
    let out = exchange(proxy, &[5, 1, 0x80]).await;
    assert_eq!(out, vec![5, 0xFF]);
    // Connection refused: reply 5.
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let mut req = vec![5, 1, 0, 5, 1, 0, 1, 127, 0, 0, 1];
    req.extend_from_slice(&closed.port().to_be_bytes());
    let out = exchange(proxy, &req).await;
    assert_eq!(out[3], 5, "{out:?}");
    // Garbage and a silent client: closed, recorded, nothing hangs.
    assert!(exchange(proxy, b"\x16\x03\x01garbage").await.is_empty());
    let _silent = TcpStream::connect(proxy).await.unwrap();
    // A plain GET to the HTTP side is not a proxy request.
    let out = exchange(proxy, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert!(
        String::from_utf8_lossy(&out).starts_with("HTTP/1.1 405"),
        "{out:?}"
    );
    // Truncated greetings are not waited on forever: the handshake times out (2 s here).
    let out = exchange(proxy, &[5, 3, 0]).await;
    assert!(out.is_empty());

    // A good CONNECT by address, with half-close: the echo server's answer arrives after the
    // client shut down its side.
    tokio::spawn(async move {
        let (mut s, _) = echo.accept().await.unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        s.write_all(&got).await.unwrap();
        s.write_all(b" back").await.unwrap();
    });
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let mut req = vec![5, 1, 0, 5, 1, 0, 1, 127, 0, 0, 1];
    req.extend_from_slice(&echo_addr.port().to_be_bytes());
    s.write_all(&req).await.unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(
        &head[..4],
        &[5, 0, 5, 0],
        "method accepted, then success: {head:?}"
    );
    s.write_all(b"ping").await.unwrap();
    s.shutdown().await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out, b"ping back");
}

/// The front door's HTTP/1 rules hold on the HTTP CONNECT side: two `Host` headers, none on
/// HTTP/1.1, a bare LF, and a smuggled second request are answered 400 (or the connection is
/// closed) and nothing is dialed.
#[tokio::test]
async fn ambiguous_connect_requests_are_refused_and_nothing_is_dialed() {
    let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = echo.local_addr().unwrap();
    let dialer = Arc::new(MapDialer::default());
    let (proxy, _drain) = start(dialer.clone()).await;
    for (name, req) in [
        (
            "two Host headers",
            format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nHost: evil:1\r\n\r\n"),
        ),
        ("no Host", format!("CONNECT {target} HTTP/1.1\r\n\r\n")),
        (
            "bare LF",
            format!("CONNECT {target} HTTP/1.1\nHost: {target}\n\n"),
        ),
        (
            "invalid Host",
            format!("CONNECT {target} HTTP/1.1\r\nHost: a b\r\n\r\n"),
        ),
        (
            "user info in the target (found by the socks_connect fuzz target)",
            format!("CONNECT u@{target} HTTP/1.1\r\nHost: {target}\r\n\r\n"),
        ),
    ] {
        let out = exchange(proxy, req.as_bytes()).await;
        let text = String::from_utf8_lossy(&out);
        assert!(
            text.starts_with("HTTP/1.1 400"),
            "{name}: answered {text:?}"
        );
        assert!(!text.contains("200"), "{name}: {text:?}");
    }
    let dialed = dialer
        .records
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.target.is_some())
        .count();
    assert_eq!(dialed, 0, "a refused CONNECT dialed its target");
    // A well-formed CONNECT still works.
    tokio::spawn(async move {
        let (mut s, _) = echo.accept().await.unwrap();
        s.write_all(b"hello").await.unwrap();
    });
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&out);
    assert!(
        text.starts_with("HTTP/1.1 200") && text.ends_with("hello"),
        "{text:?}"
    );
}
