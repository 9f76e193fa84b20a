//! Job status writes: read, change, replace with the read `resourceVersion`, again on a
//! conflict. The controllers and the attempt drivers all write Job status; optimistic
//! concurrency keeps one writer from undoing another's change.

use kube::Api;
use kube::api::PostParams;
use spur_api::Job;
use spur_api::conditions::set_now;
use spur_api::jobs::JobStatus;

use crate::Error;

/// How often a conflicting write is retried.
const ATTEMPTS: usize = 8;

/// Applies `change` to the current status of `name`. `change` returns false to write nothing
/// (the job is no longer in the state it expected). Returns the job as written, or `None` when
/// it is gone or `change` declined.
pub(crate) async fn update(
    api: &Api<Job>,
    name: &str,
    mut change: impl FnMut(&Job, &mut JobStatus) -> bool,
) -> Result<Option<Job>, Error> {
    for _ in 0..ATTEMPTS {
        let Some(mut job) = api.get_opt(name).await? else {
            return Ok(None);
        };
        let mut st = job.status.clone().unwrap_or_default();
        if !change(&job, &mut st) {
            return Ok(None);
        }
        if job.status.as_ref() == Some(&st) {
            return Ok(Some(job));
        }
        st.observed_generation = job.metadata.generation;
        job.status = Some(st);
        match api.replace_status(name, &PostParams::default(), &job).await {
            Ok(j) => return Ok(Some(j)),
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    }
    Err(Error::Pending(format!(
        "a status write of Job {name} without conflicts"
    )))
}

pub(crate) fn now_string() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

pub(crate) fn condition(
    st: &mut JobStatus,
    job: &Job,
    type_: &str,
    ok: bool,
    reason: &str,
    message: &str,
) {
    set_now(
        &mut st.conditions,
        job.metadata.generation,
        type_,
        ok,
        reason,
        message,
    );
}

/// Ends a job that was not running (or whose runner was lost) as canceled by request.
pub(crate) fn canceled_by_request(st: &mut JobStatus, job: &Job, message: &str) {
    st.phase = Some(spur_api::jobs::JobPhase::Canceled);
    st.canceled_by = Some(spur_api::jobs::CanceledBy::Request);
    st.finished_at = Some(now_string());
    condition(st, job, crate::queue::FINISHED, true, "Canceled", message);
}
