//! `ListenerSet`: TCP and UDP listeners on the Spur gateway pods a selector picks, each piping
//! sessions to a cluster of endpoints (pods by label selector, addresses, DNS names) with
//! consistent hashing, health checks and an optional routing key read from a session's first
//! bytes (l7mp's listener/cluster model, built on `spur-l4`; docs/l4.md).
//!
//! ```text
//! ListenerSet (user) ──operator──► Service <name> over spec.selector (the listeners' ports)
//!        │                        headless Service per selector endpoint ─► EndpointSlices
//!        ▼
//! route server: ListenerSets + EndpointSlices ─► spur_l4::L4Config per gateway pod
//!        │ (Spur's own L4 service, same authenticated watch stream as routes)
//!        ▼
//! gateway pod: spur-l4 listeners; endpoint health ─► status.gateways[] (one entry per pod)
//! ```

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::names::derived_name;
use crate::validation::{
    Checker, ROUTING_KEY_MAX, is_dns_label, is_dns1035_label, is_host, is_label_key, is_label_value,
};

/// Most listeners in one ListenerSet.
pub const MAX_LISTENERS: usize = 64;
/// Most endpoint entries in one cluster.
pub const MAX_ENDPOINTS: usize = 256;
/// Most key routes of one listener.
pub const MAX_KEY_ROUTES: usize = 256;

/// The label on the objects the operator creates for a ListenerSet, naming it.
pub const LISTENER_SET_LABEL: &str = "spur.dev/listener-set";

/// Condition types on a ListenerSet.
pub mod conditions {
    /// True when the spec is valid and its Services exist; false with the reason otherwise.
    pub const READY: &str = "Ready";
    /// True while every listener's cluster has at least one ready endpoint.
    pub const ENDPOINTS_READY: &str = "EndpointsReady";
}

/// Listeners served by the pods `selector` picks.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "ListenerSet",
    plural = "listenersets",
    shortname = "lset",
    category = "spur",
    namespaced,
    status = "ListenerSetStatus",
    derive = "PartialEq",
    doc = "TCP and UDP listeners on the Spur gateway pods spec.selector picks, each sending sessions to a cluster of endpoints (pods by label selector, addresses or DNS names) with round-robin, ring-hash or Maglev balancing, a session hash key, health checks, and an optional sandbox routing key read from a session's first bytes.",
    printcolumn(
        name = "Listeners",
        type_ = "integer",
        json_path = ".status.listenerCount"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ListenerSetSpec {
    /// The pods of this namespace that serve the listeners (Spur gateway pods: `spur-gateway`).
    pub selector: LabelSelector,
    /// The Service the operator keeps over `selector` with every listener's port, so clients
    /// dial `<name>.<namespace>.svc:<port>`. Needs `selector.matchLabels` only (a Service
    /// selects by labels, not expressions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ListenerService>,
    #[schemars(length(min = 1, max = MAX_LISTENERS))]
    pub listeners: Vec<Listener>,
    /// Further clusters, for key routes to send sessions to (a sandbox's fork, say).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_LISTENERS))]
    pub clusters: Vec<Cluster>,
}

/// The client-facing Service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListenerService {
    /// `ClusterIP` (default), `NodePort` or `LoadBalancer`; `None` makes no Service.
    #[serde(default, rename = "type")]
    pub type_: ServiceType,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ServiceType {
    #[default]
    ClusterIP,
    NodePort,
    LoadBalancer,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
}

/// One port on the gateway pods.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Listener {
    /// Unique in the set; a DNS label (it names the Service port).
    pub name: String,
    pub protocol: Protocol,
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    pub cluster: Cluster,
    /// Sends a session whose first bytes carry a key to another cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_route: Option<KeyRoute>,
    /// How long a TCP session's first bytes are waited for when a key route or a `firstBytes`
    /// hash key needs them (a duration such as `500ms`; default 1s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_bytes_timeout: Option<String>,
}

/// Endpoints and how sessions are spread over them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Cluster {
    /// Unique in the set across listeners' and extra clusters (a cluster used twice is
    /// written once, in `spec.clusters`, and named by key routes).
    pub name: String,
    #[schemars(length(min = 1, max = MAX_ENDPOINTS))]
    pub endpoints: Vec<Endpoint>,
    #[serde(default)]
    pub lb: LbPolicy,
    /// What identifies a session for ringHash and maglev (default: the client's address and
    /// port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_key: Option<HashKey>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
    /// A UDP session with nothing moving either way for this long ends (default 60s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout: Option<String>,
    /// Most sessions at once on one gateway pod (default 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_sessions: Option<u32>,
    /// When the table is full: `evictOldest` (default) or `refuse`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overflow: Option<Overflow>,
    /// TCP connect timeout per attempt (default 2s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout: Option<String>,
}

