//! Mesh modes (docs/mesh.md): for clusters that route with Istio or a Gateway API
//! implementation instead of Spur's sidecar, the RoutingConfig controller keeps one IstioRoute
//! and/or one GatewayAPIRoute per baseline Service its key reaches (this crate's root, called by
//! the RoutingConfig controller); their own controllers write the mesh's objects ([`istio`],
//! [`gateway`]).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{ObjectRef, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use spur_api::carriers::{ExtractConfig, KeyExtractor};

use kube::api::{ListParams, Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use spur_api::keys::labels;
use spur_api::mesh::{MatchedObject, PortMapping, ServiceRef};
use spur_api::{
    GatewayAPIRoute, GatewayAPIRouteSpec, IstioRoute, IstioRouteSpec, MeshRouteStatus,
    RoutingConfig, ServiceMapping, names,
};

use spur_operator_core::{Context, Error, delete_opt};

pub mod gateway;
pub mod istio;

/// Which mesh modes the operator runs, and what they need to know about the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshConfig {
    /// IstioRoutes, and routes in Istio VirtualServices (`--mesh-istio`).
    pub istio: bool,
    /// GatewayAPIRoutes, and derived Gateway API HTTPRoutes (`--mesh-gateway-api`).
    pub gateway_api: bool,
    /// The cluster's DNS domain: Istio destinations are written as fully qualified names, which
    /// mean the same from a VirtualService in any namespace.
    pub cluster_domain: String,
    /// The routing-key carriers the cluster's sidecars read besides the standard ones (the
    /// injection config's `routingKeys`, chart `routingKeys`): the routes match them too, with
    /// each target namespace's own ([`spur_api::carriers::of_namespace`]).
    pub routing_keys: ExtractConfig,
}

impl Default for MeshConfig {
    fn default() -> Self {
        MeshConfig {
            istio: false,
            gateway_api: false,
            cluster_domain: "cluster.local".into(),
            routing_keys: ExtractConfig::default(),
        }
    }
}

impl MeshConfig {
    pub fn enabled(&self) -> bool {
        self.istio || self.gateway_api
    }

    pub fn validate(&self) -> Result<(), Error> {
        if !spur_api::validation::is_dns_subdomain(&self.cluster_domain) {
            return Err(Error::Config(format!(
                "mesh cluster domain {:?} is not a DNS name",
                self.cluster_domain
            )));
        }
        KeyExtractor::new(&self.routing_keys)
            .map(drop)
            .map_err(|e| Error::Config(format!("the mesh routes' routing-key carriers: {e}")))
    }
}

/// The watch mapper of a mesh route controller's Namespace watch: the routes in `routes` whose
/// target Service is in the namespace that changed (its carrier annotations decide their
/// matches).
pub(crate) fn routes_in_namespace<K>(
    routes: Store<K>,
    target_namespace: fn(&K) -> &str,
) -> impl Fn(PartialObjectMeta<Namespace>) -> Vec<ObjectRef<K>> + Send + Sync + 'static
where
    K: kube::Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    move |ns| {
        let ns = ns.name_any();
        spur_controller::objects_where(&routes, |r| target_namespace(r) == ns)
    }
}

/// The routing-key carriers of each namespace, from the cluster's and the namespaces'
/// annotations (a metadata watch of Namespaces), for the matches a mesh route writes.
#[derive(Clone)]
pub(crate) struct Carriers {
    cluster_cfg: ExtractConfig,
    cluster: KeyExtractor,
    namespaces: Store<PartialObjectMeta<Namespace>>,
}

