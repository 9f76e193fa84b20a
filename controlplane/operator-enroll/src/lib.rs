//! Namespace enrollment (docs/install.md, "Namespaces Spur may write in"): the operator and the
//! jobs component write Deployments, Services, EndpointSlices, Secrets and Pods only in
//! namespaces a cluster administrator labelled `spur.dev/enabled=true`. Their ClusterRoles
//! only read; the writes are in ClusterRoles of their own (the chart's `spur-operator-enrolled`
//! and `spur-jobs-enrolled`), which this controller binds with a RoleBinding in each labelled
//! namespace and unbinds when the label goes.
//!
//! The label is on the Namespace, which is cluster-scoped: a namespace's own admins cannot set
//! it. The operator may write RoleBindings anywhere (it cannot know the namespaces in advance)
//! and may `bind` exactly those ClusterRoles; the chart's admission policy
//! `spur-operator-rolebindings` holds it to this controller's shape (the binding's name, role
//! and one service account subject, in a labelled namespace only).
//!
//! Thin and idempotent like the other controllers: a namespace's pass reads its bindings from a
//! store (a watch of the bindings this controller made) and applies only what differs.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;

use spur_operator_core::{Context, Error, FIELD_MANAGER, delete_opt};
// The configuration lives beside the context that carries it; its public path stays here.
pub use crate::enroll_config::{BINDING_LABEL, EnrollBinding, EnrollConfig};

mod desired;
mod enroll_config;

use desired::Step;

/// The namespace label that lets Spur write in a namespace, and its value.
pub const ENABLED_LABEL: &str = "spur.dev/enabled";
pub const ENABLED_VALUE: &str = "true";
/// Whether Spur may write in `ns`: labelled by an administrator, and not being deleted (a
/// terminating namespace refuses new objects, and its bindings go with it).
pub fn enrolled(ns: &Namespace) -> bool {
    ns.metadata.deletion_timestamp.is_none()
        && ns.labels().get(ENABLED_LABEL).map(String::as_str) == Some(ENABLED_VALUE)
}

impl spur_controller::HasBackoff for Enroller {
    fn backoff(&self) -> &spur_controller::Backoff {
        spur_controller::HasBackoff::backoff(&*self.ctx)
    }
}

struct Enroller {
    ctx: Arc<Context>,
    cfg: EnrollConfig,
    bindings: Store<RoleBinding>,
}

/// Keeps the enrollment RoleBindings of every namespace until `stop` (on the leader, with the
/// other controllers).
pub async fn run(ctx: Arc<Context>, cfg: EnrollConfig, stop: CancellationToken) {
    let client = ctx.client.clone();
    let (bindings, changes) = spur_controller::changes::changes(
        Api::<RoleBinding>::all(client.clone()),
        watcher::Config::default().labels(BINDING_LABEL),
        binding_digest,
    );
    let enroller = Arc::new(Enroller { ctx, cfg, bindings });
    let controller = Controller::new(Api::<Namespace>::all(client), watcher::Config::default())
        // A binding changed or deleted behind the operator's back wakes its namespace.
        .watches_stream(changes, |rb| rb.namespace().map(|ns| ObjectRef::new(&ns)));
    spur_controller::run(
        "namespace-enroller",
        controller,
        reconcile,
        error_policy,
        enroller,
        stop,
    )
    .await;
}

fn binding_digest(rb: &RoleBinding) -> u64 {
    spur_controller::hash_of(&(&rb.metadata.labels, &rb.role_ref, &rb.subjects))
}

async fn reconcile(ns: Arc<Namespace>, e: Arc<Enroller>) -> Result<Action, Error> {
    let _pass = e.ctx.metrics.reconcile("Namespace");
    let name = ns.name_any();
    let api: Api<RoleBinding> = Api::namespaced(e.ctx.client.clone(), &name);
    for b in &e.cfg.bindings {
        let have = e
            .bindings
            .get(&ObjectRef::new(&b.cluster_role).within(&name));
        let want = e.cfg.binding(b, &name);
        match desired::step(&ns, have.as_deref(), &want) {
            Step::Keep => {}
            Step::Remove => {
                delete_opt(&api, &b.cluster_role).await?;
                tracing::info!(namespace = %name, binding = %b.cluster_role, "namespace left Spur: binding removed");
            }
            Step::Apply { replace } => {
                if replace {
                    delete_opt(&api, &b.cluster_role).await?;
                }
                // k8s-openapi writes apiVersion and kind, as server-side apply needs.
                api.patch(
                    &b.cluster_role,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&want),
                )
                .await?;
                tracing::info!(namespace = %name, binding = %b.cluster_role, "namespace enrolled: binding applied");
            }
        }
    }
    Ok(Action::await_change())
}

fn error_policy(ns: Arc<Namespace>, err: &Error, e: Arc<Enroller>) -> Action {
    e.ctx.retry(&*ns, err)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn only_a_labelled_live_namespace_is_enrolled() {
        let ns = |v: serde_json::Value| serde_json::from_value::<Namespace>(v).unwrap();
        assert!(enrolled(&ns(
            json!({"metadata": {"name": "a", "labels": {"spur.dev/enabled": "true"}}})
        )));
        assert!(!enrolled(&ns(json!({"metadata": {"name": "a"}}))));
        assert!(!enrolled(&ns(
            json!({"metadata": {"name": "a", "labels": {"spur.dev/enabled": "yes"}}})
        )));
        assert!(!enrolled(&ns(json!({"metadata": {
            "name": "a", "labels": {"spur.dev/enabled": "true"},
            "deletionTimestamp": "2024-01-01T00:00:00Z"
        }}))));
    }
}
