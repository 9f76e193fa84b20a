//! The workload a grant is on, and the pod of it a grant picks (docs/access.md, "Quick start").

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use spur_api::access::{TargetKind, TargetRef};
use spur_api::keys::labels::{MANAGED_BY, MANAGED_BY_VALUE, SANDBOX};
use spur_api::names;

use super::DEFAULT_CONTAINER_ANNOTATION;
use super::plan::{self, PodChoice};
use crate::AccessContext;
use spur_operator_core::Error;

/// The workload object (`spec.selector` and `spec.template`), or why it is unusable.
pub(super) async fn workload(
    ctx: &AccessContext,
    ns: &str,
    kind: TargetKind,
    name: &str,
) -> Result<Result<DynamicObject, String>, Error> {
    let (group, version, plural) = match kind {
        TargetKind::Deployment => ("apps", "v1", "deployments"),
        TargetKind::StatefulSet => ("apps", "v1", "statefulsets"),
        TargetKind::DaemonSet => ("apps", "v1", "daemonsets"),
        TargetKind::Rollout => ("argoproj.io", "v1alpha1", "rollouts"),
    };
    let ar = ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: if group.is_empty() {
            version.into()
        } else {
            format!("{group}/{version}")
        },
        kind: kind.as_str().into(),
        plural: plural.into(),
    };
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), ns, &ar);
    match api.get_opt(name).await {
        Ok(Some(o)) => Ok(Ok(o)),
        Ok(None) => Ok(Err(format!("{kind} {ns}/{name} does not exist"))),
        // No such resource at all (Argo Rollouts not installed).
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Err(format!(
            "{kind} {ns}/{name} does not exist ({})",
            s.message
        ))),
        Err(e) => Err(e.into()),
    }
}

/// The workload a request reaches: the template's target, or a sandbox's fork of it.
pub(super) async fn resolve_target(
    ctx: &AccessContext,
    ns: &str,
    target: &TargetRef,
    sandbox: Option<&str>,
) -> Result<Result<DynamicObject, String>, Error> {
    let Some(sandbox) = sandbox else {
        return workload(ctx, ns, target.kind, &target.name).await;
    };
    let Some(kind) = target.kind.forkable() else {
        return Ok(Err(format!("a sandbox cannot fork a {}", target.kind)));
    };
    let fork = names::fork_name(sandbox, &spur_api::WorkloadRef::new(kind, ns, &target.name));
    // Every fork is a Deployment, a Rollout's too (docs/operator.md, "Argo Rollouts").
    let w = match workload(ctx, ns, TargetKind::Deployment, &fork).await? {
        Ok(w) => w,
        Err(_) => {
            return Ok(Err(format!(
                "sandbox {sandbox} has no fork of {target} in {ns}"
            )));
        }
    };
    // A fork is only the sandbox's if the operator made it for that sandbox.
    let labels = w.labels();
    if labels.get(SANDBOX).map(String::as_str) != Some(sandbox)
        || labels.get(MANAGED_BY).map(String::as_str) != Some(MANAGED_BY_VALUE)
    {
        return Ok(Err(format!(
            "Deployment {ns}/{fork} is not a fork of sandbox {sandbox}"
        )));
    }
    Ok(Ok(w))
}

/// A pod of the target (the sandbox's fork of it, with `sandbox`): `wanted` if it is one, else
/// a running one (ready ones first, then by name). A pod is the workload's when its
/// controller chain leads to the workload's uid, not merely when the selector matches it:
/// selectors of different workloads may overlap.
pub(super) async fn pick_pod(
    ctx: &AccessContext,
    ns: &str,
    target: &TargetRef,
    sandbox: Option<&str>,
    wanted: Option<&str>,
) -> Result<PodChoice, Error> {
    let w = match resolve_target(ctx, ns, target, sandbox).await? {
        Ok(w) => w,
        Err(e) => return Ok(PodChoice::Unavailable("NoPod", e)),
    };
    let query = match selector(target, &w) {
        Ok(q) => q,
        Err(e) => return Ok(PodChoice::Unavailable("NoPod", e)),
    };
    let uid = w.metadata.uid.clone().unwrap_or_default();
    let fork = w.name_any();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let listed = pods
        .list(&ListParams::default().labels(&query))
        .await?
        .items;
    let replicasets: Api<k8s_openapi::api::apps::v1::ReplicaSet> =
        Api::namespaced(ctx.client.clone(), ns);
    let mut owners_of_rs: BTreeMap<String, Option<String>> = BTreeMap::new();
    let mut candidates = Vec::new();
    for p in listed {
        let Some(controller) = plan::candidate(&p, sandbox, &fork) else {
            continue;
        };
        if plan::through_replicaset(target.kind, &controller)
            && !owners_of_rs.contains_key(&controller.name)
        {
            let owner = replicasets.get_opt(&controller.name).await?.and_then(|rs| {
                rs.owner_references()
                    .iter()
                    .find(|o| o.controller == Some(true))
                    .map(|o| o.uid.clone())
            });
            owners_of_rs.insert(controller.name.clone(), owner);
        }
        let rs_owner = owners_of_rs
            .get(&controller.name)
            .and_then(Option::as_deref);
        if plan::owned(target.kind, &controller, &uid, rs_owner) {
            candidates.push(p);
        }
    }
    let of_what = match sandbox {
        Some(s) => format!("{target} in sandbox {s}"),
        None => target.to_string(),
    };
    Ok(plan::choose(candidates, wanted, &of_what))
}

