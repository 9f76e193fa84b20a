//! The model rendered as Envoy v3 resources, one map per resource type, each with its own
//! version: a change that touches only routes bumps only the route configurations' version, so
//! streams re-send only those.

use std::collections::BTreeMap;
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::{Cluster, cluster};
use envoy_types::pb::envoy::config::core::v3::{
    AggregatedConfigSource, ApiVersion, ConfigSource, Locality, SocketAddress, address,
    config_source, socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::config::listener::v3::{ApiListener, Listener};
use envoy_types::pb::envoy::config::route::v3::{
    HeaderMatcher, QueryParameterMatcher, Route, RouteAction, RouteConfiguration, RouteMatch,
    VirtualHost, header_matcher, query_parameter_matcher, route, route_action, route_match,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, Rds, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{RegexMatcher, StringMatcher, string_matcher};
use envoy_types::pb::google::protobuf::{Any, UInt32Value};
use prost::{Message, Name};
use spur_api::carriers::{KeyExtractor, MatchKind, MatchOn};
use tokio::time::Instant;

// The resource types are their own module (the model names them too); their path stays here.
pub use super::kind::{KINDS, Kind};
use super::model::{Model, ServiceRoutes};

/// One resource type's resources and version.
#[derive(Debug, Clone, Default)]
pub struct Resources {
    /// Starts at 1 and grows by one whenever any resource of the type changes.
    pub version: u64,
    pub by_name: BTreeMap<String, Arc<Any>>,
}

/// Everything the server serves at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub model: Arc<Model>,
    pub types: [Resources; KINDS],
    /// When the model it renders was published (push latency is measured from here).
    pub published: Instant,
    /// False only for the empty snapshot before the first model: nothing is served from it.
    pub ready: bool,
    /// Grows by one whenever any node's EnvoyConfig changes.
    pub nodes_version: u64,
}

impl Default for Snapshot {
    fn default() -> Self {
        Snapshot {
            model: Arc::default(),
            types: Default::default(),
            published: Instant::now(),
            ready: false,
            nodes_version: 0,
        }
    }
}

impl Snapshot {
    pub fn resources(&self, kind: Kind) -> &Resources {
        &self.types[kind.index()]
    }

    /// The next snapshot: `model` rendered, each type's version bumped only if its resources
    /// differ from this snapshot's.
    pub fn next(&self, model: Arc<Model>) -> Snapshot {
        let mut types: [Resources; KINDS] = Default::default();
        for kind in Kind::ALL {
            let prev = self.resources(kind);
            // Listeners and routes come from the Services' routes, clusters and endpoints from
            // the endpoints: a change to one side does not re-encode the other.
            let same_input = match kind {
                Kind::Listener | Kind::Route => self.model.services == model.services,
                Kind::Cluster | Kind::Endpoint => self.model.clusters == model.clusters,
                // The cluster's own config has no secrets.
                Kind::Secret => true,
            };
            if prev.version > 0 && same_input {
                types[kind.index()] = prev.clone();
                continue;
            }
            let rendered = render(kind, &model);
            types[kind.index()] = if prev.version > 0 && prev.by_name == rendered {
                prev.clone()
            } else {
                Resources {
                    version: prev.version + 1,
                    by_name: rendered,
                }
            };
        }
        let nodes_version = if self.model.node_configs == model.node_configs {
            self.nodes_version
        } else {
            self.nodes_version + 1
        };
        Snapshot {
            model,
            types,
            published: Instant::now(),
            ready: true,
            nodes_version,
        }
    }
}

fn any<M: Message + Name>(m: &M) -> Arc<Any> {
    Arc::new(Any {
        type_url: M::type_url(),
        value: m.encode_to_vec(),
    })
}

fn render(kind: Kind, model: &Model) -> BTreeMap<String, Arc<Any>> {
    match kind {
        // Listener names are the client's own spelling of the target; rendered per stream
        // from these canonical ones (see `listener`).
        Kind::Listener => model
            .services
            .keys()
            .map(|n| (n.clone(), listener(n, n)))
            .collect(),
        Kind::Route => model
            .services
            .iter()
            .map(|(n, s)| (n.clone(), any(&route_configuration(n, s))))
            .collect(),
        Kind::Cluster => model
            .clusters
            .keys()
            .map(|n| (n.clone(), any(&eds_cluster(n))))
            .collect(),
        Kind::Endpoint => model
            .clusters
            .iter()
            .map(|(n, eps)| (n.clone(), any(&load_assignment(n, eps))))
            .collect(),
        Kind::Secret => BTreeMap::new(),
    }
}

fn ads() -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

/// A client-side (API) listener named as the client asked, whose routes come over RDS from
/// the route configuration `canonical`.
pub fn listener(requested: &str, canonical: &str) -> Arc<Any> {
    let router = HttpFilter {
        name: "envoy.filters.http.router".into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(
            (*any(&Router::default())).clone(),
        )),
        ..Default::default()
    };
    let hcm = HttpConnectionManager {
        stat_prefix: canonical.into(),
        http_filters: vec![router],
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: canonical.into(),
        })),
        ..Default::default()
    };
    any(&Listener {
        name: requested.into(),
        api_listener: Some(ApiListener {
            api_listener: Some((*any(&hcm)).clone()),
        }),
        ..Default::default()
    })
}

