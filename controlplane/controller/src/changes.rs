//! Watch streams that wake a controller only when what it reads from an object changed.
//!
//! A controller's own writes (status, finalizers) come back as watch events, and so does every
//! write of another controller to a child or related object. Most of them change nothing the
//! woken reconcile looks at: in the operator's bulk benchmark they were about half of all
//! passes (perf/results/operator_passes.md). A trigger hashes what its reconcile reads
//! (`digest`) and passes an object on only when that hash changed; deletions always pass.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::watcher::{self, Event, watcher};
use kube::runtime::{Controller, WatchStreamExt};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;

use crate::hash_of;

/// The objects of `api` whose `digest` changed since they were last passed on, and every
/// deletion; and a store of every object of `api`, updated before the object it passes on, so
/// a reconcile it wakes reads the store at least as new as what woke it. Relists (after a
/// watch expired) compare against what was seen before, so they wake nothing that did not
/// change; an object that went away meanwhile is passed on as deleted ([`vanished`]).
pub fn changes<K>(
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
    changes_tapped(api, wc, digest, |_| {})
}

/// [`changes`], with `tap` shown every event first, a deletion (also one [`vanished`] found)
/// with the object's last state: for work a deletion needs that no reconcile can do once the
/// object is gone from the store.
pub fn changes_tapped<K>(
    api: Api<K>,
    wc: watcher::Config,
    digest: fn(&K) -> u64,
    mut tap: impl FnMut(&Event<K>) + Send + 'static,
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
    let events = vanished(events, reader.clone()).inspect(move |e| {
        if let Ok(e) = e {
            tap(e);
        }
    });
    (reader, filter(reflector(writer, events), digest))
}

/// `events` with a deletion added after each relist's end for every object `store` held that
/// the relist did not list: deleted while the watch was down, so no Delete event came. Without
/// it nothing would wake a controller that matched the object (a RouteGroup would keep a
/// Sandbox deleted during an API server restart until its periodic pass). `store` must be the
/// one these events fill, read before they reach it: at a relist's end it still holds what
/// was there before.
pub fn vanished<K, S>(
    events: S,
    store: Store<K>,
) -> impl Stream<Item = Result<Event<K>, watcher::Error>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
{
    // The objects a relist has listed so far (None: no relist under way).
    let mut listed: Option<HashSet<ObjectRef<K>>> = None;
    events
        .map(move |event| {
            let gone = match &event {
                Ok(Event::Init) => {
                    listed = Some(HashSet::new());
                    Vec::new()
                }
                Ok(Event::InitApply(obj)) => {
                    (listed.get_or_insert_with(HashSet::new)).insert(ObjectRef::from_obj(obj));
                    Vec::new()
                }
                Ok(Event::InitDone) => {
                    let seen = listed.take().unwrap_or_default();
                    store.state_filter(|o| !seen.contains(&ObjectRef::from_obj(o)))
                }
                _ => Vec::new(),
            };
            let gone = gone.into_iter().map(|o| Ok(Event::Delete((*o).clone())));
            futures_util::stream::iter(std::iter::once(event).chain(gone))
        })
        .flatten()
}

/// How long a pass waits for a store's first list before it gives up (and is retried).
pub const SYNC_WAIT: Duration = Duration::from_secs(10);

/// Waits (up to [`SYNC_WAIT`]) until `store` holds every object its watch listed first, so a
/// pass that decides from what is *not* in the store (a child to prune, a member that left)
/// never decides from a store that is still filling at the start of a leader term. `kind`
/// names the watch in the error.
pub async fn synced<K>(store: &Store<K>, kind: &'static str) -> Result<(), crate::Error>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    match tokio::time::timeout(SYNC_WAIT, store.wait_until_ready()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) | Err(_) => Err(crate::Error::NotSynced(kind)),
    }
}

/// A kind the operator watches and keeps in stores.
pub trait Watched:
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

pub fn filter<K, S>(
    events: S,
    digest: fn(&K) -> u64,
) -> impl Stream<Item = Result<K, watcher::Error>>
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
pub fn meta_digest(obj: &impl Resource) -> impl Serialize + '_ {
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
pub fn own<K: Resource>(obj: &K) -> u64 {
    hash_of(&(meta_digest(obj), &obj.meta().finalizers))
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
pub fn primary<K: Watched>(api: Api<K>) -> Controller<K> {
    let (reader, trigger) = changes(api, watcher::Config::default(), own::<K>);
    Controller::for_stream(trigger, reader)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use futures_util::stream;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn cm(name: &str) -> ConfigMap {
        let mut c = ConfigMap::default();
        c.metadata.name = Some(name.into());
        c.metadata.namespace = Some("ns".into());
        c
    }

    fn names(events: &[Event<ConfigMap>]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                Event::Init => "init".into(),
                Event::InitApply(o) => format!("list {}", o.name_any()),
                Event::InitDone => "done".into(),
                Event::Apply(o) => format!("apply {}", o.name_any()),
                Event::Delete(o) => format!("delete {}", o.name_any()),
            })
            .collect()
    }

    #[tokio::test]
    async fn a_relist_reports_what_went_away_while_the_watch_was_down() {
        let (reader, mut writer) = reflector::store::<ConfigMap>();
        // What the store held before the watch expired.
        for e in [
            Event::Init,
            Event::InitApply(cm("a")),
            Event::InitApply(cm("b")),
            Event::InitDone,
        ] {
            writer.apply_watcher_event(&e);
        }
        let relist = vec![
            Event::Init,
            Event::InitApply(cm("a")),
            Event::InitApply(cm("c")),
            Event::InitDone,
        ];
        let out: Vec<Event<ConfigMap>> = vanished(stream::iter(relist.into_iter().map(Ok)), reader)
            .map(|r| r.unwrap())
            .collect()
            .await;
        assert_eq!(
            names(&out),
            ["init", "list a", "list c", "done", "delete b"]
        );
    }

    #[tokio::test]
    async fn the_first_list_and_plain_events_pass_unchanged() {
        let (reader, _writer) = reflector::store::<ConfigMap>();
        let events = vec![
            Event::Init,
            Event::InitApply(cm("a")),
            Event::InitDone,
            Event::Apply(cm("b")),
            Event::Delete(cm("a")),
        ];
        let out: Vec<Event<ConfigMap>> = vanished(stream::iter(events.into_iter().map(Ok)), reader)
            .map(|r| r.unwrap())
            .collect()
            .await;
        assert_eq!(
            names(&out),
            ["init", "list a", "done", "apply b", "delete a"]
        );
    }
}
