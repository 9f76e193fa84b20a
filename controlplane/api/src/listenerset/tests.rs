#![allow(clippy::unwrap_used)]
use super::*;
use std::time::Duration;

use serde_json::{Value, json};

/// A valid set: a UDP listener to pods with a health check and a key route to a sandbox
/// cluster, and a TCP listener to an address and a DNS name.
fn good() -> Value {
    json!({
        "selector": {"matchLabels": {"app": "spur-gateway"}},
        "listeners": [{
            "name": "rtp", "protocol": "udp", "port": 5000,
            "cluster": {
                "name": "media", "lb": "maglev",
                "hashKey": {"firstBytes": {"offset": 8, "length": 4}},
                "endpoints": [{"selector": {"matchLabels": {"app": "media"}}, "port": 5000, "healthCheckPort": 8080}],
                "healthCheck": {"protocol": "http", "path": "/ready", "interval": "2s", "timeout": "500ms"},
                "idleTimeout": "30s", "maxSessions": 1000, "overflow": "refuse"
            },
            "keyRoute": {"offset": 0, "routes": [
                {"key": "sbx1", "cluster": "media-sbx"},
                {"keyHex": "00ff", "cluster": "media-sbx"},
                {"sandbox": "alice", "cluster": "media-sbx"}
            ]}
        }, {
            "name": "pg", "protocol": "tcp", "port": 5432, "firstBytesTimeout": "1s",
            "cluster": {"name": "pg", "lb": "ringHash", "hashKey": {"sourceIp": {}},
                        "connectTimeout": "2s",
                        "endpoints": [{"address": "10.0.0.3", "port": 5432},
                                      {"dnsName": "pg.db.svc.cluster.local", "port": 5432}]}
        }, {
            "name": "rtp-tcp", "protocol": "tcp", "port": 5000,
            "cluster": {"name": "media-tcp", "endpoints": [{"address": "::1", "port": 5000}]}
        }],
        "clusters": [{"name": "media-sbx", "endpoints": [
            {"selector": {"matchLabels": {"app": "media", "spur.dev/fork": "f1"}}, "port": 5000}
        ]}]
    })
}

fn spec(v: Value) -> ListenerSetSpec {
    serde_json::from_value(v).unwrap()
}

/// The problems of `v` (as set `name`), as `path: message` lines.
fn problems(name: &str, v: Value) -> Vec<String> {
    match spec(v).validate(name) {
        Ok(()) => Vec::new(),
        Err(e) => e.field_errors().iter().map(ToString::to_string).collect(),
    }
}

/// `good()` changed by `f` has exactly one problem, at `path`, whose message has `words`.
#[track_caller]
fn refused(f: impl FnOnce(&mut Value), path: &str, words: &str) {
    let mut v = good();
    f(&mut v);
    let got = problems("media", v);
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(
        got[0].starts_with(&format!("{path}: ")) && got[0].contains(words),
        "{got:#?}"
    );
}

#[test]
fn a_good_set_passes_and_helpers_read_it() {
    assert_eq!(problems("media", good()), Vec::<String>::new());
    let s = spec(good());
    assert!(s.makes_service());
    assert_eq!(s.cluster_protocol("media"), Some(Protocol::Udp));
    assert_eq!(s.cluster_protocol("media-sbx"), Some(Protocol::Udp));
    assert_eq!(s.cluster_protocol("nope"), None);
    let paths: Vec<String> = s.all_clusters().map(|(p, _)| p).collect();
    assert_eq!(
        paths,
        [
            "spec.listeners[0].cluster",
            "spec.listeners[1].cluster",
            "spec.listeners[2].cluster",
            "spec.clusters[0]"
        ]
    );
}

