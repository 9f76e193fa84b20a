//! What the agent reads for one user: every read the hub asks for on a user's behalf names the
//! Kubernetes user (and groups) it acts as, and the agent asks its API server with
//! SubjectAccessReviews whether that user may read before it reads, returning only what the user
//! may see. The agent's own credentials do the reading; the reviews decide what leaves.
//!
//! Sandboxes, RouteGroups and RoutingConfigs are cluster-scoped: an object is returned only when
//! the user may `list` its resource in every namespace the object is in
//! ([`crate::namespaces::sandbox_namespaces`] and friends), or, for an object in no namespace, in
//! the whole cluster. A Role in namespace `a` granting `list` on `sandboxes.spur.dev` is thus
//! what shows a user the sandboxes that live in `a` only; a ClusterRole bound cluster-wide shows
//! all. Traffic is the store's own check (`get` on `sandboxes/traffic` of the sandbox), asked in
//! every namespace the sandbox is in.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::core::ObjectList;
use serde::Serialize;
use serde::de::DeserializeOwned;
use spur_api::{RouteGroup, RoutingConfig, Sandbox};
use tokio::sync::Semaphore;

use crate::namespaces;
use crate::protocol::{KubeIdentity, READ_PATHS};
use crate::users;

/// How long an answer of the API server is reused: the bound on how late a revoked right still
/// shows something.
pub const REVIEW_TTL: Duration = Duration::from_secs(10);
/// Reviews in flight at once.
const MAX_REVIEWS: usize = 8;
/// Answers remembered; past it, expired ones go, then everything.
const MAX_CACHED: usize = 8192;
/// How long one review may take.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);

/// One question for a SubjectAccessReview.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Question {
    pub verb: &'static str,
    pub resource: &'static str,
    pub subresource: Option<&'static str>,
    /// None: the whole cluster.
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// Asks the API server what a user may do, remembering answers for [`REVIEW_TTL`].
pub struct Reviewer {
    kube: kube::Client,
    cache: Mutex<HashMap<(KubeIdentity, Question), (Instant, bool)>>,
    reviews: Semaphore,
}

impl std::fmt::Debug for Reviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reviewer").finish_non_exhaustive()
    }
}

impl Reviewer {
    pub fn new(kube: kube::Client) -> Self {
        Reviewer {
            kube,
            cache: Mutex::new(HashMap::new()),
            reviews: Semaphore::new(MAX_REVIEWS),
        }
    }

    pub fn kube(&self) -> &kube::Client {
        &self.kube
    }

