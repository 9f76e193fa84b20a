//! One run of a test: each step sent to the baseline, to the sandbox and to the baseline again,
//! in that order (so a value that drifts with time brackets the sandbox's answer), its checks
//! evaluated on every answer, and the findings of the whole run (`spur_traffic_diff::findings`:
//! the baseline's two answers teach what is noise).

use std::fmt::Write as _;

use serde_json::{Value, json};
use spur_proto::traffic::Exchange;
use spur_traffic_diff::findings::{Findings, Observation, findings};

use crate::path::JsonPath;
use crate::send::send;
use crate::spec::{Check, Prepared};

/// What one step got.
#[derive(Debug)]
pub struct StepResult {
    pub name: String,
    pub endpoint: String,
    /// The baseline's answers, before and after the sandbox's.
    pub baseline: [Exchange; 2],
    pub sandbox: Exchange,
    pub checks: Vec<CheckResult>,
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
}

/// Runs `steps` with the sandbox's routing key `key`.
pub async fn run(steps: &[Prepared], key: &str) -> RunReport {
    let mut results = Vec::with_capacity(steps.len());
    for step in steps {
        let first = send(step, None).await;
        let sandbox = send(step, Some(key)).await;
        let second = send(step, None).await;
        let checks = step
            .checks
            .iter()
            .map(|c| CheckResult {
                check: describe(c),
                sandbox: evaluate(c, &sandbox),
                baseline: evaluate(c, &first).and_then(|()| evaluate(c, &second)),
            })
            .collect();
        results.push(StepResult {
            name: step.name.clone(),
            endpoint: step.endpoint.clone(),
            baseline: [first, second],
            sandbox,
            checks,
        });
    }
    let observations: Vec<Observation<'_>> = results
        .iter()
        .map(|r| Observation {
            endpoint: r.endpoint.clone(),
            baseline: [&r.baseline[0], &r.baseline[1]],
            sandbox: &r.sandbox,
        })
        .collect();
    let findings = findings(&observations);
    RunReport {
        routing_key: key.to_owned(),
        steps: results,
        findings,
    }
}

impl RunReport {
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
                json!({
                    "name": s.name,
                    "endpoint": s.endpoint,
                    "sandbox": answer(&s.sandbox),
                    "baseline": [answer(&s.baseline[0]), answer(&s.baseline[1])],
                    "checks": checks,
                })
            })
            .collect();
        json!({
            "routingKey": self.routing_key,
            "passed": self.passed(),
            "checksFailed": self.checks_failed(),
            "steps": steps,
            "findings": self.findings.to_json(),
        })
    }

    /// The run for a person: a line per step and check, then the findings by endpoint.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let brief = |x: &Exchange| {
            if !x.error.is_empty() {
                return format!("error ({})", x.error);
            }
            match grpc_status(x) {
                Some(code) => format!("grpc-status {code} in {} ms", x.duration_micros / 1000),
                None => format!("{} in {} ms", x.status, x.duration_micros / 1000),
            }
        };
        for s in &self.steps {
            let _ = writeln!(
                out,
                "step {} ({}): sandbox {}; baseline {}, {}",
                s.name,
                s.endpoint,
                brief(&s.sandbox),
                brief(&s.baseline[0]),
                brief(&s.baseline[1])
            );
            for c in &s.checks {
                let side = |r: &Result<(), String>| match r {
                    Ok(()) => "passed".to_owned(),
                    Err(e) => format!("FAILED ({e})"),
                };
                let _ = writeln!(
                    out,
                    "  check {}: sandbox {}, baseline {}",
                    c.check,
                    side(&c.sandbox),
                    side(&c.baseline)
                );
            }
        }
        let count = self.findings.count();
        if count == 0 {
            out.push_str("no findings: the sandbox answered as the baseline did, noise aside\n");
        } else {
            let _ = writeln!(out, "findings ({count}), most important first:");
            for (endpoint, e) in &self.findings.endpoints {
                if e.findings.is_empty() {
                    continue;
                }
                let _ = writeln!(out, "  {endpoint}");
                for f in &e.findings {
                    let times = if f.occurrences > 1 {
                        format!(" (x{})", f.occurrences)
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        out,
                        "    {:<6} {}{times}",
                        f.rank.as_str(),
                        f.difference.render()
                    );
                }
                if e.more > 0 {
                    let _ = writeln!(out, "    ... {} more", e.more);
                }
            }
        }
        out
    }
}

/// The gRPC status of an answer: from its trailers, or its headers for a trailers-only answer.
pub fn grpc_status(x: &Exchange) -> Option<u32> {
    x.response_trailers
        .iter()
        .chain(&x.response_headers)
        .find(|h| h.name.eq_ignore_ascii_case("grpc-status"))
        .and_then(|h| std::str::from_utf8(&h.value).ok()?.trim().parse().ok())
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
}
