//! Tunnel grants (docs/access.md, "Tunnel grants"): a workstation token's hash in a Secret the
//! tunnel proxy reads, expiring with the grant (the proxy refuses it, and ends its sessions, at
//! that instant by itself: no operator needed), and a revocation when taken back early.

use std::time::Duration;

use kube::api::{Api, ListParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use spur_api::access::{
    AccessConfig, AccessRequestStatus, Requester, TunnelAccessRequest, conditions as cond,
    labels as access_labels,
};
use spur_api::conditions::{ConditionStatus, READY};
use spur_api::keys::labels::{MANAGED_BY, MANAGED_BY_VALUE};
use spur_api::names;

use super::{
    AccessRequest, PENDING_RESYNC, READY_RESYNC, deadline, delete_existing, grant_name, mark,
    requeue_within, until, withhold,
};
use crate::Error;
use crate::context::Context;

/// A tunnel grant: the workstation is this user's alone while the grant lasts, the sandbox
/// (if named) exists, and the token Secret (only the token's hash, expiring with the grant)
/// is where the tunnel proxy looks.
#[allow(clippy::too_many_arguments)]
pub(super) async fn tunnel_grant<K: AccessRequest>(
    r: &K,
    ns: &str,
    ctx: &Context,
    api: &Api<K>,
    old: &AccessRequestStatus,
    mut status: AccessRequestStatus,
    access: &AccessConfig,
    requester: &Requester,
    left: Duration,
) -> Result<Action, Error> {
    use spur_api::tunnel::credentials as cred;
    let generation = r.meta().generation;
    let name = r.name_any();
    let Some((workstation, hash)) = r.tunnel() else {
        return Ok(Action::await_change());
    };
    let Some(token_ns) = ctx.access_tokens.clone() else {
        let message =
            "the operator has no token namespace for tunnel grants (--access-token-namespace)";
        withhold(r, ns, ctx, &mut status, "NoTokenNamespace", message).await?;
        ctx.status.apply(api, r, old, &status).await?;
        return Ok(requeue_within(READY_RESYNC, left));
    };
    if let Some(sandbox) = r.sandbox()
        && Api::<spur_api::Sandbox>::all(ctx.client.clone())
            .get_opt(sandbox)
            .await?
            .is_none()
    {
        let message = format!("sandbox {sandbox} does not exist");
        withhold(r, ns, ctx, &mut status, "NoSandbox", &message).await?;
        ctx.status.apply(api, r, old, &status).await?;
        return Ok(requeue_within(PENDING_RESYNC, left));
    }
    // A workstation is one user's at a time: another user's live grant that is already in
    // effect holds it; of two not yet in effect, the older request. (Creation times have
    // whole seconds, so age alone would often be a coin toss.)
    let others = Api::<TunnelAccessRequest>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await?;
    let mine = (r.meta().creation_timestamp.clone(), r.meta().uid.clone());
    let holder = others.items.iter().find(|o| {
        let in_effect = o.status.as_ref().is_some_and(|s| s.ready);
        o.spec.workstation == workstation
            && o.meta().uid != r.meta().uid
            && o.meta().deletion_timestamp.is_none()
            && o.spec.requester.as_ref().map(|q| q.username.as_str())
                != Some(requester.username.as_str())
            && until(deadline(*o)) > Duration::ZERO
            && (in_effect
                || (!old.ready
                    && (o.meta().creation_timestamp.clone(), o.meta().uid.clone()) < mine))
    });
    if let Some(h) = holder {
        let message = format!(
            "workstation {workstation} is held by another user's grant ({}/{}) until it ends",
            h.namespace().unwrap_or_default(),
            h.name_any()
        );
        withhold(r, ns, ctx, &mut status, "WorkstationTaken", &message).await?;
        ctx.status.apply(api, r, old, &status).await?;
        return Ok(requeue_within(PENDING_RESYNC, left));
    }
    // The workstation is recorded as the requester's until the grant ends (docs/local.md,
    // "Workstation owners"): their Sandboxes may then name it, and nobody else's. A workstation
    // another user owns (their certificate or grant has not ended) is not handed over.
    let owners = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(
        ctx.client.clone(),
        &ctx.tunnels.namespace,
    );
    let until = status.expires_at.as_ref().map(|t| t.0);
    if let Err(refused) = crate::workstation_owner::claim(
        &owners,
        &ctx.tunnels.namespace,
        workstation,
        &requester.username,
        until,
    )
    .await?
    {
        let message = format!("workstation {workstation}: {refused}");
        withhold(r, ns, ctx, &mut status, "WorkstationOwned", &message).await?;
        ctx.status.apply(api, r, old, &status).await?;
        return Ok(requeue_within(PENDING_RESYNC, left));
    }
    let secret_name = grant_name("tunnel", ns, &name);
    let expires = status
        .expires_at
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    let issued = r
        .meta()
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    let secret = serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {
            "name": secret_name,
            "namespace": token_ns,
            "labels": {
                spur_api::tunnel::WORKSTATION_LABEL: workstation,
                cred::CREDENTIAL_LABEL: "token",
                access_labels::ACCESS_REQUEST: names::label_value(&name),
                access_labels::ACCESS_KIND: "tunnel",
                MANAGED_BY: MANAGED_BY_VALUE,
            },
            "annotations": {
                cred::EXPIRES_ANNOTATION: expires,
                cred::ISSUED_ANNOTATION: issued,
                cred::GRANT_NAMESPACE_ANNOTATION: ns,
            },
        },
        "type": "Opaque",
        "stringData": {cred::TOKEN_SHA256_KEY: hash},
    });
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(ctx.client.clone(), &token_ns)
        .patch(
            &secret_name,
            &kube::api::PatchParams::apply(crate::FIELD_MANAGER).force(),
            &kube::api::Patch::Apply(&secret),
        )
        .await?;
    mark(
        &mut status,
        generation,
        cond::ACCESS_RESOURCES_CREATED,
        ConditionStatus::True,
        "Created",
        &format!("token Secret {token_ns}/{secret_name}"),
    );
    mark(
        &mut status,
        generation,
        cond::ACCESS_RESOURCES_READY,
        ConditionStatus::True,
        "Allowed",
        "",
    );
    status.access_message = Some(access.tunnel_command(ns, workstation));
    status.ready = true;
    let message = format!(
        "{} may open a tunnel as workstation {workstation} until {expires}",
        requester.username
    );
    mark(
        &mut status,
        generation,
        READY,
        ConditionStatus::True,
        "Granted",
        &message,
    );
    if ctx.status.apply(api, r, old, &status).await? && !old.ready {
        tracing::info!(kind = K::ACCESS, namespace = ns, request = %name, user = %requester.username, workstation, expires, "tunnel access granted");
        ctx.metrics.access_grant(K::ACCESS, "granted");
        ctx.event(r, false, "Granted", "Grant", message).await;
    }
    Ok(requeue_within(READY_RESYNC, left))
}

