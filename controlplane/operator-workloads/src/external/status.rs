//! An ExternalWorkload's status from its baseline, its plan and the workstation's tunnel, as
//! pure functions.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, READY, set_now};
use spur_api::tunnel::Session;
use spur_api::workloads::TunnelStatus;
use spur_api::{ExternalWorkload, ExternalWorkloadStatus, ServiceMapping};

use super::{Plan, RESYNC, TUNNEL_CONNECTED};

/// The status of an ExternalWorkload that cannot be built (its children are gone).
pub(super) fn failed(
    st: &mut ExternalWorkloadStatus,
    ew: &ExternalWorkload,
    reason: &str,
    message: &str,
) {
    st.services.clear();
    st.tunnel = None;
    set(
        st,
        ew,
        TUNNEL_CONNECTED,
        ConditionStatus::False,
        reason,
        message,
    );
    set(st, ew, READY, ConditionStatus::False, reason, message);
}

/// The status of an ExternalWorkload whose children were applied: the `mappings` of its
/// sandbox Services, the tunnel's state (`session`, and `plan`'s tunnel part: its objects are
/// not read), and Ready once keyed traffic reaches the workstation.
pub(super) fn observed(
    st: &mut ExternalWorkloadStatus,
    ew: &ExternalWorkload,
    baseline: &Deployment,
    mappings: Vec<ServiceMapping>,
    session: Option<&Session>,
    plan: &Plan,
) {
    let ready = plan.connected && !mappings.is_empty() && !plan.tunnel_ports.is_empty();
    st.baseline = Some(spur_api::workloads::BaselineObservation {
        uid: baseline.uid().unwrap_or_default(),
        generation: baseline.meta().generation,
    });
    st.services = mappings;
    st.tunnel = session.map(|s| TunnelStatus {
        connected: plan.connected,
        last_seen: k8s_openapi::jiff::Timestamp::from_second(s.renewed)
            .ok()
            .map(Time),
        last_check: None,
        proxy_pod: Some(s.proxy_pod.clone()),
        ports: plan.tunnel_ports.clone(),
    });
    let workstation = &ew.spec.workstation;
    let (status, reason, message) = match (session, plan.connected) {
        (None, _) => (
            ConditionStatus::False,
            "NoTunnel",
            format!("workstation {workstation} has no tunnel (spur local connect)"),
        ),
        (Some(s), false) => (
            ConditionStatus::False,
            "TunnelDown",
            format!(
                "the tunnel of workstation {workstation} was last renewed by {} and has expired",
                s.proxy_pod
            ),
        ),
        (Some(s), true) => (
            ConditionStatus::True,
            "TunnelUp",
            format!("tunnel through {} ({})", s.proxy_pod, s.address),
        ),
    };
    set(st, ew, TUNNEL_CONNECTED, status, reason, &message);
    let (status, reason, message) = if ready {
        (
            ConditionStatus::True,
            "Ready",
            "keyed traffic reaches the workstation".to_string(),
        )
    } else if st.services.is_empty() {
        (
            ConditionStatus::False,
            "NoServices",
            "no Service of the baseline reaches a mapped port".to_string(),
        )
    } else if plan.connected {
        (
            ConditionStatus::False,
            "PortsPending",
            "the tunnel does not forward every mapped port yet".to_string(),
        )
    } else {
        (status, reason, message)
    };
    set(st, ew, READY, status, reason, &message);
}

/// When to look again at time `now_s` (Unix seconds): a live tunnel turns stale unless renewed
/// (a renewal wakes the controller through the Lease watch), so just after it would expire.
pub(super) fn next_check(session: Option<&Session>, connected: bool, now_s: i64) -> Duration {
    let next = match session {
        Some(s) if connected => Duration::from_secs(
            u64::try_from(s.expires().saturating_sub(now_s))
                .unwrap_or(0)
                .saturating_add(1),
        ),
        _ => RESYNC,
    };
    next.min(RESYNC)
}

