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

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Resource, ResourceExt};
use spur_api::access::{
    AccessConfig, AccessRequestStatus, ExecAccessRequest, ExecAccessTemplate, PodAccessRequest,
    PodAccessTemplate, Requester, TunnelAccessRequest, TunnelAccessTemplate,
    labels as access_labels,
};
use spur_api::conditions::ConditionStatus;
use spur_api::keys::labels::{MANAGED_BY, MANAGED_BY_VALUE};
use spur_api::names;

use spur_operator_core::Error;

mod approval;
mod context;
mod controllers;
mod debug_pod;
mod desired;
mod grant;
mod plan;
mod status;
pub mod sweep;
mod targets;
mod templates;
mod tunnel;

pub use context::AccessContext;
pub use controllers::run;
pub use debug_pod::debug_pod_name;
use debug_pod::is_debug_pod_of;
pub use desired::{DebugPod, build_debug_pod};
use grant::grant;
pub(crate) use templates::{
    reconcile_exec_template, reconcile_pod_template, reconcile_tunnel_template,
    template_error_policy,
};
use tunnel::remove_tunnel_token;

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
    ctx: Arc<AccessContext>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ExecAccessRequest");
    reconcile_request(r, &ctx).await
}

pub(crate) async fn reconcile_pod(
    r: Arc<PodAccessRequest>,
    ctx: Arc<AccessContext>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("PodAccessRequest");
    reconcile_request(r, &ctx).await
}

pub(crate) async fn reconcile_tunnel(
    r: Arc<TunnelAccessRequest>,
    ctx: Arc<AccessContext>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("TunnelAccessRequest");
    reconcile_request(r, &ctx).await
}

async fn reconcile_request<K: AccessRequest>(
    r: Arc<K>,
    ctx: &AccessContext,
) -> Result<Action, Error> {
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
pub(crate) fn kind_name<K: AccessRequest>() -> &'static str {
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
    ctx: Arc<AccessContext>,
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

/// A step's refusal: the condition reason and the message.
type Refusal = (&'static str, String);

/// One pass over a request that is not being deleted: what each step of a grant reads and
/// writes through.
struct Pass<'a, K: AccessRequest> {
    r: &'a K,
    ns: &'a str,
    ctx: &'a AccessContext,
    api: Api<K>,
    /// The status as read: the status writer skips a write that changes nothing.
    old: AccessRequestStatus,
}

impl<'a, K: AccessRequest> Pass<'a, K> {
    fn new(r: &'a K, ns: &'a str, ctx: &'a AccessContext) -> Self {
        Pass {
            r,
            ns,
            ctx,
            api: Api::namespaced(ctx.client.clone(), ns),
            old: r.status().cloned().unwrap_or_default(),
        }
    }

    fn generation(&self) -> Option<i64> {
        self.r.meta().generation
    }

    /// Sets one condition of `status`, at the request's generation.
    fn mark(
        &self,
        status: &mut AccessRequestStatus,
        type_: &str,
        ok: bool,
        reason: &str,
        message: &str,
    ) {
        let ok = if ok {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        };
        status::mark(status, self.generation(), type_, ok, reason, message);
    }

    /// The request is not (or no longer) granted: `Ready=False`, and nothing of the grant left.
    async fn withhold(
        &self,
        status: &mut AccessRequestStatus,
        reason: &str,
        message: &str,
    ) -> Result<(), Error> {
        let removed = remove_grant::<K>(self.ctx, self.ns, &self.r.name_any(), true).await?;
        status::withheld(status, self.generation(), removed, reason, message);
        Ok(())
    }

    /// Writes `status` (unless it changes nothing); whether it was written.
    async fn write(&self, status: &AccessRequestStatus) -> Result<bool, Error> {
        Ok(self
            .ctx
            .status
            .apply(&self.api, self.r, &self.old, status)
            .await?)
    }

    /// A step refuses the grant: its condition (`condition`, if any) false for `reason`, the
    /// grant withheld, the status written; `then` is the pass's answer.
    async fn refuse(
        &self,
        mut status: AccessRequestStatus,
        condition: Option<&str>,
        reason: &str,
        message: &str,
        then: Action,
    ) -> Result<Action, Error> {
        if let Some(type_) = condition {
            self.mark(&mut status, type_, false, reason, message);
        }
        self.withhold(&mut status, reason, message).await?;
        self.write(&status).await?;
        Ok(then)
    }
}

/// Wakes at `every` or at the expiry, whichever comes first.
fn requeue_within(every: Duration, left: Duration) -> Action {
    Action::requeue(every.min(left).max(Duration::from_millis(50)))
}

/// Deletes what a request made; the owner references would have the garbage collector do it
/// too, but not on time.
async fn revoke<K: AccessRequest>(r: &K, ns: &str, ctx: &AccessContext) -> Result<Action, Error> {
    let name = r.name_any();
    remove_grant::<K>(ctx, ns, &name, true).await?;
    tracing::info!(kind = K::ACCESS, namespace = ns, request = %name, "access request deleted: grant removed");
    ctx.metrics.access_grant(K::ACCESS, "revoked");
    Ok(Action::await_change())
}

/// Deletes the request's RoleBinding (first: once it is gone, nothing is granted whatever
/// happens next), Role and debug pod; whether any of them existed.
async fn remove_grant<K: AccessRequest>(
    ctx: &AccessContext,
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
    ctx: &AccessContext,
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

pub(crate) fn grant_labels(access: &str, request: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned()),
        (
            access_labels::ACCESS_REQUEST.to_owned(),
            names::label_value(request),
        ),
        (access_labels::ACCESS_KIND.to_owned(), access.to_owned()),
    ])
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
