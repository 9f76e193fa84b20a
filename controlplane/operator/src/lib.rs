//! Spur's Kubernetes controllers: Sandbox, ForkedWorkload, ExternalWorkload, RouteGroup and
//! RoutingConfig, each thin and idempotent, writing with server-side apply under one field
//! manager; plus the sidecar-injection webhook and the certificate manager.
//!
//! ```text
//! Sandbox ──► ForkedWorkload (per fork, baseline namespace) ──► fork Deployment + sandbox Services
//!    │                                                              │ ready
//!    └──────► RoutingConfig (its routing key) ◄── ForkedWorkload status (Service mapping)
//! RouteGroup ─(label match over Sandboxes)─► RoutingConfig (the group's key)
//! RoutingConfig status.routeServer.routes ──► route server (`spur-routeserver --kubernetes`)
//! RoutingConfig ─(mesh modes)─► IstioRoute ──► Spur's routes in the user's VirtualServices
//!               └────────────► GatewayAPIRoute ──► derived HTTPRoutes beside the user's
//! ListenerSet ──► its Service + a headless Service per selector endpoint (owner references, no
//!                 finalizer) ◄── EndpointSlices (status.listeners[])
//! ```
//!
//! Deletion never relies on the garbage collector: every owner carries a finalizer and deletes
//! its children itself (owner references are set too, for `kubectl` and a cluster's GC). The
//! one exception is ListenerSet: its children are Services of its own namespace, which a
//! controller owner reference is enough for, so it has no finalizer to be stuck on.

mod context;
mod controllers;
pub mod external;
pub mod fork;
mod forked;
mod leader;
pub mod patch;
mod routegroup;
mod routingconfig;
pub mod sandbox;
mod triggers;
mod virtualw;

pub use context::{Context, FIELD_MANAGER, Previews};
pub use external::TunnelConfig;
pub use fork::ForkPolicy;
pub use leader::{LeaderElection, run_elected};
pub use olm::ResourceConfig;
pub use spur_operator_admission::sandbox::{MUTATE_SANDBOX_PATH, VALIDATE_SANDBOX_PATH};
pub use spur_operator_admission::{
    MUTATE_ACCESS_REQUEST_PATH, MUTATE_POD_PATH, VALIDATE_ENVOYCONFIG_PATH,
    VALIDATE_LISTENERSET_PATH, VALIDATE_POD_CONNECT_PATH, Webhook, WebhookConfig,
};
pub use spur_operator_admission::{audit, inject, inject::InjectionConfig};
pub use spur_operator_certificates::{
    PKI_LABEL, PkiConfig, ServingCert, XdsClientConfig, workstations, xds_clients,
};
use spur_operator_core::workstation_owner;
pub use spur_operator_core::{Error, FINALIZER, Metrics, owner};
pub use spur_operator_mesh::MeshConfig;

use std::sync::Arc;

// The features in crates of their own, under the names the modules here use.
pub use spur_operator_access as access;
pub use spur_operator_enroll as enroll;
use spur_operator_mesh::{self as mesh, gateway as mesh_gateway, istio as mesh_istio};
use spur_operator_resources as resources;
pub use spur_operator_resources::olm;
pub use spur_operator_xds::{envoyconfig, listenerset};

use kube::Client;
use tokio_util::sync::CancellationToken;

pub use spur_controller::DRAIN_GRACE;

/// Runs all the controllers the context enables, the dead-tunnel collector (and the
/// certificate manager, when the context has a PKI configuration) until `stop` is cancelled,
/// then lets in-flight reconciles finish for up to [`DRAIN_GRACE`].
pub async fn run(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    use controllers as c;
    let pki = tokio::spawn(c::pki(client.clone(), ctx.clone(), stop.clone()));
    let gc = tokio::spawn(external::collect_dead_tunnels(ctx.clone(), stop.clone()));
    let (term, w) = c::watches(&client, ctx.clone());
    let (cl, s) = (&client, &stop);
    tokio::join!(
        c::access(cl.clone(), ctx.clone(), s.clone()),
        c::enroller(ctx.clone(), s.clone()),
        c::mesh(cl.clone(), ctx.clone(), s.clone()),
        c::resources(cl.clone(), ctx.clone(), s.clone()),
        c::sandboxes(
            cl.clone(),
            term.clone(),
            w.sb_forks,
            w.sb_externals,
            w.sb_virtuals,
            w.sb_configs,
            s.clone()
        ),
        c::forks(
            cl.clone(),
            term.clone(),
            w.fw_deployments,
            w.fw_services,
            s.clone()
        ),
        c::externals(cl.clone(), ctx.clone(), s.clone()),
        c::virtuals(cl.clone(), ctx.clone(), s.clone()),
        c::routing_configs(
            cl.clone(),
            term.clone(),
            w.rc_forks,
            w.rc_externals,
            s.clone()
        ),
        c::groups(cl.clone(), ctx.clone(), s.clone()),
        c::envoy_configs(cl.clone(), ctx.clone(), s.clone()),
        c::listener_sets(cl.clone(), term, w.ls_services, s.clone()),
    );
    let _ = pki.await;
    let _ = gc.await;
}

#[cfg(test)]
mod tests {
    use kube::Resource;
    use kube::ResourceExt;
    use kube::runtime::reflector::ObjectRef;
    use serde_json::json;
    use spur_api::{ForkedWorkload, Sandbox};
    use spur_controller::cluster_owners;

    #[test]
    fn a_namespaced_child_wakes_its_cluster_scoped_sandbox_under_one_key() {
        let sb: Sandbox = serde_json::from_value(json!({
            "apiVersion": Sandbox::api_version(&()), "kind": "Sandbox",
            "metadata": {"name": "sb1", "uid": "u-1"},
            "spec": {}
        }))
        .unwrap();
        let fw: ForkedWorkload = serde_json::from_value(json!({
            "apiVersion": ForkedWorkload::api_version(&()), "kind": "ForkedWorkload",
            "metadata": {"name": "sb1-web", "namespace": "shop", "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "other", "uid": "u-2"},
                sb.controller_owner_ref(&()).unwrap(),
            ]},
            "spec": {"sandbox": "sb1", "routingKey": "k", "baseline": {
                "kind": "Deployment", "namespace": "shop", "name": "web"}}
        }))
        .unwrap();
        // The key the Sandbox's own watch schedules it under: one key, one reconcile at a time.
        assert_eq!(
            cluster_owners::<Sandbox>(&fw),
            vec![ObjectRef::from_obj(&sb)]
        );
        // What `Controller::owns` would schedule: a second key for the same Sandbox. When
        // kube-runtime stops doing this, `owns` can come back.
        let owns_key = fw
            .owner_references()
            .iter()
            .find_map(|o| ObjectRef::<Sandbox>::from_owner_ref(fw.namespace().as_deref(), o, ()));
        assert_ne!(owns_key, Some(ObjectRef::from_obj(&sb)));
    }
}
