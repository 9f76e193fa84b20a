//! Who may call.
//!
//! - **Sidecars** (WatchSettings, Push) present their pod's projected ServiceAccount token for
//!   the audience [`AUDIENCE`]. The TokenReview names the pod; the store looks the pod up and
//!   accepts it only as an injected sidecar (a `spur-sidecar` container) of the Deployment or
//!   Argo Rollout its controlling ReplicaSet belongs to: the pod may watch and push for that one
//!   baseline. The service then takes only exchanges of sandboxes that capture it.
//! - **Readers** (Query, Tail) present a token for the same audience — never one for the API
//!   server, which the store could replay — and need `get` on the `traffic` subresource of each
//!   sandbox they read (a SubjectAccessReview).
//!
//! Accepted tokens are remembered for [`ACCEPTED_TTL`] (never past their expiry), so a sidecar
//! pushing every 100 ms costs the API server one review per TTL, and at most [`MAX_REVIEWS`]
//! reviews run at once. Open streams are checked again without the cache every
//! [`DEFAULT_RECHECK`] (configurable, with jitter) and when their token expires.
//! Standalone, one static token stands for everything.
//!
//! Tokens are never logged.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::authorization::v1::ResourceAttributes;
use kube::Client;
use spur_proto::traffic::RunFor;
pub use spur_serving::review::PodRef;
use spur_serving::review::{
    self, AudienceCheck, BaselineError, Cache, NotAPod, ReviewError, Reviewer,
};
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::Error;
use crate::settings::Baseline;

/// The audience of every token the store accepts: sidecars' projected tokens and readers'.
pub const AUDIENCE: &str = "spur-traffic";
/// How long an accepted token (and what it was allowed) is reused without asking again.
pub const ACCEPTED_TTL: Duration = Duration::from_secs(30);
/// Token and access reviews in flight at once.
pub const MAX_REVIEWS: usize = 8;
/// How often an open stream's caller is checked again, by default (a random time between half
/// of it and all of it).
pub const DEFAULT_RECHECK: Duration = Duration::from_secs(300);
/// Tokens remembered; past it, expired entries go, then everything.
const MAX_CACHED: usize = 4096;
/// Sandboxes one reader's entry remembers being allowed to read.
const MAX_CACHED_GRANTS: usize = 16;

/// How calls are authenticated and authorized. Cheap to clone.
#[derive(Clone)]
pub enum Authorizer {
    /// Standalone: one bearer token allows everything.
    StaticToken(StaticToken),
    /// In a cluster: Kubernetes tokens and RBAC.
    Kube(KubeAuthorizer),
}

impl fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Authorizer::StaticToken(_) => f.write_str("StaticToken(<redacted>)"),
            Authorizer::Kube(k) => f
                .debug_struct("Kube")
                .field("recheck", &k.inner.recheck)
                .finish_non_exhaustive(),
        }
    }
}

/// Who a sidecar call comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The static token: any baseline.
    Anyone,
    /// An injected sidecar: its pod, and the one baseline it belongs to.
    Sidecar { pod: PodRef, baseline: Baseline },
}

impl Caller {
    /// PERMISSION_DENIED unless this caller may watch or push for `baseline`.
    pub fn may_use(&self, baseline: &Baseline) -> Result<(), Status> {
        match self {
            Caller::Anyone => Ok(()),
            Caller::Sidecar { pod, baseline: own } if own != baseline => {
                Err(Status::permission_denied(format!(
                    "pod {}/{} is the sidecar of {}; it may watch and push only for that baseline, not {}",
                    pod.namespace,
                    pod.name,
                    describe(own),
                    describe(baseline)
                )))
            }
            Caller::Sidecar { .. } => Ok(()),
        }
    }
}

/// `Deployment shop/backend`.
pub(crate) fn describe(b: &Baseline) -> String {
    format!("{} {}/{}", b.kind, b.namespace, b.name)
}

/// A caller's bearer token, kept by an open stream for its re-checks. Never printed.
#[derive(Clone)]
pub struct Credentials(Arc<str>);

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Credentials(<redacted>)")
    }
}

