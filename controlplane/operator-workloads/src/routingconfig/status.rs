//! A RoutingConfig's routes and status from the workloads it lists, as pure functions.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::Resource;
use spur_api::conditions::{ConditionStatus, READY, is_condition_true, set_now};
use spur_api::keys::{annotations, injection};
use spur_api::routingconfig::{RouteServerStatus, RouteSpan, SandboxedWorkloadRef};
use spur_api::{
    ExternalWorkload, ForkedWorkload, Route, RoutingConfig, RoutingConfigStatus, ServiceMapping,
    WorkloadRef,
};

/// How far after the operator first routes a workload its records are routed
/// ([`RouteSpan::since_ms`]): the route servers stamp their own changes 2 s ahead and promise
/// relays that every change before their clock plus 2 s is known, so a span may take up to the
/// difference (3 s, clock skew included) to reach a route server (docs/async.md).
pub(crate) const SPAN_GRACE_MS: i64 = 5_000;

/// The end of a deleted sandbox's routes, from its RoutingConfig's annotation
/// `spur.dev/routes-end-ms` (written once by the Sandbox controller); `None` if absent or not a
/// number.
pub(crate) fn routes_end_ms(annotations: &BTreeMap<String, String>) -> Option<i64> {
    (annotations.get(annotations::ROUTES_END_MS)).and_then(|v| v.trim().parse().ok())
}

/// Whether a fork's pods relay Kafka (so that its records are routed and it gets a span), from
/// its pod template's annotations (`None`: the fork's Deployment is not known) as the injection
/// webhook reads them: `sidecar.spur.dev/kafka-ports` set to ports relays, `none` does not, and
/// without it (or empty) the cluster's `kafkaPorts` decides (`by_default`: it is non-empty).
pub(super) fn relays_kafka(
    template_annotations: Option<&BTreeMap<String, String>>,
    by_default: bool,
) -> bool {
    match template_annotations.map(injection::kafka_ports) {
        Some(injection::KafkaPorts::Off) => false,
        None | Some(injection::KafkaPorts::Default) => by_default,
        Some(injection::KafkaPorts::Listed(_)) => true,
    }
}

/// Whether a fork is ready (and so routed).
pub(super) fn is_ready(fw: Option<&ForkedWorkload>) -> bool {
    fw.and_then(|fw| fw.status.as_ref())
        .is_some_and(|st| is_condition_true(&st.conditions, READY))
}

/// A listed workload as read (`None`: not found).
pub(super) enum Read {
    /// With whether its pods relay Kafka ([`relays_kafka`]).
    Forked(Option<Arc<ForkedWorkload>>, bool),
    External(Option<Arc<ExternalWorkload>>),
    /// A virtual workload has no route: its key stays on the baseline, whose sidecars handle
    /// it (the Sandbox reports whether they can). Nothing is read.
    Virtual,
}

/// What the ready workloads route, and which are not routed yet.
#[derive(Debug, Default)]
pub(super) struct Routing<'a> {
    /// Sorted, without duplicates.
    pub(super) routes: Vec<Route>,
    /// The ready workloads with their Service mappings (what mesh routes follow).
    pub(super) targets: Vec<(&'a SandboxedWorkloadRef, Vec<ServiceMapping>)>,
    /// The workloads waited for, each with why.
    pub(super) waiting: Vec<String>,
    /// Every ready fork's (baseline, sandbox) whose pods relay Kafka, with or without Services:
    /// what records are routed by (a fork without a relay consumes nothing by key, and its
    /// sandbox's deletion waits for no span). Sorted, without duplicates.
    pub(super) routed: Vec<(WorkloadRef, String)>,
}

