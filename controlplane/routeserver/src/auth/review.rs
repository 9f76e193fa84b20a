//! Kubernetes token and access reviews behind [`super::Authenticator`] (feature `kubernetes`):
//! the route server's policy over the serving kit's reviews. TokenReviews for the route
//! server's audience, SubjectAccessReviews for other identities, a pod's baseline from its
//! controlling ReplicaSet (for a fork's pod, the baseline it forks), and the cache in front of
//! them.

use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::authorization::v1::ResourceAttributes;
use kube::{Api, Client};
use spur_api::keys::labels;
use spur_serving::review::{
    self, AudienceCheck, BaselineError, Cache, NotAPod, PodRef, ReviewError, Reviewer,
};

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

/// A reviewed token's identity.
#[derive(Debug, Clone)]
enum Identity {
    /// A token bound to a pod; `baseline` is resolved on first use.
    Pod(PodRef),
    User(UserInfo),
}

#[derive(Debug, Clone)]
struct Entry {
    until: Instant,
    /// The token's own expiry: the entry never outlives it.
    expires: Option<SystemTime>,
    identity: Result<Identity, Denied>,
    /// For pods: the baseline or why there is none.
    baseline: Option<Result<review::Baseline, Denied>>,
    /// For users: whether they may read every rule, and the cluster's services.
    reads_rules: Option<bool>,
    reads_services: Option<bool>,
    /// For users: per namespace, whether they may list ListenerSets there.
    reads_listeners: Vec<(String, bool)>,
}

pub(super) struct Kube {
    reviewer: Reviewer,
    /// For a fork pod's Deployment.
    client: Client,
    audience: String,
    pub(super) watch_recheck: Duration,
    cache: Cache<String, Entry>,
}

impl Kube {
    pub(super) fn new(client: Client, audience: String, watch_recheck: Duration) -> Kube {
        Kube {
            reviewer: Reviewer::new(client.clone(), MAX_REVIEWS),
            client,
            audience,
            watch_recheck,
            cache: Cache::new(MAX_CACHED),
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
        let token = review::bearer(authorization).ok_or_else(|| {
            Denied::Unauthenticated(
                "no credentials: send `authorization: Bearer <token>` (a Kubernetes token)".into(),
            )
        })?;
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
                Identity::Pod(PodRef {
                    namespace, name, ..
                }),
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
            (Identity::Pod(pod), Scope::Rules(filter)) => {
                let baseline = match entry.baseline.clone() {
                    Some(b) => b,
                    None => {
                        let b = kube.baseline_of(pod).await;
                        // A failed lookup is asked again next time.
                        if !matches!(b, Err(Denied::Unavailable(_))) {
                            entry.baseline = Some(b.clone());
                        }
                        b
                    }
                };
                let review::Baseline {
                    kind,
                    namespace: ns,
                    name,
                } = baseline?;
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
        let expires = identity
            .as_ref()
            .ok()
            .and_then(|_| review::token_expiry(token));
        Entry {
            until: review::deadline(ttl, expires),
            expires,
            identity,
            baseline: None,
            reads_rules: None,
            reads_services: None,
            reads_listeners: Vec::new(),
        }
    }

    fn cached(&self, token: &str) -> Option<Entry> {
        self.cache.get(&token.to_string())
    }

    fn store(&self, token: &str, entry: Entry) {
        let until = entry.until;
        self.cache.insert(token.to_string(), entry, |_| until);
    }

    async fn review(&self, token: &str) -> Result<Identity, Denied> {
        let user = self
            .reviewer
            .token(token, &self.audience, AudienceCheck::Asked)
            .await
            .map_err(|e| match e {
                ReviewError::Refused(_) | ReviewError::AudienceNotConfirmed => {
                    Denied::Unauthenticated(format!(
                        "token refused for audience {}: {e}",
                        self.audience
                    ))
                }
                _ => Denied::Unavailable(e.to_string()),
            })?;
        Ok(match review::pod_of(&user) {
            Ok(pod) => Identity::Pod(pod),
            // Never issued by an API server; refused rather than reviewed as a plain user.
            Err(NotAPod::EmptyPodClaim) => {
                return Err(Denied::Unauthenticated(
                    "a pod-bound token with an empty pod name or UID".into(),
                ));
            }
            Err(NotAPod::NotServiceAccount | NotAPod::NotPodBound) => Identity::User(user),
        })
    }

    /// The baseline whose rules the pod may read: its controlling ReplicaSet's Deployment (or
    /// Argo Rollout), in the Routes API's spelling.
    ///
    /// A fork's pod (label `spur.dev/fork`) whose Deployment a ForkedWorkload controls reads the
    /// rules of the baseline that Deployment forks (its `spur.dev/baseline` annotation, which
    /// must name a Deployment or Rollout of the pod's own namespace): its sidecar relays Kafka records by
    /// the baseline's routes (docs/async.md). Anything else about a fork, or a Deployment that
    /// merely carries the label or the annotation, reads as before, its own Deployment's rules.
    /// Within a namespace this grants nothing new: whoever may create workloads there can
    /// already run a pod under any of its baselines.
    async fn baseline_of(&self, pod: &PodRef) -> Result<review::Baseline, Denied> {
        let (baseline, pod_labels) = self
            .reviewer
            .baseline_and_labels_of(pod, None)
            .await
            .map_err(|e| match e {
                BaselineError::Unavailable(ref error) => {
                    tracing::warn!(%error, "cannot look up a reader's pod");
                    Denied::Unavailable(e.to_string())
                }
                BaselineError::PodGone { .. } => Denied::Unauthenticated(e.to_string()),
                BaselineError::NoBaseline(why) => Denied::Forbidden(format!(
                    "pod {}/{} belongs to no Deployment or Argo Rollout: {why}",
                    pod.namespace, pod.name
                )),
            })?;
        if baseline.kind != "Deployment" || !pod_labels.contains_key(labels::FORK) {
            return Ok(baseline);
        }
        let deployment = Api::<Deployment>::namespaced(self.client.clone(), &baseline.namespace)
            .get_opt(&baseline.name)
            .await
            .map_err(|error| {
                tracing::warn!(%error, "cannot look up a fork pod's Deployment");
                Denied::Unavailable("cannot look up this pod now; retry".into())
            })?;
        Ok(
            match deployment.as_ref().and_then(spur_api::forkof::fork_of) {
                Some(fork) => review::Baseline {
                    kind: fork.kind.routes_api_kind(),
                    namespace: baseline.namespace,
                    name: fork.baseline,
                },
                None => baseline,
            },
        )
    }

    /// Whether `user` may list `resource` in `namespace`, or cluster-wide with None.
    async fn may_list(
        &self,
        user: &UserInfo,
        group: &str,
        resource: &str,
        namespace: Option<&str>,
    ) -> Result<bool, Denied> {
        let attributes = ResourceAttributes {
            group: Some(group.into()),
            resource: Some(resource.into()),
            namespace: namespace.map(Into::into),
            verb: Some("list".into()),
            ..ResourceAttributes::default()
        };
        self.reviewer
            .access(user, attributes)
            .await
            .map_err(|e| Denied::Unavailable(e.to_string()))
    }
}