impl Credentials {
    /// The token of `authorization: Bearer <token>`; UNAUTHENTICATED without one.
    pub fn from_metadata(metadata: &MetadataMap) -> Result<Self, Status> {
        bearer(metadata).map(|t| Credentials(Arc::from(t)))
    }
}

impl Authorizer {
    /// A static token (not empty).
    pub fn static_token(token: impl Into<String>) -> Result<Self, Error> {
        let token = token.into();
        if token.trim().is_empty() {
            return Err(Error::Config("the static token must not be empty".into()));
        }
        Ok(Authorizer::StaticToken(StaticToken(Arc::from(
            token.into_bytes().into_boxed_slice(),
        ))))
    }

    /// Kubernetes tokens, reviewed by `client`'s API server; open streams re-checked every
    /// [`DEFAULT_RECHECK`].
    pub fn kube(client: Client) -> Self {
        Self::kube_with_recheck(client, DEFAULT_RECHECK)
    }

    /// [`Authorizer::kube`], re-checking open streams every `recheck` (at least a second).
    pub fn kube_with_recheck(client: Client, recheck: Duration) -> Self {
        Authorizer::Kube(KubeAuthorizer {
            inner: Arc::new(Kube {
                reviewer: Reviewer::new(client, MAX_REVIEWS),
                recheck: recheck.max(Duration::from_secs(1)),
                cache: Cache::new(MAX_CACHED),
            }),
        })
    }

    /// Who is calling WatchSettings or Push. UNAUTHENTICATED for a missing or refused token,
    /// PERMISSION_DENIED for a pod that is no injected sidecar of a Deployment or Rollout,
    /// UNAVAILABLE when the API server cannot be asked.
    pub async fn sidecar(&self, metadata: &MetadataMap) -> Result<Caller, Status> {
        self.sidecar_with(&Credentials::from_metadata(metadata)?, false)
            .await
    }

    /// Whether the caller of Query or Tail may read `sandbox` (every sandbox when empty):
    /// PERMISSION_DENIED when RBAC says no.
    pub async fn reader(&self, metadata: &MetadataMap, sandbox: &str) -> Result<(), Status> {
        self.reader_with(&Credentials::from_metadata(metadata)?, sandbox, false)
            .await
    }

    /// Whether the caller of StartRunCapture or EndRunCapture may capture a run of `sandbox`:
    /// `update` on its `sandboxes/capture` (the right that switches its capture on). The
    /// user it names is returned, for [`Authorizer::run_namespaces`]. PERMISSION_DENIED when
    /// RBAC says no.
    pub async fn run_capturer(
        &self,
        metadata: &MetadataMap,
        sandbox: &str,
    ) -> Result<Option<UserInfo>, Status> {
        let token = bearer(metadata)?;
        match self {
            Authorizer::StaticToken(t) => t.check(token).map(|()| None),
            Authorizer::Kube(k) => k.inner.run_capturer(token, sandbox).await.map(Some),
        }
    }

    /// Whether the caller of StartRunCapture with `run_for` may start a run of `sandbox` for
    /// that user: the caller needs `delegate` on the sandbox's `sandboxes/capture`, and the
    /// user `update` on it and `get` on its `sandboxes/traffic` (what a run the user started
    /// and read back would need). The user is returned, for [`Authorizer::run_namespaces`],
    /// with the caller's username. The static token stands for everything (None, and no
    /// username).
    pub async fn run_delegate(
        &self,
        metadata: &MetadataMap,
        sandbox: &str,
        run_for: &RunFor,
    ) -> Result<(Option<UserInfo>, String), Status> {
        let token = bearer(metadata)?;
        match self {
            Authorizer::StaticToken(t) => t.check(token).map(|()| (None, String::new())),
            Authorizer::Kube(k) => {
                let (caller, user) = k.inner.run_delegate(token, sandbox, run_for).await?;
                Ok((Some(user), caller.username.unwrap_or_default()))
            }
        }
    }

