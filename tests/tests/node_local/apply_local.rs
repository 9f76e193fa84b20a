//! `spur sandbox apply --local` on the node (issue 46): from a "laptop" network namespace, with
//! a kubeconfig of the laptop's own (the API server through the `kubernetes` Service's address),
//! one command finds the tunnel proxy's node port, asks the cluster for a workstation
//! certificate (the test approves it, as an administrator would), applies the Sandbox, connects
//! and shows it coming up; a keyed request reaches the laptop's process; Ctrl-C deletes the
//! sandbox and disconnects. A user of another namespace who runs the same command for that
//! workstation gets no certificate and no Sandbox.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use spur_e2e::node::{Node, SPUR_NAMESPACE, eventually, spur_bin};

const WORKSTATION: &str = "dana-laptop";
const SANDBOX: &str = "backend-dev";

/// The admin's kubeconfig with the API server at the `kubernetes` Service's address (the
/// laptop routes only to Services and pods; the server's certificate names that address), and
/// impersonating `as_user` if given.
pub(crate) fn laptop_kubeconfig(node: &Node, dir: &Path, as_user: Option<&str>) -> PathBuf {
    let text = std::fs::read_to_string(&node.kubeconfig).unwrap();
    let mut config: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
    for cluster in config["clusters"].as_array_mut().unwrap() {
        cluster["cluster"]["server"] = "https://10.96.0.1:443".into();
    }
    if let Some(user) = as_user {
        for u in config["users"].as_array_mut().unwrap() {
            u["user"]["as"] = user.into();
        }
    }
    let path = dir.join("laptop.kubeconfig");
    std::fs::write(&path, serde_yaml_ng::to_string(&config).unwrap()).unwrap();
    path
}

/// Approves the certificate request for [`WORKSTATION`] that `user` filed (the request's
/// `spec.username`), as an administrator does; returns its name.
fn approve_request_of(node: &Node, user: &str, log: &dyn Fn() -> String) -> String {
    let name = eventually(
        &format!("{user}'s certificate request for {WORKSTATION}"),
        Duration::from_secs(90),
        || {
            let list = node.get_json(
                "default",
                &["csr", "-l", &format!("spur.dev/workstation={WORKSTATION}")],
            )?;
            Ok(list["items"]
                .as_array()
                .into_iter()
                .flatten()
                .find_map(|c| {
                    let pending = c["status"]["conditions"].is_null();
                    (c["spec"]["username"] == user && pending).then(|| {
                        c["metadata"]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string()
                    })
                }))
        },
    )
    .with_context(log)
    .unwrap();
    node.kubectl(&["certificate", "approve", &name]).unwrap();
    name
}

