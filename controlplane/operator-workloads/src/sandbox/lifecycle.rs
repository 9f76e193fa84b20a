//! The Kubernetes Events of a sandbox's lifecycle, read off its status before and after a
//! write: accepted (its routing key given), ready, no longer ready (and why), draining and
//! deleting. A pure function of the two statuses, so an event is published once per step, on
//! the pass that made the step, however often the sandbox is reconciled. Spec failures have
//! their events where they are found (`Validate`, `CreateResources`); this leaves them out.

use spur_api::SandboxStatus;
use spur_api::conditions::{READY, find_condition, reasons};

/// One event to publish about the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Step {
    pub warning: bool,
    pub reason: &'static str,
    pub action: &'static str,
    pub note: String,
}

/// The Ready reason a Sandbox being deleted carries while its forks drain or go.
pub(super) const DELETING: &str = "Deleting";
/// The Ready reason while a deleted sandbox's forks still take the records stamped before its
/// routes ended (docs/async.md).
pub(super) const DRAINING: &str = "Draining";

/// The steps `new` took from `old`.
pub(super) fn steps(old: &SandboxStatus, new: &SandboxStatus) -> Vec<Step> {
    let mut out = Vec::new();
    if old.routing_key.is_none()
        && let Some(key) = &new.routing_key
    {
        out.push(Step {
            warning: false,
            reason: "Accepted",
            action: "Create",
            note: format!("routing key {key}: requests carrying it reach this sandbox's workloads"),
        });
    }
    let was = find_condition(&old.conditions, READY);
    let is = find_condition(&new.conditions, READY);
    let was_ready = was.is_some_and(|c| c.status == "True");
    let Some(is) = is else {
        return out;
    };
    let same = was.is_some_and(|c| c.status == is.status && c.reason == is.reason);
    if same || reasons::sandbox_failed(&is.reason) {
        return out;
    }
    match (is.status.as_str(), is.reason.as_str()) {
        ("True", _) if !was_ready => out.push(Step {
            warning: false,
            reason: "Ready",
            action: "Reconcile",
            note: is.message.clone(),
        }),
        (_, DRAINING) => out.push(Step {
            warning: false,
            reason: DRAINING,
            action: "Delete",
            note: is.message.clone(),
        }),
        (_, DELETING) => out.push(Step {
            warning: false,
            reason: DELETING,
            action: "Delete",
            note: is.message.clone(),
        }),
        // Ready no more: a fork crashed, a workstation went away, the spec changed.
        ("False" | "Unknown", reason) if was_ready => out.push(Step {
            warning: true,
            reason: "NotReady",
            action: "Reconcile",
            note: format!("{reason}: {}", is.message),
        }),
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    fn status(key: Option<&str>, ready: Option<(&str, &str)>) -> SandboxStatus {
        SandboxStatus {
            routing_key: key.map(str::to_owned),
            conditions: ready
                .map(|(status, reason)| Condition {
                    type_: READY.into(),
                    status: status.into(),
                    reason: reason.into(),
                    message: format!("{reason} message"),
                    last_transition_time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
                    observed_generation: None,
                })
                .into_iter()
                .collect(),
            ..Default::default()
        }
    }

    fn reasons_of(steps: &[Step]) -> Vec<&str> {
        steps.iter().map(|s| s.reason).collect()
    }

    #[test]
    fn each_step_once_on_the_write_that_makes_it() {
        let new = status(None, None);
        let accepted = status(Some("k1"), Some(("False", "NotReady")));
        assert_eq!(reasons_of(&steps(&new, &accepted)), ["Accepted"]);
        // Still converging: nothing more.
        assert!(steps(&accepted, &accepted).is_empty());
        let ready = status(Some("k1"), Some(("True", "Ready")));
        let s = steps(&accepted, &ready);
        assert_eq!(reasons_of(&s), ["Ready"]);
        assert!(!s[0].warning);
        assert!(steps(&ready, &ready).is_empty());
        // A fork crashed.
        let s = steps(&ready, &accepted);
        assert_eq!(reasons_of(&s), ["NotReady"]);
        assert!(s[0].warning && s[0].note.starts_with("NotReady: "), "{s:?}");
        // Deleted: draining, then deleting (once each).
        let draining = status(Some("k1"), Some(("False", DRAINING)));
        assert_eq!(reasons_of(&steps(&ready, &draining)), [DRAINING]);
        assert!(steps(&draining, &draining).is_empty());
        let deleting = status(Some("k1"), Some(("False", DELETING)));
        assert_eq!(reasons_of(&steps(&draining, &deleting)), [DELETING]);
        assert_eq!(reasons_of(&steps(&accepted, &deleting)), [DELETING]);
    }

    #[test]
    fn a_failed_check_is_left_to_the_check_that_found_it() {
        let failed = status(Some("k1"), Some(("False", reasons::INVALID)));
        assert_eq!(
            reasons_of(&steps(&status(None, None), &failed)),
            ["Accepted"]
        );
        let ready = status(Some("k1"), Some(("True", "Ready")));
        assert!(steps(&ready, &failed).is_empty());
    }
}
