//! Debug pods of PodAccessRequests (docs/access.md, "Debug pods"): cloned from the workload's
//! pod template (or a template's pod spec) so that nothing else treats them as a replica, with a
//! deadline at the grant's end that the kubelet enforces even while the operator is down.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use serde_json::Value;
use spur_api::access::{PodAccessTemplate, PodMutation};
use spur_api::names;

use super::targets::resolve_target;
use super::{DEFAULT_CONTAINER_ANNOTATION, grant_labels};
use crate::Error;
use crate::context::Context;

/// Name of a PodAccessRequest's debug pod.
pub fn debug_pod_name(ns: &str, request: &str) -> String {
    names::derived_name(&[request, "debug"], &["debug-pod", ns])
}

/// Whether `meta` is the debug pod of PodAccessRequest `request`.
pub(super) fn is_debug_pod_of(meta: &ObjectMeta, request: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.kind == "PodAccessRequest" && o.name == request)
}

/// Creates (once) the debug pod of a PodAccessRequest: the pod, or a condition reason and why
/// there is none.
pub(super) async fn debug_pod(
    ctx: &Context,
    ns: &str,
    request: &str,
    template: &PodAccessTemplate,
    sandbox: Option<&str>,
    left: Duration,
    owner: &OwnerReference,
) -> Result<Result<Pod, (&'static str, String)>, Error> {
    let name = debug_pod_name(ns, request);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    if let Some(pod) = pods.get_opt(&name).await? {
        let ours = pod
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && o.uid == owner.uid);
        return Ok(match (ours, pod.metadata.deletion_timestamp.is_some()) {
            (true, false) => Ok(pod),
            (true, true) => Err((
                "PodGone",
                format!("debug pod {name} is being deleted: file a new request"),
            )),
            (false, _) => Err((
                "PodConflict",
                format!("a pod named {name} exists and is not this request's"),
            )),
        });
    }
    let mut claims = Vec::new();
    let (template_meta, spec) = match (&template.spec.target_ref, &template.spec.pod_spec) {
        (Some(target), _) => {
            let w = match resolve_target(ctx, ns, target, sandbox).await? {
                Ok(w) => w,
                Err(e) => return Ok(Err(("NoPod", e))),
            };
            let Some(t) = w.data.pointer("/spec/template").cloned() else {
                return Ok(Err(("NoPod", format!("{target} has no spec.template"))));
            };
            // A StatefulSet's claims become volumes of its pods: the debug pod gets empty
            // ones instead (it must not share a replica's disk).
            claims = w
                .data
                .pointer("/spec/volumeClaimTemplates")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|c| c.pointer("/metadata/name").and_then(Value::as_str))
                .map(str::to_owned)
                .collect();
            let meta: ObjectMeta = t
                .get("metadata")
                .cloned()
                .map(serde_json::from_value)
                .transpose()
                .map_err(Error::Json)?
                .unwrap_or_default();
            match t
                .get("spec")
                .cloned()
                .map(serde_json::from_value::<PodSpec>)
            {
                Some(Ok(spec)) => (meta, spec),
                _ => {
                    return Ok(Err((
                        "NoPod",
                        format!("{target} has an unreadable pod template"),
                    )));
                }
            }
        }
        (None, Some(spec)) => match serde_json::from_value::<PodSpec>(spec.clone()) {
            Ok(spec) => (ObjectMeta::default(), spec),
            Err(e) => return Ok(Err(("NoPod", format!("the template's podSpec: {e}")))),
        },
        (None, None) => {
            return Ok(Err((
                "NoPod",
                "the template names neither targetRef nor podSpec".into(),
            )));
        }
    };
    let pod = match build_debug_pod(
        &DebugPod {
            name: &name,
            namespace: ns,
            request,
            template: &template_meta,
            claims: &claims,
            mutation: template.spec.mutation.as_ref(),
            left,
            owner,
        },
        spec,
    ) {
        Ok(p) => p,
        Err(e) => return Ok(Err(("PodRefused", e))),
    };
    match pods.create(&PostParams::default(), &pod).await {
        Ok(created) => Ok(Ok(created)),
        // Made by a pass a moment ago: the next pass reads it.
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Err((
            "Waiting",
            format!("debug pod {name} is being created"),
        ))),
        // The pod is refused (quota, pod security): the user's to fix, not a reason to back off.
        Err(kube::Error::Api(s)) if s.code == 403 || s.code == 422 => Ok(Err((
            "PodRefused",
            format!("the debug pod was refused: {}", s.message),
        ))),
        Err(e) => Err(e.into()),
    }
}

