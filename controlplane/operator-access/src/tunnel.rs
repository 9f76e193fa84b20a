//! Tunnel grants (docs/access.md, "Tunnel grants"): a workstation token's hash in a Secret the
//! tunnel proxy reads, expiring with the grant (the proxy refuses it, and ends its sessions, at
//! that instant by itself: no operator needed), and a revocation when taken back early.

use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::controller::Action;
use spur_api::access::{
    AccessConfig, AccessRequestStatus, Requester, TunnelAccessRequest, conditions as cond,
    labels as access_labels,
};
use spur_api::names;

use super::desired::{self, TunnelToken};
use super::{
    AccessRequest, PENDING_RESYNC, Pass, READY_RESYNC, delete_existing, grant_name, plan,
    requeue_within, status,
};
use crate::AccessContext;
use spur_operator_core::Error;

/// A tunnel grant: the workstation is this user's alone while the grant lasts, the sandbox
/// (if named) exists, and the token Secret (only the token's hash, expiring with the grant)
/// is where the tunnel proxy looks.
pub(super) async fn tunnel_grant<K: AccessRequest>(
    pass: &Pass<'_, K>,
    mut status: AccessRequestStatus,
    access: &AccessConfig,
    requester: &Requester,
    left: Duration,
) -> Result<Action, Error> {
    let (r, ns, ctx) = (pass.r, pass.ns, pass.ctx);
    let name = r.name_any();
    let Some((workstation, hash)) = r.tunnel() else {
        return Ok(Action::await_change());
    };
    let Some(token_ns) = ctx.access_tokens.clone() else {
        let message =
            "the operator has no token namespace for tunnel grants (--access-token-namespace)";
        let then = requeue_within(READY_RESYNC, left);
        return pass
            .refuse(status, None, "NoTokenNamespace", message, then)
            .await;
    };
    if let Err((reason, message)) = workstation_free(pass, &status, workstation, requester).await? {
        let then = requeue_within(PENDING_RESYNC, left);
        return pass.refuse(status, None, reason, &message, then).await;
    }
    let secret_name = grant_name("tunnel", ns, &name);
    let expires = status::expires(&status);
    let issued = r
        .meta()
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    let secret = desired::tunnel_token(&TunnelToken {
        name: &secret_name,
        namespace: &token_ns,
        request: (ns, &name),
        workstation,
        token_sha256: hash,
        expires: &expires,
        issued: &issued,
    });
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(ctx.client.clone(), &token_ns)
        .patch(
            &secret_name,
            &kube::api::PatchParams::apply(spur_operator_core::FIELD_MANAGER).force(),
            &kube::api::Patch::Apply(&secret),
        )
        .await?;
    let created = format!("token Secret {token_ns}/{secret_name}");
    pass.mark(
        &mut status,
        cond::ACCESS_RESOURCES_CREATED,
        true,
        "Created",
        &created,
    );
    let command = access.tunnel_command(ns, workstation);
    let message = format!(
        "{} may open a tunnel as workstation {workstation} until {expires}",
        requester.username
    );
    let message = status::granted(&mut status, pass.generation(), command, message);
    if pass.write(&status).await? && !pass.old.ready {
        tracing::info!(kind = K::ACCESS, namespace = ns, request = %name, user = %requester.username, workstation, expires, "tunnel access granted");
        ctx.metrics.access_grant(K::ACCESS, "granted");
        ctx.event(r, false, "Granted", "Grant", message).await;
    }
    Ok(requeue_within(READY_RESYNC, left))
}

/// Whether the grant may have `workstation`: the sandbox it names exists, no other user's
/// grant holds the workstation, and it is claimed as the requester's (docs/local.md,
/// "Workstation owners") until the grant ends; else the refusal.
async fn workstation_free<K: AccessRequest>(
    pass: &Pass<'_, K>,
    status: &AccessRequestStatus,
    workstation: &str,
    requester: &Requester,
) -> Result<Result<(), super::Refusal>, Error> {
    let (r, ctx) = (pass.r, pass.ctx);
    if let Some(sandbox) = r.sandbox()
        && Api::<spur_api::Sandbox>::all(ctx.client.clone())
            .get_opt(sandbox)
            .await?
            .is_none()
    {
        return Ok(Err((
            "NoSandbox",
            format!("sandbox {sandbox} does not exist"),
        )));
    }
    // A workstation is one user's at a time: another user's live grant that is already in
    // effect holds it; of two not yet in effect, the older request.
    let others = Api::<TunnelAccessRequest>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await?;
    let user = requester.username.as_str();
    let ready = pass.old.ready;
    if let Some(h) = plan::holder(&others.items, r.meta(), workstation, user, ready) {
        let message = format!(
            "workstation {workstation} is held by another user's grant ({}/{}) until it ends",
            h.namespace().unwrap_or_default(),
            h.name_any()
        );
        return Ok(Err(("WorkstationTaken", message)));
    }
    // Their Sandboxes may then name it, and nobody else's. A workstation another user owns
    // (their certificate or grant has not ended) is not handed over.
    let owners = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(
        ctx.client.clone(),
        &ctx.tunnel_namespace,
    );
    let until = status.expires_at.as_ref().map(|t| t.0);
    if let Err(refused) = spur_operator_core::workstation_owner::claim(
        &owners,
        &ctx.tunnel_namespace,
        workstation,
        user,
        until,
    )
    .await?
    {
        let message = format!("workstation {workstation}: {refused}");
        return Ok(Err(("WorkstationOwned", message)));
    }
    Ok(Ok(()))
}

/// Deletes a tunnel grant's token Secret. Taken back before its expiry, the grant's open
/// tunnels are closed too: a revocation of the workstation's credentials issued until now
/// (the tunnel proxy closes such sessions; at expiry they end by themselves).
pub(super) async fn remove_tunnel_token(
    ctx: &AccessContext,
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
        let revocation = desired::revocation(token_ns, &ws, now);
        secrets
            .patch(
                &cred::revocation_secret_name(&ws),
                &kube::api::PatchParams::apply(spur_operator_core::FIELD_MANAGER).force(),
                &kube::api::Patch::Apply(&revocation),
            )
            .await?;
        tracing::info!(workstation = %ws, request, "tunnel grant taken back before its end: workstation credentials revoked");
    }
    Ok(removed)
}
