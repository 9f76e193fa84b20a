//! Sandbox resources (docs/resources.md): the ResourcePlugin controller (is a plugin usable),
//! the Resource controller (io context Secret, ObjectLifecycleMethods, output Secrets), and the
//! Sandbox controller's side (create a Resource per `spec.resources[]`, hold the forks back
//! until every resource is ready).
//!
//! ```text
//! Sandbox ──► Resource ──► ObjectLifecycleMethods ──► step pods ──► io context Secret (values)
//!                │ Started                                               │
//!                └──► Secret <sandbox>-<resource> in each fork namespace ◄─┘ (declared outputs)
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Api, Resource as _, ResourceExt};
use spur_api::conditions::{ConditionStatus, NewCondition, READY, set_condition};
use spur_api::keys::labels;
use spur_api::names;
use spur_api::resources::{
    OlmPhase, PluginRequest, ResourceOlm, ResourcePhase, StepFailure, UnitPhase, UnitStatus,
    compile, env, io_key, parse_plugin_request, resolve_plugin,
};
use spur_api::sandbox::ResourceStatusSummary;
use spur_api::{
    ObjectLifecycleMethods, OlmSpec, Resource, ResourcePlugin, ResourceSpec, ResourceStatus,
    Sandbox,
};

use crate::context::{Context, FIELD_MANAGER, delete_opt, now};
use crate::olm::{ResourceConfig, check_template};
use crate::{Error, FINALIZER};

// === ResourcePlugin ===

/// Validates a plugin (what its schema cannot check) into its `Ready` condition.
pub(crate) async fn reconcile_plugin(
    plugin: Arc<ResourcePlugin>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ResourcePlugin");
    let verdict = plugin_problem(&plugin);
    let old = plugin.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.observed_generation = plugin.meta().generation;
    let (status, reason, message) = match &verdict {
        None => (
            ConditionStatus::True,
            "Valid",
            "sandboxes can use this plugin".to_string(),
        ),
        Some(why) => (ConditionStatus::False, "Invalid", why.clone()),
    };
    set_condition(
        &mut st.conditions,
        NewCondition {
            type_: READY,
            status,
            reason,
            message: &message,
            observed_generation: plugin.meta().generation,
        },
        &now(),
    );
    let api: Api<ResourcePlugin> = Api::all(ctx.client.clone());
    if ctx.status.apply(&api, &plugin, &old, &st).await? && verdict.is_some() {
        ctx.event(&*plugin, true, "Invalid", "Validate", message)
            .await;
    }
    Ok(Action::await_change())
}

pub(crate) fn plugin_error_policy(
    p: Arc<ResourcePlugin>,
    err: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.retry(&*p, err)
}

/// Why a plugin cannot be used, if it cannot.
fn plugin_problem(plugin: &ResourcePlugin) -> Option<String> {
    if let Err(e) = plugin.validate() {
        return Some(e.to_string());
    }
    if let Some(overlay) = &plugin.spec.runner.pod_template_overlay
        && let Err(e) = check_template(overlay)
    {
        return Some(format!("spec.runner.podTemplateOverlay: {e}"));
    }
    None
}

// === Sandbox side ===

/// Where a sandbox's resources stand, for its status.
pub(crate) struct SandboxResources {
    pub(crate) entries: Vec<ResourceStatusSummary>,
    /// Every resource is Ready: the forks may start.
    pub(crate) ready: bool,
    /// A resource failed: `(reason, message)` for the sandbox's Ready condition.
    pub(crate) failed: Option<String>,
}

