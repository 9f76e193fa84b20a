//! What an IstioRoute puts in a VirtualService, as pure functions: its routes, where they go
//! among the VirtualService's own, and which VirtualServices name its target Service.

use kube::core::DynamicObject;
use serde_json::{Value, json};
use spur_api::carriers::{KeyExtractor, MatchKind, MatchOn};
use spur_api::mesh::{MeshRoute, ServiceRef};

use crate::spec_of;

/// Every route Spur writes into a VirtualService is named `spur.<IstioRoute>.<port>`; the
/// `spur.` prefix is Spur's, and such routes are kept ahead of all others.
const ROUTE_PREFIX: &str = "spur.";

pub(super) fn hosts(vs: &DynamicObject) -> impl Iterator<Item = &str> {
    spec_of(vs)
        .get("hosts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
}

pub(super) fn routes_of(vs: &DynamicObject) -> Vec<Value> {
    spec_of(vs)
        .get("http")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// Whether a VirtualService host in namespace `vs_ns` names `svc`: `name.ns`, `name.ns.svc`
/// and `name.ns.svc.<domain>` anywhere, the short name only in the Service's own namespace
/// (Istio reads a short name in the VirtualService's namespace). Wildcards are not followed.
pub(super) fn names_service(host: &str, vs_ns: &str, svc: &ServiceRef, domain: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    let (name, ns) = (svc.name.as_str(), svc.namespace.as_str());
    (host == name && vs_ns == ns)
        || host == format!("{name}.{ns}")
        || host == format!("{name}.{ns}.svc")
        || host == format!("{name}.{ns}.svc.{domain}")
}

pub(super) fn route_name(r: &Value) -> &str {
    r.get("name").and_then(Value::as_str).unwrap_or_default()
}

pub(super) fn is_spur(r: &Value) -> bool {
    route_name(r).starts_with(ROUTE_PREFIX)
}

pub(super) fn is_own(r: &Value, ir_name: &str) -> bool {
    // IstioRoute names are DNS labels (no dots): `spur.<name>.` is this one's alone.
    route_name(r)
        .strip_prefix(ROUTE_PREFIX)
        .and_then(|rest| rest.strip_prefix(ir_name))
        .is_some_and(|rest| rest.starts_with('.'))
}

/// The HTTP routes of an IstioRoute: one per mapped port, matching the port and any one key
/// carrier (a header, or the query parameter), sending to the sandbox Service's fully qualified
/// name.
pub(super) fn entries(
    ir_name: &str,
    route: MeshRoute<'_>,
    domain: &str,
    carriers: &KeyExtractor,
) -> Vec<Value> {
    let carriers = carriers.key_matches(route.routing_key);
    route
        .mappings
        .iter()
        .map(|m| {
            let matches: Vec<Value> = carriers
                .iter()
                .map(|k| {
                    let value = match k.kind {
                        MatchKind::Regex => json!({"regex": k.value}),
                        MatchKind::Exact => json!({"exact": k.value}),
                    };
                    match &k.on {
                        MatchOn::Header(h) => json!({"port": m.from_port, "headers": {&**h: value}}),
                        MatchOn::Query(q) => {
                            json!({"port": m.from_port, "queryParams": {&**q: value}})
                        }
                    }
                })
                .collect();
            json!({
                "name": format!("{ROUTE_PREFIX}{ir_name}.{}", m.from_port),
                "match": matches,
                "route": [{"destination": {
                    "host": format!("{}.{}.svc.{domain}", m.to_service, route.target_service.namespace),
                    "port": {"number": m.to_port},
                }}],
            })
        })
        .collect()
}

/// `current` with this IstioRoute's routes replaced by `own`: every Spur route first, in name
/// order (so IstioRoutes sharing a VirtualService agree on one order and never undo each
/// other's writes), then every other route exactly as it was, in its order.
pub(super) fn spliced(current: &[Value], ir_name: &str, own: &[Value]) -> Vec<Value> {
    let mut spur: Vec<Value> = current
        .iter()
        .filter(|r| is_spur(r) && !is_own(r, ir_name))
        .cloned()
        .collect();
    spur.extend(own.iter().cloned());
    spur.sort_by(|a, b| route_name(a).cmp(route_name(b)));
    spur.extend(current.iter().filter(|r| !is_spur(r)).cloned());
    spur
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use spur_api::mesh::PortMapping;

    use super::*;

    fn svc() -> ServiceRef {
        ServiceRef {
            namespace: "shop".into(),
            name: "web".into(),
        }
    }

    #[test]
    fn hosts_name_the_service_as_istio_reads_them() {
        let s = svc();
        for (host, ns, yes) in [
            ("web", "shop", true),
            ("web", "other", false),
            ("web.shop", "other", true),
            ("web.shop.svc", "other", true),
            ("web.shop.svc.cluster.local", "other", true),
            ("WEB.shop.svc.cluster.local.", "other", true),
            ("web.shop.svc.example.org", "other", false),
            ("*.shop.svc.cluster.local", "shop", false),
            ("web2.shop", "shop", false),
        ] {
            assert_eq!(
                names_service(host, ns, &s, "cluster.local"),
                yes,
                "{host} in {ns}"
            );
        }
    }

    #[test]
    fn spur_routes_go_first_in_name_order_and_user_routes_stay_as_they_were() {
        let s = svc();
        let mappings = [
            PortMapping {
                from_port: 80,
                to_service: "sb1-web".into(),
                to_port: 80,
            },
            PortMapping {
                from_port: 9090,
                to_service: "sb1-web".into(),
                to_port: 9090,
            },
        ];
        let route = MeshRoute {
            routing_key: "k1",
            sandbox: "sb1",
            target_service: &s,
            mappings: &mappings,
        };
        let none = KeyExtractor::new(&Default::default()).unwrap();
        let own = entries("b-ir", route, "cluster.local", &none);
        assert_eq!(own.len(), 2);
        assert_eq!(route_name(&own[0]), "spur.b-ir.80");
        assert_eq!(
            own[0]["route"][0]["destination"]["host"],
            "sb1-web.shop.svc.cluster.local"
        );
        assert_eq!(own[0]["match"].as_array().unwrap().len(), 10);
        assert_eq!(own[0]["match"][0]["port"], 80);
        assert!(own[0]["match"][0]["headers"]["baggage"]["regex"].is_string());
        assert_eq!(
            own[0]["match"][2]["headers"]["ot-baggage-sd-routing-key"]["exact"],
            "k1"
        );
        // The configured carriers come first: the query parameter, then each custom header.
        let configured = KeyExtractor::new(&spur_api::carriers::ExtractConfig {
            custom_headers: vec!["X-Route-To".into()],
            query_param: Some("sd-routing-key".into()),
        })
        .unwrap();
        let with = entries("b-ir", route, "cluster.local", &configured);
        let m = with[0]["match"].as_array().unwrap();
        assert_eq!(m.len(), 12);
        assert_eq!(
            m[0],
            json!({"port": 80, "queryParams": {"sd-routing-key": {"exact": "k1"}}})
        );
        assert_eq!(
            m[1],
            json!({"port": 80, "headers": {"x-route-to": {"exact": "k1"}}})
        );
        assert!(m[2]["headers"]["baggage"]["regex"].is_string());

        let user = json!({"name": "default", "route": [{"destination": {"host": "web"}}]});
        let unnamed = json!({"route": [{"destination": {"host": "web"}, "weight": 100}]});
        let other_ir = json!({"name": "spur.a-ir.80", "route": []});
        let look_alike = json!({"name": "spur.b-ir2.80", "route": []});
        let current = vec![
            user.clone(),
            other_ir.clone(),
            unnamed.clone(),
            look_alike.clone(),
        ];
        let next = spliced(&current, "b-ir", &own);
        let names: Vec<&str> = next.iter().map(route_name).collect();
        assert_eq!(
            names,
            [
                "spur.a-ir.80",
                "spur.b-ir.80",
                "spur.b-ir.9090",
                "spur.b-ir2.80",
                "default",
                ""
            ]
        );
        assert_eq!(next[4], user);
        assert_eq!(next[5], unnamed);
        // Stable: splicing again changes nothing; removing restores the rest in its order.
        assert_eq!(spliced(&next, "b-ir", &own), next);
        let removed = spliced(&next, "b-ir", &[]);
        assert_eq!(removed, vec![other_ir, look_alike, user, unnamed]);
    }
}
