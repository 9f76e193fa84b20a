//! Who is asking: the pod a projected ServiceAccount token was issued for, from a TokenReview
//! (the API server checks the signature, the audience, the expiry, and that the pod still
//! exists with that UID).

use kube::Client;
pub use spur_serving::review::PodRef as PodIdentity;
use spur_serving::review::{self, AudienceCheck, NotAPod, ReviewError, Reviewer};
use tonic::Status;

/// The audience of step pods' tokens (their projected volume asks for it): a token for any
/// other audience, such as the pod's default API token, is refused.
pub const AUDIENCE: &str = "spur-io";
/// Reviews in flight at once: a burst of step pods costs the API server a bounded load.
const MAX_REVIEWS: usize = 8;

pub(crate) struct Authenticator {
    reviewer: Reviewer,
    audience: String,
}

impl Authenticator {
    pub(crate) fn new(client: Client, audience: String) -> Self {
        Authenticator {
            reviewer: Reviewer::new(client, MAX_REVIEWS),
            audience,
        }
    }

    /// The pod behind the request's bearer token. UNAUTHENTICATED for a missing, malformed,
    /// invalid or non-pod token; UNAVAILABLE when the API server cannot be asked.
    pub(crate) async fn pod<T>(&self, req: &tonic::Request<T>) -> Result<PodIdentity, Status> {
        let token = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                Status::unauthenticated("a Bearer token (the pod's spur-io token) is required")
            })?;
        // Refuse an answer naming only other audiences; one naming none is trusted.
        let user = self
            .reviewer
            .token(token, &self.audience, AudienceCheck::NotContradicted)
            .await
            .map_err(|e| match e {
                ReviewError::Refused(why) => {
                    Status::unauthenticated(format!("token refused: {why}"))
                }
                ReviewError::AudienceNotConfirmed => {
                    Status::unauthenticated("token is for another audience")
                }
                ReviewError::TokenUnavailable | ReviewError::AccessUnavailable => {
                    Status::unavailable("cannot review the token now; retry")
                }
                ReviewError::ShuttingDown => Status::unavailable(e.to_string()),
            })?;
        review::pod_of(&user).map_err(|e| match e {
            NotAPod::NotServiceAccount => Status::unauthenticated("not a ServiceAccount token"),
            NotAPod::NotPodBound | NotAPod::EmptyPodClaim => Status::unauthenticated(
                "not a pod-bound token (use the pod's projected spur-io token)",
            ),
        })
    }
}
