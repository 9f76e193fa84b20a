//! Just-in-time access controllers (docs/access.md): templates are checked into their status;
//! a request is granted for its duration and everything it made is deleted, with the request,
//! the moment it expires.
//!
//! ```text
//! ExecAccessRequest ──► Role + RoleBinding (pods get, pods/exec on one pod of the target, for the requester)
//! PodAccessRequest  ──► debug pod (cloned from the target's pod template) + Role + RoleBinding
//! ```
//!
//! The expiry is the request's creation time plus the granted duration, both stored on the
//! object, so an operator restart changes nothing: the first pass after it deletes what expired
//! meanwhile. Each pass asks to be woken at the expiry instant itself (and the error policy
//! never backs off past it), not at the next resync.
//!
//! The operator does not hold `pods/exec`: it creates the Roles under `escalate` and binds them
//! under `bind`, and a ValidatingAdmissionPolicy in the chart limits the Roles and RoleBindings
//! it may write to the shape built here (one pod, one user). "Ready" is not taken on trust: a
//! SubjectAccessReview must say the requester may exec into the pod.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, PodSpec};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::api::{Api, ApiResource, DynamicObject, ListParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Resource, ResourceExt};
use serde_json::Value;
use spur_api::access::{
    AccessConfig, AccessRequestStatus, AccessTemplateStatus, ExecAccessRequest, ExecAccessTemplate,
    PodAccessRequest, PodAccessTemplate, PodMutation, Requester, TargetKind, TargetRef,
    TunnelAccessRequest, TunnelAccessTemplate, conditions as cond, format_access_duration,
    labels as access_labels,
};
use spur_api::conditions::{ConditionStatus, NewCondition, READY, set_condition};
use spur_api::keys::labels::{FORK, MANAGED_BY, MANAGED_BY_VALUE, SANDBOX};
use spur_api::names;

use crate::Error;
use crate::context::{Context, delete_opt, now};

/// The finalizer on requests: what a grant made goes before the request does.
pub const FINALIZER: &str = "spur.dev/access-cleanup";
/// Templates are looked at again this often (their target may come or go).
const TEMPLATE_RESYNC: Duration = Duration::from_secs(60);
/// A request that is not ready yet (pod starting, template missing) is looked at again this
/// often.
const PENDING_RESYNC: Duration = Duration::from_secs(5);
/// A ready request is looked at again at least this often (its pod may be gone).
const READY_RESYNC: Duration = Duration::from_secs(60);
/// The annotation that names the container `kubectl exec` picks by default.
const DEFAULT_CONTAINER_ANNOTATION: &str = "kubectl.kubernetes.io/default-container";

// === Templates ===

pub(crate) async fn reconcile_exec_template(
    t: Arc<ExecAccessTemplate>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ExecAccessTemplate");
    let ns = namespace_of(&*t, "ExecAccessTemplate")?;
    let valid = t.spec.validate().map_err(|e| e.to_string());
    let target = check_target(&ctx, &ns, Some(&t.spec.target_ref)).await?;
    let status = template_status(t.status.as_ref(), t.metadata.generation, valid, target);
    let api: Api<ExecAccessTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.apply_status(&api, &*t, &t.status.clone().unwrap_or_default(), &status)
        .await?;
    ctx.succeeded(&key_of(&*t));
    Ok(Action::requeue(TEMPLATE_RESYNC))
}

pub(crate) async fn reconcile_pod_template(
    t: Arc<PodAccessTemplate>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("PodAccessTemplate");
    let ns = namespace_of(&*t, "PodAccessTemplate")?;
    let mut valid = t.spec.validate().map_err(|e| e.to_string());
    if valid.is_ok()
        && let Some(spec) = &t.spec.pod_spec
        && let Err(e) = serde_json::from_value::<PodSpec>(spec.clone())
    {
        valid = Err(format!("spec.podSpec: {e}"));
    }
    let target = check_target(&ctx, &ns, t.spec.target_ref.as_ref()).await?;
    let status = template_status(t.status.as_ref(), t.metadata.generation, valid, target);
    let api: Api<PodAccessTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.apply_status(&api, &*t, &t.status.clone().unwrap_or_default(), &status)
        .await?;
    ctx.succeeded(&key_of(&*t));
    Ok(Action::requeue(TEMPLATE_RESYNC))
}

pub(crate) fn template_error_policy<K>(t: Arc<K>, err: &Error, ctx: Arc<Context>) -> Action
where
    K: Resource<DynamicType = ()>,
{
    ctx.backoff(key_of(&*t), err)
}

/// `Ok(None)`: no target to check (a pod-spec template); `Ok(Some(Err))`: why the target is
/// unusable.
async fn check_target(
    ctx: &Context,
    ns: &str,
    target: Option<&TargetRef>,
) -> Result<Option<Result<(), String>>, Error> {
    let Some(target) = target else {
        return Ok(None);
    };
    Ok(Some(
        workload(ctx, ns, target.kind, &target.name)
            .await?
            .map(|_| ()),
    ))
}

fn template_status(
    old: Option<&AccessTemplateStatus>,
    generation: Option<i64>,
    valid: Result<(), String>,
    target: Option<Result<(), String>>,
) -> AccessTemplateStatus {
    let mut status = old.cloned().unwrap_or_default();
    let t = now();
    let mut set = |type_, ok: bool, reason: &str, message: &str| {
        set_condition(
            &mut status.conditions,
            NewCondition {
                type_,
                status: ok.into(),
                reason,
                message,
                observed_generation: generation,
            },
            &t,
        );
    };
    match &valid {
        Ok(()) => set(cond::TEMPLATE_DURATIONS_VALID, true, "Valid", ""),
        Err(e) => set(cond::TEMPLATE_DURATIONS_VALID, false, "Invalid", e),
    }
    match &target {
        None => set(
            cond::TARGET_REF_EXISTS,
            true,
            "NoTarget",
            "the template names no workload",
        ),
        Some(Ok(())) => set(cond::TARGET_REF_EXISTS, true, "Found", ""),
        Some(Err(e)) => set(cond::TARGET_REF_EXISTS, false, "NotFound", e),
    }
    let ready = valid.is_ok() && target.as_ref().is_none_or(Result::is_ok);
    let message = match (&valid, &target) {
        (Err(e), _) | (_, Some(Err(e))) => e.as_str(),
        _ => "",
    };
    set(
        READY,
        ready,
        if ready { "Ready" } else { "NotReady" },
        message,
    );
    status.ready = ready;
    status.observed_generation = generation;
    status
}

// === Requests ===

/// What the two request kinds share.
pub(crate) trait AccessRequest:
    Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + Clone
    + std::fmt::Debug
    + serde::Serialize
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
    /// `exec` or `pod`: the label value on what the request makes.
    const ACCESS: &'static str;
    fn template_name(&self) -> &str;
    fn duration(&self) -> Option<&str>;
    fn sandbox(&self) -> Option<&str>;
    fn requester(&self) -> Option<&Requester>;
    fn target_pod(&self) -> Option<&str>;
    fn status(&self) -> Option<&AccessRequestStatus>;
    /// A tunnel grant's workstation and token hash.
    fn tunnel(&self) -> Option<(&str, &str)> {
        None
    }
}

