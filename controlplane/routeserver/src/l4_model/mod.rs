//! The L4 model: every ListenerSet rendered once per change into `spur_l4` listeners and
//! clusters (names prefixed `<set>/`, selector endpoints resolved from EndpointSlices, sandbox
//! keys from RoutingConfigs, durations parsed), and the merge of the sets one gateway pod
//! serves into that pod's configuration.
//!
//! Rendering is per set and once per store publication, so a change reaching a thousand
//! gateways costs one render plus a cheap merge per gateway. A set that cannot be rendered
//! (admission should have refused it) is left out whole and listed in the problems, so one bad
//! set never withdraws the listeners of the others.

mod selector;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use spur_api::ListenerSet;
use spur_api::RoutingConfig;
use spur_api::listenerset as api;
use spur_l4::{
    ClusterConfig, EndpointConfig, HashKey, HealthCheckConfig, HealthProtocol, KeyRoute,
    KeyRouteConfig, L4Config, LbPolicy, ListenerConfig, Overflow, Protocol,
};
use spur_proto::l4::{DnsEndpoint, ListenersUpdate};

/// The label an EndpointSlice carries naming its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// A cluster's TCP connect timeout when the set names none (the CRD's documented default).
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Every ListenerSet of the cluster, rendered. Compared as a whole, so a store publication
/// that changes nothing L4 wakes no gateway stream.
#[derive(Debug, Default, PartialEq)]
pub struct Model {
    /// Per namespace, its sets oldest first (creationTimestamp, then name): the order in which
    /// port clashes are decided.
    namespaces: BTreeMap<String, Vec<Arc<SetRender>>>,
    /// Sets left out, and parts of sets left out (an unknown sandbox, a pod twice), for logs
    /// and `/healthz`.
    pub problems: Vec<String>,
}

/// One ListenerSet as `spur_l4` configuration.
#[derive(Debug, PartialEq)]
struct SetRender {
    name: String,
    selector: LabelSelector,
    listeners: Vec<ListenerConfig>,
    clusters: Vec<ClusterConfig>,
    dns: Vec<DnsEndpoint>,
}

/// What one gateway pod is sent.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PodConfig {
    /// The sets whose selector picks the pod (their `status.gateways` get its reports).
    pub(crate) sets: BTreeSet<String>,
    /// Set → its listeners left out because an older set serves their port, and why.
    pub(crate) shadowed: BTreeMap<String, Vec<String>>,
    pub(crate) update: ListenersUpdate,
}

/// Inputs shared by every set's rendering.
struct Lookup<'a> {
    /// (namespace, Service name) → its EndpointSlices, IPv4 first, then by name.
    slices: HashMap<(&'a str, &'a str), Vec<&'a EndpointSlice>>,
    /// RoutingConfig name → routing key.
    keys: HashMap<&'a str, &'a str>,
}

