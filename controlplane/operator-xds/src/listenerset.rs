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

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::ListParams;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use spur_api::ListenerSet;
use spur_api::listenerset::{LISTENER_SET_LABEL, conditions};
use spur_api::names::label_value;
use tokio_util::sync::CancellationToken;

use spur_operator_core::{Context, Error, OWNER, delete_opt};

mod desired;
mod status;

pub use desired::{client_service, endpoint_services};
pub use status::count_endpoints;

/// The label the EndpointSlice controller puts on every slice, naming its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The one port of an endpoint Service.
pub const ENDPOINT_PORT: &str = "endpoint";
/// A set is looked at again after this long with nothing changing: a missed EndpointSlice
/// event (a slice seen before its Service reached the operator's cache) is made good.
const RESYNC: Duration = Duration::from_secs(300);
/// Endpoint Services per EndpointSlice list call: names go into the label selector of the URL.
const SERVICES_PER_LIST: usize = 40;

/// The ListenerSet controller's context: the shared one, and the Services it made as its
/// watch last saw them (labelled `spur.dev/listener-set`; the store is updated before the
/// event that wakes a pass).
pub struct ListenerSetContext {
    pub core: Arc<Context>,
    pub services: Store<Service>,
}

spur_operator_core::feature_context!(ListenerSetContext);

/// Runs the ListenerSet controller until `stop`. Its Services (`services`: the changes of the
/// watch behind `ctx.services`) wake it when changed or deleted behind the operator's back,
/// and so do the EndpointSlices of its endpoint Services, so status follows pods coming, going
/// and changing readiness. The slice watch is metadata-only and cluster-wide (no label selects
/// the slices of the operator's Services: the EndpointSlice controller names the Service in
/// `kubernetes.io/service-name`); a slice is mapped to its set through the Service store.
pub async fn run(
    client: Client,
    ctx: Arc<ListenerSetContext>,
    services: impl Stream<Item = Result<Service, watcher::Error>> + Send + 'static,
    stop: CancellationToken,
) {
    let store = ctx.services.clone();
    let listener_sets = spur_controller::changes::primary(Api::<ListenerSet>::all(client.clone()))
        .with_config(spur_operator_core::controller_config())
        .owns_stream(services)
        .watches(
            Api::<PartialObjectMeta<EndpointSlice>>::all(client),
            watcher::Config::default(),
            move |slice| set_of_slice(&store, &slice),
        );
    spur_controller::run(
        "listenerset",
        listener_sets,
        reconcile,
        error_policy,
        ctx,
        stop,
    )
    .await;
}

async fn reconcile(ls: Arc<ListenerSet>, ctx: Arc<ListenerSetContext>) -> Result<Action, Error> {
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
    let old = status::owned(ls.status.as_ref());
    let mut st = old.clone();
    st.observed_generation = ls.meta().generation;
    st.listener_count = Some(u32::try_from(ls.spec.listeners.len()).unwrap_or(u32::MAX));

    if let Err(e) = ls.spec.validate(&name) {
        // Admission refuses this; only a set written while the webhook was not installed gets
        // here. Its Services stay as the last valid spec made them (deleting them would cut
        // clients off over what may be a typo), and the status says why nothing follows it.
        let message = e.to_string();
        status::invalid(&mut st, &ls, &message);
        if status::reason_of(&old, conditions::READY) != Some("Invalid") {
            ctx.event(&*ls, true, "Invalid", "Validate", message).await;
        }
        ctx.status.apply(&api, &*ls, &old, &st).await?;
        return Ok(Action::await_change());
    }

    let owner = desired::owner(&ls)
        .ok_or_else(|| Error::Pending(format!("a uid on ListenerSet {ns}/{name}")))?;
    let (names, conflict) = services(&ls, &ns, &owner, &ctx).await?;
    let slices = endpoint_slices(&ctx, &ns, &names).await?;
    st.listeners = status::listeners(&ls, &slices);
    status::conditions(&mut st, &ls, conflict.as_deref());
    if let Some(message) = conflict
        && status::reason_of(&old, conditions::READY) != Some("ServiceConflict")
    {
        ctx.event(&*ls, true, "ServiceConflict", "Reconcile", message)
            .await;
    }
    ctx.status.apply(&api, &*ls, &old, &st).await?;
    Ok(Action::requeue(RESYNC))
}

/// Applies the set's Services and deletes the ones it made that it no longer wants. Returns
/// the endpoint Services' names, and why the client Service is not applied when a Service of
/// its name is someone else's.
async fn services(
    ls: &ListenerSet,
    ns: &str,
    owner: &OwnerReference,
    ctx: &ListenerSetContext,
) -> Result<(Vec<String>, Option<String>), Error> {
    let name = ls.name_any();
    let svc_api: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let store = Some(&ctx.services);
    let mark = label_value(&name);
    let current: Vec<Arc<Service>> = (ctx.services.state().into_iter())
        .filter(|svc| svc.namespace().as_deref() == Some(ns) && marked(&**svc, &mark))
        .collect();

    let mut wanted = BTreeSet::new();
    let mut conflict = None;
    if let Some(client) = client_service(ls, owner) {
        let svc_name = client.name_any();
        wanted.insert(svc_name.clone());
        // Never taken over: a Service of that name that is not this set's is someone else's.
        let ours = current.iter().any(|s| s.name_any() == svc_name)
            || match svc_api.get_metadata_opt(&svc_name).await? {
                None => true,
                Some(m) => marked(&m, &mark),
            };
        if ours {
            OWNER.ensure(&svc_api, store, client).await?;
        } else {
            conflict = Some(desired::conflict(&svc_name, &mark));
        }
    }
    let endpoint_services = endpoint_services(ls, owner);
    for svc in &endpoint_services {
        wanted.insert(svc.name_any());
        OWNER.ensure(&svc_api, store, svc.clone()).await?;
    }
    for svc_name in desired::stale(&current, &wanted, &name) {
        delete_opt(&svc_api, &svc_name).await?;
    }
    let names = endpoint_services
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    Ok((names, conflict))
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
fn set_of_slice(
    services: &Store<Service>,
    slice: &impl ResourceExt,
) -> Option<ObjectRef<ListenerSet>> {
    let ns = slice.namespace()?;
    let svc = services.get(&ObjectRef::new(slice.labels().get(SERVICE_NAME_LABEL)?).within(&ns))?;
    Some(ObjectRef::new(&set_of(&*svc)?).within(&ns))
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

fn error_policy(ls: Arc<ListenerSet>, err: &Error, ctx: Arc<ListenerSetContext>) -> Action {
    ctx.retry(&*ls, err)
}

#[cfg(test)]
mod tests {
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
