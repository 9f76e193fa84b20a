use std::fmt;

/// Everything that can go wrong in this crate: invalid configuration or invalid rules. Hostile
/// request input never produces an error here; it simply yields no routing key.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configured custom routing header is not a valid HTTP header name.
    #[error("invalid routing header name {name:?}")]
    InvalidHeaderName { name: String },
    /// A configured custom routing header is one of the standard carriers (`baggage`, ...):
    /// written as a bare key it would replace that header's other members.
    #[error(
        "routing header {name:?} is a standard carrier, read and written already; custom headers carry a bare key"
    )]
    StandardHeader { name: String },
    /// A configured custom header is one that HTTP, proxies or Spur's own front doors give a
    /// meaning (framing, hop-by-hop, the host, credentials, forwarding): writing a key into it
    /// would break requests.
    #[error(
        "routing header {name:?} is reserved (framing, hop-by-hop, host, credentials or forwarding); choose a header of your own"
    )]
    ReservedHeader { name: String },
    /// A configured query parameter name is empty or contains characters outside `[A-Za-z0-9._-]`.
    #[error("invalid routing query parameter name {name:?}")]
    InvalidQueryParam { name: String },
    /// A routing rule failed validation; `rule` locates it (index and routing key).
    #[error("invalid routing rule {rule}: {reason}")]
    InvalidRule { rule: RuleRef, reason: String },
    /// A rule document is not a YAML/JSON list of rules (or a `routingRules` object).
    #[error("not a rule document: {reason}")]
    Document { reason: String },
    /// A route-history span failed validation.
    #[error("invalid route history span (routingKey {routing_key:?}): {reason}")]
    InvalidSpan { routing_key: String, reason: String },
    /// Two rules share the same (baseline, routing key).
    #[error("duplicate routing rule for routing key {routing_key:?} and baseline {baseline}")]
    DuplicateRule {
        routing_key: String,
        baseline: String,
    },
}

/// Where an invalid rule sits in its source, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleRef {
    pub index: usize,
    pub routing_key: String,
}

impl fmt::Display for RuleRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} (routingKey {:?})", self.index, self.routing_key)
    }
}
