//! What the hub knows of each connected cluster: its Sandboxes and RouteGroups, kept current by
//! a list and a watch through the agent's Kubernetes API proxy (the only way in; the hub holds
//! no cluster credentials). Preview requests are resolved against it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use http::StatusCode;
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::core::{ObjectList, WatchEvent};
use serde::de::DeserializeOwned;
use spur_api::keys::injection::{QUERY_PARAM, ROUTING_HEADERS};
use spur_api::{RouteGroup, RoutingConfig, Sandbox};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::carriers::Carriers;
use crate::clusters::Clusters;
use crate::namespaces::{parse_target, route_group_namespaces, sandbox_namespaces, service_of};
use crate::protocol::{KubeIdentity, Open};

/// How long opening a stream to an agent may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest line of a watch (one object); a bigger one means something is wrong.
const MAX_WATCH_LINE: usize = 4 << 20;
/// Largest list read from an agent: tens of thousands of objects fit; more is refused rather
/// than held in the hub's memory (an agent, or whatever answers for it, may send anything).
pub const MAX_LIST_BODY: usize = 64 << 20;
/// Bytes of an agent's error answer read (the first 512 are shown).
const MAX_ERROR_BODY: usize = 64 << 10;

/// One cluster's objects.
#[derive(Clone, Debug, Default)]
pub struct ClusterView {
    pub sandboxes: BTreeMap<String, Sandbox>,
    pub route_groups: BTreeMap<String, RouteGroup>,
    /// The routes each key's RoutingConfig exports: what the baselines' sidecars hold.
    pub routing_configs: BTreeMap<String, RoutingConfig>,
    /// Jobs, by `namespace/name`.
    pub jobs: BTreeMap<String, spur_api::Job>,
    /// The lists have been read at least once since the cluster connected.
    pub synced: bool,
    /// The namespaces' routing-key carrier annotations (`sidecar.spur.dev/routing-headers` and
    /// `sidecar.spur.dev/query-param`, nothing else of them is kept), by name: a preview
    /// overwrites the carriers the sidecars of its target's namespace read. Never shown.
    pub namespaces: BTreeMap<String, Namespace>,
    /// The namespaces have been listed since the cluster connected: until then no preview to
    /// the cluster is sent (its carriers are unknown).
    pub namespaces_synced: bool,
    /// Every carrier any namespace has named since the cluster connected (never fewer, so a
    /// pod injected before an annotation changed is still covered).
    pub namespace_carriers: Carriers,
}

/// Where a preview request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// Where the target is (the endpoint's `cluster`, else the object's own).
    pub cluster: String,
    /// The endpoint opted in to previews without authentication.
    pub public: bool,
    pub routing_key: String,
    /// `http`, `https`, `grpc` or `tcp`.
    pub scheme: String,
    pub host: String,
    pub port: u16,
    /// The carriers the target cluster's namespaces name ([`ClusterView::namespace_carriers`]),
    /// or `None` while its namespaces have not been read.
    pub carriers: Option<Carriers>,
}

/// Why a preview name does not resolve.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("no sandbox or route group {0:?}")]
    UnknownOwner(String),
    #[error("{owner:?} has no endpoint {endpoint:?}")]
    UnknownEndpoint { owner: String, endpoint: String },
    #[error("no cluster {0:?} is connected")]
    UnknownCluster(String),
    #[error("{0:?} exists in several clusters; name the cluster: <endpoint>--<name>--<cluster>")]
    Ambiguous(String),
    #[error("{0:?} has no routing key yet (not ready)")]
    NoKey(String),
}

/// Every cluster's objects. Cheap to clone.
#[derive(Clone)]
pub struct Catalog {
    inner: Arc<RwLock<BTreeMap<String, ClusterView>>>,
    changed: Arc<watch::Sender<u64>>,
    /// Largest list answer read ([`MAX_LIST_BODY`]).
    max_list: usize,
}

impl Default for Catalog {
    fn default() -> Self {
        Catalog {
            inner: Arc::default(),
            changed: Arc::default(),
            max_list: MAX_LIST_BODY,
        }
    }
}