impl Carriers {
    /// The carriers and the store's change stream, which wakes `controller`'s routes of a
    /// namespace whose annotations may have changed. `cfg` was validated
    /// ([`MeshConfig::validate`]). The watch's errors are logged, not passed on: a Namespace
    /// list the role may not do would otherwise pause the controller's own watches.
    pub(crate) fn watch(
        client: &Client,
        cfg: &ExtractConfig,
        controller: &'static str,
    ) -> Result<
        (
            Carriers,
            impl futures_util::Stream<Item = Result<PartialObjectMeta<Namespace>, watcher::Error>>
            + Send
            + 'static,
        ),
        Error,
    > {
        let cluster = KeyExtractor::new(cfg)
            .map_err(|e| Error::Config(format!("the mesh routes' routing-key carriers: {e}")))?;
        let (namespaces, writer) = kube::runtime::reflector::store();
        let events = watcher(
            Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(|o| o.managed_fields_mut().clear());
        let changes = spur_controller::errors_logged(
            controller,
            "Namespaces",
            reflector(writer, events).touched_objects(),
        );
        let carriers = Carriers {
            cluster_cfg: cfg.clone(),
            cluster,
            namespaces,
        };
        Ok((carriers, changes))
    }

    /// Waits (at most a second) for the namespace watch's first list: before it, every
    /// namespace would look unannotated.
    pub(crate) async fn ready(&self) -> Result<(), Error> {
        tokio::time::timeout(Duration::from_secs(1), self.namespaces.wait_until_ready())
            .await
            .ok()
            .and_then(Result::ok)
            .ok_or_else(|| Error::Pending("the Namespace watch to sync".into()))
    }

    /// The carriers read in `namespace`. A malformed annotation there leaves the cluster's
    /// (the webhook injects no sidecar in such a namespace, and says why on each pod), logged.
    pub(crate) fn of(&self, namespace: &str) -> Cow<'_, KeyExtractor> {
        let ns = self
            .namespaces
            .get(&ObjectRef::<PartialObjectMeta<Namespace>>::new(namespace));
        let annotations = ns.as_ref().map(|n| n.annotations());
        match spur_api::carriers::of_namespace(&self.cluster_cfg, annotations) {
            Ok(None) => Cow::Borrowed(&self.cluster),
            Ok(Some(cfg)) => match KeyExtractor::new(&cfg) {
                Ok(ex) => Cow::Owned(ex),
                Err(e) => {
                    tracing::warn!(namespace, error = %e, "using the cluster's routing-key carriers");
                    Cow::Borrowed(&self.cluster)
                }
            },
            Err(e) => {
                tracing::warn!(namespace, error = %e, "using the cluster's routing-key carriers");
                Cow::Borrowed(&self.cluster)
            }
        }
    }
}

/// One routed workload's sandbox Services, as the RoutingConfig controller found them ready.
pub struct Target<'a> {
    pub namespace: &'a str,
    pub sandbox: &'a str,
    pub services: &'a [ServiceMapping],
}

/// What one mesh route is for: the baseline Service, its sandbox, its port mappings.
type Desired = BTreeMap<ServiceRef, (String, Vec<PortMapping>)>;

