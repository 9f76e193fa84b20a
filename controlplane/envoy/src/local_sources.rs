//! Data sources that read from the client's own pod. An Envoy `DataSource`
//! (`envoy.config.core.v3.DataSource`: certificates, keys, direct response bodies, Lua and Wasm
//! code, ...) may name a `filename` or an `environment_variable` of the process that loads the
//! resource: whoever may write an EnvoyConfig could then have the Envoy read its service
//! account token or any mounted file or variable into a response or an upstream request. Both
//! are refused, at admission and again by the route server before it serves a revision (one
//! published before this check existed must not be served with them); the bytes go inline, or
//! a certificate comes over SDS (`type: secret`).
//!
//! The same goes for the few other fields that make the Envoy read its own files ([`LOCAL`]):
//! the `file_server` filter, file-based config sources, Lightstep's token file. Fields that
//! only write files (access logs, TLS key logs) are not refused: `/dev/stdout` access logs are
//! common and harmless.
//!
//! The walk goes through every set field, `Any` payloads included (decoded into the message
//! their type URL names, as the encoder does), so a `DataSource` nested in a typed config is
//! found like one at the top.

use prost_reflect::{DescriptorPool, DynamicMessage, MapKey, ReflectMessage as _, Value};

const DATA_SOURCE: &str = "envoy.config.core.v3.DataSource";
const CONFIG_SOURCE: &str = "envoy.config.core.v3.ConfigSource";
const ANY: &str = "google.protobuf.Any";

/// The fields that make the client read its own pod: (message, field, why it is refused). An
/// empty field refuses the message itself, wherever it is.
const LOCAL: [(&str, &str, &str); 6] = [
    (
        DATA_SOURCE,
        "filename",
        "a data source may not read a file of the Envoy's own pod (its service account token, mounted Secrets); write the bytes inline (inline_string or inline_bytes), or serve a certificate over SDS (a resource of type secret)",
    ),
    (
        DATA_SOURCE,
        "environment_variable",
        "a data source may not read an environment variable of the Envoy's own process; write the bytes inline (inline_string or inline_bytes)",
    ),
    (
        CONFIG_SOURCE,
        "path",
        "a config source may not read files of the Envoy's own pod; use {\"ads\": {}}",
    ),
    (
        CONFIG_SOURCE,
        "path_config_source",
        "a config source may not read files of the Envoy's own pod; use {\"ads\": {}}",
    ),
    (
        "envoy.extensions.filters.http.file_server.v3.FileServerConfig",
        "",
        "the file_server filter would serve files of the Envoy's own pod",
    ),
    (
        "envoy.config.trace.v3.LightstepConfig",
        "access_token_file",
        "the tracer would read a file of the Envoy's own pod and send it to the collector",
    ),
];

/// Deepest nesting of messages the walk follows. Admission parses at most 128 levels of JSON,
/// so only a revision written by hand reaches this; the route server then leaves it out.
const MAX_DEPTH: usize = 256;

/// The first field in `msg` that reads the client's own pod ([`LOCAL`]) (or a message nested
/// deeper than [`MAX_DEPTH`], or an `Any` that does not decode): the field path from `msg`,
/// in the `.proto`'s field names (`a.b[0].c`; an `Any`'s payload adds no step, as in JSON),
/// and what is wrong there.
pub(crate) fn find(pool: &DescriptorPool, msg: &DynamicMessage) -> Result<(), (String, String)> {
    let mut path = Vec::new();
    walk(pool, msg, &mut path, 0).map_err(|message| (path.concat(), message))
}

/// Walks `msg`; on error `path` holds the steps to the field at fault.
fn walk(
    pool: &DescriptorPool,
    msg: &DynamicMessage,
    path: &mut Vec<String>,
    depth: usize,
) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!("nested more than {MAX_DEPTH} messages deep"));
    }
    let desc = msg.descriptor();
    if desc.full_name() == ANY {
        return walk_any(pool, msg, path, depth);
    }
    for (message, field, why) in LOCAL {
        if desc.full_name() != message {
            continue;
        }
        if field.is_empty() {
            return Err(why.to_owned());
        }
        if msg.has_field_by_name(field) {
            push_field(path, field);
            return Err(why.to_owned());
        }
    }
    for (field, value) in msg.fields() {
        push_field(path, field.name());
        walk_value(pool, value, path, depth)?;
        path.pop();
    }
    Ok(())
}

