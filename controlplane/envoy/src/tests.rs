#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::json;
use spur_api::envoyconfig::EnvoyResource;

use super::*;

const HCM: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const ROUTER: &str = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";

fn d() -> &'static Decoder {
    decoder().unwrap()
}

/// A gRPC proxyless client's listener: an API listener whose connection manager takes its
/// routes over RDS and ends in the router filter.
fn api_listener() -> serde_json::Value {
    json!({
        "name": "echo.default.svc:8080",
        "api_listener": {"api_listener": {
            "@type": HCM,
            "stat_prefix": "echo",
            "rds": {
                "route_config_name": "echo-routes",
                "config_source": {"ads": {}, "resource_api_version": "V3"}
            },
            "http_filters": [{
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": ROUTER}
            }]
        }}
    })
}

fn json_of(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).unwrap()
}

fn yaml_of(v: &serde_json::Value) -> String {
    serde_yaml_ng::to_string(v).unwrap()
}

fn listener(text: &str) -> Result<Decoded, (String, String)> {
    d().decode(EnvoyResourceType::Listener, Serialization::Json, text)
}

fn spec(ser: Serialization, resources: &[(EnvoyResourceType, String)]) -> EnvoyConfigSpec {
    EnvoyConfigSpec {
        node_id: "node".into(),
        serialization: ser,
        resources: resources
            .iter()
            .map(|(t, v)| EnvoyResource {
                type_: *t,
                value: v.clone(),
                generate_from_tls_secret: None,
                blueprint: None,
            })
            .collect(),
    }
}

/// The decoded message back from its bytes, as JSON (proto field names).
fn back(ty: EnvoyResourceType, bytes: &[u8]) -> serde_json::Value {
    let desc = d().pool().get_message_by_name(ty.message_name()).unwrap();
    let msg = DynamicMessage::decode(desc, bytes).unwrap();
    let opts = prost_reflect::SerializeOptions::new().use_proto_field_name(true);
    msg.serialize_with_options(serde_json::value::Serializer, &opts)
        .unwrap()
}

#[test]
fn an_api_listener_decodes_with_its_any_payloads() {
    let got = listener(&json_of(&api_listener())).unwrap();
    assert_eq!(got.name, "echo.default.svc:8080");
    let back = back(EnvoyResourceType::Listener, &got.bytes);
    let hcm = &back["api_listener"]["api_listener"];
    assert_eq!(hcm["@type"], HCM);
    assert_eq!(hcm["rds"]["route_config_name"], "echo-routes");
    assert_eq!(hcm["http_filters"][0]["typed_config"]["@type"], ROUTER);
}

#[test]
fn yaml_gives_the_same_bytes_as_json() {
    let v = api_listener();
    let from_json = listener(&json_of(&v)).unwrap();
    let from_yaml = d()
        .decode(
            EnvoyResourceType::Listener,
            Serialization::Yaml,
            &yaml_of(&v),
        )
        .unwrap();
    assert_eq!(from_json, from_yaml);
    // Proto3 JSON also takes lowerCamelCase names.
    let camel = listener(
        r#"{"name": "echo.default.svc:8080", "apiListener": {"apiListener": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "statPrefix": "echo",
            "rds": {"routeConfigName": "echo-routes", "configSource": {"ads": {}, "resourceApiVersion": "V3"}},
            "httpFilters": [{"name": "envoy.filters.http.router", "typedConfig": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
        }}}"#,
    )
    .unwrap();
    assert_eq!(camel, from_json);
}

/// A cluster with map fields at two levels (`typed_extension_protocol_options` holds `Any`s,
/// `metadata` holds `Struct`s, which are maps of maps).
fn cluster_with_maps() -> serde_json::Value {
    json!({
        "name": "backend",
        "type": "EDS",
        "connect_timeout": "1.5s",
        "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}
            },
            "envoy.extensions.upstreams.tcp.v3.TcpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.tcp.v3.TcpProtocolOptions",
                "idle_timeout": "60s"
            }
        },
        "metadata": {"filter_metadata": {
            "a": {"k1": 1, "k2": "two", "k3": {"x": true, "y": [1, 2, 3], "z": {"q": null}}},
            "b": {"k": "v"},
            "c": {"m": {"n": {"o": "p"}}, "r": "s", "t": "u"}
        }}
    })
}

