//! Automatic smart-test runs (docs/smart-tests.md, "Automatic runs"): when a Sandbox becomes
//! Ready at a new generation, each SmartTest that covers it (`SmartTestSpec::covers`) runs as a
//! Job in the test's namespace, on its runner group, with the sandbox's routing context; the
//! run's summary comes back as the Job's `status.result` and becomes the Sandbox's `Tests`
//! condition and Events.
//!
//! A run acts with its test's creator's rights, not the operator's: the creator (stamped at
//! admission, `spur.dev/created-by`) must be allowed to submit the Job, read the sandbox and
//! create what the sandbox forks (SubjectAccessReviews), or the test is not run and the
//! condition says why.

pub mod condition;
pub mod desired;
pub mod ending;
pub mod store;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use spur_api::Sandbox;
use spur_api::jobs::Job;
use spur_api::keys::labels::SANDBOX;
use spur_api::smarttest::{RUN_TEST_LABEL, SmartTest, TESTS_CONDITION, run_of};
use spur_controller::changes::{changes, changes_tapped, meta_digest, synced};
use spur_operator_core::{Context, Error, controller_config};
use tokio_util::sync::CancellationToken;

use crate::condition::{Row, State, canceled_by_request, job_state, unfinished, verdict};

/// The field manager of the runs' Jobs and of the Tests condition: not the operator's own, so
/// the Sandbox controller's status applies (which never carry the condition) leave it alone.
pub const FIELD_MANAGER: &str = "spur-smarttests";
/// Finished runs kept per test and sandbox besides the current one; older Jobs (with their logs)
/// are deleted.
pub const RUNS_KEPT: usize = 3;
/// On a run's Job once its outcome has been published as an Event, so a restart does not
/// publish it again.
pub const REPORTED_ANNOTATION: &str = "spur.dev/smarttest-reported";
/// On the Job of a run of a test with `calls`: the id of the run capture the operator started
/// for it, which it ends when the Job ends.
pub const RUN_CAPTURE_ANNOTATION: &str = "spur.dev/run-capture";
/// How long a pass waits to ask an unavailable traffic store again.
pub const STORE_RETRY: Duration = Duration::from_secs(10);
/// How often a test refused for its creator's rights is asked about again (rights change
/// without any object the controller watches changing).
pub const REFUSED_RECHECK: Duration = Duration::from_secs(300);

/// The controller's context: the operator's shared one and the stores a pass reads.
pub struct SmartTestsContext {
    pub core: Arc<Context>,
    tests: Store<SmartTest>,
    jobs: Store<Job>,
    /// The refusals announced (by sandbox uid and test, the reason), so each is published once:
    /// two passes can run before the store shows the condition that names it.
    refusals_said: std::sync::Mutex<HashMap<(String, String), String>>,
    /// The traffic store, for tests with `calls` (none: such tests are not run).
    calls: Option<store::StoreConfig>,
}

/// Refusals remembered at most; past it the memory starts again (a refusal may then be said
/// once more, and the condition still stops a repeat after a restart).
const REFUSALS_REMEMBERED: usize = 10_000;

spur_operator_core::feature_context!(SmartTestsContext);

/// What wakes a sandbox's pass: its generation, readiness and the forks' services (what
/// `covers` and `ready_generation` read), not the Tests condition this controller writes.
fn sandbox_digest(sb: &Sandbox) -> u64 {
    let st = sb.status.as_ref();
    spur_controller::hash_of(&(
        meta_digest(sb),
        st.and_then(|s| s.observed_generation),
        st.map(|s| {
            s.conditions
                .iter()
                .filter(|c| c.type_ == "Ready")
                .map(|c| c.status.clone())
                .collect::<Vec<_>>()
        }),
        st.map(|s| {
            s.forks
                .iter()
                .map(|f| (&f.fork_of, &f.services))
                .collect::<Vec<_>>()
        }),
    ))
}

