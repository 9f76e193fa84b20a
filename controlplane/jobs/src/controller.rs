//! The Job and JobRunnerGroup controllers.
//!
//! A Job pass checks what the schema cannot (its runner group and routing context exist; the
//! routing key), records its submission revision, and wakes its group. A group pass is the
//! scheduler: it plans (crate::queue) and carries the plan out (pods created and deleted,
//! queued jobs assigned, lost attempts re-queued, drivers started), one pass per group at a
//! time.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::core::v1::PodTemplateSpec;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::controller::{Action, Config as ControllerConfig};
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{Controller, watcher};
use kube::{Api, ResourceExt};
use spur_api::jobs::{JobPhase, JobRunnerGroupStatus};
use spur_api::{Job, JobRunnerGroup, RouteGroup, Sandbox};
use tokio_util::sync::CancellationToken;

use crate::driver::{self, Assignment};
use crate::pods::{self, GROUP_LABEL};
use crate::queue::{self, ACCEPTED, FINISHED};
use crate::status::{self as job_status, condition, now_string};
use crate::{Context, Error, Wakeups};

mod desired;
mod status;

/// The finalizer that deletes a Job's logs and artifacts with it.
pub(crate) const FINALIZER: &str = "spur.dev/job-store";
const FIELD_MANAGER: &str = "spur-jobs";

/// Runs both controllers and the retention sweeper until `stop`: one term of the leader (or
/// the whole life of a component run without election). The attempts driven in it stop with
/// it, and the next term resumes them where their logs end.
pub async fn run(ctx: Arc<Context>, wakeups: Wakeups, stop: CancellationToken) {
    *ctx.term.lock().unwrap_or_else(|p| p.into_inner()) = stop.clone();
    let client = ctx.client.clone();
    let cfg = ControllerConfig::default().debounce(Duration::from_millis(50));
    let jobs = Controller::new(Api::<Job>::all(client.clone()), watcher::Config::default())
        .with_config(cfg.clone())
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(reconcile_job, job_error, ctx.clone())
        .for_each(|_| std::future::ready(()));

    let woken = wakeups
        .stream()
        .map(|(ns, name)| ObjectRef::<JobRunnerGroup>::new(&name).within(&ns));
    let groups = Controller::new(
        Api::<JobRunnerGroup>::all(client.clone()),
        watcher::Config::default(),
    )
    .with_config(cfg)
    .watches(
        Api::<Job>::all(client.clone()),
        watcher::Config::default(),
        |job| {
            job.namespace()
                .map(|ns| ObjectRef::new(&job.spec.runner_group).within(&ns))
        },
    )
    .watches(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().labels(GROUP_LABEL),
        |pod| {
            let group = pod.labels().get(GROUP_LABEL)?.clone();
            pod.namespace().map(|ns| ObjectRef::new(&group).within(&ns))
        },
    )
    .reconcile_on(woken)
    .graceful_shutdown_on(stop.clone().cancelled_owned())
    .run(reconcile_group, group_error, ctx.clone())
    .for_each(|_| std::future::ready(()));

    // What a standby would otherwise export as its last view of the queues: cleared when the
    // term ends, also when it is aborted (spur_controller::leader, a term that does not stop).
    let _clear = ClearQueues(&ctx);
    let sweeper = sweep(ctx.clone(), stop.clone());
    tokio::join!(jobs, groups, sweeper);
}

struct ClearQueues<'a>(&'a Context);

impl Drop for ClearQueues<'_> {
    fn drop(&mut self) {
        self.0.metrics.queues.clear();
    }
}

// === Job ===

async fn reconcile_job(job: Arc<Job>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = job.namespace().unwrap_or_default();
    let api: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
    let r = finalizer(&api, FINALIZER, job, |event| async {
        match event {
            Event::Apply(job) => apply_job(&job, &ctx).await,
            Event::Cleanup(job) => cleanup_job(&job, &ctx).await,
        }
    })
    .await;
    match r {
        Ok(a) => Ok(a),
        Err(
            kube::runtime::finalizer::Error::ApplyFailed(e)
            | kube::runtime::finalizer::Error::CleanupFailed(e),
        ) => Err(e),
        Err(kube::runtime::finalizer::Error::RemoveFinalizer(kube::Error::Api(s)))
            if s.code == 404 =>
        {
            Ok(Action::await_change())
        }
        Err(e) => Err(Error::Pending(format!("the job finalizer: {e}"))),
    }
}

