//! What a grant makes, as pure functions: the Role and RoleBinding of an exec or pod grant, the
//! SubjectAccessReview that checks them, a PodAccessRequest's debug pod, and a tunnel grant's
//! token Secret (or the revocation that ends its sessions early). The async passes
//! (`super::grant`, `super::debug_pod`, `super::tunnel`) only apply what these return.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, PodSpec};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::DynamicObject;
use serde_json::Value;
use spur_api::access::{PodMutation, Requester, TargetRef, labels as access_labels};
use spur_api::keys::labels::{MANAGED_BY, MANAGED_BY_VALUE};
use spur_api::names;
use spur_api::tunnel::credentials as cred;

use super::{DEFAULT_CONTAINER_ANNOTATION, grant_labels};

// === Exec and pod grants ===

/// A grant's Role and RoleBinding, as [`grant_role`] builds them.
pub(super) struct GrantRole<'a> {
    pub name: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    pub pod: &'a str,
    pub user: &'a str,
    pub owner: &'a OwnerReference,
    /// The grant's end, annotated on both for the second sweeper.
    pub expires: Timestamp,
}

/// The Role (`get` on one pod, exec into it) and the RoleBinding of it to one user.
pub(super) fn grant_role(ns: &str, g: &GrantRole<'_>) -> (Role, RoleBinding) {
    let GrantRole {
        name,
        labels,
        pod,
        user,
        owner,
        expires,
    } = *g;
    let meta = ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(ns.to_owned()),
        labels: Some(labels.clone()),
        // The sweeper (`spur-operator sweep-access`, a CronJob of the chart) deletes the two at this
        // instant even while the operator is down (docs/access.md, "Expiry").
        annotations: Some(BTreeMap::from([(
            access_labels::EXPIRES_AT.to_owned(),
            expires.to_string(),
        )])),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    };
    let rule = |resource: &str, verbs: &[&str]| PolicyRule {
        api_groups: Some(vec![String::new()]),
        resources: Some(vec![resource.to_owned()]),
        resource_names: Some(vec![pod.to_owned()]),
        verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
        ..PolicyRule::default()
    };
    let role = Role {
        metadata: meta.clone(),
        // `get` on pods/exec as well as `create`: kubectl's WebSocket exec is a GET.
        rules: Some(vec![
            rule("pods", &["get"]),
            rule("pods/exec", &["get", "create"]),
        ]),
    };
    let binding = RoleBinding {
        metadata: meta,
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: name.to_owned(),
        },
        subjects: Some(vec![Subject {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "User".into(),
            name: user.to_owned(),
            namespace: None,
        }]),
    };
    (role, binding)
}

/// A SubjectAccessReview for the requester: may they exec into `pod`?
pub(super) fn exec_review(ns: &str, pod: &str, who: &Requester) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(who.username.clone()),
            uid: who.uid.clone(),
            groups: Some(who.groups.clone()),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(ns.to_owned()),
                verb: Some("create".into()),
                resource: Some("pods".into()),
                subresource: Some("exec".into()),
                name: Some(pod.to_owned()),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    }
}

// === Tunnel grants ===

/// A tunnel grant's token Secret, as [`tunnel_token`] builds it.
pub(super) struct TunnelToken<'a> {
    pub name: &'a str,
    /// Where the tunnel proxy reads tokens.
    pub namespace: &'a str,
    /// The request's namespace and name.
    pub request: (&'a str, &'a str),
    pub workstation: &'a str,
    pub token_sha256: &'a str,
    /// RFC 3339 instants (empty when unknown).
    pub expires: &'a str,
    pub issued: &'a str,
}

/// The token Secret: only the token's hash, labelled with the workstation, expiring with the
/// grant (the tunnel proxy refuses it after that by itself).
pub(super) fn tunnel_token(t: &TunnelToken<'_>) -> Value {
    let (ns, request) = t.request;
    serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {
            "name": t.name,
            "namespace": t.namespace,
            "labels": {
                spur_api::tunnel::WORKSTATION_LABEL: t.workstation,
                cred::CREDENTIAL_LABEL: "token",
                access_labels::ACCESS_REQUEST: names::label_value(request),
                access_labels::ACCESS_KIND: "tunnel",
                MANAGED_BY: MANAGED_BY_VALUE,
            },
            "annotations": {
                cred::EXPIRES_ANNOTATION: t.expires,
                cred::ISSUED_ANNOTATION: t.issued,
                cred::GRANT_NAMESPACE_ANNOTATION: ns,
            },
        },
        "type": "Opaque",
        "stringData": {cred::TOKEN_SHA256_KEY: t.token_sha256},
    })
}

