//! A baseline workload as the workload controllers read it: a Deployment as it is, an Argo
//! Rollout as the Deployment it stands for (its pod template, selector and replicas), so forks,
//! local and virtual workloads are planned one way for both kinds.
//!
//! A Rollout's fork is a Deployment, not a Rollout (docs/operator.md, "Argo Rollouts"): a fork
//! runs one build for one developer, so the baseline's canary steps, analysis and traffic
//! routing have nothing to do there, and a second Rollout naming the same `canaryService` or
//! `stableService` would have Argo rewrite the user's Services' selectors. As a Deployment it
//! needs neither the Argo controller nor any right on Rollouts beyond reading them.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{PodTemplateSpec, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::api::{ApiResource, DynamicObject};
use kube::{Api, Client, ResourceExt};
use serde::Deserialize;
use spur_api::WorkloadKind;
use spur_api::keys::labels;
use spur_controller::verified::Verified;

use crate::Error;

/// The label Argo Rollouts puts on a Rollout's ReplicaSets and pods and adds to the selectors
/// of the Services its strategy names (`stableService`, `canaryService`, `activeService`,
/// `previewService`). It is never in the Rollout's template.
pub const ROLLOUT_HASH_LABEL: &str = "rollouts-pod-template-hash";

/// The annotation Argo Rollouts puts on a Service it took over for a Rollout's strategy: the
/// Rollout's name.
pub const MANAGED_BY_ROLLOUTS: &str = "argo-rollouts.argoproj.io/managed-by-rollouts";

/// Why a baseline cannot be used: the reason and message of a Ready condition.
pub type Failure = (&'static str, String);

/// A baseline workload, read.
#[derive(Debug, Clone, PartialEq)]
pub struct Baseline {
    pub kind: WorkloadKind,
    /// A Deployment, or the Deployment a Rollout stands for: the Rollout's metadata (name,
    /// namespace, uid, generation, labels), its selector and replicas, and its pod template
    /// (the `workloadRef` Deployment's when it has one).
    pub workload: Deployment,
    /// Labels Argo adds to some of a Rollout's pods by strategy (`canaryMetadata`,
    /// `stableMetadata`, `activeMetadata`, `previewMetadata`): a Service may select on them.
    ephemeral: Vec<BTreeMap<String, String>>,
    /// The pod-template hashes of a Rollout's current ReplicaSets (`status.stableRS`,
    /// `status.currentPodHash`).
    hashes: Vec<String>,
}

impl Baseline {
    /// A Deployment baseline.
    pub fn deployment(workload: Deployment) -> Self {
        Baseline {
            kind: WorkloadKind::Deployment,
            workload,
            ephemeral: Vec::new(),
            hashes: Vec::new(),
        }
    }

    pub fn name(&self) -> String {
        self.workload.name_any()
    }

    pub fn namespace(&self) -> String {
        self.workload.namespace().unwrap_or_default()
    }

    /// "Rollout shop/web", for messages.
    pub fn describe(&self) -> String {
        format!("{} {}/{}", self.kind, self.namespace(), self.name())
    }

    /// The labels of the pod template.
    pub fn template_labels(&self) -> BTreeMap<String, String> {
        self.workload
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.labels.clone())
            .unwrap_or_default()
    }

    /// Whether `svc`'s selector picks this baseline's pods: every key a label of its pod
    /// template, of equal value. For a Rollout also the labels its strategy gives some of its
    /// pods, and the pod-template hash Argo adds to the Services it takes over (it names one
    /// ReplicaSet, stable or canary) when the Service is this Rollout's (Argo's annotation) or
    /// the hash one of its current ReplicaSets'. At least one key must be a template label: the
    /// hash or strategy labels alone could be any Rollout's.
    pub fn selects(&self, svc: &Service) -> bool {
        let Some(selector) = svc.spec.as_ref().and_then(|s| s.selector.as_ref()) else {
            return false;
        };
        let pod = self.template_labels();
        let rollout = self.kind == WorkloadKind::Rollout;
        let ours = || {
            svc.annotations()
                .get(MANAGED_BY_ROLLOUTS)
                .map(String::as_str)
                == self.workload.metadata.name.as_deref()
        };
        selector.iter().any(|(k, v)| pod.get(k) == Some(v))
            && selector.iter().all(|(k, v)| {
                pod.get(k) == Some(v)
                    || (rollout && k == ROLLOUT_HASH_LABEL && (ours() || self.hashes.contains(v)))
                    || (rollout && self.ephemeral.iter().any(|m| m.get(k) == Some(v)))
            })
    }

    /// Services among `services` whose selector picks the baseline's pods, by name. The
    /// operator's own sandbox Services never stand for a baseline.
    pub fn selecting<'a>(&self, services: &'a [Service]) -> Vec<&'a Service> {
        let mut out: Vec<&Service> = services
            .iter()
            .filter(|svc| {
                svc.labels().get(labels::MANAGED_BY).map(String::as_str)
                    != Some(labels::MANAGED_BY_VALUE)
                    && self.selects(svc)
            })
            .collect();
        out.sort_by_key(|s| s.name_any());
        out
    }
}

