//! Types shared by several kinds: workload references, Service mappings and the baseline's
//! sidecar coverage.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::validation::{Checker, DNS_LABEL_MAX, DNS_LABEL_PATTERN, DNS_SUBDOMAIN_MAX};
use crate::validation::{DNS_SUBDOMAIN_PATTERN, is_dns_label};

/// Kinds of workload that can be forked or stood in for.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum WorkloadKind {
    /// `apps/v1` Deployment.
    Deployment,
    /// Argo Rollout (`argoproj.io/v1alpha1`).
    Rollout,
}

impl WorkloadKind {
    /// The Kubernetes kind.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "Deployment",
            WorkloadKind::Rollout => "Rollout",
        }
    }

    /// The kind as the Routes API names it (`BaselineWorkload.kind`): the public API and its Go
    /// client spell Argo Rollouts `ArgoRollout`, so sidecars of Rollout pods announce that.
    pub fn routes_api_kind(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "Deployment",
            WorkloadKind::Rollout => "ArgoRollout",
        }
    }

    /// `apiVersion` of the workload object.
    pub fn api_version(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "apps/v1",
            WorkloadKind::Rollout => "argoproj.io/v1alpha1",
        }
    }
}

impl fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A workload in the cluster, usually the baseline a sandbox builds on.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadRef {
    /// Kind of the workload: Deployment or Rollout.
    pub kind: WorkloadKind,
    /// Namespace of the workload.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub namespace: String,
    /// Name of the workload.
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_MAX), regex(pattern = DNS_SUBDOMAIN_PATTERN))]
    pub name: String,
}

impl WorkloadRef {
    pub fn new(kind: WorkloadKind, namespace: impl Into<String>, name: impl Into<String>) -> Self {
        WorkloadRef {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The baseline as the Routes API carries it.
    pub fn to_rule_baseline(&self) -> spur_routing::rules::BaselineSpec {
        spur_routing::rules::BaselineSpec {
            kind: self.kind.routes_api_kind().to_owned(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    pub(crate) fn check(&self, c: &mut Checker, path: &str) {
        c.dns_label(|| format!("{path}.namespace"), &self.namespace);
        c.dns_subdomain(|| format!("{path}.name"), &self.name);
    }
}

impl fmt::Display for WorkloadRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.kind, self.namespace, self.name)
    }
}

/// A baseline Service and the sandbox's copy of it, in the workload's namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceMapping {
    /// The baseline Service that selects the baseline workload.
    pub baseline_service: String,
    /// The sandbox Service: same ports as the baseline Service, selecting the sandbox's stand-in
    /// (fork pods, or the tunnel proxy for a local workload).
    pub sandbox_service: String,
    /// Ports of the baseline Service that resolve to a port of the workload.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["port"]))]
    pub ports: Vec<ServicePort>,
}

/// One Service port: what clients dial, and the container port it reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServicePort {
    /// Service port (the same on the baseline and the sandbox Service).
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// Container port of the baseline workload that `port` resolves to (named target ports
    /// resolved); this is the `workloadPort` of routing rules.
    #[schemars(range(min = 1, max = 65535))]
    pub target_port: i32,
}

/// In-cluster DNS name of a Service (`<name>.<namespace>.svc`), without assuming the cluster
/// domain.
pub fn service_host(name: &str, namespace: &str) -> String {
    format!("{name}.{namespace}.svc")
}

pub(crate) fn check_container(c: &mut Checker, path: impl FnOnce() -> String, name: &str) {
    c.require(
        is_dns_label(name),
        path,
        "must be a container name (a DNS-1123 label)",
    );
}

/// How many of a baseline's running pods carry the DevMesh sidecar, and how many of those
/// sidecars are ready.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SidecarCoverage {
    /// Baseline pods (selected by the baseline's selector, not terminating).
    pub pods: u32,
    /// Of those, pods with an injected sidecar.
    pub injected: u32,
    /// Of those, pods whose sidecar is ready.
    pub ready: u32,
    /// There is at least one baseline pod and every one carries a ready sidecar.
    pub all_ready: bool,
    /// Baseline pods without a sidecar (at most [`SidecarCoverage::MAX_NAMED`], by name), and
    /// why: keyed requests that reach them are not routed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub without_sidecar: Vec<PodWithoutSidecar>,
}

/// A baseline pod that has no sidecar.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodWithoutSidecar {
    pub name: String,
    /// Why, as far as the pod shows it (its injection annotations).
    pub reason: String,
}

impl SidecarCoverage {
    /// How many pods without a sidecar are named.
    pub const MAX_NAMED: usize = 10;

    pub fn new(pods: u32, injected: u32, ready: u32) -> Self {
        SidecarCoverage {
            pods,
            injected,
            ready,
            all_ready: pods > 0 && ready == pods,
            without_sidecar: Vec::new(),
        }
    }
}
