//! The EnvoyConfigRevisions an EnvoyConfig keeps and which one is published, as pure functions
//! of the revisions that exist and of what the route servers report on them.

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;
use kube::api::ObjectMeta;
use kube::{Resource, ResourceExt};
use spur_api::envoyconfig::{
    CONFIG_LABEL, CacheState, EncodedResource, MAX_REVISIONS, NodeCounts, PUBLISHED_LABEL,
    RevisionRef,
};
use spur_api::{EnvoyConfig, EnvoyConfigRevision, EnvoyConfigRevisionSpec};

/// Revision `name` of `ec` (in `ns`) for `version`: `resources` as encoded when it is cut,
/// labelled with and owned by its config.
pub(super) fn revision(
    ec: &EnvoyConfig,
    ns: &str,
    name: &str,
    version: &str,
    resources: Vec<EncodedResource>,
) -> EnvoyConfigRevision {
    EnvoyConfigRevision {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            labels: Some(BTreeMap::from([(CONFIG_LABEL.to_owned(), ec.name_any())])),
            owner_references: ec.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: EnvoyConfigRevisionSpec {
            node_id: ec.spec.node_id.clone(),
            version: version.to_owned(),
            resources,
        },
        status: None,
    }
}

/// What a pass does to the revisions, each step in the order the controller takes it.
#[derive(Debug, PartialEq)]
pub(super) struct Plan {
    /// The desired revision is tainted and its spec came back: the user asked again, so its
    /// taint is cleared.
    pub untaint: bool,
    /// The published revision every subscribed node rejected, and the message saying so: it
    /// is tainted.
    pub taint: Option<(String, String)>,
    /// Revisions past [`MAX_REVISIONS`], oldest first: deleted.
    pub delete: Vec<String>,
    /// The revision to serve: the newest untainted one, else the desired one.
    pub target: String,
    /// Whether `target` is not the published revision yet (it is labelled before the others
    /// are unlabelled).
    pub publish: bool,
    /// Kept revisions other than `target` still labelled or marked published: unpublished.
    pub unpublish: Vec<String>,
    /// The revisions kept, oldest first, with their taint.
    pub order: Vec<RevisionRef>,
    pub state: CacheState,
    /// What the nodes did with the published revision; none yet when `target` is new.
    pub counts: NodeCounts,
}

/// The plan for config revisions `existing` (by name), of which the status listed `listed`,
/// when the spec asks for revision `desired` of `version` (`asked_again`: a new spec asks for
/// it). Reports older than `fresh` do not count.
pub(super) fn plan(
    existing: &BTreeMap<String, EnvoyConfigRevision>,
    listed: &[RevisionRef],
    desired: &str,
    version: &str,
    asked_again: bool,
    fresh: &Timestamp,
) -> Plan {
    let mut order = order(existing, listed, desired, version);
    let mut tainted: BTreeMap<String, bool> = existing
        .iter()
        .map(|(n, r)| (n.clone(), r.status.as_ref().is_some_and(|s| s.tainted)))
        .collect();
    let untaint = asked_again && tainted.get(desired) == Some(&true);
    if untaint {
        tainted.insert(desired.to_owned(), false);
    }

    // The published revision rejected by every node subscribed to it is tainted.
    let published = existing
        .values()
        .filter(|r| r.status.as_ref().is_some_and(|s| s.published))
        .max_by_key(|r| {
            (
                r.status.as_ref().and_then(|s| s.last_published_at.clone()),
                r.name_any(),
            )
        });
    let mut counts = published
        .and_then(|r| r.status.as_ref())
        .map(|s| s.counts(fresh))
        .unwrap_or_default();
    let taint = published.and_then(|p| rejected(p, &counts, &tainted));
    if let Some((p, _)) = &taint {
        tainted.insert(p.clone(), true);
    }
    for r in &mut order {
        r.tainted = tainted.get(&r.ref_).copied().unwrap_or(false);
    }
    // At most MAX_REVISIONS, oldest dropped first; never the one about to be published.
    let target_idx = order.iter().rposition(|r| !r.tainted);
    let target = match target_idx {
        Some(i) => order[i].ref_.clone(),
        // Nothing good left: the failing newest stays (MARIN3R keeps serving it too).
        None => desired.to_owned(),
    };
    let mut delete = Vec::new();
    while order.len() > MAX_REVISIONS {
        let Some(i) = order.iter().position(|r| r.ref_ != target) else {
            break;
        };
        delete.push(order.remove(i).ref_);
    }

    let publish = published.map(ResourceExt::name_any).as_deref() != Some(target.as_str());
    if publish {
        counts = NodeCounts::default();
    }
    let unpublish = existing
        .iter()
        .filter(|(n, r)| {
            let labelled = r.labels().get(PUBLISHED_LABEL).map(String::as_str) == Some("true");
            let marked = r.status.as_ref().is_some_and(|s| s.published);
            **n != target && order.iter().any(|o| &o.ref_ == *n) && (labelled || marked)
        })
        .map(|(n, _)| n.clone())
        .collect();
    let state = if target == desired && !order.last().is_some_and(|r| r.tainted) {
        CacheState::InSync
    } else if target_idx.is_some() {
        CacheState::Rollback
    } else {
        CacheState::RollbackFailed
    };
    Plan {
        untaint,
        taint,
        delete,
        target,
        publish,
        unpublish,
        order,
        state,
        counts,
    }
}

