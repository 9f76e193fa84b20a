//! Signadot parity on the node (issue 45, docs/from-signadot.md): what a team moving from
//! Signadot keeps without changing its apps or specs.
//!
//! - `valueFrom.fork`: the web fork calls the api fork at the address Signadot's template
//!   `http://{{.Service.Host}}:{{.Service.Port}}` renders to, so a keyed request through web's
//!   baseline Service is answered by the api fork's pod (web's baseline calls nothing at all);
//! - the fork's pods get `SIGNADOT_ROUTING_KEY` (and the downward-API names) beside Spur's own;
//! - a fork's pods never overlap old and new code: while a changed fork rolls out (Recreate by
//!   default), no two pod templates of it exist at once;
//! - a RouteGroup's `ttl` (from when it matched no sandbox, Signadot's default) deletes it;
//! - Signadot's `sdroutes` and go-routesapi's watched cache in a pod read the sandbox's rules
//!   through the chart's `routeserver.compat` (`compat`);
//! - an Argo Rollout forks like a Deployment, and runs on a laptop as a local workload, under
//!   the real Argo controller (`rollouts`);
//! - a namespace's own carriers reach the fork through sidecars and previews (`carriers`, run
//!   by the hub step, which has a hub).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::Value;
use spur_e2e::node::{Node, demo_app, eventually};

use crate::{condition, sandbox_ready, until_answered_by};

pub(crate) mod carriers;
mod compat;
mod rollouts;

const SANDBOX: &str = "parity";
const LONELY_GROUP: &str = "parity-lonely";

fn sandbox(ns: &str, marker: &str) -> String {
    format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata:
  name: {SANDBOX}
spec:
  description: Signadot parity on the node
  forks:
    - forkOf: {{kind: Deployment, namespace: {ns}, name: web}}
      customizations:
        env:
          - name: SPUR_APP_CALL
            valueFrom:
              fork:
                forkOf: {{kind: Deployment, namespace: {ns}, name: api}}
                expression: "http://{{{{.Service.Host}}}}:{{{{ .Service.Port }}}}"
    - forkOf: {{kind: Deployment, namespace: {ns}, name: api}}
      customizations:
        env:
          - {{name: SPUR_APP_MARKER, value: {marker}}}
"#
    )
}

/// The running, ready fork pod of baseline `of` in `sandbox`.
fn fork_pod(node: &Node, ns: &str, sandbox: &str, of: &str) -> String {
    eventually(
        &format!("the fork pod of {of} in {sandbox}"),
        Duration::from_secs(180),
        || {
            let pods = node.pods(
                ns,
                &format!("spur.dev/sandbox={sandbox},spur.dev/fork-of={of}"),
            )?;
            Ok(match pods.as_slice() {
                [one] => {
                    let p: Value = node.get_json(ns, &["pod", one])?;
                    (condition(&p, "Ready") == Some("True")).then(|| one.clone())
                }
                _ => None,
            })
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)))
}

/// Deletes Sandbox `name` and waits until it (and with it its forks) is gone.
fn delete_sandbox(node: &Node, name: &str) {
    node.kubectl(&["delete", "sandbox", name, "--wait=true", "--timeout=120s"])
        .unwrap();
}

