//! xDS push latency to N real grpc-go clients, side by side with the Routes API push to N watch
//! streams in the same run, and the route server's memory across many ADS streams opened and
//! dropped.
//!
//! Setup: kube-apiserver + etcd (tests/kube-harness), the CRDs, a baseline Service `api` and a
//! sandbox Service, and the route server (Kubernetes store, xDS on) in this process. N proxyless
//! clients are grpc-go's own xDS clients (`tests/go-xds`, `xds-client -clients`), at most 250 per
//! process, each with its own node id and ADS stream, subscribed to `xds:///api.bench.svc:80`.
//! The N Routes API watchers are gRPC `WatchWorkloadRoutingRules` streams of the baseline, one
//! connection each, in this process. Both ports are plaintext here (TLS costs the same on both
//! and only at connection time). The Services have no endpoints, so no client sends traffic.
//!
//! A change is a sandbox's route appearing in its RoutingConfig's status (the operator's last
//! write when a sandbox becomes ready). It is timed from just before that API call to:
//! - xDS: the last of the N clients ACKing the new route configuration version (polled every
//!   millisecond from the server's node registry: an ACK is sent once grpc-go has validated and
//!   applied the update);
//! - Routes API: the last of the N watchers receiving the new rule.
//!
//! Memory: `SPUR_BENCH_STREAMS` (default 10 000) ADS streams, 100 at a time, each with an
//! unknown node id, subscribing to a listener, reading the response and then (half of them)
//! ACKing or (the other half) never answering before being dropped; this process's RSS after a
//! warm-up of 1 000 and after all of them.
//!
//! Writes `perf/results/xds_push.md`. Run: `cargo bench -p spur-perf --bench xds_push` (needs Go
//! for tests/go and tests/kube). Without `--bench` (as `cargo test --benches` runs it) it does a
//! smoke run (4 clients, 2 changes, 200 streams) and writes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use hdrhistogram::Histogram;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use spur_api::RoutingConfig;
use spur_kube_harness::KubeApi;
use spur_perf::params::env_usize;
use spur_proto::routes::routes_client::RoutesClient;
use spur_proto::routes::{BaselineWorkload, WatchOp, WorkloadRoutingRulesRequest};
use spur_routeserver::{KubeStore, RouteServer, RouteServerConfig, XdsConfig};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

const NS: &str = "bench";
const CLIENTS_PER_PROCESS: usize = 250;
const WAIT: Duration = Duration::from_secs(300);

fn main() -> Result<()> {
    let full = std::env::args().any(|a| a == "--bench");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(full))
}

async fn run(full: bool) -> Result<()> {
    let (sizes, changes, streams) = if full {
        (
            vec![100, 1000],
            env_usize("SPUR_BENCH_CHANGES", 20),
            env_usize("SPUR_BENCH_STREAMS", 10_000),
        )
    } else {
        (vec![4], 2, 200)
    };
    let api = KubeApi::start().await?;
    spur_e2e::kube::install_crds(&api).await?;
    let client = api.client();
    let version = client.apiserver_version().await?.git_version;
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}}))?,
        )
        .await?;
    for name in ["api", "sb-api"] {
        service(&client, name).await?;
    }
    let server = RouteServer::start_with(
        RouteServerConfig {
            grpc_addr: "127.0.0.1:0".parse()?,
            http_addr: "127.0.0.1:0".parse()?,
            xds: Some(XdsConfig {
                addr: "127.0.0.1:0".parse()?,
                ..XdsConfig::new(None)
            }),
            ..RouteServerConfig::new("")
        },
        KubeStore::new(client.clone()).with_xds(),
    )
    .await?;
    let xds_addr = server.xds_addr.context("no xDS port")?;
    let dir = tempfile::tempdir()?;
    let bootstrap = dir.path().join("bootstrap.json");
    std::fs::write(
        &bootstrap,
        json!({
            "xds_servers": [{"server_uri": xds_addr.to_string(),
                             "channel_creds": [{"type": "insecure"}],
                             "server_features": ["xds_v3"]}],
            "node": {"id": "bench"},
        })
        .to_string(),
    )?;

    let mut rows = Vec::new();
    for &n in &sizes {
        rows.push(push_round(&client, &server, &bootstrap, n, changes).await?);
    }
    let memory = stream_churn(xds_addr, streams).await?;
    let nodes_left = server.xds_nodes().len();
    server.shutdown().await;

    let mut out = String::new();
    writeln!(
        out,
        "# xDS push latency vs the Routes API, and ADS stream churn\n\n\
         `cargo bench -p spur-perf --bench xds_push` on {} ({}), kube-apiserver {version}, \
         {changes} changes per row. Setup and method: the header of `perf/benches/xds_push.rs`.\n\n\
         Time from the RoutingConfig status write that adds a sandbox's route to the last of N \
         clients having it (ms):\n\n\
         | N | xDS queued on every stream p50 | p90 | xDS ACKed by every grpc-go client p50 | p90 | max | Routes API watch p50 | p90 | max |\n\
         |---|---|---|---|---|---|---|---|---|",
        hostname(),
        cpus()
    )?;
    for r in &rows {
        writeln!(out, "{r}")?;
    }
    writeln!(
        out,
        "\nADS stream churn: {} streams (unknown node ids; half ACK, half never answer), 100 at a \
         time. RSS of the process holding the route server: {:.1} MiB after a warm-up of {}, \
         {:.1} MiB after all ({:+.1} MiB); {} streams left in the node registry afterwards.",
        memory.streams,
        memory.warm_rss_mib,
        memory.warmup,
        memory.end_rss_mib,
        memory.end_rss_mib - memory.warm_rss_mib,
        nodes_left
    )?;
    print!("{out}");
    if full {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/xds_push.md");
        std::fs::write(&path, &out).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if nodes_left != 0 {
        bail!("{nodes_left} node registry entries outlived their streams");
    }
    Ok(())
}

