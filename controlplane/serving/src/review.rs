//! Kubernetes token and access reviews (feature `kube`): the TokenReview that says who a bearer
//! token belongs to, the SubjectAccessReview that says what they may do, the baseline a
//! pod-bound token's pod belongs to, and the bounded cache servers keep in front of them.
//!
//! What a server accepts stays its own: which audience, how far it trusts the API server's
//! audience answer ([`AudienceCheck`]), which resource attributes it asks about, how long
//! answers live and what a refusal says. This module only asks and reads the answers.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::Semaphore;

mod cache;

pub use cache::Cache;

/// TokenReview's names for the pod a bound token was issued for.
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";

/// How much a server trusts the API server to have checked the audience it was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AudienceCheck {
    /// Trust it: an authenticated answer is enough.
    Asked,
    /// Refuse an answer that names audiences, none of them the one asked for.
    NotContradicted,
    /// Refuse an answer that does not name the audience asked for (an authenticator that does
    /// not know audiences names none).
    Confirmed,
}

/// Why a review gave no answer. Servers word the refusals themselves; the texts here are what
/// most of them say.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReviewError {
    /// No review can start any more.
    #[error("shutting down")]
    ShuttingDown,
    /// The TokenReview failed (logged with its error); the caller may retry.
    #[error("cannot check the token now; retry")]
    TokenUnavailable,
    /// The SubjectAccessReview failed (logged with its error); the caller may retry.
    #[error("cannot check access now; retry")]
    AccessUnavailable,
    /// The API server did not authenticate the token: its reason, which names no secret and
    /// helps whoever set up the client.
    #[error("{0}")]
    Refused(String),
    /// Authenticated, but not for the audience asked for (see [`AudienceCheck`]).
    #[error("the API server did not confirm the audience")]
    AudienceNotConfirmed,
}

/// A pod, as a reviewed pod-bound token names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// Why a reviewed identity is no pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotAPod {
    /// The user is no ServiceAccount.
    NotServiceAccount,
    /// A ServiceAccount token bound to no pod.
    NotPodBound,
    /// A pod-bound token whose pod name or UID is empty: an API server never issues one, and it
    /// is refused rather than taken for a token bound to no pod (which could widen what its
    /// bearer may read where plain ServiceAccounts are reviewed by RBAC).
    EmptyPodClaim,
}

/// The workload a pod belongs to, in the Routes API's spelling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Baseline {
    /// `Deployment` or `ArgoRollout`.
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
}

/// Why a pod has no baseline.
#[derive(Debug, thiserror::Error)]
pub enum BaselineError {
    /// The pod or its ReplicaSet cannot be read now: the caller logs the error, the client
    /// retries.
    #[error("cannot look up this pod now; retry")]
    Unavailable(#[source] kube::Error),
    /// The token's pod no longer exists (or another pod has its name now).
    #[error("the token's pod {namespace}/{name} no longer exists")]
    PodGone { namespace: String, name: String },
    /// The pod belongs to no Deployment or Argo Rollout (or lacks the container asked for):
    /// why, for the caller's refusal.
    #[error("{0}")]
    NoBaseline(String),
}

/// Asks one API server, with a bound on the token and access reviews in flight at once.
pub struct Reviewer {
    client: Client,
    reviews: Semaphore,
}

impl std::fmt::Debug for Reviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reviewer").finish_non_exhaustive()
    }
}

impl Reviewer {
    /// Reviews through `client`, at most `max_in_flight` at once.
    pub fn new(client: Client, max_in_flight: usize) -> Self {
        Reviewer {
            client,
            reviews: Semaphore::new(max_in_flight),
        }
    }

