//! Grants end with the operator down (issue 42, point 8): the chart's second sweeper
//! (`spur-operator sweep-access`, CronJob spur-access-sweeper, its own ServiceAccount and rules) deletes
//! the Role and RoleBinding of a grant whose time is up, or whose request was revoked, without
//! the operator.

use super::*;

/// One pass of the sweeper as the chart's CronJob runs it: `spur-operator sweep-access` under the
/// ServiceAccount spur-access-sweeper with the chart's rules.
async fn sweep(sweeper: &Client) -> spur_operator::access::sweep::Swept {
    spur_operator::access::sweep::sweep(sweeper).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_end_on_time_with_the_operator_stopped() {
    let mut setup = Setup::start().await;
    let admin = setup.api.client();
    workload(&admin, "web").await;
    // What the chart runs: the CronJob's command and account, and the account's rules.
    let template =
        std::fs::read_to_string(spur_e2e::kube::chart_path("templates/access.yaml")).unwrap();
    let cronjob = template
        .split("\n---\n")
        .find(|d| d.contains("kind: CronJob"))
        .expect("the chart has the sweeper's CronJob");
    assert!(
        cronjob.contains("name: spur-access-sweeper")
            && cronjob.contains("serviceAccountName: spur-access-sweeper")
            && cronjob.contains("command: [spur-operator]")
            && cronjob.contains("args: [sweep-access]"),
        "{cronjob}"
    );
    let sweeper = spur_e2e::kube::chart_client(
        &setup.api,
        "spur-access-sweeper",
        "access-sweeper-rules.yaml",
        None,
    )
    .await
    .unwrap();

    let templates: Api<ExecAccessTemplate> = Api::namespaced(admin.clone(), NS);
    for (name, max) in [("web-short", "20s"), ("web-hour", "1h")] {
        templates
            .create(&PostParams::default(), &exec_template(name, "web", max))
            .await
            .unwrap();
    }
    let alice = setup.user(DEVS, "alice").await;
    let bob = setup.user(DEVS, "bob").await;
    Api::<ExecAccessRequest>::namespaced(alice.clone(), NS)
        .create(
            &PostParams::default(),
            &exec_request("alice-web", "web-short", None),
        )
        .await
        .unwrap();
    let bob_requests: Api<ExecAccessRequest> = Api::namespaced(bob.clone(), NS);
    bob_requests
        .create(
            &PostParams::default(),
            &exec_request("bob-web", "web-hour", None),
        )
        .await
        .unwrap();
    let requests: Api<ExecAccessRequest> = Api::namespaced(admin.clone(), NS);
    let mut expires = None;
    for name in ["alice-web", "bob-web"] {
        let r = eventually("the grants are ready", || {
            let requests = requests.clone();
            async move {
                let r = requests.get(name).await.ok()?;
                r.status.as_ref()?.ready.then_some(r)
            }
        })
        .await;
        if name == "alice-web" {
            expires = r.status.unwrap().expires_at.map(|t| t.0);
        }
    }
    let expires = expires.unwrap();
    assert!(may_exec(&alice, "web-1").await && may_exec(&bob, "web-1").await);
    // The grant's end is on its Role and RoleBinding.
    let bindings: Api<RoleBinding> = Api::namespaced(admin.clone(), NS);
    let grant = spur_operator::access::grant_name("exec", NS, "alice-web");
    let binding = bindings.get(&grant).await.unwrap();
    assert_eq!(
        binding
            .annotations()
            .get(spur_api::access::labels::EXPIRES_AT)
            .map(String::as_str),
        Some(expires.to_string().as_str())
    );

    // The operator stops (a crash, a bad rollout, replicas: 0).
    setup.stop_operator().await;

    // Bob revokes his grant meanwhile: his request waits on its finalizer, and nothing of the
    // old code takes the grant back until the operator returns.
    bob_requests
        .delete("bob-web", &DeleteParams::default())
        .await
        .unwrap();
    assert!(requests.get_opt("bob-web").await.unwrap().is_some());
    assert!(
        may_exec(&bob, "web-1").await,
        "still granted without a sweeper"
    );
    let swept = sweep(&sweeper).await;
    assert!(
        !may_exec(&bob, "web-1").await,
        "the sweeper ends a revoked grant"
    );
    let bob_grant = spur_operator::access::grant_name("exec", NS, "bob-web");
    assert!(
        swept
            .ended
            .iter()
            .any(|e| e.kind == "RoleBinding" && e.name == bob_grant && e.why.contains("revoked")),
        "{swept:?}"
    );
    assert!(
        may_exec(&alice, "web-1").await,
        "and leaves a grant in effect alone ({:?} before its end): {swept:?}",
        expires.duration_since(k8s_openapi::jiff::Timestamp::now())
    );

    // Alice's grant expires with the operator still down.
    let left = Duration::try_from(expires.duration_since(k8s_openapi::jiff::Timestamp::now()))
        .unwrap_or_default();
    tokio::time::sleep(left + Duration::from_millis(500)).await;
    assert!(
        may_exec(&alice, "web-1").await,
        "past its expiry, the grant outlives a stopped operator until the sweeper runs"
    );
    let swept = sweep(&sweeper).await;
    assert!(
        !may_exec(&alice, "web-1").await,
        "the sweeper ended the expired grant: {swept:?}"
    );
    let roles: Api<Role> = Api::namespaced(admin.clone(), NS);
    assert!(roles.get_opt(&grant).await.unwrap().is_none());
    assert!(bindings.get_opt(&grant).await.unwrap().is_none());
    assert_eq!(sweep(&sweeper).await.ended, vec![], "nothing left to do");

    // The sweeper deletes nothing but grants (policy spur-access-sweeper), though RBAC lets it
    // delete any Role or RoleBinding.
    let e = Api::<RoleBinding>::namespaced(sweeper.clone(), NS)
        .delete("requesters", &DeleteParams::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("deletes only the Roles and RoleBindings of access grants"),
        "{e}"
    );
    setup.shutdown().await;
}
