//! Templates may require a second user's approval (issue 42, point 8): a request waits in
//! PendingApproval until a user who is not the requester and holds the verb `approve` on its
//! kind approves it. The chart's policy spur-access-requests decides who may record an
//! approval; the operator grants only once one is recorded.

use super::*;
use spur_api::access::Approver;

/// Records an approval of `request` as `user` writes it: the annotations `spur access approve`
/// writes, naming `username` and `groups`.
async fn approve(
    user: &Client,
    request: &str,
    username: &str,
    groups: &[&str],
) -> Result<ExecAccessRequest, String> {
    let approval = Approver {
        username: username.into(),
        groups: groups.iter().map(|g| (*g).to_owned()).collect(),
    };
    Api::<ExecAccessRequest>::namespaced(user.clone(), NS)
        .patch(
            request,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": approval.annotations()}})),
        )
        .await
        .map_err(|e| e.to_string())
}

/// A Role in [`NS`] with `rules`, bound to ServiceAccounts `(namespace, name)`.
async fn bind(admin: &Client, name: &str, rules: Value, who: &[(&str, &str)]) {
    let role: Role = serde_json::from_value(
        json!({"metadata": {"name": name, "namespace": NS}, "rules": rules}),
    )
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let subjects: Vec<Value> = who
        .iter()
        .map(|(ns, n)| json!({"kind": "ServiceAccount", "name": n, "namespace": ns}))
        .collect();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": subjects,
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn templates_may_require_a_second_users_approval() {
    let setup = Setup::start().await;
    let admin = setup.api.client();
    workload(&admin, "web").await;
    const OTHERS_GROUP: &str = "system:serviceaccounts:others";
    let mut template = exec_template("web-approved", "web", "1h");
    template.spec.access_config.approval = Some(spur_api::access::Approval {
        required: true,
        approvers: vec![OTHERS_GROUP.into()],
    });
    Api::<ExecAccessTemplate>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &template)
        .await
        .unwrap();
    // The chart's approver rules for alice (the requester herself) and carol; bob may patch
    // requests but holds no verb approve.
    let approver_rules = spur_e2e::kube::chart_rules("access-approver-rules.yaml").unwrap();
    bind(
        &admin,
        "approvers",
        approver_rules,
        &[(DEVS, "alice"), ("others", "carol")],
    )
    .await;
    bind(
        &admin,
        "patchers",
        json!([{"apiGroups": ["spur.dev"], "resources": ["execaccessrequests"], "verbs": ["get", "patch"]}]),
        &[(DEVS, "bob")],
    )
    .await;
    let alice = setup.user(DEVS, "alice").await;
    let bob = setup.user(DEVS, "bob").await;
    let carol = setup.user("others", "carol").await;
    let alice_requests: Api<ExecAccessRequest> = Api::namespaced(alice.clone(), NS);

    // Filed already approved: refused.
    let mut forged = exec_request("pre-approved", "web-approved", None);
    forged.metadata.annotations = Some(
        Approver {
            username: "system:serviceaccount:others:carol".into(),
            groups: vec![],
        }
        .annotations(),
    );
    let e = alice_requests
        .create(&PostParams::default(), &forged)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot be filed approved"), "{e}");

    alice_requests
        .create(
            &PostParams::default(),
            &exec_request("alice-web", "web-approved", None),
        )
        .await
        .unwrap();
    let requests: Api<ExecAccessRequest> = Api::namespaced(admin.clone(), NS);
    let pending = eventually("the request waits for approval", || {
        let requests = requests.clone();
        async move {
            let s = requests.get("alice-web").await.ok()?.status?;
            (reason_of(&s.conditions, READY).as_deref() == Some("False/PendingApproval"))
                .then_some(s)
        }
    })
    .await;
    assert_eq!(
        reason_of(&pending.conditions, cond::APPROVED).as_deref(),
        Some("False/PendingApproval")
    );
    let message = find_condition(&pending.conditions, READY)
        .unwrap()
        .message
        .clone();
    assert!(
        message.contains("spur access approve exec alice-web -n shop"),
        "{message}"
    );
    assert!(!pending.ready && pending.expires_at.is_none());
    assert!(!may_exec(&alice, "web-1").await, "nothing granted yet");

    // The requester cannot approve her own request, though she holds the verb.
    let e = approve(
        &alice,
        "alice-web",
        "system:serviceaccount:devs:alice",
        &[DEVS_GROUP],
    )
    .await
    .unwrap_err();
    assert!(e.contains("cannot approve their own request"), "{e}");
    // Nor can a user without the verb.
    let e = approve(
        &bob,
        "alice-web",
        "system:serviceaccount:devs:bob",
        &[DEVS_GROUP],
    )
    .await
    .unwrap_err();
    assert!(
        e.contains("may not approve this request") && e.contains("verb approve"),
        "{e}"
    );
    // An approver cannot record someone else's name, or a group that is not theirs.
    let e = approve(&carol, "alice-web", "system:serviceaccount:devs:bob", &[])
        .await
        .unwrap_err();
    assert!(e.contains("own username"), "{e}");
    let e = approve(
        &carol,
        "alice-web",
        "system:serviceaccount:others:carol",
        &["system:masters"],
    )
    .await
    .unwrap_err();
    assert!(e.contains("only groups of theirs"), "{e}");
    assert!(!may_exec(&alice, "web-1").await);

    // Carol approves: the grant is made, from now on.
    let before = k8s_openapi::jiff::Timestamp::now();
    approve(
        &carol,
        "alice-web",
        "system:serviceaccount:others:carol",
        &[OTHERS_GROUP],
    )
    .await
    .unwrap();
    let ready = eventually("the approved request is ready", || {
        let requests = requests.clone();
        async move {
            let s = requests.get("alice-web").await.ok()?.status?;
            s.ready.then_some(s)
        }
    })
    .await;
    assert_eq!(
        ready.approved_by.as_deref(),
        Some("system:serviceaccount:others:carol")
    );
    assert_eq!(
        reason_of(&ready.conditions, cond::APPROVED).as_deref(),
        Some("True/Approved")
    );
    let expires = ready.expires_at.unwrap().0;
    assert!(
        expires.duration_since(before).as_secs() >= 3599,
        "the hour runs from the approval: {expires}"
    );
    assert!(may_exec(&alice, "web-1").await);
    // Bob cannot withdraw or replace the approval (any change to it needs the verb).
    let withdraw = json!({"metadata": {"annotations": {
        spur_api::access::approval::APPROVED_BY: null,
        spur_api::access::approval::APPROVED_BY_GROUPS: null,
    }}});
    let e = Api::<ExecAccessRequest>::namespaced(bob.clone(), NS)
        .patch(
            "alice-web",
            &PatchParams::default(),
            &Patch::Merge(withdraw.clone()),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("may not approve this request"), "{e}");
    assert!(may_exec(&alice, "web-1").await);
    // Carol may withdraw it: the grant is taken back.
    Api::<ExecAccessRequest>::namespaced(carol.clone(), NS)
        .patch(
            "alice-web",
            &PatchParams::default(),
            &Patch::Merge(withdraw),
        )
        .await
        .unwrap();
    eventually("the grant taken back with its approval", || {
        let alice = alice.clone();
        async move { (!may_exec(&alice, "web-1").await).then_some(()) }
    })
    .await;
    // The operator deletes the grant before it writes the status (access is never left behind a
    // status that says it is gone), so the status may trail what the authorizer already says.
    let reason = eventually("the status says the approval is pending again", || {
        let requests = requests.clone();
        async move {
            let s = requests.get("alice-web").await.ok()?.status?;
            reason_of(&s.conditions, READY).filter(|r| !r.starts_with("True/"))
        }
    })
    .await;
    assert_eq!(reason, "False/PendingApproval");
    assert!(!may_exec(&alice, "web-1").await);
    setup.shutdown().await;
}
