//! The Kafka relay's cost (issue 44): records per second and the relay's CPU per 1 000 records
//! for a consumer reading a whole topic directly from a real broker, through the bare relay
//! (`spur_proxy::kafka::relay`, a baseline's session that removes keyed records by a fixed
//! decision) and through the sidecar (`spur_sidecar::Sidecar`, the same assembly the
//! `spur-sidecar` binary runs, deciding each record by the route history it watches from a real
//! route server, with its holds, metrics and rule lookups), per codec, for a topic with no keyed
//! records and one with 10 % keyed.
//!
//! Run with `cargo bench -p spur-perf --bench kafka` (needs what the Kafka tier needs:
//! `docs/testing.md`); it writes `perf/results/kafka.md`. Without `--bench` (as under
//! `cargo test --benches`) it runs a small smoke configuration and writes nothing.
//!
//! - The broker (Apache Kafka 3.9.2, KRaft) runs on loopback; each topic has one partition and
//!   is filled first by the Java producer (`linger.ms=20`, default 16 KiB batches), values of
//!   about 230 bytes, every 10th record carrying `baggage: sd-routing-key=sbx1` in the keyed case.
//! - The consumer is kcat (librdkafka), reading from the beginning to the end without a group,
//!   once directly, once through the bare relay and once through the sidecar, both in this
//!   process. Each is run `ROUNDS` times, the median kept.
//! - The sidecar's Kafka relay runs in explicit mode (`--kafka-broker`: the consumer bootstraps
//!   to it and it advertises itself in place of the broker), as interception would need root and
//!   costs the relay nothing: the kernel redirects the connection once. Its rule sends key
//!   `sbx1` to a sandbox, so it withholds the keyed records as a baseline pod's sidecar does.
//! - The relay's CPU is this process's user+system time during the consumer's run (the process
//!   does nothing else then: the route server's watch is idle), from `/proc/self/stat`.
//!
//! This is a benchmark: nothing here asserts on timing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark with a broken setup should abort loudly"
)]

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spur_e2e::kafka::{Broker, Relay};
use spur_kafka::Role;
use spur_routing::KeyExtractor;

const CODECS: [&str; 5] = ["none", "gzip", "snappy", "lz4", "zstd"];
const ROUNDS: usize = 3;

/// Clock ticks of user+system CPU this process has used.
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn ticks_per_second() -> f64 {
    let out = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(100.0)
}

