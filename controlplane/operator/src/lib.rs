//! Spur's Kubernetes controllers: Sandbox, ForkedWorkload, ExternalWorkload, RouteGroup and
//! RoutingConfig, each thin and idempotent, writing with server-side apply under one field
//! manager; plus the sidecar-injection webhook and the certificate manager.
//!
//! ```text
//! Sandbox ──► ForkedWorkload (per fork, baseline namespace) ──► fork Deployment + sandbox Services
//!    │                                                              │ ready
//!    └──────► RoutingConfig (its routing key) ◄── ForkedWorkload status (Service mapping)
//! RouteGroup ─(label match over Sandboxes)─► RoutingConfig (the group's key)
//! RoutingConfig status.routeServer.routes ──► route server (`spur routeserver --kubernetes`)
//! RoutingConfig ─(mesh modes)─► IstioRoute ──► Spur's routes in the user's VirtualServices
//!               └────────────► GatewayAPIRoute ──► derived HTTPRoutes beside the user's
//! ListenerSet ──► its Service + a headless Service per selector endpoint (owner references, no
//!                 finalizer) ◄── EndpointSlices (status.listeners[])
//! ```
//!
//! Deletion never relies on the garbage collector: every owner carries a finalizer and deletes
//! its children itself (owner references are set too, for `kubectl` and a cluster's GC). The
//! one exception is ListenerSet: its children are Services of its own namespace, which a
//! controller owner reference is enough for, so it has no finalizer to be stuck on.

pub mod access;
mod apply;
pub mod audit;
mod certs;
mod context;
pub mod enroll;
mod enroll_config;
pub mod envoyconfig;
mod error;
pub mod external;
pub mod fork;
mod forked;
pub mod inject;
mod leader;
pub mod listenerset;
mod mesh;
mod mesh_gateway;
mod mesh_istio;
mod metrics;
pub mod olm;
pub mod owner;
pub mod patch;
mod pki_config;
mod resources;
mod routegroup;
mod routingconfig;
pub mod sandbox;
mod triggers;
mod virtualw;
mod webhook;
mod workstation_owner;
pub mod workstations;
pub mod xds_clients;

pub use context::{Context, FIELD_MANAGER, Previews};
pub use error::Error;
pub use external::TunnelConfig;
pub use fork::ForkPolicy;
pub use inject::InjectionConfig;
pub use leader::{LeaderElection, run_elected};
pub use mesh::MeshConfig;
pub use metrics::Metrics;
pub use olm::ResourceConfig;
pub use pki_config::XdsClientConfig;
pub use pki_config::{PKI_LABEL, PkiConfig, ServingCert};
pub use webhook::sandbox::{MUTATE_SANDBOX_PATH, VALIDATE_SANDBOX_PATH};
pub use webhook::{
    MUTATE_ACCESS_REQUEST_PATH, MUTATE_POD_PATH, VALIDATE_ENVOYCONFIG_PATH,
    VALIDATE_LISTENERSET_PATH, VALIDATE_POD_CONNECT_PATH, Webhook, WebhookConfig,
};

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{Controller, controller, watcher};
use kube::{Api, Client, ResourceExt};
use spur_api::routingconfig::SandboxedKind;
use spur_api::{
    EnvoyConfig, EnvoyConfigRevision, ExternalWorkload, ForkedWorkload, ListenerSet,
    ObjectLifecycleMethods, Resource, ResourcePlugin, RouteGroup, RoutingConfig, Sandbox,
    VirtualWorkload,
};
use tokio_util::sync::CancellationToken;

/// The finalizer on Sandboxes, ForkedWorkloads and RouteGroups.
pub const FINALIZER: &str = "spur.dev/cleanup";

/// How long in-flight reconciles may run on after `stop` before they are dropped.
pub const DRAIN_GRACE: Duration = Duration::from_secs(10);