#[test]
fn names_ports_and_clusters_are_unique() {
    refused(
        |v| v["listeners"][1]["name"] = json!("rtp"),
        "spec.listeners[1].name",
        "already used by spec.listeners[0]",
    );
    refused(
        |v| v["listeners"][1]["name"] = json!("Pg"),
        "spec.listeners[1].name",
        "DNS-1123 label",
    );
    refused(
        |v| v["listeners"][1]["name"] = json!("a-very-long-listener"),
        "spec.listeners[1].name",
        "Service port name",
    );
    // Without a Service the port name rule does not apply.
    let mut v = good();
    v["listeners"][1]["name"] = json!("a-very-long-listener");
    v["service"] = json!({"type": "None"});
    assert_eq!(problems("media", v), Vec::<String>::new());
    // TCP and UDP may share a port number; two of one protocol may not.
    refused(
        |v| v["listeners"][2]["protocol"] = json!("udp"),
        "spec.listeners[2].port",
        "udp port 5000 is already taken by spec.listeners[0] (\"rtp\")",
    );
    refused(
        |v| v["listeners"][1]["cluster"]["name"] = json!("media-sbx"),
        "spec.clusters[0].name",
        "cluster name \"media-sbx\" is already used by spec.listeners[1].cluster",
    );
    refused(
        |v| v["listeners"][2]["cluster"]["name"] = json!("media"),
        "spec.listeners[2].cluster.name",
        "already used by spec.listeners[0].cluster",
    );
    refused(
        |v| v["listeners"] = json!([]),
        "spec.listeners",
        "must not be empty",
    );
    refused(
        |v| v["listeners"][1]["port"] = json!(0),
        "spec.listeners[1].port",
        "between 1 and 65535",
    );
}

#[test]
fn key_routes() {
    refused(
        |v| v["listeners"][0]["keyRoute"]["routes"][0]["cluster"] = json!("nope"),
        "spec.listeners[0].keyRoute.routes[0].cluster",
        "names no cluster of this set",
    );
    // A listener's own cluster is a valid target.
    let mut v = good();
    v["listeners"][0]["keyRoute"]["routes"][0]["cluster"] = json!("pg");
    assert_eq!(problems("media", v), Vec::<String>::new());
    refused(
        |v| v["listeners"][0]["keyRoute"]["routes"][0]["keyHex"] = json!("00"),
        "spec.listeners[0].keyRoute.routes[0]",
        "exactly one of key, keyHex and sandbox",
    );
    refused(
        |v| v["listeners"][0]["keyRoute"]["routes"][0] = json!({"cluster": "media"}),
        "spec.listeners[0].keyRoute.routes[0]",
        "exactly one of key, keyHex and sandbox",
    );
    for bad in ["0", "zz", "+1", "0g"] {
        refused(
            |v| v["listeners"][0]["keyRoute"]["routes"][1]["keyHex"] = json!(bad),
            "spec.listeners[0].keyRoute.routes[1].keyHex",
            "hex digits",
        );
    }
    refused(
        |v| v["listeners"][0]["keyRoute"]["routes"][2]["sandbox"] = json!("Alice_1"),
        "spec.listeners[0].keyRoute.routes[2].sandbox",
        "DNS-1123 label",
    );
    refused(
        |v| {
            v["listeners"][0]["keyRoute"]["routes"][1] =
                json!({"keyHex": "73627831", "cluster": "media"})
        },
        "spec.listeners[0].keyRoute.routes[1].keyHex",
        "the same key as routes[0]",
    );
    refused(
        |v| {
            v["listeners"][0]["keyRoute"]["routes"][1] =
                json!({"sandbox": "alice", "cluster": "media"})
        },
        "spec.listeners[0].keyRoute.routes[2].sandbox",
        "already routed by routes[1]",
    );
    refused(
        |v| v["listeners"][0]["keyRoute"]["routes"][0]["key"] = json!(""),
        "spec.listeners[0].keyRoute.routes[0].key",
        "1 to 1024 bytes",
    );
    refused(
        |v| v["listeners"][0]["keyRoute"]["length"] = json!(4),
        "spec.listeners[0].keyRoute.routes[1].keyHex",
        "is 2 bytes, but length is 4",
    );
    refused(
        |v| v["listeners"][0]["keyRoute"]["offset"] = json!(MAX_FIRST_BYTES - 3),
        "spec.listeners[0].keyRoute",
        "offset + key length must be at most 16384",
    );
    refused(
        |v| v["listeners"][0]["keyRoute"]["routes"] = json!([]),
        "spec.listeners[0].keyRoute.routes",
        "must not be empty",
    );
}

