//! Watch streams that wake a controller only when what it reads from an object changed.
//!
//! A controller's own writes (status, finalizers) come back as watch events, and so does every
//! write of another controller to a child or related object. Most of them change nothing the
//! woken reconcile looks at: in the bulk benchmark they were about half of all passes
//! (perf/results/operator_passes.md). Each trigger here hashes what its reconcile reads and
//! passes an object on only when that hash changed; deletions always pass.

use std::collections::HashMap;

use futures_util::{Stream, StreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::watcher::{self, Event, watcher};
use kube::runtime::{Controller, WatchStreamExt};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use spur_api::conditions::{READY, is_condition_true};
use spur_api::{ExternalWorkload, ForkedWorkload, RoutingConfig};
use spur_controller::hash_of;

/// The objects of `api` whose `digest` changed since they were last passed on, and every
/// deletion; and a store of every object of `api`, updated before the object it passes on, so
/// a reconcile it wakes reads the store at least as new as what woke it. Relists (after a
/// watch expired) compare against what was seen before, so they wake nothing that did not
/// change, and forget objects that went away meanwhile.
pub(crate) fn changes<K>(
    api: Api<K>,
    wc: watcher::Config,
    digest: fn(&K) -> u64,
) -> (
    Store<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Watched,
{
    let (reader, writer) = reflector::store();
    // Stored objects lose their `managedFields`: often the larger half of an object, and
    // nothing in the operator reads them.
    let events = watcher(api, wc).modify(|o: &mut K| o.managed_fields_mut().clear());
    (reader, filter(reflector(writer, events), digest))
}

/// A kind the operator watches and keeps in stores.
pub(crate) trait Watched:
    Resource<DynamicType = ()>
    + Clone
    + serde::de::DeserializeOwned
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}

fn filter<K, S>(events: S, digest: fn(&K) -> u64) -> impl Stream<Item = Result<K, watcher::Error>>
where
    K: Resource<DynamicType = ()> + Clone,
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
{
    // What was last passed on, per object: its uid (a re-created object is new) and digest.
    type Seen<K> = HashMap<ObjectRef<K>, (Option<String>, u64)>;
    let mut seen: Seen<K> = HashMap::new();
    // During a relist: what it has listed so far, and the changed objects. Those are held
    // until `InitDone`: the reflector puts a relist into the store only then, and a
    // reconcile woken earlier would read the old object (and not be woken again).
    let mut relist: Option<(Seen<K>, Vec<K>)> = None;
    events
        .map(move |event| {
            let mut out = Vec::new();
            match event {
                Err(e) => out.push(Err(e)),
                Ok(Event::Init) => relist = Some((HashMap::new(), Vec::new())),
                Ok(Event::InitApply(obj)) => {
                    let (key, value) = (ObjectRef::from_obj(&obj), (obj.uid(), digest(&obj)));
                    let changed = seen.get(&key) != Some(&value);
                    let (listed, held) = relist.get_or_insert_with(Default::default);
                    listed.insert(key, value);
                    if changed {
                        held.push(obj);
                    }
                }
                Ok(Event::InitDone) => {
                    if let Some((listed, held)) = relist.take() {
                        seen = listed;
                        out.extend(held.into_iter().map(Ok));
                    }
                }
                Ok(Event::Apply(obj)) => {
                    let (key, value) = (ObjectRef::from_obj(&obj), (obj.uid(), digest(&obj)));
                    if seen.insert(key, value.clone()) != Some(value) {
                        out.push(Ok(obj));
                    }
                }
                Ok(Event::Delete(obj)) => {
                    seen.remove(&ObjectRef::from_obj(&obj));
                    out.push(Ok(obj));
                }
            }
            futures_util::stream::iter(out)
        })
        .flatten()
}

/// Spec, deletion, and the metadata an owner sets and checks (labels, annotations, owner
/// references); not finalizers, which are the object's own controller's business.
fn meta_digest(obj: &impl Resource) -> impl Serialize + '_ {
    let m = obj.meta();
    (
        m.generation,
        m.deletion_timestamp.is_some(),
        &m.labels,
        &m.annotations,
        &m.owner_references,
    )
}

/// An object as its own controller is woken by it: everything but its status (which the
/// controller writes itself), finalizers included.
pub(crate) fn own<K: Resource>(obj: &K) -> u64 {
    hash_of(&(meta_digest(obj), &obj.meta().finalizers))
}

/// A ForkedWorkload as its Sandbox and its RoutingConfig read it: spec, deletion, the fork,
/// its Service mapping, readiness and baseline sidecar coverage.
pub(crate) fn forked_workload(fw: &ForkedWorkload) -> u64 {
    let st = fw.status.as_ref();
    hash_of(&(
        meta_digest(fw),
        st.map(|s| (&s.fork, &s.services, &s.baseline_sidecars)),
        st.is_some_and(|s| is_condition_true(&s.conditions, READY)),
    ))
}

/// An ExternalWorkload as its Sandbox and its RoutingConfig read it.
pub(crate) fn external_workload(ew: &ExternalWorkload) -> u64 {
    let st = ew.status.as_ref();
    hash_of(&(
        meta_digest(ew),
        st.map(|s| (&s.services, s.tunnel.as_ref().map(|t| t.connected))),
        st.is_some_and(|s| is_condition_true(&s.conditions, READY)),
    ))
}

