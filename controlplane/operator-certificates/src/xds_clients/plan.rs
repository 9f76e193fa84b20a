//! The issuer's decisions, as pure functions of what it remembers: which namespaces are due
//! for a new certificate, and when to look again.

use std::time::Duration;

/// How often the signing CA is checked for a change besides renewals.
pub(super) const CA_CHECK: Duration = Duration::from_secs(300);

/// How soon a namespace whose certificate could not be written is retried.
pub(super) const RETRY_FAILED: Duration = Duration::from_secs(30);

/// What was last issued into one namespace.
pub(super) struct Issued {
    pub(super) renew_at: i64,
    pub(super) issuer: String,
}

/// Whether a namespace needs a new certificate at `now`: never issued (or forgotten by a new
/// leader), past its renewal time, or issued by another CA or bundle than `issuer`.
pub(super) fn due(issued: Option<&Issued>, issuer: &str, now: i64) -> bool {
    issued.is_none_or(|i| now >= i.renew_at || i.issuer != issuer)
}

/// How long until the next pass: the earliest renewal among `renew_ats` (at least a second),
/// sooner after a namespace `failed`, and never later than the next CA check.
pub(super) fn next_wake(
    renew_ats: impl IntoIterator<Item = i64>,
    failed: bool,
    now: i64,
) -> Duration {
    let mut next = CA_CHECK;
    if failed {
        next = next.min(RETRY_FAILED);
    }
    for renew_at in renew_ats {
        let left = u64::try_from(renew_at - now).unwrap_or(0);
        next = next.min(Duration::from_secs(left.max(1)));
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issued(renew_at: i64, issuer: &str) -> Issued {
        Issued {
            renew_at,
            issuer: issuer.into(),
        }
    }

    #[test]
    fn due_when_never_issued() {
        assert!(due(None, "ca1", 1000));
    }

    #[test]
    fn due_at_and_after_renewal_not_before() {
        let i = issued(1000, "ca1");
        assert!(!due(Some(&i), "ca1", 999));
        assert!(due(Some(&i), "ca1", 1000));
        assert!(due(Some(&i), "ca1", 5000));
    }

    #[test]
    fn due_when_the_issuer_changed_before_renewal() {
        let i = issued(1000, "ca1");
        assert!(due(Some(&i), "ca2", 10));
    }

    #[test]
    fn next_wake_is_the_earliest_renewal() {
        assert_eq!(
            next_wake([1120, 1060, 1200], false, 1000),
            Duration::from_secs(60)
        );
    }

    #[test]
    fn next_wake_is_at_least_a_second() {
        assert_eq!(next_wake([1000], false, 1000), Duration::from_secs(1));
        assert_eq!(next_wake([900, 2000], false, 1000), Duration::from_secs(1));
    }

    #[test]
    fn next_wake_is_capped_at_the_ca_check() {
        assert_eq!(next_wake([], false, 1000), CA_CHECK);
        assert_eq!(next_wake([1000 + 86_400], false, 1000), CA_CHECK);
        assert_eq!(CA_CHECK, Duration::from_secs(300));
    }

    #[test]
    fn next_wake_after_a_failure_is_thirty_seconds_unless_sooner() {
        assert_eq!(
            next_wake([1000 + 86_400], true, 1000),
            Duration::from_secs(30)
        );
        assert_eq!(next_wake([], true, 1000), Duration::from_secs(30));
        assert_eq!(next_wake([1005], true, 1000), Duration::from_secs(5));
    }
}
