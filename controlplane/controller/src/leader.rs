//! Leader election on a `coordination.k8s.io` Lease, shared by every component that runs
//! controllers on one replica of several (the operator, the jobs component).
//!
//! The lease itself is kept by kube-lease-manager: it takes a free or expired lease, renews it
//! `grace` seconds before it expires and releases it when the election ends. What it does not do
//! is stop believing it leads when it can no longer renew: when the API server becomes
//! unreachable its watch loop logs the error and retries, and the leader flag stays `true` while
//! the lease expires and a standby takes over. So each term here is also *fenced*: the elected
//! replica reads its Lease every `grace / 2` and ends the term when the lease's own expiry
//! (`renewTime + leaseDurationSeconds`, written by this replica's clock) minus `grace / 2` has
//! passed without a renewal it could see, or at once when the Lease names another holder. A
//! standby only takes a lease after it expired, so two replicas never run a term at once, as long
//! as the clocks of the replicas differ by less than `grace / 2` and a term stops acting within
//! the margin (the kube-rs controllers stop starting passes at once; a pass in flight finishes).

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use kube_lease_manager::LeaseManagerBuilder;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::Error;

/// Where and how the lease is held.
#[derive(Debug, Clone)]
pub struct Election {
    pub namespace: String,
    pub lease: String,
    /// This replica's name (holder identity), e.g. the pod name.
    pub identity: String,
    /// Seconds a lease stays valid without renewal: a crashed leader is replaced after it.
    pub duration_secs: u64,
    /// Seconds before expiry the holder renews; half of it is the fence's margin.
    pub grace_secs: u64,
    /// The field manager of the lease's writes.
    pub field_manager: String,
}

impl Election {
    /// An election with the usual grace: a third of the duration.
    pub fn new(
        namespace: impl Into<String>,
        lease: impl Into<String>,
        identity: impl Into<String>,
        duration_secs: u64,
        field_manager: impl Into<String>,
    ) -> Self {
        Election {
            namespace: namespace.into(),
            lease: lease.into(),
            identity: identity.into(),
            duration_secs,
            grace_secs: (duration_secs / 3).max(1),
            field_manager: field_manager.into(),
        }
    }

    fn validate(&self) -> Result<(), Error> {
        if self.identity.is_empty() || self.lease.is_empty() || self.namespace.is_empty() {
            return Err(Error::Lease(
                "the election needs a namespace, a lease name and an identity".into(),
            ));
        }
        if self.duration_secs < 2 || self.grace_secs == 0 || self.grace_secs >= self.duration_secs {
            return Err(Error::Lease(format!(
                "lease duration {} s and grace {} s: the duration must be at least 2 s and the grace at least 1 s and shorter than it",
                self.duration_secs, self.grace_secs
            )));
        }
        Ok(())
    }

    /// How far ahead of the lease's expiry a term ends without a renewal.
    fn margin(&self) -> Duration {
        Duration::from_millis(self.grace_secs * 500)
    }

    /// How often the holder reads its lease.
    fn period(&self) -> Duration {
        self.margin().max(Duration::from_millis(500))
    }
}

/// What a read of the Lease says of this replica's term.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// This replica holds it: the term may go on this long.
    For(Duration),
    /// Another replica holds it, or nobody.
    No,
}

/// How long `identity` may still act on `lease` read at `now`: until the lease's expiry less
/// `margin`. A lease without a renewal time or duration is not held.
fn held(spec: Option<&LeaseSpec>, identity: &str, now: Timestamp, margin: Duration) -> Held {
    let Some(spec) = spec else { return Held::No };
    if spec.holder_identity.as_deref() != Some(identity) {
        return Held::No;
    }
    let (Some(renewed), Some(duration)) = (&spec.renew_time, spec.lease_duration_seconds) else {
        return Held::No;
    };
    let Ok(duration) = u64::try_from(duration) else {
        return Held::No;
    };
    let expiry_ms = renewed
        .0
        .as_millisecond()
        .saturating_add(i64::try_from(duration.saturating_mul(1000)).unwrap_or(i64::MAX));
    let left_ms = expiry_ms
        .saturating_sub(now.as_millisecond())
        .saturating_sub(i64::try_from(margin.as_millis()).unwrap_or(i64::MAX));
    Held::For(Duration::from_millis(u64::try_from(left_ms).unwrap_or(0)))
}

