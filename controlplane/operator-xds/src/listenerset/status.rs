//! The part of a ListenerSet's status the operator owns, as pure functions of its spec and
//! the EndpointSlices of its endpoint Services.

use std::collections::BTreeMap;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::{Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, set_now};
use spur_api::listenerset::{Cluster, ListenerStatus, conditions, endpoint_service_name};
use spur_api::{ListenerSet, ListenerSetStatus};

use super::SERVICE_NAME_LABEL;

/// The fields of `status` the operator owns: everything but `gateways`, which the route server
/// writes. Applying this leaves `gateways` to its managers.
pub(super) fn owned(status: Option<&ListenerSetStatus>) -> ListenerSetStatus {
    let st = status.cloned().unwrap_or_default();
    ListenerSetStatus {
        gateways: Vec::new(),
        ..st
    }
}

/// An invalid spec (`message` says why): no listener is followed.
pub(super) fn invalid(st: &mut ListenerSetStatus, ls: &ListenerSet, message: &str) {
    st.listeners.clear();
    set(
        st,
        ls,
        conditions::READY,
        ConditionStatus::False,
        "Invalid",
        message,
    );
    set(
        st,
        ls,
        conditions::ENDPOINTS_READY,
        ConditionStatus::Unknown,
        "Invalid",
        "the spec is invalid (see Ready)",
    );
}

/// `status.listeners[]`: each listener's endpoints and how many are ready.
pub(super) fn listeners(ls: &ListenerSet, slices: &[EndpointSlice]) -> Vec<ListenerStatus> {
    let name = ls.name_any();
    ls.spec
        .listeners
        .iter()
        .map(|l| {
            let (endpoints, ready) = count_endpoints(&name, &l.cluster, slices);
            ListenerStatus {
                name: l.name.clone(),
                endpoints,
                ready,
            }
        })
        .collect()
}

/// `Ready` (the Services are applied, unless `conflict` says why the client Service is not)
/// and `EndpointsReady` (every listener's cluster has a ready endpoint) from `st.listeners`.
pub(super) fn conditions(st: &mut ListenerSetStatus, ls: &ListenerSet, conflict: Option<&str>) {
    match conflict {
        Some(message) => set(
            st,
            ls,
            conditions::READY,
            ConditionStatus::False,
            "ServiceConflict",
            message,
        ),
        None => set(
            st,
            ls,
            conditions::READY,
            ConditionStatus::True,
            "ServicesApplied",
            "",
        ),
    }
    let mut empty: Vec<&str> = ls
        .spec
        .listeners
        .iter()
        .zip(&st.listeners)
        .filter(|(_, s)| s.ready == 0)
        .map(|(l, _)| l.cluster.name.as_str())
        .collect();
    empty.dedup();
    if empty.is_empty() {
        set(
            st,
            ls,
            conditions::ENDPOINTS_READY,
            ConditionStatus::True,
            "EndpointsReady",
            "",
        );
    } else {
        let message = format!("no ready endpoint in cluster {}", empty.join(", "));
        set(
            st,
            ls,
            conditions::ENDPOINTS_READY,
            ConditionStatus::False,
            "NoReadyEndpoints",
            &message,
        );
    }
}

fn set(
    st: &mut ListenerSetStatus,
    ls: &ListenerSet,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    set_now(
        &mut st.conditions,
        ls.meta().generation,
        type_,
        status,
        reason,
        message,
    );
}

pub(super) fn reason_of<'a>(st: &'a ListenerSetStatus, type_: &str) -> Option<&'a str> {
    st.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.reason.as_str())
}

