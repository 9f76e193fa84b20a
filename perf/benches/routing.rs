//! Request-path cost of routing: key extraction from realistic header maps and rule-table lookup
//! at 10, 1 000 and 100 000 rules. Run with `cargo bench -p spur-perf --bench routing`.
#![allow(
    clippy::unwrap_used,
    reason = "a benchmark with a broken setup should abort loudly"
)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use http::{HeaderMap, HeaderName, HeaderValue};
use spur_routing::rules::{BaselineSpec, LocationSpec, MappingSpec, SandboxSpec, validate_rules};
use spur_routing::{BaselineWorkload, ExtractConfig, KeyExtractor, RuleSpec, RuleTable};

const KEY: &str = "ltj9s8scupb86";

/// What a browser request through an ingress typically carries.
fn ordinary_headers() -> HeaderMap {
    let mut h = HeaderMap::new();
    for (n, v) in [
        ("host", "frontend.hotrod.svc.cluster.local:8080"),
        (
            "user-agent",
            "Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0",
        ),
        (
            "accept",
            "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
        ),
        ("accept-language", "en-US,en;q=0.5"),
        ("accept-encoding", "gzip, deflate, br, zstd"),
        (
            "cookie",
            "session=6f1c2a0e9b7d4c3a8e5f; theme=dark; _ga=GA1.1.123456789.1700000000",
        ),
        ("x-request-id", "7d3f0c2e-5b1a-4e8f-9c6d-2a1b3c4d5e6f"),
        ("x-forwarded-for", "10.0.3.17, 10.0.1.2"),
        ("x-forwarded-proto", "https"),
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
        ("content-type", "application/json"),
        ("cache-control", "no-cache"),
    ] {
        h.insert(HeaderName::from_static(n), HeaderValue::from_static(v));
    }
    h
}

fn with(extra: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut h = ordinary_headers();
    for (n, v) in extra {
        h.append(HeaderName::from_static(n), HeaderValue::from_static(v));
    }
    h
}

fn extract(c: &mut Criterion) {
    let plain = KeyExtractor::new(&ExtractConfig::default()).unwrap();
    let custom = KeyExtractor::new(&ExtractConfig {
        custom_headers: vec!["x-sandbox-key".into()],
        query_param: Some("sd-routing-key".into()),
    })
    .unwrap();
    let cases = [
        ("no_key", &plain, with(&[])),
        (
            "baggage",
            &plain,
            with(&[(
                "baggage",
                "userId=alice,isProduction=false,sd-routing-key=ltj9s8scupb86,sd-sandbox=ltj9s8scupb86,\
                 tenant=acme;ttl=60,region=eu-west-1",
            )]),
        ),
        (
            "uberctx_only",
            &plain,
            with(&[("uberctx-sd-routing-key", KEY)]),
        ),
        (
            "baggage_percent_encoded",
            &plain,
            with(&[(
                "baggage",
                "userId=alice%40example.com,sd-routing-key=ltj9s8scupb86%2D1,tenant=acme",
            )]),
        ),
        ("custom_header", &custom, with(&[("x-sandbox-key", KEY)])),
    ];
    let mut g = c.benchmark_group("extract");
    for (name, extractor, headers) in &cases {
        assert!(
            name == &"no_key" || !extractor.extract(headers, None).is_empty(),
            "{name}"
        );
        g.bench_function(*name, |b| {
            b.iter(|| extractor.extract(black_box(headers), black_box(None)).len())
        });
    }
    g.finish();
}

fn spec(i: usize) -> RuleSpec {
    RuleSpec {
        routing_key: format!("key{i:08}"),
        baseline: BaselineSpec {
            kind: "Deployment".into(),
            namespace: "hotrod".into(),
            name: "route".into(),
        },
        destination_sandbox: SandboxSpec {
            name: format!("sb-{i}"),
        },
        mappings: vec![MappingSpec {
            workload_port: 8083,
            destinations: vec![LocationSpec {
                host: format!("sb-{i}-route.hotrod.svc"),
                port: 8083,
            }],
        }],
    }
}

fn lookup(c: &mut Criterion) {
    let baseline = BaselineWorkload {
        kind: "Deployment".into(),
        namespace: "hotrod".into(),
        name: "route".into(),
    };
    let mut g = c.benchmark_group("lookup");
    for n in [10usize, 1_000, 100_000] {
        let table = RuleTable::new(validate_rules((0..n).map(spec).collect()).unwrap());
        let hit_key = format!("key{:08}", n / 2);
        // Realistic candidate lists: the key appears under two member names, deduplicated to one,
        // and a miss tries a couple of unknown keys.
        let hit = [hit_key.as_str()];
        let miss = ["nosuchkey0001", "nosuchkey0002"];
        g.bench_function(format!("{n}/hit"), |b| {
            b.iter(|| {
                table
                    .baseline(black_box(&baseline))
                    .and_then(|r| r.route(black_box(8083), black_box(hit)))
                    .is_some()
            })
        });
        g.bench_function(format!("{n}/miss"), |b| {
            b.iter(|| {
                table
                    .baseline(black_box(&baseline))
                    .and_then(|r| r.route(black_box(8083), black_box(miss)))
                    .is_some()
            })
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(50)
}

criterion_group! {
    name = benches;
    config = config();
    targets = extract, lookup
}
criterion_main!(benches);