impl Model {
    /// Renders every set. `slices` may hold any EndpointSlices (only those of the sets' endpoint
    /// Services are read); `configs` are the RoutingConfigs (a sandbox's routing key).
    pub fn build(
        sets: &[Arc<ListenerSet>],
        slices: &[Arc<EndpointSlice>],
        configs: &[Arc<RoutingConfig>],
    ) -> Model {
        let mut by_service: HashMap<(&str, &str), Vec<&EndpointSlice>> = HashMap::new();
        for s in slices {
            let (Some(ns), Some(svc)) = (
                s.metadata.namespace.as_deref(),
                s.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(SERVICE_NAME_LABEL)),
            ) else {
                continue;
            };
            by_service.entry((ns, svc.as_str())).or_default().push(s);
        }
        for list in by_service.values_mut() {
            list.sort_by(|a, b| {
                (a.address_type != "IPv4", a.metadata.name.as_deref())
                    .cmp(&(b.address_type != "IPv4", b.metadata.name.as_deref()))
            });
        }
        let lookup = Lookup {
            slices: by_service,
            keys: configs
                .iter()
                .filter_map(|rc| Some((rc.metadata.name.as_deref()?, rc.spec.routing_key.as_str())))
                .collect(),
        };
        let mut ordered: Vec<&Arc<ListenerSet>> = sets.iter().collect();
        ordered.sort_by(|a, b| {
            let key = |s: &ListenerSet| {
                (
                    s.metadata.namespace.clone().unwrap_or_default(),
                    s.metadata.creation_timestamp.as_ref().map(|t| t.0),
                    s.name_any(),
                )
            };
            key(a).cmp(&key(b))
        });
        let mut model = Model::default();
        for set in ordered {
            let Some(ns) = set.metadata.namespace.as_deref() else {
                continue;
            };
            let id = format!("ListenerSet {ns}/{}", set.name_any());
            let mut warnings = Vec::new();
            match render(set, ns, &lookup, &mut warnings) {
                Ok(r) => model
                    .namespaces
                    .entry(ns.to_owned())
                    .or_default()
                    .push(Arc::new(r)),
                Err(e) => model.problems.push(format!("{id}: not served: {e}")),
            }
            model
                .problems
                .extend(warnings.into_iter().map(|w| format!("{id}: {w}")));
        }
        model
    }

    /// The configuration of the gateway pod with `labels` in `namespace`: every set of the
    /// namespace whose selector picks it, merged oldest first. A listener whose protocol and
    /// port an older set's listener already has is left out (and named in `shadowed`).
    pub(crate) fn for_pod(&self, namespace: &str, labels: &BTreeMap<String, String>) -> PodConfig {
        let mut config = L4Config::default();
        let mut dns: Vec<DnsEndpoint> = Vec::new();
        let mut sets = BTreeSet::new();
        let mut shadowed: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for set in self.namespaces.get(namespace).into_iter().flatten() {
            if !selector::matches(&set.selector, labels) {
                continue;
            }
            sets.insert(set.name.clone());
            let mut kept: Vec<ListenerConfig> = Vec::with_capacity(set.listeners.len());
            let mut dropped: Vec<ClusterConfig> = Vec::new();
            for l in &set.listeners {
                if let Some(other) = config
                    .listeners
                    .iter()
                    .find(|o| o.protocol == l.protocol && o.port.port() == l.port.port())
                {
                    shadowed.entry(set.name.clone()).or_default().push(format!(
                        "{}: {} port {} is served by the older {}",
                        l.name,
                        l.protocol,
                        l.port.port(),
                        other.name
                    ));
                    dropped.push(l.cluster.clone());
                    continue;
                }
                kept.push(l.clone());
            }
            // A left-out listener's cluster stays when a kept listener's key route names it.
            let named = |c: &ClusterConfig| {
                kept.iter().any(|l| {
                    l.key_route
                        .as_ref()
                        .is_some_and(|k| k.routes.iter().any(|r| r.cluster == c.name))
                })
            };
            let mut clusters = set.clusters.clone();
            clusters.extend(dropped.into_iter().filter(|c| named(c)));
            config.listeners.extend(kept);
            config.clusters.extend(clusters);
            dns.extend(set.dns.iter().cloned());
        }
        let present: BTreeSet<&str> = config
            .listeners
            .iter()
            .map(|l| l.cluster.name.as_str())
            .chain(config.clusters.iter().map(|c| c.name.as_str()))
            .collect();
        dns.retain(|d| present.contains(d.cluster.as_str()));
        // Serialising plain structs of strings, numbers and maps with string keys cannot fail.
        let config_json = serde_json::to_string(&config).unwrap_or_default();
        let version = content_version(&config_json, &dns);
        PodConfig {
            sets,
            shadowed,
            update: ListenersUpdate {
                version,
                config_json,
                dns_endpoints: dns,
            },
        }
    }
}

/// FNV-1a over the update's content: equal content, equal version, on every replica.
fn content_version(json: &str, dns: &[DnsEndpoint]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // A separator, so ("ab","c") and ("a","bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    eat(json.as_bytes());
    for d in dns {
        eat(d.cluster.as_bytes());
        eat(d.name.as_bytes());
        eat(&d.port.to_le_bytes());
        eat(&d.health_check_port.to_le_bytes());
    }
    // 0 means "no configuration" in reports.
    h.max(1)
}