fn set(
    st: &mut ExternalWorkloadStatus,
    ew: &ExternalWorkload,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    set_now(
        &mut st.conditions,
        ew.meta().generation,
        type_,
        status,
        reason,
        message,
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use spur_api::conditions::find_condition;

    use super::super::desired::tests::{baseline, ew, services, session};
    use super::super::plan;
    use super::*;

    /// The status and reason of condition `type_`.
    fn reason<'a>(st: &'a ExternalWorkloadStatus, type_: &str) -> (&'a str, &'a str) {
        let c = find_condition(&st.conditions, type_).unwrap();
        (&c.status, &c.reason)
    }

    /// The status after a pass with `session` at time `now`.
    fn after(session: Option<&Session>, now: i64) -> ExternalWorkloadStatus {
        let (ew, baseline) = (ew(), baseline());
        let p = plan(&ew, &baseline, &services(), session, now);
        let mappings = p.services.iter().map(|(_, m, _)| m.clone()).collect();
        let mut st = ExternalWorkloadStatus::default();
        observed(&mut st, &ew, &baseline.workload, mappings, session, &p);
        st
    }

    #[test]
    fn a_live_tunnel_forwarding_every_port_is_ready() {
        let st = after(Some(&session(100)), 105);
        assert_eq!(reason(&st, TUNNEL_CONNECTED), ("True", "TunnelUp"));
        assert_eq!(reason(&st, READY), ("True", "Ready"));
        let tunnel = st.tunnel.unwrap();
        assert!(tunnel.connected);
        assert_eq!(tunnel.proxy_pod.as_deref(), Some("tp-0"));
        assert_eq!(tunnel.ports.len(), 1);
        assert_eq!(st.services.len(), 1);
        assert!(st.baseline.is_some());
    }

    #[test]
    fn no_tunnel_or_an_expired_one_is_the_ready_reason() {
        let st = after(None, 105);
        assert_eq!(reason(&st, READY), ("False", "NoTunnel"));
        assert!(st.tunnel.is_none());
        let st = after(Some(&session(100)), 110);
        assert_eq!(reason(&st, READY), ("False", "TunnelDown"));
        assert!(!st.tunnel.unwrap().connected);
    }

    #[test]
    fn a_tunnel_missing_ports_waits_for_them() {
        let mut s = session(100);
        s.ports.clear();
        let st = after(Some(&s), 105);
        assert_eq!(reason(&st, TUNNEL_CONNECTED), ("True", "TunnelUp"));
        assert_eq!(reason(&st, READY), ("False", "PortsPending"));
    }

    #[test]
    fn no_mapped_service_is_reported_before_the_tunnel() {
        let (mut ew, baseline) = (ew(), baseline());
        ew.spec.mappings[0].port = 7000;
        let p = plan(&ew, &baseline, &services(), None, 105);
        let mut st = ExternalWorkloadStatus::default();
        observed(&mut st, &ew, &baseline.workload, Vec::new(), None, &p);
        assert_eq!(reason(&st, READY), ("False", "NoServices"));
    }

    #[test]
    fn a_failure_clears_what_was_reported() {
        let mut st = after(Some(&session(100)), 105);
        failed(&mut st, &ew(), "BaselineNotFound", "gone");
        assert!(st.services.is_empty() && st.tunnel.is_none());
        for t in [TUNNEL_CONNECTED, READY] {
            assert_eq!(reason(&st, t), ("False", "BaselineNotFound"));
        }
    }

    #[test]
    fn a_live_tunnel_is_looked_at_again_just_after_it_would_expire() {
        let s = session(100);
        assert_eq!(next_check(Some(&s), true, 105), Duration::from_secs(6));
        assert_eq!(next_check(Some(&s), false, 105), RESYNC);
        assert_eq!(next_check(None, false, 105), RESYNC);
        // Past its expiry (the clock moved on since the plan): at once, plus a second.
        assert_eq!(next_check(Some(&s), true, 200), Duration::from_secs(1));
        let long = Session {
            duration: 100_000,
            ..session(100)
        };
        assert_eq!(next_check(Some(&long), true, 105), RESYNC);
    }
}
