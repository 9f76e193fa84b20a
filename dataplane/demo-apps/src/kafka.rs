//! A minimal Kafka client for the standalone demo: [`create_topic`], a [`Producer`] of one record
//! per call, and a group-less [`consume`]r of a whole topic.
//!
//! It is not a general Kafka client: no consumer groups or committed offsets, no idempotence or
//! transactions, no compression when producing (gzip and snappy batches are read; lz4 and zstd
//! batches are skipped with a warning, their codecs being C libraries in `kafka-protocol`), no
//! TLS or SASL, one request in flight per connection. It exists because the demo must build with
//! cargo alone: the usual Rust clients wrap librdkafka (a C library) and the reference client
//! needs a JVM, while `kafka-protocol` (pure Rust, already used by the relay) encodes every message.
//!
//! Through Spur's Kafka relay the consumer meets what any consumer behind it does: the relay
//! advertises itself in Metadata in place of the broker, so every connection goes through it, and
//! a batch whose records it withheld all arrives as an empty control batch.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use kafka_protocol::ResponseError;
use kafka_protocol::messages::create_topics_request::CreatableTopic;
use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::{
    ApiKey, BrokerId, CreateTopicsRequest, FetchRequest, ListOffsetsRequest, MetadataRequest,
    ProduceRequest, RequestHeader, ResponseHeader, TopicName,
};
use kafka_protocol::protocol::{Decodable, Encodable, HeaderVersion, Request, StrBytes};
use kafka_protocol::records::{
    Compression, Record, RecordBatchDecoder, RecordBatchEncoder, RecordEncodeOptions, TimestampType,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Mutex, oneshot};
use tokio_util::sync::CancellationToken;

use crate::Error;

// API versions that Kafka 3.x and 4.x serve (3.9 is tested), `kafka-protocol` decodes, and the
// relay reads. Fetch v12 is the last that names topics (v13 and later name them by id).
const METADATA_V: i16 = 9;
const PRODUCE_V: i16 = 8;
const LIST_OFFSETS_V: i16 = 5;
const FETCH_V: i16 = 12;
const CREATE_TOPICS_V: i16 = 5;

/// Largest response frame accepted. A Fetch asks for at most [`FETCH_MAX_BYTES`]; a larger
/// frame means a broken or hostile peer, and its length is not allocated.
const MAX_FRAME: usize = 64 << 20;
const FETCH_MAX_BYTES: i32 = 8 << 20;
const PARTITION_MAX_BYTES: i32 = 1 << 20;
/// How long the broker holds a Fetch that has nothing yet: records reach the demo's worker within
/// this, and a cancelled consumer stops within it.
const FETCH_MAX_WAIT_MS: i32 = 200;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A request unanswered for this long counts as a broken connection.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
const CLIENT_ID: &str = "spur-demo";
/// ListOffsets timestamps meaning "the end" (the high watermark) and "the start".
const LATEST: i64 = -1;
const EARLIEST: i64 = -2;
/// Bytes of a v2 record batch header; the fields read here sit at fixed offsets in it.
const BATCH_HEADER_LEN: usize = 61;
const OFFSET_OUT_OF_RANGE: i16 = 1;
const TOPIC_ALREADY_EXISTS: i16 = 36;
const LEADER_NOT_AVAILABLE: i16 = 5;

fn topic_name(topic: &str) -> TopicName {
    TopicName(StrBytes::from_string(topic.to_string()))
}

/// A message `kafka-protocol` could not encode or decode, as an error.
fn protocol<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> Error + Copy + '_ {
    move |e| Error::Kafka(format!("{what}: {e:#}"))
}

/// A broker's error code as an error (`Ok` for 0).
fn check(code: i16, what: impl FnOnce() -> String) -> Result<(), Error> {
    match ResponseError::try_from_code(code) {
        None => Ok(()),
        Some(e) => Err(Error::KafkaBroker {
            what: what(),
            code,
            error: e.to_string(),
        }),
    }
}

/// Whether trying again (after learning the leaders again) may succeed: a broken connection, or
/// an error code Kafka calls retriable (no leader yet, leader moved, topic not yet known).
fn transient(e: &Error) -> bool {
    match e {
        Error::KafkaIo { .. } => true,
        Error::KafkaBroker { code, .. } => {
            ResponseError::try_from_code(*code).is_some_and(|e| e.is_retriable())
        }
        _ => false,
    }
}

