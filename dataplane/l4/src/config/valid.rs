//! The validated form of a listener-set configuration ([`ValidConfig`]) and the one pass that
//! builds it: names, ports, clusters, balancing, health checks and key routes, with every bound.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use super::*;
use crate::Error;

/// A configuration that passed validation: what [`crate::ListenerSet`] runs. Built once with
/// `ValidConfig::try_from(config)` (or [`L4Config::validate`]); the controller can do this to
/// report a refused spec in status without starting anything.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidConfig {
    pub(crate) listeners: Vec<ListenerPlan>,
    pub(crate) clusters: BTreeMap<String, ClusterPlan>,
    pub(crate) drain_grace: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ListenerPlan {
    pub(crate) name: String,
    pub(crate) protocol: Protocol,
    pub(crate) bind: SocketAddr,
    pub(crate) reuse_port: bool,
    pub(crate) cluster: String,
    pub(crate) key_route: Option<KeyRoutePlan>,
    pub(crate) first_bytes_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) max_sessions: usize,
    pub(crate) overflow: Overflow,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct KeyRoutePlan {
    pub(crate) offset: usize,
    pub(crate) length: Option<usize>,
    /// (key, cluster), longest key first.
    pub(crate) routes: Vec<(Vec<u8>, String)>,
}

