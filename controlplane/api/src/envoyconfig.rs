//! `EnvoyConfig` and `EnvoyConfigRevision`: Envoy v3 resources a user brings for one xDS node
//! id, served by the route server's ADS port to the clients that connect with that id (MARIN3R's
//! model, docs/xds.md "EnvoyConfig").
//!
//! ```text
//! EnvoyConfig (user) ──operator──► EnvoyConfigRevision per distinct spec (≤ 10, ordered)
//!                                    │ label spur.dev/envoy-published=true on exactly one
//!                                    ▼
//!                     route server ─► ADS for node id ─► ACK / NACK per stream
//!                                    │ status.reports[] (one entry per route-server replica)
//!                                    ▼
//!            operator: every subscribed node NACKs ─► tainted, previous revision published
//! ```
//!
//! The operator decodes every resource into its typed message (at admission, and again when it
//! cuts a revision) and stores the protobuf bytes in the revision, so the route server serves
//! exactly what was validated and never parses JSON itself.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Most revisions an EnvoyConfig keeps (MARIN3R's `maxRevisions`).
pub const MAX_REVISIONS: usize = 10;
/// Most resources in one EnvoyConfig.
pub const MAX_RESOURCES: usize = 1000;
/// Longest node id (the route server refuses longer ones on the wire too).
pub const NODE_ID_MAX: usize = 256;
/// Longest single resource, as text.
pub const RESOURCE_MAX: usize = 256 * 1024;

/// The label the operator puts on the one revision of a config that the route server serves.
pub const PUBLISHED_LABEL: &str = "spur.dev/envoy-published";
/// The label naming a revision's EnvoyConfig.
pub const CONFIG_LABEL: &str = "spur.dev/envoy-config";
/// The label (value `true`) a Secret needs before the route server serves it over SDS: being
/// able to write an EnvoyConfig must not be enough to read a Secret out through xDS.
pub const SECRET_LABEL: &str = "spur.dev/envoy-secret";

/// State of the art for this node id: `InSync` serves the newest revision, `Rollback` serves an
/// older one because every subscribed node rejected the newer, `RollbackFailed` found no good
/// revision left and keeps serving the failing one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum CacheState {
    InSync,
    Rollback,
    RollbackFailed,
}

/// Condition types on an EnvoyConfig.
pub mod conditions {
    /// True when the desired revision is published; false with reason `Rollback`,
    /// `RollbackFailed`, `Invalid` or `Conflict` otherwise.
    pub const IN_SYNC: &str = "InSync";
    /// True while some, not all, of the nodes subscribed to the published revision reject it:
    /// no rollback (as in MARIN3R), but it shows.
    pub const NODES_FAILING: &str = "NodesFailing";
    /// False (reason `SecretUnavailable`) while a route server with subscribed nodes cannot
    /// serve a Secret the published revision names.
    pub const SECRETS_RESOLVED: &str = "SecretsResolved";
    /// On a revision: every subscribed node rejected it.
    pub const TAINTED: &str = "RevisionTainted";
}

