//! Mesh routes: for clusters that route with Istio or a Gateway API implementation instead of
//! Spur's sidecar, the RoutingConfig controller makes one `IstioRoute` and/or one
//! `GatewayAPIRoute` per baseline Service its routing key reaches; their controllers write the
//! mesh's own objects (routes in the user's VirtualServices, derived HTTPRoutes beside the
//! user's). docs/mesh.md.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::validation::*;

/// Most ports one mesh route maps (a Service has rarely more than a handful).
pub const MAX_MAPPINGS: usize = 64;
/// Most mesh objects listed in a mesh route's status; more are handled, not listed.
pub const MAX_MATCHED_OBJECTS: usize = 64;

/// Desired routes in Istio VirtualServices for one baseline Service.
// Cluster-scoped like its owner, the RoutingConfig (and like Signadot's IstioRoute).
// `printcolumn(...)` repeats its keys by design; clippy takes that for a copy-paste slip.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "IstioRoute",
    plural = "istioroutes",
    shortname = "spir",
    category = "spur",
    status = "MeshRouteStatus",
    derive = "PartialEq",
    doc = "Routes for one routing key and one baseline Service, kept in every Istio VirtualService whose hosts name that Service: one HTTP route per port, ahead of the VirtualService's own routes, sending requests that carry the key to the sandbox Service. Made by the RoutingConfig controller when the operator runs with --mesh-istio; its status lists the VirtualServices it writes to.",
    printcolumn(name = "Key", type_ = "string", json_path = ".spec.routingKey"),
    printcolumn(
        name = "Namespace",
        type_ = "string",
        json_path = ".spec.targetService.namespace"
    ),
    printcolumn(
        name = "Service",
        type_ = "string",
        json_path = ".spec.targetService.name"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct IstioRouteSpec {
    /// The routing key whose requests are routed.
    #[schemars(length(min = 1, max = ROUTING_KEY_MAX), regex(pattern = ROUTING_KEY_PATTERN))]
    pub routing_key: String,
    /// The sandbox the destination belongs to.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: String,
    /// The baseline Service.
    pub target_service: ServiceRef,
    /// Per port of the baseline Service: where keyed requests go instead.
    #[schemars(
        length(min = 1, max = MAX_MAPPINGS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["fromPort"])
    )]
    pub mappings: Vec<PortMapping>,
}

/// Desired derived Gateway API HTTPRoutes for one baseline Service.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "GatewayAPIRoute",
    plural = "gatewayapiroutes",
    shortname = "spgr",
    category = "spur",
    status = "MeshRouteStatus",
    derive = "PartialEq",
    doc = "Routes for one routing key and one baseline Service in Gateway API: for every HTTPRoute with a backendRef to that Service, a derived HTTPRoute beside it (same parents and hostnames, the same matches each AND-ed with a match on one key carrier) sending requests that carry the key to the sandbox Service. The user's HTTPRoutes are never written. Made by the RoutingConfig controller when the operator runs with --mesh-gateway-api; its status lists the HTTPRoutes matched and the routes derived.",
    printcolumn(name = "Key", type_ = "string", json_path = ".spec.routingKey"),
    printcolumn(
        name = "Namespace",
        type_ = "string",
        json_path = ".spec.targetService.namespace"
    ),
    printcolumn(
        name = "Service",
        type_ = "string",
        json_path = ".spec.targetService.name"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct GatewayAPIRouteSpec {
    /// The routing key whose requests are routed.
    #[schemars(length(min = 1, max = ROUTING_KEY_MAX), regex(pattern = ROUTING_KEY_PATTERN))]
    pub routing_key: String,
    /// The sandbox the destination belongs to.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: String,
    /// The baseline Service.
    pub target_service: ServiceRef,
    /// Per port of the baseline Service: where keyed requests go instead.
    #[schemars(
        length(min = 1, max = MAX_MAPPINGS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["fromPort"])
    )]
    pub mappings: Vec<PortMapping>,
}

/// A Service.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct ServiceRef {
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub namespace: String,
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
}

/// Requests for the target Service's `fromPort` that carry the key go to `toService:toPort`.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct PortMapping {
    /// Port of the baseline Service.
    #[schemars(range(min = 1, max = 65535))]
    pub from_port: i32,
    /// The sandbox Service, in the target Service's namespace.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub to_service: String,
    /// Port of the sandbox Service.
    #[schemars(range(min = 1, max = 65535))]
    pub to_port: i32,
}

