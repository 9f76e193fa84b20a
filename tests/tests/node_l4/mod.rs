//! L4 listeners from ListenerSets on the node (docs/l4.md): the chart's `spur-gateway`
//! Deployment (`gateway.enabled`, in the test's namespace) gets its listeners from the route
//! server (authenticated by its projected token, trusting the CA bundle the operator copied
//! there), the operator keeps the Services clients dial and resolves the worker pods through
//! headless Services. From a client pod's network namespace, UDP sessions (each from a new
//! source port) and TCP connections (each half-closed after its payload) land on the worker
//! their first bytes hash to: spread evenly over three workers, the same worker on every try,
//! and only about a quarter moving when a fourth worker starts. A worker whose health checks
//! fail leaves rotation within two check intervals and only its sessions move; 0-byte and
//! 65 507-byte datagrams pass; a flood of sessions past a table's limit evicts the oldest,
//! counted, with the table bounded; an unreachable endpoint's ICMP errors are counted and
//! nothing else is disturbed.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use spur_e2e::node::{Node, SPUR_IMAGE, eventually, spur_bin};

const SESSIONS: u32 = 1000;
/// The flood listener's session table.
const FLOOD_TABLE: u32 = 50;
/// The worker clusters' health-check interval.
const HEALTH_INTERVAL: Duration = Duration::from_secs(1);

fn workloads(ns: &str) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: udp-worker, namespace: {ns}}}
spec:
  replicas: 3
  selector: {{matchLabels: {{app: udp-worker}}}}
  template:
    metadata:
      labels: {{app: udp-worker}}
      annotations: {{sidecar.spur.dev/inject: "false"}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
        - name: worker
          image: {SPUR_IMAGE}
          imagePullPolicy: IfNotPresent
          args: [demo, serve, --kind, udp, --name, $(POD_NAME), --listen, "0.0.0.0:5004"]
          env:
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
          readinessProbe:
            tcpSocket: {{port: 5004}}
            periodSeconds: 1
---
apiVersion: spur.dev/v1alpha1
kind: ListenerSet
metadata: {{name: media, namespace: {ns}}}
spec:
  # The chart's gateway (gateway.enabled, gateway.namespaces).
  selector: {{matchLabels: {{spur.dev/gateway: spur-gateway}}}}
  listeners:
    - name: rtp
      protocol: udp
      port: 5004
      cluster:
        name: workers
        endpoints:
          - {{selector: {{matchLabels: {{app: udp-worker}}}}, port: 5004, healthCheckPort: 5004}}
        lb: maglev
        hashKey: {{firstBytes: {{offset: 0, length: 8}}}}
        # One failed check takes a worker out, one passed brings it back: the test times how
        # soon a failing worker leaves rotation.
        healthCheck: {{protocol: tcp, interval: 1s, timeout: 500ms, healthyThreshold: 1, unhealthyThreshold: 1}}
        # Short, so the probe's batches (with pauses longer than two of these) never meet a
        # session of an earlier batch on a source port the system hands out again.
        idleTimeout: 1s
    # The same workers' TCP echo (`demo serve --kind udp` serves both on its port).
    - name: echo
      protocol: tcp
      port: 5005
      cluster:
        name: tcp-workers
        endpoints:
          - {{selector: {{matchLabels: {{app: udp-worker}}}}, port: 5004}}
        lb: maglev
        hashKey: {{firstBytes: {{offset: 0, length: 8}}}}
        healthCheck: {{protocol: tcp, interval: 1s, timeout: 500ms, healthyThreshold: 1, unhealthyThreshold: 1}}
    # A small table, for the flood.
    - name: flood
      protocol: udp
      port: 5006
      cluster:
        name: flood
        endpoints:
          - {{selector: {{matchLabels: {{app: udp-worker}}}}, port: 5004}}
        lb: ringHash
        hashKey: {{sourceIpPort: {{}}}}
        idleTimeout: 60s
        maxSessions: {FLOOD_TABLE}
        overflow: evictOldest
"#
    )
}

