//! EnvoyConfig end to end against a real kube-apiserver: the operator (under the chart's RBAC)
//! cuts revisions, the route server (under the chart's RBAC) serves the published one over its
//! xDS port to grpc-go's own xDS client (tests/go-xds, unchanged) and reports what the client
//! did with it, and the operator rolls back a revision every subscribed node rejects. Secrets
//! an EnvoyConfig names are served over SDS, to clients of its namespace only, and sent again
//! when the Secret changes. Two namespaces may use one node id without meeting; within one, the
//! older config keeps it ([`tenancy`]).
//!
//! The rejected revision is one grpc-go refuses though it decodes fine (a cluster with
//! `lb_policy: MAGLEV`, which gRPC does not implement): the "invalid resource that gets past
//! admission" of the issue. Calls run throughout and must all reach a backend.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use spur_api::{EnvoyConfig, EnvoyConfigRevision};
use spur_e2e::kube::{self as kt, eventually};
use spur_e2e::netns::TestNet;
use spur_e2e::xds::{GoClient, Pki, ads_client, grpc_app, next};
use spur_kube_harness::KubeApi;
use spur_routeserver::xds::Reports;
use spur_routeserver::{KubeStore, RouteServer, RouteServerConfig, XdsConfig};
use tokio_util::sync::CancellationToken;

#[path = "kube_envoyconfig/tenancy.rs"]
mod tenancy;

const NS: &str = "edge";
const NODE: &str = "edge-1";

/// The four resources grpc-go needs for `xds:///greeter`, with the cluster's `lb_policy` and
/// its one endpoint as given.
fn resources(lb_policy: &str, backend: SocketAddr, weight: u32) -> Value {
    let listener = json!({
        "name": "greeter",
        "api_listener": {"api_listener": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "rds": {"config_source": {"ads": {}, "resource_api_version": "V3"},
                    "route_config_name": "greeter-routes"},
            "http_filters": [{"name": "router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        }},
    });
    let route = json!({
        "name": "greeter-routes",
        "virtual_hosts": [{"name": "all", "domains": ["*"],
            "routes": [{"match": {"prefix": ""}, "route": {"cluster": "greeter"}}]}],
    });
    let cluster = json!({
        "name": "greeter", "type": "EDS",
        "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
        "lb_policy": lb_policy,
    });
    let endpoints = json!({
        "cluster_name": "greeter",
        "endpoints": [{"locality": {}, "load_balancing_weight": weight, "lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {
                "address": backend.ip().to_string(), "port_value": backend.port()}}}}]}],
    });
    json!([
        {"type": "listener", "value": listener.to_string()},
        {"type": "route", "value": route.to_string()},
        {"type": "cluster", "value": cluster.to_string()},
        {"type": "endpoint", "value": endpoints.to_string()},
    ])
}

/// Applies the config; returns its generation.
async fn apply_config(client: &Client, resources: Value) -> i64 {
    let api: Api<EnvoyConfig> = Api::namespaced(client.clone(), NS);
    let body = json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "EnvoyConfig",
        "metadata": {"name": "greeter"},
        "spec": {"nodeID": NODE, "resources": resources},
    });
    api.patch(
        "greeter",
        &PatchParams::apply("spur-tests").force(),
        &Patch::Apply(body),
    )
    .await
    .unwrap()
    .metadata
    .generation
    .unwrap()
}

async fn status(client: &Client) -> Value {
    let api: Api<EnvoyConfig> = Api::namespaced(client.clone(), NS);
    serde_json::to_value(api.get("greeter").await.unwrap().status).unwrap()
}