/// Observed state of an IstioRoute or a GatewayAPIRoute.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MeshRouteStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`: every matched object carries the routes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The mesh objects that route the target Service (at most 64 listed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MATCHED_OBJECTS))]
    pub matched_objects: Vec<MatchedObject>,
}

/// A mesh object that routes the target Service, and what was done with it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MatchedObject {
    /// `VirtualService` or `HTTPRoute`.
    pub kind: String,
    pub namespace: String,
    pub name: String,
    /// The derived HTTPRoutes (in the same namespace) that carry the routes, one per port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub derived: Vec<String>,
    /// Whether the object (or its derived routes) carries the routes now.
    pub routed: bool,
    /// What was done, or why not.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// The spec both kinds share, for the code that handles either.
#[derive(Clone, Copy, Debug)]
pub struct MeshRoute<'a> {
    pub routing_key: &'a str,
    pub sandbox: &'a str,
    pub target_service: &'a ServiceRef,
    pub mappings: &'a [PortMapping],
}

impl IstioRouteSpec {
    pub fn route(&self) -> MeshRoute<'_> {
        MeshRoute {
            routing_key: &self.routing_key,
            sandbox: &self.sandbox,
            target_service: &self.target_service,
            mappings: &self.mappings,
        }
    }
}

impl GatewayAPIRouteSpec {
    pub fn route(&self) -> MeshRoute<'_> {
        MeshRoute {
            routing_key: &self.routing_key,
            sandbox: &self.sandbox,
            target_service: &self.target_service,
            mappings: &self.mappings,
        }
    }
}

impl MeshRoute<'_> {
    /// The schema's rules, for a spec that did not come through the API server.
    pub fn validate(&self, kind: &'static str) -> Result<(), Error> {
        let mut c = Checker::default();
        c.routing_key(|| "spec.routingKey".into(), self.routing_key);
        c.dns_label(|| "spec.sandbox".into(), self.sandbox);
        c.dns_label(
            || "spec.targetService.namespace".into(),
            &self.target_service.namespace,
        );
        c.dns_label(
            || "spec.targetService.name".into(),
            &self.target_service.name,
        );
        c.require(
            !self.mappings.is_empty(),
            || "spec.mappings".into(),
            "must not be empty",
        );
        c.max_items(|| "spec.mappings".into(), self.mappings, MAX_MAPPINGS);
        let mut seen = std::collections::HashSet::new();
        for (i, m) in self.mappings.iter().enumerate() {
            for (field, port) in [("fromPort", m.from_port), ("toPort", m.to_port)] {
                c.require(
                    (1..=65535).contains(&port),
                    || format!("spec.mappings[{i}].{field}"),
                    "must be a port (1-65535)",
                );
            }
            c.dns_label(|| format!("spec.mappings[{i}].toService"), &m.to_service);
            if !seen.insert(m.from_port) {
                c.fail(format!("spec.mappings[{i}]"), "fromPort listed twice");
            }
        }
        c.finish(kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> IstioRouteSpec {
        IstioRouteSpec {
            routing_key: "k1".into(),
            sandbox: "sb1".into(),
            target_service: ServiceRef {
                namespace: "shop".into(),
                name: "web".into(),
            },
            mappings: vec![PortMapping {
                from_port: 80,
                to_service: "sb1-web-0123456789".into(),
                to_port: 80,
            }],
        }
    }

    #[test]
    fn validation_follows_the_schema() {
        spec().route().validate("IstioRoute").unwrap();
        let mut bad = spec();
        bad.mappings.push(bad.mappings[0].clone());
        bad.mappings[0].to_port = 0;
        bad.routing_key = "no spaces".into();
        let err = bad.route().validate("IstioRoute").unwrap_err().to_string();
        for want in [
            "spec.routingKey",
            "spec.mappings[0].toPort",
            "spec.mappings[1]",
        ] {
            assert!(err.contains(want), "{want}: {err}");
        }
        let mut empty = spec();
        empty.mappings.clear();
        assert!(empty.route().validate("IstioRoute").is_err());
    }
}