/// Who answered each of `SESSIONS` sessions, by session number, sent from the client pod's
/// network namespace with this checkout's `spur` (the image's build).
fn probe(
    node: &Node,
    ns: &str,
    target: &str,
    protocol: &str,
) -> anyhow::Result<BTreeMap<u32, String>> {
    // UDP batches pause longer than the listener's idle timeout; TCP needs no pause.
    let pause = if protocol == "udp" { "2500ms" } else { "0s" };
    let sessions = SESSIONS.to_string();
    let answers = probe_with(
        node,
        ns,
        &[
            "--target",
            target,
            "--protocol",
            protocol,
            "--sessions",
            &sessions,
            "--batch",
            "200",
            "--pause",
            pause,
        ],
    )?;
    if answers.len() != SESSIONS as usize {
        bail!("{} answers of {SESSIONS}: {answers:?}", answers.len());
    }
    Ok(answers)
}

/// `spur demo probe` with these arguments from the client pod: who answered each session.
fn probe_with(node: &Node, ns: &str, args: &[&str]) -> anyhow::Result<BTreeMap<u32, String>> {
    let spur = spur_bin("spur").display().to_string();
    let mut cmd = vec![spur.as_str(), "demo", "probe", "--timeout", "2s"];
    cmd.extend_from_slice(args);
    let out = node.in_pod_netns(ns, "client", "client", &cmd)?;
    let mut answers = BTreeMap::new();
    for line in out.lines() {
        let Some((n, who)) = line.split_once(' ') else {
            bail!("probe said {line:?}");
        };
        if who.starts_with("error") {
            bail!("session {n}: {who}");
        }
        answers.insert(n.parse()?, who.to_owned());
    }
    Ok(answers)
}

/// The sum of the samples of metric `name` (any prefix) whose labels include `label`, from
/// the gateway's admin server (loopback clients only: curl runs in the gateway's network
/// namespace).
fn gateway_metric(
    node: &Node,
    ns: &str,
    gateway: &str,
    name: &str,
    label: &str,
) -> anyhow::Result<f64> {
    let text = node.in_pod_netns(
        ns,
        gateway,
        "gateway",
        &[
            "curl",
            "-sS",
            "--max-time",
            "5",
            "http://127.0.0.1:15021/metrics",
        ],
    )?;
    let mut sum = 0.0;
    let mut seen = false;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (metric, labels) = series.split_once('{').unwrap_or((series, ""));
        if metric.ends_with(name) && labels.contains(label) {
            sum += value.parse::<f64>()?;
            seen = true;
        }
    }
    if !seen {
        bail!("no {name}{{{label}}} in the gateway's metrics:\n{text}");
    }
    Ok(sum)
}

/// The gateway's reported health of each endpoint of `cluster`, by endpoint id (pod name).
fn reported_health(node: &Node, ns: &str, cluster: &str) -> BTreeMap<String, bool> {
    let Ok(set) = node.get_json(ns, &["listenerset", "media"]) else {
        return BTreeMap::new();
    };
    set["status"]["gateways"][0]["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["cluster"] == cluster)
        .filter_map(|e| Some((e["id"].as_str()?.to_owned(), e["healthy"] == true)))
        .collect()
}

fn spread(answers: &BTreeMap<u32, String>) -> BTreeMap<String, u32> {
    let mut by: BTreeMap<String, u32> = BTreeMap::new();
    for who in answers.values() {
        *by.entry(who.clone()).or_default() += 1;
    }
    by
}

fn void_set(ns: &str, unreachable: &str) -> String {
    format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: ListenerSet
metadata: {{name: void, namespace: {ns}}}
spec:
  selector: {{matchLabels: {{spur.dev/gateway: spur-gateway}}}}
  listeners:
    - name: void
      protocol: udp
      port: 5007
      cluster:
        name: void
        endpoints: [{{address: "{unreachable}", port: 9}}]
"#
    )
}

