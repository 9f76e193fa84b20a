//! `spur-hub` and `spur-agent`: a self-hosted control plane that clusters dial out to. The hub
//! keeps a registry of clusters (each with its own token, stored hashed, revocable), serves
//! preview URLs that carry a sandbox's routing key into the cluster, and a web view. The agent
//! runs in each cluster, keeps one tunnel session to the hub (the workstation tunnel's library,
//! `spur-tunnel`: QUIC with HTTP/2-over-TLS fallback) and serves the streams the hub opens.
//! The cluster never accepts an inbound connection. See `docs/hub.md`.

pub mod agent;
pub mod browser;
pub mod carriers;
pub mod catalog;
pub mod clusters;
pub mod html;
pub mod listener;
pub mod login;
pub mod metrics;
pub mod namespaces;
pub mod preview;
pub mod protocol;
pub mod server;
pub mod smarttests;
pub mod store;
pub mod traffic;
pub mod upstream;
pub mod users;
pub mod web;

pub use store::Store;

/// Everything that can go wrong in the hub and the agent.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("database: {0}")]
    Db(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("tunnel: {0}")]
    Tunnel(#[from] spur_tunnel::Error),
    #[error("{0}")]
    Config(String),
    /// The cluster or its agent cannot be reached now.
    #[error("{0}")]
    Unavailable(String),
    /// The agent or the target behind it failed.
    #[error("{0}")]
    Upstream(String),
    /// The target did not answer in time.
    #[error("{0}")]
    Timeout(String),
    /// The hub refused the agent for good (unknown or revoked token).
    #[error("refused by the hub: {0}")]
    Refused(String),
}
