//! Example upstream services (HTTP/1.1 + h2c, WebSocket, gRPC, raw TCP, TLS, UDP echo) that `spur demo`
//! runs on loopback and the end-to-end tests use as real upstreams behind the proxy.
//!
//! Every service is told a `name` and reports it back in each response, so a caller can tell
//! which upstream actually served a request after it went through the router.

#![forbid(unsafe_code)]

mod grpc;
pub mod grpc_client;
mod http;
pub mod kafka;
mod net;
mod tcp;
mod udp;

pub use grpc::{
    GrpcBehaviour, HelloReply, HelloRequest, PRICES, PriceReply, PriceRequest, serve_grpc,
    serve_grpc_with,
};
pub use http::{serve_http, serve_http_producing};
pub use net::accept;
pub use tcp::{TestTls, serve_tcp_echo, serve_tls_echo, test_tls};
pub use tokio_util::sync::CancellationToken;
pub use udp::serve_udp_echo;

/// Header (and gRPC trailing metadata key) naming the service that answered.
pub const SERVED_BY: &str = "x-served-by";

/// Fully-qualified gRPC service name of the demo service.
pub const GRPC_SERVICE: &str = "spur.demo.v1.Demo";

/// The demo service's descriptors (an encoded FileDescriptorSet of `proto/demo.proto`), which its
/// gRPC server reflection serves (checked against the .proto by `tests/descriptors.rs`).
pub const DEMO_DESCRIPTORS: &[u8] = include_bytes!("../proto/demo.fds");

/// Errors from starting or running a demo service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("gRPC server error: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("TLS configuration error: {0}")]
    Tls(#[from] rustls::Error),
    #[error("service name {0:?} is not a valid header value")]
    InvalidName(String),
    /// The demo descriptors could not be served by reflection (a bug: they are checked).
    #[error("gRPC reflection: {0}")]
    Reflection(String),
    #[error("certificate generation error: {0}")]
    Cert(#[from] rcgen::Error),
    /// A Kafka broker (or relay) could not be reached, or its connection broke.
    #[error("Kafka connection to {peer}: {source}")]
    KafkaIo {
        peer: String,
        source: std::io::Error,
    },
    #[error(
        "Kafka peer {peer} sent a response frame of {len} bytes, more than the 64 MiB accepted"
    )]
    KafkaFrameTooLarge {
        peer: std::net::SocketAddr,
        len: usize,
    },
    /// The broker answered with an error code.
    #[error("Kafka {what}: {error} (error code {code})")]
    KafkaBroker {
        what: String,
        code: i16,
        error: String,
    },
    /// A Kafka message that could not be encoded or decoded, or a response that makes no sense.
    #[error("Kafka protocol error: {0}")]
    Kafka(String),
}
