//! Ends the capture of a run whose Job is deleted before the operator ended it: deleted by
//! retention or by hand, or gone with its test or sandbox, before it finished. A pass cannot
//! do it (the Job is gone from the store by the time a pass runs), so the watch of the runs'
//! Jobs hands each deletion here, with the Job's last state. The captures to end wait in a
//! bounded queue for one task that ends them in turn, asking an unavailable store again for a
//! minute. A Job of the same name made again meanwhile is no matter: its capture is started
//! for the same Job, which ends the old one at the store first, and this task ends the old one
//! by its id. What is missed (the queue full, a deletion while no operator led and the Job
//! gone before the next list, the store down for longer) expires at its time, unless a Job of
//! that name is made again.

use kube::ResourceExt;
use kube::runtime::watcher::Event;
use spur_api::jobs::Job;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::store::{self, StoreConfig, StoreError};
use crate::{REPORTED_ANNOTATION, RUN_CAPTURE_ANNOTATION, STORE_RETRY};

/// Captures waiting to be ended, at most.
pub const QUEUE: usize = 256;
/// Times an unavailable store is asked to end one capture ([`STORE_RETRY`] apart).
const ATTEMPTS: u32 = 6;

/// A capture to end: its id and its Job (`namespace/name`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ending {
    pub id: String,
    pub job: String,
}

/// `namespace/name` of `job`: what its capture was started for.
pub fn job_key(job: &Job) -> String {
    format!("{}/{}", job.namespace().unwrap_or_default(), job.name_any())
}

/// The capture a deleted run's Job leaves to end: one the operator started for it and did not
/// end when it reported the run's outcome.
pub fn left(job: &Job) -> Option<Ending> {
    if job.annotations().contains_key(REPORTED_ANNOTATION) {
        return None;
    }
    let id = job.annotations().get(RUN_CAPTURE_ANNOTATION)?;
    Some(Ending {
        id: id.clone(),
        job: job_key(job),
    })
}

/// The tap on the runs' Jobs' watch: queues the capture each deleted one leaves (twice at
/// worst, when a relist finds the deletion again: ending it again finds nothing).
pub fn tap(tx: mpsc::Sender<Ending>) -> impl FnMut(&Event<Job>) + Send + 'static {
    move |event| {
        let Event::Delete(job) = event else {
            return;
        };
        let Some(end) = left(job) else {
            return;
        };
        if let Err(e) = tx.try_send(end) {
            let end = e.into_inner();
            tracing::warn!(
                job = %end.job,
                "too many run captures wait to be ended: this one expires at its time"
            );
        }
    }
}

/// Ends the captures queued on `rx` until `stop` (with no store configured there are none
/// to end: only the queue is emptied).
pub async fn run(
    cfg: Option<StoreConfig>,
    mut rx: mpsc::Receiver<Ending>,
    stop: CancellationToken,
) {
    loop {
        let end = tokio::select! {
            () = stop.cancelled() => return,
            end = rx.recv() => match end {
                Some(end) => end,
                None => return,
            },
        };
        if let Some(cfg) = &cfg {
            end_one(cfg, &end, &stop).await;
        }
    }
}

async fn end_one(cfg: &StoreConfig, end: &Ending, stop: &CancellationToken) {
    for attempt in 1..=ATTEMPTS {
        let ended = match store::own_token(cfg) {
            Ok(token) => store::end(cfg, &end.id, &token, &end.job).await,
            Err(e) => Err(e),
        };
        match ended {
            Ok(()) => {
                tracing::info!(job = %end.job, "ended the capture of a run whose Job was deleted");
                return;
            }
            Err(StoreError::NotFound) => return,
            Err(StoreError::Unavailable(_) | StoreError::Exhausted(_)) if attempt < ATTEMPTS => {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(STORE_RETRY) => {}
                }
            }
            Err(e) => {
                tracing::warn!(
                    job = %end.job,
                    error = %e,
                    "cannot end the capture of a run whose Job was deleted: it expires at its time"
                );
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desired;
    use crate::desired::tests::{sandbox, test};

    fn run_job(annotations: &[(&str, &str)]) -> Job {
        let mut job = desired::run_job(&test("list-items", 1), &sandbox(3, 3, "True"), 3, None)
            .unwrap_or_else(|e| panic!("{e}"));
        for (k, v) in annotations {
            job.annotations_mut().insert((*k).into(), (*v).into());
        }
        job
    }

    #[test]
    fn a_deleted_runs_capture_is_queued_unless_its_outcome_ended_it() {
        let (tx, mut rx) = mpsc::channel(1);
        let mut tap = tap(tx);
        let job = run_job(&[(RUN_CAPTURE_ANNOTATION, "c1")]);

        // Changes, a test without calls, and a reported run leave nothing to end.
        tap(&Event::Apply(job.clone()));
        tap(&Event::Delete(run_job(&[])));
        tap(&Event::Delete(run_job(&[
            (RUN_CAPTURE_ANNOTATION, "c0"),
            (REPORTED_ANNOTATION, "true"),
        ])));
        assert!(rx.try_recv().is_err());

        tap(&Event::Delete(job.clone()));
        assert_eq!(
            rx.try_recv().ok(),
            Some(Ending {
                id: "c1".into(),
                job: job_key(&job)
            })
        );
        assert_eq!(job_key(&job), format!("shop/{}", job.name_any()));

        // A full queue: said, and dropped (it expires at its time).
        let mut other = run_job(&[(RUN_CAPTURE_ANNOTATION, "c2")]);
        other.metadata.name = Some("other".into());
        tap(&Event::Delete(other.clone()));
        tap(&Event::Delete(job.clone()));
        assert_eq!(rx.try_recv().ok().map(|e| e.id), Some("c2".into()));
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn without_a_store_the_queue_is_emptied() {
        let (tx, rx) = mpsc::channel(4);
        let mut tap = tap(tx);
        tap(&Event::Delete(run_job(&[(RUN_CAPTURE_ANNOTATION, "c1")])));
        drop(tap);
        // The sender went with the tap: the task ends once the queue is empty.
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            run(None, rx, CancellationToken::new()),
        )
        .await
        .unwrap();
    }
}
