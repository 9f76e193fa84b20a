//! The per-baseline objects a Sandbox compiles into, each in its baseline's namespace and owned
//! by the Sandbox: `ForkedWorkload` (a customized copy), `ExternalWorkload` (a process on a
//! workstation behind a tunnel) and `VirtualWorkload` (key-scoped handling without a workload).
//! Their status lists the sandbox Services, from which the RoutingConfig controller derives
//! routes.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

// The sidecar coverage types live in `common` (a Sandbox's status carries them too); their
// old path stays.
pub use crate::common::{PodWithoutSidecar, SidecarCoverage};
use crate::common::{ServiceMapping, WorkloadRef};
use crate::error::Error;
use crate::sandbox::{Customizations, LocalMapping, MAX_WORKLOADS, check_port};
use crate::validation::*;

// === ForkedWorkload ===

/// Desired state of a forked workload.
// `printcolumn(...)` repeats its keys by design; clippy takes that for a copy-paste slip.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "ForkedWorkload",
    plural = "forkedworkloads",
    shortname = "fw",
    category = "spur",
    namespaced,
    status = "ForkedWorkloadStatus",
    derive = "PartialEq",
    doc = "A customized copy of one baseline workload, serving one sandbox's routing key. Created by the Sandbox controller in the baseline's namespace; the fork Deployment (a Deployment for a Rollout baseline too) and one sandbox Service per baseline Service are its children.",
    printcolumn(name = "Sandbox", type_ = "string", json_path = ".spec.sandbox"),
    printcolumn(name = "Baseline", type_ = "string", json_path = ".spec.baseline.name"),
    printcolumn(name = "Fork", type_ = "string", json_path = ".status.fork"),
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
pub struct ForkedWorkloadSpec {
    /// The owning sandbox.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: String,
    /// The sandbox's routing key.
    #[schemars(length(min = 1, max = ROUTING_KEY_MAX), regex(pattern = ROUTING_KEY_PATTERN))]
    pub routing_key: String,
    /// The workload to copy; in this object's namespace.
    pub baseline: WorkloadRef,
    /// Changes applied to the copy (from the sandbox's `forks[].customizations`).
    #[serde(default, skip_serializing_if = "Customizations::is_empty")]
    pub customizations: Customizations,
}

/// Observed state of a forked workload.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForkedWorkloadStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The baseline object the fork was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<BaselineObservation>,
    /// Name of the fork Deployment, in the baseline's namespace (a Rollout's fork is a Deployment too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<String>,
    /// Baseline Services selecting the baseline, and their sandbox copies selecting the fork.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["baselineService"]))]
    pub services: Vec<ServiceMapping>,
    /// Whether the baseline's pods carry a ready DevMesh sidecar, without which keyed requests
    /// reaching those pods are not routed to the fork.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_sidecars: Option<SidecarCoverage>,
    /// `Ready` and friends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Which version of the baseline object a child was derived from, to notice baseline changes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BaselineObservation {
    /// `metadata.uid` of the baseline.
    pub uid: String,
    /// `metadata.generation` of the baseline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
}

impl ForkedWorkloadSpec {
    /// The schema's rules plus patch shapes. References from env `valueFrom` to the sandbox's
    /// resources and other forks are checked on the Sandbox, which knows them.
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        c.dns_label(|| "spec.sandbox".into(), &self.sandbox);
        c.routing_key(|| "spec.routingKey".into(), &self.routing_key);
        self.baseline.check(&mut c, "spec.baseline");
        self.customizations
            .check(&mut c, "spec.customizations", None);
        c.finish("ForkedWorkload")
    }
}

// === ExternalWorkload ===

/// Desired state of an external workload.
// `printcolumn(...)` repeats its keys by design; clippy takes that for a copy-paste slip.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "ExternalWorkload",
    plural = "externalworkloads",
    shortname = "ew",
    category = "spur",
    namespaced,
    status = "ExternalWorkloadStatus",
    derive = "PartialEq",
    doc = "Stands in for a baseline with a process on a workstation: the sandbox Services point at the tunnel proxy, which carries the traffic over the workstation's reverse tunnel. Created by the Sandbox controller (one per spec.local[]) in the baseline's namespace.",
    printcolumn(name = "Sandbox", type_ = "string", json_path = ".spec.sandbox"),
    printcolumn(name = "Baseline", type_ = "string", json_path = ".spec.baseline.name"),
    printcolumn(
        name = "Workstation",
        type_ = "string",
        json_path = ".spec.workstation"
    ),
    printcolumn(
        name = "Connected",
        type_ = "boolean",
        json_path = ".status.tunnel.connected"
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
pub struct ExternalWorkloadSpec {
    /// The owning sandbox.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: String,
    /// The sandbox's routing key.
    #[schemars(length(min = 1, max = ROUTING_KEY_MAX), regex(pattern = ROUTING_KEY_PATTERN))]
    pub routing_key: String,
    /// The local workload's name in the sandbox (`spec.local[].name`).
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    /// The workload whose keyed traffic goes to the workstation; in this object's namespace.
    pub baseline: WorkloadRef,
    /// The workstation session (tunnel) that serves it.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub workstation: String,
    /// Which baseline container ports go where on the workstation.
    #[schemars(
        length(min = 1, max = MAX_WORKLOADS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["port"])
    )]
    pub mappings: Vec<LocalMapping>,
}

