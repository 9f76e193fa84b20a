//! The operator's leader election (spur_controller::leader): of several operator replicas, only
//! the holder of the Lease runs the controllers; another takes over when it releases the lease
//! (graceful shutdown) or stops renewing it (crash, partition) for the lease duration, and a
//! holder that cannot see its own renewals stops its controllers before the lease expires.

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Api, Client};
use spur_controller::leader::{Election, create_owned_lease};
use tokio_util::sync::CancellationToken;

use crate::{Context, Error};

/// Where and how the lease is held.
#[derive(Debug, Clone)]
pub struct LeaderElection {
    pub namespace: String,
    pub lease: String,
    /// This replica's name (holder identity), e.g. the pod name.
    pub identity: String,
    /// Seconds a lease stays valid without renewal.
    pub duration_secs: u64,
    /// Seconds before expiry the holder renews (and, halved, the fence's margin).
    pub grace_secs: u64,
    /// The operator's Deployment, made the Lease's owner so it goes with the installation
    /// (crate::owner).
    pub owner: Option<OwnerReference>,
}

/// Runs the controllers until `stop`: under `election` when there is one, else at once (one
/// replica, `--no-leader-elect`).
pub async fn run_as(
    client: Client,
    ctx: Arc<Context>,
    stop: CancellationToken,
    election: Option<LeaderElection>,
) -> Result<(), Error> {
    match election {
        Some(election) => run_elected(client, ctx, stop, election).await,
        // The only replica leads: its leader series says so, or SpurOperatorNoLeader fires.
        None => {
            ctx.metrics.set_leader(true);
            crate::run(client, ctx.clone(), stop).await;
            ctx.metrics.set_leader(false);
            Ok(())
        }
    }
}

/// Runs the controllers while this replica holds the lease, until `stop` is cancelled; then
/// finishes in-flight reconciles and releases the lease.
pub async fn run_elected(
    client: Client,
    ctx: Arc<Context>,
    stop: CancellationToken,
    election: LeaderElection,
) -> Result<(), Error> {
    let LeaderElection {
        namespace,
        lease,
        identity,
        duration_secs,
        grace_secs,
        owner,
    } = election;
    let election = Election {
        namespace,
        lease,
        identity,
        duration_secs,
        grace_secs,
        field_manager: "spur-operator-lease".into(),
    };
    // Ownership only decides what `helm uninstall` removes: a failure here is logged, never a
    // reason not to elect.
    if let Some(owner) = &owner
        && let Err(e) = own_lease(&client, &election, owner).await
    {
        tracing::warn!(error = %e, lease = %election.lease, "cannot make the Deployment own the lease; it will outlive an uninstall");
    }
    let metrics = ctx.metrics.clone();
    spur_controller::leader::run_elected(
        client.clone(),
        election,
        stop,
        move |leading| metrics.set_leader(leading),
        move |term| crate::run(client.clone(), ctx.clone(), term),
    )
    .await
    .map_err(Error::from)
}

/// Creates the Lease owned by `owner`, or adopts one that exists (an installation older than
/// the owner reference).
async fn own_lease(
    client: &Client,
    election: &Election,
    owner: &OwnerReference,
) -> Result<(), Error> {
    let created = create_owned_lease(client, election, owner).await?;
    if !created {
        let api = Api::<Lease>::namespaced(client.clone(), &election.namespace);
        crate::owner::adopt(&api, &election.lease, owner).await?;
    }
    Ok(())
}