/// What of a run's Job a pass reads: its phase and result (not its log size, which changes
/// with every chunk).
fn job_digest(job: &Job) -> u64 {
    let st = job.status.as_ref();
    spur_controller::hash_of(&(
        meta_digest(job),
        st.and_then(|s| s.phase),
        st.and_then(|s| s.result.as_ref()),
        st.map(|s| {
            s.conditions
                .iter()
                .map(|c| (&c.type_, &c.status, &c.message))
                .collect::<Vec<_>>()
        }),
    ))
}

fn test_digest(t: &SmartTest) -> u64 {
    spur_controller::hash_of(&meta_digest(t))
}

/// Runs the controller until `stop`; tests with `calls` capture through the traffic store of
/// `calls`.
pub async fn run(
    client: Client,
    core: Arc<Context>,
    calls: Option<store::StoreConfig>,
    stop: CancellationToken,
) {
    let (sandboxes, sandbox_changes) = changes(
        Api::<Sandbox>::all(client.clone()),
        watcher::Config::default(),
        sandbox_digest,
    );
    let (tests, test_changes) = changes(
        Api::<SmartTest>::all(client.clone()),
        watcher::Config::default(),
        test_digest,
    );
    let (to_end, queued) = tokio::sync::mpsc::channel(ending::QUEUE);
    let (jobs, job_changes) = changes_tapped(
        Api::<Job>::all(client.clone()),
        watcher::Config::default().labels(RUN_TEST_LABEL),
        job_digest,
        ending::tap(to_end),
    );
    let ender = ending::run(calls.clone(), queued, stop.clone());
    let ctx = Arc::new(SmartTestsContext {
        core,
        tests,
        jobs: jobs.clone(),
        refusals_said: std::sync::Mutex::default(),
        calls,
    });
    let by_test = sandboxes.clone();
    let jobs_for_tests = jobs.clone();
    let controller = Controller::for_stream(sandbox_changes, sandboxes)
        .with_config(controller_config())
        .watches_stream(job_changes, |job| {
            job.labels()
                .get(SANDBOX)
                .map(|s| ObjectRef::<Sandbox>::new(s))
        })
        // A test's change wakes the sandboxes it covers, and those it has runs for (it may
        // have stopped covering them).
        .watches_stream(test_changes, move |t| {
            let ns = t.namespace().unwrap_or_default();
            let ran: HashSet<String> = jobs_for_tests
                .state()
                .iter()
                .filter(|j| {
                    j.namespace().as_deref() == Some(ns.as_str())
                        && j.labels().get(RUN_TEST_LABEL) == Some(&t.name_any())
                })
                .filter_map(|j| j.labels().get(SANDBOX).cloned())
                .collect();
            spur_controller::objects_where(&by_test, |sb| {
                ran.contains(&sb.name_any()) || !t.spec.covers(&ns, sb).is_empty()
            })
        });
    let controller = spur_controller::run(
        "smarttest-runs",
        controller,
        reconcile,
        error_policy,
        ctx,
        stop,
    );
    tokio::join!(controller, ender);
}

fn error_policy(sb: Arc<Sandbox>, err: &Error, ctx: Arc<SmartTestsContext>) -> Action {
    match err {
        Error::Pending(_) => Action::requeue(Duration::from_secs(2)),
        Error::Requeue { after, .. } => Action::requeue(*after),
        _ => ctx.retry(&*sb, err),
    }
}

/// Whether `job` is a run of `test` (of its namespace and uid) against `sb`.
fn is_run_of(job: &Job, test: &SmartTest, sb: &Sandbox) -> bool {
    job.namespace() == test.namespace()
        && run_of(job, sb).is_some_and(|r| {
            Some(r.test_uid) == test.meta().uid.as_deref() && r.test == test.name_any()
        })
}

