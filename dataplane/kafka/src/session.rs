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
//! - with `advertise` set (explicit listeners, as in the loopback tests), **Metadata and
//!   FindCoordinator responses**, whose broker addresses are replaced. A transparent relay keeps
//!   each connection's original destination and needs no such rewrite.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use kafka_protocol::messages::{
    AddOffsetsToTxnRequest, AddPartitionsToTxnRequest, ApiKey, ApiVersionsResponse,
    ConsumerGroupHeartbeatRequest, DescribeGroupsRequest, DescribeGroupsResponse, EndTxnRequest,
    FetchResponse, FindCoordinatorRequest, FindCoordinatorResponse, HeartbeatRequest,
    InitProducerIdRequest, JoinGroupRequest, LeaveGroupRequest, MetadataResponse,
    OffsetCommitRequest, OffsetDeleteRequest, OffsetFetchRequest, OffsetFetchResponse,
    ProduceRequest, RequestHeader, ResponseHeader, SyncGroupRequest, TxnOffsetCommitRequest,
};
use kafka_protocol::protocol::{Decodable, Encodable, StrBytes};

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
}

/// Counters of one connection, summed by the caller into its metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionStats {
    pub records: Stats,
    /// Group and transactional ids renamed, both ways.
    pub ids_renamed: u64,
    pub fetch_responses: u64,
}

impl SessionStats {
    pub fn add(&mut self, o: &SessionStats) {
        self.records.add(&o.records);
        self.ids_renamed += o.ids_renamed;
        self.fetch_responses += o.fetch_responses;
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

/// The APIs this module decodes: their ranges in ApiVersions are narrowed to the crate's.
const DECODED: [ApiKey; 19] = [
    ApiKey::Produce,
    ApiKey::Fetch,
    ApiKey::Metadata,
    ApiKey::OffsetCommit,
    ApiKey::OffsetFetch,
    ApiKey::FindCoordinator,
    ApiKey::JoinGroup,
    ApiKey::Heartbeat,
    ApiKey::LeaveGroup,
    ApiKey::SyncGroup,
    ApiKey::DescribeGroups,
    ApiKey::InitProducerId,
    ApiKey::AddPartitionsToTxn,
    ApiKey::AddOffsetsToTxn,
    ApiKey::EndTxn,
    ApiKey::TxnOffsetCommit,
    ApiKey::OffsetDelete,
    ApiKey::ConsumerGroupHeartbeat,
    ApiKey::ApiVersions,
];

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
        keep: impl FnMut(&BatchHeader, &Record<'_>) -> bool,
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
    /// response, which records the client receives.
    pub fn response(
        &mut self,
        frame: Bytes,
        keep: impl FnMut(&BatchHeader, &Record<'_>) -> bool,
    ) -> Result<Bytes, Error> {
        self.0.response(frame, keep)
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

    fn response(
        &mut self,
        frame: Bytes,
        keep: impl FnMut(&BatchHeader, &Record<'_>) -> bool,
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
        match key {
            ApiKey::ApiVersions => self.api_versions(v, frame),
            ApiKey::Fetch => {
                let (header, mut body) = decode_response::<FetchResponse>(key, v, &frame)?;
                self.stats.fetch_responses += 1;
                let mut keep = keep;
                for topic in &mut body.responses {
                    for part in &mut topic.partitions {
                        if let Some(records) = &part.records
                            && !records.is_empty()
                        {
                            let out = filter::filter(records, &self.cfg.limits, &mut keep)?;
                            self.stats.records.add(&out.stats);
                            part.records = Some(out.records);
                        }
                    }
                }
                encode_response(key, v, &header, &body)
            }
            ApiKey::Metadata if !self.cfg.advertise.is_empty() => {
                let (header, mut body) = decode_response::<MetadataResponse>(key, v, &frame)?;
                for b in &mut body.brokers {
                    if let Some((host, port)) = self.advertised(b.node_id.0) {
                        b.host = host;
                        b.port = port;
                    }
                }
                encode_response(key, v, &header, &body)
            }
            ApiKey::FindCoordinator
                if self.sandbox().is_some() || !self.cfg.advertise.is_empty() =>
            {
                let (header, mut body) =
                    decode_response::<FindCoordinatorResponse>(key, v, &frame)?;
                if let Some((host, port)) = self.advertised(body.node_id.0) {
                    body.host = host;
                    body.port = port;
                }
                for c in &mut body.coordinators {
                    self.restore(&mut c.key);
                    if let Some((host, port)) = self.advertised(c.node_id.0) {
                        c.host = host;
                        c.port = port;
                    }
                }
                encode_response(key, v, &header, &body)
            }
            ApiKey::OffsetFetch if self.sandbox().is_some() && v >= 8 => {
                let (header, mut body) = decode_response::<OffsetFetchResponse>(key, v, &frame)?;
                for g in &mut body.groups {
                    self.restore(&mut g.group_id.0);
                }
                encode_response(key, v, &header, &body)
            }
            ApiKey::DescribeGroups if self.sandbox().is_some() => {
                let (header, mut body) = decode_response::<DescribeGroupsResponse>(key, v, &frame)?;
                for g in &mut body.groups {
                    self.restore(&mut g.group_id.0);
                }
                encode_response(key, v, &header, &body)
            }
            _ => Ok(frame),
        }
    }

    fn advertised(&self, node: i32) -> Option<(StrBytes, i32)> {
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
            let Some(k) = ApiKey::try_from(a.api_key)
                .ok()
                .filter(|k| DECODED.contains(k))
            else {
                return true;
            };
            let ours = k.valid_versions();
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
        let err = s.response(Bytes::from(f), |_, _| true).unwrap_err();
        assert!(err.to_string().contains("bytes left"), "{err}");
    }

    #[test]
    fn responses_must_answer_the_next_request() {
        let mut s = session(Role::Baseline);
        assert!(matches!(
            s.response(Bytes::from_static(&[0, 0, 0, 1]), |_, _| true),
            Err(Error::Protocol { .. })
        ));
        s.request(fetch_request(1)).unwrap();
        s.request(fetch_request(2)).unwrap();
        let err = s
            .response(Bytes::from_static(&[0, 0, 0, 2]), |_, _| true)
            .unwrap_err();
        assert!(err.to_string().contains("where 1"), "{err}");
        assert!(s.request(Bytes::from_static(&[0, 1, 0])).is_err());
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
