//! Day-2 operations on the node (issue 47, docs/runbooks.md, docs/install.md "Upgrading"):
//! every metric name Spur's alerts and dashboards read is exported by a component running in the
//! cluster (scraped, not assumed), and a `helm upgrade` of the injection config rolls the
//! operator so that pods created afterwards get the new setting, while an upgrade of anything
//! else leaves the operator's pods running.
use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use spur_api::keys::injection::SIDECAR_CONTAINER;
use spur_e2e::node::{Node, SPUR_NAMESPACE, eventually};

/// The series names a `/metrics` text stands for: each `# TYPE` family with the sample names
/// its kind has (prometheus-client writes counters' samples with `_total`, histograms' with
/// `_bucket`, `_sum` and `_count`).
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        names.insert(name.to_owned());
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            "info" => &["_info"],
            _ => &[],
        };
        names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
    }
    names
}

/// `(file, name)` of every metric the alerts and the dashboards read, as Prometheus' parser
/// reads their expressions (`monitoring-check`, tests/go-monitoring).
fn read_by_alerts_and_dashboards() -> BTreeSet<(String, String)> {
    let chart = format!("{}/../charts/spur/files", env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![format!("{chart}/alerts.yaml")];
    for e in std::fs::read_dir(format!("{chart}/dashboards")).unwrap() {
        files.push(e.unwrap().path().display().to_string());
    }
    let out = Command::new(spur_e2e::go_bin_dir().join("monitoring-check"))
        .args(&files)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "monitoring-check: {text}");
    text.lines()
        .filter_map(|l| l.strip_prefix("METRIC "))
        .filter_map(|l| l.split_once(' '))
        .map(|(f, m)| (f.to_owned(), m.to_owned()))
        .collect()
}

/// `curl` of `url` from `client` (http, then https without verification: the route server's
/// REST port serves TLS with the operator's CA).
fn scrape(node: &Node, ns: &str, client: &str, ip: &str, port: &str) -> String {
    for scheme in ["http", "https"] {
        let url = format!("{scheme}://{ip}:{port}/metrics");
        if let Ok(text) = node.kubectl(&[
            "-n",
            ns,
            "exec",
            client,
            "--",
            "curl",
            "-sS",
            "-k",
            "--max-time",
            "10",
            &url,
        ]) && text.contains("# TYPE ")
        {
            return text;
        }
    }
    String::new()
}

/// Scrapes every Spur pod's metrics port (and an injected sidecar's admin port, `pod` in `ns`)
/// and checks each name the alerts and dashboards read is among what they export, or is a family
/// registered without a series yet.
pub(crate) fn metrics_the_alerts_read_are_exported(node: &Node, ns: &str, client: &str, pod: &str) {
    let mut have = BTreeSet::new();
    let mut scraped = Vec::new();
    let pods = node.get_json(SPUR_NAMESPACE, &["pods"]).unwrap();
    for p in pods["items"].as_array().unwrap() {
        let (Some(name), Some(ip)) = (
            p["metadata"]["name"].as_str(),
            p["status"]["podIP"].as_str(),
        ) else {
            continue;
        };
        if p["status"]["phase"] != "Running" {
            continue;
        }
        for c in p["spec"]["containers"].as_array().unwrap() {
            for port in c["ports"].as_array().into_iter().flatten() {
                if !["metrics", "http", "health"].contains(&port["name"].as_str().unwrap_or("")) {
                    continue;
                }
                let number = port["containerPort"].to_string();
                let text = scrape(node, ns, client, ip, &number);
                if !text.is_empty() {
                    scraped.push(format!("{name}:{number}"));
                    have.extend(exported(&text));
                }
            }
        }
    }
    let sidecar = node.get_json(ns, &["pod", pod]).unwrap();
    let ip = sidecar["status"]["podIP"].as_str().unwrap();
    let text = scrape(node, ns, client, ip, "15020");
    assert!(
        !text.is_empty(),
        "no metrics from the sidecar of {ns}/{pod}"
    );
    scraped.push(format!("{pod}:15020"));
    have.extend(exported(&text));

    // A family without series yet (no watch has failed, no eviction happened) writes nothing,
    // not even its `# TYPE` line; the hub runs outside the cluster here. Those names are looked
    // up in the sources' registrations instead, and listed.
    let sources = rust_sources();
    let (unseen, missing): (Vec<_>, Vec<_>) = read_by_alerts_and_dashboards()
        .into_iter()
        .filter(|(_, m)| !have.contains(m))
        .partition(|(_, m)| registered(&sources, m));
    assert!(
        missing.is_empty(),
        "read by the alerts or dashboards but exported by no running component \
         (scraped {scraped:?}): {missing:?}"
    );
    println!(
        "monitoring: {} names exported by {} endpoints cover every name the alerts and dashboards read \
         but these, registered without a series yet: {unseen:?}",
        have.len(),
        scraped.len()
    );
}