    /// Whether the caller may end a run of `sandbox` started for a user: `delegate` on the
    /// sandbox's `sandboxes/capture`, the right that started it (the operator, when the run's
    /// Job ended). The static token stands for everything.
    pub async fn run_delegator(&self, metadata: &MetadataMap, sandbox: &str) -> Result<(), Status> {
        let token = bearer(metadata)?;
        match self {
            Authorizer::StaticToken(t) => t.check(token),
            Authorizer::Kube(k) => k.inner.delegator(token, sandbox).await.map(|_| ()),
        }
    }

    /// Whether `user` (from [`Authorizer::run_capturer`]; None: the static token) may create
    /// Deployments in every one of `namespaces`, as creating a sandbox that forks from them
    /// needs: a run captures there what baselines answer.
    pub async fn run_namespaces<'a>(
        &self,
        user: Option<&UserInfo>,
        namespaces: impl IntoIterator<Item = &'a String>,
    ) -> Result<(), Status> {
        let (Authorizer::Kube(k), Some(user)) = (self, user) else {
            return Ok(());
        };
        for namespace in namespaces {
            let attributes = ResourceAttributes {
                group: Some("apps".into()),
                resource: Some("deployments".into()),
                verb: Some("create".into()),
                namespace: Some(namespace.clone()),
                ..ResourceAttributes::default()
            };
            if !k.inner.may(user, attributes).await? {
                return Err(Status::permission_denied(format!(
                    "{} may not create deployments in namespace {namespace}, where the run would \
                     capture",
                    who(user)
                )));
            }
        }
        Ok(())
    }

    /// [`Authorizer::sidecar`] for `credentials`; `fresh` skips the cache (an open stream's
    /// re-check).
    pub async fn sidecar_with(
        &self,
        credentials: &Credentials,
        fresh: bool,
    ) -> Result<Caller, Status> {
        match self {
            Authorizer::StaticToken(t) => t.check(&credentials.0).map(|()| Caller::Anyone),
            Authorizer::Kube(k) => k.inner.sidecar(&credentials.0, fresh).await,
        }
    }

    /// [`Authorizer::reader`] for `credentials`; `fresh` skips the cache.
    pub async fn reader_with(
        &self,
        credentials: &Credentials,
        sandbox: &str,
        fresh: bool,
    ) -> Result<(), Status> {
        match self {
            Authorizer::StaticToken(t) => t.check(&credentials.0),
            Authorizer::Kube(k) => k.inner.reader(&credentials.0, sandbox, fresh).await,
        }
    }

    /// When a stream opened with `credentials` is next checked again; None: never (the static
    /// token). A moment past the token's expiry if that comes first, so the API server sees it
    /// expired.
    pub fn next_recheck(&self, credentials: &Credentials) -> Option<Duration> {
        let Authorizer::Kube(k) = self else {
            return None;
        };
        Some(review::next_recheck(
            k.inner.recheck,
            review::token_expiry(&credentials.0),
        ))
    }
}

/// The token of `authorization: Bearer <token>`.
pub(crate) fn bearer(metadata: &MetadataMap) -> Result<&str, Status> {
    let value = metadata
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::as_bytes);
    review::bearer(value).ok_or_else(|| {
        Status::unauthenticated("no credentials: send `authorization: Bearer <token>`")
    })
}

// === impl StaticToken ===

/// One shared token (standalone mode).
#[derive(Clone)]
pub struct StaticToken(Arc<[u8]>);

impl StaticToken {
    fn check(&self, presented: &str) -> Result<(), Status> {
        if constant_time_eq(&self.0, presented.as_bytes()) {
            Ok(())
        } else {
            Err(Status::unauthenticated("wrong token"))
        }
    }
}

/// Equal bytes, in a time that depends only on the lengths: a wrong guess tells nothing about
/// how much of it was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// === impl KubeAuthorizer ===

/// Kubernetes tokens and RBAC, with a short cache of accepted tokens.
#[derive(Clone)]
pub struct KubeAuthorizer {
    inner: Arc<Kube>,
}

struct Kube {
    reviewer: Reviewer,
    recheck: Duration,
    cache: Cache<(String, Purpose), Identity>,
}

/// Which review a token passed: the same token is reviewed separately for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Purpose {
    Sidecar,
    Reader,
}

