//! The Kafka record filter (`spur-kafka`) against a real Apache Kafka broker and real clients:
//! - batches that real producers wrote (librdkafka through kcat, the Java client, plain and
//!   transactional, and franz-go) in each of the five codecs, fetched as the broker sends them, split by
//!   routing key into a baseline's share and a fork's share with nothing lost or doubled;
//! - batches Spur compressed (each codec) are accepted by the broker and read back by real
//!   consumers (kcat and the Java client).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use bytes::{BufMut, Bytes, BytesMut};
use indexmap::IndexMap;
use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::{FetchRequest, ProduceRequest, TopicName};
use kafka_protocol::protocol::StrBytes;
use kafka_protocol::records::{
    Compression, Record as KRecord, RecordBatchDecoder, RecordBatchEncoder, RecordEncodeOptions,
    TimestampType,
};
use spur_e2e::kafka::{Broker, Raw};
use spur_kafka::{BatchHeader, Codec, Limits, batch, filter};
use spur_routing::KeyExtractor;

const CODECS: [&str; 5] = ["none", "gzip", "snappy", "lz4", "zstd"];

/// The values of the records in `blob`, read by kafka-protocol's decoder (its gzip and snappy;
/// lz4 and zstd through ours, which it only has as C libraries), control records left out.
fn values(blob: &Bytes) -> Vec<String> {
    let mut buf = blob.clone();
    let mut out = Vec::new();
    while !buf.is_empty() {
        let set = RecordBatchDecoder::decode_with_custom_compression(
            &mut buf,
            Some(
                |packed: &mut Bytes, c: Compression| -> anyhow::Result<Bytes> {
                    use kafka_protocol::compression::{Decompressor, Gzip, Snappy};
                    match c {
                        Compression::None => Ok(packed.clone()),
                        Compression::Gzip => Gzip::decompress(packed, |b| Ok(b.clone())),
                        Compression::Snappy => Snappy::decompress(packed, |b| Ok(b.clone())),
                        _ => Ok(Bytes::from(
                            spur_kafka::codec::decompress(Codec::from(c), packed, 1 << 26)
                                .map_err(anyhow::Error::msg)?,
                        )),
                    }
                },
            ),
        )
        .unwrap();
        out.extend(
            set.records
                .iter()
                .filter(|r| !r.control)
                .map(|r| String::from_utf8(r.value.clone().unwrap().to_vec()).unwrap()),
        );
    }
    out
}