/// Deletes a tunnel grant's token Secret. Taken back before its expiry, the grant's open
/// tunnels are closed too: a revocation of the workstation's credentials issued until now
/// (the tunnel proxy closes such sessions; at expiry they end by themselves).
pub(super) async fn remove_tunnel_token(
    ctx: &Context,
    ns: &str,
    request: &str,
) -> Result<bool, Error> {
    use spur_api::tunnel::credentials as cred;
    let Some(token_ns) = ctx.access_tokens.as_deref() else {
        return Ok(false);
    };
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(ctx.client.clone(), token_ns);
    let name = grant_name("tunnel", ns, request);
    let Some(secret) = secrets.get_metadata_opt(&name).await? else {
        return Ok(false);
    };
    // Only the Secret this grant wrote.
    if secret.labels().get(access_labels::ACCESS_REQUEST) != Some(&names::label_value(request)) {
        return Ok(false);
    }
    let workstation = secret
        .labels()
        .get(spur_api::tunnel::WORKSTATION_LABEL)
        .cloned();
    let early = secret
        .annotations()
        .get(cred::EXPIRES_ANNOTATION)
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
        .is_some_and(|at| at > k8s_openapi::jiff::Timestamp::now());
    let removed = delete_existing(&secrets, &name).await?;
    if early && let Some(ws) = workstation {
        let now = k8s_openapi::jiff::Timestamp::now();
        let revocation = serde_json::json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {
                "name": cred::revocation_secret_name(&ws),
                "namespace": token_ns,
                "labels": {
                    spur_api::tunnel::WORKSTATION_LABEL: ws,
                    cred::CREDENTIAL_LABEL: "revocation",
                    MANAGED_BY: MANAGED_BY_VALUE,
                },
                "annotations": {cred::REVOKED_BEFORE_ANNOTATION: now.to_string()},
            },
            "type": "Opaque",
        });
        secrets
            .patch(
                &cred::revocation_secret_name(&ws),
                &kube::api::PatchParams::apply(crate::FIELD_MANAGER).force(),
                &kube::api::Patch::Apply(&revocation),
            )
            .await?;
        tracing::info!(workstation = %ws, request, "tunnel grant taken back before its end: workstation credentials revoked");
    }
    Ok(removed)
}