#[derive(Clone)]
enum Identity {
    Pod {
        pod: PodRef,
        /// The baseline the pod is a sidecar of, or why it is none (never "unavailable").
        baseline: Result<Baseline, Status>,
    },
    User {
        user: UserInfo,
        /// Sandboxes ("" for all) this user was allowed to read.
        granted: Vec<String>,
    },
}

impl Kube {
    async fn sidecar(&self, token: &str, fresh: bool) -> Result<Caller, Status> {
        let cached = if fresh {
            None
        } else {
            self.cached(token, Purpose::Sidecar)
        };
        let identity = match cached {
            Some(i) => i,
            None => {
                let user = self.review(token, AUDIENCE).await?;
                let pod = pod_of(&user)?;
                let baseline = self.baseline_of(&pod).await;
                if let Err(e) = &baseline
                    && e.code() == tonic::Code::Unavailable
                {
                    return Err(e.clone());
                }
                let identity = Identity::Pod { pod, baseline };
                self.store(token, Purpose::Sidecar, identity.clone());
                identity
            }
        };
        match identity {
            Identity::Pod { pod, baseline } => Ok(Caller::Sidecar {
                pod,
                baseline: baseline?,
            }),
            Identity::User { .. } => Err(Status::unauthenticated("not a pod-bound token")),
        }
    }

    async fn reader(&self, token: &str, sandbox: &str, fresh: bool) -> Result<(), Status> {
        let cached = if fresh {
            None
        } else {
            self.cached(token, Purpose::Reader)
        };
        let identity = match cached {
            Some(i) => i,
            None => Identity::User {
                user: self.review(token, AUDIENCE).await?,
                granted: Vec::new(),
            },
        };
        let Identity::User { user, mut granted } = identity else {
            return Err(Status::unauthenticated("not a user token"));
        };
        if !granted.iter().any(|g| g == sandbox) {
            if !self.may_read(&user, sandbox).await? {
                let who = user.username.clone().unwrap_or_else(|| "this user".into());
                // The token itself was good: the next call skips its TokenReview.
                self.store(token, Purpose::Reader, Identity::User { user, granted });
                let what = if sandbox.is_empty() {
                    "every sandbox (name one in the filter to read only it)".to_string()
                } else {
                    format!("sandbox {sandbox}")
                };
                return Err(Status::permission_denied(format!(
                    "{who} may not get sandboxes/traffic in spur.dev for {what}"
                )));
            }
            if granted.len() >= MAX_CACHED_GRANTS {
                granted.remove(0);
            }
            granted.push(sandbox.to_string());
        }
        self.store(token, Purpose::Reader, Identity::User { user, granted });
        Ok(())
    }

    async fn run_capturer(&self, token: &str, sandbox: &str) -> Result<UserInfo, Status> {
        let user = self.review(token, AUDIENCE).await?;
        if !self
            .may(&user, capture_right("update", "capture", sandbox))
            .await?
        {
            return Err(Status::permission_denied(format!(
                "{} may not update sandboxes/capture in spur.dev for sandbox {sandbox}",
                who(&user)
            )));
        }
        Ok(user)
    }

    /// The caller, if it may `delegate` `sandboxes/capture` of `sandbox`.
    async fn delegator(&self, token: &str, sandbox: &str) -> Result<UserInfo, Status> {
        let caller = self.review(token, AUDIENCE).await?;
        if !self
            .may(&caller, capture_right("delegate", "capture", sandbox))
            .await?
        {
            return Err(Status::permission_denied(format!(
                "{} may not delegate sandboxes/capture in spur.dev for sandbox {sandbox} (start \
                 or end a run capture for another user)",
                who(&caller)
            )));
        }
        Ok(caller)
    }

