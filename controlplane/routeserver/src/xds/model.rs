//! What the xDS server serves, in Spur's terms: every Service port of the cluster, the routing
//! keys that divert its traffic to a sandbox Service, and the endpoints behind each Service port.
//!
//! Built from the same RoutingConfigs that feed the Routes API, plus Services and EndpointSlices,
//! so a proxyless client and a Spur sidecar route one key the same way.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;
use k8s_openapi::api::core::v1::{Secret, Service, ServicePort};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use spur_api::common::service_host;
use spur_api::envoyconfig::{EnvoyResourceType, SECRET_LABEL, SecretBlueprint};
use spur_api::{EnvoyConfigRevision, RoutingConfig};

use super::render::KINDS;

/// The label that ties an EndpointSlice to its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The desired xDS state of the whole cluster. Names are `<name>.<namespace>.svc:<port>`, the
/// same for a Service port's listener, route configuration and cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Model {
    pub services: BTreeMap<String, ServiceRoutes>,
    /// Ready endpoints of every Service port, by cluster name.
    pub clusters: BTreeMap<String, Vec<SocketAddr>>,
    /// Users' own Envoy resources (EnvoyConfig), by node id: a node listed here is served
    /// these instead of the cluster's.
    pub node_configs: BTreeMap<String, Arc<NodeConfig>>,
}

/// The published revision of an EnvoyConfig, as served to its node id.
#[derive(Clone, PartialEq, Eq)]
pub struct NodeConfig {
    /// `namespace/name` of the EnvoyConfigRevision.
    /// Shared with every stream that serves it (each one tags what it sends with it).
    pub revision: Arc<str>,
    /// The revision's namespace: its secrets go only to clients whose certificate is of it.
    pub namespace: String,
    /// Its version, which every response from it carries.
    pub version: String,
    /// The SDS version: the revision's, and a digest of the secrets' bytes, so that a Secret
    /// that changes under one revision is a new version too.
    pub secrets_version: String,
    /// Resources by type ([`super::render::Kind::index`]) and name.
    pub types: [BTreeMap<String, Arc<Any>>; KINDS],
    /// Secrets the revision names that cannot be served, each with the reason.
    pub unresolved_secrets: Vec<String>,
}

// By hand: the secrets' bytes hold private keys, which no log line may carry.
impl std::fmt::Debug for NodeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeConfig")
            .field("revision", &self.revision)
            .field("version", &self.version)
            .field("secrets_version", &self.secrets_version)
            .field(
                "resources",
                &self.types.iter().map(BTreeMap::len).collect::<Vec<_>>(),
            )
            .field("unresolved_secrets", &self.unresolved_secrets)
            .finish()
    }
}

/// The Secrets SDS may serve: those labelled `spur.dev/envoy-secret=true` in the namespaces the
/// route server watches (none unless it is told to).
#[derive(Clone, Copy, Default)]
pub struct TlsSecrets<'a> {
    pub namespaces: &'a [String],
    pub secrets: &'a [Arc<Secret>],
}

/// The routes of one Service port: each key's sandbox cluster, then the baseline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceRoutes {
    /// In routing-key order; at most one entry per key.
    pub keyed: Vec<KeyRoute>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRoute {
    pub key: String,
    pub sandbox: String,
    pub cluster: String,
}

/// `host:port`, the one naming scheme of every resource.
pub fn resource_name(host: &str, port: i32) -> String {
    format!("{host}:{port}")
}

