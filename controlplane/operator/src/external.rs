//! ExternalWorkload controller: a baseline whose keyed traffic goes to a process on a
//! workstation. For every Service selecting the baseline it keeps a selector-less sandbox
//! Service with the mapped ports, and an EndpointSlice pointing at the tunnel-proxy replica that
//! carries the workstation's reverse tunnel (as its Lease says, `spur_api::tunnel`). Status
//! reports the tunnel's health; the RoutingConfig controller routes the sandbox's key to the
//! sandbox Services only while the tunnel is up.
//!
//! Tunnel Leases that have not been renewed for the configured time are deleted (garbage
//! collection of dead workstation sessions).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Service, ServicePort as K8sServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Api, Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, NewCondition, READY, set_condition};
use spur_api::keys::{annotations, labels};
use spur_api::tunnel::{self, Session};
use spur_api::workloads::{TunnelPort, TunnelStatus};
use spur_api::{
    ExternalWorkload, ExternalWorkloadStatus, ServiceMapping, ServicePort, WorkloadKind, names,
};

use crate::context::{Context, FIELD_MANAGER, delete_opt, now};
use crate::{Error, FINALIZER};

/// Condition: the workstation's tunnel is up.
pub const TUNNEL_CONNECTED: &str = "TunnelConnected";
/// `endpointslice.kubernetes.io/managed-by` of the slices the operator writes.
const SLICE_MANAGER: &str = "spur-operator.spur.dev";
const RESYNC: Duration = Duration::from_secs(300);

/// Where tunnel Leases live and when dead ones go.
#[derive(Debug, Clone)]
pub struct TunnelConfig {
    /// The tunnel proxy's namespace (the chart's release namespace).
    pub namespace: String,
    /// A tunnel not renewed for this long is garbage-collected (its Lease deleted).
    pub gc_after: Duration,
}

impl Default for TunnelConfig {
    fn default() -> Self {
        TunnelConfig {
            namespace: "spur-system".into(),
            gc_after: Duration::from_secs(600),
        }
    }
}

/// What an ExternalWorkload consists of.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub services: Vec<(Service, ServiceMapping, EndpointSlice)>,
    /// The tunnel's proxy port for every mapped port, when the tunnel is up and has them all.
    pub tunnel_ports: Vec<TunnelPort>,
    pub connected: bool,
}

