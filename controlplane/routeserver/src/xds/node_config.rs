//! Users' own Envoy resources: the published EnvoyConfigRevisions, keyed by node id and by
//! the EnvoyConfig's namespace, with the secrets they name generated from `kubernetes.io/tls`
//! Secrets.
//!
//! A node id is only a name a client picks; the namespace comes from the client's certificate
//! (`system:spur:xds:<namespace>`). So two namespaces may use one node id without meeting, and a
//! stream is served a namespace's resources only when its certificate is of that namespace
//! (`super::ads`).
//!
//! Every resource is looked at once more before it is served: a data source that reads a file
//! or an environment variable of the client's pod is refused at admission, and a revision
//! published before that check existed (or written by hand) must not get one through. Such a
//! resource is left out and logged.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, OnceLock};

use envoy_types::pb::google::protobuf::Any;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use spur_api::EnvoyConfigRevision;
use spur_api::envoyconfig::{EnvoyResourceType, SECRET_LABEL, SecretBlueprint};

use super::kind::KINDS;
use super::model::{Model, NodeConfig, TlsSecrets};

impl Model {
    /// Adds the published EnvoyConfig revisions, their secrets generated from `secrets`. For
    /// one node id in one namespace the latest-published wins: the operator labels a new
    /// revision before it unlabels the old one, so for a moment both are published (two
    /// EnvoyConfigs of one namespace with one node id are refused at admission, and the operator
    /// publishes only the older of two that got in anyway). Namespaces never compete.
    pub fn with_node_configs(
        mut self,
        revisions: &[Arc<EnvoyConfigRevision>],
        secrets: TlsSecrets<'_>,
    ) -> Model {
        use base64::Engine;
        let mut latest: BTreeMap<(&str, &str), &EnvoyConfigRevision> = BTreeMap::new();
        let when = |r: &EnvoyConfigRevision| {
            (
                r.status.as_ref().and_then(|s| s.last_published_at.clone()),
                r.name_any(),
            )
        };
        for r in revisions {
            let Some(ns) = r.metadata.namespace.as_deref() else {
                continue;
            };
            let entry = latest.entry((ns, r.spec.node_id.as_str())).or_insert(r);
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
        let mut screen = Screen::lock();
        for ((namespace, node), rev) in latest {
            let namespace = namespace.to_owned();
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
                    let bytes = match base64::engine::general_purpose::STANDARD.decode(&res.value) {
                        Ok(v) => v,
                        Err(e) => {
                            // The operator wrote it; only a hand-edited revision gets here.
                            tracing::warn!(revision = %rev.name_any(), resource = %res.name, error = %e, "EnvoyConfigRevision resource is not base64; left out");
                            continue;
                        }
                    };
                    if !screen.allows(rev, res.type_, &res.name, &res.value, &bytes) {
                        continue;
                    }
                    bytes
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
            self.node_configs
                .entry(node.to_owned())
                .or_default()
                .insert(
                    namespace.clone(),
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
        screen.forget_unused();
        self
    }
}

/// What the route server concluded about each resource it looked at, by a digest of its type
/// and bytes (as stored, base64), so that a resource is decoded once, not at every
/// publication (each change of an endpoint rebuilds the model). Kept for the resources of the
/// last build only. One for the process: `Model::with_node_configs` is a pure function of its
/// inputs, and the verdict is a pure function of the bytes.
struct Screen {
    verdicts: HashMap<u64, bool>,
    used: HashMap<u64, bool>,
    hasher: RandomState,
}

static SCREEN: OnceLock<Mutex<Screen>> = OnceLock::new();

impl Screen {
    fn lock() -> std::sync::MutexGuard<'static, Screen> {
        SCREEN
            .get_or_init(|| {
                Mutex::new(Screen {
                    verdicts: HashMap::new(),
                    used: HashMap::new(),
                    // Random keys: nobody can write a resource whose digest is a refused one's.
                    hasher: RandomState::new(),
                })
            })
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `bytes` (resource `name` of type `ty` of `rev`, `text` as stored) may be
    /// served: no data source in it reads the client's pod. Logged once when refused.
    fn allows(
        &mut self,
        rev: &EnvoyConfigRevision,
        ty: EnvoyResourceType,
        name: &str,
        text: &str,
        bytes: &[u8],
    ) -> bool {
        let key = self.hasher.hash_one((ty, text));
        let ok = match self.verdicts.get(&key) {
            Some(ok) => *ok,
            None => {
                let verdict = spur_envoy::decoder()
                    .map_err(|e| (String::new(), e.to_string()))
                    .and_then(|d| d.check_encoded(ty, bytes));
                if let Err((path, why)) = &verdict {
                    tracing::warn!(
                        revision = %format!("{}/{}", rev.namespace().unwrap_or_default(), rev.name_any()),
                        r#type = ty.message_name(),
                        resource = %name,
                        field = %path,
                        error = %why,
                        "EnvoyConfigRevision resource left out: admission refuses it today"
                    );
                }
                verdict.is_ok()
            }
        };
        self.used.insert(key, ok);
        ok
    }

    /// Keeps the verdicts of this build's resources only.
    fn forget_unused(&mut self) {
        self.verdicts = std::mem::take(&mut self.used);
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    use base64::Engine as _;
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use prost::Message as _;

    /// A Cluster named `name`, encoded and in base64, as a revision stores it.
    fn cluster(name: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(
            Cluster {
                name: name.into(),
                ..Default::default()
            }
            .encode_to_vec(),
        )
    }

    /// A published revision of `namespace` for `node` with one cluster (`value`) and an empty
    /// endpoint assignment.
    fn revision(
        namespace: &str,
        name: &str,
        node: &str,
        published_at: &str,
        value: &str,
    ) -> Arc<EnvoyConfigRevision> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "EnvoyConfigRevision",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"nodeID": node, "version": name, "resources": [
                    {"type": "cluster", "name": "c", "value": value},
                    {"type": "endpoint", "name": "c", "value": ""},
                ]},
                "status": {"published": true, "lastPublishedAt": published_at},
            }))
            .unwrap(),
        )
    }

    fn cluster_name(cfg: &NodeConfig) -> String {
        Cluster::decode(cfg.types[2]["c"].value.as_slice())
            .unwrap()
            .name
    }

    #[test]
    fn a_node_gets_its_latest_published_revision() {
        let m = Model::default().with_node_configs(
            &[
                revision("edge", "new", "n1", "2026-11-26T10:00:01Z", &cluster("new")),
                revision("edge", "old", "n1", "2026-11-26T10:00:00Z", &cluster("old")),
                revision("edge", "other", "n2", "2026-11-26T09:00:00Z", "not base64!"),
            ],
            TlsSecrets::default(),
        );
        let n1 = &m.node_configs["n1"]["edge"];
        assert_eq!(&*n1.revision, "edge/new");
        assert_eq!(n1.version, "new");
        assert_eq!(cluster_name(n1), "new");
        assert_eq!(
            n1.types[2]["c"].type_url,
            "type.googleapis.com/envoy.config.cluster.v3.Cluster"
        );
        assert!(n1.types[3].contains_key("c"));
        assert!(n1.types[0].is_empty() && n1.types[1].is_empty());
        // A resource that is not base64 is left out, not the revision.
        let n2 = &m.node_configs["n2"]["edge"];
        assert!(n2.types[2].is_empty() && n2.types[3].contains_key("c"));
    }

    /// Team b publishes a config for team a's node id, later than a's: a's Envoy keeps a's.
    #[test]
    fn another_namespace_cannot_replace_a_nodes_config() {
        let m = Model::default().with_node_configs(
            &[
                revision(
                    "a",
                    "mine",
                    "edge-1",
                    "2026-11-26T10:00:00Z",
                    &cluster("a-backend"),
                ),
                revision(
                    "b",
                    "theirs",
                    "edge-1",
                    "2026-11-26T10:00:05Z",
                    &cluster("b-backend"),
                ),
            ],
            TlsSecrets::default(),
        );
        let by_ns = &m.node_configs["edge-1"];
        assert_eq!(by_ns.len(), 2);
        assert_eq!(&*by_ns["a"].revision, "a/mine");
        assert_eq!(cluster_name(&by_ns["a"]), "a-backend");
        assert_eq!(by_ns["a"].namespace, "a");
        assert_eq!(&*by_ns["b"].revision, "b/theirs");
        assert_eq!(cluster_name(&by_ns["b"]), "b-backend");
    }

    /// A revision published before admission refused local data sources (or written by hand):
    /// the resource that reads the client's pod is not served, the others are.
    #[test]
    fn a_resource_that_reads_the_clients_pod_is_not_served() {
        use envoy_types::pb::envoy::config::core::v3::{DataSource, TransportSocket, data_source};
        use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tls;
        use prost::Name as _;
        let key = |specifier| {
            let ctx = tls::UpstreamTlsContext {
                common_tls_context: Some(tls::CommonTlsContext {
                    tls_certificates: vec![tls::TlsCertificate {
                        private_key: Some(DataSource {
                            specifier: Some(specifier),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                ..Default::default()
            };
            let c = Cluster {
                name: "c".into(),
                transport_socket: Some(TransportSocket {
                    name: "tls".into(),
                    config_type: Some(
                        envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
                            Any {
                                type_url: tls::UpstreamTlsContext::type_url(),
                                value: ctx.encode_to_vec(),
                            },
                        ),
                    ),
                }),
                ..Default::default()
            };
            base64::engine::general_purpose::STANDARD.encode(c.encode_to_vec())
        };
        let token = data_source::Specifier::Filename(
            "/var/run/secrets/kubernetes.io/serviceaccount/token".into(),
        );
        let env = data_source::Specifier::EnvironmentVariable("SECRET".into());
        let inline = data_source::Specifier::InlineString("KEY".into());
        let m = Model::default().with_node_configs(
            &[
                revision("a", "file", "n1", "2026-11-26T10:00:00Z", &key(token)),
                revision("a", "env", "n2", "2026-11-26T10:00:00Z", &key(env)),
                revision("a", "inline", "n3", "2026-11-26T10:00:00Z", &key(inline)),
            ],
            TlsSecrets::default(),
        );
        for node in ["n1", "n2"] {
            let cfg = &m.node_configs[node]["a"];
            assert!(cfg.types[2].is_empty(), "{node}: {cfg:?}");
            // The rest of the revision is still served.
            assert!(cfg.types[3].contains_key("c"), "{node}");
        }
        assert!(m.node_configs["n3"]["a"].types[2].contains_key("c"));
        // The same bytes again (the next publication) get the same answer, from the cache.
        let again = Model::default().with_node_configs(
            &[revision(
                "a",
                "file",
                "n1",
                "2026-11-26T10:00:00Z",
                &key(data_source::Specifier::Filename("/etc/passwd".into())),
            )],
            TlsSecrets::default(),
        );
        assert!(again.node_configs["n1"]["a"].types[2].is_empty());
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
                .node_configs["n"]["edge"]
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
