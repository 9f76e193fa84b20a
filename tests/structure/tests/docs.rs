//! docs/install.md's list of what the chart installs names every CRD in `charts/spur/crds/` and
//! every workload (Deployment, StatefulSet, DaemonSet, CronJob) the chart's templates render,
//! and says how many CRDs there are: one added without its line there fails here (issue 46,
//! docs that match the code). Its "Values" table has a row for every value of
//! `charts/spur/values.yaml`, no row for a value that is not there, and the defaults it gives
//! are the chart's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
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

/// The paths of a values file, dotted (`operator.resources.limits.memory`): `leaves` in file
/// order, and `all`, every path (maps too) a row may name.
#[derive(Debug, Default)]
struct ValuePaths {
    leaves: Vec<String>,
    all: BTreeSet<String>,
}

impl ValuePaths {
    fn leaf(&mut self, path: String) {
        self.all.insert(path.clone());
        self.leaves.push(path);
    }
}

/// The paths of a values file as it loads: a map with keys is walked, and an empty map, a list
/// or a scalar (null too) is a leaf.
fn value_paths(text: &str) -> ValuePaths {
    fn walk(prefix: Option<&str>, value: &serde_yaml_ng::Value, out: &mut ValuePaths) {
        match value {
            serde_yaml_ng::Value::Mapping(m) if !m.is_empty() => {
                for (k, v) in m {
                    let key = k.as_str().unwrap_or_else(|| {
                        panic!("values.yaml: a key that is not a string: {k:?}")
                    });
                    let path = prefix.map_or_else(|| key.to_string(), |p| format!("{p}.{key}"));
                    if matches!(v, serde_yaml_ng::Value::Mapping(m) if !m.is_empty()) {
                        out.all.insert(path.clone());
                    }
                    walk(Some(&path), v, out);
                }
            }
            _ => out.leaf(prefix.unwrap_or_default().to_string()),
        }
    }
    let value: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(text).unwrap_or_else(|e| panic!("values.yaml: {e}"));
    let mut out = ValuePaths::default();
    walk(None, &value, &mut out);
    out
}

/// The names the first column of docs/install.md's "Values" table gives, in order: each
/// backticked name of a row, a name starting with `.` taken relative to the parent of that
/// row's previous full name (`traffic.retention.maxAge`, `.maxBytes`).
fn values_table_names() -> Vec<String> {
    values_table_rows()
        .into_iter()
        .flat_map(|(names, _)| names)
        .collect()
}

/// Each row of the "Values" table: the names of its first column (as above) and the backticked
/// values of its second (the defaults, in the same order when there is one per name).
fn values_table_rows() -> Vec<(Vec<String>, Vec<String>)> {
    let install = read(&repo().join("docs/install.md"));
    let (_, rest) = install
        .split_once("\n## Values\n")
        .expect("docs/install.md has a \"## Values\" section");
    let section = rest.split("\n## ").next().unwrap_or_default();
    let mut rows = Vec::new();
    for row in section.lines().filter(|l| l.starts_with("| `")) {
        let mut columns = row.split('|').skip(1);
        let first = columns.next().unwrap_or_default();
        let second = columns.next().unwrap_or_default();
        let mut names = Vec::new();
        let mut full: Option<&str> = None;
        for name in first.split('`').skip(1).step_by(2) {
            if name.starts_with('.') {
                let base = full.unwrap_or_else(|| {
                    panic!("docs/install.md's Values table: `{name}` follows no full name: {row}")
                });
                let parent = base.rsplit_once('.').map_or("", |(p, _)| p);
                names.push(format!("{parent}{name}"));
            } else {
                full = Some(name);
                names.push(name.to_string());
            }
        }
        let defaults = second
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect();
        rows.push((names, defaults));
    }
    rows
}