impl Model {
    /// The model of a cluster. RoutingConfigs must come in a stable order: when two give one
    /// Service port a route for the same key, the first wins, as in the Routes API's index.
    pub fn build(
        services: &[Arc<Service>],
        configs: &[Arc<RoutingConfig>],
        slices: &[Arc<EndpointSlice>],
    ) -> Model {
        let mut by_service: BTreeMap<(String, String), Vec<&EndpointSlice>> = BTreeMap::new();
        for s in slices {
            let (Some(ns), Some(svc)) = (s.namespace(), s.labels().get(SERVICE_NAME_LABEL)) else {
                continue;
            };
            by_service.entry((ns, svc.clone())).or_default().push(s);
        }
        let mut model = Model::default();
        for svc in services {
            let (Some(ns), Some(spec)) = (svc.namespace(), svc.spec.as_ref()) else {
                continue;
            };
            // An ExternalName Service has no endpoints to balance over.
            if spec.type_.as_deref() == Some("ExternalName") {
                continue;
            }
            let host = service_host(&svc.name_any(), &ns);
            let svc_slices = by_service
                .get(&(ns.clone(), svc.name_any()))
                .map_or(&[][..], |v| &v[..]);
            for port in spec.ports.iter().flatten() {
                // UDP and SCTP ports carry no gRPC.
                if port.protocol.as_deref().is_some_and(|p| p != "TCP") {
                    continue;
                }
                let name = resource_name(&host, port.port);
                model
                    .clusters
                    .insert(name.clone(), endpoints(port, svc_slices));
                model.services.insert(name, ServiceRoutes::default());
            }
        }
        let mut seen: BTreeSet<(String, String)> = BTreeSet::new();
        for rc in configs {
            let key = &rc.spec.routing_key;
            let routes = rc
                .status
                .as_ref()
                .and_then(|s| s.route_server.as_ref())
                .map_or(&[][..], |r| &r.routes[..]);
            for r in routes {
                let from = resource_name(&r.from_host, r.from_port);
                let to = resource_name(&r.to_host, r.to_port);
                // The first config to claim a key for a Service port keeps it, as in the Routes
                // API's index, even while its sandbox Service does not exist yet: until then the
                // baseline keeps the key's calls (they would go nowhere).
                if !seen.insert((from.clone(), key.clone())) || !model.clusters.contains_key(&to) {
                    continue;
                }
                if let Some(s) = model.services.get_mut(&from) {
                    s.keyed.push(KeyRoute {
                        key: key.clone(),
                        sandbox: r.sandbox.clone(),
                        cluster: to,
                    });
                }
            }
        }
        for s in model.services.values_mut() {
            s.keyed.sort_by(|a, b| a.key.cmp(&b.key));
        }
        model
    }

    /// Adds the published EnvoyConfig revisions, their secrets generated from `secrets`. For
    /// one node id the latest-published wins: the operator labels a new revision before it
    /// unlabels the old one, so for a moment both are published.
    pub fn with_node_configs(
        mut self,
        revisions: &[Arc<EnvoyConfigRevision>],
        secrets: TlsSecrets<'_>,
    ) -> Model {
        use base64::Engine;
        let mut latest: BTreeMap<&str, &EnvoyConfigRevision> = BTreeMap::new();
        let when = |r: &EnvoyConfigRevision| {
            (
                r.status.as_ref().and_then(|s| s.last_published_at.clone()),
                r.name_any(),
            )
        };
        for r in revisions {
            let entry = latest.entry(r.spec.node_id.as_str()).or_insert(r);
            if when(r) > when(entry) {
                *entry = r;
            }
        }
        let by_key: BTreeMap<(&str, &str), &Secret> = secrets
            .secrets
            .iter()
            .filter_map(|s| {
                Some((
                    (
                        s.metadata.namespace.as_deref()?,
                        s.metadata.name.as_deref()?,
                    ),
                    &**s,
                ))
            })
            .collect();
        for (node, rev) in latest {
            let namespace = rev.namespace().unwrap_or_default();
            let mut types: [BTreeMap<String, Arc<Any>>; KINDS] = Default::default();
            let mut unresolved = Vec::new();
            let mut digest = std::hash::DefaultHasher::new();
            for res in &rev.spec.resources {
                let i = match res.type_ {
                    EnvoyResourceType::Listener => 0,
                    EnvoyResourceType::Route => 1,
                    EnvoyResourceType::Cluster => 2,
                    EnvoyResourceType::Endpoint => 3,
                    EnvoyResourceType::Secret => 4,
                };
                let value = if res.type_ == EnvoyResourceType::Secret {
                    let from = res.generate_from_tls_secret.as_deref().unwrap_or(&res.name);
                    let secret = if !secrets.namespaces.contains(&namespace) {
                        Err(format!(
                            "namespace {namespace} is not one the route server reads Secrets in (chart value xds.sds.namespaces)"
                        ))
                    } else {
                        by_key
                            .get(&(namespace.as_str(), from))
                            .ok_or_else(|| format!("no Secret labelled {SECRET_LABEL}=true"))
                            .and_then(|s| {
                                sds_secret(&res.name, s, res.blueprint.unwrap_or_default())
                            })
                    };
                    match secret {
                        Ok(bytes) => {
                            std::hash::Hash::hash(&(&res.name, &bytes), &mut digest);
                            bytes
                        }
                        Err(why) => {
                            unresolved.push(format!("Secret {namespace}/{from}: {why}"));
                            continue;
                        }
                    }
                } else {
                    match base64::engine::general_purpose::STANDARD.decode(&res.value) {
                        Ok(v) => v,
                        Err(e) => {
                            // The operator wrote it; only a hand-edited revision gets here.
                            tracing::warn!(revision = %rev.name_any(), resource = %res.name, error = %e, "EnvoyConfigRevision resource is not base64; left out");
                            continue;
                        }
                    }
                };
                types[i].insert(
                    res.name.clone(),
                    Arc::new(Any {
                        type_url: res.type_.type_url(),
                        value,
                    }),
                );
            }
            let secrets_version = if types[4].is_empty() {
                rev.spec.version.clone()
            } else {
                format!(
                    "{}.{:016x}",
                    rev.spec.version,
                    std::hash::Hasher::finish(&digest)
                )
            };
            self.node_configs.insert(
                node.to_owned(),
                Arc::new(NodeConfig {
                    revision: format!("{namespace}/{}", rev.name_any()).into(),
                    namespace,
                    version: rev.spec.version.clone(),
                    secrets_version,
                    types,
                    unresolved_secrets: unresolved,
                }),
            );
        }
        self
    }
}

