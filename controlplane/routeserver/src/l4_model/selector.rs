//! Kubernetes label selectors (`matchLabels` and `matchExpressions`), matched against a pod's
//! labels the way the API server does, to find the ListenerSets a gateway pod serves.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Whether `labels` satisfy `selector`: every `matchLabels` pair and every expression. An empty
/// selector matches every pod (as in Kubernetes). An expression with an unknown operator, or
/// `In`/`NotIn` without values, matches nothing: such a selector is invalid (admission refuses
/// it), and an invalid selector must not turn into "every pod".
pub(crate) fn matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let pairs = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    pairs
        && selector.match_expressions.iter().flatten().all(|e| {
            let have = labels.get(&e.key);
            let values = e.values.as_deref().unwrap_or_default();
            match e.operator.as_str() {
                "In" => !values.is_empty() && have.is_some_and(|v| values.contains(v)),
                "NotIn" => !values.is_empty() && have.is_none_or(|v| !values.contains(v)),
                "Exists" => values.is_empty() && have.is_some(),
                "DoesNotExist" => values.is_empty() && have.is_none(),
                _ => false,
            }
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn sel(json: serde_json::Value) -> LabelSelector {
        serde_json::from_value(json).unwrap()
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn match_labels_and_expressions() {
        let pod = labels(&[("app", "gw"), ("tier", "edge")]);
        assert!(matches(&sel(serde_json::json!({})), &pod));
        assert!(matches(
            &sel(serde_json::json!({"matchLabels": {"app": "gw"}})),
            &pod
        ));
        assert!(!matches(
            &sel(serde_json::json!({"matchLabels": {"app": "gx"}})),
            &pod
        ));
        assert!(!matches(
            &sel(serde_json::json!({"matchLabels": {"app": "gw", "zone": "a"}})),
            &pod
        ));
        let expr = |op: &str, values: &[&str]| {
            sel(
                serde_json::json!({"matchLabels": {"app": "gw"}, "matchExpressions": [
                    {"key": "tier", "operator": op, "values": values}
                ]}),
            )
        };
        assert!(matches(&expr("In", &["edge", "core"]), &pod));
        assert!(!matches(&expr("In", &["core"]), &pod));
        assert!(!matches(&expr("In", &[]), &pod), "In needs values");
        assert!(matches(&expr("NotIn", &["core"]), &pod));
        assert!(!matches(&expr("NotIn", &["edge"]), &pod));
        assert!(matches(&expr("Exists", &[]), &pod));
        assert!(
            !matches(&expr("Exists", &["x"]), &pod),
            "Exists takes no values"
        );
        assert!(!matches(&expr("DoesNotExist", &[]), &pod));
        assert!(!matches(&expr("Gt", &["1"]), &pod), "unknown operator");
        let absent = |op: &str, values: &[&str]| {
            sel(serde_json::json!({"matchExpressions": [
                {"key": "zone", "operator": op, "values": values}
            ]}))
        };
        assert!(
            matches(&absent("NotIn", &["a"]), &pod),
            "absent key is not in"
        );
        assert!(matches(&absent("DoesNotExist", &[]), &pod));
        assert!(!matches(&absent("In", &["a"]), &pod));
    }
}
