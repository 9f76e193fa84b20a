//! `ListenerSet`: TCP and UDP listeners on the Spur gateway pods a selector picks, each piping
//! sessions to a cluster of endpoints (pods by label selector, addresses, DNS names) with
//! consistent hashing, health checks and an optional routing key read from a session's first
//! bytes (l7mp's listener/cluster model, built on `spur-l4`; docs/l4.md).
//!
//! ```text
//! ListenerSet (user) ──operator──► Service <name> over spec.selector (the listeners' ports)
//!        │                        headless Service per selector endpoint ─► EndpointSlices
//!        ▼
//! route server: ListenerSets + EndpointSlices ─► spur_l4::L4Config per gateway pod
//!        │ (Spur's own L4 service, same authenticated watch stream as routes)
//!        ▼
//! gateway pod: spur-l4 listeners; endpoint health ─► status.gateways[] (one entry per pod)
//! ```

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::names::derived_name;
use crate::validation::{
    Checker, ROUTING_KEY_MAX, is_dns_label, is_dns1035_label, is_host, is_label_key, is_label_value,
};

/// Most listeners in one ListenerSet.
pub const MAX_LISTENERS: usize = 64;
/// Most endpoint entries in one cluster.
pub const MAX_ENDPOINTS: usize = 256;
/// Most key routes of one listener.
pub const MAX_KEY_ROUTES: usize = 256;

/// The label on the objects the operator creates for a ListenerSet, naming it.
pub const LISTENER_SET_LABEL: &str = "spur.dev/listener-set";

/// Condition types on a ListenerSet.
pub mod conditions {
    /// True when the spec is valid and its Services exist; false with the reason otherwise.
    pub const READY: &str = "Ready";
    /// True while every listener's cluster has at least one ready endpoint.
    pub const ENDPOINTS_READY: &str = "EndpointsReady";
}

/// Listeners served by the pods `selector` picks.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "ListenerSet",
    plural = "listenersets",
    shortname = "lset",
    category = "spur",
    namespaced,
    status = "ListenerSetStatus",
    derive = "PartialEq",
    doc = "TCP and UDP listeners on the Spur gateway pods spec.selector picks, each sending sessions to a cluster of endpoints (pods by label selector, addresses or DNS names) with round-robin, ring-hash or Maglev balancing, a session hash key, health checks, and an optional sandbox routing key read from a session's first bytes.",
    printcolumn(
        name = "Listeners",
        type_ = "integer",
        json_path = ".status.listenerCount"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ListenerSetSpec {
    /// The pods of this namespace that serve the listeners (Spur gateway pods: `spur gateway`).
    pub selector: LabelSelector,
    /// The Service the operator keeps over `selector` with every listener's port, so clients
    /// dial `<name>.<namespace>.svc:<port>`. Needs `selector.matchLabels` only (a Service
    /// selects by labels, not expressions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ListenerService>,
    #[schemars(length(min = 1, max = MAX_LISTENERS))]
    pub listeners: Vec<Listener>,
    /// Further clusters, for key routes to send sessions to (a sandbox's fork, say).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_LISTENERS))]
    pub clusters: Vec<Cluster>,
}

/// The client-facing Service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListenerService {
    /// `ClusterIP` (default), `NodePort` or `LoadBalancer`; `None` makes no Service.
    #[serde(default, rename = "type")]
    pub type_: ServiceType,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ServiceType {
    #[default]
    ClusterIP,
    NodePort,
    LoadBalancer,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
}

/// One port on the gateway pods.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Listener {
    /// Unique in the set; a DNS label (it names the Service port).
    pub name: String,
    pub protocol: Protocol,
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    pub cluster: Cluster,
    /// Sends a session whose first bytes carry a key to another cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_route: Option<KeyRoute>,
    /// How long a TCP session's first bytes are waited for when a key route or a `firstBytes`
    /// hash key needs them (a duration such as `500ms`; default 1s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_bytes_timeout: Option<String>,
}

/// Endpoints and how sessions are spread over them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Cluster {
    /// Unique in the set across listeners' and extra clusters (a cluster used twice is
    /// written once, in `spec.clusters`, and named by key routes).
    pub name: String,
    #[schemars(length(min = 1, max = MAX_ENDPOINTS))]
    pub endpoints: Vec<Endpoint>,
    #[serde(default)]
    pub lb: LbPolicy,
    /// What identifies a session for ringHash and maglev (default: the client's address and
    /// port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_key: Option<HashKey>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
    /// A UDP session with nothing moving either way for this long ends (default 60s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout: Option<String>,
    /// Most sessions at once on one gateway pod (default 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_sessions: Option<u32>,
    /// When the table is full: `evictOldest` (default) or `refuse`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overflow: Option<Overflow>,
    /// TCP connect timeout per attempt (default 2s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout: Option<String>,
}

/// Exactly one of `selector`, `address` and `dnsName`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    /// Pods of this namespace; each ready one is an endpoint, identified by its name (so a
    /// pod that moves to a new IP keeps its sessions' hash position).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    /// An IP address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// A DNS name, resolved by the gateway and re-resolved periodically; every address it
    /// has is an endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_name: Option<String>,
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// Where health checks go (default: `port`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub health_check_port: Option<u16>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum LbPolicy {
    #[default]
    RoundRobin,
    RingHash,
    Maglev,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Overflow {
    EvictOldest,
    Refuse,
}

/// Exactly one field.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HashKey {
    /// One key for every session (l7mp's constant hash key): all go to one endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constant: Option<String>,
    /// The client's IP address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_ip: Option<Empty>,
    /// The client's IP address and port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_ip_port: Option<Empty>,
    /// A byte range of the first datagram (or the first bytes of a TCP session): a call id, a
    /// session id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_bytes: Option<ByteRange>,
}

