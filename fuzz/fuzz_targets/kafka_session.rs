//! Fuzzes a relayed Kafka connection (`spur_kafka::Session`): frames from a client and from a
//! broker, for a baseline's and a fork's connection, through request and response handling
//! (ApiVersions narrowing, group and transactional id renaming, Metadata and FindCoordinator
//! address rewriting, Fetch filtering).
//!
//! Input: byte 0 picks the role (bit 0: fork) and whether addresses are advertised (bit 1); the
//! rest is a sequence of `[direction byte][u16 length][frame]`: direction even = a request from
//! the client, odd = a response from the broker. Responses to requests the fuzzer made get the
//! request's correlation id written in, so they reach the decoders.
//!
//! Checks: no panic and no unbounded allocation; a request passes through with its api key,
//! version and correlation id, a response with its correlation id; an error ends the connection
//! (the target stops, as the relay would).
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use spur_kafka::{Limits, Role, Session, SessionConfig};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, mut rest)) = data.split_first() else {
        return;
    };
    let role = if flags & 1 != 0 {
        Role::Fork {
            sandbox: "sbx1".into(),
        }
    } else {
        Role::Baseline
    };
    let advertise = if flags & 2 != 0 {
        vec![(1, "127.0.0.1".to_string(), 19092)]
    } else {
        Vec::new()
    };
    let mut session = Session::new(SessionConfig {
        role,
        limits: Limits {
            max_batch_bytes: 1 << 20,
        },
        advertise,
        // The explicit relay of one broker (`--kafka-broker`).
        front: (flags & 4 != 0).then(|| ("127.0.0.1".to_string(), 19093)),
        topics: Default::default(),
    });
    let mut sent: std::collections::VecDeque<i32> = Default::default();
    while let Some((&dir, tail)) = rest.split_first() {
        let Some((len, tail)) = tail.split_first_chunk::<2>() else {
            return;
        };
        let len = usize::from(u16::from_be_bytes(*len)).min(tail.len());
        let (frame, tail) = tail.split_at(len);
        rest = tail;
        if dir % 2 == 0 {
            let Ok(out) = session.request(Bytes::copy_from_slice(frame)) else {
                return;
            };
            assert_eq!(
                out.get(..8),
                frame.get(..8),
                "api key, version and correlation id kept"
            );
            if let Some(c) = frame.get(4..8) {
                sent.push_back(i32::from_be_bytes([c[0], c[1], c[2], c[3]]));
            }
        } else {
            let mut frame = frame.to_vec();
            // Answer the oldest request, so the response is decoded as that API.
            if let (Some(c), true) = (sent.pop_front(), frame.len() >= 4) {
                frame[..4].copy_from_slice(&c.to_be_bytes());
            }
            let Ok(out) = session.response(Bytes::from(frame.clone()), |_, _, r| r.offset % 2 == 0)
            else {
                return;
            };
            assert_eq!(out.get(..4), frame.get(..4), "correlation id kept");
        }
    }
});
