//! Sandboxes and route groups as a person wants to see them: `get` (key, readiness, resources,
//! forks, time left, preview URLs), `list` tables, and what `apply --wait` prints once ready.

use std::fmt::Write as _;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Resource;
use spur_api::conditions::{READY, find_condition};
use spur_api::routingconfig::RouteSpan;
use spur_api::{RouteGroup, Sandbox};

/// The "Kafka records" part of `spur sandbox get`: since when each fork's keyed records are its
/// own (docs/async.md), or why that is not known.
pub(crate) fn describe_records(sb: &Sandbox, spans: &Result<Vec<RouteSpan>, String>) -> String {
    let mut out = String::new();
    if sb.spec.forks.is_empty() {
        return out;
    }
    let _ = writeln!(out, "Kafka records (keyed, to forks with a Kafka relay):");
    match spans {
        Err(why) => {
            let _ = writeln!(out, "  unknown: {why}");
        }
        Ok(spans) if spans.is_empty() => {
            let _ = writeln!(
                out,
                "  none (no fork with a Kafka relay is ready: a fork's keyed records are its own from 5 s after it is)"
            );
        }
        Ok(spans) => {
            let at = |ms: i64| {
                k8s_openapi::jiff::Timestamp::from_millisecond(ms)
                    .map_or_else(|_| format!("{ms} ms"), |t| t.to_string())
            };
            for s in spans {
                let _ = write!(
                    out,
                    "  {}/{}: records stamped from {}",
                    s.baseline.namespace,
                    s.baseline.name,
                    at(s.since_ms)
                );
                // Set when the sandbox is being deleted: its forks drain until a while past it.
                match s.until_ms {
                    Some(until) => {
                        let _ = writeln!(out, " until {} (the sandbox is going)", at(until));
                    }
                    None => {
                        let _ = writeln!(out);
                    }
                }
            }
        }
    }
    out
}

/// The lines `get` starts with, for a sandbox and a route group alike.
fn header(
    out: &mut String,
    kind: &str,
    name: Option<&str>,
    description: Option<&str>,
    key: Option<&str>,
    conditions: &[Condition],
    expires: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
) {
    let _ = writeln!(out, "{kind} {}", name.unwrap_or_default());
    if let Some(d) = description {
        let _ = writeln!(out, "Description: {d}");
    }
    let _ = writeln!(out, "Routing key: {}", key.unwrap_or("(not assigned yet)"));
    let _ = writeln!(out, "Ready:       {}", ready_text(conditions));
    // Automatic smart-test runs (docs/smart-tests.md): their findings quote what the fork
    // answered, so they are escaped.
    if let Some(c) = find_condition(conditions, spur_api::smarttest::TESTS_CONDITION) {
        let verdict = match c.status.as_str() {
            "True" => "passed",
            "False" => "failed",
            _ => "running",
        };
        let _ = writeln!(
            out,
            "Tests:       {verdict} ({})\n  {}",
            crate::text::one_line(&c.reason),
            crate::text::lines(&c.message, "  ")
        );
    }
    if let Some(t) = expires {
        let _ = writeln!(out, "Expires:     {}", t.0);
    }
}

/// The "Previews:" lines: each endpoint, its URL from status, its target.
fn previews(
    out: &mut String,
    endpoints: &[spur_api::sandbox::Endpoint],
    urls: &[spur_api::sandbox::EndpointStatus],
) {
    let _ = writeln!(out, "Previews:");
    for e in endpoints {
        let url = urls
            .iter()
            .find(|s| s.name == e.name)
            .map_or("(no URL: the operator has no preview domain)", |s| {
                s.url.as_str()
            });
        let _ = writeln!(out, "  {:<12} {url}  -> {}", e.name, e.target);
    }
}

