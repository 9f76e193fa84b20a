//! The L4 half of the proxy core: TCP and UDP listeners in front of clusters of endpoints, with
//! consistent hashing, active health checks, outlier ejection, runtime updates, drain and
//! metrics, configured from a plain serde [`L4Config`] (what a listener custom resource will
//! carry).
//!
//! ```text
//! L4Config ──validate──► ValidConfig ──ListenerSet::apply──► listeners (TCP | UDP)
//!                                                               │ per new session:
//!   first bytes ──keyRoute──► cluster (listener's own, or a sandbox one)
//!   hashKey ──hash──► ringHash | maglev | roundRobin over endpoints in rotation ──► endpoint
//! ```
//!
//! # Sessions
//!
//! A UDP session is a client address: its first datagram routes it, every later datagram from
//! that address goes to the same endpoint, and replies come back from the listener's address.
//! It ends after `idleTimeout` with nothing moving either way, when the table is full and it is
//! the least recently active (`overflow: evictOldest`), or when its cluster has no endpoint
//! left. A TCP session is one accepted connection, spliced to one endpoint with half-close
//! preserved.
//!
//! # The L4 routing key
//!
//! L4 traffic has no headers, so the only place a sandbox routing key can travel is the payload.
//! A listener's `keyRoute` reads it from the **first bytes** of a session: the first datagram
//! of a UDP session, or the first bytes a TCP client sends (read with `firstBytesTimeout` as
//! the bound, then forwarded unchanged — the key is not stripped, so it must be something the
//! server tolerates, such as a field of the protocol's own first message). The bytes at
//! `offset` are compared with each route's key: with `length` set, as an exact byte range (one
//! hash lookup, for fixed-size key fields); without, as prefixes, longest match first. A match
//! sends the session to that route's cluster; no match, or too few bytes, sends it to the
//! listener's own cluster. The decision is made once per session: later datagrams or bytes are
//! never inspected, so a session never changes cluster mid-way. Rules are the listener's own
//! (not looked up in the sidecar's HTTP routing table): one listener CR names its sandbox
//! clusters directly.
//!
//! Server-speaks-first TCP protocols (SMTP, MySQL) send nothing first: with a `firstBytes` hash
//! key or a key route, such a connection waits `firstBytesTimeout` and is then routed on nothing
//! (hash of the empty range, no key). Don't configure either for them.
//!
//! # Endpoint selection
//!
//! Hash balancers are keyed by each endpoint's stable `id` (a pod name), never its IP, and
//! their tables do not depend on the order endpoints are listed in, so every replica given the
//! same set agrees on a key's endpoint. The hash is a fixed function (FNV-1a, then murmur3's
//! 64-bit finaliser), never a seeded or std hasher: replicas of different versions agree too. An
//! endpoint out of rotation (failing health checks, ejected) is looked up past, not removed
//! from the table: only its keys move, and they come back when it does. When no endpoint is in
//! rotation every member is used again (a failing health check should not turn into certain
//! failure). New endpoints start in rotation.
//!
//! # Not done here
//!
//! - GSO/GRO (and `recvmmsg`/`sendmmsg` batching). `quinn-udp` would bring them, but it turns
//!   on don't-fragment (`IP_PMTUDISC_PROBE`) on every socket it manages, which makes datagrams
//!   larger than the path MTU fail with `EMSGSIZE` instead of being fragmented: wrong for a
//!   generic UDP proxy. One `recvfrom`/`sendto` per datagram, without allocation.
//! - Replies leave a UDP listener bound to a wildcard address from whatever source address the
//!   route to the client picks (no `IP_PKTINFO`): on a host with several addresses, bind the
//!   listener to the address clients use.
//! - UDP health checks (checks speak TCP or HTTP to `healthCheckPort`), outlier ejection from
//!   UDP errors (ICMP errors are counted only), endpoint weights, PROXY protocol, transparent
//!   (original-destination) L4 listeners, ICMP relaying to clients.

mod cluster;
mod config;
mod error;
mod hash;
mod health;
mod lru;
mod metrics;
mod route;
mod set;
mod tcp;
mod udp;

pub use cluster::{ClusterStatus, EndpointStatus};
pub use config::{
    ClusterConfig, EndpointConfig, HashKey, HealthCheckConfig, HealthProtocol, KeyRoute,
    KeyRouteConfig, L4Config, LbPolicy, ListenerConfig, MAX_FIRST_BYTES, OutlierConfig, Overflow,
    Protocol, ValidConfig,
};
pub use error::Error;
pub use set::{ListenerSet, ListenerStatus};
