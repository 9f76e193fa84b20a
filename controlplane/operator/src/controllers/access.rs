//! The just-in-time access controllers (docs/access.md): templates, and requests woken by their
//! template and by their debug pods.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use spur_api::access::labels::ACCESS_KIND;
use spur_api::{
    ExecAccessRequest, ExecAccessTemplate, PodAccessRequest, PodAccessTemplate,
    TunnelAccessRequest, TunnelAccessTemplate,
};
use tokio_util::sync::CancellationToken;

use super::{config, primary};
use crate::access as acc;
use crate::context::Context;

/// The access controllers, when enabled.
pub(crate) async fn access(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    if !ctx.access {
        return;
    }
    let exec_templates =
        primary(Api::<ExecAccessTemplate>::all(client.clone())).with_config(config());
    let pod_templates =
        primary(Api::<PodAccessTemplate>::all(client.clone())).with_config(config());
    let tunnel_templates =
        primary(Api::<TunnelAccessTemplate>::all(client.clone())).with_config(config());
    let ear = primary(Api::<ExecAccessRequest>::all(client.clone())).with_config(config());
    let ear_store = ear.store();
    // A template's status (readiness) matters to its requests: not `primary`'s filter.
    let exec_requests = ear.watches(
        Api::<ExecAccessTemplate>::all(client.clone()),
        watcher::Config::default(),
        move |t| {
            acc::requests_of(
                &ear_store,
                &t.namespace().unwrap_or_default(),
                &t.name_any(),
            )
        },
    );
    let par = primary(Api::<PodAccessRequest>::all(client.clone())).with_config(config());
    let par_store = par.store();
    let pod_requests = par
        .watches(
            Api::<PodAccessTemplate>::all(client.clone()),
            watcher::Config::default(),
            move |t| {
                acc::requests_of(
                    &par_store,
                    &t.namespace().unwrap_or_default(),
                    &t.name_any(),
                )
            },
        )
        // Debug pods starting (readiness) or going.
        .owns(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().labels(&format!("{ACCESS_KIND}=pod")),
        );
    let tar = primary(Api::<TunnelAccessRequest>::all(client.clone())).with_config(config());
    let tar_store = tar.store();
    let tunnel_requests = tar.watches(
        Api::<TunnelAccessTemplate>::all(client),
        watcher::Config::default(),
        move |t| {
            acc::requests_of(
                &tar_store,
                &t.namespace().unwrap_or_default(),
                &t.name_any(),
            )
        },
    );
    let (c, s) = (&ctx, &stop);
    tokio::join!(
        spur_controller::run(
            "tunnelaccesstemplate",
            tunnel_templates,
            acc::reconcile_tunnel_template,
            acc::template_error_policy,
            c.clone(),
            s.clone(),
        ),
        spur_controller::run(
            "tunnelaccessrequest",
            tunnel_requests,
            acc::reconcile_tunnel,
            acc::request_error_policy,
            c.clone(),
            s.clone(),
        ),
        spur_controller::run(
            "execaccesstemplate",
            exec_templates,
            acc::reconcile_exec_template,
            acc::template_error_policy,
            c.clone(),
            s.clone(),
        ),
        spur_controller::run(
            "podaccesstemplate",
            pod_templates,
            acc::reconcile_pod_template,
            acc::template_error_policy,
            c.clone(),
            s.clone(),
        ),
        spur_controller::run(
            "execaccessrequest",
            exec_requests,
            acc::reconcile_exec,
            acc::request_error_policy,
            c.clone(),
            s.clone(),
        ),
        spur_controller::run(
            "podaccessrequest",
            pod_requests,
            acc::reconcile_pod,
            acc::request_error_policy,
            c.clone(),
            s.clone(),
        ),
    );
}
