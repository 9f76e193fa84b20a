//! Reads of whole objects that a metadata-only store vouches for.
//!
//! Some passes need objects the operator keeps no full store of: a baseline Deployment's pod
//! template, the Services and pods of a baseline's namespace. Keeping every Deployment and pod
//! of the cluster in memory would cost far more than the reads; reading them on every pass
//! was most of the API requests a Sandbox cost (perf/results/operator_passes.md). A metadata
//! watch is kept anyway (it is what wakes the passes), and `resourceVersion` changes on every
//! write. So a copy read earlier is still the object when the store holds the same
//! `resourceVersion`, and a list read earlier is still the list when the store's matching
//! objects have the same names and versions. Only then is the copy returned; anything else
//! (a changed or new object, a store that has not listed yet, an object the store lacks) is
//! read from the API server, as before.
//!
//! A store lags the API server as every store does: a hit returns what the store has seen,
//! which is what a pass reading from stores sees, and the change it has not seen yet wakes the
//! pass again when it arrives.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures_util::FutureExt;
use k8s_openapi::NamespaceResourceScope;
use kube::api::ListParams;
use kube::core::{PartialObjectMeta, Selector, SelectorExt};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource, ResourceExt};

use crate::changes::Watched;

/// Copies kept at most, per kind of read: beyond, the ones the store no longer vouches for go
/// first, then all. Each entry is one baseline (or one namespace's list), so this is far above
/// what a cluster forks from.
const CAPACITY: usize = 512;

/// The names and versions of a list's objects, sorted.
type Versions = Vec<(String, String)>;

/// A list as read: its objects' names and versions, and the objects.
type Listed<K> = (Versions, Arc<Vec<K>>);

/// Whole objects of `K`, read from the API server only when the metadata store shows they
/// changed since they were last read (module docs). Clones share the copies.
pub struct Verified<K: Watched> {
    inner: Arc<Inner<K>>,
}