impl Catalog {
    /// A catalog that refuses lists over `bytes`.
    pub fn with_max_list(mut self, bytes: usize) -> Self {
        self.max_list = bytes;
        self
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, ClusterView>> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, ClusterView>> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Bumped on every change (for the web view's live updates).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn update(&self, cluster: &str, f: impl FnOnce(&mut ClusterView)) {
        f(self.write().entry(cluster.to_owned()).or_default());
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A copy of every cluster's view.
    pub fn snapshot(&self) -> BTreeMap<String, ClusterView> {
        self.read().clone()
    }

    /// Finds endpoint `endpoint` of sandbox (or, failing that, route group) `owner`, in
    /// `cluster` or in the only cluster that has `owner`.
    pub fn resolve(
        &self,
        cluster: Option<&str>,
        owner: &str,
        endpoint: &str,
    ) -> Result<Resolved, ResolveError> {
        self.resolve_for(cluster, owner, endpoint, |_, _| true)
    }

    /// [`Catalog::resolve`] among what `sees` lets through: `sees(cluster, namespaces)` says
    /// whether an object of `cluster` in exactly those namespaces may be seen. An owner it
    /// hides is unknown, and a target in another cluster must be seen there too
    /// ([`crate::users::HubUser::sees`]).
    pub fn resolve_for(
        &self,
        cluster: Option<&str>,
        owner: &str,
        endpoint: &str,
        sees: impl Fn(&str, &BTreeSet<String>) -> bool,
    ) -> Result<Resolved, ResolveError> {
        let all = self.read();
        let visible = |c: &str, v: &ClusterView| {
            if let Some(s) = v.sandboxes.get(owner) {
                sees(c, &sandbox_namespaces(s))
            } else if let Some(g) = v.route_groups.get(owner) {
                sees(c, &route_group_namespaces(g, &v.sandboxes))
            } else {
                false
            }
        };
        let (cluster, view) = match cluster {
            Some(c) => match all.get(c) {
                Some(v) if visible(c, v) => (c, v),
                Some(_) => return Err(ResolveError::UnknownOwner(owner.to_owned())),
                None => return Err(ResolveError::UnknownCluster(c.to_owned())),
            },
            None => {
                let mut having = all.iter().filter(|(c, v)| visible(c, v));
                let first = having
                    .next()
                    .ok_or_else(|| ResolveError::UnknownOwner(owner.to_owned()))?;
                if having.next().is_some() {
                    return Err(ResolveError::Ambiguous(owner.to_owned()));
                }
                (first.0.as_str(), first.1)
            }
        };
        let (endpoints, key) = if let Some(s) = view.sandboxes.get(owner) {
            (
                s.spec
                    .default_route_group
                    .as_ref()
                    .map(|g| g.endpoints.as_slice())
                    .unwrap_or_default(),
                s.status.as_ref().and_then(|s| s.routing_key.clone()),
            )
        } else if let Some(g) = view.route_groups.get(owner) {
            (
                g.spec.endpoints.as_slice(),
                g.status.as_ref().and_then(|s| s.routing_key.clone()),
            )
        } else {
            return Err(ResolveError::UnknownOwner(owner.to_owned()));
        };
        let e = endpoints
            .iter()
            .find(|e| e.name == endpoint)
            .ok_or_else(|| ResolveError::UnknownEndpoint {
                owner: owner.to_owned(),
                endpoint: endpoint.to_owned(),
            })?;
        let key = key.ok_or_else(|| ResolveError::NoKey(owner.to_owned()))?;
        // An endpoint may name another cluster for its target (a multi-cluster hub).
        let target_cluster = e.cluster.as_deref().unwrap_or(cluster);
        if !all.contains_key(target_cluster) {
            return Err(ResolveError::UnknownCluster(target_cluster.to_owned()));
        }
        let (scheme, host, port) =
            parse_target(&e.target).ok_or_else(|| ResolveError::UnknownEndpoint {
                owner: owner.to_owned(),
                endpoint: endpoint.to_owned(),
            })?;
        // A target in another cluster: its namespace there must be visible too (a target in
        // the owner's cluster is one of the owner's namespaces already).
        if target_cluster != cluster {
            let ns = service_of(&host)
                .map(|(ns, _)| BTreeSet::from([ns]))
                .unwrap_or_default();
            if !sees(target_cluster, &ns) {
                return Err(ResolveError::UnknownEndpoint {
                    owner: owner.to_owned(),
                    endpoint: endpoint.to_owned(),
                });
            }
        }
        let carriers = all
            .get(target_cluster)
            .and_then(|v| v.namespaces_synced.then(|| v.namespace_carriers.clone()));
        Ok(Resolved {
            cluster: target_cluster.to_owned(),
            public: e.public,
            routing_key: key,
            scheme,
            host,
            port,
            carriers,
        })
    }

    /// Keeps a watcher running for every connected cluster until `stop`. A cluster's watcher
    /// lives as long as the cluster has any agent session: its watches reopen on the preferred
    /// session whenever theirs ends (an agent replica going, a new one coming changes nothing
    /// that is being read, so the catalog is not emptied for it).
    pub async fn run(&self, clusters: Clusters, stop: CancellationToken) {
        let mut changes = clusters.changes();
        let mut running: BTreeMap<String, CancellationToken> = BTreeMap::new();
        loop {
            let connected = clusters.connected();
            // Stop watchers of clusters that left (their last session ended).
            running.retain(|name, token| {
                let keep = connected.iter().any(|(n, _)| n == name);
                if !keep {
                    token.cancel();
                }
                keep
            });
            for (name, _) in connected {
                if running.contains_key(&name) {
                    continue;
                }
                let token = stop.child_token();
                running.insert(name.clone(), token.clone());
                let catalog = self.clone();
                let clusters = clusters.clone();
                tokio::spawn(async move {
                    catalog.update(&name, |v| {
                        v.synced = false;
                        v.namespaces_synced = false;
                        v.namespace_carriers = Carriers::default();
                    });
                    // The catalog lists what a user's read lists (filtered there), and more.
                    let [sandboxes, route_groups, configs, jobs] = crate::protocol::READ_PATHS;
                    let t = || token.clone();
                    tokio::join!(
                        catalog.watch::<Sandbox>(&clusters, &name, sandboxes, t()),
                        catalog.watch::<RouteGroup>(&clusters, &name, route_groups, t()),
                        catalog.watch::<RoutingConfig>(&clusters, &name, configs, t()),
                        catalog.watch::<spur_api::Job>(&clusters, &name, jobs, t()),
                        catalog.watch::<Namespace>(&clusters, &name, NAMESPACES_PATH, t()),
                    );
                });
            }
            tokio::select! {
                r = changes.changed() => if r.is_err() { return },
                () = stop.cancelled() => return,
            }
        }
    }

    /// List, then watch, `path` in `cluster`, again and again until `stop`.
    async fn watch<K>(
        &self,
        clusters: &Clusters,
        cluster: &str,
        path: &str,
        stop: CancellationToken,
    ) where
        K: DeserializeOwned + kube::Resource + Clone,
        K: Kind,
    {
        let mut backoff = Duration::from_millis(200);
        loop {
            let result = tokio::select! {
                r = self.list_and_watch::<K>(clusters, cluster, path) => r,
                () = stop.cancelled() => return,
            };
            match result {
                Ok(()) => backoff = Duration::from_millis(200),
                Err(Error::Upstream(reason)) if reason == crate::protocol::NO_KUBE => {
                    // Nothing to read there; what the kind needs to know of that, it records.
                    self.update(cluster, K::without_kube);
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(60)) => {}
                        () = stop.cancelled() => return,
                    }
                }
                Err(e) => {
                    tracing::warn!(%cluster, %path, "watching through the agent: {e}");
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = stop.cancelled() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
    }

    /// One list and the watch that follows it, until the watch ends (timeout, 410 Gone).
    async fn list_and_watch<K>(
        &self,
        clusters: &Clusters,
        cluster: &str,
        path: &str,
    ) -> Result<(), Error>
    where
        K: DeserializeOwned + kube::Resource + Clone + Kind,
    {
        let body = get(clusters, cluster, path).await?;
        let body = read_limited(body, self.max_list, &format!("listing {path}")).await?;
        let list: ObjectList<K> = serde_json::from_slice(&body)
            .map_err(|e| Error::Upstream(format!("listing {path}: {e}")))?;
        let version = list.metadata.resource_version.clone().unwrap_or_default();
        let objects: BTreeMap<String, K> = list
            .items
            .into_iter()
            .map(K::kept)
            .filter_map(|o| Some((key_of(&o)?, o)))
            .collect();
        self.update(cluster, |v| {
            for o in objects.values() {
                K::seen(v, o);
            }
            *K::map(v) = objects;
            K::synced(v);
        });
        let watch = format!("{path}?watch=1&timeoutSeconds=240&resourceVersion={version}");
        let mut body = get(clusters, cluster, &watch).await?;
        let mut buf = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Error::Upstream(format!("watching {path}: {e}")))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                let line = buf.split_to(nl + 1);
                let event: WatchEvent<K> = match serde_json::from_slice(&line[..nl]) {
                    Ok(e) => e,
                    Err(e) => return Err(Error::Upstream(format!("watching {path}: {e}"))),
                };
                match event {
                    WatchEvent::Added(o) | WatchEvent::Modified(o) => {
                        let o = K::kept(o);
                        if let Some(name) = key_of(&o) {
                            self.update(cluster, |v| {
                                K::seen(v, &o);
                                K::map(v).insert(name, o);
                            });
                        }
                    }
                    WatchEvent::Deleted(o) => {
                        if let Some(name) = key_of(&o) {
                            self.update(cluster, |v| {
                                K::map(v).remove(&name);
                            });
                        }
                    }
                    // Each watch starts from a fresh list, so no version is carried over.
                    WatchEvent::Bookmark(_) => {}
                    // 410 Gone and friends: list again.
                    WatchEvent::Error(e) => {
                        return Err(Error::Upstream(format!("watching {path}: {}", e.message)));
                    }
                }
            }
            if buf.len() > MAX_WATCH_LINE {
                return Err(Error::Upstream(format!(
                    "watching {path}: a line over 4 MiB"
                )));
            }
        }
        // The watch timed out: the loop lists again, which also repairs anything missed.
        Ok(())
    }
}

