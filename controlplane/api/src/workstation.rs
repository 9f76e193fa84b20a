//! Who owns a workstation, and who created a Sandbox: the record that keeps one developer's
//! routing key off another developer's laptop (docs/local.md, "Workstation owners").
//!
//! A workstation belongs to the Kubernetes user who obtained its credential: the requester of
//! its client certificate (the CertificateSigningRequest's `spec.username`), of its tunnel grant
//! (the access request's stamped requester), or the user an administrator names with `spur local
//! token --owner`. The record is one ConfigMap per workstation in the release namespace (where
//! the tunnel proxy's session Leases live), written by whoever issues the credential:
//!
//! - name [`owner_record_name`]: `spur-workstation-owner-<workstation>`;
//! - label `spur.dev/workstation=<workstation>`;
//! - annotation [`OWNER_ANNOTATION`] (`spur.dev/owner`): the username;
//! - optional annotation [`EXPIRES_ANNOTATION`] (`spur.dev/expires-at`, RFC 3339): when the
//!   credential it was recorded for ends. Until then no other user may claim the workstation;
//!   after it, another user's credential may take it over. Without it the claim lasts until an
//!   administrator deletes or rewrites the record.
//!
//! Sandboxes carry their creator in [`CREATED_BY_ANNOTATION`], stamped at admission from the
//! API server's user info; a Sandbox may name only a workstation whose recorded owner is its
//! creator.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;

use crate::keys::labels;

/// The signer name workstation certificate requests carry (`spec.signerName`): what `spur local
/// cert` asks for and the operator's workstation signer signs.
pub const WORKSTATION_SIGNER: &str = "spur.dev/workstation";

/// Annotation of a Sandbox: the user who created it (set by the operator's admission webhook,
/// never by the client).
pub const CREATED_BY_ANNOTATION: &str = "spur.dev/created-by";
/// Annotation of an owner record: the workstation's owner (a Kubernetes username).
pub const OWNER_ANNOTATION: &str = "spur.dev/owner";
/// Annotation of an owner record: when the claim may be taken over by another user (RFC 3339).
pub const EXPIRES_ANNOTATION: &str = crate::tunnel::credentials::EXPIRES_ANNOTATION;
/// The longest username recorded (as for access requesters).
pub const USERNAME_MAX: usize = crate::access::IDENTITY_MAX;

/// Name of the owner record (a ConfigMap) of `workstation`.
pub fn owner_record_name(workstation: &str) -> String {
    format!("spur-workstation-owner-{workstation}")
}

/// A workstation's recorded owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub user: String,
    /// When another user may take the workstation over; `None`: never by itself.
    pub expires_at: Option<Timestamp>,
}

impl Owner {
    /// Reads an owner record. `None` when it names nobody. An unreadable expiry counts as
    /// already passed: the record then protects nothing a new credential could not renew.
    pub fn from_record(cm: &ConfigMap) -> Option<Owner> {
        let annotations = cm.metadata.annotations.as_ref()?;
        let user = annotations
            .get(OWNER_ANNOTATION)
            .filter(|u| !u.is_empty())?
            .clone();
        let expires_at = annotations
            .get(EXPIRES_ANNOTATION)
            .map(|t| t.parse::<Timestamp>().unwrap_or(Timestamp::UNIX_EPOCH));
        Some(Owner { user, expires_at })
    }

    /// Whether the claim has ended by `now`.
    pub fn expired(&self, now: Timestamp) -> bool {
        self.expires_at.is_some_and(|t| t <= now)
    }

    /// The record of `workstation` in `namespace` naming this owner.
    pub fn record(&self, namespace: &str, workstation: &str) -> ConfigMap {
        let mut annotations = BTreeMap::from([(OWNER_ANNOTATION.to_string(), self.user.clone())]);
        if let Some(t) = self.expires_at {
            annotations.insert(EXPIRES_ANNOTATION.to_string(), t.to_string());
        }
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(owner_record_name(workstation)),
                namespace: Some(namespace.to_string()),
                labels: Some(BTreeMap::from([
                    (
                        crate::tunnel::WORKSTATION_LABEL.to_string(),
                        workstation.to_string(),
                    ),
                    (
                        labels::MANAGED_BY.to_string(),
                        labels::MANAGED_BY_VALUE.to_string(),
                    ),
                ])),
                annotations: Some(annotations),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }
}

/// Why `user` may not claim a workstation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimRefused {
    /// Another user's claim has not ended.
    HeldByAnother,
    /// The username is empty or longer than [`USERNAME_MAX`].
    BadUser,
    /// This many Sandboxes that another user created (or that carry no creator) name the
    /// workstation: handing it over would hand their keyed traffic to the new owner.
    NamedByOthers(usize),
}

