//! Spur's wire contracts: the Signadot-compatible Routes API (generated code committed) and conversions to routing types.
//!
//! `routes` is generated from `routes.proto` (package `routes`, wire-identical to the public
//! `routesapi`); `tests/codegen.rs` keeps the committed code in step with the `.proto`.

#[allow(clippy::all, unreachable_pub, missing_docs, rust_2018_idioms)]
pub mod routes {
    include!("gen/routes.rs");
}

mod convert;

pub use convert::{rule_from_proto, rule_to_proto};
