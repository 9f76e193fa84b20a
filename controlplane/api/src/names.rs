//! Names of the objects the controllers create: deterministic (the same inputs always give the
//! same name, so reconciling is idempotent), length-safe and valid for any kind, Services
//! included. Names are for uniqueness and for humans; code finds objects through labels and
//! owner references and never parses a name. A sandbox's routing key is derived here too, from
//! its UID.

use crate::common::WorkloadRef;
use crate::validation::is_label_value;

/// Longest derived name: a DNS label, the strictest name rule among the kinds created.
pub const MAX_NAME_LEN: usize = 63;
/// Hex digits of hash in every derived name (40 bits).
pub const HASH_LEN: usize = 10;

/// `<readable parts, sanitized, joined by '-', truncated>-<hash>`: always a DNS-1035 label (at
/// most 63 of `[a-z0-9-]`, starting with a letter), hence valid for Services too. The hash
/// covers every part exactly as given (before sanitizing or truncating) plus `identity`, the
/// parts that distinguish objects but are not worth showing (kind, namespace, purpose), so
/// names differ whenever their inputs differ, up to a 40-bit hash collision.
pub fn derived_name(readable: &[&str], identity: &[&str]) -> String {
    let mut text = String::with_capacity(MAX_NAME_LEN);
    for part in readable {
        for c in part.chars() {
            let c = c.to_ascii_lowercase();
            let c = if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '-'
            };
            if c != '-' || !(text.is_empty() || text.ends_with('-')) {
                text.push(c);
            }
        }
        if !text.is_empty() && !text.ends_with('-') {
            text.push('-');
        }
    }
    if !text.starts_with(|c: char| c.is_ascii_lowercase()) {
        text.insert_str(0, "s-");
    }
    // Everything is ASCII here, so byte truncation is character truncation.
    text.truncate(MAX_NAME_LEN - HASH_LEN - 1);
    let text = text.trim_end_matches('-');
    format!(
        "{text}-{:0width$x}",
        hash(readable, identity) & ((1 << (4 * HASH_LEN)) - 1),
        width = HASH_LEN
    )
}

/// FNV-1a (64-bit): stable across Rust releases and platforms, unlike `std`'s hashers, which is
/// what names that must survive controller upgrades need. Parts are delimited so that
/// `["a-b", "c"]` and `["a", "b-c"]` differ.
fn hash(readable: &[&str], identity: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    for (section, parts) in [readable, identity].into_iter().enumerate() {
        for part in parts {
            part.bytes().for_each(&mut eat);
            eat(0);
        }
        eat(0xff - section as u8);
    }
    h
}

/// Name of a sandbox's fork of `baseline`: the ForkedWorkload and the fork Deployment
/// (both in the baseline's namespace). Also a valid label value, for selecting the fork's pods.
pub fn fork_name(sandbox: &str, baseline: &WorkloadRef) -> String {
    derived_name(
        &[sandbox, &baseline.name],
        &["fork", baseline.kind.as_str(), &baseline.namespace],
    )
}

/// Name of the sandbox Service standing for `baseline_service` (in that Service's namespace).
pub fn sandbox_service_name(sandbox: &str, baseline_service: &str) -> String {
    derived_name(&[sandbox, baseline_service], &["service"])
}

/// Name of the ExternalWorkload for `spec.local[].name == local`.
pub fn external_workload_name(sandbox: &str, local: &str) -> String {
    derived_name(&[sandbox, local], &["external"])
}

/// Name of the VirtualWorkload for `spec.virtual[].name == virtual_name`.
pub fn virtual_workload_name(sandbox: &str, virtual_name: &str) -> String {
    derived_name(&[sandbox, virtual_name], &["virtual"])
}

/// Name of the Resource (cluster-scoped) for `spec.resources[].name == resource`; also its
/// ObjectLifecycleMethods', its io context's and its output Secrets' (one per fork namespace).
pub fn resource_name(sandbox: &str, resource: &str) -> String {
    derived_name(&[sandbox, resource], &["resource"])
}

/// Name of the Secret holding an io context's values (in the io context server's namespace).
pub fn io_context_secret_name(io_context: &str) -> String {
    format!("spur-io-{io_context}")
}

/// Name of the RoutingConfig of a sandbox's routing key.
pub fn sandbox_routing_config_name(sandbox: &str) -> String {
    derived_name(&[sandbox], &["routingconfig", "Sandbox"])
}

/// Name of the RoutingConfig of a route group's routing key.
pub fn route_group_routing_config_name(route_group: &str) -> String {
    derived_name(&[route_group], &["routingconfig", "RouteGroup"])
}

/// Name of the IstioRoute (cluster-scoped) of RoutingConfig `routing_config` for the baseline
/// Service `namespace/service`; `owner` (the sandbox or route group) is only for people.
pub fn istio_route_name(
    owner: &str,
    routing_config: &str,
    namespace: &str,
    service: &str,
) -> String {
    derived_name(
        &[owner, service],
        &["istioroute", routing_config, namespace],
    )
}

