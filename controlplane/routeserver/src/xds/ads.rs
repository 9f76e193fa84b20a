//! The Aggregated Discovery Service, state of the world: one task per stream that tracks, per
//! resource type, what the client subscribed to, what it was last sent, and whether it accepted
//! it — and re-sends a type only when that client's own view of it changed.
//!
//! The protocol's rules, as Envoy's and gRPC's clients expect them: a request whose
//! `response_nonce` is not the last one sent for its type is stale and ignored; a request with
//! `error_detail` NACKs the response with that nonce (the client keeps its previous config, and
//! the server does not send the same resources again); a change of subscription is answered
//! with the current state even if nothing changed.

use std::collections::{BTreeSet, HashMap};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::config::core::v3::ControlPlane;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryService;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use futures_util::Stream;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use super::metrics::XdsMetrics;
use super::model::{NodeConfig, canonical_listener};
use super::render::{KINDS, Kind, Snapshot, listener};

/// Responses queued per stream before its task waits for the client to read.
const STREAM_BUFFER: usize = 4;
/// The longest NACK message kept for logs and the node registry.
const MAX_ERROR_LEN: usize = 512;
/// The longest resource name, node id or cluster a client may send.
const MAX_NAME_LEN: usize = 256;

/// What one connected node last did with each resource type.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TypeStatus {
    /// The version last sent, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sent: Option<String>,
    /// The last version it accepted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acked: Option<String>,
    /// The version it rejected last, if its latest answer was a rejection, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nacked: Option<Nack>,
    /// The EnvoyConfigRevision (`namespace/name`) the type was last evaluated against, for a
    /// node served an EnvoyConfig.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Nack {
    pub version: String,
    pub message: String,
    /// The EnvoyConfigRevision the rejected response came from, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
}

/// One open stream, as reported by [`Nodes::list`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    pub node_id: String,
    pub cluster: String,
    /// The namespace the client's certificate names (`system:spur:xds:<namespace>`): the
    /// namespace whose EnvoyConfig for the node id it is served. None over plaintext.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Per type label (`lds`, `rds`, `cds`, `eds`), for the types the node subscribed to.
    pub types: std::collections::BTreeMap<&'static str, TypeStatus>,
}

/// Every open stream's status; a stream's entry goes when the stream does.
#[derive(Debug, Clone, Default)]
pub struct Nodes(Arc<Mutex<HashMap<u64, NodeStatus>>>);

