//! The upgrade from the previous release on the node (issue 47, point 3; RELEASES,
//! docs/releasing.md, docs/install.md "Upgrading"): the node tier installs the last release of
//! RELEASES — its chart and its Spur image, rebuilt from its commit by tests/node/release.sh —
//! and runs an app on it: a Sandbox with capture on, a RouteGroup over it, a finished job and a
//! running one. Under a bounded load loop of keyed, group-keyed and unkeyed requests through the
//! release's sidecars it `helm upgrade`s to the tree under test as a user does (same release,
//! the user's values, `--wait`). Then: no request failed; every object is the same object
//! (uid), Ready, and acted on by the new operator; the finished job's logs are still served and
//! the running one finished in at most two attempts; the release's sidecars kept capturing into
//! the new traffic store; pods restarted afterwards carry the new sidecar and route the same.
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use spur_e2e::node::{CHART_VALUES, Node, SPUR_NAMESPACE, demo_app, eventually};

use crate::{condition, fork_pod, routegroup, sandbox, sandbox_ready, try_get};

const CLIENT: &str = "upgrade-client";
const SANDBOX: &str = "upgrade-fix";
const GROUP: &str = "upgrade-team";
const RUNNERS: &str = "upgrade";
/// The apps' baseline pods (a fork's carry its Sandbox's label).
const APPS: &str = "app in (backend,frontend),!spur.dev/sandbox";
/// The load loop's bounds: iterations, seconds (and a stop file).
const MAX_ITERATIONS: u32 = 20_000;
const MAX_SECONDS: u32 = 900;

/// A release rebuilt by tests/node/release.sh: `SPUR_PREVIOUS_RELEASE` names its directory
/// (tests/run.sh sets it).
pub(crate) struct Release {
    pub(crate) version: String,
    pub(crate) commit: String,
    /// The release's charts/spur.
    pub(crate) chart: String,
}

impl Release {
    pub(crate) fn previous() -> Self {
        let dir = std::env::var("SPUR_PREVIOUS_RELEASE").unwrap_or_else(|_| {
            panic!(
                "SPUR_PREVIOUS_RELEASE is not set: it names the directory tests/node/release.sh \
                 prints (tests/run.sh sets it; tests/node/README.md)"
            )
        });
        let text = std::fs::read_to_string(format!("{dir}/release"))
            .unwrap_or_else(|e| panic!("{dir}/release: {e} (run tests/node/release.sh)"));
        let mut words = text.split_whitespace();
        let (Some(version), Some(commit), None) = (words.next(), words.next(), words.next()) else {
            panic!("{dir}/release: expected '<version> <commit>', found {text:?}");
        };
        Release {
            version: version.to_owned(),
            commit: commit.to_owned(),
            chart: format!("{dir}/chart"),
        }
    }

    /// The release's image, as tests/node/release.sh tagged it.
    pub(crate) fn image(&self) -> String {
        format!("localhost/spur:{}", self.version)
    }

    /// `helm install` of the release's chart with the node tier's values and its own image.
    pub(crate) fn install(&self, node: &Node, release: &str) {
        let tag = format!("image.tag={}", self.version);
        let mut args = vec![
            "install",
            release,
            &self.chart,
            "--namespace",
            SPUR_NAMESPACE,
            "--wait",
            "--timeout",
            "5m",
        ];
        args.extend_from_slice(CHART_VALUES);
        // After the node tier's values: the later --set wins.
        args.extend(["--set", &tag]);
        node.helm(&args)
            .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(SPUR_NAMESPACE)));
        eprintln!(
            "upgrade: release {} ({}) installed",
            self.version, self.commit
        );
    }
}

