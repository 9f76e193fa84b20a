//! The workload controllers' context: the operator's shared one, the configuration of the
//! features they use (tunnels, fork policy, previews, mesh modes, resources, enrollment) and,
//! per leader term, the stores of their watches ([`Term`]).

use std::sync::Arc;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::Store;
use spur_api::{ExternalWorkload, ForkedWorkload, RoutingConfig, Sandbox};
use spur_controller::verified::Verified;
use spur_operator_enroll::EnrollConfig;
use spur_operator_mesh::MeshConfig;
use spur_operator_resources::ResourcesContext;

pub(crate) use spur_operator_core::FIELD_MANAGER;
pub(crate) use spur_operator_core::{OWNER, delete_opt, now};

use crate::{ForkPolicy, TunnelConfig};

#[derive(Clone)]
pub struct WorkloadsContext {
    /// What every feature shares; the fields below are the workloads' own.
    pub core: Arc<spur_operator_core::Context>,
    /// Where workstation tunnels report themselves, and when dead ones are collected.
    pub tunnels: TunnelConfig,
    /// What a fork patch may change.
    pub fork_policy: ForkPolicy,
    /// Where preview URLs live, when a hub serves this cluster.
    pub previews: Option<Previews>,
    /// Sandbox resources (`spur_operator_resources`): their controllers' context, and the
    /// Sandbox controller's when it makes and deletes a sandbox's resources.
    pub res: Arc<ResourcesContext>,
    /// Mesh modes (docs/mesh.md). `None`: none is enabled.
    pub mesh: Option<MeshConfig>,
    /// Namespace enrollment: the RoleBindings made in namespaces labelled
    /// `spur.dev/enabled=true` (`spur_operator_enroll`). `None`: the enroller does not run.
    pub enrollment: Option<EnrollConfig>,
    /// Whether the injection config's `kafkaPorts` is non-empty: a fork's sidecar relays Kafka
    /// by default (its pod template's `sidecar.spur.dev/kafka-ports` says otherwise). Only
    /// forks that relay Kafka get route-history spans (docs/async.md).
    pub kafka_by_default: bool,
}

impl WorkloadsContext {
    /// The workloads of `core` with every feature at its default (none enabled).
    pub fn new(core: Arc<spur_operator_core::Context>) -> Self {
        WorkloadsContext {
            res: Arc::new(ResourcesContext {
                core: core.clone(),
                resources: None,
            }),
            core,
            tunnels: TunnelConfig::default(),
            fork_policy: ForkPolicy::default(),
            previews: None,
            mesh: None,
            enrollment: None,
            kafka_by_default: false,
        }
    }
}

spur_operator_core::feature_context!(WorkloadsContext);

/// The hub's preview domain and this cluster's name there (docs/hub.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Previews {
    pub domain: String,
    /// Qualifies URLs when the hub serves several clusters.
    pub cluster: Option<String>,
}

impl Previews {
    /// The status entries of `endpoints` of `owner`.
    pub fn urls(
        &self,
        owner: &str,
        endpoints: &[spur_api::sandbox::Endpoint],
    ) -> Vec<spur_api::sandbox::EndpointStatus> {
        endpoints
            .iter()
            .map(|e| spur_api::sandbox::EndpointStatus {
                name: e.name.clone(),
                url: spur_api::sandbox::preview_url(
                    &self.domain,
                    &e.name,
                    owner,
                    self.cluster.as_deref(),
                ),
            })
            .collect()
    }
}

/// Children as the watches that wake their owners' controllers last saw them (each store is
/// updated before the event that wakes a pass), for [`OWNER`]'s `ensure`.
#[derive(Clone)]
pub struct Stores {
    pub forks: Store<ForkedWorkload>,
    pub externals: Store<ExternalWorkload>,
    pub configs: Store<RoutingConfig>,
    /// The RoutingConfig controller's own views of the workloads it routes.
    pub rc_forks: Store<ForkedWorkload>,
    pub rc_externals: Store<ExternalWorkload>,
    /// The operator's own (managed) Deployments and Services.
    pub deployments: Store<Deployment>,
    pub services: Store<Service>,
    /// The Services the ListenerSet controller made (labelled `spur.dev/listener-set`).
    pub listener_services: Store<Service>,
    /// Every Sandbox, as the RouteGroup controller matches them.
    pub sandboxes: Store<Sandbox>,
    /// Workstation tunnel Leases (in the tunnel namespace), as ExternalWorkloads read them.
    pub leases: Store<Lease>,
    /// The operator's own EndpointSlices, as the ExternalWorkload controller prunes them (its
    /// Services it finds in `services`).
    pub external_slices: Store<EndpointSlice>,
    /// Whole baseline Deployments, the Services of their namespaces and their pods, read
    /// again only when their metadata shows a change. Filled by the watches that wake the
    /// ForkedWorkload controller, so its passes read them at least as new as what woke them;
    /// the Sandbox controller reads them too (as it reads any store).
    pub baselines: Verified<Deployment>,
    pub namespace_services: Verified<Service>,
    pub pods: Verified<Pod>,
}

/// The context of the controllers of one run (a leader term: a new term has new watches): the
/// [`WorkloadsContext`] and the stores of this run's watches, handed over at construction.
pub struct Term {
    pub ctx: Arc<WorkloadsContext>,
    pub stores: Stores,
}

impl Term {
    /// The baseline `kind` `ns/name`, through the term's stores (`Ok(Err)`: why it cannot be
    /// forked).
    pub(crate) async fn baseline(
        &self,
        kind: spur_api::WorkloadKind,
        ns: &str,
        name: &str,
    ) -> Result<Result<crate::baseline::Baseline, crate::baseline::Failure>, crate::Error> {
        crate::baseline::read(&self.client, Some(&self.stores.baselines), kind, ns, name).await
    }

    /// The Services of `ns` a fork's sandbox Services can be made from (not the operator's own).
    pub(crate) async fn baseline_services(
        &self,
        ns: &str,
    ) -> Result<Arc<Vec<Service>>, crate::Error> {
        let selector = crate::fork::baseline_services();
        Ok(self
            .stores
            .namespace_services
            .list(&self.client, ns, &selector)
            .await?)
    }
}

impl std::ops::Deref for Term {
    type Target = WorkloadsContext;
    fn deref(&self) -> &WorkloadsContext {
        &self.ctx
    }
}

impl spur_controller::HasBackoff for Term {
    fn backoff(&self) -> &spur_controller::Backoff {
        spur_controller::HasBackoff::backoff(&*self.ctx.core)
    }
}
