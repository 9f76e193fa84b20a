//! `spur local token --owner`: an administrator records whose workstation a token is for
//! (docs/local.md, "Workstation owners"). The record is the ConfigMap the operator's signer and
//! tunnel grants write ([`spur_api::workstation`]); Sandboxes may name the workstation only if
//! their creator is its owner.

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use spur_api::workstation::{self as ws, Owner};

/// What happened to the record.
pub(super) enum Recorded {
    /// `user` owns the workstation (a new record, or theirs extended).
    Owner,
    /// Another user's claim was replaced: an administrator's decision.
    Reassigned,
}

/// Records `user` as the owner of `workstation` until `until` (`None`: until an administrator
/// changes it). The same user's claim is extended, never shortened; another user's is
/// replaced, since only an administrator writes tokens.
pub(super) async fn record(
    client: kube::Client,
    namespace: &str,
    workstation: &str,
    user: &str,
    until: Option<Timestamp>,
) -> Result<Recorded> {
    if user.is_empty() || user.len() > ws::USERNAME_MAX {
        anyhow::bail!(
            "--owner must be a Kubernetes username of 1 to {} bytes",
            ws::USERNAME_MAX
        );
    }
    let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, namespace);
    let name = ws::owner_record_name(workstation);
    let context = || format!("cannot write the owner record ConfigMap {namespace}/{name}");
    let current = api.get_opt(&name).await.with_context(context)?;
    let previous = current.as_ref().and_then(Owner::from_record);
    let (owner, outcome) = match ws::claim(previous.as_ref(), user, until, Timestamp::now()) {
        Ok(o) if previous.as_ref().is_some_and(|p| p.user != user) => (o, Recorded::Reassigned),
        Ok(o) => (o, Recorded::Owner),
        Err(_) => (
            Owner {
                user: user.to_string(),
                expires_at: until,
            },
            Recorded::Reassigned,
        ),
    };
    match current {
        None => {
            api.create(
                &PostParams::default(),
                &owner.record(namespace, workstation),
            )
            .await
            .with_context(context)?;
        }
        Some(cm) => {
            // The read's resourceVersion makes a concurrent change fail instead of being lost;
            // `null` removes an expiry the new claim does not have.
            let patch = serde_json::json!({"metadata": {
                "resourceVersion": cm.metadata.resource_version,
                "annotations": {
                    ws::OWNER_ANNOTATION: owner.user,
                    ws::EXPIRES_ANNOTATION: owner.expires_at.map(|t| t.to_string()),
                },
            }});
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .with_context(context)?;
        }
    }
    Ok(outcome)
}