/// Every `.rs` file under controlplane/ and dataplane/, concatenated.
fn rust_sources() -> String {
    fn walk(dir: &std::path::Path, out: &mut String) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = e.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|x| x == "rs") {
                out.push_str(&std::fs::read_to_string(&path).unwrap_or_default());
            }
        }
    }
    let mut out = String::new();
    for dir in ["controlplane", "dataplane"] {
        walk(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join(dir),
            &mut out,
        );
    }
    out
}

/// Whether `name` is registered in `sources`: its family name without the registry prefixes
/// Spur's components use and the sample suffix, as a string literal.
fn registered(sources: &str, name: &str) -> bool {
    let prefixes = [
        "spur_operator_",
        "spur_routeserver_",
        "spur_jobs_",
        "spur_traffic_",
        "spur_hub_",
        "spur_tunnel_proxy_",
        "spur_tunnel_",
        "spur_",
    ];
    prefixes
        .iter()
        .filter_map(|p| name.strip_prefix(p))
        .any(|rest| {
            let base = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| rest.strip_suffix(s))
                .unwrap_or(rest);
            sources.contains(&format!("\"{base}\""))
        })
}

fn operator_pods(node: &Node) -> BTreeSet<String> {
    node.pods(SPUR_NAMESPACE, "app.kubernetes.io/name=spur-operator")
        .unwrap()
        .into_iter()
        .collect()
}

