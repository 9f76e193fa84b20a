//! A workstation on the node: `spur local connect` in a "laptop" network namespace, through the
//! chart's tunnel proxy (its Service's cluster IP), with a demo app on the laptop standing in for
//! the developer's process. Shared by the steps whose Sandboxes have local workloads.

use spur_e2e::node::{Laptop, Node, SPUR_NAMESPACE, spur_bin};
use tempfile::TempDir;

use crate::node_spur;

/// A connected workstation; its laptop namespace, processes and files go when it is dropped.
pub(crate) struct Workstation {
    /// The workstation's token (`spur local token`), for the step that checks no log has it.
    pub(crate) token: String,
    // Before `dir`: the laptop's processes stop before their state and logs go.
    _laptop: Laptop,
    dir: TempDir,
}

impl Workstation {
    /// Workstation `name`, owned by the node's admin (who creates the Sandboxes naming it),
    /// connected from laptop `n` (`Node::laptop`). Its process listens on 127.0.0.1:3000 of the
    /// laptop and answers as pod `pod` with marker `marker`.
    pub(crate) fn connect(node: &Node, n: u8, name: &str, pod: &str, marker: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let spur = spur_bin("spur");
        let admin = node
            .kubectl(&[
                "auth",
                "whoami",
                "-o",
                "jsonpath={.status.userInfo.username}",
            ])
            .unwrap();
        let token = node_spur(
            node,
            &[
                "local",
                "token",
                "--workstation",
                name,
                "--owner",
                admin.trim(),
                "--owner-namespace",
                SPUR_NAMESPACE,
            ],
        );
        let token = token.trim().to_string();
        std::fs::write(dir.path().join("token"), &token).unwrap();
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
        std::fs::write(dir.path().join("ca.crt"), ca).unwrap();
        let svc = node
            .get_json(SPUR_NAMESPACE, &["service", "spur-tunnel-proxy"])
            .unwrap();
        let server = svc["spec"]["clusterIP"].as_str().unwrap().to_string();

        let mut laptop = node.laptop(n).unwrap();
        laptop
            .spawn(
                &spur,
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
                &dir.path().join("app.log"),
            )
            .unwrap();
        let token_file = dir.path().join("token");
        let ca_file = dir.path().join("ca.crt");
        let state = dir.path().join("state");
        laptop
            .spawn(
                &spur,
                &[
                    "local",
                    "connect",
                    "--server",
                    &server,
                    "--quic-port",
                    "443",
                    "--h2-port",
                    "443",
                    "--server-name",
                    &format!("spur-tunnel-proxy.{SPUR_NAMESPACE}.svc.cluster.local"),
                    "--no-dns",
                    "--no-socks",
                    "--token-file",
                    token_file.to_str().unwrap(),
                    "--ca-file",
                    ca_file.to_str().unwrap(),
                    "--state-dir",
                    state.to_str().unwrap(),
                ],
                &[],
                &dir.path().join("connect.log"),
            )
            .unwrap();
        Workstation {
            token,
            _laptop: laptop,
            dir,
        }
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
