//! L4 listeners from a ListenerSet end to end against a real kube-apiserver: the route server
//! (under the chart's RBAC, TLS, token authentication) renders the ListenerSet for a gateway
//! pod, resolving its selector endpoint from hand-made EndpointSlices (there is no
//! controller-manager here); the gateway (in process, with the pod's bound token) runs the
//! listener; UDP echo workers answer with their name. The API server refuses loopback
//! addresses in EndpointSlices, so each worker listens on the host end of a test network
//! namespace's veth (an address of this host that is not loopback).
//!
//! Checked: a session reaches a worker and two source ports with the same hash key reach the
//! same one; 1 000 sessions spread within ±15 %; a fourth worker added to the EndpointSlice
//! moves at most 30 % of them; an endpoint marked not ready gets no session; the gateway's
//! entry in `status.gateways[]` shows its endpoints' health; the entry goes when the gateway's
//! stream ends; the gateway keeps serving while the route server is down and picks up a change
//! once it is back; another pod's token is refused; a worker whose health port closes turns
//! unhealthy in status and gets no new session.
//!
//! And a DNS endpoint (a name server on loopback that the gateway is pointed at) is resolved
//! again when its records expire: when the name's address changes, new sessions reach the new
//! worker within a few seconds, long before the gateway's 30 s DNS interval. A newer set with a
//! listener on the same port is not served on that port, and its status says so.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequestSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use spur_api::ListenerSet;
use spur_api::listenerset::endpoint_service_name;
use spur_e2e::free_port;
use spur_e2e::kube::{self as kt, eventually};
use spur_e2e::netns::TestNet;
use spur_gateway::{Gateway, GatewayConfig, RouteServerConn};
use spur_kube_harness::KubeApi;
use spur_proto::l4::listeners_client::ListenersClient;
use spur_proto::l4::{GatewayReport, WatchListenersRequest};
use spur_routeserver::{AuthConfig, KubeStore, L4Options, RouteServer, RouteServerConfig};
use spur_serving::ServingTls;
use tokio::net::{TcpListener, UdpSocket};
use tokio_util::sync::CancellationToken;
use tonic::Code;

const NS: &str = "media";
const AUDIENCE: &str = "spur-routeserver";
const SET: &str = "rtp";
const LISTENER: &str = "rtp/media";
const CLUSTER: &str = "rtp/workers";

/// A CA and a `localhost` serving certificate in `dir` (tls.crt, tls.key, ca.crt).
fn pki(dir: &Path) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = params.self_signed(&key).unwrap();
    let issuer = rcgen::Issuer::new(params, key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();
    std::fs::write(dir.join("ca.crt"), ca.pem()).unwrap();
    std::fs::write(dir.join("tls.crt"), leaf.pem()).unwrap();
    std::fs::write(dir.join("tls.key"), leaf_key.serialize_pem()).unwrap();
}

async fn start_route_server(client: &Client, dir: &Path, grpc: SocketAddr) -> RouteServer {
    RouteServer::start_with(
        RouteServerConfig {
            grpc_addr: grpc,
            http_addr: "127.0.0.1:0".parse().unwrap(),
            tls: Some(ServingTls::new(dir.join("tls.crt"), dir.join("tls.key"))),
            auth: AuthConfig::Kubernetes {
                client: client.clone(),
                audience: AUDIENCE.into(),
                watch_recheck: Duration::from_secs(600),
            },
            l4: Some(L4Options {
                report_refresh: Duration::from_secs(2),
                pod_refresh: Duration::from_secs(1),
                ..L4Options::new(client.clone())
            }),
            ..RouteServerConfig::new("")
        },
        KubeStore::new(client.clone()).with_l4(),
    )
    .await
    .unwrap()
}

/// A kube-apiserver with the CRDs and the test namespace, and its admin client.
async fn start_api() -> (KubeApi, Client) {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, NS).await.unwrap();
    (api, admin)
}

