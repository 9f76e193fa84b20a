//! A finalizer pass's outcome as the reconciler's own result.

use kube::runtime::controller::Action;
use kube::runtime::finalizer::Error as F;

use crate::Error;

/// The reconciler's own error out of a finalizer pass (`kube::runtime::finalizer`), so the
/// error policy sees what happened; a failure of the finalizer's own patches becomes
/// [`Error::Finalizer`].
pub fn finalized<E: From<Error> + std::error::Error + 'static>(
    r: Result<Action, F<E>>,
) -> Result<Action, E> {
    match r {
        Ok(a) => Ok(a),
        Err(F::ApplyFailed(e) | F::CleanupFailed(e)) => Err(e),
        // The object is gone: a reconcile from a cache a moment old cleaned up again after the
        // finalizer had already been removed. Nothing is left to do.
        Err(F::RemoveFinalizer(kube::Error::Api(s))) if s.is_not_found() => {
            Ok(Action::await_change())
        }
        Err(e) => Err(Error::Finalizer(e.to_string()).into()),
    }
}
