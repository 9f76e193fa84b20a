//! Conversions between the Routes API messages (`spur-proto`) and this crate's types (feature
//! `proto`): the wire crate knows no domain type. Incoming rules go through the wire shape
//! ([`RuleSpec`]) so they are validated by the one validator ([`RoutingRule::from_spec`])
//! everything else uses.

use spur_proto::routes;

use crate::RoutingRule;
use crate::rules::{BaselineSpec, LocationSpec, MappingSpec, RuleSpec, SandboxSpec};

/// A received rule in wire shape, ready for validation. Missing sub-messages become empty
/// fields, which validation then rejects with a precise reason.
pub fn rule_from_proto(r: &routes::WorkloadRoutingRule) -> RuleSpec {
    rule_from_proto_owned(r.clone())
}

/// [`rule_from_proto`] for a message the caller is done with: its strings are moved, not copied
/// (a sidecar converts every rule its watch receives).
pub fn rule_from_proto_owned(r: routes::WorkloadRoutingRule) -> RuleSpec {
    let baseline = r.baseline.unwrap_or_default();
    RuleSpec {
        routing_key: r.routing_key,
        baseline: BaselineSpec {
            kind: baseline.kind,
            namespace: baseline.namespace,
            name: baseline.name,
        },
        destination_sandbox: SandboxSpec {
            name: r.destination_sandbox.map(|d| d.name).unwrap_or_default(),
        },
        mappings: r
            .mappings
            .into_iter()
            .map(|m| MappingSpec {
                workload_port: m.workload_port,
                destinations: m
                    .destinations
                    .into_iter()
                    .map(|d| LocationSpec {
                        host: d.host,
                        port: d.port,
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// A validated rule as a complete Routes API message (every sub-message set: the public Go
/// client dereferences them without checking).
pub fn rule_to_proto(r: &RoutingRule) -> routes::WorkloadRoutingRule {
    routes::WorkloadRoutingRule {
        routing_key: r.routing_key.clone(),
        baseline: Some(routes::BaselineWorkload {
            kind: r.baseline.kind.clone(),
            namespace: r.baseline.namespace.clone(),
            name: r.baseline.name.clone(),
        }),
        destination_sandbox: Some(routes::DestinationSandbox {
            name: r.destination_sandbox.clone(),
        }),
        mappings: r
            .mappings
            .iter()
            .map(|m| routes::WorkloadPortMapping {
                workload_port: u32::from(m.workload_port),
                destinations: m
                    .destinations
                    .iter()
                    .map(|d| routes::Location {
                        host: d.host.clone(),
                        port: u32::from(d.port),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// A received route-history span, validated ([`crate::Span::new`]); `until_ms` 0 is "still in
/// force".
pub fn span_from_proto(s: &spur_proto::history::Span) -> Result<crate::Span, crate::Error> {
    crate::Span::new(
        s.routing_key.clone(),
        s.sandbox.clone(),
        s.since_ms,
        (s.until_ms != 0).then_some(s.until_ms),
    )
}

/// A span as sent on the route-history stream.
pub fn span_to_proto(s: &crate::Span) -> spur_proto::history::Span {
    spur_proto::history::Span {
        routing_key: s.routing_key.clone(),
        sandbox: s.sandbox.clone(),
        since_ms: s.since_ms,
        until_ms: s.until_ms.unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_through_validation() {
        let spec = RuleSpec {
            routing_key: "k1".into(),
            baseline: BaselineSpec {
                kind: "Deployment".into(),
                namespace: "ns".into(),
                name: "web".into(),
            },
            destination_sandbox: SandboxSpec { name: "sb".into() },
            mappings: vec![MappingSpec {
                workload_port: 8080,
                destinations: vec![LocationSpec {
                    host: "sb-web.ns.svc".into(),
                    port: 80,
                }],
            }],
        };
        let rule = RoutingRule::from_spec(0, spec.clone()).unwrap();
        let wire = rule_to_proto(&rule);
        assert_eq!(rule_from_proto(&wire), spec);
        assert_eq!(rule_from_proto_owned(wire), spec);
    }

    #[test]
    fn missing_sub_messages_fail_validation() {
        let wire = routes::WorkloadRoutingRule {
            routing_key: "k1".into(),
            ..Default::default()
        };
        assert!(RoutingRule::from_spec(0, rule_from_proto(&wire)).is_err());
        assert_eq!(rule_from_proto_owned(wire.clone()), rule_from_proto(&wire));
    }
}
