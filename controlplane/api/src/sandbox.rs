//! `Sandbox`: what a developer asks for. The controllers compile it into ForkedWorkloads,
//! ExternalWorkloads, VirtualWorkloads and one RoutingConfig for its routing key.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::{ServiceMapping, WorkloadRef};
use crate::validation::*;

/// Most forks, local and virtual workloads (each) in one sandbox. The bounds keep the CEL
/// uniqueness rules, which are quadratic, inside the apiserver's cost budget.
pub const MAX_WORKLOADS: usize = 32;
/// Most image customizations per fork.
pub const MAX_IMAGES: usize = 16;
/// Most env customizations per fork. This bound keeps the CEL rule "one entry per (name,
/// container)" (quadratic, and nested in `forks`) inside the apiserver's per-rule cost budget;
/// kube-apiserver 1.33 rejects the CRD with 64.
pub const MAX_ENV: usize = 32;
pub const MAX_RESOURCES: usize = 16;
pub const MAX_ENDPOINTS: usize = 32;
pub const MAX_LABELS: usize = 64;
pub const MAX_PARAMS: usize = 64;
/// Largest patch value, serialized as JSON. Checked in Rust only: CEL cannot size an untyped
/// value.
pub const MAX_PATCH_BYTES: usize = 64 * 1024;

/// Desired state of a sandbox.
// Cluster-scoped: a sandbox forks baselines in any namespace, and the per-baseline objects it
// creates there can only be owned (garbage-collected with it) by a cluster-scoped owner.
// `printcolumn(...)` repeats its keys by design; clippy takes that for a copy-paste slip.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "Sandbox",
    plural = "sandboxes",
    shortname = "sbx",
    category = "spur",
    status = "SandboxStatus",
    derive = "PartialEq",
    doc = "A request-level sandbox: forks of baseline workloads (with customizations), workloads that run on a workstation, and virtual workloads, all reachable through one routing key. Requests that carry the key reach the sandbox's workloads; all other traffic keeps flowing to the baselines.",
    validation = Rule::new("size(self.metadata.name) <= 63 && !self.metadata.name.contains('.')").message("a sandbox name must be a DNS-1123 label (at most 63 characters, no dots): it is used in label values and host names"),
    printcolumn(name = "Key", type_ = "string", json_path = ".status.routingKey", description = "Routing key"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Expires", type_ = "date", json_path = ".status.expiresAt", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "(has(self.forks) && size(self.forks) > 0) || (has(self.local) && size(self.local) > 0) || (has(self.virtual) && size(self.virtual) > 0)",
        "message": "a sandbox needs at least one fork, local or virtual workload"
    },
    {
        "rule": "!has(self.forks) || self.forks.all(f, self.forks.exists_one(g, g.forkOf == f.forkOf))",
        "message": "each baseline may be forked only once (forks[].forkOf must be unique)"
    },
    {
        "rule": "!has(self.local) || self.local.all(l, self.local.exists_one(m, m.from == l.from))",
        "message": "each baseline may be replaced by only one local workload (local[].from must be unique)"
    },
    {
        "rule": "!has(self.virtual) || self.virtual.all(v, self.virtual.exists_one(w, w.workload == v.workload))",
        "message": "each baseline may have only one virtual workload (virtual[].workload must be unique)"
    },
    {
        "rule": crate::schema::disjoint_baselines_rule(),
        "message": "a baseline may appear only once across forks, local and virtual"
    },
    {
        "rule": "!has(self.local) || size(self.local) == 0 || has(self.workstation)",
        "message": "local workloads need spec.workstation"
    },
    {
        "rule": "has(self.resources) == has(oldSelf.resources) && (!has(self.resources) || self.resources == oldSelf.resources)",
        "message": "resources are immutable"
    }
]))]
pub struct SandboxSpec {
    /// What the sandbox is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = DESCRIPTION_MAX))]
    pub description: Option<String>,

