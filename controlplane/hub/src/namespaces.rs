//! The namespaces an object is in, defined once for the hub and the agent alike. Sandboxes,
//! RouteGroups and RoutingConfigs are cluster-scoped objects, so "the namespaces an object is
//! in" are those of the workloads it forks, runs locally, observes or routes, and of the
//! Services its preview endpoints target in the same cluster (read from the target's host
//! name). Who may see what is `crate::users`'s business; this module only says where objects
//! are.

use std::collections::{BTreeMap, BTreeSet};

use spur_api::{RouteGroup, RoutingConfig, Sandbox};

/// The namespace of an endpoint target in the same cluster (`<service>.<namespace>.svc…`).
fn endpoint_namespace(e: &spur_api::sandbox::Endpoint) -> Option<String> {
    if e.cluster.is_some() {
        return None;
    }
    let (_, host, _) = parse_target(&e.target)?;
    service_of(&host).map(|(ns, _)| ns)
}

/// The namespaces a Sandbox is in: of its forks' baselines, local workloads, virtual
/// workloads and same-cluster endpoint targets.
pub fn sandbox_namespaces(s: &Sandbox) -> BTreeSet<String> {
    let spec = &s.spec;
    let mut out: BTreeSet<String> = spec
        .forks
        .iter()
        .map(|f| f.fork_of.namespace.clone())
        .chain(spec.local.iter().map(|l| l.from.namespace.clone()))
        .chain(
            spec.virtual_workloads
                .iter()
                .map(|v| v.workload.namespace.clone()),
        )
        .collect();
    if let Some(g) = &spec.default_route_group {
        out.extend(g.endpoints.iter().filter_map(endpoint_namespace));
    }
    out
}

/// The namespaces a RouteGroup is in: of the sandboxes it matched (those in `sandboxes`) and
/// of its same-cluster endpoint targets.
pub fn route_group_namespaces(
    g: &RouteGroup,
    sandboxes: &BTreeMap<String, Sandbox>,
) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = g
        .spec
        .endpoints
        .iter()
        .filter_map(endpoint_namespace)
        .collect();
    for name in g.status.iter().flat_map(|s| &s.matched_sandboxes) {
        if let Some(s) = sandboxes.get(name) {
            out.extend(sandbox_namespaces(s));
        }
    }
    out
}

/// The namespaces a RoutingConfig is in: of the workloads it routes to and the baselines its
/// routes apply in.
pub fn routing_config_namespaces(c: &RoutingConfig) -> BTreeSet<String> {
    c.spec
        .workloads
        .iter()
        .map(|w| w.namespace.clone())
        .chain(
            c.status
                .iter()
                .filter_map(|s| s.route_server.as_ref())
                .flat_map(|r| &r.routes)
                .map(|r| r.baseline.namespace.clone()),
        )
        .collect()
}

/// A Job's namespace.
pub fn job_namespaces(j: &spur_api::Job) -> BTreeSet<String> {
    j.metadata.namespace.iter().cloned().collect()
}

/// The namespace and Service a cluster DNS name names: `<service>.<namespace>.svc[.<domain>]`,
/// or a pod of a headless Service, `<pod>.<service>.<namespace>.svc[.<domain>]`.
pub fn service_of(host: &str) -> Option<(String, String)> {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let labels: Vec<&str> = host.split('.').collect();
    let svc = labels.iter().rposition(|l| *l == "svc")?;
    if svc < 2 {
        return None;
    }
    Some((labels[svc - 1].to_owned(), labels[svc - 2].to_owned()))
}

/// `scheme://host[:port]` of an endpoint target; the port defaults by scheme.
pub fn parse_target(target: &str) -> Option<(String, String, u16)> {
    let (scheme, rest) = target.split_once("://")?;
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) => (h, p.parse().ok()?),
        None => (
            rest,
            match scheme {
                "https" => 443,
                "http" | "grpc" => 80,
                _ => return None,
            },
        ),
    };
    Some((scheme.to_owned(), host.to_owned(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_of_names() {
        let s = |h: &str| service_of(h).map(|(n, s)| format!("{n}/{s}"));
        assert_eq!(s("web.shop.svc").as_deref(), Some("shop/web"));
        assert_eq!(
            s("web.shop.svc.cluster.local.").as_deref(),
            Some("shop/web")
        );
        assert_eq!(
            s("pod-0.db.shop.svc.cluster.local").as_deref(),
            Some("shop/db")
        );
        assert_eq!(s("shop.svc"), None);
        assert_eq!(s("localhost"), None);
    }
}