/// Endpoints of `cluster` (of set `set`) and how many are ready: the pods in the EndpointSlices
/// of its selector entries (a pod in two slices, or picked by two entries, counts once; ready
/// unless its slice says `ready: false`), one for each address and each DNS name (the gateways
/// resolve those; they count as ready here, their health is in `status.gateways`).
pub fn count_endpoints(set: &str, cluster: &Cluster, slices: &[EndpointSlice]) -> (u32, u32) {
    let mut seen: BTreeMap<String, bool> = BTreeMap::new();
    for (i, e) in cluster.endpoints.iter().enumerate() {
        if e.selector.is_some() {
            let svc = endpoint_service_name(set, &cluster.name, i);
            let of_service = slices
                .iter()
                .filter(|s| s.labels().get(SERVICE_NAME_LABEL) == Some(&svc));
            for ep in of_service.flat_map(|s| &s.endpoints) {
                let id = match (&ep.target_ref, ep.addresses.first()) {
                    (Some(r), _) if r.name.is_some() => {
                        format!("pod/{}", r.name.as_deref().unwrap_or_default())
                    }
                    (_, Some(a)) => format!("ip/{a}"),
                    _ => continue,
                };
                let ready = ep.conditions.as_ref().and_then(|c| c.ready) != Some(false);
                *seen.entry(id).or_insert(false) |= ready;
            }
        } else if let Some(a) = &e.address {
            seen.insert(format!("address/{a}:{}", e.port), true);
        } else if let Some(d) = &e.dns_name {
            seen.insert(format!("dns/{d}:{}", e.port), true);
        }
    }
    let total = u32::try_from(seen.len()).unwrap_or(u32::MAX);
    let ready = u32::try_from(seen.values().filter(|r| **r).count()).unwrap_or(u32::MAX);
    (total, ready)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::desired::tests::{set, spec};
    use super::*;
    use serde_json::json;

    #[test]
    fn endpoints_are_counted_once_and_by_readiness() {
        let ls = set(spec());
        let slice = |svc: String, eps: serde_json::Value| -> EndpointSlice {
            serde_json::from_value(json!({
                "metadata": {"name": format!("{svc}-x"), "namespace": "shop",
                             "labels": {SERVICE_NAME_LABEL: svc}},
                "addressType": "IPv4", "endpoints": eps,
            }))
            .unwrap()
        };
        let pod = |name: &str, ip: &str, ready: Option<bool>| {
            json!({"addresses": [ip], "targetRef": {"kind": "Pod", "name": name},
                   "conditions": ready.map_or(json!({}), |r| json!({"ready": r}))})
        };
        let first = endpoint_service_name("media", "media", 0);
        let second = endpoint_service_name("media", "media", 2);
        let slices = vec![
            slice(
                first.clone(),
                json!([
                    pod("m-0", "10.1.0.1", Some(true)),
                    pod("m-1", "10.1.0.2", Some(false))
                ]),
            ),
            // The same pod in a second slice of the Service, and through the second entry.
            slice(first, json!([pod("m-0", "10.1.0.1", None)])),
            slice(
                second,
                json!([
                    pod("m-0", "10.1.0.1", Some(true)),
                    pod("m-2", "10.1.0.3", None)
                ]),
            ),
            // Another Service's slice does not count.
            slice("other".into(), json!([pod("x", "10.9.0.1", Some(true))])),
        ];
        // m-0, m-1 (not ready), m-2 (no condition: ready), the address.
        assert_eq!(
            count_endpoints("media", &ls.spec.listeners[0].cluster, &slices),
            (4, 3)
        );
        // A DNS name counts once, as ready.
        assert_eq!(
            count_endpoints("media", &ls.spec.listeners[1].cluster, &slices),
            (1, 1)
        );
        assert_eq!(
            count_endpoints("media", &ls.spec.listeners[0].cluster, &[]),
            (1, 1)
        );
    }

    #[test]
    fn only_the_operators_status_fields_are_applied() {
        let st: ListenerSetStatus = serde_json::from_value(json!({
            "observedGeneration": 2,
            "listeners": [{"name": "rtp", "endpoints": 1, "ready": 1}],
            "gateways": [{"pod": "gw-0", "updatedAt": "2026-01-01T00:00:00Z"}],
        }))
        .unwrap();
        let body = serde_json::to_value(owned(Some(&st))).unwrap();
        assert!(body.get("gateways").is_none(), "{body}");
        assert_eq!(body["listeners"][0]["name"], "rtp");
    }

    /// (status, reason, message) of condition `type_`.
    fn cond(st: &ListenerSetStatus, type_: &str) -> (String, String, String) {
        let c = st.conditions.iter().find(|c| c.type_ == type_).unwrap();
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    #[test]
    fn listeners_and_conditions_follow_the_endpoints() {
        let ls = set(spec());
        // No slice yet: the address and the DNS name count, the pods do not.
        let mut st = ListenerSetStatus {
            listeners: listeners(&ls, &[]),
            ..ListenerSetStatus::default()
        };
        let got: Vec<_> = st
            .listeners
            .iter()
            .map(|l| (l.name.as_str(), l.endpoints, l.ready))
            .collect();
        assert_eq!(got, [("rtp", 1, 1), ("sip", 1, 1)]);
        conditions(&mut st, &ls, None);
        assert_eq!(
            cond(&st, conditions::READY),
            ("True".into(), "ServicesApplied".into(), String::new())
        );
        assert_eq!(cond(&st, conditions::ENDPOINTS_READY).1, "EndpointsReady");
        assert!(
            st.conditions
                .iter()
                .all(|c| c.observed_generation == Some(3))
        );

        st.listeners[0].ready = 0;
        st.listeners[1].ready = 0;
        conditions(&mut st, &ls, Some("Service media is someone else's"));
        assert_eq!(
            cond(&st, conditions::READY),
            (
                "False".into(),
                "ServiceConflict".into(),
                "Service media is someone else's".into()
            )
        );
        assert_eq!(
            cond(&st, conditions::ENDPOINTS_READY),
            (
                "False".into(),
                "NoReadyEndpoints".into(),
                "no ready endpoint in cluster media, sip".into()
            )
        );
        assert_eq!(reason_of(&st, conditions::READY), Some("ServiceConflict"));
        assert_eq!(reason_of(&st, "Other"), None);
    }

    #[test]
    fn an_invalid_spec_clears_the_listeners() {
        let ls = set(spec());
        let mut st = ListenerSetStatus {
            listeners: listeners(&ls, &[]),
            ..ListenerSetStatus::default()
        };
        invalid(&mut st, &ls, "listener rtp: port 0");
        assert!(st.listeners.is_empty());
        assert_eq!(
            cond(&st, conditions::READY),
            (
                "False".into(),
                "Invalid".into(),
                "listener rtp: port 0".into()
            )
        );
        assert_eq!(
            cond(&st, conditions::ENDPOINTS_READY),
            (
                "Unknown".into(),
                "Invalid".into(),
                "the spec is invalid (see Ready)".into()
            )
        );
    }
}
