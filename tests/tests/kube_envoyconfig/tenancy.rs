//! Node ids are not a tenancy boundary, namespaces are: an EnvoyConfig of namespace B with team
//! A's node id does not replace A's config, and B's client certificate gets nothing of A's.
//! Within one namespace the older of two configs for one node id keeps it (the operator reports
//! the other and does not publish it). A revision published with a data source that reads the
//! Envoy's own pod (here written by hand, as one published before admission refused them) is
//! not served with it.

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use prost::Message as _;

use super::*;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const TEAM_B: &str = "team-b";

/// The cluster names a new ADS stream of `node`, with the client certificate `cert`, is sent
/// first (every cluster: a wildcard subscription).
async fn clusters(addr: SocketAddr, pki: &Pki, cert: &str, node: &str) -> Vec<String> {
    let mut c = ads_client(addr, pki, Some(cert)).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel::<DiscoveryRequest>(1);
    tx.send(DiscoveryRequest {
        node: Some(Node {
            id: node.into(),
            ..Default::default()
        }),
        type_url: CDS.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut responses = c
        .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let r = next(&mut responses).await;
    let mut names: Vec<String> = r
        .resources
        .iter()
        .map(|a| Cluster::decode(a.value.as_slice()).unwrap().name)
        .collect();
    names.sort();
    names
}

/// Waits until a new stream of `node` with `cert` is sent exactly the clusters `want`.
async fn until_served(addr: SocketAddr, pki: &Pki, cert: &str, node: &str, want: &[&str]) {
    eventually(&format!("{cert}/{node} served {want:?}"), || async {
        (clusters(addr, pki, cert, node).await == want).then_some(())
    })
    .await;
}

/// EnvoyConfig `namespace/name` for `node`, with one EDS cluster named `cluster`.
async fn put_config(client: &Client, namespace: &str, name: &str, node: &str, cluster: &str) {
    let api: Api<EnvoyConfig> = Api::namespaced(client.clone(), namespace);
    let value = json!({"name": cluster, "type": "EDS",
        "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}}});
    let body = json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "EnvoyConfig",
        "metadata": {"name": name},
        "spec": {"nodeID": node, "resources": [{"type": "cluster", "value": value.to_string()}]},
    });
    api.patch(
        name,
        &PatchParams::apply("spur-tests").force(),
        &Patch::Apply(body),
    )
    .await
    .unwrap();
}

/// The `InSync` condition of EnvoyConfig `namespace/name` once it has `reason`.
async fn until_in_sync_reason(client: &Client, namespace: &str, name: &str, reason: &str) -> Value {
    let api: Api<EnvoyConfig> = Api::namespaced(client.clone(), namespace);
    eventually(
        &format!("{namespace}/{name} InSync reason {reason}"),
        || async {
            let st = serde_json::to_value(api.get(name).await.ok()?.status).ok()?;
            let c = condition(&st, "InSync").clone();
            (c["reason"] == reason).then_some(c)
        },
    )
    .await
}

/// A cluster whose TLS key is read from the client's own service account token.
fn leaky_cluster() -> Vec<u8> {
    use envoy_types::pb::envoy::config::core::v3::{
        DataSource, TransportSocket, data_source, transport_socket,
    };
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tls;
    use envoy_types::pb::google::protobuf::Any;
    use prost::Name as _;
    let ctx = tls::UpstreamTlsContext {
        common_tls_context: Some(tls::CommonTlsContext {
            tls_certificates: vec![tls::TlsCertificate {
                private_key: Some(DataSource {
                    specifier: Some(data_source::Specifier::Filename(
                        "/var/run/secrets/kubernetes.io/serviceaccount/token".into(),
                    )),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    Cluster {
        name: "leaky".into(),
        transport_socket: Some(TransportSocket {
            name: "tls".into(),
            config_type: Some(transport_socket::ConfigType::TypedConfig(Any {
                type_url: tls::UpstreamTlsContext::type_url(),
                value: ctx.encode_to_vec(),
            })),
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_share_a_node_id_without_meeting() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, NS).await.unwrap();
    kt::ensure_namespace(&admin, TEAM_B).await.unwrap();
    let Stack {
        stop,
        _stop_all,
        operator,
        server,
        pki,
    } = Stack::start(&api, &[]).await;
    let xds_addr = server.xds_addr.unwrap();
    pki.xds_client("a-client", NS);
    pki.xds_client("b-client", TEAM_B);

    // Team a's Envoy, node id edge-1.
    put_config(&admin, NS, "greeter", NODE, "a-backend").await;
    until_served(xds_addr, &pki, "a-client", NODE, &["a-backend"]).await;

    // Team b publishes a config for the same node id, later: b's own client gets it...
    put_config(&admin, TEAM_B, "intruder", NODE, "b-backend").await;
    until_served(xds_addr, &pki, "b-client", NODE, &["b-backend"]).await;
    // ...and team a's Envoy still gets a's, and nothing of b's.
    assert_eq!(
        clusters(xds_addr, &pki, "a-client", NODE).await,
        ["a-backend"]
    );
    // A certificate of a third namespace gets neither: the cluster's own resources.
    let third = clusters(xds_addr, &pki, "client", NODE).await;
    assert!(
        !third.iter().any(|c| c == "a-backend" || c == "b-backend"),
        "{third:?}"
    );
    // b's streams do not count as subscribers of a's revision (they could hold back its
    // rollback): a's status shows a's client alone once a stream of each is open.
    let _a_stream = SdsStream::open(xds_addr, &pki, "a-client", NODE, &[]).await;
    let _b_stream = SdsStream::open(xds_addr, &pki, "b-client", NODE, &[]).await;
    let configs: Api<EnvoyConfig> = Api::namespaced(admin.clone(), NS);
    let subscribed = |api: Api<EnvoyConfig>, name: &'static str| async move {
        let st = serde_json::to_value(api.get(name).await.ok()?.status).ok()?;
        st["nodes"]["subscribed"].as_u64()
    };
    let b_configs: Api<EnvoyConfig> = Api::namespaced(admin.clone(), TEAM_B);
    eventually("each revision's subscriber reported", || async {
        let a = subscribed(configs.clone(), "greeter").await;
        let b = subscribed(b_configs.clone(), "intruder").await;
        (a == Some(1) && b == Some(1)).then_some(())
    })
    .await;
    // Reports go out within half a second of a change, refreshed every second here.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(subscribed(configs.clone(), "greeter").await, Some(1));

    // A second config of namespace a for the same node id (written with no webhook to refuse
    // it, as before admission checked): reported, not published; a's Envoy keeps the first.
    put_config(&admin, NS, "second", NODE, "a-second").await;
    let c = until_in_sync_reason(&admin, NS, "second", "NodeIDConflict").await;
    assert_eq!(c["status"], "False");
    let message = c["message"].as_str().unwrap();
    assert!(
        message.contains("already used by EnvoyConfig edge/greeter"),
        "{message}"
    );
    assert_eq!(
        clusters(xds_addr, &pki, "a-client", NODE).await,
        ["a-backend"]
    );
    // The first goes: the second takes the node id over.
    configs
        .delete("greeter", &DeleteParams::default())
        .await
        .unwrap();
    until_in_sync_reason(&admin, NS, "second", "Published").await;
    until_served(xds_addr, &pki, "a-client", NODE, &["a-second"]).await;

    // A revision published with a cluster whose key is read from the Envoy's own pod (by
    // hand: admission and the operator refuse one today): served without that cluster.
    use base64::Engine as _;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let ok = Cluster {
        name: "ok".into(),
        ..Default::default()
    }
    .encode_to_vec();
    let revisions: Api<EnvoyConfigRevision> = Api::namespaced(admin.clone(), TEAM_B);
    revisions
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "EnvoyConfigRevision",
                "metadata": {"name": "handmade", "labels": {"spur.dev/envoy-published": "true"}},
                "spec": {"nodeID": "edge-9", "version": "handmade", "resources": [
                    {"type": "cluster", "name": "leaky", "value": b64(&leaky_cluster())},
                    {"type": "cluster", "name": "ok", "value": b64(&ok)},
                ]},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    until_served(xds_addr, &pki, "b-client", "edge-9", &["ok"]).await;

    server.shutdown().await;
    stop.cancel();
    operator.await.unwrap();
}
