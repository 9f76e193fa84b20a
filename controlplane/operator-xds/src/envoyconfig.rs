//! EnvoyConfig controller: cuts an `EnvoyConfigRevision` per distinct spec (decoded and encoded
//! once, so the route server serves exactly what admission validated), keeps at most
//! [`MAX_REVISIONS`](spur_api::envoyconfig::MAX_REVISIONS) in order, publishes the newest
//! untainted one, and rolls back when every node subscribed to the published revision rejected
//! it (MARIN3R's rule: a partial rejection is reported, never rolled back). What to keep and
//! publish is [`desired`]; the status it leaves is [`status`].
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
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, set_now};
use spur_api::envoyconfig::{CONFIG_LABEL, CacheState, PUBLISHED_LABEL, Serialization, conditions};
use spur_api::{EnvoyConfig, EnvoyConfigRevision, EnvoyConfigRevisionStatus, EnvoyConfigSpec};
use tokio_util::sync::CancellationToken;

use spur_operator_core::{Context, Error, FIELD_MANAGER, FINALIZER, delete_opt, now};

mod desired;
pub mod node_id;
mod status;

/// How often a route server replica refreshes its report while it has streams of a node id
/// (`spur routeserver --xds-report-interval`); a report older than three of these is a dead
/// replica's and is not counted.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(30);

/// Runs the EnvoyConfig controller until `stop`. A revision's status (the route servers'
/// reports) wakes its config.
pub async fn run(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    let envoy = spur_controller::changes::primary(Api::<EnvoyConfig>::all(client.clone()))
        .with_config(spur_operator_core::controller_config())
        .owns(
            Api::<EnvoyConfigRevision>::all(client),
            watcher::Config::default(),
        );
    spur_controller::run("envoyconfig", envoy, reconcile, error_policy, ctx, stop).await;
}

async fn reconcile(ec: Arc<EnvoyConfig>, ctx: Arc<Context>) -> Result<Action, Error> {
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
                status::invalid(&mut st, ec, &e.to_string());
                ctx.status.apply(&cfg_api, ec, &old, &st).await?;
                return Ok(Action::await_change());
            }
        };
        let body = desired::revision(ec, ns, &desired, &version, encoded);
        rev_api
            .patch(
                &desired,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await?;
    }
    let plan = desired::plan(
        &existing,
        &st.revisions,
        &desired,
        &version,
        asked_again,
        &fresh_since(),
    );
    carry_out(&plan, ec, &desired, &rev_api, ctx).await?;
    if old.cache_state != Some(plan.state) && plan.state == CacheState::RollbackFailed {
        ctx.event(
            ec,
            true,
            "RollbackFailed",
            "Rollback",
            format!("every kept revision of {name} is tainted; the newest is served"),
        )
        .await;
    }
    status::status(&mut st, ec, &version, plan);
    ctx.status.apply(&cfg_api, ec, &old, &st).await?;
    // Reports are refreshed every REPORT_INTERVAL; a look now and then ages dead ones out.
    Ok(Action::requeue(REPORT_INTERVAL * 2))
}

/// Writes what `plan` decided, in its order: taints, deletions past the limit, then publishing
/// (the target labelled before the others are unlabelled).
async fn carry_out(
    plan: &desired::Plan,
    ec: &EnvoyConfig,
    desired: &str,
    rev_api: &Api<EnvoyConfigRevision>,
    ctx: &Context,
) -> Result<(), Error> {
    if plan.untaint {
        write_revision_status(rev_api, desired, |s| {
            s.tainted = false;
            s.conditions.retain(|c| c.type_ != conditions::TAINTED);
        })
        .await?;
    }
    if let Some((pname, message)) = &plan.taint {
        write_revision_status(rev_api, pname, |s| {
            s.tainted = true;
            set_now(
                &mut s.conditions,
                None,
                conditions::TAINTED,
                ConditionStatus::True,
                "ResourcesFailing",
                message,
            );
        })
        .await?;
        ctx.event(ec, true, "RevisionTainted", "Rollback", message.clone())
            .await;
    }
    for gone in &plan.delete {
        delete_opt(rev_api, gone).await?;
    }
    let target = &plan.target;
    if plan.publish {
        write_revision_status(rev_api, target, |s| {
            s.published = true;
            s.last_published_at = Some(now());
            s.reports.clear();
        })
        .await?;
        set_published_label(rev_api, target, true).await?;
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
    }
    for n in &plan.unpublish {
        set_published_label(rev_api, n, false).await?;
        write_revision_status(rev_api, n, |s| s.published = false).await?;
    }
    Ok(())
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

fn error_policy(ec: Arc<EnvoyConfig>, err: &Error, ctx: Arc<Context>) -> Action {
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
