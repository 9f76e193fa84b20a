//! What a fork's Deployment says about itself: the baseline it forks and its sandbox, read by
//! the servers that treat a fork's pods specially (the route server lets them read their
//! baseline's rules; the injection webhook gives them a Kafka relay in fork mode,
//! docs/async.md). One reading, so the two agree on what counts as a fork.

use k8s_openapi::api::apps::v1::Deployment;
use kube::ResourceExt as _;

use crate::keys::{annotations, labels};
use crate::validation::{is_dns_label, is_dns_subdomain};

/// A fork's Deployment, as the operator makes it (`spur-operator-workloads`' fork plan).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForkOf {
    /// The kind of the forked workload: a Rollout's fork is a Deployment too.
    pub kind: crate::WorkloadKind,
    /// The forked Deployment or Rollout, in the fork's own namespace.
    pub baseline: String,
    /// The sandbox the fork belongs to (its `spur.dev/sandbox` label), when it is a sandbox name.
    pub sandbox: Option<String>,
}

/// `Some` when a ForkedWorkload (`spur.dev`) controls `d` and its `spur.dev/baseline`
/// annotation (`Deployment/<namespace>/<name>` or `Rollout/…`) names a workload of `d`'s own
/// namespace.
/// A Deployment that merely carries the annotation or a fork's labels is no fork.
pub fn fork_of(d: &Deployment) -> Option<ForkOf> {
    let forked = d.owner_references().iter().any(|o| {
        o.controller == Some(true)
            && o.kind == "ForkedWorkload"
            && o.api_version.starts_with("spur.dev/")
    });
    if !forked {
        return None;
    }
    let namespace = d.namespace()?;
    let text = d.annotations().get(annotations::BASELINE)?;
    let mut parts = text.splitn(3, '/');
    let (kind, ns, name) = (parts.next()?, parts.next()?, parts.next()?);
    let kind = match kind {
        "Deployment" => crate::WorkloadKind::Deployment,
        "Rollout" => crate::WorkloadKind::Rollout,
        _ => return None,
    };
    if ns != namespace || !is_dns_subdomain(name) {
        return None;
    }
    let sandbox = d
        .labels()
        .get(labels::SANDBOX)
        .filter(|s| is_dns_label(s))
        .cloned();
    Some(ForkOf {
        kind,
        baseline: name.to_owned(),
        sandbox,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn deployment(owner_kind: &str, api_version: &str, baseline: &str) -> Deployment {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "api-sb1", "namespace": "shop",
                "labels": {"spur.dev/sandbox": "sb1"},
                "annotations": {"spur.dev/baseline": baseline},
                "ownerReferences": [{"apiVersion": api_version, "kind": owner_kind,
                                     "name": "sb1-api", "uid": "u1", "controller": true}],
            }
        }))
        .unwrap()
    }

    #[test]
    fn only_a_forked_workloads_deployment_names_another_baseline() {
        let fw = |b: &str| deployment("ForkedWorkload", "spur.dev/v1alpha1", b);
        assert_eq!(
            fork_of(&fw("Deployment/shop/api")),
            Some(ForkOf {
                kind: crate::WorkloadKind::Deployment,
                baseline: "api".into(),
                sandbox: Some("sb1".into())
            })
        );
        assert_eq!(
            fork_of(&fw("Rollout/shop/api")).unwrap().kind,
            crate::WorkloadKind::Rollout
        );
        for (d, why) in [
            (fw("Deployment/other/api"), "another namespace"),
            (fw("ArgoRollout/shop/api"), "not a kind Spur forks"),
            (fw("Deployment/shop/"), "no name"),
            (fw("Deployment/shop/a/b"), "not a name"),
            (fw("Deployment/shop/API"), "not a name"),
            (
                deployment("ReplicaSet", "apps/v1", "Deployment/shop/api"),
                "not a fork's",
            ),
            (
                deployment("ForkedWorkload", "evil.dev/v1", "Deployment/shop/api"),
                "not ours",
            ),
        ] {
            assert_eq!(fork_of(&d), None, "{why}");
        }
        let mut odd = fw("Deployment/shop/api");
        odd.metadata.labels = Some([("spur.dev/sandbox".into(), "Not_A_Name".into())].into());
        assert_eq!(fork_of(&odd).unwrap().sandbox, None);
    }
}
