//! One run of a test: each step sent (or, a script, run) to the baseline, to the sandbox and to
//! the baseline again, in that order (so a value that drifts with time brackets the sandbox's
//! answer), its checks evaluated on every answer, and the findings of the whole run
//! (`spur_traffic_diff::findings`: the baseline's two answers teach what is noise). How it reads
//! for a person is `render`.

use serde_json::{Value, json};
use spur_proto::traffic::Exchange;
use spur_traffic_diff::Calls;
use spur_traffic_diff::findings::{Findings, Observation, findings};

use crate::calls::{CallPlan, Pass, attribute};
use crate::exec::{Side, execute};
use crate::path::JsonPath;
use crate::send::send;
use crate::spec::{Action, Check, Prepared};
use crate::summary::{CallsBrief, FailedCheck, Summary, TopFinding};

/// What one step got.
#[derive(Debug)]
pub struct StepResult {
    pub name: String,
    pub endpoint: String,
    /// The baseline's answers, before and after the sandbox's.
    pub baseline: [Exchange; 2],
    pub sandbox: Exchange,
    /// The answers as compared, when they are gRPC answers decoded with the step's descriptor
    /// set: baseline, baseline, sandbox, each body the JSON of its message.
    pub decoded: Option<[Exchange; 3]>,
    pub checks: Vec<CheckResult>,
    /// The calls each request caused downstream (baseline, baseline, sandbox), when the run
    /// captured them ([`RunReport::attach_calls`]).
    pub calls: Option<[Calls; 3]>,
}

impl StepResult {
    /// The answers the diff compares (baseline, baseline, sandbox): decoded when they could be.
    pub fn compared(&self) -> [&Exchange; 3] {
        match &self.decoded {
            Some([a, b, s]) => [a, b, s],
            None => [&self.baseline[0], &self.baseline[1], &self.sandbox],
        }
    }
}

/// A check, as each side's answers met it (`Err`: why not).
#[derive(Debug, PartialEq)]
pub struct CheckResult {
    pub check: String,
    pub sandbox: Result<(), String>,
    /// The first of the baseline's answers that failed it, if one did: a check the baseline
    /// fails too is a wrong test (or a broken baseline), not the sandbox's doing.
    pub baseline: Result<(), String>,
}

/// A whole run.
#[derive(Debug)]
pub struct RunReport {
    pub routing_key: String,
    pub steps: Vec<StepResult>,
    pub findings: Findings,
    /// How the run's downstream calls were captured, when they were.
    pub calls: Option<CallsSeen>,
}

/// What a run's capture of downstream calls saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallsSeen {
    /// Where it captured: the namespaces the sandbox forks from.
    pub namespaces: Vec<String>,
    /// Baselines there whose sidecars were watching their capture settings.
    pub watching: u32,
    /// Exchanges captured with the run's keys while it ran.
    pub captured: usize,
    /// Of them, those without this run's marker (not attributed to a step).
    pub unmarked: usize,
    /// Past the most a run takes in: not looked at.
    pub skipped: usize,
}

