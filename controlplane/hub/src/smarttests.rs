//! The web view's smart-test results of one sandbox (`/tests?cluster=C&sandbox=S`,
//! docs/smart-tests.md): the `Tests` condition the automatic runs' controller wrote on the
//! Sandbox, and its kept runs (Jobs of the SmartTests that cover it), newest first, each with
//! its outcome: the counts, the top findings and the failed checks. Server-rendered, no script.
//! Read as the user, like the overview: a sandbox outside the user's scope is not found, and runs
//! are listed only from namespaces in it.

use std::fmt::Write as _;
use std::time::SystemTime;

use spur_api::smarttest::{RUN_SANDBOX_GENERATION, RUN_TEST_LABEL, TESTS_CONDITION};
use spur_api::{Job, Sandbox};
use spur_smarttest::summary::{Outcome, Summary};

use crate::html::{ago, esc};

/// Runs listed (the newest): the controller keeps four per test and sandbox.
const MAX_RUNS_SHOWN: usize = 50;

/// The page's query: which sandbox of which cluster.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TestsParams {
    pub cluster: String,
    pub sandbox: String,
}

impl TestsParams {
    pub fn parse(query: &str) -> TestsParams {
        let mut p = TestsParams::default();
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            match &*k {
                "cluster" => p.cluster = v.trim().to_owned(),
                "sandbox" => p.sandbox = v.trim().to_owned(),
                _ => {}
            }
        }
        p
    }

    /// The page's address (for links from the overview).
    pub fn href(cluster: &str, sandbox: &str) -> String {
        let query = form_urlencoded::Serializer::new(String::new())
            .append_pair("cluster", cluster)
            .append_pair("sandbox", sandbox)
            .finish();
        format!("/tests?{query}")
    }
}

/// The overview's word for a sandbox's Tests condition (`None`: no test covers it).
pub fn verdict(sb: &Sandbox) -> Option<(&'static str, &'static str)> {
    let c = sb
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == TESTS_CONDITION)?;
    Some(match (c.status.as_str(), c.reason.as_str()) {
        ("True", _) => ("passed", "ok"),
        ("False", "Findings") => ("findings", "bad"),
        ("False", _) => ("failed", "bad"),
        _ => ("running", "dim"),
    })
}

/// The runs of `sb` among `jobs`, newest first, as the automatic runs' controller recognizes
/// them (`spur_api::smarttest::run_of`).
pub fn runs_of<'a>(sb: &Sandbox, jobs: impl IntoIterator<Item = &'a Job>) -> Vec<&'a Job> {
    let mut runs: Vec<&Job> = jobs
        .into_iter()
        .filter(|j| spur_api::smarttest::run_of(j, sb).is_some())
        .collect();
    runs.sort_by(|a, b| {
        b.metadata
            .creation_timestamp
            .cmp(&a.metadata.creation_timestamp)
            .then_with(|| generation(b).cmp(&generation(a)))
            .then_with(|| a.metadata.name.cmp(&b.metadata.name))
    });
    runs.truncate(MAX_RUNS_SHOWN);
    runs
}

fn generation(job: &Job) -> i64 {
    job.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RUN_SANDBOX_GENERATION))
        .and_then(|g| g.parse().ok())
        .unwrap_or(0)
}

