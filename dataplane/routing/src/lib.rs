//! Routing keys, W3C baggage parsing and the immutable routing-rule table (pure: no I/O, no tokio).
//!
//! This crate is the vocabulary shared by every Spur data-plane component:
//! - [`extract`] finds candidate routing keys in a request's headers and query string, from every
//!   carrier that Signadot-instrumented applications already send (see `docs/routing-keys.md`);
//! - [`carrier`] defines the standard carriers once: extraction, injection, the relay's header
//!   list and the header matches rendered for other proxies all derive from [`Carrier::ALL`];
//! - [`baggage`] is the exact W3C `baggage` / `tracestate` list parser those carriers need;
//! - [`rules`] holds the routing rules in the wire shape of the public Routes API
//!   (`WorkloadRoutingRule`) and validates them into domain types once, at the edge;
//! - [`table`] compiles validated rules into an immutable lookup table and the lock-free
//!   [`table::SharedTable`] handle that the request path loads from;
//! - [`history`] says when each route of a baseline was in force, for relays that decide per
//!   record by its timestamp (Kafka);
//! - [`trace`] reads trace ids from trace-context headers and says which traces sidecars record
//!   (`spur doctor propagation`).
//!
//! Lookups never allocate and cost the same whatever the size of the table.

pub mod baggage;
pub mod carrier;
pub mod extract;
pub mod history;
pub mod inject;
pub mod rules;
pub mod table;
pub mod trace;
#[cfg(feature = "proto")]
pub mod wire;

mod error;

pub use carrier::Carrier;
pub use error::Error;
pub use extract::{Candidates, ExtractConfig, KeyExtractor};
pub use history::{History, Span};
pub use rules::{BaselineWorkload, Location, RoutingRule, RuleSpec};
pub use table::{Destination, RuleTable, SharedTable, Snapshot};
