//! Cluster service names on the workstation: one loopback address per Service (127.77.x.y by
//! default), answered by the local DNS responder, written into the hosts file, and listened on
//! for every TCP port of the Service.
//!
//! The table is immutable and swapped whole ([`arc_swap`]); the DNS responder only loads it.
//! Addresses are stable for as long as the Service exists, and a freed address is handed out
//! again only after every other free one (the allocator moves on round-robin), so a name that
//! went away is not quietly answered by another Service's listeners while caches still hold it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::Ipv4Addr;

use spur_proto::tunnel::ClusterService;

/// One Service as the workstation serves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceEntry {
    pub namespace: String,
    pub name: String,
    pub addr: Ipv4Addr,
    /// TCP ports, sorted.
    pub ports: Vec<u16>,
}

impl ServiceEntry {
    /// The name a tunnel stream asks the cluster for.
    pub fn cluster_host(&self) -> String {
        format!("{}.{}.svc", self.name, self.namespace)
    }

    /// `<svc>.<ns>`, `<svc>.<ns>.svc`, `<svc>.<ns>.svc.<domain>`.
    pub fn names(&self, domain: &str) -> [String; 3] {
        let short = format!("{}.{}", self.name, self.namespace);
        let svc = format!("{short}.svc");
        let full = format!("{svc}.{domain}");
        [short, svc, full]
    }
}

/// Name → address, for the DNS responder and the hosts file.
#[derive(Debug, Default)]
pub struct NameTable {
    domain: String,
    by_name: HashMap<String, Ipv4Addr>,
    services: Vec<ServiceEntry>,
}

impl NameTable {
    /// The address of `qname` (case-insensitive, with or without the trailing dot).
    pub fn lookup(&self, qname: &str) -> Option<Ipv4Addr> {
        let q = qname.strip_suffix('.').unwrap_or(qname);
        if q.bytes().any(|b| b.is_ascii_uppercase()) {
            self.by_name.get(&q.to_ascii_lowercase()).copied()
        } else {
            self.by_name.get(q).copied()
        }
    }

    pub fn services(&self) -> &[ServiceEntry] {
        &self.services
    }

    pub fn domain(&self) -> &str {
        &self.domain
    }

    pub fn len(&self) -> usize {
        self.services.len()
    }

    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }
}

/// Hands out addresses in a /16 of 127/8, round-robin, never `.0.0` or `.255.255`.
#[derive(Debug)]
pub(crate) struct Allocator {
    net: [u8; 2],
    by_service: HashMap<(String, String), u16>,
    used: HashSet<u16>,
    cursor: u16,
}

impl Allocator {
    /// `net`: the first two octets are used; it must be in 127.0.0.0/8.
    pub(crate) fn new(net: Ipv4Addr) -> Result<Self, crate::Error> {
        let o = net.octets();
        if o[0] != 127 {
            return Err(crate::Error::Config(format!(
                "service address range {net}/16 is not loopback (127.0.0.0/8)"
            )));
        }
        Ok(Allocator {
            net: [o[0], o[1]],
            by_service: HashMap::new(),
            used: HashSet::new(),
            cursor: 1,
        })
    }

    fn addr(&self, host: u16) -> Ipv4Addr {
        let [hi, lo] = host.to_be_bytes();
        Ipv4Addr::new(self.net[0], self.net[1], hi, lo)
    }

    fn assign(&mut self, key: &(String, String)) -> Option<Ipv4Addr> {
        if let Some(h) = self.by_service.get(key) {
            return Some(self.addr(*h));
        }
        // 65534 usable host parts: 1..=65534.
        let mut h = self.cursor;
        for _ in 0..65534u32 {
            if !(1..=65534).contains(&h) {
                h = 1;
            }
            if !self.used.contains(&h) {
                self.used.insert(h);
                self.by_service.insert(key.clone(), h);
                self.cursor = h.wrapping_add(1);
                return Some(self.addr(h));
            }
            h = h.wrapping_add(1);
        }
        None
    }