/// Checks the sandbox's resources for what only the cluster knows: resources are enabled, each
/// plugin exists, is usable and gets the parameters it reads. Resources that exist already are
/// not checked again (they keep the plugin version they were made from).
pub(crate) async fn check(
    sb: &Sandbox,
    ctx: &Context,
) -> Result<Result<(), (&'static str, String)>, Error> {
    if sb.spec.resources.is_empty() {
        return Ok(Ok(()));
    }
    if ctx.resources.is_none() {
        return Ok(Err((
            "Unsupported",
            "sandbox resources are not enabled in this installation (chart value resources.enabled)"
                .into(),
        )));
    }
    let name = sb.name_any();
    let resources: Api<Resource> = Api::all(ctx.client.clone());
    let mut plugins: Option<Vec<ResourcePlugin>> = None;
    for (i, r) in sb.spec.resources.iter().enumerate() {
        if let Some(existing) = resources
            .get_opt(&names::resource_name(&name, &r.name))
            .await?
        {
            // Made already (and immutable): its outputs reach the namespaces it was made for.
            let reached = &existing.spec.output_namespaces;
            if let Some(ns) = sb
                .spec
                .forks
                .iter()
                .map(|f| &f.fork_of.namespace)
                .find(|ns| !reached.contains(ns))
            {
                return Ok(Err((
                    "InvalidResource",
                    format!(
                        "resources[{i}] ({}): made for forks in {}; a fork in {ns} would not get its outputs (recreate the sandbox to fork there)",
                        r.name,
                        reached.join(", ")
                    ),
                )));
            }
            continue;
        }
        let all = plugins_once(&mut plugins, ctx).await?;
        let checked = pick(all, &r.plugin).and_then(|p| {
            compile_for(p, sb, &r.name, &r.params, "check")?;
            outputs_exist(sb, &r.name, p)
        });
        if let Err(why) = checked {
            return Ok(Err((
                "InvalidResource",
                format!("resources[{i}] ({}): {why}", r.name),
            )));
        }
    }
    Ok(Ok(()))
}

/// Every `valueFrom.resource` of the forks that names `resource` names an output its plugin's
/// create steps declare (a typo would otherwise leave the fork waiting for a key that never
/// comes).
fn outputs_exist(sb: &Sandbox, resource: &str, plugin: &ResourcePlugin) -> Result<(), String> {
    let declared: Vec<String> = plugin
        .spec
        .create
        .iter()
        .flat_map(|s| s.outputs.iter().map(|o| io_key(&s.name, &o.name)))
        .collect();
    for (i, f) in sb.spec.forks.iter().enumerate() {
        for (j, e) in f.customizations.env.iter().enumerate() {
            let Some(r) = e.value_from.as_ref().and_then(|v| v.resource.as_ref()) else {
                continue;
            };
            if r.name == resource && !declared.contains(&r.output_key) {
                return Err(format!(
                    "forks[{i}].customizations.env[{j}]: plugin {} has no output {} (its create steps declare: {})",
                    plugin.name_any(),
                    r.output_key,
                    if declared.is_empty() {
                        "none".to_string()
                    } else {
                        declared.join(", ")
                    }
                ));
            }
        }
    }
    Ok(())
}

/// The cluster's plugins, listed at most once per pass (and only when a resource needs one).
async fn plugins_once<'a>(
    cache: &'a mut Option<Vec<ResourcePlugin>>,
    ctx: &Context,
) -> Result<&'a [ResourcePlugin], Error> {
    if cache.is_none() {
        let all = Api::<ResourcePlugin>::all(ctx.client.clone())
            .list(&ListParams::default())
            .await?
            .items;
        *cache = Some(all);
    }
    Ok(cache.as_deref().unwrap_or_default())
}

fn pick<'a>(plugins: &'a [ResourcePlugin], request: &str) -> Result<&'a ResourcePlugin, String> {
    let req = parse_plugin_request(request)?;
    let names: Vec<String> = plugins.iter().map(ResourceExt::name_any).collect();
    let chosen =
        resolve_plugin(&req, names.iter().map(String::as_str)).ok_or_else(|| match req {
            PluginRequest::Latest(p) => format!("no ResourcePlugin named {p} or {p}.<version>"),
            PluginRequest::Exact(p, (a, b, c)) => {
                format!("no ResourcePlugin {p}.{a}.{b}.{c} (plugin {request})")
            }
        })?;
    let plugin = plugins
        .iter()
        .find(|p| p.name_any() == chosen)
        .ok_or("the plugin vanished")?;
    if let Some(why) = plugin_problem(plugin) {
        return Err(format!("ResourcePlugin {chosen} is invalid: {why}"));
    }
    Ok(plugin)
}

