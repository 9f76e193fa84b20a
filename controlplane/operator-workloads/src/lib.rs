//! The operator's workload controllers: Sandbox, ForkedWorkload, ExternalWorkload,
//! VirtualWorkload, RouteGroup and RoutingConfig, with fork planning and patching
//! (docs/operator.md).
//!
//! ```text
//! Sandbox ──► ForkedWorkload (per fork, baseline namespace) ──► fork Deployment + sandbox Services
//!    │                                                              │ ready
//!    └──────► RoutingConfig (its routing key) ◄── ForkedWorkload status (Service mapping)
//! RouteGroup ─(label match over Sandboxes)─► RoutingConfig (the group's key)
//! RoutingConfig status.routeServer.routes ──► route server (`spur-routeserver --kubernetes`)
//! RoutingConfig ─(mesh modes, spur_operator_mesh)─► IstioRoute / GatewayAPIRoute
//! ```
//!
//! Deletion never relies on the garbage collector: every owner carries a finalizer and deletes
//! its children itself (owner references are set too, for `kubectl` and a cluster's GC).

pub mod baseline;
mod context;
pub mod controllers;
pub mod external;
pub mod fork;
mod fork_refs;
mod forked;
pub mod patch;
mod routegroup;
mod routingconfig;
pub mod sandbox;
mod triggers;
mod virtualw;

pub use context::{Previews, Stores, Term, WorkloadsContext};
pub use external::TunnelConfig;
pub use fork::ForkPolicy;

// What the modules here use of the shared core and of the features they call into, under the
// names they use.
use spur_operator_core::{Error, FINALIZER};
use spur_operator_enroll as enroll;
use spur_operator_mesh::{self as mesh, MeshConfig};
use spur_operator_resources as resources;

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
