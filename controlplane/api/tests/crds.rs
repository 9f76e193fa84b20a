//! The CRD manifests under `charts/spur/crds/` are generated from the types and committed. This
//! test regenerates them in memory and fails on any difference; run it with `SPUR_REGENERATE=1`
//! to rewrite the committed files after changing a type.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use spur_api::crdgen;

#[test]
fn committed_crds_are_up_to_date() {
    let dir = crdgen::default_dir();
    if std::env::var_os("SPUR_REGENERATE").is_some() {
        crdgen::write_all(&dir).unwrap();
        return;
    }
    let stale = crdgen::check(&dir).unwrap();
    assert!(
        stale.is_empty(),
        "charts/spur/crds is stale:\n  {}\nrun `SPUR_REGENERATE=1 cargo test -p spur-api --test crds` (or `cargo run -p spur-api --bin spur-crdgen`) and commit the result",
        stale
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n  ")
    );
}

/// Kinds nothing reconciles: documents that a command reads (a SmartTest is read by `spur test
/// run`; its runs get a status when they run in the cluster, docs/smart-tests.md "Not yet"). No
/// status subresource and no readiness column, since nothing would ever fill them.
const DOCUMENTS: &[&str] = &["smarttests.spur.dev"];

#[test]
fn every_kind_has_status_printer_columns_short_name_and_category() {
    for crd in crdgen::crds() {
        let name = crd.metadata.name.clone().unwrap();
        assert_eq!(crd.spec.group, "spur.dev", "{name}");
        let names = &crd.spec.names;
        // `kubectl get spur` lists every kind; the access kinds also answer to
        // `kubectl get spur-access`.
        let categories = names.categories.clone().unwrap_or_default();
        assert_eq!(
            categories.first().map(String::as_str),
            Some("spur"),
            "{name}"
        );
        assert!(
            categories[1..].iter().all(|c| c == "spur-access")
                && (categories.len() == 1) != name.contains("access"),
            "{name}: {categories:?}"
        );
        assert_eq!(names.short_names.as_ref().map(Vec::len), Some(1), "{name}");
        let [version] = &crd.spec.versions[..] else {
            panic!("{name}: one version expected")
        };
        assert_eq!(version.name, "v1alpha1");
        let columns = version.additional_printer_columns.as_ref().unwrap();
        let column_names: Vec<&str> = columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(column_names.last(), Some(&"Age"), "{name}");
        let schema = version
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap();
        assert!(
            schema.description.as_deref().is_some_and(|d| d.len() > 40),
            "{name}"
        );
        if DOCUMENTS.contains(&name.as_str()) {
            assert!(version.subresources.is_none(), "{name}: has a status now");
            continue;
        }
        assert!(
            version.subresources.as_ref().unwrap().status.is_some(),
            "{name}"
        );
        // Jobs end rather than become ready: their column is the phase. An EnvoyConfig's is
        // its cache state (InSync, Rollback, RollbackFailed), a revision's whether it is
        // published.
        assert!(
            ["Ready", "Phase", "State", "Published"]
                .iter()
                .any(|c| column_names.contains(c)),
            "{name}: {column_names:?}"
        );
    }
}

/// The structural-schema rules a kube-apiserver applies that are easy to break from Rust types:
/// every node has a type (unless it preserves unknown fields), no `$ref`, no
/// `additionalProperties: false`, `anyOf`/`oneOf`/`allOf` absent, list-map keys required.
#[test]
fn schemas_are_structural() {
    fn walk(path: &str, v: &serde_json::Value, problems: &mut Vec<String>) {
        let Some(o) = v.as_object() else { return };
        for banned in [
            "$ref",
            "anyOf",
            "oneOf",
            "allOf",
            "not",
            "definitions",
            "$defs",
        ] {
            if o.contains_key(banned) {
                problems.push(format!("{path}: has {banned}"));
            }
        }
        let preserve = o.get("x-kubernetes-preserve-unknown-fields") == Some(&true.into());
        if !o.contains_key("type") && !preserve && !o.contains_key("x-kubernetes-int-or-string") {
            problems.push(format!("{path}: no type"));
        }
        if o.get("additionalProperties") == Some(&false.into()) {
            problems.push(format!("{path}: additionalProperties: false"));
        }
        if o.contains_key("properties") && o.contains_key("additionalProperties") {
            problems.push(format!("{path}: both properties and additionalProperties"));
        }
        if o.get("x-kubernetes-list-type").and_then(|t| t.as_str()) == Some("map") {
            let keys: Vec<&str> = o["x-kubernetes-list-map-keys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap())
                .collect();
            let required: Vec<&str> = o["items"]["required"]
                .as_array()
                .map(|r| r.iter().map(|k| k.as_str().unwrap()).collect())
                .unwrap_or_default();
            for k in keys {
                if !required.contains(&k) {
                    problems.push(format!("{path}: list-map key {k} is not required"));
                }
            }
        }
        if let Some(props) = o.get("properties").and_then(|p| p.as_object()) {
            for (k, p) in props {
                walk(&format!("{path}.{k}"), p, problems);
            }
        }
        if let Some(items) = o.get("items") {
            walk(&format!("{path}[]"), items, problems);
        }
        if let Some(ap) = o.get("additionalProperties") {
            walk(&format!("{path}{{}}"), ap, problems);
        }
    }

    let mut problems = Vec::new();
    for crd in crdgen::crds() {
        let schema = &crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema;
        let v = serde_json::to_value(schema).unwrap();
        walk(crd.metadata.name.as_deref().unwrap(), &v, &mut problems);
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn check_reports_and_write_all_repairs_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let stale = crdgen::check(d).unwrap();
    assert_eq!(stale.len(), crdgen::crds().len());
    assert!(stale.iter().all(|s| matches!(s, crdgen::Stale::Missing(_))));

    crdgen::write_all(d).unwrap();
    assert_eq!(crdgen::check(d).unwrap(), vec![]);
    assert_eq!(
        crdgen::write_all(d).unwrap(),
        Vec::<std::path::PathBuf>::new(),
        "idempotent"
    );

    let sandboxes = d.join("sandboxes.spur.dev.yaml");
    let text = std::fs::read_to_string(&sandboxes).unwrap();
    std::fs::write(&sandboxes, text.replacen("shortNames", "shortnames", 1)).unwrap();
    std::fs::write(d.join("gone.spur.dev.yaml"), "").unwrap();
    std::fs::write(d.join("README.md"), "not ours").unwrap();
    let stale = crdgen::check(d).unwrap();
    assert!(
        matches!(&stale[..], [crdgen::Stale::Differs { file, line }, crdgen::Stale::Extra(extra)]
            if file == "sandboxes.spur.dev.yaml" && *line > 3 && extra == "gone.spur.dev.yaml"),
        "{stale:?}"
    );

    assert_eq!(crdgen::write_all(d).unwrap().len(), 2);
    assert_eq!(crdgen::check(d).unwrap(), vec![]);
    assert!(
        d.join("README.md").exists(),
        "files of other generators are left alone"
    );
    assert!(text.starts_with(crdgen::HEADER));
}