#[test]
fn endpoints() {
    refused(
        |v| v["listeners"][1]["cluster"]["endpoints"][0]["dnsName"] = json!("pg"),
        "spec.listeners[1].cluster.endpoints[0]",
        "exactly one of selector, address and dnsName",
    );
    refused(
        |v| v["listeners"][1]["cluster"]["endpoints"][0] = json!({"port": 1}),
        "spec.listeners[1].cluster.endpoints[0]",
        "exactly one of selector, address and dnsName",
    );
    refused(
        |v| v["listeners"][1]["cluster"]["endpoints"][0]["address"] = json!("10.0.0.300"),
        "spec.listeners[1].cluster.endpoints[0].address",
        "IPv4 or IPv6 address",
    );
    refused(
        |v| v["listeners"][1]["cluster"]["endpoints"][0]["address"] = json!("0.0.0.0"),
        "spec.listeners[1].cluster.endpoints[0].address",
        "specific address",
    );
    refused(
        |v| v["listeners"][1]["cluster"]["endpoints"][1]["dnsName"] = json!("pg..db"),
        "spec.listeners[1].cluster.endpoints[1].dnsName",
        "DNS name",
    );
    refused(
        |v| v["listeners"][1]["cluster"]["endpoints"][1]["dnsName"] = json!("10.0.0.4"),
        "spec.listeners[1].cluster.endpoints[1].dnsName",
        "write it in address",
    );
    refused(
        |v| {
            v["listeners"][1]["cluster"]["endpoints"][1] =
                json!({"address": "10.0.0.3", "port": 5432})
        },
        "spec.listeners[1].cluster.endpoints[1]",
        "the same endpoints as endpoints[0]",
    );
    refused(
        |v| v["listeners"][1]["cluster"]["endpoints"][0]["port"] = json!(0),
        "spec.listeners[1].cluster.endpoints[0].port",
        "between 1 and 65535",
    );
    refused(
        |v| v["listeners"][1]["cluster"]["endpoints"] = json!([]),
        "spec.listeners[1].cluster.endpoints",
        "must not be empty",
    );
    // A UDP listener's health-checked endpoints need a TCP port to be checked on.
    refused(
        |v| {
            v["listeners"][0]["cluster"]["endpoints"][0]
                .as_object_mut()
                .unwrap()
                .remove("healthCheckPort");
        },
        "spec.listeners[0].cluster.endpoints[0].healthCheckPort",
        "health checks speak TCP or HTTP",
    );
}