    async fn run_delegate(
        &self,
        token: &str,
        sandbox: &str,
        run_for: &RunFor,
    ) -> Result<(UserInfo, UserInfo), Status> {
        let caller = self.delegator(token, sandbox).await?;
        if run_for.username.is_empty() || run_for.username.len() > MAX_NAME {
            return Err(Status::invalid_argument(format!(
                "run_for.username: the user the run is for (1 to {MAX_NAME} characters) is \
                 required"
            )));
        }
        // As many as a SmartTest may record for its creator (the operator's runs are for them).
        let group_bytes: usize = run_for.groups.iter().map(|g| g.len() + 3).sum();
        if group_bytes > MAX_GROUP_BYTES || run_for.groups.iter().any(|g| g.len() > MAX_NAME) {
            return Err(Status::invalid_argument(format!(
                "run_for.groups: at most {MAX_GROUP_BYTES} bytes as JSON, of at most {MAX_NAME} \
                 characters each"
            )));
        }
        let user = UserInfo {
            username: Some(run_for.username.clone()),
            groups: (!run_for.groups.is_empty()).then(|| run_for.groups.clone()),
            ..UserInfo::default()
        };
        for (verb, subresource) in [("update", "capture"), ("get", "traffic")] {
            if !self
                .may(&user, capture_right(verb, subresource, sandbox))
                .await?
            {
                return Err(Status::permission_denied(format!(
                    "{} (the user the run is for) may not {verb} sandboxes/{subresource} in spur.dev \
                     for sandbox {sandbox}",
                    who(&user)
                )));
            }
        }
        Ok((caller, user))
    }

    async fn may(&self, user: &UserInfo, attributes: ResourceAttributes) -> Result<bool, Status> {
        self.reviewer
            .access(user, attributes)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))
    }

    fn cached(&self, token: &str, purpose: Purpose) -> Option<Identity> {
        self.cache.get(&(token.to_string(), purpose))
    }

    /// Remembers an accepted token until [`ACCEPTED_TTL`] from now, or its expiry if sooner.
    fn store(&self, token: &str, purpose: Purpose, identity: Identity) {
        // An entry being updated (a new grant) keeps its deadline: grants never extend it.
        self.cache
            .insert((token.to_string(), purpose), identity, |live| {
                live.unwrap_or_else(|| review::deadline(ACCEPTED_TTL, review::token_expiry(token)))
            });
    }

    /// The user behind `token`, if it was issued for `audience`.
    async fn review(&self, token: &str, audience: &str) -> Result<UserInfo, Status> {
        // An API server that ignored the audience (an authenticator that does not know them)
        // names none, or others: refused either way.
        self.reviewer
            .token(token, audience, AudienceCheck::Confirmed)
            .await
            .map_err(|e| match e {
                ReviewError::Refused(_) | ReviewError::AudienceNotConfirmed => {
                    Status::unauthenticated(format!(
                        "token refused for audience {audience}: {e} (present a token issued \
                         for {audience}, e.g. `kubectl create token NAME --audience {audience}`)"
                    ))
                }
                _ => Status::unavailable(e.to_string()),
            })
    }

    /// The baseline `pod` is an injected sidecar of: its controlling ReplicaSet's Deployment
    /// (or Argo Rollout), in the Routes API's spelling. UNAUTHENTICATED when the token's pod is
    /// gone, PERMISSION_DENIED when it is no sidecar of a baseline.
    async fn baseline_of(&self, pod: &PodRef) -> Result<Baseline, Status> {
        let sidecar = spur_api::keys::injection::SIDECAR_CONTAINER;
        let b = self
            .reviewer
            .baseline_of(pod, Some(sidecar))
            .await
            .map_err(|e| match e {
                BaselineError::Unavailable(ref error) => {
                    tracing::warn!(%error, "cannot look up a sidecar's pod");
                    Status::unavailable(e.to_string())
                }
                BaselineError::PodGone { .. } => Status::unauthenticated(e.to_string()),
                BaselineError::NoBaseline(why) => Status::permission_denied(format!(
                    "pod {}/{} is not a Spur sidecar of a Deployment or Argo Rollout: {why}",
                    pod.namespace, pod.name
                )),
            })?;
        Ok(Baseline::new(b.kind, b.namespace.as_str(), b.name.as_str()))
    }

    /// Whether `user` may `get` `sandboxes/traffic` (of `sandbox`, or of all when empty).
    async fn may_read(&self, user: &UserInfo, sandbox: &str) -> Result<bool, Status> {
        let attributes = ResourceAttributes {
            group: Some("spur.dev".into()),
            resource: Some("sandboxes".into()),
            subresource: Some("traffic".into()),
            verb: Some("get".into()),
            name: (!sandbox.is_empty()).then(|| sandbox.to_string()),
            ..ResourceAttributes::default()
        };
        self.may(user, attributes).await
    }
}