impl AccessRequest for TunnelAccessRequest {
    const ACCESS: &'static str = "tunnel";
    fn template_name(&self) -> &str {
        &self.spec.template_name
    }
    fn duration(&self) -> Option<&str> {
        self.spec.duration.as_deref()
    }
    fn sandbox(&self) -> Option<&str> {
        self.spec.sandbox.as_deref()
    }
    fn requester(&self) -> Option<&Requester> {
        self.spec.requester.as_ref()
    }
    fn target_pod(&self) -> Option<&str> {
        None
    }
    fn status(&self) -> Option<&AccessRequestStatus> {
        self.status.as_ref()
    }
    fn tunnel(&self) -> Option<(&str, &str)> {
        Some((&self.spec.workstation, &self.spec.token_sha256))
    }
}

impl AccessRequest for ExecAccessRequest {
    const ACCESS: &'static str = "exec";
    fn template_name(&self) -> &str {
        &self.spec.template_name
    }
    fn duration(&self) -> Option<&str> {
        self.spec.duration.as_deref()
    }
    fn sandbox(&self) -> Option<&str> {
        self.spec.sandbox.as_deref()
    }
    fn requester(&self) -> Option<&Requester> {
        self.spec.requester.as_ref()
    }
    fn target_pod(&self) -> Option<&str> {
        self.spec.target_pod.as_deref()
    }
    fn status(&self) -> Option<&AccessRequestStatus> {
        self.status.as_ref()
    }
}

impl AccessRequest for PodAccessRequest {
    const ACCESS: &'static str = "pod";
    fn template_name(&self) -> &str {
        &self.spec.template_name
    }
    fn duration(&self) -> Option<&str> {
        self.spec.duration.as_deref()
    }
    fn sandbox(&self) -> Option<&str> {
        self.spec.sandbox.as_deref()
    }
    fn requester(&self) -> Option<&Requester> {
        self.spec.requester.as_ref()
    }
    fn target_pod(&self) -> Option<&str> {
        None
    }
    fn status(&self) -> Option<&AccessRequestStatus> {
        self.status.as_ref()
    }
}

/// The template a request names, as far as a grant needs it.
enum Template {
    Exec(ExecAccessTemplate),
    Pod(PodAccessTemplate),
    Tunnel(TunnelAccessTemplate),
}

impl Template {
    fn access(&self) -> &AccessConfig {
        match self {
            Template::Exec(t) => &t.spec.access_config,
            Template::Pod(t) => &t.spec.access_config,
            Template::Tunnel(t) => &t.spec.access_config,
        }
    }

    fn ready(&self) -> bool {
        match self {
            Template::Exec(t) => t.status.as_ref().is_some_and(|s| s.ready),
            Template::Pod(t) => t.status.as_ref().is_some_and(|s| s.ready),
            Template::Tunnel(t) => t.status.as_ref().is_some_and(|s| s.ready),
        }
    }
}

pub(crate) async fn reconcile_exec(
    r: Arc<ExecAccessRequest>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ExecAccessRequest");
    reconcile_request(r, &ctx).await
}

pub(crate) async fn reconcile_pod(
    r: Arc<PodAccessRequest>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("PodAccessRequest");
    reconcile_request(r, &ctx).await
}

pub(crate) async fn reconcile_tunnel(
    r: Arc<TunnelAccessRequest>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("TunnelAccessRequest");
    reconcile_request(r, &ctx).await
}

pub(crate) async fn reconcile_tunnel_template(
    t: Arc<TunnelAccessTemplate>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("TunnelAccessTemplate");
    let ns = namespace_of(&*t, "TunnelAccessTemplate")?;
    let valid = t.spec.validate().map_err(|e| e.to_string());
    let status = template_status(t.status.as_ref(), t.metadata.generation, valid, None);
    let api: Api<TunnelAccessTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.apply_status(&api, &*t, &t.status.clone().unwrap_or_default(), &status)
        .await?;
    ctx.succeeded(&key_of(&*t));
    Ok(Action::requeue(TEMPLATE_RESYNC))
}

async fn reconcile_request<K: AccessRequest>(r: Arc<K>, ctx: &Context) -> Result<Action, Error> {
    let ns = namespace_of(&*r, kind_name::<K>())?;
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &ns);
    let action = finalizer(&api, FINALIZER, r, |event| async {
        match event {
            Event::Apply(r) => grant(&*r, &ns, ctx).await,
            Event::Cleanup(r) => revoke(&*r, &ns, ctx).await,
        }
    })
    .await;
    crate::error::from_finalizer(action)
}

/// The request kind's name, for messages.
fn kind_name<K: AccessRequest>() -> &'static str {
    match K::ACCESS {
        "exec" => "ExecAccessRequest",
        "pod" => "PodAccessRequest",
        _ => "TunnelAccessRequest",
    }
}

/// Never backs off past the request's expiry: a request failing at that instant is still
/// deleted on time. Past it, failures are retried every second (not in a tight loop).
pub(crate) fn request_error_policy<K: AccessRequest>(
    r: Arc<K>,
    err: &Error,
    ctx: Arc<Context>,
) -> Action {
    let delay = match err {
        Error::Requeue { after, .. } => *after,
        _ => ctx.backoff_delay(key_of(&*r), err),
    };
    let left = until(deadline(&*r));
    let cap = if left.is_zero() {
        Duration::from_secs(1)
    } else {
        left
    };
    Action::requeue(delay.min(cap).max(Duration::from_millis(50)))
}

/// When the request ends: its recorded expiry, never later than creation plus the longest
/// grant the API allows (so a status written by someone else cannot stretch it); a request
/// never granted ends at that bound too.
fn deadline<K: AccessRequest>(r: &K) -> k8s_openapi::jiff::Timestamp {
    let created = r
        .meta()
        .creation_timestamp
        .as_ref()
        .map_or_else(k8s_openapi::jiff::Timestamp::now, |t| t.0);
    let bound = created
        .checked_add(spur_api::access::MAX_ACCESS_DURATION)
        .unwrap_or(created);
    match r.status().and_then(|s| s.expires_at.as_ref()) {
        Some(at) => at.0.min(bound),
        None => bound,
    }
}

/// Time from now to `at` (zero when past).
fn until(at: k8s_openapi::jiff::Timestamp) -> Duration {
    Duration::try_from(at.duration_since(k8s_openapi::jiff::Timestamp::now()))
        .unwrap_or(Duration::ZERO)
}

/// Sets one condition of a request's status.
fn mark(
    status: &mut AccessRequestStatus,
    generation: Option<i64>,
    type_: &str,
    ok: ConditionStatus,
    reason: &str,
    message: &str,
) {
    set_condition(
        &mut status.conditions,
        NewCondition {
            type_,
            status: ok,
            reason,
            message,
            observed_generation: generation,
        },
        &now(),
    );
}

