//! Server-side apply that is skipped when the object already holds what it would write.
//!
//! Passes run several times per object as its children progress and almost always find the
//! children as they want them; a no-op apply still costs the API server a whole apply (the
//! costliest request of a pass, and a Service's by far). So each desired object is stamped
//! with a digest of itself (the owner's stamp annotation) and applied only when the current
//! object, from a store filled by the watch that wakes the controller, does not hold every
//! field of it: a change of ours changes the stamp, a change of someone else's to a field we
//! set breaks the match, and fields the API server defaults or others add are left alone, as
//! apply would.

use std::hash::{DefaultHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::Error;

/// Who writes: the field manager of every server-side apply, and the annotation its applies
/// stamp their digest into.
#[derive(Clone, Copy, Debug)]
pub struct Owner {
    pub field_manager: &'static str,
    pub stamp: &'static str,
}

impl Owner {
    /// Applies `desired` (stamped) unless `store` holds it already; returns the object as it
    /// is now.
    pub async fn ensure<K>(
        &self,
        api: &Api<K>,
        store: Option<&Store<K>>,
        mut desired: K,
    ) -> Result<Arc<K>, Error>
    where
        K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + Serialize + DeserializeOwned,
    {
        stamp(&mut desired, self.stamp);
        if let Some(cur) = store.and_then(|s| s.get(&ObjectRef::from_obj(&desired)))
            && cur.meta().deletion_timestamp.is_none()
            && holds(&*cur, &desired)?
        {
            return Ok(cur);
        }
        let pp = PatchParams::apply(self.field_manager).force();
        let applied = api
            .patch(&desired.name_any(), &pp, &Patch::Apply(&desired))
            .await?;
        Ok(Arc::new(applied))
    }
}

/// Sets the `key` annotation to a digest of `obj` without it.
fn stamp<K: Resource + Serialize>(obj: &mut K, key: &str) {
    obj.annotations_mut().remove(key);
    let digest = hash_of(obj);
    obj.annotations_mut()
        .insert(key.into(), format!("{digest:016x}"));
}

/// A digest of `v`'s serialization (API types do not implement `Hash`).
pub fn hash_of(v: &impl Serialize) -> u64 {
    /// Feeds serialized bytes straight into the hasher.
    struct Feed(DefaultHasher);
    impl std::io::Write for Feed {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.write(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    // Serializing what a reconcile reads is the one way to hash API types, which do not
    // implement `Hash`. A failure (none of these types has one) must count as a change.
    static FAILED: AtomicU64 = AtomicU64::new(0);
    let mut feed = Feed(DefaultHasher::new());
    match serde_json::to_writer(&mut feed, v) {
        Ok(()) => feed.0.finish(),
        Err(_) => !FAILED.fetch_add(1, Ordering::Relaxed),
    }
}

/// Whether `current` has every field of `desired` with the same value.
fn holds<K: Serialize>(current: &K, desired: &K) -> Result<bool, Error> {
    let cur = serde_json::to_value(current)?;
    let want = serde_json::to_value(desired)?;
    Ok(subset(&want, &cur))
}

/// Fields whose value is one whole (atomic maps and label selectors): an apply replaces them,
/// so a key someone added is a difference, not a field of theirs.
const ATOMIC: [&str; 3] = ["selector", "matchLabels", "nodeSelector"];

/// `want` ⊆ `have`: objects by key, arrays element by element (same length), the rest equal.
/// An empty or null wanted value holds wherever the field is absent too (serialization writes
/// some defaults that the API server leaves out).
fn subset(want: &Value, have: &Value) -> bool {
    match (want, have) {
        (Value::Object(w), Value::Object(h)) => w.iter().all(|(k, wv)| match h.get(k) {
            Some(hv) if ATOMIC.contains(&k.as_str()) => wv == hv,
            Some(hv) => subset(wv, hv),
            None => is_empty(wv),
        }),
        (Value::Array(w), Value::Array(h)) => {
            w.len() == h.len() && w.iter().zip(h).all(|(a, b)| subset(a, b))
        }
        (w, Value::Null) => is_empty(w),
        (w, h) => w == h,
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use k8s_openapi::api::core::v1::Service;

    /// Spur's stamp (any annotation key does).
    const DESIRED: &str = "spur.dev/desired";
    use serde_json::json;

    fn svc(v: Value) -> Service {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn defaults_and_foreign_fields_hold_changes_do_not() {
        let mut want = svc(json!({
            "metadata": {"name": "web-sb", "namespace": "shop", "labels": {"spur.dev/fork": "f"}},
            "spec": {"selector": {"spur.dev/fork": "f"}, "ports": [{"port": 80, "targetPort": 8080}]}
        }));
        stamp(&mut want, DESIRED);
        let stamp_value = want.annotations()[DESIRED].clone();
        // As the API server returns it: defaults filled in, fields of others added.
        let have = svc(json!({
            "metadata": {"name": "web-sb", "namespace": "shop", "uid": "u", "resourceVersion": "7",
                         "labels": {"spur.dev/fork": "f", "team": "x"},
                         "annotations": {DESIRED: stamp_value}},
            "spec": {"selector": {"spur.dev/fork": "f"}, "clusterIP": "10.96.0.9", "type": "ClusterIP",
                     "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]},
            "status": {"loadBalancer": {}}
        }));
        assert!(holds(&have, &want).unwrap());

        // Someone changed a field we set.
        let mut drifted = have.clone();
        drifted.spec.as_mut().unwrap().selector = Some([("app".into(), "web".into())].into());
        assert!(!holds(&drifted, &want).unwrap());
        // A key added to the (atomic) selector: the Service no longer selects the fork.
        let mut narrowed = have.clone();
        narrowed
            .spec
            .as_mut()
            .unwrap()
            .selector
            .as_mut()
            .unwrap()
            .insert("app".into(), "web".into());
        assert!(!holds(&narrowed, &want).unwrap());
        // A port more or less.
        let mut ports = have.clone();
        ports.spec.as_mut().unwrap().ports.as_mut().unwrap().clear();
        assert!(!holds(&ports, &want).unwrap());
        // We want something else: the stamp differs, even where the fields would hold (a
        // removed field of ours must be removed by an apply).
        let mut less = svc(json!({
            "metadata": {"name": "web-sb", "namespace": "shop"},
            "spec": {"selector": {"spur.dev/fork": "f"}}
        }));
        stamp(&mut less, DESIRED);
        assert!(!holds(&have, &less).unwrap());
    }

    #[test]
    fn the_stamp_is_stable_and_ignores_itself() {
        let mut a = svc(json!({"metadata": {"name": "a"}}));
        stamp(&mut a, DESIRED);
        let first = a.annotations()[DESIRED].clone();
        stamp(&mut a, DESIRED);
        assert_eq!(a.annotations()[DESIRED], first);
    }
}