/// The images of every container of the pods of `ns` matching `selector`, by pod.
fn images(node: &Node, ns: &str, selector: &str) -> BTreeMap<String, Vec<String>> {
    let pods = if selector.is_empty() {
        node.get_json(ns, &["pods"])
    } else {
        node.get_json(ns, &["pods", "-l", selector])
    }
    .unwrap();
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let spec = &p["spec"];
            let images = ["initContainers", "containers"]
                .iter()
                .flat_map(|k| spec[k].as_array().into_iter().flatten())
                .filter_map(|c| c["image"].as_str().map(str::to_owned))
                .collect();
            (
                p["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                images,
            )
        })
        .collect()
}

/// Whether a pod of Spur's namespace has ended (Succeeded or Failed).
fn finished(node: &Node, pod: &str) -> bool {
    node.get_json(SPUR_NAMESPACE, &["pod", pod])
        .map(|p| matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed")))
        .unwrap_or(true)
}

fn uid(node: &Node, ns: &str, what: &[&str]) -> String {
    let v = node.get_json(ns, what).unwrap();
    v["metadata"]["uid"].as_str().unwrap_or_default().to_owned()
}

fn job_yaml(ns: &str, name: &str, extra: &str, script: &str) -> String {
    let script: String = script.lines().map(|l| format!("    {l}\n")).collect();
    format!(
        "apiVersion: spur.dev/v1alpha1\nkind: Job\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  runnerGroup: {RUNNERS}\n{extra}  script: |\n{script}"
    )
}

fn job_ended(node: &Node, ns: &str, name: &str, limit: Duration) -> Value {
    eventually(&format!("job {name} to end"), limit, || {
        let j = node.get_json(ns, &["jobs.spur.dev", name])?;
        let phase = j["status"]["phase"].as_str().unwrap_or("");
        Ok(["Succeeded", "Failed", "Canceled"]
            .contains(&phase)
            .then_some(j))
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)))
}