/// The text `spur sandbox get` prints.
pub(crate) fn describe(sb: &Sandbox) -> String {
    let st = sb.status.clone().unwrap_or_default();
    let mut out = String::new();
    header(
        &mut out,
        "Sandbox:    ",
        sb.metadata.name.as_deref(),
        sb.spec.description.as_deref(),
        st.routing_key.as_deref(),
        &st.conditions,
        st.expires_at.as_ref(),
    );
    if !st.resources.is_empty() {
        let _ = writeln!(out, "Resources:");
        for r in &st.resources {
            let _ = writeln!(
                out,
                "  {} ({}): {}{}",
                r.name,
                r.plugin.as_deref().unwrap_or("plugin not resolved yet"),
                r.phase,
                r.message
                    .as_deref()
                    .map(|m| format!(" - {m}"))
                    .unwrap_or_default()
            );
            if let Some(secret) = &r.output_secret {
                let _ = writeln!(out, "    outputs in Secret {secret} of each fork namespace");
            }
        }
    }
    if !st.forks.is_empty() {
        let _ = writeln!(out, "Forks:");
        for f in &st.forks {
            let _ = writeln!(
                out,
                "  {}/{} -> {} ({})",
                f.fork_of.namespace,
                f.fork_of.name,
                f.fork.as_deref().unwrap_or("(not created yet)"),
                if f.ready { "ready" } else { "not ready" }
            );
        }
    }
    let endpoints = sb
        .spec
        .default_route_group
        .as_ref()
        .map(|g| g.endpoints.as_slice())
        .unwrap_or_default();
    if !endpoints.is_empty() {
        previews(&mut out, endpoints, &st.endpoints);
    }
    out
}

/// The header a curl example sends: W3C baggage, which every carrier of routing-keys.md
/// accepts and OpenTelemetry propagates.
fn key_header(key: &str) -> String {
    format!("baggage: sd-routing-key={key}")
}

/// What `spur sandbox apply --wait` prints once the sandbox is ready: the key, the preview
/// URLs, and a request to paste.
pub(crate) fn ready_summary(sb: &Sandbox, took: Duration) -> String {
    let st = sb.status.clone().unwrap_or_default();
    let name = sb.metadata.name.as_deref().unwrap_or_default();
    let key = st.routing_key.as_deref().unwrap_or_default();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nSandbox {name} is ready ({:.1}s).",
        took.as_secs_f64()
    );
    let _ = writeln!(out, "Routing key: {key}");
    if !st.endpoints.is_empty() {
        let _ = writeln!(out, "Preview URLs (spur preview open {name} NAME):");
        for e in &st.endpoints {
            let _ = writeln!(out, "  {:<12} {}", e.name, e.url);
        }
    }
    // A Service of the first fork: where a keyed request shows the fork answering.
    let target = st.forks.iter().find_map(|f| {
        let m = f.services.first()?;
        let port = m.ports.first()?.port;
        Some(format!(
            "http://{}.{}.svc:{port}/",
            m.baseline_service, f.fork_of.namespace
        ))
    });
    match target {
        Some(url) => {
            let _ = writeln!(
                out,
                "Try it (from a pod of the cluster, or through `spur local connect`):\n  curl -H '{}' {url}",
                key_header(key)
            );
        }
        None => {
            let _ = writeln!(
                out,
                "Requests carrying the header '{}' reach it.",
                key_header(key)
            );
        }
    }
    out
}

/// What `spur routegroup apply --wait` prints once the group is ready.
pub(crate) fn route_group_summary(rg: &RouteGroup, took: Duration) -> String {
    let st = rg.status.clone().unwrap_or_default();
    let name = rg.metadata.name.as_deref().unwrap_or_default();
    let key = st.routing_key.as_deref().unwrap_or_default();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nRoute group {name} is ready ({:.1}s): {} sandboxes.",
        took.as_secs_f64(),
        st.matched_sandboxes.join(", ")
    );
    let _ = writeln!(out, "Routing key: {key} (header '{}')", key_header(key));
    for e in &st.endpoints {
        let _ = writeln!(out, "  {:<12} {}", e.name, e.url);
    }
    out
}

