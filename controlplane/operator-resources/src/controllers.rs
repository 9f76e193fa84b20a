//! Sandbox resources' controllers: plugins are validated into their status; Resources drive
//! their ObjectLifecycleMethods, whose step pods (in the resource namespace) wake them.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use kube::{Api, Client};
use spur_api::{ObjectLifecycleMethods, Resource, ResourcePlugin};
use spur_controller::cluster_owners;
use tokio_util::sync::CancellationToken;

use spur_controller::changes::primary;
use spur_operator_core::controller_config as config;

use crate::{self as res, ResourcesContext, olm};

/// Runs the resource controllers until `stop`, when resources are enabled (without, they
/// would only watch for nothing).
pub async fn run(client: Client, ctx: Arc<ResourcesContext>, stop: CancellationToken) {
    let Some(step_namespace) = ctx.resources.as_ref().map(|r| r.namespace.clone()) else {
        return;
    };
    let plugins = primary(Api::<ResourcePlugin>::all(client.clone())).with_config(config());
    let resource_objects = primary(Api::<Resource>::all(client.clone()))
        .with_config(config())
        .owns(
            Api::<ObjectLifecycleMethods>::all(client.clone()),
            watcher::Config::default(),
        );
    let olms = primary(Api::<ObjectLifecycleMethods>::all(client.clone()))
        .with_config(config())
        .watches(
            Api::<Pod>::namespaced(client, &step_namespace),
            watcher::Config::default().labels(spur_api::keys::labels::OLM),
            |pod| cluster_owners::<ObjectLifecycleMethods>(&pod),
        );
    tokio::join!(
        spur_controller::run(
            "resourceplugin",
            plugins,
            res::reconcile_plugin,
            res::plugin_error_policy,
            ctx.clone(),
            stop.clone(),
        ),
        spur_controller::run(
            "resource",
            resource_objects,
            res::reconcile,
            res::error_policy,
            ctx.clone(),
            stop.clone(),
        ),
        spur_controller::run(
            "objectlifecyclemethods",
            olms,
            olm::reconcile,
            olm::error_policy,
            ctx,
            stop,
        ),
    );
}
