//! An OLM's status as its units move, as pure functions: which unit runs next, what a pod's
//! end means for its unit, when a failed postStop unit is retried, and the `Ready` condition.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use k8s_openapi::jiff::Timestamp;
use kube::{Resource, ResourceExt};
use spur_api::ObjectLifecycleMethods;
use spur_api::conditions::{READY, set_now};
use spur_api::resources::{
    ExecUnitRef, OlmPhase, OlmStatus, UnitPhase, UnitStatus, WorkUnit, Workflow, reserved,
};

use super::ResourceConfig;

/// Where a workflow stands after a pass.
pub(super) enum Progress {
    /// Every unit succeeded.
    Done,
    /// A unit failed for good (preStart only).
    Failed(String, String),
    /// A unit runs, or waits for its retry (look again after this long at the latest).
    Waiting(Option<Duration>),
}

/// Status entries in spec order (a new OLM, or entries from an older spec are dropped).
pub(super) fn in_spec_order(units: &[WorkUnit], current: &[UnitStatus]) -> Vec<UnitStatus> {
    units
        .iter()
        .map(|u| {
            current
                .iter()
                .find(|s| s.name == u.name)
                .cloned()
                .unwrap_or_else(|| UnitStatus {
                    name: u.name.clone(),
                    ..UnitStatus::default()
                })
        })
        .collect()
}

/// How long a failed unit still waits for its next attempt (a little more, so the pass that
/// wakes finds it due); `None` once it is due.
pub(super) fn retry_wait(us: &UnitStatus, now: Timestamp) -> Option<Duration> {
    us.retry_at
        .as_deref()
        .and_then(|t| t.parse::<Timestamp>().ok())
        .map(|at| at.duration_since(now))
        .and_then(|d| Duration::try_from(d).ok())
        .filter(|d| !d.is_zero())
        .map(|wait| wait + Duration::from_millis(100))
}

/// The wait before the attempt after attempt `attempts`: doubling from the first, capped.
pub(super) fn backoff(cfg: &ResourceConfig, attempts: i32) -> Duration {
    let n = u32::try_from(attempts.saturating_sub(1).clamp(0, 16)).unwrap_or(0);
    cfg.retry_base
        .saturating_mul(1u32 << n.min(16))
        .min(cfg.retry_max)
}

/// A postStop unit that cannot run: the outputs its inputs name were never written.
pub(super) fn skip(us: &mut UnitStatus, missing: &[String], now: Timestamp) {
    us.phase = UnitPhase::Skipped;
    us.finished_at = Some(now.to_string());
    us.message = Some(format!(
        "skipped: its inputs {} come from outputs that were never written (the create step making them failed or never ran)",
        missing.join(", ")
    ));
}

pub(super) fn succeed(us: &mut UnitStatus, now: Timestamp) {
    us.phase = UnitPhase::Succeeded;
    us.finished_at = Some(now.to_string());
    us.message = None;
    us.log_tail = None;
    us.retry_at = None;
}

/// How an attempt failed: why, the end of the log, the step's exit code.
pub(super) struct Failure {
    pub(super) why: String,
    pub(super) tail: Option<String>,
    pub(super) code: Option<i32>,
}

/// Records a failed attempt. A postStop unit (`retry`) waits out its backoff: the second value
/// is then the Warning event's message. A preStart unit fails its workflow.
pub(super) fn fail(
    us: &mut UnitStatus,
    cfg: &ResourceConfig,
    workflow: Workflow,
    f: Failure,
    retry: bool,
    now: Timestamp,
) -> (Progress, Option<String>) {
    let Failure { why, tail, code } = f;
    us.phase = UnitPhase::Failed;
    us.exit_code = code;
    us.log_tail = tail;
    us.finished_at = Some(now.to_string());
    if !retry {
        us.message = Some(why.clone());
        return (Progress::Failed(us.name.clone(), why), None);
    }
    let wait = backoff(cfg, us.attempts);
    us.retry_at = Some((now + wait).to_string());
    us.message = Some(format!(
        "attempt {} failed: {why}; retrying in {}s",
        us.attempts,
        wait.as_secs()
    ));
    let event = format!(
        "{} unit {} attempt {} failed: {why}; retrying in {}s",
        workflow.as_str(),
        us.name,
        us.attempts,
        wait.as_secs()
    );
    (
        Progress::Waiting(Some(wait + Duration::from_millis(100))),
        Some(event),
    )
}