/// `spur_traffic_exchanges_stored_total` of the traffic store's pod(s), scraped from `client`.
fn exchanges_stored(node: &Node, ns: &str) -> u64 {
    let ips: Vec<String> = node
        .get_json(
            SPUR_NAMESPACE,
            &["pods", "-l", "app.kubernetes.io/name=spur-traffic"],
        )
        .unwrap()["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|p| p["status"]["podIP"].as_str().map(str::to_owned))
        .collect();
    ips.iter()
        .map(|ip| {
            let out = node
                .kubectl(&[
                    "-n",
                    ns,
                    "exec",
                    CLIENT,
                    "--",
                    "sh",
                    "-c",
                    &format!(
                        "curl -s --max-time 3 http://{ip}:9090/metrics | grep -E '^spur_traffic_exchanges_stored_total ' || true"
                    ),
                ])
                .unwrap_or_default();
            out.split_whitespace()
                .nth(1)
                .and_then(|n| n.parse::<f64>().ok())
                .unwrap_or(0.0) as u64
        })
        .sum()
}

/// What the sidecars of `ns` and the traffic store said about capture (a failure's context):
/// the sidecars' capture log lines, the store's calls by method and code, its log.
fn capture_logs(node: &Node, ns: &str) -> String {
    let mut out = String::new();
    let pods = node.get_json(ns, &["pods"]).unwrap_or_default();
    for p in pods["items"].as_array().into_iter().flatten() {
        let pod = p["metadata"]["name"].as_str().unwrap_or_default();
        let log = node
            .kubectl(&["-n", ns, "logs", pod, "-c", "spur-sidecar", "--tail=5000"])
            .unwrap_or_else(|e| format!("{e:#}"));
        let log: Vec<&str> = log
            .lines()
            .filter(|l| !l.contains("DEBUG") && (l.contains("captur") || l.contains("traffic")))
            .collect();
        out.push_str(&format!(
            "--- {pod} ({}) spur-sidecar:\n{}\n",
            p["metadata"]["labels"],
            log.join("\n")
        ));
    }
    let ips = node
        .get_json(
            SPUR_NAMESPACE,
            &["pods", "-l", "app.kubernetes.io/name=spur-traffic"],
        )
        .unwrap_or_default();
    for ip in ips["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["status"]["podIP"].as_str())
    {
        let m = node
            .kubectl(&[
                "-n",
                ns,
                "exec",
                CLIENT,
                "--",
                "sh",
                "-c",
                &format!("curl -s --max-time 3 http://{ip}:9090/metrics | grep -E '^spur_traffic_(calls|exchanges|sidecar)'"),
            ])
            .unwrap_or_else(|e| format!("{e:#}"));
        out.push_str(&format!("--- spur-traffic {ip} metrics:\n{m}\n"));
    }
    let log = node
        .kubectl(&[
            "-n",
            SPUR_NAMESPACE,
            "logs",
            "deploy/spur-traffic",
            "--tail=2000",
        ])
        .unwrap_or_else(|e| format!("{e:#}"));
    let log: Vec<&str> = log.lines().filter(|l| !l.contains("DEBUG")).collect();
    out.push_str(&format!("--- spur-traffic:\n{}\n", log.join("\n")));
    out
}

/// The upgrade (see the module docs). `upgrade` runs `helm upgrade` of the tree's chart with
/// the node tier's values, `--wait`.
pub(crate) fn from_the_previous_release(node: &Node, previous: &Release, upgrade: impl FnOnce()) {
    let old_image = previous.image();
    let app = node
        .namespace(
            "upgrade",
            &[
                ("sidecar.spur.dev/inject", "true"),
                ("spur.dev/enabled", "true"),
            ],
        )
        .unwrap();
    let ns = app.name.as_str();
    // The jobs' runner pods start while the apps do.
    node.apply(&format!(
        "apiVersion: spur.dev/v1alpha1\nkind: JobRunnerGroup\nmetadata:\n  name: {RUNNERS}\n  namespace: {ns}\nspec:\n  image: localhost/spur-test-client:dev\n  replicas: 1\n  jobTimeout: 10m\n"
    ))
    .unwrap();
    node.apply(&demo_app(ns, "backend", None)).unwrap();
    node.apply(&demo_app(ns, "frontend", Some("http://backend:8080")))
        .unwrap();
    node.rollout(ns, "backend").unwrap();
    node.rollout(ns, "frontend").unwrap();
    let backend = node
        .pods(ns, "app=backend,!spur.dev/sandbox")
        .unwrap()
        .swap_remove(0);
    // The release's webhook injected the release's sidecar.
    for (pod, images) in images(node, ns, APPS) {
        assert!(
            images.contains(&old_image),
            "{pod} runs {images:?}, not the release's sidecar ({old_image})"
        );
    }
    node.client_pod_with(ns, CLIENT, None).unwrap();
    let frontend = format!("http://frontend.{ns}.svc.cluster.local:8080/");

    // --- a Sandbox with capture on, a RouteGroup over it -------------------------------------
    node.apply(&format!(
        "{}  capture: {{enabled: true}}\n",
        sandbox(SANDBOX, ns, "backend", "fix", Some(GROUP))
    ))
    .unwrap();
    node.apply(&routegroup(GROUP, ns)).unwrap();
    let key = sandbox_ready(node, SANDBOX);
    let fork = fork_pod(node, ns, SANDBOX);
    let group_key = eventually("the RouteGroup's key", Duration::from_secs(60), || {
        let g = node.get_json("default", &["routegroup", GROUP])?;
        Ok(g["status"]["routingKey"].as_str().map(String::from))
    })
    .unwrap();
    for k in [&key, &group_key] {
        crate::until_answered_by(node, ns, CLIENT, &frontend, k, &fork).unwrap();
    }

    // --- a job that finished, one running through the upgrade --------------------------------
    node.apply(&job_yaml(
        ns,
        "before",
        &format!("  routingContext:\n    sandbox: {SANDBOX}\n"),
        &format!(
            "#!/bin/sh\nset -eu\ncurl -sS --max-time 10 -H \"baggage: sd-routing-key=$SPUR_ROUTING_KEY\" {frontend}\necho\n"
        ),
    ))
    .unwrap();
    let before = job_ended(node, ns, "before", Duration::from_secs(240));
    assert_eq!(before["status"]["phase"], "Succeeded", "{before}");
    let logs = |name: &str| {
        let (code, out, err) = crate::node_jobs::run(node, ns, &["job", "logs", name], None);
        assert_eq!(code, 0, "spur job logs {name}: {out}\n{err}");
        out
    };
    let before_log = logs("before");
    assert!(
        before_log.contains(&format!("\"pod\":\"{fork}\"")),
        "the job's request reached the fork: {before_log}"
    );
    node.apply(&job_yaml(
        ns,
        "through",
        "",
        "echo started\nsleep 45\necho finished\n",
    ))
    .unwrap();

    // --- what the upgrade must keep -----------------------------------------------------------
    let forks = node
        .get_json(
            ns,
            &["deployments", "-l", &format!("spur.dev/sandbox={SANDBOX}")],
        )
        .unwrap();
    let fork_deployment = forks["items"][0]["metadata"]["name"]
        .as_str()
        .unwrap_or_else(|| panic!("no fork Deployment: {forks}"))
        .to_owned();
    let kept: [(&str, [&str; 2]); 5] = [
        ("default", ["sandbox", SANDBOX]),
        ("default", ["routegroup", GROUP]),
        (ns, ["deployment", &fork_deployment]),
        (ns, ["jobs.spur.dev", "before"]),
        (ns, ["jobrunnergroup", RUNNERS]),
    ];
    let uids_of = || -> Vec<String> { kept.iter().map(|(n, what)| uid(node, n, what)).collect() };
    let uids = uids_of();
    assert!(uids.iter().all(|u| !u.is_empty()), "{kept:?}: {uids:?}");
    let stored_before = eventually(
        "the release's sidecars to capture keyed exchanges",
        Duration::from_secs(60),
        || {
            try_get(node, ns, CLIENT, &frontend, Some(&key))?;
            let n = exchanges_stored(node, ns);
            Ok((n > 0).then_some(n))
        },
    )
    .unwrap();

    // --- the load: keyed, group-keyed and unkeyed, through the release's sidecars ------------
    let exec = |script: &str| node.kubectl(&["-n", ns, "exec", CLIENT, "--", "sh", "-c", script]);
    let script = format!(
        r#"cat > /tmp/load.sh <<'END'
end=$(( $(date +%s) + {MAX_SECONDS} )); i=0
while [ ! -e /tmp/stop ] && [ $i -lt {MAX_ITERATIONS} ] && [ $(date +%s) -lt $end ]; do
  i=$((i+1))
  k=$(curl -sS --max-time 5 -H 'baggage: sd-routing-key={key}' -w ' %{{http_code}}' '{frontend}' 2>&1)
  case "$k" in *'"pod":"{fork_deployment}-'*' 200') ;; *) echo "keyed $i $(date +%T): $k" ;; esac
  g=$(curl -sS --max-time 5 -H 'baggage: sd-routing-key={group_key}' -w ' %{{http_code}}' '{frontend}' 2>&1)
  case "$g" in *'"pod":"{fork_deployment}-'*' 200') ;; *) echo "group $i $(date +%T): $g" ;; esac
  u=$(curl -sS --max-time 5 -w ' %{{http_code}}' '{frontend}' 2>&1)
  case "$u" in *'"pod":"{backend}"'*' 200') ;; *) echo "unkeyed $i $(date +%T): $u" ;; esac
  echo $i > /tmp/count
