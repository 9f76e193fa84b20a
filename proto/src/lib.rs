//! Spur's wire contracts: the Signadot-compatible Routes API and Spur's tunnel API (generated
//! code committed), and conversions to routing types.
//!
//! `routes` is generated from `routes.proto` (package `routes`, wire-identical to the public
//! `routesapi`); `tunnel` from `tunnel.proto` (package `spur.tunnel.v1`, what `spur local
//! connect` asks the tunnel proxy). `tests/codegen.rs` keeps the committed code in step with
//! the `.proto` files.

#[allow(clippy::all, unreachable_pub, missing_docs, rust_2018_idioms)]
pub mod routes {
    include!("gen/routes.rs");
}

#[allow(clippy::all, unreachable_pub, missing_docs, rust_2018_idioms)]
pub mod tunnel {
    include!("gen/spur.tunnel.v1.rs");
}

mod convert;

pub use convert::{rule_from_proto, rule_to_proto};