    /// Whether `who` may do `q`; an error when the API server cannot be asked (nothing is read
    /// then).
    pub async fn allowed(&self, who: &KubeIdentity, q: &Question) -> Result<bool, String> {
        let key = (who.clone(), q.clone());
        let now = Instant::now();
        if let Some((at, answer)) = self.lock().get(&key)
            && now.duration_since(*at) < REVIEW_TTL
        {
            return Ok(*answer);
        }
        let _permit = self
            .reviews
            .acquire()
            .await
            .map_err(|_| "the agent is shutting down".to_owned())?;
        let body = serde_json::json!({
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": who.user,
                "groups": who.groups,
                "resourceAttributes": {
                    "group": "spur.dev",
                    "resource": q.resource,
                    "subresource": q.subresource.unwrap_or_default(),
                    "verb": q.verb,
                    "namespace": q.namespace.clone().unwrap_or_default(),
                    "name": q.name.clone().unwrap_or_default(),
                }
            }
        });
        let req = http::Request::post("/apis/authorization.k8s.io/v1/subjectaccessreviews")
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body.to_string().into_bytes())
            .map_err(|e| format!("a SubjectAccessReview: {e}"))?;
        let answer =
            match tokio::time::timeout(REVIEW_TIMEOUT, self.kube.request::<Review>(req)).await {
                Ok(Ok(r)) => r.status.is_some_and(|s| s.allowed),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "SubjectAccessReview failed");
                    return Err(format!(
                        "the agent cannot check {:?}'s access now (SubjectAccessReview: {e}); its \
                         ClusterRole needs create on subjectaccessreviews",
                        who.user
                    ));
                }
                Err(_) => {
                    return Err(format!(
                        "the API server did not answer a SubjectAccessReview within \
                         {REVIEW_TIMEOUT:?}"
                    ));
                }
            };
        let mut cache = self.lock();
        if cache.len() >= MAX_CACHED {
            cache.retain(|_, (at, _)| now.duration_since(*at) < REVIEW_TTL);
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
        }
        cache.insert(key, (now, answer));
        Ok(answer)
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<(KubeIdentity, Question), (Instant, bool)>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `who` may `verb` `resource[/subresource]` (of `name`) in every namespace of
    /// `namespaces`, or in the whole cluster when there are none. Returns the namespaces
    /// checked.
    pub async fn allowed_in(
        &self,
        who: &KubeIdentity,
        verb: &'static str,
        resource: &'static str,
        subresource: Option<&'static str>,
        name: Option<&str>,
        namespaces: &BTreeSet<String>,
    ) -> Result<bool, String> {
        let question = |namespace: Option<String>| Question {
            verb,
            resource,
            subresource,
            namespace,
            name: name.map(str::to_owned),
        };
        if namespaces.is_empty() {
            return self.allowed(who, &question(None)).await;
        }
        for ns in namespaces {
            if !self.allowed(who, &question(Some(ns.clone()))).await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The list at `path` (one of [`READ_PATHS`]) with only the objects `who` may see, as JSON.
    pub async fn list_for(&self, who: &KubeIdentity, path: &str) -> Result<Vec<u8>, ReadError> {
        match READ_PATHS.iter().position(|p| *p == path) {
            Some(0) => {
                let list: ObjectList<Sandbox> = self.read(path).await?;
                self.keep(who, "sandboxes", list, namespaces::sandbox_namespaces)
                    .await
            }
            Some(1) => {
                let list: ObjectList<RouteGroup> = self.read(path).await?;
                // A route group is in the namespaces of the sandboxes it matched.
                let sandboxes: ObjectList<Sandbox> = self.read(READ_PATHS[0]).await?;
                let by_name: BTreeMap<String, Sandbox> = sandboxes
                    .items
                    .into_iter()
                    .filter_map(|s| Some((s.metadata.name.clone()?, s)))
                    .collect();
                self.keep(who, "routegroups", list, |g| {
                    namespaces::route_group_namespaces(g, &by_name)
                })
                .await
            }
            Some(2) => {
                let list: ObjectList<RoutingConfig> = self.read(path).await?;
                self.keep(
                    who,
                    "routingconfigs",
                    list,
                    namespaces::routing_config_namespaces,
                )
                .await
            }
            Some(3) => {
                let list: ObjectList<spur_api::Job> = self.read(path).await?;
                self.keep(who, "jobs", list, namespaces::job_namespaces)
                    .await
            }
            _ => Err(ReadError::NotServed(format!(
                "a read stream serves only GET of {}",
                READ_PATHS.join(", ")
            ))),
        }
    }

    async fn read<K: DeserializeOwned + Clone>(
        &self,
        path: &str,
    ) -> Result<ObjectList<K>, ReadError> {
        let req = http::Request::get(path)
            .body(Vec::new())
            .map_err(|e| ReadError::Upstream(e.to_string()))?;
        self.kube
            .request::<ObjectList<K>>(req)
            .await
            .map_err(|e| ReadError::Upstream(format!("listing {path}: {e}")))
    }

    /// `list` with only the objects whose namespaces `who` may `list` `resource` in.
    async fn keep<K: Serialize + Clone>(
        &self,
        who: &KubeIdentity,
        resource: &'static str,
        mut list: ObjectList<K>,
        namespaces: impl Fn(&K) -> BTreeSet<String>,
    ) -> Result<Vec<u8>, ReadError> {
        let mut kept = Vec::with_capacity(list.items.len());
        for item in std::mem::take(&mut list.items) {
            let ns = namespaces(&item);
            if self
                .allowed_in(who, "list", resource, None, None, &ns)
                .await
                .map_err(ReadError::Review)?
            {
                kept.push(item);
            }
        }
        list.items = kept;
        serde_json::to_vec(&list).map_err(|e| ReadError::Upstream(e.to_string()))
    }

    /// Whether `who` may read sandbox `name`'s traffic: `get` on `sandboxes/traffic` of it in
    /// every namespace it is in (in the whole cluster for one in none, or one that is gone).
    /// Returns the namespaces whose exchanges may be shown (None: any).
    pub async fn traffic_allowed(
        &self,
        who: &KubeIdentity,
        name: &str,
    ) -> Result<Option<BTreeSet<String>>, ReadError> {
        let path = format!("/apis/spur.dev/v1alpha1/sandboxes/{name}");
        let req = http::Request::get(&path)
            .body(Vec::new())
            .map_err(|e| ReadError::Upstream(e.to_string()))?;
        let namespaces = match self.kube.request::<Sandbox>(req).await {
            Ok(s) => namespaces::sandbox_namespaces(&s),
            Err(kube::Error::Api(e)) if e.code == 404 => BTreeSet::new(),
            Err(e) => return Err(ReadError::Upstream(format!("reading {path}: {e}"))),
        };
        let allowed = self
            .allowed_in(
                who,
                "get",
                "sandboxes",
                Some("traffic"),
                Some(name),
                &namespaces,
            )
            .await
            .map_err(ReadError::Review)?;
        if !allowed {
            return Err(ReadError::Forbidden(format!(
                "{} may not get sandboxes/traffic of {name} in {}",
                who.user,
                if namespaces.is_empty() {
                    "the cluster".to_owned()
                } else {
                    format!(
                        "namespace {}",
                        namespaces.iter().cloned().collect::<Vec<_>>().join(", ")
                    )
                }
            )));
        }
        Ok((!namespaces.is_empty()).then_some(namespaces))
    }
}

/// Why a read for a user is refused.
#[derive(Debug)]
pub enum ReadError {
    /// Not a read this stream serves.
    NotServed(String),
    /// The user may not.
    Forbidden(String),
    /// The access check could not be made.
    Review(String),
    /// The Kubernetes API failed.
    Upstream(String),
}

impl ReadError {
    pub fn status(&self) -> (http::StatusCode, &str) {
        match self {
            ReadError::NotServed(m) => (http::StatusCode::NOT_FOUND, m),
            ReadError::Forbidden(m) => (http::StatusCode::FORBIDDEN, m),
            ReadError::Review(m) => (http::StatusCode::SERVICE_UNAVAILABLE, m),
            ReadError::Upstream(m) => (http::StatusCode::BAD_GATEWAY, m),
        }
    }
}

/// What a request must say about its user: a user name, else the reason it is refused.
pub fn check_identity(who: &KubeIdentity) -> Result<(), String> {
    let invalid = |m: String| Err(format!("refused: {m}"));
    if who.user.is_empty() {
        return invalid(
            "the request names no user to act for (every read for a user carries the user's \
             Kubernetes identity; update the hub)"
                .into(),
        );
    }
    users::check_kube_name("user", &who.user).or_else(|e| invalid(e.to_string()))?;
    if who.groups.len() > users::MAX_GROUPS {
        return invalid(format!("more than {} groups", users::MAX_GROUPS));
    }
    for g in &who.groups {
        users::check_kube_name("group", g).or_else(|e| invalid(e.to_string()))?;
    }
    Ok(())
}

/// The answer of a SubjectAccessReview (the part read).
#[derive(serde::Deserialize)]
struct Review {
    status: Option<ReviewStatus>,
}

#[derive(serde::Deserialize)]
struct ReviewStatus {
    #[serde(default)]
    allowed: bool,
}