fn render(
    set: &ListenerSet,
    namespace: &str,
    lookup: &Lookup<'_>,
    warnings: &mut Vec<String>,
) -> Result<SetRender, String> {
    let name = set.name_any();
    let spec = &set.spec;
    let mut dns = Vec::new();
    let mut listeners = Vec::with_capacity(spec.listeners.len());
    for (i, l) in spec.listeners.iter().enumerate() {
        let at = format!("listeners[{i}] ({:?})", l.name);
        let cluster = cluster(&name, namespace, &l.cluster, lookup, &mut dns, warnings)
            .map_err(|e| format!("{at}.cluster: {e}"))?;
        let mut lc = ListenerConfig::new(
            format!("{name}/{}", l.name),
            protocol(l.protocol),
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), l.port),
            cluster,
        );
        if let Some(t) = &l.first_bytes_timeout {
            lc.first_bytes_timeout =
                duration(t).map_err(|e| format!("{at}.firstBytesTimeout: {e}"))?;
        }
        if let Some(k) = &l.key_route {
            lc.key_route = key_route(&name, k, lookup, &mut |w| {
                warnings.push(format!("{at}.keyRoute: {w}"));
            });
        }
        listeners.push(lc);
    }
    let mut clusters = Vec::with_capacity(spec.clusters.len());
    for (i, c) in spec.clusters.iter().enumerate() {
        clusters.push(
            cluster(&name, namespace, c, lookup, &mut dns, warnings)
                .map_err(|e| format!("clusters[{i}] ({:?}): {e}", c.name))?,
        );
    }
    // Validated on its own, with a stand-in for each endpoint list still empty (no ready pod
    // yet, DNS only): the gateway leaves such clusters out, which no other check depends on.
    let mut probe = L4Config {
        listeners: listeners.clone(),
        clusters: clusters.clone(),
        ..L4Config::default()
    };
    for c in probe
        .listeners
        .iter_mut()
        .map(|l| &mut l.cluster)
        .chain(probe.clusters.iter_mut())
    {
        if c.endpoints.is_empty() {
            c.endpoints.push(EndpointConfig {
                id: "stand-in".into(),
                address: SocketAddr::from(([192, 0, 2, 1], 1)),
                health_check_port: Some(1),
            });
        }
    }
    probe.validate().map_err(|e| e.to_string())?;
    Ok(SetRender {
        name,
        selector: spec.selector.clone(),
        listeners,
        clusters,
        dns,
    })
}

fn protocol(p: api::Protocol) -> Protocol {
    match p {
        api::Protocol::Tcp => Protocol::Tcp,
        api::Protocol::Udp => Protocol::Udp,
    }
}

fn duration(s: &str) -> Result<Duration, String> {
    spur_runtime::parse_duration(s)
}

