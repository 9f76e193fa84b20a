//! The gRPC watch, encoded once per change instead of once per watcher.
//!
//! Each rule is serialized when it enters the index ([`crate::index::Entry::wire`]). A watch
//! stream carries [`EncodedOp`]s, which share those bytes, and [`WatchCodec`] writes them
//! around a two-field header: with 10 000 watchers of one baseline, a change costs one
//! serialization and 10 000 copies of its bytes, not 10 000 clones of the rule's strings and
//! 10 000 serializations. The bytes on the wire are exactly what prost writes for the same
//! `WorkloadRoutingRuleOp` (a unit test holds them to it), so clients see no difference.

use bytes::{BufMut, Bytes};
use spur_proto::routes::{WatchOp, WorkloadRoutingRulesRequest};
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};

/// The encode buffer each watch stream keeps: a few rules' worth. tonic's default (8 KiB) is
/// the largest part of a watcher's memory; the buffer grows for a bigger initial sync.
const STREAM_BUFFER: usize = 1024;

/// One `WorkloadRoutingRuleOp` whose route is already encoded.
#[derive(Debug, Clone)]
pub(crate) struct EncodedOp {
    op: WatchOp,
    route: Option<Bytes>,
}

impl EncodedOp {
    pub(crate) fn new(op: WatchOp, route: Option<Bytes>) -> Self {
        EncodedOp { op, route }
    }

    /// Field 1 (`op`, omitted when 0 as prost omits proto3 defaults), then field 2 (`route`,
    /// length-delimited).
    fn encode(&self, dst: &mut impl BufMut) {
        let op = self.op as i32;
        if op != 0 {
            prost::encoding::int32::encode(1, &op, dst);
        }
        if let Some(route) = &self.route {
            prost::encoding::encode_key(2, prost::encoding::WireType::LengthDelimited, dst);
            prost::encoding::encode_varint(route.len() as u64, dst);
            dst.put_slice(route);
        }
    }
}

/// Decodes watch requests with prost and writes [`EncodedOp`]s as they are.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct WatchCodec;

impl Codec for WatchCodec {
    type Encode = EncodedOp;
    type Decode = WorkloadRoutingRulesRequest;
    type Encoder = OpEncoder;
    type Decoder = tonic_prost::ProstDecoder<WorkloadRoutingRulesRequest>;

    fn encoder(&mut self) -> OpEncoder {
        OpEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::default()
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct OpEncoder;

impl Encoder for OpEncoder {
    type Item = EncodedOp;
    type Error = Status;

    fn encode(&mut self, item: EncodedOp, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::new(STREAM_BUFFER, 32 * 1024)
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use spur_proto::routes::{BaselineWorkload, WorkloadRoutingRule, WorkloadRoutingRuleOp};

    use super::*;

    #[test]
    fn encoded_ops_are_what_prost_writes() {
        let rule = WorkloadRoutingRule {
            routing_key: "k1".into(),
            baseline: Some(BaselineWorkload {
                kind: "Deployment".into(),
                namespace: "shop".into(),
                name: "api".into(),
            }),
            ..Default::default()
        };
        let route = Bytes::from(rule.encode_to_vec());
        for op in [
            WatchOp::Add,
            WatchOp::Remove,
            WatchOp::Replace,
            WatchOp::Synced,
        ] {
            let route = (op != WatchOp::Synced).then(|| route.clone());
            let expected = WorkloadRoutingRuleOp {
                op: op.into(),
                route: route.as_ref().map(|_| rule.clone()),
            }
            .encode_to_vec();
            let mut got = Vec::new();
            EncodedOp::new(op, route).encode(&mut got);
            assert_eq!(got, expected, "{op:?}");
        }
        // A route longer than 127 bytes takes a two-byte length.
        let long = WorkloadRoutingRule {
            routing_key: "k".repeat(300),
            ..Default::default()
        };
        let mut got = Vec::new();
        EncodedOp::new(WatchOp::Replace, Some(long.encode_to_vec().into())).encode(&mut got);
        let expected = WorkloadRoutingRuleOp {
            op: WatchOp::Replace.into(),
            route: Some(long),
        }
        .encode_to_vec();
        assert_eq!(got, expected);
    }
}
