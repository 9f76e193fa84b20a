//! Ends the capture of a run whose Job is deleted before the operator ended it: deleted by
//! retention or by hand, or gone with its test or sandbox, before it finished. A pass cannot
//! do it (the Job is gone from the store by the time a pass runs), so the watch of the runs'
//! Jobs hands each deletion here, with the Job's last state. The captures to end wait in a
//! bounded queue for one task that ends them in turn, asking an unavailable store again for a
//! minute. A run whose Job's capture is still to be ended is not started again until it is:
//! the store would give the new Job the old capture (a start for the same Job resumes it).
//! What is missed (the queue full, a deletion while no operator led and the Job gone before
//! the next list, the store down for longer) expires at its time.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

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

/// The Jobs (`namespace/name`) whose captures are queued or being ended.
#[derive(Debug, Default, Clone)]
pub struct Pending(Arc<Mutex<HashSet<String>>>);

impl Pending {
    fn set(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the capture of the Job `job` (`namespace/name`) is still to be ended.
    pub fn contains(&self, job: &str) -> bool {
        self.set().contains(job)
    }

    fn insert(&self, job: &str) -> bool {
        self.set().insert(job.to_owned())
    }

    fn remove(&self, job: &str) {
        self.set().remove(job);
    }
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

/// The tap on the runs' Jobs' watch: queues the capture each deleted one leaves.
pub fn tap(tx: mpsc::Sender<Ending>, pending: Pending) -> impl FnMut(&Event<Job>) + Send + 'static {
    move |event| {
        let Event::Delete(job) = event else {
            return;
        };
        let Some(end) = left(job) else {
            return;
        };
        if !pending.insert(&end.job) {
            return;
        }
        if let Err(e) = tx.try_send(end) {
            let end = e.into_inner();
            pending.remove(&end.job);
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
    pending: Pending,
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
        pending.remove(&end.job);
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
    fn a_deleted_runs_capture_is_queued_once_unless_its_outcome_ended_it() {
        let (tx, mut rx) = mpsc::channel(1);
        let pending = Pending::default();
        let mut tap = tap(tx, pending.clone());
        let job = run_job(&[(RUN_CAPTURE_ANNOTATION, "c1")]);
        let key = job_key(&job);

        // Changes, a test without calls, and a reported run leave nothing to end.
        tap(&Event::Apply(job.clone()));
        tap(&Event::Delete(run_job(&[])));
        tap(&Event::Delete(run_job(&[
            (RUN_CAPTURE_ANNOTATION, "c0"),
            (REPORTED_ANNOTATION, "true"),
        ])));
        assert!(rx.try_recv().is_err());
        assert!(!pending.contains(&key));

        tap(&Event::Delete(job.clone()));
        assert!(pending.contains(&key), "the Job's next run waits for it");
        // Seen again (a relist's vanished deletion): queued once.
        tap(&Event::Delete(job.clone()));
        assert_eq!(
            rx.try_recv().ok(),
            Some(Ending {
                id: "c1".into(),
                job: key.clone()
            })
        );
        assert!(rx.try_recv().is_err());

        // A full queue: said, and the Job's next run is not held back for it.
        let mut other = run_job(&[(RUN_CAPTURE_ANNOTATION, "c2")]);
        other.metadata.name = Some("other".into());
        tap(&Event::Delete(other.clone()));
        let mut third = run_job(&[(RUN_CAPTURE_ANNOTATION, "c3")]);
        third.metadata.name = Some("third".into());
        tap(&Event::Delete(third.clone()));
        assert!(pending.contains(&job_key(&other)));
        assert!(!pending.contains(&job_key(&third)));
    }

    #[tokio::test]
    async fn without_a_store_the_queue_is_emptied_and_nothing_waits() {
        let (tx, rx) = mpsc::channel(4);
        let pending = Pending::default();
        let mut tap = tap(tx, pending.clone());
        let job = run_job(&[(RUN_CAPTURE_ANNOTATION, "c1")]);
        tap(&Event::Delete(job.clone()));
        drop(tap);
        // The sender went with the tap: the task ends once the queue is empty.
        run(None, rx, pending.clone(), CancellationToken::new()).await;
        assert!(!pending.contains(&job_key(&job)));
    }
}
