//! The just-in-time access controllers (docs/access.md): templates, and requests woken by their
//! template and by their debug pods.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, ResourceExt};
use spur_api::access::labels::ACCESS_KIND;
use spur_api::{
    ExecAccessRequest, ExecAccessTemplate, PodAccessRequest, PodAccessTemplate,
    TunnelAccessRequest, TunnelAccessTemplate,
};
use tokio_util::sync::CancellationToken;

use spur_controller::changes::{Watched, primary};
use spur_operator_core::controller_config as config;

use crate as acc;
use crate::AccessContext;

/// Runs the access controllers until `stop` (their rights are the chart's
/// `operator-access-rules.yaml`).
pub async fn run(client: Client, ctx: Arc<AccessContext>, stop: CancellationToken) {
    tokio::join!(
        templates(client.clone(), &ctx, &stop),
        requests(client, &ctx, &stop)
    );
}

/// The three template controllers: each template's validity and target.
async fn templates(client: Client, c: &Arc<AccessContext>, s: &CancellationToken) {
    let exec_templates =
        primary(Api::<ExecAccessTemplate>::all(client.clone())).with_config(config());
    let pod_templates =
        primary(Api::<PodAccessTemplate>::all(client.clone())).with_config(config());
    let tunnel_templates = primary(Api::<TunnelAccessTemplate>::all(client)).with_config(config());
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
    );
}

/// A request controller, woken by its template (a template's status, its readiness, matters
/// to its requests: not `primary`'s filter).
fn woken_by_template<R, T>(client: &Client) -> Controller<R>
where
    R: acc::AccessRequest,
    T: Watched,
{
    let requests = primary(Api::<R>::all(client.clone())).with_config(config());
    let store = requests.store();
    requests.watches(
        Api::<T>::all(client.clone()),
        watcher::Config::default(),
        move |t| acc::requests_of(&store, &t.namespace().unwrap_or_default(), &t.name_any()),
    )
}

/// The three request controllers.
async fn requests(client: Client, c: &Arc<AccessContext>, s: &CancellationToken) {
    let exec_requests = woken_by_template::<ExecAccessRequest, ExecAccessTemplate>(&client);
    // Debug pods starting (readiness) or going.
    let pod_requests = woken_by_template::<PodAccessRequest, PodAccessTemplate>(&client).owns(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().labels(&format!("{ACCESS_KIND}=pod")),
    );
    let tunnel_requests = woken_by_template::<TunnelAccessRequest, TunnelAccessTemplate>(&client);
    tokio::join!(
        spur_controller::run(
            "tunnelaccessrequest",
            tunnel_requests,
            acc::reconcile_tunnel,
            acc::request_error_policy,
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
