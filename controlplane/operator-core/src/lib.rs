//! What every operator feature shares: the controllers' common context (client, events,
//! backoff, status writes), the operator's error type and metrics, its field manager and
//! finalizer, and the ownership of what it makes in its own namespace. The features (their
//! controllers and webhooks) are crates above this one; `spur-operator` assembles them.

mod context;
mod error;
mod metrics;
pub mod owner;

pub use context::{Context, FIELD_MANAGER, OWNER, delete_opt, now};
pub use error::Error;
pub use metrics::{Metrics, ReconcileTimer};

/// The finalizer on Sandboxes, ForkedWorkloads and RouteGroups.
pub const FINALIZER: &str = "spur.dev/cleanup";