/// What a debug pod is made from, besides the pod spec.
pub struct DebugPod<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    pub request: &'a str,
    /// The pod template's metadata (for its default-container annotation).
    pub template: &'a ObjectMeta,
    /// A StatefulSet's claim template names: empty volumes of those names.
    pub claims: &'a [String],
    pub mutation: Option<&'a PodMutation>,
    /// Time left on the grant (the pod's deadline).
    pub left: Duration,
    pub owner: &'a OwnerReference,
}

/// The debug pod: the workload's pod spec with Spur's labels only (so no Service or
/// controller selects it), the template's annotations dropped, probes stripped unless kept,
/// the mutation applied to its main container, and a deadline at the grant's expiry.
pub fn build_debug_pod(d: &DebugPod<'_>, mut spec: PodSpec) -> Result<Pod, String> {
    let DebugPod {
        name,
        namespace: ns,
        request,
        template,
        claims,
        mutation,
        left,
        owner,
    } = *d;
    let default = PodMutation::default();
    let m = mutation.unwrap_or(&default);
    let mut labels = grant_labels("pod", request);
    labels.extend(m.pod_labels.clone());
    let mut annotations = m.pod_annotations.clone();
    // A debug pod is nobody's baseline: no sidecar, whatever the namespace says.
    annotations.insert(spur_api::keys::injection::INJECT.into(), "false".into());
    let wanted = m.default_container.clone().or_else(|| {
        template
            .annotations
            .as_ref()
            .and_then(|a| a.get(DEFAULT_CONTAINER_ANNOTATION).cloned())
    });
    let index = match &wanted {
        Some(w) => spec
            .containers
            .iter()
            .position(|c| &c.name == w)
            .ok_or_else(|| format!("the pod template has no container {w}"))?,
        None if spec.containers.is_empty() => {
            return Err("the pod template has no container".into());
        }
        None => 0,
    };
    if let Some(c) = wanted.or_else(|| spec.containers.first().map(|c| c.name.clone())) {
        annotations.insert(DEFAULT_CONTAINER_ANNOTATION.into(), c);
    }
    for c in spec
        .containers
        .iter_mut()
        .chain(spec.init_containers.iter_mut().flatten())
    {
        strip_probes(c, m);
    }
    let main = &mut spec.containers[index];
    if !m.command.is_empty() {
        main.command = Some(m.command.clone());
        // The workload's arguments belong to its command, not to this one.
        main.args = None;
    }
    if !m.args.is_empty() {
        main.args = Some(m.args.clone());
    }
    if !m.env.is_empty() {
        let env = main.env.get_or_insert_with(Vec::new);
        for e in &m.env {
            env.retain(|x| x.name != e.name);
            env.push(EnvVar {
                name: e.name.clone(),
                value: Some(e.value.clone()),
                value_from: None,
            });
        }
    }
    if let Some(r) = &m.resources {
        main.resources = Some(
            serde_json::from_value(r.clone()).map_err(|e| format!("mutation.resources: {e}"))?,
        );
    }
    // The kubelet kills the pod at the deadline even if the operator is down then.
    spec.active_deadline_seconds = Some(i64::try_from(left.as_secs().max(1)).unwrap_or(i64::MAX));
    // A pod created directly is nobody's replica: fixed node bindings of a DaemonSet's
    // template stay (they are affinities), a hostname from a StatefulSet does not apply.
    spec.hostname = None;
    spec.subdomain = None;
    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    for claim in claims {
        if !volumes.iter().any(|v| &v.name == claim) {
            volumes.push(k8s_openapi::api::core::v1::Volume {
                name: claim.clone(),
                empty_dir: Some(Default::default()),
                ..Default::default()
            });
        }
    }
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: Some(vec![owner.clone()]),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    })
}

fn strip_probes(c: &mut Container, m: &PodMutation) {
    if !m.keep_liveness_probe {
        c.liveness_probe = None;
    }
    if !m.keep_readiness_probe {
        c.readiness_probe = None;
    }
    if !m.keep_startup_probe {
        c.startup_probe = None;
    }
}