/// Argo Rollouts' Rollout resource (`argoproj.io/v1alpha1`).
pub fn rollout_resource() -> ApiResource {
    ApiResource {
        group: "argoproj.io".into(),
        version: "v1alpha1".into(),
        api_version: "argoproj.io/v1alpha1".into(),
        kind: "Rollout".into(),
        plural: "rollouts".into(),
    }
}

/// Reads the baseline `kind` `ns/name`: `Ok(Err(_))` when it does not exist or cannot be used.
/// Deployments come through `cache` when there is one (read again only when their metadata
/// changed); a controller whose passes another watch wakes passes `None`, so that it never
/// reads an older version than the one that woke it.
pub async fn read(
    client: &Client,
    cache: Option<&Verified<Deployment>>,
    kind: WorkloadKind,
    ns: &str,
    name: &str,
) -> Result<Result<Baseline, Failure>, Error> {
    let deployment = async |name: &str| -> Result<Option<Deployment>, Error> {
        Ok(match cache {
            Some(cache) => cache
                .get_opt(client, ns, name)
                .await?
                .map(Arc::unwrap_or_clone),
            None => {
                Api::<Deployment>::namespaced(client.clone(), ns)
                    .get_opt(name)
                    .await?
            }
        })
    };
    match kind {
        WorkloadKind::Deployment => Ok(match deployment(name).await? {
            Some(d) => Ok(Baseline::deployment(d)),
            None => Err(not_found(kind, ns, name)),
        }),
        WorkloadKind::Rollout => {
            let rollouts: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), ns, &rollout_resource());
            // A cluster without Argo Rollouts answers 404 for the resource itself: get_opt
            // reads that as a missing object too.
            let Some(rollout) = rollouts.get_opt(name).await? else {
                return Ok(Err(not_found(kind, ns, name)));
            };
            let spec = match RolloutSpec::of(&rollout) {
                Ok(spec) => spec,
                Err(message) => return Ok(Err(invalid(ns, name, message))),
            };
            let referenced = match &spec.workload_ref {
                None => None,
                Some(r) => {
                    if let Err(message) = r.check() {
                        return Ok(Err(invalid(ns, name, message)));
                    }
                    let Some(d) = deployment(&r.name).await? else {
                        return Ok(Err((
                            "BaselineNotFound",
                            format!(
                                "Deployment {ns}/{} (the workloadRef of Rollout {ns}/{name}) not found",
                                r.name
                            ),
                        )));
                    };
                    Some(d)
                }
            };
            Ok(rollout_view(&rollout, spec, referenced.as_ref()).map_err(|m| invalid(ns, name, m)))
        }
    }
}

/// The failure of a baseline that does not exist.
pub fn not_found(kind: WorkloadKind, ns: &str, name: &str) -> Failure {
    let hint = match kind {
        WorkloadKind::Deployment => "",
        WorkloadKind::Rollout => " (or Argo Rollouts is not installed)",
    };
    (
        "BaselineNotFound",
        format!("{kind} {ns}/{name} not found{hint}"),
    )
}

fn invalid(ns: &str, name: &str, message: String) -> Failure {
    (
        "InvalidBaseline",
        format!("Rollout {ns}/{name} cannot be a baseline: {message}"),
    )
}

