//! ListenerSet controller: the Services a ListenerSet needs, and the part of its status the
//! operator owns (docs/l4.md, "ListenerSet").
//!
//! ```text
//! ListenerSet ──► Service <name> over spec.selector, one port per listener (none with type None)
//!            └──► headless Service per selector endpoint, labelled spur.dev/listener-set=<name>
//!                    └── EndpointSlices (EndpointSlice controller) ──► status.listeners[]
//! ```
//!
//! No finalizer: every child carries a controller owner reference, and the garbage collector
//! deletes it with its set. The status is written by server-side apply with only the operator's
//! fields (`observedGeneration`, `listenerCount`, `listeners`, `conditions`): `gateways[]`
//! belongs to the route server, which writes one entry per gateway pod under a field manager of
//! its own, and an apply that left it out of what it owns never removes it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ListParams;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, NewCondition, set_condition};
use spur_api::keys::labels::{MANAGED_BY, MANAGED_BY_VALUE};
use spur_api::listenerset::{
    Cluster, LISTENER_SET_LABEL, ListenerStatus, Protocol, ServiceType, conditions,
    endpoint_service_name, listener_service_name,
};
use spur_api::names::label_value;
use spur_api::{ListenerSet, ListenerSetStatus};

use crate::Error;
use crate::context::{Context, Term, delete_opt, now};

/// The label the EndpointSlice controller puts on every slice, naming its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The one port of an endpoint Service.
pub const ENDPOINT_PORT: &str = "endpoint";
/// A set is looked at again after this long with nothing changing: a missed EndpointSlice
/// event (a slice seen before its Service reached the operator's cache) is made good.
const RESYNC: Duration = Duration::from_secs(300);
/// Endpoint Services per EndpointSlice list call: names go into the label selector of the URL.
const SERVICES_PER_LIST: usize = 40;

