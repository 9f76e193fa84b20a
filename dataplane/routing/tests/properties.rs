//! Property tests: extraction is total and well-behaved on arbitrary input, injection round-trips,
//! baggage encoding round-trips, and table lookup agrees with a naive scan of the rules.
#![allow(clippy::unwrap_used, reason = "test helpers")]

use std::collections::HashSet;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};
use proptest::collection::vec;
use proptest::prelude::*;
use spur_routing::baggage::{encode_value, members};
use spur_routing::extract::{MAX_CANDIDATES, is_valid_key, strip_query_param};
use spur_routing::inject::inject_key;
use spur_routing::rules::{
    BaselineSpec, LocationSpec, MappingSpec, PortMapping, SandboxSpec, validate_rules,
};
use spur_routing::{
    BaselineWorkload, ExtractConfig, KeyExtractor, Location, RoutingRule, RuleSpec, RuleTable,
};

const NAMES: &[&str] = &[
    "baggage",
    "tracestate",
    "x-route",
    "ot-baggage-sd-routing-key",
    "ot-baggage-sd-sandbox",
    "uberctx-sd-routing-key",
    "uberctx-sd-workspace",
    "accept",
];

fn extractor() -> KeyExtractor {
    KeyExtractor::new(&ExtractConfig {
        custom_headers: vec!["x-route".into()],
        query_param: Some("sd-routing-key".into()),
    })
    .unwrap()
}

/// Values biased towards list syntax so the parsers' interesting paths are reached.
fn listish() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..200),
        "[a-z=,;% \t0-9A-F._-]{0,200}".prop_map(String::into_bytes),
        "((sd-routing-key|sd-sandbox|spur-routing-key|sd-workspace|x) ?= ?[a-z0-9%.-]{0,12} ?(;p)?,){0,12}"
            .prop_map(String::into_bytes),
    ]
}

