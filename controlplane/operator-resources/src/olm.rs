//! ObjectLifecycleMethods controller: runs an OLM's `preStart` work units in order when it is
//! created and its `postStop` units in order when it is deleted (behind a finalizer), each as a
//! pod in the resource namespace with `spur-io` copied in.
//!
//! Everything a pass needs is in the OLM's status (unit phase, attempt, pod name and UID), so a
//! restarted operator resumes where the last one was: a finished unit is never run again, and a
//! pod created just before a crash is adopted rather than duplicated. The pod's name is written
//! to status before the pod is created, and its UID right after: the io context server serves
//! a pod only once status names it with that UID.
//!
//! A failed preStart unit fails the OLM (phase `Failed`; the workflow stops there). A failed
//! postStop unit is retried with exponential backoff (10 s doubling to 5 min) until it
//! succeeds: the finalizer holds the OLM, and with it the Resource and the Sandbox, until then,
//! and every failure is visible in status and as a Warning event.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{LogParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Api, ResourceExt};
use spur_api::ObjectLifecycleMethods;
use spur_api::resources::{
    LOG_TAIL_MAX, OlmPhase, OlmStatus, UnitPhase, UnitStatus, WorkUnit, Workflow,
};

use spur_operator_core::{Error, FINALIZER, delete_opt};

use crate::ResourcesContext;

mod desired;
mod status;

pub use desired::check_template;
use status::{PodOutcome, Progress};

/// Where step pods run and how they reach the io context server (`spur operator
/// --resources-*` flags; the chart's `resources.*` values).
#[derive(Debug, Clone)]
pub struct ResourceConfig {
    /// The namespace step pods run in (holds no Spur secrets).
    pub namespace: String,
    /// Their ServiceAccount (no RBAC rights: its token is only for the io context server).
    pub service_account: String,
    /// Spur's image, with `spur-io` (the init container's).
    pub io_image: String,
    pub io_pull_policy: Option<String>,
    /// `https://host:port` of the io context server.
    pub ics_url: String,
    /// Where the io context Secrets live: a namespace of their own (holding nothing else), so
    /// the io context server's Secret rights reach no other Secret.
    pub ics_namespace: String,
    /// The CA bundle ConfigMap (key `ca.crt`) in the operator's namespace; copied into
    /// `namespace` for the step pods.
    pub ca_config_map: String,
    /// The operator's namespace (where `ca_config_map` is).
    pub operator_namespace: String,
    /// First wait after a failed postStop attempt; doubles up to `retry_max`.
    pub retry_base: Duration,
    pub retry_max: Duration,
}

impl ResourceConfig {
    pub fn validate(&self) -> Result<(), Error> {
        for (what, v) in [
            ("--resources-namespace", &self.namespace),
            ("--resources-service-account", &self.service_account),
            ("--resources-io-image", &self.io_image),
            ("--resources-ics-url", &self.ics_url),
            ("--resources-ca-config-map", &self.ca_config_map),
            ("--resources-context-namespace", &self.ics_namespace),
        ] {
            if v.trim().is_empty() {
                return Err(Error::Config(format!("{what} must not be empty")));
            }
        }
        if !self.ics_url.starts_with("https://") {
            return Err(Error::Config(
                "--resources-ics-url must be https://host:port".into(),
            ));
        }
        if self.retry_base.is_zero() || self.retry_max < self.retry_base {
            return Err(Error::Config(
                "the postStop retry delays must be positive, the maximum at least the first".into(),
            ));
        }
        Ok(())
    }
}

/// Lines of a failed step's log kept in status.
const LOG_TAIL_LINES: i64 = 30;

