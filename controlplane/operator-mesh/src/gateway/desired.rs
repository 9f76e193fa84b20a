//! The HTTPRoutes a GatewayAPIRoute derives from the user's HTTPRoutes, as pure functions.

use std::collections::BTreeSet;

use kube::core::DynamicObject;
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};
use spur_api::carriers::{KeyExtractor, KeyMatch, MatchKind, MatchOn};
use spur_api::keys::{annotations, labels};
use spur_api::mesh::{MeshRoute, PortMapping, ServiceRef};
use spur_api::{GatewayAPIRoute, names};

use crate::spec_of;

/// Gateway API's bounds on an HTTPRoute (standard channel CRD, v1.6): matches per rule, matches
/// per route, header matches per match.
const MAX_MATCHES_PER_RULE: usize = 64;
const MAX_MATCHES_PER_ROUTE: usize = 128;
const MAX_HEADERS_PER_MATCH: usize = 16;

/// What a pass derives from one user HTTPRoute that sends to the target Service.
#[derive(Debug)]
pub(super) struct Derived {
    pub(super) namespace: String,
    pub(super) name: String,
    /// One derived route per mapped port that the user route sends to.
    pub(super) routes: Vec<DynamicObject>,
    /// Why a port could not be derived (`port <n>: <why>`).
    pub(super) problems: Vec<String>,
}

/// The derived routes of every user HTTPRoute in `all` (sorted by namespace and name) that
/// sends to the GatewayAPIRoute's target Service.
pub(super) fn plan(
    gr: &GatewayAPIRoute,
    all: &[std::sync::Arc<DynamicObject>],
    carriers: &KeyExtractor,
) -> Vec<Derived> {
    let route = gr.spec.route();
    let mut out = Vec::new();
    for user in all.iter().filter(|r| !is_managed(r)) {
        if !references(user, route.target_service) {
            continue;
        }
        let mut d = Derived {
            namespace: user.namespace().unwrap_or_default(),
            name: user.name_any(),
            routes: Vec::new(),
            problems: Vec::new(),
        };
        for m in route.mappings {
            match derive(gr, user, route, m, carriers) {
                Ok(None) => {}
                Ok(Some(obj)) => d.routes.push(obj),
                Err(why) => d.problems.push(format!("port {}: {why}", m.from_port)),
            }
        }
        out.push(d);
    }
    out
}

/// The derived routes in `all` that `gar` made and no longer wants (`keep` holds those it
/// does, as namespace and name).
pub(super) fn unwanted<'a>(
    all: &'a [std::sync::Arc<DynamicObject>],
    gar: &str,
    keep: &BTreeSet<(String, String)>,
) -> impl Iterator<Item = &'a DynamicObject> {
    all.iter()
        .map(|r| &**r)
        .filter(move |r| derived_by(r, gar))
        .filter(move |r| !keep.contains(&(r.namespace().unwrap_or_default(), r.name_any())))
}

pub(super) fn is_managed(route: &DynamicObject) -> bool {
    route.labels().get(labels::MANAGED_BY).map(String::as_str) == Some(labels::MANAGED_BY_VALUE)
}

fn derived_by(route: &DynamicObject, gar: &str) -> bool {
    is_managed(route)
        && route
            .labels()
            .get(labels::GATEWAY_API_ROUTE)
            .map(String::as_str)
            == Some(gar)
}