/// What a job's routing context resolves to.
enum Resolved {
    None,
    Key(String),
    Missing(&'static str, String),
}

async fn routing(job: &Job, ctx: &Context) -> Result<Resolved, Error> {
    let Some(rc) = &job.spec.routing_context else {
        return Ok(Resolved::None);
    };
    if let Some(name) = &rc.sandbox {
        let Some(sb) = Api::<Sandbox>::all(ctx.client.clone())
            .get_opt(name)
            .await?
        else {
            return Ok(Resolved::Missing(
                "SandboxNotFound",
                format!("sandbox {name} does not exist"),
            ));
        };
        return Ok(match sb.status.and_then(|s| s.routing_key) {
            Some(k) => Resolved::Key(k),
            None => Resolved::Missing(
                "RoutingKeyPending",
                format!("sandbox {name} has no routing key yet"),
            ),
        });
    }
    if let Some(name) = &rc.route_group {
        let Some(rg) = Api::<RouteGroup>::all(ctx.client.clone())
            .get_opt(name)
            .await?
        else {
            return Ok(Resolved::Missing(
                "RouteGroupNotFound",
                format!("route group {name} does not exist"),
            ));
        };
        return Ok(match rg.status.and_then(|s| s.routing_key) {
            Some(k) => Resolved::Key(k),
            None => Resolved::Missing(
                "RoutingKeyPending",
                format!("route group {name} has no routing key yet"),
            ),
        });
    }
    Ok(Resolved::None)
}

async fn apply_job(job: &Job, ctx: &Arc<Context>) -> Result<Action, Error> {
    let ns = job.namespace().unwrap_or_default();
    let name = job.name_any();
    let phase = queue::phase(job);
    if phase.is_terminal() {
        return Ok(Action::await_change());
    }
    if phase == JobPhase::Running && job.spec.canceled {
        ctx.drivers.cancel(&job.uid().unwrap_or_default());
    }
    let api: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
    let group = Api::<JobRunnerGroup>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&job.spec.runner_group)
        .await?;
    let invalid = job.validate().err().map(|e| e.to_string());
    let resolved = routing(job, ctx).await?;
    let revision = job
        .metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse::<u64>().ok());
    let group_name = job.spec.runner_group.clone();
    let mut accepted = false;
    job_status::update(&api, &name, |job, st| {
        if st.phase.is_some_and(JobPhase::is_terminal) {
            return false;
        }
        if st.submission_revision.is_none() {
            st.submission_revision = revision.or(Some(u64::MAX));
        }
        if st.phase.is_none() {
            st.phase = Some(JobPhase::Queued);
        }
        let queued = st.phase == Some(JobPhase::Queued);
        let refuse = |st: &mut spur_api::jobs::JobStatus, reason: &str, message: &str| {
            condition(st, job, ACCEPTED, false, reason, message);
            if queued && job.spec.canceled {
                job_status::canceled_by_request(st, job, "canceled before it ran");
            }
        };
        if let Some(m) = &invalid {
            // The schema rejects these at admission; a CRD installed without it does not.
            st.phase = Some(JobPhase::Failed);
            st.finished_at = Some(now_string());
            condition(st, job, ACCEPTED, false, "Invalid", m);
            condition(st, job, FINISHED, true, "Failed", m);
            return true;
        }
        if group.is_none() {
            refuse(st, "RunnerGroupNotFound", &format!("runner group {group_name} does not exist in namespace {}", job.namespace().unwrap_or_default()));
            return true;
        }
        if job.spec.inject_routing_key == spur_api::jobs::InjectRoutingKey::Auto
            && group.as_ref().is_some_and(|g| !g.spec.routing_key_injection)
        {
            // Running it without the header it relies on would reach the baselines.
            refuse(
                st,
                "NoRoutingKeyInjection",
                &format!("injectRoutingKey: Auto needs runner group {group_name} with routingKeyInjection: true"),
            );
            return true;
        }
        match &resolved {
            Resolved::Missing(reason, message) => refuse(st, reason, message),
            Resolved::Key(k) => {
                st.routing_key = Some(k.clone());
                condition(st, job, ACCEPTED, true, "Accepted", &format!("queued on runner group {group_name}"));
                accepted = true;
            }
            Resolved::None => {
                condition(st, job, ACCEPTED, true, "Accepted", &format!("queued on runner group {group_name} (no routing context: baselines)"));
                accepted = true;
            }
        }
        true
    })
    .await?;
    ctx.wake(&ns, &job.spec.runner_group);
    if accepted || group.is_some() && matches!(resolved, Resolved::Key(_) | Resolved::None) {
        Ok(Action::requeue(Duration::from_secs(300)))
    } else {
        // A missing group or sandbox may appear: look again soon.
        Ok(Action::requeue(Duration::from_secs(5)))
    }
}

