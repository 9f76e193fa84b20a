//! What is known about one inbound connection, below every other module of the proxy: the
//! protocol servers, the router and the header code read it; only the listener creates it.

use std::net::SocketAddr;

use crate::detect::Protocol;

/// What the proxy knows about one inbound connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnMeta {
    pub client: SocketAddr,
    pub local: SocketAddr,
    /// Where the client meant to go; its port is the workload port used for rule lookup.
    pub original_dst: SocketAddr,
    pub protocol: Protocol,
    /// `client`'s IP as a header value, rendered once per connection for `X-Forwarded-For`.
    pub client_ip: http::HeaderValue,
}

impl ConnMeta {
    pub fn new(
        client: SocketAddr,
        local: SocketAddr,
        original_dst: SocketAddr,
        protocol: Protocol,
    ) -> Self {
        let client_ip = http::HeaderValue::from_str(&client.ip().to_string())
            .unwrap_or_else(|_| http::HeaderValue::from_static("unknown"));
        ConnMeta {
            client,
            local,
            original_dst,
            protocol,
            client_ip,
        }
    }
}