    /// Free-form labels; route groups select sandboxes by them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend(
        "maxProperties" = MAX_LABELS,
        "additionalProperties" = {"type": "string", "maxLength": FREE_LABEL_VALUE_MAX},
        "x-kubernetes-validations" = [{
            "rule": crate::schema::label_keys_rule(),
            "message": "label keys must be Kubernetes label keys ([prefix/]name, name at most 63 characters)"
        }]
    ))]
    pub labels: BTreeMap<String, String>,

    /// Baseline workloads to fork: each fork runs a customized copy of its baseline that
    /// receives the requests carrying this sandbox's routing key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_WORKLOADS))]
    pub forks: Vec<Fork>,

    /// Baseline workloads replaced by a process on a workstation: requests carrying the routing
    /// key are tunnelled to it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_WORKLOADS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub local: Vec<Local>,

    /// Baselines that get key-scoped traffic handling without a new workload; what the handling
    /// does not answer goes to the baseline.
    #[serde(rename = "virtual", default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_WORKLOADS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub virtual_workloads: Vec<Virtual>,

    /// Resources (databases, queues, …) created for the sandbox by resource plugins. Immutable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_RESOURCES),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub resources: Vec<SandboxResource>,

    /// Endpoints of the sandbox's default route group (preview URLs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_route_group: Option<DefaultRouteGroup>,

    /// When the sandbox is deleted. Without it the sandbox lives until deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<Ttl>,

    /// The workstation (its `spur local connect` session id) that serves the local workloads.
    /// Required when `local` is not empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub workstation: Option<String>,

    /// Traffic capture of the requests carrying this sandbox's routing key, at the sidecars of
    /// the baselines it forks, replaces or virtualizes (docs/traffic.md). Off unless enabled;
    /// enabling it needs `update` on `sandboxes/capture` (checked at admission).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<SandboxCapture>,
}

/// Traffic capture settings of one sandbox.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxCapture {
    /// Capture on or off; `spur traffic capture on|off` flips it.
    #[serde(default)]
    pub enabled: bool,
    /// Headers whose values are redacted before an exchange leaves the sidecar, in addition to
    /// `authorization`, `proxy-authorization`, `cookie`, `set-cookie` and the cluster's list.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_REDACT_HEADERS),
        inner(length(min = 1, max = HEADER_NAME_MAX), regex(pattern = HEADER_NAME_PATTERN))
    )]
    pub redact_headers: Vec<String>,
}

/// Most extra redacted headers per sandbox.
pub const MAX_REDACT_HEADERS: usize = 32;
const HEADER_NAME_MAX: usize = 64;
/// Lowercase HTTP header names (tokens, RFC 9110).
const HEADER_NAME_PATTERN: &str = "^[a-z0-9!#$%&'*+.^_`|~-]+$";

