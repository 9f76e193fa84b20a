//! Reading and claiming workstation owner records ([`spur_api::workstation`]): the signer claims
//! a workstation for the requester of its certificate, a tunnel grant for its requester, and the
//! Sandbox admission webhook reads the record.
//!
//! A claim is read-then-write with the read's resourceVersion as a precondition (a create for a
//! new record), so two users claiming one workstation at once cannot both win: the loser's write
//! fails with a conflict and is retried against the winner's record.
//!
//! A workstation does not change hands while Sandboxes of another user (or without a recorded
//! creator) name it: the new owner would otherwise receive their keyed traffic.

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use spur_api::Sandbox;
use spur_api::workstation::{self as ws, ClaimRefused, Owner};

use crate::Error;

/// Attempts before a claim that keeps losing races gives up (and is retried by its caller).
const CLAIM_ATTEMPTS: usize = 3;

/// The record of `workstation` and its resourceVersion, if there is one.
async fn read(
    api: &Api<ConfigMap>,
    workstation: &str,
) -> Result<Option<(Option<Owner>, String)>, Error> {
    Ok(api
        .get_opt(&ws::owner_record_name(workstation))
        .await?
        .map(|cm| {
            let version = cm.metadata.resource_version.clone().unwrap_or_default();
            (Owner::from_record(&cm), version)
        }))
}

/// The recorded owner of `workstation`, if any.
pub async fn owner(api: &Api<ConfigMap>, workstation: &str) -> Result<Option<Owner>, Error> {
    Ok(read(api, workstation).await?.and_then(|(o, _)| o))
}

/// Records `user` as the owner of `workstation` until `until` (see [`ws::claim`]). `Ok(Err)`
/// when another user's claim holds it.
pub async fn claim(
    api: &Api<ConfigMap>,
    namespace: &str,
    workstation: &str,
    user: &str,
    until: Option<Timestamp>,
) -> Result<Result<Owner, ClaimRefused>, Error> {
    for _ in 0..CLAIM_ATTEMPTS {
        let current = read(api, workstation).await?;
        let now = Timestamp::now();
        let owner = match ws::claim(
            current.as_ref().and_then(|(o, _)| o.as_ref()),
            user,
            until,
            now,
        ) {
            Ok(o) => o,
            Err(refused) => return Ok(Err(refused)),
        };
        let unchanged = current
            .as_ref()
            .is_some_and(|(o, _)| o.as_ref() == Some(&owner));
        if unchanged {
            return Ok(Ok(owner));
        }
        let changes_hands = current
            .as_ref()
            .and_then(|(o, _)| o.as_ref())
            .is_none_or(|o| o.user != user);
        if changes_hands {
            // Sandboxes are cluster-scoped and a field selector cannot reach spec.workstation:
            // list them all (claims are rare: a certificate or a grant).
            let sandboxes = Api::<Sandbox>::all(api.clone().into_client())
                .list(&ListParams::default())
                .await?;
            let others = ws::named_by_others(workstation, user, &sandboxes.items);
            if others > 0 {
                return Ok(Err(ClaimRefused::NamedByOthers(others)));
            }
        }
        let record = owner.record(namespace, workstation);
        let written = match &current {
            None => api
                .create(&PostParams::default(), &record)
                .await
                .map(|_| ()),
            Some((_, version)) => {
                // A merge patch carrying the read's resourceVersion fails with 409 if the record
                // changed since; the annotations are replaced as a whole (a `null` expiry
                // removes an old one).
                let patch = serde_json::json!({
                    "metadata": {
                        "resourceVersion": version,
                        "labels": record.metadata.labels,
                        "annotations": {
                            ws::OWNER_ANNOTATION: owner.user,
                            ws::EXPIRES_ANNOTATION: owner.expires_at.map(|t| t.to_string()),
                        },
                    }
                });
                api.patch(
                    &ws::owner_record_name(workstation),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
                .map(|_| ())
            }
        };
        match written {
            Ok(()) => {
                tracing::info!(%workstation, user, until = ?owner.expires_at, "workstation owner recorded");
                return Ok(Ok(owner));
            }
            // Someone else wrote the record first: read it again.
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(Error::Pending(format!(
        "the owner record of workstation {workstation} to stop changing"
    )))
}

/// Whether `sb`'s local workloads may be bound to its workstation now ([`ws::bindable`]): its
/// creator must be the workstation's recorded owner, read from `records` (the release
/// namespace's).
pub async fn bindable(records: &Api<ConfigMap>, sb: &Sandbox) -> Result<Result<(), String>, Error> {
    let Some(workstation) = sb.spec.workstation.as_deref() else {
        return Ok(Ok(()));
    };
    let owner = owner(records, workstation).await?;
    Ok(ws::bindable(workstation, owner.as_ref(), sb))
}
