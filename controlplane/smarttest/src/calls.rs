//! The calls each request of a run caused downstream (docs/smart-tests.md, "Downstream
//! calls"). While a run captures (the traffic store's StartRunCapture), every sidecar of the
//! sandbox's namespaces records the requests that carry the sandbox's key or the run's
//! reference key. The runner marks each request it sends with a `baggage` member naming the
//! run, the step and the pass (`spur-test-step=<run>.<step>.<pass>`); services that propagate
//! their callers' baggage (OpenTelemetry's propagators do) carry it on to every call they make,
//! so a captured call names the request that caused it, whatever the clocks say.

use std::collections::BTreeMap;

use spur_proto::traffic::Exchange;
use spur_traffic_diff::Calls;

pub use crate::marker::MARKER;
/// Most captured exchanges a run takes in (the rest are counted, not attributed).
pub const MAX_CAPTURED: usize = 10_000;

/// How a run captures: the key its baseline requests carry and the tag its markers start with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallPlan {
    /// The reference key the traffic store made up for the run (routed nowhere).
    pub reference_key: String,
    /// Random, per run: a marker of another run (or one made up) is not this run's.
    pub tag: String,
}

/// Which of a step's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// The baseline, before the sandbox.
    Baseline1,
    Sandbox,
    /// The baseline, after the sandbox.
    Baseline2,
    /// The sandbox again, to time a slow answer: its calls are not compared.
    SandboxAgain,
}

impl Pass {
    fn as_str(self) -> &'static str {
        match self {
            Pass::Baseline1 => "b1",
            Pass::Sandbox => "s",
            Pass::Baseline2 => "b2",
            Pass::SandboxAgain => "s2",
        }
    }

    /// Where the pass's calls go in a step's `[baseline, baseline, sandbox]`.
    fn slot(self) -> Option<usize> {
        match self {
            Pass::Baseline1 => Some(0),
            Pass::Baseline2 => Some(1),
            Pass::Sandbox => Some(2),
            Pass::SandboxAgain => None,
        }
    }
}

impl CallPlan {
    /// A plan with a fresh random tag.
    pub fn new(reference_key: String) -> Result<CallPlan, crate::Error> {
        let mut bytes = [0u8; 8];
        getrandom::fill(&mut bytes)
            .map_err(|e| crate::Error::Run(format!("no randomness for the run's tag: {e}")))?;
        Ok(CallPlan {
            reference_key,
            tag: bytes.iter().map(|b| format!("{b:02x}")).collect(),
        })
    }

    /// A plan with the tag a traffic store gave the run (a run started for a user, whose
    /// reads return only requests marked with it): 1 to 64 lower-case hex digits.
    pub fn with_tag(reference_key: String, tag: String) -> Result<CallPlan, crate::Error> {
        if tag.is_empty()
            || tag.len() > 64
            || !tag
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(crate::Error::Run(format!(
                "the run's marker tag {tag:?} is not 1 to 64 lower-case hex digits"
            )));
        }
        Ok(CallPlan { reference_key, tag })
    }

    /// The marker value of step `step`'s request of `pass`.
    pub fn marker(&self, step: usize, pass: Pass) -> String {
        format!("{}.{step}.{}", self.tag, pass.as_str())
    }

    /// The step and pass `marker` names, if it is this run's.
    fn parse(&self, marker: &str) -> Option<(usize, Pass)> {
        let rest = marker.strip_prefix(&self.tag)?.strip_prefix('.')?;
        let (step, pass) = rest.split_once('.')?;
        let pass = match pass {
            "b1" => Pass::Baseline1,
            "s" => Pass::Sandbox,
            "b2" => Pass::Baseline2,
            "s2" => Pass::SandboxAgain,
            _ => return None,
        };
        Some((step.parse().ok()?, pass))
    }
}

/// What the run's capture recorded, attributed to its steps.
#[derive(Debug, Default)]
pub struct Attributed {
    /// Per step: the calls of baseline, baseline, sandbox.
    pub steps: Vec<[Calls; 3]>,
    /// Captured with the run's keys but without this run's marker (a service that does not
    /// propagate baggage, or another request sent with the sandbox's key meanwhile).
    pub unmarked: usize,
    /// Past [`MAX_CAPTURED`]: not looked at.
    pub skipped: usize,
}