/// Starts the unit's next attempt; returns the name of its pod (recorded before it exists).
pub(super) fn next_attempt(us: &mut UnitStatus, olm: &str, namespace: &str) -> String {
    us.attempts = us.attempts.saturating_add(1);
    us.phase = UnitPhase::Running;
    us.retry_at = None;
    us.exit_code = None;
    let pod_name = format!("{olm}-{}-{}", us.name, us.attempts);
    us.exec_unit = Some(ExecUnitRef {
        name: pod_name.clone(),
        namespace: namespace.to_owned(),
        uid: String::new(),
    });
    us.message = Some(format!("attempt {}: starting pod {pod_name}", us.attempts));
    pod_name
}

/// An attempt whose pod could not be made (a template the operator cannot run, or one the
/// API server refuses): failed, to be tried again at `retry_at` (postStop) at the earliest.
pub(super) fn refused(us: &mut UnitStatus, why: String, retry_at: Timestamp) {
    us.phase = UnitPhase::Failed;
    us.message = Some(why);
    us.retry_at = Some(retry_at.to_string());
}

pub(super) fn set_unit(st: &mut OlmStatus, workflow: Workflow, us: &UnitStatus) {
    let units = st.units_mut(workflow);
    match units.iter_mut().find(|u| u.name == us.name) {
        Some(u) => *u = us.clone(),
        None => units.push(us.clone()),
    }
}

pub(super) fn owned_by(pod: &Pod, olm: &ObjectLifecycleMethods) -> bool {
    let uid = olm.meta().uid.as_deref();
    pod.owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && Some(o.uid.as_str()) == uid)
}

/// What a unit's pod's status says.
#[derive(Debug, PartialEq)]
pub(super) enum PodOutcome {
    Succeeded,
    /// The container whose log explains it, why, the exit code.
    Failed(&'static str, String, Option<i32>),
    /// Still going: the unit's message (what the pod waits for, if anything).
    Running(String),
}

pub(super) fn pod_outcome(status: &PodStatus, attempts: i32, pod: &str) -> PodOutcome {
    match status.phase.as_deref() {
        Some("Succeeded") => PodOutcome::Succeeded,
        Some("Failed") => {
            let init_failed = status.init_container_statuses.iter().flatten().find(|c| {
                c.name == reserved::INIT_CONTAINER
                    && c.state
                        .as_ref()
                        .and_then(|s| s.terminated.as_ref())
                        .is_some_and(|t| t.exit_code != 0)
            });
            let (container, what) = match init_failed {
                Some(_) => (reserved::INIT_CONTAINER, "fetching its inputs failed"),
                None => (reserved::STEP_CONTAINER, "the step failed"),
            };
            let code = terminated_code(status, container);
            let why = match (code, status.reason.as_deref()) {
                (Some(c), _) => format!("{what} (exit code {c})"),
                (None, Some(r)) => format!("{what}: pod {r}"),
                (None, None) => what.to_string(),
            };
            PodOutcome::Failed(container, why, code)
        }
        _ => {
            // Say what the pod waits for (an image pull, a missing Secret...).
            let waiting = status
                .init_container_statuses
                .iter()
                .flatten()
                .chain(status.container_statuses.iter().flatten())
                .find_map(|c| {
                    c.state
                        .as_ref()
                        .and_then(|s| s.waiting.as_ref())
                        .and_then(|w| {
                            w.reason
                                .clone()
                                .map(|r| (c.name.clone(), r, w.message.clone()))
                        })
                });
            PodOutcome::Running(match waiting {
                Some((c, r, m)) if r != "PodInitializing" && r != "ContainerCreating" => format!(
                    "attempt {attempts}: container {c} waits: {r}{}",
                    m.map(|m| format!(": {m}")).unwrap_or_default()
                ),
                _ => format!("attempt {attempts}: pod {pod} runs"),
            })
        }
    }
}

fn terminated_code(status: &PodStatus, container: &str) -> Option<i32> {
    status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten())
        .find(|c| c.name == container)
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref())
        .map(|t| t.exit_code)
}

