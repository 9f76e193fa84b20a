//! The Kubernetes rule store: routing rules from the status of every `RoutingConfig` in the
//! cluster, cluster services (for `GetClusterServices`) from Services.
//!
//! With [`KubeStore::with_l4`], also ListenerSets and the EndpointSlices of their endpoint
//! Services, rendered into the L4 model gateways are served from ([`crate::l4`]).
//!
//! All come from watch-backed reflectors. Every change marks the set dirty; a publisher task
//! rebuilds the whole rule set at most once per `debounce` and hands it to the index, which
//! diffs it and streams only the changed rules to watchers.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use spur_api::carriers::ExtractConfig;
use spur_api::{EnvoyConfigRevision, ListenerSet, RoutingConfig};
use spur_proto::routes;
use spur_routing::RoutingRule;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::index::{Index, RuleKey};
use crate::metrics::Metrics;
use crate::store::RuleStore;

/// Routing rules and cluster services from a Kubernetes API server.
pub struct KubeStore {
    client: Client,
    sync_timeout: Duration,
    debounce: Duration,
    xds: bool,
    l4: bool,
    /// Namespaces whose labelled Secrets SDS may serve.
    secret_namespaces: Vec<String>,
    /// The cluster's routing-key carriers besides the standard ones, for the xDS routes.
    carriers: ExtractConfig,
    running: Option<Running>,
}

struct Running {
    configs: Store<RoutingConfig>,
    services: Store<Service>,
    /// Only with xDS: its clusters' endpoints, and the published EnvoyConfig revisions.
    slices: Option<Store<EndpointSlice>>,
    revisions: Option<Store<EnvoyConfigRevision>>,
    /// Only with L4: ListenerSets, and (without xDS, which watches them all) the EndpointSlices
    /// labelled with a ListenerSet.
    listener_sets: Option<Store<ListenerSet>>,
    l4_slices: Option<Store<EndpointSlice>>,
    /// One per namespace of `secret_namespaces`, only Secrets labelled for SDS.
    secrets: Vec<Store<Secret>>,
    /// Only with xDS: Namespaces' metadata, whose annotations may change the carriers.
    namespaces: Option<Store<PartialObjectMeta<Namespace>>>,
    carriers: ExtractConfig,
    secret_namespaces: Vec<String>,
    dirty: Arc<Notify>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl KubeStore {
    /// A store over `client`; nothing is watched until the route server starts it.
    pub fn new(client: Client) -> Self {
        KubeStore {
            client,
            sync_timeout: Duration::from_secs(60),
            debounce: Duration::from_millis(20),
            xds: false,
            l4: false,
            secret_namespaces: Vec::new(),
            carriers: ExtractConfig::default(),
            running: None,
        }
    }

    /// With xDS, the routes match these carriers too (the cluster's `routingKeys`), and those a
    /// namespace's annotations add ([`spur_api::carriers::of_namespace`]): the Namespaces'
    /// metadata is watched for them. Fails when the carriers are malformed.
    pub fn with_carriers(mut self, carriers: ExtractConfig) -> Result<Self, crate::Error> {
        spur_api::carriers::KeyExtractor::new(&carriers)
            .map_err(|e| crate::Error::Store(format!("routing-key carriers: {e}")))?;
        self.carriers = carriers;
        Ok(self)
    }

    /// Also watches EndpointSlices and publishes the xDS model (see [`crate::xds`]).
    pub fn with_xds(mut self) -> Self {
        self.xds = true;
        self
    }

    /// Also watches ListenerSets (and the EndpointSlices of their endpoint Services) and
    /// publishes the L4 model gateways are served from (see [`crate::l4`]).
    ///
    /// Without xDS only the EndpointSlices labelled `spur.dev/listener-set` are watched (the
    /// EndpointSlice controller copies a Service's labels onto its slices, and the operator
    /// labels the endpoint Services so), not every slice of the cluster.
    pub fn with_l4(mut self) -> Self {
        self.l4 = true;
        self
    }

    /// With xDS, also serves over SDS the Secrets labelled `spur.dev/envoy-secret=true` in
    /// `namespaces` that EnvoyConfigs there name (the route server may read Secrets there and
    /// nowhere else).
    pub fn with_secret_namespaces(mut self, namespaces: Vec<String>) -> Self {
        self.secret_namespaces = namespaces;
        self
    }

    /// How long start-up waits for the first complete list of RoutingConfigs and Services.
    pub fn with_sync_timeout(mut self, timeout: Duration) -> Self {
        self.sync_timeout = timeout;
        self
    }
}

/// What every reflector's events reach: the rule set's dirty mark, and the watch-failure count.
struct Wake {
    dirty: Arc<Notify>,
    metrics: Metrics,
}

/// Drives one reflector for the life of the store, marking the rule set dirty on every event.
fn spawn_reflector<K>(api: Api<K>, wake: &Wake, what: &'static str) -> (Store<K>, JoinHandle<()>)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    spawn_reflector_with(api, watcher::Config::default(), wake, what)
}

fn spawn_reflector_with<K>(
    api: Api<K>,
    config: watcher::Config,
    wake: &Wake,
    what: &'static str,
) -> (Store<K>, JoinHandle<()>)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, config))
        .default_backoff()
        .boxed();
    let dirty = wake.dirty.clone();
    let metrics = wake.metrics.clone();
    metrics.watching(what);
    let task = tokio::spawn(async move {
        let mut stream = stream;
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => dirty.notify_one(),
                // The watcher retries with backoff and the store keeps its last view, so the
                // rules in force stay in force while the API server is unreachable.
                Err(e) => {
                    metrics.watch_failed(what);
                    tracing::warn!(error = %e, "{what} watch failed; retrying");
                }
            }
        }
    });
    (reader, task)
}

