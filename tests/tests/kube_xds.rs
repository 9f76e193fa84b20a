//! Proxyless gRPC routed by sandbox key through the route server's xDS (ADS) port, against a
//! real kube-apiserver: grpc-go's own xDS client (tests/go-xds, built from its Go module and
//! used unchanged) dials `xds:///api.shop.svc:80` and the test checks which server answered.
//!
//! The route server runs as the chart's ServiceAccount with the chart's rules (so the
//! EndpointSlice watch is proven allowed), serves the xDS port with mutual TLS from a test CA,
//! and reads Services, EndpointSlices and RoutingConfigs written here as the operator and the
//! EndpointSlice controller would write them (no pods in this tier: the endpoints are demo gRPC
//! servers in a network namespace of the test, since the API server refuses loopback endpoints).
//!
//! Also checked: the ADS protocol as a raw client sees it (per-type versions, ACK/NACK per node,
//! stale nonces, no stream without a client certificate of a trusted CA, a CA added to the
//! bundle trusted without a restart), and the operator's credentials for
//! opted-in namespaces, used as issued.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use spur_api::RoutingConfig;
use spur_e2e::kube::{self as kt, eventually};
use spur_e2e::netns::TestNet;
use spur_e2e::xds::{GoClient, Pki, ads_client, grpc_app, next};
use spur_kube_harness::KubeApi;
use spur_routeserver::{KubeStore, RouteServer, RouteServerConfig, XdsConfig, XdsTls};
use spur_serving::ServingTls;
use tokio_util::sync::CancellationToken;

const NS: &str = "shop";

/// A Service `name` (port 80, named `grpc`) and its EndpointSlice pointing at `backend`.
async fn service(client: &Client, name: &str, backend: SocketAddr) {
    let svcs: Api<Service> = Api::namespaced(client.clone(), NS);
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [
            {"name": "grpc", "port": 80, "targetPort": 8080, "appProtocol": "grpc"}]},
    }))
    .unwrap();
    svcs.create(&PostParams::default(), &svc).await.unwrap();
    set_endpoints(client, name, backend).await;
}

/// What the EndpointSlice controller would write for one ready pod at `backend`.
async fn set_endpoints(client: &Client, name: &str, backend: SocketAddr) {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-abcde"),
                     "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "ports": [{"name": "grpc", "port": backend.port(), "protocol": "TCP"}],
        "endpoints": [{"addresses": [backend.ip().to_string()], "conditions": {"ready": true}}],
    });
    slices
        .patch(
            &format!("{name}-abcde"),
            &PatchParams::apply("spur-tests").force(),
            &Patch::Apply(slice),
        )
        .await
        .unwrap();
}

/// The RoutingConfig of sandbox `sandbox` with key `key`, routing `api` to `to`, as the
/// operator writes it (spec, then the routes in status).
async fn sandbox(client: &Client, sandbox: &str, key: &str, to: &str) {
    let rcs: Api<RoutingConfig> = Api::all(client.clone());
    let rc: RoutingConfig = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "RoutingConfig",
        "metadata": {"name": sandbox}, "spec": {"routingKey": key}
    }))
    .unwrap();
    rcs.create(&PostParams::default(), &rc).await.unwrap();
    let route = json!({
        "fromHost": format!("api.{NS}.svc"), "fromPort": 80,
        "toHost": format!("{to}.{NS}.svc"), "toPort": 80, "workloadPort": 8080,
        "sandbox": sandbox,
        "baseline": {"kind": "Deployment", "namespace": NS, "name": "api"},
    });
    rcs.patch_status(
        sandbox,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"routeServer": {"routes": [route]}}})),
    )
    .await
    .unwrap();
}

/// The chart's route-server identity.
async fn routeserver_client(api: &KubeApi) -> Client {
    kt::chart_client(api, "spur-routeserver", "routeserver-rules.yaml", None)
        .await
        .unwrap()
}

