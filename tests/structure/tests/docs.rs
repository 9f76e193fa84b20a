//! docs/install.md's list of what the chart installs names every CRD in `charts/spur/crds/` and
//! every workload (Deployment, StatefulSet, DaemonSet, CronJob) the chart's templates render,
//! and says how many CRDs there are: one added without its line there fails here (issue 46,
//! docs that match the code).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// The CRDs' kinds: `spec.names.kind` of each file (a CRD per file, as `spur-crdgen` writes).
fn crd_kinds() -> Vec<String> {
    yaml_files(&repo().join("charts/spur/crds"))
        .iter()
        .map(|f| {
            let text = read(f);
            let names = text
                .split_once("\n  names:\n")
                .unwrap_or_else(|| panic!("{}: no spec.names", f.display()))
                .1;
            names
                .lines()
                .take_while(|l| l.starts_with("    "))
                .find_map(|l| l.strip_prefix("    kind: "))
                .unwrap_or_else(|| panic!("{}: no spec.names.kind", f.display()))
                .trim()
                .to_string()
        })
        .collect()
}

/// `(kind, name)` of every workload the templates render: a document's top-level `kind:` of a
/// workload kind and its `metadata.name` (the chart spells these names out).
fn chart_workloads() -> Vec<(String, String)> {
    const KINDS: [&str; 4] = ["Deployment", "StatefulSet", "DaemonSet", "CronJob"];
    let mut found = Vec::new();
    for f in yaml_files(&repo().join("charts/spur/templates")) {
        let text = read(&f);
        for doc in text.split("\n---") {
            let Some(kind) = doc
                .lines()
                .find_map(|l| l.strip_prefix("kind: "))
                .map(str::trim)
                .filter(|k| KINDS.contains(k))
            else {
                continue;
            };
            let name = doc
                .split_once("\nmetadata:\n")
                .and_then(|(_, m)| {
                    m.lines()
                        .take_while(|l| l.starts_with("  "))
                        .find_map(|l| l.strip_prefix("  name: "))
                })
                .unwrap_or_else(|| panic!("{}: a {kind} without metadata.name", f.display()));
            found.push((kind.to_string(), name.trim().to_string()));
        }
    }
    found
}

/// install.md's bullet list under "The chart installs:" (up to the first blank line).
fn installs_list() -> String {
    let install = read(&repo().join("docs/install.md"));
    let (_, rest) = install
        .split_once("The chart installs:\n\n")
        .expect("docs/install.md says what the chart installs");
    rest.split("\n\n").next().unwrap_or_default().to_string()
}

#[test]
fn install_md_names_every_crd_and_how_many() {
    let kinds = crd_kinds();
    assert!(kinds.len() >= 20, "{kinds:?}");
    let list = installs_list();
    let crds = list
        .split("- the CRDs, ")
        .nth(1)
        .expect("install.md's list has a `- the CRDs, N (...)` bullet");
    let stated: usize = crds
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .expect("the CRD bullet starts with their number");
    assert_eq!(stated, kinds.len(), "install.md's count of CRDs");
    let named: Vec<&str> = crds
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    let missing: Vec<&String> = kinds
        .iter()
        .filter(|k| !named.contains(&k.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "install.md does not name the CRDs {missing:?}"
    );
}

#[test]
fn install_md_names_every_workload_of_the_chart() {
    let workloads = chart_workloads();
    assert!(workloads.len() >= 8, "{workloads:?}");
    let list = installs_list();
    let missing: Vec<String> = workloads
        .iter()
        .filter(|(kind, name)| !list.contains(&format!("{kind} `{name}`")))
        .map(|(kind, name)| format!("{kind} `{name}`"))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/install.md's \"The chart installs\" list does not name {missing:?}"
    );
}
