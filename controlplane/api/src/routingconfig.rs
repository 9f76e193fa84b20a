//! `RoutingConfig`: the desired routing of one routing key. Its status is what the route server
//! serves: each [`Route`] becomes part of a Routes API rule through [`rule_specs`].

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use spur_routing::rules::{LocationSpec, MappingSpec, RuleSpec, SandboxSpec as RuleSandbox};

use crate::common::{ServiceMapping, WorkloadRef, service_host};
use crate::error::Error;
use crate::validation::*;

/// Most sandboxed workloads behind one routing key (a route group spans several sandboxes).
pub const MAX_ROUTED_WORKLOADS: usize = 1024;

/// Desired state of a routing config.
// Cluster-scoped: a route group's key spans sandboxes and namespaces, and its owner (Sandbox or
// RouteGroup) is cluster-scoped too.
// `printcolumn(...)` repeats its keys by design; clippy takes that for a copy-paste slip.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "RoutingConfig",
    plural = "routingconfigs",
    shortname = "rcfg",
    category = "spur",
    status = "RoutingConfigStatus",
    derive = "PartialEq",
    doc = "The desired routing of one routing key: the sandboxed workloads that requests carrying it should reach. Created by the Sandbox or RouteGroup controller that owns the key; its status lists the resulting routes, which the route server serves as Routes API rules.",
    printcolumn(name = "Key", type_ = "string", json_path = ".spec.routingKey"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct RoutingConfigSpec {
    /// The routing key.
    #[schemars(length(min = 1, max = ROUTING_KEY_MAX), regex(pattern = ROUTING_KEY_PATTERN))]
    pub routing_key: String,
    /// The sandboxed workloads to route the key to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_ROUTED_WORKLOADS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["kind", "namespace", "name"])
    )]
    pub workloads: Vec<SandboxedWorkloadRef>,
}

/// A ForkedWorkload, ExternalWorkload or VirtualWorkload.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxedWorkloadRef {
    /// ForkedWorkload, ExternalWorkload or VirtualWorkload.
    pub kind: SandboxedKind,
    /// Namespace of the object (its baseline's namespace).
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub namespace: String,
    /// Name of the object.
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_MAX), regex(pattern = DNS_SUBDOMAIN_PATTERN))]
    pub name: String,
    /// The sandbox it belongs to (the rules' destination sandbox).
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: String,
}

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum SandboxedKind {
    ForkedWorkload,
    ExternalWorkload,
    VirtualWorkload,
}

/// Observed state of a routing config.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoutingConfigStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// What the route server serves for this key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route_server: Option<RouteServerStatus>,
    /// `Ready` and friends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// The routes exported to the route server.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteServerStatus {
    /// One entry per (baseline Service port, sandbox): the whole set is replaced at once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<Route>,
    /// One entry per routed (baseline, sandbox) whose fork relays Kafka, with or without
    /// Services: since when (and, once the sandbox is being deleted, until when) records for the
    /// baseline that carry the routing key belong to the sandbox (route history, for the Kafka
    /// relays; see docs/async.md). Kept as first written while the route lasts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_ROUTED_WORKLOADS))]
    pub spans: Vec<RouteSpan>,
}

/// Records for `baseline` that carry the routing key and are stamped at or after `sinceMs`
/// (and before `untilMs`, when set) belong to `sandbox` (while this entry lasts).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteSpan {
    /// The baseline workload whose records are routed.
    pub baseline: WorkloadRef,
    /// The sandbox they are routed to.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: String,
    /// Milliseconds since the Unix epoch, set by the operator a grace period after it first
    /// routed the workload, so that every relay has heard of it before a record it applies to
    /// is stamped.
    #[schemars(range(min = 0))]
    pub since_ms: i64,
    /// Milliseconds since the Unix epoch: the end of the route, set by the operator when the
    /// sandbox is being deleted (a grace period ahead, the same for every route server), after
    /// `sinceMs`. Records stamped from then on belong to the baseline; the fork keeps running
    /// a while after it to finish those stamped before (docs/async.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub until_ms: Option<i64>,
}

