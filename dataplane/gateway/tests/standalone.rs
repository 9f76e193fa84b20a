//! Standalone mode (`spur-gateway --config FILE`) on loopback: a UDP and a TCP listener in front
//! of echo servers pass traffic, the admin port answers, a bad file is refused naming the field,
//! and a reload keeps the last good configuration when the new file is invalid.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use spur_gateway::{Standalone, StandaloneConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

const WAIT: Duration = Duration::from_secs(5);

async fn udp_echo() -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = s.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_535];
        while let Ok((n, peer)) = s.recv_from(&mut buf).await {
            let _ = s.send_to(&buf[..n], peer).await;
        }
    });
    addr
}

async fn tcp_echo() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

fn config(udp: SocketAddr, tcp: SocketAddr, extra: &str) -> String {
    format!(
        "drainGrace: 200ms
listeners:
- name: udp
  protocol: udp
  port: \"127.0.0.1:0\"
  cluster:
    name: udp-echo
    lb: maglev
    hashKey: sourceIpPort
    endpoints:
    - {{id: u1, address: \"{udp}\"}}
- name: tcp
  protocol: tcp
  port: \"127.0.0.1:0\"
  cluster:
    name: tcp-echo
    endpoints:
    - {{id: t1, address: \"{tcp}\"}}
{extra}"
    )
}

async fn udp_round_trip(to: SocketAddr, payload: &[u8]) -> Vec<u8> {
    let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    c.send_to(payload, to).await.unwrap();
    let mut buf = [0u8; 2048];
    let n = tokio::time::timeout(WAIT, c.recv(&mut buf))
        .await
        .expect("no UDP echo through the gateway")
        .unwrap();
    buf[..n].to_vec()
}

async fn tcp_round_trip(to: SocketAddr, payload: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(to).await.unwrap();
    s.write_all(payload).await.unwrap();
    s.shutdown().await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut got))
        .await
        .expect("no TCP echo through the gateway")
        .unwrap();
    got
}

/// (status code, body) of a GET on the admin port.
async fn get(admin: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(admin).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut raw = String::new();
    tokio::time::timeout(WAIT, s.read_to_string(&mut raw))
        .await
        .expect("admin did not answer")
        .unwrap();
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, body.to_owned())
}

fn start_config(file: &Path) -> StandaloneConfig {
    StandaloneConfig {
        file: file.to_owned(),
        admin_addr: Some("127.0.0.1:0".parse().unwrap()),
    }
}

#[tokio::test]
async fn serves_udp_and_tcp_from_a_file_and_keeps_the_last_good_one() {
    let (udp, tcp) = (udp_echo().await, tcp_echo().await);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("l4.yaml");
    std::fs::write(&file, config(udp, tcp, "")).unwrap();

    let gw = Standalone::start(start_config(&file)).await.unwrap();
    let admin = gw.admin_addr.unwrap();
    let udp_at = gw.listeners().local_addr("udp").unwrap();
    let tcp_at = gw.listeners().local_addr("tcp").unwrap();
    assert_eq!(udp_round_trip(udp_at, b"ping-1").await, b"ping-1");
    assert_eq!(
        tcp_round_trip(tcp_at, b"hello over tcp").await,
        b"hello over tcp"
    );

    assert_eq!(get(admin, "/live").await.0, 200);
    assert_eq!(get(admin, "/ready").await, (200, "ready\n".into()));
    let (status, dump) = get(admin, "/config_dump").await;
    assert_eq!(status, 200);
    let dump: serde_json::Value = serde_json::from_str(&dump).unwrap();
    assert_eq!(dump["version"], 1);
    assert_eq!(dump["file"], file.display().to_string());
    assert_eq!(dump["listeners"].as_array().unwrap().len(), 2);

    // An invalid file on reload: refused, counted, and the listeners run on.
    std::fs::write(
        &file,
        config(udp, tcp, "").replace("lb: maglev", "lb: fastest"),
    )
    .unwrap();
    let e = gw.reload().await.unwrap_err().to_string();
    assert!(
        e.contains("l4.yaml") && e.contains("listeners[0].cluster.lb"),
        "{e}"
    );
    assert_eq!(udp_round_trip(udp_at, b"ping-2").await, b"ping-2");
    let (_, metrics) = get(admin, "/metrics").await;
    assert!(
        metrics.contains("spur_gateway_config_updates_total{result=\"rejected\"} 1"),
        "{metrics}"
    );
    let (_, dump) = get(admin, "/config_dump").await;
    assert!(dump.contains("listeners[0].cluster.lb"), "{dump}");

    // A valid change: kept listeners keep their ports, the new one opens.
    let more = "- name: udp-2\n  protocol: udp\n  port: \"127.0.0.1:0\"\n  cluster:\n    name: udp-echo-2\n    endpoints: [{id: u2, address: \"UDP\"}]\n"
        .replace("UDP", &udp.to_string());
    let with_more = config(udp, tcp, "").replace("- name: tcp\n", &format!("{more}- name: tcp\n"));
    std::fs::write(&file, with_more).unwrap();
    assert_eq!(gw.reload().await.unwrap(), 2);
    assert_eq!(gw.listeners().local_addr("udp"), Some(udp_at));
    let udp2_at = gw.listeners().local_addr("udp-2").unwrap();
    assert_eq!(udp_round_trip(udp2_at, b"ping-3").await, b"ping-3");
    assert_eq!(tcp_round_trip(tcp_at, b"still here").await, b"still here");
    let (_, dump) = get(admin, "/config_dump").await;
    let dump: serde_json::Value = serde_json::from_str(&dump).unwrap();
    assert_eq!(dump["version"], 2);
    assert_eq!(dump["error"], "");

    tokio::time::timeout(Duration::from_secs(10), gw.shutdown())
        .await
        .expect("the drain did not end");
}

#[tokio::test]
async fn refuses_a_bad_file_naming_the_file_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let (udp, tcp): (SocketAddr, SocketAddr) = (
        "127.0.0.1:9".parse().unwrap(),
        "127.0.0.1:9".parse().unwrap(),
    );
    let refused = async |name: &str, text: String| {
        let file = dir.path().join(name);
        std::fs::write(&file, text).unwrap();
        match Standalone::start(start_config(&file)).await {
            Ok(_) => panic!("{name} was accepted"),
            Err(e) => e.to_string(),
        }
    };
    // Parsing: the field's path.
    let e = refused(
        "bad-lb.yaml",
        config(udp, tcp, "").replace("lb: maglev", "lb: fastest"),
    )
    .await;
    assert!(
        e.contains("bad-lb.yaml: listeners[0].cluster.lb: unknown variant `fastest`"),
        "{e}"
    );
    let e = refused(
        "typo.yaml",
        config(udp, tcp, "").replace("hashKey:", "hashKy:"),
    )
    .await;
    assert!(
        e.contains("typo.yaml: listeners[0].cluster: unknown field `hashKy`"),
        "{e}"
    );
    // Validation: spur-l4's message, which names the field too.
    let e = refused(
        "table.yaml",
        config(udp, tcp, "").replace("lb: maglev", "lb: maglev\n    maglevTableSize: 100"),
    )
    .await;
    assert!(
        e.contains("table.yaml: ") && e.contains("maglevTableSize 100"),
        "{e}"
    );
    // JSON, by name.
    let e = refused(
        "l4.json",
        r#"{"listeners": [{"name": "u", "protocol": "sctp"}]}"#.into(),
    )
    .await;
    assert!(
        e.contains("l4.json: listeners[0].protocol: unknown variant `sctp`"),
        "{e}"
    );
    // A file that is not there.
    let missing = dir.path().join("missing.yaml");
    let e = match Standalone::start(start_config(&missing)).await {
        Ok(_) => panic!("a missing file was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("missing.yaml: cannot read"), "{e}");
}
