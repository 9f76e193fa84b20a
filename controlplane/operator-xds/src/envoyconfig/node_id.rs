//! One node id, one EnvoyConfig per namespace. The route server keys what it serves by
//! (namespace, node id), so namespaces never compete; within one namespace two configs for one
//! node id would both be published and the latest-published would silently win. Admission
//! refuses the second ([`admission`]); a duplicate that got in anyway (created while the webhook
//! was not installed, or two creations racing through it) is reported by the controller and not
//! published ([`holder`]): the older config keeps the node id.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::ListParams;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, Operation};
use kube::runtime::controller::Action;
use kube::{Api, Client, Resource, ResourceExt};
use spur_api::envoyconfig::{CONFIG_LABEL, PUBLISHED_LABEL, conditions};
use spur_api::{EnvoyConfig, EnvoyConfigRevision, EnvoyConfigStatus};

use spur_operator_core::{Context, Error};

/// The reason of the `InSync=False` condition of a config whose node id another (older) config
/// of its namespace holds.
pub const CONFLICT_REASON: &str = "NodeIDConflict";

/// How long admission waits for the list of the namespace's configs (the webhook's other API
/// calls wait as long; the API server gives the whole review 10 s).
const LIST_TIMEOUT: Duration = Duration::from_secs(3);

/// How often a config whose node id another holds looks again.
const CONFLICT_RECHECK: Duration = Duration::from_secs(10);

/// How a config ranks for a node id: the older holds it (names break ties). A config being
/// created has no creation time yet and ranks after every stored one.
fn rank(
    created: Option<&Time>,
    name: &str,
) -> (bool, Option<k8s_openapi::jiff::Timestamp>, String) {
    (created.is_none(), created.map(|t| t.0), name.to_owned())
}

/// The config among `others` that holds `node_id` ahead of config `name` (created at
/// `created`, None while it is being created), if any. Configs being deleted hold nothing.
pub fn holder<'a>(
    others: impl IntoIterator<Item = &'a EnvoyConfig>,
    name: &str,
    created: Option<&Time>,
    node_id: &str,
) -> Option<&'a EnvoyConfig> {
    let me = rank(created, name);
    others
        .into_iter()
        .filter(|o| {
            o.name_any() != name
                && o.spec.node_id == node_id
                && o.metadata.deletion_timestamp.is_none()
        })
        .filter(|o| rank(o.metadata.creation_timestamp.as_ref(), &o.name_any()) < me)
        .min_by_key(|o| rank(o.metadata.creation_timestamp.as_ref(), &o.name_any()))
}

/// Why `name` may not use `node_id`, held by `other` in `namespace`.
pub fn conflict_message(namespace: &str, node_id: &str, other: &EnvoyConfig) -> String {
    let other = other.name_any();
    format!(
        "spec.nodeID: node id {node_id:?} is already used by EnvoyConfig {namespace}/{other}: a namespace has one EnvoyConfig per node id (give this one another nodeID, or change {other} instead)"
    )
}

/// The admission check of an EnvoyConfig's `node_id`: Ok(Some(message)) refuses it, Err is a
/// failure to look (the API server's). A create, or an update that changes the node id, is
/// refused when any other config of the namespace has the node id; an update that keeps it
/// only when an older config has it, so that the config that holds the node id can still be
/// changed while a duplicate from before this check exists.
pub async fn admission(
    client: &Client,
    req: &AdmissionRequest<DynamicObject>,
    node_id: &str,
) -> Result<Option<String>, String> {
    if !matches!(req.operation, Operation::Create | Operation::Update) {
        return Ok(None);
    }
    let Some(ns) = req.namespace.as_deref() else {
        return Ok(None);
    };
    let node_of = |o: &Option<DynamicObject>| {
        o.as_ref().and_then(|o| {
            o.data
                .get("spec")?
                .get("nodeID")?
                .as_str()
                .map(str::to_owned)
        })
    };
    // A config that moves onto a node id claims it anew, however old the config is.
    let moved =
        req.operation == Operation::Update && node_of(&req.old_object).as_deref() != Some(node_id);
    let created = req
        .object
        .as_ref()
        .and_then(|o| o.metadata.creation_timestamp.as_ref())
        .filter(|_| !moved);
    let api: Api<EnvoyConfig> = Api::namespaced(client.clone(), ns);
    let configs = tokio::time::timeout(LIST_TIMEOUT, api.list(&ListParams::default()))
        .await
        .map_err(|_| format!("listing the EnvoyConfigs of namespace {ns} timed out"))?
        .map_err(|e| format!("cannot list the EnvoyConfigs of namespace {ns}: {e}"))?;
    Ok(holder(&configs.items, &req.name, created, node_id)
        .map(|other| conflict_message(ns, node_id, other)))
}

