//! Leader election on a `coordination.k8s.io` Lease (kube-lease-manager): of several operator
//! replicas, only the holder runs the controllers; another takes over when it releases the lease
//! (graceful shutdown) or stops renewing it (crash, partition) for the lease duration.

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use kube_lease_manager::LeaseManagerBuilder;
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
    /// Extra seconds tolerated for clock skew before a lease counts as expired.
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
    // Ownership only decides what `helm uninstall` removes: a failure here is logged, never a
    // reason not to elect.
    if let Some(owner) = &election.owner
        && let Err(e) = own_lease(&client, &election, owner).await
    {
        tracing::warn!(error = %e, lease = %election.lease, "cannot make the Deployment own the lease; it will outlive an uninstall");
    }
    let manager = LeaseManagerBuilder::new(client.clone(), &election.lease)
        .with_namespace(&election.namespace)
        .with_identity(&election.identity)
        .with_duration(election.duration_secs)
        .with_grace(election.grace_secs)
        .with_field_manager("spur-operator-lease")
        .build()
        .await
        .map_err(|e| Error::Lease(e.to_string()))?;
    let (mut leader, task) = manager.watch().await;
    let result = async {
        loop {
            while !*leader.borrow_and_update() {
                ctx.metrics.set_leader(false);
                tokio::select! {
                    () = stop.cancelled() => return Ok(()),
                    r = leader.changed() => if r.is_err() {
                        return Err(Error::Lease("the lease manager stopped".into()));
                    },
                }
            }
            tracing::info!(lease = %election.lease, identity = %election.identity, "leading: controllers started");
            ctx.metrics.set_leader(true);
            let term = stop.child_token();
            let controllers = tokio::spawn(crate::run(client.clone(), ctx.clone(), term.clone()));
            let lost = loop {
                tokio::select! {
                    () = stop.cancelled() => break false,
                    r = leader.changed() => if r.is_err() || !*leader.borrow_and_update() { break true },
                }
            };
            term.cancel();
            let _ = controllers.await;
            ctx.metrics.set_leader(false);
            if !lost {
                return Ok(());
            }
            tracing::warn!(lease = %election.lease, "lost the lease: controllers stopped");
        }
    }
    .await;
    // Dropping the receiver makes the manager release the lease, so a standby takes over at
    // once instead of after the lease duration.
    drop(leader);
    match task.await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot release the lease"),
        Err(e) => tracing::warn!(error = %e, "lease manager task failed"),
    }
    result
}

/// Creates the Lease owned by `owner` before the lease manager first sees it (the manager then
/// uses it as it is), or adopts one that exists.
async fn own_lease(
    client: &Client,
    election: &LeaderElection,
    owner: &OwnerReference,
) -> Result<(), Error> {
    let api = Api::<Lease>::namespaced(client.clone(), &election.namespace);
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(election.lease.clone()),
            owner_references: Some(vec![owner.clone()]),
            ..ObjectMeta::default()
        },
        spec: None,
    };
    match api.create(&PostParams::default(), &lease).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_already_exists() => {
            crate::owner::adopt(&api, &election.lease, owner).await
        }
        Err(e) => Err(e.into()),
    }
}