/// The routes of the workloads `rc` lists (`reads`, in the same order). A workload contributes
/// only once it is ready, so keyed traffic never reaches a fork that cannot answer yet. A ready
/// workload without Services (a consumer that serves nothing) has no request route, only its
/// records are routed.
pub(super) fn routing<'a>(rc: &'a RoutingConfig, reads: &[Read]) -> Routing<'a> {
    let mut out = Routing::default();
    for (w, read) in rc.spec.workloads.iter().zip(reads) {
        let id = format!("{:?} {}/{}", w.kind, w.namespace, w.name);
        let (baseline, st, not_ready, fork) = match read {
            Read::Forked(Some(fw), kafka) => {
                let st = fw.status.clone().unwrap_or_default();
                (
                    &fw.spec.baseline,
                    (st.conditions, st.services),
                    "not ready",
                    *kafka,
                )
            }
            // Routed only while the workstation's tunnel is up: otherwise keyed traffic falls
            // back to the baseline instead of timing out.
            Read::External(Some(ew)) => {
                let st = ew.status.clone().unwrap_or_default();
                let why = "tunnel not connected";
                (&ew.spec.baseline, (st.conditions, st.services), why, false)
            }
            Read::Forked(None, _) | Read::External(None) => {
                out.waiting.push(format!("{id} (not found)"));
                continue;
            }
            Read::Virtual => continue,
        };
        let (conditions, services) = st;
        if !is_condition_true(&conditions, READY) {
            out.waiting.push(format!("{id} ({not_ready})"));
            continue;
        }
        // Records go to forks that relay Kafka only: a local workload's app reads its broker
        // from the workstation, with no relay to give it its records (the baseline keeps them).
        if fork {
            out.routed.push((baseline.clone(), w.sandbox.clone()));
        }
        if services.is_empty() {
            continue;
        }
        (out.routes).extend(Route::for_services(
            &w.namespace,
            &w.sandbox,
            baseline,
            &services,
        ));
        out.targets.push((w, services));
    }
    out.routes.sort();
    out.routes.dedup();
    out.routed.sort();
    out.routed.dedup();
    out
}

/// The route-history spans of the `routed` (baseline, sandbox) pairs: each keeps the `since` of
/// its entry in `old`, and a new one starts [`SPAN_GRACE_MS`] after `now_ms`. Once the sandbox
/// is being deleted (`end_ms`, [`routes_end_ms`]) each ends there (or where its entry in `old`
/// already ends), and one that would not start before its end is left out.
pub(super) fn spans(
    old: &[RouteSpan],
    routed: &[(WorkloadRef, String)],
    now_ms: i64,
    end_ms: Option<i64>,
) -> Vec<RouteSpan> {
    routed
        .iter()
        .filter_map(|(baseline, sandbox)| {
            let old = (old.iter()).find(|s| s.baseline == *baseline && s.sandbox == *sandbox);
            let since_ms = old.map_or(now_ms.saturating_add(SPAN_GRACE_MS), |s| s.since_ms);
            let until_ms = old.and_then(|s| s.until_ms).or(end_ms);
            if until_ms.is_some_and(|u| u <= since_ms) {
                return None;
            }
            Some(RouteSpan {
                baseline: baseline.clone(),
                sandbox: sandbox.clone(),
                since_ms,
                until_ms,
            })
        })
        .collect()
}