/// The revocation of workstation `ws`'s credentials issued before `now`: the tunnel proxy
/// closes the sessions they opened.
pub(super) fn revocation(token_ns: &str, ws: &str, now: Timestamp) -> Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {
            "name": cred::revocation_secret_name(ws),
            "namespace": token_ns,
            "labels": {
                spur_api::tunnel::WORKSTATION_LABEL: ws,
                cred::CREDENTIAL_LABEL: "revocation",
                MANAGED_BY: MANAGED_BY_VALUE,
            },
            "annotations": {cred::REVOKED_BEFORE_ANNOTATION: now.to_string()},
        },
        "type": "Opaque",
    })
}

// === Debug pods ===

/// What a debug pod is cloned from.
#[derive(Debug)]
pub(super) struct PodSource {
    /// The pod template's metadata (for its default-container annotation).
    pub meta: ObjectMeta,
    pub spec: PodSpec,
    /// A StatefulSet's claim template names.
    pub claims: Vec<String>,
}

/// The pod template of workload `w` (the template's `target`), or why it is unusable. An
/// unreadable template metadata is an error, as it always was; an unreadable spec a message.
pub(super) fn workload_pod(
    target: &TargetRef,
    w: &DynamicObject,
) -> Result<Result<PodSource, String>, serde_json::Error> {
    let Some(t) = w.data.pointer("/spec/template") else {
        return Ok(Err(format!("{target} has no spec.template")));
    };
    // A StatefulSet's claims become volumes of its pods: the debug pod gets empty ones
    // instead (it must not share a replica's disk).
    let claims = w
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
        .transpose()?
        .unwrap_or_default();
    Ok(
        match t
            .get("spec")
            .cloned()
            .map(serde_json::from_value::<PodSpec>)
        {
            Some(Ok(spec)) => Ok(PodSource { meta, spec, claims }),
            _ => Err(format!("{target} has an unreadable pod template")),
        },
    )
}

