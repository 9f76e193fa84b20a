//! What a sandbox changed, with the noise learned away: a smart test sends each of its requests
//! to the baseline twice and to the sandbox once; every way the two baseline answers differ
//! (timestamps, ids, the order of a set) is noise, and is left out of what the sandbox's answer
//! changes against the baseline's. What is left are findings, ranked (a status or error first,
//! then the shape of a body, then values, then timing) and grouped per endpoint.
//!
//! Paths are compared with array indices as `[*]`, so an id that differs in every element of a
//! list is one noisy path, and a field a fork removed from every element is one finding.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use spur_proto::traffic::Exchange;

use crate::calls::{Calls, compare_calls};
use crate::compare::{Difference, compare, group_of};

/// How much a finding matters, most first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rank {
    /// The status, the gRPC status or a transport error changed.
    Status,
    /// The shape changed: a JSON field or element added or removed or of another type, a header
    /// added or removed.
    Schema,
    /// A value changed: a JSON value of the same type, a header's value, text lines, bytes.
    Value,
    /// The sandbox answered much slower than the baseline did.
    Timing,
}

impl Rank {
    pub fn as_str(self) -> &'static str {
        match self {
            Rank::Status => "status",
            Rank::Schema => "schema",
            Rank::Value => "value",
            Rank::Timing => "timing",
        }
    }
}

/// A sandbox answer is slow when it took more than this many times the slower baseline answer,
/// and more than [`TIMING_SLACK_MICROS`] longer: a fast endpoint's jitter is not a finding.
pub const TIMING_FACTOR: u64 = 3;
pub const TIMING_SLACK_MICROS: u64 = 100_000;
/// Findings kept per endpoint; the rest are counted.
pub const MAX_FINDINGS_PER_ENDPOINT: usize = 20;

