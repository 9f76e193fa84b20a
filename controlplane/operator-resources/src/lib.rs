//! Sandbox resources (docs/resources.md): the ResourcePlugin controller (is a plugin usable),
//! the Resource controller (io context Secret, ObjectLifecycleMethods, output Secrets), and the
//! Sandbox controller's side (create a Resource per `spec.resources[]`, hold the forks back
//! until every resource is ready), and the ObjectLifecycleMethods controller that runs a
//! resource's steps ([`olm`]).
//!
//! ```text
//! Sandbox ──► Resource ──► ObjectLifecycleMethods ──► step pods ──► io context Secret (values)
//!                │ Started                                               │
//!                └──► Secret <sandbox>-<resource> in each fork namespace ◄─┘ (declared outputs)
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Api, Resource as _, ResourceExt};
use spur_api::keys::{labels, signadot_env};
use spur_api::names;
use spur_api::resources::{
    OlmPhase, PluginRequest, ResourceOlm, ResourcePhase, compile, env, io_key,
    parse_plugin_request, resolve_plugin,
};
use spur_api::sandbox::ResourceStatusSummary;
use spur_api::{ObjectLifecycleMethods, Resource, ResourcePlugin, Sandbox};

use spur_operator_core::{Error, FIELD_MANAGER, FINALIZER, delete_opt};

use crate::olm::{ResourceConfig, check_template};

mod context;
mod controllers;
mod desired;
pub mod olm;
mod status;

pub use context::ResourcesContext;
pub use controllers::run;

// === ResourcePlugin ===