/// The developer's day in one command, from the laptop; `client` calls `frontend`, which calls
/// `ns/backend` (whose baseline pod is `backend_baseline`).
pub(crate) fn joins_in_one_command(
    node: &Node,
    ns: &str,
    client: &str,
    frontend: &str,
    backend_baseline: &str,
) {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = laptop_kubeconfig(node, dir.path(), None);
    let file = dir.path().join(format!("{SANDBOX}.yaml"));
    std::fs::write(
        &file,
        super::local_sandbox_yaml(SANDBOX, WORKSTATION, "Deployment", ns, "backend"),
    )
    .unwrap();
    let state = dir.path().join("state");
    let mut laptop = node.laptop(6).unwrap();
    // A node's address as the laptop sees it: its side of the laptop's link.
    let node_addr = {
        let (net, last) = laptop.ip.rsplit_once('.').unwrap();
        format!("{net}.{}", last.parse::<u8>().unwrap() - 1)
    };
    super::developers_process(&mut laptop, "danas-laptop", "laptop-dev", dir.path());
    let spur = spur_bin("spur");
    let apply_log = dir.path().join("apply.log");
    let path = |p: &Path| p.to_str().unwrap().to_string();
    let args = [
        "sandbox".to_string(),
        "apply".into(),
        "--local".into(),
        "-f".into(),
        path(&file),
        "--kubeconfig".into(),
        path(&kubeconfig),
        "--server".into(),
        node_addr.clone(),
        "--state-dir".into(),
        path(&state),
        "--no-dns".into(),
        "--no-socks".into(),
        "--timeout".into(),
        "180s".into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let apply = laptop.spawn(&spur, &args, &[], &apply_log).unwrap();
    let log = || std::fs::read_to_string(&apply_log).unwrap_or_default();

    // No credential on this laptop yet: the command files a request and waits.
    let admin = crate::node_local::admin(node);
    let csr = approve_request_of(node, &admin, &log);
    let key = eventually(
        &format!("`spur sandbox apply --local` to print {SANDBOX} ready"),
        Duration::from_secs(240),
        || {
            // The last line of what it prints once ready.
            let text = log();
            if !text.contains("Ctrl-C disconnects") {
                return Ok(None);
            }
            Ok(text
                .lines()
                .find_map(|l| l.strip_prefix("Routing key: "))
                .map(|k| k.trim().to_string()))
        },
    )
    .with_context(|| format!("{}\n{}", log(), node.describe(ns)))
    .unwrap();
    let text = log();
    eprintln!("`spur sandbox apply --local` on the laptop:\n{text}");
    // What a person sees, in this order (progress lines are `[ elapsed] item: step`).
    let port = node
        .kubectl(&[
            "-n",
            SPUR_NAMESPACE,
            "get",
            "service",
            "spur-tunnel-proxy",
            "-o",
            "jsonpath={.spec.ports[0].nodePort}",
        ])
        .unwrap();
    let expected = [
        format!(
            "] workstation: tunnel proxy at {node_addr}:{} (--server), certificate name spur-tunnel-proxy.{SPUR_NAMESPACE}.svc",
            port.trim()
        ),
        format!(
            "] workstation: no certificate for workstation {WORKSTATION} here; asking the cluster"
        ),
        format!(
            "] workstation: certificate request {csr} filed; waiting up to 15m for an administrator to run: kubectl certificate approve {csr}"
        ),
        format!("] workstation: certificate for workstation {WORKSTATION} saved in "),
        // The session first: one that cannot start leaves nothing applied.
        "] workstation: connected via ".to_string(),
        format!("] sandbox: {SANDBOX} created"),
        "] local backend: workstation connected".to_string(),
        "] local backend: keyed requests reach the workstation".to_string(),
        format!("Sandbox {SANDBOX} is ready ("),
        format!("Routing key: {key}"),
        "This machine serves the sandbox's local workloads:".to_string(),
        format!("  {ns}/backend port 8080 → 127.0.0.1:3000 here"),
        format!("Ctrl-C disconnects and deletes sandbox {SANDBOX} (--keep leaves it)."),
    ];
    let mut rest = text.as_str();
    for want in &expected {
        let at = rest
            .find(want.as_str())
            .unwrap_or_else(|| panic!("{want:?} (in this order) is not in:\n{text}"));
        rest = &rest[at + want.len()..];
    }
    // The workstation's credential is where `spur local connect` finds it next time.
    assert!(state.join("client.crt").is_file() && state.join("ca.crt").is_file());

    // Keyed requests reach the laptop's process; the rest stay on the baseline.
    let answer = crate::until_answered_by(node, ns, client, frontend, &key, "danas-laptop")
        .with_context(log)
        .unwrap();
    assert_eq!(answer.marker(), Some("laptop-dev"), "{answer:?}");
    let unkeyed = crate::get(node, ns, client, frontend, None);
    assert_eq!(unkeyed.answered_by(), Some(backend_baseline), "{unkeyed:?}");

    // Ctrl-C: the sandbox goes, then the tunnel; the command exits 0.
    laptop.interrupt(&apply).unwrap();
    let exit = laptop
        .wait(&apply, Duration::from_secs(90))
        .with_context(log)
        .unwrap();
    let text = log();
    assert!(exit.success(), "exit {exit}:\n{text}");
    let after_ready = &text[text.find("Ctrl-C disconnects").unwrap_or(0)..];
    eprintln!("after Ctrl-C:\n{after_ready}");
    for want in [
        "] sandbox: deleting",
        "] sandbox: deleted",
        "] workstation: disconnected",
    ] {
        assert!(after_ready.contains(want), "{want:?} after Ctrl-C:\n{text}");
    }
    assert!(node.is_gone(None, "sandbox", SANDBOX).unwrap(), "{text}");
    // A clean close removes the session's Lease.
    eventually(
        "the workstation's session Lease to go",
        Duration::from_secs(30),
        || {
            Ok(node
                .is_gone(
                    Some(SPUR_NAMESPACE),
                    "lease",
                    &format!("spur-tunnel-{WORKSTATION}"),
                )?
                .then_some(()))
        },
    )
    .unwrap();
    let keyed = crate::get(node, ns, client, frontend, Some(&key));
    assert_eq!(keyed.answered_by(), Some(backend_baseline), "{keyed:?}");
    eprintln!(
        "spur sandbox apply --local: certificate {csr}, ready, keyed request to the laptop, Ctrl-C took it down"
    );
}

/// A user of another namespace (`tenant_kubeconfig`, who may file certificate requests as every
/// developer may) runs the same command for [`WORKSTATION`], the admin's since
/// [`joins_in_one_command`]: the request is approved, and still no certificate is issued to
/// them, the command ends with the signer's reason, and no Sandbox of theirs exists.
pub(crate) fn another_users_workstation_is_refused(
    node: &Node,
    tenant: &str,
    tenant_kubeconfig: &Path,
    ns: &str,
) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("theirs.yaml");
    std::fs::write(
        &file,
        super::local_sandbox_yaml(
            "tenant-takes-dana",
            WORKSTATION,
            "Deployment",
            ns,
            "backend",
        ),
    )
    .unwrap();
    let state = dir.path().join("state");
    // Every user may get the tunnel proxy's Service (where the command finds it), and no other
    // Service of Spur's namespace, nor list them.
    let as_tenant = format!("--as={tenant}");
    for (what, answer) in [
        ("service/spur-tunnel-proxy", "yes"),
        ("service/spur-routeserver", "no"),
        ("services", "no"),
    ] {
        let verb = if what == "services" { "list" } else { "get" };
        let got = node
            .kubectl_status(&[
                "auth",
                "can-i",
                verb,
                what,
                "-n",
                SPUR_NAMESPACE,
                &as_tenant,
            ])
            .unwrap();
        assert_eq!(got.1, answer, "{tenant} {verb} {what}");
    }
    // Developers may ask for workstation certificates (the chart's ClusterRole for it).
    node.apply(&format!(
        r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: tenant-workstation}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: spur-workstation}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: "{tenant}"}}]