async fn start_routeserver(client: &Client, xds: XdsConfig) -> RouteServer {
    let client = client.clone();
    RouteServer::start_with(
        RouteServerConfig {
            grpc_addr: "127.0.0.1:0".parse().unwrap(),
            http_addr: "127.0.0.1:0".parse().unwrap(),
            xds: Some(xds),
            ..RouteServerConfig::new("")
        },
        KubeStore::new(client)
            .with_xds()
            // The chart's routingKeys, as it passes them (--routing-header, --query-param).
            .with_carriers(spur_api::carriers::ExtractConfig {
                custom_headers: vec!["x-route-to".into()],
                query_param: Some("sd-routing-key".into()),
            })
            .unwrap(),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxyless_grpc_client_routes_by_key_through_xds() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, NS).await.unwrap();
    let net = TestNet::new().unwrap();
    let apps = CancellationToken::new();
    let _stop_apps = apps.clone().drop_guard();
    let baseline = grpc_app(&net, "baseline", &apps);
    let fork1 = grpc_app(&net, "fork-1", &apps);
    let fork2 = grpc_app(&net, "fork-2", &apps);
    service(&admin, "api", baseline).await;
    service(&admin, "sb1-api", fork1).await;
    sandbox(&admin, "sb1", "k1", "sb1-api").await;

    let pki = Pki::new();
    let xds = XdsConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        ..XdsConfig::new(Some(pki.xds_tls()))
    };
    let rs_client = routeserver_client(&api).await;
    let server = start_routeserver(&rs_client, xds.clone()).await;
    let xds_addr = server.xds_addr.unwrap();
    let bootstrap = pki.bootstrap(xds_addr, "client-1");
    let mut c = GoClient::start(&format!("xds:///api.{NS}.svc:80"), &bootstrap).await;

    // No key: the baseline. The key in any carrier the sidecar reads: the fork.
    assert_eq!(c.call(&[]).await.as_deref(), Ok("baseline"));
    for md in [
        ("baggage", "sd-routing-key=k1"),
        ("baggage", "other=1,spur-routing-key=k1;prop=x"),
        ("tracestate", "vendor=abc,sd-routing-key=k1"),
        ("ot-baggage-sd-routing-key", "k1"),
        ("uberctx-sd-sandbox", "k1"),
        // The cluster's custom header (grpc-go skips the query parameter's route: a call has
        // no query string).
        ("x-route-to", "k1"),
    ] {
        assert_eq!(c.call(&[md]).await.as_deref(), Ok("fork-1"), "{md:?}");
    }
    // A header the namespace names is a carrier once it is annotated (the Namespace watch,
    // allowed by the chart's rules), and not before.
    assert_eq!(c.call(&[("x-team", "k1")]).await.as_deref(), Ok("baseline"));
    kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(admin.clone())
        .patch(
            NS,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "sidecar.spur.dev/routing-headers": "x-team"}}})),
        )
        .await
        .unwrap();
    c.eventually_served_by(
        "the namespace's custom header",
        &[("x-team", "k1")],
        "fork-1",
    )
    .await;
    assert_eq!(
        c.call(&[("x-route-to", "k1")]).await.as_deref(),
        Ok("fork-1"),
        "the cluster's header stays"
    );
    // Near misses stay with the baseline: another key, a key only as a baggage property, a
    // member whose name merely ends like a carrier's.
    for md in [
        ("baggage", "sd-routing-key=k2"),
        ("baggage", "a=1;sd-routing-key=k1"),
        ("baggage", "xsd-routing-key=k1"),
        ("sd-routing-key", "k1"),
    ] {
        assert_eq!(c.call(&[md]).await.as_deref(), Ok("baseline"), "{md:?}");
    }
    // Another client, dialing the Service by its fully qualified name.
    let mut fq = GoClient::start(
        &format!("xds:///api.{NS}.svc.cluster.local:80"),
        &pki.bootstrap(xds_addr, "client-2"),
    )
    .await;
    assert_eq!(
        fq.call(&[("baggage", "sd-routing-key=k1")])
            .await
            .as_deref(),
        Ok("fork-1")
    );
    drop(fq);

    // A new sandbox takes effect on the running client.
    service(&admin, "sb2-api", fork2).await;
    sandbox(&admin, "sb2", "k2", "sb2-api").await;
    c.eventually_served_by(
        "the new sandbox's route",
        &[("baggage", "sd-routing-key=k2")],
        "fork-2",
    )
    .await;
    assert_eq!(c.call(&[]).await.as_deref(), Ok("baseline"));

    // Every node acknowledged what it was sent, per type.
    eventually("client-1 ACKed all four types", || async {
        let nodes = server.xds_nodes();
        let n = nodes.iter().find(|n| n.node_id == "client-1")?;
        (n.types.len() == 4
            && n.types
                .values()
                .all(|t| t.acked.is_some() && t.acked == t.sent && t.nacked.is_none()))
        .then_some(())
    })
    .await;

    // The route server goes away: the client keeps its last config and keeps routing.
    server.shutdown().await;
    assert_eq!(
        c.call(&[("baggage", "sd-routing-key=k2")]).await.as_deref(),
        Ok("fork-2")
    );
    assert_eq!(c.call(&[]).await.as_deref(), Ok("baseline"));
    // It comes back on the same port; what changed meanwhile reaches the client when it has
    // resynced: sandbox 1 is gone, so its key now reaches the baseline.
    let rcs: Api<RoutingConfig> = Api::all(admin.clone());
    rcs.delete("sb1", &DeleteParams::default()).await.unwrap();
    let server = start_routeserver(
        &rs_client,
        XdsConfig {
            addr: xds_addr,
            ..xds.clone()
        },
    )
    .await;
    c.eventually_served_by(
        "sandbox 1's route removed after the resync",
        &[("baggage", "sd-routing-key=k1")],
        "baseline",
    )
    .await;
    assert_eq!(
        c.call(&[("baggage", "sd-routing-key=k2")]).await.as_deref(),
        Ok("fork-2")
    );
    // A fork's endpoints move (its pod replaced): only EDS changes, and calls follow.
    let fork2b = grpc_app(&net, "fork-2b", &apps);
    set_endpoints(&admin, "sb2-api", fork2b).await;
    c.eventually_served_by(
        "the fork's new endpoint",
        &[("baggage", "sd-routing-key=k2")],
        "fork-2b",
    )
    .await;
    drop(c);
    server.shutdown().await;
}

