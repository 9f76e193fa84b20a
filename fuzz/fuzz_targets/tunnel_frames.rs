//! Fuzzes the tunnel protocol's frame decoder (`dataplane/tunnel/src/wire.rs`): 4-byte
//! big-endian length + JSON frames read with `read_frame` as control messages, stream headers
//! and stream replies, then checked with the validators the session applies.
//!
//! `read_frame`, `encode`, `Control`, `Reply` and the validators are `pub(crate)` in spur-tunnel,
//! so wire.rs itself is compiled into this target with `#[path]` (its one crate path,
//! `crate::error::Error`, points at spur-tunnel's public `Error`); see README.md.
//!
//! Input: byte 0 picks the frame-size limit and the read boundaries; the rest is the stream.
#![no_main]
#![allow(dead_code, unused_imports, unreachable_pub, clippy::all)]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use libfuzzer_sys::fuzz_target;
use serde::Serialize;
use serde::de::DeserializeOwned;

mod error {
    pub use spur_tunnel::{Error, RefusalCode};
}

#[path = "../../dataplane/tunnel/src/wire.rs"]
mod wire;

use error::Error;
use wire::{Control, MAX_BIND_ID, MAX_HOST, Reply, StreamHeader};

#[path = "common/mod.rs"]
mod common;
use common::Chunks;

/// Runs a future over in-memory readers, which are always ready.
fn now<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("in-memory read returned Pending"),
    }
}

/// One read result, comparable across runs.
fn outcome<T: Serialize>(r: &Result<Option<T>, Error>) -> Result<Option<serde_json::Value>, String> {
    match r {
        Ok(v) => Ok(v.as_ref().map(|m| serde_json::to_value(m).expect("serializes"))),
        Err(e) => Err(e.to_string()),
    }
}

/// Every frame of `data` read as `T`, until the end, an error, or 64 frames.
fn frames<T: DeserializeOwned + Serialize>(
    data: &[u8],
    sizes: &[usize],
    max: usize,
) -> Vec<Result<Option<serde_json::Value>, String>> {
    let mut r = Chunks::new(data, sizes);
    let mut out = vec![];
    for _ in 0..64 {
        let res = now(wire::read_frame::<_, T>(&mut r, max));
        let stop = !matches!(res, Ok(Some(_)));
        if let Ok(Some(msg)) = &res {
            // Re-encoded, the message reads back the same.
            let buf = wire::encode(msg, usize::MAX).expect("encodes");
            let mut again = &buf[..];
            let back: T = now(wire::read_frame(&mut again, usize::MAX))
                .expect("re-encoded frame reads")
                .expect("a frame");
            assert_eq!(
                serde_json::to_value(&back).expect("serializes"),
                serde_json::to_value(msg).expect("serializes")
            );
            assert!(again.is_empty());
        }
        if let Err(Error::FrameTooLarge { len, max: m }) = &res {
            assert!(*len > *m && *m == max);
        }
        out.push(outcome(&res));
        if stop {
            break;
        }
    }
    out
}

/// The frames as the session reads them, with any split of the stream: the same results.
fn check<T: DeserializeOwned + Serialize>(data: &[u8], sizes: &[usize], max: usize) {
    let whole = frames::<T>(data, &[usize::MAX], max);
    let split = frames::<T>(data, sizes, max);
    assert_eq!(whole, split, "reads of {sizes:?}");
}

fn check_truncate(s: &str) {
    for max in [0, 1, 2, 3, 7, MAX_BIND_ID, MAX_HOST] {
        let t = wire::truncate(s, max);
        assert!(t.len() <= max && s.starts_with(&t), "{s:?} {max}");
        assert!(s.len() <= max || t.len() + 4 > max, "cut too much: {s:?} {max}");
    }
}

fuzz_target!(|input: &[u8]| {
    let [b, data @ ..] = input else {
        return;
    };
    let max = [16, 256, 4096, 1 << 20][usize::from(b & 3)];
    let sizes: Vec<usize> = match b >> 2 {
        0 => vec![1],
        n => vec![usize::from(n % 7) + 1, usize::from(n % 5) + 2, 3],
    };

    check::<Control>(data, &sizes, max);
    check::<StreamHeader>(data, &sizes, max);
    check::<Reply>(data, &sizes, max);

    // What the session does with each message it reads: validate the peer's fields.
    let mut r = Chunks::new(data, &sizes);
    while let Ok(Some(msg)) = now(wire::read_frame::<_, Control>(&mut r, max)) {
        if msg.validate().is_ok() {
            match &msg {
                Control::Hello { client_name, .. } => {
                    assert!(client_name.len() <= 256 && !client_name.chars().any(char::is_control));
                    check_truncate(client_name);
                }
                Control::Bind { id, meta } => {
                    assert!(wire::validate_bind_id(id).is_ok() && meta.len() <= 4096);
                }
                Control::GoAway { reason } | Control::Refused { reason, .. } => {
                    check_truncate(reason);
                }
                _ => {}
            }
        }
    }
    let mut r = Chunks::new(data, &sizes);
    while let Ok(Some(h)) = now(wire::read_frame::<_, StreamHeader>(&mut r, max)) {
        let _ = h.kind().as_str();
        if h.validate().is_ok() {
            match &h {
                StreamHeader::Connect { host, port } => {
                    assert!(*port != 0 && !host.is_empty() && host.len() <= MAX_HOST);
                    assert!(!host.bytes().any(|b| b.is_ascii_whitespace() || b"/@?#\\".contains(&b)));
                }
                StreamHeader::Reverse { bind, .. } => {
                    assert!(!bind.is_empty() && bind.len() <= MAX_BIND_ID);
                }
            }
        }
    }
});
