/// Errors of a reconcile pass; every one is retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(String),
    #[error("{kind} {name} has no namespace")]
    NoNamespace { kind: &'static str, name: String },
    #[error("waiting for {0}")]
    Pending(String),
    /// Waiting, and when to look again (a step's backoff), not a failure.
    #[error("waiting for {what} (next look in {after:?})")]
    Requeue {
        what: String,
        after: std::time::Duration,
    },
    #[error("JSON encoding: {0}")]
    Json(#[from] serde_json::Error),
    /// A store a pass reads has not listed its objects within
    /// `spur_controller::changes::SYNC_WAIT`: its watch fails (often RBAC: the list or watch
    /// verb is missing). A failure, backed off and counted, not a wait: it does not heal alone.
    #[error("the watch of {0} has not listed its objects (is its list/watch allowed?)")]
    NotSynced(&'static str),
    #[error("leader election: {0}")]
    Lease(String),
    #[error("certificates: {0}")]
    Pki(String),
    /// The serving kit's PKI or TLS (its messages say which).
    #[error(transparent)]
    Serving(#[from] spur_serving::Error),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("webhook server: {0}")]
    Webhook(String),
    /// The Envoy descriptor set did not load (a build fault: every EnvoyConfig waits).
    #[error(transparent)]
    Envoy(#[from] spur_envoy::Error),
    /// A mesh object (VirtualService, HTTPRoute) could not be brought to what a mesh route
    /// wants.
    #[error("mesh routes: {0}")]
    Mesh(String),
    /// The pre-upgrade hook refused a change, or could not make it (its message says which
    /// value and what to do).
    #[error("{0}")]
    Upgrade(String),
}

/// The controller kit's errors are the operator's own (same variants, same messages), so the
/// error policies see them as before the kit existed.
impl From<spur_controller::Error> for Error {
    fn from(e: spur_controller::Error) -> Self {
        match e {
            spur_controller::Error::Kube(e) => Error::Kube(e),
            spur_controller::Error::Json(e) => Error::Json(e),
            spur_controller::Error::Finalizer(m) => Error::Finalizer(m),
            spur_controller::Error::NotSynced(kind) => Error::NotSynced(kind),
            spur_controller::Error::Lease(m) => Error::Lease(m),
        }
    }
}