/// Per baseline Service: the sandbox and the port mappings. A baseline Service that two
/// sandboxes of one key both fork (possible only in a route group, and rejected for the route
/// server too) keeps the first sandbox in name order, so the choice is stable.
fn desired(targets: &[Target<'_>]) -> Desired {
    let mut out: Desired = BTreeMap::new();
    let mut sorted: Vec<&Target<'_>> = targets.iter().collect();
    sorted.sort_by_key(|t| (t.sandbox, t.namespace));
    for t in sorted {
        for s in t.services {
            let key = ServiceRef {
                namespace: t.namespace.to_owned(),
                name: s.baseline_service.clone(),
            };
            let entry = out
                .entry(key)
                .or_insert_with(|| (t.sandbox.to_owned(), Vec::new()));
            if entry.0 != t.sandbox {
                continue;
            }
            for p in &s.ports {
                if !entry.1.iter().any(|m| m.from_port == p.port) {
                    entry.1.push(PortMapping {
                        from_port: p.port,
                        to_service: s.sandbox_service.clone(),
                        to_port: p.port,
                    });
                }
            }
        }
    }
    out.retain(|_, (_, m)| !m.is_empty());
    for (_, m) in out.values_mut() {
        m.sort();
        m.truncate(spur_api::mesh::MAX_MAPPINGS);
    }
    out
}

/// The sandbox or route group a RoutingConfig serves, for readable names.
fn owner_name(rc: &RoutingConfig) -> String {
    let l = rc.labels();
    l.get(labels::SANDBOX)
        .or_else(|| l.get(labels::ROUTE_GROUP))
        .cloned()
        .unwrap_or_else(|| rc.name_any())
}

/// Keeps exactly one IstioRoute / GatewayAPIRoute (per enabled mode) for each baseline Service
/// of `targets`, applied with server-side apply, labelled with and owned by `rc`; deletes the
/// ones `rc` no longer wants.
pub async fn sync(
    rc: &RoutingConfig,
    targets: &[Target<'_>],
    cfg: &MeshConfig,
    ctx: &Context,
) -> Result<(), Error> {
    let want = desired(targets);
    let rc_name = rc.name_any();
    let owner = owner_name(rc);
    let key = &rc.spec.routing_key;
    if cfg.istio {
        let objs = want
            .iter()
            .map(|(svc, (sandbox, mappings))| {
                let name = names::istio_route_name(&owner, &rc_name, &svc.namespace, &svc.name);
                let mut ir = IstioRoute::new(
                    &name,
                    IstioRouteSpec {
                        routing_key: key.clone(),
                        sandbox: sandbox.clone(),
                        target_service: svc.clone(),
                        mappings: mappings.clone(),
                    },
                );
                meta_of(rc, sandbox, ir.meta_mut());
                ir
            })
            .collect();
        apply_and_prune::<IstioRoute>(ctx, &rc_name, objs).await?;
    }
    if cfg.gateway_api {
        let objs = want
            .iter()
            .map(|(svc, (sandbox, mappings))| {
                let name =
                    names::gateway_api_route_name(&owner, &rc_name, &svc.namespace, &svc.name);
                let mut gr = GatewayAPIRoute::new(
                    &name,
                    GatewayAPIRouteSpec {
                        routing_key: key.clone(),
                        sandbox: sandbox.clone(),
                        target_service: svc.clone(),
                        mappings: mappings.clone(),
                    },
                );
                meta_of(rc, sandbox, gr.meta_mut());
                gr
            })
            .collect();
        apply_and_prune::<GatewayAPIRoute>(ctx, &rc_name, objs).await?;
    }
    Ok(())
}

fn meta_of(rc: &RoutingConfig, sandbox: &str, meta: &mut kube::core::ObjectMeta) {
    meta.labels = Some(BTreeMap::from([
        (
            labels::MANAGED_BY.to_owned(),
            labels::MANAGED_BY_VALUE.to_owned(),
        ),
        (labels::ROUTING_CONFIG.to_owned(), rc.name_any()),
        (labels::ROUTING_KEY.to_owned(), rc.spec.routing_key.clone()),
        (labels::SANDBOX.to_owned(), sandbox.to_owned()),
    ]));
    meta.owner_references = Some(rc.controller_owner_ref(&()).into_iter().collect());
}

fn selector(rc_name: &str) -> ListParams {
    ListParams::default().labels(&format!("{}={rc_name}", labels::ROUTING_CONFIG))
}

async fn apply_and_prune<K>(ctx: &Context, rc_name: &str, desired: Vec<K>) -> Result<(), Error>
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + Serialize
        + DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let api: Api<K> = Api::all(ctx.client.clone());
    let keep: BTreeSet<String> = desired.iter().map(ResourceExt::name_any).collect();
    for obj in desired {
        spur_operator_core::OWNER.ensure(&api, None, obj).await?;
    }
    for old in api.list_metadata(&selector(rc_name)).await?.items {
        let name = old.name_any();
        if !keep.contains(&name) {
            delete_opt(&api, &name).await?;
        }
    }
    Ok(())
}

/// The RoutingConfig `rc` is going: its mesh routes go too (each one's own finalizer takes its
/// routes out of the mesh's objects first).
pub async fn cleanup(rc: &RoutingConfig, cfg: &MeshConfig, ctx: &Context) -> Result<Action, Error> {
    let rc_name = rc.name_any();
    if cfg.istio {
        apply_and_prune::<IstioRoute>(ctx, &rc_name, Vec::new()).await?;
    }
    if cfg.gateway_api {
        apply_and_prune::<GatewayAPIRoute>(ctx, &rc_name, Vec::new()).await?;
    }
    Ok(Action::await_change())
}

/// Drops `finalizer` from a cluster-scoped `obj` (a JSON patch that first tests the list is
/// still the one read, so a concurrent change fails instead of being lost).
pub async fn remove_finalizer<K>(api: &Api<K>, obj: &K, finalizer: &str) -> Result<(), Error>
where
    K: Resource + Clone + std::fmt::Debug + DeserializeOwned,
{
    let finalizers = obj.finalizers();
    let Some(i) = finalizers.iter().position(|f| f == finalizer) else {
        return Ok(());
    };
    let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
        {"op": "test", "path": format!("/metadata/finalizers/{i}"), "value": finalizer},
        {"op": "remove", "path": format!("/metadata/finalizers/{i}")},
    ]))?;
    match api
        .patch(
            &obj.name_any(),
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

// === the mesh's own kinds, read as dynamic objects (no Istio or Gateway API crate) ===

pub fn virtual_service_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("networking.istio.io", "v1", "VirtualService"),
        "virtualservices",
    )
}

