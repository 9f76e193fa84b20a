//! Traffic capture on the node (docs/traffic.md): turning capture on is refused without the
//! capturer role and works with it; a keyed request through `frontend` shows up in `spur traffic
//! tail` (run from a laptop network namespace, TLS to the chart's store) with the fork's answer;
//! a reference sandbox's virtual workload captures the baseline's answer to the same request and
//! `spur traffic diff` shows the fork's changed env; credentials never reach the store; 10 000
//! captured requests all succeed, are stored or counted as dropped, and the sidecar stays within
//! its memory limit; with the store scaled to zero, traffic is unaffected and the drop counter
//! rises.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;
use spur_e2e::node::{Node, SPUR_NAMESPACE, eventually, spur_bin};

use super::node_access::user_in;

const USERS: &str = "traffic-users";
const SECRET: &str = "node-capture-secret-4bd1";
const LOAD: usize = 10_000;

/// What the test needs of the node test's state at this point.
pub(crate) struct Scene<'a> {
    pub ns: &'a str,
    pub client: &'a str,
    /// The frontend's URL (it calls backend, propagating the key).
    pub frontend: &'a str,
    /// The sandbox forking backend (with marker `fix`) and its key.
    pub sandbox: &'a str,
    pub key: &'a str,
    pub fork_pod: &'a str,
    pub backend_pod: &'a str,
}

