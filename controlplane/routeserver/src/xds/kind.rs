//! The xDS resource types the server serves (LDS, RDS, CDS, EDS, SDS), in the order a client
//! needs them: rendered resources and users' own are both kept by type.

/// The resource types served, in the order a client needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Listener,
    Route,
    Cluster,
    Endpoint,
    /// SDS: only a node with an EnvoyConfig that names Secrets has any.
    Secret,
}

/// How many resource types are served.
pub const KINDS: usize = 5;

impl Kind {
    pub const ALL: [Kind; KINDS] = [
        Kind::Listener,
        Kind::Route,
        Kind::Cluster,
        Kind::Endpoint,
        Kind::Secret,
    ];

    pub fn type_url(self) -> &'static str {
        match self {
            Kind::Listener => "type.googleapis.com/envoy.config.listener.v3.Listener",
            Kind::Route => "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
            Kind::Cluster => "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            Kind::Endpoint => "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            Kind::Secret => "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
        }
    }

    pub fn from_type_url(url: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.type_url() == url)
    }

    /// Short label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Listener => "lds",
            Kind::Route => "rds",
            Kind::Cluster => "cds",
            Kind::Endpoint => "eds",
            Kind::Secret => "sds",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether a state-of-the-world response carries every subscribed resource of the type, so
    /// that one left out is deleted (LDS and CDS), rather than only the changed ones.
    pub fn full_state(self) -> bool {
        matches!(self, Kind::Listener | Kind::Cluster)
    }
}