/// One connection; one request at a time.
struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    correlation: i32,
}

impl Conn {
    async fn connect(peer: SocketAddr) -> Result<Conn, Error> {
        let io = |source| Error::KafkaIo {
            peer: peer.to_string(),
            source,
        };
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(peer))
            .await
            .map_err(|_| io(std::io::ErrorKind::TimedOut.into()))?
            .map_err(io)?;
        // Small requests, each awaited: Nagle's delay would only add latency.
        stream.set_nodelay(true).map_err(io)?;
        Ok(Conn {
            stream,
            peer,
            correlation: 0,
        })
    }

    /// Sends `req` as `version` and reads its response: frames are a u32 length, then the header
    /// and the body.
    async fn call<R: Request>(&mut self, version: i16, req: &R) -> Result<R::Response, Error> {
        let api =
            ApiKey::try_from(R::KEY).map_or_else(|()| R::KEY.to_string(), |k| format!("{k:?}"));
        let what = format!("{api} v{version}");
        self.correlation = self.correlation.wrapping_add(1);
        let header = RequestHeader::default()
            .with_request_api_key(R::KEY)
            .with_request_api_version(version)
            .with_correlation_id(self.correlation)
            .with_client_id(Some(StrBytes::from_static_str(CLIENT_ID)));
        let encoding = format!("encoding {what}");
        let encode = protocol(&encoding);
        let mut frame = BytesMut::new();
        frame.put_u32(0); // the length, set below
        header
            .encode(&mut frame, R::header_version(version))
            .map_err(encode)?;
        req.encode(&mut frame, version).map_err(encode)?;
        let len = u32::try_from(frame.len() - 4)
            .map_err(|_| Error::Kafka(format!("{what}: request too large")))?;
        frame[..4].copy_from_slice(&len.to_be_bytes());
        let body = tokio::time::timeout(CALL_TIMEOUT, self.exchange(&frame))
            .await
            .map_err(|_| Error::KafkaIo {
                peer: self.peer.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::TimedOut, "no response in 30 s"),
            })??;
        let mut buf = Bytes::from(body);
        let decoding = format!("decoding the {what} response");
        let decode = protocol(&decoding);
        let rh = ResponseHeader::decode(&mut buf, R::Response::header_version(version))
            .map_err(decode)?;
        if rh.correlation_id != self.correlation {
            return Err(Error::Kafka(format!(
                "{what}: response for correlation id {} where {} was expected",
                rh.correlation_id, self.correlation
            )));
        }
        R::Response::decode(&mut buf, version).map_err(decode)
    }

    async fn exchange(&mut self, frame: &[u8]) -> Result<Vec<u8>, Error> {
        let io = |source| Error::KafkaIo {
            peer: self.peer.to_string(),
            source,
        };
        self.stream.write_all(frame).await.map_err(io)?;
        let len = self.stream.read_u32().await.map_err(io)? as usize;
        if len > MAX_FRAME {
            return Err(Error::KafkaFrameTooLarge {
                peer: self.peer,
                len,
            });
        }
        let mut body = vec![0; len];
        self.stream.read_exact(&mut body).await.map_err(io)?;
        Ok(body)
    }
}

/// Creates `topic` with `partitions` partitions (replication 1) on `broker`; Ok if it exists
/// already. Its partitions may lack a leader for a moment after: [`Producer`] and [`consume`]
/// wait for one.
pub async fn create_topic(broker: SocketAddr, topic: &str, partitions: i32) -> Result<(), Error> {
    let req = CreateTopicsRequest::default()
        .with_timeout_ms(10_000)
        .with_topics(vec![
            CreatableTopic::default()
                .with_name(topic_name(topic))
                .with_num_partitions(partitions)
                .with_replication_factor(1),
        ]);
    let mut conn = Conn::connect(broker).await?;
    let resp = conn.call(CREATE_TOPICS_V, &req).await?;
    match resp.topics.first().map_or(0, |t| t.error_code) {
        TOPIC_ALREADY_EXISTS => Ok(()),
        code => check(code, || format!("CreateTopics {topic:?}")),
    }
}

/// The connections and partition leaders of one topic, for the producer and the consumer.
struct Client {
    bootstrap: SocketAddr,
    topic: String,
    conns: HashMap<SocketAddr, Conn>,
    /// Learnt from Metadata when empty; cleared after an error, to be learnt again.
    leaders: BTreeMap<i32, SocketAddr>,
}

