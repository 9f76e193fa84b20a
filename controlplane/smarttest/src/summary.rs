//! A run's summary: what `spur test run --summary-file` writes (at most 4096 bytes of JSON, a
//! Job's `status.result`) and what the automatic runs' controller reads back. One type for both
//! sides, so the writer and the reader cannot drift apart.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A run's outcome in brief ([`crate::RunReport::summary`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    /// No findings and every check passed on the sandbox.
    pub passed: bool,
    pub steps: usize,
    pub checks_failed: usize,
    /// Findings in all, kept or not.
    pub findings: usize,
    /// Findings per rank (`status`, `schema`, `value`, `timing`).
    #[serde(default)]
    pub by_rank: BTreeMap<String, u64>,
    /// The most important findings that fit, most important first.
    #[serde(default)]
    pub top: Vec<TopFinding>,
    /// The checks that failed on the sandbox, as many as fit.
    #[serde(default)]
    pub failed_checks: Vec<FailedCheck>,
    /// How many findings and failed checks did not fit.
    #[serde(default)]
    pub omitted: usize,
    /// When the run compared its downstream calls: how they were captured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls: Option<CallsBrief>,
}

/// [`Summary::calls`]: the run's captured calls, counted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CallsBrief {
    /// Baselines whose sidecars were watching their capture settings when the run started.
    pub watching_baselines: u32,
    /// Exchanges captured with the run's keys.
    pub captured: usize,
    /// Of them, those without this run's marker.
    pub unmarked: usize,
}

/// One finding of [`Summary::top`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopFinding {
    pub rank: String,
    pub endpoint: String,
    /// The difference, in one line (`$.items[*].price: removed 3`).
    pub what: String,
    /// The same without the values the service answered (`$.items[*].price: removed`), for
    /// what more people than the test's team may read; empty in a summary of an older runner.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub shape: String,
    pub occurrences: u64,
}

/// One check of [`Summary::failed_checks`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailedCheck {
    pub step: String,
    pub check: String,
    /// Why it failed on the sandbox.
    pub sandbox: String,
}

impl Summary {
    /// One line for people: `passed (3 steps, no findings)`, or the counts per rank and the
    /// first `named` findings (then failed checks) with their endpoints.
    pub fn brief(&self, named: usize) -> String {
        self.brief_with(named, true)
    }

    /// [`Self::brief`] without the values the service answered: each finding's shape, and a
    /// failed check without what the sandbox had. For the Sandbox's status and Events, which
    /// anyone who may read Sandboxes (cluster-scoped) or Events in `default` reads; the values
    /// stay in the run's Job, in the test's namespace.
    pub fn brief_without_values(&self, named: usize) -> String {
        self.brief_with(named, false)
    }

    fn brief_with(&self, named: usize, values: bool) -> String {
        use std::fmt::Write as _;
        if self.passed {
            return format!("passed ({} steps, no findings)", self.steps);
        }
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        let mut out = format!("{} finding{}", self.findings, plural(self.findings));
        if !self.by_rank.is_empty() {
            let ranks: Vec<String> = ["status", "schema", "value", "timing"]
                .iter()
                .filter_map(|r| self.by_rank.get(*r).map(|n| format!("{n} {r}")))
                .collect();
            let _ = write!(out, " ({})", ranks.join(", "));
        }
        if self.checks_failed > 0 {
            let _ = write!(
                out,
                ", {} check{} failed",
                self.checks_failed,
                plural(self.checks_failed)
            );
        }
        let names: Vec<String> = self
            .top
            .iter()
            .take(named)
            .map(|f| match (values, f.shape.is_empty()) {
                (true, _) => format!("[{}] {}: {}", f.rank, f.endpoint, f.what),
                (false, false) => format!("[{}] {}: {}", f.rank, f.endpoint, f.shape),
                (false, true) => format!("[{}] {}", f.rank, f.endpoint),
            })
            .chain(
                self.failed_checks
                    .iter()
                    .take(named.saturating_sub(self.top.len()))
                    .map(|c| match values {
                        true => format!("[check] {} {}: {}", c.step, c.check, c.sandbox),
                        false => format!("[check] {} {}: failed", c.step, c.check),
                    }),
            )
            .collect();
        if !names.is_empty() {
            let _ = write!(out, ": {}", names.join("; "));
        }
        out
    }
}

/// What a summary file holds: a run's summary, or why the run could not happen.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Ran(Summary),
    Error(String),
}

impl Outcome {
    /// Reads a summary file's text; `Err` says why it is not one.
    pub fn parse(text: &str) -> Result<Outcome, String> {
        #[derive(Deserialize)]
        struct Failed {
            error: String,
        }
        if let Ok(f) = serde_json::from_str::<Failed>(text) {
            return Ok(Outcome::Error(f.error));
        }
        serde_json::from_str::<Summary>(text)
            .map(Outcome::Ran)
            .map_err(|e| format!("not a smart test's summary: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_and_an_error_are_told_apart() {
        let s = Outcome::parse(
            r#"{"passed":false,"steps":2,"checksFailed":1,"findings":3,"byRank":{"schema":3},
                "top":[{"rank":"schema","endpoint":"GET api/x","what":"$.a: removed 1","occurrences":2}],
                "failedChecks":[{"step":"a","check":"$.a","sandbox":"absent"}],"omitted":1}"#,
        )
        .unwrap();
        let Outcome::Ran(s) = s else { panic!("{s:?}") };
        assert_eq!((s.steps, s.findings, s.omitted), (2, 3, 1));
        assert_eq!(s.top[0].what, "$.a: removed 1");
        assert_eq!(
            Outcome::parse(r#"{"error":"no such sandbox"}"#).unwrap(),
            Outcome::Error("no such sandbox".into())
        );
        assert!(Outcome::parse("passed 3").is_err());
        assert!(
            Outcome::parse(r#"{"passed":true}"#).is_err(),
            "counts are required"
        );
    }
}