/// The request is not (or no longer) granted: `Ready=False`, and nothing of the grant left.
async fn withhold<K: AccessRequest>(
    r: &K,
    ns: &str,
    ctx: &Context,
    status: &mut AccessRequestStatus,
    reason: &str,
    message: &str,
) -> Result<(), Error> {
    let generation = r.meta().generation;
    let removed = remove_grant::<K>(ctx, ns, &r.name_any(), true).await?;
    if removed || status.ready {
        mark(
            status,
            generation,
            cond::ACCESS_RESOURCES_CREATED,
            ConditionStatus::False,
            "Removed",
            message,
        );
        mark(
            status,
            generation,
            cond::ACCESS_RESOURCES_READY,
            ConditionStatus::False,
            "Removed",
            message,
        );
    }
    status.ready = false;
    status.access_message = None;
    mark(
        status,
        generation,
        READY,
        ConditionStatus::False,
        reason,
        message,
    );
    Ok(())
}

/// One pass of a request that is not being deleted.
async fn grant<K: AccessRequest>(r: &K, ns: &str, ctx: &Context) -> Result<Action, Error> {
    let name = r.name_any();
    let old = r.status().cloned().unwrap_or_default();
    let mut status = old.clone();
    let generation = r.meta().generation;
    let set = |status: &mut AccessRequestStatus, type_, ok, reason: &str, message: &str| {
        mark(status, generation, type_, ok, reason, message);
    };
    let api: Api<K> = Api::namespaced(ctx.client.clone(), ns);

    // Expiry first: whatever else is wrong, an expired request goes, and its grant with it.
    if until(deadline(r)).is_zero() {
        return expire(r, ns, ctx, &api, &old, status).await;
    }

    // The template. Gone or broken, it grants nothing any more: a platform team deleting a
    // template cuts the access it gave.
    let template = match get_template::<K>(ctx, ns, r.template_name()).await? {
        Some(t) if t.ready() => t,
        found => {
            let (reason, message) = if found.is_some() {
                (
                    "TemplateNotReady",
                    format!(
                        "template {} is not ready (see its conditions)",
                        r.template_name()
                    ),
                )
            } else {
                (
                    "TemplateNotFound",
                    format!(
                        "no {} {} in namespace {ns}",
                        kind_name::<K>().replace("Request", "Template"),
                        r.template_name()
                    ),
                )
            };
            set(
                &mut status,
                cond::TARGET_TEMPLATE_EXISTS,
                ConditionStatus::False,
                reason,
                &message,
            );
            withhold(r, ns, ctx, &mut status, reason, &message).await?;
            ctx.apply_status(&api, r, &old, &status).await?;
            return Ok(requeue_within(PENDING_RESYNC, until(deadline(r))));
        }
    };
    set(
        &mut status,
        cond::TARGET_TEMPLATE_EXISTS,
        ConditionStatus::True,
        "Found",
        "",
    );

    // The requester, and whether the template lets them ask.
    let Some(requester) = r.requester().filter(|q| !q.username.is_empty()) else {
        let message = "spec.requester is not set: the access webhook stamps it at admission (is the chart's access.enabled on?)";
        set(
            &mut status,
            cond::REQUESTER_ALLOWED,
            ConditionStatus::False,
            "NoRequester",
            message,
        );
        withhold(r, ns, ctx, &mut status, "NoRequester", message).await?;
        ctx.apply_status(&api, r, &old, &status).await?;
        return Ok(requeue_within(READY_RESYNC, until(deadline(r))));
    };
    if !template.access().allows(&requester.groups) {
        let message = format!(
            "{} is in none of the template's allowed groups ({})",
            requester.username,
            template.access().allowed_groups.join(", ")
        );
        set(
            &mut status,
            cond::REQUESTER_ALLOWED,
            ConditionStatus::False,
            "NotInAllowedGroups",
            &message,
        );
        // Nothing may stay granted to someone the template no longer allows.
        withhold(r, ns, ctx, &mut status, "NotInAllowedGroups", &message).await?;
        ctx.apply_status(&api, r, &old, &status).await?;
        return Ok(requeue_within(READY_RESYNC, until(deadline(r))));
    }
    set(
        &mut status,
        cond::REQUESTER_ALLOWED,
        ConditionStatus::True,
        "InAllowedGroup",
        "",
    );

    // The duration, decided once: a template changed later does not stretch a grant.
    if status.expires_at.is_none() {
        match template.access().grant(r.duration()) {
            Ok(g) => {
                let created = r
                    .meta()
                    .creation_timestamp
                    .as_ref()
                    .map_or_else(k8s_openapi::jiff::Timestamp::now, |t| t.0);
                let at = created.checked_add(g.duration).unwrap_or(created);
                let message = if g.capped {
                    format!(
                        "asked for {}, above the template's maximum: granted {}",
                        r.duration().unwrap_or_default(),
                        format_access_duration(g.duration)
                    )
                } else {
                    format!("granted {}", format_access_duration(g.duration))
                };
                let reason = if g.capped { "Capped" } else { "Valid" };
                set(
                    &mut status,
                    cond::ACCESS_DURATIONS_VALID,
                    ConditionStatus::True,
                    reason,
                    &message,
                );
                status.duration = Some(format_access_duration(g.duration));
                status.expires_at = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at));
            }
            Err(e) => {
                set(
                    &mut status,
                    cond::ACCESS_DURATIONS_VALID,
                    ConditionStatus::False,
                    "Invalid",
                    &e,
                );
                withhold(r, ns, ctx, &mut status, "InvalidDuration", &e).await?;
                ctx.apply_status(&api, r, &old, &status).await?;
                return Ok(requeue_within(READY_RESYNC, until(deadline(r))));
            }
        }
        set(
            &mut status,
            cond::ACCESS_STILL_VALID,
            ConditionStatus::True,
            "NotExpired",
            "",
        );
        // The expiry is on the object before anything is granted: whatever fails next, the
        // error policy and a restarted operator know when to take the grant back.
        ctx.apply_status(&api, r, &old, &status).await?;
        return Ok(Action::requeue(Duration::from_millis(50)));
    }
    let left = until(deadline(r));
    if left.is_zero() {
        return expire(r, ns, ctx, &api, &old, status).await;
    }

    if let Template::Tunnel(t) = &template {
        return tunnel_grant(
            r,
            ns,
            ctx,
            &api,
            &old,
            status,
            &t.spec.access_config,
            requester,
            left,
        )
        .await;
    }

    // The pod.
    let owner = r
        .controller_owner_ref(&())
        .ok_or_else(|| Error::Pending("request uid".into()))?;
    let chosen = match &template {
        Template::Exec(t) => {
            pick_pod(
                ctx,
                ns,
                &t.spec.target_ref,
                r.sandbox(),
                r.target_pod().or(status.pod_name.as_deref()),
            )
            .await?
        }
        Template::Tunnel(_) => return Ok(Action::await_change()),
        Template::Pod(t) => match debug_pod(ctx, ns, &name, t, r.sandbox(), left, &owner).await? {
            Ok(pod) => PodChoice::Chosen(Box::new(pod)),
            Err((reason, e)) => PodChoice::Unavailable(reason, e),
        },
    };
    let pod = match chosen {
        PodChoice::Chosen(p) => p,
        PodChoice::Unavailable(reason, message) => {
            set(
                &mut status,
                cond::ACCESS_RESOURCES_CREATED,
                ConditionStatus::False,
                reason,
                &message,
            );
            withhold(r, ns, ctx, &mut status, reason, &message).await?;
            ctx.apply_status(&api, r, &old, &status).await?;
            return Ok(requeue_within(PENDING_RESYNC, left));
        }
    };
    let pod_name = pod.name_any();
    if status.pod_name.as_ref().is_some_and(|p| *p != pod_name) {
        // The pod chosen first is gone (or no longer the workload's): a grant never moves.
        let message = format!(
            "pod {} is gone: file a new request",
            status.pod_name.clone().unwrap_or_default()
        );
        set(
            &mut status,
            cond::ACCESS_RESOURCES_READY,
            ConditionStatus::False,
            "PodGone",
            &message,
        );
        withhold(r, ns, ctx, &mut status, "PodGone", &message).await?;
        ctx.apply_status(&api, r, &old, &status).await?;
        return Ok(requeue_within(READY_RESYNC, left));
    }
    status.pod_name = Some(pod_name.clone());
    let container = match &template {
        Template::Exec(t) => t.spec.container.clone(),
        Template::Pod(t) => t
            .spec
            .mutation
            .as_ref()
            .and_then(|m| m.default_container.clone()),
        Template::Tunnel(_) => None,
    }
    .or_else(|| default_container(&pod));
    status.container = container.clone();

    // The Role and RoleBinding, for the requester alone.
    let role_name = grant_name(K::ACCESS, ns, &name);
    let labels = grant_labels(K::ACCESS, &name);
    apply_grant(
        ctx,
        ns,
        &role_name,
        &labels,
        &pod_name,
        &requester.username,
        &owner,
    )
    .await?;
    set(
        &mut status,
        cond::ACCESS_RESOURCES_CREATED,
        ConditionStatus::True,
        "Created",
        &format!("Role and RoleBinding {role_name}"),
    );

    // Ready: the pod runs and the API server agrees the requester may exec into it.
    let running = is_running(&pod, K::ACCESS == "pod");
    let allowed = if running {
        may_exec(ctx, ns, &pod_name, requester).await?
    } else {
        false
    };
    if !(running && allowed) {
        let message = if running {
            format!(
                "the API server does not yet allow {} to exec into {pod_name}",
                requester.username
            )
        } else {
            format!("pod {pod_name} is not running and ready yet")
        };
        set(
            &mut status,
            cond::ACCESS_RESOURCES_READY,
            ConditionStatus::False,
            "Waiting",
            &message,
        );
        status.ready = false;
        status.access_message = None;
        set(
            &mut status,
            READY,
            ConditionStatus::False,
            "Waiting",
            &message,
        );
        ctx.apply_status(&api, r, &old, &status).await?;
        return Ok(requeue_within(Duration::from_secs(1), left));
    }
    set(
        &mut status,
        cond::ACCESS_RESOURCES_READY,
        ConditionStatus::True,
        "Allowed",
        "",
    );
    let command =
        template
            .access()
            .access_command(ns, &pod_name, container.as_deref().unwrap_or("app"));
    status.access_message = Some(command);
    status.ready = true;
    let message = format!(
        "{} may exec into {pod_name} until {}",
        requester.username,
        status
            .expires_at
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default()
    );
    set(
        &mut status,
        READY,
        ConditionStatus::True,
        "Granted",
        &message,
    );
    if ctx.apply_status(&api, r, &old, &status).await? && !old.ready {
        tracing::info!(kind = K::ACCESS, namespace = ns, request = %name, user = %requester.username, pod = %pod_name, expires = ?status.expires_at, "access granted");
        ctx.metrics.access_grant(K::ACCESS, "granted");
        ctx.event(r, false, "Granted", "Grant", message).await;
    }
    ctx.succeeded(&key_of(r));
    Ok(requeue_within(READY_RESYNC, left))
}

