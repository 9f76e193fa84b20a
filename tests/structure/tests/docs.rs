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

/// The `- the CRDs, N (...)` bullet of that list, up to the next bullet.
fn crd_bullet(list: &str) -> &str {
    let crds = list
        .split("\n- the CRDs, ")
        .nth(1)
        .expect("install.md's list has a `- the CRDs, N (...)` bullet");
    crds.split("\n- ").next().unwrap_or_default()
}

#[test]
fn install_md_names_every_crd_and_how_many() {
    let mut kinds = crd_kinds();
    kinds.sort();
    let list = installs_list();
    let bullet = crd_bullet(&list);
    let stated: usize = bullet
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .expect("the CRD bullet starts with their number");
    assert_eq!(stated, kinds.len(), "install.md's count of CRDs");
    // The kinds it names: the capitalised words after the API version.
    let (_, names) = bullet
        .split_once("):")
        .expect("the CRD bullet lists the kinds after `(spur.dev/v1alpha1):`");
    let mut named: Vec<String> = names
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| w.starts_with(|c: char| c.is_ascii_uppercase()))
        .map(String::from)
        .collect();
    named.sort();
    assert_eq!(
        named, kinds,
        "install.md's CRD list (left) against charts/spur/crds (right)"
    );
}

#[test]
fn install_md_names_every_workload_of_the_chart() {
    const KINDS: [&str; 4] = ["Deployment", "StatefulSet", "DaemonSet", "CronJob"];
    let mut workloads: Vec<String> = chart_workloads()
        .iter()
        .map(|(kind, name)| format!("{kind} `{name}`"))
        .collect();
    workloads.sort();
    // Every template that renders a workload is seen: as many as files name one of the kinds.
    let files_with_workloads = yaml_files(&repo().join("charts/spur/templates"))
        .iter()
        .map(|f| read(f))
        .map(|t| {
            t.lines()
                .filter(|l| KINDS.iter().any(|k| *l == format!("kind: {k}")))
                .count()
        })
        .sum::<usize>();
    assert_eq!(workloads.len(), files_with_workloads, "{workloads:?}");
    let list = installs_list();
    // The workloads the list names: `<Kind> `<name>`` anywhere in it.
    let mut named: Vec<String> = Vec::new();
    for kind in KINDS {
        for part in list.split(&format!("{kind} `")).skip(1) {
            if let Some((name, _)) = part.split_once('`') {
                named.push(format!("{kind} `{name}`"));
            }
        }
    }
    named.sort();
    named.dedup();
    assert_eq!(
        named, workloads,
        "docs/install.md's \"The chart installs\" list (left) against the chart's templates (right)"
    );
}
