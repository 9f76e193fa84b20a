//! The Sandbox's controllers: Sandboxes, their ForkedWorkloads, ExternalWorkloads and
//! VirtualWorkloads, RoutingConfigs and RouteGroups, and the watches whose stores they read.

use std::sync::Arc;

use futures_util::Stream;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::DynamicObject;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use spur_api::WorkloadKind;
use spur_api::routingconfig::SandboxedKind;
use spur_api::{
    ExternalWorkload, ForkedWorkload, Resource, RouteGroup, RoutingConfig, Sandbox, VirtualWorkload,
};
use spur_controller::{cluster_owners, objects_where};
use tokio_util::sync::CancellationToken;

use crate::context::{Stores, Term, WorkloadsContext};
use crate::triggers::primary;
use crate::{external, forked, routegroup, routingconfig, sandbox, triggers, virtualw};
use spur_controller::verified::Verified;
use spur_operator_core::controller_config as config;

/// Metadata changes of Argo Rollouts (baselines), for `controller`, of what stands in front
/// of one. Metadata only, so every change wakes them, status included: a change of the
/// Deployment a Rollout's `workloadRef` names reaches them through the Rollout's status, which
/// Argo updates as it rolls the new template out. Retried with backoff: on a cluster without
/// Argo Rollouts the list fails (404) until it is installed, then the watch starts by itself;
/// meanwhile a Rollout baseline is reported not found. Its errors are logged, not passed on:
/// passed on, they paused every other watch of the controller (up to 30 s per change, on any
/// cluster without Argo Rollouts).
fn rollouts(
    client: &Client,
    controller: &'static str,
) -> impl Stream<Item = Result<PartialObjectMeta<DynamicObject>, watcher::Error>> + Send + use<> {
    let api = Api::<PartialObjectMeta<DynamicObject>>::all_with(
        client.clone(),
        &crate::baseline::rollout_resource(),
    );
    spur_controller::errors_logged(
        controller,
        "Argo Rollouts",
        watcher(api, watcher::Config::default())
            .default_backoff()
            .touched_objects(),
    )
}

/// Whether `w` (a Rollout or a Deployment, of `kind`) is `baseline`.
fn is_baseline(
    baseline: &spur_api::WorkloadRef,
    kind: spur_api::WorkloadKind,
    w: &impl ResourceExt,
) -> bool {
    baseline.kind == kind
        && w.namespace().is_some_and(|ns| ns == baseline.namespace)
        && w.name_any() == baseline.name
}

/// A watch's events that passed its trigger's filter.
pub type Changes<K> = std::pin::Pin<Box<dyn Stream<Item = Result<K, watcher::Error>> + Send>>;

/// The watches whose stores the controllers read (each store is updated before the event that
/// wakes a pass), and what each wakes.
pub struct Wakes {
    pub sb_forks: Changes<ForkedWorkload>,
    pub sb_externals: Changes<ExternalWorkload>,
    pub sb_virtuals: Changes<VirtualWorkload>,
    pub sb_configs: Changes<RoutingConfig>,
    pub forks: ForkWakes,
    pub rc_forks: Changes<ForkedWorkload>,
    pub rc_externals: Changes<ExternalWorkload>,
    pub ls_services: Changes<Service>,
    pub rg_sandboxes: Changes<Sandbox>,
    pub ew_leases: Changes<Lease>,
    pub ew_slices: Changes<EndpointSlice>,
}

/// What wakes the ForkedWorkload controller.
pub struct ForkWakes {
    /// Its own Deployments and Services.
    pub deployments: Changes<Deployment>,
    pub services: Changes<Service>,
    /// Every Deployment, Service and pod, metadata only: baselines, the Services of their
    /// namespaces, their pods.
    pub baselines: Changes<PartialObjectMeta<Deployment>>,
    pub namespace_services: Changes<PartialObjectMeta<Service>>,
    pub pods: Changes<PartialObjectMeta<Pod>>,
}

