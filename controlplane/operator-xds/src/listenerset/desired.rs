//! The Services a ListenerSet makes, as pure functions of its spec.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};
use spur_api::ListenerSet;
use spur_api::keys::labels::{MANAGED_BY, MANAGED_BY_VALUE};
use spur_api::listenerset::{
    LISTENER_SET_LABEL, Protocol, ServiceType, endpoint_service_name, listener_service_name,
};
use spur_api::names::label_value;

use super::{ENDPOINT_PORT, set_of};

/// The owner reference every child carries; `None` until the set has a uid.
pub(super) fn owner(ls: &ListenerSet) -> Option<OwnerReference> {
    ls.controller_owner_ref(&()).map(|mut o| {
        // Not blockOwnerDeletion: setting it needs update on listenersets/finalizers, a
        // right the operator does not otherwise need, and only foreground deletion uses it.
        o.block_owner_deletion = None;
        o
    })
}

fn metadata(ls: &ListenerSet, name: String, owner: &OwnerReference) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: ls.namespace(),
        labels: Some(BTreeMap::from([
            (LISTENER_SET_LABEL.to_owned(), label_value(&ls.name_any())),
            (MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned()),
        ])),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    }
}

fn protocol(p: Protocol) -> String {
    match p {
        Protocol::Tcp => "TCP".into(),
        Protocol::Udp => "UDP".into(),
    }
}

/// The client Service: `spec.selector`'s pods, one port per listener (named after it, the same
/// number on both sides); `None` for `service.type: None`.
pub fn client_service(ls: &ListenerSet, owner: &OwnerReference) -> Option<Service> {
    let type_ = match ls.spec.service_type() {
        ServiceType::None => return None,
        ServiceType::ClusterIP => "ClusterIP",
        ServiceType::NodePort => "NodePort",
        ServiceType::LoadBalancer => "LoadBalancer",
    };
    let ports = ls
        .spec
        .listeners
        .iter()
        .map(|l| ServicePort {
            name: Some(l.name.clone()),
            protocol: Some(protocol(l.protocol)),
            port: i32::from(l.port),
            target_port: Some(IntOrString::Int(i32::from(l.port))),
            ..ServicePort::default()
        })
        .collect();
    Some(Service {
        metadata: metadata(ls, listener_service_name(&ls.name_any()), owner),
        spec: Some(ServiceSpec {
            type_: Some(type_.into()),
            selector: ls.spec.selector.match_labels.clone(),
            ports: Some(ports),
            ..ServiceSpec::default()
        }),
        status: None,
    })
}

/// One headless Service per selector endpoint of every cluster: its EndpointSlices are the
/// endpoint's pods. Its one port carries the protocol of the listener that uses the cluster
/// (TCP when none does): it only documents, a headless Service's slices list the pods either
/// way.
pub fn endpoint_services(ls: &ListenerSet, owner: &OwnerReference) -> Vec<Service> {
    let set = ls.name_any();
    let mut out = Vec::new();
    for (_, cl) in ls.spec.all_clusters() {
        let proto = protocol(ls.spec.cluster_protocol(&cl.name).unwrap_or(Protocol::Tcp));
        for (i, e) in cl.endpoints.iter().enumerate() {
            let Some(sel) = &e.selector else { continue };
            out.push(Service {
                metadata: metadata(ls, endpoint_service_name(&set, &cl.name, i), owner),
                spec: Some(ServiceSpec {
                    cluster_ip: Some("None".into()),
                    selector: sel.match_labels.clone(),
                    ports: Some(vec![ServicePort {
                        name: Some(ENDPOINT_PORT.into()),
                        protocol: Some(proto.clone()),
                        port: i32::from(e.port),
                        target_port: Some(IntOrString::Int(i32::from(e.port))),
                        ..ServicePort::default()
                    }]),
                    ..ServiceSpec::default()
                }),
                status: None,
            });
        }
    }
    out
}

/// Why the client Service `svc_name` is not applied: a Service of that name exists without
/// this set's label (`mark`), and is never taken over.
pub(super) fn conflict(svc_name: &str, mark: &str) -> String {
    format!(
        "Service {svc_name} exists and is not this ListenerSet's (it has no label {LISTENER_SET_LABEL}={mark}): delete it, rename the set, or set spec.service.type to None"
    )
}