/// The text `spur routegroup get` prints.
pub(crate) fn route_group(rg: &RouteGroup) -> String {
    let st = rg.status.clone().unwrap_or_default();
    let mut out = String::new();
    header(
        &mut out,
        "RouteGroup: ",
        rg.metadata.name.as_deref(),
        rg.spec.description.as_deref(),
        st.routing_key.as_deref(),
        &st.conditions,
        st.expires_at.as_ref(),
    );
    let _ = writeln!(
        out,
        "Sandboxes:   {} ({} ready)",
        if st.matched_sandboxes.is_empty() {
            "none match".to_string()
        } else {
            st.matched_sandboxes.join(", ")
        },
        st.ready_sandboxes
    );
    if !rg.spec.endpoints.is_empty() {
        previews(&mut out, &rg.spec.endpoints, &st.endpoints);
    }
    out
}

fn ready_text(conditions: &[Condition]) -> String {
    match find_condition(conditions, READY) {
        Some(c) if c.status == "True" => "yes".into(),
        Some(c) => format!("no ({}: {})", c.reason, c.message),
        None => "unknown".into(),
    }
}

/// One row of `list`.
pub(crate) trait Row: Resource {
    const HEADERS: [&'static str; 5];
    fn cells(&self) -> [String; 5];
}

fn short_ready(conditions: &[Condition]) -> String {
    match find_condition(conditions, READY) {
        Some(c) if c.status == "True" => "True".into(),
        Some(c) => format!("False ({})", c.reason),
        None => "Unknown".into(),
    }
}

/// Age as kubectl shows it: 45s, 12m, 3h, 2d.
fn age(meta: &kube::api::ObjectMeta, now: k8s_openapi::jiff::Timestamp) -> String {
    let Some(t) = &meta.creation_timestamp else {
        return "-".into();
    };
    let secs = now.as_second().saturating_sub(t.0.as_second()).max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 2 * 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

impl Row for Sandbox {
    const HEADERS: [&'static str; 5] = ["NAME", "ROUTING KEY", "READY", "FORKS", "AGE"];
    fn cells(&self) -> [String; 5] {
        let st = self.status.clone().unwrap_or_default();
        let forks =
            self.spec.forks.len() + self.spec.local.len() + self.spec.virtual_workloads.len();
        let ready = st.forks.iter().filter(|f| f.ready).count()
            + st.local.iter().filter(|l| l.ready).count()
            + st.virtual_workloads.iter().filter(|v| v.ready).count();
        [
            self.metadata.name.clone().unwrap_or_default(),
            st.routing_key.unwrap_or_else(|| "-".into()),
            short_ready(&st.conditions),
            format!("{ready}/{forks}"),
            age(&self.metadata, k8s_openapi::jiff::Timestamp::now()),
        ]
    }
}

impl Row for RouteGroup {
    const HEADERS: [&'static str; 5] = ["NAME", "ROUTING KEY", "READY", "SANDBOXES", "AGE"];
    fn cells(&self) -> [String; 5] {
        let st = self.status.clone().unwrap_or_default();
        [
            self.metadata.name.clone().unwrap_or_default(),
            st.routing_key.unwrap_or_else(|| "-".into()),
            short_ready(&st.conditions),
            format!("{}/{}", st.ready_sandboxes, st.matched_sandboxes.len()),
            age(&self.metadata, k8s_openapi::jiff::Timestamp::now()),
        ]
    }
}

/// A table with aligned columns, as `kubectl get` prints it.
pub(crate) fn table<K: Row>(items: &[K]) -> String {
    let rows: Vec<[String; 5]> = items.iter().map(Row::cells).collect();
    let mut widths = K::HEADERS.map(str::len);
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    let headers = K::HEADERS.map(String::from);
    for r in std::iter::once(&headers).chain(&rows) {
        let mut line = String::new();
        for (i, (c, w)) in r.iter().zip(widths).enumerate() {
            if i + 1 == r.len() {
                line.push_str(c);
            } else {
                let _ = write!(line, "{c:<w$}   ");
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tests_condition_is_shown_escaped() {
        let sb: Sandbox = serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "pr-1"},
            "spec": {"forks": []},
            "status": {"routingKey": "k1", "conditions": [
                {"type": "Ready", "status": "True", "reason": "Ready", "message": "",
                 "lastTransitionTime": "2026-12-05T00:00:00Z"},
                {"type": "Tests", "status": "False", "reason": "Findings",
                 "message": "1 test: 1 with findings\nshop/list (job list-1): 1 finding (1 value): [value] GET api/x: $.a: \"\u{1b}]0;x\u{7}\" → \"b\"",
                 "lastTransitionTime": "2026-12-05T00:00:00Z"}
            ]}
        }))
        .unwrap();
        let text = describe(&sb);
        assert!(
            text.contains("Tests:       failed (Findings)\n  1 test: 1 with findings\n  shop/list (job list-1): 1 finding (1 value): [value] GET api/x: $.a: \"\\u{1b}]0;x\\u{7}\" → \"b\"\n"),
            "{text}"
        );
        assert!(!text.contains('\u{1b}'), "{text}");
    }

    #[test]
    fn resources_show_their_phase_failure_and_secret() {
        let sb: Sandbox = serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "customer-db"},
            "spec": {"resources": [{"name": "db", "plugin": "postgres"}],
                     "forks": [{"forkOf": {"kind": "Deployment", "namespace": "hotrod", "name": "customer"}}]},
            "status": {"routingKey": "k1", "resources": [
                {"name": "db", "plugin": "postgres.1.0.0", "phase": "Failed",
                 "message": "step user failed: the step failed (exit code 3)"},
                {"name": "cache", "phase": "Ready", "outputSecret": "customer-db-cache-1"}
            ]}
        }))
        .unwrap();
        let text = describe(&sb);
        assert!(
            text.contains(
                "  db (postgres.1.0.0): Failed - step user failed: the step failed (exit code 3)"
            ),
            "{text}"
        );
        assert!(
            text.contains("  cache (plugin not resolved yet): Ready"),
            "{text}"
        );
        assert!(
            text.contains("outputs in Secret customer-db-cache-1 of each fork namespace"),
            "{text}"
        );
        let span: RouteSpan = serde_json::from_value(serde_json::json!({
            "baseline": {"kind": "Deployment", "namespace": "hotrod", "name": "customer"},
            "sandbox": "customer-db", "sinceMs": 1_800_000_000_123i64
        }))
        .unwrap();
        assert_eq!(
            describe_records(&sb, &Ok(vec![span])),
            "Kafka records (keyed, to forks with a Kafka relay):\n  hotrod/customer: records stamped from 2027-01-15T08:00:00.123Z\n"
        );
        let ending: RouteSpan = serde_json::from_value(serde_json::json!({
            "baseline": {"kind": "Deployment", "namespace": "hotrod", "name": "customer"},
            "sandbox": "customer-db", "sinceMs": 1_800_000_000_123i64,
            "untilMs": 1_800_000_060_000i64
        }))
        .unwrap();
        assert_eq!(
            describe_records(&sb, &Ok(vec![ending])),
            "Kafka records (keyed, to forks with a Kafka relay):\n  hotrod/customer: records stamped from 2027-01-15T08:00:00.123Z until 2027-01-15T08:01:00Z (the sandbox is going)\n"
        );
        assert!(describe_records(&sb, &Ok(vec![])).contains("none (no fork with a Kafka relay"));
        assert!(
            describe_records(&sb, &Err("not readable".into())).contains("unknown: not readable")
        );
    }
}