/// Longest user or group name a run may be for, and most bytes of its groups.
const MAX_NAME: usize = 512;
const MAX_GROUP_BYTES: usize = spur_api::smarttest::CREATOR_GROUPS_MAX;

/// `verb` on `sandboxes/<subresource>` of `sandbox` (Sandboxes are cluster-scoped).
fn capture_right(verb: &str, subresource: &str, sandbox: &str) -> ResourceAttributes {
    ResourceAttributes {
        group: Some("spur.dev".into()),
        resource: Some("sandboxes".into()),
        subresource: Some(subresource.into()),
        verb: Some(verb.into()),
        name: Some(sandbox.to_string()),
        ..ResourceAttributes::default()
    }
}

/// Whether `presented` is run token `token`, in a time that says nothing about how close it was.
pub(crate) fn is_run_token(token: &str, presented: &str) -> bool {
    !token.is_empty() && constant_time_eq(token.as_bytes(), presented.as_bytes())
}

/// The user's name for an error message.
fn who(user: &UserInfo) -> String {
    user.username.clone().unwrap_or_else(|| "this user".into())
}

/// The pod a reviewed sidecar token was bound to.
fn pod_of(user: &UserInfo) -> Result<PodRef, Status> {
    review::pod_of(user).map_err(|e| match e {
        NotAPod::NotServiceAccount => Status::unauthenticated("not a ServiceAccount token"),
        NotAPod::NotPodBound | NotAPod::EmptyPodClaim => Status::unauthenticated(
            "not a pod-bound token (use the pod's projected spur-traffic token)",
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(auth: Option<&str>) -> MetadataMap {
        let mut m = MetadataMap::new();
        if let Some(a) = auth {
            m.insert("authorization", a.parse().unwrap());
        }
        m
    }

    #[tokio::test]
    async fn the_static_token_allows_everything_and_nothing_else() {
        let auth = Authorizer::static_token("s3cret").unwrap();
        assert_eq!(
            auth.sidecar(&md(Some("Bearer s3cret"))).await.unwrap(),
            Caller::Anyone
        );
        auth.reader(&md(Some("bearer  s3cret ")), "").await.unwrap();
        for bad in [
            None,
            Some("Bearer wrong"),
            Some("Bearer s3cre"),
            Some("Basic s3cret"),
            Some("Bearer "),
            Some("s3cret"),
        ] {
            let e = auth.reader(&md(bad), "sb").await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{bad:?}");
            let e = auth.sidecar(&md(bad)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{bad:?}");
        }
        assert!(Authorizer::static_token(" ").is_err());
        assert!(!format!("{auth:?}").contains("s3cret"));
    }

    #[test]
    fn a_sidecar_may_use_only_its_own_baseline() {
        let backend = Baseline::new("Deployment", "team-a", "backend");
        let pod = Caller::Sidecar {
            pod: PodRef {
                namespace: "team-a".into(),
                name: "backend-1".into(),
                uid: "u1".into(),
            },
            baseline: backend.clone(),
        };
        pod.may_use(&backend).unwrap();
        for other in [
            Baseline::new("Deployment", "team-a", "frontend"),
            Baseline::new("ArgoRollout", "team-a", "backend"),
            Baseline::new("Deployment", "team-b", "backend"),
        ] {
            let e = pod.may_use(&other).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{other:?}");
            assert!(e.message().contains("Deployment team-a/backend"), "{e:?}");
        }
        Caller::Anyone.may_use(&backend).unwrap();
    }

    #[tokio::test]
    async fn static_streams_are_never_rechecked() {
        let auth = Authorizer::static_token("s3cret").unwrap();
        let creds = Credentials::from_metadata(&md(Some("Bearer s3cret"))).unwrap();
        assert_eq!(auth.next_recheck(&creds), None);
        assert!(!format!("{creds:?}").contains("s3cret"));
        assert_eq!(
            auth.sidecar_with(&creds, true).await.unwrap(),
            Caller::Anyone
        );
    }
}
