//! RouteGroup controller: matches Sandboxes by their labels, gives the group its own routing
//! key, and keeps one RoutingConfig that routes that key to the forks of every matched sandbox.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Api, Resource, ResourceExt};
use spur_api::conditions::{
    ConditionStatus, NewCondition, READY, is_condition_true, set_condition,
};
use spur_api::keys::labels;
use spur_api::routingconfig::{SandboxedKind, SandboxedWorkloadRef};
use spur_api::{RouteGroup, RouteGroupStatus, RoutingConfig, RoutingConfigSpec, Sandbox, names};

use crate::context::{Context, FIELD_MANAGER, delete_opt, now};
use crate::{Error, FINALIZER};
use spur_api::names::routing_key;

pub(crate) async fn reconcile(rg: Arc<RouteGroup>, ctx: Arc<Context>) -> Result<Action, Error> {
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

async fn apply(rg: &RouteGroup, ctx: &Context) -> Result<Action, Error> {
    let name = rg.name_any();
    let Some(uid) = rg.uid() else {
        return Err(Error::Pending(format!("RouteGroup {name} to get a UID")));
    };
    let key = rg
        .status
        .as_ref()
        .and_then(|s| s.routing_key.clone())
        .unwrap_or_else(|| routing_key(&uid));
    let rc_name = names::route_group_routing_config_name(&name);
    let rcs: Api<RoutingConfig> = Api::all(ctx.client.clone());

    if let Err(e) = rg.validate() {
        delete_opt(&rcs, &rc_name).await?;
        let message = e.to_string();
        let changed = write_status(rg, ctx, |st| {
            st.routing_key = Some(key.clone());
            st.matched_sandboxes.clear();
            st.ready_sandboxes = 0;
            condition(st, rg, ConditionStatus::False, "Invalid", &message)
        })
        .await?;
        if changed {
            ctx.event(rg, true, "Invalid", "Validate", message).await;
        }
        return Ok(Action::await_change());
    }

    let sandboxes = Api::<Sandbox>::all(ctx.client.clone())
        .list(&ListParams::default().match_any())
        .await?
        .items;
    let mut matched: Vec<&Sandbox> = sandboxes
        .iter()
        .filter(|sb| sb.meta().deletion_timestamp.is_none())
        .filter(|sb| rg.spec.selector.matches(&sb.spec.labels))
        .collect();
    matched.sort_by_key(|sb| sb.name_any());
    let mut workloads = Vec::new();
    let mut ready = 0;
    for sb in &matched {
        let st = sb.status.clone().unwrap_or_default();
        if is_condition_true(&st.conditions, READY) {
            ready += 1;
        }
        for f in &st.forks {
            workloads.push(SandboxedWorkloadRef {
                kind: SandboxedKind::ForkedWorkload,
                namespace: f.fork_of.namespace.clone(),
                name: f.forked_workload.clone(),
                sandbox: sb.name_any(),
            });
        }
    }
    workloads.sort();
    workloads.dedup();

    let mut rc = RoutingConfig::new(
        &rc_name,
        RoutingConfigSpec {
            routing_key: key.clone(),
            workloads,
        },
    );
    rc.metadata.labels = Some(BTreeMap::from([
        (
            labels::MANAGED_BY.to_owned(),
            labels::MANAGED_BY_VALUE.to_owned(),
        ),
        (labels::ROUTE_GROUP.to_owned(), name.clone()),
        (labels::ROUTING_KEY.to_owned(), key.clone()),
    ]));
    rc.metadata.owner_references = Some(rg.controller_owner_ref(&()).into_iter().collect());
    let rc = rcs
        .patch(
            &rc_name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&rc),
        )
        .await?;
    let routed = rc
        .status
        .as_ref()
        .is_some_and(|s| is_condition_true(&s.conditions, READY));
    let names: Vec<String> = matched.iter().map(|sb| sb.name_any()).collect();
    let total = names.len();
    write_status(rg, ctx, |st| {
        st.routing_key = Some(key.clone());
        st.matched_sandboxes = names;
        st.ready_sandboxes = ready;
        let (status, reason, message) = if total == 0 {
            (
                ConditionStatus::False,
                "NoSandboxes",
                "no sandbox matches".to_string(),
            )
        } else if routed && usize::try_from(ready).is_ok_and(|r| r == total) {
            (
                ConditionStatus::True,
                "Ready",
                format!("{total} sandbox(es) matched, all ready and routed"),
            )
        } else {
            (
                ConditionStatus::False,
                "NotReady",
                format!("{ready} of {total} matched sandbox(es) ready; routes published: {routed}"),
            )
        };
        condition(st, rg, status, reason, &message)
    })
    .await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

fn condition(
    st: &mut RouteGroupStatus,
    rg: &RouteGroup,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    set_condition(
        &mut st.conditions,
        NewCondition {
            type_: READY,
            status,
            reason,
            message,
            observed_generation: rg.meta().generation,
        },
        &now(),
    );
}

async fn write_status(
    rg: &RouteGroup,
    ctx: &Context,
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

async fn cleanup(rg: &RouteGroup, ctx: &Context) -> Result<Action, Error> {
    let rcs: Api<RoutingConfig> = Api::all(ctx.client.clone());
    let rc_name = names::route_group_routing_config_name(&rg.name_any());
    delete_opt(&rcs, &rc_name).await?;
    Ok(Action::await_change())
}

pub(crate) fn error_policy(rg: Arc<RouteGroup>, err: &Error, ctx: Arc<Context>) -> Action {
    if matches!(err, Error::Pending(_)) {
        return Action::requeue(Duration::from_millis(500));
    }
    ctx.retry(&*rg, err)
}
