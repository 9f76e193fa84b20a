//! The listener-set configuration: plain serde structs (camelCase, what a custom resource's spec
//! will carry), validated once into [`ValidConfig`], the only form the runtime takes.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Largest first-bytes window (hash key or key route) a listener may ask for. A TCP listener
/// buffers this much before it connects upstream, so it stays small.
pub const MAX_FIRST_BYTES: u32 = 16 * 1024;
/// Largest Maglev table: the build costs O(table size) time and 4 bytes per entry.
const MAX_MAGLEV_TABLE: u32 = 5_000_011;
/// Largest ring (endpoints × virtual nodes): 16 bytes a point.
const MAX_RING_POINTS: u64 = 8 * 1024 * 1024;
const MAX_NAME: usize = 253;
const MAX_KEY: usize = 1024;

/// A set of L4 listeners, each in front of one cluster of endpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct L4Config {
    #[serde(default)]
    pub listeners: Vec<ListenerConfig>,
    /// Clusters that no listener serves by default, only reached through a listener's
    /// `keyRoute` (sandbox clusters). Listeners' own clusters can be key-route targets too.
    #[serde(default)]
    pub clusters: Vec<ClusterConfig>,
    /// How long sessions and streams may run on after a listener stops (shutdown or removal)
    /// before they are closed.
    #[serde(default = "default_drain_grace", with = "dur")]
    pub drain_grace: Duration,
}

