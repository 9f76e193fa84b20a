//! The canonical form of an address: the one the destination policy, the owners index and the
//! reverse sources all compare, so an IPv4-mapped IPv6 address matches its IPv4 pod or Service.

use std::net::{IpAddr, Ipv4Addr};

/// The IPv4 address an IPv4-mapped or IPv4-compatible IPv6 address connects to; any other
/// address as it is.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = ip else { return ip };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return IpAddr::V4(v4);
    }
    // `::a.b.c.d` (deprecated IPv4-compatible); `::` and `::1` are IPv6's own.
    let s = v6.segments();
    if s[..6].iter().all(|&x| x == 0) && !v6.is_unspecified() && !v6.is_loopback() {
        let [.., a, b, c, d] = v6.octets();
        return IpAddr::V4(Ipv4Addr::new(a, b, c, d));
    }
    ip
}