/// A tunnel grant: the workstation is this user's alone while the grant lasts, the sandbox
/// (if named) exists, and the token Secret (only the token's hash, expiring with the grant)
/// is where the tunnel proxy looks.
#[allow(clippy::too_many_arguments)]
async fn tunnel_grant<K: AccessRequest>(
    r: &K,
    ns: &str,
    ctx: &Context,
    api: &Api<K>,
    old: &AccessRequestStatus,
    mut status: AccessRequestStatus,
    access: &AccessConfig,
    requester: &Requester,
    left: Duration,
) -> Result<Action, Error> {
    use spur_api::tunnel::credentials as cred;
    let generation = r.meta().generation;
    let name = r.name_any();
    let Some((workstation, hash)) = r.tunnel() else {
        return Ok(Action::await_change());
    };
    let Some(token_ns) = ctx.access_tokens.clone() else {
        let message =
            "the operator has no token namespace for tunnel grants (--access-token-namespace)";
        withhold(r, ns, ctx, &mut status, "NoTokenNamespace", message).await?;
        ctx.apply_status(api, r, old, &status).await?;
        return Ok(requeue_within(READY_RESYNC, left));
    };
    if let Some(sandbox) = r.sandbox()
        && Api::<spur_api::Sandbox>::all(ctx.client.clone())
            .get_opt(sandbox)
            .await?
            .is_none()
    {
        let message = format!("sandbox {sandbox} does not exist");
        withhold(r, ns, ctx, &mut status, "NoSandbox", &message).await?;
        ctx.apply_status(api, r, old, &status).await?;
        return Ok(requeue_within(PENDING_RESYNC, left));
    }
    // A workstation is one user's at a time: another user's live grant that is already in
    // effect holds it; of two not yet in effect, the older request. (Creation times have
    // whole seconds, so age alone would often be a coin toss.)
    let others = Api::<TunnelAccessRequest>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await?;
    let mine = (r.meta().creation_timestamp.clone(), r.meta().uid.clone());
    let holder = others.items.iter().find(|o| {
        let in_effect = o.status.as_ref().is_some_and(|s| s.ready);
        o.spec.workstation == workstation
            && o.meta().uid != r.meta().uid
            && o.meta().deletion_timestamp.is_none()
            && o.spec.requester.as_ref().map(|q| q.username.as_str())
                != Some(requester.username.as_str())
            && until(deadline(*o)) > Duration::ZERO
            && (in_effect
                || (!old.ready
                    && (o.meta().creation_timestamp.clone(), o.meta().uid.clone()) < mine))
    });
    if let Some(h) = holder {
        let message = format!(
            "workstation {workstation} is held by another user's grant ({}/{}) until it ends",
            h.namespace().unwrap_or_default(),
            h.name_any()
        );
        withhold(r, ns, ctx, &mut status, "WorkstationTaken", &message).await?;
        ctx.apply_status(api, r, old, &status).await?;
        return Ok(requeue_within(PENDING_RESYNC, left));
    }
    // The workstation is recorded as the requester's until the grant ends (docs/local.md,
    // "Workstation owners"): their Sandboxes may then name it, and nobody else's. A workstation
    // another user owns (their certificate or grant has not ended) is not handed over.
    let owners = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(
        ctx.client.clone(),
        &ctx.tunnels.namespace,
    );
    let until = status.expires_at.as_ref().map(|t| t.0);
    if let Err(refused) = crate::workstation_owner::claim(
        &owners,
        &ctx.tunnels.namespace,
        workstation,
        &requester.username,
        until,
    )
    .await?
    {
        let message = format!("workstation {workstation}: {refused}");
        withhold(r, ns, ctx, &mut status, "WorkstationOwned", &message).await?;
        ctx.apply_status(api, r, old, &status).await?;
        return Ok(requeue_within(PENDING_RESYNC, left));
    }
    let secret_name = grant_name("tunnel", ns, &name);
    let expires = status
        .expires_at
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    let issued = r
        .meta()
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    let secret = serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {
            "name": secret_name,
            "namespace": token_ns,
            "labels": {
                spur_api::tunnel::WORKSTATION_LABEL: workstation,
                cred::CREDENTIAL_LABEL: "token",
                access_labels::ACCESS_REQUEST: names::label_value(&name),
                access_labels::ACCESS_KIND: "tunnel",
                MANAGED_BY: MANAGED_BY_VALUE,
            },
            "annotations": {
                cred::EXPIRES_ANNOTATION: expires,
                cred::ISSUED_ANNOTATION: issued,
                "spur.dev/access-request-namespace": ns,
            },
        },
        "type": "Opaque",
        "stringData": {cred::TOKEN_SHA256_KEY: hash},
    });
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(ctx.client.clone(), &token_ns)
        .patch(
            &secret_name,
            &kube::api::PatchParams::apply(crate::FIELD_MANAGER).force(),
            &kube::api::Patch::Apply(&secret),
        )
        .await?;
    mark(
        &mut status,
        generation,
        cond::ACCESS_RESOURCES_CREATED,
        ConditionStatus::True,
        "Created",
        &format!("token Secret {token_ns}/{secret_name}"),
    );
    mark(
        &mut status,
        generation,
        cond::ACCESS_RESOURCES_READY,
        ConditionStatus::True,
        "Allowed",
        "",
    );
    status.access_message = Some(access.tunnel_command(ns, workstation));
    status.ready = true;
    let message = format!(
        "{} may open a tunnel as workstation {workstation} until {expires}",
        requester.username
    );
    mark(
        &mut status,
        generation,
        READY,
        ConditionStatus::True,
        "Granted",
        &message,
    );
    if ctx.apply_status(api, r, old, &status).await? && !old.ready {
        tracing::info!(kind = K::ACCESS, namespace = ns, request = %name, user = %requester.username, workstation, expires, "tunnel access granted");
        ctx.metrics.access_grant(K::ACCESS, "granted");
        ctx.event(r, false, "Granted", "Grant", message).await;
    }
    ctx.succeeded(&key_of(r));
    Ok(requeue_within(READY_RESYNC, left))
}