#[test]
fn the_encoding_is_deterministic_through_maps_and_any() {
    let text = json_of(&cluster_with_maps());
    let first = d()
        .decode(EnvoyResourceType::Cluster, Serialization::Json, &text)
        .unwrap();
    assert_eq!(first.name, "backend");
    // prost-reflect's own encoding orders map entries by HashMap iteration: some of these
    // would differ without the sorted encoding.
    for _ in 0..20 {
        let again = d()
            .decode(EnvoyResourceType::Cluster, Serialization::Json, &text)
            .unwrap();
        assert_eq!(again.bytes, first.bytes);
    }
    let back = back(EnvoyResourceType::Cluster, &first.bytes);
    assert_eq!(back["connect_timeout"], "1.500s");
    assert_eq!(
        back["metadata"]["filter_metadata"]["a"]["k3"]["y"],
        json!([1.0, 2.0, 3.0])
    );
    assert_eq!(
        back["typed_extension_protocol_options"]["envoy.extensions.upstreams.tcp.v3.TcpProtocolOptions"]
            ["idle_timeout"],
        "60s"
    );
}

#[test]
fn every_resource_type_decodes() {
    let route = json!({
        "name": "echo-routes",
        "virtual_hosts": [{
            "name": "echo",
            "domains": ["*"],
            "routes": [
                {"match": {"prefix": "", "headers": [{"name": "baggage", "safe_regex_match": {"regex": ".*sandbox=a.*"}}]},
                 "route": {"cluster": "echo-a"}},
                {"match": {"prefix": ""}, "route": {"cluster": "echo"},
                 "typed_per_filter_config": {"envoy.filters.http.router": {"@type": ROUTER}}}
            ]
        }]
    });
    let endpoint = json!({
        "cluster_name": "echo",
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "10.0.0.1", "port_value": 8080}}}}]}]
    });
    let s = spec(
        Serialization::Json,
        &[
            (EnvoyResourceType::Listener, json_of(&api_listener())),
            (EnvoyResourceType::Route, json_of(&route)),
            (EnvoyResourceType::Cluster, json_of(&cluster_with_maps())),
            (EnvoyResourceType::Endpoint, json_of(&endpoint)),
        ],
    );
    let got = d().decode_all(&s).unwrap();
    let names: Vec<_> = got.iter().map(|r| (r.type_, r.name.as_str())).collect();
    assert_eq!(
        names,
        [
            (EnvoyResourceType::Listener, "echo.default.svc:8080"),
            (EnvoyResourceType::Route, "echo-routes"),
            (EnvoyResourceType::Cluster, "backend"),
            (EnvoyResourceType::Endpoint, "echo"),
        ]
    );
    for r in &got {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&r.value)
            .unwrap();
        back(r.type_, &bytes);
    }
}

#[test]
fn a_syntax_error_names_line_and_column() {
    let (path, msg) = listener("{\"name\": \"x\",\n \"address\" {}}").unwrap_err();
    assert_eq!(path, "");
    assert!(msg.contains("line 2 column"), "{msg}");
    let (path, msg) = d()
        .decode(
            EnvoyResourceType::Listener,
            Serialization::Yaml,
            "name: x\n  address: [",
        )
        .unwrap_err();
    assert_eq!(path, "");
    assert!(msg.contains("line"), "{msg}");
    // Trailing garbage and non-objects.
    assert!(listener("{\"name\": \"x\"} {}").is_err());
    let (_, msg) = listener("[1]").unwrap_err();
    assert!(msg.contains("expected an object"), "{msg}");
}

