//! What a namespace's pass does with each enrollment binding, as a pure function.

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::ResourceExt;

use super::enrolled;

/// What to do with one enrollment binding of a namespace.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// It is as it should be (or absent and unwanted).
    Keep,
    /// The namespace left Spur: unbind.
    Remove,
    /// Apply `want`; `replace`: delete the binding first (the role of a binding cannot change).
    Apply { replace: bool },
}

/// The step for binding `want` of namespace `ns`, which has `have` now.
pub(super) fn step(ns: &Namespace, have: Option<&RoleBinding>, want: &RoleBinding) -> Step {
    if !enrolled(ns) {
        // A terminating namespace deletes its bindings itself, after what they allow has been
        // cleaned up in it (forks' finalizers need the operator's rights).
        return if have.is_some() && ns.metadata.deletion_timestamp.is_none() {
            Step::Remove
        } else {
            Step::Keep
        };
    }
    match have {
        None => Step::Apply { replace: false },
        Some(have)
            if have.role_ref == want.role_ref
                && have.subjects == want.subjects
                && have.labels() == want.labels() =>
        {
            Step::Keep
        }
        Some(have) => Step::Apply {
            replace: have.role_ref != want.role_ref,
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;
    use crate::{EnrollBinding, EnrollConfig};

    fn ns(v: serde_json::Value) -> Namespace {
        serde_json::from_value(v).unwrap()
    }

    fn want() -> RoleBinding {
        let cfg = EnrollConfig {
            namespace: "spur-system".into(),
            bindings: Vec::new(),
        };
        cfg.binding(
            &EnrollBinding {
                cluster_role: "spur-operator-enrolled".into(),
                service_account: "spur-operator".into(),
            },
            "shop",
        )
    }

    fn labelled() -> Namespace {
        ns(json!({"metadata": {"name": "shop", "labels": {"spur.dev/enabled": "true"}}}))
    }

    #[test]
    fn an_enrolled_namespace_gets_its_binding_once() {
        let w = want();
        assert_eq!(step(&labelled(), None, &w), Step::Apply { replace: false });
        assert_eq!(step(&labelled(), Some(&w), &w), Step::Keep);
    }

    #[test]
    fn a_changed_binding_is_reapplied_and_a_changed_role_replaced() {
        let w = want();
        let mut other_subject = w.clone();
        other_subject.subjects.as_mut().unwrap()[0].name = "someone".into();
        assert_eq!(
            step(&labelled(), Some(&other_subject), &w),
            Step::Apply { replace: false }
        );
        let mut unlabelled = w.clone();
        unlabelled.metadata.labels = None;
        assert_eq!(
            step(&labelled(), Some(&unlabelled), &w),
            Step::Apply { replace: false }
        );
        let mut other_role = w.clone();
        other_role.role_ref.name = "cluster-admin".into();
        assert_eq!(
            step(&labelled(), Some(&other_role), &w),
            Step::Apply { replace: true }
        );
    }

    #[test]
    fn a_namespace_that_left_is_unbound_unless_it_is_terminating() {
        let w = want();
        let left = ns(json!({"metadata": {"name": "shop"}}));
        assert_eq!(step(&left, Some(&w), &w), Step::Remove);
        assert_eq!(step(&left, None, &w), Step::Keep);
        let terminating = ns(json!({"metadata": {
            "name": "shop", "labels": {"spur.dev/enabled": "true"},
            "deletionTimestamp": "2024-01-01T00:00:00Z"
        }}));
        assert_eq!(step(&terminating, Some(&w), &w), Step::Keep);
    }
}
