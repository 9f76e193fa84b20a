//! The controller kit: what every Spur controller shares and that knows nothing of Spur's own
//! kinds. A controller is a `reconcile(Arc<K>, Arc<Ctx>) -> Result<Action, E>` plus an error
//! policy (kube-rs controller-rs is the model); this crate gives it
//!
//! - [`Owner::ensure`]: server-side apply of a child, skipped when a store shows it already
//!   holds every field the apply would write;
//! - [`StatusWriter`]: status apply that skips a status equal to the one the pass started from;
//! - [`finalized`]: a finalizer pass's outcome as the reconciler's own error;
//! - [`Backoff`]: per-object exponential backoff computed in the error policy and reset by the
//!   kit on a successful pass ([`run`]), so reconcilers keep no books;
//! - [`run`]: a built `Controller` driven to its end under a stop token and a drain deadline;
//! - [`changes`]: watch streams that wake a controller only when what it reads changed, with
//!   the stores a pass reads (and [`changes::synced`], which a pass that decides from what a
//!   store lacks waits on);
//! - [`errors_logged`]: a side watch whose failures are logged rather than pause the
//!   controller it wakes;
//! - [`leader`]: leader election on a Lease, each term fenced by the lease's own expiry;
//! - [`verified`]: whole objects re-read only when a metadata store shows they changed.

mod apply;
mod backoff;
pub mod changes;
mod finalizer;
pub mod leader;
mod spawn;
mod status;
pub mod verified;
mod watch_errors;

pub use apply::{Owner, hash_of};
pub use backoff::{Backoff, HasBackoff, key_of};
pub use finalizer::finalized;
pub use spawn::{DRAIN_GRACE, cluster_owners, drained, objects_where, run};
pub use status::StatusWriter;
pub use watch_errors::errors_logged;

/// What the kit's own API calls can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("JSON encoding: {0}")]
    Json(#[from] serde_json::Error),
    /// Adding or removing a finalizer failed (not the reconciler's own pass).
    #[error("finalizer: {0}")]
    Finalizer(String),
    /// A store a pass reads had not finished its first list in time (or its watch is gone).
    #[error("the watch of {0} has not listed its objects (is its list/watch allowed?)")]
    NotSynced(&'static str),
    /// Leader election could not start or its lease manager stopped.
    #[error("leader election: {0}")]
    Lease(String),
}