impl Nodes {
    pub fn list(&self) -> Vec<NodeStatus> {
        let mut v: Vec<_> = self.lock().values().cloned().collect();
        v.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        v
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, NodeStatus>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the streams of `node_id` whose certificate is of `namespace` (those served its
    /// EnvoyConfig) did with `revision`: how many are open, how many accepted every type they
    /// were sent from it, how many rejected one, and the first rejection. Another namespace's
    /// streams of the same node id do not count: they could neither hold back nor cause a
    /// rollback.
    pub fn revision_counts(
        &self,
        namespace: &str,
        node_id: &str,
        revision: &str,
    ) -> RevisionCounts {
        let mut c = RevisionCounts::default();
        for n in self
            .lock()
            .values()
            .filter(|n| n.node_id == node_id && n.namespace.as_deref() == Some(namespace))
        {
            if n.types.is_empty() {
                continue;
            }
            c.subscribed += 1;
            let nack = n.types.values().find_map(|t| {
                t.nacked
                    .as_ref()
                    .filter(|k| k.revision.as_deref() == Some(revision))
            });
            if let Some(k) = nack {
                c.nacked += 1;
                if c.message.is_none() {
                    c.message = Some(k.message.clone());
                }
                continue;
            }
            let all_acked = n.types.values().all(|t| {
                t.sent.is_some() && t.acked == t.sent && t.revision.as_deref() == Some(revision)
            });
            if all_acked {
                c.acked += 1;
            }
        }
        c
    }

    fn update(&self, id: u64, kind: Kind, f: impl FnOnce(&mut TypeStatus)) {
        if let Some(n) = self.lock().get_mut(&id) {
            f(n.types.entry(kind.label()).or_default());
        }
    }
}

/// See [`Nodes::revision_counts`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RevisionCounts {
    pub subscribed: u32,
    pub acked: u32,
    pub nacked: u32,
    pub message: Option<String>,
}

/// The ADS service.
#[derive(Clone)]
pub(crate) struct Ads {
    pub(crate) snapshots: watch::Receiver<Arc<Snapshot>>,
    pub(crate) cluster_domain: Arc<str>,
    pub(crate) metrics: XdsMetrics,
    pub(crate) nodes: Nodes,
    pub(crate) stop: CancellationToken,
    /// Most resource names one stream may subscribe to per type.
    pub(crate) max_names: usize,
    /// Most open streams, and how many are open.
    pub(crate) max_streams: usize,
    pub(crate) open: Arc<std::sync::atomic::AtomicUsize>,
    pub(crate) next_stream: Arc<AtomicU64>,
}

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ResponseStream<DiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        // The namespace of the client's certificate (`system:spur:xds:<namespace>`): an
        // EnvoyConfig goes only to clients of its namespace.
        let client_namespace = request
            .extensions()
            .get::<spur_serving::tls::Peer>()
            .and_then(|p| p.client_cn.as_deref())
            .and_then(|cn| cn.strip_prefix(super::CLIENT_CN_PREFIX))
            .filter(|ns| !ns.is_empty())
            .map(str::to_owned);
        let requests = request.into_inner();
        // Counted here, released by the stream's task when it ends.
        if self.open.fetch_add(1, Ordering::AcqRel) >= self.max_streams {
            self.open.fetch_sub(1, Ordering::AcqRel);
            return Err(Status::resource_exhausted(format!(
                "{} ADS streams are open: the most this server takes",
                self.max_streams
            )));
        }
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let stream = AdsStream {
            ads: self.clone(),
            id,
            tx,
            nonce: 0,
            types: Default::default(),
            registered: false,
            node_id: String::new(),
            client_namespace,
            noted_withheld: false,
        };
        tokio::spawn(stream.run(requests));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    type DeltaAggregatedResourcesStream = ResponseStream<DeltaDiscoveryResponse>;

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented(
            "Spur's xDS server speaks state-of-the-world ADS only; configure the client without delta xDS",
        ))
    }
}

/// One resource type on one stream.
#[derive(Default)]
struct TypeState {
    subscribed: bool,
    wildcard: bool,
    names: BTreeSet<String>,
    /// The nonce of the last response sent for this type.
    nonce: String,
    /// What that response carried (None before the first), and its version.
    sent: Option<Vec<Arc<Any>>>,
    version: String,
    /// The snapshot version of the type last compared with what was sent: a snapshot that
    /// moved other types only is not looked at again.
    evaluated: u64,
    /// Whether the client's latest answer for this type was a NACK.
    nacking: bool,
    /// The EnvoyConfigRevision what was sent stands for (None: the cluster's own config).
    source: Option<Arc<str>>,
}

struct AdsStream {
    ads: Ads,
    id: u64,
    tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    nonce: u64,
    types: [TypeState; KINDS],
    registered: bool,
    /// From the stream's first request.
    node_id: String,
    /// From the client's certificate; None over plaintext (or a certificate not issued for
    /// xDS, where the server accepts any of its CA).
    client_namespace: Option<String>,
    /// Whether this stream was told (logged and counted) that its node id's EnvoyConfigs are
    /// of other namespaces.
    noted_withheld: bool,
}

/// Why a stream ends early.
enum End {
    /// The client went, the server stops, or the response channel closed.
    Quiet,
    Error(Status),
}