/// The controller's side: if an older config of `ns` holds `ec`'s node id, `ec` is not
/// published (its published revision, if any, is unpublished, so the route server serves the
/// holder's) and its status says why, with an event the first time. None when `ec` may publish.
pub(super) async fn unpublish_if_held(
    ec: &EnvoyConfig,
    ns: &str,
    ctx: &Context,
    old: &EnvoyConfigStatus,
) -> Result<Option<Action>, Error> {
    let configs: Api<EnvoyConfig> = Api::namespaced(ctx.client.clone(), ns);
    let all = configs.list(&ListParams::default()).await?;
    let name = ec.name_any();
    let Some(other) = holder(
        &all.items,
        &name,
        ec.metadata.creation_timestamp.as_ref(),
        &ec.spec.node_id,
    ) else {
        return Ok(None);
    };
    let message = format!(
        "{}; this one is not published",
        conflict_message(ns, &ec.spec.node_id, other)
    );
    let revisions: Api<EnvoyConfigRevision> = Api::namespaced(ctx.client.clone(), ns);
    let mine = revisions
        .list(&ListParams::default().labels(&format!("{CONFIG_LABEL}={name}")))
        .await?;
    for r in &mine.items {
        let labelled = r.labels().get(PUBLISHED_LABEL).map(String::as_str) == Some("true");
        let marked = r.status.as_ref().is_some_and(|s| s.published);
        if labelled || marked {
            super::set_published_label(&revisions, &r.name_any(), false).await?;
            super::write_revision_status(&revisions, &r.name_any(), |s| s.published = false)
                .await?;
        }
    }
    let was_reported = old
        .conditions
        .iter()
        .any(|c| c.type_ == conditions::IN_SYNC && c.reason == CONFLICT_REASON);
    if !was_reported {
        ctx.event(ec, true, CONFLICT_REASON, "Publish", message.clone())
            .await;
    }
    let mut st = old.clone();
    st.observed_generation = ec.meta().generation;
    st.published_version = None;
    st.nodes = None;
    super::status::set(
        &mut st,
        ec,
        conditions::IN_SYNC,
        false,
        CONFLICT_REASON,
        &message,
    );
    ctx.status.apply(&configs, ec, old, &st).await?;
    // The holder may go or change its node id; nothing else wakes this config then.
    Ok(Some(Action::requeue(CONFLICT_RECHECK)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use serde_json::json;

    use super::*;

    fn config(name: &str, node: &str, created: Option<&str>, deleting: bool) -> EnvoyConfig {
        let mut meta = json!({"name": name, "namespace": "a"});
        if let Some(t) = created {
            meta["creationTimestamp"] = json!(t);
        }
        if deleting {
            meta["deletionTimestamp"] = json!("2026-11-26T12:00:00Z");
        }
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "EnvoyConfig",
            "metadata": meta,
            "spec": {"nodeID": node, "resources": []},
        }))
        .unwrap()
    }

    fn time(t: &str) -> Time {
        serde_json::from_value(json!(t)).unwrap()
    }

    #[test]
    fn the_older_config_holds_a_node_id() {
        let stored = [
            config("first", "edge-1", Some("2026-11-26T10:00:00Z"), false),
            config("second", "edge-1", Some("2026-11-26T10:00:05Z"), false),
            config("other-node", "edge-2", Some("2026-11-26T09:00:00Z"), false),
            config("going", "edge-3", Some("2026-11-26T09:00:00Z"), true),
        ];
        // A new config (no creation time yet) for a node id in use is refused, naming the
        // holder.
        let h = holder(&stored, "third", None, "edge-1").unwrap();
        assert_eq!(h.name_any(), "first");
        assert_eq!(
            conflict_message("a", "edge-1", h),
            "spec.nodeID: node id \"edge-1\" is already used by EnvoyConfig a/first: a namespace has one EnvoyConfig per node id (give this one another nodeID, or change first instead)"
        );
        // Of two stored ones, the newer is held back, the older is not (it may still change).
        let second = time("2026-11-26T10:00:05Z");
        assert_eq!(
            holder(&stored, "second", Some(&second), "edge-1").map(ResourceExt::name_any),
            Some("first".into())
        );
        let first = time("2026-11-26T10:00:00Z");
        assert!(holder(&stored, "first", Some(&first), "edge-1").is_none());
        // Created in the same second: the name decides, the same way every time.
        let same = [
            config("b", "n", Some("2026-11-26T10:00:00Z"), false),
            config("a", "n", Some("2026-11-26T10:00:00Z"), false),
        ];
        assert_eq!(
            holder(&same, "b", Some(&first), "n").map(ResourceExt::name_any),
            Some("a".into())
        );
        assert!(holder(&same, "a", Some(&first), "n").is_none());
        // A free node id, its own entry, and a config being deleted hold nothing.
        assert!(holder(&stored, "third", None, "edge-9").is_none());
        assert!(holder(&stored, "other-node", None, "edge-2").is_none());
        assert!(holder(&stored, "third", None, "edge-3").is_none());
    }
}
