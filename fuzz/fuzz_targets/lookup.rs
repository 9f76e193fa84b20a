//! Fuzzes rule-table compilation and lookup against a naive scan over the validated rules.
//!
//! Input: 4 bytes per rule (key, baseline, port bitmask, host) up to a `0xff` byte, then 3 bytes
//! per probe (key, baseline, port).
#![no_main]

use libfuzzer_sys::fuzz_target;
use spur_routing::rules::{BaselineSpec, LocationSpec, MappingSpec, SandboxSpec, validate_rules};
use spur_routing::{BaselineWorkload, RuleSpec, RuleTable};

const KEYS: [&str; 6] = ["a", "b", "c", "ltj9s8scupb86", "a.b_c-d", "zz"];
const BASELINES: [&str; 3] = ["x", "y", "w"];

fn baseline(i: u8) -> BaselineWorkload {
    let name = BASELINES[usize::from(i) % BASELINES.len()];
    BaselineWorkload {
        kind: "Deployment".into(),
        namespace: "ns".into(),
        name: name.into(),
    }
}

fuzz_target!(|data: &[u8]| {
    let (rule_bytes, probe_bytes) = match data.iter().position(|&b| b == 0xff) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let specs: Vec<RuleSpec> = rule_bytes
        .chunks_exact(4)
        .map(|c| {
            let b = baseline(c[1]);
            RuleSpec {
                routing_key: KEYS[usize::from(c[0]) % KEYS.len()].into(),
                baseline: BaselineSpec {
                    kind: b.kind,
                    namespace: b.namespace,
                    name: b.name,
                },
                destination_sandbox: SandboxSpec {
                    name: format!("sb{}", c[3]),
                },
                mappings: (0..4u32)
                    .filter(|p| c[2] & (1 << p) != 0)
                    .map(|p| MappingSpec {
                        workload_port: 80 + p,
                        destinations: vec![LocationSpec {
                            host: format!("h{}", c[3]),
                            port: 9000 + p,
                        }],
                    })
                    .collect(),
            }
        })
        .collect();
    // Duplicate (baseline, key) pairs must be rejected as a whole set.
    let Ok(rules) = validate_rules(specs) else {
        return;
    };
    let table = RuleTable::new(rules.clone());
    assert_eq!(table.len(), rules.len());
    for p in probe_bytes.chunks_exact(3) {
        let b = baseline(p[1]);
        let key = KEYS[usize::from(p[0]) % KEYS.len()];
        let port = 79 + u16::from(p[2] % 6);
        let naive = rules
            .iter()
            .filter(|r| r.baseline == b && r.routing_key == key)
            .flat_map(|r| r.mappings.iter())
            .find(|m| m.workload_port == port)
            .map(|m| m.destinations[0].clone());
        assert_eq!(
            table.lookup(&b, port, key).map(|d| (*d.location).clone()),
            naive
        );
        let routed = table
            .baseline(&b)
            .and_then(|r| r.route(port, [key, "zz", "a"]));
        let expected = [key, "zz", "a"].into_iter().find(|k| {
            rules.iter().any(|r| {
                r.baseline == b
                    && r.routing_key == *k
                    && r.mappings.iter().any(|m| m.workload_port == port)
            })
        });
        assert_eq!(
            routed.map(|d| d.routing_key.to_string()),
            expected.map(str::to_owned)
        );
    }
});
