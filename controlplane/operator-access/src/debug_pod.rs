//! Debug pods of PodAccessRequests (docs/access.md, "Debug pods"): cloned from the workload's
//! pod template (or a template's pod spec) so that nothing else treats them as a replica, with a
//! deadline at the grant's end that the kubelet enforces even while the operator is down.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, PostParams};
use spur_api::access::PodAccessTemplate;
use spur_api::names;

use super::desired::{self, DebugPod, build_debug_pod};
use super::targets::resolve_target;
use super::{Refusal, plan};
use crate::AccessContext;
use spur_operator_core::Error;

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
    ctx: &AccessContext,
    ns: &str,
    request: &str,
    template: &PodAccessTemplate,
    sandbox: Option<&str>,
    left: Duration,
    owner: &OwnerReference,
) -> Result<Result<Pod, Refusal>, Error> {
    let name = debug_pod_name(ns, request);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    if let Some(pod) = pods.get_opt(&name).await? {
        return Ok(plan::existing_debug_pod(pod, &owner.uid, &name));
    }
    let source = match &template.spec.target_ref {
        Some(target) => match resolve_target(ctx, ns, target, sandbox).await? {
            Ok(w) => desired::workload_pod(target, &w).map_err(Error::Json)?,
            Err(e) => Err(e),
        },
        None => desired::template_pod(template.spec.pod_spec.as_ref()),
    };
    let source = match source {
        Ok(s) => s,
        Err(e) => return Ok(Err(("NoPod", e))),
    };
    let pod = match build_debug_pod(
        &DebugPod {
            name: &name,
            namespace: ns,
            request,
            template: &source.meta,
            claims: &source.claims,
            mutation: template.spec.mutation.as_ref(),
            left,
            owner,
        },
        source.spec,
    ) {
        Ok(p) => p,
        Err(e) => return Ok(Err(("PodRefused", e))),
    };
    plan::created_debug_pod(pods.create(&PostParams::default(), &pod).await, &name)
}
