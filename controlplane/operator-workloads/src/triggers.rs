//! What the workload controllers read of the objects that wake them (the digests the
//! controller kit's change triggers, `spur_controller::changes`, compare), and those triggers
//! under the names the operator's controllers use.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use spur_api::conditions::{READY, find_condition, is_condition_true};
use spur_api::{ExternalWorkload, ForkedWorkload, RoutingConfig, Sandbox};
use spur_controller::changes::meta_digest;
use spur_controller::hash_of;

pub(crate) use spur_controller::changes::{changes, primary};

/// A ForkedWorkload as its Sandbox and its RoutingConfig read it: spec, deletion, the fork,
/// its Service mapping, readiness (and the generation it is of: the Sandbox counts a fork ready
/// only for its current spec, so a Ready that stays True through a change must still wake it)
/// and baseline sidecar coverage.
pub(crate) fn forked_workload(fw: &ForkedWorkload) -> u64 {
    let st = fw.status.as_ref();
    hash_of(&(
        meta_digest(fw),
        st.map(|s| (&s.fork, &s.services, &s.baseline_sidecars)),
        st.and_then(|s| find_condition(&s.conditions, READY))
            .map(|c| (c.status == "True", c.observed_generation)),
    ))
}

/// An ExternalWorkload as its Sandbox and its RoutingConfig read it.
pub(crate) fn external_workload(ew: &ExternalWorkload) -> u64 {
    let st = ew.status.as_ref();
    hash_of(&(
        meta_digest(ew),
        st.map(|s| (&s.services, s.tunnel.as_ref().map(|t| t.connected))),
        st.is_some_and(|s| is_condition_true(&s.conditions, READY)),
    ))
}

/// A VirtualWorkload as its Sandbox reads it: readiness and sidecar coverage.
pub(crate) fn virtual_workload(vw: &spur_api::VirtualWorkload) -> u64 {
    let st = vw.status.as_ref();
    hash_of(&(
        meta_digest(vw),
        st.map(|s| &s.baseline_sidecars),
        st.is_some_and(|s| is_condition_true(&s.conditions, READY)),
    ))
}

/// A RoutingConfig as its Sandbox reads it: spec and whether it routes.
pub(crate) fn routing_config(rc: &RoutingConfig) -> u64 {
    let st = rc.status.as_ref();
    hash_of(&(
        meta_digest(rc),
        st.is_some_and(|s| is_condition_true(&s.conditions, READY)),
    ))
}

/// A fork Deployment as its ForkedWorkload reads it: spec (drift is re-applied), metadata,
/// deletion, readiness.
pub(crate) fn fork_deployment(d: &Deployment) -> u64 {
    hash_of(&(
        meta_digest(d),
        crate::fork::deployment_ready(d),
        crate::fork::deployment_rolled_out(d),
    ))
}

/// A sandbox Service as its ForkedWorkload reads it (Services have no generation).
pub(crate) fn fork_service(svc: &Service) -> u64 {
    hash_of(&(meta_digest(svc), &svc.spec))
}

/// Any change at all (metadata watches: a status change shows only as a new version), for
/// the watches whose stores vouch for whole objects (`spur_controller::verified`).
pub(crate) fn any_change<K: kube::Resource>(obj: &K) -> u64 {
    hash_of(&obj.meta().resource_version)
}

/// A Sandbox as a RouteGroup reads it: its labels (spec), deletion, its forks and readiness.
pub(crate) fn group_member(sb: &Sandbox) -> u64 {
    let st = sb.status.as_ref();
    hash_of(&(
        meta_digest(sb),
        st.map(|s| &s.forks),
        st.is_some_and(|s| is_condition_true(&s.conditions, READY)),
    ))
}

/// A workstation's tunnel Lease as its ExternalWorkloads read it: who holds it, since and until
/// when, and the addresses it announces (labels, annotations).
pub(crate) fn tunnel_lease(lease: &Lease) -> u64 {
    hash_of(&(meta_digest(lease), &lease.spec))
}