/// An OLM whose spec is invalid: failed before anything ran.
pub(super) fn invalid(st: &mut OlmStatus, olm: &ObjectLifecycleMethods, why: &str) {
    st.phase = OlmPhase::Failed;
    st.failed_phase = Some(Workflow::PreStart);
    set_ready(st, olm, false, "Invalid", why);
}

/// The phase and condition after a preStart pass; the Warning event's message when a unit
/// failed.
pub(super) fn started(
    st: &mut OlmStatus,
    olm: &ObjectLifecycleMethods,
    step: &Progress,
) -> Option<String> {
    match step {
        Progress::Done => {
            st.phase = OlmPhase::Started;
            set_ready(st, olm, true, "Started", "every preStart unit succeeded");
            None
        }
        Progress::Failed(unit, why) => {
            st.phase = OlmPhase::Failed;
            st.failed_phase = Some(Workflow::PreStart);
            let msg = format!("preStart unit {unit} failed: {why}");
            set_ready(st, olm, false, "UnitFailed", &msg);
            Some(format!("unit {unit} failed: {why}"))
        }
        Progress::Waiting(_) => {
            st.phase = OlmPhase::Starting;
            set_ready(st, olm, false, "Starting", "the preStart workflow runs");
            None
        }
    }
}

/// The phase and condition after a postStop pass; when to look again while it is not done.
pub(super) fn stopped(
    st: &mut OlmStatus,
    olm: &ObjectLifecycleMethods,
    step: &Progress,
) -> Option<Duration> {
    match step {
        Progress::Done => {
            st.phase = OlmPhase::Stopped;
            set_ready(st, olm, false, "Stopped", "every postStop unit succeeded");
            None
        }
        Progress::Failed(unit, why) => {
            // Not reached for postStop (failures are retried), but never silently done.
            let msg = format!("postStop unit {unit}: {why}");
            set_ready(st, olm, false, "UnitFailed", &msg);
            Some(Duration::from_secs(30))
        }
        Progress::Waiting(after) => {
            set_ready(st, olm, false, "Stopping", "the postStop workflow runs");
            Some(after.unwrap_or(Duration::from_secs(60)))
        }
    }
}