/// The Services of `current` that set `set` owns and no longer wants: deleted.
pub(super) fn stale(current: &[Arc<Service>], wanted: &BTreeSet<String>, set: &str) -> Vec<String> {
    current
        .iter()
        .map(|svc| (svc.name_any(), set_of(&**svc)))
        .filter(|(svc_name, owner)| !wanted.contains(svc_name) && owner.as_deref() == Some(set))
        .map(|(svc_name, _)| svc_name)
        .collect()
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    pub(in crate::listenerset) fn set(spec: serde_json::Value) -> ListenerSet {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ListenerSet",
            "metadata": {"name": "media", "namespace": "shop", "uid": "u-1", "generation": 3},
            "spec": spec,
        }))
        .unwrap()
    }

    pub(in crate::listenerset) fn spec() -> serde_json::Value {
        json!({
            "selector": {"matchLabels": {"app": "gw"}},
            "listeners": [
                {"name": "rtp", "protocol": "udp", "port": 5000, "cluster": {"name": "media",
                    "endpoints": [{"selector": {"matchLabels": {"app": "media"}}, "port": 6000},
                                  {"address": "10.0.0.9", "port": 6000},
                                  {"selector": {"matchLabels": {"app": "media2"}}, "port": 6000}]},
                 "keyRoute": {"routes": [{"key": "k", "cluster": "sbx"}]}},
                {"name": "sip", "protocol": "tcp", "port": 5060, "cluster": {"name": "sip",
                    "endpoints": [{"dnsName": "sip.example.com", "port": 5060}]}}
            ],
            "clusters": [
                {"name": "sbx", "endpoints": [{"selector": {"matchLabels": {"app": "fork"}}, "port": 6001}]},
                {"name": "spare", "endpoints": [{"selector": {"matchLabels": {"app": "spare"}}, "port": 7}]}
            ]
        })
    }

    pub(in crate::listenerset) fn owner(ls: &ListenerSet) -> OwnerReference {
        ls.controller_owner_ref(&()).unwrap()
    }

    #[test]
    fn services_follow_the_spec() {
        let ls = set(spec());
        let svc = client_service(&ls, &owner(&ls)).unwrap();
        let v = serde_json::to_value(&svc).unwrap();
        assert_eq!(v["metadata"]["name"], "media");
        assert_eq!(v["metadata"]["labels"][LISTENER_SET_LABEL], "media");
        assert_eq!(v["spec"]["type"], "ClusterIP");
        assert_eq!(v["spec"]["selector"], json!({"app": "gw"}));
        assert_eq!(
            v["spec"]["ports"],
            json!([
                {"name": "rtp", "protocol": "UDP", "port": 5000, "targetPort": 5000},
                {"name": "sip", "protocol": "TCP", "port": 5060, "targetPort": 5060}
            ])
        );
        let eps = endpoint_services(&ls, &owner(&ls));
        let got: Vec<(String, String, i32)> = eps
            .iter()
            .map(|s| {
                let p = &s.spec.as_ref().unwrap().ports.as_ref().unwrap()[0];
                (s.name_any(), p.protocol.clone().unwrap(), p.port)
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    endpoint_service_name("media", "media", 0),
                    "UDP".into(),
                    6000
                ),
                (
                    endpoint_service_name("media", "media", 2),
                    "UDP".into(),
                    6000
                ),
                // A key-route target: the routing listener's protocol.
                (endpoint_service_name("media", "sbx", 0), "UDP".into(), 6001),
                // Used by no listener: TCP.
                (endpoint_service_name("media", "spare", 0), "TCP".into(), 7),
            ]
        );
        let headless = eps[0].spec.as_ref().unwrap();
        assert_eq!(headless.cluster_ip.as_deref(), Some("None"));
        assert_eq!(
            headless.selector,
            Some(BTreeMap::from([("app".into(), "media".into())]))
        );
        assert_eq!(set_of(&eps[0]).as_deref(), Some("media"));

        let mut none = spec();
        none["service"] = json!({"type": "None"});
        let ls = set(none);
        assert!(client_service(&ls, &owner(&ls)).is_none());
        let mut lb = spec();
        lb["service"] = json!({"type": "LoadBalancer"});
        let ls = set(lb);
        let svc = client_service(&ls, &owner(&ls)).unwrap();
        assert_eq!(svc.spec.unwrap().type_.as_deref(), Some("LoadBalancer"));
    }

    #[test]
    fn children_are_owned_without_blocking_deletion() {
        let ls = set(spec());
        let o = super::owner(&ls).unwrap();
        assert_eq!((o.uid.as_str(), o.controller), ("u-1", Some(true)));
        assert_eq!(o.block_owner_deletion, None);
        let mut no_uid = ls.clone();
        no_uid.metadata.uid = None;
        assert!(super::owner(&no_uid).is_none());
    }

    #[test]
    fn only_owned_services_no_longer_wanted_are_stale() {
        let ls = set(spec());
        let mut svcs = endpoint_services(&ls, &owner(&ls));
        // A Service with the set's label but no owner reference is not the set's to delete.
        let mut foreign = svcs[0].clone();
        foreign.metadata.name = Some("foreign".into());
        foreign.metadata.owner_references = None;
        svcs.push(foreign);
        let current: Vec<Arc<Service>> = svcs.into_iter().map(Arc::new).collect();
        let first = endpoint_service_name("media", "media", 0);
        let wanted = BTreeSet::from([first.clone()]);
        let mut gone = stale(&current, &wanted, "media");
        gone.sort();
        let mut expected = vec![
            endpoint_service_name("media", "media", 2),
            endpoint_service_name("media", "sbx", 0),
            endpoint_service_name("media", "spare", 0),
        ];
        expected.sort();
        assert_eq!(gone, expected);
        assert!(stale(&current, &wanted, "other").is_empty());
    }

    #[test]
    fn a_conflict_says_how_to_resolve_it() {
        assert_eq!(
            conflict("media", "media"),
            "Service media exists and is not this ListenerSet's (it has no label spur.dev/listener-set=media): delete it, rename the set, or set spec.service.type to None"
        );
    }
}
