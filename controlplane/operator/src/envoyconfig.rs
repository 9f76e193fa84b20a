//! EnvoyConfig controller: cuts an `EnvoyConfigRevision` per distinct spec (decoded and encoded
//! once, so the route server serves exactly what admission validated), keeps at most
//! [`MAX_REVISIONS`] in order, publishes the newest untainted one, and rolls back when every
//! node subscribed to the published revision rejected it (MARIN3R's rule: a partial rejection
//! is reported, never rolled back).
//!
//! Publishing is a label (`spur.dev/envoy-published=true`) the route server watches, plus
//! `status.lastPublishedAt`: the new revision is labelled before the old one is unlabelled, and
//! the route server serves the latest-published of two, so a node id never has a moment without
//! a configuration. A config whose node id an older config of its namespace holds is not
//! published at all ([`node_id`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Api, Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, NewCondition, set_condition};
use spur_api::envoyconfig::{
    CONFIG_LABEL, CacheState, MAX_REVISIONS, NodeCounts, PUBLISHED_LABEL, RevisionRef,
    Serialization, conditions,
};
use spur_api::{
    EnvoyConfig, EnvoyConfigRevision, EnvoyConfigRevisionSpec, EnvoyConfigRevisionStatus,
    EnvoyConfigSpec, EnvoyConfigStatus,
};

use crate::context::{Context, FIELD_MANAGER, delete_opt, now};
use crate::{Error, FINALIZER};

pub mod node_id;

/// How often a route server replica refreshes its report while it has streams of a node id
/// (`spur routeserver --xds-report-interval`); a report older than three of these is a dead
/// replica's and is not counted.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(30);

pub(crate) async fn reconcile(ec: Arc<EnvoyConfig>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("EnvoyConfig");
    let ns = ec.namespace().ok_or_else(|| Error::NoNamespace {
        kind: "EnvoyConfig",
        name: ec.name_any(),
    })?;
    let api: Api<EnvoyConfig> = Api::namespaced(ctx.client.clone(), &ns);
    let action = finalizer(&api, FINALIZER, ec, |event| async {
        match event {
            Event::Apply(ec) => apply(&ec, &ns, &ctx).await,
            Event::Cleanup(ec) => cleanup(&ec, &ns, &ctx).await,
        }
    })
    .await;
    spur_controller::finalized(action)
}

/// The revision name of `version` of config `name`: within the 253 bytes of a name.
pub fn revision_name(name: &str, version: &str) -> String {
    let keep = name.len().min(253 - version.len() - 1);
    let mut end = keep;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}-{version}", name[..end].trim_end_matches(['-', '.']))
}

