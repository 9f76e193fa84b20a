//! Kafka connections relayed by routing key: bounded framing, record batches filtered with the
//! four codecs and rewrites that keep offsets, consumer groups kept apart (pure: no I/O, no
//! tokio).
//!
//! A relay (issue 44) splits each direction into frames ([`frame`]) and passes them through a
//! [`Session`], which narrows ApiVersions, renames a fork's group and transactional ids, and hands
//! each partition's `records` of a Fetch response to [`filter::filter`] with the caller's
//! per-record decision; the decision reads the record's routing key with [`key`], through the
//! same carriers and parser as HTTP. What a rewritten batch keeps, and why consumers accept it, is
//! documented on [`filter`].
//!
//! The v2 batch layout and the record walk are written here rather than taken from the
//! `kafka-protocol` crate: its decoder trusts a batch's record count for an allocation,
//! decompresses without a bound and collapses repeated header keys, and its encoder cannot keep
//! a batch's last offset delta or write an empty batch, which filtering needs. Its tests use
//! that crate as an independent reader and writer of the same bytes.

pub mod batch;
pub mod codec;
pub mod filter;
pub mod frame;
pub mod key;
pub mod records;
pub mod session;
pub mod topics;

mod error;
mod varint;

pub use batch::BatchHeader;
pub use codec::Codec;
pub use error::Error;
pub use filter::{Filtered, Limits, Stats, filter};
pub use records::Record;
pub use session::{Requests, Responses, Role, Session, SessionConfig, SessionStats};
pub use topics::TopicNames;