pub fn http_route_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "HTTPRoute"),
        "httproutes",
    )
}

/// A dynamic object's `spec`, or an empty object.
pub(crate) fn spec_of(obj: &DynamicObject) -> &serde_json::Value {
    static EMPTY: serde_json::Value = serde_json::Value::Null;
    obj.data.get("spec").unwrap_or(&EMPTY)
}

/// A mesh route's status (IstioRoute or GatewayAPIRoute, of `generation`, with status `old`):
/// the objects it matched, and `ready` with the reason and message as its `Ready` condition.
pub(crate) fn route_status(
    generation: Option<i64>,
    old: Option<&MeshRouteStatus>,
    matched_objects: Vec<MatchedObject>,
    ready: bool,
    reason: &str,
    message: &str,
) -> MeshRouteStatus {
    let mut st = MeshRouteStatus {
        observed_generation: generation,
        conditions: old.map(|o| o.conditions.clone()).unwrap_or_default(),
        matched_objects,
    };
    spur_api::conditions::set_now(
        &mut st.conditions,
        generation,
        spur_api::conditions::READY,
        ready,
        reason,
        message,
    );
    st
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_api::ServicePort;

    #[test]
    fn one_route_per_baseline_service_first_sandbox_wins() {
        let web = [ServiceMapping {
            baseline_service: "web".into(),
            sandbox_service: "sb1-web".into(),
            ports: vec![
                ServicePort {
                    port: 8080,
                    target_port: 8080,
                },
                ServicePort {
                    port: 80,
                    target_port: 8080,
                },
            ],
        }];
        let web2 = [ServiceMapping {
            baseline_service: "web".into(),
            sandbox_service: "sb2-web".into(),
            ports: vec![ServicePort {
                port: 80,
                target_port: 8080,
            }],
        }];
        let targets = [
            Target {
                namespace: "shop",
                sandbox: "sb2",
                services: &web2,
            },
            Target {
                namespace: "shop",
                sandbox: "sb1",
                services: &web,
            },
        ];
        let d = desired(&targets);
        assert_eq!(d.len(), 1);
        let (sandbox, mappings) = &d[&ServiceRef {
            namespace: "shop".into(),
            name: "web".into(),
        }];
        assert_eq!(sandbox, "sb1");
        let ports: Vec<i32> = mappings.iter().map(|m| m.from_port).collect();
        assert_eq!(ports, [80, 8080]);
        assert!(mappings.iter().all(|m| m.to_service == "sb1-web"));
    }
}