/// Plans the sandbox Services and EndpointSlices of `ew` for its `baseline`, the Services of its
/// namespace, and the tunnel `session` (if any) at time `now`.
pub fn plan(
    ew: &ExternalWorkload,
    baseline: &Deployment,
    services: &[Service],
    session: Option<&Session>,
    now: i64,
) -> Plan {
    let ns = ew.namespace().unwrap_or_default();
    let ew_name = ew.name_any();
    let mapped: BTreeSet<i32> = ew.spec.mappings.iter().map(|m| m.port).collect();
    let session = session.filter(|s| s.workstation == ew.spec.workstation);
    let connected = session.is_some_and(|s| s.is_fresh(now));
    let proxy_ports = session
        .map(|s| s.ports_of(&ns, &ew_name))
        .unwrap_or_default();
    let containers = baseline
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|s| s.containers.clone())
        .unwrap_or_default();
    let mut out = Vec::new();
    for svc in crate::fork::selecting_services(baseline, services) {
        let svc_name = svc.name_any();
        let name = names::sandbox_service_name(&ew.spec.sandbox, &svc_name);
        // Only the ports that reach a mapped container port: keyed traffic on any other port
        // stays with the baseline (the routes cover mapped ports only).
        let ports: Vec<(K8sServicePort, i32)> = svc
            .spec
            .as_ref()
            .and_then(|s| s.ports.clone())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|p| {
                let target = crate::fork::resolve_target_port(&p, &containers)?;
                mapped.contains(&target).then_some((p, target))
            })
            .collect();
        if ports.is_empty() {
            continue;
        }
        let mapping = ServiceMapping {
            baseline_service: svc_name.clone(),
            sandbox_service: name.clone(),
            ports: ports
                .iter()
                .map(|(p, target)| ServicePort {
                    port: p.port,
                    target_port: *target,
                })
                .collect(),
        };
        let mut meta_labels = owned_labels(ew);
        let service = Service {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(ns.clone()),
                labels: Some(meta_labels.clone()),
                annotations: Some(BTreeMap::from([(
                    annotations::BASELINE.to_owned(),
                    format!("Service/{ns}/{svc_name}"),
                )])),
                ..ObjectMeta::default()
            },
            // No selector: the EndpointSlice below says where traffic goes.
            spec: Some(ServiceSpec {
                ports: Some(
                    ports
                        .iter()
                        .map(|(p, _)| K8sServicePort {
                            name: p.name.clone(),
                            port: p.port,
                            protocol: p.protocol.clone(),
                            app_protocol: p.app_protocol.clone(),
                            ..K8sServicePort::default()
                        })
                        .collect(),
                ),
                type_: Some("ClusterIP".into()),
                ..ServiceSpec::default()
            }),
            status: None,
        };
        meta_labels.insert("kubernetes.io/service-name".into(), name.clone());
        meta_labels.insert(
            "endpointslice.kubernetes.io/managed-by".into(),
            SLICE_MANAGER.into(),
        );
        let slice_ports: Vec<EndpointPort> = ports
            .iter()
            .filter_map(|(p, target)| {
                Some(EndpointPort {
                    name: Some(p.name.clone().unwrap_or_default()),
                    port: Some(*proxy_ports.get(target)?),
                    protocol: Some(p.protocol.clone().unwrap_or_else(|| "TCP".into())),
                    app_protocol: p.app_protocol.clone(),
                })
            })
            .collect();
        let complete = slice_ports.len() == ports.len();
        let endpoints = match session {
            Some(s) if connected && complete => vec![Endpoint {
                addresses: vec![s.address.clone()],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                ..Endpoint::default()
            }],
            _ => Vec::new(),
        };
        let address_type = match session.map(|s| s.address.parse::<std::net::IpAddr>()) {
            Some(Ok(std::net::IpAddr::V6(_))) => "IPv6",
            _ => "IPv4",
        };
        let slice = EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(ns.clone()),
                labels: Some(meta_labels),
                ..ObjectMeta::default()
            },
            address_type: address_type.into(),
            endpoints,
            ports: Some(slice_ports),
        };
        out.push((service, mapping, slice));
    }
    let tunnel_ports: Vec<TunnelPort> = ew
        .spec
        .mappings
        .iter()
        .filter_map(|m| {
            Some(TunnelPort {
                port: m.port,
                proxy_port: *proxy_ports.get(&m.port)?,
            })
        })
        .collect();
    let all_ports = tunnel_ports.len() == ew.spec.mappings.len();
    Plan {
        services: out,
        tunnel_ports: if connected && all_ports {
            tunnel_ports
        } else {
            Vec::new()
        },
        connected,
    }
}

fn owned_labels(ew: &ExternalWorkload) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            labels::MANAGED_BY.to_owned(),
            labels::MANAGED_BY_VALUE.to_owned(),
        ),
        (labels::SANDBOX.to_owned(), ew.spec.sandbox.clone()),
        (labels::ROUTING_KEY.to_owned(), ew.spec.routing_key.clone()),
        (labels::EXTERNAL_WORKLOAD.to_owned(), ew.name_any()),
    ])
}

pub(crate) async fn reconcile(
    ew: Arc<ExternalWorkload>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ExternalWorkload");
    let ns = ew.namespace().ok_or_else(|| Error::NoNamespace {
        kind: "ExternalWorkload",
        name: ew.name_any(),
    })?;
    let api: Api<ExternalWorkload> = Api::namespaced(ctx.client.clone(), &ns);
    let action = finalizer(&api, FINALIZER, ew, |event| async {
        match event {
            Event::Apply(ew) => apply(&ew, &ns, &ctx).await,
            Event::Cleanup(ew) => cleanup(&ew, &ns, &ctx).await,
        }
    })
    .await;
    spur_controller::finalized(action)
}

