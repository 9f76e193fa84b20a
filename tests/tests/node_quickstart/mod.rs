//! docs/quickstart.md on the node (issue 46): the page's commands, read from the page and run as
//! written by a shell in the repository root, with the node's `kubectl`, `helm` and this
//! build's `spur` on `PATH`, from a cluster Spur was just uninstalled from. The first three (the
//! `spur` build, the image build and its load into the cluster) are the tier's own (the
//! workspace build, tests/node/image.sh and the node's image import): nothing here can pull a
//! base image. Also what the page says of the chart's defaults on a cluster without a default
//! StorageClass or a load balancer: the install stops at once naming the value to set.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use spur_e2e::node::{Background, Node, SPUR_NAMESPACE, eventually, spur_bin};

/// What the tier does its own way, in the page's order.
const PREPARED: [&str; 3] = [
    "cargo install --locked --path controlplane/cli --bin spur",
    "docker build -t localhost/spur:dev .",
    "kind load docker-image localhost/spur:dev",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The commands of the page: every line of its ```sh blocks, in order.
fn commands(page: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in page.lines() {
        let t = line.trim();
        if inside && t == "```" {
            inside = false;
        } else if inside && !t.is_empty() && !t.starts_with('#') {
            out.push(t.to_string());
        } else if t == "```sh" {
            inside = true;
        }
    }
    out
}

/// The page's `helm install`, as a user on a cluster with no default StorageClass runs it:
/// refused at once, naming the value. Run before the node has one (a server-side dry run, so
/// nothing is installed; it looks the cluster's StorageClasses up as a real install does).
pub(crate) fn install_without_a_default_storage_class_fails_at_once(node: &Node) {
    let page = std::fs::read_to_string(repo().join("docs/quickstart.md")).unwrap();
    let install = commands(&page)
        .into_iter()
        .find(|c| c.starts_with("helm install "))
        .expect("docs/quickstart.md has a helm install");
    let start = Instant::now();
    let (ok, out) = sh(node, &format!("{install} --dry-run=server"));
    let took = start.elapsed();
    assert!(!ok, "installed without a default StorageClass:\n{out}");
    assert!(
        out.contains(
            "jobs.persistence.enabled is true but this cluster has no default StorageClass"
        ) && out.contains("jobs.persistence.storageClass")
            && out.contains("jobs.persistence.enabled=false"),
        "{out}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");
    // A StorageClass named but not there: the same, at once.
    let (ok, out) = sh(
        node,
        &format!("{install} --dry-run=server --set jobs.persistence.storageClass=fast-ssd"),
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("jobs.persistence.storageClass=fast-ssd: no such StorageClass"),
        "{out}"
    );
}

/// What kind and k3s come with: a default StorageClass, here with one volume made by hand (the
/// node has no provisioner), for the jobs store's claim. The claim outlives `helm uninstall`, so
/// the quickstart's install binds the same one again.
pub(crate) fn give_the_node_a_default_storage_class(node: &Node) {
    node.apply(
        r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: standard
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
"#,
    )
    .unwrap();
    a_volume(node, "pv-0");
}

/// A volume of the default StorageClass, a directory of the node named `spur-node-<name>`, for
/// one claim of the jobs store.
pub(crate) fn a_volume(node: &Node, name: &str) {
    let dir = node.root.join("volumes").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    // The jobs store runs as 65532; a hostPath volume takes no fsGroup.
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    node.apply(&format!(
        r#"apiVersion: v1
kind: PersistentVolume
metadata:
  name: spur-node-{name}
spec:
  capacity: {{storage: 10Gi}}
  accessModes: [ReadWriteOnce]
  storageClassName: standard
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: {dir:?}, type: Directory}}
"#,
        dir = dir.display().to_string()
    ))
    .unwrap();
}

/// Runs `line` with bash in the repository root, the node's tools on `PATH`: whether it
/// succeeded, and stdout followed by stderr.
fn sh(node: &Node, line: &str) -> (bool, String) {
    let (ok, stdout, stderr) = sh_split(node, line);
    (ok, format!("{stdout}{stderr}"))
}

/// [`sh`] with stdout and stderr apart (curl's progress meter goes to stderr).
fn sh_split(node: &Node, line: &str) -> (bool, String, String) {
    let out = shell(node, line).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("$ {line}\n{stdout}{stderr}");
    (out.status.success(), stdout, stderr)
}

