//! What the chart's hook `spur-operator apply-crds` does before every `helm install` and
//! `helm upgrade` changes anything (charts/spur/templates/crds.yaml, docs/install.md
//! "Upgrading"): Helm installs the CRDs of a chart's `crds/` once and never upgrades them, so
//! without this an upgrade runs the new operator against the old schemas (new fields pruned on
//! every write).
//!
//! Each CRD the binary was built with is applied server-side under this hook's field manager,
//! which then owns the whole CRD: the fields other managers hold (helm created the CRDs; a user
//! may have run `kubectl apply`) are merged into its own entry and the CRD applied once more, so
//! a field this release no longer has is removed rather than kept alive by a manager that will
//! never apply again (what client-go's `csaupgrade` does for the same reason).
//!
//! Then every CRD whose `status.storedVersions` names a version other than its storage version
//! (a release that moved storage from `v1alpha1` to `v1beta1`) has its objects migrated, as
//! kube-storage-version-migrator does: once the API server's discovery says it stores that kind
//! in the new version (`storageVersionHash`; the switch follows the CRD change asynchronously),
//! each object is written back unchanged, which the API server stores in the new version, and
//! only when all were is `status.storedVersions` set to the storage version alone. That is what
//! lets a later release drop the old version: the API server refuses a CRD whose versions leave
//! out one still in `storedVersions` (Kubernetes' "Versions in CustomResourceDefinitions"). A
//! new CRD that drops a version still stored is refused here, before anything changed.
//!
//! With several API servers, each switches its storage when it sees the CRD change; discovery
//! answers from one of them. A write in the moments between may still land in the old version,
//! as with the storage version migrator; `storedVersions` would then be wrong about it.

use std::collections::HashSet;
use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};
use kube::api::{
    ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Api, Client};
use serde_json::Value;

use crate::Error;

/// The field manager of the CRDs' server-side apply (not the controllers': nothing of theirs is
/// on a CRD).
pub const FIELD_MANAGER: &str = "spur-apply-crds";

/// How long a CRD may take to be served, and its storage to switch, after it was applied (a
/// second or two on an API server that is not overloaded).
const SWITCH_WAIT: Duration = Duration::from_secs(60);
/// Objects listed per page while migrating.
const PAGE: u32 = 250;
/// Writes of one object that lost to a concurrent writer before the migration gives up (each
/// retry reads it again: a controller updating it at that very moment).
const CONFLICT_RETRIES: usize = 5;

/// Applies `crds` and migrates the stored versions that need it, handing `report` a line for
/// each step as soon as it is done (so a failure half-way leaves a record of what changed
/// before it).
pub async fn apply(
    client: &Client,
    crds: &[CustomResourceDefinition],
    mut report: impl FnMut(String),
) -> Result<(), Error> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    // Every refusal before anything changed.
    let mut live = Vec::new();
    for crd in crds {
        let name = name_of(crd)?;
        let current = api.get_opt(name).await?;
        if let Some(current) = &current {
            refuse_dropped_stored_version(crd, current)?;
        }
        live.push(current);
    }
    let params = PatchParams::apply(FIELD_MANAGER).force();
    for (crd, before) in crds.iter().zip(live) {
        let name = name_of(crd)?;
        let mut applied = api.patch(name, &params, &Patch::Apply(crd)).await?;
        if take_over(&api, &applied).await? {
            // Owning them now, the apply removes the fields this release no longer has.
            applied = api.patch(name, &params, &Patch::Apply(crd)).await?;
        }
        let what = match &before {
            None => "created",
            Some(b) if b.metadata.resource_version == applied.metadata.resource_version => {
                "unchanged"
            }
            Some(_) => "updated",
        };
        report(format!("CRD {name}: {what}"));
        let established = established(&api, name).await?;
        if let Some(migrated) = migrate(client, &api, &established).await? {
            report(format!("CRD {name}: {migrated}"));
        }
    }
    Ok(())
}

