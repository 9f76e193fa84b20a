//! A ForkedWorkload's status from its fork and its baseline's pods, as pure functions.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::{Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, READY, reasons, set_now};
use spur_api::keys::labels;
use spur_api::workloads::PodWithoutSidecar;
use spur_api::{ForkedWorkload, ForkedWorkloadStatus, ServiceMapping, SidecarCoverage};

/// The status of a fork that cannot be built (nothing of it is left).
pub(super) fn failed(
    st: &mut ForkedWorkloadStatus,
    fw: &ForkedWorkload,
    reason: &str,
    message: &str,
) {
    st.fork = None;
    st.services.clear();
    set_ready(st, fw, ConditionStatus::False, reason, message);
}

/// Whether a fork Deployment serves, and whether what serves is its current template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Serving {
    /// A pod of it is ready: keyed requests can be routed to it.
    pub(super) ready: bool,
    /// Its current template is rolled out (`crate::fork::deployment_rolled_out`).
    pub(super) current: bool,
}

/// The status of a fork whose objects were applied: its Service `mappings`, the `baseline` and
/// its `sidecars`, and Ready once the fork Deployment is (`serving`). While a change rolls out
/// and a pod of the previous build still serves, Ready stays True (the routes stay) but keeps
/// the generation it was last observed at: the Sandbox is Ready at this generation only once
/// its fork runs it (what automatic smart tests wait for).
pub(super) fn observed(
    st: &mut ForkedWorkloadStatus,
    fw: &ForkedWorkload,
    ns: &str,
    mappings: Vec<ServiceMapping>,
    baseline: &Deployment,
    sidecars: Option<SidecarCoverage>,
    serving: Serving,
) {
    let name = fw.name_any();
    st.fork = Some(name.clone());
    st.services = mappings;
    st.baseline = Some(spur_api::workloads::BaselineObservation {
        uid: baseline.uid().unwrap_or_default(),
        generation: baseline.meta().generation,
    });
    st.baseline_sidecars = sidecars;
    if serving.ready && !serving.current {
        let before = spur_api::conditions::find_condition(&st.conditions, READY)
            .filter(|c| c.status == "True")
            .and_then(|c| c.observed_generation);
        set_now(
            &mut st.conditions,
            before,
            READY,
            ConditionStatus::True,
            "ForkRollingOut",
            &format!(
                "the fork serves its previous version while Deployment {ns}/{name} rolls out the change"
            ),
        );
        return;
    }
    let (status, reason, message) = if serving.ready {
        (
            ConditionStatus::True,
            "ForkReady",
            "the fork is ready".to_string(),
        )
    } else {
        (
            ConditionStatus::False,
            reasons::FORK_NOT_READY,
            format!("waiting for Deployment {ns}/{name} to become ready"),
        )
    };
    set_ready(st, fw, status, reason, &message);
}

fn set_ready(
    st: &mut ForkedWorkloadStatus,
    fw: &ForkedWorkload,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    set_now(
        &mut st.conditions,
        fw.meta().generation,
        READY,
        status,
        reason,
        message,
    );
}

/// How many of a baseline's `pods` (from its selector) are running with a sidecar, and which
/// are not, sorted by name: the coverage names the first [`SidecarCoverage::MAX_NAMED`] of
/// them, in the same order.
pub(super) fn coverage(pods: &[Pod]) -> (SidecarCoverage, Vec<&Pod>) {
    let (mut total, mut injected, mut ready) = (0u32, 0u32, 0u32);
    let mut missing = Vec::new();
    for pod in pods {
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        // Fork pods never match a baseline selector (the fork drops those labels); skip any
        // that would rather than count a fork as a baseline pod.
        if pod.metadata.deletion_timestamp.is_some()
            || matches!(phase, Some("Succeeded" | "Failed"))
            || pod.labels().contains_key(labels::FORK)
        {
            continue;
        }
        total += 1;
        let (has, is_ready) = sidecar_state(pod);
        injected += u32::from(has);
        ready += u32::from(is_ready);
        if !has {
            missing.push(pod);
        }
    }
    missing.sort_by_key(|p| p.name_any());
    let mut coverage = SidecarCoverage::new(total, injected, ready);
    for pod in missing.iter().take(SidecarCoverage::MAX_NAMED) {
        coverage.without_sidecar.push(PodWithoutSidecar {
            name: pod.name_any(),
            reason: why_no_sidecar(pod),
        });
    }
    (coverage, missing)
}