fn shell(node: &Node, line: &str) -> Command {
    let spur_dir = spur_bin("spur").parent().unwrap().to_path_buf();
    let path = std::env::join_paths([node.bindir.clone(), spur_dir].into_iter().chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .unwrap();
    let mut cmd = Command::new("bash");
    cmd.args(["-euo", "pipefail", "-c", line])
        .current_dir(repo())
        .env("PATH", path)
        .env("KUBECONFIG", &node.kubeconfig)
        .env("HELM_CACHE_HOME", node.root.join("helm/cache"))
        .env("HELM_CONFIG_HOME", node.root.join("helm/config"))
        .env("HELM_DATA_HOME", node.root.join("helm/data"));
    cmd
}

/// The page from step 2 on, after `helm uninstall`: each command as written, and what the page
/// says each shows.
pub(crate) fn quickstart_on_the_node(node: &Node) {
    let page = std::fs::read_to_string(repo().join("docs/quickstart.md")).unwrap();
    let all = commands(&page);
    assert!(
        all.len() < 10,
        "the quickstart promises fewer than ten commands: {all:#?}"
    );
    assert_eq!(all[..3], PREPARED, "the tier's own steps come first");
    // The chart's namespaces from the last install must be gone, or the install trips on one
    // still terminating.
    for ns in [
        "spur-workstation-tokens",
        "spur-resources",
        "spur-io-contexts",
    ] {
        eventually(
            &format!("namespace {ns} to be gone"),
            Duration::from_secs(180),
            || Ok(node.is_gone(None, "namespace", ns)?.then_some(())),
        )
        .unwrap();
    }
    let mut background = Vec::new();
    for (i, line) in all[3..].iter().enumerate() {
        if let Some(cmd) = line.strip_suffix('&') {
            // A command the page leaves running (the port-forward): until it says it is ready.
            let out = node.root.join(format!("quickstart-{i}.log"));
            let mut bg =
                Background::spawn(shell(node, &format!("exec {}", cmd.trim())), &out).unwrap();
            eventually(
                &format!("`{line}` to be ready"),
                Duration::from_secs(60),
                || {
                    if bg.wait(Duration::ZERO)? {
                        anyhow::bail!("`{line}` ended: {}", bg.output());
                    }
                    Ok(bg.output().contains("Forwarding from").then_some(()))
                },
            )
            .unwrap();
            background.push(bg);
            continue;
        }
        let (ok, stdout, stderr) = sh_split(node, line);
        assert!(ok, "`{line}` failed:\n{stdout}{stderr}");
        let out = format!("{stdout}{stderr}");
        if line.starts_with("helm install ") {
            for d in ["spur-operator", "spur-routeserver", "spur-tunnel-proxy"] {
                node.rollout(SPUR_NAMESPACE, d).unwrap();
            }
            let svc = node
                .get_json(SPUR_NAMESPACE, &["service", "spur-tunnel-proxy"])
                .unwrap();
            assert_eq!(svc["spec"]["type"], "NodePort");
            // QUIC and HTTP/2 share one node port, as local.md tells a workstation.
            let ports: Vec<&Value> = svc["spec"]["ports"].as_array().unwrap().iter().collect();
            assert_eq!(ports.len(), 2);
            assert_eq!(ports[0]["nodePort"], ports[1]["nodePort"], "{svc}");
        }
        if line.starts_with("spur sandbox apply ") {
            let key = node
                .kubectl(&[
                    "get",
                    "sandbox",
                    "quickstart",
                    "-o",
                    "jsonpath={.status.routingKey}",
                ])
                .unwrap();
            assert!(!key.trim().is_empty());
            assert!(out.contains("Sandbox quickstart is ready"), "{out}");
            assert!(
                out.contains(&format!("Routing key: {}", key.trim())),
                "{out}"
            );
            assert!(
                out.contains("quickstart/backend: routes published"),
                "{out}"
            );
        }
        if line.starts_with("curl ") {
            let answer: Value = serde_json::from_str(stdout.trim()).unwrap();
            let fork_pods = node
                .kubectl(&[
                    "-n",
                    "quickstart",
                    "get",
                    "pods",
                    "-l",
                    "spur.dev/fork",
                    "-o",
                    "jsonpath={.items[*].metadata.name}",
                ])
                .unwrap();
            let upstream = &answer["upstream"];
            assert_eq!(upstream["service"], "backend", "{answer}");
            assert_eq!(upstream["marker"], "sandbox", "{answer}");
            let pod = upstream["pod"].as_str().unwrap();
            assert!(
                fork_pods.split_whitespace().any(|p| p == pod),
                "{pod} is not a fork pod ({fork_pods})"
            );
            // And what the page says of a request without the header.
            let (ok, plain, err) = sh_split(node, "curl -sS localhost:18080/");
            assert!(ok, "{plain}{err}");
            let plain: Value = serde_json::from_str(plain.trim()).unwrap();
            assert_eq!(plain["upstream"]["marker"], "baseline", "{plain}");
        }
    }
    drop(background);
    let (ok, out) = sh(node, "spur sandbox delete quickstart --wait");
    assert!(ok, "{out}");
    // Leave the node as the tier found it, so a rerun on it starts from no default
    // StorageClass: the release, the example's namespace, the claim, the volume, the class.
    let (ok, out) = sh(
        node,
        "helm uninstall spur --namespace spur-system --wait && kubectl delete namespace quickstart --wait=false && kubectl -n spur-system delete pvc data-spur-jobs-0 --wait=false && kubectl delete pv spur-node-pv-0 --wait=false && kubectl delete storageclass standard",
    );
    assert!(ok, "{out}");
}
