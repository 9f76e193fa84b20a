//! Where a workstation may connect through the tunnel proxy (forward streams, SOCKS5, CONNECT).
//!
//! Every address a target resolves to is first put in its canonical form: an IPv4-mapped
//! (`::ffff:a.b.c.d`) or IPv4-compatible (`::a.b.c.d`) IPv6 address is the IPv4 address the
//! kernel connects to, so `::ffff:169.254.169.254` is the metadata service, not some IPv6 host.
//! IPv6 forms that embed an IPv4 address without being it (NAT64 `64:ff9b::/96`, 6to4
//! `2002::/16`) are checked under both. Then:
//! 1. unspecified, loopback, link-local, multicast, broadcast and reserved addresses are never
//!    dialled, whatever the configuration: they are the proxy pod itself or no cluster address;
//! 2. the deny list (CIDRs) is refused;
//! 3. with an allow list (the cluster's Service and Pod ranges in the chart), only addresses in
//!    it are dialled;
//! 4. a tunnel grant's session dials only its namespace's Service and pod addresses
//!    ([`crate::scope`]).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::IpNet;
use tokio::net::TcpStream;

use crate::Error;
use crate::addr::canonical;
use crate::scope::Owners;

/// The destination policy of one tunnel proxy.
#[derive(Clone, Debug, Default)]
pub struct Destinations {
    allow: Vec<IpNet>,
    deny: Vec<IpNet>,
    loopback: bool,
}

impl Destinations {
    /// Cloud metadata services outside link-local (which is always refused): Alibaba's
    /// 100.100.100.200 and AWS's IPv6 endpoint.
    pub const DEFAULT_DENY: &'static str = "100.100.100.200/32,fd00:ec2::254/128";

    /// `allow` empty: any address that is not refused. CIDRs written in IPv4-mapped form count
    /// as the IPv4 range they stand for.
    pub fn new(allow: Vec<IpNet>, deny: Vec<IpNet>) -> Destinations {
        Destinations {
            allow: allow.into_iter().map(canonical_net).collect(),
            deny: deny.into_iter().map(canonical_net).collect(),
            loopback: false,
        }
    }

    /// Also dials loopback addresses: only for tests whose "cluster" is this machine's loopback
    /// (`spur-tunnel-proxy --allow-loopback-destinations`). In a pod, loopback is the proxy's own
    /// metrics and admin ports.
    pub fn allowing_loopback(mut self) -> Destinations {
        self.loopback = true;
        self
    }

    /// Also refuses `ip`: the proxy's own pod address, where its metrics port and every other
    /// workstation's reverse listeners are.
    pub fn denying(mut self, ip: IpAddr) -> Destinations {
        self.deny.push(IpNet::from(canonical(ip)));
        self
    }

    /// Parses a comma-separated CIDR list (empty: none).
    pub fn parse_cidrs(list: &str) -> Result<Vec<IpNet>, Error> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<IpNet>().map_err(|e| {
                    Error::Config(format!(
                        "{s:?} is not a CIDR (like 10.96.0.0/12 or fd00::/108): {e}"
                    ))
                })
            })
            .collect()
    }

    /// The address to dial for `ip` (its canonical form), or why it may not be.
    pub fn check(&self, ip: IpAddr) -> Result<IpAddr, String> {
        let ip = canonical(ip);
        let embedded = match ip {
            IpAddr::V6(v6) => embedded_v4(v6).map(IpAddr::V4),
            IpAddr::V4(_) => None,
        };
        for view in std::iter::once(ip).chain(embedded) {
            if let Some(kind) = never(view)
                && !(self.loopback && kind == LOOPBACK)
            {
                return Err(format!(
                    "{ip} is {kind}: the tunnel proxy never connects there"
                ));
            }
            if let Some(net) = self.deny.iter().find(|n| n.contains(&view)) {
                return Err(format!("{ip} is in the tunnel proxy's deny list ({net})"));
            }
        }
        if !self.allow.is_empty() && !self.allow.iter().any(|n| n.contains(&ip)) {
            return Err(format!(
                "{ip} is outside the cluster ranges the tunnel proxy may reach (--allow-cidrs)"
            ));
        }
        Ok(ip)
    }
}

const LOOPBACK: &str = "a loopback address";

fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.network().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96)
                .map(IpNet::V4)
                .unwrap_or(net),
            None => net,
        },
        _ => net,
    }
}

/// The IPv4 address a NAT64 (`64:ff9b::/96`) or 6to4 (`2002::/16`) address carries.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let o = v6.octets();
    let s = v6.segments();
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

/// What kind of address no workstation may reach, if `ip` is one.
fn never(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => {
            if v4.octets()[0] == 0 {
                Some("unspecified (0.0.0.0/8 is this host)")
            } else if v4.is_loopback() {
                Some(LOOPBACK)
            } else if v4.is_link_local() {
                Some("link-local (cloud metadata services live there)")
            } else if v4.is_multicast() {
                Some("multicast")
            } else if v4.octets()[0] >= 240 {
                Some("broadcast or reserved")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            if v6.is_unspecified() {
                Some("unspecified (:: is this host)")
            } else if v6.is_loopback() {
                Some(LOOPBACK)
            } else if v6.segments()[0] & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else {
                None
            }
        }
    }
}

/// Connects to `host:port` in the cluster: a fixed address if configured, else through DNS;
/// only to addresses `destinations` allows, in their canonical form, and with `scope` (a
/// tunnel grant's session: the owners index and the grant's namespace) only to that
/// namespace's Service and pod addresses.
pub(crate) async fn dial_cluster(
    resolve: &HashMap<String, SocketAddr>,
    destinations: &Destinations,
    scope: Option<(&Owners, &str)>,
    host: &str,
    port: u16,
) -> std::io::Result<TcpStream> {
    let candidates: Vec<SocketAddr> = match resolve.get(&format!("{host}:{port}")) {
        Some(addr) => vec![*addr],
        None => tokio::net::lookup_host((host, port)).await?.collect(),
    };
    let mut refused = None;
    let mut allowed = Vec::new();
    for a in &candidates {
        let checked = destinations.check(a.ip()).and_then(|ip| match scope {
            Some((owners, namespace)) => owners.check(ip, namespace).map(|()| ip),
            None => Ok(ip),
        });
        match checked {
            Ok(ip) => allowed.push(SocketAddr::new(ip, a.port())),
            Err(why) => {
                refused.get_or_insert(why);
            }
        }
    }
    if allowed.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            match refused {
                Some(why) => format!("destination not allowed through the tunnel proxy: {why}"),
                None => format!("{host} has no address"),
            },
        ));
    }
    let mut last = None;
    for addr in allowed {
        match TcpStream::connect(addr).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no address to connect to")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn chart_default() -> Destinations {
        Destinations::new(
            Destinations::parse_cidrs("10.96.0.0/12,10.244.0.0/16").unwrap(),
            Destinations::parse_cidrs(Destinations::DEFAULT_DENY).unwrap(),
        )
    }

    #[test]
    fn every_form_of_a_refused_address_is_refused() {
        // With no allow list at all (the binary's default), so the refusal is the never-list's.
        let open = Destinations::new(
            Vec::new(),
            Destinations::parse_cidrs(Destinations::DEFAULT_DENY).unwrap(),
        );
        for refused in [
            "0.0.0.0",
            "0.1.2.3",
            "::",
            "::ffff:0.0.0.0",
            "127.0.0.1",
            "127.9.9.9",
            "::1",
            "::ffff:127.0.0.1",
            "::127.0.0.1",
            "169.254.169.254",
            "::ffff:169.254.169.254",
            "::ffff:a9fe:a9fe",
            "::169.254.169.254",
            "64:ff9b::169.254.169.254",
            "2002:a9fe:a9fe::1",
            "fe80::1",
            "febf::1",
            "224.0.0.1",
            "::ffff:224.0.0.1",
            "ff02::1",
            "255.255.255.255",
            "::ffff:255.255.255.255",
            "100.100.100.200",
            "::ffff:100.100.100.200",
            "fd00:ec2::254",
        ] {
            assert!(open.check(ip(refused)).is_err(), "{refused} got through");
        }
        for fine in [
            "10.96.0.1",
            "192.168.1.5",
            "fd12::5",
            "2001:db8::1",
            "8.8.8.8",
        ] {
            assert_eq!(open.check(ip(fine)).unwrap(), ip(fine), "{fine}");
        }
    }

    #[test]
    fn the_allow_list_admits_only_the_cluster_ranges_in_canonical_form() {
        let d = chart_default();
        assert_eq!(d.check(ip("10.96.0.10")).unwrap(), ip("10.96.0.10"));
        assert_eq!(d.check(ip("10.244.3.7")).unwrap(), ip("10.244.3.7"));
        // The mapped form is dialled as the IPv4 address it stands for.
        assert_eq!(d.check(ip("::ffff:10.96.0.10")).unwrap(), ip("10.96.0.10"));
        for outside in [
            "10.0.0.1",
            "192.168.1.5",
            "8.8.8.8",
            "2001:db8::1",
            "64:ff9b::a60:a",
        ] {
            let why = d.check(ip(outside)).unwrap_err();
            assert!(why.contains("--allow-cidrs"), "{outside}: {why}");
        }
        // An allow list naming a refused range does not open it.
        let wide = Destinations::new(
            Destinations::parse_cidrs("0.0.0.0/0,::/0").unwrap(),
            Vec::new(),
        );
        for refused in ["169.254.169.254", "::ffff:127.0.0.1", "0.0.0.0", "fe80::1"] {
            assert!(wide.check(ip(refused)).is_err(), "{refused} got through");
        }
        // A deny CIDR written in mapped form covers the IPv4 addresses.
        let mapped_deny = Destinations::new(
            Vec::new(),
            Destinations::parse_cidrs("::ffff:10.1.0.0/112").unwrap(),
        );
        assert!(mapped_deny.check(ip("10.1.2.3")).is_err());
        assert!(mapped_deny.check(ip("10.2.0.1")).is_ok());
    }

    #[test]
    fn loopback_is_dialled_only_when_a_test_asks_and_nothing_else_opens() {
        let d = Destinations::new(Vec::new(), Vec::new()).allowing_loopback();
        assert_eq!(d.check(ip("::ffff:127.0.0.1")).unwrap(), ip("127.0.0.1"));
        assert!(d.check(ip("::1")).is_ok());
        for refused in [
            "0.0.0.0",
            "169.254.169.254",
            "::ffff:169.254.169.254",
            "fe80::1",
        ] {
            assert!(d.check(ip(refused)).is_err(), "{refused} got through");
        }
    }

    #[test]
    fn the_proxy_pod_itself_is_refused_in_the_pod_range() {
        let d = chart_default().denying(ip("10.244.1.9"));
        assert!(d.check(ip("10.244.1.9")).is_err());
        assert!(d.check(ip("::ffff:10.244.1.9")).is_err());
        assert!(d.check(ip("10.244.1.10")).is_ok());
    }

    #[test]
    fn bad_cidrs_say_what_a_cidr_looks_like() {
        let e = Destinations::parse_cidrs("10.0.0.0/8, nonsense").unwrap_err();
        assert!(e.to_string().contains("\"nonsense\" is not a CIDR"), "{e}");
        assert!(Destinations::parse_cidrs(" , ").unwrap().is_empty());
    }

    /// The attack of issue 42, point 7, against a real listener: `0.0.0.0:port` and
    /// `[::ffff:127.0.0.1]:port` reach a socket on the proxy pod's loopback unless the address
    /// is canonicalized before the check.
    #[tokio::test]
    async fn unspecified_and_mapped_targets_never_reach_the_proxy_pod() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let d = Destinations::new(
            Vec::new(),
            Destinations::parse_cidrs("127.0.0.0/8,::1/128,169.254.0.0/16,fe80::/10").unwrap(),
        );
        let none = HashMap::new();
        for host in ["0.0.0.0", "::ffff:127.0.0.1", "::", "localhost"] {
            let e = dial_cluster(&none, &d, None, host, port).await.unwrap_err();
            assert_eq!(
                e.kind(),
                std::io::ErrorKind::PermissionDenied,
                "{host}: {e}"
            );
        }
        // A fixed address (`--resolve`) is checked the same way.
        let resolve = HashMap::from([(
            format!("api.shop.svc:{port}"),
            SocketAddr::new(ip("::ffff:127.0.0.1"), port),
        )]);
        let e = dial_cluster(&resolve, &d, None, "api.shop.svc", port)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("never connects there"), "{e}");
    }
}