async fn service(client: &Client, name: &str) -> Result<()> {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [{"name": "grpc", "port": 80}]},
    }))?;
    Api::<Service>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &svc)
        .await?;
    // No endpoints: nothing is ever dialled.
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": format!("{name}-x"), "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "ports": [{"name": "grpc", "port": 8080}],
        "endpoints": [],
    }))?;
    Api::<EndpointSlice>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &slice)
        .await?;
    Ok(())
}

/// One row: N clients of each kind, `changes` sandboxes added one after another.
async fn push_round(
    client: &Client,
    server: &RouteServer,
    bootstrap: &Path,
    n: usize,
    changes: usize,
) -> Result<String> {
    let prefix = format!("n{n}");
    // grpc-go clients, at most CLIENTS_PER_PROCESS per process.
    let mut procs = Vec::new();
    let mut left = n;
    let mut i = 0;
    while left > 0 {
        let k = left.min(CLIENTS_PER_PROCESS);
        let mut child = tokio::process::Command::new(spur_e2e::go_bin_dir().join("xds-client"))
            .args(["-clients", &k.to_string(), "-node-prefix"])
            .arg(format!("{prefix}p{i}"))
            .arg("-bootstrap")
            .arg(bootstrap)
            .args(["-target", &format!("xds:///api.{NS}.svc:80")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting xds-client")?;
        let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
        let first = tokio::time::timeout(WAIT, lines.next_line()).await??;
        if first.as_deref() != Some("ready") {
            bail!("xds-client said {first:?}");
        }
        procs.push(child);
        left -= k;
        i += 1;
    }
    let ours = |id: &str| id.starts_with(&prefix);
    let rds = |field: fn(&spur_routeserver::xds::TypeStatus) -> Option<&String>| {
        server
            .xds_nodes()
            .into_iter()
            .filter(|s| ours(&s.node_id))
            .filter_map(|s| Some((s.node_id.clone(), field(s.types.get("rds")?)?.clone())))
            .collect::<HashMap<String, String>>()
    };
    let rds_acked = || rds(|t| t.acked.as_ref());
    let rds_sent = || rds(|t| t.sent.as_ref());
    wait_for(&format!("{n} xDS clients subscribed"), || {
        (rds_acked().len() == n).then_some(())
    })
    .await?;

    // Routes API watchers: each reports when it receives a rule for a key.
    let (tx, mut rx) = mpsc::unbounded_channel::<(String, Instant)>();
    let (synced_tx, mut synced_rx) = mpsc::unbounded_channel::<()>();
    let mut watchers = Vec::new();
    for _ in 0..n {
        let channel =
            tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc_addr))?
                .connect()
                .await?;
        let mut c = RoutesClient::new(channel);
        let mut stream = c
            .watch_workload_routing_rules(WorkloadRoutingRulesRequest {
                baseline_workload: Some(BaselineWorkload {
                    kind: "Deployment".into(),
                    namespace: NS.into(),
                    name: "api".into(),
                }),
                ..Default::default()
            })
            .await?
            .into_inner();
        let (tx, synced_tx) = (tx.clone(), synced_tx.clone());
        watchers.push(tokio::spawn(async move {
            while let Ok(Some(op)) = stream.message().await {
                let at = Instant::now();
                if op.op() == WatchOp::Synced {
                    let _ = synced_tx.send(());
                } else if let Some(r) = op.route {
                    let _ = tx.send((r.routing_key, at));
                }
            }
        }));
    }
    for _ in 0..n {
        tokio::time::timeout(WAIT, synced_rx.recv())
            .await?
            .context("a watcher ended before SYNCED")?;
    }

    let rcs: Api<RoutingConfig> = Api::all(client.clone());
    let mut xds = Histogram::<u64>::new(3)?;
    let mut sent = Histogram::<u64>::new(3)?;
    let mut routes = Histogram::<u64>::new(3)?;
    for c in 0..changes {
        let key = format!("{prefix}c{c}");
        let rc: RoutingConfig = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "RoutingConfig",
            "metadata": {"name": key}, "spec": {"routingKey": key}
        }))?;
        rcs.create(&PostParams::default(), &rc).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = rds_acked();
        let before_sent = rds_sent();
        let route = json!({
            "fromHost": format!("api.{NS}.svc"), "fromPort": 80,
            "toHost": format!("sb-api.{NS}.svc"), "toPort": 80, "workloadPort": 8080,
            "sandbox": key, "baseline": {"kind": "Deployment", "namespace": NS, "name": "api"},
        });
        let t0 = Instant::now();
        rcs.patch_status(
            &key,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"routeServer": {"routes": [route]}}})),
        )
        .await?;
        let what = format!("{n} xDS clients ACKing change {c}");
        let xds_done = async {
            // The server's share: the new version queued on every stream.
            let sent_at = wait_for(&what, || {
                let now = rds_sent();
                (now.len() == n && now.iter().all(|(id, v)| before_sent.get(id) != Some(v)))
                    .then(Instant::now)
            })
            .await?;
            let acked_at = wait_for(&what, || {
                let now = rds_acked();
                (now.len() == n && now.iter().all(|(id, v)| before.get(id) != Some(v)))
                    .then(Instant::now)
            })
            .await?;
            anyhow::Ok((sent_at, acked_at))
        };
        let routes_done = async {
            let mut got = 0;
            let mut last = t0;
            while got < n {
                let (k, at) = tokio::time::timeout(WAIT, rx.recv())
                    .await?
                    .context("watchers gone")?;
                if k == key {
                    got += 1;
                    last = last.max(at);
                }
            }
            anyhow::Ok(last)
        };
        let (x, r) = tokio::join!(xds_done, routes_done);
        let (sent_at, acked_at) = x?;
        sent.record(sent_at.duration_since(t0).as_micros() as u64)?;
        xds.record(acked_at.duration_since(t0).as_micros() as u64)?;
        routes.record(r?.duration_since(t0).as_micros() as u64)?;
    }
    for mut p in procs {
        if let Some(mut stdin) = p.stdin.take() {
            let _ = stdin.write_all(b"quit\n").await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(30), p.wait()).await;
    }
    for w in watchers {
        w.abort();
    }
    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    Ok(format!(
        "| {n} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
        ms(&sent, 0.5),
        ms(&sent, 0.9),
        ms(&xds, 0.5),
        ms(&xds, 0.9),
        ms(&xds, 1.0),
        ms(&routes, 0.5),
        ms(&routes, 0.9),
        ms(&routes, 1.0)
    ))
}