/// Envoy v3 resources for one xDS node id.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "EnvoyConfig",
    plural = "envoyconfigs",
    shortname = "ec",
    category = "spur",
    namespaced,
    status = "EnvoyConfigStatus",
    derive = "PartialEq",
    doc = "Envoy v3 resources (listeners, routes, clusters, endpoints) served by Spur's xDS port to the clients whose node id is spec.nodeID. Every change is kept as a revision (at most 10); when every subscribed client rejects a revision it is tainted and the previous good one is served again.",
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.nodeID"),
    printcolumn(name = "State", type_ = "string", json_path = ".status.cacheState"),
    printcolumn(
        name = "Published",
        type_ = "string",
        json_path = ".status.publishedVersion"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EnvoyConfigSpec {
    /// The xDS node id (`node.id` in the client's bootstrap) this configuration is for.
    #[serde(rename = "nodeID")]
    #[schemars(length(min = 1, max = NODE_ID_MAX), regex(pattern = r"^[\x21-\x7e]+$"))]
    pub node_id: String,
    /// How every `value` is written: `json` (default) or `yaml`.
    #[serde(default)]
    pub serialization: Serialization,
    /// The resources, each one Envoy v3 message in the proto3 JSON mapping (`typed_config`
    /// and other `Any` fields carry `@type`).
    #[schemars(length(min = 1, max = MAX_RESOURCES))]
    pub resources: Vec<EnvoyResource>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Serialization {
    #[default]
    Json,
    Yaml,
}

/// The xDS resource types an EnvoyConfig may carry.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum EnvoyResourceType {
    /// `envoy.config.listener.v3.Listener`
    Listener,
    /// `envoy.config.route.v3.RouteConfiguration`
    Route,
    /// `envoy.config.cluster.v3.Cluster`
    Cluster,
    /// `envoy.config.endpoint.v3.ClusterLoadAssignment`
    Endpoint,
    /// `envoy.extensions.transport_sockets.tls.v3.Secret`, served over SDS and generated from a
    /// `kubernetes.io/tls` Secret (`generateFromTlsSecret`), never written inline.
    Secret,
}

impl EnvoyResourceType {
    pub const ALL: [EnvoyResourceType; 5] = [
        EnvoyResourceType::Listener,
        EnvoyResourceType::Route,
        EnvoyResourceType::Cluster,
        EnvoyResourceType::Endpoint,
        EnvoyResourceType::Secret,
    ];

    /// The fully qualified protobuf message name.
    pub fn message_name(self) -> &'static str {
        match self {
            EnvoyResourceType::Listener => "envoy.config.listener.v3.Listener",
            EnvoyResourceType::Route => "envoy.config.route.v3.RouteConfiguration",
            EnvoyResourceType::Cluster => "envoy.config.cluster.v3.Cluster",
            EnvoyResourceType::Endpoint => "envoy.config.endpoint.v3.ClusterLoadAssignment",
            EnvoyResourceType::Secret => "envoy.extensions.transport_sockets.tls.v3.Secret",
        }
    }

    /// The `Any` type URL xDS carries it under.
    pub fn type_url(self) -> String {
        format!("type.googleapis.com/{}", self.message_name())
    }
}

/// What an SDS secret generated from a `kubernetes.io/tls` Secret carries (MARIN3R's
/// `blueprint`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum SecretBlueprint {
    /// `tls_certificate`: `tls.crt` as the chain, `tls.key` as the private key.
    #[default]
    TlsCertificate,
    /// `validation_context`: `ca.crt` (or `tls.crt` when the Secret has no `ca.crt`) as the
    /// trusted CA.
    ValidationContext,
}

/// One resource as the user wrote it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvoyResource {
    #[serde(rename = "type")]
    pub type_: EnvoyResourceType,
    /// The message, in `spec.serialization`. Every type but `secret` has one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = RESOURCE_MAX))]
    pub value: String,
    /// Only for `type: secret`: the `kubernetes.io/tls` Secret, in this namespace and labelled
    /// `spur.dev/envoy-secret=true`, the SDS secret is generated from. The SDS resource is named
    /// after it and re-sent whenever it changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub generate_from_tls_secret: Option<String>,
    /// Only for `type: secret`: what the SDS secret carries (default `tlsCertificate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blueprint: Option<SecretBlueprint>,
}

/// Observed state of an EnvoyConfig.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvoyConfigStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_state: Option<CacheState>,
    /// The version of the current spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_version: Option<String>,
    /// The version the route server serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published_version: Option<String>,
    /// Kept revisions, oldest first; the last untainted one is published.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub revisions: Vec<RevisionRef>,
    /// What the nodes subscribed to the published revision did with it, summed over route
    /// server replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeCounts>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RevisionRef {
    pub version: String,
    /// The EnvoyConfigRevision's name.
    #[serde(rename = "ref")]
    pub ref_: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tainted: bool,
}

