//! The jobs component under leader election (spur_controller::leader): only the holder of the
//! Lease runs the controllers and drives attempts; its `spur_jobs_leader` series says so. A
//! term that ends (lease lost, fenced off, shutting down) leaves running attempts to their pods,
//! and the next term, on this replica or another, resumes them from where their logs end.

use std::sync::Arc;

use spur_controller::leader::{Election, create_owned_lease};
use tokio_util::sync::CancellationToken;

use crate::{Context, Error, Wakeups};

/// The field manager of the jobs Lease's writes.
const LEASE_FIELD_MANAGER: &str = "spur-jobs-lease";

/// Runs the controllers until `stop`: while this replica holds the lease named in `election`,
/// or at once when there is none (one replica, `--no-leader-elect`).
pub async fn run_as(
    ctx: Arc<Context>,
    wakeups: Wakeups,
    stop: CancellationToken,
    election: Option<Election>,
) -> Result<(), Error> {
    let Some(mut election) = election else {
        // The only replica leads: its leader series says so, or SpurJobsNoLeader fires.
        ctx.metrics.leader.set(1);
        crate::run(ctx.clone(), wakeups, stop).await;
        ctx.metrics.leader.set(0);
        return Ok(());
    };
    election.field_manager = LEASE_FIELD_MANAGER.into();
    // The StatefulSet owns the Lease, so `helm uninstall` removes it; a failure only leaves the
    // Lease behind, never a reason not to elect.
    if let Some(owner) = &ctx.owner
        && let Err(e) = create_owned_lease(&ctx.client, &election, owner).await
    {
        tracing::warn!(error = %e, lease = %election.lease, "cannot create the jobs lease owned by the StatefulSet; it will outlive an uninstall");
    }
    let metrics = ctx.metrics.clone();
    spur_controller::leader::run_elected(
        ctx.client.clone(),
        election,
        stop,
        move |leading| {
            metrics.leader.set(i64::from(leading));
        },
        move |term| crate::run(ctx.clone(), wakeups.clone(), term),
    )
    .await
    .map_err(|e| Error::Lease(e.to_string()))
}
