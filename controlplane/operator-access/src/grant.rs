//! One pass over a request that is not being deleted: the checks in order (expiry, template,
//! requester, approval, duration), then the grant of its kind. Each step reads or applies here
//! and leaves what the status says to `super::status`, what is applied to `super::desired`.

use std::time::Duration;

use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::controller::Action;
use spur_api::access::{AccessRequestStatus, Requester, conditions as cond};

use super::debug_pod::debug_pod;
use super::desired::{self, GrantRole};
use super::plan::{PodChoice, is_running};
use super::targets::pick_pod;
use super::tunnel::tunnel_grant;
use super::{
    AccessRequest, PENDING_RESYNC, Pass, READY_RESYNC, Template, approval, deadline, get_template,
    grant_labels, grant_name, requeue_within, status, until,
};
use spur_operator_core::Error;
use spur_operator_core::delete_opt;

/// One pass of a request that is not being deleted.
pub(super) async fn grant<K: AccessRequest>(
    r: &K,
    ns: &str,
    ctx: &crate::AccessContext,
) -> Result<Action, Error> {
    let pass = Pass::new(r, ns, ctx);
    let mut status = pass.old.clone();
    // Expiry first: whatever else is wrong, an expired request goes, and its grant with it.
    if until(deadline(r)).is_zero() {
        return expire(&pass, status).await;
    }
    // The template. Gone or broken, it grants nothing any more: a platform team deleting a
    // template cuts the access it gave.
    let template = match get_template::<K>(ctx, ns, r.template_name()).await? {
        Some(t) if t.ready() => t,
        found => {
            let (reason, message) =
                status::template_unusable::<K>(found.is_some(), ns, r.template_name());
            let then = requeue_within(PENDING_RESYNC, until(deadline(r)));
            let why = Some(cond::TARGET_TEMPLATE_EXISTS);
            return pass.refuse(status, why, reason, &message, then).await;
        }
    };
    pass.mark(&mut status, cond::TARGET_TEMPLATE_EXISTS, true, "Found", "");
    // The requester, and whether the template lets them ask. Nothing may stay granted to
    // someone the template no longer allows.
    let requester = match status::requester(r.requester(), template.access()) {
        Ok(q) => q,
        Err((reason, message)) => {
            let then = requeue_within(READY_RESYNC, until(deadline(r)));
            let why = Some(cond::REQUESTER_ALLOWED);
            return pass.refuse(status, why, reason, &message, then).await;
        }
    };
    pass.mark(
        &mut status,
        cond::REQUESTER_ALLOWED,
        true,
        "InAllowedGroup",
        "",
    );
    // A second user's approval, where the template requires one.
    if let approval::Gate::Closed(action) =
        approval::gate(&pass, &mut status, template.access(), requester).await?
    {
        return Ok(action);
    }
    // The duration, decided once: a template changed later does not stretch a grant.
    if status.expires_at.is_none() {
        let created = r
            .meta()
            .creation_timestamp
            .as_ref()
            .map_or_else(Timestamp::now, |t| t.0);
        let decided = template.access().grant(r.duration());
        let times = (created, Timestamp::now());
        let generation = pass.generation();
        if let Err(e) = status::expiry(&mut status, generation, decided, r.duration(), times) {
            let then = requeue_within(READY_RESYNC, until(deadline(r)));
            return pass.refuse(status, None, "InvalidDuration", &e, then).await;
        }
        // The expiry is on the object before anything is granted: whatever fails next, the
        // error policy and a restarted operator know when to take the grant back.
        pass.write(&status).await?;
        return Ok(Action::requeue(Duration::from_millis(50)));
    }
    let left = until(deadline(r));
    if left.is_zero() {
        return expire(&pass, status).await;
    }
    if let Template::Tunnel(t) = &template {
        return tunnel_grant(&pass, status, &t.spec.access_config, requester, left).await;
    }
    pod_grant(&pass, status, &template, requester, left).await
}

