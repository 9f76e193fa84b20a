//! Who may read which rules (docs/routeserver.md, "Authentication").
//!
//! Every request carries `authorization: Bearer <token>`, a Kubernetes token checked with a
//! TokenReview for the route server's audience:
//! - A **pod-bound ServiceAccount token** (what an injected sidecar sends: a projected token
//!   whose review names the pod) reads only the rules of its own baseline: the request must name
//!   a baseline, and the pod's controlling ReplicaSet must belong to it.
//! - **Any other identity** (a person, a CI job, a controller) may read what its RBAC allows:
//!   every rule if it may `list` `routingconfigs.spur.dev` (the objects the rules come from),
//!   the cluster's services (GetClusterServices) if it may `list` `services` cluster-wide —
//!   asked with a SubjectAccessReview.
//!
//! - For the L4 listener API (a gateway's `spur.l4.v1.Listeners`), a pod-bound token may ask
//!   only for its own pod's listeners; any other identity needs `list` on
//!   `listenersets.spur.dev` in the pod's namespace.
//!
//! Answers are cached briefly, so thousands of sidecars reconnecting at once cost the API server
//! one review per token, and at most [`MAX_REVIEWS`] reviews run at a time.
//!
//! A watch is checked when it opens and again, without the cache, every `watch_recheck` (with
//! jitter) and when its token expires (the JWT's `exp`): a deleted pod, a revoked binding or an
//! expired token ends the stream with UNAUTHENTICATED or PERMISSION_DENIED, and the sidecar
//! reconnects with the fresh token the kubelet has written meanwhile.
//!
//! The reviews need the `kubernetes` feature (on by default); without it only
//! [`AuthConfig::Disabled`] exists, as in the standalone demo.

use std::fmt;
#[cfg(feature = "kubernetes")]
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::index::Filter;

#[cfg(feature = "kubernetes")]
mod review;

/// How the route server authenticates its readers.
#[derive(Clone, Default)]
pub enum AuthConfig {
    /// Anyone who reaches the ports reads every rule (`--allow-unauthenticated`: the
    /// standalone demo and local tests only).
    #[default]
    Disabled,
    /// Kubernetes tokens, reviewed by the cluster's API server.
    #[cfg(feature = "kubernetes")]
    Kubernetes {
        client: kube::Client,
        /// The audience tokens must be issued for (the sidecar's projected token asks for it).
        audience: String,
        /// How often an open watch is checked again, bypassing the cache (a random time
        /// between half of it and all of it, so watches opened together spread their reviews).
        watch_recheck: Duration,
    },
}

impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuthConfig::Disabled => f.write_str("Disabled"),
            #[cfg(feature = "kubernetes")]
            AuthConfig::Kubernetes {
                audience,
                watch_recheck,
                ..
            } => f
                .debug_struct("Kubernetes")
                .field("audience", audience)
                .field("watch_recheck", watch_recheck)
                .finish_non_exhaustive(),
        }
    }
}

/// What a request asks to read.
#[derive(Debug, Clone, Copy)]
// Read only by the reviews; without them every scope is granted.
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
pub(crate) enum Scope<'a> {
    Rules(&'a Filter),
    ClusterServices,
    /// The L4 listeners of one gateway pod (its Watch and its Report).
    Listeners {
        namespace: &'a str,
        pod: &'a str,
    },
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
// Made only by the reviews; without them nothing is refused.
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
pub(crate) enum Denied {
    /// No token, or one the API server does not accept for our audience.
    Unauthenticated(String),
    /// A valid identity that may not read this.
    Forbidden(String),
    /// The API server could not be asked; the client should retry.
    Unavailable(String),
}

impl Denied {
    /// The gRPC code's name, for clients that see the refusal outside gRPC.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            Denied::Unauthenticated(_) => "UNAUTHENTICATED",
            Denied::Forbidden(_) => "PERMISSION_DENIED",
            Denied::Unavailable(_) => "UNAVAILABLE",
        }
    }
}

impl fmt::Display for Denied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Denied::Unauthenticated(m) | Denied::Forbidden(m) | Denied::Unavailable(m) => {
                f.write_str(m)
            }
        }
    }
}

impl From<Denied> for tonic::Status {
    fn from(d: Denied) -> Self {
        match d {
            Denied::Unauthenticated(m) => tonic::Status::unauthenticated(m),
            Denied::Forbidden(m) => tonic::Status::permission_denied(m),
            Denied::Unavailable(m) => tonic::Status::unavailable(m),
        }
    }
}

/// What an accepted request was granted on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Grant {
    /// When the token stops being valid (its `exp` claim), if it says.
    pub(crate) expires: Option<SystemTime>,
}

/// Checks requests against [`AuthConfig`].
#[derive(Clone)]
pub(crate) struct Authenticator {
    #[cfg(feature = "kubernetes")]
    inner: Option<Arc<review::Kube>>,
}

impl Authenticator {
    pub(crate) fn new(config: &AuthConfig) -> Self {
        match config {
            AuthConfig::Disabled => Authenticator {
                #[cfg(feature = "kubernetes")]
                inner: None,
            },
            #[cfg(feature = "kubernetes")]
            AuthConfig::Kubernetes {
                client,
                audience,
                watch_recheck,
            } => Authenticator {
                inner: Some(Arc::new(review::Kube::new(
                    client.clone(),
                    audience.clone(),
                    *watch_recheck,
                ))),
            },
        }
    }

    /// Whether readers are authenticated at all.
    pub(crate) fn enabled(&self) -> bool {
        #[cfg(feature = "kubernetes")]
        return self.inner.is_some();
        #[cfg(not(feature = "kubernetes"))]
        false
    }

    /// Whether `authorization` (the header's value, if any) may read `scope`.
    pub(crate) async fn check(
        &self,
        authorization: Option<&[u8]>,
        scope: Scope<'_>,
    ) -> Result<Grant, Denied> {
        self.check_with(authorization, scope, false).await
    }

    /// [`Self::check`] without the cache: for an open watch, whose grant may have lapsed.
    pub(crate) async fn recheck(
        &self,
        authorization: Option<&[u8]>,
        scope: Scope<'_>,
    ) -> Result<Grant, Denied> {
        self.check_with(authorization, scope, true).await
    }

    /// When an open watch granted `grant` is next checked again; None: never (no
    /// authentication).
    #[cfg(feature = "kubernetes")]
    pub(crate) fn next_recheck(&self, grant: Grant) -> Option<Duration> {
        let kube = self.inner.as_ref()?;
        Some(spur_serving::review::next_recheck(
            kube.watch_recheck,
            grant.expires,
        ))
    }

    /// See [`Self::next_recheck`]: without Kubernetes reviews nothing is checked again.
    #[cfg(not(feature = "kubernetes"))]
    pub(crate) fn next_recheck(&self, _grant: Grant) -> Option<Duration> {
        None
    }

    async fn check_with(
        &self,
        authorization: Option<&[u8]>,
        scope: Scope<'_>,
        fresh: bool,
    ) -> Result<Grant, Denied> {
        #[cfg(feature = "kubernetes")]
        if let Some(kube) = &self.inner {
            return kube.check(authorization, scope, fresh).await;
        }
        // Authentication disabled: every reader reads everything.
        let _ = (authorization, scope, fresh);
        Ok(Grant::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn disabled_lets_everyone_read() {
        let auth = Authenticator::new(&AuthConfig::Disabled);
        let f = Filter::default();
        assert_eq!(
            auth.check(None, Scope::Rules(&f)).await,
            Ok(Grant::default())
        );
        assert_eq!(auth.next_recheck(Grant::default()), None);
    }
}