pub(crate) async fn reconcile(ls: Arc<ListenerSet>, ctx: Arc<Term>) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ListenerSet");
    let name = ls.name_any();
    let ns = ls.namespace().ok_or_else(|| Error::NoNamespace {
        kind: "ListenerSet",
        name: name.clone(),
    })?;
    // Going away: the garbage collector deletes the children; nothing to write.
    if ls.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let api: Api<ListenerSet> = Api::namespaced(ctx.client.clone(), &ns);
    let old = owned(ls.status.as_ref());
    let mut st = old.clone();
    st.observed_generation = ls.meta().generation;
    st.listener_count = Some(u32::try_from(ls.spec.listeners.len()).unwrap_or(u32::MAX));

    if let Err(e) = ls.spec.validate(&name) {
        // Admission refuses this; only a set written while the webhook was not installed gets
        // here. Its Services stay as the last valid spec made them (deleting them would cut
        // clients off over what may be a typo), and the status says why nothing follows it.
        let message = e.to_string();
        st.listeners.clear();
        set(
            &mut st,
            &ls,
            conditions::READY,
            ConditionStatus::False,
            "Invalid",
            &message,
        );
        set(
            &mut st,
            &ls,
            conditions::ENDPOINTS_READY,
            ConditionStatus::Unknown,
            "Invalid",
            "the spec is invalid (see Ready)",
        );
        if reason_of(&old, conditions::READY) != Some("Invalid") {
            ctx.event(&*ls, true, "Invalid", "Validate", message).await;
        }
        ctx.status.apply(&api, &*ls, &old, &st).await?;
        return Ok(Action::await_change());
    }

    let owner = ls
        .controller_owner_ref(&())
        .map(|mut o| {
            // Not blockOwnerDeletion: setting it needs update on listenersets/finalizers, a
            // right the operator does not otherwise need, and only foreground deletion uses it.
            o.block_owner_deletion = None;
            o
        })
        .ok_or_else(|| Error::Pending(format!("a uid on ListenerSet {ns}/{name}")))?;
    let svc_api: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
    let store = Some(&ctx.stores.listener_services);
    let mark = label_value(&name);
    let current: Vec<Arc<Service>> = match &store {
        Some(s) => s
            .state()
            .into_iter()
            .filter(|svc| svc.namespace().as_deref() == Some(ns.as_str()) && marked(&**svc, &mark))
            .collect(),
        None => svc_api
            .list(&ListParams::default().labels(&format!("{LISTENER_SET_LABEL}={mark}")))
            .await?
            .items
            .into_iter()
            .map(Arc::new)
            .collect(),
    };

    let mut wanted = BTreeSet::new();
    let mut conflict = None;
    if let Some(desired) = client_service(&ls, &owner) {
        let svc_name = desired.name_any();
        wanted.insert(svc_name.clone());
        // Never taken over: a Service of that name that is not this set's is someone else's.
        let ours = current.iter().any(|s| s.name_any() == svc_name)
            || match svc_api.get_metadata_opt(&svc_name).await? {
                None => true,
                Some(m) => marked(&m, &mark),
            };
        if ours {
            crate::context::OWNER
                .ensure(&svc_api, store, desired)
                .await?;
        } else {
            conflict = Some(format!(
                "Service {svc_name} exists and is not this ListenerSet's (it has no label {LISTENER_SET_LABEL}={mark}): delete it, rename the set, or set spec.service.type to None"
            ));
        }
    }
    let endpoint_services = endpoint_services(&ls, &owner);
    for svc in &endpoint_services {
        wanted.insert(svc.name_any());
        crate::context::OWNER
            .ensure(&svc_api, store, svc.clone())
            .await?;
    }
    for svc in &current {
        let svc_name = svc.name_any();
        if !wanted.contains(&svc_name) && set_of(&**svc).as_deref() == Some(name.as_str()) {
            delete_opt(&svc_api, &svc_name).await?;
        }
    }

    let names: Vec<String> = endpoint_services
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    let slices = endpoint_slices(&ctx, &ns, &names).await?;
    st.listeners = ls
        .spec
        .listeners
        .iter()
        .map(|l| {
            let (endpoints, ready) = count_endpoints(&name, &l.cluster, &slices);
            ListenerStatus {
                name: l.name.clone(),
                endpoints,
                ready,
            }
        })
        .collect();

    match &conflict {
        Some(message) => {
            set(
                &mut st,
                &ls,
                conditions::READY,
                ConditionStatus::False,
                "ServiceConflict",
                message,
            );
            if reason_of(&old, conditions::READY) != Some("ServiceConflict") {
                ctx.event(&*ls, true, "ServiceConflict", "Reconcile", message.clone())
                    .await;
            }
        }
        None => set(
            &mut st,
            &ls,
            conditions::READY,
            ConditionStatus::True,
            "ServicesApplied",
            "",
        ),
    }
    let mut empty: Vec<&str> = ls
        .spec
        .listeners
        .iter()
        .zip(&st.listeners)
        .filter(|(_, s)| s.ready == 0)
        .map(|(l, _)| l.cluster.name.as_str())
        .collect();
    empty.dedup();
    if empty.is_empty() {
        set(
            &mut st,
            &ls,
            conditions::ENDPOINTS_READY,
            ConditionStatus::True,
            "EndpointsReady",
            "",
        );
    } else {
        let message = format!("no ready endpoint in cluster {}", empty.join(", "));
        set(
            &mut st,
            &ls,
            conditions::ENDPOINTS_READY,
            ConditionStatus::False,
            "NoReadyEndpoints",
            &message,
        );
    }
    ctx.status.apply(&api, &*ls, &old, &st).await?;
    Ok(Action::requeue(RESYNC))
}

/// The fields of `status` the operator owns: everything but `gateways`, which the route server
/// writes. Applying this leaves `gateways` to its managers.
fn owned(status: Option<&ListenerSetStatus>) -> ListenerSetStatus {
    let st = status.cloned().unwrap_or_default();
    ListenerSetStatus {
        gateways: Vec::new(),
        ..st
    }
}

