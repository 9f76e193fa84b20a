//! What a JobRunnerGroup owns, as pure functions (its runner pods are `crate::pods`, the plan
//! that decides how many is `crate::queue`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use spur_api::JobRunnerGroup;

/// The owner reference the group gives the executor Secret of its namespace when the Secret is
/// made (a plain owner, not a controller: the Secret serves every group of the namespace).
pub(super) fn owner(group: &JobRunnerGroup) -> Option<OwnerReference> {
    group.uid().map(|uid| OwnerReference {
        api_version: "spur.dev/v1alpha1".into(),
        kind: "JobRunnerGroup".into(),
        name: group.name_any(),
        uid,
        controller: None,
        block_owner_deletion: None,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    #[test]
    fn the_group_owns_its_secret_without_controlling_it() {
        let g: JobRunnerGroup = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "JobRunnerGroup",
            "metadata": {"name": "g", "namespace": "ns", "uid": "gu"},
            "spec": {"image": "busybox"}
        }))
        .unwrap();
        let o = owner(&g).unwrap();
        assert_eq!(
            (o.kind.as_str(), o.name.as_str(), o.uid.as_str()),
            ("JobRunnerGroup", "g", "gu")
        );
        assert_eq!((o.controller, o.block_owner_deletion), (None, None));
        let mut unsaved = g.clone();
        unsaved.metadata.uid = None;
        assert_eq!(owner(&unsaved), None);
    }
}
