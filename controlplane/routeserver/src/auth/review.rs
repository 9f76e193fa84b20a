//! Kubernetes token and access reviews behind [`super::Authenticator`] (feature `kubernetes`):
//! TokenReviews for the route server's audience, SubjectAccessReviews for other identities,
//! a pod's baseline from its controlling ReplicaSet, and the cache in front of them.

use std::collections::HashMap;
use std::sync::Mutex;
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

use super::{Denied, Grant, Scope};

/// Token and access reviews in flight at once.
const MAX_REVIEWS: usize = 16;
/// How long an accepted token's identity and its access decisions are reused.
const ACCEPTED_TTL: Duration = Duration::from_secs(60);
/// How long a refused token stays refused without asking again.
const REFUSED_TTL: Duration = Duration::from_secs(5);
/// Namespaces whose `list listenersets` answer one token's cache entry keeps.
const MAX_CACHED_NAMESPACES: usize = 16;
/// Cached tokens; past it, expired entries go, then everything.
const MAX_CACHED: usize = 20_000;
/// TokenReview's names for the pod a bound token was issued for.
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";

/// A reviewed token's identity.
#[derive(Debug, Clone)]
enum Identity {
    /// A token bound to a pod; `baseline` is resolved on first use.
    Pod {
        namespace: String,
        name: String,
        uid: String,
    },
    User(UserInfo),
}

#[derive(Debug, Clone)]
struct Entry {
    until: Instant,
    /// The token's own expiry: the entry never outlives it.
    expires: Option<SystemTime>,
    identity: Result<Identity, Denied>,
    /// For pods: the baseline (kind, namespace, name) or why there is none.
    baseline: Option<Result<(String, String, String), Denied>>,
    /// For users: whether they may read every rule, and the cluster's services.
    reads_rules: Option<bool>,
    reads_services: Option<bool>,
    /// For users: per namespace, whether they may list ListenerSets there.
    reads_listeners: Vec<(String, bool)>,
}

pub(super) struct Kube {
    client: Client,
    audience: String,
    pub(super) watch_recheck: Duration,
    cache: Mutex<HashMap<String, Entry>>,
    reviews: Semaphore,
}

impl Kube {
    pub(super) fn new(client: Client, audience: String, watch_recheck: Duration) -> Kube {
        Kube {
            client,
            audience,
            watch_recheck,
            cache: Mutex::new(HashMap::new()),
            reviews: Semaphore::new(MAX_REVIEWS),
        }
    }

    /// Whether `authorization` may read `scope`; `fresh` skips the cache.
    pub(super) async fn check(
        &self,
        authorization: Option<&[u8]>,
        scope: Scope<'_>,
        fresh: bool,
    ) -> Result<Grant, Denied> {
        let kube = self;
        let token = bearer(authorization)?;
        let mut entry = kube.entry(token, fresh).await;
        let grant = Grant {
            expires: entry.expires,
        };
        let identity = match entry.identity.clone() {
            Ok(i) => i,
            Err(e) => {
                kube.store(token, entry);
                return Err(e);
            }
        };
        let result = match (&identity, scope) {
            (
                Identity::Pod {
                    namespace, name, ..
                },
                Scope::Listeners {
                    namespace: want_ns,
                    pod,
                },
            ) => {
                if namespace == want_ns && name == pod {
                    Ok(grant)
                } else {
                    Err(Denied::Forbidden(format!(
                        "this pod's token reads only the listeners of its own pod {namespace}/{name}"
                    )))
                }
            }
            (Identity::User(user), Scope::Listeners { namespace, .. }) => {
                let cached = entry
                    .reads_listeners
                    .iter()
                    .find(|(ns, _)| ns == namespace)
                    .map(|(_, a)| *a);
                let allowed = match cached {
                    Some(a) => a,
                    None => {
                        let a = kube
                            .may_list(user, "spur.dev", "listenersets", Some(namespace))
                            .await?;
                        if entry.reads_listeners.len() >= MAX_CACHED_NAMESPACES {
                            entry.reads_listeners.remove(0);
                        }
                        entry.reads_listeners.push((namespace.to_string(), a));
                        a
                    }
                };
                if allowed {
                    Ok(grant)
                } else {
                    let who = user.username.as_deref().unwrap_or("this user");
                    Err(Denied::Forbidden(format!(
                        "{who} may not list listenersets.spur.dev in namespace {namespace}, which reading a gateway's listeners requires"
                    )))
                }
            }
            (Identity::Pod { .. }, Scope::ClusterServices) => Err(Denied::Forbidden(
                "a pod's token reads only its own baseline's rules".into(),
            )),
            (
                Identity::Pod {
                    namespace,
                    name,
                    uid,
                },
                Scope::Rules(filter),
            ) => {
                let baseline = match entry.baseline.clone() {
                    Some(b) => b,
                    None => {
                        let b = kube.baseline_of(namespace, name, uid).await;
                        // A failed lookup is asked again next time.
                        if !matches!(b, Err(Denied::Unavailable(_))) {
                            entry.baseline = Some(b.clone());
                        }
                        b
                    }
                };
                let (kind, ns, name) = baseline?;
                if filter.kind == kind && filter.namespace == ns && filter.name == name {
                    Ok(grant)
                } else {
                    Err(Denied::Forbidden(format!(
                        "this pod's token reads only the rules of {kind} {ns}/{name}; ask with that baseline"
                    )))
                }
            }
            (Identity::User(user), scope) => {
                // (Listeners were answered above.)
                let (cached, resource, group) = if matches!(scope, Scope::ClusterServices) {
                    (&mut entry.reads_services, "services", "")
                } else {
                    (&mut entry.reads_rules, "routingconfigs", "spur.dev")
                };
                let allowed = match *cached {
                    Some(a) => a,
                    None => {
                        let a = kube.may_list(user, group, resource, None).await?;
                        *cached = Some(a);
                        a
                    }
                };
                if allowed {
                    Ok(grant)
                } else {
                    let who = user.username.as_deref().unwrap_or("this user");
                    let what = if group.is_empty() {
                        resource.to_string()
                    } else {
                        format!("{resource}.{group}")
                    };
                    Err(Denied::Forbidden(format!(
                        "{who} may not list {what} cluster-wide, which reading this requires"
                    )))
                }
            }
        };
        kube.store(token, entry);
        result
    }
}