/// The request's time is up: the grant goes first (so it ends now, not after the finalizer
/// pass), then the request.
async fn expire<K: AccessRequest>(
    r: &K,
    ns: &str,
    ctx: &Context,
    api: &Api<K>,
    old: &AccessRequestStatus,
    mut status: AccessRequestStatus,
) -> Result<Action, Error> {
    let name = r.name_any();
    let generation = r.meta().generation;
    mark(
        &mut status,
        generation,
        cond::ACCESS_STILL_VALID,
        ConditionStatus::False,
        "Expired",
        "the grant has expired",
    );
    withhold(r, ns, ctx, &mut status, "Expired", "the grant has expired").await?;
    ctx.apply_status(api, r, old, &status).await?;
    let user = r
        .requester()
        .map(|q| q.username.clone())
        .unwrap_or_default();
    ctx.event(
        r,
        false,
        "Expired",
        "Delete",
        format!("the grant to {user} expired; deleting the request"),
    )
    .await;
    tracing::info!(kind = K::ACCESS, namespace = ns, request = %name, user = %user, "access grant expired");
    ctx.metrics.access_grant(K::ACCESS, "expired");
    delete_opt(api, &name).await?;
    Ok(Action::await_change())
}

/// Wakes at `every` or at the expiry, whichever comes first.
fn requeue_within(every: Duration, left: Duration) -> Action {
    Action::requeue(every.min(left).max(Duration::from_millis(50)))
}

/// Deletes what a request made; the owner references would have the garbage collector do it
/// too, but not on time.
async fn revoke<K: AccessRequest>(r: &K, ns: &str, ctx: &Context) -> Result<Action, Error> {
    let name = r.name_any();
    remove_grant::<K>(ctx, ns, &name, true).await?;
    tracing::info!(kind = K::ACCESS, namespace = ns, request = %name, "access request deleted: grant removed");
    ctx.metrics.access_grant(K::ACCESS, "revoked");
    Ok(Action::await_change())
}

/// Deletes the request's RoleBinding (first: once it is gone, nothing is granted whatever
/// happens next), Role and debug pod; whether any of them existed.
async fn remove_grant<K: AccessRequest>(
    ctx: &Context,
    ns: &str,
    request: &str,
    with_pod: bool,
) -> Result<bool, Error> {
    let role_name = grant_name(K::ACCESS, ns, request);
    let mut removed = delete_existing(
        &Api::<RoleBinding>::namespaced(ctx.client.clone(), ns),
        &role_name,
    )
    .await?;
    removed |=
        delete_existing(&Api::<Role>::namespaced(ctx.client.clone(), ns), &role_name).await?;
    if K::ACCESS == "tunnel" {
        removed |= remove_tunnel_token(ctx, ns, request).await?;
    }
    if with_pod && K::ACCESS == "pod" {
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
        let name = debug_pod_name(ns, request);
        // Only the pod this request made (a pod of that name may be someone else's).
        if let Some(pod) = pods.get_metadata_opt(&name).await?
            && is_debug_pod_of(&pod.metadata, request)
        {
            removed |= delete_existing(&pods, &name).await?;
        }
    }
    Ok(removed)
}

/// Deletes a tunnel grant's token Secret. Taken back before its expiry, the grant's open
/// tunnels are closed too: a revocation of the workstation's credentials issued until now
/// (the tunnel proxy closes such sessions; at expiry they end by themselves).
async fn remove_tunnel_token(ctx: &Context, ns: &str, request: &str) -> Result<bool, Error> {
    use spur_api::tunnel::credentials as cred;
    let Some(token_ns) = ctx.access_tokens.as_deref() else {
        return Ok(false);
    };
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(ctx.client.clone(), token_ns);
    let name = grant_name("tunnel", ns, request);
    let Some(secret) = secrets.get_metadata_opt(&name).await? else {
        return Ok(false);
    };
    // Only the Secret this grant wrote.
    if secret.labels().get(access_labels::ACCESS_REQUEST) != Some(&names::label_value(request)) {
        return Ok(false);
    }
    let workstation = secret
        .labels()
        .get(spur_api::tunnel::WORKSTATION_LABEL)
        .cloned();
    let early = secret
        .annotations()
        .get(cred::EXPIRES_ANNOTATION)
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
        .is_some_and(|at| at > k8s_openapi::jiff::Timestamp::now());
    let removed = delete_existing(&secrets, &name).await?;
    if early && let Some(ws) = workstation {
        let now = k8s_openapi::jiff::Timestamp::now();
        let revocation = serde_json::json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {
                "name": cred::revocation_secret_name(&ws),
                "namespace": token_ns,
                "labels": {
                    spur_api::tunnel::WORKSTATION_LABEL: ws,
                    cred::CREDENTIAL_LABEL: "revocation",
                    MANAGED_BY: MANAGED_BY_VALUE,
                },
                "annotations": {cred::REVOKED_BEFORE_ANNOTATION: now.to_string()},
            },
            "type": "Opaque",
        });
        secrets
            .patch(
                &cred::revocation_secret_name(&ws),
                &kube::api::PatchParams::apply(crate::FIELD_MANAGER).force(),
                &kube::api::Patch::Apply(&revocation),
            )
            .await?;
        tracing::info!(workstation = %ws, request, "tunnel grant taken back before its end: workstation credentials revoked");
    }
    Ok(removed)
}