/// Name of the GatewayAPIRoute (cluster-scoped) of RoutingConfig `routing_config` for the
/// baseline Service `namespace/service`.
pub fn gateway_api_route_name(
    owner: &str,
    routing_config: &str,
    namespace: &str,
    service: &str,
) -> String {
    derived_name(
        &[owner, service],
        &["gatewayapiroute", routing_config, namespace],
    )
}

/// Name of the HTTPRoute derived by GatewayAPIRoute `mesh_route` from the user's HTTPRoute
/// `http_route` (same namespace) for the target Service's `port`.
pub fn derived_http_route_name(mesh_route: &str, http_route: &str, port: i32) -> String {
    derived_name(
        &[http_route, "spur"],
        &["httproute", mesh_route, &port.to_string()],
    )
}

/// `value` itself when it is a valid label value, else a derived name standing for it.
pub fn label_value(value: &str) -> String {
    if is_label_value(value) {
        value.to_owned()
    } else {
        derived_name(&[value], &["label"])
    }
}

/// A routing key derived from the sandbox's UID: stable across reconciles and operator
/// restarts (even if status were lost), unique per sandbox object, and a valid label value.
pub fn routing_key(uid: &str) -> String {
    // FNV-1a 64, rendered in base 36: 13 characters, lowercase alphanumerics.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in uid.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = [b'0'; 13];
    for slot in out.iter_mut().rev() {
        *slot = DIGITS[(h % 36) as usize];
        h /= 36;
    }
    out.iter().map(|&b| char::from(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::WorkloadKind;
    use crate::validation::is_dns1035_label;

    #[test]
    fn names_are_valid_bounded_and_stable() {
        let long = "x".repeat(300);
        for (readable, identity) in [
            (vec!["sb1", "route"], vec![]),
            (vec![long.as_str(), long.as_str()], vec!["k"]),
            (vec!["1abc", "Route_Svc.v2"], vec![]),
            (vec!["---", ""], vec![]),
            (vec![], vec![]),
            (vec!["ünïcode", "名前"], vec![]),
        ] {
            let n = derived_name(&readable, &identity);
            assert!(n.len() <= MAX_NAME_LEN, "{n}");
            assert!(is_dns1035_label(&n), "{n}");
            assert!(is_label_value(&n), "{n}");
            assert_eq!(n, derived_name(&readable, &identity), "stable");
        }
        // Pinned: a change here renames every object in every cluster.
        assert_eq!(derived_name(&["sb1", "route"], &[]), "sb1-route-e14f653357");
        assert!(derived_name(&["1abc", "Route_Svc.v2"], &[]).starts_with("s-1abc-route-svc-v2-"));
        let truncated = derived_name(&[long.as_str()], &[]);
        assert_eq!(truncated.len(), MAX_NAME_LEN);
        assert!(truncated.starts_with(&"x".repeat(52)));
    }

    #[test]
    fn different_inputs_give_different_names() {
        let d = WorkloadRef::new(WorkloadKind::Deployment, "hotrod", "route");
        let r = WorkloadRef::new(WorkloadKind::Rollout, "hotrod", "route");
        let other_ns = WorkloadRef::new(WorkloadKind::Deployment, "other", "route");
        let names = [
            fork_name("sb1", &d),
            fork_name("sb1", &r),
            fork_name("sb1", &other_ns),
            fork_name("sb2", &d),
            sandbox_service_name("sb1", "route"),
            external_workload_name("sb1", "route"),
            virtual_workload_name("sb1", "route"),
            derived_name(&["sb1-route"], &[]),
            derived_name(&["sb1", "route"], &[]),
            derived_name(&["sb1-r", "oute"], &[]),
            derived_name(&["sb1"], &["route"]),
            sandbox_routing_config_name("sb1"),
            route_group_routing_config_name("sb1"),
            istio_route_name("sb1", "rc", "shop", "route"),
            gateway_api_route_name("sb1", "rc", "shop", "route"),
            istio_route_name("sb1", "rc", "other", "route"),
            derived_http_route_name("gar", "route", 80),
            derived_http_route_name("gar", "route", 81),
        ];
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        // Long names that differ only past the truncation point still differ.
        let a = "a".repeat(80);
        let b = format!("{}b", "a".repeat(79));
        assert_ne!(derived_name(&[&a], &[]), derived_name(&[&b], &[]));
        assert_eq!(
            derived_name(&[&a], &[])[..52],
            derived_name(&[&b], &[])[..52]
        );
    }

    #[test]
    fn label_values_pass_through_when_valid() {
        assert_eq!(label_value("route"), "route");
        assert_eq!(label_value(""), "");
        let long = "a.".repeat(100);
        let v = label_value(&long);
        assert!(is_label_value(&v) && v.len() <= 63, "{v}");
    }

    #[test]
    fn routing_keys_are_stable_label_values() {
        let k = routing_key("5f1b2a8e-0d7c-4a55-9b1e-3c2d1e0f9a8b");
        assert_eq!(k.len(), 13);
        assert!(
            k.bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
        );
        assert_eq!(k, routing_key("5f1b2a8e-0d7c-4a55-9b1e-3c2d1e0f9a8b"));
        assert_ne!(k, routing_key("5f1b2a8e-0d7c-4a55-9b1e-3c2d1e0f9a8c"));
    }
}
