//! Sandbox admission: workstations belong to their owner (docs/local.md, "Workstation owners").
//!
//! - `POST /mutate-spur-dev-v1alpha1-sandbox` stamps the creator: on create, the annotation
//!   `spur.dev/created-by` becomes the user the API server authenticated. SmartTests are stamped
//!   here too (webhook `smarttest-creator.spur.dev`): their automatic runs act with their
//!   creator's rights. A client-supplied
//!   different value is refused, and so is any change to it later; an update that drops it
//!   (a `kubectl replace` with an older manifest) gets it back.
//! - `POST /validate-spur-dev-v1alpha1-sandbox` refuses a Sandbox whose `spec.workstation` is
//!   not its creator's: the workstation's owner record ([`spur_api::workstation`]) must name the
//!   creator. Checked on create and whenever an update changes the workstation; other updates
//!   (the operator's finalizers, a Sandbox from before this check) pass, so nothing is stuck.
//!
//! Both run with `failurePolicy: Fail`: a Sandbox nobody checked could send its routing key to
//! another developer's laptop. The stamp is checked again by the validating webhook, which runs
//! after every mutation, so a later mutating webhook cannot change the workstation unseen.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Response, StatusCode};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use kube::{Api, Client};
use spur_api::smarttest::{CREATED_BY_GROUPS_ANNOTATION, CREATOR_GROUPS_MAX};
use spur_api::workstation::{CREATED_BY_ANNOTATION, USERNAME_MAX};

use super::{dynamic_request, reply, text};
use spur_operator_core::Metrics;

/// Sandboxes get their creator stamped here, as in the chart's MutatingWebhookConfiguration.
pub const MUTATE_SANDBOX_PATH: &str = "/mutate-spur-dev-v1alpha1-sandbox";
/// Sandboxes naming a workstation are checked against its owner here, as in the chart's
/// ValidatingWebhookConfiguration.
pub const VALIDATE_SANDBOX_PATH: &str = "/validate-spur-dev-v1alpha1-sandbox";
/// Reading the owner record; the API server waits at most the webhook's `timeoutSeconds`.
const API_TIMEOUT: Duration = Duration::from_secs(3);

fn annotation(o: Option<&DynamicObject>) -> Option<&str> {
    o?.metadata
        .annotations
        .as_ref()?
        .get(CREATED_BY_ANNOTATION)
        .map(String::as_str)
}

fn local(o: Option<&DynamicObject>) -> Option<&serde_json::Value> {
    o?.data.get("spec")?.get("local")
}

fn workstation(o: Option<&DynamicObject>) -> Option<&str> {
    o?.data.get("spec")?.get("workstation")?.as_str()
}

fn forbidden(response: AdmissionResponse, message: String) -> AdmissionResponse {
    let mut response = response.deny(message);
    response.result.code = StatusCode::FORBIDDEN.as_u16();
    response.result.reason = "Forbidden".into();
    response
}

/// The creator stamp.
pub(crate) fn review_stamp(body: &[u8], metrics: &Metrics) -> Response<Full<Bytes>> {
    let request = match dynamic_request(body) {
        Ok(r) => r,
        Err(e) => {
            metrics.sandbox_admission("invalid");
            return text(
                StatusCode::BAD_REQUEST,
                &format!("not an AdmissionReview with a request: {e}\n"),
            );
        }
    };
    let response = AdmissionResponse::from(&request);
    let kind = request.kind.kind.clone();
    match creator_patch(&request) {
        Ok(None) => {
            metrics.sandbox_admission("unchanged");
            reply(response)
        }
        Ok(Some(patch)) => match response.clone().with_patch(patch) {
            Ok(r) => {
                metrics.sandbox_admission("stamped");
                reply(r)
            }
            Err(e) => {
                metrics.sandbox_admission("error");
                reply(response.deny(format!("spur: cannot stamp the {kind}'s creator: {e}")))
            }
        },
        Err(message) => {
            metrics.sandbox_admission("denied");
            tracing::debug!(name = %request.name, %kind, %message, "creator stamp refused");
            reply(forbidden(response, message))
        }
    }
}

