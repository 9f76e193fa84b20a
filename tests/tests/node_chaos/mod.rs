//! Chaos under load on the node (issue 47, point 1; docs/runbooks.md): while a bounded load loop
//! sends keyed and unkeyed requests through injected sidecars, each control-plane component is
//! deleted in turn — both operator replicas (the leader first), the route server, the tunnel
//! proxy, the traffic store, the io context server and the jobs server with a job running — and
//! the node's containerd is restarted; during each outage a Sandbox is created and the one
//! created during the outage before is deleted. No request through the sidecars fails (the data
//! plane does not depend on the control plane being up); every Sandbox created during an outage
//! converges after it and every one deleted is gone with its fork (times measured, printed); no
//! Sandbox or fork is lost or duplicated; the running job finishes with no more than one extra
//! attempt; and neither the operator replicas' `spur_operator_leader` series nor the jobs
//! component's `spur_jobs_leader` ever add up to more than one (sampled through the run).
//! The data plane's own failure too: the worker process of a baseline pod's sidecar is killed
//! (SIGKILL); its supervisor serves on with a new one, the container is not restarted, and the
//! one request in flight in the killed worker, if there was one, is the only failure allowed.
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::Value;
use spur_e2e::node::{Node, SPUR_NAMESPACE, eventually};

use crate::{condition, fork_pod, sandbox, sandbox_ready, try_get};

mod table_watch;

const CLIENT: &str = "chaos-client";
/// The load loop's bounds: iterations, seconds (and a stop file).
const MAX_ITERATIONS: u32 = 30_000;
const MAX_SECONDS: u32 = 1800;

/// A leader-elected component whose replicas each export a leader series.
struct Elected {
    name: &'static str,
    selector: &'static str,
    port: u16,
    series: &'static str,
}

/// The operator's replicas and the jobs component's.
const ELECTED: [Elected; 2] = [
    Elected {
        name: "operator",
        selector: "app.kubernetes.io/name=spur-operator",
        port: 8080,
        series: "spur_operator_leader",
    },
    Elected {
        name: "jobs",
        selector: "app.kubernetes.io/name=spur-jobs",
        port: 9090,
        series: "spur_jobs_leader",
    },
];

/// What the run saw of the leader series, per component of [`ELECTED`].
#[derive(Default)]
struct Leaders {
    samples: [u32; 2],
    /// Samples in which no replica reported itself leader (a hand-over, or none running).
    without: [u32; 2],
}