/// One cluster with its address and selector endpoints resolved; DNS entries go to `dns`.
fn cluster(
    set: &str,
    namespace: &str,
    c: &api::Cluster,
    lookup: &Lookup<'_>,
    dns: &mut Vec<DnsEndpoint>,
    warnings: &mut Vec<String>,
) -> Result<ClusterConfig, String> {
    let full = format!("{set}/{}", c.name);
    let mut endpoints: Vec<EndpointConfig> = Vec::new();
    let mut add = |e: EndpointConfig, warnings: &mut Vec<String>| {
        if let Some(first) = endpoints
            .iter()
            .find(|o| o.id == e.id || o.address == e.address)
        {
            warnings.push(format!(
                "cluster {:?}: endpoint {} ({}) left out: the cluster already has {} ({})",
                c.name, e.id, e.address, first.id, first.address
            ));
            return;
        }
        endpoints.push(e);
    };
    for (i, e) in c.endpoints.iter().enumerate() {
        let set_forms = [
            e.selector.is_some(),
            e.address.is_some(),
            e.dns_name.is_some(),
        ];
        if set_forms.iter().filter(|s| **s).count() != 1 {
            return Err(format!(
                "endpoints[{i}]: set exactly one of selector, address and dnsName"
            ));
        }
        if e.port == 0 {
            return Err(format!("endpoints[{i}]: port must not be 0"));
        }
        if let Some(ip) = &e.address {
            let ip: IpAddr = ip
                .parse()
                .map_err(|_| format!("endpoints[{i}]: address {ip:?} is not an IP address"))?;
            let address = SocketAddr::new(ip, e.port);
            add(
                EndpointConfig {
                    id: address.to_string(),
                    address,
                    health_check_port: e.health_check_port,
                },
                warnings,
            );
        } else if let Some(name) = &e.dns_name {
            dns.push(DnsEndpoint {
                cluster: full.clone(),
                name: name.clone(),
                port: u32::from(e.port),
                health_check_port: e.health_check_port.map(u32::from).unwrap_or_default(),
            });
        } else {
            let service = api::endpoint_service_name(set, &c.name, i);
            for slice in lookup
                .slices
                .get(&(namespace, service.as_str()))
                .into_iter()
                .flatten()
            {
                if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
                    continue;
                }
                for ep in &slice.endpoints {
                    // An unset `ready` means ready (the API's documented default).
                    let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
                    let Some(ip) = ep.addresses.first().and_then(|a| a.parse::<IpAddr>().ok())
                    else {
                        continue;
                    };
                    if !ready {
                        continue;
                    }
                    let address = SocketAddr::new(ip, e.port);
                    let id = ep
                        .target_ref
                        .as_ref()
                        .and_then(|t| t.name.clone())
                        .unwrap_or_else(|| ip.to_string());
                    add(
                        EndpointConfig {
                            id,
                            address,
                            health_check_port: e.health_check_port,
                        },
                        warnings,
                    );
                }
            }
        }
    }
    let mut out = ClusterConfig::new(full, endpoints);
    out.lb = match c.lb {
        api::LbPolicy::RoundRobin => LbPolicy::RoundRobin,
        api::LbPolicy::RingHash => LbPolicy::RingHash,
        api::LbPolicy::Maglev => LbPolicy::Maglev,
    };
    out.hash_key = match &c.hash_key {
        Some(k) => Some(hash_key(k)?),
        // The CRD's default for the hashing balancers: the client's address and port.
        None if out.lb != LbPolicy::RoundRobin => Some(HashKey::SourceIpPort),
        None => None,
    };
    if let Some(h) = &c.health_check {
        let mut hc = HealthCheckConfig::new(match h.protocol {
            api::HealthProtocol::Tcp => HealthProtocol::Tcp,
            api::HealthProtocol::Http => HealthProtocol::Http,
        });
        hc.path = h.path.clone();
        if let Some(d) = &h.interval {
            hc.interval = duration(d).map_err(|e| format!("healthCheck.interval: {e}"))?;
        }
        if let Some(d) = &h.timeout {
            hc.timeout = duration(d).map_err(|e| format!("healthCheck.timeout: {e}"))?;
        }
        if let Some(n) = h.healthy_threshold {
            hc.healthy_threshold = n;
        }
        if let Some(n) = h.unhealthy_threshold {
            hc.unhealthy_threshold = n;
        }
        out.health_check = Some(hc);
    }
    if let Some(d) = &c.idle_timeout {
        out.idle_timeout = Some(duration(d).map_err(|e| format!("idleTimeout: {e}"))?);
    }
    if let Some(n) = c.max_sessions {
        out.max_sessions = n;
    }
    if let Some(o) = c.overflow {
        out.overflow = match o {
            api::Overflow::EvictOldest => Overflow::EvictOldest,
            api::Overflow::Refuse => Overflow::Refuse,
        };
    }
    out.connect_timeout = match &c.connect_timeout {
        Some(d) => duration(d).map_err(|e| format!("connectTimeout: {e}"))?,
        None => DEFAULT_CONNECT_TIMEOUT,
    };
    Ok(out)
}

fn hash_key(k: &api::HashKey) -> Result<HashKey, String> {
    let forms = [
        k.constant.as_ref().map(|c| HashKey::Constant(c.clone())),
        k.source_ip.map(|_| HashKey::SourceIp),
        k.source_ip_port.map(|_| HashKey::SourceIpPort),
        k.first_bytes.map(|r| HashKey::FirstBytes {
            offset: r.offset,
            length: r.length,
        }),
    ];
    let mut set = forms.into_iter().flatten();
    match (set.next(), set.next()) {
        (Some(one), None) => Ok(one),
        _ => Err(
            "hashKey: set exactly one of constant, sourceIp, sourceIpPort and firstBytes".into(),
        ),
    }
}

