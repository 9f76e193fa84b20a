//! What every operator feature shares: the controllers' common context (client, events,
//! backoff, status writes), the operator's error type and metrics, its field manager and
//! finalizer, and the ownership of what it makes in its own namespace. The features (their
//! controllers and webhooks) are crates above this one; `spur-operator` assembles them.

pub mod bundle;
mod context;
mod error;
mod metrics;
pub mod owner;
mod sandbox_metrics;
pub mod workstation_owner;

pub use context::{Context, FIELD_MANAGER, OWNER, delete_opt, now};
pub use error::Error;
pub use metrics::{Metrics, ReconcileTimer};
pub use sandbox_metrics::{Readiness, SandboxStore, readiness};

/// The scheduling of the controllers built on this crate (not the jobs, enrollment and
/// certificate controllers, which have their own): a short debounce coalesces the burst of
/// events one change of several children makes, and at most [`CONCURRENCY`] passes run at once.
pub fn controller_config() -> kube::runtime::controller::Config {
    kube::runtime::controller::Config::default()
        .debounce(std::time::Duration::from_millis(10))
        .concurrency(CONCURRENCY)
}

/// The passes one controller runs at once. kube-runtime's default is no bound: a thousand
/// Sandboxes created together (or an operator that starts with them) would start a thousand
/// passes, each with its own API requests, and the API server queues (then times out) what its
/// priority level for the operator cannot serve, so every pass slows and the failed ones back off
/// (issue 47, point 5: the sandbox_scale bench stalled at 1 000 Sandboxes with the API server at
/// full CPU; this is one suspected cause, not yet measured apart from the others). A pass
/// waiting for its turn is queued, not lost; while all sixteen are busy, which waiting object
/// goes next is not ordered, and sixteen passes stuck on slow calls hold up the rest of their
/// controller.
pub const CONCURRENCY: u16 = 16;

/// The finalizer on Sandboxes, ForkedWorkloads and RouteGroups.
pub const FINALIZER: &str = "spur.dev/cleanup";

#[doc(hidden)]
pub use spur_controller as __controller;

/// Makes `$t`, a feature's context holding the shared [`Context`] in a field
/// `core: Arc<Context>` beside the feature's own configuration, deref to the shared context
/// (its client, events, metrics, status writes) and back off through it (the controller
/// kit's `HasBackoff`).
#[macro_export]
macro_rules! feature_context {
    ($t:ty) => {
        impl ::std::ops::Deref for $t {
            type Target = $crate::Context;
            fn deref(&self) -> &$crate::Context {
                &self.core
            }
        }

        impl $crate::__controller::HasBackoff for $t {
            fn backoff(&self) -> &$crate::__controller::Backoff {
                $crate::__controller::HasBackoff::backoff(&*self.core)
            }
        }
    };
}
