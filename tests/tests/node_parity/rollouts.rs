//! Argo Rollouts as baselines on the node, with the real Argo Rollouts controller (v1.10,
//! tests/argo) running on the host against the node's API server:
//!
//! - a canary Rollout paused at its first step (one stable pod, one canary pod, Argo's
//!   `stableService` and `canaryService` pointing at one each) is forked by a Sandbox;
//! - a keyed request through each of its three Services is answered by the fork's pod; unkeyed
//!   ones by the stable and canary pods as Argo routes them;
//! - a Sandbox's local workload of the Rollout: a keyed request through each of its Services
//!   reaches a laptop's process through the tunnel proxy, and the Rollout's pods once it is gone;
//! - while the sandboxes live and after they are gone, the Rollout's spec, ReplicaSets and
//!   Services are as Argo left them, and promoting it afterwards completes its canary.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use spur_e2e::node::{Background, Node, demo_app, eventually};

use super::{delete_sandbox, fork_pod};
use crate::node_local::{self, Workstation};
use crate::{condition, sandbox_ready, until_answered_by};

const SANDBOX: &str = "parity-rollout";
const LOCAL_SANDBOX: &str = "parity-rollout-local";

/// Installs Argo's CRDs (server-side: each is over the client-side annotation limit) and runs
/// its controller for namespace `ns` only, with the node's admin kubeconfig (a test harness tool,
/// not part of Spur). Killed when the returned process is dropped.
fn argo_controller(node: &Node, ns: &str, log: &std::path::Path) -> Background {
    let argo = spur_e2e::argo_dir();
    let crds = argo.join("argo-rollouts/crds");
    let mut files: Vec<_> = std::fs::read_dir(&crds)
        .unwrap_or_else(|e| panic!("{}: {e}", crds.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    files.sort();
    for f in &files {
        node.kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            f.to_str().unwrap(),
        ])
        .unwrap();
    }
    // (`kubectl wait` fails outright on a CRD whose status has no conditions yet.)
    eventually(
        "Argo's Rollout CRD to be established",
        Duration::from_secs(60),
        || {
            let crd = node.get_json("default", &["crd", "rollouts.argoproj.io"])?;
            Ok((condition(&crd, "Established") == Some("True")).then_some(()))
        },
    )
    .unwrap();
    // Its two HTTP servers bind 0.0.0.0 (no flag says otherwise): ports the kernel just had free.
    let port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string()
    };
    let (healthz, metrics) = (port(), port());
    let mut cmd = std::process::Command::new(argo.join("rollouts-controller"));
    cmd.env("POD_NAMESPACE", ns)
        .arg("--kubeconfig")
        .arg(&node.kubeconfig)
        .args(["--namespaced", "--namespace", ns, "--leader-elect=false"])
        .args(["--healthzPort", &healthz, "--metricsPort", &metrics])
        .args(["--ingress-api-version", "networking/v1"]);
    let controller = Background::spawn(cmd, log).unwrap();
    eventually(
        "the Argo Rollouts controller to start",
        Duration::from_secs(90),
        || {
            Ok(controller
                .output()
                .contains("Started controller")
                .then_some(()))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", controller.output()));
    controller
}

/// The demo app `shop` as a canary Rollout (two replicas; 50 % then a pause) with Argo's stable
/// and canary Services beside its own.
fn rollout(ns: &str) -> String {
    let app = demo_app(ns, "shop", None)
        .replacen(
            "apiVersion: apps/v1\nkind: Deployment",
            "apiVersion: argoproj.io/v1alpha1\nkind: Rollout",
            1,
        )
        .replacen(
            "spec:\n  replicas: 1\n",
            "spec:\n  replicas: 2\n  strategy:\n    canary:\n      stableService: shop-stable\n      canaryService: shop-canary\n      steps:\n        - setWeight: 50\n        - pause: {}\n",
            1,
        );
    assert!(
        app.contains("kind: Rollout") && app.contains("canary:"),
        "{app}"
    );
    let services: String = ["shop-stable", "shop-canary"]
        .iter()
        .map(|name| {
            format!(
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  selector: {{app: shop}}\n  ports:\n    - {{name: http, port: 8080, targetPort: http}}\n"
            )
        })
        .collect();
    format!("{app}{services}")
}

/// What Argo owns of the Rollout and Spur must leave alone: its spec's generation, its
/// ReplicaSets, and the selectors of its Services.
fn argo_state(node: &Node, ns: &str) -> (Value, Vec<String>, BTreeMap<String, Value>) {
    let r = node.get_json(ns, &["rollout", "shop"]).unwrap();
    let rs = node.get_json(ns, &["replicasets"]).unwrap();
    let mut sets: Vec<String> = rs["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|rs| rs["metadata"]["ownerReferences"][0]["kind"] == "Rollout")
        .filter_map(|rs| rs["metadata"]["name"].as_str().map(String::from))
        .collect();
    sets.sort();
    let selectors = ["shop", "shop-stable", "shop-canary"]
        .iter()
        .map(|s| {
            let svc = node.get_json(ns, &["service", s]).unwrap();
            (s.to_string(), svc["spec"]["selector"].clone())
        })
        .collect();
    (r["metadata"]["generation"].clone(), sets, selectors)
}

/// Waits until the Rollout is in `phase` at step `step` with `ready` ready replicas.
fn rollout_at(node: &Node, ns: &str, phase: &str, step: i64, ready: i64) {
    eventually(
        &format!("Rollout shop {phase} at step {step} with {ready} ready"),
        Duration::from_secs(180),
        || {
            let r = node.get_json(ns, &["rollout", "shop"])?;
            let st = &r["status"];
            Ok((st["phase"] == phase
                && st["currentStepIndex"].as_i64().unwrap_or(0) == step
                && st["readyReplicas"].as_i64() == Some(ready))
            .then_some(()))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));
}

/// A Sandbox's local workload standing in for the Rollout: keyed requests through each of its
/// three Services reach a laptop's process through the tunnel proxy; `spur local status` shows
/// it bound and `spur local disconnect` ends the session; once the Sandbox is gone, keyed
/// requests are the Rollout's own pods' again.
fn local_workload_of_the_rollout(node: &Node, ns: &str, client: &str) {
    let mut workstation = Workstation::connect(node, 2, "rollout-dev", "rollout-laptop", "laptop");
    let key = node_local::local_sandbox(node, LOCAL_SANDBOX, "rollout-dev", "Rollout", ns, "shop");
    let ew = node
        .get_json(
            ns,
            &[
                "externalworkloads",
                "-l",
                &format!("spur.dev/sandbox={LOCAL_SANDBOX}"),
            ],
        )
        .unwrap();
    assert_eq!(
        ew["items"][0]["spec"]["baseline"]["kind"], "Rollout",
        "the local workload stands in for the Rollout: {ew}"
    );
    for svc in ["shop", "shop-stable", "shop-canary"] {
        let url = format!("http://{svc}.{ns}.svc.cluster.local:8080/");
        let keyed = until_answered_by(node, ns, client, &url, &key, "rollout-laptop")
            .unwrap_or_else(|e| panic!("{svc}: {e:#}\n{}", workstation.logs(node)));
        assert_eq!(keyed.marker(), Some("laptop"), "{svc}: {keyed:?}");
        let unkeyed = node.curl(ns, client, &url, &[]).unwrap();
        assert!(
            unkeyed
                .answered_by()
                .is_some_and(|p| p.starts_with("shop-")),
            "{svc}: {unkeyed:?}"
        );
    }
    workstation.status_then_disconnect(node, LOCAL_SANDBOX, ns, "shop", &key);
    delete_sandbox(node, LOCAL_SANDBOX);
    for svc in ["shop", "shop-stable", "shop-canary"] {
        let url = format!("http://{svc}.{ns}.svc.cluster.local:8080/");
        eventually(
            &format!("a keyed request through {svc} back at the Rollout's pods"),
            Duration::from_secs(60),
            || {
                let a = node.curl(
                    ns,
                    client,
                    &url,
                    &[("baggage", &format!("sd-routing-key={key}"))],
                )?;
                Ok(a.answered_by()
                    .is_some_and(|p| p.starts_with("shop-"))
                    .then_some(()))
            },
        )
        .unwrap_or_else(|e| panic!("{e:#}\n{}", workstation.logs(node)));
    }
}

pub(crate) fn rollouts_on_the_node(node: &Node) {
    let started = std::time::Instant::now();
    let ns_guard = node
        .namespace(
            "parity-ro",
            &[
                ("sidecar.spur.dev/inject", "true"),
                ("spur.dev/enabled", "true"),
            ],
        )
        .unwrap();
    let ns = ns_guard.name.as_str();
    let dir = tempfile::tempdir().unwrap();
    let controller = argo_controller(node, ns, &dir.path().join("argo.log"));

    node.apply(&rollout(ns)).unwrap();
    rollout_at(node, ns, "Healthy", 2, 2);
    // The webhook injected the Rollout's pods as a Rollout's.
    let pods = node.get_json(ns, &["pods", "-l", "app=shop"]).unwrap();
    for p in pods["items"].as_array().into_iter().flatten() {
        assert_eq!(
            p["metadata"]["annotations"]["sidecar.spur.dev/baseline"],
            format!("ArgoRollout/{ns}/shop"),
            "{p}"
        );
    }
    // A canary: the new template on one pod of two, paused there.
    node.kubectl(&[
        "-n",
        ns,
        "patch",
        "rollout",
        "shop",
        "--type",
        "json",
        "-p",
        r#"[{"op": "add", "path": "/spec/template/spec/containers/0/env/-", "value": {"name": "SPUR_APP_MARKER", "value": "canary"}}]"#,
    ])
    .unwrap();
    rollout_at(node, ns, "Paused", 1, 2);
    let before = argo_state(node, ns);
    assert_eq!(
        before.1.len(),
        2,
        "stable and canary ReplicaSets: {before:?}"
    );

    node.apply(&format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata:
  name: {SANDBOX}
spec:
  description: an Argo Rollout forked
  forks:
    - forkOf: {{kind: Rollout, namespace: {ns}, name: shop}}
      customizations:
        env:
          - {{name: SPUR_APP_MARKER, value: fork}}
"#
    ))
    .unwrap();
    let key = sandbox_ready(node, SANDBOX);
    let fork_pod = fork_pod(node, ns, SANDBOX, "shop");
    let fork = node
        .get_json(
            ns,
            &["deployments", "-l", &format!("spur.dev/sandbox={SANDBOX}")],
        )
        .unwrap();
    assert_eq!(
        fork["items"][0]["metadata"]["annotations"]["spur.dev/baseline"],
        format!("Rollout/{ns}/shop"),
        "the fork is a Deployment of the Rollout: {fork}"
    );

    let client = node.client_pod(ns).unwrap();
    for svc in ["shop", "shop-stable", "shop-canary"] {
        let url = format!("http://{svc}.{ns}.svc.cluster.local:8080/");
        let keyed = until_answered_by(node, ns, &client, &url, &key, &fork_pod)
            .unwrap_or_else(|e| panic!("{svc}: {e:#}\n{}", node.describe(ns)));
        assert_eq!(keyed.marker(), Some("fork"), "{svc}: {keyed:?}");
    }
    // Unkeyed, Argo's Services still lead to its stable and canary pods.
    for (svc, marker) in [("shop-stable", None), ("shop-canary", Some("canary"))] {
        let url = format!("http://{svc}.{ns}.svc.cluster.local:8080/");
        let a = node.curl(ns, &client, &url, &[]).unwrap();
        assert!(
            a.answered_by().is_some_and(|p| p.starts_with("shop-")),
            "{svc}: {a:?}"
        );
        assert_eq!(a.marker(), marker, "{svc}: {a:?}");
    }
    assert_eq!(
        argo_state(node, ns),
        before,
        "Spur changed the Rollout's objects"
    );

    delete_sandbox(node, SANDBOX);
    assert_eq!(
        argo_state(node, ns),
        before,
        "deleting the sandbox changed them"
    );

    local_workload_of_the_rollout(node, ns, &client);
    assert_eq!(
        argo_state(node, ns),
        before,
        "the local workload changed Argo's objects"
    );
    rollout_at(node, ns, "Paused", 1, 2);
    // Promoted (what `kubectl argo rollouts promote --full` writes), the canary completes.
    node.kubectl(&[
        "-n",
        ns,
        "patch",
        "rollout",
        "shop",
        "--subresource",
        "status",
        "--type",
        "merge",
        "-p",
        r#"{"status": {"promoteFull": true}}"#,
    ])
    .unwrap();
    rollout_at(node, ns, "Healthy", 2, 2);
    let url = format!("http://shop-stable.{ns}.svc.cluster.local:8080/");
    eventually(
        "the promoted canary behind shop-stable",
        Duration::from_secs(60),
        || {
            let a = node.curl(ns, &client, &url, &[])?;
            Ok((a.marker() == Some("canary")).then_some(()))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));
    drop(controller);
    eprintln!(
        "node rollouts: canary Rollout forked and run on a laptop, keyed requests through its 3 Services at the fork and at the laptop, Argo's objects unchanged, canary promoted, in {:.1?}",
        started.elapsed()
    );
}