/// `{}`
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Empty {}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ByteRange {
    #[serde(default)]
    pub offset: u32,
    #[schemars(range(min = 1))]
    pub length: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheck {
    #[serde(default)]
    pub protocol: HealthProtocol,
    /// For `http`: the path of a GET that must answer 2xx (default `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Default 5s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<String>,
    /// Default 1s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    /// Passes in a row that bring an endpoint back (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub healthy_threshold: Option<u32>,
    /// Failures in a row that take it out (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub unhealthy_threshold: Option<u32>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum HealthProtocol {
    #[default]
    Tcp,
    Http,
}

/// Where in a session's first bytes a routing key is, and where each key sends the session.
/// A session whose bytes match no route (or are too few) goes to the listener's own cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeyRoute {
    #[serde(default)]
    pub offset: u32,
    /// The key's length: an exact byte range. Without it, keys are prefixes at `offset`,
    /// longest match first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub length: Option<u32>,
    #[schemars(length(min = 1, max = MAX_KEY_ROUTES))]
    pub routes: Vec<KeyRouteTarget>,
}

/// Exactly one of `key`, `keyHex` and `sandbox`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeyRouteTarget {
    /// The key as text (its UTF-8 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The key as hex bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_hex: Option<String>,
    /// A Sandbox (cluster-scoped) by name: its routing key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// A cluster of this set (`spec.clusters[].name`, or a listener's).
    pub cluster: String,
}

