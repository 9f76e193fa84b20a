//! The Tests condition: where each covering test's run stands, folded into one status, a reason
//! and a message with the counts and the top findings. Pure.

use std::fmt::Write as _;

use kube::ResourceExt;
use spur_api::jobs::{Job, JobPhase};
use spur_smarttest::summary::Outcome;

/// Most bytes of the condition's message (the API allows 32 KiB; this keeps `kubectl describe`
/// readable). What does not fit is cut at a line and counted.
pub const MESSAGE_MAX: usize = 4096;
/// Findings named per test in the message.
pub const TOP_PER_TEST: usize = 3;

/// Where one test's run stands.
#[derive(Debug, Clone, PartialEq)]
pub enum State {
    /// Its creator may not do what a run needs (the message says what), or it has no creator.
    Refused(String),
    /// It cannot run as a Job (the message says why).
    Unrunnable(String),
    /// The sandbox is not Ready at its current generation yet.
    WaitingForSandbox,
    /// Its Job is queued or running.
    Pending { job: String, note: String },
    /// The jobs controller did not accept its Job (no such runner group, one without key
    /// injection...): it waits for someone to fix that, so the verdict is not "running".
    NotAccepted { job: String, why: String },
    /// Its Job ended: the summary it left, or why there is none.
    Finished {
        job: String,
        outcome: Result<Outcome, String>,
    },
}

/// One covering test (`namespace/name`) and its run.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub test: String,
    pub state: State,
}

/// The condition's status, reason and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub status: &'static str,
    pub reason: &'static str,
    pub message: String,
}

/// The reason of a refused `Accepted` that goes away by itself (the key is about to be known):
/// such a Job is still pending.
const TRANSIENT_REFUSAL: &str = "RoutingKeyPending";

/// Where a run's Job stands.
pub fn job_state(job: &Job) -> State {
    let name = job.name_any();
    let st = job.status.clone().unwrap_or_default();
    match st.phase {
        None | Some(JobPhase::Queued) | Some(JobPhase::Running) => {
            let refused = st
                .conditions
                .iter()
                .find(|c| c.type_ == spur_api::jobs::ACCEPTED && c.status == "False");
            match refused {
                Some(c) if c.reason != TRANSIENT_REFUSAL => State::NotAccepted {
                    job: name,
                    why: c.message.clone(),
                },
                Some(c) => State::Pending {
                    job: name,
                    note: format!("not accepted yet: {}", c.message),
                },
                None => State::Pending {
                    job: name,
                    note: match st.phase {
                        Some(JobPhase::Running) => "running",
                        _ => "queued",
                    }
                    .to_owned(),
                },
            }
        }
        Some(phase) => {
            let outcome = match &st.result {
                Some(text) => Outcome::parse(text),
                None => Err(st
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "Finished")
                    .map(|c| format!("{phase:?} without a summary: {}", c.message))
                    .unwrap_or_else(|| format!("{phase:?} without a summary"))),
            };
            State::Finished { job: name, outcome }
        }
    }
}

/// Whether a run may still end by itself (a superseded one is canceled).
pub fn unfinished(state: &State) -> bool {
    matches!(state, State::Pending { .. } | State::NotAccepted { .. })
}

/// Whether a run ended because it was asked to stop (`spec.canceled`: superseded by a newer
/// run, or by hand), not because it failed or timed out: it has no outcome to report.
pub fn canceled_by_request(job: &Job) -> bool {
    job.spec.canceled
        && job
            .status
            .as_ref()
            .is_some_and(|s| s.phase == Some(JobPhase::Canceled))
}

