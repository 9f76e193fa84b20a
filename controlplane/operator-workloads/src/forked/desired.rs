//! What a ForkedWorkload consists of, as pure functions: whether its baseline can be forked,
//! the fork's plan (`crate::fork::plan`) owned by it, and which of its objects are stale.

use std::collections::BTreeSet;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, ResourceExt};
use spur_api::ForkedWorkload;
use spur_api::keys::labels;
use spur_api::sandbox::Customizations;

use crate::baseline::Baseline;
use crate::fork::{ForkId, ForkPlan, plan};

/// Why a fork cannot be built: the reason and message of its Ready condition.
pub(super) type Failure = (&'static str, String);

/// Refuses what no baseline read can fix: a baseline outside the ForkedWorkload's namespace
/// `ns`.
pub(super) fn check(fw: &ForkedWorkload, ns: &str) -> Result<(), Failure> {
    let spec = &fw.spec;
    if spec.baseline.namespace != ns {
        return Err((
            "InvalidBaseline",
            format!(
                "the baseline must be in the ForkedWorkload's namespace {ns}, not {}",
                spec.baseline.namespace
            ),
        ));
    }
    Ok(())
}

/// The fork `name` of `baseline` with `customizations` (the ForkedWorkload's, with
/// `valueFrom.fork` rendered), among the `services` of the namespace.
pub(super) fn fork_plan(
    fw: &ForkedWorkload,
    name: &str,
    baseline: &Baseline,
    customizations: &Customizations,
    services: &[Service],
    policy: &crate::ForkPolicy,
) -> Result<ForkPlan, Failure> {
    let spec = &fw.spec;
    let id = ForkId {
        name,
        sandbox: &spec.sandbox,
        routing_key: &spec.routing_key,
    };
    plan(id, baseline, customizations, services, policy).map_err(|e| ("InvalidCustomization", e))
}

/// The merge patch that makes `current` (a fork Deployment of ours) take `desired`'s Recreate
/// strategy, when apply alone cannot: a Deployment made with RollingUpdate (by an earlier
/// Spur, or an earlier patch of the user's) holds the `rollingUpdate` the API server defaulted,
/// which no field manager owns, so apply keeps it and the API server refuses it beside
/// `Recreate` (kubernetes/kubernetes#24198).
pub(super) fn strategy_reset(
    current: &Deployment,
    desired: &Deployment,
) -> Option<serde_json::Value> {
    let strategy = |d: &Deployment| d.spec.as_ref().and_then(|s| s.strategy.clone());
    let want = strategy(desired)?;
    (want.type_.as_deref() == Some("Recreate")
        && strategy(current).is_some_and(|s| s.rolling_update.is_some()))
    .then(|| serde_json::json!({"spec": {"strategy": {"type": "Recreate", "rollingUpdate": null}}}))
}

/// `plan`'s objects with `fw` as their controller owner.
pub(super) fn owned(mut plan: ForkPlan, fw: &ForkedWorkload) -> ForkPlan {
    let owner = fw.controller_owner_ref(&()).into_iter().collect::<Vec<_>>();
    plan.deployment.metadata.owner_references = Some(owner.clone());
    for (svc, _) in &mut plan.services {
        svc.metadata.owner_references = Some(owner.clone());
    }
    plan
}

/// Whether `meta` is an object this ForkedWorkload controls (its controller owner reference,
/// by uid). The operator writes and deletes only such objects: a Deployment or Service that
/// merely has the fork's name or label is someone else's.
pub(super) fn owned_by(meta: &ObjectMeta, fw: &ForkedWorkload) -> bool {
    let Some(uid) = fw.metadata.uid.as_deref() else {
        return false;
    };
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// The Services among `services` that `fw` made for its fork `name` in `ns` and that are not
/// `wanted` (by name) any more.
pub(super) fn stale<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    fw: &ForkedWorkload,
    ns: &str,
    name: &str,
    wanted: &BTreeSet<String>,
) -> Vec<&'a Service> {
    services
        .into_iter()
        .filter(|svc| {
            svc.namespace().as_deref() == Some(ns)
                && svc.labels().get(labels::FORK).map(String::as_str) == Some(name)
                && !wanted.contains(&svc.name_any())
                && owned_by(&svc.metadata, fw)
        })
        .collect()
}

