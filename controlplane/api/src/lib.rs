//! Spur's Kubernetes API (group `spur.dev`, version `v1alpha1`): the custom resource types,
//! their validation, object naming, well-known keys, condition helpers and the CRD generator.
//!
//! ```text
//! Sandbox ──► ForkedWorkload / ExternalWorkload / VirtualWorkload   (one per baseline, in its namespace)
//!        ├──► Resource ──► ObjectLifecycleMethods ──► work-unit pods (io context server)
//!        └──► RoutingConfig (its routing key) ◄── RouteGroup (label match over sandboxes)
//!                   ├── status.routeServer.routes ──► route server ──► Routes API rules
//!                   └── IstioRoute / GatewayAPIRoute (per baseline Service, mesh modes only)
//! ```
//!
//! Validation happens twice with the same rules: the apiserver enforces the schema (patterns,
//! bounds, CEL `x-kubernetes-validations`) on every write, and each spec's `validate()` repeats
//! those checks in Rust and adds what CEL cannot express, for controllers and tests.

pub mod access;
pub mod carriers;
pub mod common;
pub mod conditions;
pub mod crdgen;
pub mod digest;
pub mod envoyconfig;
pub mod forkof;
pub mod jobs;
pub mod keys;
pub mod listenerset;
pub mod mesh;
pub mod names;
pub mod resources;
pub mod routegroup;
pub mod routingconfig;
pub mod sandbox;
pub mod smarttest;
pub mod tunnel;
pub mod validation;
pub mod workloads;
pub mod workstation;

mod error;
mod schema;

pub use access::{
    ExecAccessRequest, ExecAccessRequestSpec, ExecAccessTemplate, ExecAccessTemplateSpec,
    PodAccessRequest, PodAccessRequestSpec, PodAccessTemplate, PodAccessTemplateSpec,
    TunnelAccessRequest, TunnelAccessRequestSpec, TunnelAccessTemplate, TunnelAccessTemplateSpec,
};
pub use common::{ServiceMapping, ServicePort, WorkloadKind, WorkloadRef};
pub use envoyconfig::{
    EnvoyConfig, EnvoyConfigRevision, EnvoyConfigRevisionSpec, EnvoyConfigRevisionStatus,
    EnvoyConfigSpec, EnvoyConfigStatus,
};
pub use error::{Error, FieldError, FieldErrors};
pub use jobs::{Job, JobRunnerGroup, JobRunnerGroupSpec, JobRunnerGroupStatus, JobSpec, JobStatus};
pub use listenerset::{ListenerSet, ListenerSetSpec, ListenerSetStatus};
pub use mesh::{GatewayAPIRoute, GatewayAPIRouteSpec, IstioRoute, IstioRouteSpec, MeshRouteStatus};
pub use resources::{
    ObjectLifecycleMethods, OlmSpec, OlmStatus, Resource, ResourcePlugin, ResourcePluginSpec,
    ResourceSpec, ResourceStatus,
};
pub use routegroup::{
    Match, RouteGroup, RouteGroupSpec, RouteGroupStatus, RouteGroupTtl, RouteGroupTtlOffset,
};
pub use routingconfig::{Route, RoutingConfig, RoutingConfigSpec, RoutingConfigStatus};
pub use sandbox::{Sandbox, SandboxCapture, SandboxSpec, SandboxStatus};
pub use smarttest::{SmartTest, SmartTestSpec};
pub use workloads::{
    ExternalWorkload, ExternalWorkloadSpec, ExternalWorkloadStatus, ForkedWorkload,
    ForkedWorkloadSpec, ForkedWorkloadStatus, SidecarCoverage, VirtualWorkload,
    VirtualWorkloadSpec, VirtualWorkloadStatus,
};