/// The value at a dotted `path` of values.yaml, if each part is a key.
fn value_at<'a>(values: &'a serde_yaml_ng::Value, path: &str) -> Option<&'a serde_yaml_ng::Value> {
    path.split('.').try_fold(values, |v, key| v.get(key))
}

/// A scalar as install.md writes it: `true`, `7777`, `""`, `IfNotPresent`, `[]`.
fn as_written(v: &serde_yaml_ng::Value) -> Option<String> {
    use serde_yaml_ng::Value;
    match v {
        Value::Bool(b) => Some(b.to_string()),
        Value::Number(n) => Some(n.to_string()),
        Value::String(s) if s.is_empty() => Some("\"\"".into()),
        Value::String(s) => Some(s.clone()),
        Value::Null => Some("null".into()),
        Value::Sequence(s) if s.is_empty() => Some("[]".into()),
        Value::Mapping(m) if m.is_empty() => Some("{}".into()),
        _ => None,
    }
}

#[test]
fn install_md_values_table_defaults_are_the_charts() {
    let values: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&read(&repo().join("charts/spur/values.yaml"))).unwrap();
    let mut checked = 0;
    let mut wrong = Vec::new();
    for (names, defaults) in values_table_rows() {
        // Rows with one backticked default per name; others describe a map ("requests `50m`/…").
        if names.len() != defaults.len() {
            continue;
        }
        for (name, written) in names.iter().zip(&defaults) {
            let Some(actual) = value_at(&values, name).and_then(as_written) else {
                continue;
            };
            checked += 1;
            if *written != actual && *written != format!("\"{actual}\"") {
                wrong.push(format!(
                    "`{name}`: docs/install.md's Values table says `{written}`, charts/spur/values.yaml has `{actual}`: fix the row's default"
                ));
            }
        }
    }
    assert!(checked > 80, "only {checked} defaults compared");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn values_paths_walk_maps_and_stop_at_leaves() {
    let text = "a:\n  b: 1 # c: 2\n  c: {d: x, \"e.f/g\": {h: y}}\n  i: {}\n  j: [\"k#l\", m]\n\
                n:\n  - o: 1\n    p: 2\nq: |\n  r: 3\ns:\nt: \"u: v\"\n";
    let paths = value_paths(text);
    assert_eq!(
        paths.leaves,
        [
            "a.b",
            "a.c.d",
            "a.c.e.f/g.h",
            "a.i",
            "a.j",
            "n",
            "q",
            "s",
            "t"
        ]
    );
    for map in ["a", "a.c", "a.c.e.f/g"] {
        assert!(paths.all.contains(map), "{map} in {:?}", paths.all);
    }
}

#[test]
fn install_md_values_table_covers_every_chart_value() {
    let values = value_paths(&read(&repo().join("charts/spur/values.yaml")));
    // The reader saw the whole file: its first and last values, and a dotted key's.
    for leaf in [
        "image.repository",
        "routeserver.compat.namespaceSelector.matchLabels.spur.dev/routes-api",
        "jobs.resources.limits.memory",
    ] {
        assert!(
            values.leaves.iter().any(|l| l == leaf),
            "values.yaml: no {leaf}"
        );
    }
    let names = values_table_names();
    assert!(
        names.len() > 50,
        "docs/install.md's Values table: {names:?}"
    );
    let named: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    let mut problems = Vec::new();
    for leaf in &values.leaves {
        let documented = leaf
            .match_indices('.')
            .map(|(i, _)| &leaf[..i])
            .chain([leaf.as_str()])
            .any(|path| named.contains(path));
        if !documented {
            problems.push(format!(
                "`{leaf}` (charts/spur/values.yaml) has no row: add a row to docs/install.md's \
                 Values table naming it (or a map above it), with its default and meaning"
            ));
        }
    }
    for name in &names {
        if !values.all.contains(name) {
            problems.push(format!(
                "docs/install.md's Values table names `{name}`, which charts/spur/values.yaml does \
                 not have: rename the row to the value's path or remove it"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