impl AdsStream {
    async fn run(mut self, mut requests: Streaming<DiscoveryRequest>) {
        let metrics = self.ads.metrics.clone();
        metrics.streams.inc();
        let stop = self.ads.stop.clone();
        let mut snapshots = self.ads.snapshots.clone();
        // Nothing is answered before the first complete view of the cluster.
        let ready = tokio::select! {
            () = stop.cancelled() => false,
            r = snapshots.wait_for(|s| s.ready) => r.is_ok(),
        };
        let end = if !ready {
            End::Quiet
        } else {
            loop {
                tokio::select! {
                    () = stop.cancelled() => break End::Quiet,
                    msg = requests.message() => match msg {
                        Ok(Some(req)) => {
                            if let Err(e) = self.on_request(req).await {
                                break e;
                            }
                        }
                        Ok(None) => break End::Quiet,
                        Err(status) => {
                            tracing::debug!(stream = self.id, %status, "xDS stream broke");
                            break End::Quiet;
                        }
                    },
                    changed = snapshots.changed() => {
                        if changed.is_err() {
                            break End::Quiet;
                        }
                        let snap = snapshots.borrow_and_update().clone();
                        if let Err(e) = self.on_snapshot(&snap).await {
                            break e;
                        }
                    }
                }
            }
        };
        if let End::Error(status) = end {
            // Best effort: the client may already be gone.
            let _ = self.tx.try_send(Err(status));
        }
        for (kind, t) in Kind::ALL.iter().zip(&self.types) {
            if t.nacking {
                metrics.nacking(*kind).dec();
            }
        }
        if self.registered {
            self.ads.nodes.lock().remove(&self.id);
        }
        self.ads.open.fetch_sub(1, Ordering::AcqRel);
        metrics.streams.dec();
    }

    async fn on_request(&mut self, req: DiscoveryRequest) -> Result<(), End> {
        if !self.registered {
            let node = req.node.clone().unwrap_or_default();
            if node.id.len() > MAX_NAME_LEN || node.cluster.len() > MAX_NAME_LEN {
                return Err(End::Error(Status::invalid_argument(format!(
                    "node.id and node.cluster may have at most {MAX_NAME_LEN} bytes"
                ))));
            }
            if node.id.is_empty() {
                return Err(End::Error(Status::invalid_argument(
                    "the first DiscoveryRequest of a stream must carry node.id",
                )));
            }
            tracing::debug!(stream = self.id, node = %node.id, "xDS stream opened");
            self.node_id.clone_from(&node.id);
            self.ads.nodes.lock().insert(
                self.id,
                NodeStatus {
                    node_id: node.id,
                    cluster: node.cluster,
                    namespace: self.client_namespace.clone(),
                    types: Default::default(),
                },
            );
            self.registered = true;
        }
        let Some(kind) = Kind::from_type_url(&req.type_url) else {
            // RTDS, ECDS and the like: nothing of them is served, and answering nothing is how
            // a server says so.
            self.ads.metrics.unknown_types.inc();
            return Ok(());
        };
        let metrics = self.ads.metrics.clone();
        if req.resource_names.len() > self.ads.max_names {
            return Err(End::Error(Status::resource_exhausted(format!(
                "{} resource names of type {}: at most {} per stream",
                req.resource_names.len(),
                req.type_url,
                self.ads.max_names
            ))));
        }
        let st = &mut self.types[kind.index()];
        if !req.response_nonce.is_empty() {
            if req.response_nonce != st.nonce {
                metrics.requests(kind, "stale").inc();
                return Ok(());
            }
            match &req.error_detail {
                Some(err) => {
                    metrics.requests(kind, "nack").inc();
                    if !st.nacking {
                        st.nacking = true;
                        metrics.nacking(kind).inc();
                    }
                    let message = truncate(&err.message);
                    tracing::warn!(
                        node = %self.node_id,
                        r#type = kind.label(),
                        rejected = %st.version,
                        kept = %req.version_info,
                        error = %message,
                        "xDS client rejected a response; it keeps its previous config"
                    );
                    let version = st.version.clone();
                    let revision = st.source.as_deref().map(str::to_owned);
                    self.ads.nodes.update(self.id, kind, |s| {
                        s.nacked = Some(Nack {
                            version,
                            message,
                            revision,
                        });
                    });
                }
                None => {
                    metrics.requests(kind, "ack").inc();
                    if st.nacking {
                        st.nacking = false;
                        metrics.nacking(kind).dec();
                    }
                    let version = req.version_info.clone();
                    self.ads.nodes.update(self.id, kind, |s| {
                        s.acked = Some(version);
                        s.nacked = None;
                    });
                }
            }
        } else {
            metrics.requests(kind, "subscribe").inc();
        }
        if let Some(n) = req.resource_names.iter().find(|n| n.len() > MAX_NAME_LEN) {
            return Err(End::Error(Status::invalid_argument(format!(
                "resource name of {} bytes: at most {MAX_NAME_LEN}",
                n.len()
            ))));
        }
        let st = &mut self.types[kind.index()];
        let names: BTreeSet<String> = req.resource_names.into_iter().collect();
        let wildcard = names.contains("*")
            || (kind.full_state() && names.is_empty() && (!st.subscribed || st.wildcard));
        let changed = !st.subscribed || st.wildcard != wildcard || st.names != names;
        st.subscribed = true;
        st.wildcard = wildcard;
        st.names = names;
        if changed {
            let snap = self.ads.snapshots.borrow().clone();
            self.send(kind, &snap, true).await?;
        }
        Ok(())
    }

