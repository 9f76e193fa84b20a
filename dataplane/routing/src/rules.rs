//! Routing rules: the wire shape ([`RuleSpec`], camelCase as in the Routes API REST schema) and the
//! validated domain type ([`RoutingRule`]). Conversion happens once, at the edge, through
//! [`validate_rules`]; nothing downstream re-checks.

use std::collections::HashSet;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, RuleRef};
use crate::extract::{MAX_KEY_LEN, is_valid_key};

// === wire shape ===

/// One routing rule as found in rule files and in the Routes API REST schema
/// (`routingRules[]` of `GET /api/v1/workloads/routing-rules`). Snake-case aliases accept the
/// protobuf JSON spelling too.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleSpec {
    #[serde(alias = "routing_key")]
    pub routing_key: String,
    pub baseline: BaselineSpec,
    #[serde(alias = "destination_sandbox")]
    pub destination_sandbox: SandboxSpec,
    #[serde(default)]
    pub mappings: Vec<MappingSpec>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaselineSpec {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    pub name: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MappingSpec {
    #[serde(alias = "workload_port")]
    pub workload_port: u32,
    #[serde(default)]
    pub destinations: Vec<LocationSpec>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocationSpec {
    pub host: String,
    pub port: u32,
}

// === domain types ===

/// The baseline workload a rule applies to (`Deployment`, `ArgoRollout`, …).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BaselineWorkload {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for BaselineWorkload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.kind, self.namespace, self.name)
    }
}

/// A destination address: a DNS name or IP literal and a port.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Location {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Where traffic arriving on one workload port goes for this rule's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortMapping {
    pub workload_port: u16,
    /// Never empty. Any of them may serve; Spur uses the first, as the public Go router does.
    pub destinations: Vec<Location>,
}

/// A validated routing rule: requests for `baseline` carrying `routing_key` and arriving on a
/// mapped workload port go to that mapping's destination in `destination_sandbox`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingRule {
    pub routing_key: String,
    pub baseline: BaselineWorkload,
    pub destination_sandbox: String,
    pub mappings: Vec<PortMapping>,
}

impl RoutingRule {
    /// Validates one wire rule. `index` only feeds error messages.
    pub fn from_spec(index: usize, spec: RuleSpec) -> Result<Self, Error> {
        let invalid = |reason: String| Error::InvalidRule {
            rule: RuleRef {
                index,
                routing_key: truncate(&spec.routing_key),
            },
            reason,
        };
        if !is_valid_key(&spec.routing_key) {
            return Err(invalid(format!(
                "routingKey must be 1-{MAX_KEY_LEN} characters of [A-Za-z0-9._-]"
            )));
        }
        let b = &spec.baseline;
        check_kind(&b.kind).map_err(|r| invalid(format!("baseline.kind {r}")))?;
        check_dns_label(&b.namespace, 63)
            .map_err(|r| invalid(format!("baseline.namespace {r}")))?;
        check_dns_subdomain(&b.name).map_err(|r| invalid(format!("baseline.name {r}")))?;
        check_dns_subdomain(&spec.destination_sandbox.name)
            .map_err(|r| invalid(format!("destinationSandbox.name {r}")))?;

        let mut ports = HashSet::new();
        let mut mappings = Vec::with_capacity(spec.mappings.len());
        // The spec is ours: its hosts are moved into the rule, not copied.
        for m in spec.mappings {
            let workload_port = port(m.workload_port).ok_or_else(|| {
                invalid(format!(
                    "workloadPort {} is not in 1-65535",
                    m.workload_port
                ))
            })?;
            if !ports.insert(workload_port) {
                return Err(invalid(format!(
                    "workloadPort {workload_port} is mapped twice"
                )));
            }
            if m.destinations.is_empty() {
                return Err(invalid(format!(
                    "workloadPort {workload_port} has no destinations"
                )));
            }
            let mut destinations = Vec::with_capacity(m.destinations.len());
            for d in m.destinations {
                check_host(&d.host).map_err(|r| invalid(format!("destination host {r}")))?;
                let p = port(d.port).ok_or_else(|| {
                    invalid(format!("destination port {} is not in 1-65535", d.port))
                })?;
                destinations.push(Location {
                    host: d.host,
                    port: p,
                });
            }
            mappings.push(PortMapping {
                workload_port,
                destinations,
            });
        }
        Ok(RoutingRule {
            baseline: BaselineWorkload {
                kind: spec.baseline.kind,
                namespace: spec.baseline.namespace,
                name: spec.baseline.name,
            },
            destination_sandbox: spec.destination_sandbox.name,
            routing_key: spec.routing_key,
            mappings,
        })
    }

