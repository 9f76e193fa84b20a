//! One client connection to one broker, as the sidecar relays it: requests and responses pass
//! through [`Session::request`] and [`Session::response`] frame by frame (without their size).
//!
//! Most frames pass as they are, after an 8-byte peek. Decoded (with the `kafka-protocol` crate)
//! and written again are only:
//! - **ApiVersions responses**, whose ranges are narrowed, for every API this module decodes, to
//!   the versions the crate can decode, so a client never picks one the relay cannot read;
//! - **Fetch responses**, whose records are filtered ([`crate::filter`]) by the caller's decision;
//! - on a fork's connections, **every request that names a consumer group or a transactional
//!   id** (group membership, offsets, transactions, Produce), renamed with [`fork_id`] so the fork
//!   never joins the baseline's group or fences its producer, and the responses that echo a
//!   group id (FindCoordinator v4+, OffsetFetch v8+, DescribeGroups), renamed back;
//! - with `advertise` or `front` set (explicit listeners: the loopback tests, the standalone
//!   demo), **Metadata and FindCoordinator responses**, whose broker addresses are replaced. A
//!   transparent relay keeps each connection's original destination and needs no such rewrite.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use kafka_protocol::messages::{
    AddOffsetsToTxnRequest, AddOffsetsToTxnResponse, AddPartitionsToTxnRequest,
    AddPartitionsToTxnResponse, ApiKey, ApiVersionsRequest, ApiVersionsResponse,
    ConsumerGroupDescribeRequest, ConsumerGroupDescribeResponse, ConsumerGroupHeartbeatRequest,
    ConsumerGroupHeartbeatResponse, DeleteGroupsRequest, DeleteGroupsResponse,
    DescribeGroupsRequest, DescribeGroupsResponse, EndTxnRequest, EndTxnResponse, FetchRequest,
    FetchResponse, FindCoordinatorRequest, FindCoordinatorResponse, HeartbeatRequest,
    HeartbeatResponse, InitProducerIdRequest, InitProducerIdResponse, JoinGroupRequest,
    JoinGroupResponse, LeaveGroupRequest, LeaveGroupResponse, MetadataRequest, MetadataResponse,
    OffsetCommitRequest, OffsetCommitResponse, OffsetDeleteRequest, OffsetDeleteResponse,
    OffsetFetchRequest, OffsetFetchResponse, ProduceRequest, ProduceResponse, RequestHeader,
    ResponseHeader, SyncGroupRequest, SyncGroupResponse, TxnOffsetCommitRequest,
    TxnOffsetCommitResponse,
};
use kafka_protocol::protocol::{Decodable, Encodable, Message, StrBytes, VersionRange};

use crate::Error;
use crate::batch::BatchHeader;
use crate::filter::{self, Limits, Stats};
use crate::records::Record;

/// Requests in flight on one connection at most (librdkafka allows a million by default; each
/// entry is 8 bytes).
pub const MAX_IN_FLIGHT: usize = 1 << 16;

/// Whose consumer the connection belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// The shared baseline: group and transactional ids pass unchanged.
    Baseline,
    /// A fork in a sandbox: group and transactional ids are renamed with [`fork_id`].
    Fork { sandbox: String },
}

/// The group (or transactional) id a fork in `sandbox` uses in place of `id`.
pub fn fork_id(id: &str, sandbox: &str) -> String {
    format!("{id}.spur-sandbox.{sandbox}")
}

/// The id a fork's renamed id stands for; `None` if `id` is not one of `sandbox`'s.
pub fn unfork_id<'a>(id: &'a str, sandbox: &str) -> Option<&'a str> {
    id.strip_suffix(sandbox)?.strip_suffix(".spur-sandbox.")
}

#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub role: Role,
    pub limits: Limits,
    /// Broker addresses to advertise in place of the broker's own, by node id (explicit
    /// listeners only).
    pub advertise: Vec<(i32, String, i32)>,
    /// An explicit relay in front of a cluster of one broker (`spur-sidecar --kafka-broker`):
    /// whatever the broker's node id, it is advertised as this host and port. A Metadata
    /// response that names more than one broker is refused: the relay reaches only the one, and
    /// a client told the others' own addresses would bypass it.
    pub front: Option<(String, i32)>,
    /// Topic names by id, shared by a relay's connections (Fetch v13+ names topics by id).
    pub topics: crate::TopicNames,
}

/// Counters of one connection, summed by the caller into its metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionStats {
    pub records: Stats,
    /// The same record counters by topic name (empty: a topic id no Metadata response named),
    /// one entry per topic.
    pub topics: Vec<(Arc<str>, Stats)>,
    /// Group and transactional ids renamed, both ways.
    pub ids_renamed: u64,
    pub fetch_responses: u64,
}

impl SessionStats {
    pub fn add(&mut self, o: &SessionStats) {
        self.records.add(&o.records);
        for (topic, stats) in &o.topics {
            self.add_topic(topic, stats);
        }
        self.ids_renamed += o.ids_renamed;
        self.fetch_responses += o.fetch_responses;
    }

