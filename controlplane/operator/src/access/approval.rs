//! The approval gate (docs/access.md, "Approval"): where a template requires it, nothing is
//! granted until a second user has approved the request.
//!
//! Who may approve is decided at admission, not here: the chart's policy
//! `spur-access-requests` lets the approval annotations change only to the writer's own
//! username and groups, never by the requester, and only for a user holding the verb `approve`
//! on the request's kind. The operator matches the recorded groups against the template's
//! `approvers`, and refuses an approval naming the requester even if one got past admission.

use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use spur_api::access::{
    AccessConfig, AccessRequestStatus, ApprovalState, Approver, Requester, conditions as cond,
};
use spur_api::conditions::ConditionStatus;

use super::{AccessRequest, READY_RESYNC, deadline, kind_name, mark, requeue_within, until};
use crate::Error;
use crate::context::Context;

/// Whether a request may go on to be granted.
pub(super) enum Gate {
    Open,
    /// Not approved (the grant is withheld and the status written): the reconcile's answer.
    Closed(Action),
}

/// Records the request's approval in `status` (condition `Approved`, `approvedBy`); without the
/// approval its template requires, withholds the grant and writes the status.
#[allow(clippy::too_many_arguments)]
pub(super) async fn gate<K: AccessRequest>(
    r: &K,
    ns: &str,
    ctx: &Context,
    api: &Api<K>,
    old: &AccessRequestStatus,
    status: &mut AccessRequestStatus,
    access: &AccessConfig,
    requester: &Requester,
) -> Result<Gate, Error> {
    let generation = r.meta().generation;
    let approver = Approver::of(r.annotations());
    let (reason, message) = match access.approval_state(&requester.username, approver.as_ref()) {
        ApprovalState::NotRequired => {
            status.approved_by = None;
            mark(
                status,
                generation,
                cond::APPROVED,
                ConditionStatus::True,
                "NotRequired",
                "the template requires no approval",
            );
            return Ok(Gate::Open);
        }
        ApprovalState::Approved(user) => {
            let message = format!("approved by {user}");
            if old.approved_by.as_deref() != Some(user.as_str()) {
                tracing::info!(kind = K::ACCESS, namespace = ns, request = %r.name_any(), requester = %requester.username, approver = %user, "access request approved");
                ctx.event(r, false, "Approved", "Approve", message.clone())
                    .await;
            }
            status.approved_by = Some(user);
            mark(
                status,
                generation,
                cond::APPROVED,
                ConditionStatus::True,
                "Approved",
                &message,
            );
            return Ok(Gate::Open);
        }
        ApprovalState::Pending => (
            "PendingApproval",
            format!(
                "waiting for approval by a user other than {} who holds the verb approve on {}: \
                 spur access approve {} {} -n {ns}",
                requester.username,
                plural::<K>(),
                K::ACCESS,
                r.name_any()
            ),
        ),
        ApprovalState::ByRequester => (
            "SelfApproved",
            format!(
                "{} cannot approve their own request: another user must approve it",
                requester.username
            ),
        ),
        ApprovalState::NotAnApprover(user) => (
            "ApproverNotAllowed",
            format!(
                "{user} approved it but presented none of the template's approver groups ({}): \
                 a member of one must approve it",
                access
                    .approval
                    .as_ref()
                    .map(|a| a.approvers.join(", "))
                    .unwrap_or_default()
            ),
        ),
    };
    status.approved_by = None;
    mark(
        status,
        generation,
        cond::APPROVED,
        ConditionStatus::False,
        reason,
        &message,
    );
    // Nothing stays granted without the approval (it may have been withdrawn, or the template
    // may have come to require one).
    super::withhold(r, ns, ctx, status, reason, &message).await?;
    ctx.status.apply(api, r, old, status).await?;
    // The approval annotations wake the request (its own changes do); the resync is a backstop.
    Ok(Gate::Closed(requeue_within(
        READY_RESYNC,
        until(deadline(r)),
    )))
}

/// The request kind's resource name, as RBAC names it.
fn plural<K: AccessRequest>() -> String {
    format!("{}s", kind_name::<K>().to_ascii_lowercase())
}
