//! The Traffic service over a real loopback gRPC server with a static token: what a sidecar
//! and the CLI see.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use prometheus_client::registry::Registry;
use spur_proto::traffic::traffic_client::TrafficClient;
use spur_proto::traffic::{
    Exchange, Filter, PushRequest, QueryRequest, TailRequest, WatchSettingsRequest, Workload,
    tail_event,
};
use spur_traffic::{
    Authorizer, Limits, Server, SettingsIndex, SettingsSource, TrafficServerConfig,
};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Code, Request};

const TOKEN: &str = "test-token";
/// Bound on every wait in these tests.
const WAIT: Duration = Duration::from_secs(10);

const SETTINGS: &str = "
redactHeaders: [x-api-key]
sandboxes:
  - name: sb1
    routingKey: k1
    workloads: [{kind: Deployment, namespace: default, name: backend}]
";

struct Harness {
    addr: SocketAddr,
    stop: CancellationToken,
    server: JoinHandle<Result<(), spur_traffic::Error>>,
    registry: Registry,
    settings_path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Harness {
    async fn start() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let settings_path = dir.path().join("settings.yaml");
        std::fs::write(&settings_path, SETTINGS).unwrap();
        let config = TrafficServerConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            db: Some(dir.path().join("traffic.db")),
            limits: Limits::default(),
            tls: None,
            settings: SettingsSource::File(settings_path.clone()),
            auth: Authorizer::static_token(TOKEN).unwrap(),
        };
        let mut registry = Registry::default();
        let server = Server::bind(config, SettingsIndex::default(), &mut registry)
            .await
            .unwrap();
        let addr = server.local_addr();
        let stop = CancellationToken::new();
        let server = tokio::spawn(server.run(stop.clone()));
        Harness {
            addr,
            stop,
            server,
            registry,
            settings_path,
            _dir: dir,
        }
    }

    async fn client(&self) -> TrafficClient<Channel> {
        let channel = timeout(
            WAIT,
            tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))
                .unwrap()
                .connect(),
        )
        .await
        .unwrap()
        .unwrap();
        TrafficClient::new(channel).max_decoding_message_size(spur_traffic::MAX_MESSAGE_BYTES)
    }

    fn metrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).unwrap();
        out
    }

    async fn stop(self) {
        self.stop.cancel();
        let served = timeout(WAIT * 3, self.server).await.unwrap().unwrap();
        served.unwrap();
    }
}

fn authed<T>(msg: T) -> Request<T> {
    with_token(msg, Some(TOKEN))
}

fn with_token<T>(msg: T, token: Option<&str>) -> Request<T> {
    let mut req = Request::new(msg);
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    req
}

fn backend() -> Workload {
    Workload {
        kind: "Deployment".into(),
        namespace: "default".into(),
        name: "backend".into(),
    }
}

fn exchange(id: &str, sandbox: &str, start: i64) -> Exchange {
    Exchange {
        id: id.into(),
        baseline: Some(backend()),
        pod: "backend-1".into(),
        sandbox: sandbox.into(),
        routing_key: "k1".into(),
        destination: "fork:8080".into(),
        method: "GET".into(),
        path: format!("/items/{id}"),
        status: 200,
        start_unix_micros: start,
        ..Exchange::default()
    }
}

fn push(exchanges: Vec<Exchange>, dropped: u64) -> PushRequest {
    PushRequest { exchanges, dropped }
}

fn metric_line<'a>(metrics: &'a str, name: &str) -> Option<&'a str> {
    metrics.lines().find(|l| l.starts_with(name))
}

