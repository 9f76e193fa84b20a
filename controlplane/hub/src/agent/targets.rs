//! Where the agent lets a hub's TCP stream go. A name under the agent's suffixes is not enough:
//! an ExternalName Service under `.svc` is a CNAME to anywhere, and any name can resolve to
//! the node's loopback or the cloud's metadata address. So the agent reads the Service and
//! refuses an ExternalName one, resolves the name itself, checks every address it resolves to
//! (IPv4-mapped IPv6 and NAT64 forms taken as the IPv4 address they carry), and connects only to
//! the addresses it checked, never to the name again (so a second lookup cannot answer
//! differently).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

pub use ipnet::IpNet;
use tokio::net::TcpStream;

/// AWS's IPv6 instance metadata address (IPv4 metadata addresses are link-local).
const AWS_METADATA_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254);

/// The address an IPv6 address stands for: `::ffff:a.b.c.d` and the NAT64 well-known prefix
/// `64:ff9b::a.b.c.d` reach the IPv4 host `a.b.c.d`.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                let [a, b, c, d] = v6.octets()[12..] else {
                    return ip;
                };
                return IpAddr::V4(Ipv4Addr::new(a, b, c, d));
            }
            ip.to_canonical()
        }
        IpAddr::V4(_) => ip,
    }
}

/// Why `ip` (canonical) is never a target, whatever the allow list says; loopback is checked
/// apart (an allow list may name it).
fn never(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            if o[0] == 0 {
                Some("an unspecified (0.0.0.0/8) address")
            } else if v4.is_link_local() {
                Some("a link-local address (169.254.0.0/16, where cloud metadata services answer)")
            } else if v4.is_broadcast() || v4.is_multicast() {
                Some("a broadcast or multicast address")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            if v6.is_unspecified() {
                Some("the unspecified address ::")
            } else if s[0] & 0xffc0 == 0xfe80 {
                Some("a link-local address (fe80::/10)")
            } else if v6.is_multicast() {
                Some("a multicast address")
            } else if v6 == AWS_METADATA_V6 {
                Some("the cloud metadata address")
            } else {
                None
            }
        }
    }
}

/// The addresses a target name may resolve to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    /// When not empty, every address must lie in one of these (the cluster's Service and Pod
    /// ranges). Loopback is refused unless one of these lies wholly inside loopback
    /// (`127.0.0.0/8`, `::1/128`): a wide range such as `0.0.0.0/0` does not open it.
    pub allow_cidrs: Vec<IpNet>,
}

impl AddressPolicy {
    /// Whether `ip` may be connected to; the error says why not.
    pub fn check(&self, ip: IpAddr) -> Result<(), String> {
        let ip = canonical(ip);
        if let Some(why) = never(ip) {
            return Err(format!("{ip} is {why}"));
        }
        if ip.is_loopback() {
            let named = self.allow_cidrs.iter().any(|n| {
                n.contains(&ip) && n.network().is_loopback() && n.broadcast().is_loopback()
            });
            return if named {
                Ok(())
            } else {
                Err(format!(
                    "{ip} is a loopback address (the agent's own pod); --allow-cidrs must name a \
                     loopback range to allow it"
                ))
            };
        }
        if !self.allow_cidrs.is_empty() && !self.allow_cidrs.iter().any(|n| n.contains(&ip)) {
            return Err(format!("{ip} is outside --allow-cidrs"));
        }
        Ok(())
    }

    /// Resolves `host:port` and checks every address; all of them, or why not.
    pub async fn resolve(
        &self,
        host: &str,
        port: u16,
        timeout: Duration,
    ) -> Result<Vec<SocketAddr>, String> {
        let addrs: Vec<SocketAddr> =
            match tokio::time::timeout(timeout, tokio::net::lookup_host((host, port))).await {
                Ok(Ok(a)) => a.collect(),
                Ok(Err(e)) => return Err(format!("resolving {host}: {e}")),
                Err(_) => return Err(format!("resolving {host}: timed out")),
            };
        if addrs.is_empty() {
            return Err(format!("{host} resolves to no address"));
        }
        // One refused address refuses the name: a name that mixes them is not a plain Service.
        for a in &addrs {
            self.check(a.ip())
                .map_err(|why| format!("target {host:?} resolves to {why}"))?;
        }
        Ok(addrs
            .into_iter()
            .map(|a| SocketAddr::new(canonical(a.ip()), a.port()))
            .collect())
    }
}

