//! Where job logs and artifacts are kept after the runner pods are gone: an object store
//! (`object_store`; a local directory by default), laid out by namespace, job UID and attempt:
//!
//! ```text
//! jobs/<namespace>/<job uid>/<attempt>/log
//! jobs/<namespace>/<job uid>/<attempt>/artifacts/<sha256 of the path>   (content)
//! jobs/<namespace>/<job uid>/index.json                                  (artifact list)
//! ```
//!
//! While an attempt runs, its log grows in a spool file under the live directory (appended as
//! the executor sends it, read by followers); when the attempt ends the spool is put into the
//! store whole and removed. Keys use the job's UID, never its name: a new Job with an old
//! name never sees the old one's logs.
//!
//! Every byte a namespace keeps counts against its [`Quota`]: spooled log output, sealed logs
//! and artifacts. A write past the quota is not made (the caller says so in the attempt's
//! status); nothing another namespace stored is ever removed to make room.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

use crate::Error;
use crate::objects::Objects;
use crate::quota::Quota;

/// The artifact list of a job: small, rewritten per attempt, not counted in the quota.
const INDEX_FILE: &str = "index.json";

/// An artifact as the store lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredArtifact {
    pub attempt: i32,
    pub path: String,
    pub size: u64,
    pub sha256: String,
    pub declared: String,
}

/// The store plus the live spool.
#[derive(Clone)]
pub struct Store {
    objects: Arc<dyn ObjectStore>,
    live: PathBuf,
    quota: Arc<Quota>,
    /// Spool bytes charged to the quota per (job UID, attempt), until the spool is sealed.
    spools: Arc<Mutex<HashMap<(String, i32), u64>>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("objects", &self.objects.to_string())
            .field("live", &self.live)
            .field("quota", &self.quota.limit())
            .finish()
    }
}

impl Store {
    /// A store in directory `dir` (created): objects under `dir/objects`, spools under
    /// `dir/live`; each namespace may keep `quota` bytes. Call [`Store::count_stored`] before
    /// writing, so what is stored already counts.
    pub fn local(dir: &Path, quota: u64) -> Result<Self, Error> {
        Self::open(dir, &Objects::Local, quota)
    }

    /// A store whose objects are in `objects` and whose spools are under `dir/live` (created);
    /// each namespace may keep `quota` bytes. Call [`Store::count_stored`] before writing, so
    /// what is stored already counts (it also proves the objects can be listed).
    pub fn open(dir: &Path, objects: &Objects, quota: u64) -> Result<Self, Error> {
        let live = dir.join("live");
        std::fs::create_dir_all(&live)
            .map_err(|e| Error::Store(format!("{}: {e}", live.display())))?;
        Ok(Store {
            objects: objects.open(dir)?,
            live,
            quota: Arc::new(Quota::new(quota)),
            spools: Arc::default(),
        })
    }

    /// The quota, for reports.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// Counts what each namespace has stored (sealed logs and artifacts) against its quota.
    pub async fn count_stored(&self) -> Result<(), Error> {
        use futures_util::StreamExt;
        let mut listed = self.objects.list(Some(&ObjectPath::from("jobs")));
        while let Some(meta) = listed.next().await {
            let meta = meta.map_err(|e| Error::Store(e.to_string()))?;
            if let Some(ns) = counted_namespace(&meta.location) {
                self.quota.charge(&ns, meta.size);
            }
        }
        Ok(())
    }

    fn spools(&self) -> std::sync::MutexGuard<'_, HashMap<(String, i32), u64>> {
        self.spools.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn log_key(ns: &str, uid: &str, attempt: i32) -> ObjectPath {
        ObjectPath::from(format!("jobs/{ns}/{uid}/{attempt}/log"))
    }

    fn artifact_key(ns: &str, uid: &str, attempt: i32, path: &str) -> ObjectPath {
        ObjectPath::from(format!(
            "jobs/{ns}/{uid}/{attempt}/artifacts/{}",
            hex_sha256(path.as_bytes())
        ))
    }

    fn index_key(ns: &str, uid: &str) -> ObjectPath {
        ObjectPath::from(format!("jobs/{ns}/{uid}/{INDEX_FILE}"))
    }

    /// The spool file of a running attempt.
    pub fn spool_path(&self, uid: &str, attempt: i32) -> PathBuf {
        self.live.join(format!("{uid}.{attempt}.log"))
    }

