//! An IstioRoute's status from the VirtualServices a pass wrote, as pure functions.

use kube::core::DynamicObject;
use kube::{Resource, ResourceExt};
use spur_api::mesh::MatchedObject;
use spur_api::{IstioRoute, MeshRouteStatus};

use crate::route_status;

/// The entry of a VirtualService that names the target Service, after the pass put the
/// IstioRoute's `own` routes in it: `user` is how many routes of its own it has, `None` when it
/// was deleted meanwhile.
pub(super) fn matched(vs: &DynamicObject, own: usize, user: Option<usize>) -> MatchedObject {
    MatchedObject {
        kind: "VirtualService".into(),
        namespace: vs.namespace().unwrap_or_default(),
        name: vs.name_any(),
        derived: Vec::new(),
        routed: user.is_some(),
        message: match user {
            Some(n) => format!("{own} route(s) ahead of {n} of its own"),
            None => "deleted meanwhile".into(),
        },
    }
}

/// The status after a pass: `invalid` when the spec is, else the VirtualServices routed.
pub(super) fn status(
    ir: &IstioRoute,
    invalid: Option<&str>,
    matched: Vec<MatchedObject>,
) -> MeshRouteStatus {
    let svc = &ir.spec.target_service;
    let (ready, reason, message) = match (invalid, matched.is_empty()) {
        (Some(e), _) => (false, "Invalid", e.to_owned()),
        (None, true) => (
            false,
            "NoVirtualService",
            format!("no VirtualService names {}.{}", svc.name, svc.namespace),
        ),
        (None, false) => (
            true,
            "Routed",
            format!("routes in {} VirtualService(s)", matched.len()),
        ),
    };
    route_status(
        ir.meta().generation,
        ir.status.as_ref(),
        matched,
        ready,
        reason,
        &message,
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;
    use spur_api::conditions::find_condition;

    use super::*;

    fn ir(status: serde_json::Value) -> IstioRoute {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "IstioRoute",
            "metadata": {"name": "sb1-web", "generation": 2},
            "spec": {"routingKey": "k1", "sandbox": "sb1",
                     "targetService": {"namespace": "shop", "name": "web"},
                     "mappings": [{"fromPort": 80, "toService": "sb1-web", "toPort": 80}]},
            "status": status
        }))
        .unwrap()
    }

    fn vs() -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
            "metadata": {"name": "web", "namespace": "shop"}
        }))
        .unwrap()
    }

    fn ready(st: &MeshRouteStatus) -> (String, String, String) {
        let c = find_condition(&st.conditions, "Ready").unwrap();
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    #[test]
    fn a_routed_virtual_service_says_how_many_routes_go_ahead_of_its_own() {
        let m = matched(&vs(), 1, Some(3));
        assert_eq!(
            (m.kind.as_str(), m.namespace.as_str(), m.name.as_str()),
            ("VirtualService", "shop", "web")
        );
        assert!(m.routed);
        assert_eq!(m.message, "1 route(s) ahead of 3 of its own");
        let gone = matched(&vs(), 1, None);
        assert!(!gone.routed);
        assert_eq!(gone.message, "deleted meanwhile");

        let st = status(&ir(json!({})), None, vec![m]);
        assert_eq!(st.observed_generation, Some(2));
        assert_eq!(st.matched_objects.len(), 1);
        assert_eq!(
            ready(&st),
            (
                "True".into(),
                "Routed".into(),
                "routes in 1 VirtualService(s)".into()
            )
        );
    }

    #[test]
    fn no_virtual_service_or_an_invalid_spec_is_not_ready() {
        let old = json!({"conditions": [{"type": "Other", "status": "True", "reason": "X", "message": "",
                                         "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
        let st = status(&ir(old), None, Vec::new());
        assert_eq!(
            ready(&st),
            (
                "False".into(),
                "NoVirtualService".into(),
                "no VirtualService names web.shop".into()
            )
        );
        assert!(
            find_condition(&st.conditions, "Other").is_some(),
            "other conditions are kept"
        );
        let st = status(
            &ir(json!({})),
            Some("spec.mappings: empty"),
            vec![matched(&vs(), 1, Some(0))],
        );
        assert_eq!(ready(&st).1, "Invalid");
        assert_eq!(ready(&st).2, "spec.mappings: empty");
    }
}