/// What [`HEADER_NAME_PATTERN`] and [`HEADER_NAME_MAX`] accept.
pub fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= HEADER_NAME_MAX
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+.^_`|~-".contains(&b)
        })
}

/// A fork of one baseline workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Fork {
    /// The baseline workload to copy.
    pub fork_of: WorkloadRef,
    /// Changes applied to the copy.
    #[serde(default, skip_serializing_if = "Customizations::is_empty")]
    pub customizations: Customizations,
}

/// Changes applied to a fork: images first, then env, then the patch.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.images) || self.images.all(i, self.images.exists_one(j, has(i.container) == has(j.container) && (!has(i.container) || i.container == j.container)))",
        "message": "at most one image per container (and at most one without container)"
    },
    {
        "rule": "!has(self.env) || self.env.all(e, self.env.exists_one(f, f.name == e.name && has(f.container) == has(e.container) && (!has(e.container) || f.container == e.container)))",
        "message": "at most one env entry per (name, container)"
    }
]))]
pub struct Customizations {
    /// Container images to replace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IMAGES))]
    pub images: Vec<ImageOverride>,
    /// Environment variables to set or remove.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_ENV))]
    pub env: Vec<EnvOverride>,
    /// A patch applied to the forked workload object last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<Patch>,
}

impl Customizations {
    pub fn is_empty(&self) -> bool {
        self.images.is_empty() && self.env.is_empty() && self.patch.is_none()
    }
}

/// Replaces the image of one container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageOverride {
    /// Image reference, e.g. `ghcr.io/acme/route:pr-42`.
    #[schemars(length(min = 1, max = IMAGE_MAX), regex(pattern = IMAGE_PATTERN))]
    pub image: String,
    /// Container to change; the pod template's first container when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub container: Option<String>,
}

/// Sets (`upsert`) or removes (`delete`) one environment variable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!(has(self.operation) && self.operation == 'delete') || (!has(self.value) && !has(self.valueFrom))",
        "message": "operation delete takes neither value nor valueFrom"
    },
    {
        "rule": "(has(self.operation) && self.operation == 'delete') || (has(self.value) != has(self.valueFrom))",
        "message": "operation upsert needs exactly one of value and valueFrom"
    }
]))]
pub struct EnvOverride {
    /// Variable name.
    #[schemars(length(min = 1, max = ENV_NAME_MAX), regex(pattern = ENV_NAME_PATTERN))]
    pub name: String,
    /// Literal value (`upsert` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = VALUE_MAX))]
    pub value: Option<String>,
    /// Where the value comes from (`upsert` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from: Option<EnvValueFrom>,
    /// Container to change; every container of the pod when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub container: Option<String>,
    /// `upsert` (default) or `delete`.
    #[serde(default)]
    pub operation: EnvOperation,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EnvOperation {
    /// Set the variable, adding it if missing.
    #[default]
    Upsert,
    /// Remove the variable.
    Delete,
}

/// Exactly one source of an environment value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.configMap) ? 1 : 0) + (has(self.secret) ? 1 : 0) + (has(self.resource) ? 1 : 0) + (has(self.fork) ? 1 : 0) == 1",
    "message": "exactly one of configMap, secret, resource and fork"
}]))]
pub struct EnvValueFrom {
    /// A key of a ConfigMap in the fork's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<KeyRef>,
    /// A key of a Secret in the fork's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<KeyRef>,
    /// An output of one of this sandbox's resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<ResourceOutputRef>,
    /// A property of another fork of this sandbox (e.g. its Service address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<ForkValueRef>,
}

/// A key of a ConfigMap or Secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeyRef {
    /// Name of the ConfigMap or Secret.
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_MAX), regex(pattern = DNS_SUBDOMAIN_PATTERN))]
    pub name: String,
    /// Key within it.
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_MAX), regex(pattern = "^[-._a-zA-Z0-9]+$"))]
    pub key: String,
    /// Start the fork even when the object or key is missing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optional: bool,
}

/// An output of a sandbox resource.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceOutputRef {
    /// `spec.resources[].name`.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    /// `<step>.<output>`, e.g. `provision.host`.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[-_a-zA-Z0-9]+(\.[-_a-zA-Z0-9]+)*$")
    )]
    pub output_key: String,
}

/// A property of another fork of the same sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForkValueRef {
    /// The fork, by the baseline it forks (`spec.forks[].forkOf`).
    pub fork_of: WorkloadRef,
    /// Template over the fork: `{{.Service.Host}}` is the host name of its sandbox Service
    /// (`<name>.<namespace>.svc`; the first by name when several Services select the baseline),
    /// `{{.Service.Port}}` that Service's first port; e.g. `http://{{.Service.Host}}:{{.Service.Port}}`.
    #[schemars(length(min = 1, max = 1024))]
    pub expression: String,
}

/// A patch applied to the forked workload object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Patch {
    /// `strategic` (Kubernetes strategic merge patch), `merge` (RFC 7396) or `json` (RFC 6902).
    #[serde(rename = "type")]
    pub type_: PatchType,
    /// The patch: an object for `strategic` and `merge`, a list of operations for `json`.
    #[schemars(schema_with = "crate::schema::any_value")]
    pub value: serde_json::Value,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PatchType {
    Strategic,
    Merge,
    Json,
}

/// A baseline replaced by a process on the workstation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Local {
    /// Name of the local workload, unique in the sandbox.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    /// The baseline whose keyed traffic goes to the workstation.
    pub from: WorkloadRef,
    /// Which baseline ports go where on the workstation.
    #[schemars(
        length(min = 1, max = MAX_WORKLOADS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["port"])
    )]
    pub mappings: Vec<LocalMapping>,
    /// The baseline container whose environment and mounted files the workstation's process
    /// gets (`spur local env`); the pod template's first container when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub container: Option<String>,
    /// Environment variables set or removed on top of the baseline container's, for the
    /// workstation's process (`spur local env`, read with its user's rights). Without
    /// `container`; `valueFrom.fork` is not supported here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_ENV))]
    pub env: Vec<EnvOverride>,
    /// Files for the workstation besides the baseline container's mounted ConfigMaps and
    /// Secrets (`spur local env --files DIR`, read with its user's rights).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_ENV))]
    pub files: Vec<FileOverride>,
}

