//! Spur's Kubernetes operator, assembled from its features' crates, each thin and idempotent,
//! writing with server-side apply under one field manager (`spur-operator-core`):
//!
//! - workloads (`spur-operator-workloads`): Sandbox, ForkedWorkload, ExternalWorkload,
//!   VirtualWorkload, RouteGroup and RoutingConfig;
//! - mesh modes (`spur-operator-mesh`), sandbox resources (`spur-operator-resources`),
//!   EnvoyConfig and ListenerSet (`spur-operator-xds`), just-in-time access
//!   (`spur-operator-access`), namespace enrollment (`spur-operator-enroll`), the certificates
//!   (`spur-operator-certificates`) and the admission webhooks (`spur-operator-admission`).
//!
//! This crate holds what runs them together: the context each gets (`Context`), which
//! controllers run (`controllers`; what wakes each is its feature crate's), and leader
//! election (`leader`), and what the chart's hooks do (`crds`: the CRDs and their
//! stored versions, before every install and upgrade; `upgrade`: the StatefulSets). It re-exports the features under the names the
//! binary and the tests use.

mod context;
mod controllers;
pub mod crds;
mod leader;
pub mod upgrade;

use std::sync::Arc;

use kube::Client;
use tokio_util::sync::CancellationToken;

pub use context::{Context, FIELD_MANAGER};
pub use leader::{LeaderElection, run_as, run_elected};
pub use spur_controller::DRAIN_GRACE;
pub use spur_operator_core::{Error, FINALIZER, Metrics, owner};

// The features, under the names the binary, the tests and the modules here use.
pub use spur_operator_access as access;
pub use spur_operator_admission::sandbox::{MUTATE_SANDBOX_PATH, VALIDATE_SANDBOX_PATH};
pub use spur_operator_admission::{
    MUTATE_ACCESS_REQUEST_PATH, MUTATE_POD_PATH, VALIDATE_ENVOYCONFIG_PATH,
    VALIDATE_LISTENERSET_PATH, VALIDATE_POD_CONNECT_PATH, Webhook, WebhookConfig,
};
pub use spur_operator_admission::{audit, inject, inject::InjectionConfig};
pub use spur_operator_certificates::{
    PKI_LABEL, PkiConfig, ServingCert, XdsClientConfig, workstations, xds_clients,
};
pub use spur_operator_enroll as enroll;
pub use spur_operator_mesh::MeshConfig;
use spur_operator_mesh::{gateway as mesh_gateway, istio as mesh_istio};
pub use spur_operator_resources::olm::{self, ResourceConfig};
pub use spur_operator_smarttests as smarttests;
pub use spur_operator_workloads::{
    ForkPolicy, Previews, TunnelConfig, external, fork, patch, sandbox,
};
pub use spur_operator_xds::{envoyconfig, listenerset};

/// Runs all the controllers the context enables, the dead-tunnel collector (and the
/// certificate manager, when the context has a PKI configuration) until `stop` is cancelled,
/// then lets in-flight reconciles finish for up to [`DRAIN_GRACE`].
pub async fn run(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    use controllers as c;
    let wctx = Arc::new(ctx.workloads.clone());
    let pki = tokio::spawn(c::pki(client.clone(), ctx.clone(), stop.clone()));
    let gc = tokio::spawn(external::collect_dead_tunnels(wctx.clone(), stop.clone()));
    let (term, w) = c::watches(&client, wctx.clone());
    let (cl, s) = (&client, &stop);
    tokio::join!(
        c::access(cl.clone(), ctx.clone(), s.clone()),
        c::enroller(ctx.clone(), s.clone()),
        c::mesh(cl.clone(), ctx.clone(), s.clone()),
        c::resources(cl.clone(), ctx.clone(), s.clone()),
        c::smart_tests(cl.clone(), ctx.clone(), s.clone()),
        c::sandboxes(
            cl.clone(),
            term.clone(),
            w.sb_forks,
            w.sb_externals,
            w.sb_virtuals,
            w.sb_configs,
            s.clone()
        ),
        c::forks(cl.clone(), term.clone(), w.forks, s.clone()),
        c::externals(
            cl.clone(),
            term.clone(),
            w.ew_leases,
            w.ew_slices,
            s.clone()
        ),
        c::virtuals(cl.clone(), wctx.clone(), s.clone()),
        c::routing_configs(
            cl.clone(),
            term.clone(),
            w.rc_forks,
            w.rc_externals,
            s.clone()
        ),
        c::groups(cl.clone(), term.clone(), w.rg_sandboxes, s.clone()),
        c::envoy_configs(cl.clone(), ctx.clone(), s.clone()),
        c::listener_sets(cl.clone(), term, w.ls_services, s.clone()),
    );
    let _ = pki.await;
    let _ = gc.await;
}