/// Runs all five controllers, the dead-tunnel collector (and the certificate manager, when the context has a PKI
/// configuration) until `stop` is cancelled, then lets in-flight reconciles finish for up to
/// [`DRAIN_GRACE`].
pub async fn run(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    let pki = match ctx.pki.clone() {
        Some(cfg) => {
            let signer = drained(
                "workstation-signer",
                workstations::run(
                    client.clone(),
                    cfg.clone(),
                    ctx.metrics.clone(),
                    stop.clone(),
                ),
                stop.clone(),
            );
            let xds = cfg.xds_clients.clone().map(|x| {
                drained(
                    "xds-client-issuer",
                    xds_clients::run(
                        client.clone(),
                        cfg.clone(),
                        x,
                        ctx.metrics.clone(),
                        stop.clone(),
                    ),
                    stop.clone(),
                )
            });
            let manager = certs::run(client.clone(), cfg, ctx.metrics.clone(), stop.clone());
            tokio::spawn(async move {
                let xds = async move {
                    if let Some(x) = xds {
                        x.await;
                    }
                };
                tokio::join!(manager, signer, xds);
            })
        }
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
    let cfg = controller::Config::default().debounce(Duration::from_millis(10));

    // The Sandbox controller reads its children from these stores (it applies only what
    // differs), filled by the same watches that wake it.
    let (forks_store, sb_forks) = triggers::changes(
        Api::<ForkedWorkload>::all(client.clone()),
        wc(),
        triggers::forked_workload,
    );
    let (externals_store, sb_externals) = triggers::changes(
        Api::<ExternalWorkload>::all(client.clone()),
        wc(),
        triggers::external_workload,
    );
    let (_, sb_virtuals) = triggers::changes(
        Api::<VirtualWorkload>::all(client.clone()),
        wc(),
        triggers::virtual_workload,
    );
    let (configs_store, sb_configs) = triggers::changes(
        Api::<RoutingConfig>::all(client.clone()),
        wc(),
        triggers::routing_config,
    );
    // The ForkedWorkload controller's own Deployments and Services, likewise.
    let (deployments_store, fw_deployments) = triggers::changes(
        Api::<Deployment>::all(client.clone()),
        managed(),
        triggers::fork_deployment,
    );
    let (services_store, fw_services) = triggers::changes(
        Api::<Service>::all(client.clone()),
        managed(),
        triggers::fork_service,
    );
    let (rc_forks, rc_fork_changes) = triggers::changes(
        Api::<ForkedWorkload>::all(client.clone()),
        wc(),
        triggers::forked_workload,
    );
    let (rc_externals, rc_external_changes) = triggers::changes(
        Api::<ExternalWorkload>::all(client.clone()),
        wc(),
        triggers::external_workload,
    );
    // The ListenerSet controller's Services (client and endpoint Services), by their label.
    // `fork_service` reads what matters of them too: spec and metadata, not status.
    let (ls_services_store, ls_services) = triggers::changes(
        Api::<Service>::all(client.clone()),
        watcher::Config::default().labels(spur_api::listenerset::LISTENER_SET_LABEL),
        triggers::fork_service,
    );
    ctx.set_stores(context::Stores {
        rc_forks,
        rc_externals,
        forks: forks_store,
        externals: externals_store,
        configs: configs_store,
        deployments: deployments_store,
        services: services_store,
        listener_services: ls_services_store.clone(),
    });
    // Not `owns` for the namespaced children: see `cluster_owners`.
    let mut sandboxes = primary(Api::<Sandbox>::all(client.clone()))
        .with_config(cfg.clone())
        .watches_stream(sb_forks, |fw| cluster_owners::<Sandbox>(&fw))
        .watches_stream(sb_externals, |ew| cluster_owners::<Sandbox>(&ew))
        .watches_stream(sb_virtuals, |vw| cluster_owners::<Sandbox>(&vw))
        .owns_stream(sb_configs);
    // A workstation's owner record changing (docs/local.md, "Bound only while owned") wakes
    // the Sandboxes naming it: the old owner's are unbound at once, not at their next resync.
    let by_workstation = sandboxes.store();
    sandboxes = sandboxes.watches(
        Api::<PartialObjectMeta<ConfigMap>>::namespaced(client.clone(), &ctx.tunnels.namespace),
        watcher::Config::default().labels(spur_api::tunnel::WORKSTATION_LABEL),
        move |cm| {
            let Some(ws) = cm
                .labels()
                .get(spur_api::tunnel::WORKSTATION_LABEL)
                .cloned()
            else {
                return Vec::new();
            };
            objects_where(&by_workstation, |sb| {
                sb.spec.workstation.as_deref() == Some(ws.as_str())
            })
        },
    );
    // Resources wake their Sandbox (cluster-scoped like it: `owns` keys them right); without
    // resources enabled there is nothing to watch.
    if ctx.resources.is_some() {
        sandboxes = sandboxes.owns(Api::<Resource>::all(client.clone()), wc());
    }
    let sandboxes = sandboxes
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(sandbox::reconcile, sandbox::error_policy, ctx.clone())
        .for_each(|_| std::future::ready(()));

    let fw = primary(Api::<ForkedWorkload>::all(client.clone())).with_config(cfg.clone());
    let (by_baseline, by_namespace, by_pod) = (fw.store(), fw.store(), fw.store());
    let forks = fw
        .owns_stream(fw_deployments)
        .owns_stream(fw_services)
        // A changed baseline Deployment reaches its forks at once: metadata-only watches (no
        // specs or statuses cached), mapped through the ForkedWorkload store.
        .watches(
            Api::<PartialObjectMeta<Deployment>>::all(client.clone()),
            wc(),
            move |d| {
                let (ns, name) = (d.namespace().unwrap_or_default(), d.name_any());
                objects_where(&by_baseline, |fw| {
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
                if is_managed(&svc) {
                    return Vec::new();
                }
                let ns = svc.namespace().unwrap_or_default();
                objects_where(&by_namespace, |fw| fw.spec.baseline.namespace == ns)
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
                objects_where(&by_pod, |fw| fw.spec.baseline.namespace == ns)
            },
        )
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(forked::reconcile, forked::error_policy, ctx.clone())
        .for_each(|_| std::future::ready(()));

    // VirtualWorkloads: their baseline Deployment and its pods (metadata only) decide status.
    let vw = primary(Api::<VirtualWorkload>::all(client.clone())).with_config(cfg.clone());
    let (vw_by_baseline, vw_by_pod) = (vw.store(), vw.store());
    let virtuals = vw
        .watches(
            Api::<PartialObjectMeta<Deployment>>::all(client.clone()),
            wc(),
            move |d| {
                let (ns, name) = (d.namespace().unwrap_or_default(), d.name_any());
                objects_where(&vw_by_baseline, |vw| {
                    vw.spec.baseline.namespace == ns && vw.spec.baseline.name == name
                })
            },
        )
        .watches(
            Api::<PartialObjectMeta<Pod>>::all(client.clone()),
            wc(),
            move |pod| {
                if pod.labels().contains_key(spur_api::keys::labels::FORK) {
                    return Vec::new();
                }
                let ns = pod.namespace().unwrap_or_default();
                objects_where(&vw_by_pod, |vw| vw.spec.baseline.namespace == ns)
            },
        )
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(virtualw::reconcile, virtualw::error_policy, ctx.clone())
        .for_each(|_| std::future::ready(()));

    let ew = primary(Api::<ExternalWorkload>::all(client.clone())).with_config(cfg.clone());
    let (ew_by_baseline, ew_by_namespace, ew_by_workstation) = (ew.store(), ew.store(), ew.store());
    let tunnel_ns = ctx.tunnels.namespace.clone();
    let externals = ew
        .owns(Api::<Service>::all(client.clone()), managed())
        .owns(Api::<EndpointSlice>::all(client.clone()), managed())
        // A tunnel coming, renewing, moving or going changes endpoints and health.
        .watches(
            Api::<Lease>::namespaced(client.clone(), &tunnel_ns),
            watcher::Config::default().labels(spur_api::tunnel::WORKSTATION_LABEL),
            move |lease| {
                let ws = lease
                    .labels()
                    .get(spur_api::tunnel::WORKSTATION_LABEL)
                    .cloned()
                    .unwrap_or_default();
                objects_where(&ew_by_workstation, |ew| ew.spec.workstation == ws)
            },
        )
        .watches(
            Api::<PartialObjectMeta<Deployment>>::all(client.clone()),
            wc(),
            move |d| {
                let (ns, name) = (d.namespace().unwrap_or_default(), d.name_any());
                objects_where(&ew_by_baseline, |ew| {
                    ew.spec.baseline.namespace == ns && ew.spec.baseline.name == name
                })
            },
        )
        .watches(
            Api::<PartialObjectMeta<Service>>::all(client.clone()),
            wc(),
            move |svc| {
                if is_managed(&svc) {
                    return Vec::new();
                }
                let ns = svc.namespace().unwrap_or_default();
                objects_where(&ew_by_namespace, |ew| ew.spec.baseline.namespace == ns)
            },
        )
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(external::reconcile, external::error_policy, ctx.clone())
        .for_each(|_| std::future::ready(()));
    let gc = tokio::spawn(external::collect_dead_tunnels(ctx.clone(), stop.clone()));

    let mut rc = primary(Api::<RoutingConfig>::all(client.clone())).with_config(cfg.clone());
    let (rc_store, rc_store_ew) = (rc.store(), rc.store());
    // A mesh route changed or deleted behind the operator's back is restored.
    let mesh = ctx.mesh.clone().unwrap_or_default();
    if mesh.istio {
        rc = rc.owns(Api::<spur_api::IstioRoute>::all(client.clone()), wc());
    }
    if mesh.gateway_api {
        rc = rc.owns(Api::<spur_api::GatewayAPIRoute>::all(client.clone()), wc());
    }
    let configs = rc
        .watches_stream(rc_fork_changes, move |fw| {
            rc_store
                .state()
                .into_iter()
                .filter(|rc| routingconfig::lists(rc, SandboxedKind::ForkedWorkload, &fw))
                .map(|rc| ObjectRef::from_obj(&*rc))
                .collect::<Vec<_>>()
        })
        .watches_stream(rc_external_changes, move |ew| {
            rc_store_ew
                .state()
                .into_iter()
                .filter(|rc| routingconfig::lists(rc, SandboxedKind::ExternalWorkload, &ew))
                .map(|rc| ObjectRef::from_obj(&*rc))
                .collect::<Vec<_>>()
        })
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            routingconfig::reconcile,
            routingconfig::error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));

    let cfg_resources = cfg.clone();
    let stop_resources = stop.clone();
    let rg = primary(Api::<RouteGroup>::all(client.clone())).with_config(cfg);
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
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(routegroup::reconcile, routegroup::error_policy, ctx.clone())
        .for_each(|_| std::future::ready(()));

    // Sandbox resources: plugins are validated into their status; Resources drive their
    // ObjectLifecycleMethods, whose step pods (in the resource namespace) wake them.
    let plugins = primary(Api::<ResourcePlugin>::all(client.clone()))
        .with_config(cfg_resources.clone())
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            resources::reconcile_plugin,
            resources::plugin_error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));
    let resource_objects = primary(Api::<Resource>::all(client.clone()))
        .with_config(cfg_resources.clone())
        .owns(Api::<ObjectLifecycleMethods>::all(client.clone()), wc())
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(resources::reconcile, resources::error_policy, ctx.clone())
        .for_each(|_| std::future::ready(()));
    let step_namespace = ctx
        .resources
        .as_ref()
        .map_or_else(|| "default".to_string(), |r| r.namespace.clone());
    let olms = primary(Api::<ObjectLifecycleMethods>::all(client.clone()))
        .with_config(cfg_resources)
        .watches(
            Api::<Pod>::namespaced(client.clone(), &step_namespace),
            watcher::Config::default().labels(spur_api::keys::labels::OLM),
            |pod| cluster_owners::<ObjectLifecycleMethods>(&pod),
        )
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(olm::reconcile, olm::error_policy, ctx.clone())
        .for_each(|_| std::future::ready(()));
    let with_resources = ctx.resources.is_some();
    let resource_controllers = async move {
        // Without resources enabled the controllers would only watch for nothing.
        if with_resources {
            tokio::join!(
                drained("resourceplugin", plugins, stop_resources.clone()),
                drained("resource", resource_objects, stop_resources.clone()),
                drained("objectlifecyclemethods", olms, stop_resources),
            );
        }
    };

    // EnvoyConfigs: a revision's status (the route servers' reports) wakes its config.
    let envoy = primary(Api::<EnvoyConfig>::all(client.clone()))
        .with_config(controller::Config::default().debounce(Duration::from_millis(10)))
        .owns(Api::<EnvoyConfigRevision>::all(client.clone()), wc())
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            envoyconfig::reconcile,
            envoyconfig::error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));

    // ListenerSets: their Services wake them (changed or deleted behind the operator's back),
    // and so do the EndpointSlices of their endpoint Services, so status follows pods coming,
    // going and changing readiness. The slice watch is metadata-only and cluster-wide (no
    // label selects the slices of the operator's Services: the EndpointSlice controller names
    // the Service in `kubernetes.io/service-name`); a slice is mapped to its set through the
    // Service store.
    let listener_sets = primary(Api::<ListenerSet>::all(client.clone()))
        .with_config(controller::Config::default().debounce(Duration::from_millis(10)))
        .owns_stream(ls_services)
        .watches(
            Api::<PartialObjectMeta<EndpointSlice>>::all(client.clone()),
            wc(),
            move |slice| listenerset::set_of_slice(&ls_services_store, &slice),
        )
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            listenerset::reconcile,
            listenerset::error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));

    let access_controllers = access_controllers(client.clone(), ctx.clone(), stop.clone());
    let enroller = {
        let (ctx, stop) = (ctx.clone(), stop.clone());
        async move {
            if let Some(cfg) = ctx.enrollment.clone() {
                drained(
                    "namespace-enroller",
                    enroll::run(ctx, cfg, stop.clone()),
                    stop,
                )
                .await;
            }
        }
    };

    let stop_mesh = stop.clone();
    let mesh_controllers = async move {
        // Each mode's controller runs only when enabled: without it neither the mesh's CRDs
        // nor the rights to them need to exist.
        let istio = async {
            if mesh.istio {
                let work =
                    mesh_istio::run(client.clone(), ctx.clone(), mesh.clone(), stop_mesh.clone());
                drained("istioroute", work, stop_mesh.clone()).await;
            }
        };
        let gateway = async {
            if mesh.gateway_api {
                let work = mesh_gateway::run(client.clone(), ctx.clone(), stop_mesh.clone());
                drained("gatewayapiroute", work, stop_mesh.clone()).await;
            }
        };
        tokio::join!(istio, gateway);
    };

    tokio::join!(
        access_controllers,
        enroller,
        mesh_controllers,
        resource_controllers,
        drained("sandbox", sandboxes, stop.clone()),
        drained("forkedworkload", forks, stop.clone()),
        drained("externalworkload", externals, stop.clone()),
        drained("virtualworkload", virtuals, stop.clone()),
        drained("routingconfig", configs, stop.clone()),
        drained("routegroup", groups, stop.clone()),
        drained("envoyconfig", envoy, stop.clone()),
        drained("listenerset", listener_sets, stop.clone()),
    );
    let _ = pki.await;
    let _ = gc.await;
}