/// Whether `meta` is the debug pod of PodAccessRequest `request`.
fn is_debug_pod_of(meta: &ObjectMeta, request: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.kind == "PodAccessRequest" && o.name == request)
}

/// Deletes `name`; whether it existed.
async fn delete_existing<K>(api: &Api<K>, name: &str) -> Result<bool, Error>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    match api
        .delete(name, &kube::api::DeleteParams::background())
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(false),
        Err(e) => Err(e.into()),
    }
}

async fn get_template<K: AccessRequest>(
    ctx: &Context,
    ns: &str,
    name: &str,
) -> Result<Option<Template>, Error> {
    let c = ctx.client.clone();
    Ok(match K::ACCESS {
        "exec" => Api::<ExecAccessTemplate>::namespaced(c, ns)
            .get_opt(name)
            .await?
            .map(Template::Exec),
        "pod" => Api::<PodAccessTemplate>::namespaced(c, ns)
            .get_opt(name)
            .await?
            .map(Template::Pod),
        _ => Api::<TunnelAccessTemplate>::namespaced(c, ns)
            .get_opt(name)
            .await?
            .map(Template::Tunnel),
    })
}

/// Name of a request's Role and RoleBinding.
pub fn grant_name(access: &str, ns: &str, request: &str) -> String {
    names::derived_name(&["access", request], &[access, ns])
}

/// Name of a PodAccessRequest's debug pod.
pub fn debug_pod_name(ns: &str, request: &str) -> String {
    names::derived_name(&[request, "debug"], &["debug-pod", ns])
}

fn grant_labels(access: &str, request: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned()),
        (
            access_labels::ACCESS_REQUEST.to_owned(),
            names::label_value(request),
        ),
        (access_labels::ACCESS_KIND.to_owned(), access.to_owned()),
    ])
}

async fn apply_grant(
    ctx: &Context,
    ns: &str,
    name: &str,
    labels: &BTreeMap<String, String>,
    pod: &str,
    user: &str,
    owner: &OwnerReference,
) -> Result<(), Error> {
    let meta = ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(ns.to_owned()),
        labels: Some(labels.clone()),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    };
    let rule = |resource: &str, verbs: &[&str]| PolicyRule {
        api_groups: Some(vec![String::new()]),
        resources: Some(vec![resource.to_owned()]),
        resource_names: Some(vec![pod.to_owned()]),
        verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
        ..PolicyRule::default()
    };
    let role = Role {
        metadata: meta.clone(),
        // `get` on pods/exec as well as `create`: kubectl's WebSocket exec is a GET.
        rules: Some(vec![
            rule("pods", &["get"]),
            rule("pods/exec", &["get", "create"]),
        ]),
    };
    let binding = RoleBinding {
        metadata: meta,
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: name.to_owned(),
        },
        subjects: Some(vec![Subject {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "User".into(),
            name: user.to_owned(),
            namespace: None,
        }]),
    };
    crate::apply::ensure(&Api::<Role>::namespaced(ctx.client.clone(), ns), None, role).await?;
    crate::apply::ensure(
        &Api::<RoleBinding>::namespaced(ctx.client.clone(), ns),
        None,
        binding,
    )
    .await?;
    Ok(())
}

/// A SubjectAccessReview for the requester: may they exec into `pod`?
async fn may_exec(ctx: &Context, ns: &str, pod: &str, who: &Requester) -> Result<bool, Error> {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(who.username.clone()),
            uid: who.uid.clone(),
            groups: Some(who.groups.clone()),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(ns.to_owned()),
                verb: Some("create".into()),
                resource: Some("pods".into()),
                subresource: Some("exec".into()),
                name: Some(pod.to_owned()),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    let answer = Api::<SubjectAccessReview>::all(ctx.client.clone())
        .create(&PostParams::default(), &review)
        .await?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

enum PodChoice {
    Chosen(Box<Pod>),
    /// A condition reason and message.
    Unavailable(&'static str, String),
}

/// The workload object (`spec.selector` and `spec.template`), or why it is unusable.
async fn workload(
    ctx: &Context,
    ns: &str,
    kind: TargetKind,
    name: &str,
) -> Result<Result<DynamicObject, String>, Error> {
    let (group, version, plural) = match kind {
        TargetKind::Deployment => ("apps", "v1", "deployments"),
        TargetKind::StatefulSet => ("apps", "v1", "statefulsets"),
        TargetKind::DaemonSet => ("apps", "v1", "daemonsets"),
        TargetKind::Rollout => ("argoproj.io", "v1alpha1", "rollouts"),
    };
    let ar = ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: if group.is_empty() {
            version.into()
        } else {
            format!("{group}/{version}")
        },
        kind: kind.as_str().into(),
        plural: plural.into(),
    };
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), ns, &ar);
    match api.get_opt(name).await {
        Ok(Some(o)) => Ok(Ok(o)),
        Ok(None) => Ok(Err(format!("{kind} {ns}/{name} does not exist"))),
        // No such resource at all (Argo Rollouts not installed).
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Err(format!(
            "{kind} {ns}/{name} does not exist ({})",
            s.message
        ))),
        Err(e) => Err(e.into()),
    }
}

/// The workload a request reaches: the template's target, or a sandbox's fork of it.
async fn resolve_target(
    ctx: &Context,
    ns: &str,
    target: &TargetRef,
    sandbox: Option<&str>,
) -> Result<Result<DynamicObject, String>, Error> {
    let Some(sandbox) = sandbox else {
        return workload(ctx, ns, target.kind, &target.name).await;
    };
    let Some(kind) = target.kind.forkable() else {
        return Ok(Err(format!("a sandbox cannot fork a {}", target.kind)));
    };
    let fork = names::fork_name(sandbox, &spur_api::WorkloadRef::new(kind, ns, &target.name));
    let w = match workload(ctx, ns, target.kind, &fork).await? {
        Ok(w) => w,
        Err(_) => {
            return Ok(Err(format!(
                "sandbox {sandbox} has no fork of {target} in {ns}"
            )));
        }
    };
    // A fork is only the sandbox's if the operator made it for that sandbox.
    let labels = w.labels();
    if labels.get(SANDBOX).map(String::as_str) != Some(sandbox)
        || labels.get(MANAGED_BY).map(String::as_str) != Some(MANAGED_BY_VALUE)
    {
        return Ok(Err(format!(
            "{} {ns}/{fork} is not a fork of sandbox {sandbox}",
            target.kind
        )));
    }
    Ok(Ok(w))
}

