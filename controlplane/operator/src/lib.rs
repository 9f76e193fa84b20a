//! Spur's Kubernetes controllers: Sandbox, ForkedWorkload, RouteGroup and RoutingConfig, each
//! thin and idempotent, writing with server-side apply under one field manager.
//!
//! ```text
//! Sandbox ──► ForkedWorkload (per fork, baseline namespace) ──► fork Deployment + sandbox Services
//!    │                                                              │ ready
//!    └──────► RoutingConfig (its routing key) ◄── ForkedWorkload status (Service mapping)
//! RouteGroup ─(label match over Sandboxes)─► RoutingConfig (the group's key)
//! RoutingConfig status.routeServer.routes ──► route server (`spur routeserver --kubernetes`)
//! ```
//!
//! Deletion never relies on the garbage collector: every owner carries a finalizer and deletes
//! its children itself (owner references are set too, for `kubectl` and a cluster's GC).

mod certs;
mod context;
mod error;
pub mod fork;
mod forked;
pub mod inject;
mod leader;
mod metrics;
pub mod patch;
pub mod pki;
mod routegroup;
mod routingconfig;
pub mod sandbox;
mod webhook;

pub use certs::{PKI_LABEL, PkiConfig};
pub use context::{Context, FIELD_MANAGER};
pub use error::Error;
pub use inject::InjectionConfig;
pub use leader::{LeaderElection, run_elected};
pub use metrics::Metrics;
pub use webhook::{MUTATE_POD_PATH, Webhook, WebhookConfig};

use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{Controller, controller, watcher};
use kube::{Api, Client, ResourceExt};
use spur_api::{ForkedWorkload, RouteGroup, RoutingConfig, Sandbox};
use tokio_util::sync::CancellationToken;

/// The finalizer on Sandboxes, ForkedWorkloads and RouteGroups.
pub const FINALIZER: &str = "spur.dev/cleanup";

/// Runs all four controllers (and the certificate manager, when the context has a PKI
/// configuration) until `stop` is cancelled, then lets in-flight reconciles finish.
pub async fn run(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    let pki = match ctx.pki.clone() {
        Some(cfg) => tokio::spawn(certs::run(
            client.clone(),
            cfg,
            ctx.metrics.clone(),
            stop.clone(),
        )),
        None => tokio::spawn(async {}),
    };
    let wc = watcher::Config::default;
    // Only the operator's own Deployments and Services: watching every Deployment of a large
    // cluster would cost memory for nothing.
    let managed = || {
        watcher::Config::default().labels(&format!(
            "{}={}",
            spur_api::keys::labels::MANAGED_BY,
            spur_api::keys::labels::MANAGED_BY_VALUE
        ))
    };
    let cfg = controller::Config::default().debounce(std::time::Duration::from_millis(10));

    let sandboxes = Controller::new(Api::<Sandbox>::all(client.clone()), wc())
        .with_config(cfg.clone())
        .owns(Api::<ForkedWorkload>::all(client.clone()), wc())
        .owns(Api::<RoutingConfig>::all(client.clone()), wc())
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(sandbox::reconcile, sandbox::error_policy, ctx.clone())
        .for_each(|_| std::future::ready(()));

    let fw =
        Controller::new(Api::<ForkedWorkload>::all(client.clone()), wc()).with_config(cfg.clone());
    let (by_baseline, by_namespace, by_pod) = (fw.store(), fw.store(), fw.store());
    let forks = fw
        .owns(Api::<Deployment>::all(client.clone()), managed())
        .owns(Api::<Service>::all(client.clone()), managed())
        // A changed baseline Deployment reaches its forks at once: metadata-only watches (no
        // specs or statuses cached), mapped through the ForkedWorkload store.
        .watches(
            Api::<PartialObjectMeta<Deployment>>::all(client.clone()),
            wc(),
            move |d| {
                let (ns, name) = (d.namespace().unwrap_or_default(), d.name_any());
                forks_where(&by_baseline, |fw| {
                    fw.spec.baseline.kind == spur_api::WorkloadKind::Deployment
                        && fw.spec.baseline.namespace == ns
                        && fw.spec.baseline.name == name
                })
            },
        )
        // A new or changed baseline Service gets (or changes) its sandbox Services. The
        // operator's own Services are skipped: each would otherwise wake every fork of its
        // namespace.
        .watches(
            Api::<PartialObjectMeta<Service>>::all(client.clone()),
            wc(),
            move |svc| {
                let managed = svc
                    .labels()
                    .get(spur_api::keys::labels::MANAGED_BY)
                    .map(String::as_str)
                    == Some(spur_api::keys::labels::MANAGED_BY_VALUE);
                let ns = svc.namespace().unwrap_or_default();
                if managed {
                    return Vec::new();
                }
                forks_where(&by_namespace, |fw| fw.spec.baseline.namespace == ns)
            },
        )
        // Baseline pods coming, going or changing readiness change the sidecar coverage in
        // status. Metadata-only (every change bumps it); fork pods are the fork Deployment's.
        .watches(
            Api::<PartialObjectMeta<Pod>>::all(client.clone()),
            wc(),
            move |pod| {
                if pod.labels().contains_key(spur_api::keys::labels::FORK) {
                    return Vec::new();
                }
                let ns = pod.namespace().unwrap_or_default();
                forks_where(&by_pod, |fw| fw.spec.baseline.namespace == ns)
            },
        )
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(forked::reconcile, forked::error_policy, ctx.clone())
        .for_each(|_| std::future::ready(()));

    let rc =
        Controller::new(Api::<RoutingConfig>::all(client.clone()), wc()).with_config(cfg.clone());
    let rc_store = rc.store();
    let configs = rc
        .watches(
            Api::<ForkedWorkload>::all(client.clone()),
            wc(),
            move |fw| {
                rc_store
                    .state()
                    .into_iter()
                    .filter(|rc| routingconfig::lists(rc, &fw))
                    .map(|rc| ObjectRef::from_obj(&*rc))
                    .collect::<Vec<_>>()
            },
        )
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            routingconfig::reconcile,
            routingconfig::error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));

    let rg = Controller::new(Api::<RouteGroup>::all(client.clone()), wc()).with_config(cfg);
    let rg_store = rg.store();
    let groups = rg
        .owns(Api::<RoutingConfig>::all(client.clone()), wc())
        // Any sandbox change may change which sandboxes a group matches.
        .watches(Api::<Sandbox>::all(client.clone()), wc(), move |_| {
            rg_store
                .state()
                .into_iter()
                .map(|rg| ObjectRef::from_obj(&*rg))
                .collect::<Vec<_>>()
        })
        .graceful_shutdown_on(stop.cancelled_owned())
        .run(routegroup::reconcile, routegroup::error_policy, ctx)
        .for_each(|_| std::future::ready(()));

    tokio::join!(sandboxes, forks, configs, groups);
    let _ = pki.await;
}

fn forks_where(
    store: &kube::runtime::reflector::Store<ForkedWorkload>,
    keep: impl Fn(&ForkedWorkload) -> bool,
) -> Vec<ObjectRef<ForkedWorkload>> {
    store
        .state()
        .into_iter()
        .filter(|fw| keep(fw))
        .map(|fw| ObjectRef::from_obj(&*fw))
        .collect()
}
