//! Approval by a second user (docs/access.md, "Approval"): a template may require that a
//! request waits until someone other than the requester approves it.
//!
//! The approval is recorded on the request as two annotations, written by the approver
//! (`spur access approve`): their username and the groups they present. The chart's policy
//! `spur-access-requests` checks, whenever these annotations change, that the username is the
//! writer's own, that every group is one of the writer's, that the writer is not the requester
//! and that they hold the verb `approve` on the request's kind. The operator then only matches
//! the recorded groups against the template's `approvers`.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::IDENTITY_MAX;
use crate::validation::Checker;

/// Annotation of an approved request: the approver's username.
pub const APPROVED_BY: &str = "spur.dev/approved-by";
/// Annotation of an approved request: the approver's groups, comma-separated (a group with a
/// comma in its name cannot be presented).
pub const APPROVED_BY_GROUPS: &str = "spur.dev/approved-by-groups";
/// Most approver groups a template may name.
pub const MAX_APPROVERS: usize = 64;
/// Group names that can be recorded (no comma: the groups annotation is comma-separated).
pub const APPROVER_GROUP_PATTERN: &str = "^[^,]+$";

/// Whether requests need a second user's approval before they are granted.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.required || !has(self.approvers) || size(self.approvers) == 0",
    "message": "approvers apply only when required is true"
}]))]
pub struct Approval {
    /// Requests wait (`Ready=False`, reason `PendingApproval`) until a user other than the
    /// requester, holding the verb `approve` on the request's kind, approves them
    /// (`spur access approve`).
    #[serde(default)]
    pub required: bool,
    /// Groups whose members may approve (default: any user holding the verb). The approver
    /// presents their groups when approving; one of them must be listed here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_APPROVERS),
        inner(length(min = 1, max = IDENTITY_MAX), regex(pattern = APPROVER_GROUP_PATTERN))
    )]
    pub approvers: Vec<String>,
}

/// Who approved a request, as its annotations record it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Approver {
    pub username: String,
    pub groups: Vec<String>,
}

impl Approver {
    /// The approval recorded in a request's annotations, if any.
    pub fn of(annotations: &BTreeMap<String, String>) -> Option<Approver> {
        let username = annotations.get(APPROVED_BY).filter(|u| !u.is_empty())?;
        let groups = annotations
            .get(APPROVED_BY_GROUPS)
            .map(|g| {
                g.split(',')
                    .filter(|g| !g.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        Some(Approver {
            username: username.clone(),
            groups,
        })
    }

    /// The annotations that record this approval. Groups with a comma in their name are left
    /// out (they could not be read back as one group).
    pub fn annotations(&self) -> BTreeMap<String, String> {
        let groups: Vec<&str> = self
            .groups
            .iter()
            .map(String::as_str)
            .filter(|g| !g.is_empty() && !g.contains(','))
            .collect();
        BTreeMap::from([
            (APPROVED_BY.to_owned(), self.username.clone()),
            (APPROVED_BY_GROUPS.to_owned(), groups.join(",")),
        ])
    }
}

/// Where a request stands with its template's approval.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApprovalState {
    /// The template requires no approval.
    NotRequired,
    /// Approved by this user.
    Approved(String),
    /// Nobody has approved it yet.
    Pending,
    /// The recorded approver is the requester (the chart's policy refuses to record that; this
    /// holds without it too).
    ByRequester,
    /// The recorded approver is in none of the template's approver groups.
    NotAnApprover(String),
}

impl Approval {
    /// Where a request of `requester`, approved by `approver` (if anyone), stands.
    pub fn state(&self, requester: &str, approver: Option<&Approver>) -> ApprovalState {
        if !self.required {
            return ApprovalState::NotRequired;
        }
        let Some(a) = approver else {
            return ApprovalState::Pending;
        };
        if a.username == requester {
            return ApprovalState::ByRequester;
        }
        if !self.approvers.is_empty() && !a.groups.iter().any(|g| self.approvers.contains(g)) {
            return ApprovalState::NotAnApprover(a.username.clone());
        }
        ApprovalState::Approved(a.username.clone())
    }

    pub(crate) fn check(&self, c: &mut Checker, path: &str) {
        c.require(
            self.required || self.approvers.is_empty(),
            || format!("{path}.approvers"),
            "apply only when required is true",
        );
        c.max_items(
            || format!("{path}.approvers"),
            &self.approvers,
            MAX_APPROVERS,
        );
        for (i, g) in self.approvers.iter().enumerate() {
            c.require(
                !g.is_empty() && g.len() <= IDENTITY_MAX && !g.contains(','),
                || format!("{path}.approvers[{i}]"),
                "must be 1-512 bytes without a comma",
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn approver(user: &str, groups: &[&str]) -> Approver {
        Approver {
            username: user.into(),
            groups: groups.iter().map(|g| (*g).to_owned()).collect(),
        }
    }

    #[test]
    fn approvals_are_read_back_from_their_annotations() {
        let a = approver("carol", &["leads", "a,b", "oncall"]);
        let read = Approver::of(&a.annotations()).unwrap();
        assert_eq!(read, approver("carol", &["leads", "oncall"]));
        assert_eq!(Approver::of(&BTreeMap::new()), None);
        let empty = BTreeMap::from([(APPROVED_BY.to_owned(), String::new())]);
        assert_eq!(Approver::of(&empty), None);
    }

    #[test]
    fn only_another_user_of_an_approver_group_approves() {
        let none = Approval::default();
        assert_eq!(none.state("alice", None), ApprovalState::NotRequired);
        let any = Approval {
            required: true,
            approvers: vec![],
        };
        assert_eq!(any.state("alice", None), ApprovalState::Pending);
        assert_eq!(
            any.state("alice", Some(&approver("alice", &[]))),
            ApprovalState::ByRequester
        );
        assert_eq!(
            any.state("alice", Some(&approver("carol", &[]))),
            ApprovalState::Approved("carol".into())
        );
        let leads = Approval {
            required: true,
            approvers: vec!["leads".into()],
        };
        assert_eq!(
            leads.state("alice", Some(&approver("bob", &["devs"]))),
            ApprovalState::NotAnApprover("bob".into())
        );
        assert_eq!(
            leads.state("alice", Some(&approver("carol", &["devs", "leads"]))),
            ApprovalState::Approved("carol".into())
        );
        let mut c = Checker::default();
        Approval {
            required: false,
            approvers: vec!["a,b".into()],
        }
        .check(&mut c, "spec.accessConfig.approval");
        let e = c.finish("ExecAccessTemplate").unwrap_err().to_string();
        assert!(e.contains("apply only when required"), "{e}");
        assert!(e.contains("without a comma"), "{e}");
    }
}