fn env_of(pod: &Value, name: &str) -> Option<String> {
    pod["spec"]["containers"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == "app")?["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)?["value"]
        .as_str()
        .map(String::from)
}

pub(crate) fn signadot_parity_on_the_node(node: &Node) {
    // The group first: its TTL runs while the rest of the step does.
    node.apply(&format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: RouteGroup
metadata:
  name: {LONELY_GROUP}
spec:
  match:
    label: {{key: team, value: nobody-has-this}}
  ttl: {{duration: 1m}}
"#
    ))
    .unwrap();
    let created = Instant::now();

    let ns_guard = node
        .namespace(
            "parity",
            &[
                ("sidecar.spur.dev/inject", "true"),
                ("spur.dev/enabled", "true"),
            ],
        )
        .unwrap();
    let ns = ns_guard.name.as_str();
    node.apply(&demo_app(ns, "web", None)).unwrap();
    node.apply(&demo_app(ns, "api", None)).unwrap();
    node.rollout(ns, "web").unwrap();
    node.rollout(ns, "api").unwrap();
    let client = node.client_pod(ns).unwrap();
    let web = format!("http://web.{ns}.svc.cluster.local:8080/");

    node.apply(&sandbox(ns, "v1")).unwrap();
    let key = sandbox_ready(node, SANDBOX);
    // `signadot sandbox list` is `kubectl get sandboxes`: the printer columns show the key and
    // readiness.
    let list = node.kubectl(&["get", "sandboxes"]).unwrap();
    let header: Vec<&str> = list
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(header, ["NAME", "KEY", "READY", "AGE"], "{list}");
    let row: Vec<&str> = list
        .lines()
        .find(|l| l.split_whitespace().next() == Some(SANDBOX))
        .unwrap_or_else(|| panic!("no {SANDBOX} in {list}"))
        .split_whitespace()
        .collect();
    assert_eq!(row[1..3], [key.as_str(), "True"], "{list}");
    let web_fork = fork_pod(node, ns, SANDBOX, "web");
    let api_fork = fork_pod(node, ns, SANDBOX, "api");

    // valueFrom.fork: the web fork's upstream is the api fork's sandbox Service.
    let web_pod = node.get_json(ns, &["pod", &web_fork]).unwrap();
    let fw = node
        .get_json(
            ns,
            &[
                "forkedworkloads",
                "-l",
                &format!("spur.dev/sandbox={SANDBOX}"),
            ],
        )
        .unwrap();
    let api_service = fw["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|fw| fw["spec"]["baseline"]["name"] == "api")
        .and_then(|fw| fw["status"]["services"][0]["sandboxService"].as_str())
        .map(String::from)
        .unwrap_or_else(|| panic!("the api fork's sandbox Service: {fw}"));
    assert_eq!(
        env_of(&web_pod, "SPUR_APP_CALL"),
        Some(format!("http://{api_service}.{ns}.svc:8080"))
    );
    let keyed = until_answered_by(node, ns, &client, &web, &key, &api_fork)
        .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));
    assert_eq!(
        keyed.json["pod"].as_str(),
        Some(web_fork.as_str()),
        "{keyed:?}"
    );
    assert_eq!(keyed.marker(), Some("v1"), "{keyed:?}");
    // The baseline web calls nothing: unkeyed requests end there.
    let unkeyed = node.curl(ns, &client, &web, &[]).unwrap();
    assert!(
        unkeyed.json["upstream"].is_null()
            && unkeyed.answered_by().is_some_and(|p| p.starts_with("web-")),
        "{unkeyed:?}"
    );

    // Signadot's names beside Spur's, in every fork container.
    let api_pod = node.get_json(ns, &["pod", &api_fork]).unwrap();
    for pod in [&web_pod, &api_pod] {
        for (name, want) in [
            ("SIGNADOT_ROUTING_KEY", key.as_str()),
            ("SIGNADOT_SANDBOX_ROUTING_KEY", key.as_str()),
            ("SIGNADOT_SANDBOX_NAME", SANDBOX),
            ("SPUR_ROUTING_KEY", key.as_str()),
        ] {
            assert_eq!(env_of(pod, name).as_deref(), Some(want), "{name}");
        }
    }

    let routes_api = compat::routes_api_in_a_pod(node, ns, &client, &key, &["api", "web"]);

    // A changed fork never runs two builds at once: from the change until the new pod is
    // ready, every look at the fork's pods finds one pod template at most.
    // The running pod's template first: the old pod may stop before the first look (the demo
    // app exits at once on SIGTERM), and the change must still show as two templates.
    let old_template = api_pod["metadata"]["labels"]["pod-template-hash"]
        .as_str()
        .map(String::from)
        .unwrap_or_else(|| panic!("no pod-template-hash on {api_fork}"));
    node.apply(&sandbox(ns, "v2")).unwrap();
    let selector = format!("spur.dev/sandbox={SANDBOX},spur.dev/fork-of=api");
    let mut looks = 0u32;
    let mut seen = BTreeSet::from([old_template]);
    let deadline = Instant::now() + Duration::from_secs(180);
    // A loop of its own, not `eventually`: an overlap must fail the test, not be retried, and
    // the looks follow each other without a pause.
    let new_pod = loop {
        assert!(
            Instant::now() < deadline,
            "the changed api fork's pod never became ready\n{}",
            node.describe(ns)
        );
        let Ok(list) = node.get_json(ns, &["pods", "-l", &selector]) else {
            continue;
        };
        looks += 1;
        let pods = list["items"].as_array().cloned().unwrap_or_default();
        // A pod that has stopped (the kubelet puts a deleted pod in a terminal phase before the
        // object goes) runs no code: Recreate waits for the old pods to stop, not to vanish.
        let templates: BTreeSet<String> = pods
            .iter()
            .filter(|p| !matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed")))
            .filter_map(|p| p["metadata"]["labels"]["pod-template-hash"].as_str())
            .map(String::from)
            .collect();
        assert!(
            templates.len() <= 1,
            "two builds of the fork at once: {list}"
        );
        seen.extend(templates);
        let ready = pods.iter().find_map(|p| {
            let ready = condition(p, "Ready") == Some("True");
            let name = p["metadata"]["name"].as_str()?;
            (ready && name != api_fork && env_of(p, "SPUR_APP_MARKER").as_deref() == Some("v2"))
                .then(|| name.to_string())
        });
        if let Some(pod) = ready {
            break pod;
        }
    };
    assert!(seen.len() >= 2, "the rollout was never seen: {seen:?}");
    eprintln!(
        "node parity: {looks} looks at the fork's pods during its rollout, one build each time"
    );
    let keyed = until_answered_by(node, ns, &client, &web, &key, &new_pod)
        .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));
    assert_eq!(keyed.marker(), Some("v2"), "{keyed:?}");

    delete_sandbox(node, SANDBOX);
    routes_api.sandbox_gone(node);

    // The lonely group: expiresAt a minute after it matched nothing, then gone.
    let group = node
        .kubectl(&[
            "get",
            "routegroup",
            LONELY_GROUP,
            "--ignore-not-found",
            "-o",
            "json",
        ])
        .unwrap();
    if !group.trim().is_empty() {
        let g: Value = serde_json::from_str(&group).unwrap();
        assert!(g["status"]["expiresAt"].is_string(), "{g}");
        assert!(g["status"]["unmatchedSince"].is_string(), "{g}");
    }
    let left = Duration::from_secs(150).saturating_sub(created.elapsed());
    eventually(
        "the lonely RouteGroup's TTL to delete it",
        left.max(Duration::from_secs(10)),
        || {
            Ok(node
                .is_gone(None, "routegroup", LONELY_GROUP)?
                .then_some(()))
        },
    )
    .unwrap();

    rollouts::rollouts_on_the_node(node);
}