impl Leaders {
    /// How many pods of each component (terminating ones too: a replica leads until it lets
    /// go) report themselves leader, scraped one after another; `None` when none answered.
    fn count(node: &Node, ns: &str) -> [Option<usize>; 2] {
        let mut script = Vec::new();
        for (i, c) in ELECTED.iter().enumerate() {
            let Ok(pods) = node.get_json(SPUR_NAMESPACE, &["pods", "-l", c.selector]) else {
                continue;
            };
            let ips: BTreeSet<String> = pods["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["status"]["podIP"].as_str().map(str::to_owned))
                .collect();
            script.extend(ips.iter().map(|ip| {
                format!(
                    "curl -s --max-time 2 http://{ip}:{}/metrics | grep -E '^{} ' | sed 's/^/{i} {ip} /'",
                    c.port, c.series
                )
            }));
        }
        let mut n = [None, None];
        if script.is_empty() {
            return n;
        }
        let Ok(out) = node.kubectl(&[
            "-n",
            ns,
            "exec",
            CLIENT,
            "--",
            "sh",
            "-c",
            &script.join("; "),
        ]) else {
            return n;
        };
        for line in out.lines() {
            let i = match line.split(' ').next() {
                Some("0") => 0,
                Some("1") => 1,
                _ => continue,
            };
            let leads = usize::from(line.trim_end().ends_with(" 1"));
            n[i] = Some(n[i].unwrap_or(0) + leads);
        }
        n
    }

    /// Samples the leader series and fails the test if two replicas of a component report
    /// themselves leader at once. The replicas are scraped one after another, so a hand-over
    /// between two scrapes can look like two leaders: only two in three samples in a row count.
    fn sample(&mut self, node: &Node, ns: &str) {
        let n = Self::count(node, ns);
        for (i, c) in ELECTED.iter().enumerate() {
            let Some(leading) = n[i] else { continue };
            if leading > 1 {
                let again: Vec<Option<usize>> = (0..2).map(|_| Self::count(node, ns)[i]).collect();
                assert!(
                    again.iter().any(|a| a.is_none_or(|a| a <= 1)),
                    "two {} replicas report themselves leader at once, in three samples in a \
                     row ({leading}, {again:?})",
                    c.name
                );
            }
            self.samples[i] += 1;
            if leading == 0 {
                self.without[i] += 1;
            }
        }
    }

    /// "operator: sampled N times, M between leaders; jobs: ..."
    fn summary(&self) -> String {
        ELECTED
            .iter()
            .enumerate()
            .map(|(i, c)| {
                format!(
                    "{} leader series sampled {} times, never two leaders, {} samples without one",
                    c.name, self.samples[i], self.without[i]
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// The chaos run (see the module docs). `backend_pod` answers unkeyed requests to `frontend`.
pub(crate) fn control_plane_outages_under_load(
    node: &Node,
    ns: &str,
    frontend: &str,
    backend_pod: &str,
) {
    node.apply(&sandbox("chaos", ns, "backend", "chaos", None))
        .unwrap();
    let key = sandbox_ready(node, "chaos");
    let fork = fork_pod(node, ns, "chaos");
    // Two operator replicas, as the chart runs them: one leads, the other serves the webhook
    // (Sandbox creation goes through it, failurePolicy Fail) when the first goes.
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "scale",
        "deployment/spur-operator",
        "--replicas=2",
    ])
    .unwrap();
    node.rollout(SPUR_NAMESPACE, "spur-operator").unwrap();
    node.client_pod_with(ns, CLIENT, None).unwrap();
    let exec = |script: &str| node.kubectl(&["-n", ns, "exec", CLIENT, "--", "sh", "-c", script]);
    crate::until_answered_by(node, ns, CLIENT, frontend, &key, &fork).unwrap();
    // What the fork and its Deployment were before: neither is replaced by the outages.
    let fork_before = fork_identity(node, ns, &fork);
    // A keyed request answered elsewhere logs the baseline sidecar's table version, rule count
    // and route-server stream (its /metrics); its table's changes, key included, are watched
    // from the host (/config_dump is loopback-only) and printed on a failure.
    let backend_ip = node.get_json(ns, &["pod", backend_pod]).unwrap()["status"]["podIP"]
        .as_str()
        .unwrap()
        .to_owned();

    // Bounded by count, by time and by a stop file; every failure is a line of its log.
    let script = format!(
        r#"cat > /tmp/load.sh <<'END'
end=$(( $(date +%s) + {MAX_SECONDS} )); i=0
while [ ! -e /tmp/stop ] && [ $i -lt {MAX_ITERATIONS} ] && [ $(date +%s) -lt $end ]; do
  i=$((i+1))
  k=$(curl -sS --max-time 5 -H 'baggage: sd-routing-key={key}' -w ' %{{http_code}}' '{frontend}' 2>&1)
  case "$k" in *'"pod":"{fork}"'*' 200') ;; *) echo "keyed $i $(date +%T.%N): $k (the baseline sidecar's table, route-server stream, requests by route and upstream connects: $(curl -s --max-time 2 http://{backend_ip}:15020/metrics | grep -E '^spur_(routeserver_(connected|reconnects_total)|route_table_(version|rules)|sidecar_worker_restarts|requests_total|upstream_connects_total|http1_handovers_total)[ {{]' | tr '\n' ' '))" ;; esac
  u=$(curl -sS --max-time 5 -w ' %{{http_code}}' '{frontend}' 2>&1)
  case "$u" in *'"pod":"{backend_pod}"'*' 200') ;; *) echo "unkeyed $i $(date +%T.%N): $u" ;; esac
  echo $i > /tmp/count
done
touch /tmp/finished
END
rm -f /tmp/stop /tmp/finished /tmp/count
nohup sh /tmp/load.sh > /tmp/load.log 2>&1 &
echo started"#
    );
    assert_eq!(exec(&script).unwrap().trim(), "started");
    let table = table_watch::TableWatch::start(node, ns, backend_pod, "app", &key);
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