/// The page's content: `found` is the sandbox and its runs the user may see, or why not.
pub fn render(
    params: &TestsParams,
    found: Result<(&Sandbox, Vec<&Job>), String>,
    now: SystemTime,
) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<p><a href=\"/\">← all clusters</a></p><h2>Smart tests of {} in {}</h2>",
        esc(&params.sandbox),
        esc(&params.cluster)
    );
    let (sb, runs) = match found {
        Ok(f) => f,
        Err(why) => {
            let _ = write!(out, "<p class=bad>{}</p>", esc(&why));
            return out;
        }
    };
    let condition = sb
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == TESTS_CONDITION));
    match (condition, verdict(sb)) {
        (Some(c), Some((word, class))) => {
            let _ = write!(
                out,
                "<p>Tests: <span class={class}>{word}</span> ({}), sandbox generation {}</p><pre>{}</pre>",
                esc(&c.reason),
                c.observed_generation
                    .map_or_else(|| "-".into(), |g| g.to_string()),
                esc(&c.message)
            );
        }
        _ => out.push_str(
            "<p class=dim>No SmartTest covers this sandbox: none of its namespaces has a test \
             naming a Service it forks (docs/smart-tests.md).</p>",
        ),
    }
    out.push_str("<h3>Runs</h3>");
    if runs.is_empty() {
        out.push_str("<p class=dim>none kept</p>");
        return out;
    }
    out.push_str("<table><tr><th>Test</th><th>Job</th><th>Sandbox generation</th><th>Started</th><th>Phase</th><th>Outcome</th></tr>");
    for job in runs {
        let ns = job.metadata.namespace.as_deref().unwrap_or_default();
        let test = job
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(RUN_TEST_LABEL))
            .map(String::as_str)
            .unwrap_or_default();
        let st = job.status.clone().unwrap_or_default();
        let started = job
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or_else(|| "-".into(), |t| ago(now, SystemTime::from(t.0)));
        let outcome = match (st.phase, st.result.as_deref()) {
            (None | Some(spur_api::jobs::JobPhase::Queued), _) => {
                "<span class=dim>queued</span>".to_owned()
            }
            (Some(spur_api::jobs::JobPhase::Running), _) => {
                "<span class=dim>running</span>".to_owned()
            }
            (Some(_), None) => "<span class=bad>no summary (see the job's log)</span>".to_owned(),
            (Some(_), Some(text)) => outcome_html(text),
        };
        let _ = write!(
            out,
            "<tr><td>{}/{}</td><td>{}</td><td>{}</td><td>{started}</td><td>{}</td><td>{outcome}</td></tr>",
            esc(ns),
            esc(test),
            esc(job.metadata.name.as_deref().unwrap_or_default()),
            generation(job),
            st.phase.map_or("Queued", spur_api::jobs::JobPhase::as_str),
        );
    }
    out.push_str("</table>");
    out
}

