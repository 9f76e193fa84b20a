//! The route server with real sidecars and raw gRPC/REST clients: the watch contract, live
//! re-routing, restarts mid-traffic, a stalled watcher, malformed rule files, readiness, and a
//! hostile server sending invalid rules.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use spur_demo_apps::CancellationToken;
use spur_e2e::{AppKind, get, metrics, rule_yaml, sample, sidecar_config, spawn_app};
use spur_proto::routes::routes_client::RoutesClient;
use spur_proto::routes::{self, WatchOp, WorkloadRoutingRulesRequest};
use spur_routeserver::{RouteServer, RouteServerConfig};
use spur_sidecar::{Sidecar, SidecarConfig};

const BOUND: Duration = Duration::from_secs(15);

fn write_atomic(path: &Path, body: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The route server with its binary's small HTTP/2 buffers (a process-wide setting, so every
/// HTTP/2 server of this test process has them): the large initial syncs and rules below must
/// still arrive whole.
fn size_h2_buffers() {
    spur_routeserver::size_h2_buffers();
    assert_eq!(
        h2::server::buffer_capacities(),
        spur_routeserver::H2_BUFFERS
    );
}

async fn start_server(dir: &Path, grpc: SocketAddr) -> RouteServer {
    size_h2_buffers();
    RouteServer::start(RouteServerConfig {
        poll_interval: Duration::from_millis(20),
        grpc_addr: grpc,
        http_addr: "127.0.0.1:0".parse().unwrap(),
        ..RouteServerConfig::new(dir)
    })
    .await
    .unwrap()
}

async fn sidecar_via(app: SocketAddr, routeserver: SocketAddr) -> Sidecar {
    Sidecar::start(SidecarConfig {
        inject_key_file: None,
        kafka: None,
        routeserver: Some(spur_sidecar::RouteServerConn::plain(
            routeserver.to_string(),
        )),
        ..sidecar_config(app)
    })
    .await
    .unwrap()
}

async fn served_by(addr: SocketAddr, key: Option<&str>) -> String {
    let baggage = key.map(|k| format!("sd-routing-key={k}"));
    let headers: Vec<(&str, &str)> = baggage.iter().map(|b| ("baggage", b.as_str())).collect();
    let got = get(addr, "/", &headers).await.unwrap();
    assert_eq!(got.status, 200, "{got:?}");
    got.served_by().to_string()
}

async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + BOUND;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct World {
    apps: CancellationToken,
    baseline: SocketAddr,
    fork: SocketAddr,
    fork2: SocketAddr,
    dir: tempfile::TempDir,
}

impl World {
    async fn new() -> World {
        let apps = CancellationToken::new();
        World {
            baseline: spawn_app(AppKind::Http, "baseline", apps.clone()).await,
            fork: spawn_app(AppKind::Http, "fork", apps.clone()).await,
            fork2: spawn_app(AppKind::Http, "fork2", apps.clone()).await,
            apps,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn rules(&self, file: &str, rules: &[(&str, SocketAddr)]) {
        let body: String = rules
            .iter()
            .map(|(k, d)| rule_yaml(k, self.baseline.port(), *d))
            .collect();
        write_atomic(&self.dir.path().join(file), &body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_follows_the_route_server_and_is_ready_only_after_sync() {
    let w = World::new().await;
    w.rules("rules.yaml", &[("k1", w.fork)]);
    // The sidecar starts before the route server: unready, traffic goes to the app.
    let grpc = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let sidecar = sidecar_via(w.baseline, grpc).await;
    let admin = sidecar.admin_addr.unwrap();
    assert_eq!(get(admin, "/ready", &[]).await.unwrap().status, 503);
    assert_eq!(
        served_by(sidecar.inbound_addr, Some("k1")).await,
        "baseline"
    );

    let server = start_server(w.dir.path(), grpc).await;
    eventually("sidecar ready after SYNCED", async || {
        get(admin, "/ready", &[]).await.unwrap().status == 200
    })
    .await;
    assert_eq!(served_by(sidecar.inbound_addr, Some("k1")).await, "fork");
    assert_eq!(served_by(sidecar.inbound_addr, None).await, "baseline");

    // Editing the rule file re-routes live traffic: REPLACE, ADD, REMOVE all reach the sidecar.
    w.rules("rules.yaml", &[("k1", w.fork2), ("k2", w.fork)]);
    eventually("k1 moved to fork2", async || {
        served_by(sidecar.inbound_addr, Some("k1")).await == "fork2"
    })
    .await;
    assert_eq!(served_by(sidecar.inbound_addr, Some("k2")).await, "fork");
    w.rules("rules.yaml", &[("k2", w.fork)]);
    eventually("k1 removed", async || {
        served_by(sidecar.inbound_addr, Some("k1")).await == "baseline"
    })
    .await;

    let dump = get(admin, "/config_dump", &[]).await.unwrap().json();
    assert_eq!(dump["routingRules"].as_array().unwrap().len(), 1);
    sidecar.shutdown().await;
    server.shutdown().await;
    w.apps.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_server_restart_mid_traffic_keeps_routing_then_converges() {
    let w = World::new().await;
    w.rules("rules.yaml", &[("k1", w.fork)]);
    let server = start_server(w.dir.path(), "127.0.0.1:0".parse().unwrap()).await;
    let grpc = server.grpc_addr;
    let sidecar = sidecar_via(w.baseline, grpc).await;
    let addr = sidecar.inbound_addr;
    eventually("synced", async || {
        served_by(addr, Some("k1")).await == "fork"
    })
    .await;

    // Keyed traffic runs throughout; every request must succeed and reach a fork.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let traffic = {
        let (stop, done) = (stop.clone(), done.clone());
        tokio::spawn(async move {
            let mut seen = BTreeMap::<String, usize>::new();
            for _ in 0..20_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let by = served_by(addr, Some("k1")).await;
                assert!(
                    by == "fork" || by == "fork2",
                    "keyed request reached {by} during the outage"
                );
                *seen.entry(by).or_default() += 1;
                done.fetch_add(1, Ordering::Relaxed);
            }
            seen
        })
    };
    eventually("traffic flowing", async || {
        done.load(Ordering::Relaxed) > 20
    })
    .await;
    server.shutdown().await;
    // While the route server is down the sidecar keeps the last table and stays ready.
    let before = done.load(Ordering::Relaxed);
    eventually("traffic during the outage", async || {
        done.load(Ordering::Relaxed) > before + 50
    })
    .await;
    assert_eq!(
        get(sidecar.admin_addr.unwrap(), "/ready", &[])
            .await
            .unwrap()
            .status,
        200
    );
    // The rules change while it is down; a new server on the same port brings the change.
    w.rules("rules.yaml", &[("k1", w.fork2)]);
    let server = start_server(w.dir.path(), grpc).await;
    eventually("converged after restart", async || {
        served_by(addr, Some("k1")).await == "fork2"
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let seen = tokio::time::timeout(BOUND, traffic).await.unwrap().unwrap();
    assert!(seen.get("fork").copied().unwrap_or(0) > 50, "{seen:?}");
    let m = metrics(sidecar.admin_addr.unwrap()).await;
    assert!(
        sample(&m, "spur_routeserver_reconnects_total") >= 1.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, "spur_requests_total{outcome=\"error\"}"),
        0.0,
        "{m}"
    );
    sidecar.shutdown().await;
    server.shutdown().await;
    w.apps.cancel();
}

fn baseline_filter(name: &str) -> WorkloadRoutingRulesRequest {
    WorkloadRoutingRulesRequest {
        baseline_workload: Some(routes::BaselineWorkload {
            kind: "Deployment".into(),
            namespace: spur_e2e::NAMESPACE.into(),
            name: name.into(),
        }),
        ..Default::default()
    }
}

/// Applies one watch op to a client-side view, checking the stream contract as it goes.
fn apply(
    view: &mut BTreeMap<String, routes::WorkloadRoutingRule>,
    synced: &mut bool,
    op: routes::WorkloadRoutingRuleOp,
) {
    let kind = op.op();
    if kind == WatchOp::Synced {
        assert!(!*synced, "second SYNCED");
        assert!(op.route.is_none());
        *synced = true;
        return;
    }
    let route = op.route.expect("op without a route");
    assert!(
        route.baseline.is_some() && route.destination_sandbox.is_some(),
        "incomplete route: {route:?}"
    );
    if !*synced {
        assert_eq!(kind, WatchOp::Add, "only ADDs before SYNCED");
    }
    let key = route.routing_key.clone();
    match kind {
        WatchOp::Add => assert!(
            view.insert(key, route).is_none(),
            "ADD for a rule the stream already has"
        ),
        WatchOp::Replace => assert!(
            view.insert(key, route).is_some(),
            "REPLACE for a rule the stream never got"
        ),
        WatchOp::Remove => assert!(
            view.remove(&key).is_some(),
            "REMOVE for a rule the stream never got"
        ),
        WatchOp::Synced => unreachable!(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_watcher_does_not_delay_the_others_and_catches_up_coalesced() {
    let w = World::new().await;
    // Rules with 50 destinations each (about 2 KiB on the wire), so 60 rounds of changes are
    // megabytes: more than the stalled stream's HTTP/2 window and the server's send buffer hold.
    let baseline_port = w.baseline.port();
    let many = move |port: u16| -> String {
        (0..40)
            .map(|i| {
                let dests: String = (0..50).map(|j| format!("{{host: d{j}.sandbox-destination.example.svc, port: {port}}},")).collect();
                format!(
                    "- routingKey: k{i}\n  baseline: {{kind: Deployment, namespace: {}, name: {}}}\n  destinationSandbox: {{name: sb}}\n  mappings:\n    - workloadPort: {baseline_port}\n      destinations: [{}]\n",
                    spur_e2e::NAMESPACE,
                    spur_e2e::BASELINE_NAME,
                    dests.trim_end_matches(',')
                )
            })
            .collect()
    };
    write_atomic(&w.dir.path().join("rules.yaml"), &many(1000));
    size_h2_buffers();
    let server = RouteServer::start(RouteServerConfig {
        poll_interval: Duration::from_millis(5),
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        watch_buffer: 4,
        ..RouteServerConfig::new(w.dir.path())
    })
    .await
    .unwrap();
    let url = format!("http://{}", server.grpc_addr);

    // The stalled watcher opens its stream with HTTP/2's standard 64 KiB windows and then reads
    // nothing.
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .unwrap()
        .initial_stream_window_size(Some(65_535))
        .initial_connection_window_size(Some(65_535))
        .connect()
        .await
        .unwrap();
    let mut stalled = RoutesClient::new(channel);
    let mut stalled_stream = stalled
        .watch_workload_routing_rules(baseline_filter(spur_e2e::BASELINE_NAME))
        .await
        .unwrap()
        .into_inner();
    // A healthy watcher reads everything.
    let mut healthy = RoutesClient::connect(url.clone()).await.unwrap();
    let mut healthy_stream = healthy
        .watch_workload_routing_rules(baseline_filter(spur_e2e::BASELINE_NAME))
        .await
        .unwrap()
        .into_inner();
    let mut view = BTreeMap::new();
    let mut synced = false;
    while !synced {
        let op = tokio::time::timeout(BOUND, healthy_stream.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        apply(&mut view, &mut synced, op);
    }
    assert_eq!(view.len(), 40);

    // 60 rewrites of all 40 rules: 2 400 REPLACEs, far more than the stalled stream can buffer.
    let mut total_ops = 0;
    for round in 1..=60u16 {
        write_atomic(&w.dir.path().join("rules.yaml"), &many(1000 + round));
        total_ops += 40;
        // The healthy watcher keeps up with each round while the other one is stalled.
        let deadline = tokio::time::Instant::now() + BOUND;
        while view
            .values()
            .any(|r| r.mappings[0].destinations[0].port != u32::from(1000 + round))
        {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let op = tokio::time::timeout(left, healthy_stream.message())
                .await
                .expect("healthy watcher starved")
                .unwrap()
                .unwrap();
            apply(&mut view, &mut synced, op);
        }
    }

    // The stalled watcher now reads: a valid stream that converges to the final state, with the
    // intermediate states coalesced away.
    let mut stalled_view = BTreeMap::new();
    let mut stalled_synced = false;
    let mut received = 0;
    let deadline = tokio::time::Instant::now() + BOUND;
    while !stalled_synced
        || stalled_view
            .values()
            .any(|r: &routes::WorkloadRoutingRule| r.mappings[0].destinations[0].port != 1060)
        || stalled_view.len() != 40
    {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let op = tokio::time::timeout(left, stalled_stream.message())
            .await
            .expect("stalled watcher never converged")
            .unwrap()
            .unwrap();
        apply(&mut stalled_view, &mut stalled_synced, op);
        received += 1;
    }
    assert!(
        received < 40 + 1 + total_ops,
        "no coalescing: {received} ops for {total_ops} changes"
    );
    drop(stalled_stream);
    server.shutdown().await;
    w.apps.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_contract_filters_and_rest_api() {
    let w = World::new().await;
    let other = |key: &str, name: &str, sandbox: &str| {
        format!(
            "- routingKey: {key}\n  baseline: {{kind: Deployment, namespace: other, name: {name}}}\n  destinationSandbox: {{name: {sandbox}}}\n  mappings:\n    - workloadPort: 80\n      destinations: [{{host: {sandbox}-{name}.other.svc, port: 80}}]\n"
        )
    };
    w.rules("a.yaml", &[("k1", w.fork), ("k2", w.fork2)]);
    write_atomic(
        &w.dir.path().join("b.yaml"),
        &(other("k1", "cart", "sbx") + &other("k9", "cart", "sby")),
    );
    let server = start_server(w.dir.path(), "127.0.0.1:0".parse().unwrap()).await;
    let mut client = RoutesClient::connect(format!("http://{}", server.grpc_addr))
        .await
        .unwrap();

    let get_keys = async |client: &mut RoutesClient<tonic::transport::Channel>,
                          req: WorkloadRoutingRulesRequest| {
        let rules = client
            .get_workload_routing_rules(req)
            .await
            .unwrap()
            .into_inner()
            .routing_rules;
        rules
            .into_iter()
            .map(|r| format!("{}/{}", r.baseline.unwrap().name, r.routing_key))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        get_keys(&mut client, WorkloadRoutingRulesRequest::default())
            .await
            .len(),
        4
    );
    assert_eq!(
        get_keys(&mut client, baseline_filter(spur_e2e::BASELINE_NAME)).await,
        ["app/k1", "app/k2"]
    );
    let by_key = WorkloadRoutingRulesRequest {
        routing_key: "k1".into(),
        ..Default::default()
    };
    // Ordered by baseline (kind, namespace, name), then key: namespace "other" sorts first.
    assert_eq!(get_keys(&mut client, by_key).await, ["cart/k1", "app/k1"]);
    let by_sandbox = WorkloadRoutingRulesRequest {
        destination_sandbox: Some(routes::DestinationSandbox { name: "sby".into() }),
        ..Default::default()
    };
    assert_eq!(get_keys(&mut client, by_sandbox).await, ["cart/k9"]);
    let by_ns = WorkloadRoutingRulesRequest {
        baseline_workload: Some(routes::BaselineWorkload {
            namespace: "other".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(get_keys(&mut client, by_ns).await.len(), 2);
    assert!(
        client
            .get_cluster_services(routes::GetClusterServicesRequest {})
            .await
            .unwrap()
            .into_inner()
            .services
            .is_empty()
    );

    // Watch: ADDs, one SYNCED, then exactly the changes for this baseline.
    let mut stream = client
        .watch_workload_routing_rules(baseline_filter(spur_e2e::BASELINE_NAME))
        .await
        .unwrap()
        .into_inner();
    let mut view = BTreeMap::new();
    let mut synced = false;
    let mut next = async || {
        tokio::time::timeout(BOUND, stream.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
    };
    while !synced {
        apply(&mut view, &mut synced, next().await);
    }
    assert_eq!(view.keys().collect::<Vec<_>>(), ["k1", "k2"]);
    write_atomic(&w.dir.path().join("b.yaml"), &other("k5", "cart", "sbz"));
    w.rules("a.yaml", &[("k1", w.fork2), ("k3", w.fork)]);
    let mut ops = Vec::new();
    while ops.len() < 3 {
        let op = next().await;
        ops.push((op.op(), op.route.as_ref().unwrap().routing_key.clone()));
        apply(&mut view, &mut synced, op);
    }
    ops.sort();
    assert_eq!(
        ops,
        [
            (WatchOp::Add, "k3".into()),
            (WatchOp::Remove, "k2".into()),
            (WatchOp::Replace, "k1".into())
        ]
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), stream.message())
            .await
            .is_err(),
        "ops for another baseline leaked"
    );

    // REST: the same rules in routes-openapi.yaml's JSON, on the new and the old path.
    let http = server.http_addr;
    for path in [
        "/api/v1/workloads/routing-rules",
        "/api/v1/workloads/routes",
    ] {
        let got = get(
            http,
            &format!(
                "{path}?baselineName={}&routingKey=k1",
                spur_e2e::BASELINE_NAME
            ),
            &[],
        )
        .await
        .unwrap();
        let json = got.json();
        let rules = json["routingRules"].as_array().unwrap();
        assert_eq!(rules.len(), 1, "{json}");
        assert_eq!(rules[0]["routingKey"], "k1");
        assert_eq!(rules[0]["destinationSandbox"]["name"], "sb-k1");
        assert_eq!(rules[0]["mappings"][0]["workloadPort"], w.baseline.port());
        assert_eq!(
            rules[0]["mappings"][0]["destinations"][0]["port"],
            w.fork2.port()
        );
    }
    let health = get(http, "/healthz", &[]).await.unwrap();
    assert_eq!(health.status, 200);
    assert_eq!(health.json()["status"], "ok");
    let m = get(http, "/metrics", &[]).await.unwrap().body;
    for series in [
        "spur_routeserver_watchers 1",
        "spur_routeserver_rules 3",
        "spur_routeserver_push_latency_seconds_bucket",
        "spur_routeserver_pushes_total",
    ] {
        assert!(m.contains(series), "missing {series}: {m}");
    }
    server.shutdown().await;
    w.apps.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_watch_streams_ndjson() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let w = World::new().await;
    w.rules("a.yaml", &[("k1", w.fork)]);
    let server = start_server(w.dir.path(), "127.0.0.1:0".parse().unwrap()).await;
    let mut tcp = tokio::net::TcpStream::connect(server.http_addr)
        .await
        .unwrap();
    tcp.write_all(
        b"GET /api/v1/workloads/routing-rules/watch?routingKey=k1 HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await
    .unwrap();
    let mut lines = BufReader::new(tcp).lines();
    let mut json_lines = Vec::new();
    let mut next_json = async || loop {
        let line = tokio::time::timeout(BOUND, lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if line.starts_with('{') {
            return serde_json::from_str::<serde_json::Value>(&line).unwrap();
        }
    };
    json_lines.push(next_json().await);
    json_lines.push(next_json().await);
    assert_eq!(json_lines[0]["op"], "ADD");
    assert_eq!(json_lines[0]["route"]["routingKey"], "k1");
    assert_eq!(json_lines[1]["op"], "SYNCED");
    w.rules("a.yaml", &[]);
    let removed = next_json().await;
    assert_eq!(removed["op"], "REMOVE");
    assert_eq!(removed["route"]["routingKey"], "k1");
    server.shutdown().await;
    w.apps.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_rule_file_is_reported_and_the_rest_keep_working() {
    let w = World::new().await;
    w.rules("a.yaml", &[("k1", w.fork)]);
    w.rules("b.yaml", &[("k2", w.fork2)]);
    let server = start_server(w.dir.path(), "127.0.0.1:0".parse().unwrap()).await;
    let sidecar = sidecar_via(w.baseline, server.grpc_addr).await;
    let addr = sidecar.inbound_addr;
    eventually("synced", async || {
        served_by(addr, Some("k2")).await == "fork2"
    })
    .await;
    write_atomic(
        &w.dir.path().join("b.yaml"),
        "- routingKey: [this is not a rule",
    );
    write_atomic(
        &w.dir.path().join("c.yaml"),
        &rule_yaml("k3", w.baseline.port(), w.fork),
    );
    eventually("c.yaml served", async || {
        served_by(addr, Some("k3")).await == "fork"
    })
    .await;
    let health = get(server.http_addr, "/healthz", &[]).await.unwrap().json();
    assert_eq!(health["status"], "degraded", "{health}");
    assert!(
        health["problems"][0].as_str().unwrap().contains("b.yaml"),
        "{health}"
    );
    // b.yaml's last valid content stays in force; a.yaml is untouched.
    assert_eq!(served_by(addr, Some("k2")).await, "fork2");
    assert_eq!(served_by(addr, Some("k1")).await, "fork");
    let m = get(server.http_addr, "/metrics", &[]).await.unwrap().body;
    assert!(
        sample(&m, "spur_routeserver_rule_files_invalid") == 1.0,
        "{m}"
    );
    sidecar.shutdown().await;
    server.shutdown().await;
    w.apps.cancel();
}

/// A hostile route server. Its first stream violates the protocol (a REPLACE before SYNCED);
/// the second sends an invalid rule, a rule for another baseline, an op without a rule and one
/// valid rule, then SYNCED.
struct FakeServer {
    good: SocketAddr,
    connections: Arc<AtomicUsize>,
}

type FakeStream = std::pin::Pin<
    Box<
        dyn futures_util::Stream<Item = Result<routes::WorkloadRoutingRuleOp, tonic::Status>>
            + Send,
    >,
>;

#[tonic::async_trait]
impl routes::routes_server::Routes for FakeServer {
    async fn get_workload_routing_rules(
        &self,
        _: tonic::Request<WorkloadRoutingRulesRequest>,
    ) -> Result<tonic::Response<routes::GetWorkloadRoutingRulesResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    type WatchWorkloadRoutingRulesStream = FakeStream;
    async fn watch_workload_routing_rules(
        &self,
        _: tonic::Request<WorkloadRoutingRulesRequest>,
    ) -> Result<tonic::Response<FakeStream>, tonic::Status> {
        let n = self.connections.fetch_add(1, Ordering::SeqCst);
        let port = u32::from(self.good.port());
        let rule =
            |key: &str, name: &str, workload_port: u32, port: u32| routes::WorkloadRoutingRule {
                routing_key: key.into(),
                baseline: Some(routes::BaselineWorkload {
                    kind: "Deployment".into(),
                    namespace: spur_e2e::NAMESPACE.into(),
                    name: name.into(),
                }),
                destination_sandbox: Some(routes::DestinationSandbox { name: "sb".into() }),
                mappings: vec![routes::WorkloadPortMapping {
                    workload_port,
                    destinations: vec![routes::Location {
                        host: "127.0.0.1".into(),
                        port,
                    }],
                }],
            };
        let op = |op: WatchOp, route: Option<routes::WorkloadRoutingRule>| {
            Ok(routes::WorkloadRoutingRuleOp {
                op: op.into(),
                route,
            })
        };
        let ops = if n == 0 {
            vec![op(
                WatchOp::Replace,
                Some(rule("good", spur_e2e::BASELINE_NAME, port, port)),
            )]
        } else {
            vec![
                op(
                    WatchOp::Add,
                    Some(rule("bad", spur_e2e::BASELINE_NAME, port, 0)),
                ),
                op(
                    WatchOp::Add,
                    Some(rule("foreign", "someone-else", 80, port)),
                ),
                op(WatchOp::Add, None),
                op(
                    WatchOp::Add,
                    Some(rule("good", spur_e2e::BASELINE_NAME, port, port)),
                ),
                op(WatchOp::Synced, None),
            ]
        };
        let stream = futures_util::stream::iter(ops).chain(futures_util::stream::pending());
        Ok(tonic::Response::new(Box::pin(stream)))
    }
    async fn get_cluster_services(
        &self,
        _: tonic::Request<routes::GetClusterServicesRequest>,
    ) -> Result<tonic::Response<routes::GetClusterServicesResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
}

use futures_util::StreamExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_rules_from_the_route_server_are_rejected_individually() {
    let w = World::new().await;
    // The fake's "good" rule maps workload port == the fork's port, so the sidecar fronts the
    // fork itself: the rule applies to the port its traffic arrives for.
    let connections = Arc::new(AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc = listener.local_addr().unwrap();
    let fake = FakeServer {
        good: w.fork,
        connections: connections.clone(),
    };
    let stop = CancellationToken::new();
    let server_stop = stop.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(routes::routes_server::RoutesServer::new(fake))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                server_stop.cancelled(),
            )
            .await
            .unwrap();
    });
    let sidecar = sidecar_via(w.fork, grpc).await;
    eventually("synced", async || sidecar.table().load().version >= 1).await;
    let snapshot = sidecar.table().load();
    let keys: Vec<_> = snapshot
        .table
        .rules()
        .iter()
        .map(|r| r.routing_key.as_str())
        .collect();
    assert_eq!(
        keys,
        ["good"],
        "only the valid rule for this baseline is kept"
    );
    let m = metrics(sidecar.admin_addr.unwrap()).await;
    assert_eq!(
        sample(&m, "spur_routeserver_rules_rejected_total"),
        3.0,
        "{m}"
    );
    assert_eq!(served_by(sidecar.inbound_addr, Some("good")).await, "fork");
    assert_eq!(
        connections.load(Ordering::SeqCst),
        2,
        "the protocol violation forced one reconnect"
    );
    assert!(
        sample(&m, "spur_routeserver_reconnects_total") >= 1.0,
        "{m}"
    );
    sidecar.shutdown().await;
    stop.cancel();
    w.apps.cancel();
}

/// The REST port follows the front door's HTTP/1 rules: ambiguous requests get a 400 and the
/// connection closes; a well-formed one is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_refuses_ambiguous_requests_and_closes_the_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let w = World::new().await;
    w.rules("a.yaml", &[("k1", w.fork)]);
    let server = start_server(w.dir.path(), "127.0.0.1:0".parse().unwrap()).await;
    let exchange = async |req: &[u8]| {
        let mut tcp = tokio::net::TcpStream::connect(server.http_addr)
            .await
            .unwrap();
        tcp.write_all(req).await.unwrap();
        let mut out = Vec::new();
        // Read to EOF: the server must close the connection by itself.
        tokio::time::timeout(BOUND, tcp.read_to_end(&mut out))
            .await
            .expect("the connection was closed")
            .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    };
    let path = "/api/v1/workloads/routing-rules";
    for (name, req) in [
        (
            "two Host headers",
            format!("GET {path} HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
        ),
        ("no Host", format!("GET {path} HTTP/1.1\r\n\r\n")),
        (
            "Host against an absolute target",
            format!("GET http://a{path} HTTP/1.1\r\nHost: b\r\n\r\n"),
        ),
        ("bare LF", format!("GET {path} HTTP/1.1\nHost: a\n\n")),
    ] {
        let out = exchange(req.as_bytes()).await;
        assert!(
            out.starts_with("HTTP/1.1 400") || out.is_empty(),
            "{name}: {out:?}"
        );
        assert!(!out.contains("routingRules"), "{name}: {out:?}");
    }
    let ok =
        exchange(format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes())
            .await;
    assert!(
        ok.starts_with("HTTP/1.1 200") && ok.contains("routingRules"),
        "{ok:?}"
    );
    server.shutdown().await;
    w.apps.cancel();
}

/// The patched h2's small server buffers (`vendor/h2`) over I/O without vectored writes (an
/// in-memory pipe): h2 then needs 1 033 free bytes in an empty write buffer, more than the
/// route server's 1 KiB; a buffer that started smaller could never take a frame and the
/// connection would hang. A large response header and a body larger than both buffers must
/// arrive whole, and a large request header must be read.
#[tokio::test]
async fn small_h2_buffers_serve_io_without_vectored_writes() {
    size_h2_buffers();
    let (client_io, server_io) = tokio::io::duplex(16 * 1024);
    let server_io = Plain(server_io);
    assert!(!tokio::io::AsyncWrite::is_write_vectored(&server_io));
    let server = tokio::spawn(async move {
        let mut conn = h2::server::handshake(server_io).await.unwrap();
        let (request, mut respond) = conn.accept().await.unwrap().unwrap();
        let asked = request.headers()["x-big"].len();
        let response = http::Response::builder()
            .header("x-big", "r".repeat(asked))
            .body(())
            .unwrap();
        let mut body = respond.send_response(response, false).unwrap();
        body.send_data(bytes::Bytes::from(vec![b'x'; 40_000]), true)
            .unwrap();
        // Drive the connection until the client goes.
        while conn.accept().await.is_some() {}
    });
    let exchange = async {
        let (mut client, conn) = h2::client::handshake(client_io).await.unwrap();
        tokio::spawn(conn);
        let request = http::Request::builder()
            .uri("http://routeserver/")
            .header("x-big", "q".repeat(6000))
            .body(())
            .unwrap();
        let (response, _) = client.send_request(request, true).unwrap();
        let response = response.await.unwrap();
        assert_eq!(response.headers()["x-big"].len(), 6000);
        let mut body = response.into_body();
        let mut got = 0;
        while let Some(chunk) = body.data().await {
            let chunk = chunk.unwrap();
            got += chunk.len();
            body.flow_control().release_capacity(chunk.len()).unwrap();
        }
        got
    };
    let got = tokio::time::timeout(Duration::from_secs(20), exchange)
        .await
        .expect("the exchange over small h2 buffers must not hang");
    assert_eq!(got, 40_000);
    server.abort();
}

/// An in-memory pipe that does not offer vectored writes (`is_write_vectored` is false).
struct Plain(tokio::io::DuplexStream);

impl tokio::io::AsyncRead for Plain {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Plain {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
