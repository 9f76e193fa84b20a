//! Per-object exponential backoff, counted by the error policy and reset by a successful pass.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use kube::Resource;

/// Failures in a row per object (keyed by [`key_of`]).
#[derive(Debug, Default)]
pub struct Backoff {
    failures: Mutex<HashMap<String, u32>>,
}

/// A controller context that holds the [`Backoff`] of its controller's objects; [`crate::run`]
/// resets an object's count when its pass succeeds.
pub trait HasBackoff {
    fn backoff(&self) -> &Backoff;
}

/// An object's backoff key: `Kind/namespace/name`, or `Kind/name` when cluster-scoped.
pub fn key_of<K: Resource<DynamicType = ()>>(obj: &K) -> String {
    let m = obj.meta();
    let name = m.name.as_deref().unwrap_or_default();
    match m.namespace.as_deref() {
        Some(ns) => format!("{}/{ns}/{name}", K::kind(&())),
        None => format!("{}/{name}", K::kind(&())),
    }
}

impl Backoff {
    /// Counts a failure of `obj` and returns how long to wait before its next pass: 1 s, 2 s,
    /// 4 s … capped at 5 min.
    pub fn failed<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        err: &dyn std::fmt::Display,
    ) -> Duration {
        let key = key_of(obj);
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let n = f.entry(key.clone()).or_insert(0);
        *n = n.saturating_add(1);
        let delay = Duration::from_secs(1u64 << (*n - 1).min(8)).min(Duration::from_secs(300));
        tracing::warn!(object = %key, error = %err, retry_in = ?delay, "reconcile failed");
        delay
    }

    /// Forgets the failures of `obj` (its pass succeeded).
    pub fn succeeded<K: Resource<DynamicType = ()>>(&self, obj: &K) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        f.remove(&key_of(obj));
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
    use kube::api::ObjectMeta;

    use super::*;

    fn cm(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("shop".into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    #[test]
    fn doubles_per_failure_caps_and_resets_per_object() {
        let b = Backoff::default();
        let (a, other) = (cm("a"), cm("b"));
        let waits: Vec<u64> = (0..11).map(|_| b.failed(&a, &"x").as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 64, 128, 256, 256, 256]);
        assert_eq!(b.failed(&other, &"x"), Duration::from_secs(1));
        b.succeeded(&a);
        assert_eq!(b.failed(&a, &"x"), Duration::from_secs(1));
    }

    #[test]
    fn keys_name_kind_namespace_and_name() {
        assert_eq!(key_of(&cm("a")), "ConfigMap/shop/a");
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some("shop".into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        assert_eq!(key_of(&ns), "Namespace/shop");
    }
}
