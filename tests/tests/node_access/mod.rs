//! Just-in-time access on the node (docs/access.md), with real `kubectl exec` into running pods
//! as users authenticated by ServiceAccount tokens: no exec before a grant; `spur access request
//! --wait` prints the command once granted; the requester's exec works, a colleague's in the same
//! group does not; a grant naming a sandbox reaches that sandbox's fork; every exec is in the
//! audit Events with its user and command; one second after expiry the exec is refused; a debug
//! pod runs, no Service selects it, and it is gone at expiry; a workstation tunnel opened with a
//! tunnel grant's token (`spur local connect` in a test-made network namespace) is closed by the
//! tunnel proxy when the grant ends.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use spur_e2e::node::{Node, SPUR_NAMESPACE, eventually, spur_bin};

/// The users' namespace: templates allow its ServiceAccounts' group.
const DEVS: &str = "devs";
const GROUP: &str = "system:serviceaccounts:devs";
/// Every grant here is capped at this (requests ask for an hour).
const MAX: &str = "25s";

pub(crate) fn access_on_the_node(
    node: &Node,
    ns: &str,
    sandbox: &str,
    fork_pod: &str,
    baseline: &str,
) {
    let dir = tempfile::tempdir().unwrap();
    node.kubectl(&["create", "namespace", DEVS]).unwrap();
    let alice = user(node, dir.path(), "alice");
    let bob = user(node, dir.path(), "bob");
    node.kubectl(&[
        "-n",
        ns,
        "create",
        "rolebinding",
        "requesters",
        "--clusterrole=spur-access-requester",
        &format!("--serviceaccount={DEVS}:alice"),
        &format!("--serviceaccount={DEVS}:bob"),
    ])
    .unwrap();
    node.apply(&format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: ExecAccessTemplate
metadata: {{name: backend-exec, namespace: {ns}}}
spec:
  accessConfig: {{allowedGroups: ["{GROUP}"], defaultDuration: {MAX}, maxDuration: {MAX}}}
  targetRef: {{kind: Deployment, name: backend}}
---
apiVersion: spur.dev/v1alpha1
kind: PodAccessTemplate
metadata: {{name: backend-debug, namespace: {ns}}}
spec:
  accessConfig: {{allowedGroups: ["{GROUP}"], defaultDuration: {MAX}, maxDuration: {MAX}}}
  targetRef: {{kind: Deployment, name: backend}}
  mutation:
    podLabels: {{purpose: debug}}
"#
    ))
    .unwrap();
    let exec = |who: &Path, pod: &str| -> (bool, String) {
        let out = Command::new(node.bindir.join("kubectl"))
            .arg("--kubeconfig")
            .arg(who)
            .args([
                "-n",
                ns,
                "exec",
                pod,
                "-c",
                "app",
                "--",
                "spur",
                "--version",
            ])
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };

    // No standing rights.
    let (ok, text) = exec(&alice, baseline);
    assert!(!ok && text.contains("Forbidden"), "{text}");

    // Alice asks for an hour and gets the template's maximum, on the baseline's pod.
    let command = request(&alice, ns, &["exec", "backend-exec", "--duration", "1h"]).unwrap();
    assert_eq!(
        command.trim(),
        format!("kubectl exec -ti -n {ns} {baseline} -c app -- /bin/sh"),
        "the grant is on the baseline's pod"
    );
    let (ok, text) = exec(&alice, baseline);
    assert!(
        ok && text.contains("spur"),
        "alice's exec under her grant: {text}"
    );
    let (ok, text) = exec(&bob, baseline);
    assert!(
        !ok && text.contains("Forbidden"),
        "bob may not use alice's grant: {text}"
    );
    let (ok, text) = exec(&alice, fork_pod);
    assert!(
        !ok,
        "a grant on the baseline does not reach the fork: {text}"
    );

    // A grant in the sandbox reaches its fork.
    let command = request(
        &alice,
        ns,
        &[
            "exec",
            "backend-exec",
            "--sandbox",
            sandbox,
            "--duration",
            "1h",
        ],
    )
    .unwrap();
    assert!(command.contains(fork_pod), "{command}");
    let (ok, text) = exec(&alice, fork_pod);
    assert!(ok, "alice's exec into the fork: {text}");

    // Every exec is in the audit Events, with its user and command.
    let alice_name = format!("system:serviceaccount:{DEVS}:alice");
    for pod in [baseline, fork_pod] {
        eventually(
            &format!("the audit event of alice's exec into {pod}"),
            Duration::from_secs(30),
            || {
                let events = node.get_json(ns, &["events.events.k8s.io"])?;
                Ok(events["items"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|e| {
                        e["reason"] == "Exec"
                            && e["regarding"]["name"] == pod
                            && e["note"].as_str()
                                == Some(&format!(
                                    "exec by {alice_name} into container app: spur --version (tty: false)"
                                ))
                    })
                    .then_some(()))
            },
        )
        .unwrap();
    }

    // One second after expiry, the exec is refused.
    let requests = node.get_json(ns, &["execaccessrequests"]).unwrap();
    let expiries: Vec<String> = requests["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["status"]["expiresAt"].as_str().map(String::from))
        .collect();
    // (The first grant may have ended already.)
    assert!(!expiries.is_empty(), "{requests}");
    let last: k8s_openapi::jiff::Timestamp = expiries.iter().max().unwrap().parse().unwrap();
    let left = Duration::try_from(last.duration_since(k8s_openapi::jiff::Timestamp::now()))
        .unwrap_or_default();
    std::thread::sleep(left + Duration::from_secs(1));
    for pod in [baseline, fork_pod] {
        let (ok, text) = exec(&alice, pod);
        assert!(
            !ok && text.contains("Forbidden"),
            "alice's exec into {pod} 1 s after expiry: {text}"
        );
    }
    let left = node.get_json(ns, &["execaccessrequests"]).unwrap();
    assert_eq!(left["items"].as_array().map(Vec::len), Some(0), "{left}");

    // A debug pod: running, selected by no Service, exec-able by alice, gone at expiry.
    let command = request(&alice, ns, &["pod", "backend-debug"]).unwrap();
    let debug_pod = command.split_whitespace().nth(5).map(String::from).unwrap();
    assert!(debug_pod != baseline && debug_pod != fork_pod, "{command}");
    let pod = node.get_json(ns, &["pod", &debug_pod]).unwrap();
    assert_eq!(pod["metadata"]["labels"]["purpose"], "debug");
    assert!(pod["metadata"]["labels"]["app"].is_null(), "{pod}");
    let ip = pod["status"]["podIP"].as_str().unwrap().to_string();
    let slices = node
        .kubectl(&["-n", ns, "get", "endpointslices", "-o", "json"])
        .unwrap();
    assert!(
        !slices.contains(&format!("\"{ip}\"")),
        "a Service selects the debug pod"
    );
    let (ok, text) = exec(&alice, &debug_pod);
    assert!(ok, "alice's exec into her debug pod: {text}");
    eventually(
        "the debug pod deleted at expiry",
        Duration::from_secs(60),
        || {
            let (code, _) = node.kubectl_status(&["-n", ns, "get", "pod", &debug_pod])?;
            Ok((code != Some(0)).then_some(()))
        },
    )
    .unwrap();

    tunnel_grant_ends_the_tunnel(node, ns, &alice, dir.path());

    node.kubectl(&["delete", "namespace", DEVS, "--wait=false"])
        .unwrap();
}

