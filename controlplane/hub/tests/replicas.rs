//! Hub replicas (issue 47): two hubs share one registry, a cluster's agent keeps a session with
//! each, either reaches the cluster, one going away leaves the other serving, and a token
//! revoked through one replica is refused by every replica.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use spur_hub::Store;
use spur_hub::agent::Scope;
use spur_hub::agent::pool::{HubPool, PoolSettings, Resolver};
use spur_hub::agent::targets::AddressPolicy;
use spur_hub::listener::ListenerLimits;
use spur_hub::protocol::{AGENT_BIND, Open};
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

/// A TCP target that says who it is and closes.
async fn target(name: &'static str) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let _ = tcp.write_all(name.as_bytes()).await;
            });
        }
    });
    port
}

/// What the target says through `hub`'s session with the cluster's agent.
async fn through(hub: &TestHub, cluster: &str, port: u16) -> Result<String, String> {
    let open = Open::Tcp {
        host: "localhost".into(),
        port,
    };
    let mut stream = hub
        .clusters
        .open(cluster, &open, Duration::from_secs(5))
        .await
        .map_err(|e| e.to_string())?;
    let mut said = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut said))
        .await
        .map_err(|_| "the target's answer timed out".to_string())?
        .map_err(|e| e.to_string())?;
    Ok(said)
}

fn has_agent(hub: &TestHub, cluster: &str) -> bool {
    hub.clusters
        .get(cluster)
        .is_some_and(|s| s.binds().borrow().contains_key(AGENT_BIND))
}

fn scope() -> Scope {
    Scope {
        target_suffixes: vec!["localhost".into()],
        addresses: AddressPolicy {
            allow_cidrs: vec!["127.0.0.0/8".parse().unwrap()],
        },
        ..Scope::default()
    }
}

/// Two replicas on one registry (a SQLite file opened twice stands in for PostgreSQL here;
/// tests/store_postgres.rs runs the store itself on a real server).
async fn two_hubs(db: &std::path::Path) -> (TestHub, TestHub) {
    let a = start_hub_on(
        Store::open(db).unwrap(),
        settings(ListenerLimits::default()),
        |_| {},
    )
    .await;
    let b = start_hub_on(
        Store::open(db).unwrap(),
        settings(ListenerLimits::default()),
        |_| {},
    )
    .await;
    assert_eq!(a.ca_pem, b.ca_pem, "the replicas made two CAs");
    (a, b)
}

fn pool(hubs: Vec<String>, client: spur_tunnel::ClientConfig) -> HubPool {
    let mut registry = prometheus_client::registry::Registry::default();
    HubPool::new(
        PoolSettings {
            hubs,
            resolve_every: Duration::from_millis(50),
            // The test hubs' certificates name localhost; the pool dials their addresses.
            server_name: Some(WEB_HOST.into()),
        },
        client,
        None,
        scope(),
        None,
        &mut registry,
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_serves_every_hub_replica_and_a_revocation_reaches_all() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = two_hubs(&dir.path().join("hub.db")).await;
    let pool = pool(
        vec![a.tunnel.to_string(), b.tunnel.to_string()],
        agent_client(&a, "east"),
    );
    let ready = pool.ready();
    assert!(!ready(), "ready before any session");
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { pool.run(stop).await }
    });
    // Another cluster, with an agent on each replica.
    let west = agent_client(&a, "west");
    let west_stop = CancellationToken::new();
    for hub in [&a, &b] {
        let mut client = west.clone();
        client.h2_addr = Some(hub.tunnel.to_string());
        let mut r = prometheus_client::registry::Registry::default();
        let agent = spur_hub::agent::Agent::start(client, None, scope(), &mut r).unwrap();
        let s = west_stop.clone();
        tokio::spawn(async move { agent.run(s).await });
    }
    wait_for(
        "both agents on both replicas",
        Duration::from_secs(20),
        || {
            has_agent(&a, "east")
                && has_agent(&b, "east")
                && has_agent(&a, "west")
                && has_agent(&b, "west")
        },
    )
    .await;
    assert!(ready());
    let app = target("app-in-east").await;
    assert_eq!(through(&a, "east", app).await.unwrap(), "app-in-east");
    assert_eq!(through(&b, "east", app).await.unwrap(), "app-in-east");

    // West is revoked through replica A's store (the CLI beside one replica): both replicas end
    // west's sessions, and neither touches east's.
    a.store.revoke_cluster("west").unwrap();
    wait_for(
        "west's sessions ended on both replicas",
        Duration::from_secs(20),
        || !has_agent(&a, "west") && !has_agent(&b, "west"),
    )
    .await;
    assert!(
        has_agent(&a, "east") && has_agent(&b, "east"),
        "revoking west ended east's sessions"
    );
    let err = through(&b, "west", app).await.unwrap_err();
    assert!(err.contains("west"), "{err}");
    west_stop.cancel();

    // Replica A goes away: B still reaches the cluster, and the agent stays ready.
    a.stop.cancel();
    for _ in 0..20 {
        assert_eq!(through(&b, "east", app).await.unwrap(), "app-in-east");
    }
    assert!(ready(), "one replica gone made the agent unready");

    // East is revoked through A's store: B refuses the agent, no replica serves it, and the
    // agent ends with the refusal.
    a.store.revoke_cluster("east").unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the agent kept running after its token was revoked")
        .unwrap();
    let err = outcome
        .expect_err("a revoked agent ended cleanly")
        .to_string();
    assert!(err.contains("refused"), "{err}");
    assert!(!has_agent(&b, "east"));
    let err = through(&b, "east", app).await.unwrap_err();
    assert!(err.contains("east"), "{err}");
    stop.cancel();
}

/// The agent finds replicas by resolving the hub's name again: one that appears gets a session,
/// one gone from the name for three resolutions loses it (though it still runs), and a lookup
/// that fails changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_come_and_go_are_found_by_resolving_again() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = two_hubs(&dir.path().join("hub.db")).await;
    let listed: Arc<Mutex<Vec<SocketAddr>>> = Arc::new(Mutex::new(vec![a.tunnel]));
    let resolver: Resolver = {
        let listed = listed.clone();
        Arc::new(move |name: String| {
            assert_eq!(name, "hub.test:8443");
            let now = listed.lock().unwrap().clone();
            Box::pin(async move {
                if now.is_empty() {
                    Err(std::io::Error::other("no such name"))
                } else {
                    Ok(now)
                }
            })
        })
    };
    let pool = pool(vec!["hub.test:8443".into()], agent_client(&a, "east")).with_resolver(resolver);
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { pool.run(stop).await }
    });
    wait_for("a session with A", Duration::from_secs(20), || {
        has_agent(&a, "east")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !has_agent(&b, "east"),
        "B got a session before the name listed it"
    );

    listed.lock().unwrap().push(b.tunnel);
    wait_for(
        "a session with B once listed",
        Duration::from_secs(20),
        || has_agent(&b, "east"),
    )
    .await;

    *listed.lock().unwrap() = vec![b.tunnel];
    wait_for(
        "A's session ended once unlisted",
        Duration::from_secs(20),
        || !has_agent(&a, "east"),
    )
    .await;
    assert!(has_agent(&b, "east"));

    // The name stops resolving: the sessions stay.
    listed.lock().unwrap().clear();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(has_agent(&b, "east"), "a failed lookup ended a session");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the pool did not stop")
        .unwrap()
        .unwrap();
}
