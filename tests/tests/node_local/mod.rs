//! A workstation on the node: `spur local connect` in a "laptop" network namespace, through the
//! chart's tunnel proxy (its Service's cluster IP), with a demo app on the laptop standing in for
//! the developer's process. Shared by the steps whose Sandboxes have local workloads.

pub(crate) mod apply_local;

use std::path::Path;
use std::time::Duration;

use spur_e2e::node::{Laptop, LaptopProcess, Node, SPUR_NAMESPACE, eventually, spur_bin};
use tempfile::TempDir;

use crate::node_spur;

/// A connected workstation; its laptop namespace, processes and files go when it is dropped.
pub(crate) struct Workstation {
    /// The workstation's token (`spur local token`), for the step that checks no log has it.
    pub(crate) token: String,
    // Before `dir`: the laptop's processes stop before their state and logs go.
    laptop: Laptop,
    connect: LaptopProcess,
    dir: TempDir,
}

impl Workstation {
    /// Workstation `name`, owned by the node's admin (who creates the Sandboxes naming it),
    /// connected from laptop `n` (`Node::laptop`). Its process listens on 127.0.0.1:3000 of the
    /// laptop and answers as pod `pod` with marker `marker`.
    pub(crate) fn connect(node: &Node, n: u8, name: &str, pod: &str, marker: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let spur = spur_bin("spur");
        let token = node_spur(
            node,
            &[
                "local",
                "token",
                "--workstation",
                name,
                "--owner",
                &admin(node),
                "--owner-namespace",
                SPUR_NAMESPACE,
            ],
        );
        let token = token.trim().to_string();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, &token).unwrap();

        let mut laptop = node.laptop(n).unwrap();
        developers_process(&mut laptop, pod, marker, dir.path());
        let args = connect_args(node, &token_file, dir.path());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let connect = laptop
            .spawn(&spur, &args, &[], &dir.path().join("connect.log"))
            .unwrap();
        Workstation {
            token,
            laptop,
            connect,
            dir,
        }
    }

    /// `spur local status --json` while connected shows the tunnel up and `sandbox`'s local
    /// workload `workload` (of namespace `ns`) bound with its routing key `key`; then `spur local
    /// disconnect` stops the session cleanly: the connect process exits 0, the state file goes
    /// (`status` prints `null`, exit 1). Both read the state directory only, as on a laptop.
    pub(crate) fn status_then_disconnect(
        &mut self,
        node: &Node,
        sandbox: &str,
        ns: &str,
        workload: &str,
        key: &str,
    ) {
        let state = self.dir.path().join("state");
        let local = |args: &[&str]| {
            let out = std::process::Command::new(spur_bin("spur"))
                .arg("local")
                .args(args)
                .arg("--state-dir")
                .arg(&state)
                .output()
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )
        };
        let (code, json) = local(&["status", "--json"]);
        let st: serde_json::Value = serde_json::from_str(&json)
            .unwrap_or_else(|e| panic!("status --json printed no JSON ({e}): {json}"));
        assert_eq!(code, Some(0), "{json}\n{}", self.logs(node));
        assert_eq!(st["tunnel"]["state"], "connected", "{json}");
        let bound = st["workloads"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|w| w["sandbox"] == sandbox && w["namespace"] == ns && w["name"] == workload);
        let bound = bound.unwrap_or_else(|| panic!("no {sandbox}/{workload} in {json}"));
        assert_eq!(bound["routing_key"], key, "{json}");
        assert_eq!(bound["mappings"][0]["bind"], "active", "{json}");

        let (code, out) = local(&["disconnect", "--wait", "30s"]);
        assert_eq!(code, Some(0), "{out}\n{}", self.logs(node));
        assert!(out.starts_with("disconnected (pid "), "{out}");
        let exit = self
            .laptop
            .wait(&self.connect, Duration::from_secs(10))
            .unwrap();
        assert!(exit.success(), "connect exited {exit}\n{}", self.logs(node));
        assert_eq!(local(&["status", "--json"]), (Some(1), "null\n".into()));
    }

    /// What `spur local connect`, the laptop's process and the tunnel proxy said: for a failed
    /// wait's message.
    pub(crate) fn logs(&self, node: &Node) -> String {
        let dir = self.dir.path();
        format!(
            "connect: {}\napp: {}\ntunnel proxy: {}",
            std::fs::read_to_string(dir.join("connect.log")).unwrap_or_default(),
            std::fs::read_to_string(dir.join("app.log")).unwrap_or_default(),
            node.kubectl(&[
                "-n",
                SPUR_NAMESPACE,
                "logs",
                "deployment/spur-tunnel-proxy",
                "--tail=30"
            ])
            .unwrap_or_default()
        )
    }
}

