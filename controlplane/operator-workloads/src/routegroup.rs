//! RouteGroup controller: matches Sandboxes by their labels, gives the group its own routing
//! key, and keeps one RoutingConfig that routes that key to the forks of every matched sandbox.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Api, Resource, ResourceExt};
use spur_api::conditions::{READY, is_condition_true};
use spur_api::names::routing_key;
use spur_api::{RouteGroup, RouteGroupStatus, RoutingConfig, names};
use spur_controller::changes::synced;

use crate::context::{FIELD_MANAGER, Term, WorkloadsContext, delete_opt};
use crate::{Error, FINALIZER};

mod desired;
mod status;

pub(crate) async fn reconcile(rg: Arc<RouteGroup>, ctx: Arc<Term>) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("RouteGroup");
    let action = finalizer(&api_all(&ctx), FINALIZER, rg, |event| async {
        match event {
            Event::Apply(rg) => apply(&rg, &ctx).await,
            Event::Cleanup(rg) => cleanup(&rg, &ctx).await,
        }
    })
    .await;
    spur_controller::finalized(action)
}

async fn apply(rg: &RouteGroup, ctx: &Term) -> Result<Action, Error> {
    let name = rg.name_any();
    let Some(uid) = rg.uid() else {
        return Err(Error::Pending(format!("RouteGroup {name} to get a UID")));
    };
    let key = rg
        .status
        .as_ref()
        .and_then(|s| s.routing_key.clone())
        .unwrap_or_else(|| routing_key(&uid));
    let rcs: Api<RoutingConfig> = Api::all(ctx.client.clone());

    if let Err(e) = rg.validate() {
        delete_opt(&rcs, &names::route_group_routing_config_name(&name)).await?;
        let message = e.to_string();
        let (changed, expires) =
            write_status(rg, ctx, |st| status::invalid(st, rg, &key, &message)).await?;
        if changed {
            ctx.event(rg, true, "Invalid", "Validate", message).await;
        }
        // An invalid group expires too (it matches nothing).
        return match expires {
            Some(at) if Timestamp::now() >= at => expire(rg, at, ctx).await,
            Some(at) => Ok(Action::requeue(until(at))),
            None => Ok(Action::await_change()),
        };
    }

    // Members are decided from what is in the store: never from one still filling.
    synced(&ctx.stores.sandboxes, "Sandboxes").await?;
    let sandboxes = ctx.stores.sandboxes.state();
    let matched = desired::matched(rg, &sandboxes);
    let rc = desired::routing_config(rg, &key, &matched);
    let rc = rcs
        .patch(
            &rc.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&rc),
        )
        .await?;
    let routed = rc
        .status
        .as_ref()
        .is_some_and(|s| is_condition_true(&s.conditions, READY));
    // The TTL is decided on the status just computed: a spec change restarts `updatedAt`, and
    // a group that matches a sandbox now has no `noMatchedSandboxes` expiry, whatever the
    // status said before this pass.
    let (_, expires) = write_status(rg, ctx, |st| {
        status::observed(st, rg, &key, &matched, routed);
    })
    .await?;
    match expires {
        Some(at) if Timestamp::now() >= at => expire(rg, at, ctx).await,
        _ => Ok(Action::requeue(expires.map_or(RESYNC, until))),
    }
}

/// Deletes the group whose TTL ran out at `at`: this group, by uid, not one made since under
/// its name.
async fn expire(rg: &RouteGroup, at: Timestamp, ctx: &Term) -> Result<Action, Error> {
    ctx.event(
        rg,
        false,
        "Expired",
        "Delete",
        format!("TTL expired at {at}"),
    )
    .await;
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: rg.uid(),
            resource_version: None,
        }),
        ..DeleteParams::background()
    };
    match api_all(ctx).delete(&rg.name_any(), &dp).await {
        Ok(_) => Ok(Action::await_change()),
        // Gone, or another object of the name (the precondition failed): nothing to do.
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(Action::await_change()),
        Err(e) => Err(e.into()),
    }
}

/// How long a pass waits without a change to wake it.
const RESYNC: Duration = Duration::from_secs(300);

/// How long until `at` (capped at [`RESYNC`]), plus a little so the pass that wakes finds the
/// instant passed.
fn until(at: Timestamp) -> Duration {
    let left = Duration::try_from(at.duration_since(Timestamp::now())).unwrap_or_default();
    left.min(RESYNC) + Duration::from_millis(100)
}

fn api_all(ctx: &WorkloadsContext) -> Api<RouteGroup> {
    Api::all(ctx.client.clone())
}

/// Applies the status computed by `update` from the current one; returns whether it changed
/// and when the group expires.
async fn write_status(
    rg: &RouteGroup,
    ctx: &WorkloadsContext,
    update: impl FnOnce(&mut RouteGroupStatus),
) -> Result<(bool, Option<Timestamp>), Error> {
    let old = rg.status.clone().unwrap_or_default();
    let mut st = old.clone();
    let now = Timestamp::now();
    if st.observed_generation != rg.meta().generation {
        // `ttl.offsetFrom: updatedAt` counts from the last spec change the controller saw.
        st.updated_at = Some(Time(now));
        st.observed_generation = rg.meta().generation;
    }
    update(&mut st);
    status::unmatched(&mut st, now);
    let expires = status::expiry(rg, &st);
    st.expires_at = expires.map(Time);
    // Preview URLs follow from the spec alone: published whatever state the group is in.
    st.endpoints = ctx
        .previews
        .as_ref()
        .map(|p| p.urls(&rg.name_any(), &rg.spec.endpoints))
        .unwrap_or_default();
    let changed = ctx.status.apply(&api_all(ctx), rg, &old, &st).await?;
    Ok((changed, expires))
}

async fn cleanup(rg: &RouteGroup, ctx: &WorkloadsContext) -> Result<Action, Error> {
    let rcs: Api<RoutingConfig> = Api::all(ctx.client.clone());
    let rc_name = names::route_group_routing_config_name(&rg.name_any());
    delete_opt(&rcs, &rc_name).await?;
    Ok(Action::await_change())
}

pub(crate) fn error_policy(rg: Arc<RouteGroup>, err: &Error, ctx: Arc<Term>) -> Action {
    if matches!(err, Error::Pending(_)) {
        return Action::requeue(Duration::from_millis(500));
    }
    ctx.retry(&*rg, err)
}