fn name_of(crd: &CustomResourceDefinition) -> Result<&str, Error> {
    crd.metadata
        .name
        .as_deref()
        .ok_or_else(|| Error::Upgrade("a CRD without a name".into()))
}

/// The version `crd` stores its objects in.
fn storage_version(crd: &CustomResourceDefinition) -> Result<&str, Error> {
    crd.spec
        .versions
        .iter()
        .find(|v| v.storage)
        .map(|v| v.name.as_str())
        .ok_or_else(|| {
            Error::Upgrade(format!(
                "CRD {}: no version is marked as the storage version",
                crd.metadata.name.as_deref().unwrap_or_default()
            ))
        })
}

/// The versions `crd`'s objects are stored in, as its status says (none for a CRD the API
/// server has not reported on yet).
fn stored_versions(crd: &CustomResourceDefinition) -> &[String] {
    crd.status
        .as_ref()
        .and_then(|s| s.stored_versions.as_deref())
        .unwrap_or_default()
}

/// Refuses a `new` CRD that leaves out a version objects of `current` may still be stored in.
fn refuse_dropped_stored_version(
    new: &CustomResourceDefinition,
    current: &CustomResourceDefinition,
) -> Result<(), Error> {
    let kept: Vec<&str> = new.spec.versions.iter().map(|v| v.name.as_str()).collect();
    let dropped: Vec<&str> = stored_versions(current)
        .iter()
        .map(String::as_str)
        .filter(|v| !kept.contains(v))
        .collect();
    if dropped.is_empty() {
        return Ok(());
    }
    Err(Error::Upgrade(format!(
        "CRD {}: this release no longer serves {}, in which objects may still be stored \
         (status.storedVersions). Upgrade to a release that serves both the old and the new \
         version first (its upgrade migrates the objects), then to this one; a release older \
         than the one whose upgrade migrated them cannot run on these CRDs. Nothing was changed",
        name_of(new)?,
        dropped.join(", ")
    )))
}

/// Makes this hook's manager the only one of `crd`'s fields (but the API server's status): the
/// other managers' fields are merged into its entry and their entries dropped. `false` when
/// there were none.
async fn take_over(
    api: &Api<CustomResourceDefinition>,
    crd: &CustomResourceDefinition,
) -> Result<bool, Error> {
    let name = name_of(crd)?;
    let entries = crd.metadata.managed_fields.clone().unwrap_or_default();
    let Some(merged) = merged_entries(&entries) else {
        return Ok(false);
    };
    // Only the object as applied: a concurrent change fails the test and the upgrade, to run
    // again.
    let patch = serde_json::json!([
        {"op": "test", "path": "/metadata/resourceVersion",
         "value": crd.metadata.resource_version},
        {"op": "replace", "path": "/metadata/managedFields", "value": merged},
    ]);
    let patch: json_patch::Patch =
        serde_json::from_value(patch).map_err(|e| Error::Upgrade(format!("CRD {name}: {e}")))?;
    api.patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
        .map_err(|e| {
            Error::Upgrade(format!(
                "CRD {name}: taking over the fields of its other managers: {e}; run the upgrade \
                 again"
            ))
        })?;
    Ok(true)
}