/// Requests for `baseline` that carry the routing key and arrive on `workloadPort` go to
/// `toHost:toPort`. `fromHost:fromPort` is the baseline Service address clients dial (it feeds
/// the Routes API's `GetClusterServices`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Route {
    /// Baseline Service host, e.g. `route.hotrod.svc`.
    pub from_host: String,
    /// Baseline Service port.
    pub from_port: i32,
    /// Sandbox Service host, e.g. `sb1-route-1a2b3c4d5e.hotrod.svc`.
    pub to_host: String,
    /// Sandbox Service port.
    pub to_port: i32,
    /// Container port of the baseline the Service port resolves to: the port the sidecar sees
    /// the request arrive on.
    pub workload_port: i32,
    /// The sandbox the destination belongs to.
    pub sandbox: String,
    /// The baseline workload whose sidecars apply the route.
    pub baseline: WorkloadRef,
}

impl Route {
    /// The routes for one sandboxed workload: every port of every Service mapping, with both
    /// Services in `namespace`.
    pub fn for_services(
        namespace: &str,
        sandbox: &str,
        baseline: &WorkloadRef,
        services: &[ServiceMapping],
    ) -> Vec<Route> {
        services
            .iter()
            .flat_map(|s| {
                s.ports.iter().map(move |p| Route {
                    from_host: service_host(&s.baseline_service, namespace),
                    from_port: p.port,
                    to_host: service_host(&s.sandbox_service, namespace),
                    to_port: p.port,
                    workload_port: p.target_port,
                    sandbox: sandbox.to_owned(),
                    baseline: baseline.clone(),
                })
            })
            .collect()
    }
}

impl RoutingConfig {
    /// The route-history spans of this config's status.
    pub fn spans(&self) -> &[RouteSpan] {
        self.status
            .as_ref()
            .and_then(|s| s.route_server.as_ref())
            .map_or(&[][..], |r| &r.spans[..])
    }

    /// This config's routes as Routes API rules; see [`rule_specs`].
    pub fn rule_specs(&self) -> Vec<RuleSpec> {
        let routes = self
            .status
            .as_ref()
            .and_then(|s| s.route_server.as_ref())
            .map_or(&[][..], |r| &r.routes[..]);
        rule_specs(&self.spec.routing_key, routes)
    }
}

/// Groups routes into Routes API rules: one rule per (baseline, sandbox), one mapping per
/// workload port, one destination per distinct `toHost:toPort`, all in a stable order. Nothing is
/// checked here: the result goes through `spur_routing::rules::validate_rules` like any other
/// rule set, which rejects bad ports and a baseline routed to two sandboxes for the same key.
pub fn rule_specs(routing_key: &str, routes: &[Route]) -> Vec<RuleSpec> {
    // (baseline, sandbox) → workload port → destinations
    let mut rules: BTreeMap<(&WorkloadRef, &str), BTreeMap<i32, Vec<LocationSpec>>> =
        BTreeMap::new();
    for r in routes {
        let dests = rules
            .entry((&r.baseline, r.sandbox.as_str()))
            .or_default()
            .entry(r.workload_port)
            .or_default();
        let dest = LocationSpec {
            host: r.to_host.clone(),
            // Out-of-range ports become 0, which validation rejects with the rule named.
            port: u32::try_from(r.to_port).unwrap_or(0),
        };
        if !dests.contains(&dest) {
            dests.push(dest);
        }
    }
    rules
        .into_iter()
        .map(|((baseline, sandbox), mappings)| RuleSpec {
            routing_key: routing_key.to_owned(),
            baseline: baseline.to_rule_baseline(),
            destination_sandbox: RuleSandbox {
                name: sandbox.to_owned(),
            },
            mappings: mappings
                .into_iter()
                .map(|(port, destinations)| MappingSpec {
                    workload_port: u32::try_from(port).unwrap_or(0),
                    destinations,
                })
                .collect(),
        })
        .collect()
}

impl RoutingConfigSpec {
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        c.routing_key(|| "spec.routingKey".into(), &self.routing_key);
        c.max_items(
            || "spec.workloads".into(),
            &self.workloads,
            MAX_ROUTED_WORKLOADS,
        );
        let mut seen = std::collections::HashSet::new();
        for (i, w) in self.workloads.iter().enumerate() {
            let path = format!("spec.workloads[{i}]");
            c.dns_label(|| format!("{path}.namespace"), &w.namespace);
            c.dns_subdomain(|| format!("{path}.name"), &w.name);
            c.dns_label(|| format!("{path}.sandbox"), &w.sandbox);
            if !seen.insert((w.kind, &w.namespace, &w.name)) {
                c.fail(path, "listed twice");
            }
        }
        c.finish("RoutingConfig")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::{ServicePort, WorkloadKind};
    use spur_routing::rules::validate_rules;

