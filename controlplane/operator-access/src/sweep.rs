//! The second sweeper (docs/access.md, "Expiry"): `spur-operator sweep-access`, which the chart runs as a
//! CronJob under its own ServiceAccount (`spur-access-sweeper`), ends exec and debug-pod grants
//! whose time is up even while the operator is down or scaled to zero.
//!
//! It keeps no state and needs none of the operator's: each grant's Role and RoleBinding carry
//! their end (annotation `spur.dev/expires-at`, never later than their creation plus the longest
//! grant), and their owner reference names the request. A grant goes when its end has passed,
//! or when its request has expired, is gone or is being deleted (revoked while the operator was
//! down: the request's finalizer keeps it until the operator is back). RoleBindings go before
//! Roles, as the operator removes them: once the binding is gone nothing is granted.
//!
//! What it may do is only this: list Roles and RoleBindings, delete them, and read requests
//! (`files/access-sweeper-rules.yaml`); the policy `spur-access-sweeper` lets it delete only
//! Roles and RoleBindings named and labelled as grants.

use std::collections::HashMap;

use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Preconditions};
use kube::{Client, Resource};
use spur_api::access::{
    ExecAccessRequest, MAX_ACCESS_DURATION, PodAccessRequest, labels as access_labels,
};

use super::{AccessRequest, deadline};
use spur_operator_core::Error;

/// What one sweep did.
#[derive(Debug, Default)]
pub struct Swept {
    /// The grant objects deleted, and why.
    pub ended: Vec<Ended>,
    /// Grant objects still in effect.
    pub kept: usize,
}

/// One grant object the sweep deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// `RoleBinding` or `Role`.
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
    pub why: String,
}

/// Where a grant's request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RequestState {
    /// In effect until this instant.
    Live(Timestamp),
    /// Being deleted: revoked.
    Deleting,
}

/// One pass over every grant of the cluster.
pub async fn sweep(client: &Client) -> Result<Swept, Error> {
    let lp = ListParams::default().labels(access_labels::ACCESS_REQUEST);
    let bindings = Api::<RoleBinding>::all(client.clone())
        .list_metadata(&lp)
        .await?
        .items;
    let roles = Api::<Role>::all(client.clone())
        .list_metadata(&lp)
        .await?
        .items;
    // The requests are read after the grants: a request is always made before its grant, so
    // one missing here was really gone, not yet to come.
    let mut requests = HashMap::new();
    collect::<ExecAccessRequest>(client, &mut requests).await?;
    collect::<PodAccessRequest>(client, &mut requests).await?;
    let now = Timestamp::now();
    let mut swept = Swept::default();
    for b in &bindings {
        end_if_due(
            &mut swept,
            "RoleBinding",
            &b.metadata,
            &requests,
            now,
            |ns| Api::<RoleBinding>::namespaced(client.clone(), ns),
        )
        .await?;
    }
    for r in &roles {
        end_if_due(&mut swept, "Role", &r.metadata, &requests, now, |ns| {
            Api::<Role>::namespaced(client.clone(), ns)
        })
        .await?;
    }
    Ok(swept)
}

/// The requests of kind `K`, by uid.
async fn collect<K: AccessRequest>(
    client: &Client,
    into: &mut HashMap<String, RequestState>,
) -> Result<(), Error> {
    for r in Api::<K>::all(client.clone())
        .list(&ListParams::default())
        .await?
    {
        let Some(uid) = r.meta().uid.clone() else {
            continue;
        };
        let state = if r.meta().deletion_timestamp.is_some() {
            RequestState::Deleting
        } else {
            RequestState::Live(deadline(&r))
        };
        into.insert(uid, state);
    }
    Ok(())
}