/// `entries` with every other manager's fields of the object itself (but its metadata) merged
/// into this hook's apply entry (subresources' entries, the API server's status, kept as they
/// are); `None` when no other manager holds any.
fn merged_entries(entries: &[ManagedFieldsEntry]) -> Option<Vec<ManagedFieldsEntry>> {
    let main = |e: &ManagedFieldsEntry| e.subresource.as_deref().unwrap_or_default().is_empty();
    let ours = |e: &ManagedFieldsEntry| {
        main(e)
            && e.manager.as_deref() == Some(FIELD_MANAGER)
            && e.operation.as_deref() == Some("Apply")
    };
    let mut own = entries.iter().find(|e| ours(e))?.clone();
    let others: Vec<&ManagedFieldsEntry> = entries.iter().filter(|e| main(e) && !ours(e)).collect();
    if others.is_empty() {
        return None;
    }
    let mut fields = own
        .fields_v1
        .take()
        .map(|f| f.0)
        .unwrap_or(Value::Object(Default::default()));
    for other in &others {
        if let Some(f) = &other.fields_v1 {
            // Not their metadata: labels, annotations or finalizers others put on Spur's CRDs
            // (the chart sets none) stay as they are, owned by no one, rather than be removed
            // by the next apply.
            let mut f = f.0.clone();
            if let Value::Object(m) = &mut f {
                m.remove("f:metadata");
            }
            union(&mut fields, &f);
        }
    }
    own.fields_v1 = Some(FieldsV1(fields));
    let mut kept = vec![own];
    kept.extend(entries.iter().filter(|e| !main(e)).cloned());
    Some(kept)
}

/// Adds the field set `from` to `into` (both `FieldsV1` tries: objects whose keys name fields,
/// `{}` at the leaves).
fn union(into: &mut Value, from: &Value) {
    let (Value::Object(into), Value::Object(from)) = (into, from) else {
        return;
    };
    for (k, v) in from {
        match into.get_mut(k) {
            Some(existing) => union(existing, v),
            None => {
                into.insert(k.clone(), v.clone());
            }
        }
    }
}