pub(crate) fn l4_listeners_on_the_node(node: &Node) {
    let ns = node
        .namespace("l4", &[("spur.dev/enabled", "true")])
        .unwrap();
    let ns = ns.name.as_str();
    // The chart's gateway, in this namespace: the operator copies the route server's CA
    // bundle here for it.
    gateway_in(node, Some(ns));
    node.apply(&workloads(ns)).unwrap();
    node.rollout(ns, "udp-worker").unwrap();
    node.rollout(ns, "spur-gateway")
        .with_context(|| node.describe(ns))
        .unwrap();
    let workers = node.pods(ns, "app=udp-worker").unwrap();
    assert_eq!(workers.len(), 3, "{workers:?}");
    let gateways = node.pods(ns, "spur.dev/gateway=spur-gateway").unwrap();
    assert_eq!(gateways.len(), 1, "{gateways:?}");
    let gateway = gateways[0].as_str();
    node.client_pod(ns).unwrap();

    // The operator's Service for the listeners, and the gateway's health report in status.
    let service = node.get_json(ns, &["service", "media"]).unwrap();
    let ip = service["spec"]["clusterIP"].as_str().unwrap().to_owned();
    let protocols: Vec<_> = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["port"].as_u64().unwrap(),
                p["protocol"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        protocols,
        [
            (5004, "UDP".into()),
            (5005, "TCP".into()),
            (5006, "UDP".into())
        ],
        "{service:#}"
    );
    let udp = format!("{ip}:5004");
    let tcp = format!("{ip}:5005");
    eventually(
        "every worker healthy in the gateway's report",
        Duration::from_secs(60),
        || {
            let udp = reported_health(node, ns, "workers");
            let tcp = reported_health(node, ns, "tcp-workers");
            let healthy = |h: &BTreeMap<String, bool>| h.values().filter(|h| **h).count();
            Ok((healthy(&udp) == 3 && healthy(&tcp) == 3).then_some(()))
        },
    )
    .with_context(|| {
        let set = node
            .get_json(ns, &["listenerset", "media"])
            .unwrap_or_default();
        format!("{:#}\n{}", set["status"], node.describe(ns))
    })
    .unwrap();

    // 1000 sessions of each protocol: spread within ±15 % of a third each, and each session
    // (a new source port every time) answered by the same worker again.
    //
    // The hash is deterministic: the same sessions over the same three workers spread the same
    // way every time. A run during which a worker's health check failed (the node is loaded;
    // one failed check takes a worker out of the ring for a while) spreads differently, so a
    // spread outside the bound is tried again, with the gateway's health report alongside; a
    // biased hash fails every try.
    let mut first = BTreeMap::new();
    for (protocol, target) in [("udp", &udp), ("tcp", &tcp)] {
        let set = if protocol == "udp" {
            "workers"
        } else {
            "tcp-workers"
        };
        let mut last = BTreeMap::new();
        let answers = eventually(
            &format!("1000 {protocol} sessions answered, spread over three workers"),
            Duration::from_secs(120),
            || {
                let answers = probe(node, ns, target, protocol)?;
                let by = spread(&answers);
                let even =
                    by.len() == 3 && by.values().all(|n| (283..=383).contains(n));
                if !even {
                    eprintln!(
                        "{protocol}: spread {by:?} of {SESSIONS} sessions; health now {:?}; trying again",
                        reported_health(node, ns, set)
                    );
                }
                last = by;
                Ok(even.then_some(answers))
            },
        )
        .with_context(|| format!("{protocol}: the last spread was {last:?} (each within 283..=383)"))
        .unwrap();
        first.insert(protocol, answers);
    }
    std::thread::sleep(Duration::from_millis(2500));
    for (protocol, target) in [("udp", &udp), ("tcp", &tcp)] {
        let again = probe(node, ns, target, protocol).unwrap();
        assert_eq!(
            again, first[protocol],
            "{protocol}: a session's worker changed between tries"
        );
    }

    // A fourth worker: about a quarter of the sessions move (Maglev's table moves a few more
    // than the ideal 1/4 between old workers).
    node.kubectl(&["-n", ns, "scale", "deployment/udp-worker", "--replicas=4"])
        .unwrap();
    node.rollout(ns, "udp-worker").unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    let mut after = BTreeMap::new();
    for (protocol, target) in [("udp", &udp), ("tcp", &tcp)] {
        let got = eventually(
            &format!("{protocol} sessions reaching the fourth worker"),
            Duration::from_secs(90),
            || {
                let got = probe(node, ns, target, protocol)?;
                Ok((spread(&got).len() == 4).then_some(got))
            },
        )
        .unwrap();
        let moved = first[protocol]
            .iter()
            .filter(|(n, who)| got.get(n) != Some(*who))
            .count();
        assert!(
            moved <= 300,
            "{protocol}: {moved} of {SESSIONS} sessions moved from 3 to 4 workers: {:?}",
            spread(&got)
        );
        after.insert(protocol, got);
    }

    health_checks_take_a_worker_out(node, ns, gateway, &udp, &tcp, &after);
    bad_input(node, ns, gateway, &ip, &udp);
    // The gateway goes before its namespace does.
    gateway_in(node, None);
}