/// The status of `rc` (its current one `old`): the `routes` to publish, Ready once every
/// workload is routed, or why not (`invalid`: the spec's error; `waiting`: as [`Routing`]).
pub(super) fn status(
    rc: &RoutingConfig,
    old: &RoutingConfigStatus,
    invalid: Option<&str>,
    routes: Vec<Route>,
    spans: Vec<RouteSpan>,
    waiting: &[String],
) -> RoutingConfigStatus {
    let (status, reason, message) = match (invalid, waiting.is_empty()) {
        (Some(e), _) => (ConditionStatus::False, "Invalid", e.to_owned()),
        (None, true) => (
            ConditionStatus::True,
            "Routed",
            format!("{} route(s) published", routes.len()),
        ),
        (None, false) => (
            ConditionStatus::False,
            "WorkloadsNotReady",
            format!("waiting for {}", waiting.join(", ")),
        ),
    };
    let mut st = RoutingConfigStatus {
        observed_generation: rc.meta().generation,
        route_server: Some(RouteServerStatus { routes, spans }),
        conditions: old.conditions.clone(),
    };
    set_now(
        &mut st.conditions,
        rc.meta().generation,
        READY,
        status,
        reason,
        &message,
    );
    st
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;
    use spur_api::conditions::find_condition;

    use super::*;

    fn rc() -> RoutingConfig {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "RoutingConfig",
            "metadata": {"name": "sandbox-sb", "generation": 5},
            "spec": {"routingKey": "k1", "workloads": [
                {"kind": "ForkedWorkload", "namespace": "shop", "name": "sb-api", "sandbox": "sb"},
                {"kind": "ExternalWorkload", "namespace": "shop", "name": "sb-web", "sandbox": "sb"},
                {"kind": "VirtualWorkload", "namespace": "shop", "name": "sb-db", "sandbox": "sb"}
            ]}
        }))
        .unwrap()
    }

    /// A workload status: Ready as given, with one Service mapping of `svc` (port 80).
    fn status_of(ready: bool, svc: &str) -> serde_json::Value {
        json!({
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
                            "reason": "R", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
            "services": [{"baselineService": svc, "sandboxService": format!("sb-{svc}"),
                          "ports": [{"port": 80, "targetPort": 8080}]}]
        })
    }

    fn forked(ready: bool) -> Read {
        forked_kafka(ready, true)
    }

    fn forked_kafka(ready: bool, kafka: bool) -> Read {
        Read::Forked(Some(Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "ForkedWorkload",
                "metadata": {"name": "sb-api", "namespace": "shop"},
                "spec": {"sandbox": "sb", "routingKey": "k1",
                         "baseline": {"kind": "Deployment", "namespace": "shop", "name": "api"}},
                "status": status_of(ready, "api")
            }))
            .unwrap(),
        )), kafka)
    }

    fn external(ready: bool) -> Read {
        Read::External(Some(Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "ExternalWorkload",
                "metadata": {"name": "sb-web", "namespace": "shop"},
                "spec": {"sandbox": "sb", "routingKey": "k1", "name": "web", "workstation": "alice",
                         "baseline": {"kind": "Deployment", "namespace": "shop", "name": "web"},
                         "mappings": [{"port": 8080, "toLocal": "localhost:3000"}]},
                "status": status_of(ready, "web")
            }))
            .unwrap(),
        )))
    }

    fn ready(st: &RoutingConfigStatus) -> (&str, &str, &str) {
        let c = find_condition(&st.conditions, READY).unwrap();
        (&c.status, &c.reason, &c.message)
    }

    #[test]
    fn ready_workloads_are_routed_and_virtual_ones_need_no_route() {
        let rc = rc();
        let r = routing(&rc, &[forked(true), external(true), Read::Virtual]);
        assert!(r.waiting.is_empty());
        let hosts: Vec<&str> = r.routes.iter().map(|r| r.to_host.as_str()).collect();
        assert_eq!(hosts, vec!["sb-api.shop.svc", "sb-web.shop.svc"]);
        let targets: Vec<&str> = r.targets.iter().map(|(w, _)| w.name.as_str()).collect();
        assert_eq!(targets, vec!["sb-api", "sb-web"]);
        let st = status(
            &rc,
            &RoutingConfigStatus::default(),
            None,
            r.routes,
            Vec::new(),
            &r.waiting,
        );
        assert_eq!(ready(&st), ("True", "Routed", "2 route(s) published"));
        assert_eq!(st.observed_generation, Some(5));
        assert_eq!(st.route_server.unwrap().routes.len(), 2);
    }

    #[test]
    fn unready_or_missing_workloads_are_waited_for_and_not_routed() {
        let rc = rc();
        let r = routing(&rc, &[forked(false), external(false), Read::Virtual]);
        assert!(r.routes.is_empty() && r.targets.is_empty());
        assert_eq!(
            r.waiting,
            vec![
                "ForkedWorkload shop/sb-api (not ready)".to_string(),
                "ExternalWorkload shop/sb-web (tunnel not connected)".to_string()
            ]
        );
        let r = routing(
            &rc,
            &[Read::Forked(None, true), external(true), Read::Virtual],
        );
        assert_eq!(
            r.waiting,
            vec!["ForkedWorkload shop/sb-api (not found)".to_string()]
        );
        assert_eq!(r.routes.len(), 1, "the ready one is routed meanwhile");
        let st = status(
            &rc,
            &RoutingConfigStatus::default(),
            None,
            r.routes,
            Vec::new(),
            &r.waiting,
        );
        assert_eq!(
            ready(&st),
            (
                "False",
                "WorkloadsNotReady",
                "waiting for ForkedWorkload shop/sb-api (not found)"
            )
        );
    }

    #[test]
    fn every_ready_workload_gets_a_span_that_keeps_its_start() {
        let rc = rc();
        // The fork has no Service (a consumer): no request route, but its records are routed,
        // and the config is not waiting for it.
        let mut fw: ForkedWorkload = match forked(true) {
            Read::Forked(Some(fw), _) => (*fw).clone(),
            _ => unreachable!(),
        };
        fw.status.as_mut().unwrap().services.clear();
        let reads = [
            Read::Forked(Some(Arc::new(fw)), true),
            external(true),
            Read::Virtual,
        ];
        let r = routing(&rc, &reads);
        assert!(r.waiting.is_empty(), "{:?}", r.waiting);
        assert_eq!(r.routes.len(), 1, "only the external workload has Services");
        // Records go to the fork only (a local workload has no relay).
        let names: Vec<&str> = r.routed.iter().map(|(b, _)| b.name.as_str()).collect();
        assert_eq!(names, ["api"]);
        let first = spans(&[], &r.routed, 1_000, None);
        assert_eq!(first[0].since_ms, 1_000 + SPAN_GRACE_MS);
        assert_eq!(first[0].sandbox, "sb");
        // Later passes keep the span's start.
        let later = spans(&first, &r.routed, 9_000, None);
        assert_eq!(later, first);
        let st = status(
            &rc,
            &RoutingConfigStatus::default(),
            None,
            r.routes,
            later,
            &r.waiting,
        );
        assert_eq!(st.route_server.unwrap().spans, first);
        // A fork no longer ready loses its span; ready again, it starts anew.
        let r2 = routing(&rc, &[forked(false), external(true), Read::Virtual]);
        assert!(spans(&first, &r2.routed, 9_000, None).is_empty());
        assert_eq!(
            spans(&[], &r.routed, 9_000, None)[0].since_ms,
            9_000 + SPAN_GRACE_MS
        );
    }

    #[test]
    fn only_forks_that_relay_kafka_get_spans() {
        let ann = |v: &str| BTreeMap::from([(injection::KAFKA_PORTS.to_string(), v.to_string())]);
        let none = BTreeMap::new();
        assert!(relays_kafka(Some(&ann("9092")), false));
        assert!(relays_kafka(Some(&ann("9092,9093")), true));
        assert!(!relays_kafka(Some(&ann("none")), true));
        assert!(!relays_kafka(Some(&ann(" none ")), true));
        assert!(
            relays_kafka(Some(&ann("")), true),
            "empty: the cluster decides"
        );
        assert!(!relays_kafka(Some(&ann("")), false));
        assert!(relays_kafka(Some(&none), true));
        assert!(!relays_kafka(Some(&none), false));
        assert!(!relays_kafka(None, false));
        assert!(relays_kafka(None, true));

        // A ready fork without a relay keeps its request routes but gets no span.
        let rc = rc();
        let r = routing(
            &rc,
            &[forked_kafka(true, false), external(true), Read::Virtual],
        );
        assert!(r.waiting.is_empty());
        assert_eq!(r.routes.len(), 2);
        assert!(r.routed.is_empty());
        assert!(spans(&[], &r.routed, 1_000, None).is_empty());
    }

    #[test]
    fn a_deleted_sandboxs_spans_end_at_the_fixed_end() {
        let rc = rc();
        let r = routing(&rc, &[forked(true), external(true), Read::Virtual]);
        let open = spans(&[], &r.routed, 1_000, None);
        assert_eq!(open[0].until_ms, None);
        // The end is written into every span, and kept.
        let ended = spans(&open, &r.routed, 20_000, Some(25_000));
        assert_eq!(ended.len(), 1);
        assert_eq!(
            (ended[0].since_ms, ended[0].until_ms),
            (1_000 + SPAN_GRACE_MS, Some(25_000))
        );
        assert_eq!(spans(&ended, &r.routed, 21_000, Some(25_000)), ended);
        // An end already written stays (should the annotation change or go).
        assert_eq!(spans(&ended, &r.routed, 21_000, Some(30_000)), ended);
        assert_eq!(spans(&ended, &r.routed, 21_000, None), ended);
        // A span that would start at or after the end is left out.
        assert!(spans(&[], &r.routed, 20_000, Some(25_000)).is_empty());
        assert!(spans(&[], &r.routed, 19_000, Some(24_000)).is_empty());
        let late = spans(&[], &r.routed, 19_000, Some(24_001));
        assert_eq!(late[0].until_ms, Some(24_001));

        let anns = |v: &str| BTreeMap::from([(annotations::ROUTES_END_MS.to_string(), v.into())]);
        assert_eq!(routes_end_ms(&anns("1234")), Some(1234));
        assert_eq!(routes_end_ms(&anns("x")), None);
        assert_eq!(routes_end_ms(&BTreeMap::new()), None);
    }

    #[test]
    fn an_invalid_spec_publishes_nothing_and_says_why() {
        let rc = rc();
        let r = routing(&rc, &[]);
        assert!(r.routes.is_empty() && r.waiting.is_empty());
        let st = status(
            &rc,
            &RoutingConfigStatus::default(),
            Some("spec.routingKey: bad"),
            r.routes,
            Vec::new(),
            &r.waiting,
        );
        assert_eq!(ready(&st), ("False", "Invalid", "spec.routingKey: bad"));
        assert_eq!(st.route_server.unwrap().routes, Vec::new());
    }
}