/// What Spur reads of a Rollout's spec (Argo's `RolloutSpec`).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RolloutSpec {
    replicas: Option<i32>,
    selector: Option<LabelSelector>,
    template: Option<PodTemplateSpec>,
    workload_ref: Option<WorkloadRef>,
    min_ready_seconds: Option<i32>,
    progress_deadline_seconds: Option<i32>,
    revision_history_limit: Option<i32>,
    strategy: Option<Strategy>,
}

/// What Spur reads of a Rollout's status: the hashes of its current ReplicaSets.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RolloutStatus {
    #[serde(rename = "stableRS")]
    stable_rs: Option<String>,
    current_pod_hash: Option<String>,
}

impl RolloutStatus {
    /// An unreadable or missing status names no hash (Argo has not looked at it yet).
    fn hashes(rollout: &DynamicObject) -> Vec<String> {
        let st: RolloutStatus = rollout
            .data
            .get("status")
            .and_then(|s| serde_json::from_value(s.clone()).ok())
            .unwrap_or_default();
        let mut out: Vec<String> = [st.stable_rs, st.current_pod_hash]
            .into_iter()
            .flatten()
            .collect();
        out.dedup();
        out
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WorkloadRef {
    api_version: Option<String>,
    kind: Option<String>,
    name: String,
}

impl WorkloadRef {
    /// Spur reads a template from an `apps/v1` Deployment only (Argo also takes a PodTemplate
    /// or a ReplicaSet).
    fn check(&self) -> Result<(), String> {
        let ok = self.kind.as_deref() == Some("Deployment")
            && self.api_version.as_deref() == Some("apps/v1");
        if ok {
            Ok(())
        } else {
            Err(format!(
                "its workloadRef is a {} {}, not an apps/v1 Deployment",
                self.api_version.as_deref().unwrap_or("(no apiVersion)"),
                self.kind.as_deref().unwrap_or("(no kind)")
            ))
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Strategy {
    canary: Option<Canary>,
    blue_green: Option<BlueGreen>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Canary {
    canary_metadata: Option<PodMetadata>,
    stable_metadata: Option<PodMetadata>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct BlueGreen {
    active_metadata: Option<PodMetadata>,
    preview_metadata: Option<PodMetadata>,
}

#[derive(Deserialize, Default)]
struct PodMetadata {
    labels: Option<BTreeMap<String, String>>,
}

impl RolloutSpec {
    fn of(rollout: &DynamicObject) -> Result<Self, String> {
        let spec = rollout
            .data
            .get("spec")
            .ok_or_else(|| "it has no spec".to_string())?;
        serde_json::from_value(spec.clone()).map_err(|e| format!("its spec is not readable: {e}"))
    }

    fn ephemeral(&self) -> Vec<BTreeMap<String, String>> {
        let Some(s) = &self.strategy else {
            return Vec::new();
        };
        let canary = s.canary.as_ref();
        let blue_green = s.blue_green.as_ref();
        [
            canary.and_then(|c| c.canary_metadata.as_ref()),
            canary.and_then(|c| c.stable_metadata.as_ref()),
            blue_green.and_then(|b| b.active_metadata.as_ref()),
            blue_green.and_then(|b| b.preview_metadata.as_ref()),
        ]
        .into_iter()
        .flatten()
        .filter_map(|m| m.labels.clone())
        .filter(|l| !l.is_empty())
        .collect()
    }
}

/// The Deployment `rollout` stands for, given its `spec` and the Deployment its `workloadRef`
/// names (`referenced`, read by the caller). The message says what is missing.
fn rollout_view(
    rollout: &DynamicObject,
    spec: RolloutSpec,
    referenced: Option<&Deployment>,
) -> Result<Baseline, String> {
    let ephemeral = spec.ephemeral();
    let from_ref = referenced.and_then(|d| d.spec.as_ref());
    let mut template = match (spec.workload_ref.is_some(), from_ref) {
        (true, Some(d)) => d.template.clone(),
        (true, None) => return Err("its workloadRef Deployment has no spec".into()),
        (false, _) => spec
            .template
            .ok_or_else(|| "it has neither a template nor a workloadRef".to_string())?,
    };
    if template.spec.is_none() {
        return Err("its pod template has no spec".into());
    }
    // Argo never writes its hash into the template; one copied in by hand would pin the fork
    // to a ReplicaSet's Services.
    if let Some(l) = template.metadata.as_mut().and_then(|m| m.labels.as_mut()) {
        l.remove(ROLLOUT_HASH_LABEL);
    }
    // Argo defaults a workloadRef Rollout's selector to the Deployment's.
    let selector = spec
        .selector
        .or_else(|| from_ref.map(|d| d.selector.clone()))
        .ok_or_else(|| "it has no selector".to_string())?;
    let m = &rollout.metadata;
    let workload = Deployment {
        metadata: ObjectMeta {
            name: m.name.clone(),
            namespace: m.namespace.clone(),
            uid: m.uid.clone(),
            generation: m.generation,
            labels: m.labels.clone(),
            annotations: m.annotations.clone(),
            ..ObjectMeta::default()
        },
        spec: Some(DeploymentSpec {
            replicas: spec.replicas,
            selector,
            template,
            min_ready_seconds: spec.min_ready_seconds,
            progress_deadline_seconds: spec.progress_deadline_seconds,
            revision_history_limit: spec.revision_history_limit,
            strategy: None,
            paused: None,
        }),
        status: None,
    };
    Ok(Baseline {
        kind: WorkloadKind::Rollout,
        workload,
        ephemeral,
        hashes: RolloutStatus::hashes(rollout),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn rollout(spec: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
            "metadata": {"name": "web", "namespace": "shop", "uid": "u-r", "generation": 4},
            "spec": spec,
            "status": {"stableRS": "s1", "currentPodHash": "c2", "phase": "Paused"},
        }))
        .unwrap()
    }

    fn view(spec: serde_json::Value, referenced: Option<&Deployment>) -> Result<Baseline, String> {
        let r = rollout(spec);
        let s = RolloutSpec::of(&r)?;
        rollout_view(&r, s, referenced)
    }

    fn template(labels: serde_json::Value) -> serde_json::Value {
        json!({"metadata": {"labels": labels},
               "spec": {"containers": [{"name": "web", "image": "web:1"}]}})
    }

    fn service(name: &str, selector: serde_json::Value) -> Service {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"selector": selector, "ports": [{"port": 80}]}
        }))
        .unwrap()
    }

    /// A Service Argo took over for Rollout `rollout`.
    fn argo_service(name: &str, rollout: &str, selector: serde_json::Value) -> Service {
        let mut svc = service(name, selector);
        svc.annotations_mut()
            .insert(MANAGED_BY_ROLLOUTS.into(), rollout.into());
        svc
    }

    #[test]
    fn a_canary_rollout_is_read_as_its_template_and_its_services_as_its_own() {
        let b = view(
            json!({
                "replicas": 3,
                "selector": {"matchLabels": {"app": "web"}},
                "template": template(json!({"app": "web", ROLLOUT_HASH_LABEL: "abc"})),
                "strategy": {"canary": {
                    "canaryService": "web-canary", "stableService": "web-stable",
                    "canaryMetadata": {"labels": {"role": "canary"}},
                    "stableMetadata": {"labels": {"role": "stable"}},
                    "steps": [{"setWeight": 20}, {"pause": {}}]}}
            }),
            None,
        )
        .unwrap();
        assert_eq!(b.kind, WorkloadKind::Rollout);
        assert_eq!(b.describe(), "Rollout shop/web");
        assert_eq!(b.workload.uid().as_deref(), Some("u-r"));
        assert_eq!(b.workload.metadata.generation, Some(4));
        let spec = b.workload.spec.as_ref().unwrap();
        assert_eq!(spec.replicas, Some(3));
        // The hash is dropped from the template: it names one of Argo's ReplicaSets.
        assert_eq!(
            b.template_labels(),
            BTreeMap::from([("app".to_string(), "web".to_string())])
        );
        let services = [
            service("web", json!({"app": "web"})),
            // What Argo makes of the strategy's Services: the hash of the stable or canary
            // ReplicaSet added to their selectors, and its annotation.
            argo_service(
                "web-stable",
                "web",
                json!({"app": "web", ROLLOUT_HASH_LABEL: "s1"}),
            ),
            argo_service(
                "web-canary",
                "web",
                json!({"app": "web", ROLLOUT_HASH_LABEL: "c2"}),
            ),
            // Between Argo's writes: a hash not in status yet, on a Service Argo says is ours;
            // a hash in status, on a Service without the annotation.
            argo_service(
                "web-next",
                "web",
                json!({"app": "web", ROLLOUT_HASH_LABEL: "n3"}),
            ),
            service("web-plain", json!({"app": "web", ROLLOUT_HASH_LABEL: "s1"})),
            service("web-role", json!({"app": "web", "role": "stable"})),
            service("other", json!({"app": "other"})),
            service("wrong-role", json!({"app": "web", "role": "blue"})),
            // Another Rollout of the same app label: its Services are not this one's.
            argo_service(
                "api-stable",
                "api",
                json!({"app": "web", ROLLOUT_HASH_LABEL: "zz"}),
            ),
            service("api-plain", json!({"app": "web", ROLLOUT_HASH_LABEL: "zz"})),
            // The hash or the strategy's labels alone could be any Rollout's.
            argo_service("hash-only", "web", json!({ROLLOUT_HASH_LABEL: "s1"})),
            service("role-only", json!({"role": "stable"})),
        ];
        let names: Vec<String> = b
            .selecting(&services)
            .iter()
            .map(|s| s.name_any())
            .collect();
        assert_eq!(
            names,
            [
                "web",
                "web-canary",
                "web-next",
                "web-plain",
                "web-role",
                "web-stable"
            ]
        );
    }

    #[test]
    fn a_deployment_gets_no_rollout_allowances() {
        let d: Deployment = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"selector": {"matchLabels": {"app": "web"}},
                     "template": template(json!({"app": "web"}))}
        }))
        .unwrap();
        let b = Baseline::deployment(d);
        let services = [
            service("web", json!({"app": "web"})),
            argo_service(
                "web-stable",
                "web",
                json!({"app": "web", ROLLOUT_HASH_LABEL: "s1"}),
            ),
            service("everything", json!({})),
        ];
        let names: Vec<String> = b
            .selecting(&services)
            .iter()
            .map(|s| s.name_any())
            .collect();
        assert_eq!(names, ["web"]);
    }

    #[test]
    fn a_workload_ref_rollout_runs_the_referenced_template() {
        let d: Deployment = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web-src", "namespace": "shop"},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "web"}},
                     "template": template(json!({"app": "web", "tier": "front"}))}
        }))
        .unwrap();
        let spec = json!({"replicas": 2,
            "workloadRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web-src"}});
        let b = view(spec.clone(), Some(&d)).unwrap();
        let s = b.workload.spec.as_ref().unwrap();
        // Selector from the Deployment when the Rollout has none; replicas are the Rollout's.
        assert_eq!(s.selector, d.spec.as_ref().unwrap().selector);
        assert_eq!(s.replicas, Some(2));
        assert_eq!(
            b.template_labels().get("tier").map(String::as_str),
            Some("front")
        );
        assert_eq!(
            view(spec, None).unwrap_err(),
            "its workloadRef Deployment has no spec"
        );
    }

    #[test]
    fn unusable_rollouts_say_why() {
        assert_eq!(
            view(json!({"selector": {"matchLabels": {"app": "web"}}}), None).unwrap_err(),
            "it has neither a template nor a workloadRef"
        );
        assert_eq!(
            view(json!({"template": template(json!({"app": "web"}))}), None).unwrap_err(),
            "it has no selector"
        );
        assert!(
            view(json!({"replicas": "three"}), None)
                .unwrap_err()
                .starts_with("its spec is not readable")
        );
        let r: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
            "metadata": {"name": "web"}}))
        .unwrap();
        assert!(RolloutSpec::of(&r).is_err());
        let bad = WorkloadRef {
            api_version: Some("apps/v1".into()),
            kind: Some("StatefulSet".into()),
            name: "x".into(),
        };
        assert_eq!(
            bad.check().unwrap_err(),
            "its workloadRef is a apps/v1 StatefulSet, not an apps/v1 Deployment"
        );
        let unversioned = WorkloadRef {
            api_version: None,
            kind: Some("Deployment".into()),
            name: "x".into(),
        };
        assert!(unversioned.check().is_err());
    }
}