/// An Envoy SDS secret from a `kubernetes.io/tls` Secret, encoded; or why there is none.
fn sds_secret(name: &str, secret: &Secret, blueprint: SecretBlueprint) -> Result<Vec<u8>, String> {
    use envoy_types::pb::envoy::config::core::v3::{DataSource, data_source::Specifier};
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tls;
    use prost::Message as _;
    if secret.type_.as_deref() != Some("kubernetes.io/tls") {
        return Err(format!(
            "of type {}, not kubernetes.io/tls",
            secret.type_.as_deref().unwrap_or("Opaque")
        ));
    }
    let data = secret.data.as_ref();
    let field = |key: &str| {
        data.and_then(|d| d.get(key))
            .filter(|v| !v.0.is_empty())
            .map(|v| DataSource {
                specifier: Some(Specifier::InlineBytes(v.0.clone())),
                ..Default::default()
            })
    };
    let missing = |key: &str| format!("has no {key}");
    let kind = match blueprint {
        SecretBlueprint::TlsCertificate => tls::secret::Type::TlsCertificate(tls::TlsCertificate {
            certificate_chain: Some(field("tls.crt").ok_or_else(|| missing("tls.crt"))?),
            private_key: Some(field("tls.key").ok_or_else(|| missing("tls.key"))?),
            ..Default::default()
        }),
        SecretBlueprint::ValidationContext => {
            tls::secret::Type::ValidationContext(tls::CertificateValidationContext {
                trusted_ca: Some(
                    field("ca.crt")
                        .or_else(|| field("tls.crt"))
                        .ok_or_else(|| missing("ca.crt or tls.crt"))?,
                ),
                ..Default::default()
            })
        }
    };
    Ok(tls::Secret {
        name: name.to_owned(),
        r#type: Some(kind),
    }
    .encode_to_vec())
}

