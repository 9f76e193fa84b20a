//! Status conditions (`metav1.Condition`), kept the way `kubectl wait` and server-side apply
//! expect: one entry per type, `lastTransitionTime` moving only when the status flips.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// The object does what its spec asks.
pub const READY: &str = "Ready";
/// An external workload's tunnel answered its last health check.
pub const TUNNEL_CONNECTED: &str = "TunnelConnected";

/// Ready reasons the operator and the `spur` command both read. A Sandbox or ForkedWorkload
/// with one of the `*_FAILURES` reasons stays not ready until its spec or the cluster changes:
/// `spur sandbox apply --wait` reports it as a failure rather than waiting on.
pub mod reasons {
    /// The spec breaks a rule the schema cannot express (a Sandbox's or a RouteGroup's).
    pub const INVALID: &str = "Invalid";
    /// A sandbox that would write in a namespace that has not opted in.
    pub const NAMESPACE_NOT_ENABLED: &str = "NamespaceNotEnabled";
    /// A sandbox resource failed; no fork is started.
    pub const RESOURCE_FAILED: &str = "ResourceFailed";
    /// The sandbox names a workstation its creator does not own.
    pub const WORKSTATION_NOT_OWNED: &str = "WorkstationNotOwned";
    /// A fork that is built and waits for its Deployment: the one not-ready reason of a
    /// ForkedWorkload that is progress, not a failure.
    pub const FORK_NOT_READY: &str = "ForkNotReady";

    /// The Ready reasons of a Sandbox that failed the operator's check of its spec against
    /// the cluster (the operator re-checks such a sandbox on every pass).
    pub const SANDBOX_CHECK_FAILURES: [&str; 7] = [
        INVALID,
        "InvalidBaseline",
        // Resources with the chart's `resources.enabled` off.
        "Unsupported",
        "BaselineNotFound",
        "InvalidCustomization",
        "InvalidResource",
        NAMESPACE_NOT_ENABLED,
    ];

    /// Whether a Sandbox's Ready reason is a failure that waiting does not end.
    pub fn sandbox_failed(reason: &str) -> bool {
        SANDBOX_CHECK_FAILURES.contains(&reason)
            || reason == RESOURCE_FAILED
            || reason == WORKSTATION_NOT_OWNED
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

impl ConditionStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        }
    }
}

impl From<bool> for ConditionStatus {
    fn from(b: bool) -> Self {
        if b {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        }
    }
}

/// The desired state of one condition.
#[derive(Clone, Copy, Debug)]
pub struct NewCondition<'a> {
    /// CamelCase type, e.g. [`READY`].
    pub type_: &'a str,
    pub status: ConditionStatus,
    /// CamelCase, machine-readable, never empty.
    pub reason: &'a str,
    /// For people; may be empty.
    pub message: &'a str,
    /// The `metadata.generation` the condition was computed from.
    pub observed_generation: Option<i64>,
}

/// Sets a condition, keeping its `lastTransitionTime` unless the status changes (a new
/// condition gets `now`). Returns whether anything changed, so callers can skip a status write.
pub fn set_condition(conditions: &mut Vec<Condition>, new: NewCondition<'_>, now: &Time) -> bool {
    let status = new.status.as_str();
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        Some(c) => {
            let changed = c.status != status
                || c.reason != new.reason
                || c.message != new.message
                || c.observed_generation != new.observed_generation;
            if c.status != status {
                c.status = status.to_owned();
                c.last_transition_time = now.clone();
            }
            if changed {
                new.reason.clone_into(&mut c.reason);
                new.message.clone_into(&mut c.message);
                c.observed_generation = new.observed_generation;
            }
            changed
        }
        None => {
            conditions.push(Condition {
                type_: new.type_.to_owned(),
                status: status.to_owned(),
                reason: new.reason.to_owned(),
                message: new.message.to_owned(),
                observed_generation: new.observed_generation,
                last_transition_time: now.clone(),
            });
            true
        }
    }
}

/// [`set_condition`] for an object at `generation` (its `metadata.generation`), now: what each
/// controller's status functions call.
pub fn set_now(
    conditions: &mut Vec<Condition>,
    generation: Option<i64>,
    type_: &str,
    status: impl Into<ConditionStatus>,
    reason: &str,
    message: &str,
) -> bool {
    set_condition(
        conditions,
        NewCondition {
            type_,
            status: status.into(),
            reason,
            message,
            observed_generation: generation,
        },
        &Time(k8s_openapi::jiff::Timestamp::now()),
    )
}

pub fn find_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition is present with status `True`.
pub fn is_condition_true(conditions: &[Condition], type_: &str) -> bool {
    find_condition(conditions, type_).is_some_and(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).unwrap())
    }

    fn ready(status: bool, reason: &str, generation: i64) -> NewCondition<'_> {
        NewCondition {
            type_: READY,
            status: status.into(),
            reason,
            message: "",
            observed_generation: Some(generation),
        }
    }

    #[test]
    fn set_now_takes_a_bool_or_a_status_and_records_the_generation() {
        let mut cs = Vec::new();
        assert!(set_now(&mut cs, Some(3), READY, true, "Ready", "ok"));
        assert!(!set_now(
            &mut cs,
            Some(3),
            READY,
            ConditionStatus::True,
            "Ready",
            "ok"
        ));
        assert!(set_now(&mut cs, Some(4), "Other", false, "No", ""));
        assert_eq!(
            cs.iter()
                .map(|c| (c.type_.as_str(), c.status.as_str(), c.observed_generation))
                .collect::<Vec<_>>(),
            [("Ready", "True", Some(3)), ("Other", "False", Some(4))]
        );
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let mut cs = Vec::new();
        assert!(set_condition(&mut cs, ready(false, "Pending", 1), &at(10)));
        assert_eq!(cs[0].last_transition_time, at(10));

        assert!(!set_condition(&mut cs, ready(false, "Pending", 1), &at(20)));
        assert!(set_condition(&mut cs, ready(false, "Waiting", 2), &at(30)));
        assert_eq!(cs[0].last_transition_time, at(10));
        assert_eq!(cs[0].reason, "Waiting");
        assert_eq!(cs[0].observed_generation, Some(2));

        assert!(set_condition(&mut cs, ready(true, "Available", 2), &at(40)));
        assert_eq!(cs[0].last_transition_time, at(40));
        assert!(is_condition_true(&cs, READY));

        let tunnel = NewCondition {
            type_: TUNNEL_CONNECTED,
            status: ConditionStatus::Unknown,
            reason: "NotChecked",
            message: "no health check yet",
            observed_generation: None,
        };
        assert!(set_condition(&mut cs, tunnel, &at(50)));
        assert_eq!(cs.len(), 2);
        assert!(!is_condition_true(&cs, TUNNEL_CONNECTED));
        assert_eq!(
            find_condition(&cs, TUNNEL_CONNECTED).unwrap().status,
            "Unknown"
        );
    }
}