/// The version of a spec: a hash of its resources as written (as MARIN3R's). Not of the encoded
/// messages: protobuf encodes map fields in no fixed order, so the same spec would not always
/// hash the same.
pub fn version_of(spec: &EnvoyConfigSpec) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(match spec.serialization {
        Serialization::Json => b"json\0",
        Serialization::Yaml => b"yaml\0",
    });
    for r in &spec.resources {
        ctx.update(r.type_.message_name().as_bytes());
        ctx.update(&[0]);
        ctx.update(&(r.value.len() as u64).to_be_bytes());
        ctx.update(r.value.as_bytes());
    }
    ctx.finish().as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn apply(ec: &EnvoyConfig, ns: &str, ctx: &Context) -> Result<Action, Error> {
    let name = ec.name_any();
    let old = ec.status.clone().unwrap_or_default();
    if let Some(action) = node_id::unpublish_if_held(ec, ns, ctx, &old).await? {
        return Ok(action);
    }
    let mut st = old.clone();
    st.observed_generation = ec.meta().generation;
    let cfg_api: Api<EnvoyConfig> = Api::namespaced(ctx.client.clone(), ns);

    let version = version_of(&ec.spec);
    let rev_api: Api<EnvoyConfigRevision> = Api::namespaced(ctx.client.clone(), ns);
    let existing: BTreeMap<String, EnvoyConfigRevision> = rev_api
        .list(&ListParams::default().labels(&format!("{CONFIG_LABEL}={name}")))
        .await?
        .items
        .into_iter()
        .map(|r| (r.name_any(), r))
        .collect();

    // The desired revision: created once; a spec that comes back (a new generation asking for
    // an old version) moves it to the end and clears its taint, since the user asked again.
    let desired = revision_name(&name, &version);
    let asked_again = st.desired_version.as_deref() != Some(version.as_str());
    if !existing.contains_key(&desired) {
        // Decoded and encoded once, when the revision is cut; its bytes are what is served.
        let encoded = match spur_envoy::decoder()?.decode_all(&ec.spec) {
            Ok(r) => r,
            Err(e) => {
                // Admission refuses this; only a config written while the webhook was not
                // installed gets here. What is published stays published.
                set(
                    &mut st,
                    ec,
                    conditions::IN_SYNC,
                    false,
                    "Invalid",
                    &e.to_string(),
                );
                ctx.status.apply(&cfg_api, ec, &old, &st).await?;
                return Ok(Action::await_change());
            }
        };
        let body = EnvoyConfigRevision {
            metadata: kube::api::ObjectMeta {
                name: Some(desired.clone()),
                namespace: Some(ns.to_owned()),
                labels: Some(BTreeMap::from([(CONFIG_LABEL.to_owned(), name.clone())])),
                owner_references: ec.controller_owner_ref(&()).map(|o| vec![o]),
                ..Default::default()
            },
            spec: EnvoyConfigRevisionSpec {
                node_id: ec.spec.node_id.clone(),
                version: version.clone(),
                resources: encoded,
            },
            status: None,
        };
        rev_api
            .patch(
                &desired,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await?;
    }
    // Revisions the status does not list (it was lost, or a write failed half-way) go first,
    // oldest first: nothing is deleted for not being listed.
    let mut unlisted: Vec<&EnvoyConfigRevision> = existing
        .values()
        .filter(|r| r.name_any() != desired && !st.revisions.iter().any(|o| o.ref_ == r.name_any()))
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
            st.revisions
                .iter()
                .filter(|r| r.ref_ != desired && existing.contains_key(&r.ref_))
                .cloned(),
        )
        .collect();
    order.push(RevisionRef {
        version: version.clone(),
        ref_: desired.clone(),
        tainted: false,
    });
    let mut tainted: BTreeMap<String, bool> = existing
        .iter()
        .map(|(n, r)| (n.clone(), r.status.as_ref().is_some_and(|s| s.tainted)))
        .collect();
    if asked_again && tainted.get(&desired) == Some(&true) {
        write_revision_status(&rev_api, &desired, |s| {
            s.tainted = false;
            s.conditions.retain(|c| c.type_ != conditions::TAINTED);
        })
        .await?;
        tainted.insert(desired.clone(), false);
    }

    // The published revision rejected by every node subscribed to it is tainted.
    let fresh = fresh_since();
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
        .map(|s| s.counts(&fresh))
        .unwrap_or_default();
    if let Some(p) = published {
        let pname = p.name_any();
        if counts.subscribed > 0
            && counts.nacked == counts.subscribed
            && tainted.get(&pname) == Some(&false)
        {
            let message = format!(
                "every subscribed node ({}) rejected revision {}: {}",
                counts.subscribed,
                p.spec.version,
                counts.message.as_deref().unwrap_or("no reason given")
            );
            write_revision_status(&rev_api, &pname, |s| {
                s.tainted = true;
                set_condition(
                    &mut s.conditions,
                    NewCondition {
                        type_: conditions::TAINTED,
                        status: ConditionStatus::True,
                        reason: "ResourcesFailing",
                        message: &message,
                        observed_generation: None,
                    },
                    &now(),
                );
            })
            .await?;
            tainted.insert(pname, true);
            ctx.event(ec, true, "RevisionTainted", "Rollback", message)
                .await;
        }
    }
    for r in &mut order {
        r.tainted = tainted.get(&r.ref_).copied().unwrap_or(false);
    }
    // At most MAX_REVISIONS, oldest dropped first; never the one about to be published.
    let target_idx = order.iter().rposition(|r| !r.tainted);
    let target = match target_idx {
        Some(i) => order[i].ref_.clone(),
        // Nothing good left: the failing newest stays (MARIN3R keeps serving it too).
        None => desired.clone(),
    };
    while order.len() > MAX_REVISIONS {
        let Some(i) = order.iter().position(|r| r.ref_ != target) else {
            break;
        };
        let gone = order.remove(i);
        delete_opt(&rev_api, &gone.ref_).await?;
    }

    // Publish: label the target first, then unlabel the rest.
    let previous = published.map(|p| p.name_any());
    if previous.as_deref() != Some(target.as_str()) {
        write_revision_status(&rev_api, &target, |s| {
            s.published = true;
            s.last_published_at = Some(now());
            s.reports.clear();
        })
        .await?;
        set_published_label(&rev_api, &target, true).await?;
        let reason = if target == desired {
            "Published"
        } else {
            "RolledBack"
        };
        ctx.event(
            ec,
            target != desired,
            reason,
            "Publish",
            format!("revision {target} is served to node id {}", ec.spec.node_id),
        )
        .await;
        counts = NodeCounts::default();
    }
    for (n, r) in &existing {
        let labelled = r.labels().get(PUBLISHED_LABEL).map(String::as_str) == Some("true");
        let marked = r.status.as_ref().is_some_and(|s| s.published);
        if *n != target && order.iter().any(|o| &o.ref_ == n) && (labelled || marked) {
            set_published_label(&rev_api, n, false).await?;
            write_revision_status(&rev_api, n, |s| s.published = false).await?;
        }
    }

    let target_version = order
        .iter()
        .find(|r| r.ref_ == target)
        .map(|r| r.version.clone());
    let state = if target == desired && !order.last().is_some_and(|r| r.tainted) {
        CacheState::InSync
    } else if target_idx.is_some() {
        CacheState::Rollback
    } else {
        CacheState::RollbackFailed
    };
    if st.cache_state != Some(state) && state == CacheState::RollbackFailed {
        ctx.event(
            ec,
            true,
            "RollbackFailed",
            "Rollback",
            format!("every kept revision of {name} is tainted; the newest is served"),
        )
        .await;
    }
    st.cache_state = Some(state);
    st.desired_version = Some(version.clone());
    st.published_version = target_version.clone();
    st.revisions = order;
    st.nodes = (counts.subscribed > 0).then_some(counts.clone());
    let (ok, reason, message) = match state {
        CacheState::InSync => (
            true,
            "Published",
            format!("revision {version} is published"),
        ),
        CacheState::Rollback => (
            false,
            "Rollback",
            format!(
                "revision {version} was rejected by every subscribed node; serving {}",
                target_version.as_deref().unwrap_or_default()
            ),
        ),
        CacheState::RollbackFailed => (
            false,
            "RollbackFailed",
            format!("revision {version} was rejected and no earlier good revision is kept"),
        ),
    };
    set(&mut st, ec, conditions::IN_SYNC, ok, reason, &message);
    if counts.nacked > 0 && counts.nacked < counts.subscribed {
        let message = format!(
            "{} of {} subscribed nodes reject revision {}: {}",
            counts.nacked,
            counts.subscribed,
            target_version.as_deref().unwrap_or_default(),
            counts.message.as_deref().unwrap_or("no reason given")
        );
        set(
            &mut st,
            ec,
            conditions::NODES_FAILING,
            true,
            "PartialNack",
            &message,
        );
    } else {
        set(
            &mut st,
            ec,
            conditions::NODES_FAILING,
            false,
            "NoneFailing",
            "",
        );
    }
    if counts.unresolved_secrets.is_empty() {
        set(
            &mut st,
            ec,
            conditions::SECRETS_RESOLVED,
            true,
            "Resolved",
            "",
        );
    } else {
        let message = format!(
            "the route server cannot serve: {}",
            counts.unresolved_secrets.join("; ")
        );
        set(
            &mut st,
            ec,
            conditions::SECRETS_RESOLVED,
            false,
            "SecretUnavailable",
            &message,
        );
    }
    ctx.status.apply(&cfg_api, ec, &old, &st).await?;
    // Reports are refreshed every REPORT_INTERVAL; a look now and then ages dead ones out.
    Ok(Action::requeue(REPORT_INTERVAL * 2))
}