    fn route_baseline() -> WorkloadRef {
        WorkloadRef::new(WorkloadKind::Deployment, "hotrod", "route")
    }

    #[test]
    fn routes_become_rules_the_route_server_accepts() {
        let services = [
            ServiceMapping {
                baseline_service: "route".into(),
                sandbox_service: "sb1-route-0123456789".into(),
                ports: vec![
                    ServicePort {
                        port: 8083,
                        target_port: 8083,
                    },
                    ServicePort {
                        port: 80,
                        target_port: 8083,
                    },
                ],
            },
            ServiceMapping {
                baseline_service: "route-admin".into(),
                sandbox_service: "sb1-route-admin-0123456789".into(),
                ports: vec![ServicePort {
                    port: 9000,
                    target_port: 9000,
                }],
            },
        ];
        let mut routes = Route::for_services("hotrod", "sb1", &route_baseline(), &services);
        let rollout = WorkloadRef::new(WorkloadKind::Rollout, "hotrod", "driver");
        routes.extend(Route::for_services(
            "hotrod",
            "sb1",
            &rollout,
            &[ServiceMapping {
                baseline_service: "driver".into(),
                sandbox_service: "sb1-driver-0123456789".into(),
                ports: vec![ServicePort {
                    port: 8082,
                    target_port: 8082,
                }],
            }],
        ));
        assert_eq!(routes.len(), 4);
        assert_eq!(routes[1].from_host, "route.hotrod.svc");
        assert_eq!(routes[1].from_port, 80);
        assert_eq!(routes[1].workload_port, 8083);

        let specs = rule_specs("ltj9s8scupb86", &routes);
        assert_eq!(specs.len(), 2);
        let route_rule = specs.iter().find(|r| r.baseline.name == "route").unwrap();
        assert_eq!(route_rule.baseline.kind, "Deployment");
        assert_eq!(route_rule.destination_sandbox.name, "sb1");
        let ports: Vec<u32> = route_rule
            .mappings
            .iter()
            .map(|m| m.workload_port)
            .collect();
        assert_eq!(ports, [8083, 9000]);
        // Service ports 80 and 8083 both reach container port 8083 of the same sandbox Service.
        assert_eq!(route_rule.mappings[0].destinations.len(), 2);
        let driver = specs.iter().find(|r| r.baseline.name == "driver").unwrap();
        assert_eq!(driver.baseline.kind, "ArgoRollout");

        let rules = validate_rules(specs).unwrap();
        assert_eq!(rules.len(), 2);
    }

    #[test]
    fn a_baseline_routed_to_two_sandboxes_is_rejected_downstream() {
        let mut routes = Route::for_services(
            "hotrod",
            "sb1",
            &route_baseline(),
            &[ServiceMapping {
                baseline_service: "route".into(),
                sandbox_service: "sb1-route".into(),
                ports: vec![ServicePort {
                    port: 80,
                    target_port: 8083,
                }],
            }],
        );
        let mut other = routes[0].clone();
        other.sandbox = "sb2".into();
        other.to_host = "sb2-route.hotrod.svc".into();
        routes.push(other);
        let specs = rule_specs("rg-key", &routes);
        assert_eq!(specs.len(), 2);
        assert!(validate_rules(specs).is_err());
    }

    #[test]
    fn bad_ports_surface_as_invalid_rules() {
        let mut routes = Route::for_services(
            "hotrod",
            "sb1",
            &route_baseline(),
            &[ServiceMapping {
                baseline_service: "route".into(),
                sandbox_service: "sb1-route".into(),
                ports: vec![ServicePort {
                    port: 80,
                    target_port: 8083,
                }],
            }],
        );
        routes[0].to_port = -1;
        let err = validate_rules(rule_specs("k", &routes)).unwrap_err();
        assert!(err.to_string().contains("port 0"), "{err}");
    }
}
