//! Just-in-time access controllers (docs/access.md): templates are checked into their status;
//! a request is granted for its duration and everything it made is deleted, with the request,
//! the moment it expires.
//!
//! ```text
//! ExecAccessRequest ──► Role + RoleBinding (pods get, pods/exec on one pod of the target, for the requester)
//! PodAccessRequest  ──► debug pod (cloned from the target's pod template) + Role + RoleBinding
//! ```
//!
//! The expiry is the request's creation time (or, where the template requires approval, the
//! time the approval was seen: `approval`) plus the granted duration, both stored on the
//! object, so an operator restart changes nothing: the first pass after it deletes what expired
//! meanwhile. Each pass asks to be woken at the expiry instant itself (and the error policy
//! never backs off past it), not at the next resync. The expiry is also annotated on the Role
//! and RoleBinding, so the second sweeper (`sweep`, run by a CronJob of the chart) ends them
//! on time while the operator is down.
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
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Resource, ResourceExt};
use spur_api::access::{
    AccessConfig, AccessRequestStatus, ExecAccessRequest, ExecAccessTemplate, PodAccessRequest,
    PodAccessTemplate, Requester, TunnelAccessRequest, TunnelAccessTemplate, conditions as cond,
    format_access_duration, labels as access_labels,
};
use spur_api::conditions::{ConditionStatus, NewCondition, READY, set_condition};
use spur_api::keys::labels::{MANAGED_BY, MANAGED_BY_VALUE};
use spur_api::names;

use crate::Error;
use crate::context::{Context, delete_opt, now};

mod approval;
mod debug_pod;
pub mod sweep;
mod targets;
mod templates;
mod tunnel;

pub use debug_pod::{DebugPod, build_debug_pod, debug_pod_name};
use debug_pod::{debug_pod, is_debug_pod_of};
use targets::{PodChoice, default_container, is_running, pick_pod};
pub(crate) use templates::{
    reconcile_exec_template, reconcile_pod_template, reconcile_tunnel_template,
    template_error_policy,
};
use tunnel::{remove_tunnel_token, tunnel_grant};

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
    spur_controller::finalized(action)
}

/// The request kind's name, for messages.
pub(super) fn kind_name<K: AccessRequest>() -> &'static str {
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
        _ => ctx.retry_delay(&*r, err),
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
pub(crate) fn deadline<K: AccessRequest>(r: &K) -> k8s_openapi::jiff::Timestamp {
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
            ctx.status.apply(&api, r, &old, &status).await?;
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
        ctx.status.apply(&api, r, &old, &status).await?;
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
        ctx.status.apply(&api, r, &old, &status).await?;
        return Ok(requeue_within(READY_RESYNC, until(deadline(r))));
    }
    set(
        &mut status,
        cond::REQUESTER_ALLOWED,
        ConditionStatus::True,
        "InAllowedGroup",
        "",
    );

    // A second user's approval, where the template requires one.
    if let approval::Gate::Closed(action) = approval::gate(
        r,
        ns,
        ctx,
        &api,
        &old,
        &mut status,
        template.access(),
        requester,
    )
    .await?
    {
        return Ok(action);
    }

    // The duration, decided once: a template changed later does not stretch a grant.
    if status.expires_at.is_none() {
        match template.access().grant(r.duration()) {
            Ok(g) => {
                let created = r
                    .meta()
                    .creation_timestamp
                    .as_ref()
                    .map_or_else(k8s_openapi::jiff::Timestamp::now, |t| t.0);
                // An approved grant runs from the approval (seen now), not from the filing:
                // waiting for an approver does not eat into it. The deadline still never passes
                // creation plus the longest grant.
                let start = if status.approved_by.is_some() {
                    k8s_openapi::jiff::Timestamp::now()
                } else {
                    created
                };
                let at = start.checked_add(g.duration).unwrap_or(start);
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
                ctx.status.apply(&api, r, &old, &status).await?;
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
        ctx.status.apply(&api, r, &old, &status).await?;
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
            ctx.status.apply(&api, r, &old, &status).await?;
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
        ctx.status.apply(&api, r, &old, &status).await?;
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
    let expires = deadline(r);
    apply_grant(
        ctx,
        ns,
        &GrantRole {
            name: &role_name,
            labels: &labels,
            pod: &pod_name,
            user: &requester.username,
            owner: &owner,
            expires,
        },
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
        ctx.status.apply(&api, r, &old, &status).await?;
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
    if ctx.status.apply(&api, r, &old, &status).await? && !old.ready {
        tracing::info!(kind = K::ACCESS, namespace = ns, request = %name, user = %requester.username, pod = %pod_name, expires = ?status.expires_at, "access granted");
        ctx.metrics.access_grant(K::ACCESS, "granted");
        ctx.event(r, false, "Granted", "Grant", message).await;
    }
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
    ctx.status.apply(api, r, old, &status).await?;
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

pub(super) fn grant_labels(access: &str, request: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned()),
        (
            access_labels::ACCESS_REQUEST.to_owned(),
            names::label_value(request),
        ),
        (access_labels::ACCESS_KIND.to_owned(), access.to_owned()),
    ])
}

/// A grant's Role and RoleBinding, as [`apply_grant`] writes them.
struct GrantRole<'a> {
    name: &'a str,
    labels: &'a BTreeMap<String, String>,
    pod: &'a str,
    user: &'a str,
    owner: &'a OwnerReference,
    /// The grant's end, annotated on both for the second sweeper.
    expires: k8s_openapi::jiff::Timestamp,
}

async fn apply_grant(ctx: &Context, ns: &str, g: &GrantRole<'_>) -> Result<(), Error> {
    let GrantRole {
        name,
        labels,
        pod,
        user,
        owner,
        expires,
    } = *g;
    let meta = ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(ns.to_owned()),
        labels: Some(labels.clone()),
        // The sweeper (`spur access sweep`, a CronJob of the chart) deletes the two at this
        // instant even while the operator is down (docs/access.md, "Expiry").
        annotations: Some(BTreeMap::from([(
            access_labels::EXPIRES_AT.to_owned(),
            expires.to_string(),
        )])),
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
    crate::context::OWNER
        .ensure(&Api::<Role>::namespaced(ctx.client.clone(), ns), None, role)
        .await?;
    crate::context::OWNER
        .ensure(
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

fn namespace_of<K: Resource>(obj: &K, kind: &'static str) -> Result<String, Error> {
    obj.meta()
        .namespace
        .clone()
        .ok_or_else(|| Error::NoNamespace {
            kind,
            name: obj.meta().name.clone().unwrap_or_default(),
        })
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