async fn apply(ew: &ExternalWorkload, ns: &str, ctx: &Context) -> Result<Action, Error> {
    let name = ew.name_any();
    let fail = |reason: &'static str, message: String| async move {
        delete_children(&ew.name_any(), ns, ctx).await?;
        write_status(ew, ns, ctx, |st| {
            st.services.clear();
            st.tunnel = None;
            set(
                st,
                ew,
                TUNNEL_CONNECTED,
                ConditionStatus::False,
                reason,
                &message,
            );
            set(st, ew, READY, ConditionStatus::False, reason, &message);
        })
        .await?;
        Ok::<_, Error>(Action::requeue(RESYNC))
    };
    if ew.spec.baseline.kind != WorkloadKind::Deployment {
        return fail(
            "Unsupported",
            format!(
                "a local stand-in for a {} is not supported yet; only Deployments are",
                ew.spec.baseline.kind
            ),
        )
        .await;
    }
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let Some(baseline) = deployments.get_opt(&ew.spec.baseline.name).await? else {
        return fail(
            "BaselineNotFound",
            format!("Deployment {ns}/{} not found", ew.spec.baseline.name),
        )
        .await;
    };
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let all = services
        .list(&crate::fork::baseline_services())
        .await?
        .items;
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &ctx.tunnels.namespace);
    let session = match leases
        .get_opt(&tunnel::lease_name(&ew.spec.workstation))
        .await?
    {
        None => None,
        Some(lease) => match Session::from_lease(&lease) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(workstation = %ew.spec.workstation, error = %e, "unreadable tunnel Lease");
                None
            }
        },
    };
    let now_s = spur_serving::pki::now_unix();
    let plan = plan(ew, &baseline, &all, session.as_ref(), now_s);

    let owner = ew.controller_owner_ref(&()).into_iter().collect::<Vec<_>>();
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), ns);
    let mut wanted = BTreeSet::new();
    let mut mappings = Vec::new();
    for (mut svc, mapping, mut slice) in plan.services {
        let svc_name = svc.name_any();
        svc.metadata.owner_references = Some(owner.clone());
        slice.metadata.owner_references = Some(owner.clone());
        services.patch(&svc_name, &pp, &Patch::Apply(&svc)).await?;
        let mut body = serde_json::to_value(&slice)?;
        body["apiVersion"] = "discovery.k8s.io/v1".into();
        body["kind"] = "EndpointSlice".into();
        slices.patch(&svc_name, &pp, &Patch::Apply(&body)).await?;
        wanted.insert(svc_name);
        mappings.push(mapping);
    }
    prune(&name, ns, ctx, &wanted).await?;

    let ready = plan.connected && !mappings.is_empty() && !plan.tunnel_ports.is_empty();
    let tunnel_status = session.as_ref().map(|s| TunnelStatus {
        connected: plan.connected,
        last_seen: k8s_openapi::jiff::Timestamp::from_second(s.renewed)
            .ok()
            .map(Time),
        last_check: None,
        proxy_pod: Some(s.proxy_pod.clone()),
        ports: plan.tunnel_ports.clone(),
    });
    let workstation = ew.spec.workstation.clone();
    write_status(ew, ns, ctx, |st| {
        st.baseline = Some(spur_api::workloads::BaselineObservation {
            uid: baseline.uid().unwrap_or_default(),
            generation: baseline.meta().generation,
        });
        st.services = mappings;
        st.tunnel = tunnel_status;
        let (status, reason, message) = match (&session, plan.connected) {
            (None, _) => (
                ConditionStatus::False,
                "NoTunnel",
                format!("workstation {workstation} has no tunnel (spur local connect)"),
            ),
            (Some(s), false) => (
                ConditionStatus::False,
                "TunnelDown",
                format!(
                    "the tunnel of workstation {workstation} was last renewed by {} and has expired",
                    s.proxy_pod
                ),
            ),
            (Some(s), true) => (
                ConditionStatus::True,
                "TunnelUp",
                format!("tunnel through {} ({})", s.proxy_pod, s.address),
            ),
        };
        set(st, ew, TUNNEL_CONNECTED, status, reason, &message);
        let (status, reason, message) = if ready {
            (
                ConditionStatus::True,
                "Ready",
                "keyed traffic reaches the workstation".to_string(),
            )
        } else if st.services.is_empty() {
            (
                ConditionStatus::False,
                "NoServices",
                "no Service of the baseline reaches a mapped port".to_string(),
            )
        } else if plan.connected {
            (
                ConditionStatus::False,
                "PortsPending",
                "the tunnel does not forward every mapped port yet".to_string(),
            )
        } else {
            (status, reason, message)
        };
        set(st, ew, READY, status, reason, &message);
    })
    .await?;
    // A live tunnel turns stale unless renewed (a renewal wakes us through the Lease watch).
    let next = match &session {
        Some(s) if plan.connected => Duration::from_secs(
            u64::try_from(s.expires().saturating_sub(now_s))
                .unwrap_or(0)
                .saturating_add(1),
        ),
        _ => RESYNC,
    };
    Ok(Action::requeue(next.min(RESYNC)))
}