/// One file of a local workload: a literal value, or a key of a ConfigMap or Secret of the
/// baseline's namespace, or a resource output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.value) != has(self.valueFrom)",
    "message": "exactly one of value and valueFrom"
}]))]
pub struct FileOverride {
    /// Where the baseline's container would see the file, e.g. `/etc/app/config.yaml`: on the
    /// workstation it is written under the directory given to `spur local env --files`. No
    /// `..` components.
    #[schemars(length(min = 1, max = FILE_PATH_MAX))]
    pub path: String,
    /// Literal content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = VALUE_MAX))]
    pub value: Option<String>,
    /// Where the content comes from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from: Option<FileValueFrom>,
}

/// Exactly one source of a file's content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.configMap) ? 1 : 0) + (has(self.secret) ? 1 : 0) + (has(self.resource) ? 1 : 0) == 1",
    "message": "exactly one of configMap, secret and resource"
}]))]
pub struct FileValueFrom {
    /// A key of a ConfigMap in the baseline's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<KeyRef>,
    /// A key of a Secret in the baseline's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<KeyRef>,
    /// An output of one of this sandbox's resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<ResourceOutputRef>,
}

/// A baseline container port and where on the workstation it is served.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LocalMapping {
    /// Container port of the baseline workload.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// `host:port` on the workstation, e.g. `localhost:8080`.
    #[schemars(length(min = 3, max = HOST_PORT_MAX), regex(pattern = HOST_PORT_PATTERN))]
    pub to_local: String,
}

/// A virtual workload: key-scoped handling of a baseline without a new workload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Virtual {
    /// Name of the virtual workload, unique in the sandbox.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    /// The baseline it stands in front of.
    pub workload: WorkloadRef,
}

/// A resource created by a plugin for the sandbox's lifetime.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxResource {
    /// Name, unique in the sandbox; env `valueFrom.resource.name` refers to it.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    /// Plugin, `name` or `name@version`.
    #[schemars(length(min = 1, max = PLUGIN_MAX), regex(pattern = PLUGIN_PATTERN))]
    pub plugin: String,
    /// Plugin parameters.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend(
        "maxProperties" = MAX_PARAMS,
        "additionalProperties" = {"type": "string", "maxLength": VALUE_MAX}
    ))]
    pub params: BTreeMap<String, String>,
}

/// The sandbox's own route group.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DefaultRouteGroup {
    /// Endpoints that get a preview URL carrying the sandbox's routing key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_ENDPOINTS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub endpoints: Vec<Endpoint>,
}

/// A named entry point into the cluster, reached with a routing key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    /// Name, unique in its list; part of the preview host name.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    /// `scheme://host[:port]` with scheme http, https, grpc or tcp; the host is an in-cluster
    /// name such as `frontend.hotrod.svc`.
    #[schemars(length(min = 1, max = ENDPOINT_TARGET_MAX), regex(pattern = ENDPOINT_TARGET_PATTERN))]
    pub target: String,
    /// With a multi-cluster hub: the cluster (its name at the hub) whose `target` this is;
    /// default: the object's own cluster. The routing key is still this object's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub cluster: Option<String>,
    /// Anyone with the URL may use the preview, without an API key or login, where the hub
    /// allows it (`spur-hub serve --allow-public-previews`; off by default).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub public: bool,
}

/// An endpoint's preview URL, as the operator publishes it when it knows the hub's preview
/// domain (`spur-operator --preview-domain`; docs/hub.md).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointStatus {
    /// The endpoint's name.
    pub name: String,
    /// `https://<endpoint>--<name>[--<cluster>].<preview domain>/`.
    pub url: String,
}

/// The preview URL of endpoint `endpoint` of sandbox or route group `owner` (docs/hub.md): the
/// host form, qualified by `cluster` when the hub serves several clusters.
pub fn preview_url(domain: &str, endpoint: &str, owner: &str, cluster: Option<&str>) -> String {
    match cluster {
        Some(c) => format!("https://{endpoint}--{owner}--{c}.{domain}/"),
        None => format!("https://{endpoint}--{owner}.{domain}/"),
    }
}

/// Time to live.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Ttl {
    /// A positive whole number of minutes (`m`), hours (`h`), days (`d`) or weeks (`w`), at
    /// most 4294967295, e.g. `90m` or `2d`.
    #[schemars(length(min = 2, max = 11), regex(pattern = TTL_PATTERN))]
    pub duration: String,
    /// What the duration counts from: `createdAt` (default) or `updatedAt` (the last spec
    /// change the controller saw).
    #[serde(default)]
    pub offset_from: TtlOffset,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum TtlOffset {
    #[default]
    CreatedAt,
    UpdatedAt,
}

