//! The demo's Kafka part (`--kafka BROKER`, issue 44, `docs/async.md`): the web app writes one
//! record per `POST /order` to topic [`TOPIC`], with the request's `baggage`; a third service,
//! `worker`, consumes the topic, its baseline and its fork each through a real Spur sidecar's
//! Kafka relay. The rule that sends key `demo` to the sandbox sends the keyed request's record to
//! the worker's fork, and every other record to its baseline, with nothing Kafka-specific in the
//! rule.
//!
//! The broker is the user's (any Kafka 3.x or 4.x with one broker; the README says how to start
//! one), so the demo's first command stays free of a JVM. The relays run in explicit mode
//! (`spur-sidecar --kafka-broker`): on a workstation there is no interception, so each worker
//! bootstraps to its sidecar's relay, which advertises itself in place of the broker.
//!
//! The workers read without a consumer group (every partition, from the end at start): the demo
//! shows which records each side receives; group separation for forks is shown by the tests with
//! real clients.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use spur_demo_apps::CancellationToken;
use spur_demo_apps::kafka::{self, Handled};
use spur_kafka::Role;
use spur_sidecar::Sidecar;
use spur_sidecar::kafka::KafkaConfig;

/// The topic the web app writes orders to.
pub const TOPIC: &str = "demo-orders";
const PARTITIONS: i32 = 3;
/// The sandbox the demo's rules name.
pub const SANDBOX: &str = "demo-sandbox";

/// Records the workers handled: (worker side, record).
type Log = Arc<Mutex<Vec<(&'static str, Handled)>>>;

/// The worker's two sidecars and consumers.
pub struct Workers {
    pub broker: SocketAddr,
    pub baseline: Sidecar,
    pub fork: Sidecar,
    handled: Log,
    stop: CancellationToken,
    consumers: tokio::task::JoinSet<()>,
}

/// The Kafka relay of a worker sidecar: explicit mode in front of `broker`.
pub fn relay_config(broker: SocketAddr, listen_port: u16, fork: bool) -> KafkaConfig {
    KafkaConfig {
        ports: Default::default(),
        broker: Some(broker),
        listen_port,
        role: if fork {
            Role::Fork {
                sandbox: SANDBOX.into(),
            }
        } else {
            Role::Baseline
        },
    }
}

/// Makes the topic (a topic that exists already is fine).
pub async fn create_topic(broker: SocketAddr) -> Result<()> {
    kafka::create_topic(broker, TOPIC, PARTITIONS)
        .await
        .with_context(|| {
            format!("cannot create topic {TOPIC} on the Kafka broker at {broker} (is it running?)")
        })
}

impl Workers {
    /// Starts a consumer behind each sidecar's relay; returns once both know where they start
    /// (so records written after this are theirs to see). `print`: say each handled record on
    /// stdout (the interactive demo).
    pub async fn start(
        broker: SocketAddr,
        baseline: Sidecar,
        fork: Sidecar,
        print: bool,
    ) -> Result<Workers> {
        let handled: Log = Arc::default();
        let stop = CancellationToken::new();
        let mut consumers = tokio::task::JoinSet::new();
        let mut ready = Vec::new();
        for (side, sidecar) in [("baseline", &baseline), ("fork", &fork)] {
            let relay = sidecar
                .kafka_addr
                .context("the worker sidecar runs no Kafka relay")?;
            let (tx, rx) = tokio::sync::oneshot::channel();
            ready.push(rx);
            let (log, stop) = (handled.clone(), stop.clone());
            consumers.spawn(async move {
                let on_record = move |h: Handled| {
                    if print {
                        println!(
                            "worker {side:<8} handled {} (partition {}, offset {}{})",
                            h.value,
                            h.partition,
                            h.offset,
                            baggage(&h).map_or(String::new(), |b| format!(", baggage {b:?}"))
                        );
                    }
                    log.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((side, h));
                };
                if let Err(e) = kafka::consume(relay, TOPIC, tx, stop, on_record).await {
                    tracing::error!(error = %e, side, "demo worker stopped");
                }
            });
        }
        let workers = Workers {
            broker,
            baseline,
            fork,
            handled,
            stop,
            consumers,
        };
        for rx in ready {
            match tokio::time::timeout(Duration::from_secs(30), rx).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    workers.stop().await;
                    bail!("a demo worker could not start reading {TOPIC} (see the error above)");
                }
                Err(_) => {
                    workers.stop().await;
                    bail!("a demo worker did not reach the broker at {broker} within 30 s");
                }
            }
        }
        Ok(workers)
    }

    /// Which worker sides handled the record `value`, waiting up to `wait` for the first and
    /// then a second more, so a record handled twice shows as both.
    pub async fn handled_by(&self, value: &str, wait: Duration) -> Vec<&'static str> {
        let find = || -> Vec<&'static str> {
            let log = self.handled.lock().unwrap_or_else(|p| p.into_inner());
            log.iter()
                .filter(|(_, h)| h.value == value)
                .map(|(side, _)| *side)
                .collect()
        };
        let deadline = tokio::time::Instant::now() + wait;
        while find().is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !find().is_empty() {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let mut sides = find();
        sides.sort_unstable();
        sides
    }

    pub async fn stop(mut self) {
        self.stop.cancel();
        while self.consumers.join_next().await.is_some() {}
        self.baseline.shutdown().await;
        self.fork.shutdown().await;
    }
}

fn baggage(h: &Handled) -> Option<String> {
    h.headers
        .iter()
        .find(|(k, _)| k == "baggage")
        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
}
