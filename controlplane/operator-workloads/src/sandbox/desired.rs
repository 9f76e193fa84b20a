//! What a Sandbox wants to exist: its children, as pure functions of its spec and routing key.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use spur_api::keys::labels;
use spur_api::routingconfig::{SandboxedKind, SandboxedWorkloadRef};
use spur_api::{
    ExternalWorkload, ExternalWorkloadSpec, ForkedWorkload, ForkedWorkloadSpec, RoutingConfig,
    RoutingConfigSpec, Sandbox, VirtualWorkload, VirtualWorkloadSpec, names,
};

/// The workloads a Sandbox makes, in the order they are applied and routed.
pub(super) struct Children {
    pub(super) forks: Vec<ForkedWorkload>,
    /// Empty when the Sandbox may not bind its workstation (no keys for a workstation that
    /// changed hands).
    pub(super) locals: Vec<ExternalWorkload>,
    pub(super) virtuals: Vec<VirtualWorkload>,
}

/// One ForkedWorkload per fork (in the baseline's namespace), one ExternalWorkload per local
/// workload when `bound`, one VirtualWorkload per virtual workload.
pub(super) fn children(sb: &Sandbox, key: &str, bound: bool) -> Children {
    let name = sb.name_any();
    let owner = owner(sb);
    let forks = sb
        .spec
        .forks
        .iter()
        .map(|fork| {
            let b = &fork.fork_of;
            let fw_name = names::fork_name(&name, b);
            let mut fw = ForkedWorkload::new(
                &fw_name,
                ForkedWorkloadSpec {
                    sandbox: name.clone(),
                    routing_key: key.to_owned(),
                    baseline: b.clone(),
                    customizations: fork.customizations.clone(),
                },
            );
            fw.metadata = child_meta(&fw_name, &b.namespace, &name, key, &owner);
            fw
        })
        .collect();
    let locals = sb
        .spec
        .local
        .iter()
        .filter(|_| bound)
        .map(|local| {
            let b = &local.from;
            let ew_name = names::external_workload_name(&name, &local.name);
            let mut ew = ExternalWorkload::new(
                &ew_name,
                ExternalWorkloadSpec {
                    sandbox: name.clone(),
                    routing_key: key.to_owned(),
                    name: local.name.clone(),
                    baseline: b.clone(),
                    workstation: sb.spec.workstation.clone().unwrap_or_default(),
                    mappings: local.mappings.clone(),
                },
            );
            ew.metadata = child_meta(&ew_name, &b.namespace, &name, key, &owner);
            ew
        })
        .collect();
    let virtuals = sb
        .spec
        .virtual_workloads
        .iter()
        .map(|v| {
            let b = &v.workload;
            let vw_name = names::virtual_workload_name(&name, &v.name);
            let mut vw = VirtualWorkload::new(
                &vw_name,
                VirtualWorkloadSpec {
                    sandbox: name.clone(),
                    routing_key: key.to_owned(),
                    name: v.name.clone(),
                    baseline: b.clone(),
                },
            );
            vw.metadata = child_meta(&vw_name, &b.namespace, &name, key, &owner);
            vw
        })
        .collect();
    Children {
        forks,
        locals,
        virtuals,
    }
}

/// The entry of `child` (a workload of sandbox `sandbox`) in the sandbox's RoutingConfig.
pub(super) fn workload_ref<K: Resource>(
    kind: SandboxedKind,
    child: &K,
    sandbox: &str,
) -> SandboxedWorkloadRef {
    SandboxedWorkloadRef {
        kind,
        namespace: child.meta().namespace.clone().unwrap_or_default(),
        name: child.meta().name.clone().unwrap_or_default(),
        sandbox: sandbox.to_owned(),
    }
}