pub(crate) async fn reconcile(
    olm: Arc<ObjectLifecycleMethods>,
    ctx: Arc<ResourcesContext>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ObjectLifecycleMethods");
    let Some(cfg) = ctx.resources.clone() else {
        // Not configured: leave OLMs alone (the Sandbox controller refuses resources then).
        return Ok(Action::await_change());
    };
    let api: Api<ObjectLifecycleMethods> = Api::all(ctx.client.clone());
    // The object as the API server has it now, not as the watch cache last delivered it: a
    // pass woken by a pod event (say, the deletion of a unit's finished pod) must see the
    // status the previous pass wrote, or it would take that pod for one lost mid-run.
    let Some(olm) = api.get_opt(&olm.name_any()).await? else {
        return Ok(Action::await_change());
    };
    let olm = Arc::new(olm);
    let action = finalizer(&api, FINALIZER, olm, |event| async {
        match event {
            Event::Apply(olm) => start(&olm, &ctx, &cfg).await,
            Event::Cleanup(olm) => stop(&olm, &ctx, &cfg).await,
        }
    })
    .await;
    spur_controller::finalized(action)
}

pub(crate) fn error_policy(
    olm: Arc<ObjectLifecycleMethods>,
    err: &Error,
    ctx: Arc<ResourcesContext>,
) -> Action {
    match err {
        Error::Pending(_) => return Action::requeue(Duration::from_secs(2)),
        Error::Requeue { after, .. } => return Action::requeue(*after),
        _ => {}
    }
    ctx.retry(&*olm, err)
}

/// The preStart workflow.
async fn start(
    olm: &ObjectLifecycleMethods,
    ctx: &ResourcesContext,
    cfg: &ResourceConfig,
) -> Result<Action, Error> {
    let mut st = olm.status.clone().unwrap_or_default();
    if let Err(e) = olm.spec.validate() {
        status::invalid(&mut st, olm, &e.to_string());
        write(olm, ctx, &st).await?;
        return Ok(Action::await_change());
    }
    if matches!(st.phase, OlmPhase::Started | OlmPhase::Failed) {
        return Ok(Action::await_change());
    }
    let step = advance(olm, ctx, cfg, Workflow::PreStart, &mut st).await?;
    if let Some(msg) = status::started(&mut st, olm, &step) {
        ctx.event(olm, true, "UnitFailed", "PreStart", msg).await;
    }
    write(olm, ctx, &st).await?;
    Ok(match step {
        Progress::Waiting(Some(after)) => Action::requeue(after),
        // Pod changes wake the pass; this is a safety net.
        _ => Action::requeue(Duration::from_secs(60)),
    })
}

/// Stops a running preStart unit, then runs the postStop workflow, retrying failed units.
/// `Ok` releases the finalizer, so it is returned only when every postStop unit succeeded.
async fn stop(
    olm: &ObjectLifecycleMethods,
    ctx: &ResourcesContext,
    cfg: &ResourceConfig,
) -> Result<Action, Error> {
    let mut st = olm.status.clone().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
    // A create step still running is stopped first, and the delete steps wait until its pod is
    // gone: spur-io passes the SIGTERM to the script and still sends what it wrote, which the
    // delete steps may need (the unit stays Running meanwhile, so the io context server takes
    // those outputs).
    let mut stopping = false;
    for u in st.pre_start.iter_mut() {
        if u.phase == UnitPhase::Running
            && let Some(e) = &u.exec_unit
        {
            match pods.get_opt(&e.name).await? {
                Some(p) => {
                    if p.metadata.deletion_timestamp.is_none() {
                        delete_opt(&pods, &e.name).await?;
                    }
                    u.message = Some("stopping: the object is being deleted".into());
                    stopping = true;
                }
                None => {
                    u.phase = UnitPhase::Failed;
                    u.message = Some("stopped: the object was deleted".into());
                }
            }
        }
    }
    if stopping {
        write(olm, ctx, &st).await?;
        return Err(Error::Requeue {
            what: format!("the running preStart unit of {} to stop", olm.name_any()),
            after: Duration::from_secs(2),
        });
    }
    if olm.spec.validate().is_err() {
        // Nothing of an invalid OLM ever ran.
        return Ok(Action::await_change());
    }
    st.phase = OlmPhase::Stopping;
    let step = advance(olm, ctx, cfg, Workflow::PostStop, &mut st).await?;
    let action = status::stopped(&mut st, olm, &step);
    write(olm, ctx, &st).await?;
    match action {
        None => Ok(Action::await_change()),
        // The finalizer helper releases on Ok: keep it by reporting what we wait for, and
        // when to look again (a unit waiting out its backoff is not polled meanwhile; pod
        // changes wake the pass earlier).
        Some(after) => Err(Error::Requeue {
            what: format!("the postStop workflow of {}", olm.name_any()),
            after,
        }),
    }
}

