//! What a RouteGroup consists of, as pure functions: the Sandboxes it matches and the one
//! RoutingConfig that routes its key to their forks.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::{Resource, ResourceExt};
use spur_api::keys::labels;
use spur_api::routingconfig::{SandboxedKind, SandboxedWorkloadRef};
use spur_api::{RouteGroup, RoutingConfig, RoutingConfigSpec, Sandbox, names};

/// The Sandboxes among `sandboxes` that `rg` selects (by their labels), by name; a Sandbox
/// being deleted no longer counts.
pub(super) fn matched<'a>(rg: &RouteGroup, sandboxes: &'a [Arc<Sandbox>]) -> Vec<&'a Sandbox> {
    let mut matched: Vec<&Sandbox> = sandboxes
        .iter()
        .map(|sb| &**sb)
        .filter(|sb| sb.meta().deletion_timestamp.is_none())
        .filter(|sb| rg.spec.selector.matches(&sb.spec.labels))
        .collect();
    matched.sort_by_key(|sb| sb.name_any());
    matched
}

/// The RoutingConfig of `rg` that routes `key` to the forks of the `matched` Sandboxes (as
/// their status lists them), owned by `rg`.
pub(super) fn routing_config(rg: &RouteGroup, key: &str, matched: &[&Sandbox]) -> RoutingConfig {
    let name = rg.name_any();
    let mut workloads: Vec<SandboxedWorkloadRef> = matched
        .iter()
        .flat_map(|sb| {
            let forks = sb.status.iter().flat_map(|st| &st.forks);
            forks.map(|f| SandboxedWorkloadRef {
                kind: SandboxedKind::ForkedWorkload,
                namespace: f.fork_of.namespace.clone(),
                name: f.forked_workload.clone(),
                sandbox: sb.name_any(),
            })
        })
        .collect();
    workloads.sort();
    workloads.dedup();
    let mut rc = RoutingConfig::new(
        &names::route_group_routing_config_name(&name),
        RoutingConfigSpec {
            routing_key: key.to_owned(),
            workloads,
        },
    );
    rc.metadata.labels = Some(BTreeMap::from([
        (
            labels::MANAGED_BY.to_owned(),
            labels::MANAGED_BY_VALUE.to_owned(),
        ),
        (labels::ROUTE_GROUP.to_owned(), name),
        (labels::ROUTING_KEY.to_owned(), key.to_owned()),
    ]));
    rc.metadata.owner_references = Some(rg.controller_owner_ref(&()).into_iter().collect());
    rc
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    pub(in crate::routegroup) fn rg() -> RouteGroup {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "RouteGroup",
            "metadata": {"name": "team", "uid": "rg-uid", "generation": 2},
            "spec": {"match": {"label": {"key": "team", "value": "a"}}}
        }))
        .unwrap()
    }

    /// A Sandbox labelled `team`, Ready as given, with one fork of `shop/<fork>`.
    pub(in crate::routegroup) fn sandbox(name: &str, team: &str, ready: bool) -> Sandbox {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": {"labels": {"team": team}},
            "status": {
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
                                "reason": "R", "message": "",
                                "lastTransitionTime": "2026-01-01T00:00:00Z"}],
                "forks": [{"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "api"},
                           "forkedWorkload": format!("{name}-api"), "ready": ready}]
            }
        }))
        .unwrap()
    }

    fn names(sbs: &[&Sandbox]) -> Vec<String> {
        sbs.iter().map(|sb| sb.name_any()).collect()
    }

    #[test]
    fn matches_by_label_sorted_without_deleted_sandboxes() {
        let mut gone = sandbox("a0", "a", true);
        gone.metadata.deletion_timestamp =
            serde_json::from_value(json!("2026-01-01T00:00:00Z")).unwrap();
        let all = [
            sandbox("c", "a", true),
            sandbox("b", "other", true),
            sandbox("a", "a", false),
            gone,
        ]
        .map(Arc::new);
        assert_eq!(names(&matched(&rg(), &all)), vec!["a", "c"]);
    }

    #[test]
    fn the_routing_config_routes_every_matched_fork_and_is_owned() {
        let all = [sandbox("c", "a", true), sandbox("a", "a", false)].map(Arc::new);
        let rg = rg();
        let rc = routing_config(&rg, "k1", &matched(&rg, &all));
        assert_eq!(
            rc.name_any(),
            names::route_group_routing_config_name("team")
        );
        assert_eq!(rc.spec.routing_key, "k1");
        let routed: Vec<(&str, &str)> = (rc.spec.workloads.iter())
            .map(|w| (w.name.as_str(), w.sandbox.as_str()))
            .collect();
        // Unready sandboxes' forks are listed too: the RoutingConfig waits for them.
        assert_eq!(routed, vec![("a-api", "a"), ("c-api", "c")]);
        assert_eq!(rc.labels()[labels::ROUTE_GROUP], "team");
        assert_eq!(rc.labels()[labels::ROUTING_KEY], "k1");
        let owner = &rc.owner_references()[0];
        assert_eq!(
            (owner.uid.as_str(), owner.controller),
            ("rg-uid", Some(true))
        );
    }

    #[test]
    fn no_match_routes_nothing() {
        let rc = routing_config(&rg(), "k1", &[]);
        assert!(rc.spec.workloads.is_empty());
    }
}
