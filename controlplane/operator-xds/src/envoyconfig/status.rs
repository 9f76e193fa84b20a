//! An EnvoyConfig's status from its pass's plan and the route servers' reports, as pure
//! functions.

use kube::Resource;
use spur_api::conditions::set_now;
use spur_api::envoyconfig::{CacheState, NodeCounts, conditions};
use spur_api::{EnvoyConfig, EnvoyConfigStatus};

use super::desired::Plan;

/// The status after a pass that asked for `version` and did `plan`: the cache state, the
/// versions, the kept revisions, the node counts and the three conditions.
pub(super) fn status(st: &mut EnvoyConfigStatus, ec: &EnvoyConfig, version: &str, plan: Plan) {
    let target_version = plan
        .order
        .iter()
        .find(|r| r.ref_ == plan.target)
        .map(|r| r.version.clone());
    st.cache_state = Some(plan.state);
    st.desired_version = Some(version.to_owned());
    st.published_version = target_version.clone();
    st.revisions = plan.order;
    st.nodes = (plan.counts.subscribed > 0).then_some(plan.counts.clone());
    let target_version = target_version.unwrap_or_default();
    let (ok, reason, message) = match plan.state {
        CacheState::InSync => (
            true,
            "Published",
            format!("revision {version} is published"),
        ),
        CacheState::Rollback => (
            false,
            "Rollback",
            format!(
                "revision {version} was rejected by every subscribed node; serving {target_version}"
            ),
        ),
        CacheState::RollbackFailed => (
            false,
            "RollbackFailed",
            format!("revision {version} was rejected and no earlier good revision is kept"),
        ),
    };
    set(st, ec, conditions::IN_SYNC, ok, reason, &message);
    nodes(st, ec, &plan.counts, &target_version);
}

/// The conditions the node reports decide: some nodes (not all) reject the served revision;
/// a route server cannot serve a Secret it names.
fn nodes(st: &mut EnvoyConfigStatus, ec: &EnvoyConfig, counts: &NodeCounts, version: &str) {
    if counts.nacked > 0 && counts.nacked < counts.subscribed {
        let message = format!(
            "{} of {} subscribed nodes reject revision {version}: {}",
            counts.nacked,
            counts.subscribed,
            counts.message.as_deref().unwrap_or("no reason given")
        );
        set(
            st,
            ec,
            conditions::NODES_FAILING,
            true,
            "PartialNack",
            &message,
        );
    } else {
        set(st, ec, conditions::NODES_FAILING, false, "NoneFailing", "");
    }
    if counts.unresolved_secrets.is_empty() {
        set(st, ec, conditions::SECRETS_RESOLVED, true, "Resolved", "");
    } else {
        let message = format!(
            "the route server cannot serve: {}",
            counts.unresolved_secrets.join("; ")
        );
        set(
            st,
            ec,
            conditions::SECRETS_RESOLVED,
            false,
            "SecretUnavailable",
            &message,
        );
    }
}

/// A spec that does not decode: what is published stays published, and the status says why
/// nothing follows the spec.
pub(super) fn invalid(st: &mut EnvoyConfigStatus, ec: &EnvoyConfig, message: &str) {
    set(st, ec, conditions::IN_SYNC, false, "Invalid", message);
}

