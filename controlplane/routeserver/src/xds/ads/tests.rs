use super::*;

fn status(sent: &str, acked: Option<&str>, nack: Option<&str>, rev: &str) -> TypeStatus {
    TypeStatus {
        sent: Some(sent.into()),
        acked: acked.map(Into::into),
        nacked: nack.map(|r| Nack {
            version: sent.into(),
            message: format!("no {r}"),
            revision: Some(r.into()),
        }),
        revision: Some(rev.into()),
    }
}

#[test]
fn revision_counts_attribute_rejections_to_the_revision_that_was_sent() {
    let nodes = Nodes::default();
    let add = |id: u64, node: &str, types: &[(Kind, TypeStatus)]| {
        nodes.lock().insert(
            id,
            NodeStatus {
                node_id: node.into(),
                cluster: String::new(),
                namespace: Some(if id == 6 { "other" } else { "ns" }.into()),
                types: types.iter().map(|(k, t)| (k.label(), t.clone())).collect(),
            },
        );
    };
    // Accepted everything of r2 (the cluster's bytes came from r1 and were not re-sent,
    // but count for r2).
    add(
        1,
        "n",
        &[
            (Kind::Listener, status("v2", Some("v2"), None, "ns/r2")),
            (Kind::Cluster, status("v1", Some("v1"), None, "ns/r2")),
        ],
    );
    // Rejected r2's listener.
    add(
        2,
        "n",
        &[(
            Kind::Listener,
            status("v2", Some("v1"), Some("ns/r2"), "ns/r2"),
        )],
    );
    // Sent r2, no answer yet.
    add(
        3,
        "n",
        &[(Kind::Listener, status("v2", Some("v1"), None, "ns/r2"))],
    );
    // Another node, and a stream that subscribed to nothing yet.
    add(
        4,
        "m",
        &[(Kind::Listener, status("v2", Some("v2"), None, "ns/r2"))],
    );
    add(5, "n", &[]);
    // Another namespace's client with the same node id: never served ns's revision, so
    // neither its subscription nor its rejection of whatever it got counts.
    add(
        6,
        "n",
        &[(
            Kind::Listener,
            status("v2", Some("v1"), Some("ns/r2"), "ns/r2"),
        )],
    );
    let c = nodes.revision_counts("ns", "n", "ns/r2");
    assert_eq!(
        c,
        RevisionCounts {
            subscribed: 3,
            acked: 1,
            nacked: 1,
            message: Some("no ns/r2".into()),
        }
    );
    // A rejection of r2 says nothing about r1, which nobody has been sent.
    let c = nodes.revision_counts("ns", "n", "ns/r1");
    assert_eq!((c.subscribed, c.acked, c.nacked), (3, 0, 0));
}

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

/// A cluster with one Service port (the cluster's own resources) and, for node id
/// `edge-1`, namespace `a`'s EnvoyConfig with its own cluster `team-a-backend`.
fn snapshot() -> Arc<Snapshot> {
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use prost::Message as _;
    let mut model = super::super::model::Model::default();
    model.clusters.insert("api.shop.svc:80".into(), Vec::new());
    model
        .services
        .insert("api.shop.svc:80".into(), Default::default());
    let mut types: [std::collections::BTreeMap<String, Arc<Any>>; KINDS] = Default::default();
    types[Kind::Cluster.index()].insert(
        "team-a-backend".into(),
        Arc::new(Any {
            type_url: CDS.into(),
            value: Cluster {
                name: "team-a-backend".into(),
                ..Default::default()
            }
            .encode_to_vec(),
        }),
    );
    let cfg = NodeConfig {
        revision: "a/edge-abc".into(),
        namespace: "a".into(),
        version: "abc".into(),
        secrets_version: "abc".into(),
        types,
        unresolved_secrets: Vec::new(),
    };
    model
        .node_configs
        .entry("edge-1".into())
        .or_default()
        .insert("a".into(), Arc::new(cfg));
    Arc::new(Snapshot::default().next(Arc::new(model)))
}

/// A stream whose client certificate names `namespace` (None: plaintext).
fn stream(
    namespace: Option<&str>,
) -> (
    AdsStream,
    mpsc::Receiver<Result<DiscoveryResponse, Status>>,
    prometheus_client::registry::Registry,
) {
    let mut registry = prometheus_client::registry::Registry::default();
    let (_, snapshots) = watch::channel(snapshot());
    let ads = Ads {
        snapshots,
        cluster_domain: "cluster.local".into(),
        metrics: XdsMetrics::register(&mut registry),
        nodes: Nodes::default(),
        stop: CancellationToken::new(),
        max_names: 100,
        max_streams: 100,
        open: Arc::default(),
        next_stream: Arc::new(AtomicU64::new(1)),
    };
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let stream = AdsStream {
        ads,
        id: 1,
        tx,
        nonce: 0,
        types: Default::default(),
        registered: false,
        node_id: String::new(),
        client_namespace: namespace.map(str::to_owned),
        noted_withheld: false,
    };
    (stream, rx, registry)
}

/// The cluster names node `edge-1` is sent when it subscribes to every cluster, and the
/// revision the node registry says they came from.
async fn clusters_of(namespace: Option<&str>) -> (Vec<String>, Option<String>, String) {
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use envoy_types::pb::envoy::config::core::v3::Node;
    use prost::Message as _;
    let (mut s, mut rx, registry) = stream(namespace);
    let subscribe = DiscoveryRequest {
        node: Some(Node {
            id: "edge-1".into(),
            ..Default::default()
        }),
        type_url: CDS.into(),
        ..Default::default()
    };
    assert!(s.on_request(subscribe).await.is_ok());
    let r = rx.recv().await.and_then(Result::ok).unwrap();
    let names = r
        .resources
        .iter()
        .map(|a| Cluster::decode(a.value.as_slice()).unwrap().name)
        .collect();
    let revision = s.ads.nodes.list()[0].types["cds"].revision.clone();
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    (names, revision, text)
}

#[tokio::test]
async fn a_namespaces_envoyconfig_goes_only_to_clients_of_that_namespace() {
    // Namespace a's own client gets a's resources, and only those.
    let (names, revision, _) = clusters_of(Some("a")).await;
    assert_eq!(names, ["team-a-backend"]);
    assert_eq!(revision.as_deref(), Some("a/edge-abc"));
    // Namespace b's client with the same node id gets none of them: the cluster's own.
    let (names, revision, metrics) = clusters_of(Some("b")).await;
    assert_eq!(names, ["api.shop.svc:80"]);
    assert_eq!(revision, None);
    assert!(
        metrics.contains("xds_envoyconfigs_withheld_total 1"),
        "{metrics}"
    );
    // Plaintext (no certificate, no namespace): no EnvoyConfig at all.
    let (names, revision, metrics) = clusters_of(None).await;
    assert_eq!(names, ["api.shop.svc:80"]);
    assert_eq!(revision, None);
    assert!(
        metrics.contains("xds_envoyconfigs_withheld_total 1"),
        "{metrics}"
    );
}