/// Waits until CRD `name` is Established with its names accepted; returns it as it is then.
async fn established(
    api: &Api<CustomResourceDefinition>,
    name: &str,
) -> Result<CustomResourceDefinition, Error> {
    let deadline = tokio::time::Instant::now() + SWITCH_WAIT;
    loop {
        let crd = api.get(name).await?;
        let condition = |kind: &str| {
            crd.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == kind && c.status == "True"))
        };
        if condition("Established") && condition("NamesAccepted") {
            return Ok(crd);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Upgrade(format!(
                "CRD {name}: not Established {}s after it was applied: {:?}",
                SWITCH_WAIT.as_secs(),
                crd.status.and_then(|s| s.conditions)
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The `storageVersionHash` the API server's discovery reports for a kind stored in
/// `group/version` (apiserver's `storageversionhash.StorageVersionHash`): the first 8 bytes
/// of the SHA-256 of `group/version/kind`, base64.
fn storage_version_hash(group: &str, version: &str, kind: &str) -> String {
    let digest = ring::digest::digest(
        &ring::digest::SHA256,
        format!("{group}/{version}/{kind}").as_bytes(),
    );
    base64::engine::general_purpose::STANDARD.encode(&digest.as_ref()[..8])
}

/// Waits until discovery says the API server stores `resource` in its version.
async fn storage_switched(client: &Client, resource: &ApiResource) -> Result<(), Error> {
    let want = storage_version_hash(&resource.group, &resource.version, &resource.kind);
    let deadline = tokio::time::Instant::now() + SWITCH_WAIT;
    loop {
        let seen = match client.list_api_group_resources(&resource.api_version).await {
            Ok(list) => list
                .resources
                .into_iter()
                .find(|r| r.name == resource.plural)
                .and_then(|r| r.storage_version_hash),
            Err(kube::Error::Api(s)) if s.code == 404 => None,
            Err(e) => return Err(e.into()),
        };
        if seen.as_deref() == Some(want.as_str()) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Upgrade(format!(
                "{} {}: the API server does not store it in {} {}s after the CRD changed \
                 (discovery's storageVersionHash is {seen:?}, not {want:?}); run the upgrade again",
                resource.kind,
                resource.plural,
                resource.version,
                SWITCH_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Migrates `crd`'s objects to its storage version when its status names another stored
/// version; what was done, or `None` when nothing needed it.
async fn migrate(
    client: &Client,
    crds: &Api<CustomResourceDefinition>,
    crd: &CustomResourceDefinition,
) -> Result<Option<String>, Error> {
    let name = name_of(crd)?;
    let storage = storage_version(crd)?;
    let stored = stored_versions(crd);
    if stored.iter().all(|v| v == storage) {
        return Ok(None);
    }
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(&crd.spec.group, storage, &crd.spec.names.kind),
        &crd.spec.names.plural,
    );
    storage_switched(client, &resource).await?;
    let rewritten = rewrite_all(client, &resource, crd.spec.scope == "Namespaced").await?;
    // Only now: every object that was stored in an older version has been written in the new
    // one (and anything written since the switch was stored in it). Only the CRD as it was
    // read: a concurrent change of it fails the patch, to run again.
    storage_switched(client, &resource).await?;
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": crd.metadata.resource_version},
        "status": {"storedVersions": [storage]},
    });
    crds.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| {
            Error::Upgrade(format!(
                "CRD {name}: every object was written in {storage}, but setting \
                 status.storedVersions failed: {e}; run the upgrade again"
            ))
        })?;
    Ok(Some(format!(
        "stored versions {} migrated to {storage} ({rewritten} objects rewritten)",
        stored.join(", ")
    )))
}

/// Writes every object of `resource` back unchanged, page by page; how many were written. A
/// listing whose continue token expired (the API server compacted its history) starts over:
/// a second write of an object is harmless, and each is counted once.
async fn rewrite_all(
    client: &Client,
    resource: &ApiResource,
    namespaced: bool,
) -> Result<usize, Error> {
    let all: Api<DynamicObject> = Api::all_with(client.clone(), resource);
    let mut written = HashSet::new();
    let mut params = ListParams::default().limit(PAGE);
    loop {
        let page = match all.list(&params).await {
            Err(kube::Error::Api(s)) if s.code == 410 && params.continue_token.is_some() => {
                params = ListParams::default().limit(PAGE);
                continue;
            }
            other => other?,
        };
        for object in &page.items {
            let (Some(name), Some(uid)) = (
                object.metadata.name.as_deref(),
                object.metadata.uid.as_deref(),
            ) else {
                continue;
            };
            if written.contains(uid) {
                continue;
            }
            let namespace = object.metadata.namespace.as_deref().filter(|_| namespaced);
            let api: Api<DynamicObject> = match namespace {
                Some(ns) => Api::namespaced_with(client.clone(), ns, resource),
                None => Api::all_with(client.clone(), resource),
            };
            if rewrite(&api, resource, namespace, name, object.clone()).await? {
                written.insert(uid.to_owned());
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(written.len()),
        }
    }
}

/// Writes `object` back unchanged (read again after a conflict); `false` when it is gone.
async fn rewrite(
    api: &Api<DynamicObject>,
    resource: &ApiResource,
    namespace: Option<&str>,
    name: &str,
    mut object: DynamicObject,
) -> Result<bool, Error> {
    let what = || match namespace {
        Some(ns) => format!("{} {ns}/{name}", resource.kind),
        None => format!("{} {name}", resource.kind),
    };
    for _ in 0..CONFLICT_RETRIES {
        // A list's items may come without their type; a write needs it.
        object.types = Some(kube::core::TypeMeta {
            api_version: resource.api_version.clone(),
            kind: resource.kind.clone(),
        });
        match api.replace(name, &PostParams::default(), &object).await {
            Ok(_) => return Ok(true),
            // The version is served (discovery said so before): the object itself is gone.
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(false),
            Err(kube::Error::Api(s)) if s.code == 409 => match api.get_opt(name).await? {
                Some(fresh) => object = fresh,
                None => return Ok(false),
            },
            Err(e) => {
                return Err(Error::Upgrade(format!(
                    "{}: writing it back unchanged, to store it in {}, failed: {e} (an \
                     admission webhook or policy on it refused, or its webhook is down); \
                     nothing was lost: fix that and run the upgrade again",
                    what(),
                    resource.version
                )));
            }
        }
    }
    Err(Error::Upgrade(format!(
        "{}: still changing after {CONFLICT_RETRIES} tries to migrate it; run the upgrade again",
        what()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
        CustomResourceDefinitionStatus, CustomResourceDefinitionVersion,
    };
    use serde_json::{Value, json};

    fn crd(versions: &[(&str, bool)], stored: &[&str]) -> CustomResourceDefinition {
        let mut crd = CustomResourceDefinition::default();
        crd.metadata.name = Some("widgets.spur.dev".into());
        crd.spec.versions = versions
            .iter()
            .map(|(name, storage)| CustomResourceDefinitionVersion {
                name: (*name).into(),
                served: true,
                storage: *storage,
                ..Default::default()
            })
            .collect();
        crd.status = Some(CustomResourceDefinitionStatus {
            stored_versions: Some(stored.iter().map(|s| (*s).into()).collect()),
            ..Default::default()
        });
        crd
    }

    #[test]
    fn a_new_crd_may_not_drop_a_version_still_stored() {
        let current = crd(
            &[("v1alpha1", false), ("v1beta1", true)],
            &["v1alpha1", "v1beta1"],
        );
        let drops = crd(&[("v1beta1", true)], &[]);
        let err = refuse_dropped_stored_version(&drops, &current).unwrap_err();
        assert!(
            err.to_string().contains("no longer serves v1alpha1"),
            "{err}"
        );
        assert!(err.to_string().contains("Nothing was changed"), "{err}");
        // Once migrated (storedVersions the storage version alone), it may.
        let migrated = crd(&[("v1alpha1", false), ("v1beta1", true)], &["v1beta1"]);
        refuse_dropped_stored_version(&drops, &migrated).unwrap();
        // Keeping every version is always fine.
        refuse_dropped_stored_version(&current, &current).unwrap();
    }

    #[test]
    fn the_storage_version_hash_is_the_api_servers() {
        // What `kubectl get --raw /apis/apps/v1` reports for deployments.
        assert_eq!(
            storage_version_hash("apps", "v1", "Deployment"),
            "8aSe+NMegvE="
        );
    }

    fn entry(
        manager: &str,
        operation: &str,
        sub: Option<&str>,
        fields: Value,
    ) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.into()),
            operation: Some(operation.into()),
            subresource: sub.map(Into::into),
            fields_v1: Some(FieldsV1(fields)),
            ..Default::default()
        }
    }

    #[test]
    fn other_managers_fields_become_the_hooks() {
        let ours = entry(
            FIELD_MANAGER,
            "Apply",
            None,
            json!({"f:spec": {"f:group": {}}}),
        );
        let helm = entry(
            "helm",
            "Update",
            None,
            json!({
                "f:metadata": {"f:finalizers": {".": {}}},
                "f:spec": {"f:group": {}, "f:names": {"f:shortNames": {}}},
            }),
        );
        let status = entry(
            "kube-apiserver",
            "Update",
            Some("status"),
            json!({"f:status": {}}),
        );
        // Alone (but the status), nothing to do.
        assert!(merged_entries(&[ours.clone(), status.clone()]).is_none());
        // Not applied yet: nothing to merge into.
        assert!(merged_entries(std::slice::from_ref(&helm)).is_none());
        let merged = merged_entries(&[helm, ours, status.clone()]).unwrap();
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].manager.as_deref(), Some(FIELD_MANAGER));
        assert_eq!(
            merged[0].fields_v1.as_ref().unwrap().0,
            json!({"f:spec": {"f:group": {}, "f:names": {"f:shortNames": {}}}})
        );
        assert_eq!(merged[1], status);
    }

    #[test]
    fn the_storage_version_is_the_one_marked() {
        let c = crd(&[("v1alpha1", false), ("v1beta1", true)], &[]);
        assert_eq!(storage_version(&c).unwrap(), "v1beta1");
        let none = crd(&[("v1alpha1", false)], &[]);
        assert!(storage_version(&none).is_err());
        assert!(stored_versions(&CustomResourceDefinition::default()).is_empty());
    }
}