#[tokio::test]
async fn push_then_query() {
    let h = Harness::start().await;
    let mut c = h.client().await;
    let batch = vec![exchange("a", "sb1", 1), exchange("b", "sb1", 2)];
    let reply = c.push(authed(push(batch.clone(), 3))).await.unwrap();
    assert_eq!(reply.get_ref().stored, 2);
    // A retried push is not stored twice.
    let reply = c.push(authed(push(batch, 0))).await.unwrap();
    assert_eq!(reply.get_ref().stored, 0);
    c.push(authed(push(vec![exchange("c", "sb2", 3)], 0)))
        .await
        .unwrap();

    let got = c
        .query(authed(QueryRequest {
            filter: Some(Filter {
                sandbox: "sb1".into(),
                ..Filter::default()
            }),
            limit: 0,
            without_bodies: false,
        }))
        .await
        .unwrap()
        .into_inner()
        .exchanges;
    let ids: Vec<&str> = got
        .iter()
        .map(|s| s.exchange.as_ref().unwrap().path.as_str())
        .collect();
    assert_eq!(ids, ["/items/b", "/items/a"]);
    // Stored as pushed, under the store's own id (a number; the pusher's is not kept).
    let stored = got[0].exchange.as_ref().unwrap();
    assert!(stored.id.parse::<u64>().is_ok(), "{stored:?}");
    assert_eq!(
        stored,
        &Exchange {
            id: stored.id.clone(),
            ..exchange("b", "sb1", 2)
        },
        "stored as pushed"
    );

    // Without bodies: the heads as stored, every body's bytes left out (its size kept).
    let mut with_body = exchange("d", "sb3", 4);
    with_body.response_body = Some(spur_proto::traffic::Body {
        size: 5,
        data: b"hello".to_vec(),
        truncated: false,
    });
    c.push(authed(push(vec![with_body], 0))).await.unwrap();
    let heads = c
        .query(authed(QueryRequest {
            filter: Some(Filter {
                sandbox: "sb3".into(),
                ..Filter::default()
            }),
            limit: 0,
            without_bodies: true,
        }))
        .await
        .unwrap()
        .into_inner()
        .exchanges;
    let body = heads[0]
        .exchange
        .as_ref()
        .unwrap()
        .response_body
        .clone()
        .unwrap();
    assert_eq!((body.size, body.data.len(), body.truncated), (5, 0, true));

    let err = c
        .query(authed(QueryRequest {
            filter: Some(Filter {
                routed: 42,
                ..Filter::default()
            }),
            limit: 0,
            without_bodies: false,
        }))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    let m = h.metrics();
    assert_eq!(
        metric_line(&m, "spur_traffic_exchanges_stored_total"),
        Some("spur_traffic_exchanges_stored_total 4")
    );
    assert_eq!(
        metric_line(&m, "spur_traffic_sidecar_dropped_total"),
        Some("spur_traffic_sidecar_dropped_total 3")
    );
    assert_eq!(
        metric_line(&m, "spur_traffic_pushes_total"),
        Some("spur_traffic_pushes_total 4")
    );
    assert_eq!(
        metric_line(&m, "spur_traffic_store_exchanges"),
        Some("spur_traffic_store_exchanges 4")
    );
    assert!(m.contains("spur_traffic_retention_dropped_total 0"), "{m}");
    h.stop().await;
}

#[tokio::test]
async fn tail_sees_matching_exchanges_as_they_are_stored() {
    let h = Harness::start().await;
    let mut c = h.client().await;
    c.push(authed(push(vec![exchange("before", "sb1", 1)], 0)))
        .await
        .unwrap();
    let mut tail = c
        .tail(authed(TailRequest {
            filter: Some(Filter {
                sandbox: "sb1".into(),
                ..Filter::default()
            }),
        }))
        .await
        .unwrap()
        .into_inner();
    c.push(authed(push(
        vec![exchange("other", "sb2", 2), exchange("mine", "sb1", 3)],
        0,
    )))
    .await
    .unwrap();
    let event = timeout(WAIT, tail.message())
        .await
        .expect("a tailed exchange within the bound")
        .unwrap()
        .unwrap();
    match event.event {
        Some(tail_event::Event::Exchange(s)) => {
            assert_eq!(s.exchange.unwrap().path, "/items/mine");
            assert!(s.stored_unix_micros > 0);
        }
        other => panic!("expected an exchange, got {other:?}"),
    }
    assert!(
        h.metrics().contains("spur_traffic_tail_subscribers 1"),
        "{}",
        h.metrics()
    );
    // Draining ends the open stream, and the server stops.
    let stop = h.stop.clone();
    let server = h.server;
    stop.cancel();
    let end = timeout(WAIT, tail.message()).await.unwrap();
    assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
    timeout(WAIT * 3, server).await.unwrap().unwrap().unwrap();
}