    /// The user behind `token`, a token the API server authenticates for `audience`.
    pub async fn token(
        &self,
        token: &str,
        audience: &str,
        check: AudienceCheck,
    ) -> Result<UserInfo, ReviewError> {
        let _permit = self
            .reviews
            .acquire()
            .await
            .map_err(|_| ReviewError::ShuttingDown)?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(vec![audience.to_string()]),
            },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "TokenReview failed");
                ReviewError::TokenUnavailable
            })?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            let why = status.error.unwrap_or_else(|| "not authenticated".into());
            return Err(ReviewError::Refused(why));
        }
        let names_ours = |audiences: &[String]| audiences.iter().any(|a| a == audience);
        let confirmed = match (check, status.audiences.as_deref()) {
            (AudienceCheck::Asked, _) | (AudienceCheck::NotContradicted, None) => true,
            (AudienceCheck::NotContradicted, Some(named)) => names_ours(named),
            (AudienceCheck::Confirmed, named) => names_ours(named.unwrap_or_default()),
        };
        if !confirmed {
            return Err(ReviewError::AudienceNotConfirmed);
        }
        Ok(status.user.unwrap_or_default())
    }

    /// Whether `user` may do what `attributes` say.
    pub async fn access(
        &self,
        user: &UserInfo,
        attributes: ResourceAttributes,
    ) -> Result<bool, ReviewError> {
        let _permit = self
            .reviews
            .acquire()
            .await
            .map_err(|_| ReviewError::ShuttingDown)?;
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username.clone(),
                groups: user.groups.clone(),
                uid: user.uid.clone(),
                extra: user.extra.clone(),
                resource_attributes: Some(attributes),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "SubjectAccessReview failed");
                ReviewError::AccessUnavailable
            })?;
        Ok(answer.status.is_some_and(|s| s.allowed))
    }

    /// The baseline `pod` belongs to: its controlling ReplicaSet's Deployment (or Argo
    /// Rollout). With `container`, a pod without a container of that name (among its
    /// containers and init containers) belongs to none. Not bounded by the reviews in flight:
    /// these are reads, which the client's own limits cover.
    pub async fn baseline_of(
        &self,
        pod: &PodRef,
        container: Option<&str>,
    ) -> Result<Baseline, BaselineError> {
        self.baseline_and_labels_of(pod, container)
            .await
            .map(|(b, _)| b)
    }

    /// [`Self::baseline_of`], with the pod's labels: for a server that treats some pods
    /// specially (the route server: a fork's pods read their baseline's rules), without a
    /// second read of the pod.
    pub async fn baseline_and_labels_of(
        &self,
        pod: &PodRef,
        container: Option<&str>,
    ) -> Result<(Baseline, std::collections::BTreeMap<String, String>), BaselineError> {
        let PodRef {
            namespace,
            name,
            uid,
        } = pod;
        let found = Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(BaselineError::Unavailable)?
            .filter(|p| p.metadata.uid.as_deref() == Some(uid.as_str()))
            .ok_or_else(|| BaselineError::PodGone {
                namespace: namespace.clone(),
                name: name.clone(),
            })?;
        if let Some(container) = container {
            let has = found.spec.as_ref().is_some_and(|s| {
                s.containers
                    .iter()
                    .chain(s.init_containers.iter().flatten())
                    .any(|c| c.name == container)
            });
            if !has {
                return Err(BaselineError::NoBaseline(format!(
                    "it has no {container} container"
                )));
            }
        }
        let no_baseline = BaselineError::NoBaseline;
        let rs_ref = controller(found.metadata.owner_references.as_deref())
            .filter(|o| o.kind == "ReplicaSet" && o.api_version == "apps/v1")
            .ok_or_else(|| no_baseline("no controlling ReplicaSet".into()))?;
        let rs = Api::<ReplicaSet>::namespaced(self.client.clone(), namespace)
            .get_opt(&rs_ref.name)
            .await
            .map_err(BaselineError::Unavailable)?
            .filter(|rs| rs.metadata.uid.as_deref() == Some(rs_ref.uid.as_str()))
            .ok_or_else(|| no_baseline(format!("ReplicaSet {} is gone", rs_ref.name)))?;
        let owner = controller(rs.metadata.owner_references.as_deref())
            .ok_or_else(|| no_baseline(format!("ReplicaSet {} has no controller", rs_ref.name)))?;
        let kind = match (owner.api_version.as_str(), owner.kind.as_str()) {
            ("apps/v1", "Deployment") => "Deployment",
            (v, "Rollout") if v.starts_with("argoproj.io/") => "ArgoRollout",
            (_, k) => return Err(no_baseline(format!("its ReplicaSet is owned by a {k}"))),
        };
        let baseline = Baseline {
            kind,
            namespace: namespace.clone(),
            name: owner.name.clone(),
        };
        Ok((baseline, found.metadata.labels.unwrap_or_default()))
    }
}

fn controller(owners: Option<&[OwnerReference]>) -> Option<&OwnerReference> {
    owners
        .unwrap_or_default()
        .iter()
        .find(|o| o.controller == Some(true))
}

/// The token of an `authorization: Bearer <token>` value (the scheme in any case, as HTTP
/// has it); None without one.
pub fn bearer(authorization: Option<&[u8]>) -> Option<&str> {
    let value = std::str::from_utf8(authorization?).ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The pod a reviewed pod-bound ServiceAccount token was issued for.
pub fn pod_of(user: &UserInfo) -> Result<PodRef, NotAPod> {
    let namespace = user
        .username
        .as_deref()
        .and_then(|u| u.strip_prefix("system:serviceaccount:"))
        .and_then(|rest| rest.split_once(':'))
        .map(|(ns, _)| ns.to_string())
        .ok_or(NotAPod::NotServiceAccount)?;
    let extra = |key: &str| {
        user.extra
            .as_ref()
            .and_then(|x| x.get(key))
            .and_then(|v| v.first())
            .cloned()
    };
    match (extra(POD_NAME), extra(POD_UID)) {
        (Some(name), Some(uid)) if name.is_empty() || uid.is_empty() => Err(NotAPod::EmptyPodClaim),
        (Some(name), Some(uid)) => Ok(PodRef {
            namespace,
            name,
            uid,
        }),
        (Some(v), None) | (None, Some(v)) if v.is_empty() => Err(NotAPod::EmptyPodClaim),
        _ => Err(NotAPod::NotPodBound),
    }
}

/// The `exp` claim of a JWT, read without checking the signature: only for a token the API
/// server has accepted. None for a token that is not a JWT or says nothing.
pub fn token_expiry(token: &str) -> Option<SystemTime> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let exp = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()?
        .get("exp")?
        .as_u64()?;
    UNIX_EPOCH.checked_add(Duration::from_secs(exp))
}

