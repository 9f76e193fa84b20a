//! What every reconciler shares: the client, the field manager, the event recorder, metrics and
//! the per-object failure counts behind the error policy's backoff (kept by the controller
//! kit, `spur_controller`).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, Resource};

use spur_api::{ExternalWorkload, ForkedWorkload, RoutingConfig};

use crate::Error;

/// Field manager of every server-side apply the operator makes (spec and status alike: nothing
/// else writes the fields it owns).
pub const FIELD_MANAGER: &str = "spur-operator";

/// How the operator applies the children it owns (stamped with [`DESIRED`]).
///
/// [`DESIRED`]: spur_api::keys::annotations::DESIRED
pub(crate) const OWNER: spur_controller::Owner = spur_controller::Owner {
    field_manager: FIELD_MANAGER,
    stamp: spur_api::keys::annotations::DESIRED,
};

pub struct Context {
    pub client: Client,
    recorder: Recorder,
    /// Per-object failure counts: counted by the error policies ([`Context::retry`]), reset
    /// by `spur_controller::run` when a pass succeeds.
    backoff: spur_controller::Backoff,
    pub(crate) metrics: crate::metrics::Metrics,
    /// The certificate manager's configuration; without one, no certificates are managed.
    pub(crate) pki: Option<crate::PkiConfig>,
    /// Where workstation tunnels report themselves, and when dead ones are collected.
    pub(crate) tunnels: crate::TunnelConfig,
    /// What a fork patch may change.
    pub(crate) fork_policy: crate::ForkPolicy,
    /// Where preview URLs live, when a hub serves this cluster.
    pub(crate) previews: Option<Previews>,
    /// Sandbox resources: where their steps run. `None`: resources are not enabled.
    pub(crate) resources: Option<crate::ResourceConfig>,
    /// Mesh modes (docs/mesh.md). `None`: none is enabled.
    pub(crate) mesh: Option<crate::MeshConfig>,
    /// Just-in-time access controllers (docs/access.md) run.
    pub(crate) access: bool,
    /// The tunnel proxy's token namespace, where tunnel grants write their token Secrets.
    pub(crate) access_tokens: Option<String>,
    /// Namespace enrollment: the RoleBindings made in namespaces labelled
    /// `spur.dev/enabled=true` (`crate::enroll`). `None`: the enroller does not run.
    pub(crate) enrollment: Option<crate::enroll_config::EnrollConfig>,
    /// Every status write of the operator's controllers (skipping unchanged ones).
    pub(crate) status: spur_controller::StatusWriter,
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
        &self.ctx.backoff
    }
}

impl Context {
    pub fn new(client: Client, instance: Option<String>, metrics: crate::metrics::Metrics) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            backoff: spur_controller::Backoff::default(),
            metrics,
            pki: None,
            tunnels: crate::TunnelConfig::default(),
            fork_policy: crate::ForkPolicy::default(),
            previews: None,
            resources: None,
            mesh: None,
            access: false,
            access_tokens: None,
            enrollment: None,
            status: spur_controller::StatusWriter::new(FIELD_MANAGER),
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
        self.resources = Some(resources);
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
    pub fn with_enrollment(mut self, enrollment: crate::enroll_config::EnrollConfig) -> Self {
        self.enrollment = Some(enrollment);
        self
    }

    /// Fork patches go through `policy` instead of the default one.
    pub fn with_fork_policy(mut self, policy: crate::ForkPolicy) -> Self {
        self.fork_policy = policy;
        self
    }

    /// Publishes an event about `obj`; a failure to publish is logged, never fatal.
    pub async fn event<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let ev = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &obj.object_ref(&())).await {
            tracing::debug!(error = %e, "cannot publish event");
        }
    }

    /// Exponential per-object backoff: 1 s, 2 s, 4 s … capped at 5 min; reset by a success.
    pub(crate) fn retry<K: Resource<DynamicType = ()>>(&self, obj: &K, err: &Error) -> Action {
        Action::requeue(self.retry_delay(obj, err))
    }

    /// The delay [`Context::retry`] would requeue after (counting the failure), for error
    /// policies that cap it.
    pub(crate) fn retry_delay<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        err: &Error,
    ) -> Duration {
        let delay = self.backoff.failed(obj, err);
        self.metrics.failure();
        delay
    }
}

impl spur_controller::HasBackoff for Context {
    fn backoff(&self) -> &spur_controller::Backoff {
        &self.backoff
    }
}

/// Deletes `name` with background propagation. One that is already gone is not an error: a
/// reconcile working from a cache a moment old, or a delete that raced another, wanted exactly
/// that, and failing would only back the object off for nothing.
pub(crate) async fn delete_opt<K>(api: &kube::Api<K>, name: &str) -> Result<(), Error>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    match api
        .delete(name, &kube::api::DeleteParams::background())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

pub(crate) fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}