    /// Bytes already spooled for an attempt (where a driver resumes after a restart).
    pub async fn spooled(&self, uid: &str, attempt: i32) -> u64 {
        tokio::fs::metadata(self.spool_path(uid, attempt))
            .await
            .map(|m| m.len())
            .unwrap_or(0)
    }

    /// Where a driver resumes an attempt of a job of `ns`: the bytes already spooled, counted
    /// against the quota (once, however often the attempt is resumed).
    pub async fn resume_spool(&self, ns: &str, uid: &str, attempt: i32) -> u64 {
        let offset = self.spooled(uid, attempt).await;
        let mut spools = self.spools();
        let charged = spools.entry((uid.to_string(), attempt)).or_default();
        if offset > *charged {
            self.quota.charge(ns, offset - *charged);
            *charged = offset;
        }
        offset
    }

    /// Appends log output of a job of `ns` to its spool, if the namespace's quota has room for
    /// all of it; `Ok(false)` (nothing written) if not.
    pub async fn append_spool(
        &self,
        ns: &str,
        uid: &str,
        attempt: i32,
        f: &mut tokio::fs::File,
        data: &[u8],
    ) -> Result<bool, Error> {
        let n = data.len() as u64;
        if !self.quota.try_charge(ns, n) {
            return Ok(false);
        }
        *self.spools().entry((uid.to_string(), attempt)).or_default() += n;
        append(f, data).await?;
        Ok(true)
    }

    /// Opens the spool for appending at `offset` (truncating anything after it).
    pub async fn open_spool(
        &self,
        uid: &str,
        attempt: i32,
        offset: u64,
    ) -> Result<tokio::fs::File, Error> {
        let path = self.spool_path(uid, attempt);
        let io = |e: std::io::Error| Error::Store(format!("{}: {e}", path.display()));
        let f = tokio::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .await
            .map_err(io)?;
        f.set_len(offset).await.map_err(io)?;
        let mut f = f;
        tokio::io::AsyncSeekExt::seek(&mut f, std::io::SeekFrom::Start(offset))
            .await
            .map_err(io)?;
        Ok(f)
    }

    /// Moves the spool into the store (the attempt has ended). Returns the log's size.
    pub async fn seal_log(&self, ns: &str, uid: &str, attempt: i32) -> Result<u64, Error> {
        let path = self.spool_path(uid, attempt);
        let data = match tokio::fs::read(&path).await {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(Error::Store(format!("{}: {e}", path.display()))),
        };
        let len = data.len() as u64;
        self.objects
            .put(&Self::log_key(ns, uid, attempt), Bytes::from(data).into())
            .await
            .map_err(|e| Error::Store(e.to_string()))?;
        let _ = tokio::fs::remove_file(&path).await;
        // The spooled bytes were counted as they came; a spool never resumed here (sealed after
        // a restart) is counted now.
        let charged = self
            .spools()
            .remove(&(uid.to_string(), attempt))
            .unwrap_or(0);
        if len > charged {
            self.quota.charge(ns, len - charged);
        } else {
            self.quota.release(ns, charged - len);
        }
        Ok(len)
    }

