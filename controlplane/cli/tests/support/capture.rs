//! What the traffic-capture tests share: free loopback ports, and a sidecar of a baseline that
//! routes by a rules file and captures to a traffic store with a static token.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

pub(crate) use spur_kube_harness::free_port;

pub(crate) async fn wait_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A sidecar of Deployment `namespace/name` in front of `app`, routing by the rules file
/// `rules` (polled every 100 ms), capturing to the store on `store` with the token in
/// `token_file`; its pod is `<name>-pod`.
pub(crate) async fn capturing_sidecar(
    token_file: &Path,
    store: u16,
    namespace: &str,
    name: &str,
    app: SocketAddr,
    rules: &Path,
) -> spur_sidecar::Sidecar {
    spur_sidecar::Sidecar::start(spur_sidecar::SidecarConfig {
        inject_key_file: None,
        kafka: None,
        capture: Some(spur_sidecar::capture::CaptureConfig {
            server: spur_sidecar::RouteServerConn {
                addr: format!("127.0.0.1:{store}"),
                ca: None,
                token: Some(token_file.to_path_buf()),
            },
            settings_file: None,
            bounds: spur_proxy::capture::CaptureBounds::default(),
            pod: format!("{name}-pod"),
        }),
        inbound_addr: "127.0.0.1:0".parse().unwrap(),
        inbound: spur_proxy::Inbound::Explicit { app },
        baseline: spur_routing::BaselineWorkload {
            kind: "Deployment".into(),
            namespace: namespace.into(),
            name: name.into(),
        },
        rules: Some(rules.to_path_buf()),
        rules_poll: Duration::from_millis(100),
        routeserver: None,
        admin_addr: None,
        extract: spur_routing::ExtractConfig::default(),
        proxy: spur_proxy::ProxyConfig::default(),
    })
    .await
    .unwrap()
}
