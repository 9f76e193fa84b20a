//! Traffic capture end to end on loopback (issue #27): a real sidecar in front of a baseline
//! app with a fork, shipping to a real traffic store (`spur-traffic`, SQLite in memory). Checks
//! that keyed exchanges to the fork and a virtual workload's exchanges to the baseline are
//! stored with their responses, that unkeyed traffic is not captured, that credentials never
//! reach the store, and that an unreachable store changes nothing for traffic while the drop
//! counter rises.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use spur_discovery::RouteServerConn;
use spur_e2e::{AppKind, get, get_h2, metrics, rule_yaml, sample, sidecar_config, spawn_app};
use spur_proto::traffic as pb;
use spur_proto::traffic::traffic_client::TrafficClient;
use spur_sidecar::capture::CaptureConfig;
use spur_sidecar::{Sidecar, SidecarConfig};
use spur_traffic::{
    Authorizer, Limits, Server, SettingsIndex, SettingsMap, SettingsSource, TrafficServerConfig,
};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "store-token-for-tests";
const SECRET: &str = "s3cret-credential-value";

struct Setup {
    sidecar: Sidecar,
    store_addr: SocketAddr,
    stop: CancellationToken,
    apps: CancellationToken,
    _dir: tempfile::TempDir,
}

/// The traffic store (settings: sandbox `sb1` with key `k1` and the reference sandbox `ref`
/// with key `k2`, both on the test baseline), and a sidecar whose rules send `k1` to the fork.
/// With `store_up` false the sidecar is pointed at a port nothing listens on.
async fn setup(store_up: bool, ring_exchanges: usize) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let apps = CancellationToken::new();
    let stop = CancellationToken::new();
    let baseline = spawn_app(AppKind::Http, "baseline", apps.clone()).await;
    let fork = spawn_app(AppKind::Http, "fork", apps.clone()).await;
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, rule_yaml("k1", baseline.port(), fork)).unwrap();
    let b = spur_e2e::baseline_workload();
    let settings = dir.path().join("capture.yaml");
    std::fs::write(
        &settings,
        format!(
            "redactHeaders: [x-api-key]\nmaxBodyBytes: 4096\nsandboxes:\n\
             - {{name: sb1, routingKey: k1, workloads: [{{kind: {k}, namespace: {ns}, name: {n}}}]}}\n\
             - {{name: ref, routingKey: k2, workloads: [{{kind: {k}, namespace: {ns}, name: {n}}}]}}\n",
            k = b.kind,
            ns = b.namespace,
            n = b.name
        ),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("sidecar-capture.yaml"),
        "keys: [{routingKey: k1, sandbox: sb1}]\n",
    )
    .unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();

    let store_addr = if store_up {
        let mut registry = Registry::default();
        let server = Server::bind(
            TrafficServerConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                db: None,
                limits: Limits::default(),
                tls: None,
                settings: SettingsSource::File(settings.clone()),
                auth: Authorizer::static_token(TOKEN).unwrap(),
            },
            SettingsIndex::new(SettingsMap::default()),
            &mut registry,
        )
        .await
        .unwrap();
        let addr = server.local_addr();
        let s = stop.clone();
        tokio::spawn(async move { server.run(s).await.unwrap() });
        addr
    } else {
        // Bound then closed: nothing listens there.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let sidecar = Sidecar::start(SidecarConfig {
        rules: Some(rules),
        capture: Some(CaptureConfig {
            server: RouteServerConn {
                addr: store_addr.to_string(),
                ca: None,
                token: Some(token_file),
            },
            // Without the store, the settings come from the same file (the sidecar's own poll).
            settings_file: (!store_up).then(|| dir.path().join("sidecar-capture.yaml")),
            bounds: spur_proxy::capture::CaptureBounds {
                ring_exchanges,
                ..Default::default()
            },
            pod: "pod-1".into(),
        }),
        ..sidecar_config(baseline)
    })
    .await
    .unwrap();
    Setup {
        sidecar,
        store_addr,
        stop,
        apps,
        _dir: dir,
    }
}

impl Setup {
    async fn client(&self) -> TrafficClient<tonic::transport::Channel> {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", self.store_addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        TrafficClient::new(ch)
    }

    async fn query(&self, filter: pb::Filter) -> Vec<pb::Exchange> {
        let mut req = tonic::Request::new(pb::QueryRequest {
            filter: Some(filter),
            limit: 1000,
            without_bodies: false,
        });
        req.metadata_mut()
            .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
        self.client()
            .await
            .query(req)
            .await
            .unwrap()
            .into_inner()
            .exchanges
            .into_iter()
            .filter_map(|e| e.exchange)
            .collect()
    }

