//! Crate layering, checked on the resolved dependency graph (`cargo metadata`) rather than
//! promised in a comment: no crate under `dataplane/` reaches the Kubernetes client (`kube*`,
//! `k8s-openapi`) through its normal or build dependencies, however indirectly, so the sidecar,
//! the proxy core and the workstation side never link it. cargo-deny (`deny.toml`, run by
//! `.ci/run`) bans direct dependencies outside its `wrappers`; this test also covers indirect
//! ones and any `kube-*` crate that `deny.toml` does not name.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn is_kubernetes(name: &str) -> bool {
    name == "kube" || name.starts_with("kube-") || name == "k8s-openapi"
}

#[test]
fn dataplane_crates_never_depend_on_kubernetes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(&root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let dataplane = root.join("dataplane").canonicalize().unwrap();
    let name: HashMap<&str, &str> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect();
    let members: Vec<&str> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| {
            Path::new(p["manifest_path"].as_str().unwrap())
                .canonicalize()
                .is_ok_and(|m| m.starts_with(&dataplane))
        })
        .map(|p| p["id"].as_str().unwrap())
        .collect();
    assert!(members.len() >= 8, "dataplane crates found: {members:?}");
    // Edges that end up in the built artifact: normal and build dependencies, not dev ones.
    let mut deps: HashMap<&str, Vec<&str>> = HashMap::new();
    for node in meta["resolve"]["nodes"].as_array().unwrap() {
        let linked = node["deps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| {
                d["dep_kinds"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|k| k["kind"].is_null() || k["kind"] == "build")
            })
            .map(|d| d["pkg"].as_str().unwrap())
            .collect();
        deps.insert(node["id"].as_str().unwrap(), linked);
    }
    let mut violations = Vec::new();
    for member in members {
        // Breadth first, remembering how each crate was reached, to name the path.
        let mut via: HashMap<&str, &str> = HashMap::new();
        let mut seen = HashSet::from([member]);
        let mut queue = VecDeque::from([member]);
        while let Some(id) = queue.pop_front() {
            if is_kubernetes(name[id]) {
                let mut chain = vec![name[id]];
                let mut at = id;
                while let Some(&from) = via.get(at) {
                    chain.push(name[from]);
                    at = from;
                }
                chain.reverse();
                violations.push(chain.join(" -> "));
                continue;
            }
            for &d in deps.get(id).into_iter().flatten() {
                if seen.insert(d) {
                    via.insert(d, id);
                    queue.push_back(d);
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "dataplane crates reach the Kubernetes client:\n{}",
        violations.join("\n")
    );
}