    let mut run = Run {
        node,
        ns,
        leaders: Leaders::default(),
        converged: BTreeMap::new(),
        gone: BTreeMap::new(),
        created: Vec::new(),
        deleted: Vec::new(),
    };
    // The first outage deletes this one: a Sandbox deleted while the operator's leader is gone.
    node.apply(&sandbox("chaos-doomed", ns, "backend", "doomed", None))
        .unwrap();
    sandbox_ready(node, "chaos-doomed");
    run.created.push("chaos-doomed");

    // --- each operator replica, the leader first ----------------------------------------------
    run.leaders.sample(node, ns);
    let replicas = node
        .pods(SPUR_NAMESPACE, "app.kubernetes.io/name=spur-operator")
        .unwrap();
    assert_eq!(replicas.len(), 2, "{replicas:?}");
    let leader = lease_holder(node)
        .filter(|h| replicas.contains(h))
        .unwrap_or_else(|| panic!("no replica of {replicas:?} holds the operator's Lease"));
    let standby = replicas.iter().find(|p| **p != leader).unwrap().clone();
    for (victim, name) in [(leader, "chaos-op-leader"), (standby, "chaos-op-standby")] {
        run.outage(&format!("pod {victim}"), name, || delete_pod(node, &victim));
        node.rollout(SPUR_NAMESPACE, "spur-operator").unwrap();
    }

    // --- the route server: every watch stream breaks and resyncs from a new replica ---------
    // (The node tier runs one replica: the sidecars' streams all go with it.) Twice: while a
    // sidecar waits for the new one, the test's polling for the new sandbox's route runs beside
    // the load, and the frontend's HTTP pool opens spare connections to the backend that it
    // uses seconds later. Those were taken for opaque TCP and their keyed requests reached the
    // baseline (issue 47's flake; tests/routing.rs
    // `a_connection_silent_past_detection_is_still_routed_when_it_speaks_http`).
    const ROUTE_SERVER_OUTAGES: &[&str] = &["chaos-routeserver", "chaos-routeserver-2"];
    for &name in ROUTE_SERVER_OUTAGES {
        let victim = node
            .pods(SPUR_NAMESPACE, "app.kubernetes.io/name=spur-routeserver")
            .unwrap()
            .swap_remove(0);
        run.outage(&format!("pod {victim}"), name, || delete_pod(node, &victim));
        node.rollout(SPUR_NAMESPACE, "spur-routeserver").unwrap();
        // The keyed route of the sandbox created while the route server was away works.
        let rs_key = sandbox_ready(node, name);
        let rs_fork = fork_pod(node, ns, name);
        crate::until_answered_by(node, ns, CLIENT, frontend, &rs_key, &rs_fork).unwrap();
    }

    // --- the tunnel proxy, the traffic store, the io context server ---------------------------
    for (deployment, name) in [
        ("spur-tunnel-proxy", "chaos-tunnel-proxy"),
        ("spur-traffic", "chaos-traffic"),
        ("spur-ics", "chaos-ics"),
    ] {
        let victim = node
            .pods(
                SPUR_NAMESPACE,
                &format!("app.kubernetes.io/name={deployment}"),
            )
            .unwrap()
            .swap_remove(0);
        run.outage(&format!("pod {victim}"), name, || delete_pod(node, &victim));
        node.rollout(SPUR_NAMESPACE, deployment).unwrap();
    }

    // --- the node's container runtime ---------------------------------------------------------
    // containerd goes and comes back (its shims keep the pods' containers running); the fork of
    // the Sandbox created right after starts through the new one, the deleted one's pod is
    // stopped by it. (The restart returns once containerd answers again: the Sandbox changes
    // follow it, they do not fall inside it.)
    run.outage("the node's containerd", "chaos-containerd", || {
        node.restart_containerd().unwrap()
    });
    // --- a baseline pod's sidecar worker, killed -----------------------------------------------
    let worker_kill = sidecar_worker_killed(node, ns, backend_pod, &exec, &count);
    let Run {
        mut leaders,
        converged,
        gone,
        created,
        deleted,
        ..
    } = run;

    // --- the jobs server, with a job running ------------------------------------------------
    let (job_took, attempts) = jobs_server_outage(node, &mut leaders, ns);