/// The annotations a kind's creator stamp holds, with the values a create gets: the user for
/// Sandboxes and SmartTests, and for SmartTests the user's groups too (a JSON list), which the
/// SubjectAccessReviews of their automatic runs need: most users' rights come through groups.
fn stamps(
    req: &AdmissionRequest<DynamicObject>,
    user: &str,
) -> Result<Vec<(&'static str, String)>, String> {
    let mut out = vec![(CREATED_BY_ANNOTATION, user.to_owned())];
    if req.kind.kind == "SmartTest" {
        let groups = serde_json::to_string(&req.user_info.groups.clone().unwrap_or_default())
            .map_err(|e| format!("cannot write the groups: {e}"))?;
        if groups.len() > CREATOR_GROUPS_MAX {
            return Err(format!(
                "the creator's groups take {} bytes as JSON, more than the {CREATOR_GROUPS_MAX} a SmartTest records",
                groups.len()
            ));
        }
        out.push((CREATED_BY_GROUPS_ANNOTATION, groups));
    }
    Ok(out)
}

/// The patch that sets (on create) or restores (on update) the creator annotations, `None` when
/// they are right already, or why the request is refused.
pub(crate) fn creator_patch(
    req: &AdmissionRequest<DynamicObject>,
) -> Result<Option<json_patch::Patch>, String> {
    // Sandboxes, and SmartTests (whose automatic runs need their creator's rights).
    let kind = req.kind.kind.as_str();
    let get = |o: Option<&DynamicObject>, key: &str| -> Option<String> {
        o?.metadata.annotations.as_ref()?.get(key).cloned()
    };
    let mut set: Vec<(&'static str, String)> = Vec::new();
    let user = || -> Result<&str, String> {
        let Some(user) = req.user_info.username.as_deref().filter(|u| !u.is_empty()) else {
            return Err(format!(
                "a {kind} needs an authenticated user as its creator"
            ));
        };
        if user.len() > USERNAME_MAX {
            return Err(format!(
                "user names above {USERNAME_MAX} bytes are not supported"
            ));
        }
        Ok(user)
    };
    // A SmartTest's runs act with the rights of whoever wrote what they run: a change of its
    // spec makes the user who changed it its creator (otherwise anyone who may edit the test
    // would run their steps with the rights of the user who created it).
    let rewritten = kind == "SmartTest"
        && req.operation == Operation::Update
        && req.object.as_ref().map(|o| &o.data["spec"])
            != req.old_object.as_ref().map(|o| &o.data["spec"]);
    match req.operation {
        Operation::Update if rewritten => {
            for (key, value) in stamps(req, user()?)? {
                let old = get(req.old_object.as_ref(), key);
                match get(req.object.as_ref(), key) {
                    Some(n) if n == value => {}
                    // Left as it was (what a client that read the object sends back): restamped.
                    Some(n) if Some(&n) == old.as_ref() => set.push((key, value)),
                    None => set.push((key, value)),
                    Some(_) => {
                        return Err(format!(
                            "the annotation {key} is set by Spur to the user changing the {kind}'s spec; leave it as it was"
                        ));
                    }
                }
            }
        }
        Operation::Create => {
            for (key, value) in stamps(req, user()?)? {
                match get(req.object.as_ref(), key) {
                    Some(n) if n == value => {}
                    Some(_) => {
                        return Err(format!(
                            "the annotation {key} is set by Spur to the user creating the {kind}; remove it from the manifest"
                        ));
                    }
                    None => set.push((key, value)),
                }
            }
        }
        Operation::Update => {
            let keys: &[&'static str] = if kind == "SmartTest" {
                &[CREATED_BY_ANNOTATION, CREATED_BY_GROUPS_ANNOTATION]
            } else {
                &[CREATED_BY_ANNOTATION]
            };
            for key in keys {
                match (
                    get(req.old_object.as_ref(), key),
                    get(req.object.as_ref(), key),
                ) {
                    (Some(o), Some(n)) if o == n => {}
                    (Some(_), Some(_)) => {
                        return Err(format!(
                            "the annotation {key} records who created the {kind} and cannot be changed"
                        ));
                    }
                    (Some(o), None) => set.push((key, o)),
                    (None, Some(_)) => {
                        return Err(format!(
                            "this {kind} was created without {key} and cannot be given one; create a new {kind} instead"
                        ));
                    }
                    (None, None) => {}
                }
            }
        }
        _ => {}
    }
    if set.is_empty() {
        return Ok(None);
    }
    let has_annotations = req
        .object
        .as_ref()
        .is_some_and(|o| o.metadata.annotations.is_some());
    let ops: Vec<serde_json::Value> = if has_annotations {
        set.iter()
            .map(|(key, value)| {
                serde_json::json!({
                    "op": "add",
                    "path": format!("/metadata/annotations/{}", key.replace('~', "~0").replace('/', "~1")),
                    "value": value,
                })
            })
            .collect()
    } else {
        let all: serde_json::Map<String, serde_json::Value> = set
            .iter()
            .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(v.clone())))
            .collect();
        vec![serde_json::json!({"op": "add", "path": "/metadata/annotations", "value": all})]
    };
    serde_json::from_value(serde_json::Value::Array(ops))
        .map(Some)
        .map_err(|e| format!("cannot build the patch: {e}"))
}