/// A run's place among the runs of its test and sandbox: its creation, then the generations
/// it ran (two runs created in the same second are told apart).
fn run_order(job: &Job) -> (Option<Time>, i64, i64) {
    let generation = |key: &str| {
        job.annotations()
            .get(key)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (
        job.creation_timestamp(),
        generation(spur_api::smarttest::RUN_SANDBOX_GENERATION),
        generation(spur_api::smarttest::RUN_TEST_GENERATION),
    )
}

/// Whether `user` may do everything `questions` ask; `Err` names the first refusal.
async fn creator_may(
    client: &Client,
    user: &str,
    groups: &[String],
    questions: &[desired::Question],
) -> Result<Result<(), String>, Error> {
    let api = Api::<SubjectAccessReview>::all(client.clone());
    for q in questions {
        let answer = api
            .create(&PostParams::default(), &q.review(user, groups))
            .await?;
        if !answer.status.is_some_and(|s| s.allowed) {
            return Ok(Err(format!(
                "its creator {user} may not {} (a test runs only where its creator could have created the sandbox and submitted the job)",
                q.describe()
            )));
        }
    }
    Ok(Ok(()))
}

async fn reconcile(sb: Arc<Sandbox>, ctx: Arc<SmartTestsContext>) -> Result<Action, Error> {
    if sb.meta().deletion_timestamp.is_some() {
        // Its runs go with it (owner references).
        return Ok(Action::await_change());
    }
    synced(&ctx.tests, "SmartTests").await?;
    synced(&ctx.jobs, "smart-test Jobs").await?;
    let ready = desired::ready_generation(&sb);
    let mut tests: Vec<Arc<SmartTest>> = ctx
        .tests
        .state()
        .into_iter()
        .filter(|t| t.meta().deletion_timestamp.is_none())
        .filter(|t| {
            !t.spec
                .covers(&t.namespace().unwrap_or_default(), &sb)
                .is_empty()
        })
        .collect();
    tests.sort_by_key(|t| (t.namespace(), t.name_any()));
    let runs: Vec<Arc<Job>> = ctx
        .jobs
        .state()
        .into_iter()
        .filter(|j| run_of(j, &sb).is_some())
        .collect();

    let mut rows = Vec::new();
    let mut recheck = false;
    // A test's failure (its namespace's API refusing the operator, a review that failed) is
    // its row's, not the whole pass's: the other tests' rows, the condition and the Events are
    // written all the same, and the pass is retried with the first error.
    let mut failed: Option<Error> = None;
    for test in &tests {
        let ns = test.namespace().unwrap_or_default();
        let label = format!("{ns}/{}", test.name_any());
        let mut mine: Vec<&Arc<Job>> = runs.iter().filter(|j| is_run_of(j, test, &sb)).collect();
        // Newest first: by creation (whole seconds), then by the generations run.
        mine.sort_by_key(|j| std::cmp::Reverse(run_order(j)));
        let current = ready.map(|generation| desired::job_name(test, &sb, generation));
        // Superseded runs are canceled (and their captures ended) before a new run starts:
        // the new run's capture counts against the same bounds at the store.
        if let Err(e) = retain(&ctx, &ns, &mine, current.as_deref()).await {
            failed.get_or_insert(e);
        }
        let state = match (ready, &current) {
            (Some(generation), Some(name)) => match mine.iter().find(|j| j.name_any() == *name) {
                Some(j) => job_state(j),
                None => match start(&ctx, test, &sb, generation, &mut recheck).await {
                    Ok(state) => state,
                    Err(e) => {
                        let state = State::Pending {
                            job: name.clone(),
                            note: format!("not started yet (retrying): {e}"),
                        };
                        failed.get_or_insert(e);
                        state
                    }
                },
            },
            // The last result stands until the new generation is Ready (a run canceled because
            // it was superseded is no result).
            _ => match mine.iter().find(|j| !canceled_by_request(j)) {
                Some(j) if !unfinished(&job_state(j)) => job_state(j),
                _ => State::WaitingForSandbox,
            },
        };
        if !matches!(state, State::Refused(_)) {
            // Allowed now: a later refusal is news again.
            ctx.refusals_said
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(sb.uid().unwrap_or_default(), label.clone()));
        }
        rows.push(Row { test: label, state });
    }
    // Runs of tests that still exist but no longer cover the sandbox go. A deleted test's runs
    // go with it (it is their controller); a Job that only looks like a run (of no test of its
    // namespace) is nobody's to delete here, and may sit where the operator may not write.
    let (current, others): (Vec<Arc<Job>>, Vec<Arc<Job>>) = runs
        .into_iter()
        .partition(|j| tests.iter().any(|t| is_run_of(j, t, &sb)));
    let all_tests = ctx.tests.state();
    for j in others
        .iter()
        .filter(|j| all_tests.iter().any(|t| is_run_of(j, t, &sb)))
    {
        let api = Api::<Job>::namespaced(ctx.client.clone(), &j.namespace().unwrap_or_default());
        if let Err(e) = spur_operator_core::delete_opt(&api, &j.name_any()).await {
            failed.get_or_insert(e);
        }
    }
    write_condition(&ctx, &sb, &rows).await?;
    report(&ctx, &sb, &current).await?;
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(if recheck {
        Action::requeue(REFUSED_RECHECK)
    } else {
        Action::await_change()
    })
}