/// Creates the Lease with `owner` among its owners before the lease manager first sees it (the
/// manager then uses it as it is). `Ok(false)`: it exists already (the caller may adopt it).
pub async fn create_owned_lease(
    client: &Client,
    election: &Election,
    owner: &OwnerReference,
) -> Result<bool, Error> {
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
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Why a term ended.
enum Ended {
    Stop,
    Lost,
    Fenced,
}

/// The lease manager's task and its leader flag.
struct Manager {
    leader: tokio::sync::watch::Receiver<bool>,
    task: tokio::task::JoinHandle<
        Result<kube_lease_manager::LeaseManager, kube_lease_manager::LeaseManagerError>,
    >,
}

impl Manager {
    async fn start(client: &Client, election: &Election) -> Result<Manager, Error> {
        let manager = LeaseManagerBuilder::new(client.clone(), &election.lease)
            .with_namespace(&election.namespace)
            .with_identity(&election.identity)
            .with_duration(election.duration_secs)
            .with_grace(election.grace_secs)
            .with_field_manager(election.field_manager.clone())
            .build()
            .await
            .map_err(|e| Error::Lease(e.to_string()))?;
        let (leader, task) = manager.watch().await;
        Ok(Manager { leader, task })
    }

    /// Stops the manager, which releases the lease if it holds it.
    async fn stop(self) {
        drop(self.leader);
        match self.task.await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot release the lease"),
            Err(e) => tracing::warn!(error = %e, "lease manager task failed"),
        }
    }
}

/// Runs `term` while this replica holds the lease, until `stop` is cancelled: each term gets a
/// token cancelled when the lease is lost, fenced off or `stop` comes, and is awaited before the
/// next one starts. `leading` is told whenever this replica starts or stops leading (a metric).
/// On `stop` the lease is released; a standby reads the lease as often as the holder does and
/// takes a released one at once (the lease manager alone would wait for its expiry).
pub async fn run_elected<F, Fut>(
    client: Client,
    election: Election,
    stop: CancellationToken,
    leading: impl Fn(bool),
    mut term: F,
) -> Result<(), Error>
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    election.validate()?;
    let api = Api::<Lease>::namespaced(client.clone(), &election.namespace);
    let mut slot = Manager::start(&client, &election).await?;
    let manager = &mut slot;
    leading(false);
    let result = async {
        loop {
            // Whether a period passed since the manager started (a new one is given one to
            // take a free lease before a standby's read may restart it again).
            let mut settled = false;
            // The manager says this replica holds the lease; the fence must see it too.
            let mut until = loop {
                if *manager.leader.borrow_and_update() {
                    if let Some(until) = confirm(&api, &election).await {
                        break until;
                    }
                } else if settled && released(&api, &election).await {
                    // A fresh manager takes a free lease on its first pass.
                    let fresh = Manager::start(&client, &election).await?;
                    std::mem::replace(manager, fresh).stop().await;
                    settled = false;
                }
                tokio::select! {
                    () = stop.cancelled() => return Ok(()),
                    r = manager.leader.changed() => if r.is_err() {
                        return Err(Error::Lease("the lease manager stopped".into()));
                    },
                    // Elected but not confirmed (the API server is unreachable, or the lease
                    // is about to expire), or a standby: read again.
                    () = tokio::time::sleep(election.period()) => settled = true,
                }
            };
            tracing::info!(lease = %election.lease, identity = %election.identity, "leading: term started");
            leading(true);
            let token = stop.child_token();
            let running = tokio::spawn(term(token.clone()));
            let ended = loop {
                let next = (Instant::now() + election.period()).min(until);
                tokio::select! {
                    () = stop.cancelled() => break Ended::Stop,
                    r = manager.leader.changed() => if r.is_err() || !*manager.leader.borrow_and_update() {
                        break Ended::Lost;
                    },
                    () = tokio::time::sleep_until(next) => {
                        match read(&api, &election).await {
                            Ok(Held::For(left)) => until = Instant::now() + left,
                            Ok(Held::No) => break Ended::Lost,
                            // Unreachable: the last renewal seen still bounds the term.
                            Err(e) => tracing::warn!(lease = %election.lease, error = %e, "cannot read the lease"),
                        }
                        if Instant::now() >= until {
                            break Ended::Fenced;
                        }
                    }
                }
            };
            token.cancel();
            // Half the margin: a fenced term is aborted well before its lease expires, leaving
            // the other half for the clocks of the API server and the standby.
            end_term(running, election.margin() / 2).await;
            leading(false);
            match ended {
                Ended::Stop => return Ok(()),
                Ended::Lost => {
                    tracing::warn!(lease = %election.lease, "lost the lease: term ended")
                }
                Ended::Fenced => tracing::warn!(
                    lease = %election.lease,
                    "no renewal of the lease seen before it expires: term ended until it is renewed"
                ),
            }
        }
    }
    .await;
    slot.stop().await;
    result
}

