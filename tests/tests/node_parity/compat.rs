//! Signadot's Routes API clients in the cluster (issue 45, point 4): with the chart's
//! `routeserver.compat` on, from a pod of a namespace labelled `spur.dev/routes-api=compat`, both
//! dialing `routeserver.<release namespace>:7777` in plaintext as Signadot documents for its
//! consumers (the test-client image has both, tests/node/image.sh):
//!
//! - `sdroutes` (go-routesapi's CLI, unchanged) lists a sandbox's rules by routing key;
//! - go-routesapi's retrying watch cache (package `watched`, what message consumers use, through
//!   `routesapi-watch -mode=watched`, tests/go) holds the same rule per baseline once SYNCED,
//!   and drops it when the sandbox is deleted, as in the standalone test
//!   (`tests/tests/routesapi_go.rs`).
//!
//! What this cannot show: the node's CNI (bridge) enforces no NetworkPolicy, so that pods of
//! other namespaces are kept off the compatibility ports is checked on the policy the chart
//! renders (`spur-routeserver-compat`), not by a refused connection.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use spur_e2e::node::{Background, Node, SPUR_NAMESPACE, eventually};

use crate::{RELEASE, chart, helm_args};

/// Turns the compatibility endpoint on or off (the rest of the release's values kept).
fn compat(node: &Node, on: bool) {
    let set = format!("routeserver.compat.enabled={on}");
    node.helm(&helm_args(
        &[
            "upgrade",
            RELEASE,
            &chart(),
            "--namespace",
            SPUR_NAMESPACE,
            "--reuse-values",
            "--wait",
            "--timeout",
            "5m",
        ],
        &["--set", &set],
    ))
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(SPUR_NAMESPACE)));
}

/// The NetworkPolicy the chart renders with the endpoint on admits the compatibility ports only
/// from namespaces labelled `spur.dev/routes-api=compat`, and the authenticated ports from all.
fn rendered_policy(node: &Node) {
    let out = node
        .helm(&helm_args(
            &["template", RELEASE, &chart(), "--namespace", SPUR_NAMESPACE],
            &["--set", "routeserver.compat.enabled=true"],
        ))
        .unwrap();
    let policy: Value = out
        .split("\n---\n")
        .filter_map(|doc| serde_yaml_ng::from_str::<Value>(doc).ok())
        .find(|o| {
            o["kind"] == "NetworkPolicy" && o["metadata"]["name"] == "spur-routeserver-compat"
        })
        .unwrap_or_else(|| panic!("no NetworkPolicy spur-routeserver-compat rendered"));
    let ports = |rule: &Value| -> Vec<i64> {
        rule["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["port"].as_i64())
            .collect()
    };
    let ingress = policy["spec"]["ingress"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let (open, compat): (Vec<&Value>, Vec<&Value>) =
        ingress.iter().partition(|r| r["from"].is_null());
    assert_eq!(compat.len(), 1, "{policy}");
    assert_eq!(ports(compat[0]), [17777, 17778], "{policy}");
    assert_eq!(
        compat[0]["from"],
        serde_json::json!([{"namespaceSelector": {"matchLabels": {"spur.dev/routes-api": "compat"}}}]),
        "{policy}"
    );
    for rule in open {
        assert!(
            !ports(rule).iter().any(|p| [17777, 17778].contains(p)),
            "a compatibility port open to every namespace: {policy}"
        );
    }
}

/// The rules `sdroutes` prints for routing key `key`, from pod `client` of `ns`.
fn sdroutes(node: &Node, ns: &str, client: &str, key: &str) -> anyhow::Result<Vec<Value>> {
    let addr = format!("routeserver.{SPUR_NAMESPACE}.svc.cluster.local:7777");
    let out = node.kubectl(&[
        "-n",
        ns,
        "exec",
        client,
        "--",
        "sdroutes",
        "-addr",
        &addr,
        "-routing-key",
        key,
    ])?;
    let v: Value = serde_json::from_str(&out)
        .map_err(|e| anyhow::anyhow!("sdroutes printed no JSON ({e}): {out}"))?;
    Ok(v["routingRules"].as_array().cloned().unwrap_or_default())
}

/// A protojson field by its proto name or its JSON name (sdroutes prints proto names).
fn field<'a>(v: &'a Value, proto: &str, json: &str) -> &'a Value {
    if v[proto].is_null() {
        &v[json]
    } else {
        &v[proto]
    }
}