/// Moves `workflow` forward as far as it can go in one pass, recording each step in `st`
/// (written to the API before any pod is created).
async fn advance(
    olm: &ObjectLifecycleMethods,
    ctx: &ResourcesContext,
    cfg: &ResourceConfig,
    workflow: Workflow,
    st: &mut OlmStatus,
) -> Result<Progress, Error> {
    let units = olm.spec.workflow(workflow);
    let mut statuses = status::in_spec_order(units, st.units(workflow));
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
    let retry = workflow == Workflow::PostStop;
    let pass = Pass {
        olm,
        ctx,
        cfg,
        workflow,
    };
    let mut progress = Progress::Done;
    for (i, unit) in units.iter().enumerate() {
        let mut us = statuses[i].clone();
        let step = match us.phase {
            UnitPhase::Succeeded | UnitPhase::Skipped => None,
            UnitPhase::Failed if !retry => Some(Progress::Failed(
                unit.name.clone(),
                us.message.clone().unwrap_or_default(),
            )),
            UnitPhase::Failed => match status::retry_wait(&us, Timestamp::now()) {
                Some(wait) => Some(Progress::Waiting(Some(wait))),
                None => {
                    // The failed attempt's pod goes now, with the next attempt.
                    if let Some(e) = &us.exec_unit {
                        delete_opt(&pods, &e.name).await?;
                    }
                    *st.units_mut(workflow) = statuses.clone();
                    launch(&pass, unit, &mut us, st).await?;
                    Some(Progress::Waiting(None))
                }
            },
            UnitPhase::Pending => {
                let missing = if retry {
                    missing_inputs(olm, ctx, cfg, unit).await?
                } else {
                    Vec::new()
                };
                if missing.is_empty() {
                    *st.units_mut(workflow) = statuses.clone();
                    launch(&pass, unit, &mut us, st).await?;
                    Some(Progress::Waiting(None))
                } else {
                    // Retrying could never help: the values will not appear.
                    status::skip(&mut us, &missing, Timestamp::now());
                    None
                }
            }
            UnitPhase::Running => follow(&pass, unit, &mut us, &mut statuses, i, st, &pods).await?,
        };
        statuses[i] = us;
        if let Some(p) = step {
            progress = p;
            break;
        }
    }
    *st.units_mut(workflow) = statuses;
    Ok(progress)
}

/// What one pass over a workflow works with.
struct Pass<'a> {
    olm: &'a ObjectLifecycleMethods,
    ctx: &'a ResourcesContext,
    cfg: &'a ResourceConfig,
    workflow: Workflow,
}

/// Follows the running unit `statuses[i]` (`us`) through its pod; `None` when it succeeded
/// and the workflow goes on.
async fn follow(
    pass: &Pass<'_>,
    unit: &WorkUnit,
    us: &mut UnitStatus,
    statuses: &mut [UnitStatus],
    i: usize,
    st: &mut OlmStatus,
    pods: &Api<Pod>,
) -> Result<Option<Progress>, Error> {
    let Pass {
        olm,
        ctx,
        cfg,
        workflow,
    } = *pass;
    Ok(match observe(olm, us, pods).await? {
        Observed::Running => Some(Progress::Waiting(None)),
        Observed::NeverCreated => {
            // Create it now, as the same attempt.
            us.attempts = us.attempts.saturating_sub(1);
            *st.units_mut(workflow) = statuses.to_vec();
            launch(pass, unit, us, st).await?;
            Some(Progress::Waiting(None))
        }
        Observed::Succeeded => {
            status::succeed(us, Timestamp::now());
            // Recorded before the pod goes: a pass that found the pod gone and the unit
            // still Running would take it for a pod lost mid-run.
            statuses[i] = us.clone();
            *st.units_mut(workflow) = statuses.to_vec();
            write(olm, ctx, st).await?;
            if let Some(e) = &us.exec_unit {
                delete_opt(pods, &e.name).await?;
            }
            None
        }
        Observed::Failed(f) => {
            let retry = workflow == Workflow::PostStop;
            let (progress, event) = status::fail(us, cfg, workflow, f, retry, Timestamp::now());
            if let Some(msg) = event {
                ctx.event(olm, true, "UnitFailed", workflow.as_str(), msg)
                    .await;
            }
            Some(progress)
        }
    })
}

