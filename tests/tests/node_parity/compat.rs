//! Signadot's Routes API client in the cluster (issue 45, point 4): with the chart's
//! `routeserver.compat` on, `sdroutes` (go-routesapi's CLI, unchanged, in the test-client image)
//! in a pod of a namespace labelled `spur.dev/routes-api=compat` dials
//! `routeserver.<release namespace>:7777` in plaintext, as Signadot documents for its consumers,
//! and lists a sandbox's rules by routing key.
//!
//! What this cannot show: the node's CNI (bridge) enforces no NetworkPolicy, so that pods of
//! other namespaces are kept off the compatibility ports is checked on the policy the chart
//! renders (`spur-routeserver-compat`), not by a refused connection.

use serde_json::Value;
use spur_e2e::node::{Node, SPUR_NAMESPACE};

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

/// `sdroutes` in pod `client` of `ns` lists the rules of routing key `key`: one per baseline in
/// `baselines`, each to a sandbox Service of the sandbox.
pub(crate) fn sdroutes_in_a_pod(
    node: &Node,
    ns: &str,
    client: &str,
    key: &str,
    baselines: &[&str],
) {
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
    compat(node, false);
    node.kubectl(&["label", "namespace", ns, "spur.dev/routes-api-"])
        .unwrap();
}