pub(crate) fn traffic_on_the_node(node: &Node, s: &Scene<'_>) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    node.kubectl(&["create", "namespace", USERS]).unwrap();
    let (dev, _) = user_in(node, d, USERS, "dev");
    user_in(node, d, USERS, "reader");
    // The store takes readers' tokens only for its own audience (docs/traffic.md).
    let reader_token = node
        .kubectl(&[
            "-n",
            USERS,
            "create",
            "token",
            "reader",
            "--duration=1h",
            "--audience=spur-traffic",
        ])
        .unwrap()
        .trim()
        .to_owned();
    node.kubectl(&[
        "create",
        "clusterrolebinding",
        "traffic-dev-sandboxes",
        "--clusterrole=spur-traffic-test-sandboxes",
        &format!("--serviceaccount={USERS}:dev"),
    ])
    .unwrap();
    node.apply(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: spur-traffic-test-sandboxes}\n\
         rules: [{apiGroups: [spur.dev], resources: [sandboxes], verbs: [get, patch]}]\n",
    )
    .unwrap();
    // Changing a Sandbox needs its creator's rights where it forks (spur-sandbox-creator-rights).
    node.kubectl(&[
        "-n",
        s.ns,
        "create",
        "rolebinding",
        "traffic-dev-edit",
        "--clusterrole=edit",
        &format!("--serviceaccount={USERS}:dev"),
    ])
    .unwrap();
    node.kubectl(&[
        "create",
        "clusterrolebinding",
        "traffic-reader",
        "--clusterrole=spur-traffic-reader",
        &format!("--serviceaccount={USERS}:reader"),
    ])
    .unwrap();

    // --- turning capture on: refused without spur-traffic-capturer, done with it -------------
    let out = spur_as(&dev, &["traffic", "capture", "on", s.sandbox]);
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sandboxes/capture"), "{err}");
    node.kubectl(&[
        "create",
        "clusterrolebinding",
        "traffic-dev-capture",
        "--clusterrole=spur-traffic-capturer",
        &format!("--serviceaccount={USERS}:dev"),
    ])
    .unwrap();
    eventually(
        "capture on with the capturer role",
        Duration::from_secs(30),
        || {
            let out = spur_as(&dev, &["traffic", "capture", "on", s.sandbox]);
            Ok(out.status.success().then_some(()))
        },
    )
    .unwrap();

    // --- the reference sandbox: a virtual workload of backend, capturing ---------------------
    node.apply(&format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata: {{name: backend-ref}}
spec:
  virtual:
    - {{name: backend, workload: {{kind: Deployment, namespace: {ns}, name: backend}}}}
  capture: {{enabled: true}}
"#,
        ns = s.ns
    ))
    .unwrap();
    let ref_key = super::sandbox_ready(node, "backend-ref");
    let vw = node
        .kubectl(&["-n", s.ns, "get", "virtualworkloads", "-o", "json"])
        .unwrap();
    let vw: Value = serde_json::from_str(&vw).unwrap();
    let vw = &vw["items"][0];
    assert_eq!(super::condition(vw, "Ready"), Some("True"), "{vw}");
    assert_eq!(vw["status"]["baselineSidecars"]["ready"], 1, "{vw}");

    // --- spur traffic tail from a laptop, over TLS to the store ------------------------------
    let svc = node
        .get_json(SPUR_NAMESPACE, &["service", "spur-traffic"])
        .unwrap();
    let server = format!(
        "https://{}:7790",
        svc["spec"]["clusterIP"].as_str().unwrap()
    );
    let ca_file = d.join("ca.crt");
    std::fs::write(&ca_file, crate::node_local::ca_bundle(node)).unwrap();
    let conn = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        v.extend(
            [
                "--server",
                &server,
                "--ca",
                ca_file.to_str().unwrap(),
                "--tls-server-name",
                &format!("spur-traffic.{SPUR_NAMESPACE}.svc"),
            ]
            .map(String::from),
        );
        v
    };
    let mut laptop = node.laptop(5).unwrap();
    let tail_log = d.join("tail.log");
    let tail_args = conn(&[
        "traffic",
        "tail",
        s.sandbox,
        "--json",
        "--count",
        "1",
        "--timeout",
        "120s",
    ]);
    let tail_args: Vec<&str> = tail_args.iter().map(String::as_str).collect();
    laptop
        .spawn(
            &spur_bin("spur"),
            &tail_args,
            &[("SPUR_TRAFFIC_TOKEN", reader_token.as_str())],
            &tail_log,
        )
        .unwrap();
    // Tail sees only what is stored after it subscribed: keyed requests until one shows up,
    // the log read every 50 ms for 3 s after each answer.
    let tail_line = || {
        std::fs::read_to_string(&tail_log)
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with('{'))
            .map(str::to_string)
    };
    let (line, after) = eventually(
        "a keyed request in spur traffic tail",
        Duration::from_secs(120),
        || {
            let log = std::fs::read_to_string(&tail_log).unwrap_or_default();
            if log.contains("spur:") {
                bail!("spur traffic tail failed: {log}");
            }
            let sent = Instant::now();
            let a = super::try_get(node, s.ns, s.client, s.frontend, Some(s.key))?;
            anyhow::ensure!(a.answered_by() == Some(s.fork_pod), "{a:?}");
            let answered = Instant::now();
            while answered.elapsed() < Duration::from_secs(3) {
                if let Some(line) = tail_line() {
                    return Ok(Some((line, (sent.elapsed(), answered.elapsed()))));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(None)
        },
    )
    .unwrap();
    eprintln!(
        "node traffic: tail printed the exchange {:?} after `kubectl exec curl` started, {:?} after it returned",
        after.0, after.1
    );
    let x: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(x["sandbox"], s.sandbox, "{x}");
    assert_eq!(x["routed"], "sandbox", "{x}");
    assert_eq!(x["status"], 200, "{x}");
    let body: Value = serde_json::from_str(x["responseBody"]["data"].as_str().unwrap()).unwrap();
    assert_eq!(body["pod"], s.fork_pod, "{x}");
    assert_eq!(body["marker"], "fix", "{x}");

    // --- the same request with the reference key: the baseline answers, and diff shows it -----
    let a = super::try_get(node, s.ns, s.client, s.frontend, Some(&ref_key)).unwrap();
    assert_eq!(a.answered_by(), Some(s.backend_pod), "{a:?}");
    let laptop_spur = |args: &[&str]| -> std::process::Output {
        let args = conn(args);
        Command::new("ip")
            .args(["netns", "exec", &laptop.netns])
            .arg(spur_bin("spur"))
            .args(&args)
            .env("SPUR_TRAFFIC_TOKEN", &reader_token)
            .output()
            .unwrap()
    };
    let diff = eventually(
        "spur traffic diff to pair the fork's and the baseline's answers",
        Duration::from_secs(30),
        || {
            let out = laptop_spur(&[
                "traffic",
                "diff",
                s.sandbox,
                "--against",
                "backend-ref",
                "--json",
            ]);
            if out.status.code() == Some(2) {
                bail!("{}", String::from_utf8_lossy(&out.stderr));
            }
            let v: Value = serde_json::from_slice(&out.stdout)?;
            Ok((v["summary"]["pairs"].as_u64() > Some(0)).then_some((out.status.code(), v)))
        },
    )
    .unwrap();
    assert_eq!(diff.0, Some(1), "differences found: {}", diff.1);
    let text = diff.1["pairs"].to_string();
    assert!(
        text.contains("$.marker") && text.contains("fix"),
        "the fork's changed env in the diff: {}",
        diff.1
    );

    calls_of_a_smart_test_run(node, s, &laptop.netns, d, &conn);

    // --- credentials never reach the store ---------------------------------------------------
    let backend_url = format!("http://backend.{}.svc.cluster.local:8080/secret", s.ns);
    let bearer = format!("Bearer {SECRET}");
    let cookie = format!("session={SECRET}");
    let baggage = format!("sd-routing-key={}", s.key);
    node.curl(
        s.ns,
        s.client,
        &backend_url,
        &[
            ("authorization", &bearer),
            ("cookie", &cookie),
            ("baggage", &baggage),
        ],
    )
    .unwrap();
    let stored = eventually(
        "the request with credentials in the store",
        Duration::from_secs(30),
        || {
            let out = laptop_spur(&["traffic", "query", s.sandbox, "--path", "/secret", "--json"]);
            anyhow::ensure!(out.status.success(), "{out:?}");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            Ok((!text.trim().is_empty()).then_some(text))
        },
    )
    .unwrap();
    assert!(
        !stored.contains(SECRET),
        "a credential reached the store: {stored}"
    );
    assert!(stored.contains("<redacted>"), "{stored}");

    // --- 10 000 captured requests: none fails, all stored or counted, the sidecar bounded ----
    let backend = node.get_json(s.ns, &["pod", s.backend_pod]).unwrap();
    let backend_ip = backend["status"]["podIP"].as_str().unwrap().to_string();
    let store_pod = node
        .pods(SPUR_NAMESPACE, "app.kubernetes.io/name=spur-traffic")
        .unwrap();
    let store = node
        .get_json(SPUR_NAMESPACE, &["pod", &store_pod[0]])
        .unwrap();
    let store_ip = store["status"]["podIP"].as_str().unwrap().to_string();
    let metric = |url: &str, series: &str| -> f64 {
        let text = node
            .kubectl(&[
                "-n",
                s.ns,
                "exec",
                s.client,
                "--",
                "curl",
                "-sS",
                "--max-time",
                "10",
                url,
            ])
            .unwrap();
        spur_e2e::sample(&text, series)
    };
    let sidecar_metrics = format!("http://{backend_ip}:15020/metrics");
    let store_metrics = format!("http://{store_ip}:9090/metrics");
    let captured = |m: &str| metric(m, "spur_capture_exchanges_total");
    let dropped = |m: &str| -> f64 {
        ["ring_full", "busy", "ship_failed"]
            .iter()
            .map(|r| metric(m, &format!("spur_capture_dropped_total{{reason=\"{r}\"}}")))
            .sum()
    };
    let stored_total = |m: &str| metric(m, "spur_traffic_exchanges_stored_total");
    let (captured0, dropped0, stored0) = (
        captured(&sidecar_metrics),
        dropped(&sidecar_metrics),
        stored_total(&store_metrics),
    );
    let started = Instant::now();
    let load = node
        .kubectl(&[
            "-n",
            s.ns,
            "exec",
            s.client,
            "--",
            "sh",
            "-c",
            &format!(
                "curl -s -Z --parallel-max 8 -H 'baggage: {baggage}' -w '\\nCODE %{{http_code}}\\n' \
                 'http://backend.{}.svc.cluster.local:8080/?i=[1-{LOAD}]' | grep -c '^CODE 200$'",
                s.ns
            ),
        ])
        .unwrap();
    eprintln!(
        "node traffic: {LOAD} captured requests in {:?}",
        started.elapsed()
    );
    assert_eq!(load.trim(), LOAD.to_string(), "every request answered 200");
    let (captured1, dropped1, stored1) = eventually(
        "every captured exchange stored or counted as dropped",
        Duration::from_secs(60),
        || {
            let c = captured(&sidecar_metrics);
            let d = dropped(&sidecar_metrics);
            let st = stored_total(&store_metrics);
            Ok(
                (c - captured0 >= LOAD as f64 && (st - stored0) + (d - dropped0) >= c - captured0)
                    .then_some((c, d, st)),
            )
        },
    )
    .unwrap();
    eprintln!(
        "node traffic: captured {}, stored {}, dropped {}",
        captured1 - captured0,
        stored1 - stored0,
        dropped1 - dropped0
    );
    let (hwm, limit) = sidecar_memory(node, s.ns, s.backend_pod);
    eprintln!("node traffic: backend sidecar VmHWM {hwm} KiB (limit {limit} KiB)");
    assert!(
        hwm < limit,
        "the sidecar's peak memory {hwm} KiB reached its limit {limit} KiB"
    );

    // --- the store unreachable: traffic unaffected, drops counted -----------------------------
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "scale",
        "deployment",
        "spur-traffic",
        "--replicas=0",
    ])
    .unwrap();
    eventually("the store to be gone", Duration::from_secs(120), || {
        Ok(node
            .pods(SPUR_NAMESPACE, "app.kubernetes.io/name=spur-traffic")?
            .is_empty()
            .then_some(()))
    })
    .unwrap();
    let before = dropped(&sidecar_metrics);
    for i in 0..50 {
        let a = super::try_get(node, s.ns, s.client, s.frontend, Some(s.key))
            .with_context(|| format!("request {i} with the store down"))
            .unwrap();
        assert_eq!(a.answered_by(), Some(s.fork_pod), "{a:?}");
    }
    eventually("the drop counter to rise", Duration::from_secs(60), || {
        Ok((dropped(&sidecar_metrics) > before).then_some(()))
    })
    .unwrap();
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "scale",
        "deployment",
        "spur-traffic",
        "--replicas=1",
    ])
    .unwrap();
    node.rollout(SPUR_NAMESPACE, "spur-traffic").unwrap();

    drop(laptop);
    node.kubectl(&[
        "delete",
        "sandbox",
        "backend-ref",
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
    node.kubectl(&["delete", "namespace", USERS, "--wait=false"])
        .unwrap();
}

/// `spur <args>` as the user of `kubeconfig`.
fn spur_as(kubeconfig: &Path, args: &[&str]) -> std::process::Output {
    Command::new(spur_bin("spur"))
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .output()
        .unwrap()
}

/// The backend's sidecar processes: their peak resident memory and their container's memory
/// limit, in KiB.
fn sidecar_memory(node: &Node, ns: &str, pod: &str) -> (u64, u64) {
    let p = node.get_json(ns, &["pod", pod]).unwrap();
    let status = p["status"]["initContainerStatuses"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(
            p["status"]["containerStatuses"]
                .as_array()
                .into_iter()
                .flatten(),
        )
        .find(|c| c["name"] == "spur-sidecar")
        .unwrap();
    assert_eq!(status["restartCount"], 0, "the sidecar restarted: {status}");
    let pid = node
        .task_pid(status["containerID"].as_str().unwrap())
        .unwrap();
    // The container's process is the supervisor (`SPUR_SUPERVISE`), the worker its child: the
    // two peaks added (an upper bound of the container's peak).
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
    let hwm: u64 = std::iter::once(pid.as_str())
        .chain(children.split_whitespace())
        .map(|pid| {
            let proc_status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            proc_status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap()
        })
        .sum();
    let limit = p["spec"]["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(p["spec"]["containers"].as_array().into_iter().flatten())
        .find(|c| c["name"] == "spur-sidecar")
        .and_then(|c| c["resources"]["limits"]["memory"].as_str())
        .map(kib)
        .unwrap();
    (hwm, limit)
}

/// A Kubernetes memory quantity (`128Mi`, `1Gi`, `500M`, bytes) in KiB.
fn kib(q: &str) -> u64 {
    let (n, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let n: u64 = n.parse().unwrap();
    match unit {
        "Ki" => n,
        "Mi" => n * 1024,
        "Gi" => n * 1024 * 1024,
        "M" => n * 1_000_000 / 1024,
        "G" => n * 1_000_000_000 / 1024,
        _ => n / 1024,
    }
}

/// `spur test run --calls` from the laptop (docs/smart-tests.md, "Downstream calls"): refused
/// to a user who may read the sandbox's traffic but not capture it; for one who may, the store
/// captures the run at every sidecar of the sandbox's namespace, the run's marker travels
/// through the frontend (its real baggage propagation) to the backend's sidecar, and each
/// pass's calls are read back and compared: the fork of backend still receives the frontend's
/// call, so no call is a finding.
fn calls_of_a_smart_test_run(
    node: &Node,
    s: &Scene<'_>,
    netns: &str,
    d: &Path,
    conn: &dyn Fn(&[&str]) -> Vec<String>,
) {
    let token = |user: &str| {
        node.kubectl(&[
            "-n",
            USERS,
            "create",
            "token",
            user,
            "--duration=1h",
            "--audience=spur-traffic",
        ])
        .unwrap()
        .trim()
        .to_owned()
    };
    let svc = node.get_json(s.ns, &["service", "frontend"]).unwrap();
    let frontend = format!("{}:8080", svc["spec"]["clusterIP"].as_str().unwrap());
    let test = d.join("calls-test.yaml");
    std::fs::write(
        &test,
        format!(
            "steps:\n  - name: home\n    http: {{url: \"http://{frontend}/\"}}\n    checks: [{{status: 200}}]\n"
        ),
    )
    .unwrap();
    let run = |token: &str| -> std::process::Output {
        let args = conn(&[
            "test",
            "run",
            "-f",
            test.to_str().unwrap(),
            "--sandbox",
            s.sandbox,
            "--key",
            s.key,
            "--calls",
            "-o",
            "json",
        ]);
        let out = Command::new("ip")
            .args(["netns", "exec", netns])
            .arg(spur_bin("spur"))
            .args(&args)
            .env("SPUR_TRAFFIC_TOKEN", token)
            .output()
            .unwrap();
        eprintln!(
            "node traffic: spur test run --calls: exit {:?}\n{}{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    // The reader may read the traffic, not capture it: refused before anything is sent.
    let out = run(&token("reader"));
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("permission denied") && err.contains("sandboxes/capture"),
        "{err}"
    );
    // dev may capture (spur-traffic-capturer), create Deployments in the namespace (edit), and
    // now read what was captured.
    node.kubectl(&[
        "create",
        "clusterrolebinding",
        "traffic-dev-reader",
        "--clusterrole=spur-traffic-reader",
        &format!("--serviceaccount={USERS}:dev"),
    ])
    .unwrap();
    let dev = token("dev");
    let report: Value = eventually(
        "spur test run --calls as dev",
        Duration::from_secs(60),
        || {
            let out = run(&dev);
            if out.status.code() == Some(2) {
                // The reader binding reaches the store's review within its cache's 30 s.
                let err = String::from_utf8_lossy(&out.stderr);
                anyhow::ensure!(err.contains("sandboxes/traffic"), "{err}");
                return Ok(None);
            }
            Ok(Some(serde_json::from_slice(&out.stdout)?))
        },
    )
    .unwrap();
    assert_eq!(
        report["calls"]["namespaces"],
        serde_json::json!([s.ns]),
        "{report}"
    );
    let calls = |side: &Value| -> Vec<(String, u64)> {
        side.as_array()
            .unwrap_or_else(|| panic!("no calls: {report}"))
            .iter()
            .map(|c| {
                (
                    c["call"].as_str().unwrap().to_owned(),
                    c["count"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let both = vec![
        (format!("GET {}/backend", s.ns), 1),
        (format!("GET {}/frontend", s.ns), 1),
    ];
    let step = &report["steps"][0]["calls"];
    assert_eq!(calls(&step["sandbox"]), both, "{report}");
    assert_eq!(calls(&step["baseline"][0]), both, "{report}");
    assert_eq!(calls(&step["baseline"][1]), both, "{report}");
    let findings = report["findings"].to_string();
    assert!(!findings.contains("\"call"), "{findings}");
    // The fork's changed env is still what the run found.
    assert!(findings.contains("$.upstream.marker"), "{findings}");
}