/// Runs `steps` with the sandbox's routing key `key`. With `plan` (the run captures its calls),
/// the baseline's requests carry the run's reference key and every request its marker.
pub async fn run(steps: &[Prepared], key: &str, plan: Option<&CallPlan>) -> RunReport {
    let mut results = Vec::with_capacity(steps.len());
    for (i, step) in steps.iter().enumerate() {
        let marker = |pass| plan.map(|p| p.marker(i, pass));
        let reference = plan.map(|p| p.reference_key.as_str());
        let first = pass(step, Side::Baseline, reference, marker(Pass::Baseline1)).await;
        let mut sandbox = pass(step, Side::Sandbox, Some(key), marker(Pass::Sandbox)).await;
        let second = pass(step, Side::Baseline, reference, marker(Pass::Baseline2)).await;
        // One slow answer is often the network's (a retransmitted SYN, a cold connection) or,
        // for a script, a slow process start, not the fork's: a sandbox answer that would be a
        // timing finding is timed once more, for a request safe to repeat (HTTP GET or HEAD) or
        // a script (run three times by design), and the faster time counts. A fork that is slow
        // stays slow.
        let repeatable = step.script().is_some()
            || step.request().is_some_and(|r| {
                !r.grpc && matches!(r.method, http::Method::GET | http::Method::HEAD)
            });
        if repeatable
            && sandbox.error.is_empty()
            && spur_traffic_diff::findings::is_slow(
                [first.duration_micros, second.duration_micros],
                sandbox.duration_micros,
            )
        {
            let again = pass(step, Side::Sandbox, Some(key), marker(Pass::SandboxAgain)).await;
            if again.error.is_empty() && again.status == sandbox.status {
                sandbox.duration_micros = sandbox.duration_micros.min(again.duration_micros);
            }
        }
        let streams = step.request().is_some_and(|r| r.grpc_server_streaming);
        let output = step.request().and_then(|r| r.grpc_output.as_ref());
        let decoded = output.map(|output| {
            [
                decode(output, streams, &first),
                decode(output, streams, &second),
                decode(output, streams, &sandbox),
            ]
        });
        // JSON paths read the decoded message; everything else the answer as it came.
        let (b1, b2, s) = match &decoded {
            Some([b1, b2, s]) => (b1, b2, s),
            None => (&first, &second, &sandbox),
        };
        let checks = step
            .checks
            .iter()
            .map(|c| {
                let on = |decoded: &Exchange, raw: &Exchange| {
                    evaluate(c, if c.json_path.is_some() { decoded } else { raw })
                };
                CheckResult {
                    check: describe(c),
                    sandbox: on(s, &sandbox),
                    baseline: on(b1, &first).and_then(|()| on(b2, &second)),
                }
            })
            .collect();
        results.push(StepResult {
            name: step.name.clone(),
            endpoint: step.endpoint.clone(),
            baseline: [first, second],
            sandbox,
            decoded,
            checks,
            calls: None,
        });
    }
    let findings = findings(&observations(&results));
    RunReport {
        routing_key: key.to_owned(),
        steps: results,
        findings,
        calls: None,
    }
}

/// One pass of `step` against `side`: its request sent, or its script run.
async fn pass(step: &Prepared, side: Side, key: Option<&str>, marker: Option<String>) -> Exchange {
    match &step.action {
        Action::Request(r) => send(r, step.timeout, key, marker.as_deref()).await,
        Action::Script(s) => {
            // Its standard error is the runner's: say whose it is.
            eprintln!(
                "── step {} against the {}: {} ──",
                step.name,
                side.as_str(),
                s.program
            );
            execute(s, step.timeout, side, key, marker.as_deref()).await
        }
    }
}

/// What the findings compare, step by step.
fn observations(steps: &[StepResult]) -> Vec<Observation<'_>> {
    steps
        .iter()
        .map(|r| {
            let [b1, b2, s] = r.compared();
            Observation {
                endpoint: r.endpoint.clone(),
                baseline: [b1, b2],
                sandbox: s,
                calls: r.calls.as_ref().map(|[c1, c2, cs]| [c1, c2, cs]),
            }
        })
        .collect()
}

impl RunReport {
    /// Adds the downstream calls the run's capture recorded (`captured`, the exchanges stored
    /// with the run's keys while it ran) to each step, and compares them as the answers are:
    /// the findings are made again.
    pub fn attach_calls(&mut self, plan: &CallPlan, captured: &[Exchange], mut seen: CallsSeen) {
        let attributed = attribute(plan, self.steps.len(), captured);
        for (step, calls) in self.steps.iter_mut().zip(attributed.steps) {
            step.calls = Some(calls);
        }
        seen.captured = captured.len();
        seen.unmarked = attributed.unmarked;
        seen.skipped = attributed.skipped;
        self.calls = Some(seen);
        self.findings = findings(&observations(&self.steps));
    }

    /// Checks the sandbox failed.
    pub fn checks_failed(&self) -> usize {
        self.steps
            .iter()
            .flat_map(|s| &s.checks)
            .filter(|c| c.sandbox.is_err())
            .count()
    }

    /// Whether the sandbox changed nothing the test sees: no finding, no failed check.
    pub fn passed(&self) -> bool {
        self.findings.count() == 0 && self.checks_failed() == 0
    }