/// Applies Sandbox `name` with one local workload, `workload`, standing in for the baseline
/// `kind`/`ns`/`workload` on `workstation`'s port 3000 (the baseline's port 8080), and returns its
/// routing key once the operator gave it one.
pub(crate) fn local_sandbox(
    node: &Node,
    name: &str,
    workstation: &str,
    kind: &str,
    ns: &str,
    workload: &str,
) -> String {
    node.apply(&local_sandbox_yaml(name, workstation, kind, ns, workload))
        .unwrap();
    eventually(
        &format!("Sandbox {name}'s routing key"),
        Duration::from_secs(60),
        || {
            let s = node.get_json("default", &["sandbox", name])?;
            Ok(s["status"]["routingKey"].as_str().map(String::from))
        },
    )
    .unwrap()
}

/// A Sandbox `name` whose local workload `workload` stands in for the baseline
/// `kind`/`ns`/`workload` on `workstation`'s port 3000 (the baseline's port 8080).
pub(crate) fn local_sandbox_yaml(
    name: &str,
    workstation: &str,
    kind: &str,
    ns: &str,
    workload: &str,
) -> String {
    format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata:
  name: {name}
spec:
  workstation: {workstation}
  local:
    - name: {workload}
      from: {{kind: {kind}, namespace: {ns}, name: {workload}}}
      mappings:
        - {{port: 8080, toLocal: "127.0.0.1:3000"}}
"#
    )
}

/// The developer's process on the laptop: a demo app on 127.0.0.1:3000 answering as pod `pod`
/// with marker `marker`, its log in `dir`.
pub(crate) fn developers_process(laptop: &mut Laptop, pod: &str, marker: &str, dir: &Path) {
    laptop
        .spawn(
            &spur_bin("spur"),
            &[
                "demo",
                "app",
                "--name",
                marker,
                "--listen",
                "127.0.0.1:3000",
                "--marker",
                marker,
            ],
            &[("POD_NAME", pod)],
            &dir.join("app.log"),
        )
        .unwrap();
}

/// The node's admin user, who owns the workstations the steps connect (and creates the
/// Sandboxes naming them).
pub(crate) fn admin(node: &Node) -> String {
    node.kubectl(&[
        "auth",
        "whoami",
        "-o",
        "jsonpath={.status.userInfo.username}",
    ])
    .unwrap()
    .trim()
    .to_string()
}

/// The CA bundle the operator publishes (`spur-ca-bundle`), which a laptop trusts.
pub(crate) fn ca_bundle(node: &Node) -> String {
    let ca = node
        .kubectl(&[
            "-n",
            SPUR_NAMESPACE,
            "get",
            "configmap",
            "spur-ca-bundle",
            "-o",
            "jsonpath={.data.ca\\.crt}",
        ])
        .unwrap();
    assert!(ca.contains("BEGIN CERTIFICATE"), "{ca}");
    ca
}

/// `spur local connect`'s arguments from a laptop: the tunnel proxy's Service by its cluster
/// IP (a laptop has no cluster DNS), its name for TLS, the token in `token_file`, and `dir` for
/// the CA bundle (written there) and the session's state. No DNS or SOCKS on the laptop.
pub(crate) fn connect_args(node: &Node, token_file: &Path, dir: &Path) -> Vec<String> {
    let ca_file = dir.join("ca.crt");
    std::fs::write(&ca_file, ca_bundle(node)).unwrap();
    let svc = node
        .get_json(SPUR_NAMESPACE, &["service", "spur-tunnel-proxy"])
        .unwrap();
    let server = svc["spec"]["clusterIP"].as_str().unwrap().to_string();
    let path = |p: &Path| p.to_str().unwrap().to_string();
    vec![
        "local".into(),
        "connect".into(),
        "--server".into(),
        server,
        "--quic-port".into(),
        "443".into(),
        "--h2-port".into(),
        "443".into(),
        "--server-name".into(),
        format!("spur-tunnel-proxy.{SPUR_NAMESPACE}.svc.cluster.local"),
        "--no-dns".into(),
        "--no-socks".into(),
        "--token-file".into(),
        path(token_file),
        "--ca-file".into(),
        path(&ca_file),
        "--state-dir".into(),
        path(&dir.join("state")),
    ]
}
