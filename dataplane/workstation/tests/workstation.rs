//! `spur local` on loopback against an in-process tunnel server with a test TunnelApi: the local
//! SOCKS proxy, cluster DNS and service listeners, the hosts-file block, reverse binds from the
//! workload watch, the key-injecting local proxy, the state file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use hickory_proto::op::{Edns, Message, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use spur_runtime::Drain;
use spur_workstation::proxy::{self, ProxyConfig};
use spur_workstation::tunnel::{Transport, TransportPolicy};
use spur_workstation::{Event, SocksOpener, Workstation, state};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

async fn curl(args: &[&str]) -> (bool, String) {
    let out = within(
        "curl",
        tokio::process::Command::new("curl")
            .args(["-sS", "--max-time", "8"])
            .args(args)
            .output(),
    )
    .await
    .expect("curl runs");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

async fn connected(ws: &Workstation) {
    wait_status(ws, "the tunnel and Hello", |s| {
        s.connected() && s.proxy_pod.is_some()
    })
    .await;
}

#[tokio::test]
async fn socks_and_http_connect_reach_cluster_names() {
    let cluster = Cluster::start().await;
    let (web, _w) = header_echo_server().await;
    cluster.name("web.shop.svc");
    let events = Events::default();
    let ws = Workstation::start(cluster.connect_config(&events))
        .await
        .unwrap();
    connected(&ws).await;
    let socks = ws.socks_addr().unwrap().to_string();
    let url = format!("http://web.shop.svc:{}/hello", web.port());

    // The name is resolved on the other side of the tunnel (curl sends it unresolved).
    let (ok, out) = curl(&["--socks5-hostname", &socks, &url]).await;
    assert!(ok, "{out}");
    assert!(out.starts_with("GET /hello\n"), "{out}");
    assert!(
        out.contains(&format!("host: web.shop.svc:{}", web.port())),
        "{out}"
    );

    let (ok, out) = curl(&["-p", "-x", &format!("http://{socks}"), &url]).await;
    assert!(ok, "{out}");
    assert!(out.starts_with("GET /hello\n"), "{out}");

    // An unknown name fails with the cluster side's answer, not a hang.
    let (ok, out) = curl(&[
        "--socks5-hostname",
        &socks,
        &format!("http://nope.shop.svc:{}/", web.port()),
    ])
    .await;
    assert!(!ok, "{out}");

    // Progress lines a person would see.
    assert!(
        events.count(|e| matches!(e, Event::Connected { identity, .. } if identity == WORKSTATION))
            >= 1
    );
    let hello = events
        .wait_for("Hello", |e| matches!(e, Event::Hello { .. }))
        .await;
    assert_eq!(
        hello.to_string(),
        "workstation alice on proxy pod tunnel-proxy-test-0 (cluster domain cluster.local)"
    );
    ws.shutdown(Duration::from_secs(2)).await;
}

async fn dns_query(server: SocketAddr, name: &str, qtype: RecordType, edns: bool) -> Message {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
    if edns {
        m.edns = Some(Edns::new());
    }
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    sock.send_to(&m.to_vec().unwrap(), server).await.unwrap();
    let mut buf = [0u8; 1500];
    let (n, _) = within("a DNS reply", sock.recv_from(&mut buf))
        .await
        .unwrap();
    let r = Message::from_vec(&buf[..n]).unwrap();
    assert_eq!(r.metadata.id, m.metadata.id);
    r
}

fn a_records(m: &Message) -> Vec<Ipv4Addr> {
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn dns_names_service_listeners_and_hosts_file() {
    let cluster = Cluster::start().await;
    // The Service port is the echo server's own (ephemeral, so unique among parallel tests):
    // the peer dials web.shop.svc:<port> → 127.0.0.1:<port>.
    let (echo, _e) = echo_server().await;
    let port = echo.port();
    cluster.name("web.shop.svc");
    cluster.set_services(vec![
        service("shop", "web", &[port]),
        service("other", "db", &[closed_port().await]),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.1 localhost\n").unwrap();
    let events = Events::default();
    let mut config = cluster.connect_config(&events);
    config.socks_addr = None;
    config.dns_addr = Some("127.0.0.1:0".parse().unwrap());
    config.hosts_file = Some(hosts.clone());
    let ws = Workstation::start(config).await.unwrap();
    let dns = ws.dns_addr().unwrap();
    let status = wait_status(&ws, "service listeners", |s| s.services.listeners == 2).await;
    assert_eq!(status.services.names, 2);

    // db.other sorts first and gets .1, web.shop .2.
    let web_ip = Ipv4Addr::new(127, 77, 0, 2);
    for name in ["web.shop.", "web.shop.svc.", "WEB.shop.svc.cluster.local."] {
        let r = dns_query(dns, name, RecordType::A, false).await;
        assert_eq!(r.metadata.response_code, ResponseCode::NoError, "{name}");
        assert_eq!(a_records(&r), vec![web_ip], "{name}");
        assert!(r.metadata.authoritative);
    }
    // A known name without AAAA data: NODATA, not NXDOMAIN. EDNS is answered with EDNS.
    let r = dns_query(dns, "web.shop.", RecordType::AAAA, true).await;
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    assert!(r.answers.is_empty());
    assert!(r.edns.is_some());
    for name in ["nope.shop.", "example.com.", "web.shop.svc.example.org."] {
        let r = dns_query(dns, name, RecordType::A, false).await;
        assert_eq!(r.metadata.response_code, ResponseCode::NXDomain, "{name}");
    }

    // The answer's address and the Service port reach the upstream through the tunnel.
    let mut tcp = TcpStream::connect((web_ip, port)).await.unwrap();
    assert_eq!(
        echo_once(&mut tcp, b"hello through the tunnel").await,
        b"hello through the tunnel"
    );

    // The same names in the hosts file, between the markers, the rest kept.
    let text = std::fs::read_to_string(&hosts).unwrap();
    assert!(
        text.starts_with("127.0.0.1 localhost\n# spur begin\n"),
        "{text}"
    );
    assert!(
        text.contains("127.77.0.2\tweb.shop\tweb.shop.svc\tweb.shop.svc.cluster.local\n"),
        "{text}"
    );
    assert!(text.ends_with("# spur end\n"), "{text}");

    // The Service leaves: its name, listener and hosts line go with the next refresh.
    cluster.set_services(vec![service("other", "db", &[closed_port().await])]);
    wait_status(&ws, "the listener to go", |s| s.services.listeners == 1).await;
    let r = dns_query(dns, "web.shop.", RecordType::A, false).await;
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    // The listener's accept loop is stopped by a token: the status may report it gone a moment
    // before its socket closes (seen once under a loaded CI run). Bounded wait, then refused.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while TcpStream::connect((web_ip, port)).await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the listener of a removed Service still accepts after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !std::fs::read_to_string(&hosts)
            .unwrap()
            .contains("web.shop")
    );

    ws.shutdown(Duration::from_secs(2)).await;
    assert_eq!(
        std::fs::read_to_string(&hosts).unwrap(),
        "127.0.0.1 localhost\n"
    );
}

#[tokio::test]
async fn reverse_binds_follow_the_workload_watch_quic() {
    reverse_binds_follow_the_workload_watch(TransportPolicy::QuicOnly).await;
}

/// Over HTTP/2 the server cannot open streams itself: reverse opens go through the client.
#[tokio::test]
async fn reverse_binds_follow_the_workload_watch_h2() {
    reverse_binds_follow_the_workload_watch(TransportPolicy::H2Only).await;
}

async fn reverse_binds_follow_the_workload_watch(transports: TransportPolicy) {
    let mut cluster = Cluster::start().await;
    let (local, _l) = echo_server().await;
    let dead = closed_port().await;
    cluster.set_workloads(vec![workload(
        "shop",
        "dev-api",
        &[
            (8080, local.to_string()),
            (9090, format!("127.0.0.1:{dead}")),
        ],
    )]);
    let dir = tempfile::tempdir().unwrap();
    let events = Events::default();
    let mut config = cluster.connect_config(&events);
    config.tunnel.transports = transports;
    config.state_dir = Some(dir.path().to_owned());
    let ws = Workstation::start(config).await.unwrap();
    let session = cluster.next_session().await;
    let want = if transports == TransportPolicy::H2Only {
        Transport::H2
    } else {
        Transport::Quic
    };
    assert_eq!(session.transport(), want);

    // Both mappings are bound, with the mapping as metadata.
    let mut binds = session.binds();
    let binds_now = within(
        "both binds",
        binds.wait_for(|b| {
            b.contains_key("shop/dev-api/8080") && b.contains_key("shop/dev-api/9090")
        }),
    )
    .await
    .unwrap()
    .clone();
    let meta: serde_json::Value = serde_json::from_str(&binds_now["shop/dev-api/8080"]).unwrap();
    assert_eq!(meta["to_local"], local.to_string());
    assert_eq!(meta["workload"], "shop/dev-api");

    // Cluster traffic for the bind reaches the local process, with half-close.
    let mut s = session.open_reverse("shop/dev-api/8080").await.unwrap();
    assert_eq!(echo_once(&mut s, b"keyed request").await, b"keyed request");
    drop(s);

    // Nothing listens for 9090: the cluster side gets the reason (over both transports); the
    // warning comes once.
    for _ in 0..2 {
        let err = session.open_reverse("shop/dev-api/9090").await.unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!(
                "nothing accepts connections at 127.0.0.1:{dead} on the workstation"
            )),
            "{text}"
        );
    }
    assert_eq!(
        events.count(
            |e| matches!(e, Event::LocalUnreachable { id, .. } if id == "shop/dev-api/9090")
        ),
        1
    );

    // The state file tells `spur local status` all of it.
    let st = wait_status(&ws, "both binds active", |s| {
        s.workloads
            .iter()
            .flat_map(|w| &w.mappings)
            .all(|m| m.bind == "active")
            && s.workloads.first().is_some_and(|w| w.mappings.len() == 2)
    })
    .await;
    assert!(st.connected());
    assert_eq!(st.workstation.as_deref(), Some(WORKSTATION));
    let on_disk = within("the state file", async {
        loop {
            if let Ok(Some(s)) = state::read(dir.path())
                && s.workloads
                    .iter()
                    .flat_map(|w| &w.mappings)
                    .any(|m| m.local_error.is_some())
            {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(on_disk.pid, std::process::id());
    assert_eq!(on_disk.server, "test-cluster");
    assert_eq!(on_disk.socks_addr, ws.socks_addr());
    let m9090 = &on_disk.workloads[0].mappings[1];
    assert_eq!(m9090.bind_id, "shop/dev-api/9090");
    assert!(
        m9090
            .local_error
            .as_deref()
            .unwrap()
            .contains("nothing accepts")
    );
    assert!(state::is_running(&on_disk));

    // A mapping leaves: only its bind is dropped. Then the workload leaves: all are.
    cluster.set_workloads(vec![workload(
        "shop",
        "dev-api",
        &[(8080, local.to_string())],
    )]);
    within(
        "9090 unbound",
        binds.wait_for(|b| {
            b.contains_key("shop/dev-api/8080") && !b.contains_key("shop/dev-api/9090")
        }),
    )
    .await
    .unwrap();
    cluster.set_workloads(vec![]);
    within("all unbound", binds.wait_for(|b| b.is_empty()))
        .await
        .unwrap();
    wait_status(&ws, "no workloads", |s| s.workloads.is_empty()).await;

    ws.shutdown(Duration::from_secs(2)).await;
    assert!(
        state::read(dir.path()).unwrap().is_none(),
        "state file removed"
    );
}

#[tokio::test]
async fn local_proxy_injects_the_routing_key_through_a_running_connect() {
    let cluster = Cluster::start().await;
    let (api, _a) = header_echo_server().await;
    let (echo, _e) = echo_server().await;
    cluster.name("api.shop.svc");
    cluster.name("echo.shop.svc");
    let events = Events::default();
    let ws = Workstation::start(cluster.connect_config(&events))
        .await
        .unwrap();
    connected(&ws).await;
    // As `spur local proxy` does: through the running connect's SOCKS proxy.
    let opener = Arc::new(SocksOpener::new(ws.socks_addr().unwrap()));
    let drain = Drain::new();
    let (host, port) = proxy::parse_target(&format!("api.shop:{}", api.port()), 80).unwrap();
    let mut config = ProxyConfig::new("127.0.0.1:0".parse().unwrap(), host, port);
    config.routing_key = Some("k3y".into());
    let addr = proxy::start(config, opener.clone(), drain.clone())
        .await
        .unwrap();

    // Two requests on one kept-alive connection, with baggage of the client's own.
    let url = format!("http://{addr}/a");
    let (ok, out) = curl(&["-H", "baggage: userId=alice", &url, &url]).await;
    assert!(ok, "{out}");
    assert_eq!(out.matches("GET /a\n").count(), 2, "{out}");
    for line in [
        "baggage: sd-routing-key=k3y,sd-sandbox=k3y,userId=alice\n",
        "tracestate: sd-routing-key=k3y,sd-sandbox=k3y\n",
        "ot-baggage-sd-routing-key: k3y\n",
        "ot-baggage-sd-sandbox: k3y\n",
        "uberctx-sd-routing-key: k3y\n",
        "uberctx-sd-sandbox: k3y\n",
    ] {
        assert_eq!(out.matches(line).count(), 2, "{line} in\n{out}");
    }

    // A connection silent past the sniffing window (an HTTP pool's spare one, used later) is
    // still HTTP: its request gets the key. (Taken for opaque TCP, it went without.)
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;
    tcp.write_all(b"GET /late HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut late = Vec::new();
    within("the late request's answer", tcp.read_to_end(&mut late))
        .await
        .unwrap();
    let late = String::from_utf8_lossy(&late);
    assert!(late.contains("GET /late\n"), "{late}");
    assert!(
        late.contains("baggage: sd-routing-key=k3y,sd-sandbox=k3y\n"),
        "{late}"
    );

    // A server-first protocol: a silent client gets the greeting, then talks.
    let banner = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let banner_port = banner.local_addr().unwrap().port();
    let _banner = tokio::spawn(async move {
        while let Ok((mut s, _)) = banner.accept().await {
            tokio::spawn(async move {
                let _ = s.write_all(b"220 hello\r\n").await;
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    cluster.name("smtp.shop.svc");
    let (host, port) = proxy::parse_target(&format!("smtp.shop:{banner_port}"), 80).unwrap();
    let mut config = ProxyConfig::new("127.0.0.1:0".parse().unwrap(), host, port);
    config.routing_key = Some("k3y".into());
    let smtp = proxy::start(config, opener.clone(), drain.clone())
        .await
        .unwrap();
    let mut tcp = TcpStream::connect(smtp).await.unwrap();
    let mut greeting = [0u8; 11];
    within("the greeting", tcp.read_exact(&mut greeting))
        .await
        .unwrap();
    assert_eq!(&greeting, b"220 hello\r\n");
    assert_eq!(echo_once(&mut tcp, b"EHLO me\r\n").await, b"EHLO me\r\n");

    // An upgrade (WebSocket-style): the key goes into the upgrade request, then raw bytes flow.
    let (up, _u) = upgrade_echo_server().await;
    cluster.name("ws.shop.svc");
    let (host, port) = proxy::parse_target(&format!("ws.shop:{}", up.port()), 80).unwrap();
    let mut config = ProxyConfig::new("127.0.0.1:0".parse().unwrap(), host, port);
    config.routing_key = Some("k3y".into());
    let ws_addr = proxy::start(config, opener.clone(), drain.clone())
        .await
        .unwrap();
    let mut tcp = TcpStream::connect(ws_addr).await.unwrap();
    tcp.write_all(b"GET /ws HTTP/1.1\r\nHost: ws\r\nConnection: upgrade\r\nUpgrade: echo\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        within("the 101", tcp.read_exact(&mut b)).await.unwrap();
        head.push(b[0]);
    }
    let head = String::from_utf8(head).unwrap().to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(
        head.contains("x-seen-baggage: sd-routing-key=k3y,sd-sandbox=k3y\r\n"),
        "{head}"
    );
    assert_eq!(
        echo_once(&mut tcp, b"after the upgrade").await,
        b"after the upgrade"
    );

    // Not HTTP: carried as it is.
    let (host, port) = proxy::parse_target(&format!("echo.shop:{}", echo.port()), 80).unwrap();
    let mut config = ProxyConfig::new("127.0.0.1:0".parse().unwrap(), host, port);
    config.routing_key = Some("k3y".into());
    let raw = proxy::start(config, opener, drain.clone()).await.unwrap();
    let mut tcp = TcpStream::connect(raw).await.unwrap();
    assert_eq!(
        echo_once(&mut tcp, b"\x00\x01 binary").await,
        b"\x00\x01 binary"
    );
    // A client that half-closes without a byte is carried too: the Service sees the FIN and
    // closes back (the echo server's answer to it).
    let mut tcp = TcpStream::connect(raw).await.unwrap();
    tcp.shutdown().await.unwrap();
    let mut rest = Vec::new();
    within("the close to come back", tcp.read_to_end(&mut rest))
        .await
        .unwrap();
    assert!(rest.is_empty(), "{rest:?}");

    // An invalid key is refused up front.
    let mut bad = ProxyConfig::new("127.0.0.1:0".parse().unwrap(), "x.y.svc", 80);
    bad.routing_key = Some("not a key".into());
    assert!(
        proxy::start(
            bad,
            Arc::new(SocksOpener::new(ws.socks_addr().unwrap())),
            drain.clone()
        )
        .await
        .is_err()
    );

    drain.wait(Duration::from_secs(1)).await;
    ws.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn a_refused_token_stops_the_workstation_with_the_reason() {
    let cluster = Cluster::start().await;
    let events = Events::default();
    let mut config = cluster.connect_config(&events);
    config.tunnel = cluster.client_config("wrong-token");
    let ws = Workstation::start(config).await.unwrap();
    let reason = within("the client to stop", ws.closed()).await;
    assert!(
        reason.contains("unknown token") || reason.contains("refused"),
        "{reason}"
    );
    let st = wait_status(&ws, "closed", |s| s.tunnel.state == "closed").await;
    assert!(!st.connected());
    ws.shutdown(Duration::from_secs(1)).await;
}