fn rules(route: &DynamicObject) -> impl Iterator<Item = &Value> {
    spec_of(route)
        .get("rules")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

fn backend_refs(rule: &Value) -> impl Iterator<Item = &Value> {
    rule.get("backendRefs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// Whether a backendRef of an HTTPRoute in `route_ns` is the Service `svc` (on `port`, if
/// given). A backendRef's group defaults to the core group, its kind to Service and its
/// namespace to the route's.
fn is_service_ref(b: &Value, route_ns: &str, svc: &ServiceRef, port: Option<i32>) -> bool {
    let s = |k: &str| b.get(k).and_then(Value::as_str);
    s("group").unwrap_or_default().is_empty()
        && s("kind").unwrap_or("Service") == "Service"
        && s("name") == Some(svc.name.as_str())
        && s("namespace").unwrap_or(route_ns) == svc.namespace
        && port.is_none_or(|p| b.get("port").and_then(Value::as_i64) == Some(i64::from(p)))
}

/// Whether any rule of `route` has a backendRef to `svc` (any port).
pub(super) fn references(route: &DynamicObject, svc: &ServiceRef) -> bool {
    let ns = route.namespace().unwrap_or_default();
    rules(route).any(|r| backend_refs(r).any(|b| is_service_ref(b, &ns, svc, None)))
}

/// The derived HTTPRoute of `user` for mapping `m`: `None` when no rule of `user` sends to the
/// target Service on that port; an error (for status) when Gateway API's bounds do not leave
/// room for the carriers' matches.
pub(super) fn derive(
    gr: &GatewayAPIRoute,
    user: &DynamicObject,
    route: MeshRoute<'_>,
    m: &PortMapping,
    carriers: &KeyExtractor,
) -> Result<Option<DynamicObject>, String> {
    let ns = user.namespace().unwrap_or_default();
    let carriers = carriers.key_matches(route.routing_key);
    let default_match = [json!({"path": {"type": "PathPrefix", "value": "/"}})];
    let mut out = Vec::new();
    let mut total = 0;
    for (i, rule) in rules(user).enumerate() {
        let Some(backend) = backend_refs(rule)
            .find(|b| is_service_ref(b, &ns, route.target_service, Some(m.from_port)))
        else {
            continue;
        };
        let matches = match rule.get("matches").and_then(Value::as_array) {
            Some(ms) if !ms.is_empty() => &ms[..],
            _ => &default_match[..],
        };
        let mut derived = Vec::new();
        for mt in matches {
            derived.extend(with_carriers(mt, &carriers, i)?);
        }
        if derived.len() > MAX_MATCHES_PER_RULE {
            return Err(format!(
                "rule {i} would need {} matches (Gateway API allows {MAX_MATCHES_PER_RULE} per rule)",
                derived.len()
            ));
        }
        total += derived.len();
        let mut b = backend.clone();
        b["name"] = json!(m.to_service);
        b["port"] = json!(m.to_port);
        // Keyed requests all go to the sandbox: the rule's split among backends is the
        // baseline's.
        if let Some(o) = b.as_object_mut() {
            o.remove("weight");
        }
        let mut r = rule.clone();
        r["matches"] = Value::Array(derived);
        r["backendRefs"] = json!([b]);
        out.push(r);
    }
    if out.is_empty() {
        return Ok(None);
    }
    if total > MAX_MATCHES_PER_ROUTE {
        return Err(format!(
            "would need {total} matches (Gateway API allows {MAX_MATCHES_PER_ROUTE} per route)"
        ));
    }
    derived_object(gr, user, route, m, out)
}

/// Each carrier's match added to `mt` (match `mt` of rule `i`), one derived match per carrier:
/// a header match for a header carrier, a query parameter match for the query parameter.
fn with_carriers(mt: &Value, carriers: &[KeyMatch], i: usize) -> Result<Vec<Value>, String> {
    let list = |field: &str| -> Vec<Value> {
        mt.get(field)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let (headers, params) = (list("headers"), list("queryParams"));
    // Gateway API allows as many query parameter matches as header matches per match.
    for (what, have) in [("header", &headers), ("query parameter", &params)] {
        let needed = carriers
            .iter()
            .any(|c| matches!(c.on, MatchOn::Query(_)) == (what == "query parameter"));
        if needed && have.len() >= MAX_HEADERS_PER_MATCH {
            return Err(format!(
                "rule {i} has a match with {} {what} matches, no room for a key carrier",
                have.len()
            ));
        }
    }
    let tests = |list: &[Value], name: &str, ignore_case: bool| {
        list.iter().any(|h| {
            h.get("name").and_then(Value::as_str).is_some_and(|n| {
                if ignore_case {
                    n.eq_ignore_ascii_case(name)
                } else {
                    n == name
                }
            })
        })
    };
    let mut derived = Vec::new();
    for c in carriers {
        let kind = match c.kind {
            MatchKind::Regex => "RegularExpression",
            MatchKind::Exact => "Exact",
        };
        // A match that already tests this header (header names are case-insensitive) or this
        // query parameter (case-sensitive) cannot test it twice; that carrier is left out for
        // this match.
        let (field, mut with) = match &c.on {
            MatchOn::Header(name) if !tests(&headers, name, true) => ("headers", headers.clone()),
            MatchOn::Query(name) if !tests(&params, name, false) => ("queryParams", params.clone()),
            _ => continue,
        };
        let name = match &c.on {
            MatchOn::Header(n) => &**n,
            MatchOn::Query(n) => &**n,
        };
        with.push(json!({"type": kind, "name": name, "value": c.value}));
        let mut d = mt.clone();
        d[field] = Value::Array(with);
        derived.push(d);
    }
    Ok(derived)
}

/// The derived HTTPRoute object: the user route's parents and hostnames, the derived `rules`.
fn derived_object(
    gr: &GatewayAPIRoute,
    user: &DynamicObject,
    route: MeshRoute<'_>,
    m: &PortMapping,
    rules: Vec<Value>,
) -> Result<Option<DynamicObject>, String> {
    let ns = user.namespace().unwrap_or_default();
    let spec = spec_of(user);
    let mut new_spec = json!({"rules": rules});
    for field in ["parentRefs", "hostnames"] {
        if let Some(v) = spec.get(field) {
            new_spec[field] = v.clone();
        }
    }
    let name = names::derived_http_route_name(&gr.name_any(), &user.name_any(), m.from_port);
    let obj = json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {
                labels::MANAGED_BY: labels::MANAGED_BY_VALUE,
                labels::GATEWAY_API_ROUTE: gr.name_any(),
                labels::ROUTING_KEY: route.routing_key,
                labels::SANDBOX: route.sandbox,
            },
            "annotations": {
                annotations::BASELINE: format!("HTTPRoute/{ns}/{}", user.name_any()),
            },
            "ownerReferences": gr.controller_owner_ref(&()).into_iter().collect::<Vec<_>>(),
        },
        "spec": new_spec,
    });
    serde_json::from_value(obj).map_err(|e| format!("cannot build the derived route: {e}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use spur_api::GatewayAPIRouteSpec;
    use spur_api::mesh::PortMapping;

    use super::*;

    fn gar() -> GatewayAPIRoute {
        let mut g = GatewayAPIRoute::new(
            "sb1-web-0123456789",
            GatewayAPIRouteSpec {
                routing_key: "k1".into(),
                sandbox: "sb1".into(),
                target_service: ServiceRef {
                    namespace: "shop".into(),
                    name: "web".into(),
                },
                mappings: vec![PortMapping {
                    from_port: 80,
                    to_service: "sb1-web".into(),
                    to_port: 80,
                }],
            },
        );
        g.meta_mut().uid = Some("u-1".into());
        g
    }

    fn none() -> KeyExtractor {
        KeyExtractor::new(&Default::default()).unwrap()
    }

    fn user(rules: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "shop", "namespace": "shop"},
            "spec": {"parentRefs": [{"name": "gw"}], "hostnames": ["shop.example"], "rules": rules}
        }))
        .unwrap()
    }

    #[test]
    fn derived_rules_and_each_match_with_each_carrier_send_to_the_sandbox() {
        let g = gar();
        let u = user(json!([
            {"matches": [{"path": {"type": "PathPrefix", "value": "/api"}},
                         {"path": {"type": "Exact", "value": "/x"},
                          "headers": [{"type": "Exact", "name": "Baggage", "value": "v"}]}],
             "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {"add": [{"name": "a", "value": "b"}]}}],
             "backendRefs": [{"name": "web", "port": 80, "weight": 90}, {"name": "other", "port": 80, "weight": 10}]},
            {"backendRefs": [{"name": "other", "port": 80}]},
            {"backendRefs": [{"name": "web", "port": 8080}]},
        ]));
        assert!(references(&u, &g.spec.target_service));
        let d = derive(&g, &u, g.spec.route(), &g.spec.mappings[0], &none())
            .unwrap()
            .unwrap();
        assert_eq!(d.namespace().as_deref(), Some("shop"));
        assert_eq!(d.labels()[labels::GATEWAY_API_ROUTE], "sb1-web-0123456789");
        assert_eq!(d.owner_references()[0].uid, "u-1");
        let spec = spec_of(&d);
        assert_eq!(spec["parentRefs"], json!([{"name": "gw"}]));
        assert_eq!(spec["hostnames"], json!(["shop.example"]));
        let rules = spec["rules"].as_array().unwrap();
        assert_eq!(rules.len(), 1, "only the rule sending to web:80");
        let r = &rules[0];
        assert_eq!(r["backendRefs"], json!([{"name": "sb1-web", "port": 80}]));
        assert_eq!(r["filters"][0]["type"], "RequestHeaderModifier");
        let ms = r["matches"].as_array().unwrap();
        // 10 carriers for /api; 9 for /x, which tests baggage itself already.
        assert_eq!(ms.len(), 10 + 9);
        assert_eq!(ms[0]["path"]["value"], "/api");
        assert_eq!(ms[0]["headers"][0]["name"], "baggage");
        assert_eq!(ms[0]["headers"][0]["type"], "RegularExpression");
        assert_eq!(ms[2]["headers"][0]["type"], "Exact");
        assert_eq!(ms[2]["headers"][0]["value"], "k1");
        assert_eq!(ms[10]["headers"].as_array().unwrap().len(), 2);
        assert_eq!(ms[10]["headers"][1]["name"], "tracestate");

        // No rule sends to web on port 9090: nothing to derive.
        let other_port = PortMapping {
            from_port: 9090,
            to_service: "sb1-web".into(),
            to_port: 9090,
        };
        assert!(
            derive(&g, &u, g.spec.route(), &other_port, &none())
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn rules_without_matches_get_the_default_and_bounds_are_reported() {
        let g = gar();
        let u = user(json!([{"backendRefs": [{"name": "web", "namespace": "shop", "port": 80}]}]));
        let d = derive(&g, &u, g.spec.route(), &g.spec.mappings[0], &none())
            .unwrap()
            .unwrap();
        let ms = spec_of(&d)["rules"][0]["matches"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(ms.len(), 10);
        assert_eq!(ms[0]["path"], json!({"type": "PathPrefix", "value": "/"}));

        let many: Vec<Value> = (0..7)
            .map(|i| json!({"path": {"type": "PathPrefix", "value": format!("/{i}")}}))
            .collect();
        let u = user(json!([{"matches": many, "backendRefs": [{"name": "web", "port": 80}]}]));
        let err = derive(&g, &u, g.spec.route(), &g.spec.mappings[0], &none()).unwrap_err();
        assert!(err.contains("70 matches"), "{err}");

        let elsewhere =
            user(json!([{"backendRefs": [{"name": "web", "namespace": "other", "port": 80}]}]));
        assert!(!references(&elsewhere, &g.spec.target_service));
    }

    /// The configured carriers are matches of their own: the query parameter as a query
    /// parameter match, each custom header as an exact header match, first.
    #[test]
    fn configured_carriers_are_derived_matches_too() {
        let g = gar();
        let carriers = KeyExtractor::new(&spur_api::carriers::ExtractConfig {
            custom_headers: vec!["x-route-to".into()],
            query_param: Some("sd-routing-key".into()),
        })
        .unwrap();
        let u = user(json!([
            {"matches": [{"path": {"type": "PathPrefix", "value": "/"},
                          "queryParams": [{"type": "Exact", "name": "sd-routing-key", "value": "x"}]},
                         {"path": {"type": "PathPrefix", "value": "/b"}}],
             "backendRefs": [{"name": "web", "port": 80}]},
        ]));
        let d = derive(&g, &u, g.spec.route(), &g.spec.mappings[0], &carriers)
            .unwrap()
            .unwrap();
        let ms = spec_of(&d)["rules"][0]["matches"]
            .as_array()
            .unwrap()
            .clone();
        // The first match tests the parameter already: 1 + 10 there, 2 + 10 for /b.
        assert_eq!(ms.len(), 11 + 12);
        assert_eq!(ms[0]["headers"][0]["name"], "x-route-to");
        assert_eq!(ms[0]["headers"][0]["type"], "Exact");
        assert_eq!(ms[0]["headers"][0]["value"], "k1");
        assert_eq!(ms[0]["queryParams"].as_array().unwrap().len(), 1);
        assert_eq!(
            ms[11]["queryParams"],
            json!([{"type": "Exact", "name": "sd-routing-key", "value": "k1"}])
        );
        assert!(ms[11].get("headers").is_none());
        assert_eq!(ms[12]["headers"][0]["name"], "x-route-to");
        assert_eq!(ms[13]["headers"][0]["name"], "baggage");
    }
}