async fn prune(
    name: &str,
    ns: &str,
    ctx: &Context,
    wanted: &BTreeSet<String>,
) -> Result<(), Error> {
    let lp = ListParams::default()
        .labels(&format!("{}={name}", labels::EXTERNAL_WORKLOAD))
        .match_any();
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    for stale in services.list(&lp).await?.items {
        let n = stale.name_any();
        if !wanted.contains(&n) {
            delete_opt(&services, &n).await?;
        }
    }
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), ns);
    for stale in slices.list(&lp).await?.items {
        let n = stale.name_any();
        if !wanted.contains(&n) {
            delete_opt(&slices, &n).await?;
        }
    }
    Ok(())
}

/// Deletes every Service and EndpointSlice of the ExternalWorkload; returns whether some remain.
async fn delete_children(name: &str, ns: &str, ctx: &Context) -> Result<bool, Error> {
    let lp = ListParams::default().labels(&format!("{}={name}", labels::EXTERNAL_WORKLOAD));
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), ns);
    for s in services.list(&lp).await?.items {
        delete_opt(&services, &s.name_any()).await?;
    }
    for s in slices.list(&lp).await?.items {
        delete_opt(&slices, &s.name_any()).await?;
    }
    Ok(!services.list(&lp).await?.items.is_empty() || !slices.list(&lp).await?.items.is_empty())
}

async fn cleanup(ew: &ExternalWorkload, ns: &str, ctx: &Context) -> Result<Action, Error> {
    if delete_children(&ew.name_any(), ns, ctx).await? {
        return Err(Error::Pending(format!(
            "the children of ExternalWorkload {ns}/{} to be deleted",
            ew.name_any()
        )));
    }
    Ok(Action::await_change())
}

fn set(
    st: &mut ExternalWorkloadStatus,
    ew: &ExternalWorkload,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    set_condition(
        &mut st.conditions,
        NewCondition {
            type_,
            status,
            reason,
            message,
            observed_generation: ew.meta().generation,
        },
        &now(),
    );
}

async fn write_status(
    ew: &ExternalWorkload,
    ns: &str,
    ctx: &Context,
    update: impl FnOnce(&mut ExternalWorkloadStatus),
) -> Result<bool, Error> {
    let old = ew.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.observed_generation = ew.meta().generation;
    update(&mut st);
    let api: Api<ExternalWorkload> = Api::namespaced(ctx.client.clone(), ns);
    Ok(ctx.status.apply(&api, ew, &old, &st).await?)
}

pub(crate) fn error_policy(ew: Arc<ExternalWorkload>, err: &Error, ctx: Arc<Context>) -> Action {
    if matches!(err, Error::Pending(_)) {
        return Action::requeue(Duration::from_millis(500));
    }
    ctx.retry(&*ew, err)
}