impl Ttl {
    /// The duration, or `None` when it is malformed.
    pub fn duration(&self) -> Option<Duration> {
        parse_ttl(&self.duration)
    }

    /// When a sandbox created at `created` and last changed at `updated` expires; `None` when
    /// the duration is malformed or the instant is beyond what a timestamp can hold.
    pub fn expires_at(&self, created: Timestamp, updated: Timestamp) -> Option<Timestamp> {
        let base = match self.offset_from {
            TtlOffset::CreatedAt => created,
            TtlOffset::UpdatedAt => updated,
        };
        let d = SignedDuration::try_from(self.duration()?).ok()?;
        base.checked_add(d).ok()
    }
}

/// Parses a TTL duration (see [`Ttl::duration`]).
pub fn parse_ttl(s: &str) -> Option<Duration> {
    let unit = match s.as_bytes().last()? {
        b'm' => 60,
        b'h' => 3600,
        b'd' => 86_400,
        b'w' => 604_800,
        _ => return None,
    };
    let digits = &s[..s.len() - 1];
    if digits.is_empty() || digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u32 = digits.parse().ok()?;
    Some(Duration::from_secs(u64::from(n) * unit))
}

// === status ===

/// Observed state of a sandbox.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The routing key: requests carrying it reach this sandbox's workloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = ROUTING_KEY_MAX), regex(pattern = ROUTING_KEY_PATTERN))]
    pub routing_key: Option<String>,
    /// `Ready` and friends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// One entry per `spec.forks[]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forks: Vec<ForkStatus>,
    /// One entry per `spec.local[]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub local: Vec<LocalStatus>,
    /// One entry per `spec.virtual[]`.
    #[serde(rename = "virtual", default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub virtual_workloads: Vec<VirtualStatus>,
    /// One entry per `spec.resources[]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub resources: Vec<ResourceStatusSummary>,
    /// When the controller first saw the current spec (the base of `ttl.offsetFrom: updatedAt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Time>,
    /// When the sandbox will be deleted, from `spec.ttl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
    /// Preview URLs of `spec.defaultRouteGroup.endpoints`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub endpoints: Vec<EndpointStatus>,
}

/// Where a resource stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceStatusSummary {
    /// `spec.resources[].name`.
    pub name: String,
    /// The Resource object (cluster-scoped), once created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// The plugin version it was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<String>,
    /// `Pending`, `Creating`, `Ready`, `Failed` or `Deleting`.
    pub phase: String,
    /// The Secret (in each fork namespace) its outputs are in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_secret: Option<String>,
    /// What it waits for, or why it failed (the step, and the end of its log).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Where a fork stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForkStatus {
    /// The baseline (`spec.forks[].forkOf`).
    pub fork_of: WorkloadRef,
    /// The ForkedWorkload object, in the baseline's namespace.
    pub forked_workload: String,
    /// The fork Deployment (of a Deployment or a Rollout), once created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<String>,
    /// Baseline Services and their sandbox copies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<ServiceMapping>,
    /// The fork is available and its routes are published.
    #[serde(default)]
    pub ready: bool,
    /// Whether every pod of the baseline carries a ready DevMesh sidecar (keyed requests that
    /// reach a baseline pod without one are not routed to the fork).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_sidecars: Option<crate::common::SidecarCoverage>,
}

/// Where a local workload stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LocalStatus {
    /// `spec.local[].name`.
    pub name: String,
    /// The ExternalWorkload object, in the baseline's namespace.
    pub external_workload: String,
    /// The workstation's tunnel is up.
    #[serde(default)]
    pub connected: bool,
    /// Keyed traffic reaches the workstation.
    #[serde(default)]
    pub ready: bool,
}

/// Where a virtual workload stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualStatus {
    /// `spec.virtual[].name`.
    pub name: String,
    /// The VirtualWorkload object, in the baseline's namespace.
    pub virtual_workload: String,
    /// The baseline exists and its pods' sidecars see the key.
    #[serde(default)]
    pub ready: bool,
    /// Whether the baseline's pods carry a ready sidecar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_sidecars: Option<crate::SidecarCoverage>,
}

pub mod expression;
mod validation;

pub(crate) use validation::{check_endpoints, check_owner_name, check_port};

#[cfg(test)]
mod tests;