fn set_ready(
    st: &mut OlmStatus,
    olm: &ObjectLifecycleMethods,
    ok: bool,
    reason: &str,
    message: &str,
) {
    set_now(
        &mut st.conditions,
        olm.meta().generation,
        READY,
        ok,
        reason,
        message,
    );
    st.observed_generation = olm.meta().generation;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;
    use spur_api::conditions::find_condition;

    use super::*;
    use crate::olm::desired::tests::{cfg, olm};

    fn unit(v: serde_json::Value) -> UnitStatus {
        serde_json::from_value(v).unwrap()
    }

    fn pod_status(v: serde_json::Value) -> PodStatus {
        serde_json::from_value(v).unwrap()
    }

    fn now() -> Timestamp {
        "2026-01-01T00:00:00Z".parse().unwrap()
    }

    #[test]
    fn post_stop_backoff_doubles_to_its_cap() {
        let c = cfg();
        let waits: Vec<u64> = (1..=7).map(|a| backoff(&c, a).as_secs()).collect();
        assert_eq!(waits, [10, 20, 40, 80, 160, 300, 300]);
    }

    #[test]
    fn statuses_follow_the_spec_and_keep_what_they_knew() {
        let o = olm();
        let kept = in_spec_order(
            &o.spec.pre_start,
            &[
                unit(json!({"name": "gone", "phase": "Succeeded"})),
                unit(json!({"name": "user", "phase": "Running", "attempts": 2})),
            ],
        );
        assert_eq!(kept.len(), 1);
        assert_eq!((kept[0].phase, kept[0].attempts), (UnitPhase::Running, 2));
        let fresh = in_spec_order(&o.spec.pre_start, &[]);
        assert_eq!(
            (fresh[0].name.as_str(), fresh[0].phase),
            ("user", UnitPhase::Pending)
        );
    }

    #[test]
    fn a_failed_unit_waits_until_its_retry_is_due() {
        let waiting =
            unit(json!({"name": "u", "phase": "Failed", "retryAt": "2026-01-01T00:00:20Z"}));
        assert_eq!(
            retry_wait(&waiting, now()),
            Some(Duration::from_millis(20_100))
        );
        let due = unit(json!({"name": "u", "phase": "Failed", "retryAt": "2025-12-31T23:59:00Z"}));
        assert_eq!(retry_wait(&due, now()), None);
        let garbled = unit(json!({"name": "u", "phase": "Failed", "retryAt": "soon"}));
        assert_eq!(retry_wait(&garbled, now()), None);
    }

    #[test]
    fn a_failed_post_stop_attempt_is_retried_after_its_backoff() {
        let mut us = unit(json!({"name": "drop", "phase": "Running", "attempts": 2}));
        let f = Failure {
            why: "the step failed (exit code 1)".into(),
            tail: Some("oops".into()),
            code: Some(1),
        };
        let (progress, event) = fail(&mut us, &cfg(), Workflow::PostStop, f, true, now());
        assert!(
            matches!(progress, Progress::Waiting(Some(d)) if d == Duration::from_millis(20_100))
        );
        assert_eq!(us.phase, UnitPhase::Failed);
        assert_eq!(
            (us.exit_code, us.log_tail.as_deref()),
            (Some(1), Some("oops"))
        );
        assert_eq!(us.retry_at.as_deref(), Some("2026-01-01T00:00:20Z"));
        assert_eq!(
            us.message.as_deref(),
            Some("attempt 2 failed: the step failed (exit code 1); retrying in 20s")
        );
        assert_eq!(
            event.as_deref(),
            Some(
                "postStop unit drop attempt 2 failed: the step failed (exit code 1); retrying in 20s"
            )
        );
    }

    #[test]
    fn a_failed_pre_start_attempt_fails_the_workflow() {
        let mut us = unit(json!({"name": "user", "phase": "Running", "attempts": 1}));
        let f = Failure {
            why: "fetching its inputs failed (exit code 2)".into(),
            tail: None,
            code: Some(2),
        };
        let (progress, event) = fail(&mut us, &cfg(), Workflow::PreStart, f, false, now());
        let Progress::Failed(name, why) = progress else {
            panic!("not failed");
        };
        assert_eq!(name, "user");
        assert_eq!(why, "fetching its inputs failed (exit code 2)");
        assert_eq!(event, None);
        assert_eq!(us.retry_at, None);
        assert_eq!(us.message.as_deref(), Some(why.as_str()));
    }

    #[test]
    fn an_attempt_names_its_pod_before_it_exists() {
        let mut us = unit(
            json!({"name": "user", "phase": "Failed", "attempts": 1, "exitCode": 3, "retryAt": "x"}),
        );
        let pod = next_attempt(&mut us, "db-1", "spur-resources");
        assert_eq!(pod, "db-1-user-2");
        assert_eq!((us.phase, us.attempts), (UnitPhase::Running, 2));
        assert_eq!((us.exit_code, us.retry_at.as_deref()), (None, None));
        let e = us.exec_unit.unwrap();
        assert_eq!(
            (e.name.as_str(), e.namespace.as_str(), e.uid.as_str()),
            ("db-1-user-2", "spur-resources", "")
        );
        let mut st = OlmStatus::default();
        let mut us = unit(json!({"name": "user"}));
        set_unit(&mut st, Workflow::PostStop, &us);
        us.attempts = 4;
        set_unit(&mut st, Workflow::PostStop, &us);
        assert_eq!(st.post_stop.len(), 1);
        assert_eq!(st.post_stop[0].attempts, 4);
        assert!(st.pre_start.is_empty());
    }

    #[test]
    fn skipped_and_succeeded_units_record_when() {
        let mut us =
            unit(json!({"name": "drop", "phase": "Pending", "logTail": "x", "retryAt": "y"}));
        skip(&mut us, &["create.dsn".into()], now());
        assert_eq!(us.phase, UnitPhase::Skipped);
        assert!(
            us.message
                .as_deref()
                .unwrap()
                .contains("inputs create.dsn come from outputs")
        );
        succeed(&mut us, now());
        assert_eq!(us.phase, UnitPhase::Succeeded);
        assert_eq!(
            (us.message.clone(), us.log_tail.clone(), us.retry_at.clone()),
            (None, None, None)
        );
        assert_eq!(us.finished_at.as_deref(), Some("2026-01-01T00:00:00Z"));
    }

    #[test]
    fn a_pods_end_says_which_container_failed_and_how() {
        let init_failed = pod_status(json!({"phase": "Failed", "initContainerStatuses": [{
            "name": "spur-io-init", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 4}}
        }]}));
        assert_eq!(
            pod_outcome(&init_failed, 1, "p"),
            PodOutcome::Failed(
                "spur-io-init",
                "fetching its inputs failed (exit code 4)".into(),
                Some(4)
            )
        );
        let evicted = pod_status(json!({"phase": "Failed", "reason": "Evicted"}));
        assert_eq!(
            pod_outcome(&evicted, 1, "p"),
            PodOutcome::Failed("step", "the step failed: pod Evicted".into(), None)
        );
        assert_eq!(
            pod_outcome(&pod_status(json!({"phase": "Succeeded"})), 1, "p"),
            PodOutcome::Succeeded
        );
    }

    #[test]
    fn a_running_pod_says_what_it_waits_for() {
        let pulling = pod_status(json!({"phase": "Pending", "containerStatuses": [{
            "name": "step", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}
        }]}));
        assert_eq!(
            pod_outcome(&pulling, 3, "p"),
            PodOutcome::Running(
                "attempt 3: container step waits: ImagePullBackOff: no such image".into()
            )
        );
        let creating = pod_status(json!({"phase": "Pending", "containerStatuses": [{
            "name": "step", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ContainerCreating"}}
        }]}));
        assert_eq!(
            pod_outcome(&creating, 1, "p"),
            PodOutcome::Running("attempt 1: pod p runs".into())
        );
    }

    #[test]
    fn the_workflows_outcome_sets_phase_and_condition() {
        let o = olm();
        let reason = |st: &OlmStatus| {
            find_condition(&st.conditions, READY)
                .unwrap()
                .reason
                .clone()
        };
        let mut st = OlmStatus::default();
        assert_eq!(started(&mut st, &o, &Progress::Waiting(None)), None);
        assert_eq!(
            (st.phase, reason(&st)),
            (OlmPhase::Starting, "Starting".to_string())
        );
        let event = started(&mut st, &o, &Progress::Failed("user".into(), "boom".into()));
        assert_eq!(event.as_deref(), Some("unit user failed: boom"));
        assert_eq!(
            (st.phase, st.failed_phase),
            (OlmPhase::Failed, Some(Workflow::PreStart))
        );
        assert_eq!(started(&mut st, &o, &Progress::Done), None);
        assert_eq!(
            (st.phase, reason(&st)),
            (OlmPhase::Started, "Started".to_string())
        );
        assert_eq!(st.observed_generation, Some(1));

        let mut st = OlmStatus::default();
        assert_eq!(
            stopped(&mut st, &o, &Progress::Waiting(None)),
            Some(Duration::from_secs(60))
        );
        assert_eq!(reason(&st), "Stopping");
        let after = Some(Duration::from_secs(7));
        assert_eq!(stopped(&mut st, &o, &Progress::Waiting(after)), after);
        assert_eq!(
            stopped(&mut st, &o, &Progress::Failed("d".into(), "x".into())),
            Some(Duration::from_secs(30))
        );
        assert_eq!(reason(&st), "UnitFailed");
        assert_eq!(stopped(&mut st, &o, &Progress::Done), None);
        assert_eq!(
            (st.phase, reason(&st)),
            (OlmPhase::Stopped, "Stopped".to_string())
        );

        let mut st = OlmStatus::default();
        invalid(&mut st, &o, "spec: bad");
        assert_eq!(
            (st.phase, reason(&st)),
            (OlmPhase::Failed, "Invalid".to_string())
        );
    }
}