/// TCP or UDP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Protocol {
    Tcp,
    Udp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ListenerConfig {
    /// Unique in the set; labels the listener's metrics.
    pub name: String,
    pub protocol: Protocol,
    /// Where to listen: a port number (all IPv4 addresses) or `"ip:port"`. Port 0 takes a free
    /// port ([`crate::ListenerSet::local_addr`] tells which).
    #[serde(with = "bind")]
    pub port: SocketAddr,
    /// Set `SO_REUSEPORT`, so several processes can share the port.
    #[serde(default)]
    pub reuse_port: bool,
    /// The endpoints this listener forwards to.
    pub cluster: ClusterConfig,
    /// Sends sessions whose first bytes carry a key to another cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_route: Option<KeyRouteConfig>,
    /// TCP only: how long to wait for the client's first bytes when the hash key or the key
    /// route needs them. A client that sends less by then is routed on what it sent.
    #[serde(default = "default_first_bytes_timeout", with = "dur")]
    pub first_bytes_timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClusterConfig {
    /// Unique in the set (across listeners' clusters and `clusters`).
    pub name: String,
    pub endpoints: Vec<EndpointConfig>,
    #[serde(default)]
    pub lb: LbPolicy,
    /// What a session is hashed on; only with `ringHash` or `maglev` (default `sourceIp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_key: Option<HashKey>,
    /// `ringHash`: points on the ring per endpoint. Fixed per endpoint (not a total ring size),
    /// so adding or removing an endpoint moves only the keys of that endpoint.
    #[serde(default = "default_ring_virtual_nodes")]
    pub ring_virtual_nodes: u32,
    /// `maglev`: lookup table size; a prime larger than the number of endpoints (Maglev's
    /// imbalance is about endpoints / size).
    #[serde(default = "default_maglev_table_size")]
    pub maglev_table_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheckConfig>,
    /// A UDP session, or a TCP stream, with nothing moving for this long is closed. Defaults:
    /// 60 s for UDP, 1 h for TCP. For a listener's own cluster this is the listener's timeout;
    /// it is not read when the cluster is only a key-route target.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "opt_dur")]
    pub idle_timeout: Option<Duration>,
    /// Most concurrent sessions (UDP clients, TCP streams) of the listener this cluster
    /// serves, key-routed ones included.
    #[serde(default = "default_max_sessions")]
    pub max_sessions: u32,
    /// UDP: what a new client gets when the session table is full.
    #[serde(default)]
    pub overflow: Overflow,
    /// TCP: upstream connect timeout.
    #[serde(default = "default_connect_timeout", with = "dur")]
    pub connect_timeout: Duration,
    /// TCP: endpoints tried for one connection (the next one on a connect failure).
    #[serde(default = "default_connect_attempts")]
    pub connect_attempts: u32,
    #[serde(default)]
    pub outlier_detection: OutlierConfig,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EndpointConfig {
    /// Stable identity (a pod name): consistent hashing is keyed by it, not by the address, so
    /// an endpoint that comes back with a new IP keeps its keys.
    pub id: String,
    pub address: SocketAddr,
    /// Port the health check probes on the endpoint's IP (default: the endpoint's port). UDP
    /// endpoints need one: health checks speak TCP or HTTP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check_port: Option<u16>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LbPolicy {
    #[default]
    RoundRobin,
    /// Ketama-style consistent hashing over virtual nodes.
    RingHash,
    /// Maglev consistent hashing (lookup table).
    Maglev,
}

/// What a session's hash is computed from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub enum HashKey {
    /// The same for every session: all land on one endpoint (while it is available).
    Constant(String),
    SourceIp,
    SourceIpPort,
    /// Bytes `[offset, offset + length)` of the first datagram (UDP) or of the first bytes
    /// of the stream (TCP). Shorter input hashes what it has of the range.
    #[serde(rename_all = "camelCase")]
    FirstBytes {
        offset: u32,
        length: u32,
    },
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Overflow {
    /// Evict the least recently active session (counted in `sessions_evicted`).
    #[default]
    EvictOldest,
    /// Drop the new client's datagrams (counted in `sessions_refused{reason="full"}`).
    Refuse,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HealthCheckConfig {
    #[serde(default)]
    pub protocol: HealthProtocol,
    /// HTTP only: the path of the `GET` (answer 2xx for healthy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default = "default_hc_interval", with = "dur")]
    pub interval: Duration,
    /// At most `interval`.
    #[serde(default = "default_hc_timeout", with = "dur")]
    pub timeout: Duration,
    /// Consecutive passes that bring an unhealthy endpoint back.
    #[serde(default = "one")]
    pub healthy_threshold: u32,
    /// Consecutive failures that take an endpoint out of rotation. With 2 or less, an endpoint
    /// that starts refusing is out within two intervals.
    #[serde(default = "two")]
    pub unhealthy_threshold: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum HealthProtocol {
    /// A TCP connect that succeeds.
    #[default]
    Tcp,
    /// An HTTP/1.1 `GET` answered with a 2xx status.
    Http,
}

/// Passive outlier ejection (TCP connects): an endpoint whose connects fail
/// `consecutiveFailures` times in a row is skipped for `baseEjection`, doubling on each
/// ejection without a successful connect in between, up to `maxEjection`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct OutlierConfig {
    /// 0 turns ejection off.
    #[serde(default = "default_consecutive_failures")]
    pub consecutive_failures: u32,
    #[serde(default = "default_base_ejection", with = "dur")]
    pub base_ejection: Duration,
    #[serde(default = "default_max_ejection", with = "dur")]
    pub max_ejection: Duration,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            consecutive_failures: default_consecutive_failures(),
            base_ejection: default_base_ejection(),
            max_ejection: default_max_ejection(),
        }
    }
}

/// Routing by a key in the first bytes (see the crate docs): the bytes at `offset` are compared
/// with each route's key, and a match sends the session to that route's cluster instead of the
/// listener's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KeyRouteConfig {
    #[serde(default)]
    pub offset: u32,
    /// Set: the key is exactly the `length` bytes at `offset` (a byte range; every route's key
    /// has this length; one hash lookup). Unset: each route's key is matched as a prefix at
    /// `offset`, and the longest matching key wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u32>,
    pub routes: Vec<KeyRoute>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KeyRoute {
    /// The key as text (its UTF-8 bytes); exactly one of `key` and `keyHex`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The key as hex, for binary protocols.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_hex: Option<String>,
    pub cluster: String,
}

fn default_drain_grace() -> Duration {
    Duration::from_secs(20)
}
fn default_first_bytes_timeout() -> Duration {
    Duration::from_secs(1)
}
fn default_ring_virtual_nodes() -> u32 {
    1024
}
fn default_maglev_table_size() -> u32 {
    65_537
}
fn default_max_sessions() -> u32 {
    10_000
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_connect_attempts() -> u32 {
    3
}
fn default_hc_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_hc_timeout() -> Duration {
    Duration::from_secs(1)
}
fn one() -> u32 {
    1
}
fn two() -> u32 {
    2
}
fn default_consecutive_failures() -> u32 {
    5
}
fn default_base_ejection() -> Duration {
    Duration::from_secs(30)
}
fn default_max_ejection() -> Duration {
    Duration::from_secs(300)
}

impl ClusterConfig {
    /// A cluster with these endpoints and every other field at its default.
    pub fn new(name: impl Into<String>, endpoints: Vec<EndpointConfig>) -> Self {
        ClusterConfig {
            name: name.into(),
            endpoints,
            lb: LbPolicy::default(),
            hash_key: None,
            ring_virtual_nodes: default_ring_virtual_nodes(),
            maglev_table_size: default_maglev_table_size(),
            health_check: None,
            idle_timeout: None,
            max_sessions: default_max_sessions(),
            overflow: Overflow::default(),
            connect_timeout: default_connect_timeout(),
            connect_attempts: default_connect_attempts(),
            outlier_detection: OutlierConfig::default(),
        }
    }
}

impl ListenerConfig {
    /// A listener with every optional field at its default.
    pub fn new(
        name: impl Into<String>,
        protocol: Protocol,
        port: SocketAddr,
        cluster: ClusterConfig,
    ) -> Self {
        ListenerConfig {
            name: name.into(),
            protocol,
            port,
            reuse_port: false,
            cluster,
            key_route: None,
            first_bytes_timeout: default_first_bytes_timeout(),
        }
    }
}

impl Default for L4Config {
    fn default() -> Self {
        L4Config {
            listeners: Vec::new(),
            clusters: Vec::new(),
            drain_grace: default_drain_grace(),
        }
    }
}

impl HealthCheckConfig {
    /// A check of this protocol with every other field at its default.
    pub fn new(protocol: HealthProtocol) -> Self {
        HealthCheckConfig {
            protocol,
            path: None,
            interval: default_hc_interval(),
            timeout: default_hc_timeout(),
            healthy_threshold: 1,
            unhealthy_threshold: 2,
        }
    }
}

mod valid;

pub use valid::*;

mod dur {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{}ms", d.as_millis()))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        spur_runtime::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}

mod opt_dur {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&format!("{}ms", d.as_millis())),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        let s = Option::<String>::deserialize(d)?;
        s.map(|s| spur_runtime::parse_duration(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// `port`: a number (all IPv4 addresses) or `"ip:port"`.
mod bind {
    use std::fmt;
    use std::net::SocketAddr;

    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    use super::{IpAddr, Ipv4Addr};

    pub(super) fn serialize<S: Serializer>(a: &SocketAddr, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(a)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = SocketAddr;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a port number or \"ip:port\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<SocketAddr, E> {
                let port =
                    u16::try_from(v).map_err(|_| E::custom(format!("port {v} is out of range")))?;
                Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<SocketAddr, E> {
                let v =
                    u64::try_from(v).map_err(|_| E::custom(format!("port {v} is out of range")))?;
                self.visit_u64(v)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SocketAddr, E> {
                if let Ok(port) = v.parse::<u16>() {
                    return self.visit_u64(u64::from(port));
                }
                v.parse()
                    .map_err(|_| E::custom(format!("{v:?} is neither a port nor ip:port")))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ep(id: &str, port: u16) -> EndpointConfig {
        EndpointConfig {
            id: id.into(),
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            health_check_port: None,
        }
    }

    fn listener(name: &str, protocol: Protocol, port: u16, cluster: &str) -> ListenerConfig {
        ListenerConfig::new(
            name,
            protocol,
            SocketAddr::from(([0, 0, 0, 0], port)),
            ClusterConfig::new(cluster, vec![ep("a", 9000)]),
        )
    }

    fn err(c: L4Config) -> String {
        c.validate().unwrap_err().to_string()
    }

    #[test]
    fn parses_the_documented_shape() {
        let json = r#"{
          "drainGrace": "5s",
          "listeners": [{
            "name": "dns", "protocol": "udp", "port": 5353,
            "cluster": {
              "name": "dns", "lb": "maglev",
              "hashKey": {"firstBytes": {"offset": 0, "length": 2}},
              "endpoints": [
                {"id": "dns-0", "address": "10.0.0.1:53", "healthCheckPort": 8080},
                {"id": "dns-1", "address": "10.0.0.2:53", "healthCheckPort": 8080}
              ],
              "healthCheck": {"protocol": "http", "path": "/ready", "interval": "2s", "timeout": "500ms"},
              "idleTimeout": "30s", "maxSessions": 100, "overflow": "refuse"
            },
            "keyRoute": {"offset": 2, "length": 4, "routes": [{"key": "sbx1", "cluster": "dns-sbx"}]}
          }, {
            "name": "pg", "protocol": "tcp", "port": "127.0.0.1:5432",
            "cluster": {"name": "pg", "lb": "ringHash", "hashKey": "sourceIp",
                        "endpoints": [{"id": "pg-0", "address": "10.0.0.3:5432"}]}
          }],
          "clusters": [{"name": "dns-sbx", "endpoints": [{"id": "x", "address": "10.0.1.1:53"}],
                        "lb": "ringHash", "hashKey": {"constant": "k"}}]
        }"#;
        let c: L4Config = serde_json::from_str(json).unwrap();
        assert_eq!(c.drain_grace, Duration::from_secs(5));
        assert_eq!(c.listeners[0].port, "0.0.0.0:5353".parse().unwrap());
        assert_eq!(c.listeners[1].port, "127.0.0.1:5432".parse().unwrap());
        let v = c.clone().validate().unwrap();
        assert_eq!(v.listeners.len(), 2);
        assert_eq!(v.listeners[0].max_sessions, 100);
        assert_eq!(v.listeners[0].idle_timeout, Duration::from_secs(30));
        assert_eq!(v.listeners[1].idle_timeout, Duration::from_secs(3600));
        let dns = &v.clusters["dns"];
        assert_eq!(dns.lb, LbPlan::Maglev { table_size: 65_537 });
        assert_eq!(
            dns.endpoints[0].health_addr,
            "10.0.0.1:8080".parse().unwrap()
        );
        assert_eq!(dns.health.as_ref().unwrap().path, "/ready");
        assert_eq!(v.listeners[0].key_route.as_ref().unwrap().needed(), 6);
        // What we print reads back to the same config.
        let back: L4Config = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn refuses_duplicates_empties_and_zeros() {
        let mut c = L4Config {
            listeners: vec![
                listener("a", Protocol::Udp, 53, "c1"),
                listener("a", Protocol::Tcp, 54, "c2"),
            ],
            ..Default::default()
        };
        assert!(err(c.clone()).contains("listener name \"a\" is used twice"));
        c.listeners[1].name = "b".into();
        c.listeners[1].port = "127.0.0.1:53".parse().unwrap();
        c.listeners[1].protocol = Protocol::Udp;
        assert!(err(c.clone()).contains("udp port 53 is already taken by listener \"a\""));
        // TCP and UDP may share a port number.
        c.listeners[1].protocol = Protocol::Tcp;
        assert!(c.clone().validate().is_ok());
        c.listeners[1].cluster.name = "c1".into();
        assert!(err(c.clone()).contains("cluster name \"c1\" is used twice"));
        c.listeners[1].cluster.name = "c2".into();

        let mut bad = c.clone();
        bad.listeners[0].cluster.endpoints.clear();
        assert!(err(bad).contains("endpoints must not be empty"));
        let mut bad = c.clone();
        bad.listeners[0].cluster.idle_timeout = Some(Duration::ZERO);
        assert!(err(bad).contains("idleTimeout must be greater than zero"));
        let mut bad = c.clone();
        bad.listeners[0].cluster.connect_timeout = Duration::ZERO;
        assert!(err(bad).contains("connectTimeout"));
        let mut bad = c.clone();
        bad.listeners[0].cluster.max_sessions = 0;
        assert!(err(bad).contains("maxSessions"));
        let mut bad = c.clone();
        bad.listeners[0].cluster.endpoints.push(ep("a", 9001));
        assert!(err(bad).contains("endpoint id \"a\" is used twice"));
        let mut bad = c.clone();
        bad.listeners[0].cluster.endpoints.push(ep("b", 9000));
        assert!(err(bad).contains("is used by another endpoint"));
        let mut bad = c.clone();
        bad.listeners[0].cluster.endpoints[0].address = "0.0.0.0:9000".parse().unwrap();
        assert!(err(bad).contains("specific IP"));
        let mut bad = c.clone();
        bad.listeners[0].cluster.hash_key = Some(HashKey::SourceIp);
        assert!(err(bad).contains("hashKey needs lb ringHash or maglev"));
        let mut bad = c.clone();
        bad.listeners[0].cluster.lb = LbPolicy::Maglev;
        bad.listeners[0].cluster.maglev_table_size = 65_536;
        assert!(err(bad).contains("must be a prime"));
        let mut bad = c.clone();
        bad.listeners[0].cluster.lb = LbPolicy::RingHash;
        bad.listeners[0].cluster.hash_key = Some(HashKey::FirstBytes {
            offset: 0,
            length: 0,
        });
        assert!(err(bad).contains("firstBytes"));
        let mut bad = c.clone();
        bad.listeners[0].cluster.health_check = Some(HealthCheckConfig::new(HealthProtocol::Tcp));
        assert!(err(bad).contains("need healthCheckPort"));
        let mut bad = c.clone();
        let mut hc = HealthCheckConfig::new(HealthProtocol::Http);
        hc.path = Some("/x HTTP/1.1\r\nX: y".into());
        bad.listeners[1].cluster.health_check = Some(hc.clone());
        assert!(err(bad.clone()).contains("must start with '/'"));
        hc.path = Some("/ok".into());
        hc.timeout = Duration::from_secs(10);
        bad.listeners[1].cluster.health_check = Some(hc.clone());
        assert!(err(bad.clone()).contains("timeout must be at most interval"));
        hc.timeout = Duration::from_millis(100);
        hc.unhealthy_threshold = 0;
        bad.listeners[1].cluster.health_check = Some(hc);
        assert!(err(bad).contains("unhealthyThreshold"));
        let mut bad = c.clone();
        bad.listeners[0].first_bytes_timeout = Duration::ZERO;
        assert!(err(bad).contains("firstBytesTimeout"));
        let mut bad = c;
        bad.listeners[0].cluster.outlier_detection.max_ejection = Duration::from_secs(1);
        assert!(err(bad).contains("outlierDetection"));
    }

    #[test]
    fn key_routes() {
        let mut c = L4Config {
            listeners: vec![listener("a", Protocol::Udp, 53, "base")],
            clusters: vec![ClusterConfig::new("sbx", vec![ep("s", 9100)])],
            ..Default::default()
        };
        let route = |key: Option<&str>, hex: Option<&str>, cluster: &str| KeyRoute {
            key: key.map(Into::into),
            key_hex: hex.map(Into::into),
            cluster: cluster.into(),
        };
        c.listeners[0].key_route = Some(KeyRouteConfig {
            offset: 1,
            length: None,
            routes: vec![
                route(Some("ab"), None, "sbx"),
                route(None, Some("616263"), "base"),
            ],
        });
        let v = c.clone().validate().unwrap();
        let k = v.listeners[0].key_route.as_ref().unwrap();
        assert_eq!(k.routes[0].0, b"abc", "longest key first");
        assert_eq!(k.needed(), 4);

        let mut bad = c.clone();
        bad.listeners[0].key_route.as_mut().unwrap().length = Some(2);
        assert!(err(bad).contains("the key is 3 bytes but length is 2"));
        let mut bad = c.clone();
        bad.listeners[0].key_route.as_mut().unwrap().routes[0].cluster = "nope".into();
        assert!(err(bad).contains("unknown cluster \"nope\""));
        let mut bad = c.clone();
        bad.listeners[0].key_route.as_mut().unwrap().routes[1].key_hex = Some("6".into());
        assert!(err(bad).contains("hex digits"));
        // A sign is not a hex digit (`from_str_radix` alone would read "+1" as 1).
        let mut bad = c.clone();
        bad.listeners[0].key_route.as_mut().unwrap().routes[1].key_hex = Some("61+1".into());
        assert!(err(bad).contains("hex digits"));
        let mut bad = c.clone();
        bad.listeners[0].key_route.as_mut().unwrap().routes[1] = route(Some("ab"), None, "sbx");
        assert!(err(bad).contains("used twice"));
        let mut bad = c;
        bad.listeners[0].key_route.as_mut().unwrap().routes[1] =
            route(Some("x"), Some("78"), "sbx");
        assert!(err(bad).contains("exactly one of key and keyHex"));
    }

    #[test]
    fn ports_and_primes() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(ports_overlap(a("0.0.0.0:53"), a("127.0.0.1:53")));
        assert!(ports_overlap(a("127.0.0.1:53"), a("127.0.0.1:53")));
        assert!(!ports_overlap(a("127.0.0.1:53"), a("127.0.0.2:53")));
        assert!(!ports_overlap(a("127.0.0.1:0"), a("127.0.0.1:0")));
        let json =
            r#"{"name":"x","protocol":"tcp","port":70000,"cluster":{"name":"c","endpoints":[]}}"#;
        assert!(serde_json::from_str::<ListenerConfig>(json).is_err());
        let primes: Vec<u32> = (0..30).filter(|n| is_prime(*n)).collect();
        assert_eq!(primes, [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]);
        assert!(is_prime(65_537) && is_prime(MAX_MAGLEV_TABLE));
    }
}