/// The token of `Bearer <token>`.
fn bearer(authorization: Option<&[u8]>) -> Result<&str, Denied> {
    let missing = || {
        Denied::Unauthenticated(
            "no credentials: send `authorization: Bearer <token>` (a Kubernetes token)".into(),
        )
    };
    let value = authorization.ok_or_else(missing)?;
    let value = std::str::from_utf8(value).map_err(|_| missing())?;
    let (scheme, token) = value.trim().split_once(' ').ok_or_else(missing)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(missing());
    }
    Ok(token)
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

impl Kube {
    async fn entry(&self, token: &str, fresh: bool) -> Entry {
        if !fresh && let Some(e) = self.cached(token) {
            return e;
        }
        let identity = self.review(token).await;
        let ttl = match &identity {
            Ok(_) => ACCEPTED_TTL,
            Err(Denied::Unavailable(_)) => Duration::ZERO,
            Err(_) => REFUSED_TTL,
        };
        let expires = identity.as_ref().ok().and_then(|_| token_expiry(token));
        let mut until = Instant::now() + ttl;
        if let Some(left) = expires.map(|e| e.duration_since(SystemTime::now()).unwrap_or_default())
        {
            until = until.min(Instant::now() + left);
        }
        Entry {
            until,
            expires,
            identity,
            baseline: None,
            reads_rules: None,
            reads_services: None,
            reads_listeners: Vec::new(),
        }
    }

    fn cached(&self, token: &str) -> Option<Entry> {
        let cache = self.cache.lock().ok()?;
        cache
            .get(token)
            .filter(|e| e.until > Instant::now())
            .cloned()
    }

    fn store(&self, token: &str, entry: Entry) {
        if entry.until <= Instant::now() {
            return;
        }
        let Ok(mut cache) = self.cache.lock() else {
            return;
        };
        if cache.len() >= MAX_CACHED && !cache.contains_key(token) {
            let now = Instant::now();
            cache.retain(|_, e| e.until > now);
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
        }
        cache.insert(token.to_string(), entry);
    }