/// Retention of one test's runs against a sandbox (`mine`, newest first): the current run
/// (`current`, while the sandbox is Ready) and the newest [`RUNS_KEPT`] others stay, older ones
/// are deleted; a superseded run that has not ended is canceled, and its capture ended.
async fn retain(
    ctx: &SmartTestsContext,
    ns: &str,
    mine: &[&Arc<Job>],
    current: Option<&str>,
) -> Result<(), Error> {
    let api = Api::<Job>::namespaced(ctx.client.clone(), ns);
    let mut others = 0;
    // One run's failure (its capture's store unavailable) does not keep the others as they are.
    let mut failed = None;
    for j in mine {
        if Some(j.name_any().as_str()) == current {
            continue;
        }
        others += 1;
        let done = if others > RUNS_KEPT {
            spur_operator_core::delete_opt(&api, &j.name_any()).await
        } else if unfinished(&job_state(j)) && current.is_some() {
            match cancel(&api, j).await {
                Ok(()) => end_run_capture(ctx, j).await,
                Err(e) => Err(e),
            }
        } else {
            Ok(())
        };
        if let Err(e) = done {
            failed.get_or_insert(e);
        }
    }
    failed.map_or(Ok(()), Err)
}

/// Starts the run of `test` against `generation` of `sb`, once its creator's rights allow it.
async fn start(
    ctx: &SmartTestsContext,
    test: &SmartTest,
    sb: &Sandbox,
    generation: i64,
    recheck: &mut bool,
) -> Result<State, Error> {
    let ns = test.namespace().unwrap_or_default();
    let (creator, groups) = match desired::creator(test) {
        Ok(c) => c,
        Err(why) => return Ok(State::Refused(why)),
    };
    let questions = desired::questions(&ns, sb, test.spec.calls);
    if let Err(why) = creator_may(&ctx.client, &creator, &groups, &questions).await? {
        *recheck = true;
        // Once per refusal (each recheck and each Sandbox change would otherwise repeat it):
        // not if this process said it, nor if the condition already names it (said before a
        // restart).
        let line = format!("{ns}/{}: not run: {why}", test.name_any());
        let in_condition =
            desired::current_condition(sb).is_some_and(|c| c.message.lines().any(|l| l == line));
        let said = {
            let mut said = ctx.refusals_said.lock().unwrap_or_else(|p| p.into_inner());
            if said.len() >= REFUSALS_REMEMBERED {
                said.clear();
            }
            let key = (
                sb.uid().unwrap_or_default(),
                format!("{ns}/{}", test.name_any()),
            );
            said.insert(key, why.clone()).as_ref() == Some(&why)
        };
        if !said && !in_condition {
            ctx.event(
                sb,
                true,
                "SmartTestRefused",
                "RunSmartTest",
                format!("SmartTest {ns}/{} not run: {why}", test.name_any()),
            )
            .await;
        }
        return Ok(State::Refused(why));
    }
    let name = desired::job_name(test, sb, generation);
    // What the run's capture is started for, and ended by.
    let job_key = format!("{ns}/{name}");
    let api = Api::<Job>::namespaced(ctx.client.clone(), &ns);
    let capture = if test.spec.calls {
        // Not a second capture for a run created a moment ago that the store has not seen.
        if let Some(existing) = api.get_opt(&name).await? {
            return Ok(existing_run(&existing, test, sb, &ns, &name));
        }
        // Started for this Job's name: the store ends a capture still live for a Job of this
        // name (deleted, or never made) before it starts this one.
        match start_capture(ctx, test, sb, &creator, &groups, &job_key, recheck).await? {
            Ok(c) => Some(c),
            Err(state) => return Ok(state),
        }
    } else {
        None
    };
    let job = match desired::run_job(test, sb, generation, capture.as_ref()) {
        Ok(mut j) => {
            if let Some(c) = &capture {
                j.annotations_mut()
                    .insert(RUN_CAPTURE_ANNOTATION.to_owned(), c.run.id.clone());
            }
            j
        }
        Err(why) => {
            end_capture(ctx, capture.as_ref(), &job_key).await;
            return Ok(State::Unrunnable(why));
        }
    };
    let created = api.create(&PostParams::default(), &job).await;
    if let Err(kube::Error::Api(_)) = created {
        // Refused, so the capture was for nothing (a create whose answer was lost may have
        // made the Job: its capture then ends with it).
        end_capture(ctx, capture.as_ref(), &job_key).await;
    }
    match created {
        Ok(_) => {}
        // Created by a pass a moment ago, which the store has not seen yet: started already,
        // if the Job of that name is this run (anyone who may create Jobs here could have
        // taken the name first).
        Err(kube::Error::Api(s)) if s.code == 409 => {
            return Ok(match api.get_opt(&name).await? {
                Some(existing) => existing_run(&existing, test, sb, &ns, &name),
                // Gone again since (deleted by someone): the next pass creates it.
                None => State::Pending {
                    job: name,
                    note: "queued".into(),
                },
            });
        }
        Err(e) => return Err(e.into()),
    }
    ctx.event(
        sb,
        false,
        "SmartTestStarted",
        "RunSmartTest",
        format!(
            "SmartTest {ns}/{} runs as Job {ns}/{name} (sandbox generation {generation})",
            test.name_any()
        ),
    )
    .await;
    Ok(State::Pending {
        job: name,
        note: "queued".into(),
    })
}