impl std::fmt::Display for ClaimRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClaimRefused::HeldByAnother => f.write_str(
                "the workstation belongs to another user: pick another workstation name, or ask an administrator to release it",
            ),
            ClaimRefused::BadUser => write!(
                f,
                "a workstation owner must be a username of 1 to {USERNAME_MAX} bytes"
            ),
            ClaimRefused::NamedByOthers(n) => write!(
                f,
                "{n} Sandbox(es) of another user (or created before Spur recorded creators) still name the workstation; it changes hands only once they are deleted or stop naming it: pick another workstation name, or ask their owners or an administrator"
            ),
        }
    }
}

/// The owner to record when `user` obtains a credential for a workstation until `until`
/// (`None`: a credential without an end), given the current record. The same user's claim
/// lasts until the later of both ends; another user's only replaces a claim that has ended.
pub fn claim(
    current: Option<&Owner>,
    user: &str,
    until: Option<Timestamp>,
    now: Timestamp,
) -> Result<Owner, ClaimRefused> {
    if user.is_empty() || user.len() > USERNAME_MAX {
        return Err(ClaimRefused::BadUser);
    }
    match current {
        Some(o) if o.user == user => Ok(Owner {
            user: user.to_string(),
            expires_at: match (o.expires_at, until) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            },
        }),
        Some(o) if !o.expired(now) => Err(ClaimRefused::HeldByAnother),
        _ => Ok(Owner {
            user: user.to_string(),
            expires_at: until,
        }),
    }
}

/// How many of `sandboxes` name `workstation` and were not created by `user` (a Sandbox without
/// a recorded creator counts: nobody can show it is `user`'s). A claim that would move the
/// workstation to `user` is refused while there are any, so an expired claim never hands one
/// user's keyed traffic to the next claimant.
pub fn named_by_others<'a>(
    workstation: &str,
    user: &str,
    sandboxes: impl IntoIterator<Item = &'a crate::Sandbox>,
) -> usize {
    sandboxes
        .into_iter()
        .filter(|sb| sb.spec.workstation.as_deref() == Some(workstation))
        .filter(|sb| created_by(sb) != Some(user))
        .count()
}

/// The creator Spur recorded on a Sandbox at admission, if any.
pub fn created_by(sb: &crate::Sandbox) -> Option<&str> {
    sb.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(CREATED_BY_ANNOTATION))
        .map(String::as_str)
        .filter(|c| !c.is_empty())
}

/// Whether the operator may bind `sb`'s local workloads to its workstation now, given that
/// workstation's owner record: only while the recorded owner is the Sandbox's creator. Checked on
/// every pass, not only at admission, so a workstation that changed hands (an administrator's
/// `spur local token --owner`, a rewritten record) stops receiving the old owner's keys.
pub fn bindable(
    workstation: &str,
    owner: Option<&Owner>,
    sb: &crate::Sandbox,
) -> Result<(), String> {
    match created_by(sb) {
        Some(creator) => may_use(workstation, owner, creator),
        None => Err(format!(
            "the Sandbox has no {CREATED_BY_ANNOTATION} (it was created before Spur recorded creators, or without the webhook sandbox-creator.spur.dev), so its local workloads are not bound to workstation {workstation}: recreate the Sandbox"
        )),
    }
}

