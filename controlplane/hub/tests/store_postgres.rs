//! The hub's store on a real PostgreSQL server (issue 47: hub replicas share one registry): the
//! same behaviour as on SQLite, one schema in both dialects, replicas racing on one database,
//! TLS required and verified, a restarted server reconnected, a newer schema refused.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use spur_hub::store::{Database, PostgresSettings, ScopeChange, SessionScope};
use spur_hub::users::Namespaces;
use spur_hub::{Error, Store};
use spur_kube_harness::postgres::{PASSWORD, Postgres, ServerTls};

const MINUTE: Duration = Duration::from_secs(60);

fn url(pg: &Postgres, db: &str) -> String {
    format!("postgres://postgres:{PASSWORD}@127.0.0.1:{}/{db}", pg.port)
}

fn plaintext(pg: &Postgres, db: &str) -> PostgresSettings {
    PostgresSettings {
        url: url(pg, db),
        insecure_plaintext: true,
        ..PostgresSettings::default()
    }
}

/// A database of its own per test case, on the one server.
async fn database(pg: &Postgres, name: &str) {
    pg.admin()
        .await
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
}

/// Store calls block: run them off the runtime's threads, as the hub does.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// Everything the hub asks of its store, with what each answer must be; run on both backends.
fn behaves(s: &Store) {
    // Clusters: register, authenticate, conflict, rotate, revoke, register again.
    let t1 = s.add_cluster("east", false).unwrap();
    let id = s.cluster_for_token(&t1).unwrap().unwrap();
    assert_eq!(id.name, "east");
    assert!(s.session_valid("east", id.issued).unwrap());
    assert_eq!(s.active_clusters().unwrap().get("east"), Some(&id.issued));
    assert!(matches!(
        s.add_cluster("east", false),
        Err(Error::Conflict(_))
    ));
    std::thread::sleep(Duration::from_millis(2));
    let t2 = s.add_cluster("east", true).unwrap();
    assert_eq!(
        s.cluster_for_token(&t1).unwrap(),
        None,
        "a rotated token works"
    );
    assert!(!s.session_valid("east", id.issued).unwrap());
    assert!(s.revoke_cluster("east").unwrap());
    assert!(!s.revoke_cluster("east").unwrap());
    assert_eq!(s.cluster_for_token(&t2).unwrap(), None);
    assert!(s.active_clusters().unwrap().is_empty());
    assert!(matches!(s.revoke_cluster("west"), Err(Error::NotFound(_))));
    s.touch_cluster("east").unwrap();
    let listed = s.clusters().unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].revoked.is_some() && listed[0].last_seen.is_some());
    assert!(
        s.cluster_for_token(&s.add_cluster("east", false).unwrap())
            .unwrap()
            .is_some()
    );

    // Users, scopes and keys.
    assert!(matches!(
        s.add_api_key("k", "alice"),
        Err(Error::NotFound(_))
    ));
    s.add_user("alice").unwrap();
    assert!(matches!(s.add_user("alice"), Err(Error::Conflict(_))));
    let scope = |cluster: &str, ns: &[&str]| ScopeChange {
        cluster: cluster.into(),
        namespaces: Namespaces::parse(&ns.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap(),
        kube_user: Some("alice@example.com".into()),
        kube_groups: vec!["team-a".into()],
    };
    s.set_user_scope("alice", &scope("east", &["a"])).unwrap();
    s.set_user_scope("alice", &scope("east", &["b"])).unwrap();
    s.set_user_scope("alice", &scope("*", &["c"])).unwrap();
    let key = s.add_api_key("k", "alice").unwrap();
    assert!(matches!(
        s.add_api_key("k", "alice"),
        Err(Error::Conflict(_))
    ));
    assert_eq!(s.api_key_name(&key).unwrap().as_deref(), Some("k"));
    let user = s.principal_for_key(&key).unwrap().unwrap().user.unwrap();
    assert!(user.sees("east", &["b".to_string()].into()));
    assert!(
        !user.sees("east", &["a".to_string()].into()),
        "the replaced scope still counts"
    );
    assert_eq!(user.clusters.len(), 2);
    assert_eq!(
        user.clusters["east"].kube_user.as_deref(),
        Some("alice@example.com")
    );
    assert!(s.unset_user_scope("alice", "*").unwrap());
    assert!(!s.unset_user_scope("alice", "*").unwrap());
    assert_eq!(s.users().unwrap().len(), 1);
    assert!(s.unbound_api_keys().unwrap().is_empty());

    // Sessions and login codes.
    let web = s.create_session("k", MINUTE, SessionScope::Web).unwrap();
    assert_eq!(
        s.session_key(&web, SessionScope::Web).unwrap().as_deref(),
        Some("k")
    );
    assert_eq!(s.session_key(&web, SessionScope::Preview).unwrap(), None);
    let p = s
        .principal_for_session(&web, SessionScope::Web)
        .unwrap()
        .unwrap();
    assert_eq!(p.user.unwrap().name, "alice");
    let expired = s
        .create_session("k", Duration::ZERO, SessionScope::Web)
        .unwrap();
    assert_eq!(s.session_key(&expired, SessionScope::Web).unwrap(), None);
    let other = s
        .create_session("k", MINUTE, SessionScope::Preview)
        .unwrap();
    assert!(s.end_session(&other).unwrap());
    assert!(!s.end_session(&other).unwrap());
    assert_eq!(s.session_key(&other, SessionScope::Preview).unwrap(), None);
    let code = s.create_login_code("k", MINUTE).unwrap();
    assert_eq!(s.session_key(&code, SessionScope::Web).unwrap(), None);
    assert_eq!(s.login_code_key(&code).unwrap().as_deref(), Some("k"));
    let from_code = s.redeem_login_code(&code, MINUTE).unwrap().unwrap();
    assert_eq!(
        s.redeem_login_code(&code, MINUTE).unwrap(),
        None,
        "a code worked twice"
    );
    assert_eq!(
        s.session_key(&from_code, SessionScope::Web)
            .unwrap()
            .as_deref(),
        Some("k")
    );
    let stale = s.create_login_code("k", Duration::ZERO).unwrap();
    assert_eq!(s.redeem_login_code(&stale, MINUTE).unwrap(), None);

    // The CA is made once.
    let ca = s.ca_or_create(|| Ok(("c1".into(), "k1".into()))).unwrap();
    assert_eq!(
        s.ca_or_create(|| Ok(("c2".into(), "k2".into()))).unwrap(),
        ca
    );

    // Removing the user revokes its keys and ends their sessions.
    assert_eq!(s.remove_user("alice").unwrap(), 1);
    assert_eq!(s.principal_for_key(&key).unwrap(), None);
    assert_eq!(
        s.principal_for_session(&web, SessionScope::Web).unwrap(),
        None
    );
    assert!(!s.revoke_api_key("k").unwrap());
    assert!(matches!(s.revoke_api_key("x"), Err(Error::NotFound(_))));
    assert_eq!(s.api_keys().unwrap()[0].user.as_deref(), Some("alice"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_behaves_the_same_on_postgres_and_sqlite() {
    let pg = Postgres::start().await;
    pg.admin().await;
    database(&pg, "behaves").await;
    let settings = plaintext(&pg, "behaves");
    blocking(move || {
        behaves(&Store::in_memory().unwrap());
        let store = Store::open_database(&Database::Postgres(settings)).unwrap();
        behaves(&store);
        assert_eq!(store.data_version().unwrap(), None);
        // Both dialects end with the same tables and columns.
        let sqlite = Store::in_memory().unwrap().schema_columns().unwrap();
        assert!(sqlite.len() >= 7, "{sqlite:?}");
        assert_eq!(store.schema_columns().unwrap(), sqlite);
    })
    .await;
}

/// Four replicas start at once on one empty database (one migration between them), then race:
/// one login code, one cluster name, one CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_racing_on_one_database_agree() {
    let pg = Postgres::start().await;
    pg.admin().await;
    database(&pg, "race").await;
    let settings = plaintext(&pg, "race");
    blocking(move || {
        const REPLICAS: usize = 4;
        let barrier = Arc::new(Barrier::new(REPLICAS));
        let stores: Vec<Store> = (0..REPLICAS)
            .map(|_| {
                let (settings, barrier) = (settings.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    Store::connect(&settings).unwrap()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        stores[0].add_user("dev").unwrap();
        stores[0].add_api_key("dev", "dev").unwrap();
        let race = |f: &(dyn Fn(&Store) -> Option<String> + Sync)| -> Vec<String> {
            let barrier = Barrier::new(REPLICAS);
            std::thread::scope(|scope| {
                let racers: Vec<_> = stores
                    .iter()
                    .map(|s| {
                        let barrier = &barrier;
                        scope.spawn(move || {
                            barrier.wait();
                            f(s)
                        })
                    })
                    .collect();
                racers
                    .into_iter()
                    .filter_map(|r| r.join().unwrap())
                    .collect()
            })
        };
        for round in 0..10 {
            let code = stores[0].create_login_code("dev", MINUTE).unwrap();
            let won = race(&|s| s.redeem_login_code(&code, MINUTE).unwrap());
            assert_eq!(won.len(), 1, "one code gave {} sessions", won.len());
            let name = format!("c{round}");
            let registered = race(&|s| match s.add_cluster(&name, false) {
                Ok(token) => Some(token),
                Err(Error::Conflict(_)) => None,
                Err(e) => panic!("registering {name}: {e}"),
            });
            assert_eq!(
                registered.len(),
                1,
                "{name} registered {} times",
                registered.len()
            );
            assert!(
                stores[3]
                    .cluster_for_token(&registered[0])
                    .unwrap()
                    .is_some()
            );
        }
        let cas: BTreeSet<String> = race(&|s| {
            let mine = format!("cert-{:?}", std::thread::current().id());
            Some(s.ca_or_create(|| Ok((mine, "key".into()))).unwrap().0)
        })
        .into_iter()
        .collect();
        assert_eq!(cas.len(), 1, "replicas made different CAs: {cas:?}");
    })
    .await;
}

fn server_certificate(name: &str) -> (String, ServerTls) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let cert = rcgen::CertificateParams::new(vec![name.to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    (
        ca_cert.pem(),
        ServerTls {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        },
    )
}

/// TLS is the default and is verified (chain and host name); plaintext needs the opt-in; a
/// refusal never shows the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_required_and_verified() {
    // The certificate names localhost; the server listens on 127.0.0.1.
    let (ca, tls) = server_certificate("localhost");
    let (other_ca, _) = server_certificate("localhost");
    let pg = Postgres::start_with(Some(tls)).await;
    pg.admin().await;
    let dir = tempfile::tempdir().unwrap();
    let (ca_file, other_file) = (dir.path().join("ca.pem"), dir.path().join("other.pem"));
    std::fs::write(&ca_file, ca).unwrap();
    std::fs::write(&other_file, other_ca).unwrap();
    let port = pg.port;
    // hostaddr: the name checked is localhost, the address dialled 127.0.0.1 (localhost may
    // resolve to ::1 first, where nothing listens).
    let by_name =
        format!("host=localhost hostaddr=127.0.0.1 port={port} user=postgres password={PASSWORD}");
    let by_address = url(&pg, "postgres");
    blocking(move || {
        let with = |url: &str, ca: Option<&std::path::Path>, plaintext: bool| {
            Store::connect(&PostgresSettings {
                url: url.into(),
                password: None,
                ca: ca.map(Into::into),
                insecure_plaintext: plaintext,
            })
        };
        let store = with(&by_name, Some(&ca_file), false).expect("TLS with the right CA");
        store.add_cluster("tls", false).unwrap();
        let err = with(&by_name, Some(&other_file), false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("certificate"),
            "another CA's chain was accepted: {err}"
        );
        // The certificate names localhost, not 127.0.0.1.
        let err = with(&by_address, Some(&ca_file), false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("certificate"),
            "a wrong host name was accepted: {err}"
        );
        let err = with(
            &format!("{by_address}?sslmode=disable"),
            Some(&ca_file),
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("--database-insecure-plaintext"), "{err}");
        // The opt-in connects without TLS.
        with(&by_address, None, true).expect("plaintext with the opt-in");
        // A wrong password: refused, and the message does not carry it.
        let wrong = format!(
            "host=localhost hostaddr=127.0.0.1 port={port} user=postgres password=hunter2-not-it"
        );
        let err = with(&wrong, Some(&ca_file), false).unwrap_err().to_string();
        assert!(err.contains("password authentication failed"), "{err}");
        assert!(!err.contains("hunter2"), "the password in an error: {err}");
        let err = with("postgres://[::1", None, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("database URL"), "{err}");
    })
    .await;
}

/// The server restarts under a connected store: the next calls connect again, nothing lost.
/// A database at a newer schema version is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_is_reconnected_and_a_newer_schema_refused() {
    let mut pg = Postgres::start().await;
    pg.admin().await;
    database(&pg, "restart").await;
    let settings = plaintext(&pg, "restart");
    let store = {
        let settings = settings.clone();
        blocking(move || Store::connect(&settings).unwrap()).await
    };
    let token = {
        let s = store.clone();
        blocking(move || s.add_cluster("east", false).unwrap()).await
    };
    pg.restart().await;
    pg.admin().await;
    let s = store.clone();
    blocking(move || {
        // The first call after the restart may meet the dead connection; then it connects again.
        let mut found = None;
        for _ in 0..20 {
            match s.cluster_for_token(&token) {
                Ok(f) => {
                    found = f;
                    break;
                }
                Err(e) => {
                    eprintln!("after the restart: {e}");
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        assert_eq!(found.expect("the cluster after a restart").name, "east");
    })
    .await;
    let admin = pg.admin().await;
    let (client, conn) = tokio_postgres::connect(&url(&pg, "restart"), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute("UPDATE spur_hub_schema SET version = 99")
        .await
        .unwrap();
    drop(admin);
    let err = blocking(move || Store::connect(&settings).unwrap_err().to_string()).await;
    assert!(err.contains("newer"), "{err}");
}

/// A server that stops answering without closing its connections (a partition, a stalled
/// failover): a call fails within the store's deadline rather than hold every caller of this
/// replica, and once the server answers again the next call works on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stops_answering_fails_calls_within_the_deadline() {
    let pg = Postgres::start().await;
    pg.admin().await;
    database(&pg, "stall").await;
    let settings = plaintext(&pg, "stall");
    let store = blocking(move || Store::connect(&settings).unwrap()).await;
    let s = store.clone();
    blocking(move || s.add_cluster("east", false).unwrap()).await;
    pg.pause();
    let started = std::time::Instant::now();
    let s = store.clone();
    let err = blocking(move || s.clusters().unwrap_err().to_string()).await;
    let took = started.elapsed();
    pg.resume();
    assert!(err.contains("did not answer"), "{err}");
    // Counted for the hub's `spur_hub_database_errors_total` (alert SpurHubDatabaseErrors).
    assert_eq!(store.database_errors().get(), 1);
    assert!(
        took >= Duration::from_secs(10) && took < Duration::from_secs(40),
        "the stalled call ended after {took:?}"
    );
    let s = store.clone();
    let listed = blocking(move || s.clusters()).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        store.database_errors().get(),
        1,
        "a call that worked is not counted"
    );
}
