//! Patches a fork's Deployment with the user's `customizations.patch`: JSON Patch (RFC 6902),
//! JSON merge patch (RFC 7386) or Kubernetes strategic merge patch.
//!
//! Strategic merge is implemented here for the workload objects a Sandbox forks (Deployment,
//! Rollout): keyed lists merge element by element on the patch-merge keys Kubernetes declares
//! for the Pod API (`containers` by `name`, `ports` by `containerPort`, `volumeMounts` by
//! `mountPath`, …); other lists are replaced, as the API server does for lists without a merge
//! key. The directives `$patch: replace|delete|merge` (on maps and list elements),
//! `$deleteFromPrimitiveList/<field>` and `$setElementOrder/<field>` (accepted, order is kept as
//! merged) are supported; `$retainKeys` is rejected with a clear error rather than half-applied.

use serde_json::{Map, Value};

/// Why a patch could not be applied. The message names the offending path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PatchError(pub String);

/// The kind of patch, as in `kubectl patch --type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Strategic,
    Merge,
    Json,
}

/// Applies `patch` of `kind` to `target` (a whole object as JSON).
pub fn apply(target: &mut Value, kind: PatchType, patch: &Value) -> Result<(), PatchError> {
    match kind {
        PatchType::Json => {
            let ops: json_patch::Patch = serde_json::from_value(patch.clone())
                .map_err(|e| PatchError(format!("invalid JSON patch: {e}")))?;
            json_patch::patch(target, &ops).map_err(|e| PatchError(format!("JSON patch: {e}")))
        }
        PatchType::Merge => {
            if !patch.is_object() {
                return Err(PatchError("a merge patch must be an object".into()));
            }
            json_patch::merge(target, patch);
            Ok(())
        }
        PatchType::Strategic => {
            let Value::Object(p) = patch else {
                return Err(PatchError(
                    "a strategic merge patch must be an object".into(),
                ));
            };
            let Value::Object(t) = target else {
                return Err(PatchError("the patched object is not a map".into()));
            };
            merge_map(t, p, "")
        }
    }
}

/// The patch-merge key of a list field of the Pod template API, by field name.
fn merge_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "containers" | "initContainers" | "ephemeralContainers" => "name",
        "env" | "volumes" | "imagePullSecrets" | "resourceClaims" | "schedulingGates" => "name",
        "ports" => "containerPort",
        "volumeMounts" => "mountPath",
        "volumeDevices" => "devicePath",
        "hostAliases" => "ip",
        "topologySpreadConstraints" => "topologyKey",
        _ => return None,
    })
}

fn merge_map(
    target: &mut Map<String, Value>,
    patch: &Map<String, Value>,
    path: &str,
) -> Result<(), PatchError> {
    match patch.get("$patch").and_then(Value::as_str) {
        None | Some("merge") => {}
        Some("replace") => {
            let mut replaced = patch.clone();
            replaced.remove("$patch");
            *target = replaced;
            return Ok(());
        }
        Some("delete") => {
            target.clear();
            return Ok(());
        }
        Some(other) => {
            return Err(PatchError(format!(
                "{path}: unknown $patch directive {other:?}"
            )));
        }
    }
    for (key, value) in patch {
        if key == "$patch" || key.starts_with("$setElementOrder/") {
            continue;
        }
        if key == "$retainKeys" {
            return Err(PatchError(format!("{path}: $retainKeys is not supported")));
        }
        if let Some(field) = key.strip_prefix("$deleteFromPrimitiveList/") {
            let Value::Array(remove) = value else {
                return Err(PatchError(format!("{path}.{key}: expected a list")));
            };
            if let Some(Value::Array(list)) = target.get_mut(field) {
                list.retain(|v| !remove.contains(v));
            }
            continue;
        }
        if key.starts_with('$') {
            return Err(PatchError(format!("{path}: unknown directive {key:?}")));
        }
        let child = format!("{path}.{key}");
        match value {
            Value::Null => {
                target.remove(key);
            }
            Value::Object(p) => match target.get_mut(key) {
                Some(Value::Object(t)) => merge_map(t, p, &child)?,
                _ => {
                    let mut fresh = Map::new();
                    merge_map(&mut fresh, p, &child)?;
                    target.insert(key.clone(), Value::Object(fresh));
                }
            },
            Value::Array(p) => match merge_key(key) {
                Some(mk) => {
                    let list = target
                        .entry(key.clone())
                        .or_insert_with(|| Value::Array(Vec::new()));
                    if !list.is_array() {
                        *list = Value::Array(Vec::new());
                    }
                    if let Value::Array(t) = list {
                        merge_keyed_list(t, p, mk, &child)?;
                    }
                }
                None => {
                    target.insert(key.clone(), Value::Array(strip_directives(p)));
                }
            },
            v => {
                target.insert(key.clone(), v.clone());
            }
        }
    }
    Ok(())
}

