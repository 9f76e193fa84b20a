//! A listener's routing settings (swapped whole on a configuration change): which cluster a new
//! session goes to, and the hash that picks its endpoint there.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use crate::cluster::Cluster;
use crate::config::{HashKeyPlan, KeyRoutePlan, ListenerPlan, Overflow};
use crate::hash::{Hasher, hash_bytes};

#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) cluster: Arc<Cluster>,
    key_route: Option<KeyRouter>,
    /// Bytes a TCP listener reads before it routes (0: route at accept).
    pub(crate) first_bytes: usize,
    pub(crate) first_bytes_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) max_sessions: usize,
    pub(crate) overflow: Overflow,
    pub(crate) drain_grace: Duration,
}

#[derive(Debug)]
struct KeyRouter {
    offset: usize,
    kind: KeyMatch,
}

#[derive(Debug)]
enum KeyMatch {
    /// The key is exactly `len` bytes at the offset.
    Exact {
        len: usize,
        routes: HashMap<Vec<u8>, Arc<Cluster>>,
    },
    /// Prefixes at the offset, longest first.
    Prefix(Vec<(Vec<u8>, Arc<Cluster>)>),
}

impl KeyRouter {
    fn lookup(&self, first: &[u8]) -> Option<&Arc<Cluster>> {
        let at = first.get(self.offset..)?;
        match &self.kind {
            KeyMatch::Exact { len, routes } => routes.get(at.get(..*len)?),
            KeyMatch::Prefix(routes) => routes
                .iter()
                .find(|(key, _)| at.starts_with(key))
                .map(|(_, c)| c),
        }
    }
}

impl Settings {
    /// `clusters` holds every cluster the plan names (checked by validation; a missing one
    /// would be a bug, and yields None).
    pub(crate) fn new(
        plan: &ListenerPlan,
        clusters: &BTreeMap<String, Arc<Cluster>>,
        drain_grace: Duration,
    ) -> Option<Settings> {
        let cluster = clusters.get(&plan.cluster)?.clone();
        let key_route = match &plan.key_route {
            None => None,
            Some(k) => Some(key_router(k, clusters)?),
        };
        let mut first_bytes = cluster.load().plan.hash_key.needed();
        if let (Some(k), Some(router)) = (&plan.key_route, &key_route) {
            first_bytes = first_bytes.max(k.needed());
            let targets: Vec<&Arc<Cluster>> = match &router.kind {
                KeyMatch::Exact { routes, .. } => routes.values().collect(),
                KeyMatch::Prefix(routes) => routes.iter().map(|(_, c)| c).collect(),
            };
            for c in targets {
                first_bytes = first_bytes.max(c.load().plan.hash_key.needed());
            }
        }
        Some(Settings {
            cluster,
            key_route,
            first_bytes,
            first_bytes_timeout: plan.first_bytes_timeout,
            idle_timeout: plan.idle_timeout,
            max_sessions: plan.max_sessions,
            overflow: plan.overflow,
            drain_grace,
        })
    }

    /// The cluster and hash for a new session whose first bytes are `first` (a UDP session's
    /// first datagram, a TCP stream's first bytes).
    pub(crate) fn route(&self, first: &[u8], peer: SocketAddr) -> (Arc<Cluster>, u64) {
        let cluster = self
            .key_route
            .as_ref()
            .and_then(|k| k.lookup(first))
            .unwrap_or(&self.cluster);
        let hash = session_hash(&cluster.load().plan.hash_key, first, peer);
        (cluster.clone(), hash)
    }
}

fn key_router(k: &KeyRoutePlan, clusters: &BTreeMap<String, Arc<Cluster>>) -> Option<KeyRouter> {
    let kind = match k.length {
        Some(len) => KeyMatch::Exact {
            len,
            routes: k
                .routes
                .iter()
                .map(|(key, c)| Some((key.clone(), clusters.get(c)?.clone())))
                .collect::<Option<_>>()?,
        },
        None => KeyMatch::Prefix(
            k.routes
                .iter()
                .map(|(key, c)| Some((key.clone(), clusters.get(c)?.clone())))
                .collect::<Option<_>>()?,
        ),
    };
    Some(KeyRouter {
        offset: k.offset,
        kind,
    })
}

/// The session hash: what a hash balancer looks up. IPv4-mapped IPv6 sources hash as IPv4, so
/// a dual-stack listener agrees with an IPv4 one.
pub(crate) fn session_hash(key: &HashKeyPlan, first: &[u8], peer: SocketAddr) -> u64 {
    let ip = |h: &mut Hasher| match peer.ip().to_canonical() {
        IpAddr::V4(v4) => h.write(&v4.octets()),
        IpAddr::V6(v6) => h.write(&v6.octets()),
    };
    match key {
        HashKeyPlan::None => 0,
        HashKeyPlan::Constant(h) => *h,
        HashKeyPlan::SourceIp => {
            let mut h = Hasher::new();
            ip(&mut h);
            h.finish()
        }
        HashKeyPlan::SourceIpPort => {
            let mut h = Hasher::new();
            ip(&mut h);
            h.write(&peer.port().to_be_bytes());
            h.finish()
        }
        HashKeyPlan::FirstBytes { offset, length } => {
            let end = first.len().min(offset.saturating_add(*length));
            hash_bytes(first.get(*offset..end).unwrap_or_default())
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn hash_keys() {
        let a: SocketAddr = "10.0.0.1:1000".parse().unwrap();
        let b: SocketAddr = "10.0.0.1:2000".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:1000".parse().unwrap();
        let h = |k: &HashKeyPlan, first: &[u8], p| session_hash(k, first, p);
        assert_eq!(
            h(&HashKeyPlan::SourceIp, b"", a),
            h(&HashKeyPlan::SourceIp, b"x", b)
        );
        assert_eq!(
            h(&HashKeyPlan::SourceIp, b"", a),
            h(&HashKeyPlan::SourceIp, b"", mapped)
        );
        assert_ne!(
            h(&HashKeyPlan::SourceIpPort, b"", a),
            h(&HashKeyPlan::SourceIpPort, b"", b)
        );
        let fb = HashKeyPlan::FirstBytes {
            offset: 2,
            length: 3,
        };
        assert_eq!(h(&fb, b"..abc-rest", a), h(&fb, b"xxabc", b));
        assert_eq!(
            h(&fb, b"..ab", a),
            hash_bytes(b"ab"),
            "short input: what there is"
        );
        assert_eq!(h(&fb, b".", a), hash_bytes(b""));
    }
}