    /// Waits (bounded) until the store holds `n` exchanges of `sandbox`.
    async fn wait_stored(&self, sandbox: &str, n: usize) -> Vec<pb::Exchange> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let got = self
                .query(pb::Filter {
                    sandbox: sandbox.into(),
                    ..Default::default()
                })
                .await;
            if got.len() >= n || tokio::time::Instant::now() > deadline {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits (bounded) until the sidecar applied capture settings (its first keyed request
    /// would otherwise race the settings watch).
    async fn wait_capturing(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.sidecar_keys() == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the sidecar never received capture settings"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn sidecar_keys(&self) -> usize {
        self.sidecar.capture_keys().map_or(0, |k| k.load().len())
    }

    async fn shutdown(self) {
        self.sidecar.shutdown().await;
        self.stop.cancel();
        self.apps.cancel();
    }
}

fn header<'a>(headers: &'a [pb::Header], name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .find(|h| h.name == name)
        .map(|h| h.value.as_slice())
}

async fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &'static str,
) -> String {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::post(path).header("host", "app");
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let resp = send
        .send_request(
            req.body(Full::new(Bytes::from_static(body.as_bytes())))
                .unwrap(),
        )
        .await
        .unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_exchanges_reach_the_store_redacted_and_unkeyed_ones_do_not() {
    let s = setup(true, 4096).await;
    s.wait_capturing().await;
    let addr = s.sidecar.inbound_addr;
    let bearer = format!("Bearer {SECRET}");
    let cookie = format!("session={SECRET}");
    let creds: [(&str, &str); 3] = [
        ("authorization", bearer.as_str()),
        ("cookie", cookie.as_str()),
        ("x-api-key", SECRET),
    ];

    // The fork, over HTTP/1.1 (where the relay would otherwise take the request) and h2.
    let mut h = vec![("baggage", "sd-routing-key=k1")];
    h.extend_from_slice(&creds);
    let got = get(addr, "/?x=1", &h).await.unwrap();
    assert_eq!(got.served_by(), "fork");
    let got = get_h2(addr, "/", &h).await.unwrap();
    assert_eq!(got.served_by(), "fork");
    let echoed = post(
        addr,
        "/echo",
        &[("baggage", "sd-routing-key=k1")],
        "ping body",
    )
    .await;
    assert_eq!(echoed, "ping body");
    // The virtual workload of `ref`: stays on the baseline, captured under `ref`.
    let mut h = vec![("baggage", "sd-routing-key=k2")];
    h.extend_from_slice(&creds);
    let got = get(addr, "/?x=1", &h).await.unwrap();
    assert_eq!(got.served_by(), "baseline");
    // Neither captured: no key, and a key no sandbox captures.
    for key in [None, Some("sd-routing-key=other")] {
        let h: Vec<(&str, &str)> = key.map(|k| ("baggage", k)).into_iter().collect();
        assert_eq!(get(addr, "/", &h).await.unwrap().served_by(), "baseline");
    }

    let fork = s.wait_stored("sb1", 3).await;
    assert_eq!(fork.len(), 3, "{fork:#?}");
    let virt = s.wait_stored("ref", 1).await;
    assert_eq!(virt.len(), 1, "{virt:#?}");
    let all = s.query(pb::Filter::default()).await;
    assert_eq!(all.len(), 4, "only keyed exchanges are captured: {all:#?}");

    let h1 = fork
        .iter()
        .find(|e| e.protocol == pb::Protocol::Http1 as i32 && e.method == "GET")
        .unwrap();
    assert_eq!(h1.path, "/?x=1");
    assert_eq!(h1.status, 200);
    assert_eq!(h1.routing_key, "k1");
    assert!(!h1.destination.is_empty(), "routed to the fork: {h1:?}");
    let body = h1.response_body.as_ref().unwrap();
    assert_eq!(body.data, b"hello from fork\n");
    assert_eq!(body.size, 16);
    assert!(h1.duration_micros >= h1.response_micros);
    assert_eq!(
        h1.baseline.as_ref().unwrap().name,
        spur_e2e::baseline_workload().name
    );
    assert_eq!(h1.pod, "pod-1");
    assert_eq!(
        header(&h1.response_headers, "x-served-by"),
        Some(b"fork".as_slice())
    );
    for name in ["authorization", "cookie", "x-api-key"] {
        assert_eq!(
            header(&h1.request_headers, name),
            Some(b"<redacted>".as_slice()),
            "{name}"
        );
    }
    assert!(
        fork.iter()
            .any(|e| e.protocol == pb::Protocol::Http2 as i32)
    );
    let echo = fork.iter().find(|e| e.method == "POST").unwrap();
    assert_eq!(echo.request_body.as_ref().unwrap().data, b"ping body");
    assert_eq!(echo.response_body.as_ref().unwrap().data, b"ping body");

    let v = &virt[0];
    assert!(
        v.destination.is_empty(),
        "a virtual workload's exchange stays on the baseline"
    );
    assert_eq!(
        v.response_body.as_ref().unwrap().data,
        b"hello from baseline\n"
    );
    let baseline_only = s
        .query(pb::Filter {
            routed: pb::Routed::Baseline as i32,
            ..Default::default()
        })
        .await;
    assert_eq!(baseline_only.len(), 1);

    // No stored byte holds a credential.
    for e in &all {
        let encoded = prost::Message::encode_to_vec(e);
        assert!(
            !encoded
                .windows(SECRET.len())
                .any(|w| w == SECRET.as_bytes()),
            "a credential reached the store: {e:?}"
        );
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_store_changes_nothing_for_traffic_and_drops_are_counted() {
    let s = setup(false, 64).await;
    s.wait_capturing().await;
    let addr = s.sidecar.inbound_addr;
    let admin = s.sidecar.admin_addr.unwrap();
    for i in 0..200 {
        let got = get(addr, "/", &[("baggage", "sd-routing-key=k1")])
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(got.served_by(), "fork", "request {i}");
        assert_eq!(got.body, "hello from fork\n");
    }
    // Every capture ends dropped: by the ring (64 held) or by the failed pushes.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let m = metrics(admin).await;
        let dropped: f64 = ["ring_full", "ship_failed", "busy"]
            .iter()
            .map(|r| sample(&m, &format!("spur_capture_dropped_total{{reason=\"{r}\"}}")))
            .sum();
        let captured = sample(&m, "spur_capture_exchanges_total");
        if captured == 200.0 && dropped >= 200.0 - 64.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "captures or drops were not counted: {captured} captured, {dropped} dropped\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.shutdown().await;
}