    async fn review(&self, token: &str) -> Result<Identity, Denied> {
        let _permit = self
            .reviews
            .acquire()
            .await
            .map_err(|_| Denied::Unavailable("shutting down".into()))?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "TokenReview failed");
                Denied::Unavailable("cannot check the token now; retry".into())
            })?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            // The API server's reason names no secret; it helps whoever set up the client.
            let why = status.error.unwrap_or_else(|| "not authenticated".into());
            return Err(Denied::Unauthenticated(format!(
                "token refused for audience {}: {why}",
                self.audience
            )));
        }
        let user = status.user.unwrap_or_default();
        let extra = |k: &str| {
            user.extra
                .as_ref()
                .and_then(|x| x.get(k))
                .and_then(|v| v.first())
                .cloned()
        };
        let sa_namespace = user
            .username
            .as_deref()
            .and_then(|u| u.strip_prefix("system:serviceaccount:"))
            .and_then(|rest| rest.split_once(':'))
            .map(|(ns, _)| ns.to_string());
        Ok(match (extra(POD_NAME), extra(POD_UID), sa_namespace) {
            (Some(name), Some(uid), Some(namespace)) => Identity::Pod {
                namespace,
                name,
                uid,
            },
            _ => Identity::User(user),
        })
    }

    /// The baseline whose rules the pod may read: its controlling ReplicaSet's Deployment (or
    /// Argo Rollout), in the Routes API's spelling.
    async fn baseline_of(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<(String, String, String), Denied> {
        let unavailable = |e: kube::Error| {
            tracing::warn!(error = %e, "cannot look up a reader's pod");
            Denied::Unavailable("cannot look up this pod now; retry".into())
        };
        let no_baseline = |why: String| {
            Denied::Forbidden(format!(
                "pod {namespace}/{name} belongs to no Deployment or Argo Rollout: {why}"
            ))
        };
        let pod = Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(unavailable)?
            .filter(|p| p.metadata.uid.as_deref() == Some(uid))
            .ok_or_else(|| {
                Denied::Unauthenticated(format!(
                    "the token's pod {namespace}/{name} no longer exists"
                ))
            })?;
        let rs_ref = controller(pod.metadata.owner_references.as_deref())
            .filter(|o| o.kind == "ReplicaSet" && o.api_version == "apps/v1")
            .ok_or_else(|| no_baseline("no controlling ReplicaSet".into()))?;
        let rs = Api::<ReplicaSet>::namespaced(self.client.clone(), namespace)
            .get_opt(&rs_ref.name)
            .await
            .map_err(unavailable)?
            .filter(|rs| rs.metadata.uid.as_deref() == Some(rs_ref.uid.as_str()))
            .ok_or_else(|| no_baseline(format!("ReplicaSet {} is gone", rs_ref.name)))?;
        let owner = controller(rs.metadata.owner_references.as_deref())
            .ok_or_else(|| no_baseline(format!("ReplicaSet {} has no controller", rs_ref.name)))?;
        let kind = match (owner.api_version.as_str(), owner.kind.as_str()) {
            ("apps/v1", "Deployment") => "Deployment",
            (v, "Rollout") if v.starts_with("argoproj.io/") => "ArgoRollout",
            (_, k) => return Err(no_baseline(format!("its ReplicaSet is owned by a {k}"))),
        };
        Ok((kind.into(), namespace.into(), owner.name.clone()))
    }

    /// Whether `user` may list `resource` in `namespace`, or cluster-wide with None.
    async fn may_list(
        &self,
        user: &UserInfo,
        group: &str,
        resource: &str,
        namespace: Option<&str>,
    ) -> Result<bool, Denied> {
        let _permit = self
            .reviews
            .acquire()
            .await
            .map_err(|_| Denied::Unavailable("shutting down".into()))?;
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username.clone(),
                groups: user.groups.clone(),
                uid: user.uid.clone(),
                extra: user.extra.clone(),
                resource_attributes: Some(ResourceAttributes {
                    group: Some(group.into()),
                    resource: Some(resource.into()),
                    namespace: namespace.map(Into::into),
                    verb: Some("list".into()),
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
                Denied::Unavailable("cannot check access now; retry".into())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_are_read_strictly() {
        assert_eq!(bearer(Some(b"Bearer abc")).unwrap(), "abc");
        assert_eq!(bearer(Some(b"bearer  abc ")).unwrap(), "abc");
        for bad in [
            &b""[..],
            b"abc",
            b"Basic abc",
            b"Bearer ",
            b"Bearer",
            b"\xff\xfe",
        ] {
            assert!(
                matches!(bearer(Some(bad)), Err(Denied::Unauthenticated(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(bearer(None), Err(Denied::Unauthenticated(_))));
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
            jwt(r#"{"exp":"soon"}"#),
            jwt(r#"{"exp":-1}"#),
            "opaque-static-token".to_string(),
            "a.%%%.c".to_string(),
            format!("a.{}.c", b64("not json")),
        ] {
            assert_eq!(token_expiry(&no), None, "{no}");
        }
    }
}