/// The key routes that can be served now: a `sandbox` route whose sandbox has no routing key
/// yet, or whose key does not fit `length`, is left out (its sessions reach the listener's own
/// cluster, the baseline) and reported through `warn`. None when no route is left.
fn key_route(
    set: &str,
    k: &api::KeyRoute,
    lookup: &Lookup<'_>,
    warn: &mut dyn FnMut(String),
) -> Option<KeyRouteConfig> {
    let mut routes = Vec::with_capacity(k.routes.len());
    for (i, r) in k.routes.iter().enumerate() {
        let cluster = format!("{set}/{}", r.cluster);
        let route = match (&r.key, &r.key_hex, &r.sandbox) {
            (Some(key), None, None) => KeyRoute {
                key: Some(key.clone()),
                key_hex: None,
                cluster,
            },
            (None, Some(hex), None) => KeyRoute {
                key: None,
                key_hex: Some(hex.clone()),
                cluster,
            },
            (None, None, Some(sandbox)) => {
                let rc = spur_api::names::sandbox_routing_config_name(sandbox);
                let Some(key) = lookup.keys.get(rc.as_str()) else {
                    warn(format!(
                        "routes[{i}]: sandbox {sandbox:?} has no routing key (yet): left out"
                    ));
                    continue;
                };
                if k.length.is_some_and(|len| key.len() != len as usize) {
                    warn(format!(
                        "routes[{i}]: sandbox {sandbox:?}'s routing key is {} bytes, not the route's length: left out",
                        key.len()
                    ));
                    continue;
                }
                KeyRoute {
                    key: Some((*key).to_owned()),
                    key_hex: None,
                    cluster,
                }
            }
            _ => {
                warn(format!(
                    "routes[{i}]: set exactly one of key, keyHex and sandbox: left out"
                ));
                continue;
            }
        };
        if routes
            .iter()
            .any(|o: &KeyRoute| o.key == route.key && o.key_hex == route.key_hex)
        {
            warn(format!("routes[{i}]: the key is used twice: left out"));
            continue;
        }
        routes.push(route);
    }
    (!routes.is_empty()).then_some(KeyRouteConfig {
        offset: k.offset,
        length: k.length,
        routes,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn set(name: &str, created: &str, spec: serde_json::Value) -> Arc<ListenerSet> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "ListenerSet",
                "metadata": {"name": name, "namespace": "media", "creationTimestamp": created},
                "spec": spec,
            }))
            .unwrap(),
        )
    }

    fn slice(service: &str, eps: &[(&str, &str, bool)]) -> Arc<EndpointSlice> {
        let endpoints: Vec<_> = eps
            .iter()
            .map(|(pod, ip, ready)| {
                json!({"addresses": [ip], "conditions": {"ready": ready},
                       "targetRef": {"kind": "Pod", "name": pod, "namespace": "media"}})
            })
            .collect();
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": format!("{service}-abc"), "namespace": "media",
                             "labels": {SERVICE_NAME_LABEL: service}},
                "addressType": "IPv4", "endpoints": endpoints,
            }))
            .unwrap(),
        )
    }

    fn labels(app: &str) -> BTreeMap<String, String> {
        BTreeMap::from([("app".to_owned(), app.to_owned())])
    }

    fn config(p: &PodConfig) -> L4Config {
        serde_json::from_str(&p.update.config_json).unwrap()
    }

    #[test]
    fn renders_endpoints_keys_and_merges_oldest_first() {
        let rtp = set(
            "rtp",
            "2024-01-01T00:00:00Z",
            json!({
                "selector": {"matchLabels": {"app": "gw"}},
                "listeners": [{
                    "name": "media", "protocol": "udp", "port": 5000,
                    "cluster": {"name": "workers", "lb": "maglev",
                        "hashKey": {"firstBytes": {"offset": 0, "length": 4}},
                        "idleTimeout": "30s",
                        "endpoints": [
                            {"selector": {"matchLabels": {"app": "w"}}, "port": 7000},
                            {"address": "10.9.9.9", "port": 7001},
                            {"dnsName": "media.example", "port": 7002, "healthCheckPort": 8080}
                        ]},
                    "keyRoute": {"offset": 4, "length": 3, "routes": [
                        {"sandbox": "sb1", "cluster": "fork"},
                        {"sandbox": "gone", "cluster": "fork"},
                        {"key": "abc", "cluster": "fork"}
                    ]}
                }],
                "clusters": [{"name": "fork", "endpoints": [{"address": "10.1.1.1", "port": 7000}]}]
            }),
        );
        let newer = set(
            "other",
            "2024-06-01T00:00:00Z",
            json!({
                "selector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["gw"]}]},
                "listeners": [
                    {"name": "clash", "protocol": "udp", "port": 5000,
                     "cluster": {"name": "c", "endpoints": [{"address": "10.2.2.2", "port": 1}]}},
                    {"name": "tcp", "protocol": "tcp", "port": 5000,
                     "cluster": {"name": "t", "endpoints": [{"address": "10.2.2.3", "port": 1}]}}
                ]
            }),
        );
        let svc = api::endpoint_service_name("rtp", "workers", 0);
        let slices = vec![slice(
            &svc,
            &[
                ("w-0", "10.0.0.1", true),
                ("w-1", "10.0.0.2", true),
                ("w-2", "10.0.0.3", false),
            ],
        )];
        let rc: Arc<RoutingConfig> = Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "RoutingConfig",
                "metadata": {"name": spur_api::names::sandbox_routing_config_name("sb1")},
                "spec": {"routingKey": "k42"},
            }))
            .unwrap(),
        );
        // Given newest first: order comes from creationTimestamp.
        let model = Model::build(&[newer, rtp], &slices, &[rc]);
        assert_eq!(model.problems.len(), 1, "{:?}", model.problems);
        assert!(model.problems[0].contains("sandbox \"gone\""));

        let pod = model.for_pod("media", &labels("gw"));
        assert_eq!(
            pod.sets.iter().collect::<Vec<_>>(),
            ["other", "rtp"],
            "both select the pod"
        );
        assert_eq!(pod.shadowed.len(), 1);
        assert_eq!(
            pod.shadowed["other"],
            ["other/clash: udp port 5000 is served by the older rtp/media"]
        );
        let c = config(&pod);
        let names: Vec<_> = c.listeners.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["rtp/media", "other/tcp"]);
        let workers = &c.listeners[0].cluster;
        assert_eq!(workers.name, "rtp/workers");
        let ids: Vec<_> = workers.endpoints.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["w-0", "w-1", "10.9.9.9:7001"], "w-2 is not ready");
        assert_eq!(
            workers.endpoints[0].address,
            "10.0.0.1:7000".parse().unwrap()
        );
        assert_eq!(workers.idle_timeout, Some(Duration::from_secs(30)));
        let kr = c.listeners[0].key_route.as_ref().unwrap();
        let keys: Vec<_> = kr
            .routes
            .iter()
            .map(|r| r.key.as_deref().unwrap())
            .collect();
        assert_eq!(keys, ["k42", "abc"]);
        assert_eq!(kr.routes[0].cluster, "rtp/fork");
        assert_eq!(c.clusters[0].name, "rtp/fork");
        assert_eq!(pod.update.dns_endpoints.len(), 1);
        assert_eq!(pod.update.dns_endpoints[0].cluster, "rtp/workers");
        assert_eq!(pod.update.dns_endpoints[0].health_check_port, 8080);

        // Same content, same version; another pod's labels, nothing.
        assert_eq!(
            model.for_pod("media", &labels("gw")).update.version,
            pod.update.version
        );
        let none = model.for_pod("media", &labels("web"));
        assert!(none.sets.is_empty() && config(&none).listeners.is_empty());
        assert!(model.for_pod("elsewhere", &labels("gw")).sets.is_empty());
    }

    #[test]
    fn an_invalid_set_is_left_out_whole() {
        let bad = set(
            "bad",
            "2024-01-01T00:00:00Z",
            json!({
                "selector": {},
                "listeners": [{"name": "x", "protocol": "udp", "port": 53,
                    "cluster": {"name": "c", "idleTimeout": "soon",
                        "endpoints": [{"address": "10.0.0.1", "port": 53}]}}]
            }),
        );
        let good = set(
            "good",
            "2024-01-02T00:00:00Z",
            json!({
                "selector": {},
                "listeners": [{"name": "x", "protocol": "udp", "port": 53,
                    "cluster": {"name": "c", "endpoints": [{"selector": {}, "port": 53}]}}]
            }),
        );
        let model = Model::build(&[bad, good], &[], &[]);
        assert_eq!(model.problems.len(), 1);
        assert!(model.problems[0].contains("ListenerSet media/bad: not served"));
        let pod = model.for_pod("media", &labels("any"));
        let c = config(&pod);
        assert_eq!(c.listeners.len(), 1, "the good set takes the port");
        assert!(c.listeners[0].cluster.endpoints.is_empty(), "no slice yet");
        assert_eq!(
            c.listeners[0].cluster.connect_timeout,
            DEFAULT_CONNECT_TIMEOUT
        );
    }
}