fn set(
    st: &mut EnvoyConfigStatus,
    ec: &EnvoyConfig,
    type_: &str,
    ok: bool,
    reason: &str,
    message: &str,
) {
    set_condition(
        &mut st.conditions,
        NewCondition {
            type_,
            status: if ok {
                ConditionStatus::True
            } else {
                ConditionStatus::False
            },
            reason,
            message,
            observed_generation: ec.meta().generation,
        },
        &now(),
    );
}

/// Reports written since this instant count.
fn fresh_since() -> k8s_openapi::jiff::Timestamp {
    let stale = k8s_openapi::jiff::SignedDuration::try_from(REPORT_INTERVAL * 3)
        .unwrap_or(k8s_openapi::jiff::SignedDuration::from_secs(90));
    k8s_openapi::jiff::Timestamp::now() - stale
}

async fn set_published_label(
    api: &Api<EnvoyConfigRevision>,
    name: &str,
    on: bool,
) -> Result<(), Error> {
    let value = if on {
        serde_json::Value::from("true")
    } else {
        serde_json::Value::Null
    };
    let patch = serde_json::json!({ "metadata": { "labels": { PUBLISHED_LABEL: value } } });
    match api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Changes the operator's fields of a revision's status (`published`, `tainted`,
/// `lastPublishedAt`, conditions) by merge patch, leaving the route servers' `reports` alone.
async fn write_revision_status(
    api: &Api<EnvoyConfigRevision>,
    name: &str,
    f: impl FnOnce(&mut EnvoyConfigRevisionStatus),
) -> Result<(), Error> {
    let Some(rev) = api.get_opt(name).await? else {
        return Ok(());
    };
    let mut st = rev.status.clone().unwrap_or_default();
    let reports_before = st.reports.clone();
    f(&mut st);
    let mut body = serde_json::json!({
        "status": {
            "published": st.published,
            "tainted": st.tainted,
            "lastPublishedAt": st.last_published_at,
            "conditions": st.conditions,
        }
    });
    if st.reports != reports_before {
        body["status"]["reports"] = serde_json::to_value(&st.reports)?;
    }
    match api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&body))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn cleanup(ec: &EnvoyConfig, ns: &str, ctx: &Context) -> Result<Action, Error> {
    let api: Api<EnvoyConfigRevision> = Api::namespaced(ctx.client.clone(), ns);
    let list = api
        .list(&ListParams::default().labels(&format!("{CONFIG_LABEL}={}", ec.name_any())))
        .await?;
    for r in list.items {
        delete_opt(&api, &r.name_any()).await?;
    }
    Ok(Action::await_change())
}

pub(crate) fn error_policy(ec: Arc<EnvoyConfig>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry(&*ec, err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revision_names_fit() {
        let v = "0123456789abcdef";
        assert_eq!(revision_name("front", v), "front-0123456789abcdef");
        let long = "a".repeat(253);
        let n = revision_name(&long, v);
        assert_eq!(n.len(), 253);
        assert!(n.ends_with(v));
    }

    #[test]
    fn versions_follow_the_spec() {
        use spur_api::envoyconfig::{EnvoyResource, EnvoyResourceType as T};
        let spec = |ser, resources: &[(T, &str)]| EnvoyConfigSpec {
            node_id: "n".into(),
            serialization: ser,
            resources: resources
                .iter()
                .map(|(t, v)| EnvoyResource {
                    type_: *t,
                    value: (*v).into(),
                    generate_from_tls_secret: None,
                    blueprint: None,
                })
                .collect(),
        };
        let a = version_of(&spec(Serialization::Json, &[(T::Cluster, "{}")]));
        assert_eq!(a.len(), 16);
        assert_eq!(
            a,
            version_of(&spec(Serialization::Json, &[(T::Cluster, "{}")]))
        );
        for other in [
            spec(Serialization::Yaml, &[(T::Cluster, "{}")]),
            spec(Serialization::Json, &[(T::Listener, "{}")]),
            spec(Serialization::Json, &[(T::Cluster, "{ }")]),
            spec(Serialization::Json, &[(T::Cluster, "{}"), (T::Cluster, "")]),
        ] {
            assert_ne!(a, version_of(&other));
        }
    }
}