    /// The rule back in wire shape (for `/config_dump` and the Routes API).
    pub fn to_spec(&self) -> RuleSpec {
        RuleSpec {
            routing_key: self.routing_key.clone(),
            baseline: BaselineSpec {
                kind: self.baseline.kind.clone(),
                namespace: self.baseline.namespace.clone(),
                name: self.baseline.name.clone(),
            },
            destination_sandbox: SandboxSpec {
                name: self.destination_sandbox.clone(),
            },
            mappings: self
                .mappings
                .iter()
                .map(|m| MappingSpec {
                    workload_port: u32::from(m.workload_port),
                    destinations: m
                        .destinations
                        .iter()
                        .map(|d| LocationSpec {
                            host: d.host.clone(),
                            port: u32::from(d.port),
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

/// Accepted rule-document shapes: a bare list of rules, or the REST response object.
#[derive(Deserialize)]
#[serde(untagged)]
enum Document {
    List(Vec<RuleSpec>),
    #[serde(rename_all = "camelCase")]
    Object {
        routing_rules: Vec<RuleSpec>,
    },
}

/// Parses a rule document (YAML, which includes JSON): a list of rules or a
/// `{"routingRules": [...]}` object. An empty or blank document is an empty list. Does not
/// validate; see [`validate_rules`].
pub fn parse_document(bytes: &[u8]) -> Result<Vec<RuleSpec>, Error> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Vec::new());
    }
    let doc: Document = serde_yaml_ng::from_slice(bytes).map_err(|e| Error::Document {
        reason: e.to_string(),
    })?;
    Ok(match doc {
        Document::List(l) => l,
        Document::Object { routing_rules } => routing_rules,
    })
}

/// Validates a whole rule set: every rule, and no two rules for the same (baseline, routing key).
/// All or nothing, so that a half-valid file never replaces a good table.
pub fn validate_rules(specs: Vec<RuleSpec>) -> Result<Vec<RoutingRule>, Error> {
    let mut seen = HashSet::with_capacity(specs.len());
    let mut rules = Vec::with_capacity(specs.len());
    for (index, spec) in specs.into_iter().enumerate() {
        let rule = RoutingRule::from_spec(index, spec)?;
        if !seen.insert((rule.baseline.clone(), rule.routing_key.clone())) {
            return Err(Error::DuplicateRule {
                routing_key: rule.routing_key,
                baseline: rule.baseline.to_string(),
            });
        }
        rules.push(rule);
    }
    Ok(rules)
}

fn port(p: u32) -> Option<u16> {
    u16::try_from(p).ok().filter(|p| *p != 0)
}

fn truncate(s: &str) -> String {
    s.chars().take(MAX_KEY_LEN).collect()
}

fn check_kind(kind: &str) -> Result<(), String> {
    if kind.is_empty() || kind.len() > 63 || !kind.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err("must be 1-63 ASCII letters or digits".into());
    }
    Ok(())
}

/// `Ok` for a DNS label of at most `max` characters (a namespace, a sandbox name), else why not.
pub fn check_dns_label(s: &str, max: usize) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!("must be a DNS label (1-{max} of [a-z0-9-])"))
    }
}

fn check_dns_subdomain(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 253 || s.split('.').any(|l| check_dns_label(l, 63).is_err()) {
        return Err("must be a DNS subdomain (1-253 characters of [a-z0-9.-])".into());
    }
    Ok(())
}

fn check_host(host: &str) -> Result<(), String> {
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    let ok = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{:?} is neither an IP address nor a DNS name",
            truncate(host)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(key: &str, port: u32) -> RuleSpec {
        RuleSpec {
            routing_key: key.into(),
            baseline: BaselineSpec {
                kind: "Deployment".into(),
                namespace: "hotrod".into(),
                name: "route".into(),
            },
            destination_sandbox: SandboxSpec { name: "sb1".into() },
            mappings: vec![MappingSpec {
                workload_port: port,
                destinations: vec![LocationSpec {
                    host: "sb1-route.hotrod.svc".into(),
                    port: 8083,
                }],
            }],
        }
    }

    #[test]
    fn valid_rule_round_trips() {
        let s = spec("ltj9s8scupb86", 8083);
        let rule = RoutingRule::from_spec(0, s.clone()).unwrap();
        assert_eq!(rule.mappings[0].workload_port, 8083);
        assert_eq!(rule.to_spec(), s);
    }

    #[test]
    fn rejects_bad_fields_with_a_reason() {
        for (s, needle) in [
            (spec("", 80), "routingKey"),
            (spec("has space", 80), "routingKey"),
            (spec("k", 0), "workloadPort 0"),
            (spec("k", 70000), "workloadPort 70000"),
            (
                RuleSpec {
                    baseline: BaselineSpec {
                        namespace: "Bad_NS".into(),
                        ..spec("k", 1).baseline
                    },
                    ..spec("k", 1)
                },
                "namespace",
            ),
        ] {
            let err = RoutingRule::from_spec(3, s).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
            assert!(err.contains("#3"), "{err}");
        }
        let mut s = spec("k", 80);
        s.mappings[0].destinations.clear();
        assert!(
            RoutingRule::from_spec(0, s)
                .unwrap_err()
                .to_string()
                .contains("no destinations")
        );
        let mut s = spec("k", 80);
        s.mappings.push(s.mappings[0].clone());
        assert!(
            RoutingRule::from_spec(0, s)
                .unwrap_err()
                .to_string()
                .contains("mapped twice")
        );
        let mut s = spec("k", 80);
        s.mappings[0].destinations[0].host = "bad host".into();
        assert!(RoutingRule::from_spec(0, s).is_err());
    }

    #[test]
    fn duplicates_are_rejected() {
        let err = validate_rules(vec![spec("k", 80), spec("k", 81)]).unwrap_err();
        assert!(matches!(err, Error::DuplicateRule { .. }), "{err}");
        assert_eq!(
            validate_rules(vec![spec("a", 80), spec("b", 80)])
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn accepts_rest_and_proto_json_spellings() {
        let rest = r#"{"routingKey":"k","baseline":{"kind":"Deployment","namespace":"ns","name":"n"},
            "destinationSandbox":{"name":"s"},"mappings":[{"workloadPort":80,"destinations":[{"host":"h","port":81}]}]}"#;
        let proto = r#"{"routing_key":"k","baseline":{"kind":"Deployment","namespace":"ns","name":"n"},
            "destination_sandbox":{"name":"s"},"mappings":[{"workload_port":80,"destinations":[{"host":"h","port":81}]}]}"#;
        let a: RuleSpec = serde_json::from_str(rest).unwrap();
        let b: RuleSpec = serde_json::from_str(proto).unwrap();
        assert_eq!(a, b);
        assert!(serde_json::from_str::<RuleSpec>(r#"{"routingKey":"k","typo":1}"#).is_err());
    }
}