/// Observed state.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListenerSetStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listener_count: Option<u32>,
    /// Per listener, its cluster's endpoints as the cluster resolves them (written by the
    /// operator).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub listeners: Vec<ListenerStatus>,
    /// One entry per gateway pod serving the set, with what its health checks see (written by
    /// the route server from the gateways' reports).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["pod"]))]
    pub gateways: Vec<GatewayStatus>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListenerStatus {
    pub name: String,
    /// Endpoints the cluster resolves to now (pods, addresses; DNS names count once).
    pub endpoints: u32,
    /// Of those, the ready ones (pods by their readiness).
    pub ready: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayStatus {
    /// The gateway pod's name.
    pub pod: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<EndpointHealth>,
    /// Listeners of this set the pod does not serve: an older ListenerSet that also selects
    /// the pod has a listener with the same protocol and port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shadowed: Vec<String>,
    pub updated_at: Option<Time>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointHealth {
    pub cluster: String,
    /// The endpoint's identity (a pod name, an address).
    pub id: String,
    pub address: String,
    pub healthy: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ejected: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The client-facing Service of a ListenerSet: its own name, so clients dial
/// `<name>.<namespace>.svc` (validation requires a name a Service can have).
pub fn listener_service_name(listener_set: &str) -> String {
    listener_set.to_owned()
}

/// The headless Service whose EndpointSlices resolve `endpoints[index]` of cluster `cluster`
/// (a selector entry).
pub fn endpoint_service_name(listener_set: &str, cluster: &str, index: usize) -> String {
    derived_name(
        &[listener_set, cluster],
        &["listener-set-endpoints", &index.to_string()],
    )
}

// === validation ===

/// Largest first-bytes window a hash key or key route may need: `spur_l4::MAX_FIRST_BYTES`,
/// written again here because this crate depends on no data-plane crate (the operator's tests
/// pin the two equal). A TCP listener buffers this much before it connects upstream.
pub const MAX_FIRST_BYTES: u32 = 16 * 1024;
/// Longest key of a key route and longest constant hash key, in bytes (spur-l4's bound).
pub const MAX_KEY_BYTES: usize = 1024;
/// Most sessions a cluster may allow per gateway pod (spur-l4's bound).
pub const MAX_SESSIONS: u32 = 1_000_000;
/// Longest HTTP health-check path (spur-l4's bound: it goes into the request line).
pub const MAX_HEALTH_PATH: usize = 2048;
/// Longest duration any field may have: far beyond any sensible timeout, and far from where
/// adding it to a clock could overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Longest Service port name (IANA service name), which listener names become.
pub const MAX_PORT_NAME: usize = 15;
/// Most selector endpoints in one set, all clusters together: each is a headless Service the
/// operator makes, and being allowed to write a ListenerSet must not mean making thousands.
pub const MAX_ENDPOINT_SERVICES: usize = 256;

impl Protocol {
    /// `tcp` or `udp`, as written in the spec.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

impl ListenerSet {
    /// [`ListenerSetSpec::validate`] with the object's own name.
    pub fn validate(&self) -> Result<(), Error> {
        self.spec
            .validate(self.metadata.name.as_deref().unwrap_or_default())
    }
}

impl ListenerSetSpec {
    /// Every rule of the schema, plus what it cannot say: unique names and ports, cluster
    /// references, exactly-one-of fields, selectors a Service can carry, durations, and the
    /// bounds `spur-l4` enforces (so what admission lets in, the gateways accept). One pass:
    /// every problem is reported with its path. `name` is the ListenerSet's (it names the
    /// client Service).
    pub fn validate(&self, name: &str) -> Result<(), Error> {
        let mut c = Checker::default();
        self.check(&mut c, name);
        c.finish("ListenerSet")
    }

    /// `spec.service.type`, defaulted.
    pub fn service_type(&self) -> ServiceType {
        self.service.as_ref().map(|s| s.type_).unwrap_or_default()
    }

    /// Whether the operator keeps a client Service for this set.
    pub fn makes_service(&self) -> bool {
        self.service_type() != ServiceType::None
    }

    /// Every cluster with its field path: the listeners' own, in order, then `spec.clusters`.
    pub fn all_clusters(&self) -> impl Iterator<Item = (String, &Cluster)> {
        let own = self
            .listeners
            .iter()
            .enumerate()
            .map(|(i, l)| (format!("spec.listeners[{i}].cluster"), &l.cluster));
        let extra = self
            .clusters
            .iter()
            .enumerate()
            .map(|(i, c)| (format!("spec.clusters[{i}]"), c));
        own.chain(extra)
    }

    /// The protocol sessions reach cluster `name` with: that of the first listener whose own
    /// cluster it is, else of the first listener whose key routes name it; `None` when no
    /// listener uses it.
    pub fn cluster_protocol(&self, name: &str) -> Option<Protocol> {
        self.listeners
            .iter()
            .find(|l| l.cluster.name == name)
            .or_else(|| {
                self.listeners.iter().find(|l| {
                    l.key_route
                        .as_ref()
                        .is_some_and(|k| k.routes.iter().any(|r| r.cluster == name))
                })
            })
            .map(|l| l.protocol)
    }

    fn check(&self, c: &mut Checker, name: &str) {
        let service = self.makes_service();
        if service {
            c.require(
                is_dns1035_label(name),
                || "metadata.name".into(),
                "must be a DNS-1035 label (1-63 of [a-z0-9-], starting with a letter, ending with a letter or digit) while spec.service.type is not None: it names the listeners' Service",
            );
        }
        check_selector(
            c,
            "spec.selector",
            &self.selector,
            service.then_some(
                "spec.service.type is not None, so it becomes the listeners' Service's selector",
            ),
        );

        c.require(
            !self.listeners.is_empty(),
            || "spec.listeners".into(),
            "must not be empty",
        );
        c.max_items(|| "spec.listeners".into(), &self.listeners, MAX_LISTENERS);
        c.max_items(|| "spec.clusters".into(), &self.clusters, MAX_LISTENERS);

        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut ports: HashMap<(u16, &str), usize> = HashMap::new();
        for (i, l) in self.listeners.iter().enumerate() {
            let at = format!("spec.listeners[{i}]");
            c.dns_label(|| format!("{at}.name"), &l.name);
            if service && is_dns_label(&l.name) && !is_port_name(&l.name) {
                c.fail(
                    format!("{at}.name"),
                    format!("must be a valid Service port name while spec.service.type is not None (it names the listener's port): at most {MAX_PORT_NAME} characters, at least one letter, no \"--\""),
                );
            }
            match names.get(l.name.as_str()) {
                Some(j) => c.fail(
                    format!("{at}.name"),
                    format!(
                        "listener name {:?} is already used by spec.listeners[{j}]",
                        l.name
                    ),
                ),
                None => {
                    names.insert(&l.name, i);
                }
            }
            if l.port == 0 {
                c.fail(format!("{at}.port"), "must be between 1 and 65535");
            } else if let Some(j) = ports.get(&(l.port, l.protocol.as_str())) {
                c.fail(
                    format!("{at}.port"),
                    format!(
                        "{} port {} is already taken by spec.listeners[{j}] ({:?})",
                        l.protocol.as_str(),
                        l.port,
                        self.listeners[*j].name
                    ),
                );
            } else {
                ports.insert((l.port, l.protocol.as_str()), i);
            }
            if let Some(t) = &l.first_bytes_timeout {
                check_duration(c, format!("{at}.firstBytesTimeout"), t);
            }
            check_cluster(c, &format!("{at}.cluster"), &l.cluster, Some(l.protocol));
        }
        for (i, cl) in self.clusters.iter().enumerate() {
            check_cluster(c, &format!("spec.clusters[{i}]"), cl, None);
        }

        let mut clusters: HashMap<&str, String> = HashMap::new();
        for (at, cl) in self.all_clusters() {
            match clusters.get(cl.name.as_str()) {
                Some(first) => c.fail(
                    format!("{at}.name"),
                    format!(
                        "cluster name {:?} is already used by {first} (cluster names are unique in the set; a cluster two listeners share is written once, in spec.clusters, and named by key routes)",
                        cl.name
                    ),
                ),
                None => {
                    clusters.insert(&cl.name, at);
                }
            }
        }

        let selectors = self
            .all_clusters()
            .flat_map(|(_, cl)| &cl.endpoints)
            .filter(|e| e.selector.is_some())
            .count();
        if selectors > MAX_ENDPOINT_SERVICES {
            c.fail(
                "spec",
                format!("has {selectors} selector endpoints, at most {MAX_ENDPOINT_SERVICES} are allowed (each is a headless Service)"),
            );
        }

        for (i, l) in self.listeners.iter().enumerate() {
            if let Some(k) = &l.key_route {
                check_key_route(c, &format!("spec.listeners[{i}].keyRoute"), k, |n| {
                    clusters.contains_key(n)
                });
            }
        }
    }
}

/// A Service port name (IANA service name): at most 15 of `[a-z0-9-]`, at least one letter,
/// no leading, trailing or doubled `-`.
pub fn is_port_name(s: &str) -> bool {
    is_dns_label(s)
        && s.len() <= MAX_PORT_NAME
        && s.bytes().any(|b| b.is_ascii_lowercase())
        && !s.contains("--")
}

/// A label selector: valid keys and values, known operators. `service`: the selector becomes a
/// Service's (whose selector is a plain label map), so it must be non-empty `matchLabels`
/// only; the reason is said in the message.
fn check_selector(c: &mut Checker, path: &str, s: &LabelSelector, service: Option<&str>) {
    let labels = s.match_labels.as_ref();
    for (k, v) in labels.into_iter().flatten() {
        c.require(
            is_label_key(k),
            || format!("{path}.matchLabels[{k}]"),
            "the key must be a label key ([prefix/]name, name 1-63 of [A-Za-z0-9._-])",
        );
        c.require(
            is_label_value(v),
            || format!("{path}.matchLabels[{k}]"),
            "the value must be a label value (0-63 of [A-Za-z0-9._-], starting and ending with a letter or digit)",
        );
    }
    let exprs = s.match_expressions.as_deref().unwrap_or_default();
    if let Some(why) = service {
        if !exprs.is_empty() {
            c.fail(
                format!("{path}.matchExpressions"),
                format!("must be empty: {why}, and a Service selects by matchLabels only"),
            );
        }
        if labels.is_none_or(BTreeMap::is_empty) {
            c.fail(
                format!("{path}.matchLabels"),
                format!("must not be empty: {why}, and an empty one would select every pod of the namespace"),
            );
        }
        return;
    }
    for (i, e) in exprs.iter().enumerate() {
        let at = format!("{path}.matchExpressions[{i}]");
        c.require(
            is_label_key(&e.key),
            || format!("{at}.key"),
            "must be a label key ([prefix/]name, name 1-63 of [A-Za-z0-9._-])",
        );
        let values = e.values.as_deref().unwrap_or_default();
        match e.operator.as_str() {
            "In" | "NotIn" => c.require(
                !values.is_empty(),
                || format!("{at}.values"),
                "must not be empty for operator In or NotIn",
            ),
            "Exists" | "DoesNotExist" => c.require(
                values.is_empty(),
                || format!("{at}.values"),
                "must be empty for operator Exists or DoesNotExist",
            ),
            _ => c.fail(
                format!("{at}.operator"),
                "must be In, NotIn, Exists or DoesNotExist",
            ),
        }
        for (j, v) in values.iter().enumerate() {
            c.require(
                is_label_value(v),
                || format!("{at}.values[{j}]"),
                "must be a label value (0-63 of [A-Za-z0-9._-], starting and ending with a letter or digit)",
            );
        }
    }
}

/// One cluster; `protocol`: of the listener whose own cluster it is (`None`: `spec.clusters`).
fn check_cluster(c: &mut Checker, at: &str, cl: &Cluster, protocol: Option<Protocol>) {
    c.dns_label(|| format!("{at}.name"), &cl.name);
    c.require(
        !cl.endpoints.is_empty(),
        || format!("{at}.endpoints"),
        "must not be empty",
    );
    c.max_items(|| format!("{at}.endpoints"), &cl.endpoints, MAX_ENDPOINTS);
    // Two entries that resolve to the same endpoints would give it twice (spur-l4 refuses an
    // endpoint id or address used twice).
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (j, e) in cl.endpoints.iter().enumerate() {
        let ep = format!("{at}.endpoints[{j}]");
        let set = usize::from(e.selector.is_some())
            + usize::from(e.address.is_some())
            + usize::from(e.dns_name.is_some());
        if set != 1 {
            c.fail(
                ep.clone(),
                "set exactly one of selector, address and dnsName",
            );
        }
        let what = if let Some(s) = &e.selector {
            check_selector(
                c,
                &format!("{ep}.selector"),
                s,
                Some(
                    "it becomes the selector of a headless Service whose EndpointSlices list the endpoint pods",
                ),
            );
            format!("selector {:?}", s.match_labels)
        } else if let Some(a) = &e.address {
            match a.parse::<IpAddr>() {
                Ok(ip) if ip.is_unspecified() => c.fail(
                    format!("{ep}.address"),
                    "must be a specific address, not 0.0.0.0 or ::",
                ),
                Ok(_) => {}
                Err(_) => c.fail(
                    format!("{ep}.address"),
                    "must be an IPv4 or IPv6 address (a name goes in dnsName)",
                ),
            }
            // Normalized, so `::1` and `0::1` are the same address.
            format!(
                "address {}",
                a.parse::<IpAddr>()
                    .map_or_else(|_| a.clone(), |ip| ip.to_string())
            )
        } else if let Some(d) = &e.dns_name {
            let d = d.strip_suffix('.').unwrap_or(d);
            if d.parse::<IpAddr>().is_ok() {
                c.fail(
                    format!("{ep}.dnsName"),
                    "is an IP address: write it in address",
                );
            } else {
                c.require(
                    is_host(d),
                    || format!("{ep}.dnsName"),
                    "must be a DNS name (dot-separated labels of [A-Za-z0-9-], at most 253 characters)",
                );
            }
            format!("dnsName {}", d.to_ascii_lowercase())
        } else {
            String::new()
        };
        if e.port == 0 {
            c.fail(format!("{ep}.port"), "must be between 1 and 65535");
        }
        if e.health_check_port == Some(0) {
            c.fail(
                format!("{ep}.healthCheckPort"),
                "must be between 1 and 65535",
            );
        }
        if protocol == Some(Protocol::Udp)
            && cl.health_check.is_some()
            && e.health_check_port.is_none()
        {
            c.fail(
                format!("{ep}.healthCheckPort"),
                "required: the cluster serves a UDP listener and has a health check, and health checks speak TCP or HTTP",
            );
        }
        if set == 1 {
            let key = format!("{what} port {}", e.port);
            match seen.get(&key) {
                Some(k) => c.fail(
                    ep,
                    format!(
                        "gives the same endpoints as endpoints[{k}] (the same {what}, port {})",
                        e.port
                    ),
                ),
                None => {
                    seen.insert(key, j);
                }
            }
        }
    }

    if let Some(h) = &cl.hash_key {
        let set = usize::from(h.constant.is_some())
            + usize::from(h.source_ip.is_some())
            + usize::from(h.source_ip_port.is_some())
            + usize::from(h.first_bytes.is_some());
        if set != 1 {
            c.fail(
                format!("{at}.hashKey"),
                "set exactly one of constant, sourceIp, sourceIpPort and firstBytes",
            );
        }
        if cl.lb == LbPolicy::RoundRobin {
            c.fail(
                format!("{at}.hashKey"),
                "needs lb ringHash or maglev (roundRobin hashes nothing)",
            );
        }
        if let Some(k) = &h.constant
            && (k.is_empty() || k.len() > MAX_KEY_BYTES)
        {
            c.fail(
                format!("{at}.hashKey.constant"),
                format!("must be 1 to {MAX_KEY_BYTES} bytes"),
            );
        }
        if let Some(r) = &h.first_bytes {
            if r.length == 0 {
                c.fail(
                    format!("{at}.hashKey.firstBytes.length"),
                    "must be at least 1",
                );
            }
            if u64::from(r.offset) + u64::from(r.length) > u64::from(MAX_FIRST_BYTES) {
                c.fail(
                    format!("{at}.hashKey.firstBytes"),
                    format!("offset + length must be at most {MAX_FIRST_BYTES} (a TCP listener buffers that much before it connects)"),
                );
            }
        }
    }

    if let Some(h) = &cl.health_check {
        let hc = format!("{at}.healthCheck");
        match (h.protocol, &h.path) {
            (HealthProtocol::Tcp, Some(_)) => {
                c.fail(format!("{hc}.path"), "is for protocol http only");
            }
            (HealthProtocol::Http, Some(p)) => c.require(
                p.starts_with('/')
                    && p.len() <= MAX_HEALTH_PATH
                    && !p.bytes().any(|b| b <= b' ' || b == 0x7f),
                || format!("{hc}.path"),
                "must start with '/', have no spaces or control characters and be at most 2048 bytes",
            ),
            _ => {}
        }
        let interval = h
            .interval
            .as_deref()
            .map_or(Some(Duration::from_secs(5)), |s| {
                check_duration(c, format!("{hc}.interval"), s)
            });
        let timeout = h
            .timeout
            .as_deref()
            .map_or(Some(Duration::from_secs(1)), |s| {
                check_duration(c, format!("{hc}.timeout"), s)
            });
        if let (Some(i), Some(t)) = (interval, timeout)
            && t > i
        {
            c.fail(
                format!("{hc}.timeout"),
                "must be at most interval (the checks of one endpoint never overlap; defaults: interval 5s, timeout 1s)",
            );
        }
        for (field, v) in [
            ("healthyThreshold", h.healthy_threshold),
            ("unhealthyThreshold", h.unhealthy_threshold),
        ] {
            c.require(
                v != Some(0),
                || format!("{hc}.{field}"),
                "must be at least 1",
            );
        }
    }
    if let Some(t) = &cl.idle_timeout {
        check_duration(c, format!("{at}.idleTimeout"), t);
    }
    if let Some(t) = &cl.connect_timeout {
        check_duration(c, format!("{at}.connectTimeout"), t);
    }
    if let Some(m) = cl.max_sessions
        && !(1..=MAX_SESSIONS).contains(&m)
    {
        c.fail(
            format!("{at}.maxSessions"),
            format!("must be between 1 and {MAX_SESSIONS}"),
        );
    }
}

fn check_key_route(c: &mut Checker, at: &str, k: &KeyRoute, known: impl Fn(&str) -> bool) {
    c.require(
        !k.routes.is_empty(),
        || format!("{at}.routes"),
        "must not be empty",
    );
    c.max_items(|| format!("{at}.routes"), &k.routes, MAX_KEY_ROUTES);
    if k.length == Some(0) {
        c.fail(format!("{at}.length"), "must be at least 1");
    }
    // The longest key a route can need: literal keys are known, a sandbox's is a routing key.
    let mut longest = 0usize;
    let mut keys: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut sandboxes: HashMap<&str, usize> = HashMap::new();
    for (i, r) in k.routes.iter().enumerate() {
        let rt = format!("{at}.routes[{i}]");
        let set = usize::from(r.key.is_some())
            + usize::from(r.key_hex.is_some())
            + usize::from(r.sandbox.is_some());
        if set != 1 {
            c.fail(rt.clone(), "set exactly one of key, keyHex and sandbox");
        }
        let key = if let Some(s) = &r.key {
            Some((format!("{rt}.key"), s.as_bytes().to_vec()))
        } else if let Some(h) = &r.key_hex {
            match parse_hex(h) {
                Some(b) => Some((format!("{rt}.keyHex"), b)),
                None => {
                    c.fail(
                        format!("{rt}.keyHex"),
                        "must be an even number of hex digits ([0-9a-fA-F])",
                    );
                    None
                }
            }
        } else if let Some(s) = &r.sandbox {
            c.dns_label(|| format!("{rt}.sandbox"), s);
            match sandboxes.get(s.as_str()) {
                Some(j) => c.fail(
                    format!("{rt}.sandbox"),
                    format!("sandbox {s:?} is already routed by routes[{j}]"),
                ),
                None => {
                    sandboxes.insert(s, i);
                }
            }
            longest = longest.max(k.length.map_or(ROUTING_KEY_MAX, |l| l as usize));
            None
        } else {
            None
        };
        if let Some((path, key)) = key {
            if key.is_empty() || key.len() > MAX_KEY_BYTES {
                c.fail(path.clone(), format!("must be 1 to {MAX_KEY_BYTES} bytes"));
            }
            if let Some(len) = k.length
                && len != 0
                && key.len() != len as usize
            {
                c.fail(
                    path.clone(),
                    format!(
                        "is {} bytes, but length is {len} (with length, every key is exactly that long)",
                        key.len()
                    ),
                );
            }
            longest = longest.max(key.len());
            match keys.get(&key) {
                Some(j) => c.fail(path, format!("the same key as routes[{j}]")),
                None => {
                    keys.insert(key, i);
                }
            }
        }
        c.require(
            known(&r.cluster),
            || format!("{rt}.cluster"),
            "names no cluster of this set (a listener's cluster.name or spec.clusters[].name)",
        );
    }
    let needed = u64::from(k.offset) + k.length.map_or(longest as u64, u64::from);
    if needed > u64::from(MAX_FIRST_BYTES) {
        c.fail(
            at.to_owned(),
            format!("offset + key length must be at most {MAX_FIRST_BYTES} (a TCP listener buffers that much before it connects)"),
        );
    }
}

/// Checks a duration field; returns it when valid.
fn check_duration(c: &mut Checker, path: String, s: &str) -> Option<Duration> {
    match parse_duration(s) {
        Some(d) if d.is_zero() => c.fail(path, "must be greater than zero"),
        Some(d) if d > MAX_DURATION => c.fail(path, "must be at most 168h"),
        Some(d) => return Some(d),
        None => c.fail(
            path,
            format!("{s:?} is not a duration (a number with ms, s, m or h, e.g. 500ms, 5s, 2m)"),
        ),
    }
    None
}

/// The duration syntax the gateways read these fields with, `spur_runtime::parse_duration`'s
/// (`250ms`, `5s` or `5`, `2m`, `1h`); `None` when malformed.
pub fn parse_duration(s: &str) -> Option<Duration> {
    spur_runtime::parse_duration(s).ok()
}

/// Hex digits, two per byte; `None` for an odd count or a non-hex digit.
pub fn parse_hex(s: &str) -> Option<Vec<u8>> {
    // Checked first: `from_str_radix` alone would take a sign (`+1`).
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::{Value, json};

    /// A valid set: a UDP listener to pods with a health check and a key route to a sandbox
    /// cluster, and a TCP listener to an address and a DNS name.
    fn good() -> Value {
        json!({
            "selector": {"matchLabels": {"app": "spur-gateway"}},
            "listeners": [{
                "name": "rtp", "protocol": "udp", "port": 5000,
                "cluster": {
                    "name": "media", "lb": "maglev",
                    "hashKey": {"firstBytes": {"offset": 8, "length": 4}},
                    "endpoints": [{"selector": {"matchLabels": {"app": "media"}}, "port": 5000, "healthCheckPort": 8080}],
                    "healthCheck": {"protocol": "http", "path": "/ready", "interval": "2s", "timeout": "500ms"},
                    "idleTimeout": "30s", "maxSessions": 1000, "overflow": "refuse"
                },
                "keyRoute": {"offset": 0, "routes": [
                    {"key": "sbx1", "cluster": "media-sbx"},
                    {"keyHex": "00ff", "cluster": "media-sbx"},
                    {"sandbox": "alice", "cluster": "media-sbx"}
                ]}
            }, {
                "name": "pg", "protocol": "tcp", "port": 5432, "firstBytesTimeout": "1s",
                "cluster": {"name": "pg", "lb": "ringHash", "hashKey": {"sourceIp": {}},
                            "connectTimeout": "2s",
                            "endpoints": [{"address": "10.0.0.3", "port": 5432},
                                          {"dnsName": "pg.db.svc.cluster.local", "port": 5432}]}
            }, {
                "name": "rtp-tcp", "protocol": "tcp", "port": 5000,
                "cluster": {"name": "media-tcp", "endpoints": [{"address": "::1", "port": 5000}]}
            }],
            "clusters": [{"name": "media-sbx", "endpoints": [
                {"selector": {"matchLabels": {"app": "media", "spur.dev/fork": "f1"}}, "port": 5000}
            ]}]
        })
    }

    fn spec(v: Value) -> ListenerSetSpec {
        serde_json::from_value(v).unwrap()
    }

    /// The problems of `v` (as set `name`), as `path: message` lines.
    fn problems(name: &str, v: Value) -> Vec<String> {
        match spec(v).validate(name) {
            Ok(()) => Vec::new(),
            Err(e) => e.field_errors().iter().map(ToString::to_string).collect(),
        }
    }

    /// `good()` changed by `f` has exactly one problem, at `path`, whose message has `words`.
    #[track_caller]
    fn refused(f: impl FnOnce(&mut Value), path: &str, words: &str) {
        let mut v = good();
        f(&mut v);
        let got = problems("media", v);
        assert_eq!(got.len(), 1, "{got:#?}");
        assert!(
            got[0].starts_with(&format!("{path}: ")) && got[0].contains(words),
            "{got:#?}"
        );
    }

    #[test]
    fn a_good_set_passes_and_helpers_read_it() {
        assert_eq!(problems("media", good()), Vec::<String>::new());
        let s = spec(good());
        assert!(s.makes_service());
        assert_eq!(s.cluster_protocol("media"), Some(Protocol::Udp));
        assert_eq!(s.cluster_protocol("media-sbx"), Some(Protocol::Udp));
        assert_eq!(s.cluster_protocol("nope"), None);
        let paths: Vec<String> = s.all_clusters().map(|(p, _)| p).collect();
        assert_eq!(
            paths,
            [
                "spec.listeners[0].cluster",
                "spec.listeners[1].cluster",
                "spec.listeners[2].cluster",
                "spec.clusters[0]"
            ]
        );
    }

    #[test]
    fn names_ports_and_clusters_are_unique() {
        refused(
            |v| v["listeners"][1]["name"] = json!("rtp"),
            "spec.listeners[1].name",
            "already used by spec.listeners[0]",
        );
        refused(
            |v| v["listeners"][1]["name"] = json!("Pg"),
            "spec.listeners[1].name",
            "DNS-1123 label",
        );
        refused(
            |v| v["listeners"][1]["name"] = json!("a-very-long-listener"),
            "spec.listeners[1].name",
            "Service port name",
        );
        // Without a Service the port name rule does not apply.
        let mut v = good();
        v["listeners"][1]["name"] = json!("a-very-long-listener");
        v["service"] = json!({"type": "None"});
        assert_eq!(problems("media", v), Vec::<String>::new());
        // TCP and UDP may share a port number; two of one protocol may not.
        refused(
            |v| v["listeners"][2]["protocol"] = json!("udp"),
            "spec.listeners[2].port",
            "udp port 5000 is already taken by spec.listeners[0] (\"rtp\")",
        );
        refused(
            |v| v["listeners"][1]["cluster"]["name"] = json!("media-sbx"),
            "spec.clusters[0].name",
            "cluster name \"media-sbx\" is already used by spec.listeners[1].cluster",
        );
        refused(
            |v| v["listeners"][2]["cluster"]["name"] = json!("media"),
            "spec.listeners[2].cluster.name",
            "already used by spec.listeners[0].cluster",
        );
        refused(
            |v| v["listeners"] = json!([]),
            "spec.listeners",
            "must not be empty",
        );
        refused(
            |v| v["listeners"][1]["port"] = json!(0),
            "spec.listeners[1].port",
            "between 1 and 65535",
        );
    }

    #[test]
    fn key_routes() {
        refused(
            |v| v["listeners"][0]["keyRoute"]["routes"][0]["cluster"] = json!("nope"),
            "spec.listeners[0].keyRoute.routes[0].cluster",
            "names no cluster of this set",
        );
        // A listener's own cluster is a valid target.
        let mut v = good();
        v["listeners"][0]["keyRoute"]["routes"][0]["cluster"] = json!("pg");
        assert_eq!(problems("media", v), Vec::<String>::new());
        refused(
            |v| v["listeners"][0]["keyRoute"]["routes"][0]["keyHex"] = json!("00"),
            "spec.listeners[0].keyRoute.routes[0]",
            "exactly one of key, keyHex and sandbox",
        );
        refused(
            |v| v["listeners"][0]["keyRoute"]["routes"][0] = json!({"cluster": "media"}),
            "spec.listeners[0].keyRoute.routes[0]",
            "exactly one of key, keyHex and sandbox",
        );
        for bad in ["0", "zz", "+1", "0g"] {
            refused(
                |v| v["listeners"][0]["keyRoute"]["routes"][1]["keyHex"] = json!(bad),
                "spec.listeners[0].keyRoute.routes[1].keyHex",
                "hex digits",
            );
        }
        refused(
            |v| v["listeners"][0]["keyRoute"]["routes"][2]["sandbox"] = json!("Alice_1"),
            "spec.listeners[0].keyRoute.routes[2].sandbox",
            "DNS-1123 label",
        );
        refused(
            |v| {
                v["listeners"][0]["keyRoute"]["routes"][1] =
                    json!({"keyHex": "73627831", "cluster": "media"})
            },
            "spec.listeners[0].keyRoute.routes[1].keyHex",
            "the same key as routes[0]",
        );
        refused(
            |v| {
                v["listeners"][0]["keyRoute"]["routes"][1] =
                    json!({"sandbox": "alice", "cluster": "media"})
            },
            "spec.listeners[0].keyRoute.routes[2].sandbox",
            "already routed by routes[1]",
        );
        refused(
            |v| v["listeners"][0]["keyRoute"]["routes"][0]["key"] = json!(""),
            "spec.listeners[0].keyRoute.routes[0].key",
            "1 to 1024 bytes",
        );
        refused(
            |v| v["listeners"][0]["keyRoute"]["length"] = json!(4),
            "spec.listeners[0].keyRoute.routes[1].keyHex",
            "is 2 bytes, but length is 4",
        );
        refused(
            |v| v["listeners"][0]["keyRoute"]["offset"] = json!(MAX_FIRST_BYTES - 3),
            "spec.listeners[0].keyRoute",
            "offset + key length must be at most 16384",
        );
        refused(
            |v| v["listeners"][0]["keyRoute"]["routes"] = json!([]),
            "spec.listeners[0].keyRoute.routes",
            "must not be empty",
        );
    }

    #[test]
    fn endpoints() {
        refused(
            |v| v["listeners"][1]["cluster"]["endpoints"][0]["dnsName"] = json!("pg"),
            "spec.listeners[1].cluster.endpoints[0]",
            "exactly one of selector, address and dnsName",
        );
        refused(
            |v| v["listeners"][1]["cluster"]["endpoints"][0] = json!({"port": 1}),
            "spec.listeners[1].cluster.endpoints[0]",
            "exactly one of selector, address and dnsName",
        );
        refused(
            |v| v["listeners"][1]["cluster"]["endpoints"][0]["address"] = json!("10.0.0.300"),
            "spec.listeners[1].cluster.endpoints[0].address",
            "IPv4 or IPv6 address",
        );
        refused(
            |v| v["listeners"][1]["cluster"]["endpoints"][0]["address"] = json!("0.0.0.0"),
            "spec.listeners[1].cluster.endpoints[0].address",
            "specific address",
        );
        refused(
            |v| v["listeners"][1]["cluster"]["endpoints"][1]["dnsName"] = json!("pg..db"),
            "spec.listeners[1].cluster.endpoints[1].dnsName",
            "DNS name",
        );
        refused(
            |v| v["listeners"][1]["cluster"]["endpoints"][1]["dnsName"] = json!("10.0.0.4"),
            "spec.listeners[1].cluster.endpoints[1].dnsName",
            "write it in address",
        );
        refused(
            |v| {
                v["listeners"][1]["cluster"]["endpoints"][1] =
                    json!({"address": "10.0.0.3", "port": 5432})
            },
            "spec.listeners[1].cluster.endpoints[1]",
            "the same endpoints as endpoints[0]",
        );
        refused(
            |v| v["listeners"][1]["cluster"]["endpoints"][0]["port"] = json!(0),
            "spec.listeners[1].cluster.endpoints[0].port",
            "between 1 and 65535",
        );
        refused(
            |v| v["listeners"][1]["cluster"]["endpoints"] = json!([]),
            "spec.listeners[1].cluster.endpoints",
            "must not be empty",
        );
        // A UDP listener's health-checked endpoints need a TCP port to be checked on.
        refused(
            |v| {
                v["listeners"][0]["cluster"]["endpoints"][0]
                    .as_object_mut()
                    .unwrap()
                    .remove("healthCheckPort");
            },
            "spec.listeners[0].cluster.endpoints[0].healthCheckPort",
            "health checks speak TCP or HTTP",
        );
    }

    #[test]
    fn selectors() {
        // Endpoint selectors become headless Services' selectors.
        refused(
            |v| {
                v["clusters"][0]["endpoints"][0]["selector"] = json!({
                    "matchLabels": {"app": "media"},
                    "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]})
            },
            "spec.clusters[0].endpoints[0].selector.matchExpressions",
            "headless Service",
        );
        let mut v = good();
        v["clusters"][0]["endpoints"][0]["selector"] = json!({});
        let got = problems("media", v);
        assert_eq!(got.len(), 1, "{got:#?}");
        assert!(
            got[0].starts_with(
                "spec.clusters[0].endpoints[0].selector.matchLabels: must not be empty"
            ),
            "{got:#?}"
        );
        refused(
            |v| {
                v["clusters"][0]["endpoints"][0]["selector"]["matchLabels"] =
                    json!({"bad key": "x"})
            },
            "spec.clusters[0].endpoints[0].selector.matchLabels[bad key]",
            "label key",
        );
        refused(
            |v| v["selector"]["matchLabels"]["app"] = json!("-x"),
            "spec.selector.matchLabels[app]",
            "label value",
        );
        // The set's selector: expressions only without a Service, and valid ones.
        refused(
            |v| v["selector"]["matchExpressions"] = json!([{"key": "app", "operator": "Exists"}]),
            "spec.selector.matchExpressions",
            "listeners' Service's selector",
        );
        let mut v = good();
        v["service"] = json!({"type": "None"});
        v["selector"] = json!({"matchExpressions": [{"key": "app", "operator": "Exists"}]});
        assert_eq!(problems("media", v.clone()), Vec::<String>::new());
        v["selector"] = json!({"matchExpressions": [
            {"key": "app", "operator": "In"},
            {"key": "app", "operator": "Exists", "values": ["x"]},
            {"key": "app", "operator": "Near", "values": ["x"]},
        ]});
        let got = problems("media", v);
        assert_eq!(
            got.iter()
                .map(|p| p.split(':').next().unwrap())
                .collect::<Vec<_>>(),
            [
                "spec.selector.matchExpressions[0].values",
                "spec.selector.matchExpressions[1].values",
                "spec.selector.matchExpressions[2].operator"
            ],
            "{got:#?}"
        );
        // With a Service, the set's name is a Service's.
        let got = problems("1media", good());
        assert_eq!(got.len(), 1, "{got:#?}");
        assert!(
            got[0].starts_with("metadata.name: must be a DNS-1035 label"),
            "{got:#?}"
        );
        let mut v = good();
        v["service"] = json!({"type": "None"});
        assert_eq!(problems("1media", v), Vec::<String>::new());
    }

    #[test]
    fn hash_keys_health_checks_durations_and_bounds() {
        refused(
            |v| v["listeners"][1]["cluster"]["hashKey"] = json!({"sourceIp": {}, "constant": "k"}),
            "spec.listeners[1].cluster.hashKey",
            "exactly one of constant, sourceIp, sourceIpPort and firstBytes",
        );
        refused(
            |v| v["listeners"][1]["cluster"]["hashKey"] = json!({}),
            "spec.listeners[1].cluster.hashKey",
            "exactly one of",
        );
        refused(
            |v| v["listeners"][1]["cluster"]["lb"] = json!("roundRobin"),
            "spec.listeners[1].cluster.hashKey",
            "needs lb ringHash or maglev",
        );
        refused(
            |v| {
                v["listeners"][0]["cluster"]["hashKey"]["firstBytes"]["offset"] =
                    json!(MAX_FIRST_BYTES)
            },
            "spec.listeners[0].cluster.hashKey.firstBytes",
            "offset + length must be at most 16384",
        );
        refused(
            |v| v["listeners"][0]["cluster"]["hashKey"]["firstBytes"]["length"] = json!(0),
            "spec.listeners[0].cluster.hashKey.firstBytes.length",
            "at least 1",
        );
        refused(
            |v| v["listeners"][0]["cluster"]["healthCheck"]["path"] = json!("ready"),
            "spec.listeners[0].cluster.healthCheck.path",
            "must start with '/'",
        );
        refused(
            |v| v["listeners"][0]["cluster"]["healthCheck"]["protocol"] = json!("tcp"),
            "spec.listeners[0].cluster.healthCheck.path",
            "http only",
        );
        refused(
            |v| v["listeners"][0]["cluster"]["healthCheck"]["timeout"] = json!("3s"),
            "spec.listeners[0].cluster.healthCheck.timeout",
            "at most interval",
        );
        refused(
            |v| v["listeners"][0]["cluster"]["healthCheck"]["healthyThreshold"] = json!(0),
            "spec.listeners[0].cluster.healthCheck.healthyThreshold",
            "at least 1",
        );
        for (bad, words) in [
            ("5 s", "not a duration"),
            ("1d", "not a duration"),
            ("-1s", "not a duration"),
            ("", "not a duration"),
            ("0ms", "greater than zero"),
            ("169h", "at most 168h"),
        ] {
            refused(
                |v| v["listeners"][0]["cluster"]["idleTimeout"] = json!(bad),
                "spec.listeners[0].cluster.idleTimeout",
                words,
            );
        }
        refused(
            |v| v["listeners"][1]["cluster"]["connectTimeout"] = json!("0"),
            "spec.listeners[1].cluster.connectTimeout",
            "greater than zero",
        );
        refused(
            |v| v["listeners"][1]["firstBytesTimeout"] = json!("soon"),
            "spec.listeners[1].firstBytesTimeout",
            "not a duration",
        );
        refused(
            |v| v["listeners"][0]["cluster"]["maxSessions"] = json!(MAX_SESSIONS + 1),
            "spec.listeners[0].cluster.maxSessions",
            "between 1 and 1000000",
        );
    }

    #[test]
    fn the_rest_of_the_bounds() {
        refused(
            |v| v["listeners"][0]["cluster"]["endpoints"][0]["healthCheckPort"] = json!(0),
            "spec.listeners[0].cluster.endpoints[0].healthCheckPort",
            "between 1 and 65535",
        );
        // The key routes name the cluster by its old name, now gone: each says so too.
        let mut v = good();
        v["clusters"][0]["name"] = json!("Media_Sbx");
        let got = problems("media", v);
        assert_eq!(got.len(), 4, "{got:#?}");
        assert!(
            got[0].starts_with("spec.clusters[0].name: must be a DNS-1123 label"),
            "{got:#?}"
        );
        refused(
            |v| v["listeners"][1]["cluster"]["hashKey"] = json!({"constant": ""}),
            "spec.listeners[1].cluster.hashKey.constant",
            "1 to 1024 bytes",
        );
        refused(
            |v| v["listeners"][0]["keyRoute"]["length"] = json!(0),
            "spec.listeners[0].keyRoute.length",
            "at least 1",
        );
        refused(
            |v| {
                let ep = json!({"selector": {"matchLabels": {"app": "x"}}, "port": 1});
                let eps: Vec<Value> = (1..=MAX_ENDPOINT_SERVICES)
                    .map(|p| {
                        let mut e = ep.clone();
                        e["port"] = json!(p);
                        e
                    })
                    .collect();
                v["clusters"][0]["endpoints"] = json!(eps);
            },
            "spec",
            "257 selector endpoints, at most 256",
        );
        refused(
            |v| {
                v["service"] = json!({"type": "None"});
                v["selector"] =
                    json!({"matchExpressions": [{"key": "-bad", "operator": "Exists"}]});
            },
            "spec.selector.matchExpressions[0].key",
            "label key",
        );
    }

    #[test]
    fn every_problem_in_one_pass() {
        let mut v = good();
        v["listeners"][1]["name"] = json!("rtp");
        v["listeners"][1]["cluster"]["endpoints"][0]["address"] = json!("nowhere");
        v["listeners"][2]["cluster"]["name"] = json!("pg");
        let err = spec(v).validate("media").unwrap_err();
        assert_eq!(err.field_errors().len(), 3, "{err}");
        assert!(
            err.to_string().starts_with("invalid ListenerSet: "),
            "{err}"
        );
    }

    #[test]
    fn durations_and_hex() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("5"), Some(Duration::from_secs(5)));
        assert_eq!(parse_duration(" 2m "), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1.5s"), None);
        assert_eq!(parse_hex("00fFa1"), Some(vec![0, 0xff, 0xa1]));
        assert_eq!(parse_hex(""), Some(vec![]));
        assert_eq!(parse_hex("+1"), None);
        assert!(is_port_name("rtp-2") && !is_port_name("12") && !is_port_name("a--b"));
    }
}