/// The just-in-time access controllers (docs/access.md), when enabled: templates, and requests
/// woken by their template and by their debug pods.
async fn access_controllers(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    use spur_api::access::labels::ACCESS_KIND;
    use spur_api::{
        ExecAccessRequest, ExecAccessTemplate, PodAccessRequest, PodAccessTemplate,
        TunnelAccessRequest, TunnelAccessTemplate,
    };
    if !ctx.access {
        return;
    }
    let cfg = || controller::Config::default().debounce(Duration::from_millis(10));
    let exec_templates = primary(Api::<ExecAccessTemplate>::all(client.clone()))
        .with_config(cfg())
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            access::reconcile_exec_template,
            access::template_error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));
    let pod_templates = primary(Api::<PodAccessTemplate>::all(client.clone()))
        .with_config(cfg())
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            access::reconcile_pod_template,
            access::template_error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));
    let ear = primary(Api::<ExecAccessRequest>::all(client.clone())).with_config(cfg());
    let ear_store = ear.store();
    let exec_requests = ear
        // A template's status (readiness) matters to its requests: not `primary`'s filter.
        .watches(
            Api::<ExecAccessTemplate>::all(client.clone()),
            watcher::Config::default(),
            move |t| {
                access::requests_of(
                    &ear_store,
                    &t.namespace().unwrap_or_default(),
                    &t.name_any(),
                )
            },
        )
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            access::reconcile_exec,
            access::request_error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));
    let par = primary(Api::<PodAccessRequest>::all(client.clone())).with_config(cfg());
    let par_store = par.store();
    let pod_requests = par
        .watches(
            Api::<PodAccessTemplate>::all(client.clone()),
            watcher::Config::default(),
            move |t| {
                access::requests_of(
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
        )
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            access::reconcile_pod,
            access::request_error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));
    let tunnel_templates = primary(Api::<TunnelAccessTemplate>::all(client.clone()))
        .with_config(cfg())
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            access::reconcile_tunnel_template,
            access::template_error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));
    let tar = primary(Api::<TunnelAccessRequest>::all(client.clone())).with_config(cfg());
    let tar_store = tar.store();
    let tunnel_requests = tar
        .watches(
            Api::<TunnelAccessTemplate>::all(client.clone()),
            watcher::Config::default(),
            move |t| {
                access::requests_of(
                    &tar_store,
                    &t.namespace().unwrap_or_default(),
                    &t.name_any(),
                )
            },
        )
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            access::reconcile_tunnel,
            access::request_error_policy,
            ctx.clone(),
        )
        .for_each(|_| std::future::ready(()));
    tokio::join!(
        drained("tunnelaccesstemplate", tunnel_templates, stop.clone()),
        drained("tunnelaccessrequest", tunnel_requests, stop.clone()),
        drained("execaccesstemplate", exec_templates, stop.clone()),
        drained("podaccesstemplate", pod_templates, stop.clone()),
        drained("execaccessrequest", exec_requests, stop.clone()),
        drained("podaccessrequest", pod_requests, stop),
    );
}

