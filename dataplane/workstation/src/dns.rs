//! A small authoritative DNS responder (UDP) for cluster service names: `A` queries for a
//! Service's names are answered with its loopback address; other types for those names get an
//! empty answer (NODATA, so resolvers do not conclude the name is missing); every other name is
//! NXDOMAIN. Nothing is forwarded anywhere: the responder only knows the cluster's Services.
//!
//! The wire format is hickory-proto's (parsing hostile packets is its job, not ours).

use std::sync::Arc;

use arc_swap::ArcSwap;
use hickory_proto::op::{Edns, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{DNSClass, RData, Record, RecordType};
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use crate::names::NameTable;

/// TTL of answers. Addresses are stable while a Service exists; short enough that a Service
/// that went away is forgotten quickly.
pub const TTL: u32 = 10;

/// Answers queries on `socket` from `table` until `cancel`.
pub(crate) async fn serve(
    socket: UdpSocket,
    table: Arc<ArcSwap<NameTable>>,
    cancel: CancellationToken,
) {
    // Larger datagrams are truncated by the kernel and then fail to parse (FORMERR).
    let mut buf = vec![0u8; 4096];
    loop {
        let (len, from) = tokio::select! {
            () = cancel.cancelled() => return,
            r = socket.recv_from(&mut buf) => match r {
                Ok(v) => v,
                Err(e) => {
                    // E.g. ICMP port unreachable from an earlier reply (Linux reports it here).
                    tracing::debug!(error = %e, "DNS receive failed");
                    continue;
                }
            },
        };
        let Some(query) = buf.get(..len) else {
            continue;
        };
        if let Some(reply) = answer(query, &table.load()) {
            let _ = socket.send_to(&reply, from).await;
        }
    }
}

/// The reply to one query packet; `None` when there is nothing sensible to answer (not a
/// query, or too short to carry an id).
pub fn answer(packet: &[u8], table: &NameTable) -> Option<Vec<u8>> {
    let request = match Message::from_vec(packet) {
        Ok(m) => m,
        Err(_) => {
            // Header readable, rest not: FORMERR with the id so the client stops waiting.
            let id = u16::from_be_bytes([*packet.first()?, *packet.get(1)?]);
            if packet.len() < 12 || packet.get(2).is_some_and(|b| b & 0x80 != 0) {
                return None;
            }
            return Message::error_msg(id, OpCode::Query, ResponseCode::FormErr)
                .to_vec()
                .ok();
        }
    };
    if request.metadata.message_type != MessageType::Query {
        return None;
    }
    let id = request.metadata.id;
    let mut reply = Message::response(id, request.metadata.op_code);
    reply.metadata.recursion_desired = request.metadata.recursion_desired;
    reply.metadata.authoritative = true;
    if request.edns.is_some() {
        let mut edns = Edns::new();
        edns.set_max_payload(1232);
        reply.edns = Some(edns);
    }
    let code = if request.metadata.op_code != OpCode::Query {
        ResponseCode::NotImp
    } else if request.queries.len() != 1 {
        ResponseCode::FormErr
    } else {
        let q = &request.queries[0];
        reply.add_query(q.clone());
        let name = q.name().to_ascii();
        match table.lookup(&name) {
            None => ResponseCode::NXDomain,
            Some(_) if q.query_class() != DNSClass::IN => ResponseCode::Refused,
            Some(addr) => {
                if matches!(q.query_type(), RecordType::A | RecordType::ANY) {
                    reply.add_answer(Record::from_rdata(q.name().clone(), TTL, RData::A(A(addr))));
                }
                ResponseCode::NoError
            }
        }
    };
    reply.metadata.response_code = code;
    reply.to_vec().ok()
}