fn header_map(pairs: &[(usize, Vec<u8>)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (i, v) in pairs {
        if let Ok(v) = HeaderValue::from_bytes(v) {
            h.append(HeaderName::from_static(NAMES[i % NAMES.len()]), v);
        }
    }
    h
}

fn check_candidates(h: &HeaderMap, query: Option<&str>) -> Result<(), TestCaseError> {
    let c = extractor().extract(h, query);
    prop_assert!(c.len() <= MAX_CANDIDATES);
    prop_assert_eq!(c.iter().count(), c.len());
    let mut seen = HashSet::new();
    for k in c.iter() {
        prop_assert!(is_valid_key(k), "invalid candidate {:?}", k);
        prop_assert!(seen.insert(k), "duplicate candidate {:?}", k);
    }
    Ok(())
}

const TABLE_KEYS: [&str; 5] = ["a", "b", "c", "d", "zz"];
const TABLE_BASELINES: [&str; 3] = ["x", "y", "w"];

fn table_baseline(b: usize) -> BaselineWorkload {
    BaselineWorkload {
        kind: "Deployment".into(),
        namespace: "ns".into(),
        name: TABLE_BASELINES[b].into(),
    }
}

/// A rule of the small universe the table properties draw from: key, baseline, and per mapping a
/// workload port (80 + n; a repeated one is dropped) and a host variant. Rules are not validated:
/// two of them may share a baseline and key, whose ports the table merges.
type RawRule = (usize, usize, Vec<(u32, usize)>);

fn raw_rule() -> impl Strategy<Value = RawRule> {
    (0..5usize, 0..3usize, vec((0..3u32, 0..3usize), 1..3))
}

fn routing_rule((k, b, maps): &RawRule) -> RoutingRule {
    let mut ports = HashSet::new();
    RoutingRule {
        routing_key: TABLE_KEYS[*k].into(),
        baseline: table_baseline(*b),
        destination_sandbox: format!("sb-{k}"),
        mappings: maps
            .iter()
            .filter(|(p, _)| ports.insert(*p))
            .map(|&(p, h)| PortMapping {
                workload_port: 80 + u16::try_from(p).unwrap(),
                destinations: vec![
                    Location {
                        host: format!("h{h}-{k}-{b}"),
                        port: 9000,
                    },
                    Location {
                        host: "second".into(),
                        port: 1,
                    },
                ],
            })
            .collect(),
    }
}

/// What becomes of a rule of the previous table in the next one.
#[derive(Debug, Clone, Copy)]
enum Fate {
    /// The same `Arc`, as a source that keeps its rules publishes an unchanged rule.
    Kept,
    /// An equal rule in a new allocation, as a source that rebuilt its rules publishes it.
    Copied,
    /// The same baseline and key with another first host (a REPLACE).
    NewHost,
    /// The same baseline and key with another set of ports.
    NewPorts,
    /// The same baseline and key with another sandbox.
    NewSandbox,
    Removed,
}

fn fate() -> impl Strategy<Value = Fate> {
    prop_oneof![
        8 => Just(Fate::Kept),
        1 => Just(Fate::Copied),
        1 => Just(Fate::NewHost),
        1 => Just(Fate::NewPorts),
        1 => Just(Fate::NewSandbox),
        1 => Just(Fate::Removed),
    ]
}

/// One change of a rule set: a fate per rule by position, rules inserted (at an index modulo the
/// length), and the order the source publishes in.
type Step = (Vec<Fate>, Vec<(usize, RawRule)>, u8);

fn step() -> impl Strategy<Value = Step> {
    (
        vec(fate(), 16),
        vec((any::<usize>(), raw_rule()), 0..3),
        0..4u8,
    )
}

fn apply(rules: &[Arc<RoutingRule>], (fates, inserted, order): &Step) -> Vec<Arc<RoutingRule>> {
    let mut next: Vec<Arc<RoutingRule>> = rules
        .iter()
        .zip(fates.iter().cycle())
        .filter_map(|(r, fate)| {
            let mut changed = RoutingRule::clone(r);
            match fate {
                Fate::Kept => return Some(r.clone()),
                Fate::Copied => {}
                Fate::NewHost => changed.mappings[0].destinations[0].host.push_str("-new"),
                Fate::NewPorts => {
                    if changed.mappings.len() > 1 {
                        changed.mappings.pop();
                    } else {
                        let mut added = changed.mappings[0].clone();
                        added.workload_port = 83;
                        changed.mappings.push(added);
                    }
                }
                Fate::NewSandbox => changed.destination_sandbox.push_str("-new"),
                Fate::Removed => return None,
            }
            Some(Arc::new(changed))
        })
        .collect();
    for (at, raw) in inserted {
        let at = at % (next.len() + 1);
        next.insert(at, Arc::new(routing_rule(raw)));
    }
    match order {
        // As a route server's watch publishes them: by key.
        0 => next.sort_by(|a, b| a.routing_key.cmp(&b.routing_key)),
        // Grouped by baseline (a stable sort: a baseline's rules keep their order).
        1 => next.sort_by(|a, b| a.baseline.cmp(&b.baseline)),
        // In the order of the change.
        _ => {}
    }
    next
}

/// Every answer a table gives in the rules' universe (and one baseline and port outside it).
fn answers(table: &RuleTable) -> Vec<String> {
    let mut out = Vec::new();
    for b in 0..=TABLE_BASELINES.len() {
        let baseline = if b < TABLE_BASELINES.len() {
            table_baseline(b)
        } else {
            BaselineWorkload {
                name: "other".into(),
                ..table_baseline(0)
            }
        };
        let rules = table.baseline(&baseline);
        out.push(format!("{b} present {}", rules.is_some()));
        for (k, key) in TABLE_KEYS.iter().enumerate() {
            for port in 79..85 {
                out.push(format!(
                    "{b} {k} {port}: {:?}",
                    table.lookup(&baseline, port, key)
                ));
            }
            out.push(format!(
                "{b} {k} any: {:?}",
                rules.and_then(|r| r.lookup_any_port(key))
            ));
        }
    }
    out.push(format!("{:?}", table.locations()));
    out
}

proptest! {
    #[test]
    fn extraction_is_total(pairs in vec((any::<usize>(), listish()), 0..12), query in ".{0,100}") {
        let h = header_map(&pairs);
        check_candidates(&h, Some(&query))?;
        check_candidates(&h, None)?;
    }

    #[test]
    fn strip_query_param_is_total(pq in "/[a-z]{0,3}(\\?[a-z&=%+0-9-]{0,60})?", name in "[a-z]{1,3}") {
        if let Some((key, rewritten)) = strip_query_param(&pq, &name) {
            prop_assert!(is_valid_key(&key));
            let query = rewritten.split_once('?').map_or("", |(_, q)| q);
            prop_assert!(query.split('&').all(|p| p.split('=').next() != Some(name.as_str())));
            prop_assert!(!rewritten.ends_with('?') && !rewritten.ends_with('&'));
        }
    }

    #[test]
    fn injected_key_is_extracted_first(
        key in "[A-Za-z0-9._-]{1,64}",
        pairs in vec((any::<usize>(), listish()), 0..8),
    ) {
        let mut h = header_map(&pairs);
        inject_key(&mut h, &key, &[HeaderName::from_static("x-route")]);
        let plain = KeyExtractor::new(&ExtractConfig::default()).unwrap();
        let c = plain.extract(&h, None);
        prop_assert_eq!(c.first(), Some(key.as_str()));
        let c = extractor().extract(&h, None);
        prop_assert_eq!(c.first(), Some(key.as_str()));
        check_candidates(&h, None)?;
    }

    #[test]
    fn injection_keeps_other_baggage_members(
        key in "[a-z0-9]{1,13}",
        others in vec(("[a-z]{1,8}", "[a-zA-Z0-9%]{0,8}"), 0..10),
    ) {
        let mut existing = String::new();
        for (k, v) in &others {
            let mut enc = String::new();
            encode_value(v, &mut enc);
            existing.push_str(&format!("o{k}={enc},"));
        }
        let mut h = HeaderMap::new();
        h.insert("baggage", HeaderValue::from_str(&existing).unwrap());
        inject_key(&mut h, &key, &[]);
        let out = h.get("baggage").unwrap().to_str().unwrap();
        let got: Vec<(String, String)> =
            members(out).skip(2).map(|m| (m.key.to_owned(), m.value.into_owned())).collect();
        let want: Vec<(String, String)> = others.iter().map(|(k, v)| (format!("o{k}"), v.clone())).collect();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn baggage_round_trip(
        items in vec(("[A-Za-z0-9!#$%&'*+.^_`|~-]{1,16}", ".{0,16}", "(;[a-z]{1,4}(=[a-z0-9]{1,4})?){0,2}"), 0..20),
        ows in "[ \t]{0,2}",
    ) {
        let mut line = String::new();
        for (i, (k, v, props)) in items.iter().enumerate() {
            if i > 0 {
                line.push_str(&ows);
                line.push(',');
                line.push_str(&ows);
            }
            line.push_str(k);
            line.push_str(&ows);
            line.push('=');
            line.push_str(&ows);
            encode_value(v, &mut line);
            line.push_str(props);
        }
        let got: Vec<(String, String, String)> =
            members(&line).map(|m| (m.key.to_owned(), m.value.into_owned(), m.properties.to_owned())).collect();
        let want: Vec<(String, String, String)> = items
            .iter()
            .map(|(k, v, p)| (k.clone(), v.clone(), p.strip_prefix(';').unwrap_or("").to_owned()))
            .collect();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn lookup_agrees_with_linear_scan(
        raw in vec((0..4usize, 0..2usize, vec((0..3u32, 0..3usize), 1..3)), 0..24),
        probes in vec((0..5usize, 0..3usize, 79..84u16), 1..40),
        earlier in vec((any::<bool>(), any::<bool>()), 24),
    ) {
        const KEYS: [&str; 5] = ["a", "b", "c", "d", "zz"];
        const BASELINES: [&str; 3] = ["x", "y", "w"];
        let mut seen = HashSet::new();
        let mut specs = Vec::new();
        for (k, b, maps) in raw {
            if !seen.insert((k, b)) {
                continue;
            }
            let mut ports = HashSet::new();
            let mappings = maps
                .into_iter()
                .filter(|(p, _)| ports.insert(*p))
                .map(|(p, h)| MappingSpec {
                    workload_port: 80 + p,
                    destinations: vec![
                        LocationSpec { host: format!("h{h}-{k}-{b}"), port: 9000 + p },
                        LocationSpec { host: "second".into(), port: 1 },
                    ],
                })
                .collect();
            specs.push(RuleSpec {
                routing_key: KEYS[k].into(),
                baseline: BaselineSpec { kind: "Deployment".into(), namespace: "ns".into(), name: BASELINES[b].into() },
                destination_sandbox: SandboxSpec { name: format!("sb-{k}") },
                mappings,
            });
        }
        let rules = validate_rules(specs).unwrap();
        // The same rules compiled on top of an earlier table (some rules missing from it, some
        // different in it) must route exactly as a table compiled from scratch.
        let previous: Vec<_> = rules
            .iter()
            .zip(&earlier)
            .filter(|(_, (kept, _))| *kept)
            .map(|(r, (_, changed))| {
                let mut r = r.clone();
                if *changed {
                    r.mappings[0].destinations[0].host.push_str("-old");
                }
                Arc::new(r)
            })
            .collect();
        let previous = RuleTable::compile(previous, None);
        let incremental =
            RuleTable::compile(rules.iter().cloned().map(Arc::new).collect(), Some(&previous));
        for table in [RuleTable::new(rules.clone()), incremental] {
            prop_assert_eq!(table.len(), rules.len());
            let naive = |b: &BaselineWorkload, port: u16, key: &str| {
                rules
                    .iter()
                    .filter(|r| &r.baseline == b && r.routing_key == key)
                    .flat_map(|r| r.mappings.iter())
                    .find(|m| m.workload_port == port)
                    .map(|m| m.destinations[0].clone())
            };
            for &(k, b, port) in &probes {
                let baseline =
                    BaselineWorkload { kind: "Deployment".into(), namespace: "ns".into(), name: BASELINES[b].into() };
                let got = table.lookup(&baseline, port, KEYS[k]).map(|d| Location::clone(&d.location));
                prop_assert_eq!(got, naive(&baseline, port, KEYS[k]));
                // Routing over several candidates: the first candidate with a rule wins.
                let candidates = [KEYS[k], KEYS[(k + 1) % KEYS.len()], KEYS[(k + 2) % KEYS.len()]];
                let routed = table
                    .baseline(&baseline)
                    .and_then(|r| r.route(port, candidates))
                    .map(|d| (d.routing_key.to_string(), Location::clone(&d.location)));
                let expected = candidates.iter().find_map(|c| naive(&baseline, port, c).map(|l| ((*c).to_owned(), l)));
                prop_assert_eq!(routed, expected);
            }
        }
    }

    /// A table compiled on top of the one before it, generation after generation, routes exactly
    /// as one compiled from scratch and as a scan of its rules: whatever each change kept (by
    /// pointer or by value), replaced, removed or added, and in whatever order it came.
    #[test]
    fn compiled_on_earlier_tables_routes_like_scratch(
        first in vec(raw_rule(), 0..12),
        steps in vec(step(), 1..6),
    ) {
        let mut rules: Vec<Arc<RoutingRule>> =
            first.iter().map(|r| Arc::new(routing_rule(r))).collect();
        let mut table = RuleTable::compile(rules.clone(), None);
        for step in &steps {
            rules = apply(&rules, step);
            let next = RuleTable::compile(rules.clone(), Some(&table));
            let copies = rules.iter().map(|r| Arc::new(RoutingRule::clone(r))).collect();
            let scratch = RuleTable::compile(copies, None);
            prop_assert_eq!(answers(&next), answers(&scratch));
            prop_assert!(next.rules().iter().zip(&rules).all(|(a, b)| Arc::ptr_eq(a, b)));
            prop_assert_eq!(next.len(), rules.len());
            for b in 0..TABLE_BASELINES.len() {
                let baseline = table_baseline(b);
                for (k, key) in TABLE_KEYS.iter().enumerate() {
                    for port in 80..84u16 {
                        let naive = rules
                            .iter()
                            .filter(|r| r.baseline == baseline && r.routing_key == *key)
                            .flat_map(|r| r.mappings.iter())
                            .find(|m| m.workload_port == port)
                            .map(|m| m.destinations[0].clone());
                        let got = next.lookup(&baseline, port, key).map(|d| Location::clone(&d.location));
                        prop_assert_eq!(got, naive, "baseline {} key {} port {}", b, k, port);
                    }
                }
            }
            table = next;
        }
    }
}