/// The state of the Job `existing` found under a run's name: the run, or someone else's Job.
fn existing_run(existing: &Job, test: &SmartTest, sb: &Sandbox, ns: &str, name: &str) -> State {
    if is_run_of(existing, test, sb) {
        job_state(existing)
    } else {
        State::Unrunnable(format!(
            "a Job {ns}/{name} that is not this test's run already exists; delete it"
        ))
    }
}

/// Starts the capture of a run of `test` (with `calls`) for its creator, for the run's Job
/// `job` (`namespace/name`). `Ok(Err(state))`: the run cannot start now, and why.
async fn start_capture(
    ctx: &SmartTestsContext,
    test: &SmartTest,
    sb: &Sandbox,
    creator: &str,
    groups: &[String],
    job: &str,
    recheck: &mut bool,
) -> Result<Result<desired::GivenCapture, State>, Error> {
    let Some(cfg) = &ctx.calls else {
        return Ok(Err(State::Unrunnable(
            "it compares calls (calls: true), and the operator has no traffic store to capture them (traffic.enabled in the chart)".into(),
        )));
    };
    let unavailable = |what: String| Error::Requeue {
        what,
        after: STORE_RETRY,
    };
    // The CA bundle the Job is given, read first: nothing to undo when it is missing.
    let ca_pem = cfg
        .ca_pem()
        .map_err(|e| unavailable(format!("the traffic store's CA bundle ({e})")))?;
    let seconds = desired::capture_seconds(test);
    let run = match store::start(cfg, &sb.name_any(), seconds, creator, groups, job).await {
        Ok(run) => run,
        Err(store::StoreError::Refused(why)) => {
            *recheck = true;
            return Ok(Err(State::Refused(format!(
                "the traffic store refused its run capture: {why}"
            ))));
        }
        Err(store::StoreError::NotFound) => {
            return Err(unavailable(
                "the traffic store to learn the sandbox's routing key".into(),
            ));
        }
        Err(store::StoreError::Unavailable(why)) => {
            return Err(unavailable(format!("the traffic store ({why})")));
        }
        // Others' runs hold the store's slots: they end, or expire, and this run starts then.
        Err(store::StoreError::Exhausted(why)) => {
            return Err(unavailable(format!(
                "room at the traffic store for another run capture ({why})"
            )));
        }
    };
    Ok(Ok(desired::GivenCapture {
        run: spur_api::smarttest::RunCaptureEnv {
            id: run.id,
            routing_key: run.routing_key,
            reference_key: run.reference_key,
            marker_tag: run.marker_tag,
            namespaces: run.namespaces,
            watching_baselines: run.watching_baselines,
            until_unix_micros: run.until_unix_micros,
        },
        token: run.run_token,
        server: cfg.server.clone(),
        ca_pem,
    }))
}