impl<K: Watched> Clone for Verified<K> {
    fn clone(&self) -> Self {
        Verified {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<K: Watched> {
    meta: Store<PartialObjectMeta<K>>,
    /// By namespace and name.
    objects: Mutex<HashMap<(String, String), Arc<K>>>,
    /// By namespace and label selector.
    lists: Mutex<HashMap<(String, String), Listed<K>>>,
}

impl<K> Verified<K>
where
    K: Watched + Resource<Scope = NamespaceResourceScope>,
{
    /// Reads vouched for by `meta`, the store of a metadata watch on every object of `K`.
    pub fn new(meta: Store<PartialObjectMeta<K>>) -> Self {
        Verified {
            inner: Arc::new(Inner {
                meta,
                objects: Mutex::default(),
                lists: Mutex::default(),
            }),
        }
    }

    /// The store, once it has listed: before that it vouches for nothing.
    fn store(&self) -> Option<&Store<PartialObjectMeta<K>>> {
        let ready = self.inner.meta.wait_until_ready().now_or_never();
        matches!(ready, Some(Ok(()))).then_some(&self.inner.meta)
    }

    /// `ns/name`, as a GET would answer it.
    pub async fn get_opt(
        &self,
        client: &Client,
        ns: &str,
        name: &str,
    ) -> Result<Option<Arc<K>>, kube::Error> {
        let key = (ns.to_owned(), name.to_owned());
        let current = self
            .store()
            .and_then(|s| s.get(&ObjectRef::new(name).within(ns)))
            .and_then(|m| m.resource_version());
        if let Some(version) = &current {
            let objects = lock(&self.inner.objects);
            if let Some(obj) = objects.get(&key)
                && obj.resource_version().as_ref() == Some(version)
            {
                return Ok(Some(obj.clone()));
            }
        }
        let read = Api::<K>::namespaced(client.clone(), ns)
            .get_opt(name)
            .await?;
        let mut objects = lock(&self.inner.objects);
        match read {
            Some(mut obj) => {
                // Nothing reads them, and they are often half the object.
                obj.managed_fields_mut().clear();
                let obj = Arc::new(obj);
                self.make_room(&mut objects, |o| self.vouched(o));
                objects.insert(key, obj.clone());
                Ok(Some(obj))
            }
            None => {
                objects.remove(&key);
                Ok(None)
            }
        }
    }

    /// The objects of `ns` that `selector` selects, as a LIST from the API server's watch
    /// cache (`resourceVersion=0`) would answer it.
    pub async fn list(
        &self,
        client: &Client,
        ns: &str,
        selector: &Selector,
    ) -> Result<Arc<Vec<K>>, kube::Error> {
        let key = (ns.to_owned(), selector.to_string());
        if let Some(store) = self.store() {
            let now = versions(
                store
                    .state_filter(|m| {
                        m.metadata.namespace.as_deref() == Some(ns) && selector.matches(m.labels())
                    })
                    .iter()
                    .map(|m| m.as_ref()),
            );
            let lists = lock(&self.inner.lists);
            if let Some((seen, items)) = lists.get(&key)
                && *seen == now
            {
                return Ok(items.clone());
            }
        }
        let lp = ListParams::default().labels_from(selector).match_any();
        let mut items = Api::<K>::namespaced(client.clone(), ns)
            .list(&lp)
            .await?
            .items;
        for obj in &mut items {
            obj.managed_fields_mut().clear();
        }
        let seen = versions(items.iter());
        let items = Arc::new(items);
        let mut lists = lock(&self.inner.lists);
        self.make_room(&mut lists, |(seen, _)| self.still(seen));
        lists.insert(key, (seen, items.clone()));
        Ok(items)
    }

    /// Whether the store holds `obj` at its version.
    fn vouched(&self, obj: &K) -> bool {
        let Some(store) = self.store() else {
            return false;
        };
        let name = obj.name_any();
        let r = ObjectRef::new(&name).within(obj.namespace().as_deref().unwrap_or_default());
        store.get(&r).and_then(|m| m.resource_version()) == obj.resource_version()
    }

    /// Whether the store holds every object of a list at its version (not whether it holds
    /// others: a cheap test for eviction, not for a hit).
    fn still(&self, seen: &Versions) -> bool {
        let Some(store) = self.store() else {
            return false;
        };
        seen.iter().all(|(key, version)| {
            let (ns, name) = key.split_once('/').unwrap_or(("", key));
            store
                .get(&ObjectRef::new(name).within(ns))
                .and_then(|m| m.resource_version())
                .as_ref()
                == Some(version)
        })
    }

    /// Below [`CAPACITY`] entries: first those `keep` rejects, then all.
    fn make_room<V>(&self, map: &mut HashMap<(String, String), V>, keep: impl Fn(&V) -> bool) {
        if map.len() < CAPACITY {
            return;
        }
        map.retain(|_, v| keep(v));
        if map.len() >= CAPACITY {
            map.clear();
        }
    }
}

/// `namespace/name` and version of each object, sorted.
fn versions<'a, R: Resource + 'a>(objects: impl Iterator<Item = &'a R>) -> Versions {
    let mut v: Versions = objects
        .map(|o| {
            let ns = o.meta().namespace.as_deref().unwrap_or_default();
            let name = o.meta().name.as_deref().unwrap_or_default();
            (
                format!("{ns}/{name}"),
                o.meta().resource_version.clone().unwrap_or_default(),
            )
        })
        .collect();
    v.sort_unstable();
    v
}

/// A poisoned lock only means a pass panicked while holding it; the map is still consistent
/// (every change to it is one insert, remove or retain).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use k8s_openapi::api::core::v1::Service;
    use kube::runtime::watcher::Event;
    use serde_json::json;

    fn svc(name: &str, version: &str, managed: bool) -> Service {
        let labels = if managed {
            json!({"app.kubernetes.io/managed-by": "spur"})
        } else {
            json!({"app": name})
        };
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "shop", "resourceVersion": version,
                         "labels": labels},
        }))
        .unwrap()
    }

    fn meta(s: &Service) -> PartialObjectMeta<Service> {
        PartialObjectMeta {
            types: None,
            metadata: s.metadata.clone(),
            _phantom: std::marker::PhantomData,
        }
    }

    #[test]
    fn versions_are_sorted_and_qualified() {
        let a = svc("b", "7", false);
        let b = svc("a", "9", false);
        assert_eq!(
            versions([&a, &b].into_iter()),
            vec![
                ("shop/a".to_owned(), "9".to_owned()),
                ("shop/b".to_owned(), "7".to_owned())
            ]
        );
    }

    #[test]
    fn a_store_that_has_not_listed_vouches_for_nothing() {
        let (reader, mut writer) = kube::runtime::reflector::store::<PartialObjectMeta<Service>>();
        let v = Verified::new(reader);
        let s = svc("web", "1", false);
        assert!(!v.vouched(&s));
        writer.apply_watcher_event(&Event::Init);
        writer.apply_watcher_event(&Event::InitApply(meta(&s)));
        writer.apply_watcher_event(&Event::InitDone);
        assert!(v.vouched(&s));
        assert!(!v.vouched(&svc("web", "2", false)));
        assert!(v.still(&versions([&s].into_iter())));
        assert!(!v.still(&versions([&svc("web", "2", false)].into_iter())));
        assert!(!v.still(&versions([&svc("gone", "1", false)].into_iter())));
    }

    #[test]
    fn make_room_drops_what_the_store_no_longer_vouches_for_first() {
        let (reader, _writer) = kube::runtime::reflector::store::<PartialObjectMeta<Service>>();
        let v = Verified::new(reader);
        let mut map: HashMap<(String, String), u32> = (0..CAPACITY as u32)
            .map(|i| ((String::new(), i.to_string()), i))
            .collect();
        v.make_room(&mut map, |i| i % 2 == 0);
        assert_eq!(map.len(), CAPACITY / 2);
        let mut full: HashMap<(String, String), u32> = (0..CAPACITY as u32)
            .map(|i| ((String::new(), i.to_string()), i))
            .collect();
        v.make_room(&mut full, |_| true);
        assert!(full.is_empty());
    }
}
