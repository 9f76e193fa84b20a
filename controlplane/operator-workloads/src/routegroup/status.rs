//! A RouteGroup's status from the Sandboxes it matches and its RoutingConfig, as pure
//! functions.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
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

/// Keeps `unmatched_since` (the base of `ttl.offsetFrom: noMatchedSandboxes`): set at `now`
/// when the group first matches no sandbox, cleared while it matches one.
pub(super) fn unmatched(st: &mut RouteGroupStatus, now: Timestamp) {
    if !st.matched_sandboxes.is_empty() {
        st.unmatched_since = None;
    } else if st.unmatched_since.is_none() {
        st.unmatched_since = Some(Time(now));
    }
}

/// When `rg` with status `st` expires under its `spec.ttl`, if it does.
pub(super) fn expiry(rg: &RouteGroup, st: &RouteGroupStatus) -> Option<Timestamp> {
    let ttl = rg.spec.ttl.as_ref()?;
    let created = rg.meta().creation_timestamp.as_ref()?.0;
    let updated = st.updated_at.as_ref().map_or(created, |t| t.0);
    ttl.expires_at(created, updated, st.unmatched_since.as_ref().map(|t| t.0))
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
    fn the_ttl_counts_from_when_the_group_last_matched_nothing_by_default() {
        let t = |s: &str| -> Timestamp { s.parse().unwrap() };
        let mut rg = rg();
        rg.metadata.creation_timestamp = Some(Time(t("2026-01-01T00:00:00Z")));
        let mut st = RouteGroupStatus {
            matched_sandboxes: vec!["a".into()],
            ..RouteGroupStatus::default()
        };
        unmatched(&mut st, t("2026-01-02T00:00:00Z"));
        assert_eq!(expiry(&rg, &st), None, "no ttl");
        rg.spec.ttl = Some(serde_json::from_value(serde_json::json!({"duration": "10m"})).unwrap());
        assert_eq!(expiry(&rg, &st), None, "lives while it matches a sandbox");
        st.matched_sandboxes.clear();
        unmatched(&mut st, t("2026-01-02T00:00:00Z"));
        unmatched(&mut st, t("2026-01-03T00:00:00Z"));
        assert_eq!(
            expiry(&rg, &st),
            Some(t("2026-01-02T00:10:00Z")),
            "from the first pass that matched nothing"
        );
        st.matched_sandboxes = vec!["b".into()];
        unmatched(&mut st, t("2026-01-04T00:00:00Z"));
        assert_eq!(
            (st.unmatched_since.as_ref(), expiry(&rg, &st)),
            (None, None)
        );
        rg.spec.ttl = Some(
            serde_json::from_value(
                serde_json::json!({"duration": "1h", "offsetFrom": "createdAt"}),
            )
            .unwrap(),
        );
        assert_eq!(expiry(&rg, &st), Some(t("2026-01-01T01:00:00Z")));
        st.updated_at = Some(Time(t("2026-01-05T00:00:00Z")));
        rg.spec.ttl.as_mut().unwrap().offset_from = spur_api::RouteGroupTtlOffset::UpdatedAt;
        assert_eq!(expiry(&rg, &st), Some(t("2026-01-05T01:00:00Z")));
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