/// How long an answer about a token may be reused: `ttl` from now, never past the token's
/// `expires`.
pub fn deadline(ttl: Duration, expires: Option<SystemTime>) -> Instant {
    let left = expires
        .map(|e| e.duration_since(SystemTime::now()).unwrap_or_default())
        .unwrap_or(ttl);
    Instant::now() + left.min(ttl)
}

/// When an open stream is next checked again: a random time between half of `every` and all
/// of it (so streams opened together spread their reviews), or a moment past the token's
/// `expires` if that comes first, so the API server sees it expired.
pub fn next_recheck(every: Duration, expires: Option<SystemTime>) -> Duration {
    let wait = spur_runtime::jitter(every);
    match expires {
        Some(expires) => {
            let left = expires
                .duration_since(SystemTime::now())
                .unwrap_or_default();
            wait.min(left + Duration::from_secs(1))
        }
        None => wait,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn bearer_tokens_are_read_strictly() {
        assert_eq!(bearer(Some(b"Bearer abc")), Some("abc"));
        assert_eq!(bearer(Some(b"bearer  abc ")), Some("abc"));
        for bad in [
            &b""[..],
            b"abc",
            b"Basic abc",
            b"Bearer ",
            b"Bearer",
            b"\xff\xfe",
        ] {
            assert_eq!(bearer(Some(bad)), None, "{bad:?}");
        }
        assert_eq!(bearer(None), None);
    }

    #[test]
    fn a_tokens_expiry_is_its_exp_claim() {
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let jwt = |claims: &str| format!("{}.{}.sig", b64(r#"{"alg":"RS256"}"#), b64(claims));
        assert_eq!(
            token_expiry(&jwt(r#"{"aud":["spur-routeserver"],"exp":1800000000}"#)),
            UNIX_EPOCH.checked_add(Duration::from_secs(1_800_000_000))
        );
        for no in [
            jwt(r#"{"sub":"x"}"#),
            jwt("{}"),
            jwt(r#"{"exp":"soon"}"#),
            jwt(r#"{"exp":-1}"#),
            "opaque-static-token".to_string(),
            "a.%%%.c".to_string(),
            format!("a.{}.c", b64("not json")),
        ] {
            assert_eq!(token_expiry(&no), None, "{no}");
        }
    }

    #[test]
    fn a_reviewed_token_names_its_pod() {
        let user = |name: &str, pod: Option<&str>, uid: Option<&str>| {
            let mut extra = BTreeMap::new();
            if let Some(p) = pod {
                extra.insert(POD_NAME.to_string(), vec![p.to_string()]);
            }
            if let Some(u) = uid {
                extra.insert(POD_UID.to_string(), vec![u.to_string()]);
            }
            UserInfo {
                username: Some(name.into()),
                extra: Some(extra),
                ..UserInfo::default()
            }
        };
        let sa = "system:serviceaccount:team-a:default";
        assert_eq!(
            pod_of(&user(sa, Some("web-1"), Some("u1"))),
            Ok(PodRef {
                namespace: "team-a".into(),
                name: "web-1".into(),
                uid: "u1".into()
            })
        );
        assert_eq!(
            pod_of(&user(sa, None, Some("u1"))),
            Err(NotAPod::NotPodBound)
        );
        assert_eq!(
            pod_of(&user(sa, Some("web-1"), None)),
            Err(NotAPod::NotPodBound)
        );
        assert_eq!(
            pod_of(&user(sa, Some(""), Some("u1"))),
            Err(NotAPod::EmptyPodClaim)
        );
        assert_eq!(
            pod_of(&user(sa, Some("web-1"), Some(""))),
            Err(NotAPod::EmptyPodClaim)
        );
        assert_eq!(
            pod_of(&user("alice", Some("web-1"), Some("u1"))),
            Err(NotAPod::NotServiceAccount)
        );
    }

    #[test]
    fn answers_live_no_longer_than_their_token() {
        let ttl = Duration::from_secs(60);
        let soon = SystemTime::now() + Duration::from_secs(5);
        let now = Instant::now();
        assert!(deadline(ttl, None) >= now + ttl);
        assert!(deadline(ttl, Some(soon)) <= now + Duration::from_secs(6));
        assert!(deadline(ttl, Some(UNIX_EPOCH)) <= Instant::now());
        assert!(next_recheck(ttl, None) <= ttl);
        assert!(next_recheck(ttl, Some(soon)) <= Duration::from_secs(6));
    }
}