    /// Builds the table for `services`: Services that left free their address; new ones get
    /// the next free one (in namespace/name order, so a fresh start is deterministic). At most
    /// `max` Services are served; the count of those left out is returned too.
    pub(crate) fn table(
        &mut self,
        services: &[ClusterService],
        domain: &str,
        max: usize,
    ) -> (NameTable, usize) {
        let mut wanted: BTreeMap<(String, String), Vec<u16>> = BTreeMap::new();
        for s in services {
            if !valid_label(&s.name) || !valid_label(&s.namespace) {
                continue;
            }
            let mut ports: Vec<u16> = s
                .ports
                .iter()
                .filter(|p| p.protocol.is_empty() || p.protocol.eq_ignore_ascii_case("TCP"))
                .filter_map(|p| u16::try_from(p.port).ok().filter(|p| *p != 0))
                .collect();
            ports.sort_unstable();
            ports.dedup();
            wanted.insert(
                (
                    s.namespace.to_ascii_lowercase(),
                    s.name.to_ascii_lowercase(),
                ),
                ports,
            );
        }
        // Free the addresses of Services that are gone (or beyond the cap) first.
        let kept: HashSet<&(String, String)> = wanted.keys().take(max).collect();
        let gone: Vec<(String, String)> = self
            .by_service
            .keys()
            .filter(|k| !kept.contains(k))
            .cloned()
            .collect();
        for k in gone {
            if let Some(h) = self.by_service.remove(&k) {
                self.used.remove(&h);
            }
        }
        let skipped = wanted.len().saturating_sub(max);
        let mut table = NameTable {
            domain: domain.to_ascii_lowercase(),
            ..NameTable::default()
        };
        for (key, ports) in wanted.into_iter().take(max) {
            let Some(addr) = self.assign(&key) else {
                continue;
            };
            let entry = ServiceEntry {
                namespace: key.0,
                name: key.1,
                addr,
                ports,
            };
            for n in entry.names(&table.domain) {
                table.by_name.insert(n, addr);
            }
            table.services.push(entry);
        }
        (table, skipped)
    }
}

/// A DNS label as Kubernetes names Services and namespaces (RFC 1123, at most 63 bytes).
fn valid_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use spur_proto::tunnel::ServicePort;

    fn svc(ns: &str, name: &str, ports: &[(u32, &str)]) -> ClusterService {
        ClusterService {
            namespace: ns.into(),
            name: name.into(),
            ports: ports
                .iter()
                .map(|(p, proto)| ServicePort {
                    name: String::new(),
                    port: *p,
                    protocol: (*proto).into(),
                })
                .collect(),
        }
    }

    #[test]
    fn names_addresses_and_stability() {
        let mut a = Allocator::new(Ipv4Addr::new(127, 77, 0, 0)).unwrap();
        let first = [
            svc("shop", "api", &[(80, "TCP"), (53, "UDP"), (8080, "")]),
            svc("shop", "web", &[(443, "TCP")]),
            svc("bad", "Not_Valid", &[(80, "TCP")]),
        ];
        let (t, skipped) = a.table(&first, "cluster.local", 100);
        assert_eq!(skipped, 0);
        assert_eq!(t.len(), 2);
        let api = t.lookup("api.shop").unwrap();
        assert_eq!(api, Ipv4Addr::new(127, 77, 0, 1));
        assert_eq!(t.lookup("API.Shop.svc.").unwrap(), api);
        assert_eq!(t.lookup("api.shop.svc.cluster.local").unwrap(), api);
        assert_eq!(
            t.lookup("web.shop.svc").unwrap(),
            Ipv4Addr::new(127, 77, 0, 2)
        );
        assert!(t.lookup("api.other").is_none());
        assert!(t.lookup("api.shop.svc.example.com").is_none());
        assert_eq!(t.services()[0].ports, vec![80, 8080]);

        // `web` leaves, `db` arrives: api keeps its address, db does not reuse web's.
        let second = [
            svc("shop", "api", &[(80, "TCP")]),
            svc("shop", "db", &[(5432, "TCP")]),
        ];
        let (t, _) = a.table(&second, "cluster.local", 100);
        assert_eq!(t.lookup("api.shop").unwrap(), api);
        assert_eq!(t.lookup("db.shop").unwrap(), Ipv4Addr::new(127, 77, 0, 3));
        assert!(t.lookup("web.shop").is_none());

        // The cap leaves Services out, in order.
        let (t, skipped) = a.table(&second, "cluster.local", 1);
        assert_eq!((t.len(), skipped), (1, 1));
        assert!(Allocator::new(Ipv4Addr::new(10, 0, 0, 0)).is_err());
    }
}