    pub fn to_json(&self) -> Value {
        let answer = |x: &Exchange| {
            let mut v = json!({"status": x.status, "durationMicros": x.duration_micros});
            if let Some(code) = grpc_status(x) {
                v["grpcStatus"] = code.into();
            }
            if !x.error.is_empty() {
                v["error"] = x.error.clone().into();
            }
            v
        };
        let outcome = |r: &Result<(), String>| match r {
            Ok(()) => json!("passed"),
            Err(e) => json!({"failed": e}),
        };
        let steps: Vec<Value> = self
            .steps
            .iter()
            .map(|s| {
                let checks: Vec<Value> = s
                    .checks
                    .iter()
                    .map(|c| {
                        json!({"check": c.check, "sandbox": outcome(&c.sandbox),
                               "baseline": outcome(&c.baseline)})
                    })
                    .collect();
                let mut step = json!({
                    "name": s.name,
                    "endpoint": s.endpoint,
                    "sandbox": answer(&s.sandbox),
                    "baseline": [answer(&s.baseline[0]), answer(&s.baseline[1])],
                    "checks": checks,
                });
                if let Some([b1, b2, cs]) = &s.calls {
                    step["calls"] = json!({
                        "sandbox": cs.to_json(),
                        "baseline": [b1.to_json(), b2.to_json()],
                    });
                }
                step
            })
            .collect();
        let mut report = json!({
            "routingKey": self.routing_key,
            "passed": self.passed(),
            "checksFailed": self.checks_failed(),
            "steps": steps,
            "findings": self.findings.to_json(),
        });
        if let Some(c) = &self.calls {
            report["calls"] = json!({
                "namespaces": c.namespaces,
                "watchingBaselines": c.watching,
                "captured": c.captured,
                "unmarked": c.unmarked,
                "skipped": c.skipped,
            });
        }
        report
    }

