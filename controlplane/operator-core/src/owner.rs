//! What the operator creates for itself in its own namespace (the CA and serving-certificate
//! Secrets, the CA bundle ConfigMap, the leader-election Lease) is owned by the operator's
//! Deployment, so deleting the installation (`helm uninstall`) deletes it too, through the
//! garbage collector; `helm upgrade` keeps the Deployment, and with it the CA.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::Error;

/// The owner reference of Deployment `namespace/name` (the operator's own).
pub async fn deployment_owner(
    client: Client,
    namespace: &str,
    name: &str,
) -> Result<OwnerReference, Error> {
    let d = Api::<Deployment>::namespaced(client, namespace)
        .get_opt(name)
        .await?
        .ok_or_else(|| {
            Error::Config(format!(
                "owner Deployment {namespace}/{name} not found (--owner-deployment)"
            ))
        })?;
    let uid = d
        .uid()
        .ok_or_else(|| Error::Config(format!("Deployment {namespace}/{name} has no uid")))?;
    Ok(OwnerReference {
        api_version: "apps/v1".into(),
        kind: "Deployment".into(),
        name: name.into(),
        uid,
        // Neither controller (the objects have no controller) nor blockOwnerDeletion (which
        // needs update on deployments/finalizers, a right the operator does not otherwise need).
        controller: None,
        block_owner_deletion: None,
    })
}

/// Whether `obj` already names `owner` (by uid) among its owners.
pub fn owned_by<K: Resource>(obj: &K, owner: &OwnerReference) -> bool {
    obj.owner_references().iter().any(|o| o.uid == owner.uid)
}

/// Adds `owner` to object `name`'s owners unless it is there; a missing object is fine. A
/// conflict (the object changed between read and write, e.g. a Lease renewed) is retried.
pub async fn adopt<K>(api: &Api<K>, name: &str, owner: &OwnerReference) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    change_owners(api, name, |owners| {
        (!owners.iter().any(|o| o.uid == owner.uid)).then(|| {
            let mut owners = owners.to_vec();
            owners.push(owner.clone());
            owners
        })
    })
    .await
}

/// Takes the owner of uid `uid` off object `name`'s owners, so that the owner's deletion leaves
/// it; a missing object, or one it does not own, is fine. Conflicts are retried as for [`adopt`].
pub async fn disown<K>(api: &Api<K>, name: &str, uid: &str) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    change_owners(api, name, |owners| {
        owners
            .iter()
            .any(|o| o.uid == uid)
            .then(|| owners.iter().filter(|o| o.uid != uid).cloned().collect())
    })
    .await
}

/// Writes `change(owners)` as object `name`'s owners when it is `Some`, retrying conflicts.
async fn change_owners<K>(
    api: &Api<K>,
    name: &str,
    change: impl Fn(&[OwnerReference]) -> Option<Vec<OwnerReference>>,
) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut attempt = 0;
    loop {
        attempt += 1;
        match change_owners_once(api, name, &change).await {
            Err(Error::Kube(kube::Error::Api(s))) if s.code == 409 && attempt < 5 => {
                tokio::time::sleep(std::time::Duration::from_millis(50 * attempt)).await;
            }
            other => return other,
        }
    }
}

async fn change_owners_once<K>(
    api: &Api<K>,
    name: &str,
    change: &impl Fn(&[OwnerReference]) -> Option<Vec<OwnerReference>>,
) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let Some(obj) = api.get_opt(name).await? else {
        return Ok(());
    };
    let Some(owners) = change(obj.owner_references()) else {
        return Ok(());
    };
    // A merge patch with the whole list, compared against the version read: a concurrent change
    // of the owners fails with a conflict (retried) instead of being lost.
    let patch = serde_json::json!({
        "metadata": {
            "ownerReferences": owners,
            "resourceVersion": obj.resource_version(),
        }
    });
    match api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}
