//! RouteGroup controller: matches Sandboxes by their labels, gives the group its own routing
//! key, and keeps one RoutingConfig that routes that key to the forks of every matched sandbox.

use std::sync::Arc;
use std::time::Duration;

use kube::api::{Patch, PatchParams};
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
    let api: Api<RouteGroup> = Api::all(ctx.client.clone());
    let action = finalizer(&api, FINALIZER, rg, |event| async {
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
        let changed = write_status(rg, ctx, |st| status::invalid(st, rg, &key, &message)).await?;
        if changed {
            ctx.event(rg, true, "Invalid", "Validate", message).await;
        }
        return Ok(Action::await_change());
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
    write_status(rg, ctx, |st| {
        status::observed(st, rg, &key, &matched, routed);
    })
    .await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

async fn write_status(
    rg: &RouteGroup,
    ctx: &WorkloadsContext,
    update: impl FnOnce(&mut RouteGroupStatus),
) -> Result<bool, Error> {
    let old = rg.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.observed_generation = rg.meta().generation;
    update(&mut st);
    // Preview URLs follow from the spec alone: published whatever state the group is in.
    st.endpoints = ctx
        .previews
        .as_ref()
        .map(|p| p.urls(&rg.name_any(), &rg.spec.endpoints))
        .unwrap_or_default();
    let api: Api<RouteGroup> = Api::all(ctx.client.clone());
    Ok(ctx.status.apply(&api, rg, &old, &st).await?)
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
