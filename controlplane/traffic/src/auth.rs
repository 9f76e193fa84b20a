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

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
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
/// TokenReview's names for the pod a bound token was issued for.
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";

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

/// A pod, as a reviewed token names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
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
                client,
                recheck: recheck.max(Duration::from_secs(1)),
                cache: Mutex::new(HashMap::new()),
                reviews: Semaphore::new(MAX_REVIEWS),
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
        let mut wait = spur_runtime::jitter(k.inner.recheck);
        if let Some(expires) = token_expiry(&credentials.0) {
            let left = expires
                .duration_since(SystemTime::now())
                .unwrap_or_default();
            wait = wait.min(left + Duration::from_secs(1));
        }
        Some(wait)
    }
}

/// The token of `authorization: Bearer <token>`.
fn bearer(metadata: &MetadataMap) -> Result<&str, Status> {
    let missing =
        || Status::unauthenticated("no credentials: send `authorization: Bearer <token>`");
    let value = metadata
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(missing)?;
    let (scheme, token) = value.trim().split_once(' ').ok_or_else(missing)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(missing());
    }
    Ok(token)
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
    client: Client,
    recheck: Duration,
    cache: Mutex<HashMap<(String, Purpose), Entry>>,
    reviews: Semaphore,
}

/// Which review a token passed: the same token is reviewed separately for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Purpose {
    Sidecar,
    Reader,
}

#[derive(Clone)]
struct Entry {
    until: Instant,
    identity: Identity,
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
                let pod = pod_of(user)?;
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

    fn cached(&self, token: &str, purpose: Purpose) -> Option<Identity> {
        let cache = self.cache.lock().ok()?;
        cache
            .get(&(token.to_string(), purpose))
            .filter(|e| e.until > Instant::now())
            .map(|e| e.identity.clone())
    }

    /// Remembers an accepted token until [`ACCEPTED_TTL`] from now, or its expiry if sooner.
    fn store(&self, token: &str, purpose: Purpose, identity: Identity) {
        let now = Instant::now();
        let key = (token.to_string(), purpose);
        let Ok(mut cache) = self.cache.lock() else {
            return;
        };
        // An entry being updated (a new grant) keeps its deadline: grants never extend it.
        let until = match cache.get(&key) {
            Some(e) if e.until > now => e.until,
            _ => {
                let left = token_expiry(token)
                    .map(|exp| exp.duration_since(SystemTime::now()).unwrap_or_default())
                    .unwrap_or(ACCEPTED_TTL);
                now + left.min(ACCEPTED_TTL)
            }
        };
        if until <= now {
            return;
        }
        if cache.len() >= MAX_CACHED && !cache.contains_key(&key) {
            cache.retain(|_, e| e.until > now);
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
        }
        cache.insert(key, Entry { until, identity });
    }