/// Whether a Sandbox created by `creator` may name a workstation with this record (the last
/// recorded owner, whether or not the claim has ended: a developer whose certificate lapsed
/// keeps their workstation until someone else takes it over). The error says what to do and
/// never names the owner.
pub fn may_use(workstation: &str, owner: Option<&Owner>, creator: &str) -> Result<(), String> {
    match owner {
        Some(o) if o.user == creator => Ok(()),
        Some(_) => Err(format!(
            "workstation {workstation} belongs to another user: a Sandbox may name only a workstation whose credential its creator obtained (docs/local.md, \"Workstation owners\"); name your own workstation"
        )),
        None => Err(format!(
            "workstation {workstation} has no recorded owner: get a credential for it first (spur local cert --workstation {workstation}, spur access request tunnel ... --workstation {workstation}, or ask an administrator for spur local token --workstation {workstation} --owner <your username>)"
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn claims_follow_the_owner_and_the_end_of_their_credential() {
        let now = at(1_000);
        let alice = claim(None, "alice", Some(at(2_000)), now).unwrap();
        assert_eq!(alice.expires_at, Some(at(2_000)));
        // The same user renews: the later end wins; no end means none.
        assert_eq!(
            claim(Some(&alice), "alice", Some(at(1_500)), now)
                .unwrap()
                .expires_at,
            Some(at(2_000))
        );
        assert_eq!(
            claim(Some(&alice), "alice", None, now).unwrap().expires_at,
            None
        );
        // Another user waits for the end of alice's claim.
        assert_eq!(
            claim(Some(&alice), "bob", None, now),
            Err(ClaimRefused::HeldByAnother)
        );
        assert_eq!(
            claim(Some(&alice), "bob", Some(at(3_000)), at(2_000))
                .unwrap()
                .user,
            "bob"
        );
        // A claim without an end is never taken over by itself.
        let forever = claim(None, "alice", None, now).unwrap();
        assert!(claim(Some(&forever), "bob", None, at(i64::from(i32::MAX))).is_err());
        assert_eq!(claim(None, "", None, now), Err(ClaimRefused::BadUser));
        assert_eq!(
            claim(None, &"u".repeat(USERNAME_MAX + 1), None, now),
            Err(ClaimRefused::BadUser)
        );
    }

    #[test]
    fn records_round_trip_and_unreadable_expiry_has_passed() {
        let owner = Owner {
            user: "system:serviceaccount:devs:alice".into(),
            expires_at: Some(at(5_000)),
        };
        let mut cm = owner.record("spur-system", "alice-laptop");
        assert_eq!(
            cm.metadata.name.as_deref(),
            Some("spur-workstation-owner-alice-laptop")
        );
        assert_eq!(Owner::from_record(&cm), Some(owner));
        cm.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(EXPIRES_ANNOTATION.into(), "soon".into());
        assert!(Owner::from_record(&cm).unwrap().expired(at(0)));
        cm.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(OWNER_ANNOTATION.into(), String::new());
        assert_eq!(Owner::from_record(&cm), None);
    }

    #[test]
    fn only_the_owner_may_name_a_workstation() {
        let alice = Owner {
            user: "alice".into(),
            expires_at: Some(at(0)),
        };
        assert_eq!(may_use("w", Some(&alice), "alice"), Ok(()));
        let refused = may_use("w", Some(&alice), "bob").unwrap_err();
        assert!(refused.contains("belongs to another user"), "{refused}");
        assert!(
            !refused.contains("alice"),
            "the owner is not named: {refused}"
        );
        let refused = may_use("w", None, "bob").unwrap_err();
        assert!(refused.contains("no recorded owner"), "{refused}");
    }

    fn sandbox(workstation: &str, creator: Option<&str>) -> crate::Sandbox {
        let mut sb: crate::Sandbox = serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox", "metadata": {"name": "s"},
            "spec": {"workstation": workstation, "local": []},
        }))
        .unwrap();
        if let Some(c) = creator {
            sb.metadata.annotations = Some(BTreeMap::from([(
                CREATED_BY_ANNOTATION.to_string(),
                c.to_string(),
            )]));
        }
        sb
    }

    #[test]
    fn a_workstation_with_other_users_sandboxes_does_not_change_hands() {
        let sandboxes = [
            sandbox("w", Some("alice")),
            sandbox("w", None),
            sandbox("other", Some("carol")),
            sandbox("w", Some("")),
        ];
        // alice's own Sandbox does not block her; the unstamped ones block everyone.
        assert_eq!(named_by_others("w", "alice", &sandboxes), 2);
        assert_eq!(named_by_others("w", "bob", &sandboxes), 3);
        assert_eq!(named_by_others("free", "bob", &sandboxes), 0);
        assert!(
            ClaimRefused::NamedByOthers(3)
                .to_string()
                .contains("3 Sandbox")
        );
    }

    #[test]
    fn only_the_current_owners_sandboxes_are_bound() {
        let bob = Owner {
            user: "bob".into(),
            expires_at: None,
        };
        assert_eq!(
            bindable("w", Some(&bob), &sandbox("w", Some("bob"))),
            Ok(())
        );
        // The workstation changed hands after alice's Sandbox was admitted.
        let refused = bindable("w", Some(&bob), &sandbox("w", Some("alice"))).unwrap_err();
        assert!(refused.contains("belongs to another user"), "{refused}");
        let refused = bindable("w", Some(&bob), &sandbox("w", None)).unwrap_err();
        assert!(refused.contains("recreate the Sandbox"), "{refused}");
        assert!(bindable("w", None, &sandbox("w", Some("bob"))).is_err());
    }
}
