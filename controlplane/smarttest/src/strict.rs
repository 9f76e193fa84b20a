//! Fields a file names that its type does not have. The spec types read every field they know
//! and leave the others aside, so that a client or an operator of an older release still reads
//! a SmartTest written under a newer CRD (a new kind of step, a new check). A file a person
//! wrote is held to more: a typo (`service:`, `methd:`) must be refused, not silently dropped.
//! The type's JSON schema says which fields exist at each level; a value is walked along it.

use schemars::JsonSchema;
use serde_json::{Map, Value};

/// Most unknown fields listed (the first one is what an error names).
const MAX_LISTED: usize = 16;

/// The paths (`steps[0].http.methd`) of the fields in `value` that `T` does not have, at any
/// depth; empty when there is none. Free-form values (a request's `json`) are not looked into.
pub fn unknown_fields<T: JsonSchema>(value: &Value) -> Vec<String> {
    let schema = serde_json::to_value(schemars::schema_for!(T)).unwrap_or(Value::Null);
    let defs = schema
        .get("$defs")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let mut out = Vec::new();
    walk(&schema, &defs, value, "", &mut out);
    out
}

fn walk(schema: &Value, defs: &Map<String, Value>, value: &Value, at: &str, out: &mut Vec<String>) {
    if out.len() >= MAX_LISTED {
        return;
    }
    // A reference to a definition: `#/$defs/Step`.
    if let Some(name) = schema
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix("#/$defs/"))
    {
        if let Some(def) = defs.get(name) {
            walk(def, defs, value, at, out);
        }
        return;
    }
    // An Option's `anyOf: [T, null]` (and any other union): the branches that are not `null`.
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(branches) = schema.get(key).and_then(Value::as_array) {
            for b in branches {
                if b.get("type").and_then(Value::as_str) != Some("null") {
                    walk(b, defs, value, at, out);
                }
            }
        }
    }
    match value {
        Value::Object(fields) => {
            let Some(props) = schema.get("properties").and_then(Value::as_object) else {
                return;
            };
            for (name, v) in fields {
                let path = if at.is_empty() {
                    name.clone()
                } else {
                    format!("{at}.{name}")
                };
                match props.get(name) {
                    Some(s) => walk(s, defs, v, &path, out),
                    None if out.len() < MAX_LISTED => out.push(path),
                    None => return,
                }
            }
        }
        Value::Array(items) => {
            if let Some(item) = schema.get("items") {
                for (i, v) in items.iter().enumerate() {
                    walk(item, defs, v, &format!("{at}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::TestSpec;

    #[test]
    fn typos_are_found_at_any_depth_and_free_form_values_are_left_alone() {
        let file = serde_json::json!({
            "steps": [
                {"name": "a", "http": {"url": "http://a/", "methd": "GET",
                 "json": {"anything": {"goes": 1}}},
                 "checks": [{"status": 200}, {"jsonPath": {"path": "$.a", "equal": 1}}]},
                {"name": "b", "script": {"command": ["k6"], "env": [{"name": "A", "value": "1", "secret": true}]}},
                {"name": "c", "grpc": {"target": "a:1", "method": "p.S/M"}, "timeoutSecond": 3}
            ],
            "extra": 1
        });
        assert_eq!(
            unknown_fields::<TestSpec>(&file),
            [
                "extra",
                "steps[0].checks[1].jsonPath.equal",
                "steps[0].http.methd",
                "steps[1].script.env[0].secret",
                "steps[2].timeoutSecond",
            ]
        );
        let good = serde_json::json!({"steps": [{"name": "a", "http": {"url": "http://a/"},
            "timeoutSeconds": 3, "checks": [{"header": {"name": "x", "equals": "y"}}]}]});
        assert!(unknown_fields::<TestSpec>(&good).is_empty());
    }
}