    fn add_topic(&mut self, topic: &Arc<str>, stats: &Stats) {
        // A handful of topics per connection: a scan beats a map.
        match self.topics.iter_mut().find(|(t, _)| t == topic) {
            Some((_, s)) => s.add(stats),
            None => self.topics.push((topic.clone(), *stats)),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    correlation: i32,
    api: i16,
    version: i16,
}

/// The relay state of one connection, both directions. A relay that runs the two directions
/// concurrently [`Session::split`]s it: the halves share only the queue of requests awaiting a
/// response (a lock held to push or pop one entry), so filtering a large Fetch response never
/// holds up the client's requests.
#[derive(Debug)]
pub struct Session {
    requests: Requests,
    responses: Responses,
}

/// The client-to-broker half of a [`Session`].
#[derive(Debug)]
pub struct Requests(Side);

/// The broker-to-client half of a [`Session`].
#[derive(Debug)]
pub struct Responses(Side);

#[derive(Debug)]
struct Side {
    cfg: Arc<SessionConfig>,
    pending: Arc<Mutex<VecDeque<Pending>>>,
    stats: SessionStats,
}

/// The versions of `api` whose request and response this module can both decode, for the APIs
/// it decodes (their ranges in ApiVersions are narrowed to these); `None` for the others. The
/// crate's `ApiKey::valid_versions` is not enough: for some APIs its request types stop a version
/// below the range it lists (OffsetCommit and OffsetFetch at 9 of 10, InitProducerId at 5 of 6).
fn decodable(api: ApiKey) -> Option<VersionRange> {
    fn both<Q: Message, R: Message>() -> Option<VersionRange> {
        let (q, r) = (Q::VERSIONS, R::VERSIONS);
        Some(VersionRange {
            min: q.min.max(r.min),
            max: q.max.min(r.max),
        })
    }
    match api {
        ApiKey::Produce => both::<ProduceRequest, ProduceResponse>(),
        ApiKey::Fetch => both::<FetchRequest, FetchResponse>(),
        ApiKey::Metadata => both::<MetadataRequest, MetadataResponse>(),
        ApiKey::OffsetCommit => both::<OffsetCommitRequest, OffsetCommitResponse>(),
        ApiKey::OffsetFetch => both::<OffsetFetchRequest, OffsetFetchResponse>(),
        ApiKey::FindCoordinator => both::<FindCoordinatorRequest, FindCoordinatorResponse>(),
        ApiKey::JoinGroup => both::<JoinGroupRequest, JoinGroupResponse>(),
        ApiKey::Heartbeat => both::<HeartbeatRequest, HeartbeatResponse>(),
        ApiKey::LeaveGroup => both::<LeaveGroupRequest, LeaveGroupResponse>(),
        ApiKey::SyncGroup => both::<SyncGroupRequest, SyncGroupResponse>(),
        ApiKey::DescribeGroups => both::<DescribeGroupsRequest, DescribeGroupsResponse>(),
        ApiKey::DeleteGroups => both::<DeleteGroupsRequest, DeleteGroupsResponse>(),
        ApiKey::InitProducerId => both::<InitProducerIdRequest, InitProducerIdResponse>(),
        ApiKey::AddPartitionsToTxn => {
            both::<AddPartitionsToTxnRequest, AddPartitionsToTxnResponse>()
        }
        ApiKey::AddOffsetsToTxn => both::<AddOffsetsToTxnRequest, AddOffsetsToTxnResponse>(),
        ApiKey::EndTxn => both::<EndTxnRequest, EndTxnResponse>(),
        ApiKey::TxnOffsetCommit => both::<TxnOffsetCommitRequest, TxnOffsetCommitResponse>(),
        ApiKey::OffsetDelete => both::<OffsetDeleteRequest, OffsetDeleteResponse>(),
        ApiKey::ConsumerGroupHeartbeat => {
            both::<ConsumerGroupHeartbeatRequest, ConsumerGroupHeartbeatResponse>()
        }
        ApiKey::ConsumerGroupDescribe => {
            both::<ConsumerGroupDescribeRequest, ConsumerGroupDescribeResponse>()
        }
        ApiKey::ApiVersions => both::<ApiVersionsRequest, ApiVersionsResponse>(),
        _ => None,
    }
}

fn peek(frame: &[u8]) -> Option<(i16, i16, i32)> {
    let h = frame.first_chunk::<8>()?;
    Some((
        i16::from_be_bytes([h[0], h[1]]),
        i16::from_be_bytes([h[2], h[3]]),
        i32::from_be_bytes([h[4], h[5], h[6], h[7]]),
    ))
}

fn api_name(api: i16) -> String {
    ApiKey::try_from(api).map_or_else(|()| format!("api {api}"), |k| format!("{k:?}"))
}

fn message_error(api: i16, version: i16, side: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Message {
        api: api_name(api),
        version,
        side,
        reason: e.to_string(),
    }
}

/// A decoded request: its header and body, written again after a rewrite.
struct Req<M> {
    header: RequestHeader,
    body: M,
    header_version: i16,
    version: i16,
}

impl<M: Decodable + Encodable> Req<M> {
    fn decode(api: ApiKey, version: i16, frame: &Bytes) -> Result<Self, Error> {
        let err = |e: anyhow::Error| message_error(api as i16, version, "request", e);
        let header_version = api.request_header_version(version);
        let mut buf = frame.clone();
        let header = RequestHeader::decode(&mut buf, header_version).map_err(err)?;
        let body = M::decode(&mut buf, version).map_err(err)?;
        if !buf.is_empty() {
            return Err(message_error(
                api as i16,
                version,
                "request",
                format!("{} bytes after the body", buf.len()),
            ));
        }
        Ok(Req {
            header,
            body,
            header_version,
            version,
        })
    }

    fn encode(&self) -> Result<Bytes, Error> {
        let api = self.header.request_api_key;
        let err = |e: anyhow::Error| message_error(api, self.version, "request", e);
        let mut out = BytesMut::new();
        self.header
            .encode(&mut out, self.header_version)
            .map_err(err)?;
        self.body.encode(&mut out, self.version).map_err(err)?;
        Ok(out.freeze())
    }
}

fn decode_response<M: Decodable>(
    api: ApiKey,
    version: i16,
    frame: &Bytes,
) -> Result<(ResponseHeader, M), Error> {
    let err = |e: anyhow::Error| message_error(api as i16, version, "response", e);
    let mut buf = frame.clone();
    let header =
        ResponseHeader::decode(&mut buf, api.response_header_version(version)).map_err(err)?;
    let body = M::decode(&mut buf, version).map_err(err)?;
    if !buf.is_empty() {
        return Err(message_error(
            api as i16,
            version,
            "response",
            format!("{} bytes after the body", buf.len()),
        ));
    }
    Ok((header, body))
}

fn encode_response<M: Encodable>(
    api: ApiKey,
    version: i16,
    header: &ResponseHeader,
    body: &M,
) -> Result<Bytes, Error> {
    let err = |e: anyhow::Error| message_error(api as i16, version, "response", e);
    let mut out = BytesMut::new();
    header
        .encode(&mut out, api.response_header_version(version))
        .map_err(err)?;
    body.encode(&mut out, version).map_err(err)?;
    Ok(out.freeze())
}

impl Session {
    pub fn new(cfg: SessionConfig) -> Session {
        let cfg = Arc::new(cfg);
        let pending = Arc::new(Mutex::new(VecDeque::new()));
        let side = |cfg: &Arc<SessionConfig>, pending: &Arc<Mutex<VecDeque<Pending>>>| Side {
            cfg: cfg.clone(),
            pending: pending.clone(),
            stats: SessionStats::default(),
        };
        Session {
            requests: Requests(side(&cfg, &pending)),
            responses: Responses(side(&cfg, &pending)),
        }
    }

    /// The two halves, for a relay that runs each direction on its own.
    pub fn split(self) -> (Requests, Responses) {
        (self.requests, self.responses)
    }

    /// See [`Requests::request`].
    pub fn request(&mut self, frame: Bytes) -> Result<Bytes, Error> {
        self.requests.request(frame)
    }

    /// See [`Responses::response`].
    pub fn response(
        &mut self,
        frame: Bytes,
        keep: impl FnMut(&str, &BatchHeader, &Record<'_>) -> bool,
    ) -> Result<Bytes, Error> {
        self.responses.response(frame, keep)
    }

    /// Both halves' counters since the last call, reset.
    pub fn take_stats(&mut self) -> SessionStats {
        let mut s = self.requests.take_stats();
        s.add(&self.responses.take_stats());
        s
    }
}

impl Requests {
    /// A request from the client, to send on to the broker.
    pub fn request(&mut self, frame: Bytes) -> Result<Bytes, Error> {
        self.0.request(frame)
    }

    /// The counters since the last call, reset.
    pub fn take_stats(&mut self) -> SessionStats {
        std::mem::take(&mut self.0.stats)
    }
}

impl Responses {
    /// A response from the broker, to send on to the client. `keep` decides, for a Fetch
    /// response, which records the client receives; it is told each record's topic (empty when
    /// the topic's id was never named in a Metadata response this relay saw).
    pub fn response(
        &mut self,
        frame: Bytes,
        keep: impl FnMut(&str, &BatchHeader, &Record<'_>) -> bool,
    ) -> Result<Bytes, Error> {
        self.0.response(frame, keep)
    }

    /// Whether `frame` (a whole response frame, not yet passed to [`Self::response`]) answers
    /// a Fetch request, i.e. may carry records to decide. A relay that waits before deciding
    /// (route history) waits for these only.
    pub fn answers_fetch(&self, frame: &[u8]) -> bool {
        let Some(correlation) = frame.first_chunk::<4>().map(|c| i32::from_be_bytes(*c)) else {
            return false;
        };
        self.0
            .pending()
            .front()
            .is_some_and(|p| p.correlation == correlation && p.api == ApiKey::Fetch as i16)
    }

    /// The counters since the last call, reset.
    pub fn take_stats(&mut self) -> SessionStats {
        std::mem::take(&mut self.0.stats)
    }
}

impl Side {
    fn pending(&self) -> std::sync::MutexGuard<'_, VecDeque<Pending>> {
        // A panic elsewhere cannot leave the queue half-written: push and pop are single calls.
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn sandbox(&self) -> Option<&str> {
        match &self.cfg.role {
            Role::Fork { sandbox } => Some(sandbox),
            Role::Baseline => None,
        }
    }

    /// Renames `id` for the fork (counted); unchanged for the baseline.
    fn rename(&mut self, id: &mut StrBytes) {
        if let Some(sandbox) = self.sandbox() {
            let renamed = fork_id(id, sandbox);
            *id = StrBytes::from_string(renamed);
            self.stats.ids_renamed += 1;
        }
    }

    /// Renames a fork's id back where a response echoes it.
    fn restore(&mut self, id: &mut StrBytes) {
        if let Some(sandbox) = self.sandbox()
            && let Some(original) = unfork_id(id, sandbox)
        {
            let original = StrBytes::from_string(original.to_string());
            *id = original;
            self.stats.ids_renamed += 1;
        }
    }

    fn request(&mut self, frame: Bytes) -> Result<Bytes, Error> {
        let Some((api, version, correlation)) = peek(&frame) else {
            return Err(Error::Frame {
                reason: format!(
                    "request of {} bytes, shorter than a request header",
                    frame.len()
                ),
            });
        };
        let mut expects_response = true;
        let out = match ApiKey::try_from(api) {
            Ok(ApiKey::Produce) => {
                let mut req = Req::<ProduceRequest>::decode(ApiKey::Produce, version, &frame)?;
                expects_response = req.body.acks != 0;
                match (&mut req.body.transactional_id, self.sandbox().is_some()) {
                    (Some(id), true) => {
                        self.rename(&mut id.0);
                        req.encode()?
                    }
                    _ => frame,
                }
            }
            Ok(key) if self.sandbox().is_some() => self.rename_request(key, version, frame)?,
            _ => frame,
        };
        if expects_response {
            let mut pending = self.pending();
            if pending.len() >= MAX_IN_FLIGHT {
                return Err(Error::Protocol {
                    reason: format!("more than {MAX_IN_FLIGHT} requests in flight"),
                });
            }
            pending.push_back(Pending {
                correlation,
                api,
                version,
            });
        }
        Ok(out)
    }

    /// A fork's request that names a group or transactional id, renamed; others unchanged.
    fn rename_request(&mut self, key: ApiKey, version: i16, frame: Bytes) -> Result<Bytes, Error> {
        macro_rules! rename {
            ($ty:ty, |$s:ident, $b:ident| $body:expr) => {{
                let mut req = Req::<$ty>::decode(key, version, &frame)?;
                let $b = &mut req.body;
                let $s = &mut *self;
                $body;
                req.encode()
            }};
        }
        match key {
            ApiKey::FindCoordinator => rename!(FindCoordinatorRequest, |s, b| {
                // 0: a group, 1: a transactional id; share groups (2) are left alone.
                // Only the field of this version: the encoder refuses a value in the other.
                if b.key_type == 0 || b.key_type == 1 {
                    if version < 4 {
                        s.rename(&mut b.key);
                    }
                    for k in &mut b.coordinator_keys {
                        s.rename(k);
                    }
                }
            }),
            ApiKey::JoinGroup => rename!(JoinGroupRequest, |s, b| s.rename(&mut b.group_id.0)),
            ApiKey::SyncGroup => rename!(SyncGroupRequest, |s, b| s.rename(&mut b.group_id.0)),
            ApiKey::Heartbeat => rename!(HeartbeatRequest, |s, b| s.rename(&mut b.group_id.0)),
            ApiKey::LeaveGroup => rename!(LeaveGroupRequest, |s, b| s.rename(&mut b.group_id.0)),
            ApiKey::OffsetCommit => {
                rename!(OffsetCommitRequest, |s, b| s.rename(&mut b.group_id.0))
            }
            ApiKey::OffsetDelete => {
                rename!(OffsetDeleteRequest, |s, b| s.rename(&mut b.group_id.0))
            }
            ApiKey::ConsumerGroupHeartbeat => {
                rename!(ConsumerGroupHeartbeatRequest, |s, b| s
                    .rename(&mut b.group_id.0))
            }
            ApiKey::OffsetFetch => rename!(OffsetFetchRequest, |s, b| {
                if version < 8 {
                    s.rename(&mut b.group_id.0);
                }
                for g in &mut b.groups {
                    s.rename(&mut g.group_id.0);
                }
            }),
            ApiKey::DescribeGroups => rename!(DescribeGroupsRequest, |s, b| {
                for g in &mut b.groups {
                    s.rename(&mut g.0);
                }
            }),
            // Without these a fork's admin call would reach the baseline's group: delete it (once
            // empty) or describe it.
            ApiKey::DeleteGroups => rename!(DeleteGroupsRequest, |s, b| {
                for g in &mut b.groups_names {
                    s.rename(&mut g.0);
                }
            }),
            ApiKey::ConsumerGroupDescribe => rename!(ConsumerGroupDescribeRequest, |s, b| {
                for g in &mut b.group_ids {
                    s.rename(&mut g.0);
                }
            }),
            ApiKey::TxnOffsetCommit => rename!(TxnOffsetCommitRequest, |s, b| {
                s.rename(&mut b.transactional_id.0);
                s.rename(&mut b.group_id.0);
            }),
            ApiKey::AddOffsetsToTxn => rename!(AddOffsetsToTxnRequest, |s, b| {
                s.rename(&mut b.transactional_id.0);
                s.rename(&mut b.group_id.0);
            }),
            ApiKey::InitProducerId => rename!(InitProducerIdRequest, |s, b| {
                if let Some(id) = &mut b.transactional_id {
                    s.rename(&mut id.0);
                }
            }),
            ApiKey::AddPartitionsToTxn => rename!(AddPartitionsToTxnRequest, |s, b| {
                if version < 4 {
                    s.rename(&mut b.v3_and_below_transactional_id.0);
                }
                for t in &mut b.transactions {
                    s.rename(&mut t.transactional_id.0);
                }
            }),
            ApiKey::EndTxn => rename!(EndTxnRequest, |s, b| s.rename(&mut b.transactional_id.0)),
            _ => Ok(frame),
        }
    }

    fn learn_topics(&self, body: &MetadataResponse) {
        for t in &body.topics {
            if let Some(name) = &t.name {
                self.cfg
                    .topics
                    .learn(t.topic_id.as_bytes(), name.0.as_str());
            }
        }
    }

    fn response(
        &mut self,
        frame: Bytes,
        keep: impl FnMut(&str, &BatchHeader, &Record<'_>) -> bool,
    ) -> Result<Bytes, Error> {
        let Some(correlation) = frame.first_chunk::<4>().map(|c| i32::from_be_bytes(*c)) else {
            return Err(Error::Frame {
                reason: format!(
                    "response of {} bytes, shorter than a response header",
                    frame.len()
                ),
            });
        };
        let Some(p) = self.pending().pop_front() else {
            return Err(Error::Protocol {
                reason: format!("a response (correlation id {correlation}) to no request"),
            });
        };
        if p.correlation != correlation {
            return Err(Error::Protocol {
                reason: format!(
                    "response correlation id {correlation} where {} ({} v{}) was next",
                    p.correlation,
                    api_name(p.api),
                    p.version
                ),
            });
        }
        let Ok(key) = ApiKey::try_from(p.api) else {
            return Ok(frame);
        };
        let v = p.version;
        // A fork's response that echoes group ids in `$list[].group_id`: renamed back.
        macro_rules! restore {
            ($ty:ty, $list:ident) => {{
                let (header, mut body) = decode_response::<$ty>(key, v, &frame)?;
                for g in &mut body.$list {
                    self.restore(&mut g.group_id.0);
                }
                encode_response(key, v, &header, &body)
            }};
        }
        match key {
            ApiKey::ApiVersions => self.api_versions(v, frame),
            ApiKey::Fetch => {
                let (header, mut body) = decode_response::<FetchResponse>(key, v, &frame)?;
                self.stats.fetch_responses += 1;
                let mut keep = keep;
                let mut changed = false;
                for topic in &mut body.responses {
                    // Fetch v13 and later name topics by id only.
                    let name: Arc<str> = if v >= 13 {
                        self.cfg
                            .topics
                            .name(topic.topic_id.as_bytes())
                            .unwrap_or_else(|| Arc::from(""))
                    } else {
                        Arc::from(topic.topic.0.as_str())
                    };
                    for part in &mut topic.partitions {
                        if let Some(records) = &part.records
                            && !records.is_empty()
                        {
                            let out = filter::filter(records, &self.cfg.limits, |h, r| {
                                keep(&name, h, r)
                            })?;
                            self.stats.records.add(&out.stats);
                            self.stats.add_topic(&name, &out.stats);
                            // The filter hands back the same bytes when it removed nothing.
                            changed |= out.records.as_ptr() != records.as_ptr()
                                || out.records.len() != records.len();
                            part.records = Some(out.records);
                        }
                    }
                }
                if !changed {
                    // Nothing removed: the response goes on as it came, not written again.
                    return Ok(frame);
                }
                encode_response(key, v, &header, &body)
            }
            ApiKey::Metadata if self.cfg.advertise.is_empty() && self.cfg.front.is_none() => {
                // Read only to learn topic names (v10 and later carry topic ids); the frame goes
                // on as it came. One that does not decode goes on too, as Metadata did before
                // names were read from it: the client judges it, the relay has nothing to change.
                if v >= 10
                    && let Ok((_, body)) = decode_response::<MetadataResponse>(key, v, &frame)
                {
                    self.learn_topics(&body);
                }
                Ok(frame)
            }
            ApiKey::Metadata => {
                let (header, mut body) = decode_response::<MetadataResponse>(key, v, &frame)?;
                if self.cfg.front.is_some() && body.brokers.len() > 1 {
                    return Err(Error::Message {
                        api: "Metadata".into(),
                        version: v,
                        side: "response",
                        reason: format!(
                            "names {} brokers, but this explicit relay fronts one (--kafka-broker); a cluster of several needs transparent interception (--kafka-ports)",
                            body.brokers.len()
                        ),
                    });
                }
                self.learn_topics(&body);
                for b in &mut body.brokers {
                    if let Some((host, port)) = self.advertised(b.node_id.0) {
                        b.host = host;
                        b.port = port;
                    }
                }
                encode_response(key, v, &header, &body)
            }
            ApiKey::FindCoordinator
                if self.sandbox().is_some()
                    || !self.cfg.advertise.is_empty()
                    || self.cfg.front.is_some() =>
            {
                let (header, mut body) =
                    decode_response::<FindCoordinatorResponse>(key, v, &frame)?;
                // v4 and later answer in `coordinators` only: the top-level fields do not exist
                // there, and the encoder refuses a response that sets them.
                if v <= 3
                    && body.error_code == 0
                    && let Some((host, port)) = self.advertised(body.node_id.0)
                {
                    body.host = host;
                    body.port = port;
                }
                for c in &mut body.coordinators {
                    self.restore(&mut c.key);
                    if c.error_code == 0
                        && let Some((host, port)) = self.advertised(c.node_id.0)
                    {
                        c.host = host;
                        c.port = port;
                    }
                }
                encode_response(key, v, &header, &body)
            }
            ApiKey::OffsetFetch if self.sandbox().is_some() && v >= 8 => {
                restore!(OffsetFetchResponse, groups)
            }
            ApiKey::DeleteGroups if self.sandbox().is_some() => {
                restore!(DeleteGroupsResponse, results)
            }
            ApiKey::ConsumerGroupDescribe if self.sandbox().is_some() => {
                restore!(ConsumerGroupDescribeResponse, groups)
            }
            ApiKey::DescribeGroups if self.sandbox().is_some() => {
                restore!(DescribeGroupsResponse, groups)
            }
            _ => Ok(frame),
        }
    }

    fn advertised(&self, node: i32) -> Option<(StrBytes, i32)> {
        // -1: no broker (an error answer); it keeps its empty address.
        if node < 0 {
            return None;
        }
        if let Some((host, port)) = &self.cfg.front {
            return Some((StrBytes::from_string(host.clone()), *port));
        }
        self.cfg
            .advertise
            .iter()
            .find(|(n, _, _)| *n == node)
            .map(|(_, host, port)| (StrBytes::from_string(host.clone()), *port))
    }

    /// Narrows the decoded APIs' version ranges to the crate's. A response that does not decode
    /// at the version asked (a broker answers an ApiVersions version it does not support with a
    /// v0 error response) passes unchanged: it lists no version the client will use before
    /// asking again.
    fn api_versions(&mut self, version: i16, frame: Bytes) -> Result<Bytes, Error> {
        let key = ApiKey::ApiVersions;
        let Ok((header, mut body)) = decode_response::<ApiVersionsResponse>(key, version, &frame)
        else {
            return Ok(frame);
        };
        body.api_keys.retain_mut(|a| {
            let Some(ours) = ApiKey::try_from(a.api_key).ok().and_then(decodable) else {
                return true;
            };
            a.min_version = a.min_version.max(ours.min);
            a.max_version = a.max_version.min(ours.max);
            a.min_version <= a.max_version
        });
        encode_response(key, version, &header, &body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(role: Role) -> Session {
        Session::new(SessionConfig {
            role,
            limits: Limits::default(),
            advertise: Vec::new(),
            front: None,
            topics: crate::TopicNames::default(),
        })
    }

    /// A Fetch v11 request header (the body is not read): api key 1, version 11, `correlation`.
    fn fetch_request(correlation: i32) -> Bytes {
        let mut f = Vec::new();
        f.extend_from_slice(&1i16.to_be_bytes());
        f.extend_from_slice(&11i16.to_be_bytes());
        f.extend_from_slice(&correlation.to_be_bytes());
        f.extend_from_slice(&(-1i16).to_be_bytes()); // null client id
        Bytes::from(f)
    }

    #[test]
    fn a_declared_count_larger_than_the_frame_is_an_error() {
        let mut s = session(Role::Baseline);
        s.request(fetch_request(7)).unwrap();
        // Fetch v11 response: correlation id, throttle, error, session, then 2^31 - 1 topics in
        // a frame of 18 bytes. Released kafka-protocol 0.18.0 reserves them all first (and
        // aborts); the vendored copy refuses the count.
        let mut f = Vec::new();
        f.extend_from_slice(&7i32.to_be_bytes());
        f.extend_from_slice(&0i32.to_be_bytes());
        f.extend_from_slice(&0i16.to_be_bytes());
        f.extend_from_slice(&0i32.to_be_bytes());
        f.extend_from_slice(&i32::MAX.to_be_bytes());
        let err = s.response(Bytes::from(f), |_, _, _| true).unwrap_err();
        assert!(err.to_string().contains("bytes left"), "{err}");
    }

    #[test]
    fn responses_must_answer_the_next_request() {
        let mut s = session(Role::Baseline);
        assert!(matches!(
            s.response(Bytes::from_static(&[0, 0, 0, 1]), |_, _, _| true),
            Err(Error::Protocol { .. })
        ));
        s.request(fetch_request(1)).unwrap();
        s.request(fetch_request(2)).unwrap();
        let err = s
            .response(Bytes::from_static(&[0, 0, 0, 2]), |_, _, _| true)
            .unwrap_err();
        assert!(err.to_string().contains("where 1"), "{err}");
        assert!(s.request(Bytes::from_static(&[0, 1, 0])).is_err());
    }

    #[test]
    fn a_relay_can_tell_which_responses_answer_a_fetch() {
        let (mut requests, responses) = session(Role::Baseline).split();
        assert!(
            !responses.answers_fetch(&[0, 0, 0, 1, 9]),
            "nothing pending"
        );
        requests.request(fetch_request(1)).unwrap();
        assert!(responses.answers_fetch(&[0, 0, 0, 1, 9]));
        assert!(
            !responses.answers_fetch(&[0, 0, 0, 2]),
            "not the next response"
        );
        assert!(!responses.answers_fetch(&[0, 0]), "too short to say");
        // An ApiVersions request (api 18) is not a Fetch.
        let (mut requests, responses) = session(Role::Baseline).split();
        requests
            .request(Bytes::from_static(&[0, 18, 0, 0, 0, 0, 0, 3, 0xff, 0xff]))
            .unwrap();
        assert!(!responses.answers_fetch(&[0, 0, 0, 3]));
    }

    #[test]
    fn narrowed_ranges_are_decodable_both_ways() {
        for api in ApiKey::iter() {
            let Some(r) = decodable(api) else { continue };
            assert!(r.min <= r.max, "{api:?}: {r:?}");
            let listed = api.valid_versions();
            assert!(listed.min <= r.min && r.max <= listed.max, "{api:?}: {r:?}");
        }
        // The crate lists OffsetCommit up to 10, but its request type stops at 9.
        assert_eq!(decodable(ApiKey::OffsetCommit).map(|r| r.max), Some(9));
        assert_eq!(decodable(ApiKey::ListOffsets), None);
    }

    /// `body` as a request frame of `version` (correlation id 5).
    fn request_frame<M: Encodable + kafka_protocol::protocol::Request>(
        body: &M,
        version: i16,
    ) -> Bytes {
        let header = RequestHeader::default()
            .with_request_api_key(M::KEY)
            .with_request_api_version(version)
            .with_correlation_id(5);
        let mut out = BytesMut::new();
        let key = ApiKey::try_from(M::KEY).unwrap();
        header
            .encode(&mut out, key.request_header_version(version))
            .unwrap();
        body.encode(&mut out, version).unwrap();
        out.freeze()
    }

    #[test]
    fn a_fork_deletes_and_describes_only_its_own_groups() {
        use kafka_protocol::messages::GroupId;
        use kafka_protocol::messages::delete_groups_response::DeletableGroupResult;

        let group = || GroupId(StrBytes::from_static_str("orders"));
        let renamed = || GroupId(StrBytes::from_static_str("orders.spur-sandbox.sbx1"));
        for role in [
            Role::Baseline,
            Role::Fork {
                sandbox: "sbx1".into(),
            },
        ] {
            let fork = role != Role::Baseline;
            let mut s = session(role);
            let req = DeleteGroupsRequest::default().with_groups_names(vec![group()]);
            let sent = s.request(request_frame(&req, 2)).unwrap();
            let (_, got) = {
                let mut b = sent.clone();
                let h =
                    RequestHeader::decode(&mut b, ApiKey::DeleteGroups.request_header_version(2))
                        .unwrap();
                (h, DeleteGroupsRequest::decode(&mut b, 2).unwrap())
            };
            let want = if fork { renamed() } else { group() };
            assert_eq!(got.groups_names, vec![want.clone()]);

            // The broker answers for the id it was sent; the app sees its own.
            let resp = DeleteGroupsResponse::default()
                .with_results(vec![DeletableGroupResult::default().with_group_id(want)]);
            let mut frame = BytesMut::new();
            ResponseHeader::default()
                .with_correlation_id(5)
                .encode(&mut frame, ApiKey::DeleteGroups.response_header_version(2))
                .unwrap();
            resp.encode(&mut frame, 2).unwrap();
            let out = s.response(frame.freeze(), |_, _, _| true).unwrap();
            let mut b = out;
            ResponseHeader::decode(&mut b, ApiKey::DeleteGroups.response_header_version(2))
                .unwrap();
            let back = DeleteGroupsResponse::decode(&mut b, 2).unwrap();
            assert_eq!(back.results[0].group_id, group());

            let req = ConsumerGroupDescribeRequest::default().with_group_ids(vec![group()]);
            let sent = s.request(request_frame(&req, 0)).unwrap();
            let mut b = sent;
            RequestHeader::decode(
                &mut b,
                ApiKey::ConsumerGroupDescribe.request_header_version(0),
            )
            .unwrap();
            let got = ConsumerGroupDescribeRequest::decode(&mut b, 0).unwrap();
            assert_eq!(got.group_ids, vec![if fork { renamed() } else { group() }]);
        }
    }

    #[test]
    fn a_fetch_response_nothing_is_removed_from_is_passed_on_as_it_came() {
        use kafka_protocol::messages::TopicName;
        use kafka_protocol::messages::fetch_response::{FetchableTopicResponse, PartitionData};

        // One batch of one record: length 6, attributes, timestamp and offset deltas 0, null key,
        // empty value, no header (zig-zag varints).
        let record = [12u8, 0, 0, 0, 1, 0, 0];
        let mut header = [0u8; crate::batch::HEADER_LEN];
        header[16] = 2;
        let mut batch = Vec::new();
        crate::batch::rewrite(&header, crate::Codec::None, 1, &record[..], &mut batch).unwrap();
        let body = FetchResponse::default().with_responses(vec![
            FetchableTopicResponse::default()
                .with_topic(TopicName(StrBytes::from_static_str("t")))
                .with_partitions(vec![
                    PartitionData::default().with_records(Some(Bytes::from(batch))),
                ]),
        ]);
        let frame = || {
            let mut out = BytesMut::new();
            ResponseHeader::default()
                .with_correlation_id(1)
                .encode(&mut out, ApiKey::Fetch.response_header_version(11))
                .unwrap();
            body.encode(&mut out, 11).unwrap();
            out.freeze()
        };
        let mut s = session(Role::Baseline);
        s.request(fetch_request(1)).unwrap();
        let input = frame();
        let out = s.response(input.clone(), |_, _, _| true).unwrap();
        assert_eq!(
            out.as_ptr(),
            input.as_ptr(),
            "not decoded and written again"
        );
        s.request(fetch_request(1)).unwrap();
        let out = s.response(frame(), |_, _, _| false).unwrap();
        assert_ne!(out, frame(), "a record removed: written again");
        let stats = s.take_stats();
        assert_eq!(stats.records.records_dropped, 1);
        assert_eq!(stats.topics.len(), 1);
        assert_eq!(
            (&*stats.topics[0].0, stats.topics[0].1.records_dropped),
            ("t", 1)
        );
    }

    /// Fetch v13 and later name topics by id: the names come from the Metadata responses any
    /// connection sharing the map saw, and reach the decision and the counters.
    #[test]
    fn topic_ids_are_named_from_metadata() {
        use kafka_protocol::messages::fetch_response::{FetchableTopicResponse, PartitionData};
        use kafka_protocol::messages::metadata_response::MetadataResponseTopic;
        use kafka_protocol::messages::{FetchRequest, MetadataRequest, TopicName};

        let record = [12u8, 0, 0, 0, 1, 0, 0];
        let mut header = [0u8; crate::batch::HEADER_LEN];
        header[16] = 2;
        let mut batch = Vec::new();
        crate::batch::rewrite(&header, crate::Codec::None, 1, &record[..], &mut batch).unwrap();
        let id = uuid::Uuid::from_bytes([7; 16]);
        let response = |version: i16, body: &dyn Fn(&mut BytesMut)| {
            let mut out = BytesMut::new();
            ResponseHeader::default()
                .with_correlation_id(5)
                .encode(&mut out, ApiKey::Fetch.response_header_version(version))
                .unwrap();
            body(&mut out);
            out.freeze()
        };
        let fetch = FetchResponse::default().with_responses(vec![
            FetchableTopicResponse::default()
                .with_topic_id(id)
                .with_partitions(vec![
                    PartitionData::default().with_records(Some(Bytes::from(batch))),
                ]),
        ]);
        let names = crate::TopicNames::default();
        let mut other = Session::new(SessionConfig {
            role: Role::Baseline,
            limits: Limits::default(),
            advertise: Vec::new(),
            front: None,
            topics: names.clone(),
        });
        let mut s = Session::new(SessionConfig {
            role: Role::Baseline,
            limits: Limits::default(),
            advertise: Vec::new(),
            front: None,
            topics: names,
        });
        let seen = |s: &mut Session| {
            s.request(request_frame(&FetchRequest::default(), 13))
                .unwrap();
            let mut topic = String::new();
            s.response(
                response(13, &|o| fetch.encode(o, 13).unwrap()),
                |t, _, _| {
                    topic = t.to_owned();
                    true
                },
            )
            .unwrap();
            (topic, s.take_stats().topics[0].0.to_string())
        };
        assert_eq!(
            seen(&mut s),
            (String::new(), String::new()),
            "not named yet"
        );
        // Another connection of the relay learns the name.
        let metadata = MetadataResponse::default().with_topics(vec![
            MetadataResponseTopic::default()
                .with_name(Some(TopicName(StrBytes::from_static_str("orders"))))
                .with_topic_id(id),
        ]);
        other
            .request(request_frame(&MetadataRequest::default(), 12))
            .unwrap();
        let mut out = BytesMut::new();
        ResponseHeader::default()
            .with_correlation_id(5)
            .encode(&mut out, ApiKey::Metadata.response_header_version(12))
            .unwrap();
        metadata.encode(&mut out, 12).unwrap();
        let input = out.freeze();
        let passed = other.response(input.clone(), |_, _, _| true).unwrap();
        assert_eq!(passed.as_ptr(), input.as_ptr(), "read, not written again");
        assert_eq!(seen(&mut s), ("orders".to_owned(), "orders".to_owned()));
        // A Metadata body that does not decode goes on as it came: the relay only reads it.
        other
            .request(request_frame(&MetadataRequest::default(), 12))
            .unwrap();
        let odd = Bytes::from_static(&[0, 0, 0, 5, 0, 0xff, 0xff, 0xff]);
        assert_eq!(other.response(odd.clone(), |_, _, _| true).unwrap(), odd);
    }

    /// An explicit relay of one broker advertises itself whatever the broker's node id, and
    /// refuses a cluster of several (their own addresses would take clients around it).
    #[test]
    fn an_explicit_relay_fronts_one_broker() {
        use kafka_protocol::messages::BrokerId;
        use kafka_protocol::messages::metadata_response::MetadataResponseBroker;

        let mut s = Session::new(SessionConfig {
            role: Role::Baseline,
            limits: Limits::default(),
            advertise: Vec::new(),
            front: Some(("127.0.0.1".into(), 19093)),
            topics: crate::TopicNames::default(),
        });
        let metadata = |brokers: &[i32]| {
            let body = MetadataResponse::default().with_brokers(
                brokers
                    .iter()
                    .map(|&n| {
                        MetadataResponseBroker::default()
                            .with_node_id(BrokerId(n))
                            .with_host(StrBytes::from_static_str("10.0.0.9"))
                            .with_port(9092)
                    })
                    .collect(),
            );
            let mut out = BytesMut::new();
            ResponseHeader::default()
                .with_correlation_id(5)
                .encode(&mut out, ApiKey::Metadata.response_header_version(12))
                .unwrap();
            body.encode(&mut out, 12).unwrap();
            out.freeze()
        };
        s.request(request_frame(&MetadataRequest::default(), 12))
            .unwrap();
        let out = s.response(metadata(&[7]), |_, _, _| true).unwrap();
        let (_, body) = decode_response::<MetadataResponse>(ApiKey::Metadata, 12, &out).unwrap();
        assert_eq!(body.brokers[0].node_id.0, 7);
        assert_eq!(body.brokers[0].host.as_str(), "127.0.0.1");
        assert_eq!(body.brokers[0].port, 19093);
        s.request(request_frame(&MetadataRequest::default(), 12))
            .unwrap();
        let err = s.response(metadata(&[1, 2]), |_, _, _| true).unwrap_err();
        assert!(err.to_string().contains("names 2 brokers"), "{err}");

        // FindCoordinator: the top level up to v3, the coordinators list from v4 (where the
        // top-level fields do not exist); an error answer keeps its empty address.
        use kafka_protocol::messages::find_coordinator_response::Coordinator;
        use kafka_protocol::messages::{FindCoordinatorRequest, FindCoordinatorResponse};
        for v in [2i16, 3, 4, 6] {
            let body = if v <= 3 {
                FindCoordinatorResponse::default()
                    .with_node_id(BrokerId(7))
                    .with_host(StrBytes::from_static_str("10.0.0.9"))
                    .with_port(9092)
            } else {
                FindCoordinatorResponse::default().with_coordinators(vec![
                    Coordinator::default()
                        .with_key(StrBytes::from_static_str("g1"))
                        .with_node_id(BrokerId(7))
                        .with_host(StrBytes::from_static_str("10.0.0.9"))
                        .with_port(9092),
                    Coordinator::default()
                        .with_key(StrBytes::from_static_str("g2"))
                        .with_node_id(BrokerId(-1))
                        .with_error_code(15),
                ])
            };
            let mut out = BytesMut::new();
            ResponseHeader::default()
                .with_correlation_id(5)
                .encode(&mut out, ApiKey::FindCoordinator.response_header_version(v))
                .unwrap();
            body.encode(&mut out, v).unwrap();
            s.request(request_frame(&FindCoordinatorRequest::default(), v))
                .unwrap();
            let out = s.response(out.freeze(), |_, _, _| true).unwrap();
            let (_, got) =
                decode_response::<FindCoordinatorResponse>(ApiKey::FindCoordinator, v, &out)
                    .unwrap();
            let (host, port) = if v <= 3 {
                (got.host.to_string(), got.port)
            } else {
                assert_eq!(got.coordinators[1].host.as_str(), "", "v{v}");
                assert_eq!(got.coordinators[1].port, 0, "v{v}");
                (
                    got.coordinators[0].host.to_string(),
                    got.coordinators[0].port,
                )
            };
            assert_eq!((host.as_str(), port), ("127.0.0.1", 19093), "v{v}");
        }
    }

    #[test]
    fn fork_ids_round_trip_and_foreign_ids_stay() {
        let id = fork_id("orders", "sbx-1");
        assert_eq!(id, "orders.spur-sandbox.sbx-1");
        assert_eq!(unfork_id(&id, "sbx-1"), Some("orders"));
        assert_eq!(unfork_id(&id, "sbx-2"), None);
        assert_eq!(unfork_id("orders", "sbx-1"), None);
        assert_eq!(unfork_id("x-sbx-1", "sbx-1"), None);
    }
}
