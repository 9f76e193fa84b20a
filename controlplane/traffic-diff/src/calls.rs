//! The calls a request caused downstream, as sidecars captured them during a smart test's run:
//! grouped by method and the baseline workload that received them, with the paths called and
//! the statuses answered. Two sides' calls are compared as sets (a call made or no longer
//! made, made more or fewer times, to other paths, answered with another status), never body
//! by body: the request's own answer is what the run diffs in depth.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use spur_proto::traffic::{Exchange, Protocol};

use crate::compare::Difference;
#[cfg(test)]
use crate::compare::group_of;

/// The calls one request caused, by `METHOD namespace/workload`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Calls {
    groups: BTreeMap<String, Group>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Group {
    count: usize,
    /// Paths without their query (a query often carries ids).
    paths: BTreeSet<String>,
    /// How they were answered: the HTTP status, the gRPC status (`grpc-status 14`) or `error`,
    /// with how many times.
    statuses: BTreeMap<String, usize>,
}

impl Calls {
    /// The calls among `exchanges` (as a sidecar captured them: the baseline workload that
    /// received each).
    pub fn from_exchanges<'a>(exchanges: impl IntoIterator<Item = &'a Exchange>) -> Calls {
        let mut calls = Calls::default();
        for x in exchanges {
            let workload = x
                .baseline
                .as_ref()
                .map_or_else(|| "?".to_owned(), |b| format!("{}/{}", b.namespace, b.name));
            let group = calls
                .groups
                .entry(format!("{} {workload}", x.method))
                .or_default();
            group.count += 1;
            let path = x.path.split('?').next().unwrap_or_default();
            group.paths.insert(path.to_owned());
            *group.statuses.entry(answered(x)).or_default() += 1;
        }
        calls
    }

    /// How many calls in all.
    pub fn len(&self) -> usize {
        self.groups.values().map(|g| g.count).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// `[{call, count, paths, statuses}]`, for a report.
    pub fn to_json(&self) -> Value {
        let calls: Vec<Value> = self
            .groups
            .iter()
            .map(|(call, g)| {
                json!({"call": call, "count": g.count, "paths": g.paths, "statuses": g.statuses})
            })
            .collect();
        Value::Array(calls)
    }
}

/// How an exchange was answered, as calls compare it.
fn answered(x: &Exchange) -> String {
    if !x.error.is_empty() && x.status == 0 {
        return "error".to_owned();
    }
    let grpc = x.protocol == i32::from(Protocol::Grpc);
    let trailer = x
        .response_trailers
        .iter()
        .chain(&x.response_headers)
        .find(|h| h.name.eq_ignore_ascii_case("grpc-status"));
    match trailer {
        // A number, or `?`: the status shows where readers of a Sandbox's Events do, and a
        // service's own text has no place there.
        Some(h) if grpc || x.status == 200 => match std::str::from_utf8(&h.value)
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
        {
            Some(code) => format!("grpc-status {code}"),
            None => "grpc-status ?".to_owned(),
        },
        _ => x.status.to_string(),
    }
}

/// How `sandbox`'s calls differ from `baseline`'s:
/// - `call` at `METHOD ns/workload`: made on one side only (the count on the side that made
///   it), or made another number of times (both counts);
/// - `callPath` at `METHOD ns/workload /path`: a path called on one side only;
/// - `callStatus` at `METHOD ns/workload`: answered with other statuses (each side's, with
///   their counts, as `200 x2, 503`).
pub fn compare_calls(baseline: &Calls, sandbox: &Calls) -> Vec<Difference> {
    let mut out = Vec::new();
    let names: BTreeSet<&String> = baseline
        .groups
        .keys()
        .chain(sandbox.groups.keys())
        .collect();
    for name in names {
        match (baseline.groups.get(name), sandbox.groups.get(name)) {
            (Some(b), None) => out.push(call(name, Some(b.count), None)),
            (None, Some(s)) => out.push(call(name, None, Some(s.count))),
            (Some(b), Some(s)) => {
                if b.count != s.count {
                    out.push(call(name, Some(b.count), Some(s.count)));
                }
                for p in b.paths.difference(&s.paths) {
                    out.push(path(name, p, Some(b.count), None));
                }
                for p in s.paths.difference(&b.paths) {
                    out.push(path(name, p, None, Some(s.count)));
                }
                // Which statuses, not how many of each: a count that changed is the call's.
                if !b.statuses.keys().eq(s.statuses.keys()) {
                    out.push(Difference {
                        kind: "callStatus",
                        at: name.clone(),
                        baseline: Some(statuses(&b.statuses).into()),
                        sandbox: Some(statuses(&s.statuses).into()),
                    });
                }
            }
            (None, None) => {}
        }
    }
    out
}