impl KeyRoutePlan {
    /// Bytes from the start of the first bytes that decide this route.
    pub(crate) fn needed(&self) -> usize {
        let longest = self.routes.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        self.offset + self.length.unwrap_or(longest)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ClusterPlan {
    pub(crate) name: String,
    /// Protocol of the listener whose own cluster this is (None: a key-route target only).
    pub(crate) protocol: Option<Protocol>,
    pub(crate) endpoints: Vec<EndpointPlan>,
    pub(crate) lb: LbPlan,
    pub(crate) hash_key: HashKeyPlan,
    pub(crate) health: Option<HealthPlan>,
    pub(crate) connect_timeout: Duration,
    pub(crate) connect_attempts: usize,
    pub(crate) outlier: OutlierPlan,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EndpointPlan {
    pub(crate) id: String,
    pub(crate) addr: SocketAddr,
    pub(crate) health_addr: SocketAddr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LbPlan {
    RoundRobin,
    Ring { virtual_nodes: u32 },
    Maglev { table_size: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HashKeyPlan {
    /// Round robin: no hash.
    None,
    Constant(u64),
    SourceIp,
    SourceIpPort,
    FirstBytes {
        offset: usize,
        length: usize,
    },
}

impl HashKeyPlan {
    pub(crate) fn needed(&self) -> usize {
        match self {
            HashKeyPlan::FirstBytes { offset, length } => offset + length,
            _ => 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HealthPlan {
    pub(crate) protocol: HealthProtocol,
    /// The request sent by an HTTP check, without its `Host` line (which names the endpoint).
    pub(crate) path: String,
    pub(crate) interval: Duration,
    pub(crate) timeout: Duration,
    pub(crate) healthy_threshold: u32,
    pub(crate) unhealthy_threshold: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OutlierPlan {
    pub(crate) consecutive_failures: u32,
    pub(crate) base_ejection: Duration,
    pub(crate) max_ejection: Duration,
}

impl L4Config {
    /// Validates the configuration once; see [`ValidConfig`].
    pub fn validate(self) -> Result<ValidConfig, Error> {
        ValidConfig::try_from(self)
    }
}

impl TryFrom<L4Config> for ValidConfig {
    type Error = Error;

    fn try_from(config: L4Config) -> Result<Self, Error> {
        let mut clusters = BTreeMap::new();
        let mut add_cluster = |at: &str, c: &ClusterConfig, protocol: Option<Protocol>| {
            let plan = cluster_plan(c, protocol).map_err(|e| cfg(format!("{at}: {e}")))?;
            if clusters.insert(c.name.clone(), plan).is_some() {
                return Err(cfg(format!(
                    "{at}: cluster name {:?} is used twice (cluster names are unique in the set)",
                    c.name
                )));
            }
            Ok(())
        };
        for (i, l) in config.listeners.iter().enumerate() {
            add_cluster(
                &format!("listeners[{i}] ({:?}).cluster", l.name),
                &l.cluster,
                Some(l.protocol),
            )?;
        }
        for (i, c) in config.clusters.iter().enumerate() {
            add_cluster(&format!("clusters[{i}] ({:?})", c.name), c, None)?;
        }

        let mut listeners: Vec<ListenerPlan> = Vec::with_capacity(config.listeners.len());
        for (i, l) in config.listeners.iter().enumerate() {
            let at = format!("listeners[{i}] ({:?})", l.name);
            check_name(&l.name).map_err(|e| cfg(format!("{at}: name {e}")))?;
            if let Some(other) = listeners.iter().find(|o| o.name == l.name) {
                return Err(cfg(format!(
                    "{at}: listener name {:?} is used twice",
                    other.name
                )));
            }
            if let Some(other) = listeners
                .iter()
                .find(|o| o.protocol == l.protocol && ports_overlap(o.bind, l.port))
            {
                return Err(cfg(format!(
                    "{at}: {} port {} is already taken by listener {:?} ({})",
                    l.protocol,
                    l.port.port(),
                    other.name,
                    other.bind
                )));
            }
            if l.first_bytes_timeout.is_zero() {
                return Err(cfg(format!(
                    "{at}: firstBytesTimeout must be greater than zero"
                )));
            }
            let c = &l.cluster;
            let idle_timeout = c.idle_timeout.unwrap_or(match l.protocol {
                Protocol::Udp => Duration::from_secs(60),
                Protocol::Tcp => Duration::from_secs(3600),
            });
            if idle_timeout.is_zero() {
                return Err(cfg(format!(
                    "{at}: cluster.idleTimeout must be greater than zero"
                )));
            }
            if c.max_sessions == 0 || c.max_sessions > 1_000_000 {
                return Err(cfg(format!(
                    "{at}: cluster.maxSessions must be between 1 and 1000000"
                )));
            }
            let key_route = match &l.key_route {
                None => None,
                Some(k) => Some(
                    key_route_plan(k, &clusters).map_err(|e| cfg(format!("{at}.keyRoute: {e}")))?,
                ),
            };
            listeners.push(ListenerPlan {
                name: l.name.clone(),
                protocol: l.protocol,
                bind: l.port,
                reuse_port: l.reuse_port,
                cluster: c.name.clone(),
                key_route,
                first_bytes_timeout: l.first_bytes_timeout,
                idle_timeout,
                max_sessions: usize::try_from(c.max_sessions).unwrap_or(usize::MAX),
                overflow: c.overflow,
            });
        }
        Ok(ValidConfig {
            listeners,
            clusters,
            drain_grace: config.drain_grace,
        })
    }
}

/// Two binds of one protocol collide when their ports are equal and their IPs are equal or
/// either is a wildcard. Port 0 never collides (each gets its own free port).
pub(crate) fn ports_overlap(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0
        && a.port() == b.port()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

fn cfg(msg: String) -> Error {
    Error::Config(msg)
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > MAX_NAME {
        return Err(format!("is longer than {MAX_NAME} bytes"));
    }
    if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(format!(
            "{name:?} must not contain spaces or control characters"
        ));
    }
    Ok(())
}

/// Validates one cluster; `protocol` is that of the listener it serves (None: key routes only).
pub(crate) fn cluster_plan(
    c: &ClusterConfig,
    protocol: Option<Protocol>,
) -> Result<ClusterPlan, String> {
    check_name(&c.name).map_err(|e| format!("name {e}"))?;
    let endpoints = endpoint_plans(&c.endpoints)?;
    let lb = match c.lb {
        LbPolicy::RoundRobin => LbPlan::RoundRobin,
        LbPolicy::RingHash => {
            if c.ring_virtual_nodes == 0 {
                return Err("ringVirtualNodes must be at least 1".into());
            }
            LbPlan::Ring {
                virtual_nodes: c.ring_virtual_nodes,
            }
        }
        LbPolicy::Maglev => {
            let m = c.maglev_table_size;
            if !is_prime(m) || m > MAX_MAGLEV_TABLE {
                return Err(format!(
                    "maglevTableSize {m} must be a prime no larger than {MAX_MAGLEV_TABLE} (e.g. 65537)"
                ));
            }
            LbPlan::Maglev { table_size: m }
        }
    };
    let hash_key = match (&lb, &c.hash_key) {
        (LbPlan::RoundRobin, None) => HashKeyPlan::None,
        (LbPlan::RoundRobin, Some(_)) => {
            return Err("hashKey needs lb ringHash or maglev (roundRobin hashes nothing)".into());
        }
        (_, None | Some(HashKey::SourceIp)) => HashKeyPlan::SourceIp,
        (_, Some(HashKey::SourceIpPort)) => HashKeyPlan::SourceIpPort,
        (_, Some(HashKey::Constant(s))) => {
            HashKeyPlan::Constant(crate::hash::hash_bytes(s.as_bytes()))
        }
        (_, Some(HashKey::FirstBytes { offset, length })) => {
            if *length == 0 || u64::from(*offset) + u64::from(*length) > u64::from(MAX_FIRST_BYTES)
            {
                return Err(format!(
                    "hashKey.firstBytes: length must be at least 1 and offset + length at most {MAX_FIRST_BYTES}"
                ));
            }
            HashKeyPlan::FirstBytes {
                offset: *offset as usize,
                length: *length as usize,
            }
        }
    };
    let health = match &c.health_check {
        None => None,
        Some(h) => Some(health_plan(h).map_err(|e| format!("healthCheck: {e}"))?),
    };
    check_membership(&lb, health.is_some(), protocol, &c.endpoints)?;
    if c.connect_timeout.is_zero() {
        return Err("connectTimeout must be greater than zero".into());
    }
    if c.connect_attempts == 0 || c.connect_attempts > 16 {
        return Err("connectAttempts must be between 1 and 16".into());
    }
    let o = &c.outlier_detection;
    if o.consecutive_failures > 0 && (o.base_ejection.is_zero() || o.max_ejection < o.base_ejection)
    {
        return Err(
            "outlierDetection: baseEjection must be greater than zero and at most maxEjection"
                .into(),
        );
    }
    Ok(ClusterPlan {
        name: c.name.clone(),
        protocol,
        endpoints,
        lb,
        hash_key,
        health,
        connect_timeout: c.connect_timeout,
        connect_attempts: c.connect_attempts as usize,
        outlier: OutlierPlan {
            consecutive_failures: o.consecutive_failures,
            base_ejection: o.base_ejection,
            max_ejection: o.max_ejection,
        },
    })
}

/// The checks that depend on the endpoint list as well as the cluster's settings (also run on
/// [`crate::ListenerSet::update_endpoints`]).
pub(crate) fn check_membership(
    lb: &LbPlan,
    health: bool,
    protocol: Option<Protocol>,
    endpoints: &[EndpointConfig],
) -> Result<(), String> {
    let n = endpoints.len();
    match *lb {
        LbPlan::RoundRobin => {}
        LbPlan::Ring { virtual_nodes } => {
            if u64::from(virtual_nodes) * n as u64 > MAX_RING_POINTS {
                return Err(format!(
                    "endpoints × ringVirtualNodes must be at most {MAX_RING_POINTS}"
                ));
            }
        }
        LbPlan::Maglev { table_size } => {
            if table_size as usize <= n {
                return Err(format!(
                    "maglevTableSize {table_size} must be larger than the number of endpoints ({n})"
                ));
            }
        }
    }
    if health
        && protocol == Some(Protocol::Udp)
        && let Some(e) = endpoints.iter().find(|e| e.health_check_port.is_none())
    {
        return Err(format!(
            "endpoint {:?}: a UDP listener's endpoints need healthCheckPort (health checks speak TCP or HTTP)",
            e.id
        ));
    }
    Ok(())
}

/// Validates an endpoint list (also for [`crate::ListenerSet::update_endpoints`]).
pub(crate) fn endpoint_plans(endpoints: &[EndpointConfig]) -> Result<Vec<EndpointPlan>, String> {
    if endpoints.is_empty() {
        return Err("endpoints must not be empty".into());
    }
    let mut ids = BTreeSet::new();
    let mut addrs = BTreeSet::new();
    let mut out = Vec::with_capacity(endpoints.len());
    for e in endpoints {
        check_name(&e.id).map_err(|err| format!("endpoint id {err}"))?;
        if !ids.insert(e.id.as_str()) {
            return Err(format!("endpoint id {:?} is used twice", e.id));
        }
        if e.address.port() == 0 || e.address.ip().is_unspecified() {
            return Err(format!(
                "endpoint {:?}: address {} needs a specific IP and a non-zero port",
                e.id, e.address
            ));
        }
        if !addrs.insert(e.address) {
            return Err(format!(
                "endpoint {:?}: address {} is used by another endpoint",
                e.id, e.address
            ));
        }
        if e.health_check_port == Some(0) {
            return Err(format!(
                "endpoint {:?}: healthCheckPort must not be 0",
                e.id
            ));
        }
        let health_addr = SocketAddr::new(
            e.address.ip(),
            e.health_check_port.unwrap_or(e.address.port()),
        );
        out.push(EndpointPlan {
            id: e.id.clone(),
            addr: e.address,
            health_addr,
        });
    }
    // Sorted by id: ring and table builds must not depend on the order the endpoints came in,
    // so that every replica given the same set picks the same endpoint for a key.
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

fn health_plan(h: &HealthCheckConfig) -> Result<HealthPlan, String> {
    if h.interval.is_zero() || h.timeout.is_zero() {
        return Err("interval and timeout must be greater than zero".into());
    }
    if h.timeout > h.interval {
        return Err(
            "timeout must be at most interval (checks of one endpoint never overlap)".into(),
        );
    }
    if h.healthy_threshold == 0 || h.unhealthy_threshold == 0 {
        return Err("healthyThreshold and unhealthyThreshold must be at least 1".into());
    }
    let path = match (h.protocol, &h.path) {
        (HealthProtocol::Tcp, Some(_)) => return Err("path is for protocol http only".into()),
        (HealthProtocol::Tcp, None) => String::new(),
        (HealthProtocol::Http, None) => "/".into(),
        (HealthProtocol::Http, Some(p)) => {
            // The path goes into the request line as is: no byte that could end it early.
            if !p.starts_with('/') || p.len() > 2048 || p.bytes().any(|b| b <= b' ' || b == 0x7f) {
                return Err(format!(
                    "path {p:?} must start with '/', have no spaces or control characters and be at most 2048 bytes"
                ));
            }
            p.clone()
        }
    };
    Ok(HealthPlan {
        protocol: h.protocol,
        path,
        interval: h.interval,
        timeout: h.timeout,
        healthy_threshold: h.healthy_threshold,
        unhealthy_threshold: h.unhealthy_threshold,
    })
}

fn key_route_plan(
    k: &KeyRouteConfig,
    clusters: &BTreeMap<String, ClusterPlan>,
) -> Result<KeyRoutePlan, String> {
    if k.routes.is_empty() {
        return Err("routes must not be empty".into());
    }
    let mut routes: Vec<(Vec<u8>, String)> = Vec::with_capacity(k.routes.len());
    for (i, r) in k.routes.iter().enumerate() {
        let key = match (&r.key, &r.key_hex) {
            (Some(s), None) => s.as_bytes().to_vec(),
            (None, Some(h)) => spur_runtime::parse_hex(h).ok_or_else(|| {
                format!("routes[{i}]: keyHex {h:?} is not an even number of hex digits")
            })?,
            _ => return Err(format!("routes[{i}]: set exactly one of key and keyHex")),
        };
        if key.is_empty() || key.len() > MAX_KEY {
            return Err(format!("routes[{i}]: the key must be 1 to {MAX_KEY} bytes"));
        }
        if let Some(len) = k.length
            && key.len() != len as usize
        {
            return Err(format!(
                "routes[{i}]: the key is {} bytes but length is {len}",
                key.len()
            ));
        }
        if !clusters.contains_key(&r.cluster) {
            return Err(format!("routes[{i}]: unknown cluster {:?}", r.cluster));
        }
        if routes.iter().any(|(other, _)| *other == key) {
            return Err(format!("routes[{i}]: the key is used twice"));
        }
        routes.push((key, r.cluster.clone()));
    }
    routes.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
    let plan = KeyRoutePlan {
        offset: k.offset as usize,
        length: k.length.map(|l| l as usize),
        routes,
    };
    if plan.needed() > MAX_FIRST_BYTES as usize {
        return Err(format!(
            "offset + key length must be at most {MAX_FIRST_BYTES}"
        ));
    }
    Ok(plan)
}

pub(super) fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u32;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}