/// Waits for an ended term's task, at most `within` (half the fence's margin: a term must stop
/// acting before its lease expires), then aborts it. A kube-runtime controller whose graceful shutdown comes before its
/// store's first list is complete never ends: its runner waits for the store to be ready, and
/// the store's watch has just been stopped (a term lost or stopped right after it started). Left
/// waiting, the replica would keep renewing the lease with no controller running, and never stop.
async fn end_term(mut running: tokio::task::JoinHandle<()>, within: Duration) {
    match tokio::time::timeout(within, &mut running).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "the leader's term ended in a panic"),
        Err(_) => {
            tracing::warn!(
                ?within,
                "the leader's term did not end after it was told to; aborting it"
            );
            running.abort();
            if let Err(e) = running.await
                && !e.is_cancelled()
            {
                tracing::error!(error = %e, "the leader's term ended in a panic");
            }
        }
    }
}

/// Whether the lease has no holder (released by a leader that stopped), as far as a read shows.
async fn released(api: &Api<Lease>, election: &Election) -> bool {
    match api.get_opt(&election.lease).await {
        Ok(Some(lease)) => lease
            .spec
            .as_ref()
            .is_none_or(|s| s.holder_identity.as_deref().is_none_or(str::is_empty)),
        Ok(None) => true,
        Err(_) => false,
    }
}

/// Reads the lease: how long this replica's term may still go on.
async fn read(api: &Api<Lease>, election: &Election) -> Result<Held, Error> {
    let lease = api.get_opt(&election.lease).await?;
    Ok(held(
        lease.as_ref().and_then(|l| l.spec.as_ref()),
        &election.identity,
        Timestamp::now(),
        election.margin(),
    ))
}

/// When a term that starts now must end, if the lease is this replica's with time left.
async fn confirm(api: &Api<Lease>, election: &Election) -> Option<Instant> {
    match read(api, election).await {
        Ok(Held::For(left)) if !left.is_zero() => Some(Instant::now() + left),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(lease = %election.lease, error = %e, "cannot read the lease");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    use super::*;

    fn spec(holder: &str, renewed_s: i64, duration: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            renew_time: Some(MicroTime(Timestamp::from_second(renewed_s).unwrap())),
            lease_duration_seconds: Some(duration),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_term_lasts_until_the_lease_expires_less_the_margin() {
        let now = Timestamp::from_second(1_000).unwrap();
        let margin = Duration::from_millis(2_500);
        // Renewed 5 s ago for 15 s: 10 s left, 7.5 s of them for the term.
        assert_eq!(
            held(Some(&spec("a", 995, 15)), "a", now, margin),
            Held::For(Duration::from_millis(7_500))
        );
        // Past expiry less the margin: nothing left, though still named holder.
        assert_eq!(
            held(Some(&spec("a", 987, 15)), "a", now, margin),
            Held::For(Duration::ZERO)
        );
        assert_eq!(
            held(Some(&spec("a", 900, 15)), "a", now, margin),
            Held::For(Duration::ZERO)
        );
    }

    #[test]
    fn a_lease_of_another_or_of_nobody_is_not_held() {
        let now = Timestamp::from_second(1_000).unwrap();
        let m = Duration::from_secs(1);
        assert_eq!(held(Some(&spec("b", 999, 15)), "a", now, m), Held::No);
        assert_eq!(held(None, "a", now, m), Held::No);
        assert_eq!(held(Some(&LeaseSpec::default()), "a", now, m), Held::No);
        let mut no_renewal = spec("a", 999, 15);
        no_renewal.renew_time = None;
        assert_eq!(held(Some(&no_renewal), "a", now, m), Held::No);
        assert_eq!(held(Some(&spec("a", 999, -5)), "a", now, m), Held::No);
    }

    /// Set when dropped: whether an aborted task's future was dropped.
    struct Dropped(std::sync::Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_term_that_does_not_end_is_aborted_after_the_margin() {
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let guard = Dropped(dropped.clone());
        let stuck = tokio::spawn(async move {
            let _guard = guard;
            std::future::pending::<()>().await;
        });
        let start = Instant::now();
        end_term(stuck, Duration::from_secs(2)).await;
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
        // A term that ends is not waited for longer than it takes.
        let quick = tokio::spawn(tokio::time::sleep(Duration::from_millis(300)));
        let start = Instant::now();
        end_term(quick, Duration::from_secs(2)).await;
        assert_eq!(start.elapsed(), Duration::from_millis(300));
    }

    #[test]
    fn elections_are_checked() {
        let ok = Election::new("ns", "lease", "me", 15, "fm");
        assert_eq!(ok.grace_secs, 5);
        assert!(ok.validate().is_ok());
        assert_eq!(ok.margin(), Duration::from_millis(2_500));
        assert!(
            Election::new("ns", "lease", "", 15, "fm")
                .validate()
                .is_err()
        );
        let mut bad = ok.clone();
        bad.grace_secs = 15;
        assert!(bad.validate().is_err());
        bad.duration_secs = 1;
        bad.grace_secs = 1;
        assert!(bad.validate().is_err());
        // The shortest election still reads its lease at most twice a second.
        assert_eq!(
            Election::new("ns", "l", "me", 2, "fm").period(),
            Duration::from_millis(500)
        );
    }
}