/// Every key carrier the sidecars of the Service's namespace read ([`KeyExtractor::key_matches`],
/// shared with the mesh modes): the configured query parameter and custom headers by exact
/// value, W3C `baggage` and `tracestate` members by regular expression, the OpenTracing/Jaeger
/// headers by exact value. A route matches when all its matchers do, so each carrier is its own
/// route. (gRPC's xDS clients skip a route with query parameter matchers: a gRPC call has no
/// query string.)
fn key_matchers(
    key: &str,
    carriers: &KeyExtractor,
) -> Vec<(Option<HeaderMatcher>, Option<QueryParameterMatcher>)> {
    carriers
        .key_matches(key)
        .into_iter()
        .map(|m| {
            let string_match = StringMatcher {
                match_pattern: Some(match m.kind {
                    MatchKind::Regex => string_matcher::MatchPattern::SafeRegex(RegexMatcher {
                        regex: m.value,
                        ..Default::default()
                    }),
                    MatchKind::Exact => string_matcher::MatchPattern::Exact(m.value),
                }),
                ignore_case: false,
            };
            match m.on {
                MatchOn::Header(name) => (
                    Some(HeaderMatcher {
                        name: name.into_owned(),
                        header_match_specifier: Some(
                            header_matcher::HeaderMatchSpecifier::StringMatch(string_match),
                        ),
                        ..Default::default()
                    }),
                    None,
                ),
                MatchOn::Query(name) => (
                    None,
                    Some(QueryParameterMatcher {
                        name: name.into(),
                        query_parameter_match_specifier: Some(
                            query_parameter_matcher::QueryParameterMatchSpecifier::StringMatch(
                                string_match,
                            ),
                        ),
                    }),
                ),
            }
        })
        .collect()
}

fn to_cluster(name: &str) -> Option<route::Action> {
    Some(route::Action::Route(RouteAction {
        cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(name.into())),
        ..Default::default()
    }))
}