    // --- the load ends: not one request failed ----------------------------------------------
    // It ran through every outage: its bounds did not stop it first.
    assert_eq!(
        exec("test -e /tmp/finished && echo finished; true")
            .unwrap()
            .trim(),
        "",
        "the load loop ended before the last outage did (iterations {}, bound {MAX_ITERATIONS} or {MAX_SECONDS} s)",
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
    let table = table.stop();
    let log = exec("cat /tmp/load.log").unwrap();
    // The request in flight in the killed worker, if one was, is the only one that may fail.
    let failures: Vec<&str> = log
        .lines()
        .filter(|l| !worker_kill.log.iter().any(|f| f == l))
        .collect();

    // --- nothing lost, nothing duplicated: each Sandbox Ready with its one fork, each deleted
    // one gone with its fork -------------------------------------------------------------------
    let forks_of = |name: &str| -> usize {
        let forks = node
            .get_json(
                ns,
                &["deployments", "-l", &format!("spur.dev/sandbox={name}")],
            )
            .unwrap();
        forks["items"].as_array().map_or(0, Vec::len)
    };
    for name in created.iter().filter(|n| !deleted.contains(n)) {
        let s = node.get_json("default", &["sandbox", name]).unwrap();
        assert_eq!(condition(&s, "Ready"), Some("True"), "{name}: {s}");
        let n = forks_of(name);
        assert_eq!(n, 1, "Sandbox {name} has {n} fork Deployments");
    }
    for name in &deleted {
        assert!(node.is_gone(None, "sandbox", name).unwrap(), "{name}");
        assert_eq!(forks_of(name), 0, "Sandbox {name} is gone, its fork is not");
    }
    leaders.sample(node, ns);
    for (i, c) in ELECTED.iter().enumerate() {
        assert!(
            leaders.samples[i] > leaders.without[i],
            "no sample saw a {} leader ({} samples): the leader series was not read",
            c.name,
            leaders.samples[i]
        );
    }

    let times = |m: &BTreeMap<&str, Duration>| -> String {
        m.iter()
            .map(|(n, d)| {
                format!(
                    "{}: {:.1} s",
                    n.trim_start_matches("chaos-"),
                    d.as_secs_f64()
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    eprintln!(
        "chaos under load: {iterations} iterations ({} requests through sidecars), {} failed; \
         {} sandboxes created during outages, {} converged (time from the outage's start to \
         Ready: {}); {} deleted during outages, {} gone with their forks (time to gone, by the \
         outage: {}); a job running through the jobs server's restart finished in {:.1} s \
         after it, in {attempts} attempt(s); a baseline sidecar's worker killed: the next one \
         served {:.2} s later, {} request(s) failed with it ({:?}); {}",
        iterations * 2,
        failures.len(),
        created.len() - 1,
        converged.len(),
        times(&converged),
        deleted.len(),
        gone.len(),
        times(&gone),
        job_took.as_secs_f64(),
        worker_kill.back.as_secs_f64(),
        worker_kill.failed.len(),
        worker_kill.failed,
        leaders.summary(),
    );
    // Short (changes only), and what a failure is read against.
    eprintln!(
        "chaos: the baseline sidecar's routing table through the run (key {key}):\n{}",
        table.join("\n")
    );
    let fork_after = fork_identity(node, ns, &fork);
    if !failures.is_empty() || fork_after.0 != fork_before.0 {
        // What explains keyed requests answered by the baseline: the fork's readiness and the
        // route's, with their times, against the outages' (`chaos: ... at`, above).
        eprintln!(
            "the fork before the outages: {fork_before:?}, after: {fork_after:?}\n{}",
            routing_history(node, ns, "chaos", backend_pod, &failures)
        );
    }
    assert!(
        failures.is_empty(),
        "requests through sidecars failed while control-plane pods were deleted:\n{}",
        failures.join("\n")
    );
    assert_eq!(
        fork_after.0, fork_before.0,
        "the chaos sandbox's fork pod or Deployment was replaced during the outages"
    );

    // Gone before the operator is scaled back: their finalizers need it.
    let mut all = vec!["delete", "sandbox", "chaos"];
    all.extend(created.iter().filter(|n| !deleted.contains(n)).copied());
    all.extend(["--wait=true", "--timeout=180s"]);
    node.kubectl(&all).unwrap();
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "scale",
        "deployment/spur-operator",
        "--replicas=1",
    ])
    .unwrap();
    node.rollout(SPUR_NAMESPACE, "spur-operator").unwrap();
    // The chaos sandbox's key is back on the baseline once it is gone.
    eventually(
        "the chaos sandbox's key back on the baseline",
        Duration::from_secs(120),
        || {
            let a = try_get(node, ns, CLIENT, frontend, Some(&key))?;
            Ok((a.answered_by() == Some(backend_pod)).then_some(()))
        },
    )
    .unwrap();
    node.kubectl(&["-n", ns, "delete", "pod", CLIENT, "--wait=false"])
        .unwrap();
}

/// What killing a sidecar's worker cost.
struct WorkerKill {
    /// From the kill until the restarted worker answered a request of the load.
    back: Duration,
    /// The load's failures from the kill until then (each entry's first line): at most the one
    /// request in flight.
    failed: Vec<String>,
    /// The load's log from the kill until then, every line of those entries.
    log: Vec<String>,
}

/// Kills (SIGKILL, from the node) the worker process of the sidecar in `pod` while the load
/// runs through it: its supervisor (`SPUR_SUPERVISE`, docs/injection.md) starts another on the
/// listeners it holds, so the container is not restarted and no new connection is refused;
/// only a request in flight in the killed worker may fail (the load sends one at a time).
fn sidecar_worker_killed(
    node: &Node,
    ns: &str,
    pod: &str,
    exec: &dyn Fn(&str) -> anyhow::Result<String>,
    count: &dyn Fn() -> u64,
) -> WorkerKill {
    let status = |what: &str| -> Value {
        let p = node.get_json(ns, &["pod", pod]).unwrap();
        // A native sidecar (the default placement) is among the init containers.
        ["initContainerStatuses", "containerStatuses"]
            .iter()
            .filter_map(|k| p["status"][*k].as_array())
            .flatten()
            .find(|c| c["name"] == "spur-sidecar")
            .map(|c| c[what].clone())
            .unwrap_or_else(|| panic!("pod {pod} has no spur-sidecar container: {p}"))
    };
    let restarts_before = status("restartCount");
    let supervisor = node
        .task_pid(status("containerID").as_str().unwrap())
        .unwrap();
    let workers = || -> Vec<String> {
        std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    let first = workers();
    assert_eq!(
        first.len(),
        1,
        "the sidecar's supervisor {supervisor} has workers {first:?}"
    );
    let failed_before = exec("cat /tmp/load.log").unwrap().lines().count();
    let start = Instant::now();
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &first[0]])
        .status()
        .unwrap();
    assert!(killed.success(), "kill -KILL {}", first[0]);
    eprintln!(
        "chaos: killed the worker {} of pod {pod}'s sidecar at {}",
        first[0],
        now()
    );
    // The load's next completed iteration went through the new worker (one request at a time).
    let at_kill = count();
    let back = eventually(
        "a request through the restarted worker",
        Duration::from_secs(30),
        || Ok((count() > at_kill + 1).then(|| start.elapsed())),
    )
    .unwrap();
    let second = workers();
    assert!(
        second.len() == 1 && second != first,
        "the killed worker {first:?} was not replaced: {second:?}"
    );
    // Twenty iterations more through the new worker, then the failures since the kill.
    let settled = count() + 20;
    eventually(
        "load through the new worker",
        Duration::from_secs(60),
        || Ok((count() >= settled).then_some(())),
    )
    .unwrap();
    let log: Vec<String> = exec("cat /tmp/load.log")
        .unwrap()
        .lines()
        .skip(failed_before)
        .map(str::to_owned)
        .collect();
    // A failure is one entry of the load's log, which starts a line; its body may run over
    // several (an error page's text).
    let failed: Vec<String> = log
        .iter()
        .filter(|l| l.starts_with("keyed ") || l.starts_with("unkeyed "))
        .cloned()
        .collect();
    assert!(
        failed.len() <= 1,
        "{} requests failed when pod {pod}'s sidecar worker was killed (only the one in flight may):\n{}",
        failed.len(),
        log.join("\n")
    );
    assert_eq!(
        status("restartCount"),
        restarts_before,
        "the sidecar container was restarted: its supervisor should have replaced the worker"
    );
    let ip = node.get_json(ns, &["pod", pod]).unwrap()["status"]["podIP"]
        .as_str()
        .unwrap()
        .to_owned();
    let metrics = exec(&format!(
        "curl -s --max-time 5 http://{ip}:15020/metrics | grep '^spur_sidecar_worker_restarts '"
    ))
    .unwrap();
    assert_eq!(
        metrics.trim(),
        "spur_sidecar_worker_restarts 1",
        "{metrics}"
    );
    WorkerKill { back, failed, log }
}

/// A fork pod's identity (its uid, and its Deployment's generation) and, apart, when its
/// Ready condition last changed.
fn fork_identity(node: &Node, ns: &str, pod: &str) -> ((String, i64), String) {
    let p = node.get_json(ns, &["pod", pod]).unwrap_or_default();
    let deployment = p["metadata"]["labels"]["spur.dev/fork"]
        .as_str()
        .and_then(|d| node.get_json(ns, &["deployment", d]).ok())
        .unwrap_or_default();
    let ready_since = p["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .map(|c| format!("{} since {}", c["status"], c["lastTransitionTime"]))
        .unwrap_or_default();
    (
        (
            p["metadata"]["uid"].as_str().unwrap_or("(gone)").to_owned(),
            deployment["metadata"]["generation"].as_i64().unwrap_or(0),
        ),
        ready_since,
    )
}

/// Sandbox `name`'s routing as it changed: the Ready conditions (with their transition times)
/// of its fork and RoutingConfig, and the events of its namespace's pods and of Spur's objects
/// (readiness probe failures, fork and route changes), oldest first.
fn routing_history(
    node: &Node,
    ns: &str,
    name: &str,
    baseline_pod: &str,
    failures: &[&str],
) -> String {
    let selector = format!("spur.dev/sandbox={name}");
    let mut out = String::new();
    for (namespace, kind) in [(ns, "forkedworkloads"), ("", "routingconfigs")] {
        let mut args = vec!["get", kind, "-l", &selector, "-o", "yaml"];
        if !namespace.is_empty() {
            args.extend(["-n", namespace]);
        }
        out.push_str(&node.kubectl(&args).unwrap_or_else(|e| format!("{e:#}")));
        out.push('\n');
    }
    // What the baseline sidecar decided for each request around the failures (at debug level
    // it logs every request routed to a sandbox), and what the route servers said (their
    // INFO and above: at debug they log every HTTP/2 frame). A deleted replica's logs are gone.
    let times: Vec<f64> = failures
        .iter()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter_map(seconds_of_day)
        .collect();
    let (from, to) = (
        times.iter().copied().fold(f64::MAX, f64::min) - 3.0,
        times.iter().copied().fold(f64::MIN, f64::max) + 1.0,
    );
    let sidecar = node
        .kubectl(&[
            "-n",
            ns,
            "logs",
            baseline_pod,
            "-c",
            "spur-sidecar",
            "--timestamps",
            "--tail=-1",
        ])
        .unwrap_or_else(|e| format!("{e:#}"));
    out.push_str(
        "the baseline sidecar's log from 3 s before the first failure to 1 s after the last \
         (at most 2000 lines):\n",
    );
    for line in sidecar
        .lines()
        .filter(|l| {
            l.get(11..29)
                .and_then(seconds_of_day)
                .is_some_and(|t| t >= from && t <= to)
        })
        .take(2_000)
    {
        out.push_str(line);
        out.push('\n');
    }
    let routeservers = node
        .kubectl(&[
            "-n",
            SPUR_NAMESPACE,
            "logs",
            "-l",
            "app.kubernetes.io/name=spur-routeserver",
            "--timestamps",
            "--prefix",
            "--tail=-1",
        ])
        .unwrap_or_else(|e| format!("{e:#}"));
    out.push_str("the route servers' log, INFO and above, and the watches they synced:\n");
    for line in routeservers
        .lines()
        .filter(|l| !l.contains(" DEBUG ") || l.contains("watch synced"))
        .take(1_000)
    {
        out.push_str(line);
        out.push('\n');
    }
    out.push_str(
        &node
            .kubectl(&[
                "get",
                "events",
                "-A",
                "--sort-by=.lastTimestamp",
                "-o",
                "custom-columns=FIRST:.firstTimestamp,LAST:.lastTimestamp,COUNT:.count,KIND:.involvedObject.kind,NAME:.involvedObject.name,REASON:.reason,MESSAGE:.message",
            ])
            .unwrap_or_else(|e| format!("{e:#}")),
    );
    out
}

/// `HH:MM:SS[.frac]` as seconds since midnight.
fn seconds_of_day(t: &str) -> Option<f64> {
    let mut parts = t.trim_end_matches(':').splitn(3, ':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.trim_end_matches('Z').parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// The wall clock (the load log's), for the outages' lines.
pub(crate) fn now() -> String {
    std::process::Command::new("date")
        .arg("+%T.%N")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The operator's Lease holder, if the Lease names one.
fn lease_holder(node: &Node) -> Option<String> {
    let l = node
        .get_json(SPUR_NAMESPACE, &["lease", "spur-operator"])
        .ok()?;
    l["spec"]["holderIdentity"]
        .as_str()
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// Deletes a pod of Spur's namespace without waiting for it to go.
fn delete_pod(node: &Node, pod: &str) {
    node.kubectl(&["-n", SPUR_NAMESPACE, "delete", "pod", pod, "--wait=false"])
        .unwrap();
}

/// The chaos run's state: what it created and deleted, and when each converged.
struct Run<'a> {
    node: &'a Node,
    ns: &'a str,
    leaders: Leaders,
    /// By Sandbox created during an outage: from the outage's start until it is Ready.
    converged: BTreeMap<&'static str, Duration>,
    /// By the outage a Sandbox was deleted in: from the outage's start until it and its fork
    /// are gone.
    gone: BTreeMap<&'static str, Duration>,
    created: Vec<&'static str>,
    deleted: Vec<&'static str>,
}

impl Run<'_> {
    /// Starts an outage with `cause`, creates Sandbox `name` forking the backend at once and
    /// deletes the Sandbox created before it; returns when `name` is Ready and the other one is
    /// gone with its fork, recording both times from the outage's start. The Sandbox is applied
    /// again until the API server takes it (the webhook's Service may still route a review to
    /// a deleted operator replica for a moment).
    fn outage(&mut self, what: &str, name: &'static str, cause: impl FnOnce()) {
        let (node, ns) = (self.node, self.ns);
        let doomed = *self.created.last().expect("a Sandbox to delete");
        let start = Instant::now();
        cause();
        eprintln!(
            "chaos: {what} gone at {}; creating Sandbox {name}, deleting {doomed}",
            now()
        );
        let marker = name.trim_start_matches("chaos-");
        eventually(
            &format!("Sandbox {name} taken while {what} is gone"),
            Duration::from_secs(60),
            || {
                node.apply(&sandbox(name, ns, "backend", marker, None))
                    .map(Some)
            },
        )
        .unwrap();
        self.created.push(name);
        node.kubectl(&["delete", "sandbox", doomed, "--wait=false"])
            .unwrap();
        self.deleted.push(doomed);
        let leaders = &mut self.leaders;
        eventually(
            &format!("Sandbox {name}, created while {what} was gone, to be Ready"),
            Duration::from_secs(240),
            || {
                leaders.sample(node, ns);
                let s = node.get_json("default", &["sandbox", name])?;
                Ok((condition(&s, "Ready") == Some("True")).then_some(()))
            },
        )
        .unwrap_or_else(|e| {
            panic!(
                "{e:#}\n{}\n{}",
                node.kubectl(&["get", "sandbox", name, "-o", "yaml"])
                    .unwrap_or_default(),
                node.describe(SPUR_NAMESPACE)
            )
        });
        self.converged.insert(name, start.elapsed());
        // Not duplicated: one fork, however many operator passes the outage caused.
        let forks = node
            .get_json(
                ns,
                &["deployments", "-l", &format!("spur.dev/sandbox={name}")],
            )
            .unwrap();
        let n = forks["items"].as_array().map_or(0, Vec::len);
        assert_eq!(n, 1, "Sandbox {name} has {n} fork Deployments: {forks}");
        let selector = format!("spur.dev/sandbox={doomed}");
        eventually(
            &format!("Sandbox {doomed}, deleted while {what} was gone, to be gone with its fork"),
            Duration::from_secs(240),
            || {
                leaders.sample(node, ns);
                // The fork's Deployment; its pods follow through the garbage collector (as
                // they terminate: not waited for, a drain is not what this times).
                let forks = node.get_json(ns, &["deployments", "-l", &selector])?;
                Ok((node.is_gone(None, "sandbox", doomed)?
                    && forks["items"].as_array().is_none_or(Vec::is_empty))
                .then_some(()))
            },
        )
        .unwrap_or_else(|e| {
            panic!(
                "{e:#}\n{}\n{}",
                node.kubectl(&["get", "sandbox", doomed, "-o", "yaml"])
                    .unwrap_or_default(),
                node.describe(SPUR_NAMESPACE)
            )
        });
        self.gone.insert(name, start.elapsed());
        eprintln!("chaos: {what}: converged at {}", now());
    }
}

/// A job sleeps in a runner pod while the jobs server's pod is deleted: it finishes, in at
/// most two attempts (the running one resumed, or lost and run once more). Returns the time
/// from the deletion to its end, and its attempts.
fn jobs_server_outage(node: &Node, leaders: &mut Leaders, app_ns: &str) -> (Duration, i64) {
    let ci = node
        .namespace("chaos-ci", &[("spur.dev/enabled", "true")])
        .unwrap();
    let ns = ci.name.as_str();
    node.apply(&format!(
        "apiVersion: spur.dev/v1alpha1\nkind: JobRunnerGroup\nmetadata:\n  name: chaos\n  namespace: {ns}\nspec:\n  image: localhost/spur-test-client:dev\n  replicas: 1\n  jobTimeout: 5m\n"
    ))
    .unwrap();
    node.apply(&format!(
        "apiVersion: spur.dev/v1alpha1\nkind: Job\nmetadata:\n  name: through-restart\n  namespace: {ns}\nspec:\n  runnerGroup: chaos\n  script: |\n    echo started\n    sleep 25\n    echo finished\n"
    ))
    .unwrap();
    let job = || node.get_json(ns, &["jobs.spur.dev", "through-restart"]);
    eventually("the job to run", Duration::from_secs(180), || {
        leaders.sample(node, app_ns);
        Ok((job()?["status"]["phase"] == "Running").then_some(()))
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));
    let start = Instant::now();
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "delete",
        "pod",
        "spur-jobs-0",
        "--wait=false",
    ])
    .unwrap();
    eprintln!(
        "chaos: deleted spur-jobs-0 while job through-restart runs, at {}",
        now()
    );
    let j = eventually("the job to end", Duration::from_secs(240), || {
        leaders.sample(node, app_ns);
        let j = job()?;
        let phase = j["status"]["phase"].as_str().unwrap_or("");
        Ok(["Succeeded", "Failed", "Canceled"]
            .contains(&phase)
            .then_some(j))
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(SPUR_NAMESPACE)));
    let took = start.elapsed();
    assert_eq!(j["status"]["phase"], "Succeeded", "{j}");
    let attempts = j["status"]["attemptCount"].as_i64().unwrap_or(0);
    assert!(
        (1..=2).contains(&attempts),
        "a job running through the jobs server's restart took {attempts} attempts: {j}"
    );
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "rollout",
        "status",
        "statefulset/spur-jobs",
        "--timeout=180s",
    ])
    .unwrap();
    // The replacement pod leads under its own identity (name and uid): it took the lease the
    // deleted pod released, it did not inherit it.
    let uid = node
        .get_json(SPUR_NAMESPACE, &["pod", "spur-jobs-0"])
        .unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_owned();
    eventually(
        "the new jobs pod to hold the jobs Lease",
        Duration::from_secs(60),
        || {
            let l = node.get_json(SPUR_NAMESPACE, &["lease", "spur-jobs"])?;
            Ok(
                (l["spec"]["holderIdentity"] == format!("spur-jobs-0_{uid}").as_str())
                    .then_some(()),
            )
        },
    )
    .unwrap();
    (took, attempts)
}