    /// The run in at most `max_bytes` of JSON (a job's result, 4096 bytes): counts, findings per
    /// rank, then the most important findings and the failed checks for as many as fit; what
    /// did not fit is counted in `omitted`. The whole run is [`RunReport::to_json`].
    pub fn summary(&self, max_bytes: usize) -> String {
        /// Longest text of one finding or check in the summary.
        const TEXT_MAX: usize = 160;
        let cut = |s: String| -> String {
            if s.len() <= TEXT_MAX {
                return s;
            }
            let mut end = TEXT_MAX;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            format!("{}…", &s[..end])
        };
        let mut by_rank = std::collections::BTreeMap::new();
        for e in self.findings.endpoints.values() {
            for f in &e.findings {
                *by_rank.entry(f.rank.as_str().to_owned()).or_insert(0u64) += 1;
            }
        }
        let top: Vec<TopFinding> = self
            .findings
            .top(usize::MAX)
            .into_iter()
            .map(|(endpoint, f)| TopFinding {
                rank: f.rank.as_str().to_owned(),
                endpoint: cut(endpoint.to_owned()),
                what: cut(f.difference.render()),
                shape: cut(f.difference.render_shape()),
                occurrences: f.occurrences as u64,
            })
            .collect();
        let failed: Vec<FailedCheck> = self
            .steps
            .iter()
            .flat_map(|s| s.checks.iter().map(move |c| (s, c)))
            .filter_map(|(s, c)| {
                let why = c.sandbox.as_ref().err()?;
                Some(FailedCheck {
                    step: s.name.clone(),
                    check: cut(c.check.clone()),
                    sandbox: cut(why.clone()),
                })
            })
            .collect();
        // The least important goes first: failed checks are counted above, findings ranked. The
        // k-th removal takes from the longer list (the last failed check or the lowest finding),
        // and each removal shortens the text (an item is longer than the digit `omitted` may
        // gain), so the fewest removals that fit are found by bisection: a run with thousands of
        // findings is serialized a dozen times, not once per finding.
        let kept = |k: usize| {
            let (mut t, mut f) = (top.len(), failed.len());
            for _ in 0..k {
                if f > t {
                    f -= 1;
                } else {
                    t = t.saturating_sub(1);
                }
            }
            (t, f)
        };
        let text = |k: usize| {
            let (t, f) = kept(k);
            let summary = Summary {
                passed: self.passed(),
                steps: self.steps.len(),
                checks_failed: self.checks_failed(),
                findings: self.findings.count(),
                by_rank: by_rank.clone(),
                top: top[..t].to_vec(),
                failed_checks: failed[..f].to_vec(),
                omitted: k,
                calls: self.calls.as_ref().map(|c| CallsBrief {
                    watching_baselines: c.watching,
                    captured: c.captured,
                    unmarked: c.unmarked,
                }),
            };
            serde_json::to_string(&summary).unwrap_or_default()
        };
        let (mut lo, mut hi) = (0, top.len() + failed.len());
        if text(lo).len() <= max_bytes {
            return text(lo);
        }
        // text(lo) does not fit; text(hi) is the smallest there is, returned even if too long.
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if text(mid).len() <= max_bytes {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        text(hi)
    }
}

/// Most messages of one answer decoded to JSON; an answer with more is compared as it came.
const MAX_DECODED: usize = 1000;

/// A gRPC answer with its messages decoded as `output` and written as JSON (one message: the
/// object; several, or a stream's: an array), so the diff compares them field by field and JSON
/// paths read them.
/// Every field is written, defaults too: in protobuf a field left out reads as its default, and
/// a field that went to its default is a value change, not a removal. An answer that does not
/// decode (compressed, cut, not of that type) is kept as it came: the diff then compares its
/// bytes.
fn decode(output: &prost_reflect::MessageDescriptor, streams: bool, x: &Exchange) -> Exchange {
    let mut view = x.clone();
    let Some(body) = &x.response_body else {
        return view;
    };
    if !x.error.is_empty() || body.truncated {
        return view;
    }
    // Bounded: every field of every message is written, so a great many (empty) messages
    // would make a far larger JSON than the answer they came in.
    let Some(frames) = crate::grpc::messages(&body.data).filter(|f| f.len() <= MAX_DECODED) else {
        return view;
    };
    let mut messages = Vec::new();
    let options = prost_reflect::SerializeOptions::new().skip_default_fields(false);
    for m in frames {
        let Ok(message) = prost_reflect::DynamicMessage::decode(output.clone(), m) else {
            return view;
        };
        let Ok(json) = message.serialize_with_options(serde_json::value::Serializer, &options)
        else {
            return view;
        };
        messages.push(json);
    }
    let json = match messages.len() {
        0 if !streams => return view,
        1 if !streams => messages.remove(0),
        _ => Value::Array(messages),
    };
    let data = json.to_string().into_bytes();
    view.response_body = Some(spur_proto::traffic::Body {
        size: data.len() as u64,
        data,
        truncated: false,
    });
    // No longer gRPC frames: the diff reads it as JSON.
    view.protocol = i32::from(spur_proto::traffic::Protocol::Http2);
    for h in &mut view.response_headers {
        if h.name.eq_ignore_ascii_case("content-type") {
            h.value = b"application/json".to_vec();
        }
    }
    view
}

/// The gRPC status of an answer: from its trailers, or its headers for a trailers-only answer.
pub fn grpc_status(x: &Exchange) -> Option<u32> {
    grpc_field(x, "grpc-status").and_then(|v| v.trim().parse().ok())
}

/// The answer's `grpc-message`, as sent (percent-encoded).
pub fn grpc_message(x: &Exchange) -> Option<&str> {
    grpc_field(x, "grpc-message").filter(|m| !m.is_empty())
}

fn grpc_field<'a>(x: &'a Exchange, name: &str) -> Option<&'a str> {
    x.response_trailers
        .iter()
        .chain(&x.response_headers)
        .find(|h| h.name.eq_ignore_ascii_case(name))
        .and_then(|h| std::str::from_utf8(&h.value).ok())
}

fn describe(c: &Check) -> String {
    if let Some(s) = c.status {
        return format!("status {s}");
    }
    if let Some(s) = c.grpc_status {
        return format!("grpc-status {s}");
    }
    if let Some(h) = &c.header {
        return match &h.equals {
            Some(v) => format!("header {} = {v:?}", h.name.to_ascii_lowercase()),
            None => format!("header {} present", h.name.to_ascii_lowercase()),
        };
    }
    if let Some(j) = &c.json_path {
        return match (&j.equals, j.exists) {
            (Some(v), _) => format!("{} = {v}", j.path),
            (None, Some(false)) => format!("{} absent", j.path),
            (None, _) => format!("{} present", j.path),
        };
    }
    "nothing".into()
}

