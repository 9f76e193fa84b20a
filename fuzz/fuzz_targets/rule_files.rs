//! Fuzzes the sidecar's rule-file parser (`spur_discovery::parse_rules`: YAML or JSON, a list
//! of rules or a `{"routingRules": [...]}` object) and the validator it feeds
//! (`validate_rules` / `RoutingRule::from_spec`).
//!
//! Input: the file's bytes.
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::fuzz_target;
use spur_discovery::parse_rules;
use spur_routing::rules::{RuleSpec, parse_document, validate_rules};
use spur_routing::{RoutingRule, RuleTable};

/// What the validator promises about an accepted rule.
fn check_rule(r: &RoutingRule) {
    assert!(spur_routing::extract::is_valid_key(&r.routing_key), "{r:?}");
    assert!(!r.baseline.kind.is_empty() && !r.baseline.namespace.is_empty());
    assert!(!r.baseline.name.is_empty() && !r.destination_sandbox.is_empty());
    let mut ports = HashSet::new();
    for m in &r.mappings {
        assert!(m.workload_port != 0 && ports.insert(m.workload_port), "{r:?}");
        assert!(!m.destinations.is_empty(), "{r:?}");
        for d in &m.destinations {
            assert!(d.port != 0 && !d.host.is_empty() && d.host.len() <= 253, "{r:?}");
            assert!(
                !d.host.bytes().any(|b| b.is_ascii_whitespace() || b"/@?#".contains(&b)),
                "{r:?}"
            );
        }
    }
    // The rule back in wire shape validates to itself.
    let back = RoutingRule::from_spec(0, r.to_spec()).expect("to_spec of a valid rule validates");
    assert_eq!(&back, r);
}

/// A rule set written back out as a rule file (JSON object and YAML list) reads back the same.
fn check_round_trip(rules: &[RoutingRule]) {
    let specs: Vec<RuleSpec> = rules.iter().map(RoutingRule::to_spec).collect();
    let json = serde_json::to_vec(&serde_json::json!({ "routingRules": specs })).expect("json");
    let back = parse_rules("rules.json", &json).expect("written JSON parses");
    assert_eq!(back, rules);
    let yaml = serde_yaml_ng::to_string(&specs).expect("yaml");
    let back = parse_rules("rules.yaml", yaml.as_bytes())
        .unwrap_or_else(|e| panic!("written YAML does not parse: {e}\n{yaml}"));
    assert_eq!(back, rules);
}

fuzz_target!(|data: &[u8]| {
    let parsed = parse_rules("fuzz.yaml", data);
    // Error messages are built from attacker-controlled text (truncated keys).
    if let Err(e) = &parsed {
        let _ = e.to_string();
    }

    // parse_rules = parse_document, then validate_rules; the set is valid exactly when every
    // rule is and no two share a (baseline, routing key).
    let Ok(specs) = parse_document(data) else {
        assert!(parsed.is_err());
        return;
    };
    let one_by_one: Result<Vec<RoutingRule>, _> = specs
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, s)| RoutingRule::from_spec(i, s))
        .collect();
    let distinct = one_by_one.as_ref().is_ok_and(|rules| {
        let mut seen = HashSet::new();
        rules
            .iter()
            .all(|r| seen.insert((r.baseline.clone(), r.routing_key.clone())))
    });
    assert_eq!(parsed.is_ok(), distinct, "{parsed:?}");
    assert_eq!(
        validate_rules(specs.clone()).ok(),
        parsed.as_ref().ok().cloned()
    );

    // A document that is JSON yields the same rule set through the YAML parser as through
    // serde_json. (The strings themselves may differ: YAML 1.1 folds U+0085, U+2028 and U+2029
    // in quoted scalars, which JSON keeps; no valid rule field holds them.)
    if let Ok(from_json) = serde_json::from_slice::<Vec<RuleSpec>>(data) {
        assert_eq!(
            validate_rules(from_json).ok(),
            parsed.as_ref().ok().cloned(),
            "JSON list read differently as YAML"
        );
    }

    let Ok(rules) = parsed else {
        return;
    };
    for r in &rules {
        check_rule(r);
    }
    check_round_trip(&rules);

    // The table the sidecar builds from the file routes every mapping to its first destination.
    let table = RuleTable::new(rules.clone());
    assert_eq!(table.len(), rules.len());
    for r in &rules {
        for m in &r.mappings {
            let d = table
                .lookup(&r.baseline, m.workload_port, &r.routing_key)
                .expect("mapped port routes");
            assert_eq!(*d.location, m.destinations[0]);
        }
    }
});