impl RuleStore for KubeStore {
    async fn initial(&mut self, index: &Index, metrics: &Metrics) -> Result<(), crate::Error> {
        let dirty = Arc::new(Notify::new());
        let wake = Wake {
            dirty: dirty.clone(),
            metrics: metrics.clone(),
        };
        let (configs, t1) = spawn_reflector(
            Api::<RoutingConfig>::all(self.client.clone()),
            &wake,
            "RoutingConfig",
        );
        let (services, t2) =
            spawn_reflector(Api::<Service>::all(self.client.clone()), &wake, "Service");
        let mut tasks = vec![t1, t2];
        let slices = self.xds.then(|| {
            let (slices, t3) = spawn_reflector(
                Api::<EndpointSlice>::all(self.client.clone()),
                &wake,
                "EndpointSlice",
            );
            tasks.push(t3);
            slices
        });
        // Only the published revisions: one per EnvoyConfig, not the ten it may keep.
        let revisions = self.xds.then(|| {
            let (revisions, t4) = spawn_reflector_with(
                Api::<EnvoyConfigRevision>::all(self.client.clone()),
                watcher::Config::default()
                    .labels(&format!("{}=true", spur_api::envoyconfig::PUBLISHED_LABEL)),
                &wake,
                "EnvoyConfigRevision",
            );
            tasks.push(t4);
            revisions
        });
        let listener_sets = self.l4.then(|| {
            let (sets, t) = spawn_reflector(
                Api::<ListenerSet>::all(self.client.clone()),
                &wake,
                "ListenerSet",
            );
            tasks.push(t);
            sets
        });
        let l4_slices = (self.l4 && !self.xds).then(|| {
            let (slices, t) = spawn_reflector_with(
                Api::<EndpointSlice>::all(self.client.clone()),
                watcher::Config::default().labels(spur_api::listenerset::LISTENER_SET_LABEL),
                &wake,
                "EndpointSlice",
            );
            tasks.push(t);
            slices
        });
        let namespaces = self.xds.then(|| {
            let (namespaces, t) = spawn_reflector(
                Api::<PartialObjectMeta<Namespace>>::all(self.client.clone()),
                &wake,
                "Namespace",
            );
            tasks.push(t);
            namespaces
        });
        let mut secrets = Vec::new();
        if self.xds {
            for ns in &self.secret_namespaces {
                let (store, task) = spawn_reflector_with(
                    Api::<Secret>::namespaced(self.client.clone(), ns),
                    watcher::Config::default()
                        .labels(&format!("{}=true", spur_api::envoyconfig::SECRET_LABEL)),
                    &wake,
                    "Secret",
                );
                tasks.push(task);
                secrets.push(store);
            }
        }
        let running = Running {
            configs,
            services,
            slices,
            revisions,
            listener_sets,
            l4_slices,
            secrets,
            namespaces,
            carriers: self.carriers.clone(),
            secret_namespaces: self.secret_namespaces.clone(),
            dirty,
            tasks,
        };
        let ready = async {
            running.configs.wait_until_ready().await?;
            if let Some(slices) = &running.slices {
                slices.wait_until_ready().await?;
            }
            if let Some(revisions) = &running.revisions {
                revisions.wait_until_ready().await?;
            }
            if let Some(sets) = &running.listener_sets {
                sets.wait_until_ready().await?;
            }
            if let Some(slices) = &running.l4_slices {
                slices.wait_until_ready().await?;
            }
            for s in &running.secrets {
                s.wait_until_ready().await?;
            }
            if let Some(n) = &running.namespaces {
                n.wait_until_ready().await?;
            }
            running.services.wait_until_ready().await
        };
        match tokio::time::timeout(self.sync_timeout, ready).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(crate::Error::Store(format!("watch ended: {e}"))),
            Err(_) => {
                return Err(crate::Error::Store(format!(
                    "no complete list of RoutingConfigs and Services (and EndpointSlices, published EnvoyConfigRevisions, SDS Secrets and Namespaces, with xDS; ListenerSets, with L4) within {:?} (is the API server reachable, are the CRDs installed, may this service account list and watch them?)",
                    self.sync_timeout
                )));
            }
        }
        publish(&running, index, metrics);
        self.running = Some(running);
        Ok(())
    }

    async fn run(mut self, index: Index, metrics: Metrics, stop: CancellationToken) {
        let Some(running) = self.running.take() else {
            tracing::error!("Kubernetes store run before its initial sync");
            return;
        };
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = running.dirty.notified() => {}
            }
            // Coalesce a burst (a controller updating many RoutingConfigs) into one publication.
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.debounce) => {}
            }
            publish(&running, &index, &metrics);
        }
    }
}

