//! The traffic diff engine: pure functions over captured exchanges (proto/traffic.proto) that
//! pair what a sandbox's forks answered with what the baseline answered to the same requests,
//! compare each pair ([`compare`]) and write exchanges and comparisons as text and JSON
//! ([`render`]). The `spur traffic` command fetches and prints; nothing here does I/O, so the
//! user-facing CLI links this without the traffic store's server.

pub mod calls;
pub mod compare;
pub mod findings;
pub mod pair;
pub mod render;
pub mod text;

#[cfg(test)]
mod testing;

pub use calls::{Calls, compare_calls};
pub use compare::{Comparison, Difference, compare};
pub use findings::{Finding, Findings, Observation, Rank, findings};
pub use pair::{Pair, PairedOn, pair_exchanges, workload_key, workload_name};
