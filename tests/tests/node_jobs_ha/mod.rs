//! Two replicas of the jobs component with its store in S3 (docs/jobs.md, "Two replicas"; issue
//! 47, point 2), on SeaweedFS started in the node's network namespace, where its pods reach it.
//! A job prints a numbered line a second. The replica that does not lead, asked directly (as the
//! API server's front proxy asks it), serves the running attempt's log, read from its runner,
//! while the job still runs. Then the leader's pod is deleted mid-job: the other replica, asked
//! every half second meanwhile, answers every time with a prefix of the output; it or the deleted
//! pod's replacement (whichever reads the released lease first) takes the lease and the running
//! attempt over; the job succeeds in its one attempt, its sealed log holds every line once, and
//! both replicas (the replacement too) serve that log and the job's artifact from the bucket.
//! Twice, deleting whichever replica leads; the rounds print which replica took over.

use std::process::Command;
use std::time::{Duration, Instant};

use spur_e2e::node::{Node, SPUR_NAMESPACE, eventually};
use spur_e2e::s3::{ACCESS_KEY, S3Server, SECRET_KEY};

const BUCKET: &str = "spur-jobs-ha";
const LINES: usize = 30;

/// The job's whole output.
fn output() -> String {
    (1..=LINES).map(|i| format!("line {i}\n")).collect()
}

/// A jobs pod: its name, its IP and its identity in the leader Lease (`<name>_<uid>`: a
/// replacement pod has the name of the one it replaces, not its identity).
struct JobsPod {
    name: String,
    ip: String,
    identity: String,
}