impl Client {
    fn new(bootstrap: SocketAddr, topic: &str) -> Client {
        Client {
            bootstrap,
            topic: topic.to_string(),
            conns: HashMap::new(),
            leaders: BTreeMap::new(),
        }
    }

    /// Calls `req` on the connection to `addr` (made if there is none). The connection is out of
    /// the map while in use and goes back only once a whole response was read, so a call
    /// abandoned halfway (its future dropped) or failed leaves no half-read stream behind.
    async fn call<R: Request>(
        &mut self,
        addr: SocketAddr,
        version: i16,
        req: &R,
    ) -> Result<R::Response, Error> {
        let mut conn = match self.conns.remove(&addr) {
            Some(conn) => conn,
            None => Conn::connect(addr).await?,
        };
        let resp = conn.call(version, req).await?;
        self.conns.insert(addr, conn);
        Ok(resp)
    }

    /// Each partition's leader at its advertised address, from Metadata on the bootstrap address.
    async fn learn_leaders(&mut self) -> Result<(), Error> {
        let topic = self.topic.clone();
        let req = MetadataRequest::default()
            .with_topics(Some(vec![
                MetadataRequestTopic::default().with_name(Some(topic_name(&topic))),
            ]))
            .with_allow_auto_topic_creation(false);
        let resp = self.call(self.bootstrap, METADATA_V, &req).await?;
        let t = resp
            .topics
            .iter()
            .find(|t| t.name.as_ref().is_some_and(|n| n.0.as_str() == topic))
            .ok_or_else(|| Error::Kafka(format!("Metadata did not list the topic {topic:?}")))?;
        check(t.error_code, || format!("Metadata for {topic:?}"))?;
        let mut leaders = BTreeMap::new();
        for p in &t.partitions {
            let what = || format!("Metadata for {topic}/{}", p.partition_index);
            check(p.error_code, what)?;
            // A leader Metadata does not list (-1 during an election): as the broker would say.
            let Some(b) = resp.brokers.iter().find(|b| b.node_id == p.leader_id) else {
                return check(LEADER_NOT_AVAILABLE, what);
            };
            let peer = format!("{}:{}", b.host.as_str(), b.port);
            let port = u16::try_from(b.port).unwrap_or(0);
            let addr = tokio::net::lookup_host((b.host.as_str(), port))
                .await
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| Error::KafkaIo {
                    peer,
                    source: std::io::ErrorKind::NotFound.into(),
                })?;
            leaders.insert(p.partition_index, addr);
        }
        if leaders.is_empty() {
            return Err(Error::Kafka(format!(
                "Metadata lists no partition of {topic:?}"
            )));
        }
        self.leaders = leaders;
        Ok(())
    }
}

/// A producer of one topic; cheap to clone (Arc inside), usable from many tasks. It writes one
/// request at a time, each awaited: a demo's rate, not a throughput client.
#[derive(Clone)]
pub struct Producer {
    next: Arc<AtomicUsize>,
    client: Arc<Mutex<Client>>,
}

impl Producer {
    /// Connects lazily; `broker` is a bootstrap address (the producer then uses the partition
    /// leader's address from Metadata).
    pub fn new(broker: SocketAddr, topic: &str) -> Producer {
        Producer {
            next: Arc::new(AtomicUsize::new(0)),
            client: Arc::new(Mutex::new(Client::new(broker, topic))),
        }
    }

    /// Writes one record (acks=all, uncompressed, no key), partitions round-robin; returns
    /// (partition, offset). Reconnects once on a broken connection (a record the broker took
    /// before the connection broke is then written twice: no idempotence); a partition without a
    /// leader yet (a topic just created) is tried again for up to 5 s. Header names must be
    /// distinct (the last of a name is sent).
    pub async fn send(&self, value: &[u8], headers: &[(&str, &[u8])]) -> Result<(i32, i64), Error> {
        let batch = batch(value, headers)?;
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let mut client = self.client.lock().await;
        let (mut reconnected, mut retries) = (false, 0);
        loop {
            match try_send(&mut client, turn, batch.clone()).await {
                Ok(done) => return Ok(done),
                Err(e @ Error::KafkaIo { .. }) if !reconnected => {
                    tracing::debug!(error = %e, "Kafka producer reconnecting");
                    reconnected = true;
                }
                Err(e) if transient(&e) && !matches!(e, Error::KafkaIo { .. }) && retries < 50 => {
                    retries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e),
            }
            client.leaders.clear();
        }
    }
}