#[test]
fn an_unknown_field_inside_an_any_is_named_by_its_path() {
    let mut v = api_listener();
    v["api_listener"]["api_listener"]["http_filters"][0]["typed_config"]["dynamic_stats_typo"] =
        json!(true);
    let (path, msg) = listener(&json_of(&v)).unwrap_err();
    assert_eq!(
        path,
        "api_listener.api_listener.http_filters[0].typed_config.dynamic_stats_typo"
    );
    assert!(msg.contains("dynamic_stats_typo"), "{msg}");
    // The same in YAML.
    let (yaml_path, _) = d()
        .decode(
            EnvoyResourceType::Listener,
            Serialization::Yaml,
            &yaml_of(&v),
        )
        .unwrap_err();
    assert_eq!(yaml_path, path);
    // And at the top of the connection manager.
    let mut v = api_listener();
    v["api_listener"]["api_listener"]["rds"]["route_config"] = json!("x");
    let (path, _) = listener(&json_of(&v)).unwrap_err();
    assert_eq!(path, "api_listener.api_listener.rds.route_config");
}

#[test]
fn at_type_after_the_fields_still_gives_the_path() {
    // `@type` written last: parsing into a sorted map puts it first again.
    let text = r#"{"name": "l", "api_listener": {"api_listener": {
        "stat_prefix": "x", "bogus": 1,
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"}}}"#;
    let (path, _) = listener(text).unwrap_err();
    assert_eq!(path, "api_listener.api_listener.bogus");
}

#[test]
fn a_wrong_type_is_named_by_its_path() {
    let endpoint = json!({
        "cluster_name": "echo",
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "10.0.0.1", "port_value": "http"}}}}]}]
    });
    let (path, msg) = d()
        .decode(
            EnvoyResourceType::Endpoint,
            Serialization::Json,
            &json_of(&endpoint),
        )
        .unwrap_err();
    assert_eq!(
        path,
        "endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value"
    );
    assert!(!msg.is_empty());
    // A negative number for a uint32, a number for a duration, an unknown enum value.
    for (field, value) in [
        ("per_connection_buffer_limit_bytes", json!(-1)),
        ("listener_filters_timeout", json!(5)),
        ("traffic_direction", json!("SIDEWAYS")),
    ] {
        let mut v = api_listener();
        v[field] = value;
        let (path, _) = listener(&json_of(&v)).unwrap_err();
        assert_eq!(path, field);
    }
}

#[test]
fn an_unknown_type_url_is_refused_clearly() {
    let mut v = api_listener();
    v["api_listener"]["api_listener"]["http_filters"][0]["typed_config"]["@type"] =
        json!("type.googleapis.com/envoy.extensions.filters.http.nope.v3.Nope");
    let (path, msg) = listener(&json_of(&v)).unwrap_err();
    assert!(
        path.starts_with("api_listener.api_listener.http_filters[0].typed_config"),
        "{path}"
    );
    assert!(
        msg.contains("envoy.extensions.filters.http.nope.v3.Nope"),
        "{msg}"
    );
    // A type URL without the prefix, and a known message of the wrong kind for the field are
    // the clients' to judge (an Any may hold anything), but it must be a known message.
    v["api_listener"]["api_listener"]["http_filters"][0]["typed_config"]["@type"] = json!("Router");
    assert!(listener(&json_of(&v)).is_err());
}

