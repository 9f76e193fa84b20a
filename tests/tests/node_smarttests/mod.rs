//! Automatic smart-test runs on the node (docs/smart-tests.md, "Automatic runs"): a SmartTest
//! covering `backend` runs, as a Job on a runner group of Spur's own image, against a sandbox
//! forking `backend` once it is Ready; the summary the real `spur test run` left in the runner
//! pod becomes the Sandbox's Tests condition (the fork's marker is a change the baseline's two
//! answers do not explain) and `spur sandbox get` shows it; changing the fork's image runs it again.
//! Then issue 48's acceptance: a HotROD-like shop, one test over its HTTP and gRPC endpoints and
//! three sandboxes of its catalog: unchanged (passes, the noise learned away), a lost JSON field
//! and a failing gRPC call (each found).

use std::time::Duration;

use anyhow::Context;
use serde_json::Value;
use spur_e2e::node::{Node, SPUR_IMAGE, demo_app_with, eventually};

const GROUP: &str = "smart-tests";
const TEST: &str = "backend-root";
const SANDBOX: &str = "backend-st";

fn tests_condition(node: &Node) -> Option<(String, String, String)> {
    let s = node.get_json("default", &["sandbox", SANDBOX]).ok()?;
    let c = s["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Tests")?
        .clone();
    let text = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
    Some((text("status"), text("reason"), text("message")))
}

/// The runs of the test against the sandbox, oldest first.
fn runs(node: &Node, ns: &str) -> Vec<Value> {
    let list = node
        .get_json(
            ns,
            &[
                "jobs.spur.dev",
                "-l",
                &format!("spur.dev/smarttest={TEST},spur.dev/sandbox={SANDBOX}"),
            ],
        )
        .unwrap_or(Value::Null);
    let mut items = list["items"].as_array().cloned().unwrap_or_default();
    items.sort_by_key(|j| {
        j["metadata"]["annotations"]["spur.dev/sandbox-generation"]
            .as_str()
            .and_then(|g| g.parse::<i64>().ok())
            .unwrap_or(0)
    });
    items
}

/// Waits until the run against sandbox generation `generation` ended and the condition reports
/// it (not Running); returns the condition.
fn ended(node: &Node, ns: &str, generation: i64) -> (String, String, String) {
    eventually(
        &format!("the run against generation {generation} ended and reported"),
        Duration::from_secs(300),
        || {
            let done = runs(node, ns).iter().any(|j| {
                j["metadata"]["annotations"]["spur.dev/sandbox-generation"]
                    == generation.to_string().as_str()
                    && ["Succeeded", "Failed"]
                        .contains(&j["status"]["phase"].as_str().unwrap_or(""))
            });
            Ok(done
                .then(|| tests_condition(node))
                .flatten()
                .filter(|(status, _, _)| status != "Unknown"))
        },
    )
    .with_context(|| {
        format!(
            "{}\n{}\nruns: {:#}",
            node.kubectl(&["get", "sandbox", SANDBOX, "-o", "yaml"])
                .unwrap_or_default(),
            node.describe(ns),
            Value::Array(runs(node, ns))
        )
    })
    .unwrap()
}