/// A pod of the target (the sandbox's fork of it, with `sandbox`): `wanted` if it is one, else
/// a running one (ready ones first, then by name). A pod is the workload's when its
/// controller chain leads to the workload's uid, not merely when the selector matches it:
/// selectors of different workloads may overlap.
async fn pick_pod(
    ctx: &Context,
    ns: &str,
    target: &TargetRef,
    sandbox: Option<&str>,
    wanted: Option<&str>,
) -> Result<PodChoice, Error> {
    let w = match resolve_target(ctx, ns, target, sandbox).await? {
        Ok(w) => w,
        Err(e) => return Ok(PodChoice::Unavailable("NoPod", e)),
    };
    let selector: LabelSelector = match w
        .data
        .pointer("/spec/selector")
        .cloned()
        .map(serde_json::from_value)
    {
        Some(Ok(s)) => s,
        _ => {
            return Ok(PodChoice::Unavailable(
                "NoPod",
                format!("{target} has no usable spec.selector"),
            ));
        }
    };
    let Some(query) = selector_query(&selector) else {
        return Ok(PodChoice::Unavailable(
            "NoPod",
            format!("{target} has an empty or unusable spec.selector"),
        ));
    };
    let uid = w.metadata.uid.clone().unwrap_or_default();
    let fork = w.name_any();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let listed = pods
        .list(&ListParams::default().labels(&query))
        .await?
        .items;
    let replicasets: Api<k8s_openapi::api::apps::v1::ReplicaSet> =
        Api::namespaced(ctx.client.clone(), ns);
    let mut owners_of_rs: BTreeMap<String, Option<String>> = BTreeMap::new();
    let mut candidates = Vec::new();
    for p in listed {
        // Fork pods are the fork's: a grant on the baseline never reaches them, and one in
        // a sandbox reaches only its own fork's (fork pods drop the baseline's selector
        // labels too; this holds even if someone copied them back).
        let fork_label = p.labels().get(FORK);
        let fork_ok = match sandbox {
            None => fork_label.is_none(),
            Some(_) => fork_label == Some(&fork),
        };
        if !fork_ok
            || p.labels().contains_key(access_labels::ACCESS_REQUEST)
            || p.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
        let Some(controller) = p
            .owner_references()
            .iter()
            .find(|o| o.controller == Some(true))
            .cloned()
        else {
            continue;
        };
        let owned = match target.kind {
            TargetKind::StatefulSet | TargetKind::DaemonSet => controller.uid == uid,
            TargetKind::Deployment | TargetKind::Rollout => {
                if controller.kind != "ReplicaSet" {
                    false
                } else {
                    if !owners_of_rs.contains_key(&controller.name) {
                        let owner = replicasets.get_opt(&controller.name).await?.and_then(|rs| {
                            rs.owner_references()
                                .iter()
                                .find(|o| o.controller == Some(true))
                                .map(|o| o.uid.clone())
                        });
                        owners_of_rs.insert(controller.name.clone(), owner);
                    }
                    owners_of_rs
                        .get(&controller.name)
                        .and_then(Option::as_deref)
                        == Some(uid.as_str())
                }
            }
        };
        if owned {
            candidates.push(p);
        }
    }
    let of_what = match sandbox {
        Some(s) => format!("{target} in sandbox {s}"),
        None => target.to_string(),
    };
    if let Some(wanted) = wanted {
        return Ok(
            match candidates.into_iter().find(|p| p.name_any() == wanted) {
                Some(p) => PodChoice::Chosen(Box::new(p)),
                None => PodChoice::Unavailable(
                    "NoPod",
                    format!("pod {wanted} is not a (live) pod of {of_what}"),
                ),
            },
        );
    }
    candidates.sort_by_key(|p| (!is_running(p, true), p.name_any()));
    Ok(match candidates.into_iter().next() {
        Some(p) if is_running(&p, false) => PodChoice::Chosen(Box::new(p)),
        _ => PodChoice::Unavailable("NoPod", format!("{of_what} has no running pod")),
    })
}

/// `key=value,key in (a,b),!key` for a label selector; `None` when it selects everything (an
/// empty selector) or uses an operator this does not know.
fn selector_query(s: &LabelSelector) -> Option<String> {
    let mut parts: Vec<String> = s
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in s.match_expressions.iter().flatten() {
        let values = e.values.clone().unwrap_or_default();
        // `in ()` is not a valid query (and selects nothing in the API's own terms).
        if matches!(e.operator.as_str(), "In" | "NotIn") && values.is_empty() {
            return None;
        }
        let values = values.join(",");
        parts.push(match e.operator.as_str() {
            "In" => format!("{} in ({values})", e.key),
            "NotIn" => format!("{} notin ({values})", e.key),
            "Exists" => e.key.clone(),
            "DoesNotExist" => format!("!{}", e.key),
            _ => return None,
        });
    }
    (!parts.is_empty()).then(|| parts.join(","))
}

fn is_running(pod: &Pod, need_ready: bool) -> bool {
    let Some(status) = &pod.status else {
        return false;
    };
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    status.phase.as_deref() == Some("Running") && (ready || !need_ready)
}

/// The container `kubectl exec` should name: the pod's default-container annotation, else its
/// first container that is not Spur's injected sidecar (the application's).
fn default_container(pod: &Pod) -> Option<String> {
    pod.annotations()
        .get(DEFAULT_CONTAINER_ANNOTATION)
        .cloned()
        .or_else(|| {
            let containers = &pod.spec.as_ref()?.containers;
            containers
                .iter()
                .find(|c| c.name != spur_api::keys::injection::SIDECAR_CONTAINER)
                .or(containers.first())
                .map(|c| c.name.clone())
        })
}