/// The RoutingConfig of `sb`'s key, routing `workloads`.
pub(super) fn routing_config(
    sb: &Sandbox,
    key: &str,
    workloads: Vec<SandboxedWorkloadRef>,
) -> RoutingConfig {
    let name = sb.name_any();
    let mut rc = RoutingConfig::new(
        &names::sandbox_routing_config_name(&name),
        RoutingConfigSpec {
            routing_key: key.to_owned(),
            workloads,
        },
    );
    rc.metadata.labels = Some(child_labels(&name, key));
    rc.metadata.owner_references = Some(owner(sb));
    rc
}

pub(super) fn owner(sb: &Sandbox) -> Vec<OwnerReference> {
    sb.controller_owner_ref(&()).into_iter().collect()
}

fn child_meta(
    name: &str,
    namespace: &str,
    sandbox: &str,
    key: &str,
    owner: &[OwnerReference],
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(namespace.to_owned()),
        labels: Some(child_labels(sandbox, key)),
        owner_references: Some(owner.to_vec()),
        ..ObjectMeta::default()
    }
}

pub(super) fn child_labels(sandbox: &str, key: &str) -> std::collections::BTreeMap<String, String> {
    std::collections::BTreeMap::from([
        (
            labels::MANAGED_BY.to_owned(),
            labels::MANAGED_BY_VALUE.to_owned(),
        ),
        (labels::SANDBOX.to_owned(), sandbox.to_owned()),
        (labels::ROUTING_KEY.to_owned(), key.to_owned()),
    ])
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    pub(in crate::sandbox) fn sandbox() -> Sandbox {
        serde_json::from_value(json!({
            "apiVersion": Sandbox::api_version(&()), "kind": "Sandbox",
            "metadata": {"name": "sb1", "uid": "u-1", "generation": 1},
            "spec": {
                "workstation": "ws1",
                "forks": [{"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "web"}}],
                "local": [{"name": "api", "from": {"kind": "Deployment", "namespace": "shop", "name": "api"},
                           "mappings": [{"port": 8080, "toLocal": "localhost:8080"}]}],
                "virtual": [{"name": "cart", "workload": {"kind": "Deployment", "namespace": "shop", "name": "cart"}}]
            }
        }))
        .unwrap()
    }

    #[test]
    fn every_child_is_labelled_owned_and_keyed() {
        let sb = sandbox();
        let c = children(&sb, "k1", true);
        assert_eq!((c.forks.len(), c.locals.len(), c.virtuals.len()), (1, 1, 1));
        let fw = &c.forks[0];
        assert_eq!(fw.namespace().as_deref(), Some("shop"));
        assert_eq!(fw.spec.routing_key, "k1");
        assert_eq!(fw.spec.sandbox, "sb1");
        assert_eq!(fw.labels()[labels::ROUTING_KEY], "k1");
        assert_eq!(fw.owner_references()[0].uid, "u-1");
        assert_eq!(c.locals[0].spec.workstation, "ws1");
        assert_eq!(c.virtuals[0].spec.name, "cart");
    }

    #[test]
    fn an_unbound_sandbox_makes_no_local_workloads() {
        let c = children(&sandbox(), "k1", false);
        assert!(c.locals.is_empty());
        assert_eq!(c.forks.len(), 1);
    }

    #[test]
    fn the_routing_config_lists_the_workloads_under_the_key() {
        let sb = sandbox();
        let c = children(&sb, "k1", true);
        let refs = vec![workload_ref(
            SandboxedKind::ForkedWorkload,
            &c.forks[0],
            "sb1",
        )];
        let rc = routing_config(&sb, "k1", refs);
        assert_eq!(rc.name_any(), names::sandbox_routing_config_name("sb1"));
        assert_eq!(rc.spec.routing_key, "k1");
        assert_eq!(rc.spec.workloads[0].namespace, "shop");
        assert_eq!(rc.spec.workloads[0].name, c.forks[0].name_any());
        assert_eq!(rc.labels()[labels::SANDBOX], "sb1");
    }
}