/// `helm upgrade` of the installed release with the chart's gateway in `ns` (one replica,
/// a short grace), or without a gateway.
fn gateway_in(node: &Node, ns: Option<&str>) {
    let chart = format!("{}/../charts/spur", env!("CARGO_MANIFEST_DIR"));
    let mut args = vec![
        "upgrade",
        "spur",
        chart.as_str(),
        "--namespace",
        super::SPUR_NAMESPACE,
        // The install's values (this run's chart, CHART_VALUES).
        "--reuse-values",
        "--wait",
        "--timeout",
        "5m",
    ];
    let namespaces = ns.map(|ns| format!("gateway.namespaces={{{ns}}}"));
    match &namespaces {
        Some(namespaces) => args.extend_from_slice(&[
            "--set",
            "gateway.enabled=true",
            "--set",
            namespaces,
            "--set",
            "gateway.replicas=1",
            "--set",
            "gateway.terminationGracePeriodSeconds=5",
        ]),
        // The list may stay: a disabled gateway renders nothing, and passes the operator no
        // namespace.
        None => args.extend_from_slice(&["--set", "gateway.enabled=false"]),
    }
    node.helm(&args)
        .with_context(|| node.describe(ns.unwrap_or(super::SPUR_NAMESPACE)))
        .unwrap();
}

