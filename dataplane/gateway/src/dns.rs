//! DNS endpoints' addresses, looked up again when their records expire.
//!
//! Lookups go through `hickory-resolver` with the system's configuration (`/etc/resolv.conf`:
//! name servers, search domains, `ndots`; `/etc/hosts`), or with one given name server, so the
//! answer's TTL is known: a name is resolved again when its records expire, but never sooner
//! than [`MIN_REFRESH`] (a TTL of 0 would otherwise mean a lookup per tick) and never later
//! than the gateway's DNS interval (a cap, for answers without a meaningful TTL such as
//! `/etc/hosts` and IP literals). A failed lookup keeps the last addresses and is tried again
//! after [`RETRY`] (or the interval, if shorter).
//!
//! Without a readable resolver configuration the system resolver (`getaddrinfo`, which tells
//! no TTL) is used, every interval.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;

/// The soonest a name is looked up again after an answer.
pub(crate) const MIN_REFRESH: Duration = Duration::from_secs(1);
/// When a failed lookup is tried again (capped by the interval).
pub(crate) const RETRY: Duration = Duration::from_secs(5);
/// One lookup's bound.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// Most addresses one name contributes.
const MAX_ADDRESSES: usize = 64;

/// One successful lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    /// Sorted, deduplicated, at most [`MAX_ADDRESSES`].
    pub(crate) ips: Vec<IpAddr>,
    /// How long until the name is looked up again: the records' TTL within
    /// [`MIN_REFRESH`]..=interval.
    pub(crate) refresh_in: Duration,
}

pub(crate) struct Dns {
    resolver: Option<TokioResolver>,
    interval: Duration,
}

impl Dns {
    /// A resolver from the system's configuration, or from `server` alone.
    pub(crate) fn new(server: Option<SocketAddr>, interval: Duration) -> Dns {
        let built = match server {
            Some(addr) => {
                let mut udp = ConnectionConfig::udp();
                udp.port = addr.port();
                let mut tcp = ConnectionConfig::tcp();
                tcp.port = addr.port();
                let config = ResolverConfig::from_name_servers(vec![NameServerConfig::new(
                    addr.ip(),
                    true,
                    vec![udp, tcp],
                )]);
                Ok(TokioResolver::builder_with_config(
                    config,
                    TokioRuntimeProvider::default(),
                ))
            }
            None => TokioResolver::builder_tokio(),
        };
        let resolver = built
            .and_then(|mut b| {
                let opts: &mut ResolverOpts = b.options_mut();
                // Every address of a name, as getaddrinfo gives them: a cluster's endpoints
                // may be of either family.
                opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
                opts.timeout = LOOKUP_TIMEOUT / 2;
                b.build()
            })
            .inspect_err(|e| {
                tracing::warn!(error = %e, ?interval, "cannot set up the DNS resolver from the system's configuration; using getaddrinfo, which tells no TTL, every interval");
            })
            .ok();
        Dns { resolver, interval }
    }

    /// The addresses of `name` and when to look again.
    pub(crate) async fn lookup(&self, name: &str) -> Result<Answer, String> {
        let Some(resolver) = &self.resolver else {
            return self.lookup_system(name).await;
        };
        let found = tokio::time::timeout(LOOKUP_TIMEOUT, resolver.lookup_ip(name))
            .await
            .map_err(|_| format!("no answer within {LOOKUP_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())?;
        let ttl = found
            .valid_until()
            .saturating_duration_since(std::time::Instant::now());
        answer(found.iter().collect(), ttl, self.interval)
    }

    async fn lookup_system(&self, name: &str) -> Result<Answer, String> {
        let found = tokio::time::timeout(LOOKUP_TIMEOUT, tokio::net::lookup_host((name, 0)))
            .await
            .map_err(|_| format!("no answer within {LOOKUP_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())?;
        answer(
            found.map(|a| a.ip()).collect(),
            self.interval,
            self.interval,
        )
    }

    /// When a failed lookup is tried again.
    pub(crate) fn retry_in(&self) -> Duration {
        RETRY.min(self.interval)
    }
}

fn answer(mut ips: Vec<IpAddr>, ttl: Duration, interval: Duration) -> Result<Answer, String> {
    ips.sort();
    ips.dedup();
    ips.truncate(MAX_ADDRESSES);
    if ips.is_empty() {
        return Err("no addresses".into());
    }
    Ok(Answer {
        ips,
        refresh_in: ttl.clamp(MIN_REFRESH.min(interval), interval),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const INTERVAL: Duration = Duration::from_secs(30);

    // What follows a record's TTL end to end (a name server on loopback, the gateway, the
    // route server) is tests/tests/kube_l4.rs, `a_dns_endpoint_follows_its_records`.

    #[test]
    fn the_ttl_is_kept_within_the_floor_and_the_interval() {
        let ips = || vec![IpAddr::from([10, 0, 0, 2]), IpAddr::from([10, 0, 0, 1])];
        let a = answer(ips(), Duration::from_secs(7), INTERVAL).unwrap();
        assert_eq!(a.refresh_in, Duration::from_secs(7));
        assert_eq!(
            a.ips,
            [IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2])]
        );
        let zero = answer(ips(), Duration::ZERO, INTERVAL).unwrap();
        assert_eq!(zero.refresh_in, MIN_REFRESH);
        let day = answer(ips(), Duration::from_secs(86_400), INTERVAL).unwrap();
        assert_eq!(day.refresh_in, INTERVAL);
        // An interval below the floor wins.
        let short = answer(ips(), Duration::ZERO, Duration::from_millis(200)).unwrap();
        assert_eq!(short.refresh_in, Duration::from_millis(200));
        let many: Vec<IpAddr> = (0..=255).map(|i| IpAddr::from([10, 0, 1, i])).collect();
        assert_eq!(
            answer(many, MIN_REFRESH, INTERVAL).unwrap().ips.len(),
            MAX_ADDRESSES
        );
    }

    #[tokio::test]
    async fn no_addresses_or_no_server_is_an_error() {
        assert!(answer(Vec::new(), MIN_REFRESH, INTERVAL).is_err());
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap();
        drop(socket);
        let dns = Dns::new(Some(addr), INTERVAL);
        assert!(dns.lookup("gone.example.").await.is_err());
        assert_eq!(dns.retry_in(), RETRY);
    }
}