/// Connects to the first of `addrs` that answers within what is left of `timeout`.
pub async fn connect(
    addrs: &[SocketAddr],
    timeout: Duration,
    what: &str,
) -> Result<TcpStream, String> {
    let attempt = async {
        let mut last = None;
        for a in addrs {
            match TcpStream::connect(a).await {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(format!("{a}: {e}")),
            }
        }
        Err(last.unwrap_or_else(|| "no address".into()))
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(format!("connecting to {what}: {e}")),
        Err(_) => Err(format!("connecting to {what}: timed out")),
    }
}

/// Refuses a Service that is not a plain in-cluster one: an ExternalName Service resolves to
/// whatever name it holds, inside the cluster or not. The agent's ServiceAccount needs `get` on
/// Services; without it every `.svc` target is refused, and the answer says so.
pub async fn check_service(
    kube: &kube::Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Result<(), String> {
    let path = format!("/api/v1/namespaces/{namespace}/services/{name}");
    let req = http::Request::get(&path)
        .body(Vec::new())
        .map_err(|e| format!("reading Service {namespace}/{name}: {e}"))?;
    let read = tokio::time::timeout(timeout, kube.request::<serde_json::Value>(req)).await;
    let service = match read {
        Ok(Ok(s)) => s,
        Ok(Err(kube::Error::Api(e))) if e.code == 404 => {
            return Err(format!("no Service {namespace}/{name}"));
        }
        Ok(Err(e)) => {
            return Err(format!(
                "cannot read Service {namespace}/{name} to check its type (the agent needs get \
                 on services): {e}"
            ));
        }
        Err(_) => return Err(format!("reading Service {namespace}/{name}: timed out")),
    };
    let kind = service
        .pointer("/spec/type")
        .and_then(|t| t.as_str())
        .unwrap_or("ClusterIP");
    if kind == "ExternalName" {
        return Err(format!(
            "Service {namespace}/{name} is of type ExternalName (a name outside the cluster's \
             control): the agent refuses it"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Issue 42, point 3: every spelling of loopback, unspecified and metadata addresses.
    #[test]
    fn refused_in_every_form() {
        let open = AddressPolicy::default();
        for bad in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "::ffff:127.0.0.1",
            "0.0.0.0",
            "0.1.2.3",
            "::",
            "::ffff:0.0.0.0",
            "169.254.169.254",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "fe80::1",
            "fd00:ec2::254",
            "255.255.255.255",
            "224.0.0.1",
            "ff02::1",
        ] {
            assert!(open.check(ip(bad)).is_err(), "{bad} allowed");
        }
        for ok in ["10.96.0.10", "192.168.1.5", "fd12::5", "::ffff:10.0.0.1"] {
            assert!(open.check(ip(ok)).is_ok(), "{ok} refused");
        }
    }

    #[test]
    fn allow_cidrs_narrow_and_name_loopback() {
        let p = AddressPolicy {
            allow_cidrs: vec![
                "10.96.0.0/12".parse().unwrap(),
                "0.0.0.0/0".parse().unwrap(),
            ],
        };
        assert!(p.check(ip("10.96.0.1")).is_ok());
        assert!(
            p.check(ip("127.0.0.1")).is_err(),
            "0.0.0.0/0 opened loopback"
        );
        assert!(p.check(ip("169.254.169.254")).is_err());
        let narrow = AddressPolicy {
            allow_cidrs: vec!["10.96.0.0/12".parse().unwrap()],
        };
        assert!(narrow.check(ip("10.112.0.1")).is_err());
        assert!(narrow.check(ip("::ffff:10.96.0.1")).is_ok());
        let lo = AddressPolicy {
            allow_cidrs: vec!["127.0.0.0/8".parse().unwrap()],
        };
        assert!(lo.check(ip("127.0.0.1")).is_ok() && lo.check(ip("::ffff:127.0.0.1")).is_ok());
        assert!(lo.check(ip("::1")).is_err() && lo.check(ip("10.0.0.1")).is_err());
    }

    #[tokio::test]
    async fn names_resolving_to_loopback_are_refused() {
        let open = AddressPolicy::default();
        let err = open
            .resolve("localhost", 80, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(err.contains("loopback"), "{err}");
    }
}
