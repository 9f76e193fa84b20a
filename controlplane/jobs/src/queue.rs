//! What one pass over a runner group decides, as a pure function of the group, its jobs and
//! its pods: which queued jobs go to which idle pods (in submission order), which running jobs
//! lost their pod, and which pods to create or delete.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use spur_api::conditions::is_condition_true;
use spur_api::jobs::{AttemptPhase, JobPhase};
use spur_api::{Job, JobRunnerGroup};

use crate::pods::{RunnerState, TEMPLATE_ANNOTATION, runner_state};
// The queue order and a job's phase are read by `spur job` too, so they live with the Job type.
use spur_api::jobs::created;
pub use spur_api::jobs::{ACCEPTED, FINISHED, phase, queue_key};

/// When `job` entered the queue (Unix seconds): the end of its last attempt (a job queued
/// again after losing its pod), else its creation.
fn entered(job: &Job) -> i64 {
    job.status
        .as_ref()
        .and_then(|s| s.attempts.last())
        .and_then(|a| a.finished_at.as_deref())
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
        .map_or_else(|| created(job), |t| t.as_second())
}

/// The pod of a job's running attempt.
pub fn running_pod(job: &Job) -> Option<&str> {
    let st = job.status.as_ref()?;
    if st.phase != Some(JobPhase::Running) {
        return None;
    }
    st.attempts
        .last()
        .filter(|a| a.phase == AttemptPhase::Running)
        .map(|a| a.pod.as_str())
}

fn accepted(job: &Job) -> bool {
    job.status
        .as_ref()
        .is_some_and(|s| is_condition_true(&s.conditions, ACCEPTED))
}

/// Not yet looked at by the Job controller: no `Accepted` condition either way.
fn unevaluated(job: &Job) -> bool {
    job.status
        .as_ref()
        .is_none_or(|s| !s.conditions.iter().any(|c| c.type_ == ACCEPTED))
}

/// How long a job the Job controller has not looked at holds back the jobs submitted after it
/// (its place in the queue is unknown until then). Past this, a job that cannot be looked at
/// (the API refusing its status writes, say) no longer stalls its group.
pub const EVALUATION_WAIT_SECS: i64 = 30;

/// The decisions of one pass.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// (job, pod), in submission order.
    pub assign: Vec<(String, String)>,
    /// Running jobs whose pod is gone.
    pub lost: Vec<String>,
    /// Queued jobs whose cancel was requested.
    pub cancel_queued: Vec<String>,
    pub create_pods: usize,
    pub delete_pods: Vec<String>,
    pub queued: usize,
    /// When the longest-waiting job not assigned by this pass entered the queue (Unix
    /// seconds): its creation, or the end of its last attempt if it was queued again.
    pub oldest_waiting_since: Option<i64>,
    pub running: usize,
    pub ready: usize,
    pub idle: usize,
    /// Pods that exist and are not going away.
    pub alive: usize,
    pub desired: i32,
}

