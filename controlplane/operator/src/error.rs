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
}

/// The reconciler's own error out of a finalizer pass, so the error policy sees what happened.
pub(crate) fn from_finalizer(
    r: Result<kube::runtime::controller::Action, kube::runtime::finalizer::Error<Error>>,
) -> Result<kube::runtime::controller::Action, Error> {
    use kube::runtime::finalizer::Error as F;
    match r {
        Ok(a) => Ok(a),
        Err(F::ApplyFailed(e) | F::CleanupFailed(e)) => Err(e),
        // The object is gone: a reconcile from a cache a moment old cleaned up again after the
        // finalizer had already been removed. Nothing is left to do.
        Err(F::RemoveFinalizer(kube::Error::Api(s))) if s.is_not_found() => {
            Ok(kube::runtime::controller::Action::await_change())
        }
        Err(e) => Err(Error::Finalizer(e.to_string())),
    }
}