async fn try_send(client: &mut Client, turn: usize, batch: Bytes) -> Result<(i32, i64), Error> {
    if client.leaders.is_empty() {
        client.learn_leaders().await?;
    }
    let n = client.leaders.len().max(1);
    let Some((&partition, &leader)) = client.leaders.iter().nth(turn % n) else {
        return Err(Error::Kafka(format!("no partition of {:?}", client.topic)));
    };
    let req = ProduceRequest::default()
        .with_acks(-1)
        .with_timeout_ms(10_000)
        .with_topic_data(vec![
            TopicProduceData::default()
                .with_name(topic_name(&client.topic))
                .with_partition_data(vec![
                    PartitionProduceData::default()
                        .with_index(partition)
                        .with_records(Some(batch)),
                ]),
        ]);
    let resp = client.call(leader, PRODUCE_V, &req).await?;
    let p = resp
        .responses
        .first()
        .and_then(|t| t.partition_responses.first())
        .ok_or_else(|| Error::Kafka("a Produce response without the partition".into()))?;
    check(p.error_code, || {
        format!("Produce to {}/{partition}", client.topic)
    })?;
    Ok((partition, p.base_offset))
}

/// One record as a v2 batch of its own: no producer id (not idempotent), creation time now.
fn batch(value: &[u8], headers: &[(&str, &[u8])]) -> Result<Bytes, Error> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let record = Record {
        transactional: false,
        control: false,
        delete_horizon: false,
        partition_leader_epoch: -1,
        producer_id: -1,
        producer_epoch: -1,
        timestamp_type: TimestampType::Creation,
        offset: 0,
        sequence: -1,
        timestamp: now,
        key: None,
        value: Some(Bytes::copy_from_slice(value)),
        headers: headers
            .iter()
            .map(|(k, v)| {
                (
                    StrBytes::from_string(k.to_string()),
                    Some(Bytes::copy_from_slice(v)),
                )
            })
            .collect(),
    };
    let mut out = BytesMut::new();
    let options = RecordEncodeOptions {
        version: 2,
        compression: Compression::None,
    };
    RecordBatchEncoder::encode(&mut out, std::iter::once(&record), &options)
        .map_err(protocol("encoding a record batch"))?;
    Ok(out.freeze())
}

/// One record a consumer received.
#[derive(Debug, Clone)]
pub struct Handled {
    pub partition: i32,
    pub offset: i64,
    /// The value as UTF-8 (lossy); empty for a null value.
    pub value: String,
    /// In the record's order; a null header value as empty.
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Reads every partition of `topic` from its end as of the call (ListOffsets latest), through
/// `bootstrap` (connecting to each partition leader's advertised address from Metadata, which
/// through Spur's relay is the relay itself), calling `on_record` for every non-control record in
/// offset order per partition, until `token` is cancelled. `ready` is sent once the start offsets
/// are known, so a caller can produce only after.
///
/// Group-less: no consumer group, no committed offsets, every partition read by this one caller;
/// a restart begins at the end again. Reads uncommitted records (isolation level 0: the demo has
/// no transactions). Broken connections and retriable broker errors are retried with a backoff of
/// up to 5 s while not cancelled; other errors end it.
pub async fn consume(
    bootstrap: SocketAddr,
    topic: &str,
    ready: oneshot::Sender<()>,
    token: CancellationToken,
    mut on_record: impl FnMut(Handled) + Send,
) -> Result<(), Error> {
    let mut c = Consumer {
        client: Client::new(bootstrap, topic),
        offsets: BTreeMap::new(),
    };
    let mut ready = Some(ready);
    let mut backoff = Duration::from_millis(100);
    let mut round = 0usize;
    loop {
        round = round.wrapping_add(1);
        let step = async {
            if c.client.leaders.is_empty() {
                c.learn(ready.is_none()).await?;
                if let Some(ready) = ready.take() {
                    // The caller may have stopped waiting: nothing to tell then.
                    let _ = ready.send(());
                }
            }
            c.fetch(round, &mut on_record).await
        };
        let result = tokio::select! {
            () = token.cancelled() => return Ok(()),
            r = step => r,
        };
        match result {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) if transient(&e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "Kafka consumer of {topic:?}: retrying");
                c.client.leaders.clear();
                tokio::select! {
                    () = token.cancelled() => return Ok(()),
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e),
        }
    }
}