#[test]
fn selectors() {
    // Endpoint selectors become headless Services' selectors.
    refused(
        |v| {
            v["clusters"][0]["endpoints"][0]["selector"] = json!({
                "matchLabels": {"app": "media"},
                "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]})
        },
        "spec.clusters[0].endpoints[0].selector.matchExpressions",
        "headless Service",
    );
    let mut v = good();
    v["clusters"][0]["endpoints"][0]["selector"] = json!({});
    let got = problems("media", v);
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(
        got[0].starts_with("spec.clusters[0].endpoints[0].selector.matchLabels: must not be empty"),
        "{got:#?}"
    );
    refused(
        |v| v["clusters"][0]["endpoints"][0]["selector"]["matchLabels"] = json!({"bad key": "x"}),
        "spec.clusters[0].endpoints[0].selector.matchLabels[bad key]",
        "label key",
    );
    refused(
        |v| v["selector"]["matchLabels"]["app"] = json!("-x"),
        "spec.selector.matchLabels[app]",
        "label value",
    );
    // The set's selector: expressions only without a Service, and valid ones.
    refused(
        |v| v["selector"]["matchExpressions"] = json!([{"key": "app", "operator": "Exists"}]),
        "spec.selector.matchExpressions",
        "listeners' Service's selector",
    );
    let mut v = good();
    v["service"] = json!({"type": "None"});
    v["selector"] = json!({"matchExpressions": [{"key": "app", "operator": "Exists"}]});
    assert_eq!(problems("media", v.clone()), Vec::<String>::new());
    v["selector"] = json!({"matchExpressions": [
        {"key": "app", "operator": "In"},
        {"key": "app", "operator": "Exists", "values": ["x"]},
        {"key": "app", "operator": "Near", "values": ["x"]},
    ]});
    let got = problems("media", v);
    assert_eq!(
        got.iter()
            .map(|p| p.split(':').next().unwrap())
            .collect::<Vec<_>>(),
        [
            "spec.selector.matchExpressions[0].values",
            "spec.selector.matchExpressions[1].values",
            "spec.selector.matchExpressions[2].operator"
        ],
        "{got:#?}"
    );
    // With a Service, the set's name is a Service's.
    let got = problems("1media", good());
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(
        got[0].starts_with("metadata.name: must be a DNS-1035 label"),
        "{got:#?}"
    );
    let mut v = good();
    v["service"] = json!({"type": "None"});
    assert_eq!(problems("1media", v), Vec::<String>::new());
}

#[test]
fn hash_keys_health_checks_durations_and_bounds() {
    refused(
        |v| v["listeners"][1]["cluster"]["hashKey"] = json!({"sourceIp": {}, "constant": "k"}),
        "spec.listeners[1].cluster.hashKey",
        "exactly one of constant, sourceIp, sourceIpPort and firstBytes",
    );
    refused(
        |v| v["listeners"][1]["cluster"]["hashKey"] = json!({}),
        "spec.listeners[1].cluster.hashKey",
        "exactly one of",
    );
    refused(
        |v| v["listeners"][1]["cluster"]["lb"] = json!("roundRobin"),
        "spec.listeners[1].cluster.hashKey",
        "needs lb ringHash or maglev",
    );
    refused(
        |v| {
            v["listeners"][0]["cluster"]["hashKey"]["firstBytes"]["offset"] = json!(MAX_FIRST_BYTES)
        },
        "spec.listeners[0].cluster.hashKey.firstBytes",
        "offset + length must be at most 16384",
    );
    refused(
        |v| v["listeners"][0]["cluster"]["hashKey"]["firstBytes"]["length"] = json!(0),
        "spec.listeners[0].cluster.hashKey.firstBytes.length",
        "at least 1",
    );
    refused(
        |v| v["listeners"][0]["cluster"]["healthCheck"]["path"] = json!("ready"),
        "spec.listeners[0].cluster.healthCheck.path",
        "must start with '/'",
    );
    refused(
        |v| v["listeners"][0]["cluster"]["healthCheck"]["protocol"] = json!("tcp"),
        "spec.listeners[0].cluster.healthCheck.path",
        "http only",
    );
    refused(
        |v| v["listeners"][0]["cluster"]["healthCheck"]["timeout"] = json!("3s"),
        "spec.listeners[0].cluster.healthCheck.timeout",
        "at most interval",
    );
    refused(
        |v| v["listeners"][0]["cluster"]["healthCheck"]["healthyThreshold"] = json!(0),
        "spec.listeners[0].cluster.healthCheck.healthyThreshold",
        "at least 1",
    );
    for (bad, words) in [
        ("5 s", "not a duration"),
        ("1d", "not a duration"),
        ("-1s", "not a duration"),
        ("", "not a duration"),
        ("0ms", "greater than zero"),
        ("169h", "at most 168h"),
    ] {
        refused(
            |v| v["listeners"][0]["cluster"]["idleTimeout"] = json!(bad),
            "spec.listeners[0].cluster.idleTimeout",
            words,
        );
    }
    refused(
        |v| v["listeners"][1]["cluster"]["connectTimeout"] = json!("0"),
        "spec.listeners[1].cluster.connectTimeout",
        "greater than zero",
    );
    refused(
        |v| v["listeners"][1]["firstBytesTimeout"] = json!("soon"),
        "spec.listeners[1].firstBytesTimeout",
        "not a duration",
    );
    refused(
        |v| v["listeners"][0]["cluster"]["maxSessions"] = json!(MAX_SESSIONS + 1),
        "spec.listeners[0].cluster.maxSessions",
        "between 1 and 1000000",
    );
}

#[test]
fn the_rest_of_the_bounds() {
    refused(
        |v| v["listeners"][0]["cluster"]["endpoints"][0]["healthCheckPort"] = json!(0),
        "spec.listeners[0].cluster.endpoints[0].healthCheckPort",
        "between 1 and 65535",
    );
    // The key routes name the cluster by its old name, now gone: each says so too.
    let mut v = good();
    v["clusters"][0]["name"] = json!("Media_Sbx");
    let got = problems("media", v);
    assert_eq!(got.len(), 4, "{got:#?}");
    assert!(
        got[0].starts_with("spec.clusters[0].name: must be a DNS-1123 label"),
        "{got:#?}"
    );
    refused(
        |v| v["listeners"][1]["cluster"]["hashKey"] = json!({"constant": ""}),
        "spec.listeners[1].cluster.hashKey.constant",
        "1 to 1024 bytes",
    );
    refused(
        |v| v["listeners"][0]["keyRoute"]["length"] = json!(0),
        "spec.listeners[0].keyRoute.length",
        "at least 1",
    );
    refused(
        |v| {
            let ep = json!({"selector": {"matchLabels": {"app": "x"}}, "port": 1});
            let eps: Vec<Value> = (1..=MAX_ENDPOINT_SERVICES)
                .map(|p| {
                    let mut e = ep.clone();
                    e["port"] = json!(p);
                    e
                })
                .collect();
            v["clusters"][0]["endpoints"] = json!(eps);
        },
        "spec",
        "257 selector endpoints, at most 256",
    );
    refused(
        |v| {
            v["service"] = json!({"type": "None"});
            v["selector"] = json!({"matchExpressions": [{"key": "-bad", "operator": "Exists"}]});
        },
        "spec.selector.matchExpressions[0].key",
        "label key",
    );
}

#[test]
fn every_problem_in_one_pass() {
    let mut v = good();
    v["listeners"][1]["name"] = json!("rtp");
    v["listeners"][1]["cluster"]["endpoints"][0]["address"] = json!("nowhere");
    v["listeners"][2]["cluster"]["name"] = json!("pg");
    let err = spec(v).validate("media").unwrap_err();
    assert_eq!(err.field_errors().len(), 3, "{err}");
    assert!(
        err.to_string().starts_with("invalid ListenerSet: "),
        "{err}"
    );
}

#[test]
fn durations_and_hex() {
    assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
    assert_eq!(parse_duration("5"), Some(Duration::from_secs(5)));
    assert_eq!(parse_duration(" 2m "), Some(Duration::from_secs(120)));
    assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
    assert_eq!(parse_duration("1.5s"), None);
    assert_eq!(parse_hex("00fFa1"), Some(vec![0, 0xff, 0xa1]));
    assert_eq!(parse_hex(""), Some(vec![]));
    assert_eq!(parse_hex("+1"), None);
    assert!(is_port_name("rtp-2") && !is_port_name("12") && !is_port_name("a--b"));
}