fn publish(running: &Running, index: &Index, metrics: &Metrics) {
    let mut configs = running.configs.state();
    // A stable order decides conflicts the same way on every publication and every replica.
    configs.sort_by_key(|c| (c.namespace(), c.name_any()));
    let (rules, mut problems) = rules_from(&configs);
    let (routes, span_problems) = spans_from(&configs);
    problems.extend(span_problems);
    if let Some(sets) = &running.listener_sets {
        let slices = running
            .l4_slices
            .as_ref()
            .or(running.slices.as_ref())
            .map(Store::state)
            .unwrap_or_default();
        let model = crate::l4_model::Model::build(&sets.state(), &slices, &configs);
        problems.extend(model.problems.iter().cloned());
        index.set_l4(model);
    }
    let namespaces = running
        .namespaces
        .as_ref()
        .map(Store::state)
        .unwrap_or_default();
    let (carriers, carrier_problems) =
        crate::xds::model::Carriers::build(&running.carriers, &namespaces);
    if running.slices.is_some() {
        problems.extend(carrier_problems);
    }
    metrics.set_problems(problems.len());
    index.replace_all_with_history(rules, routes);
    index.set_problems(problems);
    let services = running.services.state();
    index.set_services(cluster_services(&services, &configs));
    if let Some(slices) = &running.slices {
        let revisions = running
            .revisions
            .as_ref()
            .map(Store::state)
            .unwrap_or_default();
        let secrets: Vec<Arc<Secret>> = running.secrets.iter().flat_map(Store::state).collect();
        index.set_xds(
            crate::xds::model::Model::build(&services, &configs, &slices.state(), &carriers)
                .with_node_configs(
                    &revisions,
                    crate::xds::model::TlsSecrets {
                        namespaces: &running.secret_namespaces,
                        secrets: &secrets,
                    },
                ),
        );
    }
}

/// Every RoutingConfig's rules, validated one by one: an invalid rule or a second rule for the
/// same (baseline, routing key) is dropped and reported, and never takes the others with it.
pub fn rules_from(configs: &[Arc<RoutingConfig>]) -> (Vec<RoutingRule>, Vec<String>) {
    let mut rules = Vec::new();
    let mut problems = Vec::new();
    let mut owner: HashMap<RuleKey, String> = HashMap::new();
    for rc in configs {
        let id = format!(
            "RoutingConfig {}/{}",
            rc.namespace().unwrap_or_default(),
            rc.name_any()
        );
        for (i, spec) in rc.rule_specs().into_iter().enumerate() {
            let rule = match RoutingRule::from_spec(i, spec) {
                Ok(r) => r,
                Err(e) => {
                    problems.push(format!("{id}: {e}"));
                    continue;
                }
            };
            let key = RuleKey {
                baseline: rule.baseline.clone(),
                routing_key: rule.routing_key.clone(),
            };
            if let Some(first) = owner.get(&key) {
                problems.push(format!(
                    "{id}: rule for routing key {:?} and baseline {} ignored: already defined by {first}",
                    rule.routing_key, rule.baseline
                ));
                continue;
            }
            owner.insert(key, id.clone());
            rules.push(rule);
        }
    }
    (rules, problems)
}