/// The jobs pods, once `n` of them run and are Ready.
fn jobs_pods(node: &Node, n: usize) -> Vec<JobsPod> {
    eventually(
        &format!("{n} ready jobs pods"),
        Duration::from_secs(180),
        || {
            let pods = node.get_json(
                SPUR_NAMESPACE,
                &["pods", "-l", "app.kubernetes.io/name=spur-jobs"],
            )?;
            let ready: Vec<JobsPod> = pods["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
                .filter(|p| {
                    p["status"]["conditions"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
                .filter_map(|p| {
                    let name = p["metadata"]["name"].as_str()?.to_owned();
                    let uid = p["metadata"]["uid"].as_str()?;
                    Some(JobsPod {
                        identity: format!("{name}_{uid}"),
                        ip: p["status"]["podIP"].as_str()?.to_owned(),
                        name,
                    })
                })
                .collect();
            Ok((ready.len() == n).then_some(ready))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(SPUR_NAMESPACE)))
}

/// For a failure's message: the last lines above debug level that each jobs replica (and a
/// replaced one, if any) logged (the node runs every component at debug level, whose last lines
/// are the lease's renewals), and the runner pods' executor logs of `ns`.
fn jobs_logs(node: &Node, ns: &str) -> String {
    let mut out = String::new();
    let pods = |ns: &str, selector: &str| {
        node.kubectl(&["-n", ns, "get", "pods", "-l", selector, "-o", "name"])
            .unwrap_or_default()
    };
    for pod in pods(SPUR_NAMESPACE, "app.kubernetes.io/name=spur-jobs").lines() {
        let logs = node
            .kubectl(&["-n", SPUR_NAMESPACE, "logs", pod])
            .unwrap_or_else(|e| format!("(no logs: {e})"));
        let kept: Vec<&str> = logs
            .lines()
            .filter(|l| {
                [" INFO ", " WARN ", " ERROR "]
                    .iter()
                    .any(|x| l.contains(x))
            })
            .collect();
        let from = kept.len().saturating_sub(60);
        out.push_str(&format!("--- {pod}\n{}\n", kept[from..].join("\n")));
    }
    for pod in pods(ns, "spur.dev/runner-group").lines() {
        let logs = node
            .kubectl(&["-n", ns, "logs", pod, "--all-containers", "--tail", "40"])
            .unwrap_or_else(|e| format!("(no logs: {e})"));
        out.push_str(&format!("--- {ns}/{pod}\n{logs}\n"));
    }
    out
}

/// The identity holding the jobs Lease (`<pod>_<pod uid>`).
fn leader(node: &Node) -> Option<String> {
    let l = node
        .get_json(SPUR_NAMESPACE, &["lease", "spur-jobs"])
        .ok()?;
    l["spec"]["holderIdentity"].as_str().map(str::to_owned)
}

/// Asks one replica directly, as the API server's front proxy does: its client certificate
/// (the node's), the user in `X-Remote-User`, the jobs CA for the replica's serving certificate.
/// The status and the body.
struct Direct {
    netns: String,
    ca: tempfile::NamedTempFile,
    cert: String,
    key: String,
}

impl Direct {
    fn new(node: &Node) -> Self {
        let ca = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            ca.path(),
            crate::secret_text(node, "spur-jobs-ca", "ca.crt"),
        )
        .unwrap();
        let pki = node.root.join("pki");
        Direct {
            netns: node.netns.clone(),
            ca,
            cert: pki.join("front-proxy-client.crt").display().to_string(),
            key: pki.join("front-proxy-client.key").display().to_string(),
        }
    }

    fn get(&self, ip: &str, path: &str) -> (u16, String) {
        let host = format!("spur-jobs.{SPUR_NAMESPACE}.svc");
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.netns,
                "curl",
                "-sS",
                "--max-time",
                "10",
            ])
            .args(["-w", "\n%{http_code}", "--cacert"])
            .arg(self.ca.path())
            .args(["--cert", &self.cert, "--key", &self.key])
            .args(["-H", "X-Remote-User: jobs-ha-test", "--noproxy", "*"])
            .args(["--connect-to", &format!("{host}:8443:{ip}:8443")])
            .arg(format!("https://{host}:8443{path}"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", ""));
        let code = code.trim().parse().unwrap_or_else(|_| {
            panic!(
                "curl to {ip}{path}: {}{}",
                text,
                String::from_utf8_lossy(&out.stderr)
            )
        });
        (code, body.to_owned())
    }
}

/// The volume of the second replica's claim: the node has no provisioner, and the volume of its
/// default StorageClass is the first replica's (node_quickstart::a_volume).
const PV: &str = "spur-node-pv-1";

/// How many times a leader is deleted mid-job: the first leader, then the replica that took over
/// from it (which led only since the takeover), with the first one's replacement as standby.
const ROUNDS: u32 = 2;

pub(crate) fn two_replicas_on_s3(node: &Node, upgrade: impl Fn(&[&str])) {
    crate::node_quickstart::a_volume(node, "pv-1");
    let s3 = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(S3Server::start_in(&node.netns, &node.ip))
        .unwrap();
    s3.create_bucket(BUCKET).unwrap();
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "create",
        "secret",
        "generic",
        "jobs-s3",
        &format!("--from-literal=AWS_ACCESS_KEY_ID={ACCESS_KEY}"),
        &format!("--from-literal=AWS_SECRET_ACCESS_KEY={SECRET_KEY}"),
    ])
    .unwrap();
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "create",
        "configmap",
        "jobs-s3-ca",
        &format!("--from-file=ca.crt={}", s3.ca_file.display()),
    ])
    .unwrap();
    let endpoint = format!("jobs.s3.endpoint={}", s3.endpoint);
    upgrade(&[
        "--set",
        "jobs.replicas=2",
        "--set",
        &format!("jobs.s3.bucket={BUCKET}"),
        "--set",
        &endpoint,
        "--set",
        "jobs.s3.credentialsSecret=jobs-s3",
        "--set",
        "jobs.s3.caConfigMap=jobs-s3-ca",
    ]);
    let direct = Direct::new(node);
    let ci = node
        .namespace("jobs-ha", &[("spur.dev/enabled", "true")])
        .unwrap();
    let ns = ci.name.as_str();
    node.apply(&format!(
        "apiVersion: spur.dev/v1alpha1\nkind: JobRunnerGroup\nmetadata:\n  name: ha\n  namespace: {ns}\nspec:\n  image: localhost/spur-test-client:dev\n  replicas: 1\n  jobTimeout: 5m\n"
    ))
    .unwrap();
    for round in 1..=ROUNDS {
        leader_deleted_mid_job(node, &direct, ns, round);
    }

    // Back to the defaults (one replica, the volume); what this step made goes.
    drop(ci);
    upgrade(&[]);
    jobs_pods(node, 1);
    for what in [
        "secret/jobs-s3",
        "configmap/jobs-s3-ca",
        "pvc/data-spur-jobs-1",
    ] {
        node.kubectl(&["-n", SPUR_NAMESPACE, "delete", what, "--wait=false"])
            .unwrap();
    }
    node.kubectl(&["delete", "pv", PV, "--wait=false"]).unwrap();
    drop(s3);
}