/// An exec or pod grant: the pod (picked, or the debug pod made), the Role and RoleBinding on
/// it for the requester alone, and `Ready` once the API server agrees they may exec into it.
async fn pod_grant<K: AccessRequest>(
    pass: &Pass<'_, K>,
    mut status: AccessRequestStatus,
    template: &Template,
    requester: &Requester,
    left: Duration,
) -> Result<Action, Error> {
    let (r, ns, ctx) = (pass.r, pass.ns, pass.ctx);
    let name = r.name_any();
    let owner = r
        .controller_owner_ref(&())
        .ok_or_else(|| Error::Pending("request uid".into()))?;
    let Some(chosen) = grant_pod(pass, &status, template, &owner, left).await? else {
        return Ok(Action::await_change());
    };
    let pod = match chosen {
        PodChoice::Chosen(p) => p,
        PodChoice::Unavailable(reason, message) => {
            let (why, then) = (cond::ACCESS_RESOURCES_CREATED, PENDING_RESYNC);
            let then = requeue_within(then, left);
            return pass.refuse(status, Some(why), reason, &message, then).await;
        }
    };
    let pod_name = pod.name_any();
    if let Some(message) = status::pod_gone(&status, &pod_name) {
        let then = requeue_within(READY_RESYNC, left);
        let why = Some(cond::ACCESS_RESOURCES_READY);
        return pass.refuse(status, why, "PodGone", &message, then).await;
    }
    status.pod_name = Some(pod_name.clone());
    let container = status::container(template, &pod);
    status.container = container.clone();

    // The Role and RoleBinding, for the requester alone.
    let role_name = grant_name(K::ACCESS, ns, &name);
    let labels = grant_labels(K::ACCESS, &name);
    let role = GrantRole {
        name: &role_name,
        labels: &labels,
        pod: &pod_name,
        user: &requester.username,
        owner: &owner,
        expires: deadline(r),
    };
    apply_grant(pass, &role).await?;
    let created = format!("Role and RoleBinding {role_name}");
    pass.mark(
        &mut status,
        cond::ACCESS_RESOURCES_CREATED,
        true,
        "Created",
        &created,
    );

    // Ready: the pod runs and the API server agrees the requester may exec into it.
    let running = is_running(&pod, K::ACCESS == "pod");
    let allowed = running && may_exec(pass, &pod_name, requester).await?;
    if !allowed {
        let generation = pass.generation();
        status::waiting(
            &mut status,
            generation,
            running,
            &pod_name,
            &requester.username,
        );
        pass.write(&status).await?;
        return Ok(requeue_within(Duration::from_secs(1), left));
    }
    let access = template.access();
    let command = access.access_command(ns, &pod_name, container.as_deref().unwrap_or("app"));
    let message = format!(
        "{} may exec into {pod_name} until {}",
        requester.username,
        status::expires(&status)
    );
    let message = status::granted(&mut status, pass.generation(), command, message);
    if pass.write(&status).await? && !pass.old.ready {
        tracing::info!(kind = K::ACCESS, namespace = ns, request = %name, user = %requester.username, pod = %pod_name, expires = ?status.expires_at, "access granted");
        ctx.metrics.access_grant(K::ACCESS, "granted");
        ctx.event(r, false, "Granted", "Grant", message).await;
    }
    Ok(requeue_within(READY_RESYNC, left))
}

/// The pod an exec or pod grant is on: one of the exec template's workload (the one asked
/// for, or the one chosen before), or the pod template's debug pod (made once). `None` for a
/// tunnel template, which grants no pod.
async fn grant_pod<K: AccessRequest>(
    pass: &Pass<'_, K>,
    status: &AccessRequestStatus,
    template: &Template,
    owner: &OwnerReference,
    left: Duration,
) -> Result<Option<PodChoice>, Error> {
    let (r, ns, ctx) = (pass.r, pass.ns, pass.ctx);
    Ok(Some(match template {
        Template::Exec(t) => {
            let wanted = r.target_pod().or(status.pod_name.as_deref());
            pick_pod(ctx, ns, &t.spec.target_ref, r.sandbox(), wanted).await?
        }
        Template::Tunnel(_) => return Ok(None),
        Template::Pod(t) => {
            match debug_pod(ctx, ns, &r.name_any(), t, r.sandbox(), left, owner).await? {
                Ok(pod) => PodChoice::Chosen(Box::new(pod)),
                Err((reason, e)) => PodChoice::Unavailable(reason, e),
            }
        }
    }))
}

/// The request's time is up: the grant goes first (so it ends now, not after the finalizer
/// pass), then the request.
async fn expire<K: AccessRequest>(
    pass: &Pass<'_, K>,
    mut status: AccessRequestStatus,
) -> Result<Action, Error> {
    let (r, ns, ctx) = (pass.r, pass.ns, pass.ctx);
    let name = r.name_any();
    let message = "the grant has expired";
    pass.mark(
        &mut status,
        cond::ACCESS_STILL_VALID,
        false,
        "Expired",
        message,
    );
    pass.withhold(&mut status, "Expired", message).await?;
    pass.write(&status).await?;
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
    delete_opt(&pass.api, &name).await?;
    Ok(Action::await_change())
}

/// Applies a grant's Role and RoleBinding.
async fn apply_grant<K: AccessRequest>(pass: &Pass<'_, K>, g: &GrantRole<'_>) -> Result<(), Error> {
    let (role, binding) = desired::grant_role(pass.ns, g);
    let client = pass.ctx.client.clone();
    spur_operator_core::OWNER
        .ensure(
            &Api::<Role>::namespaced(client.clone(), pass.ns),
            None,
            role,
        )
        .await?;
    spur_operator_core::OWNER
        .ensure(
            &Api::<RoleBinding>::namespaced(client, pass.ns),
            None,
            binding,
        )
        .await?;
    Ok(())
}

/// A SubjectAccessReview for the requester: may they exec into `pod`?
async fn may_exec<K: AccessRequest>(
    pass: &Pass<'_, K>,
    pod: &str,
    who: &Requester,
) -> Result<bool, Error> {
    let review = desired::exec_review(pass.ns, pod, who);
    let answer = Api::<SubjectAccessReview>::all(pass.ctx.client.clone())
        .create(&PostParams::default(), &review)
        .await?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}