/// The routes in force for the route history: every RoutingConfig's spans (the operator writes
/// their starts, and their ends when the sandbox goes), validated one by one like the rules: an
/// invalid span (an end not after its start included) or a second one for the same (baseline,
/// routing key) is dropped and reported.
pub(crate) fn spans_from(configs: &[Arc<RoutingConfig>]) -> (crate::history::InForce, Vec<String>) {
    let mut routes = crate::history::InForce::new();
    let mut problems = Vec::new();
    let mut owner: HashMap<RuleKey, String> = HashMap::new();
    for rc in configs {
        let id = format!("RoutingConfig {}", rc.name_any());
        for s in rc.spans() {
            let key = &rc.spec.routing_key;
            let valid =
                spur_routing::Span::new(key.clone(), s.sandbox.clone(), s.since_ms, s.until_ms);
            if let Err(e) = valid {
                problems.push(format!("{id}: span of {}: {e}", s.baseline.name));
                continue;
            }
            if let Some(until) = s.until_ms
                && until <= s.since_ms
            {
                problems.push(format!(
                    "{id}: span of {}: until {until} is not after since {}",
                    s.baseline.name, s.since_ms
                ));
                continue;
            }
            let b = s.baseline.to_rule_baseline();
            let key = RuleKey {
                baseline: spur_routing::BaselineWorkload {
                    kind: b.kind,
                    namespace: b.namespace,
                    name: b.name,
                },
                routing_key: key.clone(),
            };
            if let Some(first) = owner.get(&key) {
                problems.push(format!(
                    "{id}: span for routing key {:?} and baseline {} ignored: already given by {first}",
                    key.routing_key, key.baseline
                ));
                continue;
            }
            owner.insert(key.clone(), id.clone());
            let given = crate::history::Given {
                sandbox: s.sandbox.clone(),
                since: Some(s.since_ms),
                until: s.until_ms,
            };
            routes.insert(key, given);
        }
    }
    (routes, problems)
}

/// Services as `GetClusterServices` reports them; a sandbox Service carries the routing key and
/// the baseline Service host it stands in for (from the routes that point at it).
pub fn cluster_services(
    services: &[Arc<Service>],
    configs: &[Arc<RoutingConfig>],
) -> Vec<routes::ClusterService> {
    let mut sandboxed: BTreeMap<&str, (&str, &str)> = BTreeMap::new();
    for rc in configs {
        let Some(routes) = rc.status.as_ref().and_then(|s| s.route_server.as_ref()) else {
            continue;
        };
        for r in &routes.routes {
            sandboxed
                .entry(r.to_host.as_str())
                .or_insert((rc.spec.routing_key.as_str(), r.from_host.as_str()));
        }
    }
    let mut out: Vec<routes::ClusterService> = services
        .iter()
        .filter_map(|svc| {
            let namespace = svc.namespace()?;
            let spec = svc.spec.as_ref()?;
            let hostname = spur_api::common::service_host(&svc.name_any(), &namespace);
            let ports = spec
                .ports
                .iter()
                .flatten()
                .filter_map(|p| {
                    Some(routes::ClusterServicePort {
                        name: p.name.clone().unwrap_or_default(),
                        port: u32::try_from(p.port).ok()?,
                        protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                        app_protocol: p.app_protocol.clone().unwrap_or_default(),
                    })
                })
                .collect();
            let sandbox_info = sandboxed.get(hostname.as_str()).map(|(key, baseline)| {
                routes::SandboxedClusterService {
                    sandbox_routing_key: (*key).to_owned(),
                    baseline_hostname: (*baseline).to_owned(),
                }
            });
            Some(routes::ClusterService {
                service_ip: spec.cluster_ip.clone().unwrap_or_default(),
                hostname,
                ports,
                sandbox_info,
            })
        })
        .collect();
    out.sort_by(|a, b| a.hostname.cmp(&b.hostname));
    out
}