/// Starts (lazily: on first poll) this run's watches: the stores go into the controllers'
/// context, the streams wake them.
pub fn watches(client: &Client, ctx: Arc<WorkloadsContext>) -> (Arc<Term>, Wakes) {
    let wc = watcher::Config::default;
    // The Sandbox controller reads its children from these stores (it applies only what
    // differs), filled by the same watches that wake it.
    let (forks, sb_forks) = triggers::changes(
        Api::<ForkedWorkload>::all(client.clone()),
        wc(),
        triggers::forked_workload,
    );
    let (externals, sb_externals) = triggers::changes(
        Api::<ExternalWorkload>::all(client.clone()),
        wc(),
        triggers::external_workload,
    );
    let (_, sb_virtuals) = triggers::changes(
        Api::<VirtualWorkload>::all(client.clone()),
        wc(),
        triggers::virtual_workload,
    );
    let (configs, sb_configs) = triggers::changes(
        Api::<RoutingConfig>::all(client.clone()),
        wc(),
        triggers::routing_config,
    );
    // The ForkedWorkload controller's own Deployments and Services, likewise.
    let (deployments, fw_deployments) = triggers::changes(
        Api::<Deployment>::all(client.clone()),
        managed(),
        triggers::fork_deployment,
    );
    let (services, fw_services) = triggers::changes(
        Api::<Service>::all(client.clone()),
        managed(),
        triggers::fork_service,
    );
    // Every Deployment, Service and pod, metadata only. They wake the ForkedWorkload
    // controller (a baseline, the Services of its namespace, its pods), and their stores vouch
    // for the whole objects the passes read: each is read from the API server again only when
    // it changed (`spur_controller::verified`).
    let (baseline_meta, fw_baselines) = triggers::changes(
        Api::<PartialObjectMeta<Deployment>>::all(client.clone()),
        wc(),
        triggers::any_change,
    );
    let (service_meta, fw_namespace_services) = triggers::changes(
        Api::<PartialObjectMeta<Service>>::all(client.clone()),
        wc(),
        triggers::any_change,
    );
    let (pod_meta, fw_pods) = triggers::changes(
        Api::<PartialObjectMeta<Pod>>::all(client.clone()),
        wc(),
        triggers::any_change,
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
    let (listener_services, ls_services) = triggers::changes(
        Api::<Service>::all(client.clone()),
        watcher::Config::default().labels(spur_api::listenerset::LISTENER_SET_LABEL),
        triggers::fork_service,
    );
    // The RouteGroup controller's Sandboxes, which it matches by their labels.
    let (sandboxes, rg_sandboxes) = triggers::changes(
        Api::<Sandbox>::all(client.clone()),
        wc(),
        triggers::group_member,
    );
    // The ExternalWorkload controller's tunnel Leases and its own EndpointSlices (its Services
    // are in `services`).
    let (leases, ew_leases) = triggers::changes(
        Api::<Lease>::namespaced(client.clone(), &ctx.tunnels.namespace),
        watcher::Config::default().labels(spur_api::tunnel::WORKSTATION_LABEL),
        triggers::tunnel_lease,
    );
    let (external_slices, ew_slices) = triggers::changes(
        Api::<EndpointSlice>::all(client.clone()),
        managed(),
        triggers::external_slice,
    );
    let stores = Stores {
        sandboxes,
        leases,
        external_slices,
        rc_forks,
        rc_externals,
        forks,
        externals,
        configs,
        deployments,
        services,
        listener_services,
        baselines: Verified::new(baseline_meta),
        namespace_services: Verified::new(service_meta),
        pods: Verified::new(pod_meta),
    };
    let wakes = Wakes {
        sb_forks: Box::pin(sb_forks),
        sb_externals: Box::pin(sb_externals),
        sb_virtuals: Box::pin(sb_virtuals),
        sb_configs: Box::pin(sb_configs),
        forks: ForkWakes {
            deployments: Box::pin(fw_deployments),
            services: Box::pin(fw_services),
            baselines: Box::pin(fw_baselines),
            namespace_services: Box::pin(fw_namespace_services),
            pods: Box::pin(fw_pods),
        },
        rc_forks: Box::pin(rc_fork_changes),
        rc_externals: Box::pin(rc_external_changes),
        ls_services: Box::pin(ls_services),
        rg_sandboxes: Box::pin(rg_sandboxes),
        ew_leases: Box::pin(ew_leases),
        ew_slices: Box::pin(ew_slices),
    };
    (Arc::new(Term { ctx, stores }), wakes)
}

/// Sandboxes, woken by their children. Not `owns` for the namespaced children: see
/// `spur_controller::cluster_owners`.
pub async fn sandboxes(
    client: Client,
    term: Arc<Term>,
    forks: Changes<ForkedWorkload>,
    externals: Changes<ExternalWorkload>,
    virtuals: Changes<VirtualWorkload>,
    configs: Changes<RoutingConfig>,
    stop: CancellationToken,
) {
    let mut sandboxes = primary(Api::<Sandbox>::all(client.clone()))
        .with_config(config())
        .watches_stream(forks, |fw| cluster_owners::<Sandbox>(&fw))
        .watches_stream(externals, |ew| cluster_owners::<Sandbox>(&ew))
        .watches_stream(virtuals, |vw| cluster_owners::<Sandbox>(&vw))
        .owns_stream(configs);
    // A workstation's owner record changing (docs/local.md, "Bound only while owned") wakes
    // the Sandboxes naming it: the old owner's are unbound at once, not at their next resync.
    let by_workstation = sandboxes.store();
    term.ctx.metrics.watch_sandboxes(sandboxes.store());
    sandboxes = sandboxes.watches(
        Api::<PartialObjectMeta<ConfigMap>>::namespaced(client.clone(), &term.tunnels.namespace),
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
    if term.res.resources.is_some() {
        sandboxes = sandboxes.owns(Api::<Resource>::all(client), watcher::Config::default());
    }
    spur_controller::run(
        "sandbox",
        sandboxes,
        sandbox::reconcile,
        sandbox::error_policy,
        term,
        stop,
    )
    .await;
}

/// Whether `fw` stands in front of `w` (a workload of `kind`) or renders a `valueFrom.fork` value
/// from it: the other fork's address follows that baseline and its namespace's Services.
fn reads_workload(fw: &ForkedWorkload, kind: WorkloadKind, w: &impl ResourceExt) -> bool {
    is_baseline(&fw.spec.baseline, kind, w)
        || crate::fork_refs::references(&fw.spec.customizations).any(|r| is_baseline(r, kind, w))
}

/// Whether `fw` reads the Services of namespace `ns`: its baseline's, or a `valueFrom.fork`
/// baseline's.
fn reads_services_of(fw: &ForkedWorkload, ns: &str) -> bool {
    fw.spec.baseline.namespace == ns
        || crate::fork_refs::references(&fw.spec.customizations).any(|r| r.namespace == ns)
}

/// ForkedWorkloads, woken by their Deployment and Services, their baseline Deployment or
/// Rollout, the baseline namespace's Services and its pods, and the baselines and Services a
/// `valueFrom.fork` value is rendered from (in any namespace).
pub async fn forks(client: Client, term: Arc<Term>, wakes: ForkWakes, stop: CancellationToken) {
    let fw = primary(Api::<ForkedWorkload>::all(client.clone())).with_config(config());
    let (by_baseline, by_rollout, by_namespace, by_pod) =
        (fw.store(), fw.store(), fw.store(), fw.store());
    let forks = fw
        .owns_stream(wakes.deployments)
        .owns_stream(wakes.services)
        // A changed baseline Deployment reaches its forks at once: metadata-only watches (no
        // specs or statuses cached), mapped through the ForkedWorkload store.
        .watches_stream(wakes.baselines, move |d| {
            objects_where(&by_baseline, |fw| {
                reads_workload(fw, WorkloadKind::Deployment, &d)
            })
        })
        .watches_stream_with(
            rollouts(&client, "forkedworkload"),
            move |r| {
                objects_where(&by_rollout, |fw| {
                    reads_workload(fw, WorkloadKind::Rollout, &r)
                })
            },
            crate::baseline::rollout_resource(),
        )
        // A new or changed baseline Service gets (or changes) its sandbox Services. The
        // operator's own Services are skipped: each would otherwise wake every fork of its
        // namespace.
        .watches_stream(wakes.namespace_services, move |svc| {
            if is_managed(&svc) {
                return Vec::new();
            }
            let ns = svc.namespace().unwrap_or_default();
            objects_where(&by_namespace, |fw| reads_services_of(fw, &ns))
        })
        // Baseline pods coming, going or changing readiness change the sidecar coverage in
        // status. Metadata-only (every change bumps it); fork pods are the fork Deployment's.
        .watches_stream(wakes.pods, move |pod| {
            if pod.labels().contains_key(spur_api::keys::labels::FORK) {
                return Vec::new();
            }
            let ns = pod.namespace().unwrap_or_default();
            objects_where(&by_pod, |fw| fw.spec.baseline.namespace == ns)
        });
    spur_controller::run(
        "forkedworkload",
        forks,
        forked::reconcile,
        forked::error_policy,
        term,
        stop,
    )
    .await;
}

/// VirtualWorkloads: their baseline Deployment and its pods (metadata only) decide status.
pub async fn virtuals(client: Client, ctx: Arc<WorkloadsContext>, stop: CancellationToken) {
    let wc = watcher::Config::default;
    let vw = primary(Api::<VirtualWorkload>::all(client.clone())).with_config(config());
    let (vw_by_baseline, vw_by_rollout, vw_by_pod) = (vw.store(), vw.store(), vw.store());
    let virtuals = vw
        .watches(
            Api::<PartialObjectMeta<Deployment>>::all(client.clone()),
            wc(),
            move |d| {
                objects_where(&vw_by_baseline, |vw| {
                    is_baseline(&vw.spec.baseline, WorkloadKind::Deployment, &d)
                })
            },
        )
        .watches_stream_with(
            rollouts(&client, "virtualworkload"),
            move |r| {
                objects_where(&vw_by_rollout, |vw| {
                    is_baseline(&vw.spec.baseline, WorkloadKind::Rollout, &r)
                })
            },
            crate::baseline::rollout_resource(),
        )
        .watches(
            Api::<PartialObjectMeta<Pod>>::all(client),
            wc(),
            move |pod| {
                if pod.labels().contains_key(spur_api::keys::labels::FORK) {
                    return Vec::new();
                }
                let ns = pod.namespace().unwrap_or_default();
                objects_where(&vw_by_pod, |vw| vw.spec.baseline.namespace == ns)
            },
        );
    spur_controller::run(
        "virtualworkload",
        virtuals,
        virtualw::reconcile,
        virtualw::error_policy,
        ctx,
        stop,
    )
    .await;
}

/// ExternalWorkloads, woken by their Service and EndpointSlice, their workstation's tunnel,
/// their baseline Deployment and the baseline namespace's Services.
pub async fn externals(
    client: Client,
    term: Arc<Term>,
    leases: Changes<Lease>,
    slices: Changes<EndpointSlice>,
    stop: CancellationToken,
) {
    let wc = watcher::Config::default;
    let ew = primary(Api::<ExternalWorkload>::all(client.clone())).with_config(config());
    let (ew_by_baseline, ew_by_rollout, ew_by_namespace, ew_by_workstation) =
        (ew.store(), ew.store(), ew.store(), ew.store());
    let externals = ew
        .owns(Api::<Service>::all(client.clone()), managed())
        .owns_stream(slices)
        // A tunnel coming, renewing, moving or going changes endpoints and health.
        .watches_stream(leases, move |lease| {
            let ws = lease
                .labels()
                .get(spur_api::tunnel::WORKSTATION_LABEL)
                .cloned()
                .unwrap_or_default();
            objects_where(&ew_by_workstation, |ew| ew.spec.workstation == ws)
        })
        .watches(
            Api::<PartialObjectMeta<Deployment>>::all(client.clone()),
            wc(),
            move |d| {
                objects_where(&ew_by_baseline, |ew| {
                    is_baseline(&ew.spec.baseline, WorkloadKind::Deployment, &d)
                })
            },
        )
        .watches_stream_with(
            rollouts(&client, "externalworkload"),
            move |r| {
                objects_where(&ew_by_rollout, |ew| {
                    is_baseline(&ew.spec.baseline, WorkloadKind::Rollout, &r)
                })
            },
            crate::baseline::rollout_resource(),
        )
        .watches(
            Api::<PartialObjectMeta<Service>>::all(client),
            wc(),
            move |svc| {
                if is_managed(&svc) {
                    return Vec::new();
                }
                let ns = svc.namespace().unwrap_or_default();
                objects_where(&ew_by_namespace, |ew| ew.spec.baseline.namespace == ns)
            },
        );
    spur_controller::run(
        "externalworkload",
        externals,
        external::reconcile,
        external::error_policy,
        term,
        stop,
    )
    .await;
}

/// RoutingConfigs, woken by the workloads they list and by their mesh routes.
pub async fn routing_configs(
    client: Client,
    term: Arc<Term>,
    forks: Changes<ForkedWorkload>,
    externals: Changes<ExternalWorkload>,
    stop: CancellationToken,
) {
    let wc = watcher::Config::default;
    let mut rc = primary(Api::<RoutingConfig>::all(client.clone())).with_config(config());
    let (rc_store, rc_store_ew) = (rc.store(), rc.store());
    // A mesh route changed or deleted behind the operator's back is restored.
    let mesh = term.mesh.clone().unwrap_or_default();
    if mesh.istio {
        rc = rc.owns(Api::<spur_api::IstioRoute>::all(client.clone()), wc());
    }
    if mesh.gateway_api {
        rc = rc.owns(Api::<spur_api::GatewayAPIRoute>::all(client), wc());
    }
    let configs = rc
        .watches_stream(forks, move |fw| {
            objects_where(&rc_store, |rc| {
                routingconfig::lists(rc, SandboxedKind::ForkedWorkload, &fw)
            })
        })
        .watches_stream(externals, move |ew| {
            objects_where(&rc_store_ew, |rc| {
                routingconfig::lists(rc, SandboxedKind::ExternalWorkload, &ew)
            })
        });
    spur_controller::run(
        "routingconfig",
        configs,
        routingconfig::reconcile,
        routingconfig::error_policy,
        term,
        stop,
    )
    .await;
}

/// RouteGroups, woken by their RoutingConfig and by any Sandbox change that may change which
/// sandboxes a group matches or what it routes to (`triggers::group_member`).
pub async fn groups(
    client: Client,
    term: Arc<Term>,
    sandboxes: Changes<Sandbox>,
    stop: CancellationToken,
) {
    let rg = primary(Api::<RouteGroup>::all(client.clone())).with_config(config());
    let rg_store = rg.store();
    let groups = rg
        .owns(
            Api::<RoutingConfig>::all(client),
            watcher::Config::default(),
        )
        .watches_stream(sandboxes, move |_| objects_where(&rg_store, |_| true));
    spur_controller::run(
        "routegroup",
        groups,
        routegroup::reconcile,
        routegroup::error_policy,
        term,
        stop,
    )
    .await;
}

fn is_managed(obj: &impl ResourceExt) -> bool {
    obj.labels()
        .get(spur_api::keys::labels::MANAGED_BY)
        .map(String::as_str)
        == Some(spur_api::keys::labels::MANAGED_BY_VALUE)
}

/// Only the operator's own Deployments and Services: watching every Deployment of a large
/// cluster would cost memory for nothing.
fn managed() -> watcher::Config {
    watcher::Config::default().labels(&format!(
        "{}={}",
        spur_api::keys::labels::MANAGED_BY,
        spur_api::keys::labels::MANAGED_BY_VALUE
    ))
}