/// The io context keys `unit` reads that its OLM's io context does not hold.
async fn missing_inputs(
    olm: &ObjectLifecycleMethods,
    ctx: &ResourcesContext,
    cfg: &ResourceConfig,
    unit: &WorkUnit,
) -> Result<Vec<String>, Error> {
    let wanted: Vec<&str> = unit
        .inputs
        .iter()
        .filter_map(|i| i.iocontext.as_ref().map(|c| c.key.as_str()))
        .collect();
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(ctx.client.clone(), &cfg.ics_namespace);
    let name = spur_api::names::io_context_secret_name(&olm.spec.io_context_name);
    // No Secret is not "nothing was written": the values may be lost, and skipping would leave
    // behind whatever they name. Wait (and say so) rather than guess.
    let data = secrets
        .get_opt(&name)
        .await?
        .ok_or_else(|| {
            Error::Pending(format!(
                "the io context Secret {}/{name}, which the delete steps read (recreate it, or remove the finalizer of ObjectLifecycleMethods {} to give up)",
                cfg.ics_namespace,
                olm.name_any()
            ))
        })?
        .data
        .unwrap_or_default();
    Ok(wanted
        .into_iter()
        .filter(|k| !data.contains_key(*k))
        .map(str::to_owned)
        .collect())
}

