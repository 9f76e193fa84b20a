//! A JobRunnerGroup's status, and the Job status changes a group pass makes, as pure functions.

use kube::ResourceExt;
use spur_api::conditions::set_now;
use spur_api::jobs::{Attempt, AttemptPhase, JobPhase, JobRunnerGroupStatus, JobStatus};
use spur_api::{Job, JobRunnerGroup};

use crate::pods;
use crate::queue::Plan;

/// The group's `Ready` condition after a pass that carried out `plan`.
pub(super) fn readiness(plan: &Plan) -> (&'static str, String, bool) {
    let message = format!("{} of {} runner(s) ready", plan.ready, plan.desired);
    if plan.ready as i32 >= plan.desired {
        ("Ready", message, true)
    } else {
        ("Scaling", message, false)
    }
}

/// The group's status: counts from `plan` (the assignments it made count as running), or only
/// the pods that exist (`pods`) when there is no plan (an invalid spec).
pub(super) fn group(
    group: &JobRunnerGroup,
    plan: Option<&Plan>,
    pods: usize,
    reason: &str,
    message: &str,
    ready: bool,
) -> JobRunnerGroupStatus {
    let old = group.status.clone().unwrap_or_default();
    let mut st = JobRunnerGroupStatus {
        conditions: old.conditions,
        ..Default::default()
    };
    match plan {
        Some(p) => {
            let assigned = p.assign.len();
            st.replicas = p.alive as i32;
            st.desired_replicas = p.desired;
            st.ready_replicas = p.ready as i32;
            st.idle_replicas = p.idle as i32;
            st.queued = (p.queued - assigned) as i32;
            st.running = (p.running + assigned) as i32;
        }
        None => st.replicas = pods as i32,
    }
    st.selector = Some(pods::labels_selector(&group.name_any()));
    st.observed_generation = group.metadata.generation;
    set_now(
        &mut st.conditions,
        group.metadata.generation,
        "Ready",
        ready,
        reason,
        message,
    );
    st
}

/// Starts the next attempt of a queued job on `pod` at `now`; `false` (write nothing) when the
/// job is no longer queued.
pub(super) fn start_attempt(st: &mut JobStatus, pod: &str, now: &str) -> bool {
    if st.phase.is_some_and(|p| p != JobPhase::Queued) {
        return false;
    }
    let id = st.attempts.last().map_or(1, |a| a.id + 1);
    st.attempts.push(Attempt {
        id,
        pod: pod.to_owned(),
        phase: AttemptPhase::Running,
        started_at: Some(now.to_owned()),
        finished_at: None,
        exit_code: None,
        reason: None,
        message: None,
    });
    st.attempt_count = i32::try_from(st.attempts.len()).unwrap_or(i32::MAX);
    st.phase = Some(JobPhase::Running);
    st.started_at.get_or_insert_with(|| now.to_owned());
    true
}

/// Cancels a queued job whose cancel was requested; `false` when it is no longer queued.
pub(super) fn cancel_queued(job: &Job, st: &mut JobStatus) -> bool {
    if st.phase.is_some_and(|p| p != JobPhase::Queued) {
        return false;
    }
    crate::status::canceled_by_request(st, job, "canceled before it ran");
    true
}