fn compile_for(
    plugin: &ResourcePlugin,
    sb: &Sandbox,
    resource: &str,
    params: &BTreeMap<String, String>,
    context: &str,
) -> Result<ResourceOlm, String> {
    let key = sb
        .status
        .as_ref()
        .and_then(|s| s.routing_key.clone())
        .or_else(|| sb.uid().map(|u| spur_api::names::routing_key(&u)))
        .unwrap_or_default();
    let name = sb.name_any();
    compile(
        &plugin.spec,
        params,
        context,
        &[
            (env::SANDBOX_NAME, name.as_str()),
            (env::ROUTING_KEY, key.as_str()),
            (env::RESOURCE_NAME, resource),
        ],
    )
}

/// Creates the sandbox's missing Resources and reports where they all stand.
pub(crate) async fn ensure(
    sb: &Sandbox,
    key: &str,
    owner: &[OwnerReference],
    ctx: &Context,
) -> Result<SandboxResources, Error> {
    let name = sb.name_any();
    let api: Api<Resource> = Api::all(ctx.client.clone());
    let mut output_namespaces: Vec<String> = sb
        .spec
        .forks
        .iter()
        .map(|f| f.fork_of.namespace.clone())
        .collect();
    output_namespaces.sort();
    output_namespaces.dedup();
    let mut plugins: Option<Vec<ResourcePlugin>> = None;
    let mut out = SandboxResources {
        entries: Vec::new(),
        ready: true,
        failed: None,
    };
    for r in &sb.spec.resources {
        let rname = names::resource_name(&name, &r.name);
        let res = match api.get_opt(&rname).await? {
            Some(res) => res,
            None => {
                let all = plugins_once(&mut plugins, ctx).await?;
                let plugin = pick(all, &r.plugin).map_err(Error::Pending)?;
                let olm =
                    compile_for(plugin, sb, &r.name, &r.params, &rname).map_err(Error::Pending)?;
                let mut res = Resource::new(
                    &rname,
                    ResourceSpec {
                        sandbox: name.clone(),
                        name: r.name.clone(),
                        plugin: plugin.name_any(),
                        routing_key: key.to_owned(),
                        output_namespaces: output_namespaces.clone(),
                        olm,
                    },
                );
                res.metadata.labels = Some(resource_labels(&name, &rname, Some(key)));
                res.metadata.owner_references = Some(owner.to_vec());
                match api.create(&PostParams::default(), &res).await {
                    Ok(created) => {
                        ctx.event(
                            sb,
                            false,
                            "ResourceCreated",
                            "Create",
                            format!("resource {} from plugin {}", r.name, plugin.name_any()),
                        )
                        .await;
                        created
                    }
                    Err(kube::Error::Api(ae)) if ae.code == 409 => api.get(&rname).await?,
                    Err(e) => return Err(e.into()),
                }
            }
        };
        let st = res.status.clone().unwrap_or_default();
        let deleting = res.meta().deletion_timestamp.is_some();
        let phase = if deleting {
            ResourcePhase::Deleting
        } else {
            st.phase
        };
        let message = match (&st.failure, phase) {
            (Some(f), _) => Some(failure_message(f)),
            (None, ResourcePhase::Ready) => None,
            (None, _) => Some(progress_message(&st)),
        };
        if phase == ResourcePhase::Failed {
            out.failed.get_or_insert_with(|| {
                format!(
                    "resource {}: {}",
                    r.name,
                    message.clone().unwrap_or_default()
                )
            });
        }
        out.ready &= phase == ResourcePhase::Ready;
        out.entries.push(ResourceStatusSummary {
            name: r.name.clone(),
            resource: Some(rname),
            plugin: Some(res.spec.plugin.clone()),
            phase: phase.as_str().into(),
            output_secret: st.output_secret.clone(),
            message,
        });
    }
    Ok(out)
}

