//! The approval gate (docs/access.md, "Approval"): where a template requires it, nothing is
//! granted until a second user has approved the request.
//!
//! Who may approve is decided at admission, not here: the chart's policy
//! `spur-access-requests` lets the approval annotations change only to the writer's own
//! username and groups, never by the requester, and only for a user holding the verb `approve`
//! on the request's kind. The operator matches the recorded groups against the template's
//! `approvers`, and refuses an approval naming the requester even if one got past admission.

use kube::ResourceExt;
use kube::runtime::controller::Action;
use spur_api::access::{AccessConfig, AccessRequestStatus, Approver, Requester};

use super::{AccessRequest, Pass, READY_RESYNC, deadline, requeue_within, status, until};
use spur_operator_core::Error;

/// Whether a request may go on to be granted.
pub(super) enum Gate {
    Open,
    /// Not approved (the grant is withheld and the status written): the reconcile's answer.
    Closed(Action),
}

/// Records the request's approval in `status` (condition `Approved`, `approvedBy`); without the
/// approval its template requires, withholds the grant and writes the status.
pub(super) async fn gate<K: AccessRequest>(
    pass: &Pass<'_, K>,
    status: &mut AccessRequestStatus,
    access: &AccessConfig,
    requester: &Requester,
) -> Result<Gate, Error> {
    let (r, ns) = (pass.r, pass.ns);
    let approver = Approver::of(r.annotations());
    let name = r.name_any();
    let generation = pass.generation();
    match status::approval::<K>(
        status,
        generation,
        access,
        requester,
        approver.as_ref(),
        (ns, &name),
    ) {
        Ok(()) => {
            if let Some(user) = &status.approved_by
                && pass.old.approved_by.as_deref() != Some(user.as_str())
            {
                tracing::info!(kind = K::ACCESS, namespace = ns, request = %name, requester = %requester.username, approver = %user, "access request approved");
                let message = format!("approved by {user}");
                pass.ctx
                    .event(r, false, "Approved", "Approve", message)
                    .await;
            }
            Ok(Gate::Open)
        }
        Err((reason, message)) => {
            // Nothing stays granted without the approval (it may have been withdrawn, or the
            // template may have come to require one).
            pass.withhold(status, reason, &message).await?;
            pass.write(status).await?;
            // The approval annotations wake the request (its own changes do); the resync is a
            // backstop.
            Ok(Gate::Closed(requeue_within(
                READY_RESYNC,
                until(deadline(r)),
            )))
        }
    }
}