/// Ends a capture started for the Job `job` (`namespace/name`) that was not created (it
/// expires anyway: only said).
async fn end_capture(ctx: &SmartTestsContext, capture: Option<&desired::GivenCapture>, job: &str) {
    if let (Some(cfg), Some(c)) = (&ctx.calls, capture)
        && let Err(e) = store::end(cfg, &c.run.id, &c.token, job).await
    {
        tracing::info!(error = %e, "ending an unused run capture (it expires at its time)");
    }
}

/// Ends the capture of the run `job` (ended, or canceled), with the operator's own right,
/// which ends only the capture started for this Job; gone already is done.
async fn end_run_capture(ctx: &SmartTestsContext, job: &Job) -> Result<(), Error> {
    let (Some(cfg), Some(id)) = (&ctx.calls, job.annotations().get(RUN_CAPTURE_ANNOTATION)) else {
        return Ok(());
    };
    let token = store::own_token(cfg).map_err(|e| Error::Requeue {
        what: format!("the traffic store ({e})"),
        after: STORE_RETRY,
    })?;
    match store::end(cfg, id, &token, &ending::job_key(job)).await {
        Ok(()) | Err(store::StoreError::NotFound) => Ok(()),
        // Refused: the right is gone; the capture expires at its time.
        Err(store::StoreError::Refused(why)) => {
            tracing::warn!(%why, "the traffic store refused to end a run's capture (it expires at its time)");
            Ok(())
        }
        Err(store::StoreError::Unavailable(why) | store::StoreError::Exhausted(why)) => {
            Err(Error::Requeue {
                what: format!("the traffic store to end a run's capture ({why})"),
                after: STORE_RETRY,
            })
        }
    }
}

