//! Who is asking: the pod a projected ServiceAccount token was issued for, from a TokenReview
//! (the API server checks the signature, the audience, the expiry, and that the pod still
//! exists with that UID).

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::Semaphore;
use tonic::Status;

/// The audience of step pods' tokens (their projected volume asks for it): a token for any
/// other audience, such as the pod's default API token, is refused.
pub const AUDIENCE: &str = "spur-io";
/// TokenReview's names for the pod a bound token was issued for.
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";
/// Reviews in flight at once: a burst of step pods costs the API server a bounded load.
const MAX_REVIEWS: usize = 8;

/// A reviewed pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodIdentity {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

pub(crate) struct Authenticator {
    client: Client,
    audience: String,
    reviews: Semaphore,
}

impl Authenticator {
    pub(crate) fn new(client: Client, audience: String) -> Self {
        Authenticator {
            client,
            audience,
            reviews: Semaphore::new(MAX_REVIEWS),
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
        let _permit = self
            .reviews
            .acquire()
            .await
            .map_err(|_| Status::unavailable("shutting down"))?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let reviewed = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "TokenReview failed");
                Status::unavailable("cannot review the token now; retry")
            })?;
        let status = reviewed.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Err(Status::unauthenticated(format!(
                "token refused: {}",
                status.error.as_deref().unwrap_or("not authenticated")
            )));
        }
        if let Some(aud) = &status.audiences
            && !aud.iter().any(|a| a == &self.audience)
        {
            return Err(Status::unauthenticated("token is for another audience"));
        }
        let user = status.user.unwrap_or_default();
        let namespace = user
            .username
            .as_deref()
            .and_then(|u| u.strip_prefix("system:serviceaccount:"))
            .and_then(|rest| rest.split_once(':'))
            .map(|(ns, _)| ns.to_owned())
            .ok_or_else(|| Status::unauthenticated("not a ServiceAccount token"))?;
        let extra = user.extra.unwrap_or_default();
        let one = |key: &str| {
            extra
                .get(key)
                .and_then(|v| v.first())
                .filter(|v| !v.is_empty())
                .cloned()
        };
        match (one(POD_NAME), one(POD_UID)) {
            (Some(name), Some(uid)) => Ok(PodIdentity {
                namespace,
                name,
                uid,
            }),
            _ => Err(Status::unauthenticated(
                "not a pod-bound token (use the pod's projected spur-io token)",
            )),
        }
    }
}