    /// A sealed log, or `None`.
    pub async fn log(&self, ns: &str, uid: &str, attempt: i32) -> Result<Option<Bytes>, Error> {
        match self.objects.get(&Self::log_key(ns, uid, attempt)).await {
            Ok(r) => Ok(Some(
                r.bytes().await.map_err(|e| Error::Store(e.to_string()))?,
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Error::Store(e.to_string())),
        }
    }

    /// Keeps one artifact file if the namespace's quota has room for it; `Ok(false)` (not
    /// kept) if not.
    pub async fn put_artifact(
        &self,
        ns: &str,
        uid: &str,
        attempt: i32,
        path: &str,
        data: Bytes,
    ) -> Result<bool, Error> {
        let n = data.len() as u64;
        if !self.quota.try_charge(ns, n) {
            return Ok(false);
        }
        match self
            .objects
            .put(&Self::artifact_key(ns, uid, attempt, path), data.into())
            .await
        {
            Ok(_) => Ok(true),
            Err(e) => {
                self.quota.release(ns, n);
                Err(Error::Store(e.to_string()))
            }
        }
    }

    pub async fn artifact(
        &self,
        ns: &str,
        uid: &str,
        attempt: i32,
        path: &str,
    ) -> Result<Option<Bytes>, Error> {
        match self
            .objects
            .get(&Self::artifact_key(ns, uid, attempt, path))
            .await
        {
            Ok(r) => Ok(Some(
                r.bytes().await.map_err(|e| Error::Store(e.to_string()))?,
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Error::Store(e.to_string())),
        }
    }

    /// The job's artifact list (all attempts).
    pub async fn artifacts(&self, ns: &str, uid: &str) -> Result<Vec<StoredArtifact>, Error> {
        match self.objects.get(&Self::index_key(ns, uid)).await {
            Ok(r) => {
                let b = r.bytes().await.map_err(|e| Error::Store(e.to_string()))?;
                serde_json::from_slice(&b).map_err(|e| Error::Store(format!("artifact index: {e}")))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(Vec::new()),
            Err(e) => Err(Error::Store(e.to_string())),
        }
    }

    pub async fn put_artifact_index(
        &self,
        ns: &str,
        uid: &str,
        list: &[StoredArtifact],
    ) -> Result<(), Error> {
        let body = serde_json::to_vec(list).map_err(|e| Error::Store(e.to_string()))?;
        self.objects
            .put(&Self::index_key(ns, uid), Bytes::from(body).into())
            .await
            .map(|_| ())
            .map_err(|e| Error::Store(e.to_string()))
    }

    /// Deletes everything kept for a job (it was deleted, or its retention ran out).
    pub async fn forget(&self, ns: &str, uid: &str) -> Result<usize, Error> {
        use futures_util::StreamExt;
        let prefix = ObjectPath::from(format!("jobs/{ns}/{uid}"));
        let mut listed = self.objects.list(Some(&prefix));
        let mut n = 0;
        while let Some(meta) = listed.next().await {
            let meta = meta.map_err(|e| Error::Store(e.to_string()))?;
            match self.objects.delete(&meta.location).await {
                Ok(()) => {
                    n += 1;
                    if let Some(ns) = counted_namespace(&meta.location) {
                        self.quota.release(&ns, meta.size);
                    }
                }
                Err(object_store::Error::NotFound { .. }) => n += 1,
                Err(e) => return Err(Error::Store(e.to_string())),
            }
        }
        Ok(n)
    }

    /// Namespaces and job UIDs that have anything stored (for garbage collection).
    pub async fn stored_jobs(&self) -> Result<Vec<(String, String)>, Error> {
        use futures_util::StreamExt;
        let mut out = std::collections::BTreeSet::new();
        let mut listed = self.objects.list(Some(&ObjectPath::from("jobs")));
        while let Some(meta) = listed.next().await {
            let meta = meta.map_err(|e| Error::Store(e.to_string()))?;
            let parts: Vec<_> = meta
                .location
                .parts()
                .map(|p| p.as_ref().to_owned())
                .collect();
            if let [_, ns, uid, ..] = parts.as_slice() {
                out.insert((ns.clone(), uid.clone()));
            }
        }
        Ok(out.into_iter().collect())
    }
}

/// The namespace an object counts against (`jobs/<ns>/…`), `None` for index files.
fn counted_namespace(location: &ObjectPath) -> Option<String> {
    let parts: Vec<_> = location.parts().map(|p| p.as_ref().to_owned()).collect();
    match parts.as_slice() {
        [_, _, _, last] if last == INDEX_FILE => None,
        [_, ns, _, _, ..] => Some(ns.clone()),
        _ => None,
    }
}

/// Appends to a spool and flushes, so followers see every byte as soon as it is written.
pub async fn append(f: &mut tokio::fs::File, data: &[u8]) -> Result<(), Error> {
    f.write_all(data)
        .await
        .map_err(|e| Error::Store(format!("spool: {e}")))?;
    f.flush()
        .await
        .map_err(|e| Error::Store(format!("spool: {e}")))
}

pub fn hex_sha256(data: &[u8]) -> String {
    spur_api::digest::sha256_hex(data)
}

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn logs_spool_then_seal_and_artifacts_round_trip() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        conformance::round_trip(&Objects::Local, dir.path()).await;
    }

    #[tokio::test]
    async fn a_namespace_past_its_quota_takes_no_room_from_another() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        conformance::quota_across_restart(&Objects::Local, dir.path()).await;
    }
}