async fn cancel(api: &Api<Job>, job: &Job) -> Result<(), Error> {
    let patch = serde_json::json!({"spec": {"canceled": true}});
    match api
        .patch(
            &job.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Applies the Tests condition (none when no test covers the sandbox), unless it stands already.
async fn write_condition(ctx: &SmartTestsContext, sb: &Sandbox, rows: &[Row]) -> Result<(), Error> {
    let current = desired::current_condition(sb);
    let conditions = if rows.is_empty() {
        if current.is_none() {
            return Ok(());
        }
        Vec::new()
    } else {
        let v = verdict(rows);
        if let Some(c) = current
            && c.status == v.status
            && c.reason == v.reason
            && c.message == v.message
            && c.observed_generation == sb.meta().generation
        {
            return Ok(());
        }
        let since = match current {
            Some(c) if c.status == v.status => c.last_transition_time.clone(),
            _ => Time(k8s_openapi::jiff::Timestamp::now()),
        };
        vec![serde_json::json!({
            "type": TESTS_CONDITION,
            "status": v.status,
            "reason": v.reason,
            "message": v.message,
            "observedGeneration": sb.meta().generation,
            "lastTransitionTime": since,
        })]
    };
    let body = serde_json::json!({
        "apiVersion": Sandbox::api_version(&()),
        "kind": Sandbox::kind(&()),
        "status": {"conditions": conditions},
    });
    match Api::<Sandbox>::all(ctx.client.clone())
        .patch_status(
            &sb.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Publishes each ended run's outcome as an Event on the Sandbox, once (the Job is annotated
/// after).
async fn report(ctx: &SmartTestsContext, sb: &Sandbox, runs: &[Arc<Job>]) -> Result<(), Error> {
    for j in runs {
        if j.annotations().contains_key(REPORTED_ANNOTATION) {
            continue;
        }
        let State::Finished { .. } = job_state(j) else {
            continue;
        };
        end_run_capture(ctx, j).await?;
        let ns = j.namespace().unwrap_or_default();
        // Canceled on request (superseded by the next generation's run, or by hand): nothing
        // failed, no Event; marked all the same, so it is not looked at again.
        if !canceled_by_request(j) {
            let test = run_of(j, sb).map(|r| r.test).unwrap_or_default();
            let v = verdict(&[Row {
                test: format!("{ns}/{test}"),
                state: job_state(j),
            }]);
            let (warning, reason) = match v.reason {
                "Passed" => (false, "SmartTestPassed"),
                "Findings" => (true, "SmartTestFindings"),
                _ => (true, "SmartTestFailed"),
            };
            // The line after the count line names the test, its job and its outcome.
            let note = v.message.lines().nth(1).unwrap_or_default().to_owned();
            ctx.event(sb, warning, reason, "RunSmartTest", note).await;
        }
        let patch = serde_json::json!({"metadata": {"annotations": {REPORTED_ANNOTATION: "true"}}});
        match Api::<Job>::namespaced(ctx.client.clone(), &ns)
            .patch(
                &j.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desired::tests::{sandbox, test};
    use spur_api::smarttest::Run;

    #[test]
    fn a_run_is_a_job_the_controller_made_for_this_test_and_sandbox() {
        let sb = sandbox(3, 3, "True");
        let t = test("list-items", 1);
        let job = desired::run_job(&t, &sb, 3, None).unwrap();
        assert_eq!(
            run_of(&job, &sb),
            Some(Run {
                test: "list-items",
                test_uid: "list-items-uid"
            })
        );
        assert!(is_run_of(&job, &t, &sb));

        // The same name made again is another test: its predecessor's runs are not its own.
        let mut again = test("list-items", 1);
        again.metadata.uid = Some("another-uid".into());
        assert!(!is_run_of(&job, &again, &sb));
        // Another Sandbox of the same name.
        let mut other = sandbox(3, 3, "True");
        other.metadata.uid = Some("other-sb-uid".into());
        assert_eq!(run_of(&job, &other), None);

        // A Job made by hand with a run's labels and the Sandbox as owner, in another
        // namespace or without the test as its controller, is no run.
        let mut forged = job.clone();
        forged.metadata.namespace = Some("team-b".into());
        assert!(!is_run_of(&forged, &t, &sb));
        let mut forged = job.clone();
        forged
            .metadata
            .owner_references
            .as_mut()
            .unwrap()
            .retain(|o| o.kind != "SmartTest");
        assert_eq!(run_of(&forged, &sb), None);
        let mut forged = job.clone();
        for o in forged.metadata.owner_references.as_mut().unwrap() {
            o.controller = None;
        }
        assert_eq!(run_of(&forged, &sb), None);
    }
}