struct Consumer {
    client: Client,
    /// The next offset to fetch, per partition; kept across errors.
    offsets: BTreeMap<i32, i64>,
}

impl Consumer {
    /// Learns the leaders, and the start offset of each partition without one: the end at first,
    /// the start for a partition that appears later (`started`), so none of its records is missed.
    async fn learn(&mut self, started: bool) -> Result<(), Error> {
        self.client.learn_leaders().await?;
        let at = if started { EARLIEST } else { LATEST };
        for (partition, leader) in self.client.leaders.clone() {
            if !self.offsets.contains_key(&partition) {
                let offset = self.list_offset(leader, partition, at).await?;
                self.offsets.insert(partition, offset);
            }
        }
        Ok(())
    }

    async fn list_offset(
        &mut self,
        leader: SocketAddr,
        partition: i32,
        at: i64,
    ) -> Result<i64, Error> {
        let topic = self.client.topic.clone();
        let req = ListOffsetsRequest::default()
            .with_replica_id(BrokerId(-1))
            .with_topics(vec![
                ListOffsetsTopic::default()
                    .with_name(topic_name(&topic))
                    .with_partitions(vec![
                        ListOffsetsPartition::default()
                            .with_partition_index(partition)
                            .with_timestamp(at),
                    ]),
            ]);
        let resp = self.client.call(leader, LIST_OFFSETS_V, &req).await?;
        let p = resp
            .topics
            .first()
            .and_then(|t| t.partitions.iter().find(|p| p.partition_index == partition))
            .ok_or_else(|| Error::Kafka("a ListOffsets response without the partition".into()))?;
        check(p.error_code, || format!("ListOffsets {topic}/{partition}"))?;
        Ok(p.offset)
    }

    /// One Fetch per leader, for all the partitions it leads.
    async fn fetch(
        &mut self,
        round: usize,
        on_record: &mut (impl FnMut(Handled) + Send),
    ) -> Result<(), Error> {
        let topic = self.client.topic.clone();
        let mut by_leader: BTreeMap<SocketAddr, Vec<FetchPartition>> = BTreeMap::new();
        for (&partition, &leader) in &self.client.leaders {
            by_leader.entry(leader).or_default().push(
                FetchPartition::default()
                    .with_partition(partition)
                    .with_fetch_offset(self.offsets.get(&partition).copied().unwrap_or(0))
                    .with_partition_max_bytes(PARTITION_MAX_BYTES),
            );
        }
        for (leader, mut partitions) in by_leader {
            // A broker fills a response partition by partition up to its size, and returns a
            // batch larger than the limits whole only in the first partition: rotating the order
            // keeps a busy partition from starving the others and lets such a batch come first.
            let n = partitions.len().max(1);
            partitions.rotate_left(round % n);
            let req = FetchRequest::default()
                .with_replica_id(BrokerId(-1))
                .with_max_wait_ms(FETCH_MAX_WAIT_MS)
                .with_min_bytes(1)
                .with_max_bytes(FETCH_MAX_BYTES)
                .with_isolation_level(0)
                .with_topics(vec![
                    FetchTopic::default()
                        .with_topic(topic_name(&topic))
                        .with_partitions(partitions),
                ]);
            let resp = self.client.call(leader, FETCH_V, &req).await?;
            check(resp.error_code, || format!("Fetch {topic:?}"))?;
            for p in resp.responses.into_iter().flat_map(|t| t.partitions) {
                let partition = p.partition_index;
                if p.error_code == OFFSET_OUT_OF_RANGE {
                    // Records deleted (retention) or the topic recreated: go on from what is left.
                    let start = self.list_offset(leader, partition, EARLIEST).await?;
                    tracing::warn!(
                        topic,
                        partition,
                        start,
                        "Kafka offset out of range: restarting at the earliest"
                    );
                    self.offsets.insert(partition, start);
                    continue;
                }
                check(p.error_code, || format!("Fetch {topic}/{partition}"))?;
                if let Some(offset) = self.offsets.get_mut(&partition) {
                    let records = p.records.unwrap_or_default();
                    *offset = deliver(&topic, partition, *offset, records, on_record)?;
                }
            }
        }
        Ok(())
    }
}

fn be_i32(b: &[u8], at: usize) -> i32 {
    (&b[at..at + 4]).get_i32()
}