fn set(
    st: &mut ListenerSetStatus,
    ls: &ListenerSet,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    set_condition(
        &mut st.conditions,
        NewCondition {
            type_,
            status,
            reason,
            message,
            observed_generation: ls.meta().generation,
        },
        &now(),
    );
}

fn reason_of<'a>(st: &'a ListenerSetStatus, type_: &str) -> Option<&'a str> {
    st.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.reason.as_str())
}

/// Whether `obj` carries this set's label (`mark`: the set's name as a label value).
fn marked(obj: &impl ResourceExt, mark: &str) -> bool {
    obj.labels().get(LISTENER_SET_LABEL).map(String::as_str) == Some(mark)
}

/// The ListenerSet that owns `obj` (a Service of the operator's), by owner reference: the label
/// alone could be set by anyone, and stands for a name only when the name is a label value.
pub(crate) fn set_of(obj: &impl ResourceExt) -> Option<String> {
    obj.owner_references()
        .iter()
        .find(|o| {
            o.kind == ListenerSet::kind(&()) && o.api_version == ListenerSet::api_version(&())
        })
        .map(|o| o.name.clone())
}

/// The ListenerSet an EndpointSlice's status counts for: the owner of its Service, when that is
/// an endpoint Service in `services` (the operator's view of the Services it made).
pub(crate) fn set_of_slice(
    services: &kube::runtime::reflector::Store<Service>,
    slice: &impl ResourceExt,
) -> Option<ObjectRef<ListenerSet>> {
    let ns = slice.namespace()?;
    let svc = services.get(&ObjectRef::new(slice.labels().get(SERVICE_NAME_LABEL)?).within(&ns))?;
    Some(ObjectRef::new(&set_of(&*svc)?).within(&ns))
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

/// The EndpointSlices of the Services `names` of namespace `ns`.
async fn endpoint_slices(
    ctx: &Context,
    ns: &str,
    names: &[String],
) -> Result<Vec<EndpointSlice>, Error> {
    let api: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), ns);
    let mut slices = Vec::new();
    for chunk in names.chunks(SERVICES_PER_LIST) {
        let selector = format!("{SERVICE_NAME_LABEL} in ({})", chunk.join(","));
        slices.extend(
            api.list(&ListParams::default().labels(&selector))
                .await?
                .items,
        );
    }
    Ok(slices)
}

/// Endpoints of `cluster` (of set `set`) and how many are ready: the pods in the EndpointSlices
/// of its selector entries (a pod in two slices, or picked by two entries, counts once; ready
/// unless its slice says `ready: false`), one for each address and each DNS name (the gateways
/// resolve those; they count as ready here, their health is in `status.gateways`).
pub fn count_endpoints(set: &str, cluster: &Cluster, slices: &[EndpointSlice]) -> (u32, u32) {
    let mut seen: BTreeMap<String, bool> = BTreeMap::new();
    for (i, e) in cluster.endpoints.iter().enumerate() {
        if e.selector.is_some() {
            let svc = endpoint_service_name(set, &cluster.name, i);
            let of_service = slices
                .iter()
                .filter(|s| s.labels().get(SERVICE_NAME_LABEL) == Some(&svc));
            for ep in of_service.flat_map(|s| &s.endpoints) {
                let id = match (&ep.target_ref, ep.addresses.first()) {
                    (Some(r), _) if r.name.is_some() => {
                        format!("pod/{}", r.name.as_deref().unwrap_or_default())
                    }
                    (_, Some(a)) => format!("ip/{a}"),
                    _ => continue,
                };
                let ready = ep.conditions.as_ref().and_then(|c| c.ready) != Some(false);
                *seen.entry(id).or_insert(false) |= ready;
            }
        } else if let Some(a) = &e.address {
            seen.insert(format!("address/{a}:{}", e.port), true);
        } else if let Some(d) = &e.dns_name {
            seen.insert(format!("dns/{d}:{}", e.port), true);
        }
    }
    let total = u32::try_from(seen.len()).unwrap_or(u32::MAX);
    let ready = u32::try_from(seen.values().filter(|r| **r).count()).unwrap_or(u32::MAX);
    (total, ready)
}