/// Exactly one of `selector`, `address` and `dnsName`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    /// Pods of this namespace; each ready one is an endpoint, identified by its name (so a
    /// pod that moves to a new IP keeps its sessions' hash position).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    /// An IP address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// A DNS name, resolved by the gateway and re-resolved periodically; every address it
    /// has is an endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_name: Option<String>,
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// Where health checks go (default: `port`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub health_check_port: Option<u16>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum LbPolicy {
    #[default]
    RoundRobin,
    RingHash,
    Maglev,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Overflow {
    EvictOldest,
    Refuse,
}

/// Exactly one field.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HashKey {
    /// One key for every session (l7mp's constant hash key): all go to one endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constant: Option<String>,
    /// The client's IP address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_ip: Option<Empty>,
    /// The client's IP address and port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_ip_port: Option<Empty>,
    /// A byte range of the first datagram (or the first bytes of a TCP session): a call id, a
    /// session id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_bytes: Option<ByteRange>,
}

/// `{}`
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Empty {}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ByteRange {
    #[serde(default)]
    pub offset: u32,
    #[schemars(range(min = 1))]
    pub length: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheck {
    #[serde(default)]
    pub protocol: HealthProtocol,
    /// For `http`: the path of a GET that must answer 2xx (default `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Default 5s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<String>,
    /// Default 1s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    /// Passes in a row that bring an endpoint back (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub healthy_threshold: Option<u32>,
    /// Failures in a row that take it out (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub unhealthy_threshold: Option<u32>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum HealthProtocol {
    #[default]
    Tcp,
    Http,
}

/// Where in a session's first bytes a routing key is, and where each key sends the session.
/// A session whose bytes match no route (or are too few) goes to the listener's own cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeyRoute {
    #[serde(default)]
    pub offset: u32,
    /// The key's length: an exact byte range. Without it, keys are prefixes at `offset`,
    /// longest match first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub length: Option<u32>,
    #[schemars(length(min = 1, max = MAX_KEY_ROUTES))]
    pub routes: Vec<KeyRouteTarget>,
}

/// Exactly one of `key`, `keyHex` and `sandbox`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeyRouteTarget {
    /// The key as text (its UTF-8 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The key as hex bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_hex: Option<String>,
    /// A Sandbox (cluster-scoped) by name: its routing key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// A cluster of this set (`spec.clusters[].name`, or a listener's).
    pub cluster: String,
}

/// Observed state.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListenerSetStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listener_count: Option<u32>,
    /// Per listener, its cluster's endpoints as the cluster resolves them (written by the
    /// operator).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub listeners: Vec<ListenerStatus>,
    /// One entry per gateway pod serving the set, with what its health checks see (written by
    /// the route server from the gateways' reports).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["pod"]))]
    pub gateways: Vec<GatewayStatus>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListenerStatus {
    pub name: String,
    /// Endpoints the cluster resolves to now (pods, addresses; DNS names count once).
    pub endpoints: u32,
    /// Of those, the ready ones (pods by their readiness).
    pub ready: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayStatus {
    /// The gateway pod's name.
    pub pod: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<EndpointHealth>,
    /// Listeners of this set the pod does not serve: an older ListenerSet that also selects
    /// the pod has a listener with the same protocol and port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shadowed: Vec<String>,
    pub updated_at: Option<Time>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointHealth {
    pub cluster: String,
    /// The endpoint's identity (a pod name, an address).
    pub id: String,
    pub address: String,
    pub healthy: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ejected: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The client-facing Service of a ListenerSet: its own name, so clients dial
/// `<name>.<namespace>.svc` (validation requires a name a Service can have).
pub fn listener_service_name(listener_set: &str) -> String {
    listener_set.to_owned()
}

/// The headless Service whose EndpointSlices resolve `endpoints[index]` of cluster `cluster`
/// (a selector entry).
pub fn endpoint_service_name(listener_set: &str, cluster: &str, index: usize) -> String {
    derived_name(
        &[listener_set, cluster],
        &["listener-set-endpoints", &index.to_string()],
    )
}

mod validation;

pub use validation::*;

#[cfg(test)]
mod tests;