/// The kept revisions, oldest first, ending with `desired`. Revisions the status does not
/// list (it was lost, or a write failed half-way) go first, oldest first: nothing is deleted
/// for not being listed.
fn order(
    existing: &BTreeMap<String, EnvoyConfigRevision>,
    listed: &[RevisionRef],
    desired: &str,
    version: &str,
) -> Vec<RevisionRef> {
    let mut unlisted: Vec<&EnvoyConfigRevision> = existing
        .values()
        .filter(|r| r.name_any() != desired && !listed.iter().any(|o| o.ref_ == r.name_any()))
        .collect();
    unlisted.sort_by_key(|r| (r.creation_timestamp(), r.name_any()));
    let mut order: Vec<RevisionRef> = unlisted
        .into_iter()
        .map(|r| RevisionRef {
            version: r.spec.version.clone(),
            ref_: r.name_any(),
            tainted: false,
        })
        .chain(
            listed
                .iter()
                .filter(|r| r.ref_ != desired && existing.contains_key(&r.ref_))
                .cloned(),
        )
        .collect();
    order.push(RevisionRef {
        version: version.to_owned(),
        ref_: desired.to_owned(),
        tainted: false,
    });
    order
}

/// The published revision `p`'s name and why it is tainted, when every node subscribed to it
/// rejected it (`counts`) and it is not tainted yet.
fn rejected(
    p: &EnvoyConfigRevision,
    counts: &NodeCounts,
    tainted: &BTreeMap<String, bool>,
) -> Option<(String, String)> {
    let name = p.name_any();
    let all = counts.subscribed > 0
        && counts.nacked == counts.subscribed
        && tainted.get(&name) == Some(&false);
    all.then(|| {
        let message = format!(
            "every subscribed node ({}) rejected revision {}: {}",
            counts.subscribed,
            p.spec.version,
            counts.message.as_deref().unwrap_or("no reason given")
        );
        (name, message)
    })
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    pub(in crate::envoyconfig) fn config() -> EnvoyConfig {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "EnvoyConfig",
            "metadata": {"name": "front", "namespace": "shop", "uid": "u-1", "generation": 4},
            "spec": {"nodeID": "edge", "resources": []},
        }))
        .unwrap()
    }

    /// Revision `front-<v>` made at minute `minute`, with `status`.
    fn rev(v: &str, minute: u32, status: serde_json::Value) -> (String, EnvoyConfigRevision) {
        let r: EnvoyConfigRevision = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "EnvoyConfigRevision",
            "metadata": {"name": format!("front-{v}"), "namespace": "shop",
                         "creationTimestamp": format!("2026-01-01T00:{minute:02}:00Z")},
            "spec": {"nodeID": "edge", "version": v, "resources": []},
            "status": status,
        }))
        .unwrap();
        (r.name_any(), r)
    }

    /// A published revision's status with one fresh report of `nacked` of `subscribed`.
    fn published(subscribed: u32, nacked: u32) -> serde_json::Value {
        json!({"published": true, "lastPublishedAt": "2026-01-01T00:30:00Z",
               "reports": [{"replica": "rs-0", "subscribed": subscribed, "acked": subscribed - nacked,
                            "nacked": nacked, "message": "bad cluster",
                            "updatedAt": "2026-01-01T01:00:00Z"}]})
    }

    fn listed(v: &str, tainted: bool) -> RevisionRef {
        RevisionRef {
            version: v.into(),
            ref_: format!("front-{v}"),
            tainted,
        }
    }

    fn fresh() -> Timestamp {
        "2026-01-01T00:59:00Z".parse().unwrap()
    }

    #[test]
    fn a_revision_is_labelled_and_owned_by_its_config() {
        let r = revision(&config(), "shop", "front-v1", "v1", Vec::new());
        assert_eq!(r.labels()[CONFIG_LABEL], "front");
        assert_eq!(r.owner_references()[0].uid, "u-1");
        assert_eq!(
            (r.spec.node_id.as_str(), r.spec.version.as_str()),
            ("edge", "v1")
        );
    }

    #[test]
    fn the_first_revision_is_published() {
        let p = plan(&BTreeMap::new(), &[], "front-v1", "v1", true, &fresh());
        assert_eq!(p.order, [listed("v1", false)]);
        assert_eq!(p.target, "front-v1");
        assert!(p.publish && p.unpublish.is_empty() && p.delete.is_empty());
        assert_eq!(
            (p.state, p.taint, p.untaint),
            (CacheState::InSync, None, false)
        );
    }

    #[test]
    fn a_new_revision_replaces_the_published_one_and_unlisted_ones_go_first() {
        let existing = BTreeMap::from([
            rev("v1", 1, published(2, 1)),
            rev("v0", 5, json!({})),
            rev("vx", 3, json!({})),
        ]);
        let p = plan(
            &existing,
            &[listed("v1", false)],
            "front-v2",
            "v2",
            true,
            &fresh(),
        );
        // Unlisted ones by creation time, then the listed, then the desired.
        let refs: Vec<&str> = p.order.iter().map(|r| r.ref_.as_str()).collect();
        assert_eq!(refs, ["front-vx", "front-v0", "front-v1", "front-v2"]);
        assert_eq!(p.unpublish, ["front-v1"]);
        assert!(p.publish && p.taint.is_none());
        // Counts are of the revision now published: none yet.
        assert_eq!(p.counts, NodeCounts::default());
        assert_eq!(p.state, CacheState::InSync);
    }

    #[test]
    fn a_partial_rejection_is_counted_never_rolled_back() {
        let existing = BTreeMap::from([rev("v1", 1, published(3, 1))]);
        let p = plan(
            &existing,
            &[listed("v1", false)],
            "front-v1",
            "v1",
            false,
            &fresh(),
        );
        assert!(!p.publish && p.taint.is_none() && p.unpublish.is_empty());
        assert_eq!((p.counts.subscribed, p.counts.nacked), (3, 1));
        assert_eq!(p.state, CacheState::InSync);
        // A stale report does not count.
        let late: Timestamp = "2026-01-01T02:00:00Z".parse().unwrap();
        let p = plan(
            &existing,
            &[listed("v1", false)],
            "front-v1",
            "v1",
            false,
            &late,
        );
        assert_eq!(p.counts, NodeCounts::default());
    }

    #[test]
    fn a_revision_every_node_rejects_is_tainted_and_rolled_back() {
        let existing = BTreeMap::from([rev("v1", 1, json!({})), rev("v2", 2, published(2, 2))]);
        let was = [listed("v1", false), listed("v2", false)];
        let p = plan(&existing, &was, "front-v2", "v2", false, &fresh());
        let (name, message) = p.taint.clone().unwrap();
        assert_eq!(name, "front-v2");
        assert_eq!(
            message,
            "every subscribed node (2) rejected revision v2: bad cluster"
        );
        assert_eq!(p.order, [listed("v1", false), listed("v2", true)]);
        assert_eq!(p.target, "front-v1");
        assert!(p.publish);
        assert_eq!(p.unpublish, ["front-v2"]);
        assert_eq!(p.state, CacheState::Rollback);
    }

    #[test]
    fn with_every_revision_tainted_the_newest_is_served() {
        let existing = BTreeMap::from([
            rev("v1", 1, json!({"tainted": true})),
            rev("v2", 2, published(1, 1)),
        ]);
        let was = [listed("v1", true), listed("v2", false)];
        let p = plan(&existing, &was, "front-v2", "v2", false, &fresh());
        assert_eq!(p.target, "front-v2");
        assert!(!p.publish && p.unpublish.is_empty());
        assert_eq!(p.state, CacheState::RollbackFailed);
    }

    #[test]
    fn a_spec_asked_for_again_clears_its_revisions_taint() {
        let existing = BTreeMap::from([
            rev("v1", 1, json!({"tainted": true})),
            rev("v2", 2, published(1, 0)),
        ]);
        let was = [listed("v1", true), listed("v2", false)];
        let p = plan(&existing, &was, "front-v1", "v1", true, &fresh());
        assert!(p.untaint);
        assert_eq!(p.order, [listed("v2", false), listed("v1", false)]);
        assert_eq!((p.target.as_str(), p.publish), ("front-v1", true));
        assert_eq!(p.unpublish, ["front-v2"]);
        assert_eq!(p.state, CacheState::InSync);
        // The same spec, not asked again: its taint stands, and v2 stays served.
        let p = plan(&existing, &was, "front-v1", "v1", false, &fresh());
        assert!(!p.untaint);
        assert_eq!(
            (p.target.as_str(), p.state),
            ("front-v2", CacheState::Rollback)
        );
    }

    #[test]
    fn the_oldest_revisions_past_the_limit_are_deleted_never_the_target() {
        let n = u32::try_from(MAX_REVISIONS).unwrap() + 2;
        let mut existing: BTreeMap<_, _> = (0..n)
            .map(|i| rev(&format!("v{i:02}"), i, json!({"tainted": i > 0})))
            .collect();
        // The desired one is tainted too: the oldest, the only good one, is served and kept.
        existing.extend([rev("v99", 59, json!({"tainted": true}))]);
        let was: Vec<_> = (0..n).map(|i| listed(&format!("v{i:02}"), i > 0)).collect();
        let p = plan(&existing, &was, "front-v99", "v99", false, &fresh());
        assert_eq!(p.target, "front-v00");
        assert_eq!(p.order.len(), MAX_REVISIONS);
        assert_eq!(p.order[0].ref_, "front-v00");
        assert_eq!(p.delete, ["front-v01", "front-v02", "front-v03"]);
        assert_eq!(p.state, CacheState::Rollback);
    }
}