#[test]
fn names_are_required_and_unique_per_type() {
    let mut nameless = api_listener();
    nameless.as_object_mut().unwrap().remove("name");
    let err = d()
        .decode_all(&spec(
            Serialization::Json,
            &[(EnvoyResourceType::Listener, json_of(&nameless))],
        ))
        .unwrap_err();
    assert_eq!((err.index, err.path.as_str()), (0, "name"));

    let cla = |name: &str| json_of(&json!({"cluster_name": name}));
    let err = d()
        .decode_all(&spec(
            Serialization::Json,
            &[
                (EnvoyResourceType::Endpoint, cla("a")),
                (EnvoyResourceType::Endpoint, cla("b")),
                (EnvoyResourceType::Endpoint, cla("a")),
            ],
        ))
        .unwrap_err();
    assert_eq!((err.index, err.path.as_str()), (2, "cluster_name"));
    assert_eq!(
        err.to_string(),
        "spec.resources[2].value: cluster_name: a second envoy.config.endpoint.v3.ClusterLoadAssignment named \"a\": names are unique per type"
    );
    // One name in two types is fine.
    d().decode_all(&spec(
        Serialization::Json,
        &[
            (EnvoyResourceType::Endpoint, cla("a")),
            (EnvoyResourceType::Cluster, json_of(&json!({"name": "a"}))),
        ],
    ))
    .unwrap();
    let err = d()
        .decode_all(&spec(
            Serialization::Json,
            &[(
                EnvoyResourceType::Endpoint,
                cla(&"n".repeat(NODE_ID_MAX + 1)),
            )],
        ))
        .unwrap_err();
    assert_eq!(err.path, "cluster_name");
}

#[test]
fn secrets_name_a_tls_secret_and_carry_nothing_inline() {
    use spur_api::envoyconfig::SecretBlueprint;
    let secret =
        |from: Option<&str>, value: &str, blueprint: Option<SecretBlueprint>| EnvoyResource {
            type_: EnvoyResourceType::Secret,
            value: value.into(),
            generate_from_tls_secret: from.map(str::to_owned),
            blueprint,
        };
    let with = |resources: Vec<EnvoyResource>| EnvoyConfigSpec {
        node_id: "node".into(),
        serialization: Serialization::Json,
        resources,
    };
    let got = d()
        .decode_all(&with(vec![
            secret(Some("edge-cert"), "", None),
            secret(
                Some("client-ca"),
                "",
                Some(SecretBlueprint::ValidationContext),
            ),
        ]))
        .unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].name, "edge-cert");
    assert_eq!(got[0].value, "");
    assert_eq!(got[0].blueprint, Some(SecretBlueprint::TlsCertificate));
    assert_eq!(
        got[1].generate_from_tls_secret.as_deref(),
        Some("client-ca")
    );
    assert_eq!(got[1].blueprint, Some(SecretBlueprint::ValidationContext));

    let err = d()
        .decode_all(&with(vec![secret(
            Some("edge-cert"),
            r#"{"name":"edge-cert","tls_certificate":{}}"#,
            None,
        )]))
        .unwrap_err();
    assert_eq!(err.field, "value");
    assert!(err.to_string().contains("not written inline"), "{err}");

    let err = d()
        .decode_all(&with(vec![secret(None, "", None)]))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "spec.resources[0].generateFromTlsSecret: a resource of type secret names the kubernetes.io/tls Secret it is generated from"
    );
    let err = d()
        .decode_all(&with(vec![secret(Some("Not_A_Name"), "", None)]))
        .unwrap_err();
    assert_eq!(err.field, "generateFromTlsSecret");

    let err = d()
        .decode_all(&with(vec![
            secret(Some("a"), "", None),
            secret(Some("a"), "", Some(SecretBlueprint::ValidationContext)),
        ]))
        .unwrap_err();
    assert_eq!((err.index, err.field), (1, "generateFromTlsSecret"));

    // The secret fields belong to secrets only.
    let mut cluster = secret(Some("a"), r#"{"name":"c"}"#, None);
    cluster.type_ = EnvoyResourceType::Cluster;
    let err = d().decode_all(&with(vec![cluster])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "spec.resources[0].generateFromTlsSecret: only a resource of type secret has generateFromTlsSecret"
    );
}

#[test]
fn the_error_says_where() {
    let mut bad = api_listener();
    bad["api_listener"]["api_listener"]["stat_prefx"] = json!("x");
    let err = d()
        .decode_all(&spec(
            Serialization::Json,
            &[
                (EnvoyResourceType::Listener, json_of(&api_listener())),
                (EnvoyResourceType::Listener, json_of(&bad)),
            ],
        ))
        .unwrap_err();
    assert_eq!(err.index, 1);
    let text = err.to_string();
    assert!(
        text.starts_with("spec.resources[1].value: api_listener.api_listener.stat_prefx: "),
        "{text}"
    );
    let err = d()
        .decode_all(&spec(
            Serialization::Json,
            &[(EnvoyResourceType::Listener, "{".into())],
        ))
        .unwrap_err();
    assert!(
        err.to_string().starts_with("spec.resources[0].value: EOF"),
        "{err}"
    );
}