/// Gateway pod gw-0 of `NS`, with the token and CA in `dir`, watching the route server at
/// `grpc`; `configure` changes the defaults.
async fn start_gateway(
    dir: &Path,
    grpc: SocketAddr,
    configure: impl FnOnce(GatewayConfig) -> GatewayConfig,
) -> Gateway {
    let config = GatewayConfig::new(
        RouteServerConn {
            addr: format!("localhost:{}", grpc.port()),
            ca: Some(dir.join("ca.crt")),
            token: Some(dir.join("token")),
        },
        NS,
        "gw-0",
    );
    Gateway::start(configure(config)).await.unwrap()
}

/// A UDP echo worker named `name` on `ip:port`, with a TCP health port `ip:health` whose
/// listener stops when `health_stop` is cancelled.
async fn worker(
    name: &str,
    ip: IpAddr,
    port: u16,
    health: u16,
    stop: &CancellationToken,
    health_stop: CancellationToken,
) {
    let socket = UdpSocket::bind((ip, port)).await.unwrap();
    tokio::spawn(spur_demo_apps::serve_udp_echo(
        socket,
        name.into(),
        stop.child_token(),
    ));
    let listener = TcpListener::bind((ip, health)).await.unwrap();
    let stop = stop.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = health_stop.cancelled() => return,
                r = listener.accept() => drop(r),
            }
        }
    });
}

/// The host's end of `net`'s veth (`.1` of its /30; the namespace has `.2`).
fn host_ip(net: &TestNet) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(u32::from(net.ip) - 1))
}

/// The EndpointSlice of the set's endpoint Service with these (worker, ready) entries, applied.
async fn apply_slice(admin: &Client, ips: &[IpAddr], workers: &[(usize, bool)]) {
    let service = endpoint_service_name(SET, "workers", 0);
    let endpoints: Vec<Value> = workers
        .iter()
        .map(|(i, ready)| {
            json!({
                "addresses": [ips[*i].to_string()],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "namespace": NS, "name": format!("w-{i}")},
            })
        })
        .collect();
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-x7k2p"), "namespace": NS, "labels": {
            "kubernetes.io/service-name": service,
            spur_api::listenerset::LISTENER_SET_LABEL: SET,
        }},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "", "protocol": "UDP"}],
    });
    Api::<EndpointSlice>::namespaced(admin.clone(), NS)
        .patch(
            &format!("{service}-x7k2p"),
            &PatchParams::apply("spur-tests").force(),
            &Patch::Apply(slice),
        )
        .await
        .unwrap();
}

async fn pod(admin: &Client, name: &str, app: &str) -> Pod {
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {"serviceAccountName": "gateway", "containers": [{"name": "gateway", "image": "spur:dev"}]},
    }))
    .unwrap();
    Api::<Pod>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &p)
        .await
        .unwrap()
}

async fn pod_token(api: &KubeApi, pod: Option<&Pod>) -> String {
    api.token_request(
        NS,
        "gateway",
        TokenRequestSpec {
            audiences: vec![AUDIENCE.into()],
            expiration_seconds: Some(3600),
            bound_object_ref: pod.map(|p| BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(p.name_any()),
                uid: p.uid(),
            }),
        },
    )
    .await
    .unwrap()
}

/// Sends `payload` from `socket` to `to` and returns the name of the worker that answered
/// (a few tries: UDP).
async fn ask(socket: &UdpSocket, to: SocketAddr, payload: &[u8]) -> Option<String> {
    let mut buf = vec![0u8; 2048];
    for _ in 0..3 {
        socket.send_to(payload, to).await.unwrap();
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(1000), socket.recv(&mut buf)).await
        {
            let reply = &buf[..n];
            let space = reply.iter().position(|b| *b == b' ')?;
            assert_eq!(&reply[space + 1..], payload, "the echo carries the payload");
            return Some(String::from_utf8_lossy(&reply[..space]).into_owned());
        }
    }
    None
}

/// The 8-byte hash key of session `i`.
fn key(i: usize) -> Vec<u8> {
    format!("s{i:07}").into_bytes()
}

/// One session per socket, keyed `key(i)`: who answered each.
async fn sessions(sockets: &[UdpSocket], to: SocketAddr) -> Vec<String> {
    let mut out = Vec::with_capacity(sockets.len());
    for (i, s) in sockets.iter().enumerate() {
        let who = ask(s, to, &key(i)).await;
        out.push(who.unwrap_or_else(|| panic!("session {i} got no answer")));
    }
    out
}