pub(crate) fn smart_tests_on_the_node(node: &Node, ns: &str) {
    node.apply(&format!(
        "apiVersion: spur.dev/v1alpha1\nkind: JobRunnerGroup\nmetadata:\n  name: {GROUP}\n  namespace: {ns}\nspec:\n  image: {SPUR_IMAGE}\n  replicas: 1\n  jobTimeout: 5m\n"
    ))
    .unwrap();
    // Created with the admin's credentials: the stamp records the user and the groups
    // (system:masters) the runs' access reviews ask with.
    node.apply(&format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: SmartTest
metadata:
  name: {TEST}
  namespace: {ns}
spec:
  services: [backend]
  runnerGroup: {GROUP}
  steps:
    - name: root
      http: {{url: "http://backend.{ns}.svc.cluster.local:8080/"}}
      checks: [{{status: 200}}]
"#
    ))
    .unwrap();
    let t = node.get_json(ns, &["smarttest", TEST]).unwrap();
    assert!(
        t["metadata"]["annotations"]["spur.dev/created-by-groups"]
            .as_str()
            .is_some_and(|g| g.contains("system:masters")),
        "{t:#}"
    );

    // The sandbox: its fork reports a marker the baseline does not.
    node.apply(&crate::sandbox(SANDBOX, ns, "backend", "st1", None))
        .unwrap();
    crate::sandbox_ready(node, SANDBOX);
    let (status, reason, message) = ended(node, ns, 1);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "Findings"),
        "{message}"
    );
    assert!(
        message.contains(&format!("{ns}/{TEST} (job ")) && message.contains("$.marker"),
        "{message}"
    );
    let first = runs(node, ns);
    assert_eq!(first.len(), 1, "one run per generation");
    let result = first[0]["status"]["result"].as_str().unwrap_or_default();
    let summary: Value = serde_json::from_str(result).unwrap_or(Value::Null);
    assert_eq!(summary["steps"], 1, "{result}");
    assert_eq!(summary["checksFailed"], 0, "{result}");
    // The CLI shows it.
    let shown = node_cli_get(node);
    assert!(
        shown.contains("Tests:       failed (Findings)") && shown.contains("$.marker"),
        "{shown}"
    );
    eprintln!("smart tests: the automatic run against generation 1 reported: {message}");

    // The fork's image changes (to the previous release's Spur image, which the node holds
    // for the upgrade test): run again, against the new generation.
    let image = crate::node_upgrade::Release::previous().image();
    let patched = crate::sandbox(SANDBOX, ns, "backend", "st2", None).replace(
        "      customizations:\n",
        &format!("      customizations:\n        images:\n          - image: {image}\n"),
    );
    assert!(patched.contains(&image), "{patched}");
    node.apply(&patched).unwrap();
    eventually(
        "the sandbox's generation 2 Ready",
        Duration::from_secs(180),
        || {
            let s = node.get_json("default", &["sandbox", SANDBOX])?;
            let ready = s["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            Ok((ready && s["status"]["observedGeneration"] == 2).then_some(()))
        },
    )
    .unwrap();
    let (_, reason, message) = ended(node, ns, 2);
    assert_eq!(reason, "Findings", "{message}");
    // Generation 2's run, not generation 1's again: the condition names its Job, whose result
    // (in the test's namespace: the cluster-scoped Sandbox carries no answered value) shows the
    // new marker of the fork.
    let second = runs(node, ns)
        .into_iter()
        .find(|j| j["metadata"]["annotations"]["spur.dev/sandbox-generation"] == "2")
        .expect("generation 2's run");
    let job = second["metadata"]["name"].as_str().unwrap_or_default();
    assert!(message.contains(&format!("(job {job})")), "{message}");
    assert!(
        !message.contains("\"st2\""),
        "a value on the Sandbox: {message}"
    );
    let result = second["status"]["result"].as_str().unwrap_or_default();
    assert!(result.contains("\\\"st2\\\""), "{result}");
    let fork = crate::fork_pod(node, ns, SANDBOX);
    let pod = node.get_json(ns, &["pod", &fork]).unwrap();
    assert!(
        pod["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["image"] == image.as_str()),
        "the fork runs {image}: {pod}"
    );
    let all = runs(node, ns);
    assert_eq!(all.len(), 2, "the first run is kept");
    assert_ne!(all[0]["metadata"]["name"], all[1]["metadata"]["name"]);
    eprintln!("smart tests: the fork changed, generation 2 ran again: {message}");

    node.kubectl(&[
        "delete",
        "sandbox",
        SANDBOX,
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
    node.kubectl(&["delete", "smarttest", TEST, "-n", ns])
        .unwrap();

    three_sandboxes_of_a_shop(node, ns);
    node.kubectl(&["delete", "jobrunnergroup", GROUP, "-n", ns])
        .unwrap();
}

/// A HotROD-like pair of services, a shop's frontend calling its catalog (HTTP, and gRPC
/// beside it), with answers that carry a fresh request id and time, as real services' do.
fn shop(ns: &str) -> String {
    let front = demo_app_with(
        ns,
        "shop-front",
        &[format!(
            "--call=http://shop-catalog.{ns}.svc.cluster.local:8080"
        )],
        &[],
    );
    let catalog = demo_app_with(
        ns,
        "shop-catalog",
        &["--grpc-listen=0.0.0.0:9090".to_owned()],
        &[],
    );
    format!("{front}---\n{catalog}")
}

/// The Tests condition of sandbox `name` once it no longer says a run is under way.
fn verdict_of(node: &Node, name: &str) -> (String, String, String) {
    eventually(
        &format!("the Tests condition of {name} with its run's outcome"),
        Duration::from_secs(300),
        || {
            let s = node.get_json("default", &["sandbox", name])?;
            let c = s["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "Tests")
                .cloned();
            let text = |c: &Value, k: &str| c[k].as_str().unwrap_or_default().to_owned();
            Ok(c.filter(|c| c["status"] != "Unknown")
                .map(|c| (text(&c, "status"), text(&c, "reason"), text(&c, "message"))))
        },
    )
    .with_context(|| {
        node.kubectl(&["get", "sandbox", name, "-o", "yaml"])
            .unwrap_or_default()
    })
    .unwrap()
}

/// Issue 48's acceptance on the node: one SmartTest over two endpoints of a HotROD-like shop
/// (the frontend's catalog page over HTTP, which calls the catalog service, and the catalog's
/// gRPC `Price`), and three sandboxes of the catalog, each tested automatically when Ready: one
/// that changes nothing the test sees (its answers differ from the baseline's only in request
/// ids and times, which the baseline's two runs show to be noise: it passes), one whose build
/// lost the items' `price` (a schema finding, through the frontend), and one whose gRPC fails
/// (a status finding and a failed check). The gRPC step's types come from the catalog's server
/// reflection. A script step (curl in the runner pod, as a k6 script would be) fetches the same
/// page, sending the key only on the sandbox's run: its output shows the lost field too.
fn three_sandboxes_of_a_shop(node: &Node, ns: &str) {
    node.apply(&shop(ns)).unwrap();
    node.rollout(ns, "shop-catalog").unwrap();
    node.rollout(ns, "shop-front").unwrap();
    // The gRPC step learns Price's types from the catalog's server reflection (at the
    // baseline): its request is JSON and a JSON path reads its answer.
    node.apply(&format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: SmartTest
metadata:
  name: shop
  namespace: {ns}
spec:
  services: [shop-catalog]
  runnerGroup: {GROUP}
  calls: true
  steps:
    - name: catalog-page
      http: {{url: "http://shop-front.{ns}.svc.cluster.local:8080/catalog"}}
      checks: [{{status: 200}}]
    - name: price-a1
      grpc:
        target: shop-catalog.{ns}.svc.cluster.local:9090
        method: spur.demo.v1.Demo/Price
        reflection: true
        json: {{sku: A1}}
      checks: [{{grpcStatus: 0}}, {{jsonPath: {{path: $.priceCents, equals: "300"}}}}]
    - name: catalog-script
      script:
        command: [sh, -c, 'curl -sS --max-time 10 ${{SPUR_BAGGAGE:+-H "baggage: $SPUR_BAGGAGE"}} http://shop-front.{ns}.svc.cluster.local:8080/catalog']
      checks: [{{status: 0}}]
"#
    ))
    .unwrap();
    let sandboxes = [
        ("shop-same", ("SPUR_APP_MARKER", "same")),
        ("shop-no-price", ("SPUR_APP_DROP_FIELD", "price")),
        ("shop-grpc-down", ("SPUR_APP_GRPC_UNAVAILABLE", "true")),
    ];
    for (name, env) in sandboxes {
        node.apply(&crate::sandbox_with_env(
            name,
            ns,
            "shop-catalog",
            env,
            None,
        ))
        .unwrap();
    }
    let verdicts: Vec<(String, String, String)> = sandboxes
        .iter()
        .map(|(name, _)| {
            crate::sandbox_ready(node, name);
            verdict_of(node, name)
        })
        .collect();
    for ((name, _), (status, reason, message)) in sandboxes.iter().zip(&verdicts) {
        eprintln!("smart tests, the shop: {name}: {status} {reason}: {message}");
    }

    let (status, reason, message) = &verdicts[0];
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "Passed"),
        "ids and times the baseline varies are noise, nothing else changed: {message}"
    );
    let (status, reason, message) = &verdicts[1];
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "Findings"),
        "{message}"
    );
    assert!(
        message.contains("[schema]") && message.contains("/catalog: $.catalog.items[*].price"),
        "the lost field, seen by the HTTP step through the frontend: {message}"
    );
    assert!(
        message.contains("SCRIPT catalog-script: $.catalog.items[*].price"),
        "the lost field, in the script's output: {message}"
    );
    assert!(
        !message.contains("requestId") && !message.contains("servedAt"),
        "noise reported: {message}"
    );
    let (status, _, message) = &verdicts[2];
    assert_eq!(status, "False", "{message}");
    assert!(
        message.contains("[status]") && message.contains("Price"),
        "the failing gRPC call: {message}"
    );
    // `calls: true`: each run compared its downstream calls, through a capture the operator
    // started for the test's creator: the frontend's call to the catalog, the catalog's own
    // requests, each marked by the run.
    for (name, _) in sandboxes {
        let jobs = node
            .get_json(
                ns,
                &[
                    "jobs.spur.dev",
                    "-l",
                    &format!("spur.dev/smarttest=shop,spur.dev/sandbox={name}"),
                ],
            )
            .unwrap();
        let job = &jobs["items"][0];
        assert!(
            job["metadata"]["annotations"]["spur.dev/run-capture"].is_string(),
            "{name}: no run capture on its Job: {job}"
        );
        let summary: Value =
            serde_json::from_str(job["status"]["result"].as_str().unwrap_or("{}")).unwrap();
        let captured = summary["calls"]["captured"].as_u64().unwrap_or(0);
        eprintln!("smart tests, the shop: {name}: calls {}", summary["calls"]);
        assert!(captured > 0, "{name}: no call captured: {summary}");
    }

    for (name, _) in sandboxes {
        node.kubectl(&["delete", "sandbox", name, "--wait=true", "--timeout=120s"])
            .unwrap();
    }
    node.kubectl(&["delete", "smarttest", "shop", "-n", ns])
        .unwrap();
    node.kubectl(&[
        "-n",
        ns,
        "delete",
        "deployment/shop-front",
        "deployment/shop-catalog",
        "service/shop-front",
        "service/shop-catalog",
    ])
    .unwrap();
}

/// `spur sandbox get` with the admin's credentials.
fn node_cli_get(node: &Node) -> String {
    let out = std::process::Command::new("timeout")
        .args(["-s", "KILL", "60"])
        .arg(spur_e2e::node::spur_bin("spur"))
        .args(["sandbox", "get", SANDBOX])
        .env("SPUR_KUBECONFIG", &node.kubeconfig)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}
