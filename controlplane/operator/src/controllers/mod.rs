//! Which controllers run: one function per feature, each handing the feature its part of the
//! context and running its controllers (their watches and triggers are the feature crate's;
//! each is drained on stop by `spur_controller::run`). `crate::run` joins them.

pub(crate) use spur_operator_workloads::controllers::{
    externals, forks, groups, routing_configs, sandboxes, virtuals, watches,
};

use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use kube::Client;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

use spur_operator_workloads::Term;

use crate::context::Context;
use crate::{enroll, envoyconfig, listenerset, mesh_gateway, mesh_istio};

/// The certificate manager, the workstation signer and the xDS client issuer
/// (`spur_operator_certificates`), when the context has a PKI configuration.
pub(crate) async fn pki(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    let Some(cfg) = ctx.pki.clone() else {
        return;
    };
    spur_operator_certificates::run(client, cfg, ctx.metrics.clone(), stop).await;
}

/// EnvoyConfigs (`spur_operator_xds::envoyconfig`): a revision's status (the route servers'
/// reports) wakes its config.
pub(crate) async fn envoy_configs(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    envoyconfig::run(client, ctx.core.clone(), stop).await;
}

/// ListenerSets (`spur_operator_xds::listenerset`), woken by the Services they made through
/// the workload watches' Service store.
pub(crate) async fn listener_sets(
    client: Client,
    term: Arc<Term>,
    services: impl futures_util::Stream<Item = Result<Service, watcher::Error>> + Send + 'static,
    stop: CancellationToken,
) {
    let ctx = Arc::new(listenerset::ListenerSetContext {
        core: term.ctx.core.clone(),
        services: term.stores.listener_services.clone(),
    });
    listenerset::run(client, ctx, services, stop).await;
}

/// Sandbox resources' controllers (`spur_operator_resources`).
pub(crate) async fn resources(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    spur_operator_resources::run(client, ctx.workloads.res.clone(), stop).await;
}

/// The just-in-time access controllers (`spur_operator_access`), when enabled.
pub(crate) async fn access(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    if !ctx.access {
        return;
    }
    let access = Arc::new(crate::access::AccessContext {
        core: ctx.core.clone(),
        tunnel_namespace: ctx.workloads.tunnels.namespace.clone(),
        access_tokens: ctx.access_tokens.clone(),
    });
    crate::access::run(client, access, stop).await;
}

/// Automatic smart-test runs (`spur_operator_smarttests`), when enabled.
pub(crate) async fn smart_tests(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    if ctx.smart_tests {
        let calls = ctx.smart_test_calls.clone();
        spur_operator_smarttests::run(client, ctx.core.clone(), calls, stop).await;
    }
}

/// The namespace enroller, when the context has an enrollment configuration.
pub(crate) async fn enroller(ctx: Arc<Context>, stop: CancellationToken) {
    if let Some(cfg) = ctx.workloads.enrollment.clone() {
        enroll::run(ctx.core.clone(), cfg, stop).await;
    }
}

/// The mesh routes' controllers. Each mode's controller runs only when enabled: without it
/// neither the mesh's CRDs nor the rights to them need to exist.
pub(crate) async fn mesh(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    let mesh = ctx.workloads.mesh.clone().unwrap_or_default();
    let istio = async {
        if mesh.istio {
            mesh_istio::run(client.clone(), ctx.core.clone(), mesh.clone(), stop.clone()).await;
        }
    };
    let gateway = async {
        if mesh.gateway_api {
            mesh_gateway::run(client.clone(), ctx.core.clone(), mesh.clone(), stop.clone()).await;
        }
    };
    tokio::join!(istio, gateway);
}