/// A finished run's summary: its brief line, then its top findings and failed checks.
fn outcome_html(text: &str) -> String {
    let summary: Summary = match Outcome::parse(text) {
        Ok(Outcome::Ran(s)) => s,
        Ok(Outcome::Error(e)) => return format!("<span class=bad>not run: {}</span>", esc(&e)),
        Err(e) => return format!("<span class=bad>{}</span>", esc(&e)),
    };
    if summary.passed {
        return format!("<span class=ok>{}</span>", esc(&summary.brief(0)));
    }
    let mut out = format!("<span class=bad>{}</span>", esc(&summary.brief(0)));
    if !summary.top.is_empty() || !summary.failed_checks.is_empty() {
        out.push_str("<ul>");
        for f in &summary.top {
            let _ = write!(
                out,
                "<li>[{}] <code>{}</code>: {}{}</li>",
                esc(&f.rank),
                esc(&f.endpoint),
                esc(&f.what),
                if f.occurrences > 1 {
                    format!(" (×{})", f.occurrences)
                } else {
                    String::new()
                }
            );
        }
        for c in &summary.failed_checks {
            let _ = write!(
                out,
                "<li>[check] {} <code>{}</code>: {}</li>",
                esc(&c.step),
                esc(&c.check),
                esc(&c.sandbox)
            );
        }
        if summary.omitted > 0 {
            let _ = write!(out, "<li class=dim>{} more not kept</li>", summary.omitted);
        }
        out.push_str("</ul>");
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;
    use spur_api::keys::labels::SANDBOX;

    fn sandbox() -> Sandbox {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "pr-1", "uid": "sb-uid"},
            "spec": {},
            "status": {"conditions": [{"type": "Tests", "status": "False", "reason": "Findings",
                "message": "1 test: 1 with findings\nshop/list (job l-2): <b>1 finding</b>",
                "observedGeneration": 2, "lastTransitionTime": "2026-12-05T00:00:00Z"}]}
        }))
        .unwrap()
    }

    fn run(
        name: &str,
        created: &str,
        generation: &str,
        owner_uid: &str,
        result: Option<&str>,
    ) -> Job {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
            "metadata": {"name": name, "namespace": "shop", "creationTimestamp": created,
                "labels": {RUN_TEST_LABEL: "list", SANDBOX: "pr-1"},
                "annotations": {RUN_SANDBOX_GENERATION: generation},
                "ownerReferences": [
                    {"apiVersion": "spur.dev/v1alpha1", "kind": "SmartTest", "name": "list", "uid": "t", "controller": true},
                    {"apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox", "name": "pr-1", "uid": owner_uid}]},
            "spec": {"runnerGroup": "smart-tests", "script": "true"},
            "status": result.map_or(json!({"phase": "Running"}), |r| json!({"phase": "Failed", "result": r}))
        }))
        .unwrap()
    }

    #[test]
    fn the_page_shows_the_condition_and_the_runs_newest_first_escaped() {
        let sb = sandbox();
        let findings = r#"{"passed":false,"steps":1,"checksFailed":1,"findings":1,"byRank":{"schema":1},
            "top":[{"rank":"schema","endpoint":"GET api/items","what":"$.price: removed <script>","occurrences":3}],
            "failedChecks":[{"step":"list","check":"status","sandbox":"500"}],"omitted":2}"#;
        let jobs = [
            run(
                "l-1",
                "2026-12-05T00:00:00Z",
                "1",
                "sb-uid",
                Some(r#"{"error":"no key"}"#),
            ),
            run("l-2", "2026-12-05T00:01:00Z", "2", "sb-uid", Some(findings)),
            run("l-3", "2026-12-05T00:02:00Z", "2", "sb-uid", None),
            // A namesake sandbox's run: not this one's.
            run("old", "2026-12-05T00:03:00Z", "1", "earlier-uid", None),
        ];
        let runs = runs_of(&sb, &jobs);
        let names: Vec<_> = runs
            .iter()
            .map(|j| j.metadata.name.as_deref().unwrap())
            .collect();
        assert_eq!(names, ["l-3", "l-2", "l-1"]);
        let params = TestsParams::parse("cluster=east&sandbox=pr-1");
        let html = render(&params, Ok((&sb, runs)), SystemTime::now());
        assert!(
            html.contains(
                "Tests: <span class=bad>findings</span> (Findings), sandbox generation 2"
            ),
            "{html}"
        );
        assert!(html.contains("&lt;b&gt;1 finding&lt;/b&gt;"), "{html}");
        assert!(
            html.contains("<td>shop/list</td><td>l-2</td><td>2</td>"),
            "{html}"
        );
        assert!(
            html.contains(
                "[schema] <code>GET api/items</code>: $.price: removed &lt;script&gt; (×3)"
            ),
            "{html}"
        );
        assert!(
            html.contains("[check] list <code>status</code>: 500"),
            "{html}"
        );
        assert!(html.contains("2 more not kept"), "{html}");
        assert!(html.contains("not run: no key"), "{html}");
        assert!(html.contains("<span class=dim>running</span>"), "{html}");
        assert!(!html.contains("<script>"), "{html}");
        assert_eq!(verdict(&sb), Some(("findings", "bad")));
    }

    #[test]
    fn a_sandbox_not_found_says_so_and_one_without_tests_says_why() {
        let params = TestsParams::parse("cluster=east&sandbox=%3Cx%3E");
        let html = render(
            &params,
            Err("no sandbox \"<x>\" that you may see".into()),
            SystemTime::now(),
        );
        assert!(html.contains("Smart tests of &lt;x&gt; in east"), "{html}");
        assert!(
            html.contains("class=bad>no sandbox &quot;&lt;x&gt;&quot;"),
            "{html}"
        );
        let mut sb = sandbox();
        sb.status = None;
        assert_eq!(verdict(&sb), None);
        let html = render(&params, Ok((&sb, Vec::new())), SystemTime::now());
        assert!(html.contains("No SmartTest covers this sandbox"), "{html}");
        assert!(html.contains("none kept"), "{html}");
        assert_eq!(
            TestsParams::href("e a", "pr-1"),
            "/tests?cluster=e+a&sandbox=pr-1"
        );
    }
}