/// The id of the job's latest attempt.
pub(super) fn last_attempt(job: &Job) -> Option<i32> {
    job.status
        .as_ref()
        .and_then(|s| s.attempts.last())
        .map(|a| a.id)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;
    use spur_api::conditions::find_condition;

    use super::*;

    fn a_group(status: serde_json::Value) -> JobRunnerGroup {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "JobRunnerGroup",
            "metadata": {"name": "g", "namespace": "ns", "uid": "gu", "generation": 5},
            "spec": {"image": "busybox", "replicas": 3},
            "status": status
        }))
        .unwrap()
    }

    fn a_job(status: serde_json::Value) -> Job {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
            "metadata": {"name": "j", "namespace": "ns", "generation": 1},
            "spec": {"runnerGroup": "g", "command": ["true"]},
            "status": status
        }))
        .unwrap()
    }

    fn plan() -> Plan {
        Plan {
            assign: vec![("j1".into(), "p1".into())],
            queued: 4,
            running: 1,
            ready: 2,
            idle: 1,
            alive: 3,
            desired: 3,
            ..Plan::default()
        }
    }

    #[test]
    fn assignments_made_this_pass_count_as_running() {
        let p = plan();
        let (reason, message, ready) = readiness(&p);
        assert_eq!(
            (reason, message.as_str(), ready),
            ("Scaling", "2 of 3 runner(s) ready", false)
        );
        let st = group(&a_group(json!({})), Some(&p), 9, reason, &message, ready);
        assert_eq!(
            (
                st.replicas,
                st.desired_replicas,
                st.ready_replicas,
                st.idle_replicas
            ),
            (3, 3, 2, 1)
        );
        assert_eq!((st.queued, st.running), (3, 2));
        assert_eq!(st.selector, Some(pods::labels_selector("g")));
        assert_eq!(st.observed_generation, Some(5));
        let c = find_condition(&st.conditions, "Ready").unwrap();
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "Scaling"));
    }

    #[test]
    fn enough_ready_runners_make_the_group_ready() {
        let p = Plan { ready: 3, ..plan() };
        let (reason, message, ready) = readiness(&p);
        assert_eq!(
            (reason, message.as_str(), ready),
            ("Ready", "3 of 3 runner(s) ready", true)
        );
    }

    #[test]
    fn an_invalid_spec_counts_only_the_pods_and_keeps_other_conditions() {
        let old = json!({"replicas": 7, "queued": 2, "conditions": [{
            "type": "Other", "status": "True", "reason": "X", "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
        let st = group(
            &a_group(old),
            None,
            2,
            "InvalidSpec",
            "spec.image: empty",
            false,
        );
        assert_eq!((st.replicas, st.queued, st.desired_replicas), (2, 0, 0));
        assert!(find_condition(&st.conditions, "Other").is_some());
        let c = find_condition(&st.conditions, "Ready").unwrap();
        assert_eq!(
            (c.reason.as_str(), c.message.as_str()),
            ("InvalidSpec", "spec.image: empty")
        );
    }

    #[test]
    fn a_queued_job_gets_the_next_attempt_and_a_running_one_is_left_alone() {
        let mut st: JobStatus = serde_json::from_value(json!({"phase": "Queued", "attempts": [
            {"id": 1, "pod": "old", "phase": "Lost", "startedAt": "2026-01-01T00:00:00Z"}
        ], "startedAt": "2026-01-01T00:00:00Z"}))
        .unwrap();
        assert!(start_attempt(&mut st, "p2", "2026-01-01T00:01:00Z"));
        let a = st.attempts.last().unwrap();
        assert_eq!(
            (a.id, a.pod.as_str(), a.phase),
            (2, "p2", AttemptPhase::Running)
        );
        assert_eq!((st.phase, st.attempt_count), (Some(JobPhase::Running), 2));
        assert_eq!(st.started_at.as_deref(), Some("2026-01-01T00:00:00Z"));
        assert!(!start_attempt(&mut st, "p3", "later"));
        assert_eq!(st.attempts.len(), 2);

        let mut fresh = JobStatus::default();
        assert!(start_attempt(&mut fresh, "p1", "t0"));
        assert_eq!(
            (fresh.attempts[0].id, fresh.started_at.as_deref()),
            (1, Some("t0"))
        );
    }

    #[test]
    fn only_a_queued_job_is_canceled_before_it_runs() {
        let job =
            a_job(json!({"phase": "Queued", "attempts": [{"id": 4, "pod": "p", "phase": "Lost"}]}));
        assert_eq!(last_attempt(&job), Some(4));
        let mut st = job.status.clone().unwrap();
        assert!(cancel_queued(&job, &mut st));
        assert_eq!(st.phase, Some(JobPhase::Canceled));
        let mut running: JobStatus = serde_json::from_value(json!({"phase": "Running"})).unwrap();
        assert!(!cancel_queued(&job, &mut running));
        assert_eq!(running.phase, Some(JobPhase::Running));
        assert_eq!(last_attempt(&a_job(json!({}))), None);
    }
}