#[tokio::test]
async fn a_missing_or_wrong_token_is_refused() {
    let h = Harness::start().await;
    let mut c = h.client().await;
    for token in [None, Some("wrong"), Some("test-toke")] {
        let e = c
            .push(with_token(push(vec![exchange("x", "sb1", 1)], 0), token))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{token:?}");
        let e = c
            .query(with_token(QueryRequest::default(), token))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{token:?}");
        let e = c
            .tail(with_token(TailRequest::default(), token))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{token:?}");
        let e = c
            .watch_settings(with_token(
                WatchSettingsRequest {
                    baseline: Some(backend()),
                },
                token,
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{token:?}");
    }
    let got = c.query(authed(QueryRequest::default())).await.unwrap();
    assert!(got.get_ref().exchanges.is_empty(), "nothing was stored");
    h.stop().await;
}

#[tokio::test]
async fn a_batch_over_the_limit_or_without_baselines_is_refused() {
    let h = Harness::start().await;
    let mut c = h.client().await;
    let too_many: Vec<Exchange> = (0..=spur_traffic::MAX_BATCH)
        .map(|i| exchange(&format!("e{i}"), "sb1", i as i64))
        .collect();
    let e = c.push(authed(push(too_many, 0))).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let mut orphan = exchange("orphan", "sb1", 1);
    orphan.baseline = None;
    let e = c
        .push(authed(push(vec![exchange("fine", "sb1", 1), orphan], 0)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c
        .push(authed(push(vec![exchange("", "sb1", 1)], 0)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let got = c.query(authed(QueryRequest::default())).await.unwrap();
    assert!(got.get_ref().exchanges.is_empty(), "nothing was stored");
    // Exactly the limit is fine.
    let full: Vec<Exchange> = (0..spur_traffic::MAX_BATCH)
        .map(|i| exchange(&format!("e{i}"), "sb1", i as i64))
        .collect();
    let reply = c.push(authed(push(full, 0))).await.unwrap();
    assert_eq!(reply.get_ref().stored as usize, spur_traffic::MAX_BATCH);
    h.stop().await;
}

async fn write_atomically(path: &Path, content: &str) {
    let tmp = path.with_extension("tmp");
    tokio::fs::write(&tmp, content).await.unwrap();
    tokio::fs::rename(&tmp, path).await.unwrap();
}

#[tokio::test]
async fn watch_settings_sends_the_file_then_its_changes() {
    let h = Harness::start().await;
    let mut c = h.client().await;
    let mut watch = c
        .watch_settings(authed(WatchSettingsRequest {
            baseline: Some(backend()),
        }))
        .await
        .unwrap()
        .into_inner();
    let first = timeout(WAIT, watch.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let keys: Vec<(&str, &str)> = first
        .keys
        .iter()
        .map(|k| (k.routing_key.as_str(), k.sandbox.as_str()))
        .collect();
    assert_eq!(keys, [("k1", "sb1")]);
    assert_eq!(
        first.redact_headers,
        [
            "authorization",
            "proxy-authorization",
            "cookie",
            "set-cookie",
            "x-api-key"
        ]
    );
    assert_eq!(first.max_body_bytes, spur_traffic::DEFAULT_MAX_BODY_BYTES);

    // An invalid edit keeps the last good settings: nothing is sent.
    write_atomically(&h.settings_path, "maxBodyBytes: 99999999\n").await;
    assert!(
        timeout(Duration::from_millis(2500), watch.message())
            .await
            .is_err(),
        "an invalid file must not change the settings"
    );

    let edited = SETTINGS.replace("routingKey: k1", "routingKey: k2");
    write_atomically(&h.settings_path, &edited).await;
    let next = timeout(WAIT, watch.message())
        .await
        .expect("new settings within the bound")
        .unwrap()
        .unwrap();
    assert_eq!(next.keys.len(), 1);
    assert_eq!(next.keys[0].routing_key, "k2");

    // A baseline the file does not list captures nothing.
    let mut other = c
        .watch_settings(authed(WatchSettingsRequest {
            baseline: Some(Workload {
                name: "unlisted".into(),
                ..backend()
            }),
        }))
        .await
        .unwrap()
        .into_inner();
    let s = timeout(WAIT, other.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(s.keys.is_empty());

    let e = c
        .watch_settings(authed(WatchSettingsRequest { baseline: None }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c
        .watch_settings(authed(WatchSettingsRequest {
            baseline: Some(Workload {
                kind: String::new(),
                ..backend()
            }),
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    h.stop().await;
}