fn count(answers: &[String]) -> BTreeMap<&str, usize> {
    let mut m = BTreeMap::new();
    for a in answers {
        *m.entry(a.as_str()).or_insert(0) += 1;
    }
    m
}

/// The ids of the gateway's endpoints of the workers' cluster.
fn endpoint_ids(gateway: &Gateway) -> Vec<String> {
    let mut ids: Vec<String> = gateway
        .listeners()
        .clusters()
        .into_iter()
        .filter(|c| c.name == CLUSTER)
        .flat_map(|c| c.endpoints.into_iter().map(|e| e.id))
        .collect();
    ids.sort();
    ids
}

async fn gateways_status(admin: &Client) -> Value {
    let set = Api::<ListenerSet>::namespaced(admin.clone(), NS)
        .get(SET)
        .await
        .unwrap();
    serde_json::to_value(set.status.unwrap_or_default().gateways).unwrap()
}

/// `status.gateways[]`'s entry of pod gw-0: (endpoint id → healthy).
async fn gateway_entry(admin: &Client) -> Option<BTreeMap<String, bool>> {
    let all = gateways_status(admin).await;
    let entry = all.as_array()?.iter().find(|g| g["pod"] == "gw-0")?.clone();
    assert!(entry["updatedAt"].is_string(), "{entry}");
    Some(
        entry["endpoints"]
            .as_array()?
            .iter()
            .map(|e| {
                assert_eq!(e["cluster"], "workers", "{e}");
                (
                    e["id"].as_str().unwrap().to_owned(),
                    e["healthy"].as_bool().unwrap(),
                )
            })
            .collect(),
    )
}

/// A raw client of the L4 API over TLS, for the refusals.
async fn listeners_client(port: u16, ca: &Path) -> ListenersClient<tonic::transport::Channel> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let pem = std::fs::read(ca).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config));
    let connector = tower::service_fn(move |_: http::Uri| {
        let tls = tls.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            let s = tls.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
        }
    });
    let channel = tonic::transport::Endpoint::from_shared(format!("http://localhost:{port}"))
        .unwrap()
        .connect_with_connector(connector)
        .await
        .unwrap();
    ListenersClient::new(channel)
}

