//! Spur's wire contracts: the Signadot-compatible Routes API and Spur's own gRPC APIs (generated
//! code committed). No domain type: conversions live with the types they convert to
//! (`spur_routing::wire`).
//!
//! `routes` is generated from `routes.proto` (package `routes`, wire-identical to the public
//! `routesapi`); `tunnel` from `tunnel.proto` (package `spur.tunnel.v1`, what `spur local
//! connect` asks the tunnel proxy); `jobs` from `jobs.proto` (package `spur.jobs.v1`, what the
//! operator asks the job executor in a runner pod); `io` from `io.proto` (package `spur.io.v1`,
//! what a sandbox resource's step pod asks the io context server); `l4` from `l4.proto` (package
//! `spur.l4.v1`, what a Spur gateway pod asks the route server for its L4 listeners); `traffic`
//! from `traffic.proto` (package `spur.traffic.v1`, how sidecars ship captured exchanges to the
//! traffic store and how the CLI reads them); `history` from `history.proto` (package
//! `spur.history.v1`, how a sidecar's Kafka relay learns when each route was in force).
//! `tests/codegen.rs` keeps the committed code in step with the `.proto` files.

#[allow(clippy::all, unreachable_pub, missing_docs, rust_2018_idioms)]
pub mod routes {
    include!("gen/routes.rs");
}

#[allow(clippy::all, unreachable_pub, missing_docs, rust_2018_idioms)]
pub mod jobs {
    include!("gen/spur.jobs.v1.rs");
}

#[allow(clippy::all, unreachable_pub, missing_docs, rust_2018_idioms)]
pub mod io {
    include!("gen/spur.io.v1.rs");
}

#[allow(clippy::all, unreachable_pub, missing_docs, rust_2018_idioms)]
pub mod l4 {
    include!("gen/spur.l4.v1.rs");
}

#[allow(clippy::all, unreachable_pub, missing_docs, rust_2018_idioms)]
pub mod traffic {
    include!("gen/spur.traffic.v1.rs");
}

#[allow(clippy::all, unreachable_pub, missing_docs, rust_2018_idioms)]
pub mod history {
    include!("gen/spur.history.v1.rs");
}

#[allow(clippy::all, unreachable_pub, missing_docs, rust_2018_idioms)]
pub mod tunnel {
    include!("gen/spur.tunnel.v1.rs");
}

/// How a workstation reaches the tunnel API: a forward tunnel stream to this host and port,
/// on which the tunnel proxy serves gRPC (HTTP/2 without TLS; the tunnel is already
/// authenticated and encrypted).
pub const TUNNEL_API_HOST: &str = "spur-tunnel-api";
/// See [`TUNNEL_API_HOST`].
pub const TUNNEL_API_PORT: u16 = 443;