fn walk_value(
    pool: &DescriptorPool,
    value: &Value,
    path: &mut Vec<String>,
    depth: usize,
) -> Result<(), String> {
    match value {
        Value::Message(m) => walk(pool, m, path, depth + 1),
        Value::List(items) => {
            for (i, item) in items.iter().enumerate() {
                path.push(format!("[{i}]"));
                walk_value(pool, item, path, depth)?;
                path.pop();
            }
            Ok(())
        }
        Value::Map(entries) => {
            // In key order, so that the first of several is always the same one.
            let mut sorted: Vec<_> = entries.iter().collect();
            sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
            for (key, item) in sorted {
                path.push(format!("[{}]", map_key(key)));
                walk_value(pool, item, path, depth)?;
                path.pop();
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// An `Any`'s payload, decoded into the message its type URL names.
fn walk_any(
    pool: &DescriptorPool,
    any: &DynamicMessage,
    path: &mut Vec<String>,
    depth: usize,
) -> Result<(), String> {
    let type_url = any
        .get_field_by_number(1)
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    let payload = any
        .get_field_by_number(2)
        .and_then(|v| v.as_bytes().cloned())
        .unwrap_or_default();
    if type_url.is_empty() && payload.is_empty() {
        return Ok(());
    }
    let name = type_url.rsplit('/').next().unwrap_or_default();
    let desc = pool
        .get_message_by_name(name)
        .ok_or_else(|| format!("{type_url:?} names no message of Envoy's v3 API"))?;
    let inner = DynamicMessage::decode(desc, payload)
        .map_err(|e| format!("the payload of a {type_url} does not decode: {e}"))?;
    walk(pool, &inner, path, depth + 1)
}

fn push_field(path: &mut Vec<String>, name: &str) {
    if path.is_empty() {
        path.push(name.to_owned());
    } else {
        path.push(format!(".{name}"));
    }
}

fn map_key(key: &MapKey) -> String {
    match key {
        MapKey::String(s) => format!("{s:?}"),
        MapKey::Bool(b) => b.to_string(),
        MapKey::I32(n) => n.to_string(),
        MapKey::I64(n) => n.to_string(),
        MapKey::U32(n) => n.to_string(),
        MapKey::U64(n) => n.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use prost::Message as _;
    use serde_json::json;
    use spur_api::envoyconfig::{EnvoyConfigSpec, EnvoyResource, EnvoyResourceType, Serialization};

    use super::super::decoder;

    const TLS: &str =
        "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext";
    const HCM: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
    const LUA_PER_ROUTE: &str =
        "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute";

    fn cluster_with_key(key: serde_json::Value) -> serde_json::Value {
        json!({
            "name": "upstream", "type": "EDS",
            "eds_cluster_config": {"eds_config": {"ads": {}}},
            "transport_socket": {"name": "tls", "typed_config": {
                "@type": TLS,
                "common_tls_context": {"tls_certificates": [
                    {"certificate_chain": {"inline_string": "CHAIN"}, "privateKey": key}
                ]}
            }}
        })
    }

    /// A listener whose connection manager carries its routes inline, the route's per-filter
    /// config (a map of `Any`) and its direct response as given.
    fn listener(per_filter: serde_json::Value, body: serde_json::Value) -> serde_json::Value {
        json!({
            "name": "l",
            "api_listener": {"api_listener": {
                "@type": HCM,
                "stat_prefix": "l",
                "route_config": {"name": "r", "virtual_hosts": [{
                    "name": "all", "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/a"}, "route": {"cluster": "c"}},
                        {"match": {"prefix": ""}, "direct_response": {"status": 200, "body": body},
                         "typed_per_filter_config": per_filter}
                    ]
                }]},
                "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
            }}
        })
    }

    fn decode(ty: EnvoyResourceType, v: &serde_json::Value) -> Result<(), (String, String)> {
        decoder()
            .unwrap()
            .decode(ty, Serialization::Json, &v.to_string())
            .map(|_| ())
    }

    #[test]
    fn a_file_or_a_variable_of_the_clients_pod_is_refused_wherever_it_is() {
        let token = "/var/run/secrets/kubernetes.io/serviceaccount/token";
        // In a typed config (an Any), camelCase as the JSON mapping allows.
        let (path, why) = decode(
            EnvoyResourceType::Cluster,
            &cluster_with_key(json!({"filename": token})),
        )
        .unwrap_err();
        assert_eq!(
            path,
            "transport_socket.typed_config.common_tls_context.tls_certificates[0].private_key.filename"
        );
        assert!(why.contains("may not read a file"), "{why}");
        assert!(!why.contains(token), "{why}");

        // A direct response that would serve the token to every caller, two Anys down.
        let (path, _) = decode(
            EnvoyResourceType::Listener,
            &listener(json!({}), json!({"filename": token})),
        )
        .unwrap_err();
        assert_eq!(
            path,
            "api_listener.api_listener.route_config.virtual_hosts[0].routes[1].direct_response.body.filename"
        );
        // In a map of Anys (per-route Lua code).
        let lua = json!({"envoy.filters.http.lua": {"@type": LUA_PER_ROUTE, "source_code": {"filename": "/etc/passwd"}}});
        let (path, _) = decode(
            EnvoyResourceType::Listener,
            &listener(lua, json!({"inline_string": "ok"})),
        )
        .unwrap_err();
        assert_eq!(
            path,
            r#"api_listener.api_listener.route_config.virtual_hosts[0].routes[1].typed_per_filter_config["envoy.filters.http.lua"].source_code.filename"#
        );
        // The process's environment likewise.
        let (path, why) = decode(
            EnvoyResourceType::Cluster,
            &cluster_with_key(json!({"environment_variable": "AWS_SECRET_ACCESS_KEY"})),
        )
        .unwrap_err();
        assert!(path.ends_with("private_key.environment_variable"), "{path}");
        assert!(why.contains("environment variable"), "{why}");
        // Even empty: the field is what reads.
        assert!(
            decode(
                EnvoyResourceType::Cluster,
                &cluster_with_key(json!({"filename": ""}))
            )
            .is_err()
        );

        // Inline bytes are what a resource carries.
        decode(
            EnvoyResourceType::Cluster,
            &cluster_with_key(json!({"inline_string": "KEY"})),
        )
        .unwrap();
        decode(
            EnvoyResourceType::Listener,
            &listener(json!({}), json!({"inline_string": "ok"})),
        )
        .unwrap();
    }

    #[test]
    fn admission_names_the_resource_and_the_field() {
        let spec = EnvoyConfigSpec {
            node_id: "n".into(),
            serialization: Serialization::Yaml,
            resources: vec![EnvoyResource {
                type_: EnvoyResourceType::Cluster,
                value: serde_yaml_ng::to_string(&cluster_with_key(
                    json!({"filename": "/etc/envoy/key.pem"}),
                ))
                .unwrap(),
                generate_from_tls_secret: None,
                blueprint: None,
            }],
        };
        let e = decoder().unwrap().decode_all(&spec).unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.resources[0].value: transport_socket.typed_config.common_tls_context.tls_certificates[0].private_key.filename: a data source may not read a file of the Envoy's own pod (its service account token, mounted Secrets); write the bytes inline (inline_string or inline_bytes), or serve a certificate over SDS (a resource of type secret)"
        );
    }

    /// What the route server checks: the encoded bytes of a revision written before this check
    /// existed (or by hand).
    #[test]
    fn encoded_resources_are_checked_too() {
        let d = decoder().unwrap();
        let encode = |ty: EnvoyResourceType, v: serde_json::Value| {
            let desc = d.pool().get_message_by_name(ty.message_name()).unwrap();
            prost_reflect::DynamicMessage::deserialize(desc, v)
                .unwrap()
                .encode_to_vec()
        };
        let bad = encode(
            EnvoyResourceType::Cluster,
            cluster_with_key(json!({"filename": "/k"})),
        );
        let (path, _) = d
            .check_encoded(EnvoyResourceType::Cluster, &bad)
            .unwrap_err();
        assert!(path.ends_with("private_key.filename"), "{path}");
        let good = encode(
            EnvoyResourceType::Cluster,
            cluster_with_key(json!({"inline_bytes": "S0VZ"})),
        );
        d.check_encoded(EnvoyResourceType::Cluster, &good).unwrap();
        // Bytes that are not the type's message are not served either.
        let (_, why) = d
            .check_encoded(EnvoyResourceType::Cluster, &[0xff, 0xff])
            .unwrap_err();
        assert!(why.contains("does not decode"), "{why}");
    }

    /// Every entry of the table names a field of Envoy's descriptors (an `envoy-types` upgrade
    /// that renames one fails here, not silently).
    #[test]
    fn every_refused_field_exists() {
        let pool = decoder().unwrap().pool();
        for (message, field, _) in super::LOCAL {
            let m = pool
                .get_message_by_name(message)
                .unwrap_or_else(|| panic!("no message {message}"));
            assert!(
                field.is_empty() || m.get_field_by_name(field).is_some(),
                "{message} has no field {field}"
            );
        }
    }

    #[test]
    fn other_ways_to_read_the_clients_files_are_refused() {
        // The file_server filter, as an HTTP filter of a listener: refused at the filter's
        // typed config.
        let mut l = listener(json!({}), json!({"inline_string": "ok"}));
        l["api_listener"]["api_listener"]["http_filters"] = json!([
            {"name": "files", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.file_server.v3.FileServerConfig"}},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
        ]);
        let (path, why) = decode(EnvoyResourceType::Listener, &l).unwrap_err();
        assert_eq!(
            path,
            "api_listener.api_listener.http_filters[0].typed_config"
        );
        assert!(why.contains("file_server"), "{why}");
        // Endpoints read from a file instead of ADS.
        let c = json!({"name": "c", "type": "EDS",
            "eds_cluster_config": {"eds_config": {"path_config_source": {"path": "/etc/eds.yaml"}}}});
        let (path, _) = decode(EnvoyResourceType::Cluster, &c).unwrap_err();
        assert_eq!(path, "eds_cluster_config.eds_config.path_config_source");
        let c = json!({"name": "c", "type": "EDS",
            "eds_cluster_config": {"eds_config": {"path": "/etc/eds.yaml"}}});
        let (path, _) = decode(EnvoyResourceType::Cluster, &c).unwrap_err();
        assert_eq!(path, "eds_cluster_config.eds_config.path");
    }

    /// An `Any` nested in itself past any sensible depth is refused, not followed until the
    /// stack runs out.
    #[test]
    fn nesting_is_bounded() {
        let d = decoder().unwrap();
        let any = d.pool().get_message_by_name("google.protobuf.Any").unwrap();
        let mut bytes = Vec::new();
        for _ in 0..300 {
            let mut m = prost_reflect::DynamicMessage::new(any.clone());
            m.set_field_by_number(
                1,
                prost_reflect::Value::String("type.googleapis.com/google.protobuf.Any".into()),
            );
            m.set_field_by_number(2, prost_reflect::Value::Bytes(bytes.into()));
            bytes = m.encode_to_vec();
        }
        let m = prost_reflect::DynamicMessage::decode(any, bytes.as_slice()).unwrap();
        let (_, why) = super::find(d.pool(), &m).unwrap_err();
        assert!(why.contains("nested more than"), "{why}");
    }
}