/// Summaries of the sandbox's Resources as they are (while it is being deleted: `Deleting`
/// once their deletion has started).
pub(crate) async fn summaries(
    sb: &Sandbox,
    ctx: &Context,
) -> Result<Vec<ResourceStatusSummary>, Error> {
    let name = sb.name_any();
    let api: Api<Resource> = Api::all(ctx.client.clone());
    let mut out = Vec::new();
    for r in &sb.spec.resources {
        let rname = names::resource_name(&name, &r.name);
        let Some(res) = api.get_opt(&rname).await? else {
            continue;
        };
        let st = res.status.clone().unwrap_or_default();
        let phase = if res.meta().deletion_timestamp.is_some() {
            ResourcePhase::Deleting
        } else {
            st.phase
        };
        out.push(ResourceStatusSummary {
            name: r.name.clone(),
            resource: Some(rname),
            plugin: Some(res.spec.plugin.clone()),
            phase: phase.as_str().into(),
            output_secret: st.output_secret.clone(),
            message: Some(match &st.failure {
                Some(f) => failure_message(f),
                None => progress_message(&st),
            }),
        });
    }
    Ok(out)
}

/// Deletes the sandbox's Resources; `true` while some still exist (their delete workflows
/// run behind their finalizers).
pub(crate) async fn delete_all(sandbox: &str, ctx: &Context) -> Result<bool, Error> {
    let api: Api<Resource> = Api::all(ctx.client.clone());
    let lp = ListParams::default().labels(&format!("{}={sandbox}", labels::SANDBOX));
    let mut remaining = false;
    for res in api.list(&lp).await?.items {
        remaining = true;
        if res.meta().deletion_timestamp.is_none() {
            delete_opt(&api, &res.name_any()).await?;
        }
    }
    Ok(remaining)
}

fn failure_message(f: &StepFailure) -> String {
    let mut m = format!("step {} failed", f.step);
    if f.attempts > 1 {
        m.push_str(&format!(" (attempt {})", f.attempts));
    }
    m.push_str(&format!(": {}", f.message));
    if let Some(tail) = f.log_tail.as_deref().filter(|t| !t.is_empty()) {
        m.push_str(&format!("; log: {tail}"));
    }
    m
}

fn progress_message(st: &ResourceStatus) -> String {
    let units = match st.phase {
        ResourcePhase::Deleting => &st.delete,
        _ => &st.create,
    };
    match units.iter().find(|u| !u.phase.is_done()) {
        Some(u) => format!(
            "step {}: {}",
            u.name,
            u.message.clone().unwrap_or_else(|| "pending".into())
        ),
        None => st.phase.as_str().to_string(),
    }
}

fn resource_labels(sandbox: &str, resource: &str, key: Option<&str>) -> BTreeMap<String, String> {
    let mut l = BTreeMap::from([
        (
            labels::MANAGED_BY.to_owned(),
            labels::MANAGED_BY_VALUE.to_owned(),
        ),
        (labels::SANDBOX.to_owned(), sandbox.to_owned()),
        (labels::RESOURCE.to_owned(), resource.to_owned()),
    ]);
    if let Some(k) = key {
        l.insert(labels::ROUTING_KEY.to_owned(), k.to_owned());
    }
    l
}

// === Resource ===

pub(crate) async fn reconcile(res: Arc<Resource>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("Resource");
    let Some(cfg) = ctx.resources.clone() else {
        return Ok(Action::await_change());
    };
    let api: Api<Resource> = Api::all(ctx.client.clone());
    let action = finalizer(&api, FINALIZER, res, |event| async {
        match event {
            Event::Apply(res) => apply(&res, &ctx, &cfg).await,
            Event::Cleanup(res) => cleanup(&res, &ctx, &cfg).await,
        }
    })
    .await;
    spur_controller::finalized(action)
}

pub(crate) fn error_policy(res: Arc<Resource>, err: &Error, ctx: Arc<Context>) -> Action {
    match err {
        Error::Pending(_) => return Action::requeue(Duration::from_secs(2)),
        Error::Requeue { after, .. } => return Action::requeue(*after),
        _ => {}
    }
    ctx.retry(&*res, err)
}