/// One round: a job runs, the standby serves its log, the leader's pod is deleted mid-job, a
/// replica other than the deleted one takes the attempt over and the job succeeds in its one attempt.
fn leader_deleted_mid_job(node: &Node, direct: &Direct, ns: &str, round: u32) {
    let job_name = format!("through-failover-{round}");
    let pods = jobs_pods(node, 2);
    // One of these two pods (not a replaced pod of the same name whose lease has not expired).
    let lead_id = eventually("a jobs leader", Duration::from_secs(60), || {
        Ok(leader(node).filter(|l| pods.iter().any(|p| p.identity == *l)))
    })
    .unwrap();
    let lead = pods
        .iter()
        .find(|p| p.identity == lead_id)
        .map(|p| p.name.clone())
        .unwrap();
    let (standby_ip, standby_id) = pods
        .iter()
        .find(|p| p.identity != lead_id)
        .map(|p| (p.ip.clone(), p.identity.clone()))
        .unwrap();
    node.apply(&format!(
        "apiVersion: spur.dev/v1alpha1\nkind: Job\nmetadata:\n  name: {job_name}\n  namespace: {ns}\nspec:\n  runnerGroup: ha\n  artifacts:\n  - path: /tmp/count.txt\n  script: |\n    for i in $(seq 1 {LINES}); do echo \"line $i\"; sleep 1; done\n    echo {LINES} > /tmp/count.txt\n"
    ))
    .unwrap();
    let job = || node.get_json(ns, &["jobs.spur.dev", &job_name]);
    let log_path = format!("/apis/jobs.spur.dev/v1alpha1/namespaces/{ns}/jobs/{job_name}/log");
    let whole = output();

    // The standby, asked directly while the job runs: the lines so far, from the runner.
    let seen = eventually(
        "the standby to serve the running attempt's first lines",
        Duration::from_secs(180),
        || {
            let (code, body) = direct.get(&standby_ip, &log_path);
            assert!(
                code < 500 && code != 401 && code != 403,
                "the standby answered {code}: {body}"
            );
            Ok((code == 200 && body.lines().count() >= 3).then_some(body))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));
    assert!(
        whole.starts_with(&seen),
        "the standby served what the job did not print: {seen:?}"
    );
    let j = job().unwrap();
    assert_eq!(
        j["status"]["phase"], "Running",
        "the job ended before the standby's read could show it reads the runner: {j}"
    );
    println!(
        "jobs HA, round {round}: the standby {standby_ip} served {} lines of the running attempt",
        seen.lines().count()
    );

    // The leader's pod deleted mid-job; the standby, asked meanwhile, answers every time.
    let deleted_at = Instant::now();
    node.kubectl(&["-n", SPUR_NAMESPACE, "delete", "pod", &lead, "--wait=false"])
        .unwrap();
    eprintln!("jobs HA, round {round}: deleted the leader {lead} while job {job_name} runs");
    let mut reads = 0u32;
    let mut most = seen.lines().count();
    let mut took_lease = None;
    let end = Instant::now() + Duration::from_secs(120);
    let finished = loop {
        assert!(
            Instant::now() < end,
            "the job did not end in 2 minutes after the leader's deletion (deleted {lead}, lease \
             holder now {:?}, taken (after, by) {took_lease:?}; {reads} reads of the standby, at most \
             {most} lines): {}\n{}\n{}",
            leader(node),
            job()
                .map(|j| j.to_string())
                .unwrap_or_else(|e| e.to_string()),
            jobs_logs(node, ns),
            node.describe(ns)
        );
        let (code, body) = direct.get(&standby_ip, &log_path);
        reads += 1;
        assert_eq!(code, 200, "read {reads} of the surviving replica: {body}");
        // A prefix, not always a longer one: the replica that takes the attempt over serves it
        // from its own spool, which starts empty and catches up with the runner at once.
        assert!(whole.starts_with(&body), "read {reads}: {body:?}");
        most = most.max(body.lines().count());
        if took_lease.is_none()
            && let Some(l) = leader(node).filter(|l| *l != lead_id)
        {
            took_lease = Some((deleted_at.elapsed(), l));
        }
        let j = job().unwrap();
        if ["Succeeded", "Failed", "Canceled"]
            .contains(&j["status"]["phase"].as_str().unwrap_or(""))
        {
            break j;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let took = deleted_at.elapsed();
    assert_eq!(finished["status"]["phase"], "Succeeded", "{finished}");
    assert_eq!(
        finished["status"]["attemptCount"], 1,
        "the running attempt was not taken over but run again: {finished}"
    );
    let (took_lease, taker) = took_lease
        .or_else(|| leader(node).filter(|l| *l != lead_id).map(|l| (took, l)))
        .unwrap_or_else(|| panic!("the jobs Lease is still {lead}'s"));
    // Either may win: the standby reads the lease every 2.5 s, and the StatefulSet's replacement
    // of the deleted pod, up within about a second, takes a free lease on its first read.
    let taker = if taker == standby_id {
        "the standby"
    } else {
        "the deleted pod's replacement"
    };

    // Sealed, in the bucket: every replica serves the same log and artifact, the deleted one's
    // replacement too (its own volume never held them).
    let pods = jobs_pods(node, 2);
    let artifact = format!(
        "/apis/jobs.spur.dev/v1alpha1/namespaces/{ns}/jobs/{job_name}/artifacts?path=/tmp/count.txt"
    );
    for JobsPod { name: pod, ip, .. } in &pods {
        let (code, body) = direct.get(ip, &log_path);
        assert_eq!(
            (code, body.as_str()),
            (200, whole.as_str()),
            "{pod}'s sealed log"
        );
        let (code, body) = direct.get(ip, &artifact);
        assert_eq!(
            (code, body.trim()),
            (200, LINES.to_string().as_str()),
            "{pod}'s artifact"
        );
    }
    // Through the API server, as users read it.
    assert_eq!(node.kubectl(&["get", "--raw", &log_path]).unwrap(), whole);
    // One leader: the two replicas' leader series add up to one.
    let leaders: i64 = pods
        .iter()
        .map(|JobsPod { name: pod, .. }| {
            let m = node
                .kubectl(&[
                    "get",
                    "--raw",
                    &format!("/api/v1/namespaces/{SPUR_NAMESPACE}/pods/{pod}:9090/proxy/metrics"),
                ])
                .unwrap();
            m.lines()
                .find_map(|l| l.strip_prefix("spur_jobs_leader "))
                .and_then(|v| v.trim().parse::<i64>().ok())
                .unwrap_or_else(|| panic!("{pod} exports no spur_jobs_leader"))
        })
        .sum();
    assert_eq!(leaders, 1, "spur_jobs_leader over both replicas");
    println!(
        "jobs HA, round {round}: leader {lead} deleted mid-job; {taker} took the lease after \
         {:.1} s, the standby answered all {reads} log reads meanwhile (HTTP 200, a prefix of the output, up to \
         {most} lines before the end), and the job succeeded in 1 attempt {:.1} s after the \
         deletion; both replicas serve its sealed log and artifact from S3",
        took_lease.as_secs_f64(),
        took.as_secs_f64()
    );
}