/// Runs `work` to its end, but for no longer than [`DRAIN_GRACE`] once `stop` is cancelled.
///
/// A kube-runtime controller's graceful shutdown never ends if its object store was not yet
/// ready when it began (its runner holds every request until the store is ready, and the
/// watch that would make it ready is no longer polled): a stop early in start-up, while a
/// watch is still backing off, would otherwise keep the operator, and the leader lease it
/// holds, forever.
async fn drained(name: &'static str, work: impl Future<Output = ()>, stop: CancellationToken) {
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

/// A controller on every object of `K`, woken by changes of an object's spec (generation),
/// labels, annotations, owner references, finalizers or deletion, not of its status
/// ([`triggers::own`]). (An annotation, e.g.
/// `kubectl annotate sandbox x spur.dev/reconcile=$(date +%s)`, is how a user forces a pass.)
///
/// Every controller writes its object's status, and each write comes back as a watch event:
/// unfiltered, those were about half of all passes in the bulk benchmark (perf/results/
/// operator_passes.md), each repeating the pass before it. What the controllers read from
/// other objects' statuses reaches them through their `owns`/`watches` triggers.
fn primary<K: triggers::Watched>(api: Api<K>) -> Controller<K> {
    let (reader, trigger) = triggers::changes(api, watcher::Config::default(), triggers::own::<K>);
    Controller::for_stream(trigger, reader)
}

fn is_managed(obj: &impl ResourceExt) -> bool {
    obj.labels()
        .get(spur_api::keys::labels::MANAGED_BY)
        .map(String::as_str)
        == Some(spur_api::keys::labels::MANAGED_BY_VALUE)
}

/// The owners of kind `K` (cluster-scoped) of `obj`, keyed as cluster-scoped objects.
///
/// `Controller::owns` keys an owner by its child's namespace, so a cluster-scoped Sandbox
/// reached through a namespaced ForkedWorkload got a second scheduler key
/// (`shop/sb1` besides `sb1`), and two reconciles of the same Sandbox could run at once (the
/// store lookup falls back to the cluster-scoped object). They then raced each other's deletes
/// and status writes into errors, and the errors into backoff.
fn cluster_owners<K>(obj: &impl ResourceExt) -> Vec<ObjectRef<K>>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    obj.owner_references()
        .iter()
        .filter(|o| o.kind == K::kind(&()) && o.api_version == K::api_version(&()))
        .map(|o| ObjectRef::new(&o.name))
        .collect()
}