/// Streams of one node id on the route server(s), by what they last did with the published
/// revision.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeCounts {
    pub subscribed: u32,
    /// Accepted every type of the revision they subscribed to.
    pub acked: u32,
    /// Rejected some type of the revision.
    pub nacked: u32,
    /// The first rejection's message, shortened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Secrets the revision names that a route server cannot serve, each with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unresolved_secrets: Vec<String>,
}

/// One revision of an EnvoyConfig: its resources, decoded and encoded once, as served.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "EnvoyConfigRevision",
    plural = "envoyconfigrevisions",
    shortname = "ecr",
    category = "spur",
    namespaced,
    status = "EnvoyConfigRevisionStatus",
    derive = "PartialEq",
    doc = "One revision of an EnvoyConfig, written by the operator: the resources encoded as protobuf, as the route server serves them. Not for users to edit.",
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.nodeID"),
    printcolumn(name = "Version", type_ = "string", json_path = ".spec.version"),
    printcolumn(name = "Published", type_ = "boolean", json_path = ".status.published"),
    printcolumn(name = "Tainted", type_ = "boolean", json_path = ".status.tainted"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EnvoyConfigRevisionSpec {
    #[serde(rename = "nodeID")]
    #[schemars(length(min = 1, max = NODE_ID_MAX))]
    pub node_id: String,
    /// Hash of the EnvoyConfig's resources.
    #[schemars(length(min = 1, max = 64))]
    pub version: String,
    #[schemars(length(max = MAX_RESOURCES))]
    pub resources: Vec<EncodedResource>,
}

/// A resource as served: its name and its message's protobuf bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EncodedResource {
    #[serde(rename = "type")]
    pub type_: EnvoyResourceType,
    /// The resource's `name` (`cluster_name` for endpoints).
    #[schemars(length(min = 1, max = NODE_ID_MAX))]
    pub name: String,
    /// The protobuf encoding of the message, base64; empty for a secret, which the route server
    /// generates from its Secret whenever that changes.
    #[serde(default)]
    pub value: String,
    /// For a secret: the Secret it is generated from (in the revision's namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generate_from_tls_secret: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blueprint: Option<SecretBlueprint>,
}

/// Observed state of a revision.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvoyConfigRevisionStatus {
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub published: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tainted: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_published_at: Option<Time>,
    /// One entry per route server replica with streams of this node id, each written by that
    /// replica under its own field manager and refreshed while it has streams.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["replica"]))]
    pub reports: Vec<ReplicaReport>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// What one route server replica's streams of the node id did with this revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaReport {
    /// The route server's pod name.
    pub replica: String,
    pub subscribed: u32,
    pub acked: u32,
    pub nacked: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Secrets of the revision this replica cannot serve (missing, not labelled
    /// `spur.dev/envoy-secret=true`, not `kubernetes.io/tls`, or in a namespace it does not
    /// watch), each with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unresolved_secrets: Vec<String>,
    /// When the replica last wrote this entry; the operator ignores entries older than three
    /// report intervals (a replica that died without clearing its entry).
    pub updated_at: Time,
}

impl EnvoyConfigRevisionStatus {
    /// Sum of the reports written at or after `fresh_since`.
    pub fn counts(&self, fresh_since: &k8s_openapi::jiff::Timestamp) -> NodeCounts {
        let mut c = NodeCounts::default();
        for r in self
            .reports
            .iter()
            .filter(|r| r.updated_at.0 >= *fresh_since)
        {
            c.subscribed += r.subscribed;
            c.acked += r.acked;
            c.nacked += r.nacked;
            if c.message.is_none() {
                c.message.clone_from(&r.message);
            }
            c.unresolved_secrets
                .extend(r.unresolved_secrets.iter().cloned());
        }
        c.unresolved_secrets.sort();
        c.unresolved_secrets.dedup();
        c
    }
}