fn call(name: &str, b: Option<usize>, s: Option<usize>) -> Difference {
    Difference {
        kind: "call",
        at: name.to_owned(),
        baseline: b.map(Value::from),
        sandbox: s.map(Value::from),
    }
}

fn path(name: &str, path: &str, b: Option<usize>, s: Option<usize>) -> Difference {
    Difference {
        kind: "callPath",
        at: format!("{name} {path}"),
        baseline: b.map(|_| Value::from(path)),
        sandbox: s.map(|_| Value::from(path)),
    }
}

/// `200 x2, 503`.
fn statuses(s: &BTreeMap<String, usize>) -> String {
    s.iter()
        .map(|(status, n)| match n {
            1 => status.clone(),
            n => format!("{status} x{n}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_proto::traffic::{Header, Workload};

    fn x(method: &str, workload: &str, path: &str, status: u32) -> Exchange {
        Exchange {
            method: method.into(),
            path: path.into(),
            status,
            baseline: Some(Workload {
                kind: "Deployment".into(),
                namespace: "shop".into(),
                name: workload.into(),
            }),
            ..Exchange::default()
        }
    }

    fn rendered(b: &[Exchange], s: &[Exchange]) -> Vec<String> {
        compare_calls(&Calls::from_exchanges(b), &Calls::from_exchanges(s))
            .iter()
            .map(Difference::render)
            .collect()
    }

    #[test]
    fn calls_differ_by_workload_count_path_and_status() {
        let same = [
            x("GET", "catalog", "/catalog?id=1", 200),
            x("GET", "catalog", "/catalog?id=2", 200),
        ];
        assert!(rendered(&same, &same).is_empty());
        let other_query = [
            x("GET", "catalog", "/catalog?id=7", 200),
            x("GET", "catalog", "/catalog?id=8", 200),
        ];
        assert!(
            rendered(&same, &other_query).is_empty(),
            "queries are not compared"
        );
        assert_eq!(rendered(&same, &[]), ["call GET shop/catalog: removed 2"]);
        assert_eq!(
            rendered(&[], &[x("POST", "audit", "/log", 204)]),
            ["call POST shop/audit: added 1"]
        );
        assert_eq!(
            rendered(&same, &same[..1]),
            ["call GET shop/catalog: 2 → 1"]
        );
        assert_eq!(
            rendered(&same[..1], &[x("GET", "catalog", "/v2/catalog", 503)]),
            [
                "call GET shop/catalog /catalog: removed \"/catalog\"",
                "call GET shop/catalog /v2/catalog: added \"/v2/catalog\"",
                "call GET shop/catalog status: \"200\" → \"503\"",
            ]
        );
    }

    #[test]
    fn grpc_calls_are_answered_by_their_grpc_status() {
        let mut ok = x("POST", "catalog", "/spur.demo.v1.Demo/Price", 200);
        ok.protocol = i32::from(Protocol::Grpc);
        ok.response_trailers = vec![Header {
            name: "grpc-status".into(),
            value: b"0".to_vec(),
        }];
        let mut down = ok.clone();
        down.response_trailers[0].value = b"14".to_vec();
        let mut odd = ok.clone();
        odd.response_trailers[0].value = b"<script>".to_vec();
        assert_eq!(answered(&odd), "grpc-status ?");
        let mut failed = ok.clone();
        failed.status = 0;
        failed.error = "upstream reset".into();
        let d = compare_calls(
            &Calls::from_exchanges([&ok, &ok]),
            &Calls::from_exchanges([&down, &failed]),
        );
        assert_eq!(d.len(), 1);
        assert_eq!(
            d[0].render(),
            "call POST shop/catalog status: \"grpc-status 0 x2\" → \"error, grpc-status 14\""
        );
        assert_eq!(group_of("GET shop/catalog /x"), "GET shop/catalog");
        assert_eq!(group_of("GET shop/catalog"), "GET shop/catalog");
    }
}