/// Deletes tunnel Leases not renewed for `gc_after`, every so often, until `stop`.
pub(crate) async fn collect_dead_tunnels(
    ctx: Arc<Context>,
    stop: tokio_util::sync::CancellationToken,
) {
    let cfg = ctx.tunnels.clone();
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
    let every = (cfg.gc_after / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let gc_after = i64::try_from(cfg.gc_after.as_secs()).unwrap_or(i64::MAX);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let lp = ListParams::default().labels(tunnel::WORKSTATION_LABEL);
        let list = match leases.list(&lp).await {
            Ok(l) => l.items,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list tunnel Leases");
                continue;
            }
        };
        let now_s = spur_serving::pki::now_unix();
        for lease in list {
            let dead = match Session::from_lease(&lease) {
                Ok(s) => now_s >= s.expires().saturating_add(gc_after),
                // Unreadable and old: judged by its creation time.
                Err(_) => lease
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .is_some_and(|t| now_s >= t.0.as_second().saturating_add(gc_after)),
            };
            if dead {
                let n = lease.name_any();
                match leases.delete(&n, &DeleteParams::default()).await {
                    Ok(_) => {
                        tracing::info!(lease = %n, "dead workstation tunnel garbage-collected");
                        ctx.metrics.tunnel_collected();
                    }
                    Err(e) => {
                        tracing::warn!(lease = %n, error = %e, "cannot delete dead tunnel Lease")
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;
    use spur_api::tunnel::PortAssignment;

    fn ew() -> ExternalWorkload {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ExternalWorkload",
            "metadata": {"name": "sb-api", "namespace": "shop"},
            "spec": {"sandbox": "sb", "routingKey": "k1", "name": "api", "workstation": "alice",
                     "baseline": {"kind": "Deployment", "namespace": "shop", "name": "api"},
                     "mappings": [{"port": 8080, "toLocal": "localhost:3000"}]}
        }))
        .unwrap()
    }

    fn baseline() -> Deployment {
        serde_json::from_value(json!({
            "metadata": {"name": "api", "namespace": "shop"},
            "spec": {"selector": {"matchLabels": {"app": "api"}},
                     "template": {"metadata": {"labels": {"app": "api"}},
                                  "spec": {"containers": [{"name": "api", "image": "api", "ports": [{"name": "http", "containerPort": 8080}, {"name": "admin", "containerPort": 9000}]}]}}}
        }))
        .unwrap()
    }

    fn services() -> Vec<Service> {
        vec![
            serde_json::from_value(json!({
                "metadata": {"name": "api", "namespace": "shop"},
                "spec": {"selector": {"app": "api"}, "ports": [
                    {"name": "http", "port": 80, "targetPort": "http"},
                    {"name": "admin", "port": 9000, "targetPort": 9000}]}
            }))
            .unwrap(),
            serde_json::from_value(json!({
                "metadata": {"name": "other", "namespace": "shop"},
                "spec": {"selector": {"app": "other"}, "ports": [{"port": 80}]}
            }))
            .unwrap(),
        ]
    }

    fn session(renewed: i64) -> Session {
        Session {
            workstation: "alice".into(),
            proxy_pod: "tp-0".into(),
            address: "10.0.0.7".into(),
            ports: vec![PortAssignment {
                namespace: "shop".into(),
                external_workload: "sb-api".into(),
                port: 8080,
                proxy_port: 31001,
            }],
            renewed,
            duration: 10,
            started_micros: 0,
        }
    }

    #[test]
    fn selectorless_services_with_mapped_ports_and_tunnel_endpoints() {
        let p = plan(&ew(), &baseline(), &services(), Some(&session(100)), 105);
        assert!(p.connected);
        assert_eq!(
            p.tunnel_ports,
            vec![TunnelPort {
                port: 8080,
                proxy_port: 31001
            }]
        );
        assert_eq!(
            p.services.len(),
            1,
            "only the Service selecting the baseline"
        );
        let (svc, mapping, slice) = &p.services[0];
        let spec = svc.spec.as_ref().unwrap();
        assert!(spec.selector.is_none());
        let ports = spec.ports.as_ref().unwrap();
        assert_eq!(ports.len(), 1, "the unmapped admin port is left out");
        assert_eq!(
            (ports[0].port, ports[0].name.as_deref()),
            (80, Some("http"))
        );
        assert_eq!(
            mapping.ports,
            vec![ServicePort {
                port: 80,
                target_port: 8080
            }]
        );
        assert_eq!(slice.endpoints[0].addresses, vec!["10.0.0.7".to_string()]);
        let sp = &slice.ports.as_ref().unwrap()[0];
        assert_eq!((sp.name.as_deref(), sp.port), (Some("http"), Some(31001)));
        assert_eq!(
            slice.metadata.labels.as_ref().unwrap()["kubernetes.io/service-name"],
            svc.name_any()
        );
    }

    #[test]
    fn stale_missing_or_foreign_tunnels_leave_no_endpoints() {
        for (s, now) in [
            (Some(session(100)), 110),
            (None, 105),
            (
                Some(Session {
                    workstation: "bob".into(),
                    ..session(100)
                }),
                105,
            ),
        ] {
            let p = plan(&ew(), &baseline(), &services(), s.as_ref(), now);
            assert!(!p.connected);
            assert!(p.tunnel_ports.is_empty());
            assert!(p.services[0].2.endpoints.is_empty());
        }
        // Up, but not forwarding the mapped port yet.
        let mut s = session(100);
        s.ports.clear();
        let p = plan(&ew(), &baseline(), &services(), Some(&s), 105);
        assert!(p.connected && p.tunnel_ports.is_empty());
        assert!(p.services[0].2.endpoints.is_empty());
    }
}