async fn cleanup_job(job: &Job, ctx: &Arc<Context>) -> Result<Action, Error> {
    let uid = job.uid().unwrap_or_default();
    let ns = job.namespace().unwrap_or_default();
    // A running attempt goes with its job: cancel it on the runner, then stop driving it.
    if let Some(pod) = queue::running_pod(job) {
        ctx.drivers.cancel(&uid);
        tokio::time::sleep(Duration::from_millis(200)).await;
        ctx.drivers.abandon(&uid);
        tracing::info!(%ns, job = %job.name_any(), %pod, "job deleted while running");
    }
    let n = ctx.store.forget(&ns, &uid).await?;
    tracing::debug!(%ns, job = %job.name_any(), objects = n, "stored logs and artifacts deleted");
    ctx.wake(&ns, &job.spec.runner_group);
    Ok(Action::await_change())
}

fn job_error(job: Arc<Job>, err: &Error, _: Arc<Context>) -> Action {
    tracing::warn!(job = %job.name_any(), error = %err, "job pass failed");
    Action::requeue(Duration::from_secs(2))
}

// === JobRunnerGroup ===

async fn reconcile_group(group: Arc<JobRunnerGroup>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = group.namespace().unwrap_or_default();
    let name = group.name_any();
    let groups: Api<JobRunnerGroup> = Api::namespaced(ctx.client.clone(), &ns);
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let jobs_api: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);

    let jobs: Vec<Arc<Job>> = jobs_api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|j| j.spec.runner_group == name)
        .map(Arc::new)
        .collect();
    let pods: Vec<Arc<Pod>> = pods_api
        .list(&ListParams::default().labels(&pods::labels_selector(&name)))
        .await?
        .items
        .into_iter()
        .map(Arc::new)
        .collect();

    let template = group
        .validate()
        .map_err(|e| e.to_string())
        .and_then(|()| pods::check_template(&group));
    let template = match template {
        Ok(t) => t,
        Err(message) => {
            let st = status::group(&group, None, pods.len(), "InvalidSpec", &message, false);
            write_group_status(&groups, &group, st).await?;
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
    };
    ctx.pki
        .ensure_executor_secret(&ctx.client, &ns, desired::owner(&group))
        .await?;

    let digest = pods::template_digest(&group);
    let plan = queue::plan(
        &group,
        &jobs,
        &pods,
        &digest,
        k8s_openapi::jiff::Timestamp::now().as_second(),
    );
    ctx.metrics.queues.observe(
        &ns,
        &name,
        plan.queued.saturating_sub(plan.assign.len()),
        plan.oldest_waiting_since,
    );
    let pass = GroupPass {
        ctx: &ctx,
        group: &group,
        ns: &ns,
        jobs_api: &jobs_api,
        pods_api: &pods_api,
        jobs: &jobs,
        pods: &pods,
    };
    settle(&pass, &plan).await?;
    if !scale(&pass, &plan, template).await? {
        // The namespace (and the group with it) is going away.
        return Ok(Action::await_change());
    }
    assign(&pass, &plan).await?;
    resume(&pass, &plan);

    let (reason, message, ready) = status::readiness(&plan);
    let st = status::group(&group, Some(&plan), pods.len(), reason, &message, ready);
    write_group_status(&groups, &group, st).await?;
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// What a group pass carries its plan out with.
struct GroupPass<'a> {
    ctx: &'a Arc<Context>,
    group: &'a JobRunnerGroup,
    ns: &'a str,
    jobs_api: &'a Api<Job>,
    pods_api: &'a Api<Pod>,
    jobs: &'a [Arc<Job>],
    pods: &'a [Arc<Pod>],
}

