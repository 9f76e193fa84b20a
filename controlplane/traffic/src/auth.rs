//! Who may call: a sidecar may watch settings and push exchanges for baselines in its own
//! pod's namespace; a reader may query and tail the sandboxes RBAC lets it `get` the `traffic`
//! subresource of.
//!
//! In a cluster both are Kubernetes tokens checked with a TokenReview: a sidecar's is its pod's
//! projected token for the audience [`AUDIENCE`] (the review names the pod), a reader's any
//! token the API server accepts, followed by a SubjectAccessReview. Accepted tokens are
//! remembered for [`ACCEPTED_TTL`] (never past their expiry), so a sidecar pushing every 200 ms
//! costs the API server one review per TTL, and at most [`MAX_REVIEWS`] reviews run at once.
//! Standalone, one static token stands for everything.
//!
//! Tokens are never logged.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::Semaphore;
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::Error;

/// The audience of sidecars' projected tokens.
pub const AUDIENCE: &str = "spur-traffic";
/// How long an accepted token (and what it was allowed) is reused without asking again.
pub const ACCEPTED_TTL: Duration = Duration::from_secs(30);
/// Token and access reviews in flight at once.
pub const MAX_REVIEWS: usize = 8;
/// Tokens remembered; past it, expired entries go, then everything.
const MAX_CACHED: usize = 4096;
/// Sandboxes one reader's entry remembers being allowed to read.
const MAX_CACHED_GRANTS: usize = 16;
/// TokenReview's name for the pod a bound token was issued for.
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";

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
            Authorizer::Kube(_) => f.write_str("Kube"),
        }
    }
}

/// Who a sidecar call comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The static token: any baseline.
    Anyone,
    /// A pod: baselines in its own namespace only.
    Pod { namespace: String, name: String },
}

impl Caller {
    /// PERMISSION_DENIED unless this caller may watch or push for a baseline in `namespace`.
    pub fn may_use(&self, namespace: &str) -> Result<(), Status> {
        match self {
            Caller::Anyone => Ok(()),
            Caller::Pod {
                namespace: own,
                name,
            } if own != namespace => Err(Status::permission_denied(format!(
                "pod {own}/{name} may only capture for baselines in namespace {own}, not {namespace:?}"
            ))),
            Caller::Pod { .. } => Ok(()),
        }
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

    /// Kubernetes tokens, reviewed by `client`'s API server.
    pub fn kube(client: Client) -> Self {
        Authorizer::Kube(KubeAuthorizer {
            inner: Arc::new(Kube {
                client,
                cache: Mutex::new(HashMap::new()),
                reviews: Semaphore::new(MAX_REVIEWS),
            }),
        })
    }

    /// Who is calling WatchSettings or Push. UNAUTHENTICATED for a missing or refused token,
    /// UNAVAILABLE when the API server cannot be asked.
    pub async fn sidecar(&self, metadata: &MetadataMap) -> Result<Caller, Status> {
        let token = bearer(metadata)?;
        match self {
            Authorizer::StaticToken(t) => t.check(token).map(|()| Caller::Anyone),
            Authorizer::Kube(k) => k.inner.sidecar(token).await,
        }
    }

    /// Whether the caller of Query or Tail may read `sandbox` (every sandbox when empty):
    /// PERMISSION_DENIED when RBAC says no.
    pub async fn reader(&self, metadata: &MetadataMap, sandbox: &str) -> Result<(), Status> {
        let token = bearer(metadata)?;
        match self {
            Authorizer::StaticToken(t) => t.check(token),
            Authorizer::Kube(k) => k.inner.reader(token, sandbox).await,
        }
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
        namespace: String,
        name: String,
    },
    User {
        user: UserInfo,
        /// Sandboxes ("" for all) this user was allowed to read.
        granted: Vec<String>,
    },
}

impl Kube {
    async fn sidecar(&self, token: &str) -> Result<Caller, Status> {
        let identity = match self.cached(token, Purpose::Sidecar) {
            Some(i) => i,
            None => {
                let user = self.review(token, Some(AUDIENCE)).await?;
                let identity = pod_of(user)?;
                self.store(token, Purpose::Sidecar, identity.clone());
                identity
            }
        };
        match identity {
            Identity::Pod { namespace, name } => Ok(Caller::Pod { namespace, name }),
            Identity::User { .. } => Err(Status::unauthenticated("not a pod-bound token")),
        }
    }

    async fn reader(&self, token: &str, sandbox: &str) -> Result<(), Status> {
        let identity = match self.cached(token, Purpose::Reader) {
            Some(i) => i,
            None => Identity::User {
                user: self.review(token, None).await?,
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

    /// The user behind `token`, for `audience` (None: the API server's own).
    async fn review(&self, token: &str, audience: Option<&str>) -> Result<UserInfo, Status> {
        let _permit = self
            .reviews
            .acquire()
            .await
            .map_err(|_| Status::unavailable("shutting down"))?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: audience.map(|a| vec![a.to_string()]),
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
        if status.authenticated != Some(true) {
            // The API server's reason names no secret; it helps whoever set up the client.
            let why = status.error.unwrap_or_else(|| "not authenticated".into());
            return Err(Status::unauthenticated(format!("token refused: {why}")));
        }
        if let (Some(want), Some(got)) = (audience, &status.audiences)
            && !got.iter().any(|a| a == want)
        {
            return Err(Status::unauthenticated(format!(
                "the token is not for audience {want}"
            )));
        }
        Ok(status.user.unwrap_or_default())
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

/// The pod a reviewed sidecar token was bound to.
fn pod_of(user: UserInfo) -> Result<Identity, Status> {
    let namespace = user
        .username
        .as_deref()
        .and_then(|u| u.strip_prefix("system:serviceaccount:"))
        .and_then(|rest| rest.split_once(':'))
        .map(|(ns, _)| ns.to_string())
        .ok_or_else(|| Status::unauthenticated("not a ServiceAccount token"))?;
    let name = user
        .extra
        .as_ref()
        .and_then(|x| x.get(POD_NAME))
        .and_then(|v| v.first())
        .filter(|v| !v.is_empty())
        .cloned()
        .ok_or_else(|| {
            Status::unauthenticated(
                "not a pod-bound token (use the pod's projected spur-traffic token)",
            )
        })?;
    Ok(Identity::Pod { namespace, name })
}

/// The `exp` claim of a JWT, read without checking the signature: only for a token the API
/// server has just accepted. None for a token that is not a JWT or says nothing.
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
    fn a_pod_may_use_only_its_own_namespace() {
        let pod = Caller::Pod {
            namespace: "team-a".into(),
            name: "backend-1".into(),
        };
        pod.may_use("team-a").unwrap();
        assert_eq!(
            pod.may_use("team-b").unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        assert_eq!(
            pod.may_use("").unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        Caller::Anyone.may_use("anything").unwrap();
    }

    #[test]
    fn a_reviewed_token_names_its_pod() {
        let user = |name: &str, pod: Option<&str>| UserInfo {
            username: Some(name.into()),
            extra: pod.map(|p| BTreeMap::from([(POD_NAME.to_string(), vec![p.to_string()])])),
            ..UserInfo::default()
        };
        match pod_of(user("system:serviceaccount:team-a:default", Some("web-1"))) {
            Ok(Identity::Pod { namespace, name }) => {
                assert_eq!((namespace.as_str(), name.as_str()), ("team-a", "web-1"))
            }
            _ => panic!("expected a pod"),
        }
        assert!(pod_of(user("system:serviceaccount:team-a:default", None)).is_err());
        assert!(pod_of(user("alice", Some("web-1"))).is_err());
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