/// Attributes `captured` to the `steps` steps of the run planned by `plan`.
pub fn attribute(plan: &CallPlan, steps: usize, captured: &[Exchange]) -> Attributed {
    let mut by_step: BTreeMap<(usize, usize), Vec<&Exchange>> = BTreeMap::new();
    let mut out = Attributed {
        skipped: captured.len().saturating_sub(MAX_CAPTURED),
        ..Attributed::default()
    };
    for x in captured.iter().take(MAX_CAPTURED) {
        match marker_of(x).and_then(|m| plan.parse(&m)) {
            Some((step, pass)) if step < steps => {
                if let Some(slot) = pass.slot() {
                    by_step.entry((step, slot)).or_default().push(x);
                }
            }
            _ => out.unmarked += 1,
        }
    }
    out.steps = (0..steps)
        .map(|step| {
            [0, 1, 2].map(|slot| {
                Calls::from_exchanges(by_step.get(&(step, slot)).into_iter().flatten().copied())
            })
        })
        .collect();
    out
}

/// The [`MARKER`] member of the captured request's `baggage`, if it has one.
fn marker_of(x: &Exchange) -> Option<String> {
    crate::marker::marker_in(
        x.request_headers
            .iter()
            .map(|h| (h.name.as_str(), h.value.as_slice())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_proto::traffic::{Header, Workload};

    #[test]
    fn a_given_tag_is_hex_and_its_markers_are_the_runs() {
        let plan = CallPlan::with_tag("ref".into(), "00ff".into()).unwrap();
        assert_eq!(plan.marker(2, Pass::Sandbox), "00ff.2.s");
        assert_eq!(plan.parse("00ff.2.s"), Some((2, Pass::Sandbox)));
        for bad in ["", "00FF", "00ff.1", "zz", &"a".repeat(65)] {
            assert!(
                CallPlan::with_tag("ref".into(), bad.into()).is_err(),
                "{bad:?}"
            );
        }
    }

    fn captured(marker: Option<&str>, workload: &str) -> Exchange {
        let mut request_headers = vec![Header {
            name: "content-type".into(),
            value: b"text/plain".to_vec(),
        }];
        if let Some(m) = marker {
            request_headers.push(Header {
                name: "baggage".into(),
                value: format!("sd-routing-key=k, {MARKER}={m};p=1").into_bytes(),
            });
        }
        Exchange {
            method: "GET".into(),
            path: "/catalog".into(),
            status: 200,
            baseline: Some(Workload {
                kind: "Deployment".into(),
                namespace: "shop".into(),
                name: workload.into(),
            }),
            request_headers,
            ..Exchange::default()
        }
    }

    #[test]
    fn captured_calls_go_to_the_step_and_pass_their_marker_names() {
        let plan = CallPlan::new("spur-run-1".into()).unwrap();
        assert_eq!(plan.tag.len(), 16);
        let other = CallPlan::new("spur-run-2".into()).unwrap();
        assert_ne!(plan.tag, other.tag);
        let xs = [
            captured(Some(&plan.marker(0, Pass::Baseline1)), "catalog"),
            captured(Some(&plan.marker(0, Pass::Baseline2)), "catalog"),
            captured(Some(&plan.marker(0, Pass::Sandbox)), "catalog"),
            captured(Some(&plan.marker(0, Pass::Sandbox)), "audit"),
            captured(Some(&plan.marker(0, Pass::SandboxAgain)), "catalog"),
            captured(Some(&plan.marker(1, Pass::Sandbox)), "catalog"),
            // Another run's, a step past the end, none, garbage: not this run's.
            captured(Some(&other.marker(0, Pass::Sandbox)), "catalog"),
            captured(Some(&plan.marker(7, Pass::Sandbox)), "catalog"),
            captured(None, "catalog"),
            captured(Some(&format!("{}.x.s", plan.tag)), "catalog"),
        ];
        let a = attribute(&plan, 2, &xs);
        assert_eq!(a.steps.len(), 2);
        assert_eq!(a.unmarked, 4);
        assert_eq!(a.skipped, 0);
        let [b1, b2, s] = &a.steps[0];
        assert_eq!((b1.len(), b2.len(), s.len()), (1, 1, 2));
        let [b1, b2, s] = &a.steps[1];
        assert_eq!((b1.len(), b2.len(), s.len()), (0, 0, 1));
    }
}