/// Polls the EnvoyConfig's status until `check` holds, making a call before each look: every
/// call must be answered (by `serving`), or the test fails.
async fn while_calling(
    client: &Client,
    c: &mut GoClient,
    serving: &[&str],
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = tokio::time::Instant::now() + kt::WAIT;
    loop {
        let got = c.call(&[]).await;
        assert!(
            got.as_ref().is_ok_and(|b| serving.contains(&b.as_str())),
            "a call failed or went astray while waiting for {what}: {got:?}"
        );
        let st = status(client).await;
        if check(&st) {
            return st;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; status: {st:#}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn condition<'a>(st: &'a Value, type_: &str) -> &'a Value {
    st["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or(&Value::Null)
}

/// A raw ADS stream of node `NODE` that subscribes to the cluster and accepts whatever it is
/// sent: the second, well-behaved subscriber of a partial rejection.
async fn accepting_node(addr: SocketAddr, pki: &Pki, stop: CancellationToken) {
    let mut c = ads_client(addr, pki, Some("client")).await.unwrap();
    tokio::spawn(async move {
        let (tx, rx) = tokio::sync::mpsc::channel::<DiscoveryRequest>(4);
        let subscribe = DiscoveryRequest {
            node: Some(Node {
                id: NODE.into(),
                ..Default::default()
            }),
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            resource_names: vec!["greeter".into()],
            ..Default::default()
        };
        tx.send(subscribe.clone()).await.unwrap();
        let mut responses = c
            .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        loop {
            let r = tokio::select! {
                () = stop.cancelled() => return,
                r = next(&mut responses) => r,
            };
            let ack = DiscoveryRequest {
                version_info: r.version_info,
                response_nonce: r.nonce,
                ..subscribe.clone()
            };
            if tx.send(ack).await.is_err() {
                return;
            }
        }
    });
}

/// The operator and the route server (with xDS and reports), each with the chart's rights;
/// the route server also reads Secrets in `sds_namespaces` (the chart's SDS Role there).
struct Stack {
    stop: CancellationToken,
    _stop_all: tokio_util::sync::DropGuard,
    operator: tokio::task::JoinHandle<()>,
    server: RouteServer,
    pki: Pki,
}

impl Stack {
    async fn start(api: &KubeApi, sds_namespaces: &[&str]) -> Stack {
        let stop = CancellationToken::new();
        let _stop_all = stop.clone().drop_guard();
        let operator_client = kt::chart_client(
            api,
            "spur-operator",
            "operator-rules.yaml",
            Some("operator-lease-rules.yaml"),
        )
        .await
        .unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = spur_operator::Metrics::register(&mut registry);
        let ctx = std::sync::Arc::new(spur_operator::Context::new(
            operator_client.clone(),
            Some("test".into()),
            metrics,
        ));
        let operator = tokio::spawn(spur_operator::run(operator_client, ctx, stop.clone()));
        let rs_client = kt::chart_client(api, "spur-routeserver", "routeserver-rules.yaml", None)
            .await
            .unwrap();
        for ns in sds_namespaces {
            kt::grant_in_namespace(api, "spur-routeserver", ns, "routeserver-sds-rules.yaml")
                .await
                .unwrap();
        }
        let pki = Pki::new();
        let server = RouteServer::start_with(
            RouteServerConfig {
                grpc_addr: "127.0.0.1:0".parse().unwrap(),
                http_addr: "127.0.0.1:0".parse().unwrap(),
                xds: Some(XdsConfig {
                    addr: "127.0.0.1:0".parse().unwrap(),
                    reports: Some(Reports {
                        client: rs_client.clone(),
                        replica: "routeserver-0".into(),
                        interval: Duration::from_secs(1),
                    }),
                    ..XdsConfig::new(Some(pki.xds_tls()))
                }),
                ..RouteServerConfig::new("")
            },
            KubeStore::new(rs_client)
                .with_xds()
                .with_secret_namespaces(sds_namespaces.iter().map(|n| (*n).to_owned()).collect()),
        )
        .await
        .unwrap();
        Stack {
            stop,
            _stop_all,
            operator,
            server,
            pki,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revision_every_node_rejects_is_rolled_back_without_stopping_traffic() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, NS).await.unwrap();
    let net = TestNet::new().unwrap();
    let apps = CancellationToken::new();
    let _stop_apps = apps.clone().drop_guard();
    let one = grpc_app(&net, "backend-1", &apps);
    let two = grpc_app(&net, "backend-2", &apps);

    // The operator and the route server, each with the chart's rights.
    let Stack {
        stop,
        _stop_all,
        operator,
        server,
        pki,
    } = Stack::start(&api, &[]).await;
    let xds_addr = server.xds_addr.unwrap();
    // The clients' certificate (grpc-go's and the raw second node's) is of the config's
    // namespace: an EnvoyConfig is served to no other.
    pki.xds_client("client", NS);

    // Revision 1: served, accepted, in sync.
    apply_config(&admin, resources("ROUND_ROBIN", one, 1)).await;
    let first = eventually("revision 1 published", || async {
        let st = status(&admin).await;
        (st["cacheState"] == "InSync").then(|| st["publishedVersion"].clone())
    })
    .await;
    let mut c = GoClient::start("xds:///greeter", &pki.bootstrap(xds_addr, NODE)).await;
    c.eventually_served_by("the EnvoyConfig's backend", &[], "backend-1")
        .await;
    while_calling(
        &admin,
        &mut c,
        &["backend-1"],
        "the node's ACK in status",
        |st| st["nodes"]["subscribed"] == 1 && st["nodes"]["acked"] == 1,
    )
    .await;

    // Revision 2, which grpc-go rejects, while a second node accepts it: a partial rejection
    // is shown and not rolled back.
    let accepting = CancellationToken::new();
    accepting_node(xds_addr, &pki, accepting.clone()).await;
    while_calling(
        &admin,
        &mut c,
        &["backend-1"],
        "the second node's ACK",
        |st| st["nodes"]["subscribed"] == 2 && st["nodes"]["acked"] == 2,
    )
    .await;
    apply_config(&admin, resources("MAGLEV", one, 1)).await;
    let st = while_calling(&admin, &mut c, &["backend-1"], "a partial NACK", |st| {
        st["publishedVersion"] != first
            && st["nodes"]["subscribed"] == 2
            && st["nodes"]["nacked"] == 1
    })
    .await;
    assert_eq!(st["cacheState"], "InSync", "{st:#}");
    let failing = condition(&st, "NodesFailing");
    assert_eq!(failing["status"], "True", "{st:#}");
    assert!(
        failing["message"]
            .as_str()
            .unwrap()
            .contains("1 of 2 subscribed nodes"),
        "{st:#}"
    );
    let second = st["publishedVersion"].clone();

    // The accepting node goes: now every subscribed node rejects revision 2, which is tainted,
    // and revision 1 is served again. Calls never stop.
    accepting.cancel();
    let st = while_calling(&admin, &mut c, &["backend-1"], "the rollback", |st| {
        st["cacheState"] == "Rollback" && st["publishedVersion"] == first
    })
    .await;
    assert_eq!(condition(&st, "InSync")["reason"], "Rollback", "{st:#}");
    let revisions = st["revisions"].as_array().unwrap();
    assert_eq!(revisions.len(), 2, "{st:#}");
    assert_eq!(revisions[1]["version"], second);
    assert_eq!(revisions[1]["tainted"], true, "{st:#}");
    let revs: Api<EnvoyConfigRevision> = Api::namespaced(admin.clone(), NS);
    let tainted = revs
        .get(revisions[1]["ref"].as_str().unwrap())
        .await
        .unwrap();
    let tst = tainted.status.unwrap();
    assert!(tst.tainted && !tst.published);
    let cond = tst
        .conditions
        .iter()
        .find(|c| c.type_ == "RevisionTainted")
        .unwrap();
    assert_eq!(cond.reason, "ResourcesFailing");
    assert!(cond.message.contains("MAGLEV"), "{}", cond.message);
    eventually("the rollback's events", || async {
        let events: Api<Event> = Api::namespaced(admin.clone(), NS);
        let list = events.list(&ListParams::default()).await.ok()?;
        let reasons: Vec<String> = list.items.iter().filter_map(|e| e.reason.clone()).collect();
        (reasons.iter().any(|r| r == "RevisionTainted")
            && reasons.iter().any(|r| r == "RolledBack"))
        .then_some(())
    })
    .await;
    // The client is back on revision 1, acknowledged.
    while_calling(
        &admin,
        &mut c,
        &["backend-1"],
        "revision 1 acknowledged again",
        |st| st["nodes"]["acked"] == 1 && st["nodes"]["nacked"].as_u64().unwrap_or(0) == 0,
    )
    .await;

    // A good revision 3 is served (to the second backend) and the state is in sync again.
    apply_config(&admin, resources("ROUND_ROBIN", two, 1)).await;
    while_calling(
        &admin,
        &mut c,
        &["backend-1", "backend-2"],
        "revision 3",
        |st| st["cacheState"] == "InSync" && st["revisions"].as_array().unwrap().len() == 3,
    )
    .await;
    c.eventually_served_by("revision 3's backend", &[], "backend-2")
        .await;

    // Re-applying revision 1's spec republishes that revision (no new one), last in order.
    apply_config(&admin, resources("ROUND_ROBIN", one, 1)).await;
    let st = while_calling(
        &admin,
        &mut c,
        &["backend-1", "backend-2"],
        "revision 1 republished",
        |st| st["cacheState"] == "InSync" && st["publishedVersion"] == first,
    )
    .await;
    let order: Vec<&Value> = st["revisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["version"])
        .collect();
    assert_eq!(order.len(), 3, "{st:#}");
    assert_eq!(order[2], &first, "{st:#}");
    c.eventually_served_by("revision 1's backend again", &[], "backend-1")
        .await;

    // At most ten revisions are kept, the oldest dropped.
    for weight in 2..=11 {
        let generation = apply_config(&admin, resources("ROUND_ROBIN", one, weight)).await;
        eventually("the new revision published", || async {
            let st = status(&admin).await;
            (st["observedGeneration"] == generation
                && st["cacheState"] == "InSync"
                && st["desiredVersion"] == st["publishedVersion"])
                .then_some(())
        })
        .await;
    }
    eventually("ten revisions kept", || async {
        let st = status(&admin).await;
        let kept = revs
            .list(&ListParams::default().labels("spur.dev/envoy-config=greeter"))
            .await
            .ok()?
            .items
            .len();
        (st["revisions"].as_array()?.len() == 10 && kept == 10).then_some(())
    })
    .await;
    assert_eq!(c.call(&[]).await.as_deref(), Ok("backend-1"));

    // The server's certificate is renewed (as the operator's PKI does at 80 % of its
    // lifetime): new connections get the new one; the running client's stream is not dropped
    // (it never subscribes again) and its calls go on.
    let subscribes = || async {
        let text = spur_e2e::metrics(server.http_addr).await;
        spur_e2e::sample(
            &text,
            r#"spur_routeserver_xds_requests_total{type="lds",kind="subscribe"}"#,
        )
    };
    let before = subscribes().await;
    assert!(before >= 1.0, "no subscription counted: wrong series name?");
    // Each watch's error series exists from its start, at 0, so an alert's `increase()` sees
    // its first failure (charts/spur/files/alerts.yaml, SpurRouteServerWatchFailing).
    let text = spur_e2e::metrics(server.http_addr).await;
    for resource in ["RoutingConfig", "Service", "EndpointSlice"] {
        let series = format!(r#"spur_routeserver_watch_errors_total{{resource="{resource}"}} 0"#);
        assert!(
            text.lines().any(|l| l == series),
            "{series} not exported:\n{text}"
        );
    }
    let renewed = pki.reissue_server();
    eventually("the renewed certificate served", || async {
        (pki.presented(xds_addr).await == renewed).then_some(())
    })
    .await;
    for _ in 0..5 {
        assert_eq!(c.call(&[]).await.as_deref(), Ok("backend-1"));
    }
    assert_eq!(subscribes().await, before, "a stream was opened again");

    // Deleting the config deletes its revisions.
    let configs: Api<EnvoyConfig> = Api::namespaced(admin.clone(), NS);
    configs
        .delete("greeter", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the revisions deleted", || async {
        let left = revs.list(&ListParams::default()).await.ok()?.items;
        (left.is_empty() && configs.get_opt("greeter").await.ok()?.is_none()).then_some(())
    })
    .await;
    let names: Vec<String> = revs
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|r| r.name_any())
        .collect();
    assert!(names.is_empty(), "{names:?}");

    drop(c);
    server.shutdown().await;
    stop.cancel();
    operator.await.unwrap();
}

/// One ADS stream of node `node` subscribed to the SDS secrets `names`.
struct SdsStream {
    tx: tokio::sync::mpsc::Sender<DiscoveryRequest>,
    responses: tonic::Streaming<envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse>,
    subscribe: DiscoveryRequest,
}

const SDS: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

impl SdsStream {
    async fn open(addr: SocketAddr, pki: &Pki, cert: &str, node: &str, names: &[&str]) -> Self {
        let mut c = ads_client(addr, pki, Some(cert)).await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel::<DiscoveryRequest>(4);
        let subscribe = DiscoveryRequest {
            node: Some(Node {
                id: node.into(),
                ..Default::default()
            }),
            type_url: SDS.into(),
            resource_names: names.iter().map(|n| (*n).to_owned()).collect(),
            ..Default::default()
        };
        tx.send(subscribe.clone()).await.unwrap();
        let responses = c
            .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        SdsStream {
            tx,
            responses,
            subscribe,
        }
    }

    /// The next response's secrets (name, certificate chain or trusted CA), ACKed.
    async fn next(&mut self) -> (String, Vec<(String, Vec<u8>)>) {
        use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
        use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tls;
        use prost::Message as _;
        let r = next(&mut self.responses).await;
        assert_eq!(r.type_url, SDS);
        let secrets = r
            .resources
            .iter()
            .map(|a| {
                let s = tls::Secret::decode(a.value.as_slice()).unwrap();
                let source = match s.r#type.unwrap() {
                    tls::secret::Type::TlsCertificate(c) => {
                        // The key goes along with the chain.
                        assert!(c.private_key.is_some(), "{}: no private key", s.name);
                        c.certificate_chain.unwrap()
                    }
                    tls::secret::Type::ValidationContext(v) => v.trusted_ca.unwrap(),
                    other => panic!("unexpected secret type {other:?}"),
                };
                let Some(Specifier::InlineBytes(b)) = source.specifier else {
                    panic!("{}: not inline bytes", s.name)
                };
                (s.name, b)
            })
            .collect();
        let ack = DiscoveryRequest {
            version_info: r.version_info.clone(),
            response_nonce: r.nonce,
            ..self.subscribe.clone()
        };
        self.tx.send(ack).await.unwrap();
        (r.version_info, secrets)
    }
}

async fn put_tls_secret(client: &Client, name: &str, labelled: bool, chain: &str) {
    let api: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), NS);
    let labels = if labelled {
        json!({"spur.dev/envoy-secret": "true"})
    } else {
        json!({})
    };
    let body = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "labels": labels},
        "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": chain, "tls.key": "-----BEGIN PRIVATE KEY-----\nnot a real key\n-----END PRIVATE KEY-----\n"},
    });
    api.patch(
        name,
        &PatchParams::apply("spur-tests").force(),
        &Patch::Apply(body),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_served_over_sds_to_their_namespace_and_sent_again_when_they_change() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, NS).await.unwrap();
    // The route server also gets the SDS Role in NS, as the chart binds it for
    // xds.sds.namespaces=[edge].
    let Stack {
        stop,
        _stop_all,
        operator,
        server,
        pki,
    } = Stack::start(&api, &[NS]).await;
    pki.xds_client("edge-client", NS);
    let xds_addr = server.xds_addr.unwrap();

    put_tls_secret(&admin, "edge-cert", true, "CHAIN-1").await;
    // Not labelled: an EnvoyConfig author who may not read Secrets cannot have it served.
    put_tls_secret(&admin, "ingress-cert", false, "INGRESS").await;
    let api_ec: Api<EnvoyConfig> = Api::namespaced(admin.clone(), NS);
    api_ec
        .patch(
            "gateway",
            &PatchParams::apply("spur-tests").force(),
            &Patch::Apply(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "EnvoyConfig",
                "metadata": {"name": "gateway"},
                "spec": {"nodeID": "gateway", "resources": [
                    {"type": "secret", "generateFromTlsSecret": "edge-cert"},
                    {"type": "secret", "generateFromTlsSecret": "edge-cert-ca", "blueprint": "validationContext"},
                    {"type": "secret", "generateFromTlsSecret": "ingress-cert"},
                ]},
            })),
        )
        .await
        .unwrap();
    eventually("the revision published", || async {
        let st = api_ec.get("gateway").await.ok()?.status?;
        (st.cache_state == Some(spur_api::envoyconfig::CacheState::InSync)).then_some(())
    })
    .await;

    let mut edge = SdsStream::open(
        xds_addr,
        &pki,
        "edge-client",
        "gateway",
        &["edge-cert", "edge-cert-ca", "ingress-cert"],
    )
    .await;
    // Until the route server sees the published revision, the node has the cluster's own
    // config, which has no secrets.
    let (mut v1, mut got) = edge.next().await;
    for _ in 0..3 {
        if !got.is_empty() {
            break;
        }
        (v1, got) = edge.next().await;
    }
    assert_eq!(got, [("edge-cert".to_owned(), b"CHAIN-1".to_vec())]);

    // What cannot be served says so in the EnvoyConfig's status.
    let st = eventually("the unresolved secrets in status", || async {
        let st = serde_json::to_value(api_ec.get("gateway").await.ok()?.status).ok()?;
        (condition(&st, "SecretsResolved")["status"] == "False").then_some(st)
    })
    .await;
    let message = condition(&st, "SecretsResolved")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("edge/ingress-cert: no Secret labelled spur.dev/envoy-secret=true")
            && message.contains("edge/edge-cert-ca"),
        "{message}"
    );

    // A client whose certificate is of another namespace gets nothing of this one's config,
    // secrets included, even with the right node id.
    let mut other = SdsStream::open(xds_addr, &pki, "client", "gateway", &["edge-cert"]).await;
    let (_, got) = other.next().await;
    assert!(got.is_empty(), "{got:?}");
    let refused = spur_e2e::sample(
        &spur_e2e::metrics(server.http_addr).await,
        "spur_routeserver_xds_envoyconfigs_withheld_total",
    );
    assert_eq!(refused, 1.0);

    // The Secret changes (a renewal): sent again on the open stream, a new version, no new
    // subscription.
    put_tls_secret(&admin, "edge-cert", true, "CHAIN-2").await;
    let (v2, got) = edge.next().await;
    assert_eq!(got, [("edge-cert".to_owned(), b"CHAIN-2".to_vec())]);
    assert_ne!(v1, v2);

    // The missing CA appears, and the once-unlabelled Secret is labelled: both are served.
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(admin.clone(), NS);
    secrets
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "edge-cert-ca", "labels": {"spur.dev/envoy-secret": "true"}},
                "type": "kubernetes.io/tls",
                "stringData": {"tls.crt": "LEAF", "tls.key": "KEY", "ca.crt": "THE-CA"},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    // The next response carries it (nothing else changes meanwhile); a few allow for a
    // watch event that moved nothing served.
    let mut got = Vec::new();
    for _ in 0..3 {
        got = edge.next().await.1;
        if got.iter().any(|(n, _)| n == "edge-cert-ca") {
            break;
        }
    }
    assert!(
        got.contains(&("edge-cert-ca".to_owned(), b"THE-CA".to_vec())),
        "{got:?}"
    );
    put_tls_secret(&admin, "ingress-cert", true, "INGRESS").await;
    let (_, got) = edge.next().await;
    assert_eq!(got.len(), 3, "{got:?}");
    eventually("every secret resolved", || async {
        let st = serde_json::to_value(api_ec.get("gateway").await.ok()?.status).ok()?;
        (condition(&st, "SecretsResolved")["status"] == "True").then_some(())
    })
    .await;

    drop(edge);
    drop(other);
    server.shutdown().await;
    stop.cancel();
    operator.await.unwrap();
}