/// The `SPUR_LOG` of the sidecar injected into `pod`.
fn sidecar_log(node: &Node, ns: &str, pod: &str) -> Option<String> {
    let p = node.get_json(ns, &["pod", pod]).ok()?;
    let containers = p["spec"]["containers"].as_array().into_iter().flatten();
    let inits = p["spec"]["initContainers"].as_array().into_iter().flatten();
    let sidecar: &Value = containers
        .chain(inits)
        .find(|c| c["name"] == SIDECAR_CONTAINER)?;
    sidecar["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == "SPUR_LOG")
        .and_then(|e| e["value"].as_str())
        .map(str::to_owned)
}

/// `upgrade(extra values)` runs `helm upgrade` the way the node test does. First an upgrade of
/// the route server alone (its memory limit): the operator's pods are the same after it. Then
/// `injection.sidecarLog=info` (the node test installs with debug): the operator's pods are
/// replaced, and a pod created afterwards (deployment `deployment` of `ns` restarted) has a
/// sidecar logging at info where the one before logged at debug.
pub(crate) fn a_changed_injection_config_reaches_new_pods(
    node: &Node,
    ns: &str,
    deployment: &str,
    upgrade: impl Fn(&[&str]),
) {
    node.rollout(SPUR_NAMESPACE, "spur-operator").unwrap();
    let before = operator_pods(node);
    upgrade(&["--set", "routeserver.resources.limits.memory=150Mi"]);
    node.rollout(SPUR_NAMESPACE, "spur-routeserver").unwrap();
    assert_eq!(
        operator_pods(node),
        before,
        "an upgrade of the route server alone replaced the operator's pods"
    );
    let label = format!("app={deployment}");
    let old_pod = node.pods(ns, &label).unwrap().swap_remove(0);
    let old_log = sidecar_log(node, ns, &old_pod);
    assert_eq!(old_log.as_deref(), Some("debug"), "{ns}/{old_pod}");

    upgrade(&["--set", "injection.sidecarLog=info"]);
    node.rollout(SPUR_NAMESPACE, "spur-operator").unwrap();
    let after = operator_pods(node);
    assert!(
        after.is_disjoint(&before),
        "the operator kept pods from before the injection config changed: {before:?} -> {after:?}"
    );
    // The new replicas serve the webhook once their Service has them; the restart's pods are
    // admitted by whichever replica answers, so retry until a new pod carries the new config.
    let pod = eventually(
        "a pod created after the upgrade to get the new injection config",
        Duration::from_secs(180),
        || {
            node.kubectl(&[
                "-n",
                ns,
                "rollout",
                "restart",
                &format!("deployment/{deployment}"),
            ])?;
            node.rollout(ns, deployment)?;
            let pods = node.pods(ns, &label)?;
            Ok(pods
                .into_iter()
                .find(|p| sidecar_log(node, ns, p).as_deref() == Some("info")))
        },
    )
    .unwrap();
    println!("config: injection.sidecarLog=info reached {ns}/{pod} after the operator rolled");
}

/// `helm upgrade` turns `jobs.persistence.enabled` off and on again: each upgrade succeeds (the
/// chart's pre-upgrade hook replaces the StatefulSet whose claim template cannot change), the
/// jobs server runs on an emptyDir and then on its claim again, the same claim as before (kept
/// while persistence was off). `upgrade(extra values)` as for
/// [`a_changed_injection_config_reaches_new_pods`].
pub(crate) fn jobs_persistence_switches_in_an_upgrade(node: &Node, upgrade: impl Fn(&[&str])) {
    let claim = |node: &Node| -> Option<String> {
        let c = node
            .get_json(SPUR_NAMESPACE, &["pvc", "data-spur-jobs-0"])
            .ok()?;
        c["metadata"]["uid"].as_str().map(str::to_owned)
    };
    let sts = |node: &Node| -> Value {
        node.get_json(SPUR_NAMESPACE, &["statefulset", "spur-jobs"])
            .unwrap()
    };
    let pod_volume = |node: &Node| -> Value {
        eventually(
            "the jobs server's pod of the new StatefulSet to run",
            Duration::from_secs(180),
            || {
                let s = sts(node);
                let p = node.get_json(SPUR_NAMESPACE, &["pod", "spur-jobs-0"])?;
                let current = p["metadata"]["labels"]["controller-revision-hash"]
                    == s["status"]["updateRevision"];
                let ready = p["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True");
                let data = p["spec"]["volumes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|v| v["name"] == "data")
                    .cloned();
                Ok(
                    (current && ready && p["metadata"]["deletionTimestamp"].is_null())
                        .then_some(data)
                        .flatten(),
                )
            },
        )
        .unwrap()
    };
    let first_claim = claim(node).expect("the jobs server's claim before the switch");
    let first_uid = sts(node)["metadata"]["uid"].clone();
    let ca = |node: &Node| {
        node.get_json(SPUR_NAMESPACE, &["secret", "spur-jobs-ca"])
            .unwrap()
    };
    let ca_uid = ca(node)["metadata"]["uid"].clone();

    upgrade(&["--set", "jobs.persistence.enabled=false"]);
    let off = sts(node);
    assert_ne!(
        off["metadata"]["uid"], first_uid,
        "the StatefulSet was not replaced"
    );
    assert!(
        off["spec"]["volumeClaimTemplates"].is_null(),
        "{}",
        off["spec"]
    );
    let volume = pod_volume(node);
    assert!(volume["emptyDir"].is_object(), "{volume}");
    assert_eq!(
        claim(node).as_deref(),
        Some(first_claim.as_str()),
        "the claim is kept while persistence is off"
    );

    upgrade(&[]);
    let on = sts(node);
    assert_eq!(
        on["spec"]["volumeClaimTemplates"][0]["metadata"]["name"],
        "data"
    );
    let volume = pod_volume(node);
    assert_eq!(
        volume["persistentVolumeClaim"]["claimName"], "data-spur-jobs-0",
        "{volume}"
    );
    assert_eq!(
        claim(node).as_deref(),
        Some(first_claim.as_str()),
        "persistence back on uses the claim it had"
    );
    // The jobs CA outlived both replacements (runner pods hold certificates it signed), and
    // belongs to the StatefulSet of now, so an uninstall still removes it.
    let sts_uid = on["metadata"]["uid"].clone();
    eventually(
        "the jobs CA Secret owned by the new StatefulSet",
        Duration::from_secs(60),
        || {
            let c = ca(node);
            assert_eq!(c["metadata"]["uid"], ca_uid, "the jobs CA was replaced");
            let owned = c["metadata"]["ownerReferences"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|o| o["uid"] == sts_uid);
            Ok(owned.then_some(()))
        },
    )
    .unwrap();
    println!(
        "upgrade: jobs.persistence.enabled off and on again, claim data-spur-jobs-0 and the jobs CA kept"
    );
}
