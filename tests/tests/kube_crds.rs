//! The chart's CRD hook (`spur-operator apply-crds`, charts/spur/templates/crds.yaml; issue 47,
//! point 3) against a real kube-apiserver, under exactly the rights the chart gives it
//! (charts/spur/files/crds-rules.yaml). On CRDs helm created (a plain create, one of them with a
//! field this release removed, one of this release's CRDs missing) it creates the missing one and
//! takes the others over, so the removed field goes; again, it leaves them unchanged; a CRD
//! someone changed by hand it puts back. A release that moves a CRD's storage from `v1alpha1` to
//! `v1beta1` (a version new in it, and one the release before already served) has its objects
//! migrated: each one (cluster-scoped and namespaced, more than a page of them) is stored in
//! `v1beta1` afterwards, as read back from etcd itself, and `status.storedVersions` names
//! `v1beta1` alone, which is what lets the next release drop `v1alpha1` (the API server accepts
//! that CRD). A CRD that drops a version objects are still stored in is refused before anything
//! changed. The hook's rights reach no CRD but Spur's and no other group's objects.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use base64::Engine as _;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use serde_json::{Value, json};
use spur_e2e::kube as kt;
use spur_kube_harness::KubeApi;

const HOOK: &str = "spur-apply-crds";

/// Runs the hook's apply as `client`; its lines.
async fn apply(
    client: &kube::Client,
    crds: &[CustomResourceDefinition],
) -> Result<Vec<String>, spur_operator::Error> {
    let mut lines = Vec::new();
    spur_operator::crds::apply(client, crds, |l| lines.push(l)).await?;
    Ok(lines)
}

/// Where a later release has a CRD's `v1beta1` (the same schema as `v1alpha1`).
#[derive(Clone, Copy)]
enum Beta {
    /// Served beside `v1alpha1`, which stays the storage version.
    Served,
    /// Served and stored, `v1alpha1` still served.
    Stored,
    /// The only version.
    Only,
}

/// Spur's CRDs as a later release has them: each of `changes` with its `v1beta1`.
fn release(changes: &[(&str, Beta)]) -> Vec<CustomResourceDefinition> {
    let mut crds = spur_api::crdgen::crds();
    for (name, beta) in changes {
        let crd = crds
            .iter_mut()
            .find(|c| c.metadata.name.as_deref() == Some(*name))
            .unwrap();
        let mut version = crd.spec.versions[0].clone();
        assert_eq!(version.name, "v1alpha1");
        version.name = "v1beta1".into();
        match beta {
            Beta::Served => {
                version.storage = false;
                crd.spec.versions.push(version);
            }
            Beta::Stored => {
                crd.spec.versions[0].storage = false;
                crd.spec.versions.push(version);
            }
            Beta::Only => crd.spec.versions = vec![version],
        }
    }
    crds
}

fn named<'a>(crds: &'a [CustomResourceDefinition], name: &str) -> &'a CustomResourceDefinition {
    crds.iter()
        .find(|c| c.metadata.name.as_deref() == Some(name))
        .unwrap()
}

fn resource(plural: &str, kind: &str, version: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("spur.dev", version, kind), plural)
}

/// The `apiVersion` etcd holds for `key` (`/registry/spur.dev/<plural>/[<ns>/]<name>`), through
/// etcd's own JSON gateway: what the API server stored, not what it serves.
fn stored_api_version(etcd: &str, key: &str) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "--fail",
            "-X",
            "POST",
            &format!("{etcd}/v3/kv/range"),
        ])
        .args(["-d", &json!({ "key": b64.encode(key) }).to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    let value = answer["kvs"][0]["value"]
        .as_str()
        .unwrap_or_else(|| panic!("{key} is not in etcd: {answer}"));
    let object: Value = serde_json::from_slice(&b64.decode(value).unwrap()).unwrap();
    object["apiVersion"].as_str().unwrap().to_owned()
}

/// Someone else (another field manager) gives the Sandbox CRD a short name of their own.
async fn change_by_hand(crds: &Api<CustomResourceDefinition>) {
    crds.patch(
        "sandboxes.spur.dev",
        &PatchParams::apply("someone").force(),
        &Patch::Apply(json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "sandboxes.spur.dev"},
            "spec": {"names": {"shortNames": ["sbx-by-hand"]}},
        })),
    )
    .await
    .unwrap();
}

fn stored_versions(crd: &CustomResourceDefinition) -> Vec<String> {
    crd.status
        .as_ref()
        .and_then(|s| s.stored_versions.clone())
        .unwrap_or_default()
}