fn fetch_request(topic: &str, partition: i32, offset: i64) -> FetchRequest {
    FetchRequest::default()
        .with_replica_id(kafka_protocol::messages::BrokerId(-1))
        .with_max_wait_ms(100)
        .with_min_bytes(1)
        .with_max_bytes(1 << 20)
        .with_topics(vec![
            FetchTopic::default()
                .with_topic(TopicName(StrBytes::from_string(topic.to_string())))
                .with_partitions(vec![
                    FetchPartition::default()
                        .with_partition(partition)
                        .with_fetch_offset(offset)
                        .with_partition_max_bytes(64 << 10)
                        .with_log_start_offset(-1),
                ]),
        ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_real_producers_split_by_key_in_every_codec() {
    let broker = Broker::start().await.unwrap();
    let bs = broker.bootstrap();
    broker.probe(&["create", &bs, "orders", "3"]).await.unwrap();
    let (mut plain, mut keyed) = (BTreeSet::new(), BTreeSet::new());
    for codec in CODECS {
        let p: Vec<String> = (0..12).map(|i| format!("kcat-{codec}-{i}")).collect();
        let k: Vec<String> = (0..6).map(|i| format!("kcat-{codec}-k{i}")).collect();
        broker
            .kcat_produce("orders", codec, &p, None)
            .await
            .unwrap();
        broker
            .kcat_produce(
                "orders",
                codec,
                &k,
                Some(("baggage", "userId=7,sd-routing-key=sbx1")),
            )
            .await
            .unwrap();
        plain.extend(p);
        keyed.extend(k);
        let prefix = format!("java-{codec}");
        let prefix_k = format!("java-{codec}-k");
        broker
            .probe(&["produce", &bs, "orders", codec, &prefix, "12", "-"])
            .await
            .unwrap();
        broker
            .probe(&["produce", &bs, "orders", codec, &prefix_k, "6", "sbx1"])
            .await
            .unwrap();
        plain.extend((0..12).map(|i| format!("{prefix}-{i}")));
        keyed.extend((0..6).map(|i| format!("{prefix_k}-{i}")));
        let (franz, franz_k) = (format!("franz-{codec}"), format!("franz-{codec}-k"));
        broker
            .franz(&["produce", &bs, "orders", codec, &franz, "12", "-"])
            .await
            .unwrap();
        broker
            .franz(&["produce", &bs, "orders", codec, &franz_k, "6", "sbx1"])
            .await
            .unwrap();
        plain.extend((0..12).map(|i| format!("{franz}-{i}")));
        keyed.extend((0..6).map(|i| format!("{franz_k}-{i}")));
    }
    // Transactional producers: their batches carry producer ids and end in commit markers.
    broker
        .probe(&[
            "produce", &bs, "orders", "zstd", "txn", "8", "-", "tx-plain",
        ])
        .await
        .unwrap();
    broker
        .probe(&[
            "produce", &bs, "orders", "lz4", "txn-k", "4", "sbx1", "tx-keyed",
        ])
        .await
        .unwrap();
    plain.extend((0..8).map(|i| format!("txn-{i}")));
    keyed.extend((0..4).map(|i| format!("txn-k-{i}")));

    let extractor = KeyExtractor::new(&Default::default()).unwrap();
    let key_of = |r: &spur_kafka::Record<'_>| {
        spur_kafka::key::with_candidates(&extractor, r, |c| c.first().map(str::to_string))
    };
    let (mut baseline, mut fork) = (Vec::new(), Vec::new());
    let mut codecs_seen = BTreeSet::new();
    let (mut control, mut rewritten) = (0, 0);
    let mut raw = Raw::connect(broker.addr).await.unwrap();
    for partition in 0..3 {
        let mut offset = 0;
        // Bounded: 1 000 records in at most 64 KiB per fetch take far fewer rounds.
        for round in 0.. {
            assert!(
                round < 200,
                "partition {partition} never reached its high watermark"
            );
            let resp = raw
                .call(12, &fetch_request("orders", partition, offset))
                .await
                .unwrap();
            let p = &resp.responses[0].partitions[0];
            assert_eq!(p.error_code, 0);
            let records = p.records.clone().unwrap_or_default();
            if records.is_empty() {
                assert_eq!(offset, p.high_watermark, "an empty fetch before the end");
                break;
            }
            let mut pos = 0;
            while pos + batch::HEADER_LEN <= records.len() {
                let h = BatchHeader::read(&records[pos..]).unwrap();
                let end = pos + batch::LOG_OVERHEAD + h.batch_length as usize;
                if end > records.len() {
                    break;
                }
                codecs_seen.insert(h.codec().unwrap().name());
                offset = h.last_offset() + 1;
                pos = end;
            }
            let b = filter(&records, &Limits::default(), |_, r| key_of(r).is_none()).unwrap();
            let f = filter(&records, &Limits::default(), |_, r| {
                key_of(r).as_deref() == Some("sbx1")
            })
            .unwrap();
            control += b.stats.control_batches;
            rewritten += b.stats.batches_rewritten + f.stats.batches_rewritten;
            assert_eq!(
                b.stats.records_kept + f.stats.records_kept,
                b.stats.records_kept + b.stats.records_dropped
            );
            baseline.extend(values(&b.records));
            fork.extend(values(&f.records));
        }
    }
    assert_eq!(
        codecs_seen.len(),
        5,
        "every codec was fetched: {codecs_seen:?}"
    );
    assert!(
        control >= 2,
        "the two transactions' commit markers passed: {control}"
    );
    assert!(rewritten > 0);
    let (b, f): (BTreeSet<String>, BTreeSet<String>) = (
        baseline.iter().cloned().collect(),
        fork.iter().cloned().collect(),
    );
    assert_eq!(
        b.len(),
        baseline.len(),
        "no record twice in the baseline's share"
    );
    assert_eq!(f.len(), fork.len(), "no record twice in the fork's share");
    assert_eq!(b, plain);
    assert_eq!(f, keyed);
}

/// `n` plain records in one batch (no producer id: not idempotent) with values `prefix-i`, keyed by header.
fn records(prefix: &str, n: i64) -> Vec<KRecord> {
    // Current timestamps: the broker answered INVALID_RECORD to records stamped in 2023.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    (0..n)
        .map(|i| {
            let mut headers = IndexMap::new();
            headers.insert(
                StrBytes::from_static_str("baggage"),
                Some(Bytes::from_static(b"sd-routing-key=sbx1")),
            );
            KRecord {
                transactional: false,
                control: false,
                delete_horizon: false,
                partition_leader_epoch: -1,
                producer_id: -1,
                producer_epoch: -1,
                timestamp_type: TimestampType::Creation,
                offset: i,
                // Base sequence -1 (no producer id); kafka-protocol keeps records in one batch
                // only while offset minus sequence stays the same.
                sequence: i as i32 - 1,
                timestamp: now + i,
                key: None,
                value: Some(Bytes::from(format!(
                    "{prefix}-{i} {}",
                    "payload ".repeat(20)
                ))),
                headers,
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_spur_compressed_are_read_by_real_consumers() {
    let broker = Broker::start().await.unwrap();
    let bs = broker.bootstrap();
    broker
        .probe(&["create", &bs, "written", "5"])
        .await
        .unwrap();
    let mut raw = Raw::connect(broker.addr).await.unwrap();
    let mut want = BTreeSet::new();
    for (partition, codec) in Codec::ALL.into_iter().enumerate() {
        let recs = records(codec.name(), 40);
        let mut blob = BytesMut::new();
        let compression = Compression::from(codec);
        // The batch framing by kafka-protocol, the compression by Spur's codecs.
        RecordBatchEncoder::encode_with_custom_compression(
            &mut blob,
            &recs,
            &RecordEncodeOptions {
                version: 2,
                compression,
            },
            Some(|plain: &mut BytesMut, out: &mut BytesMut, c: Compression| {
                out.put_slice(
                    &spur_kafka::codec::compress(Codec::from(c), plain)
                        .map_err(anyhow::Error::msg)?,
                );
                Ok(())
            }),
        )
        .unwrap();
        assert_eq!(
            BatchHeader::read(&blob).unwrap().codec().unwrap(),
            codec,
            "the batch is compressed as asked"
        );
        let req = ProduceRequest::default()
            .with_acks(-1)
            .with_timeout_ms(10_000)
            .with_topic_data(vec![
                TopicProduceData::default()
                    .with_name(TopicName(StrBytes::from_static_str("written")))
                    .with_partition_data(vec![
                        PartitionProduceData::default()
                            .with_index(partition as i32)
                            .with_records(Some(blob.freeze())),
                    ]),
            ]);
        // A partition just created may not have its leader yet: retry what every client
        // retries (UNKNOWN_TOPIC_OR_PARTITION, LEADER_NOT_AVAILABLE, NOT_LEADER_OR_FOLLOWER),
        // a bounded number of times.
        let mut attempts = 0;
        let p = loop {
            let resp = raw.call(8, &req).await.unwrap();
            let p = resp.responses[0].partition_responses[0].clone();
            attempts += 1;
            if matches!(p.error_code, 3 | 5 | 6) && attempts < 100 {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
            break p;
        };
        assert_eq!(
            p.error_code,
            0,
            "{codec}: the broker refused the batch: {:?} {:?}\n{}",
            p.error_message,
            p.record_errors,
            broker.log_tail()
        );
        want.extend(
            recs.iter()
                .map(|r| String::from_utf8(r.value.clone().unwrap().to_vec()).unwrap()),
        );
    }
    let kcat: BTreeSet<String> = broker
        .kcat_consume("written")
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(kcat, want, "librdkafka read every record");
    let java = broker
        .probe(&["consume", &bs, "written", "reader", "200", "30000"])
        .await
        .unwrap();
    let java: BTreeSet<String> = java
        .lines()
        .filter_map(|l| l.strip_prefix("record "))
        .map(|l| l.splitn(3, ' ').nth(2).unwrap().to_string())
        .collect();
    assert_eq!(java, want, "the Java client read every record");
}

/// Whether `r` carries the routing key `key` (any candidate, as the sidecar will match rules).
fn carries(extractor: &KeyExtractor, r: &spur_kafka::Record<'_>, key: &str) -> bool {
    spur_kafka::key::with_candidates(extractor, r, |c| c.iter().any(|k| k == key))
}

/// The values a Java or franz-go consumer printed.
fn java_values(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.strip_prefix("record "))
        .map(|l| l.splitn(3, ' ').nth(2).unwrap().to_string())
        .collect()
}

/// A baseline consumer and a fork's consumer with the same `group.id`, each through its own
/// relay, run at the same time: the fork's group is renamed so neither takes partitions from the
/// other, and each receives exactly its share of the records, by key, whatever the codec.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_baseline_and_a_fork_in_one_group_receive_their_records() {
    use spur_e2e::kafka::Relay;
    use spur_kafka::Role;
    use std::sync::Arc;

    let broker = Broker::start().await.unwrap();
    let bs = broker.bootstrap();
    broker.probe(&["create", &bs, "orders", "3"]).await.unwrap();
    let (mut plain, mut keyed) = (BTreeSet::new(), BTreeSet::new());
    for (codec, n, k) in [("lz4", 30, 10), ("gzip", 20, 5), ("none", 10, 5)] {
        let (p, q) = (format!("p-{codec}"), format!("k-{codec}"));
        broker
            .probe(&["produce", &bs, "orders", codec, &p, &n.to_string(), "-"])
            .await
            .unwrap();
        broker
            .probe(&["produce", &bs, "orders", codec, &q, &k.to_string(), "sbx1"])
            .await
            .unwrap();
        plain.extend((0..n).map(|i| format!("{p}-{i}")));
        keyed.extend((0..k).map(|i| format!("{q}-{i}")));
    }
    // Records for another sandbox's key: neither this fork's nor (once routed) the baseline's.
    broker
        .kcat_produce(
            "orders",
            "zstd",
            &["other-0".into(), "other-1".into()],
            Some(("baggage", "sd-routing-key=sbx2")),
        )
        .await
        .unwrap();

    let extractor = Arc::new(KeyExtractor::new(&Default::default()).unwrap());
    let e = extractor.clone();
    let baseline = Relay::start(
        broker.addr,
        Role::Baseline,
        Arc::new(move |r| !carries(&e, r, "sbx1") && !carries(&e, r, "sbx2")),
    )
    .await;
    let e = extractor.clone();
    let fork = Relay::start(
        broker.addr,
        Role::Fork {
            sandbox: "sbx1".into(),
        },
        Arc::new(move |r| carries(&e, r, "sbx1")),
    )
    .await;

    let (b_bs, f_bs) = (baseline.addr.to_string(), fork.addr.to_string());
    let (b_n, f_n) = (plain.len().to_string(), keyed.len().to_string());
    let b_args = ["consume", &b_bs, "orders", "orders-app", &b_n, "40000"];
    let f_args = ["consume", &f_bs, "orders", "orders-app", &f_n, "40000"];
    let (b, f) = tokio::join!(broker.probe(&b_args), broker.probe(&f_args));
    let (b, f) = (java_values(&b.unwrap()), java_values(&f.unwrap()));
    assert!(
        baseline.errors.lock().unwrap().is_empty(),
        "{:?}",
        baseline.errors
    );
    assert!(fork.errors.lock().unwrap().is_empty(), "{:?}", fork.errors);
    assert_eq!(
        b.iter().cloned().collect::<BTreeSet<_>>(),
        plain,
        "the baseline's share, Java"
    );
    assert_eq!(b.len(), plain.len(), "no record twice");
    assert_eq!(
        f.iter().cloned().collect::<BTreeSet<_>>(),
        keyed,
        "the fork's share, Java"
    );
    assert_eq!(f.len(), keyed.len(), "no record twice");
    let stats = fork.stats.lock().unwrap().clone();
    assert!(stats.ids_renamed > 0, "{stats:?}");

    // librdkafka's balanced consumer, in a group of its own, through the same relays.
    let b = broker
        .kcat_group(baseline.addr, "orders-kcat", "orders")
        .await
        .unwrap();
    let f = broker
        .kcat_group(fork.addr, "orders-kcat", "orders")
        .await
        .unwrap();
    assert_eq!(
        b.iter().cloned().collect::<BTreeSet<_>>(),
        plain,
        "the baseline's share, kcat"
    );
    assert_eq!(b.len(), plain.len());
    assert_eq!(
        f.iter().cloned().collect::<BTreeSet<_>>(),
        keyed,
        "the fork's share, kcat"
    );
    assert_eq!(f.len(), keyed.len());

    // franz-go's group consumer (cooperative-sticky, topic ids in Fetch v17) likewise, the
    // baseline's and the fork's member at the same time.
    let b_args = ["consume", &b_bs, "orders", "orders-franz", &b_n, "40000"];
    let f_args = ["consume", &f_bs, "orders", "orders-franz", &f_n, "40000"];
    let (b, f) = tokio::join!(broker.franz(&b_args), broker.franz(&f_args));
    let (b, f) = (java_values(&b.unwrap()), java_values(&f.unwrap()));
    assert_eq!(
        b.iter().cloned().collect::<BTreeSet<_>>(),
        plain,
        "the baseline's share, franz-go"
    );
    assert_eq!(b.len(), plain.len());
    assert_eq!(
        f.iter().cloned().collect::<BTreeSet<_>>(),
        keyed,
        "the fork's share, franz-go"
    );
    assert_eq!(f.len(), keyed.len());
    assert!(
        baseline.errors.lock().unwrap().is_empty(),
        "{:?}",
        baseline.errors
    );
    assert!(fork.errors.lock().unwrap().is_empty(), "{:?}", fork.errors);
}

/// A baseline consumer behind its relay moves past long runs of records that are all a fork's:
/// with fetch sizes of a few batches, kcat's consumer gets a dozen Fetch responses or more in a row
/// whose batches were all emptied (each an empty control batch), and still reaches the records after them and the end of the
/// partition; the Java client and franz-go (read_committed) likewise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_moves_past_runs_of_records_that_are_not_its_own() {
    use spur_e2e::kafka::Relay;
    use spur_kafka::Role;
    use std::sync::Arc;

    let broker = Broker::start().await.unwrap();
    let bs = broker.bootstrap();
    broker.probe(&["create", &bs, "runs", "1"]).await.unwrap();
    let keyed: Vec<String> = (0..300).map(|i| format!("fork-{i}")).collect();
    // Small batches: five records each.
    let mut cmd = tokio::process::Command::new("kcat");
    cmd.args(["-P", "-b", &bs, "-t", "runs", "-z", "lz4"])
        .args(["-X", "batch.num.messages=5", "-X", "linger.ms=5"])
        .args(["-H", "baggage=sd-routing-key=sbx1"])
        .stdin(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    {
        use tokio::io::AsyncWriteExt as _;
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all((keyed.join("\n") + "\n").as_bytes())
            .await
            .unwrap();
    }
    assert!(child.wait().await.unwrap().success());
    let plain: Vec<String> = (0..5).map(|i| format!("base-{i}")).collect();
    broker
        .kcat_produce("runs", "none", &plain, None)
        .await
        .unwrap();
    let want: BTreeSet<String> = plain.iter().cloned().collect();

    let extractor = Arc::new(KeyExtractor::new(&Default::default()).unwrap());
    let e = extractor.clone();
    let baseline = Relay::start(
        broker.addr,
        Role::Baseline,
        Arc::new(move |r| !carries(&e, r, "sbx1")),
    )
    .await;
    let mut cmd = tokio::process::Command::new("kcat");
    cmd.args([
        "-b",
        &baseline.addr.to_string(),
        "-G",
        "runs-kcat",
        "runs",
        "-e",
    ])
    .args(["-f", "%s\\n", "-X", "auto.offset.reset=earliest"])
    .args(["-X", "fetch.max.bytes=1000", "-X", "message.max.bytes=1000"])
    // librdkafka doubles a partition's fetch size after each response it reads no record and
    // no control batch from, and reports "too large to fetch" (kcat exits) once it passes 1 GiB:
    // starting at 1e9, the second all-empty response would do it.
    .args(["-X", "fetch.message.max.bytes=1000000000"])
    .kill_on_drop(true);
    let out = tokio::time::timeout(std::time::Duration::from_secs(60), cmd.output())
        .await
        .expect("kcat stalled on the emptied batches")
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(got.iter().cloned().collect::<BTreeSet<_>>(), want, "kcat");
    assert_eq!(got.len(), want.len());
    let stats = baseline.stats.lock().unwrap().clone();
    assert!(
        stats.fetch_responses >= 10 && stats.records.batches_emptied >= 50,
        "the run was not fetched in many small responses: {stats:?}"
    );

    let args = [
        "consume",
        &baseline.addr.to_string(),
        "runs",
        "runs-java",
        "5",
        "40000",
    ];
    let java = java_values(&broker.probe(&args).await.unwrap());
    assert_eq!(java.iter().cloned().collect::<BTreeSet<_>>(), want, "Java");
    let args = [
        "consume",
        &baseline.addr.to_string(),
        "runs",
        "runs-franz",
        "5",
        "40000",
    ];
    let franz = java_values(&broker.franz(&args).await.unwrap());
    assert_eq!(
        franz.iter().cloned().collect::<BTreeSet<_>>(),
        want,
        "franz-go"
    );
    assert!(
        baseline.errors.lock().unwrap().is_empty(),
        "{:?}",
        baseline.errors
    );
}

/// A consumer of the demo's Kafka client (`spur_demo_apps::kafka::consume`) on a task of its
/// own, and the records it handled.
struct DemoConsumer {
    token: spur_demo_apps::CancellationToken,
    seen: std::sync::Arc<std::sync::Mutex<Vec<spur_demo_apps::kafka::Handled>>>,
    task: tokio::task::JoinHandle<Result<(), spur_demo_apps::Error>>,
}

impl DemoConsumer {
    /// Starts one on `topic` through `bootstrap`; returns once it knows its start offsets.
    async fn start(bootstrap: std::net::SocketAddr, topic: &str) -> DemoConsumer {
        let (ready, started) = tokio::sync::oneshot::channel();
        let token = spur_demo_apps::CancellationToken::new();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (t, s, topic) = (token.clone(), seen.clone(), topic.to_string());
        let task = tokio::spawn(async move {
            spur_demo_apps::kafka::consume(bootstrap, &topic, ready, t, move |h| {
                s.lock().unwrap().push(h)
            })
            .await
        });
        let started = tokio::time::timeout(std::time::Duration::from_secs(30), started).await;
        if !matches!(started, Ok(Ok(()))) {
            panic!("the demo consumer did not start: {:?}", task.await);
        }
        DemoConsumer { token, seen, task }
    }

    /// Waits (30 s at most) until it handled a record of every value of `want`, then a moment
    /// more for any record it should not get; everything it handled.
    async fn handled(&self, want: &BTreeSet<String>) -> Vec<spur_demo_apps::kafka::Handled> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let values: BTreeSet<String> = self
                .seen
                .lock()
                .unwrap()
                .iter()
                .map(|h| h.value.clone())
                .collect();
            let missing: Vec<&String> = want.difference(&values).collect();
            if missing.is_empty() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the demo consumer is stuck: after 30 s it still misses {missing:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        self.seen.lock().unwrap().clone()
    }

    /// Cancels it; it must end without an error at once.
    async fn stop(self) {
        self.token.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(5), self.task)
            .await
            .expect("the demo consumer did not stop when cancelled")
            .unwrap()
            .unwrap();
    }
}

/// The demo's own Kafka client (`spur_demo_apps::kafka`, on kafka-protocol) against a real
/// broker: its producer, used from several tasks, and kcat write one topic; its group-less
/// consumer, straight to the broker, handles every record written after it started exactly once,
/// in offset order, headers intact; kcat reads back what the producer wrote. Through a relay that
/// withholds every `fork-` record, whole batches arrive emptied (empty control batches): the
/// consumer moves past them and handles all the other records and none of those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_clients_against_a_real_broker() {
    use spur_demo_apps::kafka::{self, Producer};
    use spur_e2e::kafka::Relay;
    use std::sync::Arc;

    let broker = Broker::start().await.unwrap();
    kafka::create_topic(broker.addr, "demo", 3).await.unwrap();
    kafka::create_topic(broker.addr, "demo", 3)
        .await
        .expect("a topic that exists already is no error");
    let producer = Producer::new(broker.addr, "demo");
    // Written before the consumers start, which read from the end: not theirs.
    let before: Vec<String> = (0..3).map(|i| format!("before-{i}")).collect();
    for v in &before {
        producer.send(v.as_bytes(), &[]).await.unwrap();
    }

    let relay = Relay::start(
        broker.addr,
        spur_kafka::Role::Baseline,
        Arc::new(|r: &spur_kafka::Record<'_>| !r.value.is_some_and(|v| v.starts_with(b"fork-"))),
    )
    .await;
    let direct = DemoConsumer::start(broker.addr, "demo").await;
    let relayed = DemoConsumer::start(relay.addr, "demo").await;

    // The fork's records first, so the relayed consumer has to move past their emptied batches:
    // kcat's (gzip, several records a batch), then the producer's (one record a batch).
    let kcat_fork: Vec<String> = (0..20).map(|i| format!("fork-kcat-{i}")).collect();
    broker
        .kcat_produce(
            "demo",
            "gzip",
            &kcat_fork,
            Some(("baggage", "sd-routing-key=sbx1")),
        )
        .await
        .unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..3 {
        let producer = producer.clone();
        tasks.spawn(async move {
            let mut sent = Vec::new();
            for i in 0..13 {
                let value = if i < 3 {
                    format!("fork-demo-{t}-{i}")
                } else {
                    format!("demo-{t}-{i}")
                };
                let baggage = format!("userId={t}-{i}");
                let at = producer
                    .send(value.as_bytes(), &[("baggage", baggage.as_bytes())])
                    .await
                    .unwrap();
                sent.push((value, baggage, at));
            }
            sent
        });
    }
    let sent: Vec<(String, String, (i32, i64))> =
        tasks.join_all().await.into_iter().flatten().collect();
    let kcat_plain: Vec<String> = (0..5).map(|i| format!("kcat-{i}")).collect();
    broker
        .kcat_produce(
            "demo",
            "snappy",
            &kcat_plain,
            Some(("baggage", "from=kcat")),
        )
        .await
        .unwrap();
    let partitions: BTreeSet<i32> = sent.iter().map(|(_, _, (p, _))| *p).collect();
    assert_eq!(partitions.len(), 3, "round-robin over the partitions");
    // Last, a fork record on each partition (round-robin): every partition ends in a batch the
    // relay empties, where a consumer that took its next offset from the records it read would
    // fetch the same batch again and again.
    let last: Vec<String> = (0..3).map(|i| format!("fork-last-{i}")).collect();
    for v in &last {
        producer.send(v.as_bytes(), &[]).await.unwrap();
    }

    let all: BTreeSet<String> = sent
        .iter()
        .map(|(v, _, _)| v.clone())
        .chain(kcat_fork.iter().cloned())
        .chain(kcat_plain.iter().cloned())
        .chain(last.iter().cloned())
        .collect();
    let got = direct.handled(&all).await;
    let values: BTreeSet<String> = got.iter().map(|h| h.value.clone()).collect();
    assert_eq!(values, all, "the direct consumer handled every record");
    assert_eq!(got.len(), all.len(), "and each once: {got:?}");
    for (value, baggage, (partition, offset)) in &sent {
        let h = got.iter().find(|h| &h.value == value).unwrap();
        assert_eq!((h.partition, h.offset), (*partition, *offset), "{value}");
        assert_eq!(
            h.headers,
            vec![("baggage".to_string(), baggage.clone().into_bytes())]
        );
    }
    for h in got.iter().filter(|h| h.value.starts_with("kcat-")) {
        assert_eq!(
            h.headers,
            vec![("baggage".to_string(), b"from=kcat".to_vec())]
        );
    }
    for p in 0..3 {
        let offsets: Vec<i64> = got
            .iter()
            .filter(|h| h.partition == p)
            .map(|h| h.offset)
            .collect();
        assert!(
            offsets.windows(2).all(|w| w[0] < w[1]),
            "partition {p} in offset order: {offsets:?}"
        );
    }

    let plain: BTreeSet<String> = all
        .iter()
        .filter(|v| !v.starts_with("fork-"))
        .cloned()
        .collect();
    let got = relayed.handled(&plain).await;
    let values: BTreeSet<String> = got.iter().map(|h| h.value.clone()).collect();
    assert_eq!(
        values, plain,
        "the relayed consumer handled no fork- record"
    );
    assert_eq!(got.len(), plain.len(), "and each other once: {got:?}");
    let stats = relay.stats.lock().unwrap().clone();
    assert!(
        stats.records.batches_emptied >= 9,
        "whole batches were withheld: {stats:?}"
    );
    // At the end of every partition it waits in Fetch (200 ms a round), not fetching the emptied
    // batches again: a few Fetch responses a second, not hundreds.
    let fetches = relay.stats.lock().unwrap().fetch_responses;
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let fetches = relay.stats.lock().unwrap().fetch_responses - fetches;
    assert!(fetches <= 30, "{fetches} Fetch responses in 2 s at the end");
    assert!(
        relay.errors.lock().unwrap().is_empty(),
        "{:?}",
        relay.errors
    );
    direct.stop().await;
    relayed.stop().await;

    // An independent consumer (librdkafka) reads back what the producer wrote.
    let kcat: BTreeSet<String> = broker
        .kcat_consume("demo")
        .await
        .unwrap()
        .into_iter()
        .collect();
    let want: BTreeSet<String> = all.iter().chain(&before).cloned().collect();
    assert_eq!(kcat, want, "kcat read every record");
}
