//! Active health checks: one check of one endpoint (TCP connect, or an HTTP/1.1 `GET` expecting
//! 2xx), bounded by the timeout. The cluster's health task (`cluster::health_task`) runs them
//! for every endpoint each interval, all endpoints at once.

use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::config::{HealthPlan, HealthProtocol};

/// Most bytes read looking for the status line.
const MAX_STATUS_LINE: usize = 1024;

/// One check, bounded by the plan's timeout. `Err` carries why it failed (for the status API).
pub(crate) async fn check(plan: &HealthPlan, addr: SocketAddr) -> Result<(), String> {
    match tokio::time::timeout(plan.timeout, probe(plan, addr)).await {
        Ok(r) => r,
        Err(_) => Err(format!("timed out after {:?}", plan.timeout)),
    }
}

async fn probe(plan: &HealthPlan, addr: SocketAddr) -> Result<(), String> {
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    if plan.protocol == HealthProtocol::Tcp {
        return Ok(());
    }
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: spur-l4-health\r\nAccept: */*\r\nConnection: close\r\n\r\n",
        plan.path
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("send request: {e}"))?;
    let mut buf = [0u8; MAX_STATUS_LINE];
    let mut len = 0;
    loop {
        if let Some(end) = buf[..len].windows(2).position(|w| w == b"\r\n") {
            return status_ok(&buf[..end]);
        }
        if len == buf.len() {
            return Err("status line too long".into());
        }
        let n = stream
            .read(&mut buf[len..])
            .await
            .map_err(|e| format!("read response: {e}"))?;
        if n == 0 {
            return Err("connection closed before a status line".into());
        }
        len += n;
    }
}

/// `HTTP/1.x 2xx …` passes; any other status fails.
fn status_ok(line: &[u8]) -> Result<(), String> {
    let text = String::from_utf8_lossy(line);
    let mut parts = line.splitn(3, |b| *b == b' ');
    let version = parts.next().unwrap_or_default();
    let code = parts.next().unwrap_or_default();
    if !version.starts_with(b"HTTP/1.") || code.len() != 3 || !code.iter().all(u8::is_ascii_digit) {
        return Err(format!("not an HTTP/1 status line: {text:?}"));
    }
    if code[0] == b'2' {
        Ok(())
    } else {
        Err(format!("status {}", String::from_utf8_lossy(code)))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use tokio::net::TcpListener;

    use super::*;

    fn plan(protocol: HealthProtocol) -> HealthPlan {
        HealthPlan {
            protocol,
            path: "/healthz".into(),
            interval: Duration::from_secs(1),
            timeout: Duration::from_millis(500),
            healthy_threshold: 1,
            unhealthy_threshold: 1,
        }
    }

    async fn http_server(reply: &'static [u8]) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut req = vec![0u8; 1024];
            let n = s.read(&mut req).await.unwrap();
            assert!(req[..n].starts_with(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:"));
            s.write_all(reply).await.unwrap();
        });
        addr
    }

    #[tokio::test]
    async fn http_checks_want_a_2xx() {
        let ok = http_server(b"HTTP/1.1 204 No Content\r\n\r\n").await;
        assert_eq!(check(&plan(HealthProtocol::Http), ok).await, Ok(()));
        let bad = http_server(b"HTTP/1.1 503 Service Unavailable\r\n\r\n").await;
        assert_eq!(
            check(&plan(HealthProtocol::Http), bad).await,
            Err("status 503".into())
        );
        let junk = http_server(b"SSH-2.0-OpenSSH\r\n").await;
        assert!(
            check(&plan(HealthProtocol::Http), junk)
                .await
                .unwrap_err()
                .contains("not an HTTP/1 status line")
        );
    }

    #[tokio::test]
    async fn tcp_checks_connect_and_time_out() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        assert_eq!(check(&plan(HealthProtocol::Tcp), addr).await, Ok(()));
        drop(l);
        assert!(
            check(&plan(HealthProtocol::Tcp), addr)
                .await
                .unwrap_err()
                .contains("connect")
        );
        // A server that accepts and never answers: the timeout bounds the HTTP check.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut p = plan(HealthProtocol::Http);
        p.timeout = Duration::from_millis(100);
        assert!(check(&p, addr).await.unwrap_err().contains("timed out"));
        drop(l);
    }

    #[test]
    fn status_lines() {
        assert!(status_ok(b"HTTP/1.0 200 OK").is_ok());
        assert!(status_ok(b"HTTP/1.1 299").is_ok());
        assert!(status_ok(b"HTTP/1.1 301 Moved").is_err());
        assert!(status_ok(b"HTTP/1.1 2000 x").is_err());
        assert!(status_ok(b"").is_err());
    }
}