#[tokio::test]
async fn the_crd_hook_applies_migrates_and_refuses() {
    let api = KubeApi::start().await.unwrap();
    let admin = api.client();
    let hook = kt::chart_client(&api, HOOK, "crds-rules.yaml", None)
        .await
        .unwrap();
    let crd_api: Api<CustomResourceDefinition> = Api::all(admin.clone());
    let ours = spur_api::crdgen::crds();

    // --- as helm installs them (a plain create), one with a field this release no longer has,
    // and one missing (new in this release) ----------------------------------------------------
    const NEW: &str = "tunnelaccessrequests.spur.dev";
    for crd in &ours {
        let mut crd = crd.clone();
        match crd.metadata.name.as_deref() {
            Some(NEW) => continue,
            Some("sandboxes.spur.dev") => {
                let schema = crd.spec.versions[0].schema.as_mut().unwrap();
                let spec = schema
                    .open_api_v3_schema
                    .as_mut()
                    .unwrap()
                    .properties
                    .as_mut()
                    .unwrap()
                    .get_mut("spec")
                    .unwrap();
                spec.properties.as_mut().unwrap().insert(
                    "legacy".into(),
                    serde_json::from_value(json!({"type": "string"})).unwrap(),
                );
            }
            _ => {}
        }
        let pp = PostParams {
            field_manager: Some("helm".into()),
            ..PostParams::default()
        };
        crd_api.create(&pp, &crd).await.unwrap();
    }
    let lines = apply(&hook, &ours).await.unwrap();
    assert_eq!(lines.len(), ours.len(), "{lines:#?}");
    for line in &lines {
        let want = if line.starts_with(&format!("CRD {NEW}:")) {
            "created"
        } else {
            "updated"
        };
        assert!(line.ends_with(&format!(": {want}")), "{lines:#?}");
    }
    // The hook owns every CRD now, and the field helm alone held is gone.
    for crd in crd_api.list(&ListParams::default()).await.unwrap() {
        let name = crd.metadata.name.clone().unwrap();
        let managers: Vec<String> = crd
            .metadata
            .managed_fields
            .unwrap_or_default()
            .into_iter()
            .filter(|m| m.subresource.as_deref().unwrap_or_default().is_empty())
            .filter_map(|m| m.manager)
            .collect();
        assert_eq!(managers, [HOOK], "{name}");
    }
    let sandboxes = crd_api.get("sandboxes.spur.dev").await.unwrap();
    let spec_schema = serde_json::to_value(&sandboxes.spec.versions[0].schema).unwrap();
    assert!(
        spec_schema["openAPIV3Schema"]["properties"]["spec"]["properties"]
            .get("legacy")
            .is_none(),
        "a field the release removed is still there"
    );

    // --- again: nothing to do ------------------------------------------------------------------
    let lines = apply(&hook, &ours).await.unwrap();
    assert!(
        lines.iter().all(|l| l.ends_with(": unchanged")),
        "{lines:#?}"
    );

    // --- a CRD changed by hand (another field manager) is put back ------------------------------
    change_by_hand(&crd_api).await;
    let lines = apply(&hook, &ours).await.unwrap();
    assert!(
        lines.contains(&"CRD sandboxes.spur.dev: updated".to_owned()),
        "{lines:#?}"
    );
    let live = crd_api.get("sandboxes.spur.dev").await.unwrap();
    let expected = named(&ours, "sandboxes.spur.dev");
    assert_eq!(
        live.spec.names.short_names, expected.spec.names.short_names,
        "the hand-made short name was not put back"
    );

    // --- a release that serves v1beta1 beside v1alpha1 (which stays the storage) ------------
    let served = release(&[("jobrunnergroups.spur.dev", Beta::Served)]);
    let lines = apply(&hook, &served).await.unwrap();
    assert!(
        lines.contains(&"CRD jobrunnergroups.spur.dev: updated".to_owned())
            && !lines.iter().any(|l| l.contains("migrated")),
        "{lines:#?}"
    );

    // --- objects stored in v1alpha1: more than a page of cluster-scoped ones, and namespaced ---
    let routing_v1 = resource("routingconfigs", "RoutingConfig", "v1alpha1");
    let routing: Api<DynamicObject> = Api::all_with(admin.clone(), &routing_v1);
    const CLUSTER_OBJECTS: usize = 260;
    for i in 0..CLUSTER_OBJECTS {
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "RoutingConfig",
            "metadata": {"name": format!("key-{i}")},
            "spec": {"routingKey": format!("key{i}")},
        }))
        .unwrap();
        routing
            .create(&PostParams::default(), &object)
            .await
            .unwrap();
    }
    let groups_v1 = resource("jobrunnergroups", "JobRunnerGroup", "v1alpha1");
    let mut namespaced = Vec::new();
    for ns in ["team-a", "team-b"] {
        kt::ensure_namespace(&admin, ns).await.unwrap();
        let groups: Api<DynamicObject> = Api::namespaced_with(admin.clone(), ns, &groups_v1);
        for name in ["builders", "testers"] {
            let object: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "JobRunnerGroup",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"image": "debian:bookworm"},
            }))
            .unwrap();
            groups
                .create(&PostParams::default(), &object)
                .await
                .unwrap();
            namespaced.push(format!("/registry/spur.dev/jobrunnergroups/{ns}/{name}"));
        }
    }
    let etcd = api.etcd_url();
    assert_eq!(
        stored_api_version(etcd, "/registry/spur.dev/routingconfigs/key-0"),
        "spur.dev/v1alpha1"
    );

    // --- a release that stores v1beta1 (serving both): every object migrated -------------------
    // The next release stores v1beta1: for routingconfigs a version new in it, for
    // jobrunnergroups one the API server already served (where only discovery's storage hash
    // says when the API server switched).
    let next = release(&[
        ("routingconfigs.spur.dev", Beta::Stored),
        ("jobrunnergroups.spur.dev", Beta::Stored),
    ]);
    let lines = apply(&hook, &next).await.unwrap();
    for line in [
        "CRD routingconfigs.spur.dev: updated".to_owned(),
        format!(
            "CRD routingconfigs.spur.dev: stored versions v1alpha1, v1beta1 migrated to v1beta1 \
             ({CLUSTER_OBJECTS} objects rewritten)"
        ),
        "CRD jobrunnergroups.spur.dev: updated".to_owned(),
        "CRD jobrunnergroups.spur.dev: stored versions v1alpha1, v1beta1 migrated to v1beta1 \
         (4 objects rewritten)"
            .to_owned(),
    ] {
        assert!(lines.contains(&line), "{line} not in {lines:#?}");
    }
    for i in [0, 1, CLUSTER_OBJECTS / 2, CLUSTER_OBJECTS - 1] {
        assert_eq!(
            stored_api_version(etcd, &format!("/registry/spur.dev/routingconfigs/key-{i}")),
            "spur.dev/v1beta1"
        );
    }
    for key in &namespaced {
        assert_eq!(stored_api_version(etcd, key), "spur.dev/v1beta1", "{key}");
    }
    for name in ["routingconfigs.spur.dev", "jobrunnergroups.spur.dev"] {
        let crd = crd_api.get(name).await.unwrap();
        assert_eq!(stored_versions(&crd), ["v1beta1"], "{name}");
    }
    // Another apply has nothing left to migrate.
    let lines = apply(&hook, &next).await.unwrap();
    assert!(
        lines.iter().all(|l| l.ends_with(": unchanged")),
        "{lines:#?}"
    );

    // --- the release after may drop v1alpha1: the API server accepts it -------------------------
    let last = release(&[
        ("routingconfigs.spur.dev", Beta::Only),
        ("jobrunnergroups.spur.dev", Beta::Stored),
    ]);
    let lines = apply(&hook, &last).await.unwrap();
    assert!(
        lines.contains(&"CRD routingconfigs.spur.dev: updated".to_owned()),
        "{lines:#?}"
    );
    let served: Api<DynamicObject> = Api::all_with(
        admin.clone(),
        &resource("routingconfigs", "RoutingConfig", "v1beta1"),
    );
    let all = served.list(&ListParams::default()).await.unwrap();
    assert_eq!(all.items.len(), CLUSTER_OBJECTS);
    let key = served.get("key-7").await.unwrap();
    assert_eq!(key.data["spec"]["routingKey"], "key7");

    // --- dropping a version objects are still stored in: refused, nothing changed ---------------
    // RouteGroups stored in both versions (the admin applied the two-version CRD by hand, after
    // an object was written in v1alpha1), then a release without v1alpha1.
    let both = named(
        &release(&[("routegroups.spur.dev", Beta::Stored)]),
        "routegroups.spur.dev",
    )
    .clone();
    let group: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "RouteGroup",
        "metadata": {"name": "team"},
        "spec": {"match": {"label": {"key": "team", "value": "*"}}},
    }))
    .unwrap();
    Api::<DynamicObject>::all_with(
        admin.clone(),
        &resource("routegroups", "RouteGroup", "v1alpha1"),
    )
    .create(&PostParams::default(), &group)
    .await
    .unwrap();
    crd_api
        .patch(
            "routegroups.spur.dev",
            &PatchParams::apply("someone").force(),
            &Patch::Apply(&both),
        )
        .await
        .unwrap();
    let stored_both = kt::eventually("routegroups stored in both versions", || async {
        let crd = crd_api.get("routegroups.spur.dev").await.ok()?;
        let v = stored_versions(&crd);
        (v.len() == 2).then_some(v)
    })
    .await;
    assert_eq!(stored_both, ["v1alpha1", "v1beta1"]);
    // The hand-changed sandboxes CRD comes first in the list: a refusal must leave it too.
    change_by_hand(&crd_api).await;
    let drops = release(&[
        ("routingconfigs.spur.dev", Beta::Only),
        ("jobrunnergroups.spur.dev", Beta::Stored),
        ("routegroups.spur.dev", Beta::Only),
    ]);
    let err = apply(&hook, &drops).await.unwrap_err().to_string();
    assert!(
        err.contains("CRD routegroups.spur.dev: this release no longer serves v1alpha1")
            && err.contains("Nothing was changed"),
        "{err}"
    );
    let sandboxes = crd_api.get("sandboxes.spur.dev").await.unwrap();
    assert!(
        sandboxes
            .spec
            .names
            .short_names
            .unwrap_or_default()
            .contains(&"sbx-by-hand".to_owned()),
        "the refused apply changed the CRD before it"
    );
    let groups_crd = crd_api.get("routegroups.spur.dev").await.unwrap();
    assert_eq!(groups_crd.spec.versions.len(), 2);

    // --- the hook's rights: Spur's CRDs and objects only -------------------------------------
    let foreign: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com", "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [{"name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object",
                    "x-kubernetes-preserve-unknown-fields": true}}}],
        },
    }))
    .unwrap();
    crd_api
        .create(&PostParams::default(), &foreign)
        .await
        .unwrap();
    let hook_crds: Api<CustomResourceDefinition> = Api::all(hook.clone());
    let forbidden = |what: &str, r: Result<String, kube::Error>| match r {
        Err(kube::Error::Api(e)) if e.code == 403 => {}
        other => panic!("the hook could {what}: {other:?}"),
    };
    forbidden(
        "change another group's CRD",
        hook_crds
            .patch(
                "widgets.example.com",
                &PatchParams::apply(HOOK).force(),
                &Patch::Apply(&foreign),
            )
            .await
            .map(|_| String::new()),
    );
    let mut other = foreign.clone();
    other.metadata.name = Some("gadgets.example.com".into());
    other.spec.names.plural = "gadgets".into();
    other.spec.names.singular = Some("gadget".into());
    other.spec.names.kind = "Gadget".into();
    forbidden(
        "create another group's CRD",
        hook_crds
            .create(&PostParams::default(), &other)
            .await
            .map(|_| String::new()),
    );
    forbidden(
        "delete a CRD",
        hook_crds
            .delete("sandboxes.spur.dev", &DeleteParams::default())
            .await
            .map(|_| String::new()),
    );
    forbidden(
        "list CRDs",
        hook_crds
            .list(&ListParams::default())
            .await
            .map(|_| String::new()),
    );
    forbidden(
        "read Secrets",
        Api::<Secret>::namespaced(hook.clone(), "team-a")
            .list(&ListParams::default())
            .await
            .map(|_| String::new()),
    );
    let widgets: Api<DynamicObject> = Api::namespaced_with(
        hook.clone(),
        "team-a",
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("example.com", "v1", "Widget"),
            "widgets",
        ),
    );
    forbidden(
        "read another group's objects",
        widgets
            .list(&ListParams::default())
            .await
            .map(|_| String::new()),
    );
    forbidden(
        "delete Spur's objects",
        Api::<DynamicObject>::namespaced_with(hook.clone(), "team-b", &groups_v1)
            .delete("builders", &DeleteParams::default())
            .await
            .map(|_| String::new()),
    );
}