    async fn on_snapshot(&mut self, snap: &Arc<Snapshot>) -> Result<(), End> {
        for kind in Kind::ALL {
            if self.types[kind.index()].subscribed {
                self.send(kind, snap, false).await?;
            }
        }
        Ok(())
    }

    /// Sends `kind`'s current state to the client, unless (`force` aside) it is what the client
    /// was last sent.
    async fn send(&mut self, kind: Kind, snap: &Snapshot, force: bool) -> Result<(), End> {
        let node_config = self.node_config(snap);
        // A node with an EnvoyConfig is evaluated against the configs' version (its high bit
        // set so the two never compare equal), any other against its type's.
        let snap_version = match &node_config {
            Some(_) => snap.nodes_version | 1 << 63,
            None => snap.resources(kind).version,
        };
        if !force && self.types[kind.index()].evaluated == snap_version {
            return Ok(());
        }
        self.types[kind.index()].evaluated = snap_version;
        let st = &self.types[kind.index()];
        let resources = match &node_config {
            Some(cfg) => self.own_resources(kind, st, cfg),
            None => self.resources(kind, st, snap),
        };
        let source: Option<Arc<str>> = node_config.as_ref().map(|c| c.revision.clone());
        if !force && st.sent.as_ref() == Some(&resources) {
            // Same bytes from another revision: what the client accepted (or rejected) of
            // them stands for this one too.
            if st.source != source {
                let revision = source.as_deref().map(str::to_owned);
                self.types[kind.index()].source = source;
                self.ads
                    .nodes
                    .update(self.id, kind, |s| s.revision = revision);
            }
            return Ok(());
        }
        self.nonce += 1;
        let nonce = self.nonce.to_string();
        let version = match &node_config {
            Some(cfg) if kind == Kind::Secret => cfg.secrets_version.clone(),
            Some(cfg) => cfg.version.clone(),
            None => snap.resources(kind).version.to_string(),
        };
        let response = DiscoveryResponse {
            version_info: version.clone(),
            resources: resources.iter().map(|a| (**a).clone()).collect(),
            type_url: kind.type_url().into(),
            nonce: nonce.clone(),
            control_plane: Some(ControlPlane {
                identifier: concat!("spur-routeserver/", env!("CARGO_PKG_VERSION")).into(),
            }),
            ..Default::default()
        };
        let st = &mut self.types[kind.index()];
        st.nonce = nonce;
        st.sent = Some(resources);
        st.version.clone_from(&version);
        st.source.clone_from(&source);
        let revision = source.as_deref().map(str::to_owned);
        self.ads.nodes.update(self.id, kind, |s| {
            s.sent = Some(version);
            s.revision = revision;
        });
        self.ads.metrics.responses(kind).inc();
        if !force {
            // A change of the cluster's state, not an answer to a subscription.
            self.ads
                .metrics
                .push_latency
                .observe(snap.published.elapsed().as_secs_f64());
        }
        // A client that stops reading holds only its own task, and not past shutdown.
        tokio::select! {
            r = self.tx.send(Ok(response)) => r.map_err(|_| End::Quiet),
            () = self.ads.stop.cancelled() => Err(End::Quiet),
        }
    }