/// `now` (Unix seconds) decides which not-yet-evaluated jobs still hold the queue back.
pub fn plan(
    group: &JobRunnerGroup,
    jobs: &[Arc<Job>],
    pods: &[Arc<Pod>],
    digest: &str,
    now: i64,
) -> Plan {
    let mut p = Plan::default();
    let by_name = |name: &str| pods.iter().find(|pod| pod.name_any() == name);

    // Pods that ran a job: with reusePods off they are replaced once idle.
    let used: BTreeSet<&str> = jobs
        .iter()
        .filter_map(|j| j.status.as_ref())
        .flat_map(|s| s.attempts.iter().map(|a| a.pod.as_str()))
        .collect();
    let mut busy: BTreeSet<String> = BTreeSet::new();
    let mut queued: Vec<&Arc<Job>> = Vec::new();
    // Jobs the Job controller has not looked at yet may come before any job of their creation
    // second or later (their revision is not known yet): those wait for them.
    let barrier = jobs
        .iter()
        .filter(|j| j.metadata.deletion_timestamp.is_none() && !j.spec.canceled)
        .filter(|j| phase(j) == JobPhase::Queued && unevaluated(j))
        .map(|j| created(j))
        .filter(|c| now - c < EVALUATION_WAIT_SECS)
        .min();
    for job in jobs {
        if job.metadata.deletion_timestamp.is_some() {
            continue;
        }
        match phase(job) {
            JobPhase::Running => match running_pod(job) {
                Some(pod) if by_name(pod).is_some_and(|p| runner_state(p) != RunnerState::Gone) => {
                    busy.insert(pod.to_owned());
                    p.running += 1;
                }
                _ => p.lost.push(job.name_any()),
            },
            JobPhase::Queued => {
                if job.spec.canceled {
                    p.cancel_queued.push(job.name_any());
                } else if accepted(job) && barrier.is_none_or(|b| created(job) < b) {
                    queued.push(job);
                }
            }
            _ => {}
        }
    }
    queued.sort_by_key(|j| queue_key(j));
    p.queued = queued.len();

    let current = |pod: &Pod| {
        pod.annotations()
            .get(TEMPLATE_ANNOTATION)
            .map(String::as_str)
            == Some(digest)
    };
    let mut sorted: Vec<&Arc<Pod>> = pods.iter().collect();
    sorted.sort_by_key(|pod| pod.name_any());
    let mut idle: Vec<String> = Vec::new();
    let mut starting: Vec<String> = Vec::new();
    for pod in sorted {
        let name = pod.name_any();
        let state = runner_state(pod);
        let finished_phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|ph| ph == "Succeeded" || ph == "Failed");
        if state == RunnerState::Gone {
            // Ended but not yet deleted: delete it so it stops counting against the quota.
            if finished_phase && pod.metadata.deletion_timestamp.is_none() {
                p.delete_pods.push(name);
            }
            continue;
        }
        if busy.contains(&name) {
            p.alive += 1;
            if state == RunnerState::Ready {
                p.ready += 1;
            }
            continue;
        }
        let spent = !group.spec.reuse_pods && used.contains(name.as_str());
        if !current(pod) || spent {
            p.delete_pods.push(name);
            continue;
        }
        p.alive += 1;
        match state {
            RunnerState::Ready => {
                p.ready += 1;
                idle.push(name);
            }
            _ => starting.push(name),
        }
    }

    // Assignments, oldest job to the first idle pod.
    let n = queued.len().min(idle.len());
    for (job, pod) in queued.iter().zip(idle.drain(..n)) {
        p.assign.push((job.name_any(), pod));
    }
    p.idle = idle.len();
    p.oldest_waiting_since = queued[n..].iter().map(|j| entered(j)).min();

    let waiting = p.queued - p.assign.len();
    p.desired = group
        .spec
        .desired_replicas(waiting + p.assign.len(), p.running);
    let want = usize::try_from(p.desired).unwrap_or(0);
    if p.alive < want {
        p.create_pods = want - p.alive;
    } else {
        // Too many: starting pods first, then idle ones, newest (last by name) first; never a
        // busy one or one just assigned.
        let mut extra = p.alive - want;
        for name in starting.iter().rev().chain(idle.iter().rev()) {
            if extra == 0 {
                break;
            }
            p.delete_pods.push(name.clone());
            extra -= 1;
            p.alive -= 1;
        }
    }
    p
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    /// 2026-01-01T00:00:10Z: the test jobs were created seconds ago.
    const NOW: i64 = 1_767_225_610;

    fn group(replicas: i32, reuse: bool) -> JobRunnerGroup {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "JobRunnerGroup",
            "metadata": {"name": "g", "namespace": "ns", "uid": "gu"},
            "spec": {"image": "busybox", "replicas": replicas, "reusePods": reuse}
        }))
        .unwrap()
    }

    fn job(name: &str, sec: i64, rev: u64, status: serde_json::Value) -> Arc<Job> {
        let mut st = json!({"submissionRevision": rev, "conditions": [{
            "type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
        if let serde_json::Value::Object(m) = status {
            for (k, v) in m {
                st[k] = v;
            }
        }
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
                "metadata": {"name": name, "namespace": "ns",
                             "creationTimestamp": format!("2026-01-01T00:00:{sec:02}Z")},
                "spec": {"runnerGroup": "g", "command": ["true"]},
                "status": st
            }))
            .unwrap(),
        )
    }

    fn pod(name: &str, ready: bool, digest: &str) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns",
                             "annotations": {TEMPLATE_ANNOTATION: digest}},
                "status": {"phase": "Running", "podIP": "10.0.0.1",
                           "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn queued_jobs_go_to_idle_pods_in_submission_order() {
        let g = group(2, true);
        // Same second: the creation revision decides, not the name.
        let jobs = vec![
            job("c", 5, 30, json!({})),
            job("a", 5, 31, json!({})),
            job("b", 4, 99, json!({})),
        ];
        let pods = vec![pod("g-2", true, "d"), pod("g-1", true, "d")];
        let p = plan(&g, &jobs, &pods, "d", NOW);
        assert_eq!(
            p.assign,
            vec![("b".into(), "g-1".into()), ("c".into(), "g-2".into())]
        );
        assert_eq!((p.queued, p.create_pods, p.delete_pods.len()), (3, 0, 0));
    }

    #[test]
    fn the_oldest_waiting_job_dates_from_its_creation_or_its_requeue() {
        let g = group(1, true);
        let requeued = json!({"attempts": [{"id": 1, "pod": "gone", "phase": "Lost",
            "finishedAt": "2026-01-01T00:00:09Z"}]});
        let jobs = vec![
            job("first", 2, 10, json!({})),
            job("second", 3, 11, json!({})),
            job("again", 1, 5, requeued),
        ];
        let p = plan(&g, &jobs, &[pod("g-1", true, "d")], "d", NOW);
        // `again` is first in submission order and takes the pod; of the two left, `first`
        // has waited since its creation at :02.
        assert_eq!(p.assign, vec![("again".into(), "g-1".into())]);
        assert_eq!(p.oldest_waiting_since, Some(NOW - 8));
        // No pod: `again` waits too, but only since its attempt ended at :09.
        let p = plan(&g, &jobs, &[], "d", NOW);
        assert_eq!(p.oldest_waiting_since, Some(NOW - 8));
        let p = plan(&g, &jobs[2..], &[], "d", NOW);
        assert_eq!(p.oldest_waiting_since, Some(NOW - 1));
        // Nothing waits.
        let p = plan(&g, &jobs[..1], &[pod("g-1", true, "d")], "d", NOW);
        assert_eq!(p.oldest_waiting_since, None);
    }

    #[test]
    fn a_job_not_yet_evaluated_holds_back_those_after_it() {
        let g = group(2, true);
        let mut fresh = (*job("b", 5, 0, json!({}))).clone();
        fresh.status = None; // not seen by the Job controller yet
        let jobs = vec![
            job("early", 4, 10, json!({})),
            Arc::new(fresh),
            job("same-second", 5, 31, json!({})),
            job("later", 6, 40, json!({})),
        ];
        let pods = vec![pod("g-1", true, "d"), pod("g-2", true, "d")];
        let p = plan(&g, &jobs, &pods, "d", NOW);
        assert_eq!(p.assign, vec![("early".into(), "g-1".into())]);
        // Long unevaluated: it no longer holds the queue.
        let p = plan(&g, &jobs, &pods, "d", NOW + EVALUATION_WAIT_SECS);
        assert_eq!(p.assign.len(), 2);
    }

    #[test]
    fn busy_pods_lost_pods_cancels_and_scaling() {
        let g = group(3, true);
        let running = |pod: &str| json!({"phase": "Running", "attempts": [{"id": 1, "pod": pod, "phase": "Running"}]});
        let mut canceled = (*job("x", 1, 1, json!({}))).clone();
        canceled.spec.canceled = true;
        let jobs = vec![
            job("r1", 1, 1, running("g-1")),
            job("r2", 1, 2, running("g-gone")),
            Arc::new(canceled),
            job("q", 2, 3, json!({})),
        ];
        let pods = vec![
            pod("g-1", true, "d"),
            pod("g-2", false, "d"),
            pod("g-old", true, "old"),
        ];
        let p = plan(&g, &jobs, &pods, "d", NOW);
        assert_eq!(p.lost, vec!["r2".to_owned()]);
        assert_eq!(p.cancel_queued, vec!["x".to_owned()]);
        assert!(p.assign.is_empty(), "g-2 is not ready, g-old is stale");
        assert_eq!(p.delete_pods, vec!["g-old".to_owned()]);
        assert_eq!((p.alive, p.create_pods, p.running), (2, 1, 1));

        // Scale down: never the busy pod.
        let g1 = group(1, true);
        let p = plan(&g1, &jobs, &pods, "d", NOW);
        assert_eq!(p.delete_pods, vec!["g-old".to_owned(), "g-2".to_owned()]);
        assert_eq!(p.alive, 1);
    }

    #[test]
    fn without_reuse_a_pod_that_ran_a_job_is_replaced() {
        let g = group(1, false);
        let done = json!({"phase": "Succeeded", "attempts": [{"id": 1, "pod": "g-1", "phase": "Succeeded"}]});
        let jobs = vec![job("done", 1, 1, done), job("next", 2, 2, json!({}))];
        let pods = vec![pod("g-1", true, "d")];
        let p = plan(&g, &jobs, &pods, "d", NOW);
        assert!(p.assign.is_empty());
        assert_eq!(p.delete_pods, vec!["g-1".to_owned()]);
        assert_eq!(p.create_pods, 1);
    }

    #[test]
    fn autoscaling_counts_the_queue() {
        let mut g = group(1, true);
        g.spec.autoscaling = Some(spur_api::jobs::Autoscaling {
            min_replicas: 0,
            max_replicas: 4,
        });
        let jobs: Vec<_> = (0..6)
            .map(|i| job(&format!("j{i}"), 1, i, json!({})))
            .collect();
        let p = plan(&g, &jobs, &[], "d", NOW);
        assert_eq!((p.desired, p.create_pods), (4, 4));
        let p = plan(&g, &[], &[pod("g-1", true, "d")], "d", NOW);
        assert_eq!((p.desired, p.delete_pods.len()), (0, 1));
    }
}
