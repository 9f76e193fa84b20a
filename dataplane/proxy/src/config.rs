//! Proxy configuration: one plain serde struct, validated once before anything binds.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::Error;

/// Tunables of the proxy core. Defaults suit a sidecar in front of one application.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct ProxyConfig {
    /// How long protocol detection waits for the client's first bytes. A client that sends
    /// nothing by then gets its connection to the application opened, and whichever side speaks
    /// first decides: the application's greeting (server-speaks-first protocols such as MySQL or
    /// SMTP) makes it opaque TCP, the client's bytes are detected as usual (an HTTP pool's spare
    /// connection, used later). Ports listed in `opaque_ports` skip detection entirely and pay no
    /// such delay.
    #[serde(with = "dur")]
    pub detect_timeout: Duration,
    /// Upstream TCP connect timeout; exceeding it answers 504 (HTTP) or closes the connection.
    #[serde(with = "dur")]
    pub connect_timeout: Duration,
    /// Time a client has to send a complete HTTP/1 request head (slowloris guard).
    #[serde(with = "dur")]
    pub header_read_timeout: Duration,
    /// A connection (either direction) with no bytes moving for this long is closed.
    #[serde(with = "dur")]
    pub idle_timeout: Duration,
    /// Grace period for in-flight work when draining.
    #[serde(with = "dur")]
    pub drain_grace: Duration,
    /// Largest HTTP/1 request head (request line + headers) and HTTP/2 header list, in bytes.
    /// Larger heads get 431. At least 8192 (hyper's floor).
    pub max_header_bytes: usize,
    /// Most request headers accepted; more get 431.
    pub max_headers: usize,
    /// Longest request target accepted; longer ones get 414.
    pub max_uri_len: usize,
    /// Idle HTTP/1 connections kept per upstream.
    pub pool_max_idle_per_upstream: usize,
    /// Idle pooled connections older than this are closed.
    #[serde(with = "dur")]
    pub pool_idle_timeout: Duration,
    /// Destination ports that are never sniffed: always opaque TCP.
    pub opaque_ports: Vec<u16>,
    /// Add `X-Forwarded-For` / `X-Forwarded-Proto` to proxied requests.
    pub forwarded_headers: bool,
    /// Fixed addresses for sandbox destinations, `"host:port" → "ip:port"`, consulted before
    /// DNS (like curl's `--resolve`). For running sidecars where the cluster's Service names do
    /// not resolve: on a workstation, or in tests that stand in for a cluster.
    pub resolve: BTreeMap<String, SocketAddr>,
    /// Forward plain HTTP/1.1 exchanges with the relay, which copies request and response heads
    /// as read (with the proxy's header edits) instead of parsing them into header maps and
    /// encoding them again; requests it does not handle byte for byte go to the full hyper path
    /// either way. Off sends every HTTP/1 connection down the full path (for comparison).
    pub http1_relay: bool,
    /// Serve HTTP/2 clients with the HTTP/2 relay, which drives each client connection and the
    /// pooled upstream connections with `h2` directly, every stream inside the client
    /// connection's task; off serves them with hyper's server and client (a task per stream
    /// and per request body), for comparison.
    pub http2_relay: bool,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            detect_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            drain_grace: Duration::from_secs(20),
            max_header_bytes: 64 * 1024,
            max_headers: 100,
            max_uri_len: 8 * 1024,
            pool_max_idle_per_upstream: 64,
            pool_idle_timeout: Duration::from_secs(90),
            opaque_ports: Vec::new(),
            forwarded_headers: true,
            resolve: BTreeMap::new(),
            http1_relay: true,
            http2_relay: true,
        }
    }
}

impl ProxyConfig {
    pub fn validate(&self) -> Result<(), Error> {
        let nonzero = [
            ("detectTimeout", self.detect_timeout),
            ("connectTimeout", self.connect_timeout),
            ("headerReadTimeout", self.header_read_timeout),
            ("idleTimeout", self.idle_timeout),
            ("poolIdleTimeout", self.pool_idle_timeout),
        ];
        for (name, d) in nonzero {
            if d.is_zero() {
                return Err(Error::Config(format!("{name} must be greater than zero")));
            }
        }
        if self.max_header_bytes < 8192 || self.max_header_bytes > 1024 * 1024 {
            return Err(Error::Config(
                "maxHeaderBytes must be between 8192 and 1048576".into(),
            ));
        }
        if self.max_headers == 0 || self.max_headers > 10_000 {
            return Err(Error::Config(
                "maxHeaders must be between 1 and 10000".into(),
            ));
        }
        if self.max_uri_len < 16 || self.max_uri_len > 1024 * 1024 {
            return Err(Error::Config(
                "maxUriLen must be between 16 and 1048576".into(),
            ));
        }
        if self.opaque_ports.contains(&0) {
            return Err(Error::Config("opaquePorts must not contain 0".into()));
        }
        for key in self.resolve.keys() {
            split_host_port(key)?;
        }
        Ok(())
    }
}

/// Splits a `resolve` key, `host:port`, where host is a DNS name or an IP (IPv6 in brackets).
pub(crate) fn split_host_port(key: &str) -> Result<(String, u16), Error> {
    let bad = || Error::Config(format!("resolve key {key:?}: expected host:port"));
    let (host, port) = key.rsplit_once(':').ok_or_else(bad)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.is_empty() || port == 0 || host.contains(char::is_whitespace) {
        return Err(bad());
    }
    Ok((host.to_ascii_lowercase(), port))
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_catches_values_hyper_would_panic_on() {
        assert!(ProxyConfig::default().validate().is_ok());
        let c = ProxyConfig {
            max_header_bytes: 100,
            ..Default::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("maxHeaderBytes")
        );
        let c = ProxyConfig {
            connect_timeout: Duration::ZERO,
            ..Default::default()
        };
        assert!(c.validate().is_err());
        let json = r#"{"detectTimeout":"200ms","opaquePorts":[3306]}"#;
        let c: ProxyConfig = serde_json::from_str(json).unwrap();
        assert_eq!(c.detect_timeout, Duration::from_millis(200));
        assert_eq!(c.opaque_ports, vec![3306]);
    }

    #[test]
    fn resolve_keys() {
        assert_eq!(
            split_host_port("Web.NS.svc:8080").unwrap(),
            ("web.ns.svc".to_string(), 8080)
        );
        assert_eq!(
            split_host_port("[::1]:80").unwrap(),
            ("::1".to_string(), 80)
        );
        for bad in ["web", "web:", ":80", "web:0", "web:99999", "a b:80"] {
            assert!(split_host_port(bad).is_err(), "{bad}");
        }
        let json = r#"{"resolve":{"web-sbx.ns.svc:80":"127.0.0.1:9000"}}"#;
        let c: ProxyConfig = serde_json::from_str(json).unwrap();
        assert!(c.validate().is_ok());
        let json = r#"{"resolve":{"web-sbx.ns.svc":"127.0.0.1:9000"}}"#;
        let c: ProxyConfig = serde_json::from_str(json).unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("host:port"));
    }
}