/// A rule as `routesapi-watch` prints it (tests/go/main.go): `<routingKey> <kind>/<namespace>/<name>
/// <sandbox> <port>-><host>:<port>[,...][;...]`, from `sdroutes`' protojson.
fn describe(rule: &Value) -> String {
    let b = field(rule, "baseline", "baseline");
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let mappings: Vec<String> = rule["mappings"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            let dests: Vec<String> = m["destinations"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| format!("{}:{}", s(&d["host"]), d["port"]))
                .collect();
            format!(
                "{}->{}",
                field(m, "workload_port", "workloadPort"),
                dests.join(",")
            )
        })
        .collect();
    format!(
        "{} {}/{}/{} {} {}",
        s(field(rule, "routing_key", "routingKey")),
        s(&b["kind"]),
        s(&b["namespace"]),
        s(&b["name"]),
        s(&field(rule, "destination_sandbox", "destinationSandbox")["name"]),
        if mappings.is_empty() {
            "-".to_string()
        } else {
            mappings.join(";")
        }
    )
}

/// go-routesapi's `watched` cache in a pod, following one baseline Deployment for one key.
/// Stopped in the pod when dropped: killing `kubectl exec` would leave it running there.
struct Watched<'a> {
    node: &'a Node,
    ns: String,
    client: String,
    baseline: String,
    // Before `_dir`: the exec stops before its log goes.
    proc: Background,
    _dir: tempfile::TempDir,
}

impl<'a> Watched<'a> {
    /// Its pid file in the pod.
    fn pid_file(baseline: &str) -> String {
        format!("/tmp/routesapi-watch-{baseline}.pid")
    }

    /// Started in pod `client` of `ns` through `kubectl exec`, with a pid file to stop it by
    /// and, should that fail, an end of its own after 30 minutes.
    fn start(node: &'a Node, ns: &str, client: &str, baseline: &str, key: &str) -> Self {
        let addr = format!("routeserver.{SPUR_NAMESPACE}.svc.cluster.local:7777");
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("watched.log");
        // kubectl exec gives it no stdin: it must not take that for its end.
        let script = format!(
            "echo $$ > {pid}; exec timeout 1800 routesapi-watch -addr={addr} -mode=watched \
             -kind=Deployment -namespace={ns} -name={baseline} -keys={key} \
             -exit-on-stdin-eof=false",
            pid = Self::pid_file(baseline)
        );
        let proc = node
            .kubectl_spawn(&["-n", ns, "exec", client, "--", "sh", "-c", &script], &log)
            .unwrap();
        Watched {
            node,
            ns: ns.to_string(),
            client: client.to_string(),
            baseline: baseline.to_string(),
            proc,
            _dir: dir,
        }
    }

    /// The client's view (routing key → rule) once it printed SYNCED, with every change after
    /// it applied; None before SYNCED. What the standalone test refuses is refused here too: an
    /// ADD of a present key, a REPLACE or REMOVE of an absent one, an INCONSISTENT line; and a
    /// client that exited cannot converge.
    fn view(&self) -> anyhow::Result<Option<BTreeMap<String, String>>> {
        let out = self.proc.output();
        let mut view = BTreeMap::new();
        let mut synced = false;
        for line in out.lines() {
            let (op, rest) = line.split_once(' ').unwrap_or((line, ""));
            let key = rest.split(' ').next().unwrap_or_default().to_string();
            let ok = match op {
                "SYNCED" => {
                    synced = true;
                    true
                }
                "ADD" => view.insert(key, rest.to_string()).is_none(),
                "REPLACE" => view.insert(key, rest.to_string()).is_some(),
                "REMOVE" => view.remove(&key).is_some(),
                "INCONSISTENT" => false,
                // The program's own diagnostics (stderr) and kubectl's.
                _ => true,
            };
            if !ok {
                panic!("the watched client of {}: {line:?}\n{out}", self.baseline);
            }
        }
        if out.contains("command terminated with exit code") {
            panic!("the watched client of {} exited:\n{out}", self.baseline);
        }
        Ok(synced.then_some(view))
    }

