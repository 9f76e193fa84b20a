//! The chart's hub with two replicas on PostgreSQL (docs/hub.md, "Several replicas"; issue 47,
//! point 2). PostgreSQL runs in the node's network namespace on the node's address, where its
//! pods reach it, over TLS with a certificate for that address. The chart's agent dials the
//! headless Service `spur-hub-replicas` and keeps a session with each replica.
//!
//! - A cluster, a user and an API key are made by `kubectl exec` on different replicas.
//! - A preview of a Sandbox endpoint, sent to each replica's own address, is answered by the
//!   fork pod.
//! - One replica's pod is deleted while previews go to the other, one after another: none fails.
//!   The replacement pod, with a new address, serves previews once the agent has found it.
//! - A key revoked through one replica is refused by the other.
//! - A user scoped to another cluster gets nothing through either replica.
//! - The cluster revoked through one replica is reached through neither.
//!
//! The install is then upgraded back to its own values (no hub, no agent).

use std::process::Command;
use std::time::{Duration, Instant};

use spur_e2e::node::{Answer, Node, SPUR_NAMESPACE, eventually};
use spur_kube_harness::postgres::{PASSWORD, Postgres, ServerTls};

const HOST: &str = "shop--hub-ha.preview.test";

/// A CA and a serving certificate for PostgreSQL on `ip`.
fn certificate(ip: &str) -> (String, ServerTls) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let cert = rcgen::CertificateParams::new(vec![ip.to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    (
        ca_cert.pem(),
        ServerTls {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        },
    )
}

/// The hub pods that run and are Ready: (name, IP, uid).
fn hub_pods(node: &Node) -> Vec<(String, String, String)> {
    let pods = node
        .get_json(
            SPUR_NAMESPACE,
            &["pods", "-l", "app.kubernetes.io/name=spur-hub"],
        )
        .unwrap_or_default();
    pods["items"]
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
            Some((
                p["metadata"]["name"].as_str()?.to_owned(),
                p["status"]["podIP"].as_str()?.to_owned(),
                p["metadata"]["uid"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// A preview request to the hub pod at `ip`, from the node's network namespace.
fn preview(node: &Node, ca: &std::path::Path, ip: &str, key: &str) -> Answer {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &node.netns,
            "curl",
            "-sS",
            "--max-time",
            "10",
            "--cacert",
        ])
        .arg(ca)
        .args([
            "--resolve",
            &format!("{HOST}:8444:{ip}"),
            "-w",
            "\n%{http_code}",
        ])
        .args(["-H", &format!("x-spur-api-key: {key}")])
        .arg(format!("https://{HOST}:8444/"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
    let status = code.trim().parse().unwrap_or(0);
    Answer {
        status,
        json: serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
        // No answer: what curl said instead.
        body: if status == 0 {
            stderr.trim().to_owned()
        } else {
            body.to_owned()
        },
    }
}

/// What went wrong, for a failure's message: the pods, the hubs' and agents' last lines, and,
/// in the target's namespace `ns`, who answers a keyed request sent from inside it, and what
/// each sidecar holds and logged.
fn diagnose(node: &Node, ns: &str, key: &str) -> String {
    let mut out = node.describe(SPUR_NAMESPACE);
    for app in ["spur-hub", "spur-agent", "spur-routeserver"] {
        let selector = format!("app.kubernetes.io/name={app}");
        let logs = node
            .kubectl(&[
                "-n",
                SPUR_NAMESPACE,
                "logs",
                "-l",
                &selector,
                "--prefix",
                "--tail=40",
            ])
            .unwrap_or_else(|e| format!("{e:#}"));
        out.push_str(&format!("\nlogs of {app}:\n{logs}"));
    }
    if let Ok(client) = node.client_pod(ns) {
        let baggage = format!("sd-routing-key={key}");
        let a = node.curl(
            ns,
            &client,
            &format!("http://frontend.{ns}.svc:8080/"),
            &[("baggage", baggage.as_str())],
        );
        out.push_str(&format!("\nfrontend with the key, from {ns}: {a:?}\n"));
    }
    for pod in node
        .pods(ns, "spur.dev/sandbox notin (x)")
        .unwrap_or_default()
    {
        let container = node
            .get_json(ns, &["pod", &pod])
            .ok()
            .and_then(|p| {
                p["spec"]["containers"][0]["name"]
                    .as_str()
                    .map(String::from)
            })
            .unwrap_or_default();
        let dump = node
            .in_pod_netns(
                ns,
                &pod,
                &container,
                &[
                    "curl",
                    "-sS",
                    "--max-time",
                    "5",
                    "http://127.0.0.1:15020/config_dump",
                ],
            )
            .unwrap_or_else(|e| format!("{e:#}"));
        let dump: String = dump.chars().take(4000).collect();
        out.push_str(&format!("\nconfig_dump of {ns}/{pod}:\n{dump}\n"));
        let log = node
            .kubectl(&["-n", ns, "logs", &pod, "-c", "spur-sidecar", "--tail=40"])
            .unwrap_or_else(|e| format!("{e:#}"));
        out.push_str(&format!("sidecar log of {ns}/{pod}:\n{log}\n"));
    }
    out
}

pub(crate) fn two_replicas_on_postgres(node: &Node, ns: &str, upgrade: impl Fn(&[&str])) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (db_ca, tls) = certificate(&node.ip);
    let pg = rt.block_on(Postgres::start_in(&node.netns, &node.ip, Some(tls)));
    rt.block_on(async {
        pg.admin()
            .await
            .batch_execute("CREATE DATABASE spur_hub")
            .await
            .unwrap()
    });
    let dir = tempfile::tempdir().unwrap();
    let db_ca_file = dir.path().join("db-ca.pem");
    std::fs::write(&db_ca_file, db_ca).unwrap();
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "create",
        "secret",
        "generic",
        "spur-hub-db",
        &format!("--from-literal=password={PASSWORD}"),
    ])
    .unwrap();
    let url = format!(
        "hub.database.url=postgres://postgres@{}:{}/spur_hub",
        node.ip, pg.port
    );
    let db_ca_arg = format!("hub.database.ca={}", db_ca_file.display());
    let hub_values = [
        "--set",
        "hub.enabled=true",
        "--set",
        "hub.previewDomain=preview.test",
        "--set",
        "hub.serviceType=ClusterIP",
        "--set",
        "hub.replicas=2",
        "--set",
        &url,
        "--set",
        "hub.database.passwordSecret=spur-hub-db",
        "--set-file",
        &db_ca_arg,
        "--set",
        "hub.names[0]=spur-hub-replicas.spur-system.svc",
    ];
    let started = Instant::now();
    upgrade(&hub_values);
    let pods = hub_pods(node);
    assert_eq!(pods.len(), 2, "{pods:?}\n{}", node.describe(SPUR_NAMESPACE));
    eprintln!(
        "hub HA: two hub replicas on PostgreSQL ready after {:.1?}",
        started.elapsed()
    );
    let exec = |pod: &str, args: &[&str]| -> String {
        let mut all = vec!["-n", SPUR_NAMESPACE, "exec", pod, "--", "spur-hub"];
        all.extend_from_slice(args);
        node.kubectl(&all)
            .unwrap_or_else(|e| panic!("spur-hub {args:?} on {pod}: {e:#}"))
    };
    // The registry is one: what one replica's CLI writes, the other serves.
    let token = exec("spur-hub-0", &["cluster", "add", "ha"]);
    exec(
        "spur-hub-1",
        &[
            "user",
            "add",
            "ha-dev",
            "--cluster",
            "*",
            "--all-namespaces",
            "--kube-group",
            "system:masters",
        ],
    );
    let key = exec("spur-hub-1", &["apikey", "add", "ha-dev"])
        .trim()
        .to_owned();
    let hub_ca = dir.path().join("hub-ca.pem");
    std::fs::write(&hub_ca, exec("spur-hub-0", &["ca"])).unwrap();
    assert_eq!(
        std::fs::read_to_string(&hub_ca).unwrap(),
        exec("spur-hub-1", &["ca"]),
        "the replicas have two CAs"
    );
    node.apply(&format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: spur-agent-token, namespace: {SPUR_NAMESPACE}}}\nstringData: {{token: {}}}\n",
        token.trim()
    ))
    .unwrap();
    let hub_ca_arg = format!("agent.hubCA={}", hub_ca.display());
    let mut with_agent = hub_values.to_vec();
    with_agent.extend_from_slice(&[
        "--set",
        "agent.enabled=true",
        "--set",
        "agent.hub=spur-hub-replicas.spur-system.svc:8443",
        "--set-file",
        &hub_ca_arg,
        "--set",
        "agent.previewDomain=preview.test",
    ]);
    upgrade(&with_agent);

    node.apply(&format!(
        "{}  defaultRouteGroup:\n    endpoints:\n      - {{name: shop, target: \"http://frontend.{ns}.svc:8080\"}}\n",
        crate::sandbox("hub-ha", ns, "backend", "hub-ha", None)
    ))
    .unwrap();
    let routing_key = crate::sandbox_ready(node, "hub-ha");
    let fork = crate::fork_pod(node, ns, "hub-ha");
    let answered = |a: &Answer| a.status == 200 && a.answered_by() == Some(fork.as_str());
    // Each replica, asked at its own address, reaches the cluster through its own session.
    for (pod, ip, _) in &pods {
        eventually(
            &format!("a preview through hub replica {pod}"),
            Duration::from_secs(90),
            || {
                let a = preview(node, &hub_ca, ip, &key);
                if answered(&a) {
                    Ok(Some(()))
                } else {
                    Err(anyhow::anyhow!("{} {}", a.status, a.body))
                }
            },
        )
        .unwrap_or_else(|e| panic!("{e:#}\n{}", diagnose(node, ns, &routing_key)));
    }

    // Replica 0 is deleted while previews go to replica 1: none fails.
    let (gone_pod, _, gone_uid) = pods[0].clone();
    let survivor_ip = pods[1].1.clone();
    let start = Instant::now();
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "delete",
        "pod",
        &gone_pod,
        "--wait=false",
    ])
    .unwrap();
    let (mut sent, mut failed) = (0, Vec::new());
    let mut back: Option<(Duration, String)> = None;
    // Bounded: until the replacement is Ready, and at most 180 s.
    while start.elapsed() < Duration::from_secs(180) {
        let a = preview(node, &hub_ca, &survivor_ip, &key);
        sent += 1;
        if !answered(&a) {
            failed.push(format!(
                "{:.1} s: {} {}",
                start.elapsed().as_secs_f64(),
                a.status,
                a.body
            ));
        }
        // The replacement: a pod of the same name, another uid (its address may be the same).
        if sent % 5 == 0
            && let Some((_, ip, _)) = hub_pods(node)
                .into_iter()
                .find(|(name, _, uid)| *name == gone_pod && *uid != gone_uid)
        {
            back = Some((start.elapsed(), ip));
            break;
        }
    }
    let (ready_after, new_ip) = back.unwrap_or_else(|| {
        panic!(
            "hub pod {gone_pod} not back within 180 s\n{}",
            node.describe(SPUR_NAMESPACE)
        )
    });
    // The agent finds the replacement by resolving the headless Service again (every 5 s).
    let reached = eventually(
        "a preview through the replacement hub pod",
        Duration::from_secs(90),
        || {
            let a = preview(node, &hub_ca, &new_ip, &key);
            if answered(&a) {
                Ok(Some(start.elapsed()))
            } else {
                Err(anyhow::anyhow!("{} {}", a.status, a.body))
            }
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", diagnose(node, ns, &routing_key)));
    eprintln!(
        "hub HA: replica {gone_pod} deleted under preview load: {sent} previews through the \
         other replica, {} failed; replacement Ready after {:.1?}, serving previews after {:.1?}",
        failed.len(),
        ready_after,
        reached
    );
    assert!(sent >= 5, "too few previews while {gone_pod} went");
    assert!(
        failed.is_empty(),
        "previews failed while hub replica {gone_pod} went: {failed:#?}"
    );

    // Another cluster's user: nothing through either replica.
    exec(
        "spur-hub-0",
        &[
            "user",
            "add",
            "outsider",
            "--cluster",
            "elsewhere",
            "--all-namespaces",
        ],
    );
    let outsider = exec("spur-hub-0", &["apikey", "add", "outsider"])
        .trim()
        .to_owned();
    for ip in [&survivor_ip, &new_ip] {
        let a = preview(node, &hub_ca, ip, &outsider);
        assert!(
            a.status != 200 && !a.body.contains(&fork),
            "a user of another cluster reached the sandbox through {ip}: {a:?}"
        );
    }
    // A key revoked through one replica is refused by the other (a checked credential is
    // trusted for 2 s).
    exec("spur-hub-0", &["apikey", "revoke", "ha-dev"]);
    eventually(
        "the revoked key refused by the other replica",
        Duration::from_secs(30),
        || Ok((preview(node, &hub_ca, &survivor_ip, &key).status == 401).then_some(())),
    )
    .unwrap();

    // The cluster is revoked through replica 1: neither replica reaches it any more (the agent
    // is refused by both; a fresh key does not help).
    exec(
        "spur-hub-1",
        &[
            "user",
            "add",
            "ha-ops",
            "--cluster",
            "*",
            "--all-namespaces",
            "--kube-group",
            "system:masters",
        ],
    );
    let fresh = exec("spur-hub-1", &["apikey", "add", "ha-ops"])
        .trim()
        .to_owned();
    assert!(answered(&preview(node, &hub_ca, &new_ip, &fresh)));
    exec("spur-hub-1", &["cluster", "revoke", "ha"]);
    for ip in [&survivor_ip, &new_ip] {
        eventually(
            &format!("the revoked cluster unreachable through {ip}"),
            Duration::from_secs(30),
            || {
                let a = preview(node, &hub_ca, ip, &fresh);
                Ok((a.status != 200 && !a.body.contains(&fork)).then_some(()))
            },
        )
        .unwrap();
    }

    node.kubectl(&[
        "delete",
        "sandbox",
        "hub-ha",
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
    upgrade(&[]);
    for secret in ["spur-agent-token", "spur-hub-db"] {
        node.kubectl(&["-n", SPUR_NAMESPACE, "delete", "secret", secret])
            .unwrap();
    }
    drop(pg);
}