"#
    ))
    .unwrap();
    let out = dir.path().join("apply.log");
    let mut child = std::process::Command::new("timeout")
        .args(["-s", "KILL", "150"])
        .arg(spur_bin("spur"))
        .args(["sandbox", "apply", "--local", "-f"])
        .arg(&file)
        .arg("--kubeconfig")
        .arg(tenant_kubeconfig)
        // Never dialled: the command stops before it connects.
        .args(["--server", "127.0.0.1", "--state-dir"])
        .arg(&state)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(dir.path().join("apply.err")).unwrap())
        .spawn()
        .unwrap();
    let log = || {
        format!(
            "{}{}",
            std::fs::read_to_string(&out).unwrap_or_default(),
            std::fs::read_to_string(dir.path().join("apply.err")).unwrap_or_default()
        )
    };
    approve_request_of(node, tenant, &log);
    let status = child.wait().unwrap();
    let text = log();
    eprintln!("{tenant} runs `spur sandbox apply --local` for {WORKSTATION}:\n{text}");
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(
        text.contains("failed: ") && text.contains("belongs to another user"),
        "{text}"
    );
    assert!(!state.join("client.crt").exists(), "{text}");
    assert!(
        node.is_gone(None, "sandbox", "tenant-takes-dana").unwrap(),
        "{text}"
    );
    node.kubectl(&["delete", "clusterrolebinding", "tenant-workstation"])
        .unwrap();
}