/// The ready addresses behind one Service port: the slices' port of the same name (the
/// Service's target port, resolved by the EndpointSlice controller per pod).
fn endpoints(port: &ServicePort, slices: &[&EndpointSlice]) -> Vec<SocketAddr> {
    let want = port.name.as_deref().unwrap_or("");
    let mut out = BTreeSet::new();
    for s in slices {
        if !matches!(s.address_type.as_str(), "IPv4" | "IPv6") {
            continue;
        }
        let Some(target) = s
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref().unwrap_or("") == want)
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok())
        else {
            continue;
        };
        for e in &s.endpoints {
            // No condition means ready (the API's own reading of an unset field).
            if e.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            for a in &e.addresses {
                if let Ok(ip) = a.parse::<IpAddr>() {
                    out.insert(SocketAddr::new(ip, target));
                }
            }
        }
    }
    out.into_iter().collect()
}

/// The Service-port name a client's listener name stands for: `<svc>.<ns>[.svc[.<domain>]][:port]`
/// (trailing dot allowed). Without a port, a Service with a single port is meant.
pub fn canonical_listener(model: &Model, requested: &str, cluster_domain: &str) -> Option<String> {
    let (host, port) = match requested.rsplit_once(':') {
        // Digits only, no leading zero: one spelling per port, so a client cannot make the
        // server render the same listener under endless names.
        Some((h, p)) if !p.starts_with('0') && p.bytes().all(|b| b.is_ascii_digit()) => {
            (h, Some(p.parse::<u16>().ok()?))
        }
        Some(_) => return None,
        None => (requested, None),
    };
    let host = host.strip_suffix('.').unwrap_or(host);
    let host = host
        .strip_suffix(cluster_domain)
        .and_then(|h| h.strip_suffix('.'))
        .unwrap_or(host);
    let host = host.strip_suffix(".svc").unwrap_or(host);
    let (name, ns) = host.split_once('.')?;
    if name.is_empty() || ns.is_empty() || ns.contains('.') {
        return None;
    }
    let base = service_host(name, ns);
    match port {
        Some(p) => {
            let n = resource_name(&base, i32::from(p));
            model.services.contains_key(&n).then_some(n)
        }
        None => {
            let prefix = format!("{base}:");
            let mut ports = model.services.range(prefix.clone()..).map(|(k, _)| k);
            let first = ports.next().filter(|k| k.starts_with(&prefix))?;
            let more = ports.next().is_some_and(|k| k.starts_with(&prefix));
            (!more).then(|| first.clone())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(ns: &str, name: &str, ports: &[(&str, i32)]) -> Arc<Service> {
        let ports: Vec<_> = ports
            .iter()
            .map(|(n, p)| json!({"name": n, "port": p, "protocol": "TCP"}))
            .collect();
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": ns},
                "spec": {"ports": ports},
            }))
            .unwrap(),
        )
    }

    fn slice(ns: &str, svc: &str, port: (&str, i32), ips: &[(&str, bool)]) -> Arc<EndpointSlice> {
        let endpoints: Vec<_> = ips
            .iter()
            .map(|(ip, ready)| json!({"addresses": [ip], "conditions": {"ready": ready}}))
            .collect();
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": format!("{svc}-x"), "namespace": ns,
                             "labels": {SERVICE_NAME_LABEL: svc}},
                "addressType": "IPv4",
                "ports": [{"name": port.0, "port": port.1}],
                "endpoints": endpoints,
            }))
            .unwrap(),
        )
    }

    fn config(key: &str, sandbox: &str, from: (&str, i32), to: (&str, i32)) -> Arc<RoutingConfig> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": sandbox},
                "spec": {"routingKey": key, "workloads": []},
                "status": {"routeServer": {"routes": [{
                    "fromHost": from.0, "fromPort": from.1, "toHost": to.0, "toPort": to.1,
                    "workloadPort": 8080, "sandbox": sandbox,
                    "baseline": {"kind": "Deployment", "namespace": "default", "name": "api"},
                }]}},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn services_endpoints_and_keyed_routes() {
        let services = [
            svc("default", "api", &[("grpc", 80), ("metrics", 9090)]),
            svc("default", "sb1-api", &[("grpc", 80)]),
        ];
        let slices = [
            slice(
                "default",
                "api",
                ("grpc", 8080),
                &[("10.0.0.1", true), ("10.0.0.2", false)],
            ),
            slice("default", "sb1-api", ("grpc", 8081), &[("10.0.0.3", true)]),
        ];
        let configs = [
            config(
                "k1",
                "sb1",
                ("api.default.svc", 80),
                ("sb1-api.default.svc", 80),
            ),
            // Same key again: the first config keeps it.
            config(
                "k1",
                "sb2",
                ("api.default.svc", 80),
                ("api.default.svc", 9090),
            ),
            // A sandbox Service that does not exist yet: no route.
            config(
                "k3",
                "sb3",
                ("api.default.svc", 80),
                ("sb3-api.default.svc", 80),
            ),
        ];
        let m = Model::build(&services, &configs, &slices);
        assert_eq!(
            m.clusters["api.default.svc:80"],
            vec!["10.0.0.1:8080".parse().unwrap()]
        );
        assert!(m.clusters["api.default.svc:9090"].is_empty());
        assert_eq!(
            m.services["api.default.svc:80"].keyed,
            vec![KeyRoute {
                key: "k1".into(),
                sandbox: "sb1".into(),
                cluster: "sb1-api.default.svc:80".into()
            }]
        );
        assert!(m.services["sb1-api.default.svc:80"].keyed.is_empty());
    }

    #[test]
    fn listener_names_clients_may_use() {
        let services = [
            svc("default", "api", &[("grpc", 80), ("metrics", 9090)]),
            svc("ns2", "one", &[("", 50051)]),
        ];
        let m = Model::build(&services, &[], &[]);
        let c = |n: &str| canonical_listener(&m, n, "cluster.local");
        for n in [
            "api.default:80",
            "api.default.svc:80",
            "api.default.svc.cluster.local:80",
            "api.default.svc.cluster.local.:80",
        ] {
            assert_eq!(c(n).as_deref(), Some("api.default.svc:80"), "{n}");
        }
        assert_eq!(c("one.ns2").as_deref(), Some("one.ns2.svc:50051"));
        // Two ports: which one is ambiguous.
        assert_eq!(c("api.default"), None);
        for n in [
            "api:80",
            "api.default:81",
            "api.default:x",
            "a.b.c.d:80",
            ".default:80",
            "",
        ] {
            assert_eq!(c(n), None, "{n}");
        }
    }

    fn revision(
        name: &str,
        node: &str,
        published_at: &str,
        value: &str,
    ) -> Arc<EnvoyConfigRevision> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "EnvoyConfigRevision",
                "metadata": {"name": name, "namespace": "edge"},
                "spec": {"nodeID": node, "version": name, "resources": [
                    {"type": "cluster", "name": "c", "value": value},
                    {"type": "endpoint", "name": "c", "value": "AA=="},
                ]},
                "status": {"published": true, "lastPublishedAt": published_at},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn a_node_gets_its_latest_published_revision() {
        let m = Model::default().with_node_configs(
            &[
                revision("new", "n1", "2026-11-26T10:00:01Z", "AQI="),
                revision("old", "n1", "2026-11-26T10:00:00Z", "AQE="),
                revision("other", "n2", "2026-11-26T09:00:00Z", "not base64!"),
            ],
            TlsSecrets::default(),
        );
        let n1 = &m.node_configs["n1"];
        assert_eq!(&*n1.revision, "edge/new");
        assert_eq!(n1.version, "new");
        let cluster = &n1.types[2]["c"];
        assert_eq!(cluster.value, vec![1, 2]);
        assert_eq!(
            cluster.type_url,
            "type.googleapis.com/envoy.config.cluster.v3.Cluster"
        );
        assert!(n1.types[3].contains_key("c"));
        assert!(n1.types[0].is_empty() && n1.types[1].is_empty());
        // A resource that is not base64 is left out, not the revision.
        let n2 = &m.node_configs["n2"];
        assert!(n2.types[2].is_empty() && n2.types[3].contains_key("c"));
    }

    fn tls_secret(name: &str, type_: &str, data: &[(&str, &str)]) -> Arc<Secret> {
        let data: serde_json::Map<String, serde_json::Value> = data
            .iter()
            .map(|(k, v)| {
                use base64::Engine;
                (
                    (*k).to_owned(),
                    base64::engine::general_purpose::STANDARD.encode(v).into(),
                )
            })
            .collect();
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": name, "namespace": "edge"},
                "type": type_, "data": data,
            }))
            .unwrap(),
        )
    }

    #[test]
    fn secrets_are_generated_from_labelled_tls_secrets_of_watched_namespaces() {
        use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tls;
        use prost::Message as _;
        let rev: Arc<EnvoyConfigRevision> = Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "EnvoyConfigRevision",
                "metadata": {"name": "r", "namespace": "edge"},
                "spec": {"nodeID": "n", "version": "v1", "resources": [
                    {"type": "secret", "name": "cert", "generateFromTlsSecret": "cert", "blueprint": "tlsCertificate"},
                    {"type": "secret", "name": "ca", "generateFromTlsSecret": "ca", "blueprint": "validationContext"},
                    {"type": "secret", "name": "opaque", "generateFromTlsSecret": "opaque"},
                    {"type": "secret", "name": "gone", "generateFromTlsSecret": "gone"},
                ]},
                "status": {"published": true},
            }))
            .unwrap(),
        );
        let ns = ["edge".to_owned()];
        let secrets = vec![
            tls_secret(
                "cert",
                "kubernetes.io/tls",
                &[("tls.crt", "CHAIN"), ("tls.key", "PRIVATE KEY")],
            ),
            tls_secret("ca", "kubernetes.io/tls", &[("tls.crt", "CA")]),
            tls_secret("opaque", "Opaque", &[("password", "x")]),
        ];
        let build = |secrets: &[Arc<Secret>], namespaces: &[String]| {
            Model::default()
                .with_node_configs(
                    std::slice::from_ref(&rev),
                    TlsSecrets {
                        namespaces,
                        secrets,
                    },
                )
                .node_configs["n"]
                .clone()
        };
        let n = build(&secrets, &ns);
        assert_eq!(&n.namespace, "edge");
        let cert = tls::Secret::decode(n.types[4]["cert"].value.as_slice()).unwrap();
        let Some(tls::secret::Type::TlsCertificate(c)) = cert.r#type else {
            panic!("{cert:?}")
        };
        use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
        assert_eq!(
            c.private_key.unwrap().specifier,
            Some(Specifier::InlineBytes(b"PRIVATE KEY".to_vec()))
        );
        let ca = tls::Secret::decode(n.types[4]["ca"].value.as_slice()).unwrap();
        let Some(tls::secret::Type::ValidationContext(v)) = ca.r#type else {
            panic!("{ca:?}")
        };
        // Without ca.crt, tls.crt is the trusted CA.
        assert_eq!(
            v.trusted_ca.unwrap().specifier,
            Some(Specifier::InlineBytes(b"CA".to_vec()))
        );
        assert_eq!(
            n.unresolved_secrets,
            [
                "Secret edge/opaque: of type Opaque, not kubernetes.io/tls",
                "Secret edge/gone: no Secret labelled spur.dev/envoy-secret=true",
            ]
        );
        assert!(
            n.secrets_version.starts_with("v1."),
            "{}",
            n.secrets_version
        );
        assert!(!format!("{n:?}").contains("PRIVATE"), "{n:?}");

        // A Secret that changes is a new SDS version under the same revision.
        let mut changed = secrets.clone();
        changed[0] = tls_secret(
            "cert",
            "kubernetes.io/tls",
            &[("tls.crt", "CHAIN2"), ("tls.key", "PRIVATE KEY")],
        );
        let n2 = build(&changed, &ns);
        assert_eq!(n2.version, n.version);
        assert_ne!(n2.secrets_version, n.secrets_version);
        assert_eq!(build(&secrets, &ns).secrets_version, n.secrets_version);

        // A namespace the route server does not read Secrets in serves none.
        let n3 = build(&secrets, &[]);
        assert!(n3.types[4].is_empty());
        assert_eq!(n3.unresolved_secrets.len(), 4);
        assert!(n3.unresolved_secrets[0].contains("xds.sds.namespaces"));
    }
}