fn merge_keyed_list(
    target: &mut Vec<Value>,
    patch: &[Value],
    key: &str,
    path: &str,
) -> Result<(), PatchError> {
    // `[{"$patch": "replace"}, …]` replaces the whole list with the other elements.
    if patch
        .iter()
        .any(|e| e.get("$patch").and_then(Value::as_str) == Some("replace") && e.get(key).is_none())
    {
        *target = strip_directives(
            &patch
                .iter()
                .filter(|e| e.get("$patch").is_none())
                .cloned()
                .collect::<Vec<_>>(),
        );
        return Ok(());
    }
    for element in patch {
        let Value::Object(p) = element else {
            return Err(PatchError(format!(
                "{path}: elements must be maps with a {key:?} field"
            )));
        };
        let Some(id) = p.get(key) else {
            return Err(PatchError(format!(
                "{path}: an element has no {key:?} field"
            )));
        };
        let pos = target.iter().position(|t| t.get(key) == Some(id));
        let delete = p.get("$patch").and_then(Value::as_str) == Some("delete");
        match (pos, delete) {
            (Some(i), true) => {
                target.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => {
                if let Some(Value::Object(t)) = target.get_mut(i) {
                    merge_map(t, p, &format!("{path}[{key}={id}]"))?;
                }
            }
            (None, false) => {
                let mut fresh = Map::new();
                merge_map(&mut fresh, p, &format!("{path}[{key}={id}]"))?;
                target.push(Value::Object(fresh));
            }
        }
    }
    Ok(())
}

fn strip_directives(list: &[Value]) -> Vec<Value> {
    list.iter()
        .map(|v| match v {
            Value::Object(m) => Value::Object(
                m.iter()
                    .filter(|(k, _)| !k.starts_with('$'))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            ),
            v => v.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn deployment() -> Value {
        json!({
            "spec": {"replicas": 2, "template": {"spec": {
                "containers": [
                    {"name": "app", "image": "app:1", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                     "ports": [{"containerPort": 8080}], "args": ["--x", "--y"]},
                    {"name": "side", "image": "side:1"}
                ],
                "tolerations": [{"key": "a"}]
            }}}
        })
    }

    #[test]
    fn strategic_merges_keyed_lists_and_replaces_others() {
        let mut d = deployment();
        let patch = json!({"spec": {"template": {"spec": {
            "containers": [
                {"name": "app", "image": "app:2", "env": [{"name": "B", "$patch": "delete"}, {"name": "C", "value": "3"}]},
                {"name": "new", "image": "new:1"}
            ],
            "tolerations": [{"key": "b"}]
        }}}});
        apply(&mut d, PatchType::Strategic, &patch).unwrap();
        let spec = &d["spec"]["template"]["spec"];
        assert_eq!(spec["containers"][0]["image"], "app:2");
        assert_eq!(
            spec["containers"][0]["env"],
            json!([{"name": "A", "value": "1"}, {"name": "C", "value": "3"}])
        );
        assert_eq!(
            spec["containers"][0]["ports"],
            json!([{"containerPort": 8080}]),
            "untouched"
        );
        assert_eq!(spec["containers"][1]["image"], "side:1");
        assert_eq!(spec["containers"][2]["name"], "new");
        assert_eq!(
            spec["tolerations"],
            json!([{"key": "b"}]),
            "no merge key: replaced"
        );
        assert_eq!(d["spec"]["replicas"], 2);
    }

    #[test]
    fn strategic_directives() {
        let mut d = deployment();
        let patch = json!({"spec": {"replicas": null, "template": {"spec": {
            "containers": [{"name": "side", "$patch": "delete"}, {"name": "app", "$deleteFromPrimitiveList/args": ["--x"]}]
        }}}});
        apply(&mut d, PatchType::Strategic, &patch).unwrap();
        assert!(d["spec"].get("replicas").is_none());
        let containers = d["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap();
        assert_eq!(containers.len(), 1);
        assert_eq!(containers[0]["args"], json!(["--y"]));

        let mut d = deployment();
        let patch = json!({"spec": {"template": {"spec": {"containers": [{"$patch": "replace"}, {"name": "only", "image": "o:1"}]}}}});
        apply(&mut d, PatchType::Strategic, &patch).unwrap();
        assert_eq!(
            d["spec"]["template"]["spec"]["containers"],
            json!([{"name": "only", "image": "o:1"}])
        );

        let mut d = deployment();
        let patch =
            json!({"spec": {"template": {"spec": {"$patch": "replace", "containers": []}}}});
        apply(&mut d, PatchType::Strategic, &patch).unwrap();
        assert_eq!(d["spec"]["template"]["spec"], json!({"containers": []}));
    }

    #[test]
    fn strategic_errors_name_the_path() {
        let mut d = deployment();
        let bad = json!({"spec": {"template": {"spec": {"containers": [{"image": "x"}]}}}});
        let e = apply(&mut d, PatchType::Strategic, &bad).unwrap_err();
        assert!(
            e.0.contains(".spec.template.spec.containers") && e.0.contains("\"name\""),
            "{e}"
        );
        let e = apply(
            &mut d,
            PatchType::Strategic,
            &json!({"spec": {"$retainKeys": []}}),
        )
        .unwrap_err();
        assert!(e.0.contains("$retainKeys"), "{e}");
        let e = apply(&mut d, PatchType::Strategic, &json!([1])).unwrap_err();
        assert!(e.0.contains("object"), "{e}");
    }

    #[test]
    fn json_and_merge_patches() {
        let mut d = deployment();
        let ops = json!([{"op": "replace", "path": "/spec/replicas", "value": 1}]);
        apply(&mut d, PatchType::Json, &ops).unwrap();
        assert_eq!(d["spec"]["replicas"], 1);
        let e = apply(
            &mut d,
            PatchType::Json,
            &json!([{"op": "remove", "path": "/nope"}]),
        )
        .unwrap_err();
        assert!(e.0.starts_with("JSON patch"), "{e}");
        assert!(apply(&mut d, PatchType::Json, &json!({"op": "x"})).is_err());

        apply(
            &mut d,
            PatchType::Merge,
            &json!({"spec": {"template": {"spec": {"tolerations": null}}}}),
        )
        .unwrap();
        assert!(d["spec"]["template"]["spec"].get("tolerations").is_none());
        assert!(apply(&mut d, PatchType::Merge, &json!("x")).is_err());
    }
}