async fn apply(res: &Resource, ctx: &Context, cfg: &ResourceConfig) -> Result<Action, Error> {
    let name = res.name_any();
    let owner: Vec<OwnerReference> = res.controller_owner_ref(&()).into_iter().collect();
    let labels_map = resource_labels(&res.spec.sandbox, &name, Some(&res.spec.routing_key));

    // The io context first: a step may only run once there is somewhere to put its outputs.
    let contexts: Api<Secret> = Api::namespaced(ctx.client.clone(), &cfg.ics_namespace);
    let context_secret = names::io_context_secret_name(&name);
    if contexts.get_metadata_opt(&context_secret).await?.is_none() {
        let s = Secret {
            metadata: ObjectMeta {
                name: Some(context_secret.clone()),
                namespace: Some(cfg.ics_namespace.clone()),
                labels: Some(labels_map.clone()),
                // No owner: the garbage collector must not remove it while the delete steps
                // still need its values (a foreground deletion would); this Resource's
                // finalizer deletes it once they have run.
                ..ObjectMeta::default()
            },
            type_: Some("Opaque".into()),
            ..Secret::default()
        };
        match contexts.create(&PostParams::default(), &s).await {
            Ok(_) => {}
            Err(kube::Error::Api(ae)) if ae.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }

    let olms: Api<ObjectLifecycleMethods> = Api::all(ctx.client.clone());
    let olm = match olms.get_opt(&name).await? {
        Some(o) => o,
        None => {
            let mut o = ObjectLifecycleMethods::new(
                &name,
                OlmSpec {
                    io_context_name: name.clone(),
                    pre_start: res.spec.olm.pre_start.clone(),
                    post_stop: res.spec.olm.post_stop.clone(),
                },
            );
            o.metadata.labels = Some(labels_map.clone());
            o.metadata.owner_references = Some(owner.clone());
            match olms.create(&PostParams::default(), &o).await {
                Ok(o) => o,
                Err(kube::Error::Api(ae)) if ae.code == 409 => olms.get(&name).await?,
                Err(e) => return Err(e.into()),
            }
        }
    };
    let ost = olm.status.clone().unwrap_or_default();
    let old = res.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.io_context_name = Some(name.clone());
    st.olm_name = Some(name.clone());
    st.create = ost.pre_start.clone();
    st.delete = ost.post_stop.clone();
    st.observed_generation = res.meta().generation;
    match ost.phase {
        OlmPhase::Pending | OlmPhase::Starting => {
            st.phase = ResourcePhase::Creating;
            st.failure = None;
            let msg = progress_message(&st);
            condition(&mut st, res, false, "Creating", &msg);
        }
        OlmPhase::Failed => {
            st.phase = ResourcePhase::Failed;
            let f = first_failure(&ost.pre_start).unwrap_or_else(|| StepFailure {
                step: String::new(),
                attempts: 0,
                message: ost
                    .conditions
                    .iter()
                    .find(|c| c.type_ == READY)
                    .map(|c| c.message.clone())
                    .unwrap_or_else(|| "the create workflow failed".into()),
                log_tail: None,
            });
            let msg = failure_message(&f);
            st.failure = Some(f);
            if st != old {
                ctx.event(res, true, "CreateFailed", "Create", msg.clone())
                    .await;
            }
            condition(&mut st, res, false, "CreateFailed", &msg);
        }
        OlmPhase::Started => {
            let keys = publish_outputs(res, ctx, cfg, &labels_map, &owner).await?;
            st.phase = ResourcePhase::Ready;
            st.failure = None;
            st.output_secret = Some(name.clone());
            st.output_keys = keys;
            condition(
                &mut st,
                res,
                true,
                "Ready",
                &format!(
                    "created; outputs in Secret {name} of namespace(s) {}",
                    res.spec.output_namespaces.join(", ")
                ),
            );
        }
        OlmPhase::Stopping | OlmPhase::Stopped => {}
    }
    let api: Api<Resource> = Api::all(ctx.client.clone());
    ctx.status.apply(&api, res, &old, &st).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Copies the create workflow's declared outputs from the io context into Secret `<resource>`
/// of every output namespace; returns their keys.
async fn publish_outputs(
    res: &Resource,
    ctx: &Context,
    cfg: &ResourceConfig,
    labels_map: &BTreeMap<String, String>,
    owner: &[OwnerReference],
) -> Result<Vec<String>, Error> {
    let name = res.name_any();
    let contexts: Api<Secret> = Api::namespaced(ctx.client.clone(), &cfg.ics_namespace);
    let data = contexts
        .get_opt(&names::io_context_secret_name(&name))
        .await?
        .and_then(|s| s.data)
        .unwrap_or_default();
    let declared: Vec<String> = res
        .spec
        .olm
        .pre_start
        .iter()
        .flat_map(|u| u.outputs.iter().map(|o| io_key(&u.name, &o.name)))
        .collect();
    let outputs: BTreeMap<String, ByteString> = declared
        .iter()
        .filter_map(|k| data.get(k).map(|v| (k.clone(), v.clone())))
        .collect();
    for ns in &res.spec.output_namespaces {
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(ns.clone()),
                labels: Some(labels_map.clone()),
                owner_references: Some(owner.to_vec()),
                ..ObjectMeta::default()
            },
            type_: Some("Opaque".into()),
            data: Some(outputs.clone()),
            ..Secret::default()
        };
        let body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": secret.metadata,
            "type": secret.type_,
            "data": secret.data,
        });
        Api::<Secret>::namespaced(ctx.client.clone(), ns)
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await?;
    }
    Ok(outputs.into_keys().collect())
}