/// Cancels the queued jobs whose cancel was requested and ends the attempts whose pod is gone.
async fn settle(g: &GroupPass<'_>, plan: &queue::Plan) -> Result<(), Error> {
    for name in &plan.cancel_queued {
        job_status::update(g.jobs_api, name, status::cancel_queued).await?;
        g.ctx.metrics.finished("Canceled");
    }
    for name in &plan.lost {
        if let Some(j) = g.jobs.iter().find(|j| j.name_any() == *name) {
            let uid = j.uid().unwrap_or_default();
            let attempt = status::last_attempt(j).unwrap_or(0);
            g.ctx.drivers.abandon(&uid);
            let len = g.ctx.store.seal_log(g.ns, &uid, attempt).await.ok();
            driver::lost(g.ctx, j, attempt, "the runner pod is gone", len).await?;
        }
    }
    Ok(())
}

/// Deletes and creates runner pods as planned; `false` when the namespace is going away.
async fn scale(
    g: &GroupPass<'_>,
    plan: &queue::Plan,
    template: PodTemplateSpec,
) -> Result<bool, Error> {
    for pod in &plan.delete_pods {
        match g.pods_api.delete(pod, &DeleteParams::default()).await {
            Ok(_) => {
                g.ctx.metrics.pods_deleted.inc();
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    let build = pods::Build {
        executor_image: &g.ctx.cfg.executor_image,
        pull_policy: g.ctx.cfg.executor_pull_policy.as_deref(),
        max_log_bytes: g.ctx.cfg.max_log_bytes,
        routing_headers: &g.ctx.cfg.routing_headers,
    };
    for _ in 0..plan.create_pods {
        let pod = pods::runner_pod(g.group, template.clone(), &build);
        match g.pods_api.create(&PostParams::default(), &pod).await {
            Ok(_) => {
                g.ctx.metrics.pods_created.inc();
            }
            Err(kube::Error::Api(s))
                if s.details.as_ref().is_some_and(|d| {
                    d.causes.iter().any(|c| c.reason == "NamespaceTerminating")
                }) =>
            {
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Assignments: recorded in the Job before the driver starts, so a restart finds them.
async fn assign(g: &GroupPass<'_>, plan: &queue::Plan) -> Result<(), Error> {
    for (job_name, pod_name) in &plan.assign {
        let Some(pod) = g.pods.iter().find(|p| &p.name_any() == pod_name) else {
            continue;
        };
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
            continue;
        };
        let written = job_status::update(g.jobs_api, job_name, |_, st| {
            status::start_attempt(st, pod_name, &now_string())
        })
        .await?;
        if let Some(j) = written {
            let attempt = status::last_attempt(&j).unwrap_or(1);
            let routing_key = j.status.as_ref().and_then(|s| s.routing_key.clone());
            let ns = g.ns;
            tracing::info!(%ns, job = %job_name, pod = %pod_name, attempt, "assigned");
            driver::spawn(
                g.ctx,
                Assignment {
                    job: j,
                    attempt,
                    pod: pod_name.clone(),
                    pod_ip: ip,
                    group: g.group.clone(),
                    routing_key,
                },
            );
        }
    }
    Ok(())
}

/// Running attempts nobody drives (after a restart of this component): resume them.
fn resume(g: &GroupPass<'_>, plan: &queue::Plan) {
    for j in g.jobs {
        let Some(pod_name) = queue::running_pod(j) else {
            continue;
        };
        if plan.lost.iter().any(|n| *n == j.name_any()) {
            continue;
        }
        let uid = j.uid().unwrap_or_default();
        let attempt = status::last_attempt(j).unwrap_or(1);
        if g.ctx.drivers.running(&uid, attempt) {
            if j.spec.canceled {
                g.ctx.drivers.cancel(&uid);
            }
            continue;
        }
        if g.ctx.drivers.finished(&uid, attempt) {
            // Ended since this pass listed the jobs.
            continue;
        }
        let Some(ip) = g
            .pods
            .iter()
            .find(|p| p.name_any() == pod_name)
            .and_then(|p| p.status.as_ref()?.pod_ip.clone())
        else {
            continue;
        };
        let ns = g.ns;
        tracing::info!(%ns, job = %j.name_any(), pod = %pod_name, attempt, "resuming the attempt");
        driver::spawn(
            g.ctx,
            Assignment {
                job: (**j).clone(),
                attempt,
                pod: pod_name.to_owned(),
                pod_ip: ip,
                group: g.group.clone(),
                routing_key: j.status.as_ref().and_then(|s| s.routing_key.clone()),
            },
        );
    }
}

/// Writes the group's status unless it is unchanged.
async fn write_group_status(
    api: &Api<JobRunnerGroup>,
    group: &JobRunnerGroup,
    st: JobRunnerGroupStatus,
) -> Result<(), Error> {
    if group.status.clone().unwrap_or_default() == st {
        return Ok(());
    }
    let body = serde_json::json!({
        "apiVersion": "spur.dev/v1alpha1",
        "kind": "JobRunnerGroup",
        "status": st,
    });
    match api
        .patch_status(
            &group.name_any(),
            &kube::api::PatchParams::apply(FIELD_MANAGER).force(),
            &kube::api::Patch::Apply(&body),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn group_error(group: Arc<JobRunnerGroup>, err: &Error, _: Arc<Context>) -> Action {
    tracing::warn!(group = %group.name_any(), error = %err, "runner group pass failed");
    Action::requeue(Duration::from_secs(2))
}

// === retention ===

/// Deletes finished jobs past the retention (their finalizer deletes what is stored), and
/// stored data whose job no longer exists.
async fn sweep(ctx: Arc<Context>, stop: CancellationToken) {
    let every = Duration::from_secs(300);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        if let Err(e) = sweep_once(&ctx).await {
            tracing::warn!(error = %e, "retention sweep failed");
        }
    }
}

pub(crate) async fn sweep_once(ctx: &Context) -> Result<(), Error> {
    // Stored data first, jobs second: data of a job created in between is then never taken
    // for a deleted job's.
    let stored = ctx.store.stored_jobs().await?;
    let jobs = Api::<Job>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let now = k8s_openapi::jiff::Timestamp::now();
    let retention = k8s_openapi::jiff::SignedDuration::try_from(ctx.cfg.retention)
        .unwrap_or(k8s_openapi::jiff::SignedDuration::MAX);
    for job in &jobs {
        let Some(finished) = job
            .status
            .as_ref()
            .filter(|s| s.phase.is_some_and(JobPhase::is_terminal))
            .and_then(|s| s.finished_at.as_deref())
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
        else {
            continue;
        };
        if now.duration_since(finished) > retention && job.metadata.deletion_timestamp.is_none() {
            let api: Api<Job> =
                Api::namespaced(ctx.client.clone(), &job.namespace().unwrap_or_default());
            match api.delete(&job.name_any(), &DeleteParams::default()).await {
                Ok(_) => tracing::info!(job = %job.name_any(), "retention: finished job deleted"),
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    let live: std::collections::BTreeSet<(String, String)> = jobs
        .iter()
        .map(|j| {
            (
                j.namespace().unwrap_or_default(),
                j.uid().unwrap_or_default(),
            )
        })
        .collect();
    for (ns, uid) in stored {
        if !live.contains(&(ns.clone(), uid.clone())) {
            ctx.store.forget(&ns, &uid).await?;
            tracing::info!(%ns, %uid, "retention: stored data of a deleted job removed");
        }
    }
    Ok(())
}