/// Validates a plugin (what its schema cannot check) into its `Ready` condition.
pub(crate) async fn reconcile_plugin(
    plugin: Arc<ResourcePlugin>,
    ctx: Arc<ResourcesContext>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ResourcePlugin");
    let verdict = plugin_problem(&plugin);
    let old = plugin.status.clone().unwrap_or_default();
    let (st, message) = status::plugin(&plugin, verdict.as_deref());
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
    ctx: Arc<ResourcesContext>,
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
pub struct SandboxResources {
    pub entries: Vec<ResourceStatusSummary>,
    /// Every resource is Ready: the forks may start.
    pub ready: bool,
    /// A resource failed: `(reason, message)` for the sandbox's Ready condition.
    pub failed: Option<String>,
}

/// Checks the sandbox's resources for what only the cluster knows: resources are enabled, each
/// plugin exists, is usable and gets the parameters it reads. Resources that exist already are
/// not checked again (they keep the plugin version they were made from).
pub async fn check(
    sb: &Sandbox,
    ctx: &ResourcesContext,
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
            // Forks' namespaces, and those of local workloads that read outputs.
            if let Some(ns) = desired::output_namespaces(sb)
                .into_iter()
                .find(|ns| !reached.contains(ns))
            {
                return Ok(Err((
                    "InvalidResource",
                    format!(
                        "resources[{i}] ({}): made for workloads in {}; one in {ns} would not get its outputs (recreate the sandbox to add it there)",
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
    ctx: &ResourcesContext,
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
            // The names Signadot's plugin scripts read, so they run unchanged.
            (signadot_env::SANDBOX_NAME, name.as_str()),
            (signadot_env::SANDBOX_ROUTING_KEY, key.as_str()),
            (signadot_env::SANDBOX_ID, key.as_str()),
            (signadot_env::RESOURCE_NAME, resource),
        ],
    )
}

/// Creates the sandbox's missing Resources and reports where they all stand.
pub async fn ensure(
    sb: &Sandbox,
    key: &str,
    owner: &[OwnerReference],
    ctx: &ResourcesContext,
) -> Result<SandboxResources, Error> {
    let name = sb.name_any();
    let api: Api<Resource> = Api::all(ctx.client.clone());
    let output_namespaces = desired::output_namespaces(sb);
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
                let res = desired::resource(
                    sb,
                    desired::NewResource {
                        rname: &rname,
                        resource: &r.name,
                        plugin: plugin.name_any(),
                        key,
                        owner,
                        output_namespaces: output_namespaces.clone(),
                        olm,
                    },
                );
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
        let (entry, phase) = status::summary(&r.name, &res, true);
        if phase == ResourcePhase::Failed {
            out.failed.get_or_insert_with(|| {
                format!(
                    "resource {}: {}",
                    r.name,
                    entry.message.clone().unwrap_or_default()
                )
            });
        }
        out.ready &= phase == ResourcePhase::Ready;
        out.entries.push(entry);
    }
    Ok(out)
}

/// Summaries of the sandbox's Resources as they are (while it is being deleted: `Deleting`
/// once their deletion has started).
pub async fn summaries(
    sb: &Sandbox,
    ctx: &ResourcesContext,
) -> Result<Vec<ResourceStatusSummary>, Error> {
    let name = sb.name_any();
    let api: Api<Resource> = Api::all(ctx.client.clone());
    let mut out = Vec::new();
    for r in &sb.spec.resources {
        let rname = names::resource_name(&name, &r.name);
        let Some(res) = api.get_opt(&rname).await? else {
            continue;
        };
        out.push(status::summary(&r.name, &res, false).0);
    }
    Ok(out)
}

/// Deletes the sandbox's Resources; `true` while some still exist (their delete workflows
/// run behind their finalizers).
pub async fn delete_all(sandbox: &str, ctx: &ResourcesContext) -> Result<bool, Error> {
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

// === Resource ===

pub(crate) async fn reconcile(
    res: Arc<Resource>,
    ctx: Arc<ResourcesContext>,
) -> Result<Action, Error> {
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

pub(crate) fn error_policy(res: Arc<Resource>, err: &Error, ctx: Arc<ResourcesContext>) -> Action {
    match err {
        Error::Pending(_) => return Action::requeue(Duration::from_secs(2)),
        Error::Requeue { after, .. } => return Action::requeue(*after),
        _ => {}
    }
    ctx.retry(&*res, err)
}

async fn apply(
    res: &Resource,
    ctx: &ResourcesContext,
    cfg: &ResourceConfig,
) -> Result<Action, Error> {
    let name = res.name_any();
    let owner: Vec<OwnerReference> = res.controller_owner_ref(&()).into_iter().collect();
    let labels_map = desired::labels(&res.spec.sandbox, &name, Some(&res.spec.routing_key));

    // The io context first: a step may only run once there is somewhere to put its outputs.
    let contexts: Api<Secret> = Api::namespaced(ctx.client.clone(), &cfg.ics_namespace);
    if contexts
        .get_metadata_opt(&names::io_context_secret_name(&name))
        .await?
        .is_none()
    {
        let s = desired::io_context(&name, &cfg.ics_namespace, &labels_map);
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
            let o = desired::olm(res, &labels_map, &owner);
            match olms.create(&PostParams::default(), &o).await {
                Ok(o) => o,
                Err(kube::Error::Api(ae)) if ae.code == 409 => olms.get(&name).await?,
                Err(e) => return Err(e.into()),
            }
        }
    };
    let ost = olm.status.clone().unwrap_or_default();
    let keys = match ost.phase {
        OlmPhase::Started => publish_outputs(res, ctx, cfg, &labels_map, &owner).await?,
        _ => Vec::new(),
    };
    let old = res.status.clone().unwrap_or_default();
    let (st, failed) = status::applied(res, &ost, keys);
    if let Some(msg) = failed {
        ctx.event(res, true, "CreateFailed", "Create", msg).await;
    }
    let api: Api<Resource> = Api::all(ctx.client.clone());
    ctx.status.apply(&api, res, &old, &st).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Copies the create workflow's declared outputs from the io context into Secret `<resource>`
/// of every output namespace; returns their keys.
async fn publish_outputs(
    res: &Resource,
    ctx: &ResourcesContext,
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
    let outputs = desired::outputs(res, &data);
    for ns in &res.spec.output_namespaces {
        let body = desired::output_secret(res, ns, labels_map, owner, &outputs);
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

async fn cleanup(
    res: &Resource,
    ctx: &ResourcesContext,
    cfg: &ResourceConfig,
) -> Result<Action, Error> {
    let name = res.name_any();
    let olms: Api<ObjectLifecycleMethods> = Api::all(ctx.client.clone());
    if let Some(olm) = olms.get_opt(&name).await? {
        if olm.meta().deletion_timestamp.is_none() {
            delete_opt(&olms, &name).await?;
        }
        let ost = olm.status.clone().unwrap_or_default();
        let old = res.status.clone().unwrap_or_default();
        let st = status::deleting(res, &ost);
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    /// Plugin steps get the sandbox's identity under Spur's names and under the ones Signadot's
    /// plugin scripts read (`SIGNADOT_SANDBOX_ID` is the routing key, as in Signadot).
    #[test]
    fn steps_get_spurs_and_signadots_names() {
        let plugin: ResourcePlugin = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ResourcePlugin",
            "metadata": {"name": "pg"},
            "spec": {"runner": {"image": "localhost/spur-postgres:dev"},
                     "create": [{"name": "make", "script": "#!/bin/sh\ntrue\n"}],
                     "delete": [{"name": "drop", "script": "#!/bin/sh\ntrue\n"}]}
        }))
        .unwrap();
        let sb: Sandbox = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "sb1", "uid": "u1"},
            "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "web"}}]},
            "status": {"routingKey": "k1"}
        }))
        .unwrap();
        let olm = compile_for(&plugin, &sb, "db", &BTreeMap::new(), "ctx").unwrap();
        for unit in olm.pre_start.iter().chain(&olm.post_stop) {
            let env = &unit.exec_unit_template.pod_template["spec"]["containers"][0]["env"];
            let get = |name: &str| {
                env.as_array()
                    .unwrap()
                    .iter()
                    .filter(|e| e["name"] == name)
                    .map(|e| e["value"].as_str().unwrap().to_owned())
                    .collect::<Vec<_>>()
            };
            for (name, want) in [
                ("SPUR_SANDBOX_NAME", "sb1"),
                ("SPUR_ROUTING_KEY", "k1"),
                ("SPUR_RESOURCE_NAME", "db"),
                ("SIGNADOT_SANDBOX_NAME", "sb1"),
                ("SIGNADOT_SANDBOX_ROUTING_KEY", "k1"),
                ("SIGNADOT_SANDBOX_ID", "k1"),
                ("SIGNADOT_RESOURCE_NAME", "db"),
            ] {
                assert_eq!(get(name), [want], "{name} in {env}");
            }
        }
    }
}