/// Polls `check` every millisecond for up to [`WAIT`].
async fn wait_for<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> Result<T> {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = check() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

struct Churn {
    streams: usize,
    warmup: usize,
    warm_rss_mib: f64,
    end_rss_mib: f64,
}

fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// `total` ADS streams, 100 at a time over 10 connections.
async fn stream_churn(addr: std::net::SocketAddr, total: usize) -> Result<Churn> {
    let mut clients = Vec::new();
    for _ in 0..10 {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        clients.push(AggregatedDiscoveryServiceClient::new(channel));
    }
    let warmup = (total / 10).max(1);
    let mut warm_rss = 0.0;
    let mut done = 0;
    while done < total {
        let batch = (total - done).min(100);
        let mut tasks = Vec::with_capacity(batch);
        for j in 0..batch {
            let mut c = clients[j % clients.len()].clone();
            let id = done + j;
            tasks.push(tokio::spawn(async move {
                let (tx, rx) = mpsc::channel::<DiscoveryRequest>(2);
                let req = |nonce: String| DiscoveryRequest {
                    node: Some(Node {
                        id: format!("churn-{id}"),
                        ..Default::default()
                    }),
                    type_url: "type.googleapis.com/envoy.config.listener.v3.Listener".into(),
                    resource_names: vec![format!("api.{NS}.svc:80")],
                    response_nonce: nonce,
                    ..Default::default()
                };
                tx.send(req(String::new())).await?;
                let mut responses = c
                    .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                let r = tokio::time::timeout(Duration::from_secs(30), responses.message())
                    .await??
                    .context("no response")?;
                if id % 2 == 0 {
                    tx.send(req(r.nonce)).await?;
                }
                anyhow::Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        done += batch;
        if warm_rss == 0.0 && done >= warmup {
            warm_rss = settle_rss().await;
        }
    }
    Ok(Churn {
        streams: total,
        warmup,
        warm_rss_mib: warm_rss,
        end_rss_mib: settle_rss().await,
    })
}

/// RSS once the streams just dropped have been cleaned up.
async fn settle_rss() -> f64 {
    tokio::time::sleep(Duration::from_millis(500)).await;
    rss_mib()
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".into())
}

fn cpus() -> String {
    format!(
        "{} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    )
}