/// What `as_user` may see of `cluster`, read now through its agent (`Open::Read`: the agent
/// checks every object with SubjectAccessReviews).
pub async fn read_as(
    clusters: &Clusters,
    cluster: &str,
    as_user: &KubeIdentity,
) -> Result<ClusterView, Error> {
    let [sandboxes, route_groups, routing_configs, jobs] = crate::protocol::READ_PATHS;
    let (sandboxes, route_groups, routing_configs, jobs) = tokio::try_join!(
        read_list::<Sandbox>(clusters, cluster, as_user, sandboxes),
        read_list::<RouteGroup>(clusters, cluster, as_user, route_groups),
        read_list::<RoutingConfig>(clusters, cluster, as_user, routing_configs),
        read_list::<spur_api::Job>(clusters, cluster, as_user, jobs),
    )?;
    Ok(ClusterView {
        sandboxes,
        route_groups,
        routing_configs,
        jobs,
        synced: true,
        ..ClusterView::default()
    })
}

async fn read_list<K: DeserializeOwned + kube::Resource + Clone>(
    clusters: &Clusters,
    cluster: &str,
    as_user: &KubeIdentity,
    path: &str,
) -> Result<BTreeMap<String, K>, Error> {
    let open = Open::Read {
        as_user: as_user.clone(),
    };
    let body = get_on(clusters, cluster, &open, path).await?;
    let body = read_limited(body, MAX_LIST_BODY, &format!("listing {path}")).await?;
    let list: ObjectList<K> = serde_json::from_slice(&body)
        .map_err(|e| Error::Upstream(format!("listing {path}: {e}")))?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|o| Some((key_of(&o)?, o)))
        .collect())
}

