//! What namespace enrollment binds (this crate): the bindings the operator is configured
//! with, carried by the operator's context, and the RoleBinding each makes in an
//! enrolled namespace.

use std::collections::BTreeMap;

use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use kube::api::ObjectMeta;

use spur_operator_core::Error;

/// On the RoleBindings the enrollment controller makes: the ClusterRole they bind (its watch selects
/// them by this label).
pub const BINDING_LABEL: &str = "spur.dev/enrollment";

/// One RoleBinding made in every enrolled namespace: ClusterRole `cluster_role` (also the
/// binding's name) to ServiceAccount `service_account` of the operator's namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnrollBinding {
    pub cluster_role: String,
    pub service_account: String,
}

impl std::str::FromStr for EnrollBinding {
    type Err = Error;

    /// `<cluster role>:<service account>`, e.g. `spur-operator-enrolled:spur-operator`.
    fn from_str(s: &str) -> Result<Self, Error> {
        let (role, account) = s.split_once(':').unwrap_or((s, ""));
        let valid = |n: &str| {
            !n.is_empty()
                && n.len() <= 253
                && n.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        };
        if !valid(role) || !valid(account) {
            return Err(Error::Config(format!(
                "enrollment binding {s:?}: expected <cluster role>:<service account>, both Kubernetes names (e.g. spur-operator-enrolled:spur-operator)"
            )));
        }
        Ok(EnrollBinding {
            cluster_role: role.to_owned(),
            service_account: account.to_owned(),
        })
    }
}

/// What the enroller binds, and where the bound service accounts live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnrollConfig {
    /// The service accounts' namespace (the operator's own).
    pub namespace: String,
    pub bindings: Vec<EnrollBinding>,
}

impl EnrollConfig {
    /// The RoleBinding `b` in namespace `ns`, as applied.
    pub fn binding(&self, b: &EnrollBinding, ns: &str) -> RoleBinding {
        RoleBinding {
            metadata: ObjectMeta {
                name: Some(b.cluster_role.clone()),
                namespace: Some(ns.to_owned()),
                labels: Some(BTreeMap::from([
                    (
                        spur_api::keys::labels::MANAGED_BY.to_owned(),
                        spur_api::keys::labels::MANAGED_BY_VALUE.to_owned(),
                    ),
                    (BINDING_LABEL.to_owned(), b.cluster_role.clone()),
                ])),
                ..ObjectMeta::default()
            },
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "ClusterRole".into(),
                name: b.cluster_role.clone(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name: b.service_account.clone(),
                namespace: Some(self.namespace.clone()),
                api_group: None,
            }]),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn bindings_parse_from_role_and_account() {
        let b: EnrollBinding = "spur-operator-enrolled:spur-operator".parse().unwrap();
        assert_eq!(b.cluster_role, "spur-operator-enrolled");
        assert_eq!(b.service_account, "spur-operator");
        for bad in ["", "spur-operator-enrolled", ":x", "x:", "A:b", "a:b:c"] {
            assert!(bad.parse::<EnrollBinding>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn the_binding_names_its_role_and_one_service_account() {
        let cfg = EnrollConfig {
            namespace: "spur-system".into(),
            bindings: vec!["spur-jobs-enrolled:spur-jobs".parse().unwrap()],
        };
        let rb = serde_json::to_value(cfg.binding(&cfg.bindings[0], "shop")).unwrap();
        assert_eq!(
            rb,
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": "spur-jobs-enrolled", "namespace": "shop", "labels": {
                    "app.kubernetes.io/managed-by": "spur",
                    "spur.dev/enrollment": "spur-jobs-enrolled"}},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "spur-jobs-enrolled"},
                "subjects": [{"kind": "ServiceAccount", "name": "spur-jobs",
                    "namespace": "spur-system"}]
            })
        );
    }
}
