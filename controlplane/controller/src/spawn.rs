//! Running a built controller: its passes reset their object's backoff when they succeed, and
//! a stop lets in-flight passes finish for a bounded time.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use kube::ResourceExt;
use kube::runtime::Controller;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio_util::sync::CancellationToken;

use crate::HasBackoff;
use crate::watch_errors::resource_missing;

/// How long in-flight reconciles may run on after `stop` before they are dropped.
pub const DRAIN_GRACE: Duration = Duration::from_secs(10);

/// Runs `controller` with `reconcile` and `error_policy` until `stop`, then drains it
/// ([`drained`]). A pass that succeeds resets its object's backoff in the context's
/// [`crate::Backoff`]; the error policy counts failures there.
pub async fn run<K, C, E, R, Fut, P>(
    name: &'static str,
    controller: Controller<K>,
    reconcile: R,
    error_policy: P,
    ctx: Arc<C>,
    stop: CancellationToken,
) where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    C: HasBackoff + Send + Sync + 'static,
    E: std::error::Error + Send + 'static,
    R: Fn(Arc<K>, Arc<C>) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    P: Fn(Arc<K>, &E, Arc<C>) -> Action + Send + Sync + 'static,
{
    let pass = move |obj: Arc<K>, ctx: Arc<C>| -> BoxFuture<'static, Result<Action, E>> {
        let reconcile = reconcile.clone();
        Box::pin(async move {
            let r = reconcile(obj.clone(), ctx.clone()).await;
            if r.is_ok() {
                ctx.backoff().succeeded(&*obj);
            }
            r
        })
    };
    let work = controller
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(pass, error_policy, ctx)
        .for_each(move |r| {
            // A failing watch (the primary's or one that wakes it: a 403 on a resource the
            // chart forgot, a CRD that went) would otherwise only show as passes that stop
            // coming. The watchers back off, so this logs at their pace. A watch expected to
            // fail for long goes through `errors_logged` instead, which keeps it from pausing
            // the controller.
            if let Err(kube::runtime::controller::Error::QueueError(e)) = &r {
                if resource_missing(e) {
                    // An optional resource not installed (Argo Rollouts, say): expected.
                    tracing::debug!(controller = name, error = %e, "a watched resource is not installed; retrying");
                } else {
                    tracing::warn!(controller = name, error = %e, "a watch of this controller failed; retrying");
                }
            }
            std::future::ready(())
        });
    drained(name, work, stop).await;
}

/// Runs `work` to its end, but for no longer than [`DRAIN_GRACE`] once `stop` is cancelled.
///
/// A kube-runtime controller's graceful shutdown never ends if its object store was not yet
/// ready when it began (its runner holds every request until the store is ready, and the
/// watch that would make it ready is no longer polled): a stop early in start-up, while a
/// watch is still backing off, would otherwise keep the process, and any leader lease it
/// holds, forever.
pub async fn drained(name: &'static str, work: impl Future<Output = ()>, stop: CancellationToken) {
    let mut work = std::pin::pin!(work);
    tokio::select! {
        () = &mut work => return,
        () = stop.cancelled() => {}
    }
    if tokio::time::timeout(DRAIN_GRACE, work).await.is_err() {
        tracing::warn!(
            controller = name,
            grace = ?DRAIN_GRACE,
            "in-flight reconciles did not finish in time after stop: dropped"
        );
    }
}

/// The owners of kind `K` (cluster-scoped) of `obj`, keyed as cluster-scoped objects.
///
/// `Controller::owns` keys an owner by its child's namespace, so a cluster-scoped owner
/// reached through a namespaced child gets a second scheduler key (`ns/name` besides `name`),
/// and two reconciles of the same owner could run at once (the store lookup falls back to the
/// cluster-scoped object), racing each other's deletes and status writes into errors.
pub fn cluster_owners<K>(obj: &impl ResourceExt) -> Vec<ObjectRef<K>>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    obj.owner_references()
        .iter()
        .filter(|o| o.kind == K::kind(&()) && o.api_version == K::api_version(&()))
        .map(|o| ObjectRef::new(&o.name))
        .collect()
}

/// The objects of `store` that `keep` keeps, as the keys a watch mapper returns.
pub fn objects_where<K>(store: &Store<K>, keep: impl Fn(&K) -> bool) -> Vec<ObjectRef<K>>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    store
        .state()
        .into_iter()
        .filter(|o| keep(o))
        .map(|o| ObjectRef::from_obj(&*o))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_stop_drains_for_the_grace_then_drops() {
        let stop = CancellationToken::new();
        stop.cancel();
        let started = tokio::time::Instant::now();
        drained("test", std::future::pending(), stop).await;
        assert_eq!(started.elapsed(), DRAIN_GRACE);
    }
}