/// Whether answer `x` meets check `c`.
pub fn evaluate(c: &Check, x: &Exchange) -> Result<(), String> {
    if !x.error.is_empty() {
        return Err(format!("no answer: {}", x.error));
    }
    if let Some(want) = c.status {
        return (x.status == u32::from(want))
            .then_some(())
            .ok_or_else(|| format!("status {}", x.status));
    }
    if let Some(want) = c.grpc_status {
        return match grpc_status(x) {
            Some(got) if got == want => Ok(()),
            Some(got) => Err(format!("grpc-status {got}")),
            None => Err(format!("no grpc-status (HTTP status {})", x.status)),
        };
    }
    if let Some(h) = &c.header {
        let found = x
            .response_headers
            .iter()
            .find(|r| r.name.eq_ignore_ascii_case(&h.name));
        return match (found, &h.equals) {
            (None, _) => Err("absent".into()),
            (Some(_), None) => Ok(()),
            (Some(r), Some(want)) if r.value == want.as_bytes() => Ok(()),
            (Some(r), Some(_)) => Err(format!("{:?}", String::from_utf8_lossy(&r.value))),
        };
    }
    if let Some(j) = &c.json_path {
        let path = JsonPath::parse(&j.path)?;
        let body = x.response_body.as_ref().map(|b| (&b.data, b.truncated));
        let value: Value = match body {
            Some((_, true)) => {
                return Err("the body is larger than the runner keeps (256 KiB)".into());
            }
            Some((data, false)) => {
                serde_json::from_slice(data).map_err(|e| format!("the body is not JSON ({e})"))?
            }
            None => return Err("no body".into()),
        };
        let at = path.get(&value);
        return match (at, &j.equals, j.exists.unwrap_or(true)) {
            (None, _, false) => Ok(()),
            (Some(v), _, false) => Err(format!("present: {v}")),
            (None, _, true) => Err("absent".into()),
            (Some(_), None, true) => Ok(()),
            (Some(v), Some(want), true) if v == want => Ok(()),
            (Some(v), Some(_), true) => Err(format!("{v}")),
        };
    }
    Err("a check with nothing to check".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{HeaderCheck, JsonPathCheck};
    use spur_proto::traffic::{Body, Header};

    /// A stream's answer is a list even when it holds one message (so `$[0].x` reads it, and a
    /// stream that gives one message more or less is a list's change); a unary answer is the
    /// message itself.
    #[test]
    fn a_streamed_answer_is_a_list_even_of_one() {
        let pool = prost_reflect::DescriptorPool::decode(
            &include_bytes!("../../../dataplane/demo-apps/proto/demo.fds")[..],
        )
        .unwrap();
        let reply = pool.get_message_by_name("spur.demo.v1.HelloReply").unwrap();
        // message "hi" (field 1), once.
        let body = crate::grpc::frame(b"\x0a\x02hi".to_vec());
        let x = Exchange {
            response_body: Some(Body {
                size: body.len() as u64,
                data: body,
                truncated: false,
            }),
            ..Exchange::default()
        };
        let json = |x: &Exchange| -> serde_json::Value {
            serde_json::from_slice(&x.response_body.as_ref().unwrap().data).unwrap()
        };
        assert_eq!(json(&decode(&reply, true, &x))[0]["message"], "hi");
        assert_eq!(json(&decode(&reply, false, &x))["message"], "hi");
        // An empty stream is an empty list.
        let empty = Exchange {
            response_body: Some(Body::default()),
            ..Exchange::default()
        };
        assert_eq!(json(&decode(&reply, true, &empty)), serde_json::json!([]));
    }

    fn answer(body: &str) -> Exchange {
        Exchange {
            status: 200,
            response_headers: vec![Header {
                name: "Content-Type".into(),
                value: b"application/json".to_vec(),
            }],
            response_body: Some(Body {
                size: body.len() as u64,
                data: body.as_bytes().to_vec(),
                truncated: false,
            }),
            ..Exchange::default()
        }
    }

    fn json_check(path: &str, equals: Option<Value>, exists: Option<bool>) -> Check {
        Check {
            json_path: Some(JsonPathCheck {
                path: path.into(),
                equals,
                exists,
            }),
            ..Check::default()
        }
    }

    #[test]
    fn checks_say_what_they_saw() {
        let x = answer(r#"{"items": [{"name": "tea"}]}"#);
        let status = Check {
            status: Some(201),
            ..Check::default()
        };
        assert_eq!(evaluate(&status, &x), Err("status 200".into()));
        assert_eq!(describe(&status), "status 201");
        let c = json_check("$.items[0].name", Some("tea".into()), None);
        assert_eq!(evaluate(&c, &x), Ok(()));
        assert_eq!(describe(&c), "$.items[0].name = \"tea\"");
        let c = json_check("$.items[0].name", Some("cake".into()), None);
        assert_eq!(evaluate(&c, &x), Err("\"tea\"".into()));
        assert_eq!(
            evaluate(&json_check("$.items[0].price", None, None), &x),
            Err("absent".into())
        );
        assert_eq!(
            evaluate(&json_check("$.items[0].price", None, Some(false)), &x),
            Ok(())
        );
        let header = |equals: Option<&str>| Check {
            header: Some(HeaderCheck {
                name: "content-type".into(),
                equals: equals.map(Into::into),
            }),
            ..Check::default()
        };
        assert_eq!(evaluate(&header(None), &x), Ok(()));
        assert_eq!(
            evaluate(&header(Some("text/plain")), &x),
            Err("\"application/json\"".into())
        );
        let mut broken = x.clone();
        broken.error = "connection refused".into();
        assert_eq!(
            evaluate(&header(None), &broken),
            Err("no answer: connection refused".into())
        );
        let text = answer("hello");
        assert!(
            evaluate(&json_check("$.a", None, None), &text)
                .unwrap_err()
                .starts_with("the body is not JSON")
        );
        let grpc = Check {
            grpc_status: Some(0),
            ..Check::default()
        };
        assert_eq!(
            evaluate(&grpc, &x),
            Err("no grpc-status (HTTP status 200)".into())
        );
        let mut g = x.clone();
        g.response_trailers = vec![Header {
            name: "grpc-status".into(),
            value: b"14".to_vec(),
        }];
        assert_eq!(evaluate(&grpc, &g), Err("grpc-status 14".into()));
    }

    /// A report of `n` steps on `n` endpoints whose sandbox answer drops field `gone` and changes
    /// `price` (each step's two baseline answers alike), with a failed check per step.
    fn report(n: usize) -> RunReport {
        let steps: Vec<StepResult> = (0..n)
            .map(|i| StepResult {
                name: format!("step-{i}"),
                endpoint: format!("GET svc-{i}.shop:8080/items/{}", "x".repeat(i % 7)),
                baseline: [
                    answer(r#"{"gone": 1, "price": 3}"#),
                    answer(r#"{"gone": 1, "price": 3}"#),
                ],
                sandbox: answer(r#"{"price": 4}"#),
                decoded: None,
                calls: None,
                checks: vec![CheckResult {
                    check: "$.gone".into(),
                    sandbox: Err("absent".into()),
                    baseline: Ok(()),
                }],
            })
            .collect();
        let findings = findings(&observations(&steps));
        RunReport {
            routing_key: "k".into(),
            steps,
            findings,
            calls: None,
        }
    }

    #[test]
    fn a_summary_fits_its_bound_and_keeps_the_most_important_first() {
        let small: Value = serde_json::from_str(&report(1).summary(4096)).unwrap();
        assert_eq!(small["passed"], false);
        assert_eq!(small["steps"], 1);
        assert_eq!(small["checksFailed"], 1);
        assert_eq!(small["findings"], 2);
        assert_eq!(small["byRank"], json!({"schema": 1, "value": 1}));
        assert_eq!(small["top"][0]["rank"], "schema", "{small}");
        assert_eq!(small["top"][0]["what"], "$.gone: removed 1");
        assert_eq!(small["top"][1]["what"], "$.price: 3 → 4");
        assert_eq!(
            small["failedChecks"][0],
            json!({"step": "step-0", "check": "$.gone", "sandbox": "absent"})
        );
        assert_eq!(small["omitted"], 0);

        let big = report(200);
        let text = big.summary(4096);
        assert!(text.len() <= 4096, "{}", text.len());
        // The fewest removals: one more item (at most ~400 bytes with its cut texts) would not fit.
        assert!(text.len() > 4096 - 400, "{}", text.len());
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["findings"], 400);
        assert_eq!(v["checksFailed"], 200);
        let top = v["top"].as_array().unwrap();
        assert!(!top.is_empty());
        // Schema changes (the removed field) come before value changes.
        assert!(top.iter().take(10).all(|f| f["rank"] == "schema"), "{v}");
        let kept = top.len() + v["failedChecks"].as_array().unwrap().len();
        assert_eq!(v["omitted"].as_u64().unwrap() as usize + kept, 600);
    }
}