#[test]
fn a_duplicate_key_is_refused() {
    let (_, msg) = listener(r#"{"name": "a", "name": "b"}"#).unwrap_err();
    assert!(msg.contains("duplicate key"), "{msg}");
    let (_, msg) = d()
        .decode(
            EnvoyResourceType::Listener,
            Serialization::Yaml,
            "name: a\nname: b\n",
        )
        .unwrap_err();
    assert!(msg.contains("duplicate"), "{msg}");
}

#[test]
fn a_resource_of_the_largest_size_decodes_and_a_larger_one_is_refused() {
    let host = |i: usize| {
        json!({"name": format!("vh-{i}"), "domains": [format!("host-{i}.example.com")],
               "routes": [{"match": {"prefix": "/"}, "route": {"cluster": format!("cluster-{i}")}}]})
    };
    let body = |n: usize| {
        let hosts: Vec<_> = (0..n).map(host).collect();
        serde_json::to_string(&json!({"name": "big", "virtual_hosts": hosts})).unwrap()
    };
    let per_host = body(2).len() - body(1).len();
    let mut n = RESOURCE_MAX / per_host;
    let mut text = body(n);
    while text.len() > RESOURCE_MAX {
        n -= 1;
        text = body(n);
    }
    assert!(text.len() > RESOURCE_MAX - 2 * per_host, "{}", text.len());
    let started = std::time::Instant::now();
    let got = d()
        .decode(EnvoyResourceType::Route, Serialization::Json, &text)
        .unwrap();
    eprintln!(
        "{} bytes of JSON ({n} virtual hosts) decoded in {:?}",
        text.len(),
        started.elapsed()
    );
    assert_eq!(got.name, "big");
    let long = format!("{text}{}", " ".repeat(RESOURCE_MAX));
    let (_, msg) = d()
        .decode(EnvoyResourceType::Route, Serialization::Json, &long)
        .unwrap_err();
    assert!(msg.contains("more than"), "{msg}");
}

#[test]
fn deep_nesting_is_refused_without_exhausting_the_stack() {
    // The largest resource, all nesting: JSON stops at 128 levels; YAML before it scans.
    let depth = RESOURCE_MAX / 2 - 10;
    let arrays = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    let objects = format!("{}{}", "{\"a\":".repeat(depth / 5), "}".repeat(depth / 5));
    for text in [&arrays, &objects] {
        let (path, msg) = listener(text).unwrap_err();
        assert_eq!(path, "");
        assert!(msg.contains("recursion limit"), "{msg}");
        let started = std::time::Instant::now();
        let (_, msg) = listener_yaml(text).unwrap_err();
        assert!(msg.contains("more than 4096 '[' and '{'"), "{msg}");
        assert!(started.elapsed() < std::time::Duration::from_millis(100));
    }
    // Within the flow bound, YAML stops at 128 levels too.
    let yaml = format!("{}{}", "{a: ".repeat(4000), "}".repeat(4000));
    let (_, msg) = listener_yaml(&yaml).unwrap_err();
    assert!(msg.contains("recursion limit"), "{msg}");
    // Block style nests by indentation, which costs text: as deep as 256 KiB allows.
    let mut yaml = String::new();
    for i in 0..700 {
        yaml.push_str(&" ".repeat(i));
        yaml.push_str("a:\n");
    }
    assert!(yaml.len() < RESOURCE_MAX);
    let (_, msg) = listener_yaml(&yaml).unwrap_err();
    assert!(msg.contains("recursion limit"), "{msg}");
    // Just inside the parsers' limit, through messages: Struct values in metadata, each level
    // two messages deep (Struct, Value). Refused: more than prost decodes.
    for levels in [40, 60, 120] {
        let mut inner = json!("leaf");
        for _ in 0..levels {
            inner = json!({ "k": inner });
        }
        let v = json!({"name": "deep", "metadata": {"filter_metadata": {"f": inner}}});
        let got = listener(&json_of(&v));
        match levels {
            40 => assert!(got.is_ok(), "{got:?}"),
            _ => assert!(got.is_err(), "{levels} levels"),
        }
    }
    // `Any`s holding `Any`s: each payload decodes on its own (as the clients decode them),
    // and the text's nesting bounds the whole.
    let chain = |n: usize| {
        let mut any = json!({"@type": "type.googleapis.com/google.protobuf.Empty", "value": {}});
        for _ in 0..n {
            any = json!({"@type": "type.googleapis.com/google.protobuf.Any", "value": any});
        }
        json_of(&json!({"name": "deep", "api_listener": {"api_listener": any}}))
    };
    listener(&chain(60)).unwrap();
    let (_, msg) = listener(&chain(130)).unwrap_err();
    assert!(msg.contains("recursion limit"), "{msg}");
}

#[test]
fn yaml_aliases_cannot_expand_without_bound() {
    let mut yaml = String::from("name: x\nanchors:\n  - &a \"");
    yaml.push_str(&"x".repeat(100_000));
    yaml.push_str("\"\nbomb: [");
    for _ in 0..30_000 {
        yaml.push_str("*a,");
    }
    yaml.push_str("]\n");
    assert!(yaml.len() < RESOURCE_MAX);
    let (path, msg) = d()
        .decode(EnvoyResourceType::Listener, Serialization::Yaml, &yaml)
        .unwrap_err();
    assert_eq!(path, "");
    assert!(msg.contains("expands to more than"), "{msg}");
    // A few aliases are fine.
    let yaml = "name: x\nmetadata:\n  filter_metadata:\n    a: &m {k: v}\n    b: *m\n";
    listener_yaml(yaml).unwrap();
}

fn listener_yaml(text: &str) -> Result<Decoded, (String, String)> {
    d().decode(EnvoyResourceType::Listener, Serialization::Yaml, text)
}

/// Envoy's extension points accept xDS's TypedStruct (and UDPA's older one) for
/// configurations whose proto the control plane does not have, but `envoy-types` compiles
/// neither: such a resource is refused, saying which message is missing. If a later
/// `envoy-types` has them, this fails and the docs (docs/xds.md, "Admission") change.
#[test]
fn typed_struct_is_refused_by_name() {
    for name in ["xds.type.v3.TypedStruct", "udpa.type.v1.TypedStruct"] {
        assert!(d().pool().get_message_by_name(name).is_none(), "{name}");
        let mut v = api_listener();
        v["api_listener"]["api_listener"]["http_filters"][0]["typed_config"] = json!({
            "@type": format!("type.googleapis.com/{name}"),
            "type_url": "type.googleapis.com/acme.Filter",
            "value": {"anything": ["goes", 1]}
        });
        let (path, msg) = listener(&json_of(&v)).unwrap_err();
        assert_eq!(
            path,
            "api_listener.api_listener.http_filters[0].typed_config.@type"
        );
        assert!(msg.contains(name), "{msg}");
    }
}

/// Run alone to read the figures: `cargo test -p spur-envoy --lib
/// tests::loading_the_pool -- --nocapture`.
#[test]
fn loading_the_pool() {
    fn rss_kib() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse()
            .ok()
    }
    let before = rss_kib();
    let started = std::time::Instant::now();
    let decoder = Decoder::new(descriptors::DESCRIPTORS).unwrap();
    let elapsed = started.elapsed();
    let after = rss_kib();
    eprintln!(
        "descriptor pool: {} bytes, {} files, {} messages; loaded in {elapsed:?}; VmRSS {before:?} → {after:?} KiB",
        descriptors::DESCRIPTORS.len(),
        decoder.pool().files().len(),
        decoder.pool().all_messages().len(),
    );
    assert!(decoder.pool().files().len() > 500);
}
