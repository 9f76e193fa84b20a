//! A real API server with Spur's CRDs, the operator (under the chart's RBAC, leader-elected,
//! writing only in enrolled namespaces) and the route server (Kubernetes store): the control
//! plane of the apiserver-tier Sandbox tests. There is no kubelet: tests mark what a kubelet
//! and the Deployment controller would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use spur_kube_harness::KubeApi;
use spur_routeserver::{KubeStore, RouteServer, RouteServerConfig};
use tokio_util::sync::CancellationToken;

use super::WAIT;
use kube::Client;

/// A real API server with our CRDs, the operator and the route server (Kubernetes store).
pub struct ControlPlane {
    pub api: KubeApi,
    stop: CancellationToken,
    operator: tokio::task::JoinHandle<()>,
    pub routeserver: Option<RouteServer>,
    /// The operator's metrics.
    registry: prometheus_client::registry::Registry,
}

impl ControlPlane {
    pub async fn start() -> ControlPlane {
        Self::start_with_crds(&[]).await
    }

    /// [`ControlPlane::start`] with further CRDs (YAML) installed before the operator starts, as
    /// a cluster that has them (Argo Rollouts') would be.
    pub async fn start_with_crds(crds: &[&str]) -> ControlPlane {
        super::capture_logs();
        let api = KubeApi::start().await.unwrap();
        super::install_crds(&api).await.unwrap();
        for crd in crds {
            api.install_crd_yaml(crd).await.unwrap();
        }
        // Both components run under the chart's RBAC rules (the operator with its namespace
        // Role, which holds its lease), so a permission the chart lacks fails these tests.
        let operator_client = super::operator_client(&api).await.unwrap();
        let routeserver_client =
            super::chart_client(&api, "spur-routeserver", "routeserver-rules.yaml", None)
                .await
                .unwrap();
        let stop = CancellationToken::new();
        let operator_stop = stop.clone();
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = spur_operator::Metrics::register(&mut registry);
        // Dead workstation tunnels are collected 8 s after they expire (default 10 min).
        let ctx = Arc::new(
            spur_operator::Context::new(operator_client.clone(), Some("test".into()), metrics)
                .with_tunnels(spur_operator::TunnelConfig {
                    namespace: "spur-system".into(),
                    gc_after: Duration::from_secs(8),
                })
                // As the chart runs it: Spur writes only in namespaces that opted in.
                .with_enrollment(super::enroll_config()),
        );
        // Leader-elected, as the chart runs it, on a Lease in spur-system (the chart's Role).
        let election = spur_operator::LeaderElection {
            namespace: "spur-system".into(),
            lease: "spur-operator".into(),
            identity: "test".into(),
            duration_secs: 15,
            grace_secs: 5,
            owner: None,
        };
        let operator = tokio::spawn(async move {
            spur_operator::run_elected(operator_client, ctx, operator_stop, election)
                .await
                .unwrap();
        });
        let routeserver = RouteServer::start_with(
            RouteServerConfig {
                grpc_addr: "127.0.0.1:0".parse().unwrap(),
                http_addr: "127.0.0.1:0".parse().unwrap(),
                ..RouteServerConfig::new("")
            },
            KubeStore::new(routeserver_client),
        )
        .await
        .unwrap();
        ControlPlane {
            api,
            stop,
            operator,
            routeserver: Some(routeserver),
            registry,
        }
    }

    /// Reconcile passes that failed (and were retried with backoff) so far.
    pub fn reconcile_failures(&self) -> f64 {
        self.metric("reconcile_failures_total")
    }

    /// A series of the operator's metrics, named without the binary's `spur_operator_` prefix
    /// (0 when absent).
    pub fn metric(&self, series: &str) -> f64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        crate::sample(&text, series)
    }

    pub fn client(&self) -> Client {
        self.api.client()
    }

    pub fn routeserver_addr(&self) -> String {
        self.routeserver.as_ref().unwrap().grpc_addr.to_string()
    }

    pub async fn shutdown(mut self) {
        self.stop.cancel();
        tokio::time::timeout(WAIT, &mut self.operator)
            .await
            .unwrap()
            .unwrap();
        self.routeserver.take().unwrap().shutdown().await;
    }
}
