//! The jobs store on a real S3-compatible server (issue 47: "job artifacts and logs in an
//! S3-compatible object store where users outgrow the PVC"): SeaweedFS built from its Go module
//! (`spur_e2e::s3`), its S3 gateway over TLS with a CA of the test's own, signature v4 with one
//! identity. The store's own scenarios (`spur_jobs::store::conformance`, the same the unit tests
//! run on a directory) pass on it; a prefix keeps installations sharing a bucket apart; a wrong
//! secret, a missing bucket, an untrusted certificate and a plaintext endpoint each fail with an
//! error that names the bucket and never the secret.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use spur_e2e::s3::{ACCESS_KEY, S3Server, SECRET_KEY};
use spur_jobs::objects::{Credentials, Objects, S3};
use spur_jobs::store::{Store, conformance};

fn bucket(server: &S3Server, bucket: &str, prefix: &str) -> S3 {
    S3 {
        bucket: bucket.into(),
        prefix: prefix.into(),
        endpoint: Some(server.endpoint.clone()),
        region: Some("us-east-1".into()),
        allow_http: false,
        virtual_hosted: false,
        ca_file: Some(server.ca_file.clone()),
        credentials: Some(Credentials {
            access_key_id: ACCESS_KEY.into(),
            secret_access_key: SECRET_KEY.into(),
        }),
    }
}

/// Opens a store and lists what it holds (what the component does at start).
async fn open(s3: S3, dir: &std::path::Path) -> Result<Store, String> {
    let store = Store::open(dir, &Objects::S3(s3), 1 << 20).map_err(|e| e.to_string())?;
    store.count_stored().await.map_err(|e| e.to_string())?;
    Ok(store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_keeps_logs_and_artifacts_in_a_bucket() {
    let server = S3Server::start().await.unwrap();
    server.create_bucket("spur-jobs").unwrap();
    let volume = tempfile::tempdir().unwrap();

    // The store's scenarios, each under a prefix of its own in one bucket.
    conformance::round_trip(
        &Objects::S3(bucket(&server, "spur-jobs", "cluster-a")),
        &volume.path().join("a"),
    )
    .await;
    conformance::quota_across_restart(
        &Objects::S3(bucket(&server, "spur-jobs", "cluster-b")),
        &volume.path().join("b"),
    )
    .await;

    // Two installations sharing the bucket under two prefixes see only their own objects.
    let a = open(bucket(&server, "spur-jobs", "cluster-a"), volume.path())
        .await
        .unwrap();
    let b = open(bucket(&server, "spur-jobs", "cluster-b"), volume.path())
        .await
        .unwrap();
    let root = open(bucket(&server, "spur-jobs", ""), volume.path())
        .await
        .unwrap();
    assert!(
        a.put_artifact("team", "job-1", 1, "/out", bytes::Bytes::from_static(b"A"))
            .await
            .unwrap()
    );
    assert_eq!(
        a.stored_jobs().await.unwrap(),
        vec![("team".into(), "job-1".into())]
    );
    assert!(b.stored_jobs().await.unwrap().is_empty());
    assert!(
        b.artifact("team", "job-1", 1, "/out")
            .await
            .unwrap()
            .is_none()
    );
    // Under the bucket's root the prefix is a directory, not a job: nothing there counts.
    assert!(root.stored_jobs().await.unwrap().is_empty());
    // A store opened again over the prefix counts what is there against the namespace.
    let again = open(bucket(&server, "spur-jobs", "cluster-a"), volume.path())
        .await
        .unwrap();
    assert_eq!(again.quota().used("team"), 1);
    assert_eq!(a.forget("team", "job-1").await.unwrap(), 1);
    assert!(again.stored_jobs().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_credentials_a_missing_bucket_and_an_untrusted_server_are_clear_errors() {
    let server = S3Server::start().await.unwrap();
    server.create_bucket("spur-jobs").unwrap();
    let volume = tempfile::tempdir().unwrap();
    let no_secret = |e: &str| {
        assert!(!e.contains(SECRET_KEY), "the secret is in the error: {e}");
    };

    let mut wrong = bucket(&server, "spur-jobs", "");
    let wrong_secret = "not-the-secret-at-all-0123456789";
    wrong.credentials = Some(Credentials {
        access_key_id: ACCESS_KEY.into(),
        secret_access_key: wrong_secret.into(),
    });
    let e = open(wrong, volume.path())
        .await
        .expect_err("a wrong secret was accepted");
    assert!(
        e.contains("403") || e.contains("SignatureDoesNotMatch"),
        "{e}"
    );
    assert!(!e.contains(wrong_secret), "the secret is in the error: {e}");

    let e = open(bucket(&server, "no-such-bucket", ""), volume.path())
        .await
        .expect_err("a missing bucket was accepted");
    assert!(e.contains("no-such-bucket"), "{e}");
    no_secret(&e);

    // The server's certificate checked: a CA that did not sign it is refused...
    let mut untrusted = bucket(&server, "spur-jobs", "");
    untrusted.ca_file = Some(server.other_ca_file.clone());
    let e = open(untrusted, volume.path())
        .await
        .expect_err("a certificate of an untrusted CA was accepted");
    assert!(
        e.to_lowercase().contains("certificate") || e.contains("error sending request"),
        "{e}"
    );
    no_secret(&e);

    // ...and plaintext is refused before any request, unless asked for.
    let mut plain = bucket(&server, "spur-jobs", "");
    plain.endpoint = Some(server.endpoint.replace("https://", "http://"));
    let e = open(plain, volume.path())
        .await
        .expect_err("an http:// endpoint was accepted without --s3-allow-http");
    assert!(e.contains("--s3-allow-http"), "{e}");

    // The right key still works after all that.
    open(bucket(&server, "spur-jobs", ""), volume.path())
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", server.log_tail()));
}