/// The condition for these rows (one per covering test, in a stable order).
pub fn verdict(rows: &[Row]) -> Verdict {
    let (mut passed, mut found, mut failed, mut refused, mut pending, mut waiting) =
        (0, 0, 0, 0, 0, 0);
    let mut not_accepted = 0;
    let mut lines = Vec::new();
    for row in rows {
        let line = match &row.state {
            State::Refused(why) => {
                refused += 1;
                format!("{}: not run: {why}", row.test)
            }
            State::Unrunnable(why) => {
                failed += 1;
                format!("{}: not run: {why}", row.test)
            }
            State::WaitingForSandbox => {
                waiting += 1;
                format!("{}: waiting for the sandbox to be Ready", row.test)
            }
            State::Pending { job, note } => {
                pending += 1;
                format!("{} (job {job}): {note}", row.test)
            }
            State::NotAccepted { job, why } => {
                not_accepted += 1;
                format!("{} (job {job}): not accepted: {why}", row.test)
            }
            State::Finished { job, outcome } => match outcome {
                Ok(Outcome::Ran(s)) if s.passed => {
                    passed += 1;
                    format!(
                        "{} (job {job}): {}",
                        row.test,
                        s.brief_without_values(TOP_PER_TEST)
                    )
                }
                Ok(Outcome::Ran(s)) => {
                    found += 1;
                    format!(
                        "{} (job {job}): {}",
                        row.test,
                        s.brief_without_values(TOP_PER_TEST)
                    )
                }
                Ok(Outcome::Error(e)) => {
                    failed += 1;
                    format!("{} (job {job}): the run could not happen: {e}", row.test)
                }
                Err(e) => {
                    failed += 1;
                    format!("{} (job {job}): {e}", row.test)
                }
            },
        };
        lines.push(line);
    }
    let (status, reason) = if pending + waiting > 0 {
        (
            "Unknown",
            if pending > 0 {
                "Running"
            } else {
                "WaitingForSandbox"
            },
        )
    } else if found > 0 {
        ("False", "Findings")
    } else if failed > 0 {
        ("False", "RunFailed")
    } else if not_accepted > 0 {
        ("False", "NotAccepted")
    } else if refused > 0 {
        ("False", "Refused")
    } else {
        ("True", "Passed")
    };
    let mut counts = Vec::new();
    for (n, what) in [
        (passed, "passed"),
        (found, "with findings"),
        (failed, "failed to run"),
        (not_accepted, "not accepted"),
        (refused, "refused"),
        (pending, "running"),
        (waiting, "waiting"),
    ] {
        if n > 0 {
            counts.push(format!("{n} {what}"));
        }
    }
    let mut message = format!(
        "{} test{}: {}",
        rows.len(),
        if rows.len() == 1 { "" } else { "s" },
        counts.join(", ")
    );
    let mut left = lines.len();
    for line in lines {
        let more = format!(" (and {left} more)");
        if message.len() + 1 + line.len() + more.len() > MESSAGE_MAX {
            // Cut at a character boundary if the line alone is too long for what is left.
            let room = MESSAGE_MAX.saturating_sub(message.len() + 1 + more.len());
            if room > 40 {
                // Room for the ellipsis (3 bytes) too.
                let mut end = (room - 3).min(line.len());
                while !line.is_char_boundary(end) {
                    end -= 1;
                }
                let _ = write!(message, "\n{}…", &line[..end]);
                left -= 1;
            }
            if left > 0 {
                let _ = write!(message, "\n(and {left} more)");
            }
            break;
        }
        let _ = write!(message, "\n{line}");
        left -= 1;
    }
    Verdict {
        status,
        reason,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn job(phase: &str, result: Option<&str>) -> Job {
        let mut status = json!({"phase": phase, "conditions": [
            {"type": "Finished", "status": "True", "reason": phase, "message": "exit code 1",
             "lastTransitionTime": "2026-12-05T00:00:00Z"}]});
        if let Some(r) = result {
            status["result"] = json!(r);
        }
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
            "metadata": {"name": "list-items-00ab", "namespace": "shop"},
            "spec": {"runnerGroup": "smart-tests", "script": "#!/bin/sh\n"},
            "status": status
        }))
        .unwrap()
    }

    const FOUND: &str = r#"{"passed":false,"steps":2,"checksFailed":1,"findings":2,
        "byRank":{"status":1,"schema":1},
        "top":[{"rank":"status","endpoint":"gRPC api:9090/shop.Items/Get","what":"trailer grpc-status: \"0\" → \"14\"","shape":"trailer grpc-status: \"0\" → \"14\"","occurrences":1},
               {"rank":"schema","endpoint":"GET api.shop/items","what":"$.items[*].price: removed 3","shape":"$.items[*].price: removed","occurrences":1}],
        "failedChecks":[{"step":"get","check":"grpc-status 0","sandbox":"grpc-status 14"}],"omitted":0}"#;

    #[test]
    fn a_finished_run_is_read_from_its_summary() {
        let State::Finished { outcome, .. } = job_state(&job("Failed", Some(FOUND))) else {
            panic!()
        };
        assert!(matches!(outcome, Ok(Outcome::Ran(s)) if s.findings == 2));
        let State::Finished { outcome, .. } = job_state(&job("Failed", None)) else {
            panic!()
        };
        assert_eq!(
            outcome.unwrap_err(),
            "Failed without a summary: exit code 1"
        );
        assert!(matches!(
            job_state(&job("Running", None)),
            State::Pending { note, .. } if note == "running"
        ));
    }

    #[test]
    fn the_verdict_counts_and_names_the_top_findings() {
        let rows = vec![
            Row {
                test: "shop/list-items".into(),
                state: job_state(&job("Failed", Some(FOUND))),
            },
            Row {
                test: "shop/quiet".into(),
                state: job_state(&job(
                    "Succeeded",
                    Some(r#"{"passed":true,"steps":4,"checksFailed":0,"findings":0}"#),
                )),
            },
            Row {
                test: "shop/mallory".into(),
                state: State::Refused(
                    "its creator mallory may not create deployments.apps in shop".into(),
                ),
            },
        ];
        let v = verdict(&rows);
        assert_eq!((v.status, v.reason), ("False", "Findings"));
        let lines: Vec<&str> = v.message.lines().collect();
        assert_eq!(lines[0], "3 tests: 1 passed, 1 with findings, 1 refused");
        assert_eq!(
            lines[1],
            "shop/list-items (job list-items-00ab): 2 findings (1 status, 1 schema), 1 check failed: \
             [status] gRPC api:9090/shop.Items/Get: trailer grpc-status: \"0\" → \"14\"; \
             [schema] GET api.shop/items: $.items[*].price: removed; \
             [check] get grpc-status 0: failed"
        );
        assert_eq!(
            lines[2],
            "shop/quiet (job list-items-00ab): passed (4 steps, no findings)"
        );
        assert!(lines[3].starts_with("shop/mallory: not run: its creator mallory"));

        let v = verdict(&rows[1..2]);
        assert_eq!((v.status, v.reason), ("True", "Passed"));
        let mut pending = rows.clone();
        pending.push(Row {
            test: "shop/slow".into(),
            state: job_state(&job("Queued", None)),
        });
        assert_eq!(verdict(&pending).status, "Unknown");
        assert_eq!(verdict(&rows[2..]).reason, "Refused");
    }

    #[test]
    fn only_a_run_asked_to_stop_is_canceled_by_request() {
        let mut superseded = job("Canceled", None);
        superseded.spec.canceled = true;
        assert!(canceled_by_request(&superseded));
        // Its timeout stopped it: a failure to report.
        assert!(!canceled_by_request(&job("Canceled", None)));
        let mut asked = job("Running", None);
        asked.spec.canceled = true;
        assert!(!canceled_by_request(&asked), "not stopped yet");
    }

    /// A Job the jobs controller refused waits for someone to fix its runner group: the
    /// verdict says so instead of "running" forever. A key about to be known is still pending.
    #[test]
    fn a_run_not_accepted_is_not_running() {
        let refused = |reason: &str, message: &str| {
            let mut j = job("Queued", None);
            j.status.as_mut().unwrap().conditions = vec![
                serde_json::from_value(json!({"type": "Accepted", "status": "False",
                    "reason": reason, "message": message,
                    "lastTransitionTime": "2026-12-05T00:00:00Z"}))
                .unwrap(),
            ];
            job_state(&j)
        };
        let state = refused(
            "RunnerGroupNotFound",
            "runner group smart-tests does not exist in namespace shop",
        );
        assert!(unfinished(&state));
        let v = verdict(&[Row {
            test: "shop/list-items".into(),
            state,
        }]);
        assert_eq!((v.status, v.reason), ("False", "NotAccepted"));
        assert_eq!(
            v.message,
            "1 test: 1 not accepted\nshop/list-items (job list-items-00ab): not accepted: \
             runner group smart-tests does not exist in namespace shop"
        );
        let state = refused("RoutingKeyPending", "route group rg has no routing key yet");
        assert!(
            matches!(&state, State::Pending { note, .. } if note.starts_with("not accepted yet"))
        );
        let v = verdict(&[Row {
            test: "shop/list-items".into(),
            state,
        }]);
        assert_eq!((v.status, v.reason), ("Unknown", "Running"));
    }

    #[test]
    fn the_message_is_bounded_and_counts_what_it_leaves_out() {
        let rows: Vec<Row> = (0..200)
            .map(|i| Row {
                test: format!("shop/test-{i}"),
                state: State::Unrunnable("x".repeat(100)),
            })
            .collect();
        let v = verdict(&rows);
        assert!(v.message.len() <= MESSAGE_MAX, "{}", v.message.len());
        assert!(v.message.ends_with("more)"), "{}", v.message);
        let one = vec![Row {
            test: "shop/long".into(),
            state: State::Unrunnable("é".repeat(5000)),
        }];
        let v = verdict(&one);
        assert!(v.message.len() <= MESSAGE_MAX, "{}", v.message.len());
    }
}
