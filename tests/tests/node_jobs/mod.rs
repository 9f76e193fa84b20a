//! Jobs on the node (docs/jobs.md): a JobRunnerGroup of runner pods from an unchanged image,
//! jobs submitted with `spur job submit --attach`, answered by the sandbox's fork when they carry
//! its key; the queue (20 jobs, 2 runners, submission order per runner, each once), scaling,
//! lost runners, cancel and timeout killing the process tree, logs and artifacts kept after the
//! pods are gone, and bad input.

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::Value;
use spur_e2e::node::{Answer, Node, eventually, spur_bin};

const GROUP: &str = "smoke";
const RUNNER_IMAGE: &str = "localhost/spur-test-client:dev";

/// `spur` on the host with the admin kubeconfig, killed after 3 minutes whatever happens.
fn spur(node: &Node, ns: &str, args: &[&str]) -> Command {
    let mut c = Command::new("timeout");
    c.args(["-s", "KILL", "180"])
        .arg(spur_bin("spur"))
        .args(args)
        .args(["-n", ns])
        .env("SPUR_KUBECONFIG", &node.kubeconfig);
    c
}

/// Runs `spur`; (exit code, stdout, stderr). Killed after 3 minutes (no test waits forever).
pub(crate) fn run(
    node: &Node,
    ns: &str,
    args: &[&str],
    stdin: Option<&str>,
) -> (i32, String, String) {
    let mut c = spur(node, ns, args);
    c.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    if let Some(text) = stdin {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = read(Box::new(child.stdout.take().unwrap()));
    let err = read(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "spur {args:?} ran for 3 minutes: {}\n{}",
                err.join().unwrap_or_default(),
                node.describe(ns)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status.code().unwrap_or(-1),
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    )
}

fn job_yaml(ns: &str, name: &str, extra: &str, script: &str) -> String {
    let script: String = script.lines().map(|l| format!("    {l}\n")).collect();
    format!(
        "apiVersion: spur.dev/v1alpha1\nkind: Job\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  runnerGroup: {GROUP}\n{extra}  script: |\n{script}"
    )
}

fn job(node: &Node, ns: &str, name: &str) -> Value {
    node.get_json(ns, &["jobs.spur.dev", name]).unwrap()
}

fn phase(j: &Value) -> &str {
    j["status"]["phase"].as_str().unwrap_or("")
}

fn wait_phase(node: &Node, ns: &str, name: &str, want: &[&str], limit: Duration) -> Value {
    eventually(&format!("job {name} to be {want:?}"), limit, || {
        let j = node.get_json(ns, &["jobs.spur.dev", name])?;
        Ok(want.contains(&phase(&j)).then_some(j))
    })
    .with_context(|| node.describe(ns))
    .unwrap()
}

fn condition<'a>(obj: &'a Value, type_: &str) -> Option<(&'a str, &'a str)> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .map(|c| {
            (
                c["reason"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or(""),
            )
        })
}

/// Host pids whose command line contains `marker` (pods' processes are the host's too).
fn pids_with(marker: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(marker) && !cmd.contains("grep") {
                out.push(pid);
            }
        }
    }
    out
}

fn ready_runners(node: &Node, ns: &str, n: i64) {
    eventually(
        &format!("{n} ready runners"),
        Duration::from_secs(120),
        || {
            let g = node.get_json(ns, &["jobrunnergroup", GROUP])?;
            let pods = node.pods(ns, &format!("spur.dev/runner-group={GROUP}"))?;
            Ok((g["status"]["readyReplicas"].as_i64() == Some(n)
                && g["status"]["replicas"].as_i64() == Some(n)
                && pods.len() == n as usize)
                .then_some(()))
        },
    )
    .with_context(|| node.describe(ns))
    .unwrap();
}

