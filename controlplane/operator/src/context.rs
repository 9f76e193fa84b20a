//! The operator's context: the part every feature shares (`spur_operator_core::Context`: the
//! client, the field manager, the event recorder, metrics and the per-object failure counts
//! behind the error policy's backoff) and each feature's configuration, handed to each
//! feature's controllers by `crate::run`.

use std::sync::Arc;

use kube::Client;
use spur_operator_resources::ResourcesContext;
use spur_operator_workloads::WorkloadsContext;

pub use spur_operator_core::FIELD_MANAGER;

pub struct Context {
    /// What every feature shares; the fields below are the features' own.
    pub(crate) core: Arc<spur_operator_core::Context>,
    /// The certificate manager's configuration; without one, no certificates are managed.
    pub(crate) pki: Option<crate::PkiConfig>,
    /// Just-in-time access controllers (docs/access.md) run.
    pub(crate) access: bool,
    /// The tunnel proxy's token namespace, where tunnel grants write their token Secrets.
    pub(crate) access_tokens: Option<String>,
    /// Automatic smart-test runs (docs/smart-tests.md) run.
    pub(crate) smart_tests: bool,
    /// The traffic store their tests with `calls` capture through.
    pub(crate) smart_test_calls: Option<spur_operator_smarttests::store::StoreConfig>,
    /// The workload controllers' configuration (tunnels, fork policy, previews, resources,
    /// mesh modes, enrollment), which the features they call into read too.
    pub(crate) workloads: WorkloadsContext,
}

impl Context {
    pub fn new(client: Client, instance: Option<String>, metrics: crate::Metrics) -> Self {
        let core = Arc::new(spur_operator_core::Context::new(client, instance, metrics));
        Context {
            workloads: WorkloadsContext::new(core.clone()),
            core,
            pki: None,
            access: false,
            access_tokens: None,
            smart_tests: false,
            smart_test_calls: None,
        }
    }

    /// Where tunnel Leases live (the tunnel proxy's namespace) and when dead ones go.
    pub fn with_tunnels(mut self, tunnels: crate::TunnelConfig) -> Self {
        self.workloads.tunnels = tunnels;
        self
    }

    /// Also run the certificate manager (on the leader, with the controllers).
    pub fn with_pki(mut self, pki: crate::PkiConfig) -> Self {
        self.pki = Some(pki);
        self
    }

    /// Publish preview URLs of endpoints in Sandbox and RouteGroup status.
    pub fn with_previews(mut self, previews: crate::Previews) -> Self {
        self.workloads.previews = Some(previews);
        self
    }

    /// Run sandbox resources' workflows as configured.
    pub fn with_resources(mut self, resources: crate::ResourceConfig) -> Self {
        self.workloads.res = Arc::new(ResourcesContext {
            core: self.core.clone(),
            resources: Some(resources),
        });
        self
    }

    /// Also write routing keys' routes into Istio and/or Gateway API objects (a configuration
    /// with no mode enabled is the same as none).
    pub fn with_mesh(mut self, mesh: crate::MeshConfig) -> Self {
        self.workloads.mesh = mesh.enabled().then_some(mesh);
        self
    }

    /// Runs the automatic smart-test runs' controller (its rights are the chart's
    /// `operator-smarttests-rules.yaml`; the Jobs it creates need the jobs component).
    pub fn with_smart_tests(mut self) -> Self {
        self.smart_tests = true;
        self
    }

    /// Tests with `calls: true` capture their runs through this traffic store (its rights:
    /// `delegate` on `sandboxes/capture`, the chart's `operator-smarttests-rules.yaml`).
    pub fn with_smart_test_calls(
        mut self,
        store: spur_operator_smarttests::store::StoreConfig,
    ) -> Self {
        self.smart_test_calls = Some(store);
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
        self.workloads.enrollment = Some(enrollment);
        self
    }

    /// Forks' sidecars relay Kafka unless their pod template says otherwise (the injection
    /// config's `kafkaPorts` is non-empty), so ready forks get route-history spans by default.
    pub fn with_kafka_by_default(mut self, kafka: bool) -> Self {
        self.workloads.kafka_by_default = kafka;
        self
    }

    /// Fork patches go through `policy` instead of the default one.
    pub fn with_fork_policy(mut self, policy: crate::ForkPolicy) -> Self {
        self.workloads.fork_policy = policy;
        self
    }
}

impl Context {
    /// The part every feature shares: what one feature's controllers run on when run alone
    /// (e.g. `enroll::run`).
    pub fn shared(&self) -> Arc<spur_operator_core::Context> {
        self.core.clone()
    }
}

spur_operator_core::feature_context!(Context);
