//! Hub replicas (issue 47): two hubs share one registry, a cluster's agent keeps a session with
//! each, either reaches the cluster, one going away leaves the other serving, and a token
//! revoked through one replica is refused by every replica.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use spur_hub::Store;
use spur_hub::agent::Scope;
use spur_hub::agent::pool::{HubPool, PoolSettings};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_serves_every_hub_replica_and_a_revocation_reaches_all() {
    // Two replicas on one registry (a SQLite file opened twice stands in for PostgreSQL here;
    // tests/store_postgres.rs runs the store itself on a real server).
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("hub.db");
    let a = start_hub_on(
        Store::open(&db).unwrap(),
        settings(ListenerLimits::default()),
        |_| {},
    )
    .await;
    let b = start_hub_on(
        Store::open(&db).unwrap(),
        settings(ListenerLimits::default()),
        |_| {},
    )
    .await;
    assert_eq!(a.ca_pem, b.ca_pem, "the replicas made two CAs");

    let client = agent_client(&a, "east");
    let mut registry = prometheus_client::registry::Registry::default();
    let pool = HubPool::new(
        PoolSettings {
            hubs: vec![a.tunnel.to_string(), b.tunnel.to_string()],
            resolve_every: Duration::from_millis(100),
        },
        client,
        None,
        Scope {
            target_suffixes: vec!["localhost".into()],
            addresses: AddressPolicy {
                allow_cidrs: vec!["127.0.0.0/8".parse().unwrap()],
            },
            ..Scope::default()
        },
        None,
        &mut registry,
    )
    .unwrap();
    let ready = pool.ready();
    assert!(!ready(), "ready before any session");
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { pool.run(stop).await }
    });
    wait_for(
        "the agent on both replicas",
        Duration::from_secs(20),
        || has_agent(&a, "east") && has_agent(&b, "east"),
    )
    .await;
    assert!(ready());
    let app = target("app-in-east").await;
    assert_eq!(through(&a, "east", app).await.unwrap(), "app-in-east");
    assert_eq!(through(&b, "east", app).await.unwrap(), "app-in-east");

    // Replica A goes away: B still reaches the cluster, and the agent stays ready.
    a.stop.cancel();
    for _ in 0..20 {
        assert_eq!(through(&b, "east", app).await.unwrap(), "app-in-east");
    }
    assert!(ready(), "one replica gone made the agent unready");

    // Another cluster's agent on B: its session is west's, never east's.
    let west = agent_client(&b, "west");
    let mut r2 = prometheus_client::registry::Registry::default();
    let west_agent = spur_hub::agent::Agent::start(west, None, Scope::default(), &mut r2).unwrap();
    let west_stop = CancellationToken::new();
    tokio::spawn({
        let s = west_stop.clone();
        async move { west_agent.run(s).await }
    });
    wait_for("west's agent", Duration::from_secs(20), || {
        has_agent(&b, "west")
    })
    .await;

    // East is revoked through replica A's store (the CLI on another replica): B ends its
    // session and refuses the token, and the agent stops with the refusal.
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
    assert!(has_agent(&b, "west"), "revoking east ended west's session");
    west_stop.cancel();
    stop.cancel();
}