/// A worker that refuses the gateway's health checks (an nftables rule in its network
/// namespace resets the gateway's TCP connections to its port; the kubelet's probes, from the
/// node, still pass) is out of rotation within two check intervals; only its sessions move;
/// when the rule goes, it comes back.
fn health_checks_take_a_worker_out(
    node: &Node,
    ns: &str,
    gateway: &str,
    udp: &str,
    tcp: &str,
    after: &BTreeMap<&str, BTreeMap<u32, String>>,
) {
    let gateway_ip = node.get_json(ns, &["pod", gateway]).unwrap()["status"]["podIP"]
        .as_str()
        .unwrap()
        .to_owned();
    let by = spread(&after["udp"]);
    let (sick, _) = by.iter().next().unwrap();
    let sick = sick.clone();
    let sample = *after["udp"]
        .iter()
        .find(|(_, who)| **who == sick)
        .unwrap()
        .0;
    let nft = |args: &[&str]| {
        let mut cmd = vec!["nft"];
        cmd.extend_from_slice(args);
        node.in_pod_netns(ns, &sick, "worker", &cmd).unwrap();
    };
    nft(&["add", "table", "inet", "spur_l4_test"]);
    nft(&[
        "add",
        "chain",
        "inet",
        "spur_l4_test",
        "input",
        "{ type filter hook input priority 0; }",
    ]);
    let started = Instant::now();
    nft(&[
        "add",
        "rule",
        "inet",
        "spur_l4_test",
        "input",
        "ip",
        "saddr",
        &gateway_ip,
        "tcp",
        "dport",
        "5004",
        "reject",
        "with",
        "tcp",
        "reset",
    ]);
    // One of the worker's sessions, again and again from new source ports, until another
    // worker answers it.
    let sample_arg = sample.to_string();
    let moved_after = loop {
        let got = probe_with(
            node,
            ns,
            &["--target", udp, "--sessions", "1", "--first", &sample_arg],
        )
        .unwrap();
        if got.get(&sample) != Some(&sick) {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{sick} still answers its sessions 30 s after failing its health checks"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("node_l4: {sick} out of rotation {moved_after:?} after it failed its health checks");
    assert!(
        moved_after <= 2 * HEALTH_INTERVAL,
        "{sick} left rotation {moved_after:?} after failing its health checks (interval {HEALTH_INTERVAL:?})"
    );
    eventually(
        "the failing worker reported unhealthy",
        Duration::from_secs(30),
        || Ok((reported_health(node, ns, "workers").get(&sick) == Some(&false)).then_some(())),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    for (protocol, target) in [("udp", udp), ("tcp", tcp)] {
        let now = probe(node, ns, target, protocol).unwrap();
        for (n, who) in &after[protocol] {
            if *who == sick {
                assert_ne!(now[n], sick, "{protocol}: session {n} still on {sick}");
            } else {
                assert_eq!(
                    &now[n], who,
                    "{protocol}: session {n} moved though its worker is healthy"
                );
            }
        }
    }

    nft(&["delete", "table", "inet", "spur_l4_test"]);
    eventually(
        "the worker back in rotation",
        Duration::from_secs(30),
        || {
            let got = probe_with(
                node,
                ns,
                &["--target", udp, "--sessions", "1", "--first", &sample_arg],
            )?;
            Ok((got.get(&sample) == Some(&sick)).then_some(()))
        },
    )
    .unwrap();
}

/// Datagrams of 0 and 65 507 bytes pass; a flood of sessions past a table's limit evicts the
/// oldest (counted, the table bounded) and every session is still answered; an endpoint whose
/// port is closed sends ICMP errors back, counted, and the other listeners carry on.
fn bad_input(node: &Node, ns: &str, gateway: &str, ip: &str, udp: &str) {
    for size in ["0", "65507"] {
        let got = probe_with(
            node,
            ns,
            &[
                "--target",
                udp,
                "--sessions",
                "5",
                "--first",
                "5000",
                "--size",
                size,
            ],
        )
        .unwrap();
        assert_eq!(got.len(), 5, "{size}-byte datagrams: {got:?}");
    }

    let flood = 6 * FLOOD_TABLE;
    let got = probe_with(
        node,
        ns,
        &[
            "--target",
            &format!("{ip}:5006"),
            "--sessions",
            &flood.to_string(),
            "--batch",
            &flood.to_string(),
        ],
    )
    .unwrap();
    assert_eq!(got.len(), flood as usize, "{got:?}");
    let evicted = gateway_metric(
        node,
        ns,
        gateway,
        "l4_sessions_evicted_total",
        "listener=\"media/flood\"",
    )
    .unwrap();
    let active = gateway_metric(
        node,
        ns,
        gateway,
        "l4_sessions_active",
        "listener=\"media/flood\"",
    )
    .unwrap();
    assert!(
        evicted >= f64::from(flood - FLOOD_TABLE),
        "{evicted} sessions evicted of {flood} in a table of {FLOOD_TABLE}"
    );
    assert!(
        active <= f64::from(FLOOD_TABLE),
        "{active} sessions in a table of {FLOOD_TABLE}"
    );

    // An endpoint with nothing on its port: a worker's address, port 9.
    let workers = node.pods(ns, "app=udp-worker").unwrap();
    let unreachable = node.get_json(ns, &["pod", &workers[0]]).unwrap()["status"]["podIP"]
        .as_str()
        .unwrap()
        .to_owned();
    node.apply(&void_set(ns, &unreachable)).unwrap();
    let void = eventually(
        "the void listener's Service",
        Duration::from_secs(60),
        || {
            let Ok(s) = node.get_json(ns, &["service", "void"]) else {
                return Ok(None);
            };
            Ok(s["spec"]["clusterIP"].as_str().map(str::to_owned))
        },
    )
    .unwrap();
    eventually("ICMP errors counted", Duration::from_secs(60), || {
        // bash's /dev/udp: datagrams without waiting for replies that never come.
        node.in_pod_netns(
            ns,
            "client",
            "client",
            &[
                "bash",
                "-c",
                &format!("for i in 1 2 3 4 5; do printf x >/dev/udp/{void}/5007; done"),
            ],
        )?;
        std::thread::sleep(Duration::from_millis(500));
        let icmp = gateway_metric(
            node,
            ns,
            gateway,
            "l4_icmp_errors_total",
            "listener=\"void/void\"",
        )
        .unwrap_or(0.0);
        Ok((icmp > 0.0).then_some(()))
    })
    .unwrap();
    let got = probe_with(
        node,
        ns,
        &["--target", udp, "--sessions", "20", "--first", "6000"],
    )
    .unwrap();
    assert_eq!(
        got.len(),
        20,
        "the rtp listener after the flood and the ICMP errors: {got:?}"
    );
}