    /// The user behind `token`, if it was issued for `audience`.
    async fn review(&self, token: &str, audience: &str) -> Result<UserInfo, Status> {
        let _permit = self
            .reviews
            .acquire()
            .await
            .map_err(|_| Status::unavailable("shutting down"))?;
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
                Status::unavailable("cannot check the token now; retry")
            })?;
        let status = answer.status.unwrap_or_default();
        let refused = |why: &str| {
            Status::unauthenticated(format!(
                "token refused for audience {audience}: {why} (present a token issued for \
                 {audience}, e.g. `kubectl create token NAME --audience {audience}`)"
            ))
        };
        if status.authenticated != Some(true) {
            // The API server's reason names no secret; it helps whoever set up the client.
            let why = status.error.unwrap_or_else(|| "not authenticated".into());
            return Err(refused(&why));
        }
        // An API server that ignored the audience (an authenticator that does not know them)
        // names none, or others: refused either way.
        if !status
            .audiences
            .as_deref()
            .unwrap_or_default()
            .iter()
            .any(|a| a == audience)
        {
            return Err(refused("the API server did not confirm the audience"));
        }
        Ok(status.user.unwrap_or_default())
    }

    /// The baseline `pod` is an injected sidecar of: its controlling ReplicaSet's Deployment
    /// (or Argo Rollout), in the Routes API's spelling. UNAUTHENTICATED when the token's pod is
    /// gone, PERMISSION_DENIED when it is no sidecar of a baseline.
    async fn baseline_of(&self, pod: &PodRef) -> Result<Baseline, Status> {
        let PodRef {
            namespace,
            name,
            uid,
        } = pod;
        let unavailable = |e: kube::Error| {
            tracing::warn!(error = %e, "cannot look up a sidecar's pod");
            Status::unavailable("cannot look up this pod now; retry")
        };
        let refuse = |why: String| {
            Status::permission_denied(format!(
                "pod {namespace}/{name} is not a Spur sidecar of a Deployment or Argo Rollout: {why}"
            ))
        };
        let found = Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(unavailable)?
            .filter(|p| p.metadata.uid.as_deref() == Some(uid.as_str()))
            .ok_or_else(|| {
                Status::unauthenticated(format!(
                    "the token's pod {namespace}/{name} no longer exists"
                ))
            })?;
        let sidecar = spur_api::keys::injection::SIDECAR_CONTAINER;
        let injected = found.spec.as_ref().is_some_and(|s| {
            s.containers
                .iter()
                .chain(s.init_containers.iter().flatten())
                .any(|c| c.name == sidecar)
        });
        if !injected {
            return Err(refuse(format!("it has no {sidecar} container")));
        }
        let rs_ref = controller(found.metadata.owner_references.as_deref())
            .filter(|o| o.kind == "ReplicaSet" && o.api_version == "apps/v1")
            .ok_or_else(|| refuse("no controlling ReplicaSet".into()))?;
        let rs = Api::<ReplicaSet>::namespaced(self.client.clone(), namespace)
            .get_opt(&rs_ref.name)
            .await
            .map_err(unavailable)?
            .filter(|rs| rs.metadata.uid.as_deref() == Some(rs_ref.uid.as_str()))
            .ok_or_else(|| refuse(format!("ReplicaSet {} is gone", rs_ref.name)))?;
        let owner = controller(rs.metadata.owner_references.as_deref())
            .ok_or_else(|| refuse(format!("ReplicaSet {} has no controller", rs_ref.name)))?;
        let kind = match (owner.api_version.as_str(), owner.kind.as_str()) {
            ("apps/v1", "Deployment") => "Deployment",
            (v, "Rollout") if v.starts_with("argoproj.io/") => "ArgoRollout",
            (_, k) => return Err(refuse(format!("its ReplicaSet is owned by a {k}"))),
        };
        Ok(Baseline::new(kind, namespace.as_str(), owner.name.as_str()))
    }

    /// Whether `user` may `get` `sandboxes/traffic` (of `sandbox`, or of all when empty).
    async fn may_read(&self, user: &UserInfo, sandbox: &str) -> Result<bool, Status> {
        let _permit = self
            .reviews
            .acquire()
            .await
            .map_err(|_| Status::unavailable("shutting down"))?;
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username.clone(),
                groups: user.groups.clone(),
                uid: user.uid.clone(),
                extra: user.extra.clone(),
                resource_attributes: Some(ResourceAttributes {
                    group: Some("spur.dev".into()),
                    resource: Some("sandboxes".into()),
                    subresource: Some("traffic".into()),
                    verb: Some("get".into()),
                    name: (!sandbox.is_empty()).then(|| sandbox.to_string()),
                    ..ResourceAttributes::default()
                }),
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
                Status::unavailable("cannot check access now; retry")
            })?;
        Ok(answer.status.is_some_and(|s| s.allowed))
    }
}

fn controller(owners: Option<&[OwnerReference]>) -> Option<&OwnerReference> {
    owners
        .unwrap_or_default()
        .iter()
        .find(|o| o.controller == Some(true))
}

/// The pod a reviewed sidecar token was bound to.
fn pod_of(user: UserInfo) -> Result<PodRef, Status> {
    let namespace = user
        .username
        .as_deref()
        .and_then(|u| u.strip_prefix("system:serviceaccount:"))
        .and_then(|rest| rest.split_once(':'))
        .map(|(ns, _)| ns.to_string())
        .ok_or_else(|| Status::unauthenticated("not a ServiceAccount token"))?;
    let extra = |key: &str| {
        user.extra
            .as_ref()
            .and_then(|x| x.get(key))
            .and_then(|v| v.first())
            .filter(|v| !v.is_empty())
            .cloned()
    };
    match (extra(POD_NAME), extra(POD_UID)) {
        (Some(name), Some(uid)) => Ok(PodRef {
            namespace,
            name,
            uid,
        }),
        _ => Err(Status::unauthenticated(
            "not a pod-bound token (use the pod's projected spur-traffic token)",
        )),
    }
}

/// The `exp` claim of a JWT, read without checking the signature: only for a token the API
/// server has accepted. None for a token that is not a JWT or says nothing.
fn token_expiry(token: &str) -> Option<SystemTime> {
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

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
        let pod = pod_of(user(
            "system:serviceaccount:team-a:default",
            Some("web-1"),
            Some("u1"),
        ))
        .unwrap();
        assert_eq!(
            pod,
            PodRef {
                namespace: "team-a".into(),
                name: "web-1".into(),
                uid: "u1".into()
            }
        );
        assert!(
            pod_of(user(
                "system:serviceaccount:team-a:default",
                None,
                Some("u1")
            ))
            .is_err()
        );
        assert!(
            pod_of(user(
                "system:serviceaccount:team-a:default",
                Some("web-1"),
                None
            ))
            .is_err()
        );
        assert!(pod_of(user("alice", Some("web-1"), Some("u1"))).is_err());
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

    #[test]
    fn a_tokens_expiry_is_its_exp_claim() {
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let jwt = |claims: &str| format!("{}.{}.sig", b64(r#"{"alg":"RS256"}"#), b64(claims));
        assert_eq!(
            token_expiry(&jwt(r#"{"exp":1800000000}"#)),
            UNIX_EPOCH.checked_add(Duration::from_secs(1_800_000_000))
        );
        assert_eq!(token_expiry(&jwt("{}")), None);
        assert_eq!(token_expiry("opaque"), None);
    }
}