/// An EndpointSlice of an ExternalWorkload as it reads it: metadata, endpoints and ports.
pub(crate) fn external_slice(slice: &EndpointSlice) -> u64 {
    hash_of(&(meta_digest(slice), &slice.endpoints, &slice.ports))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use futures_util::{StreamExt, stream};
    use kube::ResourceExt;
    use kube::runtime::watcher::Event;
    use serde_json::json;
    use spur_controller::changes::filter;

    fn fw(name: &str, generation: i64, ready: bool, note: &str) -> ForkedWorkload {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ForkedWorkload",
            "metadata": {"name": name, "namespace": "shop", "generation": generation},
            "spec": {"sandbox": "sb", "routingKey": "k",
                     "baseline": {"kind": "Deployment", "namespace": "shop", "name": "web"}},
            "status": {"fork": name, "conditions": [{
                "type": "Ready", "status": if ready { "True" } else { "False" },
                "reason": "r", "message": note, "lastTransitionTime": "2026-11-26T00:00:00Z"}]}
        }))
        .unwrap()
    }

    async fn passed(events: Vec<Event<ForkedWorkload>>) -> Vec<String> {
        filter(stream::iter(events.into_iter().map(Ok)), forked_workload)
            .map(|r| {
                let o = r.unwrap();
                format!(
                    "{}@{}",
                    o.name_any(),
                    o.metadata.generation.unwrap_or_default()
                )
            })
            .collect()
            .await
    }

    #[tokio::test]
    async fn only_changes_that_a_reconcile_reads_pass() {
        let mut labelled = fw("a", 2, true, "z");
        labelled.labels_mut().insert("x".into(), "y".into());
        let got = passed(vec![
            Event::Init,
            Event::InitApply(fw("a", 1, false, "x")),
            Event::InitDone,
            // A condition message: nothing the Sandbox reads.
            Event::Apply(fw("a", 1, false, "y")),
            Event::Apply(fw("a", 1, true, "y")),
            Event::Apply(fw("a", 2, true, "y")),
            Event::Apply(fw("a", 2, true, "z")),
            // Labels and annotations: what the owner sets (and puts back).
            Event::Apply(labelled.clone()),
            Event::Apply(labelled),
            Event::Delete(fw("a", 2, true, "z")),
        ])
        .await;
        assert_eq!(got, ["a@1", "a@1", "a@2", "a@2", "a@2"]);
    }

    #[tokio::test]
    async fn a_ready_condition_of_a_new_generation_passes() {
        let with_observed = |observed: i64| {
            let mut f = fw("a", 2, true, "y");
            if let Some(st) = f.status.as_mut() {
                st.conditions[0].observed_generation = Some(observed);
            }
            f
        };
        let got = passed(vec![
            Event::Init,
            Event::InitDone,
            Event::Apply(with_observed(1)),
            // Ready stays True through the change; its generation is what the Sandbox reads.
            Event::Apply(with_observed(2)),
            Event::Apply(with_observed(2)),
        ])
        .await;
        assert_eq!(got, ["a@2", "a@2"]);
    }

    #[tokio::test]
    async fn a_relist_passes_nothing_before_the_store_has_it() {
        let got = passed(vec![Event::Init, Event::InitApply(fw("a", 1, false, "x"))]).await;
        assert!(got.is_empty(), "{got:?}");
    }

    #[tokio::test]
    async fn a_recreated_object_is_new() {
        let mut again = fw("a", 1, false, "x");
        again.metadata.uid = Some("second".into());
        let got = passed(vec![
            Event::Apply(fw("a", 1, false, "x")),
            Event::Apply(fw("a", 1, false, "x")),
            Event::Apply(again),
        ])
        .await;
        assert_eq!(got, ["a@1", "a@1"]);
    }

    #[tokio::test]
    async fn a_relist_wakes_only_what_changed_and_forgets_the_gone() {
        let got = passed(vec![
            Event::Init,
            Event::InitApply(fw("a", 1, false, "x")),
            Event::InitApply(fw("b", 1, false, "x")),
            Event::InitDone,
            // The watch expired; b changed meanwhile, c is new, a is unchanged.
            Event::Init,
            Event::InitApply(fw("a", 1, false, "x")),
            Event::InitApply(fw("b", 1, true, "x")),
            Event::InitApply(fw("c", 1, false, "x")),
            Event::InitDone,
            // a is deleted while the watch is down (missing from the relist); a new a is
            // new to the filter.
            Event::Init,
            Event::InitApply(fw("b", 1, true, "x")),
            Event::InitDone,
            Event::Apply(fw("a", 1, false, "x")),
        ])
        .await;
        assert_eq!(got, ["a@1", "b@1", "b@1", "c@1", "a@1"]);
    }
}
