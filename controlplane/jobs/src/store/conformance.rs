//! What every object backend must do for the store, as scenarios a test runs against one
//! (feature `conformance`): the unit tests run them on a directory, the Go tier on a real
//! S3-compatible server (`tests/tests/s3_store.rs`). Each one panics on the first difference.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::Path;

use bytes::Bytes;

use super::{Store, StoredArtifact, append, hex_sha256};
use crate::objects::Objects;

/// Spooled output is sealed into a log that reads back whole; artifacts and their index round
/// trip; another namespace or attempt sees nothing; `forget` removes all of a job. `dir` is the
/// spool's volume (and, for [`Objects::Local`], the objects').
pub async fn round_trip(objects: &Objects, dir: &Path) {
    let s = Store::open(dir, objects, 1 << 20).unwrap();
    s.count_stored().await.unwrap();
    let mut f = s.open_spool("u1", 1, 0).await.unwrap();
    append(&mut f, b"hello ").await.unwrap();
    append(&mut f, b"world\n").await.unwrap();
    assert_eq!(s.spooled("u1", 1).await, 12);
    // A resumed driver rewinds to what the executor will resend.
    let mut f = s.open_spool("u1", 1, 6).await.unwrap();
    append(&mut f, b"there\n").await.unwrap();
    assert_eq!(s.seal_log("ns", "u1", 1).await.unwrap(), 12);
    assert!(!s.spool_path("u1", 1).exists());
    assert_eq!(
        &s.log("ns", "u1", 1).await.unwrap().unwrap()[..],
        b"hello there\n"
    );
    assert!(s.log("ns", "u1", 2).await.unwrap().is_none());
    assert!(s.log("other", "u1", 1).await.unwrap().is_none());

    s.put_artifact("ns", "u1", 1, "/tmp/a", Bytes::from_static(b"A"))
        .await
        .unwrap();
    let list = vec![StoredArtifact {
        attempt: 1,
        path: "/tmp/a".into(),
        size: 1,
        sha256: hex_sha256(b"A"),
        declared: "/tmp/a".into(),
    }];
    s.put_artifact_index("ns", "u1", &list).await.unwrap();
    assert_eq!(s.artifacts("ns", "u1").await.unwrap(), list);
    assert_eq!(
        &s.artifact("ns", "u1", 1, "/tmp/a").await.unwrap().unwrap()[..],
        b"A"
    );
    assert!(
        s.artifact("other", "u1", 1, "/tmp/a")
            .await
            .unwrap()
            .is_none()
    );
    assert!(s.artifacts("other", "u1").await.unwrap().is_empty());
    assert_eq!(
        s.stored_jobs().await.unwrap(),
        vec![("ns".into(), "u1".into())]
    );
    assert_eq!(s.forget("ns", "u1").await.unwrap(), 3);
    assert!(s.artifacts("ns", "u1").await.unwrap().is_empty());
    assert!(s.log("ns", "u1", 1).await.unwrap().is_none());
    assert!(s.stored_jobs().await.unwrap().is_empty());
}

/// A namespace past its quota is refused without taking room from another; a store opened
/// again over the same objects (a restarted component) counts what is there, and a deleted
/// job gives its room back. Needs the objects empty at the start.
pub async fn quota_across_restart(objects: &Objects, dir: &Path) {
    let s = Store::open(dir, objects, 100).unwrap();
    s.count_stored().await.unwrap();
    // Namespace a fills its quota with a log and an artifact.
    let mut f = s.open_spool("a1", 1, 0).await.unwrap();
    assert!(
        s.append_spool("a", "a1", 1, &mut f, &[b'x'; 60])
            .await
            .unwrap()
    );
    assert!(
        !s.append_spool("a", "a1", 1, &mut f, &[b'x'; 41])
            .await
            .unwrap()
    );
    assert!(
        s.put_artifact("a", "a1", 1, "/f", Bytes::from_static(&[0; 40]))
            .await
            .unwrap()
    );
    assert!(
        !s.put_artifact("a", "a1", 1, "/g", Bytes::from_static(b"1"))
            .await
            .unwrap()
    );
    assert_eq!(s.seal_log("a", "a1", 1).await.unwrap(), 60);
    assert_eq!(s.quota().used("a"), 100);
    // Namespace b still has all of its own, and nothing of a's was removed for it.
    let mut f = s.open_spool("b1", 1, 0).await.unwrap();
    assert!(
        s.append_spool("b", "b1", 1, &mut f, &[b'y'; 100])
            .await
            .unwrap()
    );
    assert_eq!(s.log("a", "a1", 1).await.unwrap().unwrap().len(), 60);
    // A restarted component counts what is stored (b's spool when its attempt resumes, once
    // however often it is resumed).
    let again = Store::open(dir, objects, 100).unwrap();
    again.count_stored().await.unwrap();
    assert_eq!(again.quota().used("a"), 100);
    assert_eq!(again.resume_spool("b", "b1", 1).await, 100);
    assert_eq!(again.resume_spool("b", "b1", 1).await, 100);
    assert_eq!(again.quota().used("b"), 100);
    assert_eq!(again.seal_log("b", "b1", 1).await.unwrap(), 100);
    assert_eq!(again.quota().used("b"), 100);
    // Deleting a's job gives its room back.
    again.forget("a", "a1").await.unwrap();
    assert_eq!(again.quota().used("a"), 0);
    assert!(
        again
            .put_artifact("a", "a2", 1, "/f", Bytes::from_static(&[0; 100]))
            .await
            .unwrap()
    );
    // Leave the objects as found.
    for (ns, uid) in again.stored_jobs().await.unwrap() {
        again.forget(&ns, &uid).await.unwrap();
    }
    assert!(again.stored_jobs().await.unwrap().is_empty());
}
