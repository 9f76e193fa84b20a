//! Status writes that skip a status equal to the one the pass started from.

use std::collections::HashMap;
use std::sync::Mutex;

use kube::Resource;

use crate::Error;

/// Writes the status of a controller's objects; remembers, per object, the resource version of
/// its last write until the store that feeds the controller has it.
#[derive(Debug)]
pub struct StatusWriter {
    field_manager: &'static str,
    /// Per object (`Kind/namespace/name`): the resource version of our last status write, until
    /// the store has it (see [`StatusWriter::apply`]).
    written: Mutex<HashMap<String, String>>,
}

impl StatusWriter {
    pub fn new(field_manager: &'static str) -> Self {
        StatusWriter {
            field_manager,
            written: Mutex::new(HashMap::new()),
        }
    }

    /// Server-side applies `status` as the whole status of `obj` (the controller owns every
    /// status field of its kinds), unless it equals `old`, the status the reconcile started
    /// from: an unchanged status is never written, so a reconcile does not wake its own watch
    /// for nothing. Returns whether it wrote; an object deleted meanwhile (the reconcile worked
    /// from a cache a moment old) has no status left to write, which is not an error.
    ///
    /// `old` comes from a store, which may not have this controller's own last status write
    /// yet (another trigger started the pass first). Equal to that older copy is not equal to
    /// the object: until the store holds the resource version of our last write, the status is
    /// written whatever `old` says. (Status writes should not wake a pass, so nothing else
    /// would correct it.)
    pub async fn apply<K, S>(
        &self,
        api: &kube::Api<K>,
        obj: &K,
        old: &S,
        status: &S,
    ) -> Result<bool, Error>
    where
        K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
        S: serde::Serialize + PartialEq,
    {
        let name = obj.meta().name.clone().unwrap_or_default();
        let key = format!(
            "{}/{}/{name}",
            K::kind(&()),
            obj.meta().namespace.as_deref().unwrap_or_default()
        );
        if self.trusted(&key, obj.meta().resource_version.as_deref()) && old == status {
            return Ok(false);
        }
        let body = serde_json::json!({
            "apiVersion": K::api_version(&()),
            "kind": K::kind(&()),
            "status": status,
        });
        match api
            .patch_status(
                &name,
                &kube::api::PatchParams::apply(self.field_manager).force(),
                &kube::api::Patch::Apply(&body),
            )
            .await
        {
            Ok(now) => {
                self.remember(key, now.meta().resource_version.clone());
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.is_not_found() => {
                self.remember(key, None);
                tracing::debug!(
                    kind = K::kind(&()).as_ref(),
                    name,
                    "gone before its status was written"
                );
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Whether the copy at resource version `seen` holds our last write to `key`.
    fn trusted(&self, key: &str, seen: Option<&str>) -> bool {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        match written.get(key) {
            None => true,
            Some(rv) if Some(rv.as_str()) == seen => {
                // The store caught up with our write: trust it from now on.
                written.remove(key);
                true
            }
            Some(_) => false,
        }
    }

    fn remember(&self, key: String, rv: Option<String>) {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        match rv {
            Some(rv) => written.insert(key, rv),
            None => written.remove(&key),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_older_than_our_write_is_not_trusted_until_the_store_has_it() {
        let w = StatusWriter::new("test");
        assert!(w.trusted("ConfigMap/shop/a", Some("1")));
        w.remember("ConfigMap/shop/a".into(), Some("5".into()));
        assert!(!w.trusted("ConfigMap/shop/a", Some("4")));
        assert!(w.trusted("ConfigMap/shop/a", Some("5")));
        // Caught up once: trusted from then on.
        assert!(w.trusted("ConfigMap/shop/a", Some("4")));
    }
}