/// Why a pod has no sidecar, from what the webhook wrote on it (or did not).
fn why_no_sidecar(pod: &Pod) -> String {
    use spur_api::keys::injection as keys;
    let annotations = pod.annotations();
    match (
        annotations.get(keys::STATUS).map(String::as_str),
        annotations.get(keys::INJECT).map(String::as_str),
    ) {
        (Some("skipped"), _) => format!(
            "not injected: {}",
            annotations
                .get(keys::REASON)
                .map_or("no reason recorded", String::as_str)
        ),
        (Some("injected"), _) => "injected, but the sidecar container is gone".into(),
        (_, Some("false")) => format!("opted out ({}=false)", keys::INJECT),
        (_, Some("true")) => "opted in, but created without passing the injection webhook (unreachable or failing then; failurePolicy Ignore): restart it once injection works".into(),
        _ => format!(
            "not opted in (annotation {0}=\"true\" or namespace label {0}=true), or created while the injection webhook was unreachable",
            keys::INJECT
        ),
    }
}

/// Whether the pod has the injected sidecar, and whether the kubelet reports it ready (a native
/// sidecar's status is among the init container statuses).
fn sidecar_state(pod: &Pod) -> (bool, bool) {
    const NAME: &str = spur_api::keys::injection::SIDECAR_CONTAINER;
    let Some(spec) = &pod.spec else {
        return (false, false);
    };
    let has = spec.containers.iter().any(|c| c.name == NAME)
        || spec
            .init_containers
            .as_deref()
            .unwrap_or_default()
            .iter()
            .any(|c| c.name == NAME);
    let ready = pod.status.as_ref().is_some_and(|st| {
        st.init_container_statuses
            .iter()
            .flatten()
            .chain(st.container_statuses.iter().flatten())
            .any(|c| c.name == NAME && c.ready)
    });
    (has, has && ready)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;
    use spur_api::conditions::find_condition;
    use spur_api::keys::injection::{INJECT, REASON, SIDECAR_CONTAINER, STATUS};

    use super::super::desired::tests::{baseline, fw};
    use super::*;

    const CURRENT: Serving = Serving {
        ready: true,
        current: true,
    };
    const NOT_READY: Serving = Serving {
        ready: false,
        current: false,
    };

    fn ready(st: &ForkedWorkloadStatus) -> (&str, &str, &str) {
        let c = find_condition(&st.conditions, READY).unwrap();
        (&c.status, &c.reason, &c.message)
    }

    /// A running pod named `name`: with the sidecar (`Some(ready)`) or without, annotated.
    fn pod(name: &str, sidecar: Option<bool>, annotations: serde_json::Value) -> Pod {
        let mut containers = vec![json!({"name": "api", "image": "api"})];
        let mut statuses = Vec::new();
        if let Some(ready) = sidecar {
            containers.push(json!({"name": SIDECAR_CONTAINER, "image": "spur"}));
            statuses.push(
                json!({"name": SIDECAR_CONTAINER, "ready": ready, "restartCount": 0,
                                 "image": "spur", "imageID": ""}),
            );
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "shop", "annotations": annotations},
            "spec": {"containers": containers},
            "status": {"phase": "Running", "containerStatuses": statuses}
        }))
        .unwrap()
    }

    #[test]
    fn ready_follows_the_fork_deployment() {
        let (fw, base) = (fw(), baseline());
        let mut st = ForkedWorkloadStatus::default();
        observed(&mut st, &fw, "shop", Vec::new(), &base, None, NOT_READY);
        assert_eq!(
            ready(&st),
            (
                "False",
                "ForkNotReady",
                "waiting for Deployment shop/sb-api to become ready"
            )
        );
        assert_eq!(st.fork.as_deref(), Some("sb-api"));
        let seen = st.baseline.clone().unwrap();
        assert_eq!((seen.uid.as_str(), seen.generation), ("base-uid", Some(7)));
        observed(&mut st, &fw, "shop", Vec::new(), &base, None, CURRENT);
        assert_eq!(ready(&st).1, "ForkReady");
        let c = find_condition(&st.conditions, READY).unwrap();
        assert_eq!(c.observed_generation, Some(2));

        // A change (generation 3) rolling out while the previous build serves: still Ready
        // (routed), at the generation it was observed at.
        let mut changed = fw.clone();
        changed.metadata.generation = Some(3);
        let rolling = Serving {
            ready: true,
            current: false,
        };
        observed(&mut st, &changed, "shop", Vec::new(), &base, None, rolling);
        let c = find_condition(&st.conditions, READY).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.observed_generation),
            ("True", "ForkRollingOut", Some(2))
        );
        observed(&mut st, &changed, "shop", Vec::new(), &base, None, CURRENT);
        let c = find_condition(&st.conditions, READY).unwrap();
        assert_eq!(
            (c.reason.as_str(), c.observed_generation),
            ("ForkReady", Some(3))
        );
    }

    #[test]
    fn a_failed_fork_reports_no_fork_and_no_services() {
        let (fw, base) = (fw(), baseline());
        let mut st = ForkedWorkloadStatus::default();
        let mapping: ServiceMapping = serde_json::from_value(json!({
            "baselineService": "api", "sandboxService": "sb-api", "ports": []
        }))
        .unwrap();
        observed(&mut st, &fw, "shop", vec![mapping], &base, None, CURRENT);
        failed(
            &mut st,
            &fw,
            "BaselineNotFound",
            "Deployment shop/api not found",
        );
        assert!(st.fork.is_none() && st.services.is_empty());
        assert_eq!(
            ready(&st),
            ("False", "BaselineNotFound", "Deployment shop/api not found")
        );
    }

    #[test]
    fn coverage_counts_running_baseline_pods_and_names_those_without_a_sidecar() {
        let mut fork_pod = pod("fork", None, json!({}));
        fork_pod
            .labels_mut()
            .insert(labels::FORK.into(), "sb-api".into());
        let mut done = pod("done", None, json!({}));
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        let pods = [
            pod("b", None, json!({(INJECT): "false"})),
            pod("ok", Some(true), json!({})),
            pod("starting", Some(false), json!({})),
            pod(
                "a",
                None,
                json!({(STATUS): "skipped", (REASON): "hostNetwork"}),
            ),
            fork_pod,
            done,
        ];
        let (c, missing) = coverage(&pods);
        assert_eq!((c.pods, c.injected, c.ready, c.all_ready), (4, 2, 1, false));
        let named: Vec<(&str, &str)> = (c.without_sidecar.iter())
            .map(|p| (p.name.as_str(), p.reason.as_str()))
            .collect();
        assert_eq!(
            named,
            vec![
                ("a", "not injected: hostNetwork"),
                ("b", "opted out (sidecar.spur.dev/inject=false)")
            ]
        );
        let missing: Vec<String> = missing.iter().map(|p| p.name_any()).collect();
        assert_eq!(missing, vec!["a".to_string(), "b".to_string()]);
    }

    #[test]
    fn coverage_names_at_most_max_named_pods() {
        let pods: Vec<Pod> = (0..SidecarCoverage::MAX_NAMED + 2)
            .map(|i| pod(&format!("p{i:02}"), None, json!({})))
            .collect();
        let (c, missing) = coverage(&pods);
        assert_eq!(missing.len(), pods.len());
        assert_eq!(c.without_sidecar.len(), SidecarCoverage::MAX_NAMED);
        assert!(c.without_sidecar[0].reason.starts_with("not opted in"));
    }

    #[test]
    fn why_no_sidecar_reads_the_webhooks_marks() {
        let reason = |a: serde_json::Value| why_no_sidecar(&pod("p", None, a));
        assert_eq!(
            reason(json!({(STATUS): "skipped"})),
            "not injected: no reason recorded"
        );
        assert_eq!(
            reason(json!({(STATUS): "injected"})),
            "injected, but the sidecar container is gone"
        );
        assert!(reason(json!({(INJECT): "true"})).starts_with("opted in, but"));
    }
}