/// Deletes the grant object `meta` (of `kind`) if its time is up; only that very object (a
/// uid precondition: a newer grant of the same name is not touched).
async fn end_if_due<K>(
    swept: &mut Swept,
    kind: &'static str,
    meta: &ObjectMeta,
    requests: &HashMap<String, RequestState>,
    now: Timestamp,
    api: impl Fn(&str) -> Api<K>,
) -> Result<(), Error>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let (Some(ns), Some(name)) = (&meta.namespace, &meta.name) else {
        return Ok(());
    };
    let Some(why) = why_ended(meta, requests, now) else {
        if is_grant(meta) {
            swept.kept += 1;
        }
        return Ok(());
    };
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: meta.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::background()
    };
    match api(ns).delete(name, &dp).await {
        Ok(_) => {
            tracing::info!(kind, namespace = %ns, name = %name, why = %why, "access grant swept");
            swept.ended.push(Ended {
                kind,
                namespace: ns.clone(),
                name: name.clone(),
                why,
            });
            Ok(())
        }
        // Gone meanwhile (the operator took it back), or replaced by a newer grant.
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Named and labelled as the operator makes grants (the policy spur-access-sweeper lets the
/// sweeper delete nothing else).
fn is_grant(meta: &ObjectMeta) -> bool {
    meta.name
        .as_deref()
        .is_some_and(|n| n.starts_with("access-"))
        && meta
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(access_labels::ACCESS_REQUEST))
}

/// Why the grant object `meta` must go now, or `None` while it is in effect.
fn why_ended(
    meta: &ObjectMeta,
    requests: &HashMap<String, RequestState>,
    now: Timestamp,
) -> Option<String> {
    if !is_grant(meta) {
        return None;
    }
    // Never later than creation plus the longest grant, whatever the annotation says (and
    // that much without one: a grant written before the annotation existed).
    let created = meta.creation_timestamp.as_ref().map(|t| t.0);
    let bound = created.and_then(|c| c.checked_add(MAX_ACCESS_DURATION).ok());
    let annotated = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(access_labels::EXPIRES_AT))
        .and_then(|t| t.parse::<Timestamp>().ok());
    let end = match (annotated, bound) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    if let Some(end) = end
        && now >= end
    {
        return Some(format!("the grant ended at {end}"));
    }
    let owner = meta.owner_references.iter().flatten().find(|o| {
        o.controller == Some(true)
            && matches!(o.kind.as_str(), "ExecAccessRequest" | "PodAccessRequest")
    })?;
    match requests.get(&owner.uid) {
        None => Some(format!("its {} {} is gone", owner.kind, owner.name)),
        Some(RequestState::Deleting) => Some(format!(
            "its {} {} was deleted (revoked)",
            owner.kind, owner.name
        )),
        Some(RequestState::Live(end)) if now >= *end => {
            Some(format!("its {} {} ended at {end}", owner.kind, owner.name))
        }
        Some(RequestState::Live(_)) => None,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};

    use super::*;

    fn grant(name: &str, created: Timestamp, expires: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: Some("shop".into()),
            uid: Some(format!("{name}-uid")),
            creation_timestamp: Some(Time(created)),
            labels: Some(BTreeMap::from([(
                access_labels::ACCESS_REQUEST.to_owned(),
                "alice-web".to_owned(),
            )])),
            annotations: expires
                .map(|e| BTreeMap::from([(access_labels::EXPIRES_AT.to_owned(), e.to_owned())])),
            owner_references: Some(vec![OwnerReference {
                api_version: "spur.dev/v1alpha1".into(),
                kind: "ExecAccessRequest".into(),
                name: "alice-web".into(),
                uid: "req-uid".into(),
                controller: Some(true),
                block_owner_deletion: None,
            }]),
            ..ObjectMeta::default()
        }
    }

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn grants_end_at_their_annotated_end_or_with_their_request() {
        let created = at("2026-01-01T10:00:00Z");
        let g = grant("access-x", created, Some("2026-01-01T10:30:00Z"));
        let live = HashMap::from([(
            "req-uid".to_owned(),
            RequestState::Live(at("2026-01-01T10:30:00Z")),
        )]);
        assert_eq!(why_ended(&g, &live, at("2026-01-01T10:29:59Z")), None);
        assert!(
            why_ended(&g, &live, at("2026-01-01T10:30:00Z"))
                .unwrap()
                .contains("ended at 2026-01-01T10:30:00Z")
        );
        // The request went (or is going) before the end: so does the grant.
        let gone = HashMap::new();
        let why = why_ended(&g, &gone, at("2026-01-01T10:10:00Z")).unwrap();
        assert!(why.contains("ExecAccessRequest alice-web is gone"), "{why}");
        let deleting = HashMap::from([("req-uid".to_owned(), RequestState::Deleting)]);
        let why = why_ended(&g, &deleting, at("2026-01-01T10:10:00Z")).unwrap();
        assert!(why.contains("revoked"), "{why}");
        // The request's own end counts even if the annotation said later.
        let shorter = HashMap::from([(
            "req-uid".to_owned(),
            RequestState::Live(at("2026-01-01T10:05:00Z")),
        )]);
        assert!(why_ended(&g, &shorter, at("2026-01-01T10:06:00Z")).is_some());
    }

    #[test]
    fn no_grant_outlives_the_longest_grant_and_only_grants_are_touched() {
        let created = at("2026-01-01T10:00:00Z");
        let week_later = created
            .checked_add(MAX_ACCESS_DURATION + Duration::from_secs(1))
            .unwrap();
        let live = HashMap::from([("req-uid".to_owned(), RequestState::Live(week_later))]);
        // A far-off or unreadable annotation, or none: creation plus a week at the latest.
        for expires in [Some("2030-01-01T00:00:00Z"), Some("soon"), None] {
            let g = grant("access-x", created, expires);
            assert!(
                why_ended(&g, &live, week_later).is_some(),
                "{expires:?} outlived the longest grant"
            );
        }
        // Not named or not labelled as a grant: never deleted.
        let other = grant("admins", created, Some("2026-01-01T10:30:00Z"));
        assert_eq!(why_ended(&other, &HashMap::new(), week_later), None);
        let mut unlabelled = grant("access-y", created, Some("2026-01-01T10:30:00Z"));
        unlabelled.labels = None;
        assert_eq!(why_ended(&unlabelled, &HashMap::new(), week_later), None);
    }
}