/// The workstation owner check.
pub(crate) async fn review_owner(
    body: &[u8],
    client: &Client,
    namespace: &str,
    metrics: &Metrics,
) -> Response<Full<Bytes>> {
    let request = match dynamic_request(body) {
        Ok(r) => r,
        Err(e) => {
            metrics.sandbox_admission("invalid");
            return text(
                StatusCode::BAD_REQUEST,
                &format!("not an AdmissionReview with a request: {e}\n"),
            );
        }
    };
    let response = AdmissionResponse::from(&request);
    let (workstation, creator) = match to_check(&request) {
        Ok(None) => {
            metrics.sandbox_admission("allowed");
            return reply(response);
        }
        Ok(Some(c)) => c,
        Err(message) => {
            metrics.sandbox_admission("denied");
            return reply(forbidden(response, message));
        }
    };
    let records: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let owner = match tokio::time::timeout(
        API_TIMEOUT,
        spur_operator_core::workstation_owner::owner(&records, &workstation),
    )
    .await
    {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => return internal(response, metrics, &request, &e.to_string()),
        Err(_) => return internal(response, metrics, &request, "timed out"),
    };
    match spur_api::workstation::may_use(&workstation, owner.as_ref(), &creator) {
        Ok(()) => {
            metrics.sandbox_admission("allowed");
            reply(response)
        }
        Err(message) => {
            metrics.sandbox_admission("denied");
            tracing::info!(sandbox = %request.name, %workstation, %creator, "Sandbox refused: the workstation is not its creator's");
            reply(forbidden(response, message))
        }
    }
}

fn internal(
    response: AdmissionResponse,
    metrics: &Metrics,
    request: &AdmissionRequest<DynamicObject>,
    error: &str,
) -> Response<Full<Bytes>> {
    metrics.sandbox_admission("error");
    tracing::warn!(sandbox = %request.name, %error, "cannot read a workstation's owner record");
    let mut response = response.deny(format!(
        "spur: the workstation's owner could not be checked ({error}); retry"
    ));
    response.result.code = StatusCode::INTERNAL_SERVER_ERROR.as_u16();
    response.result.reason = "InternalError".into();
    reply(response)
}