fn route_configuration(name: &str, routes: &ServiceRoutes) -> RouteConfiguration {
    let matching =
        |header: Option<HeaderMatcher>, query: Option<QueryParameterMatcher>| RouteMatch {
            path_specifier: Some(route_match::PathSpecifier::Prefix("/".into())),
            headers: header.into_iter().collect(),
            query_parameters: query.into_iter().collect(),
            ..Default::default()
        };
    // Validated with the model (model::Carriers::build); the standard carriers alone if not.
    let carriers = KeyExtractor::new(&routes.carriers).unwrap_or_else(|e| {
        tracing::error!(error = %e, "routing-key carriers of {name}: the standard ones only");
        KeyExtractor::standard()
    });
    let mut out = Vec::with_capacity(routes.keyed.len() * 10 + 1);
    for k in &routes.keyed {
        for (i, (h, q)) in key_matchers(&k.key, &carriers).into_iter().enumerate() {
            out.push(Route {
                name: format!("{}/{}/{i}", k.sandbox, k.key),
                r#match: Some(matching(h, q)),
                action: to_cluster(&k.cluster),
                ..Default::default()
            });
        }
    }
    out.push(Route {
        name: "baseline".into(),
        r#match: Some(matching(None, None)),
        action: to_cluster(name),
        ..Default::default()
    });
    RouteConfiguration {
        name: name.into(),
        virtual_hosts: vec![VirtualHost {
            name: name.into(),
            // One route configuration per Service port: whatever authority the client uses.
            domains: vec!["*".into()],
            routes: out,
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn eds_cluster(name: &str) -> Cluster {
    Cluster {
        name: name.into(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: name.into(),
        }),
        lb_policy: cluster::LbPolicy::RoundRobin as i32,
        ..Default::default()
    }
}

fn load_assignment(name: &str, endpoints: &[std::net::SocketAddr]) -> ClusterLoadAssignment {
    let lb_endpoints = endpoints
        .iter()
        .map(|a| LbEndpoint {
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                address: Some(envoy_types::pb::envoy::config::core::v3::Address {
                    address: Some(address::Address::SocketAddress(SocketAddress {
                        address: a.ip().to_string(),
                        port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(
                            a.port(),
                        ))),
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            })),
            ..Default::default()
        })
        .collect();
    ClusterLoadAssignment {
        cluster_name: name.into(),
        // gRPC ignores a locality without a weight.
        endpoints: vec![LocalityLbEndpoints {
            locality: Some(Locality::default()),
            lb_endpoints,
            load_balancing_weight: Some(UInt32Value { value: 1 }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xds::model::KeyRoute;

    fn model() -> Model {
        let mut m = Model::default();
        m.services.insert(
            "api.default.svc:80".into(),
            ServiceRoutes {
                keyed: vec![KeyRoute {
                    key: "k1.x".into(),
                    sandbox: "sb1".into(),
                    cluster: "sb1-api.default.svc:80".into(),
                }],
                carriers: Default::default(),
            },
        );
        m.services
            .insert("sb1-api.default.svc:80".into(), ServiceRoutes::default());
        m.clusters.insert(
            "api.default.svc:80".into(),
            vec!["10.0.0.1:8080".parse().unwrap()],
        );
        m.clusters.insert("sb1-api.default.svc:80".into(), vec![]);
        m
    }

    #[test]
    fn versions_move_per_type() {
        let s1 = Snapshot::default().next(Arc::new(model()));
        assert!(Kind::ALL.iter().all(|k| s1.resources(*k).version == 1));
        // An endpoint change: only EDS moves.
        let mut m = model();
        m.clusters.insert(
            "sb1-api.default.svc:80".into(),
            vec!["10.0.0.9:8080".parse().unwrap()],
        );
        let s2 = s1.next(Arc::new(m.clone()));
        let v: Vec<_> = Kind::ALL.iter().map(|k| s2.resources(*k).version).collect();
        assert_eq!(v, [1, 1, 1, 2, 1]);
        // A new key: only RDS moves.
        m.services
            .get_mut("api.default.svc:80")
            .unwrap()
            .keyed
            .push(KeyRoute {
                key: "k2".into(),
                sandbox: "sb2".into(),
                cluster: "sb1-api.default.svc:80".into(),
            });
        let s3 = s2.next(Arc::new(m));
        let v: Vec<_> = Kind::ALL.iter().map(|k| s3.resources(*k).version).collect();
        assert_eq!(v, [1, 2, 1, 2, 1]);
    }

    #[test]
    fn routes_match_every_carrier_then_fall_back_to_the_baseline() {
        let m = model();
        let rc = route_configuration("api.default.svc:80", &m.services["api.default.svc:80"]);
        // Without configured carriers: the standard ones, headers only.
        assert!(
            rc.virtual_hosts[0].routes.iter().all(|r| r
                .r#match
                .as_ref()
                .unwrap()
                .query_parameters
                .is_empty())
        );
        let routes = &rc.virtual_hosts[0].routes;
        assert_eq!(
            routes.len(),
            2 + spur_routing::extract::LEGACY_HEADERS.len() + 1
        );
        assert_eq!(routes.last().unwrap().name, "baseline");
        let re = |r: &Route| match &r.r#match.as_ref().unwrap().headers[0].header_match_specifier {
            Some(header_matcher::HeaderMatchSpecifier::StringMatch(StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::SafeRegex(re)),
                ..
            })) => re.regex.clone(),
            other => panic!("{other:?}"),
        };
        let baggage = regex_lite(&re(&routes[0]));
        for (v, want) in [
            ("sd-routing-key=k1.x", true),
            ("a=1, sd-routing-key = k1.x ;p=2,b=3", true),
            ("spur-routing-key=k1.x,a=1", true),
            ("sd-routing-key=k1.xy", false),
            ("sd-routing-key=k1Zx", false),
            ("a=1;sd-routing-key=k1.x", false),
            ("xsd-routing-key=k1.x", false),
        ] {
            assert_eq!(baggage(v), want, "baggage {v:?}");
        }
        let tracestate = regex_lite(&re(&routes[1]));
        assert!(tracestate("vendor=x,sd-routing-key=k1.x"));
        assert!(!tracestate("sd-routing-key=k1.x;p"));
    }

    /// The `regex` crate's syntax is RE2's for everything these patterns use.
    fn regex_lite(pattern: &str) -> impl Fn(&str) -> bool + use<> {
        let re = ::regex::Regex::new(pattern).unwrap();
        move |s| re.is_match(s)
    }

    /// The configured carriers are routes of their own, first: the query parameter as a query
    /// parameter matcher, each custom header as an exact header matcher.
    #[test]
    fn configured_carriers_are_routes_too() {
        let mut routes = model().services["api.default.svc:80"].clone();
        routes.carriers = spur_api::carriers::ExtractConfig {
            custom_headers: vec!["x-route-to".into()],
            query_param: Some("sd-routing-key".into()),
        };
        let rc = route_configuration("api.default.svc:80", &routes);
        let r = &rc.virtual_hosts[0].routes;
        assert_eq!(
            r.len(),
            2 + 2 + spur_routing::extract::LEGACY_HEADERS.len() + 1
        );
        let q = &r[0].r#match.as_ref().unwrap();
        assert!(q.headers.is_empty());
        assert_eq!(q.query_parameters.len(), 1);
        assert_eq!(q.query_parameters[0].name, "sd-routing-key");
        let exact = |m: &Option<query_parameter_matcher::QueryParameterMatchSpecifier>| match m {
            Some(query_parameter_matcher::QueryParameterMatchSpecifier::StringMatch(s)) => {
                s.match_pattern.clone()
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(
            exact(&q.query_parameters[0].query_parameter_match_specifier),
            Some(string_matcher::MatchPattern::Exact("k1.x".into()))
        );
        let h = &r[1].r#match.as_ref().unwrap().headers;
        assert_eq!(h[0].name, "x-route-to");
        assert_eq!(r[2].r#match.as_ref().unwrap().headers[0].name, "baggage");
    }
}
