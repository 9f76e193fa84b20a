//! Operator metrics, registered into the caller's registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Cert {
    certificate: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Forked {
    namespace: String,
    forked_workload: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Admission {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AccessEvent {
    kind: &'static str,
    event: &'static str,
}

#[derive(Clone, Debug)]
pub struct Metrics {
    reconciles: Family<Kind, Counter>,
    reconcile_seconds: Family<Kind, Histogram>,
    failures: Counter,
    leader: Gauge,
    cert_not_after: Family<Cert, Gauge>,
    cert_issued: Family<Cert, Counter>,
    pki_failures: Counter,
    admissions: Family<Admission, Counter>,
    envoyconfig_admissions: Family<Admission, Counter>,
    listenerset_admissions: Family<Admission, Counter>,
    access_admissions: Family<Admission, Counter>,
    sandbox_admissions: Family<Admission, Counter>,
    access_grants: Family<AccessEvent, Counter>,
    audits: Family<Admission, Counter>,
    tls_errors: Counter,
    serving_cert_loaded: Gauge,
    tunnels_collected: Counter,
    workstation_requests_failed: Counter,
    without_sidecar: Family<Forked, Gauge>,
    sandboxes: crate::SandboxStore,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            reconciles: Family::default(),
            // 1 ms to 8 s: a pass is a few API calls.
            reconcile_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 14))
            }),
            failures: Counter::default(),
            leader: Gauge::default(),
            cert_not_after: Family::default(),
            cert_issued: Family::default(),
            pki_failures: Counter::default(),
            admissions: Family::default(),
            envoyconfig_admissions: Family::default(),
            listenerset_admissions: Family::default(),
            access_admissions: Family::default(),
            sandbox_admissions: Family::default(),
            access_grants: Family::default(),
            audits: Family::default(),
            tls_errors: Counter::default(),
            serving_cert_loaded: Gauge::default(),
            tunnels_collected: Counter::default(),
            workstation_requests_failed: Counter::default(),
            without_sidecar: Family::default(),
            sandboxes: crate::SandboxStore::default(),
        }
    }
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics::default();
        registry.register(
            "reconciles",
            "Reconcile passes, by resource kind",
            m.reconciles.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "How long reconcile passes took, by resource kind",
            m.reconcile_seconds.clone(),
        );
        registry.register(
            "reconcile_failures",
            "Reconcile passes that failed and were retried with backoff",
            m.failures.clone(),
        );
        registry.register(
            "baseline_pods_without_sidecar",
            "Running pods of a forked baseline that have no sidecar: keyed requests reaching them stay on the baseline",
            m.without_sidecar.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the lease and runs the controllers",
            m.leader.clone(),
        );
        registry.register(
            "certificate_expiry_timestamp_seconds",
            "When the current certificate expires (ca, serving, tunnel-proxy, routeserver), Unix time",
            m.cert_not_after.clone(),
        );
        registry.register(
            "workstation_certificate_requests_failed",
            "Approved workstation certificate requests the signer marked Failed (invalid requests)",
            m.workstation_requests_failed.clone(),
        );
        registry.register(
            "certificates_issued",
            "Certificates issued by the certificate manager (ca, serving, tunnel-proxy, routeserver) and the workstation signer (workstation)",
            m.cert_issued.clone(),
        );
        registry.register(
            "pki_failures",
            "Certificate manager passes that failed and were retried",
            m.pki_failures.clone(),
        );
        registry.register(
            "webhook_admissions",
            "Pod admission reviews answered, by result (injected, skipped, error, invalid)",
            m.admissions.clone(),
        );
        registry.register(
            "webhook_envoyconfig_admissions",
            "EnvoyConfig admission reviews answered, by result (allowed, denied, error, invalid)",
            m.envoyconfig_admissions.clone(),
        );
        registry.register(
            "webhook_listenerset_admissions",
            "ListenerSet admission reviews answered, by result (allowed, denied, invalid)",
            m.listenerset_admissions.clone(),
        );
        registry.register(
            "webhook_access_admissions",
            "Access request admission reviews answered, by result (stamped, ignored, denied, invalid, error)",
            m.access_admissions.clone(),
        );
        registry.register(
            "webhook_sandbox_admissions",
            "Sandbox admission reviews answered (creator stamp and workstation owner check), by result (stamped, unchanged, allowed, denied, invalid, error)",
            m.sandbox_admissions.clone(),
        );
        registry.register(
            "access_grants",
            "Just-in-time access grants, by kind (exec, pod) and event (granted, expired, revoked)",
            m.access_grants.clone(),
        );
        registry.register(
            "webhook_pod_connect_audits",
            "Exec, attach and port-forward connections audited, by result (recorded, event_failed, event_dropped, invalid)",
            m.audits.clone(),
        );
        registry.register(
            "webhook_tls_handshake_errors",
            "TLS handshakes on the webhook port that failed (unknown CA, no certificate yet, ...)",
            m.tls_errors.clone(),
        );
        registry.register(
            "webhook_serving_certificate_loaded",
            "1 once the webhook server holds a serving certificate",
            m.serving_cert_loaded.clone(),
        );
        registry.register(
            "tunnels_collected",
            "Workstation tunnel Leases deleted after going unrenewed for the GC period",
            m.tunnels_collected.clone(),
        );
        registry.register_collector(Box::new(crate::sandbox_metrics::SandboxCollector(
            m.sandboxes.clone(),
        )));
        // The failure series exist at 0 from the start: `increase()` over a series that first
        // appears at 1 sees no increase, and SpurWebhookErrors would miss the first failure.
        for result in ["error", "invalid"] {
            drop(m.admissions.get_or_create(&Admission { result }));
        }
        m
    }

    /// Exports the readiness of the sandboxes in `store` from now on (the Sandbox controller's
    /// store, set when it starts).
    pub fn watch_sandboxes(&self, store: kube::runtime::reflector::Store<spur_api::Sandbox>) {
        self.sandboxes.set(store);
    }

    pub fn tunnel_collected(&self) {
        self.tunnels_collected.inc();
    }

    pub fn cert_expiry(&self, certificate: &'static str, not_after: i64) {
        self.cert_not_after
            .get_or_create(&Cert { certificate })
            .set(not_after);
    }

    pub fn workstation_request_failed(&self) {
        self.workstation_requests_failed.inc();
    }

    pub fn cert_issued(&self, certificate: &'static str) {
        self.cert_issued.get_or_create(&Cert { certificate }).inc();
    }

    pub fn pods_without_sidecar(&self, namespace: &str, forked_workload: &str, n: usize) {
        self.without_sidecar
            .get_or_create(&Forked {
                namespace: namespace.into(),
                forked_workload: forked_workload.into(),
            })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A ForkedWorkload is gone: its series goes too.
    pub fn forget_forked(&self, namespace: &str, forked_workload: &str) {
        self.without_sidecar.remove(&Forked {
            namespace: namespace.into(),
            forked_workload: forked_workload.into(),
        });
    }

    pub fn pki_failure(&self) {
        self.pki_failures.inc();
    }

    pub fn admission(&self, result: &'static str) {
        self.admissions.get_or_create(&Admission { result }).inc();
    }

    pub fn access_admission(&self, result: &'static str) {
        self.access_admissions
            .get_or_create(&Admission { result })
            .inc();
    }

    pub fn sandbox_admission(&self, result: &'static str) {
        self.sandbox_admissions
            .get_or_create(&Admission { result })
            .inc();
    }

    pub fn audit(&self, result: &'static str) {
        self.audits.get_or_create(&Admission { result }).inc();
    }

    pub fn access_grant(&self, kind: &'static str, event: &'static str) {
        self.access_grants
            .get_or_create(&AccessEvent { kind, event })
            .inc();
    }

    pub fn listenerset_admission(&self, result: &'static str) {
        self.listenerset_admissions
            .get_or_create(&Admission { result })
            .inc();
    }

    pub fn envoyconfig_admission(&self, result: &'static str) {
        self.envoyconfig_admissions
            .get_or_create(&Admission { result })
            .inc();
    }

    pub fn tls_error(&self) {
        self.tls_errors.inc();
    }

    pub fn serving_cert_loaded(&self, loaded: bool) {
        self.serving_cert_loaded.set(i64::from(loaded));
    }

    /// Without the lease, the series only the leader's controllers and certificate manager
    /// keep go: a former leader would otherwise export its last view for good (and alerts
    /// such as SpurSandboxNotReady would read a frozen sandbox ageing on it).
    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
        if !leading {
            self.sandboxes.clear();
            self.cert_not_after.clear();
            self.without_sidecar.clear();
        }
    }

    /// Counts a reconcile pass of `kind`; its duration is recorded when the guard drops, so
    /// failed and cancelled passes are timed too.
    pub fn reconcile(&self, kind: &'static str) -> ReconcileTimer<'_> {
        self.reconciles.get_or_create(&Kind { kind }).inc();
        ReconcileTimer {
            metrics: self,
            kind,
            started: std::time::Instant::now(),
        }
    }

    pub fn failure(&self) {
        self.failures.inc();
    }
}

/// See [`Metrics::reconcile`].
pub struct ReconcileTimer<'a> {
    metrics: &'a Metrics,
    kind: &'static str,
    started: std::time::Instant,
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        self.metrics
            .reconcile_seconds
            .get_or_create(&Kind { kind: self.kind })
            .observe(self.started.elapsed().as_secs_f64());
    }
}
