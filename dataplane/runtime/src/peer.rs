//! Who a per-peer connection cap counts ([`PeerKey`]): shared by every listener that caps
//! peers (the tunnel's handshakes, the hub's listeners), so all of them count a peer the same way.

use std::net::IpAddr;

/// A peer for a per-peer cap: an IPv4 address (also when it arrives IPv4-mapped on a
/// dual-stack socket), an IPv6 peer by its /64, one host's usual share: counting single IPv6
/// addresses would let one host take a listener's whole table from its own /64.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct PeerKey(IpAddr);

impl PeerKey {
    pub fn of(ip: IpAddr) -> PeerKey {
        match ip {
            IpAddr::V4(_) => PeerKey(ip),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => PeerKey(IpAddr::V4(v4)),
                None => {
                    let s = v6.segments();
                    PeerKey(IpAddr::from([s[0], s[1], s[2], s[3], 0, 0, 0, 0]))
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_an_ipv4_address_or_an_ipv6_64() {
        let k = |s: &str| PeerKey::of(s.parse().unwrap_or(IpAddr::from([0, 0, 0, 0])));
        assert_eq!(k("192.0.2.1"), k("::ffff:192.0.2.1"));
        assert_ne!(k("192.0.2.1"), k("192.0.2.2"));
        assert_eq!(k("2001:db8:1:2::1"), k("2001:db8:1:2:ffff::9"));
        assert_ne!(k("2001:db8:1:2::1"), k("2001:db8:1:3::1"));
    }
}