/// The workstation and the creator to check it against, `None` when there is nothing to check,
/// or why the request is refused without looking.
pub(crate) fn to_check(
    req: &AdmissionRequest<DynamicObject>,
) -> Result<Option<(String, String)>, String> {
    if !matches!(req.operation, Operation::Create | Operation::Update) {
        return Ok(None);
    }
    let Some(ws) = workstation(req.object.as_ref()) else {
        return Ok(None);
    };
    let creator = annotation(req.object.as_ref());
    if req.operation == Operation::Update {
        // The workstation and the local workloads decide what the creator's laptop connects
        // to: nobody else may change them, whatever rights they hold on Sandboxes (cluster-
        // scoped, so update rights are often cluster-wide).
        let remapped = workstation(req.old_object.as_ref()) != Some(ws)
            || local(req.old_object.as_ref()) != local(req.object.as_ref());
        if remapped && creator.is_some() && req.user_info.username.as_deref() != creator {
            return Err(
                "only the Sandbox's creator may change its workstation or its local workloads (they decide what the creator's laptop connects to); ask them, or create a Sandbox of your own".to_string(),
            );
        }
        if !remapped && annotation(req.old_object.as_ref()) == creator {
            return Ok(None);
        }
    }
    let Some(creator) = creator else {
        return Err(format!(
            "the Sandbox has no {CREATED_BY_ANNOTATION}, so it cannot name a workstation: create a new Sandbox (the webhook sandbox-creator.spur.dev records its creator)"
        ));
    };
    // On create the stamp must be the requester's: the mutating webhook set it, and nothing
    // after it may put another user there.
    if req.operation == Operation::Create && req.user_info.username.as_deref() != Some(creator) {
        return Err(format!(
            "{CREATED_BY_ANNOTATION} must be the user creating the Sandbox"
        ));
    }
    Ok(Some((ws.to_string(), creator.to_string())))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kube::core::admission::AdmissionReview;
    use serde_json::{Value, json};

    fn sandbox(workstation: Option<&str>, created_by: Option<&str>) -> Value {
        let mut o = json!({"apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "sb"},
            "spec": {"local": [{"name": "api", "from": {"kind": "Deployment", "namespace": "b", "name": "api"},
                                "mappings": [{"port": 8080, "toLocal": "localhost:8080"}]}]}});
        if let Some(w) = workstation {
            o["spec"]["workstation"] = w.into();
        }
        if let Some(c) = created_by {
            o["metadata"]["annotations"] = json!({CREATED_BY_ANNOTATION: c});
        }
        o
    }

    fn request(
        operation: &str,
        user: &str,
        object: Value,
        old: Option<Value>,
    ) -> AdmissionRequest<DynamicObject> {
        let review: AdmissionReview<DynamicObject> = serde_json::from_value(json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u", "operation": operation, "name": "sb",
                "kind": {"group": "spur.dev", "version": "v1alpha1", "kind": "Sandbox"},
                "resource": {"group": "spur.dev", "version": "v1alpha1", "resource": "sandboxes"},
                "userInfo": {"username": user}, "object": object, "oldObject": old,
            }
        }))
        .unwrap();
        review.try_into().unwrap()
    }

    fn patched(req: &AdmissionRequest<DynamicObject>) -> Value {
        let mut doc = serde_json::to_value(req.object.as_ref().unwrap()).unwrap();
        json_patch::patch(&mut doc, &creator_patch(req).unwrap().unwrap()).unwrap();
        doc
    }

    #[test]
    fn the_creator_is_stamped_and_cannot_be_forged_or_changed() {
        // Create: stamped from the user info, with or without other annotations.
        let doc = patched(&request("CREATE", "bob", sandbox(Some("w"), None), None));
        assert_eq!(doc["metadata"]["annotations"][CREATED_BY_ANNOTATION], "bob");
        let mut with_other = sandbox(Some("w"), None);
        with_other["metadata"]["annotations"] = json!({"team": "b"});
        let doc = patched(&request("CREATE", "bob", with_other, None));
        assert_eq!(doc["metadata"]["annotations"][CREATED_BY_ANNOTATION], "bob");
        assert_eq!(doc["metadata"]["annotations"]["team"], "b");
        // Bob writing alice's name is refused; his own is left alone.
        let forged = request("CREATE", "bob", sandbox(Some("w"), Some("alice")), None);
        assert!(creator_patch(&forged).unwrap_err().contains("set by Spur"));
        let own = request("CREATE", "bob", sandbox(Some("w"), Some("bob")), None);
        assert_eq!(creator_patch(&own), Ok(None));
        assert!(creator_patch(&request("CREATE", "", sandbox(None, None), None)).is_err());
        // Update: a change is refused, a drop restored, a late addition refused.
        let old = Some(sandbox(Some("w"), Some("alice")));
        let changed = request(
            "UPDATE",
            "alice",
            sandbox(Some("w"), Some("bob")),
            old.clone(),
        );
        assert!(
            creator_patch(&changed)
                .unwrap_err()
                .contains("cannot be changed")
        );
        let dropped = request("UPDATE", "carol", sandbox(Some("w"), None), old.clone());
        assert_eq!(
            patched(&dropped)["metadata"]["annotations"][CREATED_BY_ANNOTATION],
            "alice"
        );
        let late = request(
            "UPDATE",
            "bob",
            sandbox(Some("w"), Some("bob")),
            Some(sandbox(Some("w"), None)),
        );
        assert!(creator_patch(&late).is_err());
        let legacy = request(
            "UPDATE",
            "op",
            sandbox(None, None),
            Some(sandbox(None, None)),
        );
        assert_eq!(creator_patch(&legacy), Ok(None));
    }

    fn smart_test_request(
        operation: &str,
        annotations: Value,
        old: Option<Value>,
    ) -> AdmissionRequest<DynamicObject> {
        let object = json!({"apiVersion": "spur.dev/v1alpha1", "kind": "SmartTest",
            "metadata": {"name": "t", "namespace": "shop", "annotations": annotations},
            "spec": {"steps": []}});
        let old = old.map(|a| {
            let mut o = object.clone();
            o["metadata"]["annotations"] = a;
            o
        });
        let review: AdmissionReview<DynamicObject> = serde_json::from_value(json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u", "operation": operation, "name": "t", "namespace": "shop",
                "kind": {"group": "spur.dev", "version": "v1alpha1", "kind": "SmartTest"},
                "resource": {"group": "spur.dev", "version": "v1alpha1", "resource": "smarttests"},
                "userInfo": {"username": "ann", "groups": ["shop-devs", "system:authenticated"]},
                "object": object, "oldObject": old,
            }
        }))
        .unwrap();
        review.try_into().unwrap()
    }

    #[test]
    fn a_smart_tests_creator_is_stamped_with_its_groups() {
        let doc = patched(&smart_test_request("CREATE", json!({"team": "shop"}), None));
        let a = &doc["metadata"]["annotations"];
        assert_eq!(a[CREATED_BY_ANNOTATION], "ann");
        assert_eq!(
            a[CREATED_BY_GROUPS_ANNOTATION],
            r#"["shop-devs","system:authenticated"]"#
        );
        assert_eq!(a["team"], "shop");
        // Groups written by the client: refused, as a user is.
        let forged = smart_test_request(
            "CREATE",
            json!({CREATED_BY_GROUPS_ANNOTATION: r#"["system:masters"]"#}),
            None,
        );
        let err = creator_patch(&forged).unwrap_err();
        assert!(
            err.contains(CREATED_BY_GROUPS_ANNOTATION) && err.contains("set by Spur"),
            "{err}"
        );
        // Changed later: refused; dropped: restored.
        let stamped = json!({CREATED_BY_ANNOTATION: "ann",
                             CREATED_BY_GROUPS_ANNOTATION: r#"["shop-devs"]"#});
        let changed = smart_test_request(
            "UPDATE",
            json!({CREATED_BY_ANNOTATION: "ann",
                   CREATED_BY_GROUPS_ANNOTATION: r#"["system:masters"]"#}),
            Some(stamped.clone()),
        );
        assert!(
            creator_patch(&changed)
                .unwrap_err()
                .contains("cannot be changed")
        );
        let dropped = smart_test_request(
            "UPDATE",
            json!({CREATED_BY_ANNOTATION: "ann"}),
            Some(stamped.clone()),
        );
        assert_eq!(
            patched(&dropped)["metadata"]["annotations"][CREATED_BY_GROUPS_ANNOTATION],
            r#"["shop-devs"]"#
        );
        let same = smart_test_request("UPDATE", stamped.clone(), Some(stamped));
        assert_eq!(creator_patch(&same), Ok(None));
    }

    #[test]
    fn whoever_changes_a_smart_tests_spec_becomes_its_creator() {
        let stamped = json!({CREATED_BY_ANNOTATION: "ann",
                             CREATED_BY_GROUPS_ANNOTATION: r#"["shop-devs"]"#});
        let by_mallory = |annotations: Value| {
            let mut req = smart_test_request("UPDATE", annotations, Some(stamped.clone()));
            req.object.as_mut().unwrap().data["spec"] = json!({"steps": [{"name": "exfiltrate"}]});
            req.user_info.username = Some("mallory".into());
            req.user_info.groups = Some(vec!["devs".into()]);
            req
        };
        // The annotations sent back as they were: the runs now act with mallory's rights.
        let a = patched(&by_mallory(stamped.clone()))["metadata"]["annotations"].clone();
        assert_eq!(a[CREATED_BY_ANNOTATION], "mallory");
        assert_eq!(a[CREATED_BY_GROUPS_ANNOTATION], r#"["devs"]"#);
        // Dropped: stamped as well.
        let a = patched(&by_mallory(json!({})))["metadata"]["annotations"].clone();
        assert_eq!(a[CREATED_BY_ANNOTATION], "mallory");
        // Naming a third user: refused.
        let err = creator_patch(&by_mallory(json!({CREATED_BY_ANNOTATION: "root",
                                                 CREATED_BY_GROUPS_ANNOTATION: r#"["shop-devs"]"#})))
        .unwrap_err();
        assert!(err.contains("changing the SmartTest's spec"), "{err}");
        // Ann changing her own test's spec: stamped with her groups of now.
        let mut own = by_mallory(stamped.clone());
        own.user_info.username = Some("ann".into());
        let a = patched(&own)["metadata"]["annotations"].clone();
        assert_eq!(
            (
                a[CREATED_BY_ANNOTATION].as_str(),
                a[CREATED_BY_GROUPS_ANNOTATION].as_str()
            ),
            (Some("ann"), Some(r#"["devs"]"#))
        );
    }

    #[test]
    fn the_workstation_is_checked_against_the_creator() {
        // Create: the stamped creator, who must be the requester.
        let create = request(
            "CREATE",
            "bob",
            sandbox(Some("alice-laptop"), Some("bob")),
            None,
        );
        assert_eq!(
            to_check(&create),
            Ok(Some(("alice-laptop".into(), "bob".into())))
        );
        let unstamped = request("CREATE", "bob", sandbox(Some("w"), None), None);
        assert!(to_check(&unstamped).is_err());
        let other = request("CREATE", "bob", sandbox(Some("w"), Some("alice")), None);
        assert!(to_check(&other).is_err());
        // No workstation: nothing to check.
        assert_eq!(
            to_check(&request("CREATE", "bob", sandbox(None, Some("bob")), None)),
            Ok(None)
        );
        // Update: the operator's metadata changes pass; only the creator may move a Sandbox to
        // another workstation (which must be theirs).
        let old = sandbox(Some("w"), Some("alice"));
        let same = request("UPDATE", "spur-operator", old.clone(), Some(old.clone()));
        assert_eq!(to_check(&same), Ok(None));
        let legacy = sandbox(Some("w"), None);
        let legacy_update = request("UPDATE", "spur-operator", legacy.clone(), Some(legacy));
        assert_eq!(to_check(&legacy_update), Ok(None));
        let moved_by_other = request(
            "UPDATE",
            "carol",
            sandbox(Some("carol-laptop"), Some("alice")),
            Some(old.clone()),
        );
        let refused = to_check(&moved_by_other).unwrap_err();
        assert!(refused.contains("only the Sandbox's creator"), "{refused}");
        let moved = request(
            "UPDATE",
            "alice",
            sandbox(Some("alice-2"), Some("alice")),
            Some(old),
        );
        assert_eq!(
            to_check(&moved),
            Ok(Some(("alice-2".into(), "alice".into())))
        );
        let legacy_moved = request(
            "UPDATE",
            "bob",
            sandbox(Some("v"), None),
            Some(sandbox(Some("w"), None)),
        );
        assert!(to_check(&legacy_moved).is_err());
    }
}