/// Reads the whole topic with kcat from `bootstrap`; (records read, wall time, this process's
/// CPU ticks meanwhile).
async fn consume(bootstrap: &str, topic: &str) -> (usize, Duration, u64) {
    let cpu = cpu_ticks();
    let start = Instant::now();
    let out = tokio::process::Command::new("kcat")
        .args([
            "-C",
            "-b",
            bootstrap,
            "-t",
            topic,
            "-o",
            "beginning",
            "-e",
            "-q",
        ])
        .args(["-f", "%o\\n"])
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let wall = start.elapsed();
    assert!(
        out.status.success(),
        "kcat: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let n = out.stdout.iter().filter(|&&b| b == b'\n').count();
    (n, wall, cpu_ticks() - cpu)
}

/// A route server (rule: key `sbx1` of baseline `bench/consumer` to sandbox `s1`) and a sidecar
/// for that baseline whose Kafka relay fronts `broker` in explicit mode; returns once the
/// sidecar has its routes (rules of a route server's first load are in force since ever).
async fn sidecar(
    broker: std::net::SocketAddr,
) -> (
    spur_sidecar::Sidecar,
    spur_routeserver::RouteServer,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("rules.yaml"),
        "- routingKey: sbx1\n  baseline: {kind: Deployment, namespace: bench, name: consumer}\n  destinationSandbox: {name: s1}\n  mappings:\n    - workloadPort: 8080\n      destinations: [{host: 127.0.0.1, port: 9}]\n",
    )
    .unwrap();
    let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let routeserver = spur_routeserver::RouteServer::start(spur_routeserver::RouteServerConfig {
        grpc_addr: loopback,
        http_addr: loopback,
        ..spur_routeserver::RouteServerConfig::new(dir.path())
    })
    .await
    .unwrap();
    let sidecar = spur_sidecar::Sidecar::start(spur_sidecar::SidecarConfig {
        inject_key_file: None,
        kafka: Some(spur_sidecar::kafka::KafkaConfig {
            ports: Default::default(),
            broker: Some(broker),
            listen_port: 0,
            role: Role::Baseline,
        }),
        capture: None,
        inbound_addr: loopback,
        // No HTTP here: the app address is never dialed.
        inbound: spur_proxy::Inbound::Explicit {
            app: std::net::SocketAddr::from(([127, 0, 0, 1], 9)),
        },
        baseline: spur_routing::BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "bench".into(),
            name: "consumer".into(),
        },
        rules: None,
        rules_poll: Duration::from_secs(1),
        routeserver: Some(spur_sidecar::RouteServerConn::plain(
            routeserver.grpc_addr.to_string(),
        )),
        admin_addr: None,
        extract: Default::default(),
        proxy: Default::default(),
    })
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while sidecar.table().load().version == 0 {
        assert!(
            Instant::now() < deadline,
            "the sidecar got no routes in 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (sidecar, routeserver, dir)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let records: usize = if full { 100_000 } else { 2_000 };
    let rounds = if full { ROUNDS } else { 1 };
    let broker = Broker::start().await.unwrap();
    let bs = broker.bootstrap();
    let extractor = Arc::new(KeyExtractor::new(&Default::default()).unwrap());
    let e = extractor.clone();
    let relay = Relay::start(
        broker.addr,
        Role::Baseline,
        Arc::new(move |r| {
            !spur_kafka::key::with_candidates(&e, r, |c| c.iter().any(|k| k == "sbx1"))
        }),
    )
    .await;
    let relay_bs = relay.addr.to_string();
    let (sidecar, routeserver, _rules) = sidecar(broker.addr).await;
    let sidecar_bs = sidecar.kafka_addr.unwrap().to_string();
    let hz = ticks_per_second();

    let mut table = String::new();
    writeln!(
        table,
        "| codec | keyed | records | direct rec/s | relay rec/s | relay / direct | relay CPU ms per 1 000 records | sidecar rec/s | sidecar / direct | sidecar CPU ms per 1 000 records | records kept |"
    )
    .unwrap();
    writeln!(
        table,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    .unwrap();
    for codec in CODECS {
        for keyed in [false, true] {
            let topic = format!("bench-{codec}-{}", if keyed { "10" } else { "0" });
            broker.probe(&["create", &bs, &topic, "1"]).await.unwrap();
            let key = if keyed { "sbx1/10" } else { "-" };
            broker
                .probe(&[
                    "produce",
                    &bs,
                    &topic,
                    codec,
                    "v",
                    &records.to_string(),
                    key,
                ])
                .await
                .unwrap();
            let (mut direct, mut via, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
            let (mut side, mut side_cpu) = (Vec::new(), Vec::new());
            let mut kept = 0;
            for _ in 0..rounds {
                let (n, wall, _) = consume(&bs, &topic).await;
                assert_eq!(n, records, "{topic}: direct read every record");
                direct.push(n as f64 / wall.as_secs_f64());
                let (n, wall, ticks) = consume(&relay_bs, &topic).await;
                let want = if keyed {
                    records - records.div_ceil(10)
                } else {
                    records
                };
                assert_eq!(
                    n, want,
                    "{topic}: the relay kept exactly the unkeyed records"
                );
                kept = n;
                via.push(records as f64 / wall.as_secs_f64());
                cpu.push(ticks as f64 / hz * 1000.0 / (records as f64 / 1000.0));
                let (n, wall, ticks) = consume(&sidecar_bs, &topic).await;
                assert_eq!(
                    n, want,
                    "{topic}: the sidecar kept exactly the unkeyed records"
                );
                side.push(records as f64 / wall.as_secs_f64());
                side_cpu.push(ticks as f64 / hz * 1000.0 / (records as f64 / 1000.0));
            }
            let (d, v, c) = (median(direct), median(via), median(cpu));
            let (sv, sc) = (median(side), median(side_cpu));
            writeln!(
                table,
                "| {codec} | {} | {records} | {d:.0} | {v:.0} | {:.2} | {c:.2} | {sv:.0} | {:.2} | {sc:.2} | {kept} |",
                if keyed { "10 %" } else { "0 %" },
                v / d,
                sv / d
            )
            .unwrap();
        }
    }
    assert!(
        relay.errors.lock().unwrap().is_empty(),
        "{:?}",
        relay.errors
    );
    sidecar.shutdown().await;
    routeserver.shutdown().await;
    print!("{table}");
    if full {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/results/kafka.md");
        let doc = format!(
            "# Kafka relay: throughput and CPU (issue 44)\n\n\
             `cargo bench -p spur-perf --bench kafka` ({}; method in `perf/benches/kafka.rs`).\n\
             One Kafka 3.9.2 broker on loopback, one partition per topic, {records} records of about\n\
             230 bytes written by the Java producer; kcat reads the topic from the beginning to the\n\
             end, directly, through the bare relay (a baseline's session that removes keyed records)\n\
             and through the sidecar (its Kafka relay in explicit mode, deciding by the route history\n\
             of a real route server whose rule sends the key to a sandbox); median of {rounds} runs.\n\
             2 cores shared by the broker, kcat and the relay: the ratios and the CPU per 1 000\n\
             records are the figures to read, not the rates.\n\n{table}",
            std::process::Command::new("date")
                .arg("-u")
                .arg("+%Y-%m-%d")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .unwrap_or_default()
        );
        std::fs::write(path, doc).unwrap();
        println!("wrote {path}");
    }
}