    /// Waits until the view is `want`.
    fn until(&self, what: &str, want: &BTreeMap<String, String>) {
        eventually(
            &format!("the watched client of {} to {what}", self.baseline),
            Duration::from_secs(90),
            || Ok(self.view()?.filter(|v| v == want).map(|_| ())),
        )
        .unwrap_or_else(|e| panic!("{e:#}\n{}", self.proc.output()));
    }
}

impl Drop for Watched<'_> {
    fn drop(&mut self) {
        let kill = format!("kill $(cat {}) 2>/dev/null", Self::pid_file(&self.baseline));
        let _ = self.node.kubectl(&[
            "-n",
            &self.ns,
            "exec",
            &self.client,
            "--",
            "sh",
            "-c",
            &kill,
        ]);
    }
}

/// The compatibility endpoint on, with go-routesapi's watched clients following the sandbox:
/// [`Compat::sandbox_gone`] checks they drop its rules, then turns the endpoint off.
pub(crate) struct Compat<'a> {
    ns: String,
    key: String,
    watched: Vec<Watched<'a>>,
}

impl Compat<'_> {
    /// After the sandbox was deleted: every watched client's view is empty, without a restart.
    pub(crate) fn sandbox_gone(self, node: &Node) {
        for w in &self.watched {
            w.until("drop the sandbox's rule", &BTreeMap::new());
        }
        eprintln!(
            "node parity: go-routesapi's watched cache in a pod dropped key {}'s rules for {} baselines",
            self.key,
            self.watched.len()
        );
        drop(self.watched);
        compat(node, false);
        node.kubectl(&["label", "namespace", &self.ns, "spur.dev/routes-api-"])
            .unwrap();
    }
}

/// `sdroutes` in pod `client` of `ns` lists the rules of routing key `key`: one per baseline in
/// `baselines`, each to a sandbox Service of the sandbox; go-routesapi's watched cache in the
/// same pod holds the same rule for each baseline. The endpoint stays on, the watched clients
/// running, until [`Compat::sandbox_gone`].
pub(crate) fn routes_api_in_a_pod<'a>(
    node: &'a Node,
    ns: &str,
    client: &str,
    key: &str,
    baselines: &[&str],
) -> Compat<'a> {
    rendered_policy(node);
    compat(node, true);
    node.kubectl(&[
        "label",
        "namespace",
        ns,
        "spur.dev/routes-api=compat",
        "--overwrite",
    ])
    .unwrap();
    // The route server's pods restarted with the new flags: retry until one answers.
    let rules = spur_e2e::node::eventually(
        "sdroutes in a pod to list the sandbox's rules",
        std::time::Duration::from_secs(90),
        || {
            let rules = sdroutes(node, ns, client, key)?;
            if rules.len() != baselines.len() {
                anyhow::bail!("{} rules, not {}: {rules:?}", rules.len(), baselines.len());
            }
            Ok(Some(rules))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(SPUR_NAMESPACE)));
    let mut names: Vec<&str> = rules
        .iter()
        .map(|r| {
            assert_eq!(field(r, "routing_key", "routingKey"), key, "{r}");
            let baseline = field(r, "baseline", "baseline");
            assert_eq!(baseline["namespace"], ns, "{r}");
            assert_eq!(baseline["kind"], "Deployment", "{r}");
            let dest = field(r, "destination_sandbox", "destinationSandbox");
            assert!(!dest.is_null(), "a rule without a destination: {r}");
            baseline["name"].as_str().unwrap_or_default()
        })
        .collect();
    names.sort_unstable();
    assert_eq!(names, baselines, "{rules:?}");
    eprintln!(
        "node parity: sdroutes in a pod listed {} rules through routeserver.compat",
        rules.len()
    );
    let watched: Vec<Watched<'_>> = rules
        .iter()
        .map(|rule| {
            let baseline = field(rule, "baseline", "baseline")["name"]
                .as_str()
                .unwrap_or_default();
            let w = Watched::start(node, ns, client, baseline, key);
            w.until(
                "hold the rule sdroutes listed",
                &BTreeMap::from([(key.to_string(), describe(rule))]),
            );
            w
        })
        .collect();
    eprintln!(
        "node parity: go-routesapi's watched cache in a pod holds key {key}'s rule for {} baselines",
        watched.len()
    );
    Compat {
        ns: ns.to_string(),
        key: key.to_string(),
        watched,
    }
}