/// Alice's tunnel grant: `spur access request tunnel` writes a token file; `spur local connect`
/// with it from a laptop network namespace opens a session (its Lease appears); when the grant
/// ends, the tunnel proxy ends the session (the Lease goes) and refuses the token.
fn tunnel_grant_ends_the_tunnel(node: &Node, ns: &str, alice: &Path, dir: &Path) {
    node.apply(&format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: TunnelAccessTemplate
metadata: {{name: laptops, namespace: {ns}}}
spec:
  accessConfig: {{allowedGroups: ["{GROUP}"], defaultDuration: {MAX}, maxDuration: {MAX}}}
"#
    ))
    .unwrap();
    let token_file = dir.join("tunnel-token");
    let command = request(
        alice,
        ns,
        &[
            "tunnel",
            "laptops",
            "--workstation",
            "alice-ws",
            "--token-file",
            token_file.to_str().unwrap(),
        ],
    )
    .unwrap();
    assert_eq!(
        command.trim(),
        format!("spur local connect --token-file {}", token_file.display())
    );
    let mut laptop = node.laptop(4).unwrap();
    let log = dir.join("tunnel-connect.log");
    let tunnel_dir = dir.join("tunnel");
    std::fs::create_dir_all(&tunnel_dir).unwrap();
    let args = crate::node_local::connect_args(node, &token_file, &tunnel_dir);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    laptop.spawn(&spur_bin("spur"), &args, &[], &log).unwrap();
    let lease = spur_api::tunnel::lease_name("alice-ws");
    let connect_log = || std::fs::read_to_string(&log).unwrap_or_default();
    eventually(
        "the tunnel session's Lease",
        Duration::from_secs(60),
        || {
            let (code, _) = node.kubectl_status(&["-n", SPUR_NAMESPACE, "get", "lease", &lease])?;
            Ok((code == Some(0)).then_some(()))
        },
    )
    .with_context(connect_log)
    .unwrap();
    let requests = node.get_json(ns, &["tunnelaccessrequests"]).unwrap();
    let expires: k8s_openapi::jiff::Timestamp = requests["items"][0]["status"]["expiresAt"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let left = Duration::try_from(expires.duration_since(k8s_openapi::jiff::Timestamp::now()))
        .unwrap_or_default();
    std::thread::sleep(left);
    // "Within seconds": the session ends at the token's expiry (a goaway, then the Lease goes).
    eventually(
        "the tunnel closed at the grant's end",
        Duration::from_secs(15),
        || {
            let (code, _) = node.kubectl_status(&["-n", SPUR_NAMESPACE, "get", "lease", &lease])?;
            Ok((code != Some(0)).then_some(()))
        },
    )
    .with_context(connect_log)
    .unwrap();
    let left = node.get_json(ns, &["tunnelaccessrequests"]).unwrap();
    eventually("the tunnel grant deleted", Duration::from_secs(15), || {
        let r = node.get_json(ns, &["tunnelaccessrequests"])?;
        Ok((r["items"].as_array().map(Vec::len) == Some(0)).then_some(()))
    })
    .with_context(|| format!("{left}"))
    .unwrap();
    drop(laptop);
}

