//! Fuzzes route-server messages as the sidecar decodes them: protobuf bytes decoded as
//! `GetWorkloadRoutingRulesResponse` and as a watch stream of length-delimited
//! `WorkloadRoutingRuleOp`s, each rule converted with `spur_routing::wire::rule_from_proto` and validated
//! with `RoutingRule::from_spec`, the watch ops applied the way `spur_discovery`'s route-server
//! source applies them.
//!
//! Input: protobuf bytes.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use prost::Message;
use spur_proto::routes::{
    GetWorkloadRoutingRulesResponse, WatchOp, WorkloadRoutingRule, WorkloadRoutingRuleOp,
};
use spur_routing::wire::{rule_from_proto, rule_to_proto};
use spur_routing::rules::validate_rules;
use spur_routing::{RoutingRule, RuleTable};

/// Validates one received rule; a valid one must survive the trip back to the wire.
fn check(route: &WorkloadRoutingRule) -> Option<RoutingRule> {
    let rule = match RoutingRule::from_spec(0, rule_from_proto(route)) {
        Ok(rule) => rule,
        Err(e) => {
            let _ = e.to_string();
            return None;
        }
    };
    // Every field was set and in range, so the rule re-encodes to exactly what was received
    // (minus unknown fields, which prost drops).
    let proto = rule_to_proto(&rule);
    assert_eq!(&proto, route);
    let bytes = proto.encode_to_vec();
    let decoded = WorkloadRoutingRule::decode(bytes.as_slice()).expect("re-encoded rule decodes");
    assert_eq!(decoded, proto);
    let back = RoutingRule::from_spec(0, rule_from_proto(&decoded)).expect("still valid");
    assert_eq!(back, rule);
    Some(rule)
}

fuzz_target!(|data: &[u8]| {
    // The unary GetWorkloadRoutingRules answer.
    if let Ok(resp) = GetWorkloadRoutingRulesResponse::decode(data) {
        let valid: Vec<RoutingRule> = resp.routing_rules.iter().filter_map(check).collect();
        if valid.len() == resp.routing_rules.len() {
            let specs = valid.iter().map(RoutingRule::to_spec).collect();
            if let Ok(rules) = validate_rules(specs) {
                assert_eq!(rules, valid);
            }
        }
    }

    // The watch stream: ops applied in order to the sidecar's map keyed by routing key, for one
    // baseline (the first valid rule's here). What gets published must be a valid rule set.
    let mut rest = data;
    let mut rules: BTreeMap<String, RoutingRule> = BTreeMap::new();
    let mut baseline = None;
    while !rest.is_empty() {
        let Ok(op) = WorkloadRoutingRuleOp::decode_length_delimited(&mut rest) else {
            break;
        };
        let _ = op.op(); // unknown values map to the default
        let Some(route) = &op.route else {
            continue;
        };
        match op.op() {
            WatchOp::Remove => {
                rules.remove(&route.routing_key);
            }
            WatchOp::Add | WatchOp::Replace => {
                if let Some(rule) = check(route)
                    && *baseline.get_or_insert_with(|| rule.baseline.clone()) == rule.baseline
                {
                    rules.insert(rule.routing_key.clone(), rule);
                }
            }
            WatchOp::Synced => {}
        }
        let published: Vec<RoutingRule> = rules.values().cloned().collect();
        let specs = published.iter().map(RoutingRule::to_spec).collect();
        assert_eq!(
            validate_rules(specs).expect("published set validates"),
            published
        );
        let table = RuleTable::new(published);
        assert_eq!(table.len(), rules.len());
    }
});