/// The key of an object in its map: its name, or `namespace/name` for a namespaced one.
fn key_of<K: kube::Resource>(o: &K) -> Option<String> {
    let name = o.meta().name.clone()?;
    Some(match &o.meta().namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name,
    })
}

impl Kind for spur_api::Job {
    fn map(view: &mut ClusterView) -> &mut BTreeMap<String, Self> {
        &mut view.jobs
    }
}

/// Which map of a [`ClusterView`] a kind lives in.
pub trait Kind {
    fn map(view: &mut ClusterView) -> &mut BTreeMap<String, Self>
    where
        Self: Sized;

    /// What of an object the view keeps (all of it, unless the kind says otherwise).
    fn kept(self) -> Self
    where
        Self: Sized,
    {
        self
    }

    /// Records that the kind's list was read.
    fn synced(view: &mut ClusterView) {
        view.synced = true;
    }

    /// Records that the cluster's agent has no Kubernetes access (nothing of the kind to read).
    fn without_kube(_view: &mut ClusterView) {}

    /// Notes an object listed or watched (before it is stored).
    fn seen(_view: &mut ClusterView, _o: &Self)
    where
        Self: Sized,
    {
    }
}

/// The cluster's namespaces, listed and watched for their carrier annotations: the agent allows
/// this one core path besides Spur's resources ([`crate::agent::kube_path_allowed`]).
pub const NAMESPACES_PATH: &str = "/api/v1/namespaces";

