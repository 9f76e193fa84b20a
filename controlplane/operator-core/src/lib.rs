//! What every operator feature shares: the controllers' common context (client, events,
//! backoff, status writes), the operator's error type and metrics, its field manager and
//! finalizer, and the ownership of what it makes in its own namespace. The features (their
//! controllers and webhooks) are crates above this one; `spur-operator` assembles them.

pub mod bundle;
mod context;
mod error;
mod metrics;
pub mod owner;
pub mod workstation_owner;

pub use context::{Context, FIELD_MANAGER, OWNER, delete_opt, now};
pub use error::Error;
pub use metrics::{Metrics, ReconcileTimer};

/// Every controller's scheduling: a short debounce coalesces the burst of events one change
/// of several children makes.
pub fn controller_config() -> kube::runtime::controller::Config {
    kube::runtime::controller::Config::default().debounce(std::time::Duration::from_millis(10))
}

/// The finalizer on Sandboxes, ForkedWorkloads and RouteGroups.
pub const FINALIZER: &str = "spur.dev/cleanup";