/// Observed state of an external workload.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalWorkloadStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The baseline object the Services were derived from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<BaselineObservation>,
    /// The workstation's tunnel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel: Option<TunnelStatus>,
    /// Baseline Services and their sandbox copies (which point at the tunnel proxy).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["baselineService"]))]
    pub services: Vec<ServiceMapping>,
    /// `Ready`, `TunnelConnected` and friends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Health of the reverse tunnel behind an external workload.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelStatus {
    /// The last health check reached the workstation.
    #[serde(default)]
    pub connected: bool,
    /// Last successful health check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<Time>,
    /// Last health check, successful or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_check: Option<Time>,
    /// Tunnel-proxy pod carrying the tunnel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_pod: Option<String>,
    /// Where each baseline port is exposed on the tunnel proxy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["port"]))]
    pub ports: Vec<TunnelPort>,
}

/// A baseline port and the tunnel-proxy port that forwards it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelPort {
    /// Container port of the baseline.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// Port on the tunnel proxy.
    #[schemars(range(min = 1, max = 65535))]
    pub proxy_port: i32,
}

impl ExternalWorkloadSpec {
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        c.dns_label(|| "spec.sandbox".into(), &self.sandbox);
        c.routing_key(|| "spec.routingKey".into(), &self.routing_key);
        c.dns_label(|| "spec.name".into(), &self.name);
        self.baseline.check(&mut c, "spec.baseline");
        c.dns_label(|| "spec.workstation".into(), &self.workstation);
        if self.mappings.is_empty() {
            c.fail("spec.mappings", "must not be empty");
        }
        c.max_items(|| "spec.mappings".into(), &self.mappings, MAX_WORKLOADS);
        let mut ports = std::collections::HashSet::new();
        for (i, m) in self.mappings.iter().enumerate() {
            check_port(&mut c, || format!("spec.mappings[{i}].port"), m.port);
            if !ports.insert(m.port) {
                c.fail(
                    format!("spec.mappings[{i}].port"),
                    format!("port {} is mapped twice", m.port),
                );
            }
            c.require(
                is_host_port(&m.to_local),
                || format!("spec.mappings[{i}].toLocal"),
                "must be host:port (e.g. localhost:8080)",
            );
        }
        c.finish("ExternalWorkload")
    }
}

// === VirtualWorkload ===

/// Desired state of a virtual workload.
// `printcolumn(...)` repeats its keys by design; clippy takes that for a copy-paste slip.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "VirtualWorkload",
    plural = "virtualworkloads",
    shortname = "vw",
    category = "spur",
    namespaced,
    status = "VirtualWorkloadStatus",
    derive = "PartialEq",
    doc = "Stands for a baseline inside a sandbox without forking it: requests carrying the sandbox's routing key keep reaching the baseline, and its sidecars handle them as the sandbox's (traffic capture, so a reference sandbox records what the baseline answers; docs/traffic.md). Created by the Sandbox controller (one per spec.virtual[]) in the baseline's namespace.",
    printcolumn(name = "Sandbox", type_ = "string", json_path = ".spec.sandbox"),
    printcolumn(name = "Baseline", type_ = "string", json_path = ".spec.baseline.name"),
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
pub struct VirtualWorkloadSpec {
    /// The owning sandbox.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: String,
    /// The sandbox's routing key.
    #[schemars(length(min = 1, max = ROUTING_KEY_MAX), regex(pattern = ROUTING_KEY_PATTERN))]
    pub routing_key: String,
    /// The virtual workload's name in the sandbox (`spec.virtual[].name`).
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    /// The workload it stands in front of; in this object's namespace.
    pub baseline: WorkloadRef,
}

/// Observed state of a virtual workload.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualWorkloadStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The baseline object the Services were derived from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<BaselineObservation>,
    /// Baseline Services and the sandbox Services that carry the key-scoped handling.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["baselineService"]))]
    pub services: Vec<ServiceMapping>,
    /// Whether the baseline's pods carry a ready DevMesh sidecar: only those see (and capture)
    /// the sandbox's keyed requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_sidecars: Option<SidecarCoverage>,
    /// `Ready` and friends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl VirtualWorkloadSpec {
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        c.dns_label(|| "spec.sandbox".into(), &self.sandbox);
        c.routing_key(|| "spec.routingKey".into(), &self.routing_key);
        c.dns_label(|| "spec.name".into(), &self.name);
        self.baseline.check(&mut c, "spec.baseline");
        c.finish("VirtualWorkload")
    }
}