fn authorized<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_set_is_served_by_its_gateway_pod() {
    let (api, admin) = start_api().await;

    // Four workers on one port, each on its own address, with a TCP health port.
    let nets: Vec<TestNet> = (0..4).map(|_| TestNet::new().unwrap()).collect();
    let ips: Vec<IpAddr> = nets.iter().map(host_ip).collect();
    let stop = CancellationToken::new();
    let _stop_all = stop.clone().drop_guard();
    let (port, health) = (free_port(), free_port());
    let mut health_stops = Vec::new();
    for (i, ip) in ips.iter().enumerate() {
        let hs = CancellationToken::new();
        worker(&format!("w-{i}"), *ip, port, health, &stop, hs.clone()).await;
        health_stops.push(hs);
    }
    let listen_port = free_port();
    let target = SocketAddr::from(([127, 0, 0, 1], listen_port));

    // The ListenerSet, its endpoint Service's slice (w-0..w-2), the gateway pod and its token.
    let set: ListenerSet = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "ListenerSet",
        "metadata": {"name": SET},
        "spec": {
            "selector": {"matchLabels": {"app": "gw"}},
            "listeners": [{
                "name": "media", "protocol": "udp", "port": listen_port,
                "cluster": {
                    "name": "workers", "lb": "maglev",
                    "hashKey": {"firstBytes": {"offset": 0, "length": 8}},
                    // Short, so a session's client port is a new session again soon.
                    "idleTimeout": "1s",
                    "healthCheck": {"protocol": "tcp", "interval": "300ms", "timeout": "200ms"},
                    "endpoints": [{"selector": {"matchLabels": {"app": "worker"}},
                                   "port": port, "healthCheckPort": health}]
                }
            }]
        }
    }))
    .unwrap();
    Api::<ListenerSet>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &set)
        .await
        .unwrap();
    apply_slice(&admin, &ips, &[(0, true), (1, true), (2, true)]).await;
    // The ServiceAccount exists before its pods (no ServiceAccount admission here).
    let _ = pod_token(&api, None).await;
    let gw0 = pod(&admin, "gw-0", "gw").await;
    let gw1 = pod(&admin, "gw-1", "other").await;
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path());
    let token = pod_token(&api, Some(&gw0)).await;
    std::fs::write(dir.path().join("token"), &token).unwrap();

    // The route server with the chart's rights, TLS and token authentication.
    let rs_client = kt::chart_client(&api, "spur-routeserver", "routeserver-rules.yaml", None)
        .await
        .unwrap();
    let server = start_route_server(&rs_client, dir.path(), "127.0.0.1:0".parse().unwrap()).await;
    let grpc = server.grpc_addr;

    let gateway = start_gateway(dir.path(), grpc, |c| GatewayConfig {
        report_interval: Duration::from_secs(1),
        ..c
    })
    .await;
    eventually("the gateway runs the listener", || async {
        (gateway.is_ready() && gateway.listeners().local_addr(LISTENER).is_some()).then_some(())
    })
    .await;
    assert_eq!(endpoint_ids(&gateway), ["w-0", "w-1", "w-2"]);

    // One session reaches a worker; the same key from another source port reaches it too.
    let a = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let b = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let first = ask(&a, target, b"call-042rtp").await.expect("an answer");
    assert!(["w-0", "w-1", "w-2"].contains(&first.as_str()), "{first}");
    assert_eq!(ask(&b, target, b"call-042rtcp").await.unwrap(), first);

    // 1 000 sessions spread within ±15 %.
    let mut sockets = Vec::with_capacity(1000);
    for _ in 0..1000 {
        sockets.push(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    }
    let before = sessions(&sockets, target).await;
    let spread = count(&before);
    assert_eq!(spread.len(), 3, "{spread:?}");
    for (who, n) in &spread {
        assert!((283..=383).contains(n), "{who} got {n} of 1000: {spread:?}");
    }

    // A fourth worker moves at most 30 % of the sessions (its fair share is 25 %).
    apply_slice(&admin, &ips, &[(0, true), (1, true), (2, true), (3, true)]).await;
    eventually("the gateway has four endpoints", || async {
        (endpoint_ids(&gateway).len() == 4).then_some(())
    })
    .await;
    // The sockets' sessions idle out, so the same sockets are new sessions again.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let after = sessions(&sockets, target).await;
    let moved = before.iter().zip(&after).filter(|(x, y)| x != y).count();
    assert!(moved <= 300, "{moved} of 1000 sessions moved");
    let to_new = after.iter().filter(|w| *w == "w-3").count();
    assert!(to_new >= 150, "w-3 got only {to_new}");

    // A worker marked not ready is out: no new session reaches it.
    apply_slice(&admin, &ips, &[(0, false), (1, true), (2, true), (3, true)]).await;
    eventually("w-0 is gone from the gateway", || async {
        (endpoint_ids(&gateway) == ["w-1", "w-2", "w-3"]).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let without = sessions(&sockets[..300], target).await;
    assert!(!without.iter().any(|w| w == "w-0"), "{:?}", count(&without));

    // status.gateways: the gateway's entry, with health; a worker whose health port closes
    // turns unhealthy there.
    eventually("the gateway's entry in status", || async {
        let e = gateway_entry(&admin).await?;
        (e == BTreeMap::from([
            ("w-1".to_owned(), true),
            ("w-2".to_owned(), true),
            ("w-3".to_owned(), true),
        ]))
        .then_some(())
    })
    .await;
    // Another pod's token may not read or report for gw-0; gw-0's own token may, but not
    // for another pod.
    let other = pod_token(&api, Some(&gw1)).await;
    let mut raw = listeners_client(grpc.port(), &dir.path().join("ca.crt")).await;
    let watch_gw0 = || WatchListenersRequest {
        namespace: NS.into(),
        pod: "gw-0".into(),
    };
    let refused = raw
        .watch(authorized(watch_gw0(), &other))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let report = GatewayReport {
        namespace: NS.into(),
        pod: "gw-0".into(),
        ..GatewayReport::default()
    };
    let refused = raw.report(authorized(report, &other)).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let for_gw1 = WatchListenersRequest {
        namespace: NS.into(),
        pod: "gw-1".into(),
    };
    let refused = raw.watch(authorized(for_gw1, &token)).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let refused = raw
        .watch(tonic::Request::new(watch_gw0()))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");

    // The route server goes: the gateway's entry goes with its stream, the gateway serves on.
    server.shutdown().await;
    eventually("the gateway's entry removed", || async {
        gateway_entry(&admin).await.is_none().then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let offline = sessions(&sockets[..100], target).await;
    assert!(!offline.iter().any(|w| w == "w-0"), "{:?}", count(&offline));

    // A change made meanwhile is picked up once the route server is back (same address).
    apply_slice(&admin, &ips, &[(0, true), (1, true), (2, true), (3, true)]).await;
    let server = start_route_server(&rs_client, dir.path(), grpc).await;
    eventually("w-0 back in the gateway", || async {
        (endpoint_ids(&gateway) == ["w-0", "w-1", "w-2", "w-3"]).then_some(())
    })
    .await;
    eventually("the gateway's entry back in status", || async {
        gateway_entry(&admin)
            .await
            .filter(|e| e.len() == 4)
            .map(|_| ())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let back = sessions(&sockets, target).await;
    assert_eq!(back, after, "the same four workers, the same sessions");

    // A worker whose health port closes turns unhealthy in status, and gets no new session.
    health_stops[2].cancel();
    eventually("w-2 unhealthy in status", || async {
        let e = gateway_entry(&admin).await?;
        (e.get("w-2") == Some(&false) && e.get("w-1") == Some(&true)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let unhealthy = sessions(&sockets[..300], target).await;
    assert!(
        !unhealthy.iter().any(|w| w == "w-2"),
        "{:?}",
        count(&unhealthy)
    );

    gateway.shutdown().await;
    server.shutdown().await;
    kt::assert_no_secret_logged(&[&token, &other]);
}

/// A name server on loopback: every A query is answered with the current address and a TTL of
/// `ttl` seconds, every other query with no records. Counts A queries.
struct NameServer {
    addr: SocketAddr,
    answer: Arc<Mutex<Ipv4Addr>>,
    queries: Arc<AtomicU32>,
}

impl NameServer {
    async fn start(ip: Ipv4Addr, ttl: u32, stop: CancellationToken) -> NameServer {
        use hickory_proto::op::{Message, MessageType};
        use hickory_proto::rr::rdata::A;
        use hickory_proto::rr::{RData, Record, RecordType};

        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let answer = Arc::new(Mutex::new(ip));
        let queries = Arc::new(AtomicU32::new(0));
        let (current, count) = (answer.clone(), queries.clone());
        tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            loop {
                let (n, peer) = tokio::select! {
                    () = stop.cancelled() => return,
                    r = socket.recv_from(&mut buf) => match r {
                        Ok(got) => got,
                        Err(_) => continue,
                    },
                };
                let Ok(query) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let mut reply = Message::response(query.metadata.id, query.metadata.op_code);
                reply.metadata.message_type = MessageType::Response;
                reply.metadata.recursion_desired = query.metadata.recursion_desired;
                reply.metadata.recursion_available = true;
                for q in &query.queries {
                    reply.add_query(q.clone());
                    if q.query_type() == RecordType::A {
                        count.fetch_add(1, Ordering::SeqCst);
                        let ip = *current.lock().unwrap();
                        reply.add_answer(Record::from_rdata(
                            q.name().clone(),
                            ttl,
                            RData::A(A(ip)),
                        ));
                    }
                }
                if let Ok(bytes) = reply.to_vec() {
                    let _ = socket.send_to(&bytes, peer).await;
                }
            }
        });
        NameServer {
            addr,
            answer,
            queries,
        }
    }
}

#[tokio::test]
async fn a_dns_endpoint_follows_its_records() {
    let (api, admin) = start_api().await;

    // Two workers on loopback addresses of their own (the name's answers; loopback is fine
    // here, no EndpointSlice carries it), one port.
    let stop = CancellationToken::new();
    let _stop_all = stop.clone().drop_guard();
    let ips = [Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)];
    let (port, health) = (free_port(), free_port());
    for (i, ip) in ips.iter().enumerate() {
        let name = format!("w-{i}");
        worker(
            &name,
            IpAddr::V4(*ip),
            port,
            health,
            &stop,
            stop.child_token(),
        )
        .await;
    }
    const TTL: u32 = 2;
    let names = NameServer::start(ips[0], TTL, stop.child_token()).await;

    let listen_port = free_port();
    let target = SocketAddr::from(([127, 0, 0, 1], listen_port));
    let set: ListenerSet = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "ListenerSet",
        "metadata": {"name": "named"},
        "spec": {
            "selector": {"matchLabels": {"app": "gw"}},
            "listeners": [{
                "name": "media", "protocol": "udp", "port": listen_port,
                "cluster": {
                    "name": "workers",
                    "idleTimeout": "1s",
                    "healthCheck": {"protocol": "tcp", "interval": "300ms", "timeout": "200ms"},
                    "endpoints": [{"dnsName": "workers.media.example.", "port": port,
                                   "healthCheckPort": health}]
                }
            }]
        }
    }))
    .unwrap();
    Api::<ListenerSet>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &set)
        .await
        .unwrap();
    let _ = pod_token(&api, None).await;
    let gw = pod(&admin, "gw-0", "gw").await;
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path());
    let token = pod_token(&api, Some(&gw)).await;
    std::fs::write(dir.path().join("token"), &token).unwrap();
    let rs_client = kt::chart_client(&api, "spur-routeserver", "routeserver-rules.yaml", None)
        .await
        .unwrap();
    let server = start_route_server(&rs_client, dir.path(), "127.0.0.1:0".parse().unwrap()).await;
    let interval = Duration::from_secs(30);
    let gateway = start_gateway(dir.path(), server.grpc_addr, |c| GatewayConfig {
        dns_interval: interval,
        dns_server: Some(names.addr),
        ..c
    })
    .await;
    eventually("the gateway runs the listener", || async {
        (gateway.is_ready() && gateway.listeners().local_addr("named/media").is_some())
            .then_some(())
    })
    .await;
    // A new socket is a new session.
    let who = || async {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        ask(&socket, target, b"hello").await
    };
    eventually("w-0 answers", || async {
        (who().await? == "w-0").then_some(())
    })
    .await;

    // The name moves to w-1: new sessions follow once the records expire.
    *names.answer.lock().unwrap() = ips[1];
    let moved = Instant::now();
    loop {
        if who().await.as_deref() == Some("w-1") {
            break;
        }
        assert!(
            moved.elapsed() < Duration::from_secs(15),
            "sessions still reach w-0 15 s after its name moved (TTL {TTL} s)"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let took = moved.elapsed();
    eprintln!("kube_l4: the DNS endpoint moved {took:?} after its name (TTL {TTL} s)");
    assert!(
        took < interval / 2,
        "{took:?}: the interval, not the TTL, drove it"
    );
    // A lookup per TTL, not one per session or per tick.
    let asked = names.queries.load(Ordering::SeqCst);
    assert!(
        (2..=20).contains(&asked),
        "{asked} A queries in about {took:?} plus start-up"
    );

    // A newer set with a listener on the same port: the gateway keeps serving the older one,
    // and the newer set's status says which listener it does not serve and why.
    let shadow: ListenerSet = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "ListenerSet",
        "metadata": {"name": "shadow"},
        "spec": {
            "selector": {"matchLabels": {"app": "gw"}},
            "listeners": [{
                "name": "media", "protocol": "udp", "port": listen_port,
                "cluster": {"name": "other", "endpoints": [{"address": "127.0.0.3", "port": port}]}
            }]
        }
    }))
    .unwrap();
    Api::<ListenerSet>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &shadow)
        .await
        .unwrap();
    let want = format!("shadow/media: udp port {listen_port} is served by the older named/media");
    eventually(
        "the shadowed listener in the newer set's status",
        || async {
            let set = Api::<ListenerSet>::namespaced(admin.clone(), NS)
                .get("shadow")
                .await
                .ok()?;
            let gateways = set.status?.gateways;
            (gateways.first()?.shadowed == [want.clone()]).then_some(())
        },
    )
    .await;
    assert_eq!(
        who().await.as_deref(),
        Some("w-1"),
        "the older set still serves"
    );

    gateway.shutdown().await;
    server.shutdown().await;
    kt::assert_no_secret_logged(&[&token]);
}