/// One request of a test, as each side answered it.
#[derive(Debug)]
pub struct Observation<'a> {
    /// The endpoint the request exercises, as the report groups it (e.g. `GET /items`).
    pub endpoint: String,
    /// The baseline's two answers (two runs).
    pub baseline: [&'a Exchange; 2],
    pub sandbox: &'a Exchange,
    /// The calls each request caused downstream (baseline, baseline, sandbox), when the run
    /// captured them: compared as the answers are, noise learned from the baseline's two.
    pub calls: Option<[&'a Calls; 3]>,
}

/// One way the sandbox's answers differ from the baseline's that the baseline's own runs do not.
#[derive(Debug, PartialEq)]
pub struct Finding {
    pub rank: Rank,
    /// The difference, its `at` with array indices as `[*]`; the values are the first seen.
    pub difference: Difference,
    /// How many times it was seen on the endpoint (elements of a list, requests).
    pub occurrences: usize,
}

/// The findings of one endpoint, and the noise learned there.
#[derive(Debug, Default, PartialEq)]
pub struct EndpointFindings {
    pub findings: Vec<Finding>,
    /// Findings past [`MAX_FINDINGS_PER_ENDPOINT`], not kept.
    pub more: usize,
    /// Where the baseline's runs disagree (kind and path): left out of the findings.
    pub noise: BTreeSet<(String, String)>,
}

/// The findings of a run, by endpoint.
#[derive(Debug, Default, PartialEq)]
pub struct Findings {
    pub endpoints: BTreeMap<String, EndpointFindings>,
}

/// Compares every observation and returns what the sandbox changed, noise left out.
pub fn findings(observations: &[Observation<'_>]) -> Findings {
    // Noise is learned over every request of an endpoint first: a field that varied between the
    // baseline runs of one request is noise in all of them.
    let mut noise: BTreeMap<&str, Noise> = BTreeMap::new();
    for o in observations {
        let n = noise.entry(&o.endpoint).or_default();
        let [b1, b2] = o.baseline;
        for d in compare(b1, b2).differences {
            n.learn(&d);
        }
        if let Some([c1, c2, _]) = o.calls {
            for d in compare_calls(c1, c2) {
                n.learn(&d);
            }
        }
        if b1.error != b2.error {
            n.error = true;
        }
    }
    let mut out = Findings::default();
    // (endpoint) -> (rank, kind, at) -> finding, so repeats fold into one with a count.
    let mut found: BTreeMap<&str, BTreeMap<(Rank, &'static str, String), Finding>> =
        BTreeMap::new();
    for o in observations {
        let n = &noise[o.endpoint.as_str()];
        let at = found.entry(&o.endpoint).or_default();
        let mut add = |rank: Rank, mut d: Difference| {
            d.at = normalize(&d.at);
            at.entry((rank, d.kind, d.at.clone()))
                .and_modify(|f| f.occurrences += 1)
                .or_insert(Finding {
                    rank,
                    difference: d,
                    occurrences: 1,
                });
        };
        let baseline = o.baseline[0];
        if baseline.error != o.sandbox.error && !n.error {
            let side = |e: &str| (!e.is_empty()).then(|| Value::from(e));
            add(
                Rank::Status,
                Difference {
                    kind: "error",
                    at: String::new(),
                    baseline: side(&baseline.error),
                    sandbox: side(&o.sandbox.error),
                },
            );
        }
        let calls = o
            .calls
            .map(|[c1, _, cs]| compare_calls(c1, cs))
            .unwrap_or_default();
        for d in compare(baseline, o.sandbox)
            .differences
            .into_iter()
            .chain(calls)
        {
            let rank = rank(&d);
            if !n.masks(&d, rank) {
                add(rank, d);
            }
        }
        if let Some(d) = slow(o) {
            add(Rank::Timing, d);
        }
    }
    for (endpoint, found) in found {
        let mut findings: Vec<Finding> = found.into_values().collect();
        // The map's order is rank, kind, path: the most important first, stable between runs.
        let more = findings.len().saturating_sub(MAX_FINDINGS_PER_ENDPOINT);
        findings.truncate(MAX_FINDINGS_PER_ENDPOINT);
        let noise = noise
            .get(endpoint)
            .map(|n| n.seen.clone())
            .unwrap_or_default();
        out.endpoints.insert(
            endpoint.to_owned(),
            EndpointFindings {
                findings,
                more,
                noise,
            },
        );
    }
    out
}

impl Findings {
    /// How many findings in all (those past the per-endpoint cap included).
    pub fn count(&self) -> usize {
        self.endpoints
            .values()
            .map(|e| e.findings.len() + e.more)
            .sum()
    }

    /// The `n` most important findings over every endpoint, with their endpoint.
    pub fn top(&self, n: usize) -> Vec<(&str, &Finding)> {
        let mut all: Vec<(&str, &Finding)> = self
            .endpoints
            .iter()
            .flat_map(|(e, f)| f.findings.iter().map(move |f| (e.as_str(), f)))
            .collect();
        all.sort_by_key(|(e, f)| (f.rank, *e));
        all.truncate(n);
        all
    }

    pub fn to_json(&self) -> Value {
        let endpoints: Vec<Value> = self
            .endpoints
            .iter()
            .map(|(endpoint, e)| {
                let findings: Vec<Value> = e
                    .findings
                    .iter()
                    .map(|f| {
                        let mut v = f.difference.to_json();
                        v["rank"] = f.rank.as_str().into();
                        v["occurrences"] = f.occurrences.into();
                        v
                    })
                    .collect();
                let noise: Vec<Value> = e
                    .noise
                    .iter()
                    .map(|(kind, at)| json!({"kind": kind, "at": at}))
                    .collect();
                json!({"endpoint": endpoint, "findings": findings, "more": e.more, "noise": noise})
            })
            .collect();
        json!({"count": self.count(), "endpoints": endpoints})
    }
}

/// The differences the baseline's runs showed on one endpoint.
#[derive(Debug, Default)]
struct Noise {
    /// (kind, normalized path) of every difference.
    seen: BTreeSet<(String, String)>,
    /// Those of them that changed the shape (a field present in one run only, another type).
    schema: BTreeSet<(String, String)>,
    /// JSON paths whose value was of another type in each run (`null` in one, an object in the
    /// other): whatever is under them varies too. An element present in one run only is not
    /// here: a list of varying length says nothing of the fields of its other elements.
    replaced: BTreeSet<String>,
    /// The runs disagreed on a transport error.
    error: bool,
}

impl Noise {
    fn learn(&mut self, d: &Difference) {
        let key = (d.kind.to_owned(), normalize(&d.at));
        if rank(d) <= Rank::Schema {
            self.schema.insert(key.clone());
            if d.kind == "json" && d.baseline.is_some() && d.sandbox.is_some() {
                self.replaced.insert(key.1.clone());
            }
        }
        self.seen.insert(key);
    }

    /// Whether the baseline's own runs explain the difference `d` of rank `rank`: the same place
    /// varied there (a value varying masks values only; a shape varying masks both), or a place
    /// that holds it was of another type in each run.
    fn masks(&self, d: &Difference, rank: Rank) -> bool {
        let at = normalize(&d.at);
        let key = (d.kind.to_owned(), at.clone());
        if rank == Rank::Schema && self.schema.contains(&key) {
            return true;
        }
        if rank >= Rank::Value && self.seen.contains(&key) {
            return true;
        }
        if rank == Rank::Status {
            // A status that flips between the baseline's own runs is flaky, not changed.
            return self.seen.contains(&key);
        }
        match d.kind {
            "json" => self.replaced.iter().any(|noisy| holds(noisy, &at)),
            // Text and bytes: any line or byte that varied makes the body noise; a structure
            // to tell which part is which is not there.
            "line" | "binary" | "grpc" | "bodySize" => {
                rank >= Rank::Value && self.seen.iter().any(|(kind, _)| kind == d.kind)
            }
            // Paths that varied between the baseline's runs (an id in the path): every path
            // of that call is noise.
            "callPath" => {
                let group = group_of(&d.at);
                self.seen
                    .iter()
                    .any(|(kind, at)| kind == "callPath" && group_of(at) == group)
            }
            _ => false,
        }
    }
}

/// Whether JSON path `outer` is a strict prefix of `inner` (an object or array holding it).
fn holds(outer: &str, inner: &str) -> bool {
    inner.len() > outer.len()
        && inner.starts_with(outer)
        && matches!(inner.as_bytes()[outer.len()], b'.' | b'[')
}

fn rank(d: &Difference) -> Rank {
    let grpc_status = |d: &Difference| d.at.eq_ignore_ascii_case("grpc-status");
    match d.kind {
        "status" | "error" | "callStatus" => Rank::Status,
        "trailer" | "header" if grpc_status(d) => Rank::Status,
        "header" | "trailer" | "call" | "callPath"
            if d.baseline.is_none() || d.sandbox.is_none() =>
        {
            Rank::Schema
        }
        "json" => match (&d.baseline, &d.sandbox) {
            (Some(b), Some(s)) if std::mem::discriminant(b) == std::mem::discriminant(s) => {
                Rank::Value
            }
            _ => Rank::Schema,
        },
        _ => Rank::Value,
    }
}

/// Whether a sandbox answer that took `took` µs is much slower than the slower of the
/// baseline's two (`baseline`, µs): what makes a timing finding.
pub fn is_slow(baseline: [u64; 2], took: u64) -> bool {
    let base = baseline[0].max(baseline[1]);
    let bound = base
        .saturating_mul(TIMING_FACTOR)
        .max(base.saturating_add(TIMING_SLACK_MICROS));
    base > 0 && took > bound
}

/// The sandbox's answer, when much slower than both of the baseline's.
fn slow(o: &Observation<'_>) -> Option<Difference> {
    let [b1, b2] = o.baseline;
    let base = b1.duration_micros.max(b2.duration_micros);
    let took = o.sandbox.duration_micros;
    is_slow([b1.duration_micros, b2.duration_micros], took).then(|| Difference {
        kind: "duration",
        at: String::new(),
        baseline: Some(format!("{} ms", base / 1000).into()),
        sandbox: Some(format!("{} ms", took / 1000).into()),
    })
}

/// A JSON path with every array index as `[*]` (`$.items[3].id` → `$.items[*].id`); a quoted key
/// (`["a b"]`) is kept as it is. Other paths (header names, line numbers) are returned unchanged.
pub fn normalize(at: &str) -> String {
    if !at.starts_with('$') {
        return at.to_owned();
    }
    let mut out = String::with_capacity(at.len());
    let mut rest = at;
    while let Some(i) = rest.find('[') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && after.as_bytes().get(digits) == Some(&b']') {
            out.push_str("[*]");
            rest = &after[digits + 1..];
        } else if after.starts_with('"') {
            // A quoted key: up to its closing quote (JSON escapes inside), then `]`.
            let end = quoted_end(after).map_or(after.len(), |e| e + 1);
            out.push('[');
            out.push_str(&after[..end]);
            rest = &after[end..];
        } else {
            out.push('[');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The index of the quote that closes the JSON string `s` starts with.
fn quoted_end(s: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in s.char_indices().skip(1) {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{exchange, header};
    use spur_proto::traffic::Body;

    fn answer(status: u32, body: Value, micros: u64) -> Exchange {
        let mut x = exchange("api", "GET", "/items", 0);
        x.status = status;
        x.duration_micros = micros;
        x.response_headers = vec![header("content-type", b"application/json")];
        let data = serde_json::to_vec(&body).unwrap();
        x.response_body = Some(Body {
            size: data.len() as u64,
            data,
            truncated: false,
        });
        x
    }

    fn items(ids: [&str; 2], at: &str, price: bool) -> Value {
        let item = |id: &str| {
            let mut v = json!({"id": id, "name": "tea"});
            if price {
                v["price"] = json!(3);
            }
            v
        };
        json!({"items": [item(ids[0]), item(ids[1])], "generatedAt": at})
    }

    fn run(b1: &Exchange, b2: &Exchange, s: &Exchange) -> Findings {
        findings(&[Observation {
            endpoint: "GET /items".into(),
            baseline: [b1, b2],
            sandbox: s,
            calls: None,
        }])
    }

    fn summary(f: &Findings) -> Vec<String> {
        f.top(100)
            .iter()
            .map(|(e, f)| {
                format!(
                    "{e} {} {} x{}",
                    f.rank.as_str(),
                    f.difference.render(),
                    f.occurrences
                )
            })
            .collect()
    }

    #[test]
    fn an_unchanged_fork_has_no_findings_despite_ids_and_timestamps() {
        let b1 = answer(200, items(["a1", "a2"], "t1", true), 1000);
        let b2 = answer(200, items(["b1", "b2"], "t2", true), 1200);
        let s = answer(200, items(["c1", "c2"], "t3", true), 1100);
        let f = run(&b1, &b2, &s);
        assert_eq!(f.count(), 0, "{:?}", summary(&f));
        let noise = &f.endpoints["GET /items"].noise;
        assert!(noise.contains(&("json".into(), "$.items[*].id".into())));
        assert!(noise.contains(&("json".into(), "$.generatedAt".into())));
    }

    #[test]
    fn a_removed_field_is_one_schema_finding_however_many_elements_lost_it() {
        let b1 = answer(200, items(["a1", "a2"], "t1", true), 1000);
        let b2 = answer(200, items(["b1", "b2"], "t2", true), 1000);
        let s = answer(200, items(["c1", "c2"], "t3", false), 1000);
        let f = run(&b1, &b2, &s);
        assert_eq!(
            summary(&f),
            ["GET /items schema $.items[*].price: removed 3 x2"]
        );
    }

    #[test]
    fn a_value_that_varies_is_noise_but_its_removal_is_not() {
        let b1 = answer(200, json!({"at": "t1", "n": 1}), 1000);
        let b2 = answer(200, json!({"at": "t2", "n": 1}), 1000);
        let s = answer(200, json!({"n": 2}), 1000);
        assert_eq!(
            summary(&run(&b1, &b2, &s)),
            [
                "GET /items schema $.at: removed \"t1\" x1",
                "GET /items value $.n: 1 → 2 x1",
            ]
        );
        // Of another type: a schema change too.
        let s = answer(200, json!({"at": 5, "n": 1}), 1000);
        assert_eq!(
            summary(&run(&b1, &b2, &s)),
            ["GET /items schema $.at: string \"t1\" → number 5 x1"]
        );
    }

    #[test]
    fn a_set_in_another_order_is_noise_an_element_gone_is_not() {
        let b1 = answer(200, json!({"tags": ["a", "b"]}), 1000);
        let b2 = answer(200, json!({"tags": ["b", "a"]}), 1000);
        let s = answer(200, json!({"tags": ["b"]}), 1000);
        assert_eq!(
            summary(&run(&b1, &b2, &s)),
            ["GET /items schema $.tags[*]: removed \"b\" x1"]
        );
        let s = answer(200, json!({"tags": ["b", "a"]}), 1000);
        assert_eq!(run(&b1, &b2, &s).count(), 0);
    }

    #[test]
    fn a_whole_object_that_varies_masks_what_is_under_it() {
        let b1 = answer(200, json!({"trace": null, "n": 1}), 1000);
        let b2 = answer(200, json!({"trace": {"span": "x"}, "n": 1}), 1000);
        let s = answer(
            200,
            json!({"trace": {"span": "y", "more": 1}, "n": 1}),
            1000,
        );
        assert_eq!(run(&b1, &b2, &s).count(), 0);
    }

    #[test]
    fn a_list_of_varying_length_does_not_hide_a_field_removed_from_its_elements() {
        let b1 = answer(200, json!({"items": [{"id": 1, "price": 3}]}), 1000);
        let b2 = answer(
            200,
            json!({"items": [{"id": 1, "price": 3}, {"id": 2, "price": 4}]}),
            1000,
        );
        let s = answer(200, json!({"items": [{"id": 1}, {"id": 2}]}), 1000);
        assert_eq!(
            summary(&run(&b1, &b2, &s)),
            ["GET /items schema $.items[*].price: removed 3 x1"]
        );
    }

    #[test]
    fn status_errors_and_grpc_status_rank_first() {
        let b = answer(200, json!({"n": 1}), 1000);
        let mut s = answer(500, json!({"n": 1, "extra": true}), 1000);
        assert_eq!(
            summary(&run(&b, &b, &s)),
            [
                "GET /items status status: 200 → 500 x1",
                "GET /items schema $.extra: added true x1",
            ]
        );
        let mut g = exchange("api", "POST", "/shop.Items/Get", 0);
        g.response_trailers = vec![header("grpc-status", b"0")];
        s = g.clone();
        s.response_trailers = vec![header("grpc-status", b"14")];
        assert_eq!(
            summary(&run(&g, &g, &s)),
            ["GET /items status trailer grpc-status: \"0\" → \"14\" x1"]
        );
        s = g.clone();
        s.error = "connection reset".into();
        assert_eq!(
            summary(&run(&g, &g, &s)),
            ["GET /items status error: added \"connection reset\" x1"]
        );
    }

    #[test]
    fn a_status_that_flips_in_the_baseline_is_flaky_not_a_finding() {
        let b1 = answer(200, json!({}), 1000);
        let b2 = answer(503, json!({}), 1000);
        let s = answer(503, json!({}), 1000);
        assert_eq!(run(&b1, &b2, &s).count(), 0);
    }

    #[test]
    fn slow_is_three_times_and_100ms_past_the_slower_baseline() {
        let b1 = answer(200, json!({}), 10_000);
        let b2 = answer(200, json!({}), 20_000);
        // 60 ms is three times 20 ms but not 100 ms past it.
        assert_eq!(run(&b1, &b2, &answer(200, json!({}), 110_000)).count(), 0);
        assert_eq!(
            summary(&run(&b1, &b2, &answer(200, json!({}), 130_000))),
            ["GET /items timing duration: \"20 ms\" → \"130 ms\" x1"]
        );
    }

    #[test]
    fn noise_is_learned_across_the_requests_of_an_endpoint() {
        // The first request's baseline runs agree; the second's do not on `at`.
        let a = answer(200, json!({"at": "t"}), 1000);
        let (b1, b2) = (
            answer(200, json!({"at": "t1"}), 1000),
            answer(200, json!({"at": "t2"}), 1000),
        );
        let s = answer(200, json!({"at": "t9"}), 1000);
        let o = |b: [&'static Exchange; 2], s: &'static Exchange| Observation {
            endpoint: "GET /items".into(),
            baseline: b,
            sandbox: s,
            calls: None,
        };
        let (a, b1, b2, s) = (leak(a), leak(b1), leak(b2), leak(s));
        assert_eq!(findings(&[o([a, a], s), o([b1, b2], s)]).count(), 0);
        assert_eq!(findings(&[o([a, a], s)]).count(), 1);
    }

    fn leak(x: Exchange) -> &'static Exchange {
        Box::leak(Box::new(x))
    }

    #[test]
    fn findings_per_endpoint_are_capped_and_counted() {
        let many = |v: i64| Value::Object((0..30).map(|i| (format!("f{i}"), json!(v))).collect());
        let b = answer(200, many(1), 1000);
        let s = answer(200, many(2), 1000);
        let f = run(&b, &b, &s);
        let e = &f.endpoints["GET /items"];
        assert_eq!((e.findings.len(), e.more, f.count()), (20, 10, 30));
        let j = f.to_json();
        assert_eq!(j["count"], 30);
        assert_eq!(j["endpoints"][0]["findings"][0]["rank"], "value");
    }

    #[test]
    fn normalize_indices_but_not_quoted_keys() {
        assert_eq!(normalize("$.a[3].b[10][2]"), "$.a[*].b[*][*]");
        assert_eq!(normalize(r#"$["x[1]"][0]"#), r#"$["x[1]"][*]"#);
        assert_eq!(normalize(r#"$["q\"[2]"].c"#), r#"$["q\"[2]"].c"#);
        assert_eq!(normalize("content-type"), "content-type");
        assert_eq!(normalize("$[abc"), "$[abc");
        assert_eq!(normalize("$[\"open"), "$[\"open");
        assert!(holds("$.a", "$.a.b") && holds("$.a", "$.a[*]"));
        assert!(!holds("$.a", "$.ab") && !holds("$.a", "$.a"));
    }
    #[test]
    fn downstream_calls_are_compared_with_their_noise_learned() {
        use crate::calls::Calls;
        use spur_proto::traffic::Workload;
        let call = |workload: &str, path: &str, status: u32| Exchange {
            method: "GET".into(),
            path: path.into(),
            status,
            baseline: Some(Workload {
                kind: "Deployment".into(),
                namespace: "shop".into(),
                name: workload.into(),
            }),
            ..Exchange::default()
        };
        let answer = Exchange {
            status: 200,
            ..Exchange::default()
        };
        let run = |b1: &[Exchange], b2: &[Exchange], s: &[Exchange]| {
            let [c1, c2, cs] = [b1, b2, s].map(Calls::from_exchanges);
            let f = findings(&[Observation {
                endpoint: "GET /".into(),
                baseline: [&answer, &answer],
                sandbox: &answer,
                calls: Some([&c1, &c2, &cs]),
            }]);
            f.top(10)
                .iter()
                .map(|(_, f)| format!("{} {}", f.rank.as_str(), f.difference.render_shape()))
                .collect::<Vec<_>>()
        };
        let catalog = [call("catalog", "/catalog", 200)];
        assert!(run(&catalog, &catalog, &catalog).is_empty());
        // A call the fork no longer makes, one it makes anew, one answered otherwise.
        assert_eq!(
            run(&catalog, &catalog, &[]),
            ["schema call GET shop/catalog: removed"]
        );
        assert_eq!(
            run(
                &catalog,
                &catalog,
                &[catalog[0].clone(), call("audit", "/log", 200)]
            ),
            ["schema call GET shop/audit: added"]
        );
        assert_eq!(
            run(&catalog, &catalog, &[call("catalog", "/catalog", 503)]),
            ["status call GET shop/catalog status: \"200\" → \"503\""]
        );
        // Paths with an id in them vary between the baseline's runs: noise, for every path of
        // that call; a call the baseline makes only sometimes is noise too.
        let (u1, u2, u3) = (
            [call("users", "/users/1", 200)],
            [call("users", "/users/2", 200)],
            [call("users", "/users/3", 200)],
        );
        assert!(run(&u1, &u2, &u3).is_empty());
        assert!(run(&catalog, &[], &[]).is_empty());
        // The shape hidden there, a removal is still seen elsewhere.
        assert_eq!(run(&u1, &u2, &[]), ["schema call GET shop/users: removed"]);
    }
}
