//! Transparent mode for real: a client network namespace and a "pod" namespace joined by a veth
//! pair, iptables REDIRECT in the pod (the DevMesh init's job), and the `spur-sidecar` binary in
//! `--transparent` mode recovering each connection's original destination with SO_ORIGINAL_DST.
//!
//! The REDIRECT rule is written by hand on purpose: this test pins down the sidecar binary alone,
//! and Cargo gives a package's tests only that package's own binaries, so `spur-init` is not
//! available here. The rules `spur-init` generates (iptables-legacy and nft, hairpin, the proxy
//! uid, excluded ports, cleanup) are tested with the sidecar in dataplane/init/tests/interception.rs.
//!
//! Needs root, `ip` and `iptables` (tests/run.sh installs iptables). It fails, rather than
//! skipping, when they are missing, so a green suite always means transparent mode was tested.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const POD_IP: &str = "10.233.0.2";
const CLIENT_IP: &str = "10.233.0.1";

fn sh(args: &[&str]) {
    let out = std::process::Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| {
        panic!("cannot run {args:?}: {e} (tests/run.sh installs iproute2 and iptables; run as root)")
    });
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespaces and a veth pair, removed on drop.
struct Topology {
    client: String,
    pod: String,
}

impl Topology {
    fn new() -> Topology {
        let id = std::process::id() % 100_000;
        let t = Topology {
            client: format!("spur{id}c"),
            pod: format!("spur{id}p"),
        };
        let (vc, vp) = (format!("sv{id}c"), format!("sv{id}p"));
        sh(&["ip", "netns", "add", &t.client]);
        sh(&["ip", "netns", "add", &t.pod]);
        sh(&[
            "ip", "link", "add", &vc, "netns", &t.client, "type", "veth", "peer", "name", &vp,
            "netns", &t.pod,
        ]);
        for (ns, dev, ip) in [(&t.client, &vc, CLIENT_IP), (&t.pod, &vp, POD_IP)] {
            sh(&[
                "ip",
                "-n",
                ns,
                "addr",
                "add",
                &format!("{ip}/30"),
                "dev",
                dev,
            ]);
            sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        // What the DevMesh init container does: inbound TCP to the app ports goes to the sidecar.
        sh(&[
            "ip",
            "netns",
            "exec",
            &t.pod,
            "iptables",
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-p",
            "tcp",
            "-m",
            "multiport",
            "--dports",
            "8080,7070",
            "-j",
            "REDIRECT",
            "--to-ports",
            "15006",
        ]);
        t
    }

    /// Runs `f` on a thread that has entered namespace `ns`; sockets it creates live there.
    fn in_ns<T: Send + 'static>(&self, ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/var/run/netns/{ns}");
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).unwrap();
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            f()
        })
        .join()
        .unwrap()
    }

    fn listen_in_pod(&self, port: u16) -> tokio::net::TcpListener {
        let l = self.in_ns(&self.pod, move || {
            std::net::TcpListener::bind(("0.0.0.0", port)).unwrap()
        });
        l.set_nonblocking(true).unwrap();
        tokio::net::TcpListener::from_std(l).unwrap()
    }

    /// A connection from the client namespace.
    fn connect_from_client(&self, addr: SocketAddr) -> tokio::net::TcpStream {
        let s = self.in_ns(&self.client, move || {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap()
        });
        s.set_nonblocking(true).unwrap();
        tokio::net::TcpStream::from_std(s).unwrap()
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for ns in [&self.client, &self.pod] {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", ns])
                .status();
        }
    }
}

async fn get(
    topo: &Topology,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String, String) {
    let tcp = topo.connect_from_client(addr);
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::get(path).header("host", addr.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = send
        .send_request(req.body(Empty::<Bytes>::new()).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let by = resp
        .headers()
        .get("x-served-by")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, by, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transparent_mode_recovers_original_destination_across_namespaces() {
    assert!(
        nix_is_root(),
        "transparent-mode test needs root (CI and tests/run.sh run as root)"
    );
    let topo = Topology::new();
    let apps = spur_demo_apps::CancellationToken::new();
    tokio::spawn(spur_demo_apps::serve_http(
        topo.listen_in_pod(8080),
        "baseline".into(),
        apps.clone(),
    ));
    tokio::spawn(spur_demo_apps::serve_http(
        topo.listen_in_pod(9090),
        "fork".into(),
        apps.clone(),
    ));
    tokio::spawn(spur_demo_apps::serve_tcp_echo(
        topo.listen_in_pod(7070),
        "tcp-app".into(),
        apps.clone(),
    ));

    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(
        &rules,
        "- routingKey: k1\n  baseline: {kind: Deployment, namespace: test, name: app}\n  destinationSandbox: {name: sb}\n  mappings:\n    - workloadPort: 8080\n      destinations: [{host: 127.0.0.1, port: 9090}]\n",
    )
    .unwrap();
    let mut sidecar = tokio::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &topo.pod,
            env!("CARGO_BIN_EXE_spur-sidecar"),
            "--transparent",
        ])
        .args([
            "--inbound-addr",
            "0.0.0.0:15006",
            "--admin-addr",
            "0.0.0.0:15020",
        ])
        .args([
            "--baseline-namespace",
            "test",
            "--baseline-name",
            "app",
            "--drain-grace",
            "2s",
        ])
        .arg("--rules")
        .arg(&rules)
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    let admin: SocketAddr = format!("{POD_IP}:15020").parse().unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let ok = topo.in_ns(&topo.client, move || {
            std::net::TcpStream::connect_timeout(&admin, Duration::from_millis(200)).is_ok()
        });
        if ok {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "sidecar admin never came up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let app: SocketAddr = format!("{POD_IP}:8080").parse().unwrap();
    let (status, by, _) = get(&topo, app, "/", &[]).await;
    assert_eq!((status, by.as_str()), (200, "baseline"));
    let (_, by, _) = get(&topo, app, "/", &[("baggage", "sd-routing-key=k1")]).await;
    assert_eq!(
        by, "fork",
        "keyed request to the pod's port 8080 must reach the fork"
    );
    // The app sees the real client address in X-Forwarded-For.
    let (_, _, body) = get(&topo, app, "/headers", &[]).await;
    assert!(body.contains(CLIENT_IP), "{body}");

    // Opaque TCP to another port goes to that port's original destination, half-close intact.
    let mut tcp = topo.connect_from_client(format!("{POD_IP}:7070").parse().unwrap());
    tcp.write_all(b"\x00\x01opaque").await.unwrap();
    tcp.shutdown().await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out, b"\x00\x01opaquebye from tcp-app\n");

    // Everything above went through the sidecar, not around it.
    let (_, _, metrics) = get(&topo, admin, "/metrics", &[]).await;
    for series in [
        "spur_requests_total{outcome=\"baseline\"} 2",
        "spur_requests_total{outcome=\"sandbox\"} 1",
        "spur_connections_total{protocol=\"tcp\"} 1",
    ] {
        assert!(metrics.contains(series), "missing {series}:\n{metrics}");
    }

    // A connection straight to the sidecar's port (no redirect) would loop: it is refused.
    let mut direct = topo.connect_from_client(format!("{POD_IP}:15006").parse().unwrap());
    direct
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(10), direct.read_to_end(&mut buf))
        .await
        .unwrap();
    assert!(
        n.is_err() || buf.is_empty(),
        "direct connection was served: {}",
        String::from_utf8_lossy(&buf)
    );

    let pid = sidecar.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(20), sidecar.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "{exit}");
    apps.cancel();
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}
