//! The operator's context: the part every feature shares (`spur_operator_core::Context`: the
//! client, the field manager, the event recorder, metrics and the per-object failure counts
//! behind the error policy's backoff) and each feature's configuration.

use std::sync::Arc;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::Client;
use kube::runtime::reflector::Store;

use spur_api::{ExternalWorkload, ForkedWorkload, RoutingConfig};

pub use spur_operator_core::FIELD_MANAGER;
pub(crate) use spur_operator_core::{OWNER, delete_opt, now};

pub struct Context {
    /// What every feature shares; the fields below are the features' own.
    pub(crate) core: Arc<spur_operator_core::Context>,
    /// The certificate manager's configuration; without one, no certificates are managed.
    pub(crate) pki: Option<crate::PkiConfig>,
    /// Where workstation tunnels report themselves, and when dead ones are collected.
    pub(crate) tunnels: crate::TunnelConfig,
    /// What a fork patch may change.
    pub(crate) fork_policy: crate::ForkPolicy,
    /// Where preview URLs live, when a hub serves this cluster.
    pub(crate) previews: Option<Previews>,
    /// Sandbox resources (`spur_operator_resources`): their controllers' context, and the
    /// Sandbox controller's when it makes and deletes a sandbox's resources.
    pub(crate) res: Arc<spur_operator_resources::ResourcesContext>,
    /// Mesh modes (docs/mesh.md). `None`: none is enabled.
    pub(crate) mesh: Option<crate::MeshConfig>,
    /// Just-in-time access controllers (docs/access.md) run.
    pub(crate) access: bool,
    /// The tunnel proxy's token namespace, where tunnel grants write their token Secrets.
    pub(crate) access_tokens: Option<String>,
    /// Namespace enrollment: the RoleBindings made in namespaces labelled
    /// `spur.dev/enabled=true` (`crate::enroll`). `None`: the enroller does not run.
    pub(crate) enrollment: Option<crate::enroll::EnrollConfig>,
}

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
pub(crate) struct Stores {
    pub(crate) forks: Store<ForkedWorkload>,
    pub(crate) externals: Store<ExternalWorkload>,
    pub(crate) configs: Store<RoutingConfig>,
    /// The RoutingConfig controller's own views of the workloads it routes.
    pub(crate) rc_forks: Store<ForkedWorkload>,
    pub(crate) rc_externals: Store<ExternalWorkload>,
    /// The operator's own (managed) Deployments and Services.
    pub(crate) deployments: Store<Deployment>,
    pub(crate) services: Store<Service>,
    /// The Services the ListenerSet controller made (labelled `spur.dev/listener-set`).
    pub(crate) listener_services: Store<Service>,
}

/// The context of the controllers of one run (a leader term: a new term has new watches): the
/// operator's [`Context`] and the stores of this run's watches, handed over at construction.
pub(crate) struct Term {
    pub(crate) ctx: Arc<Context>,
    pub(crate) stores: Stores,
}

impl std::ops::Deref for Term {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.ctx
    }
}

impl spur_controller::HasBackoff for Term {
    fn backoff(&self) -> &spur_controller::Backoff {
        spur_controller::HasBackoff::backoff(&*self.ctx.core)
    }
}

impl Context {
    pub fn new(client: Client, instance: Option<String>, metrics: crate::Metrics) -> Self {
        let core = Arc::new(spur_operator_core::Context::new(client, instance, metrics));
        Context {
            res: Arc::new(spur_operator_resources::ResourcesContext {
                core: core.clone(),
                resources: None,
            }),
            core,
            pki: None,
            tunnels: crate::TunnelConfig::default(),
            fork_policy: crate::ForkPolicy::default(),
            previews: None,
            mesh: None,
            access: false,
            access_tokens: None,
            enrollment: None,
        }
    }

    /// Where tunnel Leases live (the tunnel proxy's namespace) and when dead ones go.
    pub fn with_tunnels(mut self, tunnels: crate::TunnelConfig) -> Self {
        self.tunnels = tunnels;
        self
    }

    /// Also run the certificate manager (on the leader, with the controllers).
    pub fn with_pki(mut self, pki: crate::PkiConfig) -> Self {
        self.pki = Some(pki);
        self
    }

    /// Publish preview URLs of endpoints in Sandbox and RouteGroup status.
    pub fn with_previews(mut self, previews: Previews) -> Self {
        self.previews = Some(previews);
        self
    }

    /// Run sandbox resources' workflows as configured.
    pub fn with_resources(mut self, resources: crate::ResourceConfig) -> Self {
        self.res = Arc::new(spur_operator_resources::ResourcesContext {
            core: self.core.clone(),
            resources: Some(resources),
        });
        self
    }

    /// Also write routing keys' routes into Istio and/or Gateway API objects (a configuration
    /// with no mode enabled is the same as none).
    pub fn with_mesh(mut self, mesh: crate::MeshConfig) -> Self {
        self.mesh = mesh.enabled().then_some(mesh);
        self
    }

    /// Runs the just-in-time access controllers (their rights are the chart's
    /// `operator-access-rules.yaml`).
    pub fn with_access(mut self) -> Self {
        self.access = true;
        self
    }

    /// Tunnel grants write their token Secrets into `namespace` (the tunnel proxy's token
    /// namespace; rights: the chart's `operator-access-token-rules.yaml` there).
    pub fn with_access_tokens(mut self, namespace: impl Into<String>) -> Self {
        self.access_tokens = Some(namespace.into());
        self
    }

    /// Also run the namespace enroller (on the leader, with the controllers).
    pub fn with_enrollment(mut self, enrollment: crate::enroll::EnrollConfig) -> Self {
        self.enrollment = Some(enrollment);
        self
    }

    /// Fork patches go through `policy` instead of the default one.
    pub fn with_fork_policy(mut self, policy: crate::ForkPolicy) -> Self {
        self.fork_policy = policy;
        self
    }
}

impl std::ops::Deref for Context {
    type Target = spur_operator_core::Context;
    fn deref(&self) -> &spur_operator_core::Context {
        &self.core
    }
}

impl spur_controller::HasBackoff for Context {
    fn backoff(&self) -> &spur_controller::Backoff {
        spur_controller::HasBackoff::backoff(&*self.core)
    }
}