done
touch /tmp/finished
END
rm -f /tmp/stop /tmp/finished /tmp/count
nohup sh /tmp/load.sh > /tmp/load.log 2>&1 &
echo started"#
    );
    assert_eq!(exec(&script).unwrap().trim(), "started");
    let count = || -> u64 {
        exec("cat /tmp/count 2>/dev/null || echo 0")
            .unwrap_or_default()
            .trim()
            .parse()
            .unwrap_or(0)
    };
    eventually("load to flow", Duration::from_secs(60), || {
        Ok((count() >= 20).then_some(()))
    })
    .unwrap();
    eventually(
        "the job through the upgrade to run",
        Duration::from_secs(180),
        || {
            let j = node.get_json(ns, &["jobs.spur.dev", "through"])?;
            Ok((j["status"]["phase"] == "Running").then_some(()))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));

    // --- helm upgrade to the tree under test ---------------------------------------------------
    let sent_before = count();
    let started = Instant::now();
    upgrade();
    let took = started.elapsed();
    // Every component runs the tree's image: the release's pods are gone (terminating ones
    // too: a pod still draining would still be the release's).
    eventually(
        "every Spur pod to run the tree's image",
        Duration::from_secs(180),
        || {
            // Every pod of the namespace but finished ones (a CronJob's, a hook's).
            let running = images(node, SPUR_NAMESPACE, "");
            let running: BTreeMap<String, Vec<String>> = running
                .into_iter()
                .filter(|(pod, _)| !finished(node, pod))
                .collect();
            anyhow::ensure!(!running.is_empty(), "no pod in {SPUR_NAMESPACE}");
            let left: Vec<&String> = running
                .iter()
                .filter(|(_, i)| {
                    i.iter()
                        .any(|i| i.starts_with("localhost/spur:") && i != "localhost/spur:dev")
                })
                .map(|(pod, _)| pod)
                .collect();
            Ok(left.is_empty().then_some(()))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(SPUR_NAMESPACE)));
    // The load goes on through the new control plane for a while: the release's sidecars
    // against the new route server.
    let upgraded_at = count();
    eventually(
        "100 more iterations after the upgrade",
        Duration::from_secs(180),
        || Ok((count() >= upgraded_at + 100).then_some(())),
    )
    .unwrap();

    // --- the load ends: not one request failed ---------------------------------------------
    assert_eq!(
        exec("test -e /tmp/finished && echo finished; true")
            .unwrap()
            .trim(),
        "",
        "the load loop ended before the upgrade did (iterations {}, bound {MAX_ITERATIONS} or {MAX_SECONDS} s)",
        count()
    );
    exec("touch /tmp/stop").unwrap();
    eventually("the load loop to stop", Duration::from_secs(30), || {
        Ok(exec("test -e /tmp/finished && echo yes")
            .unwrap_or_default()
            .contains("yes")
            .then_some(()))
    })
    .unwrap();
    let iterations = count();
    let failures = exec("cat /tmp/load.log").unwrap();

    // --- every object the same one, reconciled by the new operator ---------------------------
    assert_eq!(uids_of(), uids, "{kept:?} replaced by the upgrade");
    let s = node.get_json("default", &["sandbox", SANDBOX]).unwrap();
    assert_eq!(condition(&s, "Ready"), Some("True"), "{s}");
    assert_eq!(s["status"]["routingKey"], key.as_str(), "{s}");
    let g = node.get_json("default", &["routegroup", GROUP]).unwrap();
    assert_eq!(g["status"]["routingKey"], group_key.as_str(), "{g}");
    let through = job_ended(node, ns, "through", Duration::from_secs(240));
    assert_eq!(through["status"]["phase"], "Succeeded", "{through}");
    let attempts = through["status"]["attemptCount"].as_i64().unwrap_or(0);
    assert!(
        (1..=2).contains(&attempts),
        "a job running through the upgrade took {attempts} attempts: {through}"
    );
    assert!(logs("through").contains("finished"));
    assert_eq!(
        logs("before"),
        before_log,
        "the finished job's logs, stored by the release"
    );
    // The release's sidecars push captured exchanges to the new store.
    let stored_after = eventually(
        "the release's sidecars to capture into the new traffic store",
        Duration::from_secs(60),
        || {
            try_get(node, ns, CLIENT, &frontend, Some(&key))?;
            let n = exchanges_stored(node, ns);
            Ok((n > 0).then_some(n))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", capture_logs(node, ns)));
    // The new operator acts on the release's Sandbox: a changed fork rolls out and answers.
    node.kubectl(&[
        "patch",
        "sandbox",
        SANDBOX,
        "--type=json",
        "-p",
        r#"[{"op":"replace","path":"/spec/forks/0/customizations/env/0/value","value":"fix-upgraded"}]"#,
    ])
    .unwrap();
    let changed = eventually(
        "the release's Sandbox, changed after the upgrade, to answer with its new marker",
        Duration::from_secs(180),
        || {
            let a = try_get(node, ns, CLIENT, &frontend, Some(&key))?;
            Ok((a.marker() == Some("fix-upgraded")).then_some(a))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));
    let new_fork = fork_pod(node, ns, SANDBOX);
    assert_eq!(
        changed.answered_by(),
        Some(new_fork.as_str()),
        "{changed:?}"
    );
    // A job submitted now runs on the release's runner group.
    node.apply(&job_yaml(ns, "after", "", "echo after\n"))
        .unwrap();
    let after = job_ended(node, ns, "after", Duration::from_secs(240));
    assert_eq!(after["status"]["phase"], "Succeeded", "{after}");

    // --- restarted apps take the new sidecar and route the same ------------------------------
    for app in ["backend", "frontend"] {
        node.kubectl(&["-n", ns, "rollout", "restart", &format!("deployment/{app}")])
            .unwrap();
        node.rollout(ns, app).unwrap();
    }
    eventually(
        "the restarted apps' old pods to go",
        Duration::from_secs(120),
        || Ok((images(node, ns, APPS).len() == 2).then_some(())),
    )
    .unwrap();
    for (pod, images) in images(node, ns, APPS) {
        assert!(
            images.iter().any(|i| i == "localhost/spur:dev") && !images.contains(&old_image),
            "{pod} runs {images:?}: not the new sidecar"
        );
    }
    let backend = node
        .pods(ns, "app=backend,!spur.dev/sandbox")
        .unwrap()
        .swap_remove(0);
    // The fork follows its baseline's template, so the restart rolls it as well: a pod of the
    // fork's Deployment, with the changed marker, answers.
    for k in [&key, &group_key] {
        eventually(
            &format!("key {k} answered by the fork after the restart"),
            Duration::from_secs(180),
            || {
                let a = try_get(node, ns, CLIENT, &frontend, Some(k))?;
                let by = a.answered_by().unwrap_or_default();
                Ok((by.starts_with(&format!("{fork_deployment}-"))
                    && a.marker() == Some("fix-upgraded"))
                .then_some(()))
            },
        )
        .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));
    }
    let plain = try_get(node, ns, CLIENT, &frontend, None).unwrap();
    assert_eq!(plain.answered_by(), Some(backend.as_str()), "{plain:?}");

    eprintln!(
        "upgrade from {} ({}) under load: helm upgrade --wait took {:.1} s; {iterations} \
         iterations ({} requests through the release's sidecars, {} of them sent before the \
         upgrade began), {} failed; Sandbox, RouteGroup, fork, job and runner group kept \
         (same uids); a job running through it finished in {attempts} attempt(s); exchanges \
         captured: {stored_before} into the release's store, {stored_after} into the new one",
        previous.version,
        &previous.commit[..12],
        took.as_secs_f64(),
        iterations * 3,
        sent_before * 3,
        failures.lines().count(),
    );
    assert_eq!(
        failures.trim(),
        "",
        "requests through the release's sidecars failed during the upgrade"
    );

    node.kubectl(&[
        "delete",
        "routegroup",
        GROUP,
        "--wait=true",
        "--timeout=60s",
    ])
    .unwrap();
    node.kubectl(&[
        "delete",
        "sandbox",
        SANDBOX,
        "--wait=true",
        "--timeout=180s",
    ])
    .unwrap();
    drop(app);
}