pub(crate) fn jobs_on_the_node(
    node: &Node,
    app_ns: &str,
    sandbox: &str,
    key: &str,
    fork: &str,
    baseline: &str,
) {
    // --- the aggregated API is up: logs come through the API server ------------------------
    eventually(
        "APIService v1alpha1.jobs.spur.dev Available",
        Duration::from_secs(120),
        || {
            let a: Value = serde_json::from_str(&node.kubectl(&[
                "get",
                "apiservice",
                "v1alpha1.jobs.spur.dev",
                "-o",
                "json",
            ])?)?;
            Ok((a["status"]["conditions"][0]["status"] == "True").then_some(()))
        },
    )
    .unwrap();

    let ci = node
        .namespace("ci", &[("spur.dev/enabled", "true")])
        .unwrap();
    let ns = ci.name.as_str();
    node.apply(&format!(
        "apiVersion: spur.dev/v1alpha1\nkind: JobRunnerGroup\nmetadata:\n  name: {GROUP}\n  namespace: {ns}\nspec:\n  image: {RUNNER_IMAGE}\n  replicas: 2\n  jobTimeout: 10m\n"
    ))
    .unwrap();
    ready_runners(node, ns, 2);
    let runners = node
        .pods(ns, &format!("spur.dev/runner-group={GROUP}"))
        .unwrap();
    // The image is used unchanged: the executor came in through the init container.
    let p = node.get_json(ns, &["pod", &runners[0]]).unwrap();
    assert_eq!(p["spec"]["initContainers"][0]["name"], "spur-job-init");
    let containers = p["spec"]["containers"].as_array().unwrap();
    // The outbound sidecar (routingKeyInjection, the default) first, then the runner.
    assert_eq!(containers[0]["name"], "spur-sidecar");
    assert_eq!(containers[1]["name"], "runner");
    assert_eq!(containers[1]["image"], RUNNER_IMAGE);

    let frontend = format!("http://frontend.{app_ns}.svc.cluster.local:8080/");

    // --- a job with the sandbox's key in baggage is answered by the fork -------------------
    let keyed = job_yaml(
        ns,
        "keyed",
        &format!(
            "  routingContext:\n    sandbox: {sandbox}\n  artifacts:\n  - path: /tmp/answer.json\n    meta: {{kind: response}}\n  resultPath: /tmp/result.txt\n"
        ),
        &format!(
            "#!/bin/sh\nset -eu\ncurl -sS --max-time 10 -H \"baggage: sd-routing-key=$SPUR_ROUTING_KEY\" {frontend} | tee /tmp/answer.json\necho\necho \"key=$SPUR_ROUTING_KEY signadot=$SIGNADOT_ROUTING_KEY sandbox=$SPUR_SANDBOX_NAME attempt=$SPUR_JOB_ATTEMPT\"\nprintf 'answered %s bytes' \"$(wc -c < /tmp/answer.json)\" > /tmp/result.txt\n"
        ),
    );
    let (code, out, err) = run(
        node,
        ns,
        &["job", "submit", "-f", "-", "--attach"],
        Some(&keyed),
    );
    assert_eq!(
        code,
        0,
        "stdout: {out}\nstderr: {err}\n{}",
        node.describe(ns)
    );
    let first = out.lines().next().unwrap_or_default();
    let answer = Answer {
        status: 200,
        json: serde_json::from_str(first).unwrap_or(Value::Null),
        body: first.to_owned(),
    };
    assert_eq!(answer.answered_by(), Some(fork), "{out}");
    assert!(
        out.contains(&format!(
            "key={key} signadot={key} sandbox={sandbox} attempt=1"
        )),
        "{out}"
    );
    assert!(err.contains("Succeeded"), "{err}");

    // Without a routing context: the baseline.
    let plain = job_yaml(
        ns,
        "plain",
        "",
        &format!(
            "#!/bin/sh\ncurl -sS --max-time 10 {frontend}\necho\necho \"key=${{SPUR_ROUTING_KEY:-none}}\"\n"
        ),
    );
    let (code, out, err) = run(
        node,
        ns,
        &["job", "submit", "-f", "-", "--attach"],
        Some(&plain),
    );
    assert_eq!(code, 0, "{out}\n{err}");
    let first = out.lines().next().unwrap_or_default();
    let answer = Answer {
        status: 200,
        json: serde_json::from_str(first).unwrap_or(Value::Null),
        body: first.to_owned(),
    };
    assert_eq!(answer.answered_by(), Some(baseline), "{out}");
    assert!(out.contains("key=none"), "{out}");

    // --- injectRoutingKey: Auto: a script that sets no header still reaches the fork ---------
    // (HTTP/1 and h2 with prior knowledge, both through the runner's outbound sidecar).
    let auto = job_yaml(
        ns,
        "auto",
        &format!("  routingContext:\n    sandbox: {sandbox}\n  injectRoutingKey: Auto\n"),
        &format!(
            "#!/bin/sh\nset -eu\ncurl -sS --max-time 10 {frontend}\ncurl -sS --max-time 10 --http2-prior-knowledge {frontend}\n"
        ),
    );
    let (code, out, err) = run(
        node,
        ns,
        &["job", "submit", "-f", "-", "--attach"],
        Some(&auto),
    );
    assert_eq!(code, 0, "{out}\n{err}\n{}", node.describe(ns));
    let answers: Vec<Answer> = out
        .lines()
        .map(|l| Answer {
            status: 200,
            json: serde_json::from_str(l).unwrap_or(Value::Null),
            body: l.to_owned(),
        })
        .collect();
    assert_eq!(answers.len(), 2, "{out}");
    for a in &answers {
        assert_eq!(a.answered_by(), Some(fork), "{out}");
    }
    // The same runners, a job without Auto: nothing is added.
    let (code, out, _) = run(
        node,
        ns,
        &["job", "submit", "-f", "-", "--attach"],
        Some(&plain.replace("name: plain", "name: plain-again")),
    );
    assert_eq!(code, 0);
    let first = out.lines().next().unwrap_or_default();
    let answer = Answer {
        status: 200,
        json: serde_json::from_str(first).unwrap_or(Value::Null),
        body: first.to_owned(),
    };
    assert_eq!(
        answer.answered_by(),
        Some(baseline),
        "a key left from the Auto job: {out}"
    );

    // --- logs and artifacts outlive the runner pod ------------------------------------------
    let j = job(node, ns, "keyed");
    let ran_on = j["status"]["attempts"][0]["pod"]
        .as_str()
        .unwrap()
        .to_owned();
    let (_, log_before, _) = run(node, ns, &["job", "logs", "keyed"], None);
    node.kubectl(&["-n", ns, "delete", "pod", &ran_on, "--wait=true"])
        .unwrap();
    let (code, log_after, err) = run(node, ns, &["job", "logs", "keyed"], None);
    assert_eq!(code, 0, "{err}");
    assert_eq!(log_after, log_before);
    let dl = ci_tmp(ns).join("answer.json");
    let (code, _, err) = run(
        node,
        ns,
        &[
            "artifact",
            "download",
            "keyed",
            "/tmp/answer.json",
            "-o",
            dl.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let got = std::fs::read(&dl).unwrap();
    // The demo app's answer ends with a newline; the log has it too.
    let want = format!("{}\n", log_after.lines().next().unwrap());
    assert_eq!(got, want.as_bytes(), "the artifact downloads byte for byte");
    assert_eq!(j["status"]["artifacts"][0]["meta"]["kind"], "response");
    // The result file, read by the executor once the script ended, is in the status and shown.
    assert_eq!(
        j["status"]["result"],
        format!("answered {} bytes", got.len()),
        "{j}"
    );
    let (code, shown, err) = run(node, ns, &["job", "get", "keyed"], None);
    assert_eq!(code, 0, "{err}");
    assert!(
        shown.contains(&format!("Result:\n  answered {} bytes\n", got.len())),
        "{shown}"
    );
    // The group replaces the deleted pod.
    ready_runners(node, ns, 2);

    // --- the first line arrives while the job still runs ------------------------------------
    let live = job_yaml(
        ns,
        "live",
        "",
        "#!/bin/sh\necho first-line\nsleep 4\necho last-line\n",
    );
    let mut child = spur(node, ns, &["job", "submit", "-f", "-", "--attach"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(live.as_bytes())
            .unwrap();
    }
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "first-line");
    assert_eq!(
        phase(&job(node, ns, "live")),
        "Running",
        "the first line came before the end"
    );
    assert_eq!(lines.next().unwrap().unwrap(), "last-line");
    assert!(child.wait().unwrap().success());

    // --- 20 jobs at once on 2 runners: each once, in submission order per runner ----------
    let many: Vec<String> = (0..20)
        .map(|i| {
            job_yaml(
                ns,
                &format!("q-{i:02}"),
                "",
                "#!/bin/sh\necho \"$SPUR_JOB_NAME on $(hostname)\"\nsleep 0.3\n",
            )
        })
        .collect();
    let t = Instant::now();
    node.kubectl_stdin(&["create"], &many.join("---\n"))
        .unwrap();
    let mut by_pod: std::collections::BTreeMap<String, Vec<(k8s_openapi::jiff::Timestamp, usize)>> =
        Default::default();
    for i in 0..20 {
        let name = format!("q-{i:02}");
        let j = wait_phase(node, ns, &name, &["Succeeded"], Duration::from_secs(180));
        let attempts = j["status"]["attempts"].as_array().unwrap();
        assert_eq!(attempts.len(), 1, "{name} ran once: {attempts:?}");
        let pod = attempts[0]["pod"].as_str().unwrap().to_owned();
        // Compared as instants: the RFC 3339 text has as many fraction digits as it needs, so
        // "…:05.12Z" sorts after "…:05.123Z" as text.
        let started: k8s_openapi::jiff::Timestamp =
            attempts[0]["startedAt"].as_str().unwrap().parse().unwrap();
        by_pod.entry(pod.clone()).or_default().push((started, i));
        let (_, log, _) = run(node, ns, &["job", "logs", &name], None);
        assert_eq!(log, format!("{name} on {pod}\n"), "{name}'s log");
    }
    let burst = t.elapsed();
    assert_eq!(by_pod.len(), 2, "both runners worked: {by_pod:?}");
    for (pod, mut runs) in by_pod {
        runs.sort();
        let order: Vec<usize> = runs.iter().map(|r| r.1).collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(order, sorted, "{pod} ran its jobs out of submission order");
    }
    eprintln!("20 jobs on 2 runners: {burst:?}");

    // --- kubectl scale ------------------------------------------------------------------------
    node.kubectl(&[
        "-n",
        ns,
        "scale",
        &format!("jobrunnergroup/{GROUP}"),
        "--replicas=3",
    ])
    .unwrap();
    ready_runners(node, ns, 3);
    node.kubectl(&[
        "-n",
        ns,
        "scale",
        &format!("jobrunnergroup/{GROUP}"),
        "--replicas=2",
    ])
    .unwrap();
    ready_runners(node, ns, 2);

    // --- a runner pod lost mid-job: the job runs again elsewhere ------------------------------
    let lost = job_yaml(
        ns,
        "lost",
        "",
        "#!/bin/sh\necho \"attempt $SPUR_JOB_ATTEMPT\"\nif [ \"$SPUR_JOB_ATTEMPT\" = 1 ]; then sleep 300; fi\necho ok\n",
    );
    node.kubectl_stdin(&["create"], &lost).unwrap();
    let j = wait_phase(node, ns, "lost", &["Running"], Duration::from_secs(60));
    let pod = j["status"]["attempts"][0]["pod"]
        .as_str()
        .unwrap()
        .to_owned();
    eventually("attempt 1's output", Duration::from_secs(30), || {
        let (_, log, _) = run(node, ns, &["job", "logs", "lost"], None);
        Ok(log.contains("attempt 1").then_some(()))
    })
    .unwrap();
    node.kubectl(&["-n", ns, "delete", "pod", &pod, "--wait=false"])
        .unwrap();
    let j = wait_phase(
        node,
        ns,
        "lost",
        &["Succeeded", "Failed"],
        Duration::from_secs(120),
    );
    assert_eq!(phase(&j), "Succeeded", "{j}");
    let attempts = j["status"]["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[0]["phase"], "Lost");
    assert_ne!(attempts[1]["pod"], pod.as_str());
    let (_, log, _) = run(node, ns, &["job", "logs", "lost"], None);
    assert_eq!(log, "attempt 2\nok\n");
    let (_, log1, _) = run(node, ns, &["job", "logs", "lost", "--attempt", "1"], None);
    assert_eq!(log1, "attempt 1\n", "the lost attempt's output is kept");

    // --- cancel and timeout end the job and kill its process tree ----------------------------
    let cancel = job_yaml(
        ns,
        "cancel-me",
        "",
        "#!/bin/sh\nsh -c 'sleep 31337' &\nsleep 31338\n",
    );
    node.kubectl_stdin(&["create"], &cancel).unwrap();
    wait_phase(node, ns, "cancel-me", &["Running"], Duration::from_secs(60));
    eventually("the job's processes", Duration::from_secs(30), || {
        Ok(
            (!pids_with("sleep 31337").is_empty() && !pids_with("sleep 31338").is_empty())
                .then_some(()),
        )
    })
    .unwrap();
    let t = Instant::now();
    let (code, _, err) = run(node, ns, &["job", "cancel", "cancel-me"], None);
    assert_eq!(code, 0, "{err}");
    let j = wait_phase(
        node,
        ns,
        "cancel-me",
        &["Canceled"],
        Duration::from_secs(30),
    );
    eprintln!("cancel took {:?}", t.elapsed());
    assert_eq!(j["status"]["canceledBy"], "Request");
    assert!(
        pids_with("sleep 31337").is_empty() && pids_with("sleep 31338").is_empty(),
        "the process tree survived the cancel"
    );

    let slow = job_yaml(
        ns,
        "too-slow",
        "  timeout: 3s\n",
        "#!/bin/sh\necho started\nsleep 31339\n",
    );
    let (code, out, _) = run(
        node,
        ns,
        &["job", "submit", "-f", "-", "--attach"],
        Some(&slow),
    );
    assert_eq!(
        code, 124,
        "a timed-out job exits 124 like timeout(1): {out}"
    );
    let j = job(node, ns, "too-slow");
    assert_eq!(phase(&j), "Canceled");
    assert_eq!(j["status"]["canceledBy"], "Timeout");
    assert!(pids_with("sleep 31339").is_empty());

    // --- bad input -------------------------------------------------------------------------------
    let both = format!(
        "apiVersion: spur.dev/v1alpha1\nkind: Job\nmetadata: {{name: both, namespace: {ns}}}\nspec:\n  runnerGroup: {GROUP}\n  script: \"true\"\n  command: [\"true\"]\n"
    );
    let refused = node
        .kubectl_stdin(&["create"], &both)
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("exactly one of script and command"),
        "{refused}"
    );
    let bad_timeout = job_yaml(ns, "bad-timeout", "  timeout: 5x\n", "true\n");
    let refused = node
        .kubectl_stdin(&["create"], &bad_timeout)
        .unwrap_err()
        .to_string();
    assert!(refused.contains("spec.timeout"), "{refused}");
    let immutable = node
        .kubectl(&[
            "-n",
            ns,
            "patch",
            "jobs.spur.dev",
            "plain",
            "--type=merge",
            "-p",
            "{\"spec\":{\"script\":\"echo changed\"}}",
        ])
        .unwrap_err()
        .to_string();
    assert!(immutable.contains("immutable"), "{immutable}");

    let orphan = job_yaml(ns, "no-group", "", "true\n")
        .replace(&format!("runnerGroup: {GROUP}"), "runnerGroup: missing");
    node.kubectl_stdin(&["create"], &orphan).unwrap();
    let no_sb = job_yaml(
        ns,
        "no-sandbox",
        "  routingContext:\n    sandbox: nope\n",
        "true\n",
    );
    node.kubectl_stdin(&["create"], &no_sb).unwrap();
    for (name, reason) in [
        ("no-group", "RunnerGroupNotFound"),
        ("no-sandbox", "SandboxNotFound"),
    ] {
        let j = eventually(
            &format!("{name}'s condition"),
            Duration::from_secs(30),
            || {
                let j = node.get_json(ns, &["jobs.spur.dev", name])?;
                Ok(condition(&j, "Accepted")
                    .is_some_and(|(r, _)| r == reason)
                    .then_some(j))
            },
        )
        .unwrap();
        assert_eq!(phase(&j), "Queued", "{j}");
    }

    // A hostile script: no API token, no executor key, and another runner refuses it.
    let other = node
        .pods(ns, &format!("spur.dev/runner-group={GROUP}"))
        .unwrap()
        .into_iter()
        .map(|p| {
            node.get_json(ns, &["pod", &p]).unwrap()["status"]["podIP"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect::<Vec<_>>();
    let hostile = job_yaml(
        ns,
        "hostile",
        "",
        &format!(
            "#!/bin/sh\nls /var/run/secrets/kubernetes.io/serviceaccount/token 2>/dev/null && echo TOKEN-FOUND || echo no-token\nls /spur-job/tls/tls.key 2>/dev/null && echo KEY-FOUND || echo no-key\nfor ip in {}; do curl -sk --max-time 5 -o /dev/null https://$ip:7447/ && echo EXECUTOR-ANSWERED || echo executor-refused; done\n",
            other.join(" ")
        ),
    );
    let (code, out, err) = run(
        node,
        ns,
        &["job", "submit", "-f", "-", "--attach"],
        Some(&hostile),
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("no-token") && out.contains("no-key"), "{out}");
    assert!(!out.contains("FOUND") && !out.contains("ANSWERED"), "{out}");
    assert_eq!(
        out.matches("executor-refused").count(),
        other.len(),
        "{out}"
    );
    // RBAC decides who reads logs: the namespace's default ServiceAccount may not.
    let as_default = format!("--as=system:serviceaccount:{ns}:default");
    let denied = node
        .kubectl(&[
            "get",
            "--raw",
            &format!("/apis/jobs.spur.dev/v1alpha1/namespaces/{ns}/jobs/keyed/log"),
            &as_default,
        ])
        .unwrap_err()
        .to_string();
    assert!(
        denied.contains("forbidden") || denied.contains("Forbidden"),
        "{denied}"
    );
}

fn ci_tmp(ns: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("spur-node-jobs-{ns}"));
    std::fs::create_dir_all(&d).unwrap();
    d
}