pub(crate) fn error_policy(ls: Arc<ListenerSet>, err: &Error, ctx: Arc<Term>) -> Action {
    ctx.retry(&*ls, err)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn set(spec: serde_json::Value) -> ListenerSet {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ListenerSet",
            "metadata": {"name": "media", "namespace": "shop", "uid": "u-1", "generation": 3},
            "spec": spec,
        }))
        .unwrap()
    }

    fn spec() -> serde_json::Value {
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

    fn owner(ls: &ListenerSet) -> OwnerReference {
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
    fn endpoints_are_counted_once_and_by_readiness() {
        let ls = set(spec());
        let slice = |svc: String, eps: serde_json::Value| -> EndpointSlice {
            serde_json::from_value(json!({
                "metadata": {"name": format!("{svc}-x"), "namespace": "shop",
                             "labels": {SERVICE_NAME_LABEL: svc}},
                "addressType": "IPv4", "endpoints": eps,
            }))
            .unwrap()
        };
        let pod = |name: &str, ip: &str, ready: Option<bool>| {
            json!({"addresses": [ip], "targetRef": {"kind": "Pod", "name": name},
                   "conditions": ready.map_or(json!({}), |r| json!({"ready": r}))})
        };
        let first = endpoint_service_name("media", "media", 0);
        let second = endpoint_service_name("media", "media", 2);
        let slices = vec![
            slice(
                first.clone(),
                json!([
                    pod("m-0", "10.1.0.1", Some(true)),
                    pod("m-1", "10.1.0.2", Some(false))
                ]),
            ),
            // The same pod in a second slice of the Service, and through the second entry.
            slice(first, json!([pod("m-0", "10.1.0.1", None)])),
            slice(
                second,
                json!([
                    pod("m-0", "10.1.0.1", Some(true)),
                    pod("m-2", "10.1.0.3", None)
                ]),
            ),
            // Another Service's slice does not count.
            slice("other".into(), json!([pod("x", "10.9.0.1", Some(true))])),
        ];
        // m-0, m-1 (not ready), m-2 (no condition: ready), the address.
        assert_eq!(
            count_endpoints("media", &ls.spec.listeners[0].cluster, &slices),
            (4, 3)
        );
        // A DNS name counts once, as ready.
        assert_eq!(
            count_endpoints("media", &ls.spec.listeners[1].cluster, &slices),
            (1, 1)
        );
        assert_eq!(
            count_endpoints("media", &ls.spec.listeners[0].cluster, &[]),
            (1, 1)
        );
    }

    #[test]
    fn only_the_operators_status_fields_are_applied() {
        let st: ListenerSetStatus = serde_json::from_value(json!({
            "observedGeneration": 2,
            "listeners": [{"name": "rtp", "endpoints": 1, "ready": 1}],
            "gateways": [{"pod": "gw-0", "updatedAt": "2026-01-01T00:00:00Z"}],
        }))
        .unwrap();
        let body = serde_json::to_value(owned(Some(&st))).unwrap();
        assert!(body.get("gateways").is_none(), "{body}");
        assert_eq!(body["listeners"][0]["name"], "rtp");
    }

    #[test]
    fn the_mirrored_bounds_are_the_data_planes() {
        use spur_api::listenerset::{MAX_FIRST_BYTES, parse_duration};
        assert_eq!(MAX_FIRST_BYTES, spur_l4::MAX_FIRST_BYTES);
        for s in [
            "",
            "0",
            "5",
            "5s",
            "250ms",
            "2m",
            "1h",
            " 3s ",
            "1d",
            "1.5s",
            "-1s",
            "5 s",
            "ms",
            "18446744073709551615",
            "18446744073709551616s",
            "99999999999999h",
            "s5",
            "1S",
        ] {
            assert_eq!(
                parse_duration(s),
                spur_runtime::parse_duration(s).ok(),
                "{s:?}"
            );
        }
    }
}