/// The hook's rules name exactly the CRDs the binary applies (a release that adds a CRD must add
/// it there, or its upgrade fails on that CRD).
#[test]
fn the_hook_rules_name_every_crd() {
    let rules = kt::chart_rules("crds-rules.yaml").unwrap();
    let list = |rule: &Value, key: &str| -> BTreeSet<String> {
        rule[key]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_str().unwrap().to_owned()).collect())
            .unwrap_or_default()
    };
    let crds = spur_api::crdgen::crds();
    let names: BTreeSet<String> = crds
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();
    let plurals: BTreeSet<String> = crds.iter().map(|c| c.spec.names.plural.clone()).collect();
    let rules = rules.as_array().unwrap();
    let mut named_rules = 0;
    for rule in rules {
        let resources = list(rule, "resources");
        if list(rule, "apiGroups").contains("spur.dev") {
            assert_eq!(resources, plurals, "the rule on Spur's objects");
            assert_eq!(
                list(rule, "verbs"),
                ["get", "list", "update"].map(String::from).into()
            );
        } else if rule.get("resourceNames").is_some() {
            assert_eq!(list(rule, "resourceNames"), names, "{rule}");
            named_rules += 1;
        } else {
            assert_eq!(
                list(rule, "verbs"),
                BTreeSet::from(["create".to_owned()]),
                "{rule}"
            );
        }
    }
    assert_eq!(named_rules, 2, "the CRDs' rule and their status' rule");
}