/// Starts the next attempt of `unit`: its pod's name goes to status first, then the pod is
/// created, then its UID goes to status.
async fn launch(
    pass: &Pass<'_>,
    unit: &WorkUnit,
    us: &mut UnitStatus,
    st: &mut OlmStatus,
) -> Result<(), Error> {
    let Pass {
        olm,
        ctx,
        cfg,
        workflow,
    } = *pass;
    let pod_name = status::next_attempt(us, &olm.name_any(), &cfg.namespace);
    status::set_unit(st, workflow, us);
    write(olm, ctx, st).await?;

    ensure_ca_bundle(ctx, cfg).await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
    let pod = match desired::build_pod(olm, cfg, workflow, unit, &pod_name) {
        Ok(p) => p,
        Err(why) => {
            // A template the operator cannot run: fail the unit with the reason.
            status::refused(us, why, Timestamp::now() + cfg.retry_max);
            status::set_unit(st, workflow, us);
            write(olm, ctx, st).await?;
            return Ok(());
        }
    };
    let created = match pods.create(&PostParams::default(), &pod).await {
        Ok(p) => p,
        // Refused for good (pod security, an invalid field, a webhook): creating it again
        // would be refused again. Quota (403 "exceeded quota") and throttling (429) pass.
        Err(kube::Error::Api(ae))
            if matches!(ae.code, 400 | 403 | 422) && !ae.message.contains("exceeded quota") =>
        {
            let why = format!("the API server refused the pod: {}", ae.message);
            let at = Timestamp::now() + status::backoff(cfg, us.attempts);
            status::refused(us, why, at);
            status::set_unit(st, workflow, us);
            write(olm, ctx, st).await?;
            return Ok(());
        }
        Err(kube::Error::Api(ae)) if ae.code == 409 => {
            // Created by a pass that crashed before recording it: adopt it if it is ours.
            let existing = pods.get(&pod_name).await?;
            if !status::owned_by(&existing, olm) {
                return Err(Error::Config(format!(
                    "pod {}/{pod_name} exists and is not this ObjectLifecycleMethods' (remove it)",
                    cfg.namespace
                )));
            }
            existing
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(e) = us.exec_unit.as_mut() {
        e.uid = created.metadata.uid.clone().unwrap_or_default();
    }
    us.message = Some(format!("attempt {}: pod {pod_name} runs", us.attempts));
    status::set_unit(st, workflow, us);
    write(olm, ctx, st).await?;
    Ok(())
}

enum Observed {
    Running,
    /// Status names a pod that was never created.
    NeverCreated,
    Succeeded,
    Failed(status::Failure),
}

/// What the unit's current pod is doing.
async fn observe(
    olm: &ObjectLifecycleMethods,
    us: &mut UnitStatus,
    pods: &Api<Pod>,
) -> Result<Observed, Error> {
    let failed = |why: String| {
        Observed::Failed(status::Failure {
            why,
            tail: None,
            code: None,
        })
    };
    let Some(e) = us.exec_unit.clone() else {
        return Ok(failed("no pod was recorded".into()));
    };
    let Some(pod) = pods.get_opt(&e.name).await? else {
        if e.uid.is_empty() {
            // Recorded, never created: the operator stopped in between.
            return Ok(Observed::NeverCreated);
        }
        return Ok(failed(format!(
            "pod {} was deleted before it finished",
            e.name
        )));
    };
    if e.uid.is_empty() || pod.metadata.uid.as_deref() != Some(e.uid.as_str()) {
        if !status::owned_by(&pod, olm) {
            return Ok(failed(format!("pod {} is not this unit's", e.name)));
        }
        if let Some(x) = us.exec_unit.as_mut() {
            x.uid = pod.metadata.uid.clone().unwrap_or_default();
        }
    }
    let pod_status = pod.status.clone().unwrap_or_default();
    Ok(
        match status::pod_outcome(&pod_status, us.attempts, &e.name) {
            PodOutcome::Succeeded => Observed::Succeeded,
            PodOutcome::Failed(container, why, code) => {
                let tail = log_tail(pods, &e.name, container).await;
                Observed::Failed(status::Failure { why, tail, code })
            }
            PodOutcome::Running(message) => {
                us.message = Some(message);
                Observed::Running
            }
        },
    )
}

/// The last lines of a container's log, at most [`LOG_TAIL_MAX`] bytes (`None` if unreadable).
async fn log_tail(pods: &Api<Pod>, pod: &str, container: &str) -> Option<String> {
    let lp = LogParams {
        container: Some(container.into()),
        tail_lines: Some(LOG_TAIL_LINES),
        limit_bytes: Some(i64::try_from(LOG_TAIL_MAX * 4).unwrap_or(i64::MAX)),
        ..LogParams::default()
    };
    match pods.logs(pod, &lp).await {
        Ok(text) => {
            let text = text.trim_end();
            let mut start = text.len().saturating_sub(LOG_TAIL_MAX);
            while !text.is_char_boundary(start) {
                start += 1;
            }
            Some(text[start..].to_string())
        }
        Err(e) => {
            tracing::debug!(pod, error = %e, "cannot read the failed step's log");
            None
        }
    }
}

/// Copies the CA bundle into the step namespace when it is missing there (the certificate
/// manager keeps every copy current afterwards).
async fn ensure_ca_bundle(ctx: &ResourcesContext, cfg: &ResourceConfig) -> Result<(), Error> {
    let here: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
    if here.get_metadata_opt(&cfg.ca_config_map).await?.is_some() {
        return Ok(());
    }
    let source: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &cfg.operator_namespace);
    let bundle = source
        .get_opt(&cfg.ca_config_map)
        .await?
        .and_then(|cm| cm.data)
        .and_then(|d| d.get("ca.crt").cloned())
        .ok_or_else(|| {
            Error::Pending(format!(
                "the CA bundle ConfigMap {}/{} (made by the certificate manager)",
                cfg.operator_namespace, cfg.ca_config_map
            ))
        })?;
    let cm =
        spur_operator_core::bundle::namespace_bundle(&cfg.namespace, &cfg.ca_config_map, &bundle);
    match here.create(&PostParams::default(), &cm).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(ae)) if ae.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn write(
    olm: &ObjectLifecycleMethods,
    ctx: &ResourcesContext,
    st: &OlmStatus,
) -> Result<(), Error> {
    let api: Api<ObjectLifecycleMethods> = Api::all(ctx.client.clone());
    let old = olm.status.clone().unwrap_or_default();
    ctx.status.apply(&api, olm, &old, st).await?;
    Ok(())
}
