//! A RouteGroup's status from the Sandboxes it matches and its RoutingConfig, as pure
//! functions.

use kube::{Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, READY, is_condition_true, set_now};
use spur_api::{RouteGroup, RouteGroupStatus, Sandbox};

/// The status of a RouteGroup whose spec is invalid (`message` says why): it matches nothing.
pub(super) fn invalid(st: &mut RouteGroupStatus, rg: &RouteGroup, key: &str, message: &str) {
    st.routing_key = Some(key.to_owned());
    st.matched_sandboxes.clear();
    st.ready_sandboxes = 0;
    condition(st, rg, ConditionStatus::False, "Invalid", message);
}

/// The status of a RouteGroup with key `key` that matches `matched`, its RoutingConfig
/// `routed` or not: Ready once some Sandbox matches and all of them are ready and routed.
pub(super) fn observed(
    st: &mut RouteGroupStatus,
    rg: &RouteGroup,
    key: &str,
    matched: &[&Sandbox],
    routed: bool,
) {
    let ready = matched
        .iter()
        .filter(|sb| {
            sb.status
                .as_ref()
                .is_some_and(|st| is_condition_true(&st.conditions, READY))
        })
        .count();
    let total = matched.len();
    st.routing_key = Some(key.to_owned());
    st.matched_sandboxes = matched.iter().map(|sb| sb.name_any()).collect();
    st.ready_sandboxes = i32::try_from(ready).unwrap_or(i32::MAX);
    let (status, reason, message) = if total == 0 {
        (
            ConditionStatus::False,
            "NoSandboxes",
            "no sandbox matches".to_string(),
        )
    } else if routed && ready == total {
        (
            ConditionStatus::True,
            "Ready",
            format!("{total} sandbox(es) matched, all ready and routed"),
        )
    } else {
        (
            ConditionStatus::False,
            "NotReady",
            format!("{ready} of {total} matched sandbox(es) ready; routes published: {routed}"),
        )
    };
    condition(st, rg, status, reason, &message);
}

fn condition(
    st: &mut RouteGroupStatus,
    rg: &RouteGroup,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    set_now(
        &mut st.conditions,
        rg.meta().generation,
        READY,
        status,
        reason,
        message,
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use spur_api::conditions::find_condition;

    use super::super::desired::tests::{rg, sandbox};
    use super::*;

    fn ready(st: &RouteGroupStatus) -> (&str, &str, &str) {
        let c = find_condition(&st.conditions, READY).unwrap();
        (&c.status, &c.reason, &c.message)
    }

    #[test]
    fn ready_once_every_matched_sandbox_is_ready_and_routed() {
        let (rg, a, b) = (rg(), sandbox("a", "a", true), sandbox("b", "a", false));
        let mut st = RouteGroupStatus::default();
        observed(&mut st, &rg, "k1", &[&a, &b], true);
        assert_eq!(
            ready(&st),
            (
                "False",
                "NotReady",
                "1 of 2 matched sandbox(es) ready; routes published: true"
            )
        );
        assert_eq!(st.matched_sandboxes, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(st.ready_sandboxes, 1);
        observed(&mut st, &rg, "k1", &[&a], false);
        assert_eq!(ready(&st).1, "NotReady", "not routed yet");
        observed(&mut st, &rg, "k1", &[&a], true);
        assert_eq!(
            ready(&st),
            (
                "True",
                "Ready",
                "1 sandbox(es) matched, all ready and routed"
            )
        );
        assert_eq!(st.routing_key.as_deref(), Some("k1"));
        let c = find_condition(&st.conditions, READY).unwrap();
        assert_eq!(c.observed_generation, Some(2));
    }

    #[test]
    fn no_match_is_not_ready() {
        let mut st = RouteGroupStatus::default();
        observed(&mut st, &rg(), "k1", &[], true);
        assert_eq!(ready(&st), ("False", "NoSandboxes", "no sandbox matches"));
    }

    #[test]
    fn an_invalid_group_matches_nothing() {
        let (rg, a) = (rg(), sandbox("a", "a", true));
        let mut st = RouteGroupStatus::default();
        observed(&mut st, &rg, "k1", &[&a], true);
        invalid(&mut st, &rg, "k1", "spec.selector: empty");
        assert!(st.matched_sandboxes.is_empty());
        assert_eq!(st.ready_sandboxes, 0);
        assert_eq!(ready(&st), ("False", "Invalid", "spec.selector: empty"));
    }
}