pub(super) fn set(
    st: &mut EnvoyConfigStatus,
    ec: &EnvoyConfig,
    type_: &str,
    ok: bool,
    reason: &str,
    message: &str,
) {
    set_now(
        &mut st.conditions,
        ec.meta().generation,
        type_,
        ok,
        reason,
        message,
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use spur_api::envoyconfig::RevisionRef;

    use super::super::desired::tests::config;
    use super::*;

    fn plan(state: CacheState, counts: NodeCounts) -> Plan {
        let r = |v: &str, tainted| RevisionRef {
            version: v.into(),
            ref_: format!("front-{v}"),
            tainted,
        };
        Plan {
            untaint: false,
            taint: None,
            delete: Vec::new(),
            target: "front-v1".into(),
            publish: false,
            unpublish: Vec::new(),
            order: vec![r("v1", false), r("v2", state != CacheState::InSync)],
            state,
            counts,
        }
    }

    /// (status, reason, message) of condition `type_`.
    fn cond(st: &EnvoyConfigStatus, type_: &str) -> (String, String, String) {
        let c = st.conditions.iter().find(|c| c.type_ == type_).unwrap();
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    #[test]
    fn in_sync_with_every_node_fine() {
        let mut st = EnvoyConfigStatus::default();
        let counts = NodeCounts {
            subscribed: 2,
            acked: 2,
            ..NodeCounts::default()
        };
        status(&mut st, &config(), "v1", plan(CacheState::InSync, counts));
        assert_eq!(st.cache_state, Some(CacheState::InSync));
        assert_eq!(st.desired_version.as_deref(), Some("v1"));
        assert_eq!(st.published_version.as_deref(), Some("v1"));
        assert_eq!(st.revisions.len(), 2);
        assert_eq!(st.nodes.as_ref().map(|n| n.acked), Some(2));
        assert_eq!(
            cond(&st, conditions::IN_SYNC),
            (
                "True".into(),
                "Published".into(),
                "revision v1 is published".into()
            )
        );
        assert_eq!(cond(&st, conditions::NODES_FAILING).1, "NoneFailing");
        assert_eq!(cond(&st, conditions::SECRETS_RESOLVED).0, "True");
        assert!(
            st.conditions
                .iter()
                .all(|c| c.observed_generation == Some(4))
        );
    }

    #[test]
    fn a_rollback_names_what_is_served_and_what_fails() {
        let mut st = EnvoyConfigStatus::default();
        let counts = NodeCounts {
            subscribed: 3,
            acked: 2,
            nacked: 1,
            message: Some("bad listener".into()),
            unresolved_secrets: vec!["a: missing".into(), "b: not labelled".into()],
        };
        status(&mut st, &config(), "v2", plan(CacheState::Rollback, counts));
        assert_eq!(st.published_version.as_deref(), Some("v1"));
        assert_eq!(
            cond(&st, conditions::IN_SYNC),
            (
                "False".into(),
                "Rollback".into(),
                "revision v2 was rejected by every subscribed node; serving v1".into()
            )
        );
        assert_eq!(
            cond(&st, conditions::NODES_FAILING),
            (
                "True".into(),
                "PartialNack".into(),
                "1 of 3 subscribed nodes reject revision v1: bad listener".into()
            )
        );
        assert_eq!(
            cond(&st, conditions::SECRETS_RESOLVED),
            (
                "False".into(),
                "SecretUnavailable".into(),
                "the route server cannot serve: a: missing; b: not labelled".into()
            )
        );
    }

    #[test]
    fn no_node_no_counts_and_a_failed_rollback() {
        let mut st = EnvoyConfigStatus::default();
        status(
            &mut st,
            &config(),
            "v2",
            plan(CacheState::RollbackFailed, NodeCounts::default()),
        );
        assert_eq!(st.nodes, None);
        let (ok, reason, _) = cond(&st, conditions::IN_SYNC);
        assert_eq!((ok.as_str(), reason.as_str()), ("False", "RollbackFailed"));
        // Every node rejecting is not a partial rejection.
        let all = NodeCounts {
            subscribed: 2,
            nacked: 2,
            ..NodeCounts::default()
        };
        status(&mut st, &config(), "v2", plan(CacheState::Rollback, all));
        assert_eq!(cond(&st, conditions::NODES_FAILING).1, "NoneFailing");
    }

    #[test]
    fn an_invalid_spec_says_so_and_keeps_the_rest() {
        let mut st = EnvoyConfigStatus {
            published_version: Some("v1".into()),
            ..EnvoyConfigStatus::default()
        };
        invalid(&mut st, &config(), "no such field");
        assert_eq!(
            cond(&st, conditions::IN_SYNC),
            ("False".into(), "Invalid".into(), "no such field".into())
        );
        assert_eq!(st.published_version.as_deref(), Some("v1"));
    }
}