/// The label query of workload `w`'s `spec.selector`, or why it has none usable.
fn selector(target: &TargetRef, w: &DynamicObject) -> Result<String, String> {
    let selector: LabelSelector = match w
        .data
        .pointer("/spec/selector")
        .cloned()
        .map(serde_json::from_value)
    {
        Some(Ok(s)) => s,
        _ => return Err(format!("{target} has no usable spec.selector")),
    };
    selector_query(&selector)
        .ok_or_else(|| format!("{target} has an empty or unusable spec.selector"))
}

/// `key=value,key in (a,b),!key` for a label selector; `None` when it selects everything (an
/// empty selector) or uses an operator this does not know.
fn selector_query(s: &LabelSelector) -> Option<String> {
    let mut parts: Vec<String> = s
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in s.match_expressions.iter().flatten() {
        let values = e.values.clone().unwrap_or_default();
        // `in ()` is not a valid query (and selects nothing in the API's own terms).
        if matches!(e.operator.as_str(), "In" | "NotIn") && values.is_empty() {
            return None;
        }
        let values = values.join(",");
        parts.push(match e.operator.as_str() {
            "In" => format!("{} in ({values})", e.key),
            "NotIn" => format!("{} notin ({values})", e.key),
            "Exists" => e.key.clone(),
            "DoesNotExist" => format!("!{}", e.key),
            _ => return None,
        });
    }
    (!parts.is_empty()).then(|| parts.join(","))
}

/// The container `kubectl exec` should name: the pod's default-container annotation, else its
/// first container that is not Spur's injected sidecar (the application's).
pub(super) fn default_container(pod: &Pod) -> Option<String> {
    pod.annotations()
        .get(DEFAULT_CONTAINER_ANNOTATION)
        .cloned()
        .or_else(|| {
            let containers = &pod.spec.as_ref()?.containers;
            containers
                .iter()
                .find(|c| c.name != spur_api::keys::injection::SIDECAR_CONTAINER)
                .or(containers.first())
                .map(|c| c.name.clone())
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    fn deployment(selector: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"selector": selector},
        }))
        .unwrap()
    }

    fn target() -> TargetRef {
        serde_json::from_value(json!({"kind": "Deployment", "name": "web"})).unwrap()
    }

    #[test]
    fn the_workloads_selector_is_the_pod_query() {
        let w = deployment(json!({
            "matchLabels": {"app": "web"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["a", "b"]},
                {"key": "canary", "operator": "DoesNotExist"},
            ],
        }));
        assert_eq!(
            selector(&target(), &w).unwrap(),
            "app=web,tier in (a,b),!canary"
        );
    }

    #[test]
    fn an_empty_or_unknown_selector_selects_nothing() {
        let e = selector(&target(), &deployment(json!({}))).unwrap_err();
        assert_eq!(e, "Deployment/web has an empty or unusable spec.selector");
        let odd = json!({"matchExpressions": [{"key": "a", "operator": "Near"}]});
        assert!(selector(&target(), &deployment(odd)).is_err());
        let empty_in = json!({"matchExpressions": [{"key": "a", "operator": "In", "values": []}]});
        assert!(selector(&target(), &deployment(empty_in)).is_err());
        let e = selector(&target(), &deployment(json!("app=web"))).unwrap_err();
        assert_eq!(e, "Deployment/web has no usable spec.selector");
    }
}