/// Hands each non-control record of `records` at `offset` or later to `on_record`; returns the
/// offset to fetch next.
///
/// That offset comes from each batch's header (base offset + last offset delta + 1), not from the
/// records decoded: offsets have gaps (compaction, transaction markers), and the relay sends a
/// batch whose records it withheld all as an empty control batch, whose offsets must be passed
/// too or the same batch would be fetched forever. A batch cut off at the end (the fetch size
/// ended inside it) is left for the next Fetch, which starts at it.
fn deliver(
    topic: &str,
    partition: i32,
    mut offset: i64,
    mut records: Bytes,
    on_record: &mut impl FnMut(Handled),
) -> Result<i64, Error> {
    while records.len() >= BATCH_HEADER_LEN {
        let base = (&records[..8]).get_i64();
        let size = usize::try_from(be_i32(&records, 8))
            .ok()
            .and_then(|len| len.checked_add(12))
            .ok_or_else(|| {
                Error::Kafka(format!("{topic}/{partition}: a batch of negative length"))
            })?;
        if size < BATCH_HEADER_LEN {
            return Err(Error::Kafka(format!(
                "{topic}/{partition}: a batch of {size} bytes at offset {base}, shorter than its header"
            )));
        }
        if size > records.len() {
            break;
        }
        let mut batch = records.split_to(size);
        let magic = batch[16];
        if magic != 2 {
            return Err(Error::Kafka(format!(
                "{topic}/{partition}: message format v{magic} at offset {base} (only v2, Kafka 0.11 and later, is read)"
            )));
        }
        let next = base
            .saturating_add(i64::from(be_i32(&batch, 23)))
            .saturating_add(1);
        let codec = (&batch[21..23]).get_i16() & 7;
        if codec == Compression::Lz4 as i16 || codec == Compression::Zstd as i16 {
            tracing::warn!(
                topic,
                partition,
                base,
                codec,
                "Kafka batch skipped: lz4 and zstd are not read by the demo client"
            );
        } else {
            let set = RecordBatchDecoder::decode(&mut batch).map_err(protocol(&format!(
                "{topic}/{partition}: the batch at {base}"
            )))?;
            for r in set
                .records
                .into_iter()
                .filter(|r| !r.control && r.offset >= offset)
            {
                on_record(Handled {
                    partition,
                    offset: r.offset,
                    value: r
                        .value
                        .map(|v| String::from_utf8_lossy(&v).into_owned())
                        .unwrap_or_default(),
                    headers: r
                        .headers
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), v.map(|v| v.to_vec()).unwrap_or_default()))
                        .collect(),
                });
            }
        }
        offset = offset.max(next);
    }
    Ok(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-record batch of `value` at `base` (the base offset is outside the batch's CRC).
    fn at(base: i64, value: &str) -> Vec<u8> {
        let mut b = batch(value.as_bytes(), &[("baggage", b"k=v")])
            .unwrap()
            .to_vec();
        b[..8].copy_from_slice(&base.to_be_bytes());
        b
    }

    #[test]
    fn offsets_come_from_batch_headers_and_a_cut_off_batch_waits() {
        let (first, second) = (at(5, "a"), at(9, "b"));
        let mut seen = Vec::new();
        let mut cut = first.clone();
        cut.extend_from_slice(&second[..second.len() - 3]);
        let next = deliver("t", 0, 5, cut.into(), &mut |h| seen.push(h)).unwrap();
        assert_eq!(
            next, 6,
            "past the whole batch; the cut-off one left for the next Fetch"
        );
        let whole = [first, second].concat();
        // Records before the fetch offset (a batch starting earlier) are not handed on again.
        let next = deliver("t", 0, next, whole.into(), &mut |h| seen.push(h)).unwrap();
        assert_eq!(next, 10, "past the gap and the second batch");
        let got: Vec<_> = seen.iter().map(|h| (h.offset, h.value.as_str())).collect();
        assert_eq!(got, [(5, "a"), (9, "b")]);
        assert_eq!(seen[1].headers, [("baggage".to_string(), b"k=v".to_vec())]);
    }

    /// A batch whose length field is shorter than a batch header is an error, not a panic.
    #[test]
    fn a_batch_shorter_than_its_header_is_refused() {
        for len in [0i32, 1, 48] {
            let mut b = at(5, "a");
            b[8..12].copy_from_slice(&len.to_be_bytes());
            let err = deliver("t", 0, 5, b.into(), &mut |_| {}).unwrap_err();
            assert!(err.to_string().contains("shorter than its header"), "{err}");
        }
    }
}