/// A VirtualWorkload as its Sandbox reads it: readiness and sidecar coverage.
pub(crate) fn virtual_workload(vw: &spur_api::VirtualWorkload) -> u64 {
    let st = vw.status.as_ref();
    hash_of(&(
        meta_digest(vw),
        st.map(|s| &s.baseline_sidecars),
        st.is_some_and(|s| is_condition_true(&s.conditions, READY)),
    ))
}

/// A RoutingConfig as its Sandbox reads it: spec and whether it routes.
pub(crate) fn routing_config(rc: &RoutingConfig) -> u64 {
    let st = rc.status.as_ref();
    hash_of(&(
        meta_digest(rc),
        st.is_some_and(|s| is_condition_true(&s.conditions, READY)),
    ))
}

/// A fork Deployment as its ForkedWorkload reads it: spec (drift is re-applied), metadata,
/// deletion, readiness.
pub(crate) fn fork_deployment(d: &Deployment) -> u64 {
    hash_of(&(meta_digest(d), crate::fork::deployment_ready(d)))
}

/// A sandbox Service as its ForkedWorkload reads it (Services have no generation).
pub(crate) fn fork_service(svc: &Service) -> u64 {
    hash_of(&(meta_digest(svc), &svc.spec))
}

/// A controller on every object of `K`, woken by changes of an object's spec (generation),
/// labels, annotations, owner references, finalizers or deletion, not of its status
/// ([`own`]). (An annotation, e.g.
/// `kubectl annotate sandbox x spur.dev/reconcile=$(date +%s)`, is how a user forces a pass.)
///
/// Every controller writes its object's status, and each write comes back as a watch event:
/// unfiltered, those were about half of all passes in the bulk benchmark (perf/results/
/// operator_passes.md), each repeating the pass before it. What the controllers read from
/// other objects' statuses reaches them through their `owns`/`watches` triggers.
pub(crate) fn primary<K: Watched>(api: Api<K>) -> Controller<K> {
    let (reader, trigger) = changes(api, watcher::Config::default(), own::<K>);
    Controller::for_stream(trigger, reader)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use futures_util::stream;
    use serde_json::json;

    fn fw(name: &str, generation: i64, ready: bool, note: &str) -> ForkedWorkload {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ForkedWorkload",
            "metadata": {"name": name, "namespace": "shop", "generation": generation},
            "spec": {"sandbox": "sb", "routingKey": "k",
                     "baseline": {"kind": "Deployment", "namespace": "shop", "name": "web"}},
            "status": {"fork": name, "conditions": [{
                "type": "Ready", "status": if ready { "True" } else { "False" },
                "reason": "r", "message": note, "lastTransitionTime": "2026-11-26T00:00:00Z"}]}
        }))
        .unwrap()
    }

    async fn passed(events: Vec<Event<ForkedWorkload>>) -> Vec<String> {
        filter(stream::iter(events.into_iter().map(Ok)), forked_workload)
            .map(|r| {
                let o = r.unwrap();
                format!(
                    "{}@{}",
                    o.name_any(),
                    o.metadata.generation.unwrap_or_default()
                )
            })
            .collect()
            .await
    }

    #[tokio::test]
    async fn only_changes_that_a_reconcile_reads_pass() {
        let mut labelled = fw("a", 2, true, "z");
        labelled.labels_mut().insert("x".into(), "y".into());
        let got = passed(vec![
            Event::Init,
            Event::InitApply(fw("a", 1, false, "x")),
            Event::InitDone,
            // A condition message: nothing the Sandbox reads.
            Event::Apply(fw("a", 1, false, "y")),
            Event::Apply(fw("a", 1, true, "y")),
            Event::Apply(fw("a", 2, true, "y")),
            Event::Apply(fw("a", 2, true, "z")),
            // Labels and annotations: what the owner sets (and puts back).
            Event::Apply(labelled.clone()),
            Event::Apply(labelled),
            Event::Delete(fw("a", 2, true, "z")),
        ])
        .await;
        assert_eq!(got, ["a@1", "a@1", "a@2", "a@2", "a@2"]);
    }

    #[tokio::test]
    async fn a_relist_passes_nothing_before_the_store_has_it() {
        let got = passed(vec![Event::Init, Event::InitApply(fw("a", 1, false, "x"))]).await;
        assert!(got.is_empty(), "{got:?}");
    }

    #[tokio::test]
    async fn a_recreated_object_is_new() {
        let mut again = fw("a", 1, false, "x");
        again.metadata.uid = Some("second".into());
        let got = passed(vec![
            Event::Apply(fw("a", 1, false, "x")),
            Event::Apply(fw("a", 1, false, "x")),
            Event::Apply(again),
        ])
        .await;
        assert_eq!(got, ["a@1", "a@1"]);
    }

    #[tokio::test]
    async fn a_relist_wakes_only_what_changed_and_forgets_the_gone() {
        let got = passed(vec![
            Event::Init,
            Event::InitApply(fw("a", 1, false, "x")),
            Event::InitApply(fw("b", 1, false, "x")),
            Event::InitDone,
            // The watch expired; b changed meanwhile, c is new, a is unchanged.
            Event::Init,
            Event::InitApply(fw("a", 1, false, "x")),
            Event::InitApply(fw("b", 1, true, "x")),
            Event::InitApply(fw("c", 1, false, "x")),
            Event::InitDone,
            // a is deleted while the watch is down (missing from the relist); a new a is
            // new to the filter.
            Event::Init,
            Event::InitApply(fw("b", 1, true, "x")),
            Event::InitDone,
            Event::Apply(fw("a", 1, false, "x")),
        ])
        .await;
        assert_eq!(got, ["a@1", "b@1", "b@1", "c@1", "a@1"]);
    }
}