fn first_failure(units: &[UnitStatus]) -> Option<StepFailure> {
    units
        .iter()
        .find(|u| u.phase == UnitPhase::Failed)
        .map(|u| StepFailure {
            step: u.name.clone(),
            attempts: u.attempts,
            message: u.message.clone().unwrap_or_default(),
            log_tail: u.log_tail.clone(),
        })
}

async fn cleanup(res: &Resource, ctx: &Context, cfg: &ResourceConfig) -> Result<Action, Error> {
    let name = res.name_any();
    let olms: Api<ObjectLifecycleMethods> = Api::all(ctx.client.clone());
    if let Some(olm) = olms.get_opt(&name).await? {
        if olm.meta().deletion_timestamp.is_none() {
            delete_opt(&olms, &name).await?;
        }
        let ost = olm.status.clone().unwrap_or_default();
        let old = res.status.clone().unwrap_or_default();
        let mut st = old.clone();
        st.phase = ResourcePhase::Deleting;
        st.create = ost.pre_start.clone();
        st.delete = ost.post_stop.clone();
        st.failure = first_failure(&ost.post_stop);
        let msg = match &st.failure {
            Some(f) => failure_message(f),
            None => progress_message(&st),
        };
        condition(&mut st, res, false, "Deleting", &msg);
        let api: Api<Resource> = Api::all(ctx.client.clone());
        ctx.status.apply(&api, res, &old, &st).await?;
        // Every change of the OLM wakes this pass; the requeue is a safety net.
        return Err(Error::Requeue {
            what: format!("the delete workflow of resource {name}"),
            after: Duration::from_secs(30),
        });
    }
    // The io context goes with its resource (its owner reference covers clusters with a
    // garbage collector; this covers the moment).
    let contexts: Api<Secret> = Api::namespaced(ctx.client.clone(), &cfg.ics_namespace);
    delete_opt(&contexts, &names::io_context_secret_name(&name)).await?;
    Ok(Action::await_change())
}

fn condition(st: &mut ResourceStatus, res: &Resource, ok: bool, reason: &str, message: &str) {
    set_condition(
        &mut st.conditions,
        NewCondition {
            type_: READY,
            status: if ok {
                ConditionStatus::True
            } else {
                ConditionStatus::False
            },
            reason,
            message,
            observed_generation: res.meta().generation,
        },
        &now(),
    );
}