/// The ADS protocol as a raw client sees it: per-type versions, ACK and NACK tracked per node,
/// stale nonces ignored, and no connection without a client certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ads_protocol_versions_acks_nacks_and_client_certificates() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, NS).await.unwrap();
    // Nothing is sent to these.
    service(&admin, "api", "10.0.0.1:8080".parse().unwrap()).await;
    service(&admin, "sb1-api", "10.0.0.2:8080".parse().unwrap()).await;
    let pki = Pki::new();
    let server = start_routeserver(
        &routeserver_client(&api).await,
        XdsConfig {
            addr: "127.0.0.1:0".parse().unwrap(),
            ..XdsConfig::new(Some(pki.xds_tls()))
        },
    )
    .await;
    let addr = server.xds_addr.unwrap();

    // Without a client certificate, or with one of a CA the server does not trust: no stream.
    assert!(!opens_stream(addr, &pki, None).await);
    assert!(
        !opens_stream(addr, &pki, Some("workstation")).await,
        "a workstation's certificate (same CA) read xDS"
    );
    pki.second_ca();
    assert!(!opens_stream(addr, &pki, Some("client2")).await);
    // The CA bundle gains that CA (a CA rotation): its clients are accepted, no restart.
    let bundle = [
        std::fs::read_to_string(pki.path("ca.crt")).unwrap(),
        std::fs::read_to_string(pki.path("ca2.crt")).unwrap(),
    ]
    .concat();
    std::fs::write(pki.path("ca.crt"), bundle).unwrap();
    eventually("a client of the new CA accepted", || async {
        opens_stream(addr, &pki, Some("client2"))
            .await
            .then_some(())
    })
    .await;

    let mut c = ads_client(addr, &pki, Some("client")).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel::<DiscoveryRequest>(8);
    let mut responses = c
        .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let rds = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
    let eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
    let req = |type_url: &str, names: &[&str], version: &str, nonce: &str| DiscoveryRequest {
        node: Some(Node {
            id: "raw-1".into(),
            ..Default::default()
        }),
        type_url: type_url.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        version_info: version.into(),
        response_nonce: nonce.into(),
        ..Default::default()
    };
    let route_name = format!("api.{NS}.svc:80");
    tx.send(req(rds, &[&route_name], "", "")).await.unwrap();
    let r1 = next(&mut responses).await;
    assert_eq!((r1.type_url.as_str(), r1.resources.len()), (rds, 1));
    tx.send(req(eds, &[&route_name], "", "")).await.unwrap();
    let e1 = next(&mut responses).await;
    assert_eq!((e1.type_url.as_str(), e1.resources.len()), (eds, 1));
    // ACK both; then a stale ACK (an old nonce) is ignored: no response to it.
    tx.send(req(rds, &[&route_name], &r1.version_info, &r1.nonce))
        .await
        .unwrap();
    tx.send(req(eds, &[&route_name], &e1.version_info, &e1.nonce))
        .await
        .unwrap();
    tx.send(req(rds, &[&route_name], &r1.version_info, "stale"))
        .await
        .unwrap();

    // A new sandbox changes routes only: the next response is RDS, a new version.
    sandbox(&admin, "sb1", "k1", "sb1-api").await;
    let r2 = next(&mut responses).await;
    assert_eq!(r2.type_url, rds);
    assert_ne!(r2.version_info, r1.version_info);
    // The client rejects it: recorded for this node and type, and not sent again.
    tx.send(DiscoveryRequest {
        error_detail: Some(RpcStatus {
            code: 3,
            message: "pretend the route was invalid".into(),
            details: vec![],
        }),
        ..req(rds, &[&route_name], &r1.version_info, &r2.nonce)
    })
    .await
    .unwrap();
    eventually("the NACK recorded", || async {
        let nodes = server.xds_nodes();
        let n = nodes.iter().find(|n| n.node_id == "raw-1")?;
        let t = n.types.get("rds")?;
        let nack = t.nacked.as_ref()?;
        (nack.version == r2.version_info
            && nack.message == "pretend the route was invalid"
            && t.acked.as_deref() == Some(r1.version_info.as_str()))
        .then_some(())
    })
    .await;
    // An endpoint change: EDS alone moves, RDS is not re-sent.
    set_endpoints(&admin, "api", "10.0.0.3:8080".parse().unwrap()).await;
    let e2 = next(&mut responses).await;
    assert_eq!(e2.type_url, eds);
    assert_ne!(e2.version_info, e1.version_info);
    // Dropping the stream drops the node.
    drop(tx);
    drop(responses);
    eventually("the node forgotten with its stream", || async {
        server
            .xds_nodes()
            .iter()
            .all(|n| n.node_id != "raw-1")
            .then_some(())
    })
    .await;
    server.shutdown().await;
}

