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

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{LogParams, ObjectMeta, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Api, Resource, ResourceExt};
use serde_json::{Value, json};
use spur_api::ObjectLifecycleMethods;
use spur_api::keys::labels;
use spur_api::resources::{
    ExecUnitRef, LOG_TAIL_MAX, OlmPhase, OlmStatus, UnitPhase, UnitStatus, WorkUnit, Workflow,
    reserved,
};

use crate::context::{Context, delete_opt};
use crate::{Error, FINALIZER};

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

/// Where the step pods' token is mounted.
const TOKEN_DIR: &str = "/var/run/secrets/spur.dev/io";
/// Where the CA bundle is mounted.
const CA_DIR: &str = "/etc/spur-io-ca";
/// The shared volume's mount point (also `spur-io --dir`'s default).
const IO_DIR: &str = "/spur-io";
/// Lifetime asked for the projected token (the kubelet renews it at 80 %).
const TOKEN_SECONDS: i64 = 600;
/// Lines of a failed step's log kept in status.
const LOG_TAIL_LINES: i64 = 30;

pub(crate) async fn reconcile(
    olm: Arc<ObjectLifecycleMethods>,
    ctx: Arc<Context>,
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
    ctx: Arc<Context>,
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
    ctx: &Context,
    cfg: &ResourceConfig,
) -> Result<Action, Error> {
    let mut st = olm.status.clone().unwrap_or_default();
    if let Err(e) = olm.spec.validate() {
        st.phase = OlmPhase::Failed;
        st.failed_phase = Some(Workflow::PreStart);
        set_ready(&mut st, olm, false, "Invalid", &e.to_string());
        write(olm, ctx, &st).await?;
        return Ok(Action::await_change());
    }
    if matches!(st.phase, OlmPhase::Started | OlmPhase::Failed) {
        return Ok(Action::await_change());
    }
    let step = advance(olm, ctx, cfg, Workflow::PreStart, &mut st).await?;
    match &step {
        Progress::Done => {
            st.phase = OlmPhase::Started;
            set_ready(
                &mut st,
                olm,
                true,
                "Started",
                "every preStart unit succeeded",
            );
        }
        Progress::Failed(unit, why) => {
            st.phase = OlmPhase::Failed;
            st.failed_phase = Some(Workflow::PreStart);
            set_ready(
                &mut st,
                olm,
                false,
                "UnitFailed",
                &format!("preStart unit {unit} failed: {why}"),
            );
            ctx.event(
                olm,
                true,
                "UnitFailed",
                "PreStart",
                format!("unit {unit} failed: {why}"),
            )
            .await;
        }
        Progress::Waiting(_) => {
            st.phase = OlmPhase::Starting;
            set_ready(
                &mut st,
                olm,
                false,
                "Starting",
                "the preStart workflow runs",
            );
        }
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
    ctx: &Context,
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
    let action = match &step {
        Progress::Done => {
            st.phase = OlmPhase::Stopped;
            set_ready(
                &mut st,
                olm,
                false,
                "Stopped",
                "every postStop unit succeeded",
            );
            None
        }
        Progress::Failed(unit, why) => {
            // Not reached for postStop (failures are retried), but never silently done.
            set_ready(
                &mut st,
                olm,
                false,
                "UnitFailed",
                &format!("postStop unit {unit}: {why}"),
            );
            Some(Duration::from_secs(30))
        }
        Progress::Waiting(after) => {
            set_ready(
                &mut st,
                olm,
                false,
                "Stopping",
                "the postStop workflow runs",
            );
            Some(after.unwrap_or(Duration::from_secs(60)))
        }
    };
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

enum Progress {
    /// Every unit succeeded.
    Done,
    /// A unit failed for good (preStart only).
    Failed(String, String),
    /// A unit runs, or waits for its retry (look again after this long at the latest).
    Waiting(Option<Duration>),
}

/// Moves `workflow` forward as far as it can go in one pass, recording each step in `st`
/// (written to the API before any pod is created).
async fn advance(
    olm: &ObjectLifecycleMethods,
    ctx: &Context,
    cfg: &ResourceConfig,
    workflow: Workflow,
    st: &mut OlmStatus,
) -> Result<Progress, Error> {
    let units = olm.spec.workflow(workflow);
    // Status entries in spec order (a new OLM, or entries from an older spec are dropped).
    let mut statuses: Vec<UnitStatus> = units
        .iter()
        .map(|u| {
            st.units(workflow)
                .iter()
                .find(|s| s.name == u.name)
                .cloned()
                .unwrap_or_else(|| UnitStatus {
                    name: u.name.clone(),
                    ..UnitStatus::default()
                })
        })
        .collect();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
    let retry = workflow == Workflow::PostStop;
    let mut progress = Progress::Done;
    for (i, unit) in units.iter().enumerate() {
        let mut us = statuses[i].clone();
        let step = match us.phase {
            UnitPhase::Succeeded => None,
            UnitPhase::Failed if !retry => Some(Progress::Failed(
                unit.name.clone(),
                us.message.clone().unwrap_or_default(),
            )),
            UnitPhase::Failed => {
                let due = us
                    .retry_at
                    .as_deref()
                    .and_then(|t| t.parse::<Timestamp>().ok())
                    .map(|at| at.duration_since(Timestamp::now()))
                    .and_then(|d| Duration::try_from(d).ok())
                    .filter(|d| !d.is_zero());
                match due {
                    Some(wait) => Some(Progress::Waiting(Some(wait + Duration::from_millis(100)))),
                    None => {
                        // The failed attempt's pod goes now, with the next attempt.
                        if let Some(e) = &us.exec_unit {
                            delete_opt(&pods, &e.name).await?;
                        }
                        *st.units_mut(workflow) = statuses.clone();
                        launch(olm, ctx, cfg, workflow, unit, &mut us, st).await?;
                        Some(Progress::Waiting(None))
                    }
                }
            }
            UnitPhase::Pending => {
                let missing = if retry {
                    missing_inputs(olm, ctx, cfg, unit).await?
                } else {
                    Vec::new()
                };
                if missing.is_empty() {
                    *st.units_mut(workflow) = statuses.clone();
                    launch(olm, ctx, cfg, workflow, unit, &mut us, st).await?;
                    Some(Progress::Waiting(None))
                } else {
                    // Retrying could never help: the values will not appear.
                    us.phase = UnitPhase::Skipped;
                    us.finished_at = Some(Timestamp::now().to_string());
                    us.message = Some(format!(
                        "skipped: its inputs {} come from outputs that were never written (the create step making them failed or never ran)",
                        missing.join(", ")
                    ));
                    None
                }
            }
            UnitPhase::Skipped => None,
            UnitPhase::Running => match observe(olm, &mut us, &pods).await? {
                Observed::Running => Some(Progress::Waiting(None)),
                Observed::NeverCreated => {
                    // Create it now, as the same attempt.
                    us.attempts = us.attempts.saturating_sub(1);
                    *st.units_mut(workflow) = statuses.clone();
                    launch(olm, ctx, cfg, workflow, unit, &mut us, st).await?;
                    Some(Progress::Waiting(None))
                }
                Observed::Succeeded => {
                    us.phase = UnitPhase::Succeeded;
                    us.finished_at = Some(Timestamp::now().to_string());
                    us.message = None;
                    us.log_tail = None;
                    us.retry_at = None;
                    // Recorded before the pod goes: a pass that found the pod gone and the
                    // unit still Running would take it for a pod lost mid-run.
                    statuses[i] = us.clone();
                    *st.units_mut(workflow) = statuses.clone();
                    write(olm, ctx, st).await?;
                    if let Some(e) = &us.exec_unit {
                        delete_opt(&pods, &e.name).await?;
                    }
                    None
                }
                Observed::Failed(why, tail, code) => {
                    us.phase = UnitPhase::Failed;
                    us.exit_code = code;
                    us.log_tail = tail;
                    us.finished_at = Some(Timestamp::now().to_string());
                    if retry {
                        let wait = backoff(cfg, us.attempts);
                        us.retry_at = Some((Timestamp::now() + wait).to_string());
                        us.message = Some(format!(
                            "attempt {} failed: {why}; retrying in {}s",
                            us.attempts,
                            wait.as_secs()
                        ));
                        ctx.event(
                            olm,
                            true,
                            "UnitFailed",
                            workflow.as_str(),
                            format!(
                                "{} unit {} attempt {} failed: {why}; retrying in {}s",
                                workflow.as_str(),
                                unit.name,
                                us.attempts,
                                wait.as_secs()
                            ),
                        )
                        .await;
                        Some(Progress::Waiting(Some(wait + Duration::from_millis(100))))
                    } else {
                        us.message = Some(why.clone());
                        Some(Progress::Failed(unit.name.clone(), why))
                    }
                }
            },
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

/// The io context keys `unit` reads that its OLM's io context does not hold.
async fn missing_inputs(
    olm: &ObjectLifecycleMethods,
    ctx: &Context,
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

fn backoff(cfg: &ResourceConfig, attempts: i32) -> Duration {
    let n = u32::try_from(attempts.saturating_sub(1).clamp(0, 16)).unwrap_or(0);
    cfg.retry_base
        .saturating_mul(1u32 << n.min(16))
        .min(cfg.retry_max)
}

/// Starts the next attempt of `unit`: its pod's name goes to status first, then the pod is
/// created, then its UID goes to status.
async fn launch(
    olm: &ObjectLifecycleMethods,
    ctx: &Context,
    cfg: &ResourceConfig,
    workflow: Workflow,
    unit: &WorkUnit,
    us: &mut UnitStatus,
    st: &mut OlmStatus,
) -> Result<(), Error> {
    us.attempts = us.attempts.saturating_add(1);
    us.phase = UnitPhase::Running;
    us.retry_at = None;
    us.exit_code = None;
    let pod_name = format!("{}-{}-{}", olm.name_any(), unit.name, us.attempts);
    us.exec_unit = Some(ExecUnitRef {
        name: pod_name.clone(),
        namespace: cfg.namespace.clone(),
        uid: String::new(),
    });
    us.message = Some(format!("attempt {}: starting pod {pod_name}", us.attempts));
    set_unit(st, workflow, us);
    write(olm, ctx, st).await?;

    ensure_ca_bundle(ctx, cfg).await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
    let pod = match build_pod(olm, cfg, workflow, unit, &pod_name) {
        Ok(p) => p,
        Err(why) => {
            // A template the operator cannot run: fail the unit with the reason.
            us.phase = UnitPhase::Failed;
            us.message = Some(why.clone());
            us.retry_at = Some((Timestamp::now() + cfg.retry_max).to_string());
            set_unit(st, workflow, us);
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
            us.phase = UnitPhase::Failed;
            us.message = Some(format!("the API server refused the pod: {}", ae.message));
            us.retry_at = Some((Timestamp::now() + backoff(cfg, us.attempts)).to_string());
            set_unit(st, workflow, us);
            write(olm, ctx, st).await?;
            return Ok(());
        }
        Err(kube::Error::Api(ae)) if ae.code == 409 => {
            // Created by a pass that crashed before recording it: adopt it if it is ours.
            let existing = pods.get(&pod_name).await?;
            if !owned_by(&existing, olm) {
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
    set_unit(st, workflow, us);
    write(olm, ctx, st).await?;
    Ok(())
}

fn set_unit(st: &mut OlmStatus, workflow: Workflow, us: &UnitStatus) {
    let units = st.units_mut(workflow);
    match units.iter_mut().find(|u| u.name == us.name) {
        Some(u) => *u = us.clone(),
        None => units.push(us.clone()),
    }
}

fn owned_by(pod: &Pod, olm: &ObjectLifecycleMethods) -> bool {
    let uid = olm.meta().uid.as_deref();
    pod.owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && Some(o.uid.as_str()) == uid)
}

enum Observed {
    Running,
    /// Status names a pod that was never created.
    NeverCreated,
    Succeeded,
    /// Why, the end of the log, the step's exit code.
    Failed(String, Option<String>, Option<i32>),
}

/// What the unit's current pod is doing.
async fn observe(
    olm: &ObjectLifecycleMethods,
    us: &mut UnitStatus,
    pods: &Api<Pod>,
) -> Result<Observed, Error> {
    let Some(e) = us.exec_unit.clone() else {
        return Ok(Observed::Failed("no pod was recorded".into(), None, None));
    };
    let Some(pod) = pods.get_opt(&e.name).await? else {
        if e.uid.is_empty() {
            // Recorded, never created: the operator stopped in between.
            return Ok(Observed::NeverCreated);
        }
        return Ok(Observed::Failed(
            format!("pod {} was deleted before it finished", e.name),
            None,
            None,
        ));
    };
    if e.uid.is_empty() || pod.metadata.uid.as_deref() != Some(e.uid.as_str()) {
        if !owned_by(&pod, olm) {
            return Ok(Observed::Failed(
                format!("pod {} is not this unit's", e.name),
                None,
                None,
            ));
        }
        if let Some(x) = us.exec_unit.as_mut() {
            x.uid = pod.metadata.uid.clone().unwrap_or_default();
        }
    }
    let status = pod.status.clone().unwrap_or_default();
    match status.phase.as_deref() {
        Some("Succeeded") => Ok(Observed::Succeeded),
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
            let code = terminated_code(&status, container);
            let tail = log_tail(pods, &e.name, container).await;
            let why = match (code, status.reason.as_deref()) {
                (Some(c), _) => format!("{what} (exit code {c})"),
                (None, Some(r)) => format!("{what}: pod {r}"),
                (None, None) => what.to_string(),
            };
            Ok(Observed::Failed(why, tail, code))
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
            us.message = Some(match waiting {
                Some((c, r, m)) if r != "PodInitializing" && r != "ContainerCreating" => format!(
                    "attempt {}: container {c} waits: {r}{}",
                    us.attempts,
                    m.map(|m| format!(": {m}")).unwrap_or_default()
                ),
                _ => format!("attempt {}: pod {} runs", us.attempts, e.name),
            });
            Ok(Observed::Running)
        }
    }
}

fn terminated_code(status: &k8s_openapi::api::core::v1::PodStatus, container: &str) -> Option<i32> {
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
async fn ensure_ca_bundle(ctx: &Context, cfg: &ResourceConfig) -> Result<(), Error> {
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
    let cm = crate::certs::namespace_bundle(&cfg.namespace, &cfg.ca_config_map, &bundle);
    match here.create(&PostParams::default(), &cm).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(ae)) if ae.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Whether a pod template (a plugin overlay or a unit's template) uses a name the operator
/// reserves, or a restart policy other than Never. `Err` says which.
pub fn check_template(template: &Value) -> Result<(), String> {
    let names = |path: &str| -> Vec<String> {
        template
            .pointer(path)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.get("name").and_then(Value::as_str).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    for v in names("/spec/volumes") {
        if [
            reserved::IO_VOLUME,
            reserved::TOKEN_VOLUME,
            reserved::CA_VOLUME,
        ]
        .contains(&v.as_str())
        {
            return Err(format!("volume name {v} is reserved for Spur"));
        }
    }
    for c in names("/spec/initContainers") {
        if c == reserved::INIT_CONTAINER {
            return Err(format!("init container name {c} is reserved for Spur"));
        }
    }
    for c in names("/spec/containers") {
        if c == reserved::INIT_CONTAINER {
            return Err(format!("container name {c} is reserved for Spur"));
        }
    }
    match template
        .pointer("/spec/restartPolicy")
        .and_then(Value::as_str)
    {
        None | Some("Never") => {}
        Some(p) => return Err(format!("restartPolicy must be unset or Never, not {p}")),
    }
    if template.pointer("/metadata/name").is_some() {
        return Err("the pod name must be left empty: the operator names step pods".into());
    }
    Ok(())
}

/// The pod of one attempt of `unit`.
fn build_pod(
    olm: &ObjectLifecycleMethods,
    cfg: &ResourceConfig,
    workflow: Workflow,
    unit: &WorkUnit,
    name: &str,
) -> Result<Pod, String> {
    let t = &unit.exec_unit_template;
    check_template(&t.pod_template)?;
    let mut template = t.pod_template.clone();
    let spec = template
        .as_object_mut()
        .ok_or("the pod template must be an object")?
        .entry("spec")
        .or_insert_with(|| json!({}));
    let spec = spec.as_object_mut().ok_or("spec must be an object")?;
    spec.insert("restartPolicy".into(), json!("Never"));
    spec.entry("serviceAccountName")
        .or_insert_with(|| json!(cfg.service_account));
    spec.entry("automountServiceAccountToken")
        .or_insert_with(|| json!(false));
    spec.entry("enableServiceLinks")
        .or_insert_with(|| json!(false));

    let io_env = |extra: Vec<Value>| -> Vec<Value> {
        let mut env = vec![
            json!({"name": "SPUR_IO_SERVER", "value": cfg.ics_url}),
            json!({"name": "SPUR_IO_CA_FILE", "value": format!("{CA_DIR}/ca.crt")}),
            json!({"name": "SPUR_IO_TOKEN_FILE", "value": format!("{TOKEN_DIR}/token")}),
            json!({"name": "SPUR_IO_OLM", "value": olm.name_any()}),
            json!({"name": "SPUR_IO_WORKFLOW", "value": workflow.as_str()}),
            json!({"name": "SPUR_IO_UNIT", "value": unit.name}),
        ];
        env.extend(extra);
        env
    };
    let mounts = json!([
        {"name": reserved::IO_VOLUME, "mountPath": IO_DIR},
        {"name": reserved::TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": true},
        {"name": reserved::CA_VOLUME, "mountPath": CA_DIR, "readOnly": true},
    ]);
    let volumes = spec
        .entry("volumes")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or("volumes must be a list")?;
    volumes.push(json!({"name": reserved::IO_VOLUME, "emptyDir": {}}));
    volumes.push(json!({"name": reserved::TOKEN_VOLUME, "projected": {"sources": [
        {"serviceAccountToken": {"audience": spur_ics_audience(), "expirationSeconds": TOKEN_SECONDS, "path": "token"}}
    ]}}));
    volumes.push(json!({"name": reserved::CA_VOLUME, "configMap": {"name": cfg.ca_config_map}}));

    let mut init = json!({
        "name": reserved::INIT_CONTAINER,
        "image": cfg.io_image,
        "command": ["spur-io", "init"],
        "env": io_env(t.script.iter().map(|s| json!({"name": "SPUR_IO_SCRIPT", "value": s})).collect()),
        "volumeMounts": mounts.clone(),
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": {"drop": ["ALL"]}
        },
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}
    });
    if let Some(p) = &cfg.io_pull_policy {
        init["imagePullPolicy"] = json!(p);
    }
    spec.entry("initContainers")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or("initContainers must be a list")?
        .push(init);

    let containers = spec
        .get_mut("containers")
        .and_then(Value::as_array_mut)
        .filter(|c| !c.is_empty())
        .ok_or("the pod template has no container")?;
    let idx = containers
        .iter()
        .position(|c| c.get("name").and_then(Value::as_str) == Some(reserved::STEP_CONTAINER))
        .unwrap_or(0);
    let step = containers[idx]
        .as_object_mut()
        .ok_or("a container must be an object")?;
    let mut args: Vec<String> = vec![format!("{IO_DIR}/bin/spur-io"), "run".into()];
    let input_names: BTreeMap<&str, ()> =
        unit.inputs.iter().map(|i| (i.name.as_str(), ())).collect();
    for inj in &t.input_injects {
        if !input_names.contains_key(inj.input_name.as_str()) {
            return Err(format!("inputInjects: {} is not an input", inj.input_name));
        }
        match (&inj.dst.env, &inj.dst.local_path) {
            (Some(e), None) => args.push(format!("--env={e}={}", inj.input_name)),
            (None, Some(p)) => args.push(format!("--file={p}={}", inj.input_name)),
            _ => return Err("an inputInject has exactly one of env and localPath".into()),
        }
    }
    for e in &t.output_exports {
        args.push(format!("--export={}={}", e.output_name, e.from_path));
    }
    if t.script.is_none() {
        let own: Vec<String> = ["command", "args"]
            .iter()
            .filter_map(|k| step.get(*k).and_then(Value::as_array))
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect();
        if own.is_empty() {
            return Err(
                "a unit without a script needs the step container's command (an image's entrypoint cannot be wrapped)".into(),
            );
        }
        args.push("--".into());
        args.extend(own);
    }
    step.insert("command".into(), json!(args));
    step.remove("args");
    let env = step
        .entry("env")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or("env must be a list")?;
    env.extend(io_env(Vec::new()));
    step.entry("volumeMounts")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or("volumeMounts must be a list")?
        .extend(mounts.as_array().cloned().unwrap_or_default());

    let mut pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": template.get("metadata").cloned().unwrap_or_else(|| json!({})),
        "spec": template.get("spec").cloned().unwrap_or_else(|| json!({})),
    }))
    .map_err(|e| format!("the pod template does not decode as a pod: {e}"))?;
    let mut labels_map = pod.metadata.labels.take().unwrap_or_default();
    labels_map.insert(labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into());
    labels_map.insert(
        labels::OLM.into(),
        spur_api::names::label_value(&olm.name_any()),
    );
    labels_map.insert(labels::WORK_UNIT.into(), unit.name.clone());
    pod.metadata = ObjectMeta {
        name: Some(name.into()),
        namespace: Some(cfg.namespace.clone()),
        labels: Some(labels_map),
        annotations: pod.metadata.annotations.take(),
        owner_references: olm.controller_owner_ref(&()).map(|o| vec![o]),
        ..ObjectMeta::default()
    };
    Ok(pod)
}

fn spur_ics_audience() -> &'static str {
    // The io context server's default audience (`spur ics serve --audience`).
    "spur-io"
}

fn set_ready(
    st: &mut OlmStatus,
    olm: &ObjectLifecycleMethods,
    ok: bool,
    reason: &str,
    message: &str,
) {
    spur_api::conditions::set_condition(
        &mut st.conditions,
        spur_api::conditions::NewCondition {
            type_: spur_api::conditions::READY,
            status: if ok {
                spur_api::conditions::ConditionStatus::True
            } else {
                spur_api::conditions::ConditionStatus::False
            },
            reason,
            message,
            observed_generation: olm.meta().generation,
        },
        &crate::context::now(),
    );
    st.observed_generation = olm.meta().generation;
}

async fn write(olm: &ObjectLifecycleMethods, ctx: &Context, st: &OlmStatus) -> Result<(), Error> {
    let api: Api<ObjectLifecycleMethods> = Api::all(ctx.client.clone());
    let old = olm.status.clone().unwrap_or_default();
    ctx.status.apply(&api, olm, &old, st).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ResourceConfig {
        ResourceConfig {
            namespace: "spur-resources".into(),
            service_account: "spur-resource-runner".into(),
            io_image: "localhost/spur:dev".into(),
            io_pull_policy: Some("Never".into()),
            ics_url: "https://spur-ics.spur-system.svc:8443".into(),
            ics_namespace: "spur-io-contexts".into(),
            ca_config_map: "spur-ca-bundle".into(),
            operator_namespace: "spur-system".into(),
            retry_base: Duration::from_secs(10),
            retry_max: Duration::from_secs(300),
        }
    }

    fn olm() -> ObjectLifecycleMethods {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ObjectLifecycleMethods",
            "metadata": {"name": "db-1", "uid": "olm-uid"},
            "spec": {"ioContextName": "db-1", "preStart": [{
                "name": "user", "type": "ExecUnit",
                "inputs": [{"name": "dbname", "iocontext": {"name": "db-1", "key": "database.dbname"}}],
                "outputs": [{"name": "dsn"}],
                "execUnitTemplate": {
                    "podTemplate": {"spec": {"containers": [{"name": "step", "image": "pg", "env": [{"name": "A", "value": "b"}]}]}},
                    "script": "#!/bin/sh\ntrue\n",
                    "inputInjects": [{"inputName": "dbname", "dst": {"env": "DBNAME"}}],
                    "outputExports": [{"fromPath": "/tmp/dsn", "outputName": "dsn"}]
                }
            }]}
        }))
        .unwrap()
    }

    #[test]
    fn step_pods_get_spur_io_and_nothing_else_of_the_operator() {
        let o = olm();
        let unit = &o.spec.pre_start[0];
        let pod = build_pod(&o, &cfg(), Workflow::PreStart, unit, "db-1-user-1").unwrap();
        let spec = pod.spec.unwrap();
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("spur-resource-runner")
        );
        assert_eq!(spec.automount_service_account_token, Some(false));
        let init = &spec.init_containers.unwrap()[0];
        assert_eq!(init.name, "spur-io-init");
        assert_eq!(init.command.as_deref().unwrap(), ["spur-io", "init"]);
        let step = &spec.containers[0];
        let cmd = step.command.clone().unwrap();
        assert_eq!(cmd[..2], ["/spur-io/bin/spur-io".to_string(), "run".into()]);
        assert!(cmd.contains(&"--env=DBNAME=dbname".to_string()), "{cmd:?}");
        assert!(
            cmd.contains(&"--export=dsn=/tmp/dsn".to_string()),
            "{cmd:?}"
        );
        let env: Vec<_> = step
            .env
            .clone()
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert!(env.contains(&"A".to_string()) && env.contains(&"SPUR_IO_UNIT".to_string()));
        let token = spec
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == "spur-io-token")
            .unwrap();
        let src = &token.projected.unwrap().sources.unwrap()[0];
        assert_eq!(
            src.service_account_token
                .as_ref()
                .unwrap()
                .audience
                .as_deref(),
            Some("spur-io")
        );
        let owner = &pod.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.uid.as_str(), owner.controller),
            ("olm-uid", Some(true))
        );
    }

    #[test]
    fn reserved_names_and_restart_policies_are_refused() {
        for (t, says) in [
            (
                json!({"spec": {"volumes": [{"name": "spur-io"}]}}),
                "reserved",
            ),
            (
                json!({"spec": {"initContainers": [{"name": "spur-io-init"}]}}),
                "reserved",
            ),
            (
                json!({"spec": {"restartPolicy": "Always"}}),
                "restartPolicy",
            ),
            (json!({"metadata": {"name": "x"}}), "pod name"),
        ] {
            let e = check_template(&t).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
        check_template(&json!({"spec": {"restartPolicy": "Never", "volumes": [{"name": "data"}]}}))
            .unwrap();
    }

    #[test]
    fn post_stop_backoff_doubles_to_its_cap() {
        let c = cfg();
        let waits: Vec<u64> = (1..=7).map(|a| backoff(&c, a).as_secs()).collect();
        assert_eq!(waits, [10, 20, 40, 80, 160, 300, 300]);
    }
}