/// Creates (once) the debug pod of a PodAccessRequest: the pod, or a condition reason and why
/// there is none.
async fn debug_pod(
    ctx: &Context,
    ns: &str,
    request: &str,
    template: &PodAccessTemplate,
    sandbox: Option<&str>,
    left: Duration,
    owner: &OwnerReference,
) -> Result<Result<Pod, (&'static str, String)>, Error> {
    let name = debug_pod_name(ns, request);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    if let Some(pod) = pods.get_opt(&name).await? {
        let ours = pod
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && o.uid == owner.uid);
        return Ok(match (ours, pod.metadata.deletion_timestamp.is_some()) {
            (true, false) => Ok(pod),
            (true, true) => Err((
                "PodGone",
                format!("debug pod {name} is being deleted: file a new request"),
            )),
            (false, _) => Err((
                "PodConflict",
                format!("a pod named {name} exists and is not this request's"),
            )),
        });
    }
    let mut claims = Vec::new();
    let (template_meta, spec) = match (&template.spec.target_ref, &template.spec.pod_spec) {
        (Some(target), _) => {
            let w = match resolve_target(ctx, ns, target, sandbox).await? {
                Ok(w) => w,
                Err(e) => return Ok(Err(("NoPod", e))),
            };
            let Some(t) = w.data.pointer("/spec/template").cloned() else {
                return Ok(Err(("NoPod", format!("{target} has no spec.template"))));
            };
            // A StatefulSet's claims become volumes of its pods: the debug pod gets empty
            // ones instead (it must not share a replica's disk).
            claims = w
                .data
                .pointer("/spec/volumeClaimTemplates")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|c| c.pointer("/metadata/name").and_then(Value::as_str))
                .map(str::to_owned)
                .collect();
            let meta: ObjectMeta = t
                .get("metadata")
                .cloned()
                .map(serde_json::from_value)
                .transpose()
                .map_err(Error::Json)?
                .unwrap_or_default();
            match t
                .get("spec")
                .cloned()
                .map(serde_json::from_value::<PodSpec>)
            {
                Some(Ok(spec)) => (meta, spec),
                _ => {
                    return Ok(Err((
                        "NoPod",
                        format!("{target} has an unreadable pod template"),
                    )));
                }
            }
        }
        (None, Some(spec)) => match serde_json::from_value::<PodSpec>(spec.clone()) {
            Ok(spec) => (ObjectMeta::default(), spec),
            Err(e) => return Ok(Err(("NoPod", format!("the template's podSpec: {e}")))),
        },
        (None, None) => {
            return Ok(Err((
                "NoPod",
                "the template names neither targetRef nor podSpec".into(),
            )));
        }
    };
    let pod = match build_debug_pod(
        &DebugPod {
            name: &name,
            namespace: ns,
            request,
            template: &template_meta,
            claims: &claims,
            mutation: template.spec.mutation.as_ref(),
            left,
            owner,
        },
        spec,
    ) {
        Ok(p) => p,
        Err(e) => return Ok(Err(("PodRefused", e))),
    };
    match pods.create(&PostParams::default(), &pod).await {
        Ok(created) => Ok(Ok(created)),
        // Made by a pass a moment ago: the next pass reads it.
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Err((
            "Waiting",
            format!("debug pod {name} is being created"),
        ))),
        // The pod is refused (quota, pod security): the user's to fix, not a reason to back off.
        Err(kube::Error::Api(s)) if s.code == 403 || s.code == 422 => Ok(Err((
            "PodRefused",
            format!("the debug pod was refused: {}", s.message),
        ))),
        Err(e) => Err(e.into()),
    }
}

/// What a debug pod is made from, besides the pod spec.
pub struct DebugPod<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    pub request: &'a str,
    /// The pod template's metadata (for its default-container annotation).
    pub template: &'a ObjectMeta,
    /// A StatefulSet's claim template names: empty volumes of those names.
    pub claims: &'a [String],
    pub mutation: Option<&'a PodMutation>,
    /// Time left on the grant (the pod's deadline).
    pub left: Duration,
    pub owner: &'a OwnerReference,
}

/// The debug pod: the workload's pod spec with Spur's labels only (so no Service or
/// controller selects it), the template's annotations dropped, probes stripped unless kept,
/// the mutation applied to its main container, and a deadline at the grant's expiry.
pub fn build_debug_pod(d: &DebugPod<'_>, mut spec: PodSpec) -> Result<Pod, String> {
    let DebugPod {
        name,
        namespace: ns,
        request,
        template,
        claims,
        mutation,
        left,
        owner,
    } = *d;
    let default = PodMutation::default();
    let m = mutation.unwrap_or(&default);
    let mut labels = grant_labels("pod", request);
    labels.extend(m.pod_labels.clone());
    let mut annotations = m.pod_annotations.clone();
    // A debug pod is nobody's baseline: no sidecar, whatever the namespace says.
    annotations.insert(spur_api::keys::injection::INJECT.into(), "false".into());
    let wanted = m.default_container.clone().or_else(|| {
        template
            .annotations
            .as_ref()
            .and_then(|a| a.get(DEFAULT_CONTAINER_ANNOTATION).cloned())
    });
    let index = match &wanted {
        Some(w) => spec
            .containers
            .iter()
            .position(|c| &c.name == w)
            .ok_or_else(|| format!("the pod template has no container {w}"))?,
        None if spec.containers.is_empty() => {
            return Err("the pod template has no container".into());
        }
        None => 0,
    };
    if let Some(c) = wanted.or_else(|| spec.containers.first().map(|c| c.name.clone())) {
        annotations.insert(DEFAULT_CONTAINER_ANNOTATION.into(), c);
    }
    for c in spec
        .containers
        .iter_mut()
        .chain(spec.init_containers.iter_mut().flatten())
    {
        strip_probes(c, m);
    }
    let main = &mut spec.containers[index];
    if !m.command.is_empty() {
        main.command = Some(m.command.clone());
        // The workload's arguments belong to its command, not to this one.
        main.args = None;
    }
    if !m.args.is_empty() {
        main.args = Some(m.args.clone());
    }
    if !m.env.is_empty() {
        let env = main.env.get_or_insert_with(Vec::new);
        for e in &m.env {
            env.retain(|x| x.name != e.name);
            env.push(EnvVar {
                name: e.name.clone(),
                value: Some(e.value.clone()),
                value_from: None,
            });
        }
    }
    if let Some(r) = &m.resources {
        main.resources = Some(
            serde_json::from_value(r.clone()).map_err(|e| format!("mutation.resources: {e}"))?,
        );
    }
    // The kubelet kills the pod at the deadline even if the operator is down then.
    spec.active_deadline_seconds = Some(i64::try_from(left.as_secs().max(1)).unwrap_or(i64::MAX));
    // A pod created directly is nobody's replica: fixed node bindings of a DaemonSet's
    // template stay (they are affinities), a hostname from a StatefulSet does not apply.
    spec.hostname = None;
    spec.subdomain = None;
    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    for claim in claims {
        if !volumes.iter().any(|v| &v.name == claim) {
            volumes.push(k8s_openapi::api::core::v1::Volume {
                name: claim.clone(),
                empty_dir: Some(Default::default()),
                ..Default::default()
            });
        }
    }
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: Some(vec![owner.clone()]),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    })
}

fn strip_probes(c: &mut Container, m: &PodMutation) {
    if !m.keep_liveness_probe {
        c.liveness_probe = None;
    }
    if !m.keep_readiness_probe {
        c.readiness_probe = None;
    }
    if !m.keep_startup_probe {
        c.startup_probe = None;
    }
}

fn namespace_of<K: Resource>(obj: &K, kind: &'static str) -> Result<String, Error> {
    obj.meta()
        .namespace
        .clone()
        .ok_or_else(|| Error::NoNamespace {
            kind,
            name: obj.meta().name.clone().unwrap_or_default(),
        })
}

fn key_of<K: Resource<DynamicType = ()>>(obj: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        obj.meta().namespace.as_deref().unwrap_or_default(),
        obj.meta().name.as_deref().unwrap_or_default()
    )
}

/// The requests of `ns` naming template `name` (to wake them when it changes).
pub(crate) fn requests_of<K: AccessRequest>(
    store: &kube::runtime::reflector::Store<K>,
    ns: &str,
    name: &str,
) -> Vec<kube::runtime::reflector::ObjectRef<K>> {
    store
        .state()
        .into_iter()
        .filter(|r| r.meta().namespace.as_deref() == Some(ns) && r.template_name() == name)
        .map(|r| kube::runtime::reflector::ObjectRef::from_obj(&*r))
        .collect()
}