fn objects_where<K>(
    store: &kube::runtime::reflector::Store<K>,
    keep: impl Fn(&K) -> bool,
) -> Vec<ObjectRef<K>>
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
    use kube::Resource;
    use serde_json::json;

    use super::*;

    #[test]
    fn a_namespaced_child_wakes_its_cluster_scoped_sandbox_under_one_key() {
        let sb: Sandbox = serde_json::from_value(json!({
            "apiVersion": Sandbox::api_version(&()), "kind": "Sandbox",
            "metadata": {"name": "sb1", "uid": "u-1"},
            "spec": {}
        }))
        .unwrap();
        let fw: ForkedWorkload = serde_json::from_value(json!({
            "apiVersion": ForkedWorkload::api_version(&()), "kind": "ForkedWorkload",
            "metadata": {"name": "sb1-web", "namespace": "shop", "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "other", "uid": "u-2"},
                sb.controller_owner_ref(&()).unwrap(),
            ]},
            "spec": {"sandbox": "sb1", "routingKey": "k", "baseline": {
                "kind": "Deployment", "namespace": "shop", "name": "web"}}
        }))
        .unwrap();
        // The key the Sandbox's own watch schedules it under: one key, one reconcile at a time.
        assert_eq!(
            cluster_owners::<Sandbox>(&fw),
            vec![ObjectRef::from_obj(&sb)]
        );
        // What `Controller::owns` would schedule: a second key for the same Sandbox. When
        // kube-runtime stops doing this, `owns` can come back.
        let owns_key = fw
            .owner_references()
            .iter()
            .find_map(|o| ObjectRef::<Sandbox>::from_owner_ref(fw.namespace().as_deref(), o, ()));
        assert_ne!(owns_key, Some(ObjectRef::from_obj(&sb)));
    }
}
