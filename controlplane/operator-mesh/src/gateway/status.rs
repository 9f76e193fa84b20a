//! A GatewayAPIRoute's status from what a pass derived, as pure functions.

use kube::{Resource, ResourceExt};
use spur_api::mesh::{MAX_MATCHED_OBJECTS, MatchedObject};
use spur_api::{GatewayAPIRoute, MeshRouteStatus};

use super::desired::Derived;
use crate::route_status;

/// The status after a pass: `invalid` when the spec is, else the user routes derived from (at
/// most [`MAX_MATCHED_OBJECTS`] listed; every one counts for `Ready`).
pub(super) fn status(
    gr: &GatewayAPIRoute,
    invalid: Option<&str>,
    derived: &[Derived],
) -> MeshRouteStatus {
    let matched: Vec<MatchedObject> = derived
        .iter()
        .take(MAX_MATCHED_OBJECTS)
        .map(matched)
        .collect();
    let failed = derived.iter().filter(|d| !d.problems.is_empty()).count();
    let svc = &gr.spec.target_service;
    let (ready, reason, message) = match (invalid, matched.is_empty(), failed) {
        (Some(e), _, _) => (false, "Invalid", e.to_owned()),
        (None, true, _) => (
            false,
            "NoHTTPRoute",
            format!(
                "no HTTPRoute has a backendRef to Service {}/{}",
                svc.namespace, svc.name
            ),
        ),
        (None, false, 0) => (
            true,
            "Routed",
            format!("routes derived from {} HTTPRoute(s)", matched.len()),
        ),
        (None, false, n) => (
            false,
            "NotDerivable",
            format!("{n} HTTPRoute(s) could not be derived from: see matchedObjects"),
        ),
    };
    route_status(
        gr.meta().generation,
        gr.status.as_ref(),
        matched,
        ready,
        reason,
        &message,
    )
}

/// A user route's entry in `matchedObjects`.
fn matched(d: &Derived) -> MatchedObject {
    let names: Vec<String> = d.routes.iter().map(ResourceExt::name_any).collect();
    let mut message = format!("{} route(s) derived", names.len());
    for p in &d.problems {
        message.push_str("; ");
        message.push_str(p);
    }
    MatchedObject {
        kind: "HTTPRoute".into(),
        namespace: d.namespace.clone(),
        name: d.name.clone(),
        routed: !names.is_empty() && d.problems.is_empty(),
        derived: names,
        message,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use kube::core::DynamicObject;
    use serde_json::json;
    use spur_api::conditions::find_condition;

    use super::*;

    fn gar() -> GatewayAPIRoute {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "GatewayAPIRoute",
            "metadata": {"name": "sb1-web", "generation": 4},
            "spec": {"routingKey": "k1", "sandbox": "sb1",
                     "targetService": {"namespace": "shop", "name": "web"},
                     "mappings": [{"fromPort": 80, "toService": "sb1-web", "toPort": 80}]}
        }))
        .unwrap()
    }

    fn derived(name: &str, routes: &[&str], problems: &[&str]) -> Derived {
        Derived {
            namespace: "shop".into(),
            name: name.into(),
            routes: routes
                .iter()
                .map(|r| {
                    serde_json::from_value::<DynamicObject>(json!({
                        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                        "metadata": {"name": r, "namespace": "shop"}
                    }))
                    .unwrap()
                })
                .collect(),
            problems: problems.iter().map(|p| (*p).to_owned()).collect(),
        }
    }

    fn ready(st: &MeshRouteStatus) -> (String, String, String) {
        let c = find_condition(&st.conditions, "Ready").unwrap();
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    #[test]
    fn routes_derived_from_every_user_route_make_it_ready() {
        let st = status(&gar(), None, &[derived("shop", &["d1"], &[])]);
        assert_eq!(st.observed_generation, Some(4));
        assert_eq!(
            ready(&st),
            (
                "True".into(),
                "Routed".into(),
                "routes derived from 1 HTTPRoute(s)".into()
            )
        );
        let m = &st.matched_objects[0];
        assert_eq!(
            (m.kind.as_str(), m.name.as_str(), m.routed),
            ("HTTPRoute", "shop", true)
        );
        assert_eq!(m.derived, ["d1"]);
        assert_eq!(m.message, "1 route(s) derived");
    }

    #[test]
    fn a_port_that_cannot_be_derived_is_reported_per_route() {
        let st = status(
            &gar(),
            None,
            &[
                derived("a", &["d1"], &[]),
                derived("b", &[], &["port 80: would need 130 matches"]),
            ],
        );
        let (status, reason, message) = ready(&st);
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("False", "NotDerivable")
        );
        assert_eq!(
            message,
            "1 HTTPRoute(s) could not be derived from: see matchedObjects"
        );
        let b = &st.matched_objects[1];
        assert!(!b.routed);
        assert_eq!(
            b.message,
            "0 route(s) derived; port 80: would need 130 matches"
        );
    }

    #[test]
    fn no_user_route_or_an_invalid_spec_is_not_ready() {
        let st = status(&gar(), None, &[]);
        assert_eq!(ready(&st).1, "NoHTTPRoute");
        assert_eq!(
            ready(&st).2,
            "no HTTPRoute has a backendRef to Service shop/web"
        );
        let st = status(
            &gar(),
            Some("spec.mappings: empty"),
            &[derived("a", &["d1"], &[])],
        );
        assert_eq!(ready(&st).1, "Invalid");
        assert_eq!(ready(&st).2, "spec.mappings: empty");
    }

    #[test]
    fn at_most_the_cap_is_listed() {
        let many: Vec<Derived> = (0..MAX_MATCHED_OBJECTS + 3)
            .map(|i| derived(&format!("r{i}"), &["d"], &[]))
            .collect();
        let st = status(&gar(), None, &many);
        assert_eq!(st.matched_objects.len(), MAX_MATCHED_OBJECTS);
    }
}
