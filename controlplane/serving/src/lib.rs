//! The serving kit: what every Spur server shares on its listening side, so that no server
//! imports another server's crate. Serving TLS with hot reload ([`tls`]), the small CA that
//! signs serving and client certificates ([`pki`]), the HTTP/1 front door ([`http1`]) and the
//! probe and metrics server of every long-running binary ([`health`]), and, with the feature
//! `kube`, Kubernetes token and access reviews ([`review`]).

pub mod health;
pub mod http1;
pub mod pki;
#[cfg(feature = "kube")]
pub mod review;
pub mod tls;

pub use tls::ServingTls;

/// Errors of the serving kit.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A serving certificate, key or client CA that cannot be used.
    #[error("TLS: {0}")]
    Tls(String),
    /// A certificate that cannot be issued or read.
    #[error("certificates: {0}")]
    Pki(String),
    /// The probe and metrics address cannot be bound.
    #[error("cannot bind the metrics address {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}