/// The failure that reports objects in the fork's way (`taken`, as "Kind ns/name"), if any.
pub(super) fn name_conflict(taken: &[String]) -> Option<Failure> {
    (!taken.is_empty()).then(|| {
        (
            "NameConflict",
            format!(
                "{} already exist(s) and belong(s) to something else; the fork leaves them alone (rename the ForkedWorkload or remove them)",
                taken.join(", ")
            ),
        )
    })
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;
    use spur_api::WorkloadKind;

    use super::*;

    pub(in crate::forked) fn fw() -> ForkedWorkload {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ForkedWorkload",
            "metadata": {"name": "sb-api", "namespace": "shop", "uid": "fw-uid", "generation": 2},
            "spec": {"sandbox": "sb", "routingKey": "k1",
                     "baseline": {"kind": "Deployment", "namespace": "shop", "name": "api"}}
        }))
        .unwrap()
    }

    pub(in crate::forked) fn baseline() -> Deployment {
        serde_json::from_value(json!({
            "metadata": {"name": "api", "namespace": "shop", "uid": "base-uid", "generation": 7},
            "spec": {"selector": {"matchLabels": {"app": "api"}},
                     "template": {"metadata": {"labels": {"app": "api"}},
                                  "spec": {"containers": [{"name": "api", "image": "api:1", "ports": [{"containerPort": 8080}]}]}}}
        }))
        .unwrap()
    }

    fn services() -> Vec<Service> {
        vec![
            serde_json::from_value(json!({
                "metadata": {"name": "api", "namespace": "shop"},
                "spec": {"selector": {"app": "api"}, "ports": [{"port": 80, "targetPort": 8080}]}
            }))
            .unwrap(),
        ]
    }

    fn planned() -> ForkPlan {
        let fw = fw();
        fork_plan(
            &fw,
            "sb-api",
            &Baseline::deployment(baseline()),
            &fw.spec.customizations,
            &services(),
            &crate::ForkPolicy::default(),
        )
        .unwrap()
    }

    /// A Service of fork `fork` in `ns`, controlled by the object with `uid`.
    fn service(name: &str, ns: &str, fork: &str, uid: &str) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "labels": {(labels::FORK): fork},
                         "ownerReferences": [{"apiVersion": "spur.dev/v1alpha1",
                             "kind": "ForkedWorkload", "name": fork, "uid": uid,
                             "controller": true}]}
        }))
        .unwrap()
    }

    #[test]
    fn only_baselines_in_the_own_namespace_are_forked() {
        assert_eq!(check(&fw(), "shop"), Ok(()));
        assert_eq!(check(&fw(), "other").unwrap_err().0, "InvalidBaseline");
        let mut rollout = fw();
        rollout.spec.baseline.kind = WorkloadKind::Rollout;
        assert_eq!(check(&rollout, "shop"), Ok(()));
    }

    #[test]
    fn a_rolling_fork_is_reset_before_it_is_applied_as_recreate() {
        let desired = planned().deployment;
        let mut current = desired.clone();
        assert_eq!(strategy_reset(&current, &desired), None);
        current.spec.as_mut().unwrap().strategy = serde_json::from_value(json!(
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}
        ))
        .unwrap();
        let reset = strategy_reset(&current, &desired).unwrap();
        assert_eq!(reset["spec"]["strategy"]["rollingUpdate"], json!(null));
        // A fork patched to roll keeps rolling.
        assert_eq!(strategy_reset(&desired, &current), None);
        assert_eq!(strategy_reset(&current, &current), None);
    }

    #[test]
    fn the_plans_objects_are_owned_by_the_forked_workload() {
        let p = owned(planned(), &fw());
        assert_eq!(p.services.len(), 1);
        assert!(owned_by(&p.deployment.metadata, &fw()));
        assert!(p.services.iter().all(|(s, _)| owned_by(&s.metadata, &fw())));
    }

    #[test]
    fn a_customization_the_policy_refuses_is_invalid() {
        let mut fw = fw();
        fw.spec.customizations = serde_json::from_value(json!({
            "patch": {"type": "json", "value": [
                {"op": "add", "path": "/spec/template/spec/hostNetwork", "value": true}]}
        }))
        .unwrap();
        let e = fork_plan(
            &fw,
            "sb-api",
            &Baseline::deployment(baseline()),
            &fw.spec.customizations,
            &services(),
            &crate::ForkPolicy::default(),
        )
        .unwrap_err();
        assert_eq!(e.0, "InvalidCustomization");
    }

    #[test]
    fn objects_of_the_same_name_but_another_owner_are_not_ours() {
        let mut d = baseline().metadata;
        assert!(!owned_by(&d, &fw()));
        d.owner_references = service("x", "shop", "sb-api", "other-uid")
            .metadata
            .owner_references;
        assert!(!owned_by(&d, &fw()));
        // A ForkedWorkload without a uid yet owns nothing.
        let mut young = fw();
        young.metadata.uid = None;
        assert!(!owned_by(
            &service("x", "shop", "sb-api", "fw-uid").metadata,
            &young
        ));
    }

    #[test]
    fn stale_services_are_our_own_ones_the_plan_dropped() {
        let p = planned();
        let kept = p.services[0].0.name_any();
        let wanted = BTreeSet::from([kept.clone()]);
        let all = [
            service(&kept, "shop", "sb-api", "fw-uid"),
            service("sb-api-old", "shop", "sb-api", "fw-uid"),
            service("sb-api-theirs", "shop", "sb-api", "other-uid"),
            service("sb-api-elsewhere", "other", "sb-api", "fw-uid"),
            service("sb-web-old", "shop", "sb-web", "fw-uid"),
        ];
        let stale: Vec<String> = stale(&all, &fw(), "shop", "sb-api", &wanted)
            .iter()
            .map(|s| s.name_any())
            .collect();
        assert_eq!(stale, vec!["sb-api-old".to_string()]);
    }

    #[test]
    fn a_name_conflict_names_what_is_in_the_way() {
        assert_eq!(name_conflict(&[]), None);
        let (reason, message) =
            name_conflict(&["Deployment shop/sb-api".into(), "Service shop/x".into()]).unwrap();
        assert_eq!(reason, "NameConflict");
        assert!(message.starts_with("Deployment shop/sb-api, Service shop/x already exist(s)"));
    }
}