/// A kubeconfig authenticating as ServiceAccount `devs/<name>` (a token from the TokenRequest
/// API), for kubectl and `spur`.
fn user(node: &Node, dir: &Path, name: &str) -> PathBuf {
    user_in(node, dir, DEVS, name).0
}

/// A kubeconfig authenticating as ServiceAccount `<namespace>/<name>` (created, in a namespace
/// that exists), and its token.
pub(super) fn user_in(node: &Node, dir: &Path, namespace: &str, name: &str) -> (PathBuf, String) {
    node.kubectl(&["-n", namespace, "create", "serviceaccount", name])
        .unwrap();
    let token = node
        .kubectl(&["-n", namespace, "create", "token", name, "--duration=1h"])
        .unwrap();
    let admin = std::fs::read_to_string(&node.kubeconfig).unwrap();
    let config: String = admin
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("token:") {
                format!("    token: {}", token.trim())
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let path = dir.join(format!("{namespace}-{name}.kubeconfig"));
    std::fs::write(&path, config).unwrap();
    (path, token.trim().to_string())
}

/// `spur access request <args> --wait` as the user of `kubeconfig`: the command it prints.
fn request(kubeconfig: &Path, ns: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(spur_bin("spur"))
        .args(["access", "request"])
        .args(args)
        .args(["-n", ns, "--wait=60s", "--kubeconfig"])
        .arg(kubeconfig)
        .output()
        .context("running spur access request")?;
    if !out.status.success() {
        bail!(
            "spur access request {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