    /// The EnvoyConfig this stream is served: its node id's in the namespace its client
    /// certificate names. A node id is only a name the client chose, so one of another
    /// namespace is never served (nor, without a certificate namespace, any at all): the
    /// stream gets the cluster's own resources, and is told why once (log and metric).
    fn node_config(&mut self, snap: &Snapshot) -> Option<Arc<NodeConfig>> {
        let by_namespace = snap.model.node_configs.get(&self.node_id)?;
        if let Some(cfg) = self
            .client_namespace
            .as_deref()
            .and_then(|ns| by_namespace.get(ns))
        {
            return Some(cfg.clone());
        }
        if !self.noted_withheld {
            self.noted_withheld = true;
            self.ads.metrics.configs_withheld.inc();
            let namespaces: Vec<&str> = by_namespace.keys().map(String::as_str).collect();
            match &self.client_namespace {
                Some(ns) => tracing::warn!(
                    node = %self.node_id,
                    client_namespace = %ns,
                    config_namespaces = ?namespaces,
                    "xDS client's node id has EnvoyConfigs only in other namespaces than its certificate's; serving it the cluster's resources"
                ),
                None => tracing::warn!(
                    node = %self.node_id,
                    config_namespaces = ?namespaces,
                    "xDS client has no certificate namespace (plaintext, or a certificate not issued for xDS): no EnvoyConfig is served to it, only the cluster's resources"
                ),
            }
        }
        None
    }

    /// The subscribed part of a node's own (EnvoyConfig) resources: names as written, no
    /// respelling of listener names.
    fn own_resources(&self, kind: Kind, st: &TypeState, cfg: &NodeConfig) -> Vec<Arc<Any>> {
        let all = &cfg.types[kind.index()];
        if st.wildcard {
            return all.values().cloned().collect();
        }
        st.names
            .iter()
            .filter_map(|n| all.get(n).cloned())
            .collect()
    }

    fn resources(&self, kind: Kind, st: &TypeState, snap: &Snapshot) -> Vec<Arc<Any>> {
        let all = &snap.resources(kind).by_name;
        match kind {
            Kind::Listener if st.wildcard => all.values().cloned().collect(),
            Kind::Listener => st
                .names
                .iter()
                .filter_map(|requested| {
                    let canonical =
                        canonical_listener(&snap.model, requested, &self.ads.cluster_domain)?;
                    Some(if *requested == canonical {
                        all.get(&canonical)?.clone()
                    } else {
                        listener(requested, &canonical)
                    })
                })
                .collect(),
            _ if st.wildcard => all.values().cloned().collect(),
            _ => st
                .names
                .iter()
                .filter_map(|n| all.get(n).cloned())
                .collect(),
        }
    }
}

fn truncate(s: &str) -> String {
    if s.len() <= MAX_ERROR_LEN {
        return s.to_owned();
    }
    let mut end = MAX_ERROR_LEN;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests;