impl Kind for Namespace {
    fn map(view: &mut ClusterView) -> &mut BTreeMap<String, Self> {
        &mut view.namespaces
    }

    /// Its name and its carrier annotations, nothing else.
    fn kept(self) -> Self {
        let annotations: BTreeMap<String, String> = self
            .metadata
            .annotations
            .unwrap_or_default()
            .into_iter()
            .filter(|(k, _)| [ROUTING_HEADERS, QUERY_PARAM].contains(&k.as_str()))
            .collect();
        Namespace {
            metadata: kube::api::ObjectMeta {
                name: self.metadata.name,
                annotations: (!annotations.is_empty()).then_some(annotations),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn synced(view: &mut ClusterView) {
        view.namespaces_synced = true;
    }

    /// No namespaces to read: previews to the cluster overwrite the hub's carriers only
    /// (docs/hub.md).
    fn without_kube(view: &mut ClusterView) {
        view.namespaces_synced = true;
    }

    fn seen(view: &mut ClusterView, o: &Self) {
        if let Some(a) = &o.metadata.annotations {
            view.namespace_carriers.add_namespace(a);
        }
    }
}

impl Kind for Sandbox {
    fn map(view: &mut ClusterView) -> &mut BTreeMap<String, Self> {
        &mut view.sandboxes
    }
}

impl Kind for RouteGroup {
    fn map(view: &mut ClusterView) -> &mut BTreeMap<String, Self> {
        &mut view.route_groups
    }
}

impl Kind for RoutingConfig {
    fn map(view: &mut ClusterView) -> &mut BTreeMap<String, Self> {
        &mut view.routing_configs
    }
}

/// GET `path` on `cluster`'s Kubernetes API, through its agent; the body of a 200.
async fn get(
    clusters: &Clusters,
    cluster: &str,
    path: &str,
) -> Result<hyper::body::Incoming, Error> {
    get_on(clusters, cluster, &Open::Kube, path).await
}

/// GET `path` on a stream opened for `open`; the body of a 200.
async fn get_on(
    clusters: &Clusters,
    cluster: &str,
    open: &Open,
    path: &str,
) -> Result<hyper::body::Incoming, Error> {
    let resp = clusters.http_get(cluster, open, path, OPEN_TIMEOUT).await?;
    if resp.status() != StatusCode::OK {
        let status = resp.status();
        let body = read_limited(resp.into_body(), MAX_ERROR_BODY, "an error answer").await;
        let text = body
            .map(|mut b| String::from_utf8_lossy(&b.copy_to_bytes(b.len().min(512))).into_owned())
            .unwrap_or_default();
        return Err(Error::Upstream(format!("GET {path}: {status}: {text}")));
    }
    Ok(resp.into_body())
}

/// The whole of an agent's answer, refused (an error that says so, and a warning in the log)
/// once it is over `max` bytes: the hub reads no further and the stream is dropped.
pub async fn read_limited(
    body: hyper::body::Incoming,
    max: usize,
    what: &str,
) -> Result<bytes::Bytes, Error> {
    match http_body_util::Limited::new(body, max).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            tracing::warn!(what, max, "an agent's answer was over the limit: refused");
            Err(Error::Upstream(format!(
                "{what}: the agent's answer is over {max} bytes; refused"
            )))
        }
        Err(e) => Err(Error::Upstream(format!("{what}: {e}"))),
    }
}
