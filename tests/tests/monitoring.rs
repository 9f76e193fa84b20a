//! Spur's alerts and dashboards (docs/runbooks.md), checked with the tools that read them:
//! `promtool check rules` and `promtool test rules` (tests/monitoring/alerts_test.yaml: every
//! alert fires on its series and a healthy set fires none) on `charts/spur/files/alerts.yaml`;
//! each dashboard against the Grafana dashboard model with its queries parsed by Prometheus'
//! parser (`monitoring-check`, tests/go-monitoring), and shown to refuse broken ones; a runbook
//! section and link for every alert; and what the chart renders from both files.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use spur_e2e::kube::{chart_path, helm_template};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// Runs a Go tool of tests/go/build.sh: (success, stdout + stderr).
fn go_tool(name: &str, args: &[&Path], cwd: &Path) -> (bool, String) {
    let bin = spur_e2e::go_bin_dir().join(name);
    let out = Command::new(&bin)
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn alerts() -> Value {
    let text = std::fs::read_to_string(chart_path("files/alerts.yaml")).unwrap();
    serde_yaml_ng::from_str(&text).unwrap()
}

fn alert_names(rules: &Value) -> Vec<String> {
    rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn promtool_checks_the_rules_and_every_alert_fires_as_its_test_says() {
    let rules = chart_path("files/alerts.yaml");
    let (ok, out) = go_tool(
        "promtool",
        &[Path::new("check"), Path::new("rules"), &rules],
        &repo("."),
    );
    assert!(ok, "promtool check rules:\n{out}");
    let n = alert_names(&alerts()).len();
    assert!(out.contains(&format!("SUCCESS: {n} rules found")), "{out}");

    let dir = repo("tests/monitoring");
    let (ok, out) = go_tool(
        "promtool",
        &[
            Path::new("test"),
            Path::new("rules"),
            Path::new("alerts_test.yaml"),
        ],
        &dir,
    );
    assert!(ok, "promtool test rules:\n{out}");

    // Every alert is proven to fire somewhere in the test file, and to stay quiet on the
    // healthy set (the first test group).
    let tests: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(dir.join("alerts_test.yaml")).unwrap())
            .unwrap();
    let cases: Vec<&Value> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .collect();
    for name in alert_names(&alerts()) {
        let of = |c: &&&Value| c["alertname"] == name.as_str();
        let fires = cases
            .iter()
            .filter(of)
            .any(|c| !c["exp_alerts"].as_array().unwrap().is_empty());
        assert!(fires, "{name}: no test shows it firing");
        let quiet = tests["tests"][0]["alert_rule_test"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["alertname"] == name.as_str() && c["exp_alerts"] == serde_json::json!([]));
        assert!(quiet, "{name}: the healthy set does not show it quiet");
    }
}

#[test]
fn promtool_refuses_a_broken_rule() {
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.yaml");
    let text = std::fs::read_to_string(chart_path("files/alerts.yaml"))
        .unwrap()
        .replacen(
            "max(spur_operator_sandbox_oldest_converging_seconds) > 900",
            "max(spur_operator_sandbox_oldest_converging_seconds > 900",
            1,
        );
    std::fs::write(&broken, text).unwrap();
    let (ok, out) = go_tool(
        "promtool",
        &[Path::new("check"), Path::new("rules"), &broken],
        dir.path(),
    );
    assert!(!ok && out.contains("unclosed left parenthesis"), "{out}");
}

#[test]
fn every_alert_has_a_runbook_section_and_links_to_it() {
    let runbooks = std::fs::read_to_string(repo("docs/runbooks.md")).unwrap();
    let sections: BTreeSet<String> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(str::to_owned)
        .collect();
    let rules = alerts();
    let names = alert_names(&rules);
    for rule in rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
    {
        let name = rule["alert"].as_str().unwrap();
        assert!(
            sections.contains(name),
            "docs/runbooks.md has no section `### {name}`"
        );
        let link = format!("docs/runbooks.md#{}", name.to_lowercase());
        assert_eq!(rule["annotations"]["runbook_url"], link.as_str(), "{name}");
        assert!(
            rule["annotations"]["summary"].is_string(),
            "{name}: no summary"
        );
        let severity = rule["labels"]["severity"].as_str().unwrap_or_default();
        assert!(
            ["critical", "warning", "info"].contains(&severity),
            "{name}: severity {severity:?}"
        );
    }
    // No section for an alert that does not exist.
    let under_alerts: Vec<&String> = sections
        .iter()
        .filter(|s| s.starts_with("Spur"))
        .filter(|s| !names.contains(s))
        .collect();
    assert!(
        under_alerts.is_empty(),
        "runbooks of no alert: {under_alerts:?}"
    );
}

fn dashboards() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(chart_path("files/dashboards"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}

#[test]
fn the_dashboards_are_grafana_dashboards_whose_queries_parse() {
    let files = dashboards();
    assert_eq!(files.len(), 2, "{files:?}");
    let args: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let (ok, out) = go_tool("monitoring-check", &args, &repo("."));
    assert!(ok, "monitoring-check:\n{out}");
    assert!(out.contains("OK 2"), "{out}");
    // Each reads the metrics its part exports.
    let used = |file: &str| -> BTreeSet<String> {
        out.lines()
            .filter_map(|l| l.strip_prefix(&format!("METRIC {file} ")))
            .map(str::to_owned)
            .collect()
    };
    let data = used("spur-data-plane.json");
    let control = used("spur-control-plane.json");
    for m in [
        "spur_requests_total",
        "spur_routeserver_connected",
        "spur_request_duration_seconds_bucket",
        "spur_upstream_stream_retries_total",
    ] {
        assert!(data.contains(m), "data plane dashboard lacks {m}: {data:?}");
    }
    for m in [
        "spur_operator_leader",
        "spur_operator_sandboxes",
        "spur_routeserver_watch_errors_total",
        "spur_jobs_oldest_queued_seconds",
        "spur_traffic_store_max_bytes",
    ] {
        assert!(
            control.contains(m),
            "control plane dashboard lacks {m}: {control:?}"
        );
    }
}

/// The first query of the dashboard's first panel that is not a row.
fn first_query(d: &mut Value) -> &mut Value {
    let panel = d["panels"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|p| p["type"] != "row")
        .unwrap();
    &mut panel["targets"][0]
}

#[test]
fn the_dashboard_check_refuses_what_grafana_or_prometheus_would() {
    let original: Value =
        serde_json::from_str(&std::fs::read_to_string(&dashboards()[0]).unwrap()).unwrap();
    type Break = fn(&mut Value);
    let cases: [(&str, Break, &str); 4] = [
        (
            "an unknown field",
            |d| d["schemaVersions"] = 39.into(),
            "unexpected field",
        ),
        (
            "a query that does not parse",
            |d| first_query(d)["expr"] = "sum(rate(spur_requests_total[5m])".into(),
            "unclosed left parenthesis",
        ),
        (
            "a query on another datasource",
            |d| first_query(d)["datasource"]["uid"] = "prometheus".into(),
            "does not use the ${datasource} variable",
        ),
        (
            "overlapping panels",
            |d| {
                let panels = d["panels"].as_array_mut().unwrap();
                let pos = panels[1]["gridPos"].clone();
                panels[2]["gridPos"] = pos;
            },
            "overlap",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (what, breaks, expect) in cases {
        let mut d = original.clone();
        breaks(&mut d);
        let file = dir.path().join("broken.json");
        std::fs::write(&file, serde_json::to_vec_pretty(&d).unwrap()).unwrap();
        let (ok, out) = go_tool("monitoring-check", &[&file], dir.path());
        assert!(!ok, "{what}: accepted\n{out}");
        assert!(
            out.contains(expect),
            "{what}: expected {expect:?} in\n{out}"
        );
    }
}

#[tokio::test]
async fn the_chart_renders_the_rules_and_dashboards_when_asked() {
    // Off by default.
    let objects = helm_template(&[]).await.unwrap();
    assert!(
        !objects.iter().any(|o| o["kind"] == "PrometheusRule"
            || o["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("-dashboard"))),
        "rendered without being asked"
    );
    // Without the Prometheus Operator's API: refused, saying why.
    let err = helm_template(&["--set", "monitoring.prometheusRule.enabled=true"])
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no monitoring.coreos.com/v1 PrometheusRule"),
        "{err}"
    );

    let objects = helm_template(&[
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--set",
        "monitoring.prometheusRule.labels.release=kube-prometheus-stack",
        "--set",
        "monitoring.dashboards.enabled=true",
        "--set",
        "monitoring.runbookBaseUrl=https://git.example/spur/blob/main/docs/runbooks.md",
    ])
    .await
    .unwrap();
    let rule = objects
        .iter()
        .find(|o| o["kind"] == "PrometheusRule")
        .unwrap();
    assert_eq!(
        rule["metadata"]["labels"]["release"],
        "kube-prometheus-stack"
    );
    // The file's groups, with the runbook links made absolute and nothing else changed.
    let mut expected = alerts();
    for g in expected["groups"].as_array_mut().unwrap() {
        for r in g["rules"].as_array_mut().unwrap() {
            let url = &mut r["annotations"]["runbook_url"];
            *url = url
                .as_str()
                .unwrap()
                .replace(
                    "docs/runbooks.md#",
                    "https://git.example/spur/blob/main/docs/runbooks.md#",
                )
                .into();
        }
    }
    assert_eq!(rule["spec"], expected);

    for file in dashboards() {
        let name = file.file_name().unwrap().to_str().unwrap();
        let cm = objects
            .iter()
            .find(|o| o["kind"] == "ConfigMap" && o["data"].get(name).is_some())
            .unwrap_or_else(|| panic!("no ConfigMap holds {name}"));
        assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
        let rendered: Value = serde_json::from_str(cm["data"][name].as_str().unwrap()).unwrap();
        let source: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(rendered, source, "{name}");
    }

    // A runbook base that is not a URL is refused by the values schema.
    let err = helm_template(&["--set", "monitoring.runbookBaseUrl=runbooks"])
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("runbookBaseUrl"), "{err}");
}