/// Whether a client with certificate `cert` (file stem, None: no certificate) gets a listener
/// over a new ADS stream.
async fn opens_stream(addr: SocketAddr, pki: &Pki, cert: Option<&str>) -> bool {
    let Ok(mut c) = ads_client(addr, pki, cert).await else {
        return false;
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<DiscoveryRequest>(1);
    tx.send(DiscoveryRequest {
        node: Some(Node {
            id: "probe".into(),
            ..Default::default()
        }),
        type_url: "type.googleapis.com/envoy.config.listener.v3.Listener".into(),
        resource_names: vec![format!("api.{NS}.svc:80")],
        ..Default::default()
    })
    .await
    .unwrap();
    let Ok(r) = c
        .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
    else {
        return false;
    };
    let mut responses = r.into_inner();
    matches!(
        tokio::time::timeout(Duration::from_secs(5), responses.message()).await,
        Ok(Ok(Some(_)))
    )
}

/// The chart's way: the operator (under the chart's RBAC) issues the route server's certificate
/// and, for a namespace labelled `spur.dev/xds=enabled`, a client Secret whose bootstrap grpc-go
/// uses as is (its file paths and server address pointed at this test's copies); opting out
/// empties the Secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_issued_client_credentials_reach_the_xds_port() {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::{Namespace, Secret};
    use prometheus_client::registry::Registry;
    use spur_e2e::kube::SYSTEM_NAMESPACE;
    use spur_operator::{PkiConfig, ServingCert, XdsClientConfig};

    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, NS).await.unwrap();
    let operator = kt::operator_client(&api).await.unwrap();
    let mut registry = Registry::with_prefix("spur_operator");
    let metrics = spur_operator::Metrics::register(&mut registry);
    let mut pki = PkiConfig::new(SYSTEM_NAMESPACE, "spur-webhook");
    pki.routeserver = Some(ServingCert::routeserver(
        SYSTEM_NAMESPACE,
        &["localhost".into()],
    ));
    let server_uri = format!("spur-routeserver.{SYSTEM_NAMESPACE}.svc:7779");
    pki.xds_clients = Some(XdsClientConfig::new(server_uri.clone()));
    pki.validate().unwrap();
    let ctx = Arc::new(
        spur_operator::Context::new(operator.clone(), Some("test".into()), metrics).with_pki(pki),
    );
    let stop = CancellationToken::new();
    let running = tokio::spawn(spur_operator::run(operator, ctx, stop.clone()));

    // The route server's files, as its pod would mount them.
    let files = tempfile::tempdir().unwrap();
    let write = |data: &std::collections::BTreeMap<String, ByteString>, keys: &[&str]| {
        for k in keys {
            std::fs::write(files.path().join(k), &data[*k].0).unwrap();
        }
    };
    let system: Api<Secret> = Api::namespaced(admin.clone(), SYSTEM_NAMESPACE);
    let serving = eventually("the route server's certificate", || async {
        system.get_opt("spur-routeserver-tls").await.ok()??.data
    })
    .await;
    write(&serving, &["tls.crt", "tls.key", "ca.crt"]);
    let xds = XdsConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        ..XdsConfig::new(Some(XdsTls {
            serving: ServingTls::new(files.path().join("tls.crt"), files.path().join("tls.key")),
            client_ca: files.path().join("ca.crt"),
            client_cn_prefix: Some(spur_routeserver::xds::CLIENT_CN_PREFIX.into()),
        }))
    };
    let net = TestNet::new().unwrap();
    let apps = CancellationToken::new();
    let _stop_apps = apps.clone().drop_guard();
    service(&admin, "api", grpc_app(&net, "baseline", &apps)).await;
    let server = start_routeserver(&routeserver_client(&api).await, xds).await;

    // Opting in: the Secret appears with a client certificate, the bundle and a bootstrap.
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    let label = |v: Option<&str>| json!({"metadata": {"labels": {"spur.dev/xds": v}}});
    namespaces
        .patch(
            NS,
            &PatchParams::default(),
            &Patch::Merge(label(Some("enabled"))),
        )
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), NS);
    let creds = eventually("the namespace's xDS client Secret", || async {
        let d = secrets.get_opt("spur-xds").await.ok()??.data?;
        d.contains_key("tls.key").then_some(d)
    })
    .await;
    let cert = String::from_utf8(creds["tls.crt"].0.clone()).unwrap();
    let info = spur_serving::pki::info(&cert).unwrap();
    assert!(!info.is_ca);
    assert_eq!(creds["ca.crt"].0, serving["ca.crt"].0);
    let client_dir = tempfile::tempdir().unwrap();
    for k in ["tls.crt", "tls.key", "ca.crt"] {
        std::fs::write(client_dir.path().join(k), &creds[k].0).unwrap();
    }
    let bootstrap = String::from_utf8(creds["bootstrap.json"].0.clone())
        .unwrap()
        .replace(
            spur_operator::xds_clients::MOUNT_PATH,
            &client_dir.path().display().to_string(),
        )
        .replace(
            &server_uri,
            &format!("localhost:{}", server.xds_addr.unwrap().port()),
        );
    let bootstrap_path = client_dir.path().join("bootstrap.json");
    std::fs::write(&bootstrap_path, bootstrap).unwrap();
    let mut c = GoClient::start(&format!("xds:///api.{NS}:80"), &bootstrap_path).await;
    assert_eq!(c.call(&[]).await.as_deref(), Ok("baseline"));
    let nodes = server.xds_nodes();
    assert!(
        nodes
            .iter()
            .any(|n| n.node_id == format!("{NS}/spur-xds-client")),
        "{nodes:?}"
    );
    drop(c);

    // Opting out: the Secret is emptied.
    namespaces
        .patch(NS, &PatchParams::default(), &Patch::Merge(label(None)))
        .await
        .unwrap();
    eventually("the Secret emptied", || async {
        let s = secrets.get_opt("spur-xds").await.ok()??;
        s.data.unwrap_or_default().is_empty().then_some(())
    })
    .await;
    server.shutdown().await;
    stop.cancel();
    running.await.unwrap();
}