/// The pod spec a template gives itself (`spec.podSpec`), for a template without a target.
pub(super) fn template_pod(pod_spec: Option<&Value>) -> Result<PodSource, String> {
    let Some(spec) = pod_spec else {
        return Err("the template names neither targetRef nor podSpec".into());
    };
    match serde_json::from_value::<PodSpec>(spec.clone()) {
        Ok(spec) => Ok(PodSource {
            meta: ObjectMeta::default(),
            spec,
            claims: Vec::new(),
        }),
        Err(e) => Err(format!("the template's podSpec: {e}")),
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
    mutate(&mut spec.containers[index], m)?;
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

/// The mutation's command, arguments, environment and resources, on the main container.
fn mutate(main: &mut Container, m: &PodMutation) -> Result<(), String> {
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
    Ok(())
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    fn owner() -> OwnerReference {
        OwnerReference {
            api_version: "spur.dev/v1alpha1".into(),
            kind: "PodAccessRequest".into(),
            name: "alice-web".into(),
            uid: "uid-1".into(),
            controller: Some(true),
            block_owner_deletion: None,
        }
    }

    #[test]
    fn the_role_reaches_one_pod_and_binds_one_user() {
        let labels = grant_labels("exec", "alice-web");
        let owner = owner();
        let expires: Timestamp = "2026-01-01T11:00:00Z".parse().unwrap();
        let (role, binding) = grant_role(
            "shop",
            &GrantRole {
                name: "access-alice-web",
                labels: &labels,
                pod: "web-1",
                user: "alice",
                owner: &owner,
                expires,
            },
        );
        for meta in [&role.metadata, &binding.metadata] {
            assert_eq!(meta.name.as_deref(), Some("access-alice-web"));
            assert_eq!(meta.namespace.as_deref(), Some("shop"));
            assert_eq!(meta.labels.as_ref(), Some(&labels));
            assert_eq!(
                meta.annotations
                    .as_ref()
                    .and_then(|a| a.get(access_labels::EXPIRES_AT))
                    .map(String::as_str),
                Some("2026-01-01T11:00:00Z")
            );
            assert_eq!(meta.owner_references.as_deref(), Some(&[owner.clone()][..]));
        }
        let rules = role.rules.unwrap_or_default();
        let shape: Vec<_> = rules
            .iter()
            .map(|r| {
                (
                    r.resources.clone().unwrap_or_default().join(","),
                    r.verbs.join(","),
                    r.resource_names.clone().unwrap_or_default().join(","),
                )
            })
            .collect();
        assert_eq!(
            shape,
            [
                ("pods".into(), "get".into(), "web-1".into()),
                ("pods/exec".into(), "get,create".into(), "web-1".into()),
            ]
        );
        assert_eq!(binding.role_ref.kind, "Role");
        assert_eq!(binding.role_ref.name, "access-alice-web");
        let subjects = binding.subjects.unwrap_or_default();
        assert_eq!(subjects.len(), 1);
        assert_eq!(
            (subjects[0].kind.as_str(), subjects[0].name.as_str()),
            ("User", "alice")
        );
    }

    #[test]
    fn the_review_asks_for_exec_into_the_pod_as_the_requester() {
        let who = Requester {
            username: "alice".into(),
            uid: Some("u1".into()),
            groups: vec!["devs".into()],
        };
        let review = exec_review("shop", "web-1", &who);
        assert_eq!(review.spec.user.as_deref(), Some("alice"));
        assert_eq!(review.spec.uid.as_deref(), Some("u1"));
        assert_eq!(review.spec.groups, Some(vec!["devs".to_owned()]));
        let attrs = review.spec.resource_attributes.unwrap_or_default();
        assert_eq!(
            (
                attrs.namespace.as_deref(),
                attrs.verb.as_deref(),
                attrs.resource.as_deref(),
                attrs.subresource.as_deref(),
                attrs.name.as_deref(),
            ),
            (
                Some("shop"),
                Some("create"),
                Some("pods"),
                Some("exec"),
                Some("web-1")
            )
        );
    }

    #[test]
    fn the_token_secret_holds_only_the_hash_and_the_grants_times() {
        let secret = tunnel_token(&TunnelToken {
            name: "access-alice-tunnel",
            namespace: "spur-tokens",
            request: ("shop", "alice-tunnel"),
            workstation: "alice-laptop",
            token_sha256: "abc123",
            expires: "2026-01-01T11:00:00Z",
            issued: "2026-01-01T10:00:00Z",
        });
        assert_eq!(secret["metadata"]["namespace"], "spur-tokens");
        let labels = &secret["metadata"]["labels"];
        assert_eq!(labels[spur_api::tunnel::WORKSTATION_LABEL], "alice-laptop");
        assert_eq!(labels[cred::CREDENTIAL_LABEL], "token");
        assert_eq!(labels[access_labels::ACCESS_KIND], "tunnel");
        assert_eq!(labels[access_labels::ACCESS_REQUEST], "alice-tunnel");
        let annotations = &secret["metadata"]["annotations"];
        assert_eq!(
            annotations[cred::EXPIRES_ANNOTATION],
            "2026-01-01T11:00:00Z"
        );
        assert_eq!(annotations[cred::ISSUED_ANNOTATION], "2026-01-01T10:00:00Z");
        assert_eq!(annotations[cred::GRANT_NAMESPACE_ANNOTATION], "shop");
        assert_eq!(
            secret["stringData"],
            json!({cred::TOKEN_SHA256_KEY: "abc123"})
        );
    }

    #[test]
    fn a_revocation_names_the_workstation_and_the_instant() {
        let now: Timestamp = "2026-01-01T10:30:00Z".parse().unwrap();
        let r = revocation("spur-tokens", "alice-laptop", now);
        assert_eq!(
            r["metadata"]["name"],
            cred::revocation_secret_name("alice-laptop")
        );
        assert_eq!(
            r["metadata"]["labels"][cred::CREDENTIAL_LABEL],
            "revocation"
        );
        assert_eq!(
            r["metadata"]["annotations"][cred::REVOKED_BEFORE_ANNOTATION],
            "2026-01-01T10:30:00Z"
        );
    }

    fn target(kind: &str) -> TargetRef {
        serde_json::from_value(json!({"kind": kind, "name": "db"})).unwrap()
    }

    fn workload(data: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "db", "namespace": "shop"},
            "spec": data,
        }))
        .unwrap()
    }

    #[test]
    fn a_workloads_pod_template_is_the_source_with_its_claims() {
        let w = workload(json!({
            "template": {
                "metadata": {"annotations": {"kubectl.kubernetes.io/default-container": "pg"}},
                "spec": {"containers": [{"name": "pg"}]},
            },
            "volumeClaimTemplates": [{"metadata": {"name": "data"}}],
        }));
        let source = workload_pod(&target("StatefulSet"), &w).unwrap().unwrap();
        assert_eq!(source.claims, ["data"]);
        assert_eq!(source.spec.containers[0].name, "pg");
        assert!(source.meta.annotations.is_some());

        let no_template = workload(json!({"replicas": 1}));
        let e = workload_pod(&target("StatefulSet"), &no_template)
            .unwrap()
            .unwrap_err();
        assert_eq!(e, "StatefulSet/db has no spec.template");
        let unreadable = workload(json!({"template": {"spec": {"containers": "pg"}}}));
        let e = workload_pod(&target("StatefulSet"), &unreadable)
            .unwrap()
            .unwrap_err();
        assert_eq!(e, "StatefulSet/db has an unreadable pod template");
        let bad_meta = workload(json!({"template": {"metadata": {"labels": 3}, "spec": {}}}));
        assert!(workload_pod(&target("StatefulSet"), &bad_meta).is_err());
    }

    #[test]
    fn a_templates_own_pod_spec_is_the_source_without_a_target() {
        let source = template_pod(Some(&json!({"containers": [{"name": "tools"}]}))).unwrap();
        assert_eq!(source.spec.containers[0].name, "tools");
        assert!(source.claims.is_empty());
        assert_eq!(
            template_pod(None).unwrap_err(),
            "the template names neither targetRef nor podSpec"
        );
        let e = template_pod(Some(&json!({"containers": 1}))).unwrap_err();
        assert!(e.starts_with("the template's podSpec: "), "{e}");
    }

    fn spec() -> PodSpec {
        serde_json::from_value(json!({
            "hostname": "db-0",
            "containers": [
                {"name": "spur-proxy", "readinessProbe": {"tcpSocket": {"port": 1}}},
                {
                    "name": "pg",
                    "args": ["-c", "fsync=off"],
                    "env": [{"name": "MODE", "value": "serve"}],
                    "livenessProbe": {"tcpSocket": {"port": 5432}},
                    "readinessProbe": {"tcpSocket": {"port": 5432}},
                },
            ],
        }))
        .unwrap()
    }

    fn debug_pod(
        template: &ObjectMeta,
        mutation: Option<&PodMutation>,
        spec: PodSpec,
    ) -> Result<Pod, String> {
        let owner = owner();
        build_debug_pod(
            &DebugPod {
                name: "alice-web-debug",
                namespace: "shop",
                request: "alice-web",
                template,
                claims: &["data".to_owned()],
                mutation,
                left: Duration::from_secs(600),
                owner: &owner,
            },
            spec,
        )
    }

    #[test]
    fn the_debug_pod_is_nobodys_replica_and_ends_with_the_grant() {
        let template: ObjectMeta = serde_json::from_value(json!({
            "annotations": {"kubectl.kubernetes.io/default-container": "pg", "team": "db"},
        }))
        .unwrap();
        let pod = debug_pod(&template, None, spec()).unwrap();
        let meta = &pod.metadata;
        assert_eq!(
            meta.labels.as_ref(),
            Some(&grant_labels("pod", "alice-web"))
        );
        let annotations = meta.annotations.clone().unwrap_or_default();
        assert_eq!(
            annotations
                .get(DEFAULT_CONTAINER_ANNOTATION)
                .map(String::as_str),
            Some("pg")
        );
        assert_eq!(
            annotations
                .get(spur_api::keys::injection::INJECT)
                .map(String::as_str),
            Some("false")
        );
        assert!(!annotations.contains_key("team"), "{annotations:?}");
        let spec = pod.spec.unwrap_or_default();
        assert_eq!(spec.active_deadline_seconds, Some(600));
        assert_eq!(spec.hostname, None);
        assert!(
            spec.containers
                .iter()
                .all(|c| c.liveness_probe.is_none() && c.readiness_probe.is_none())
        );
        let volumes = spec.volumes.unwrap_or_default();
        assert_eq!(volumes.len(), 1);
        assert_eq!(volumes[0].name, "data");
        assert!(volumes[0].empty_dir.is_some());
    }

    #[test]
    fn the_mutation_reshapes_the_main_container_only() {
        let mutation: PodMutation = serde_json::from_value(json!({
            "defaultContainer": "pg",
            "command": ["sleep"],
            "env": [{"name": "MODE", "value": "debug"}],
            "keepReadinessProbe": true,
            "podLabels": {"debug": "yes"},
        }))
        .unwrap();
        let pod = debug_pod(&ObjectMeta::default(), Some(&mutation), spec()).unwrap();
        assert_eq!(
            pod.metadata
                .labels
                .unwrap_or_default()
                .get("debug")
                .map(String::as_str),
            Some("yes")
        );
        let made = pod.spec.unwrap_or_default();
        let (sidecar, pg) = (&made.containers[0], &made.containers[1]);
        assert_eq!(sidecar.command, None);
        assert!(sidecar.readiness_probe.is_some(), "kept");
        assert_eq!(pg.command, Some(vec!["sleep".to_owned()]));
        assert_eq!(
            pg.args, None,
            "the workload's arguments go with its command"
        );
        let env = pg.env.clone().unwrap_or_default();
        assert_eq!(env.len(), 1);
        assert_eq!(env[0].value.as_deref(), Some("debug"));
        assert!(pg.liveness_probe.is_none());

        let missing: PodMutation =
            serde_json::from_value(json!({"defaultContainer": "redis"})).unwrap();
        assert_eq!(
            debug_pod(&ObjectMeta::default(), Some(&missing), spec()).unwrap_err(),
            "the pod template has no container redis"
        );
        assert_eq!(
            debug_pod(&ObjectMeta::default(), None, PodSpec::default()).unwrap_err(),
            "the pod template has no container"
        );
    }
}
