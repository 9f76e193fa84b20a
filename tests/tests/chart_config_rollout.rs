//! Configuration the components read once, at start, rolls them when it changes (issue 47,
//! "Configuration changes and upgrades that take effect"): the operator's pod template carries
//! the checksum of the injection config (ConfigMap `spur-injection`, which the webhook reads at
//! start), the agent's that of the hub's CA. `helm upgrade --set injection.sidecarLog=debug`
//! thus replaces the operator's pods and newly injected sidecars log at debug; a change of
//! nothing they read leaves them running.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use spur_e2e::kube::helm_template;

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

fn annotation(objects: &[Value], deployment: &str, key: &str) -> String {
    find(objects, "Deployment", deployment)["spec"]["template"]["metadata"]["annotations"][key]
        .as_str()
        .unwrap_or_else(|| panic!("{deployment}: no pod annotation {key}"))
        .to_owned()
}

#[tokio::test]
async fn a_changed_injection_config_rolls_the_operator_and_nothing_else_does() {
    let base = helm_template(&[]).await.unwrap();
    let debug = helm_template(&["--set", "injection.sidecarLog=debug"])
        .await
        .unwrap();
    let other = helm_template(&["--set", "operator.resources.limits.memory=300Mi"])
        .await
        .unwrap();
    let key = "checksum/injection";
    let config = |objects: &[Value]| {
        find(objects, "ConfigMap", "spur-injection")["data"]["injection.yaml"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(
        config(&debug).contains("sidecarLog: debug"),
        "{}",
        config(&debug)
    );
    assert_ne!(
        annotation(&base, "spur-operator", key),
        annotation(&debug, "spur-operator", key),
        "the injection config changed and the operator's pods would keep the old one"
    );
    // The checksum is of the config, not of the values: unrelated values leave it alone.
    assert_eq!(
        annotation(&base, "spur-operator", key),
        annotation(&other, "spur-operator", key)
    );
    // Other value paths that feed the config roll it too.
    let keys = helm_template(&["--set", "routingKeys.queryParam=sbx"])
        .await
        .unwrap();
    assert!(
        config(&keys).contains("queryParam: \"sbx\""),
        "{}",
        config(&keys)
    );
    assert_ne!(
        annotation(&base, "spur-operator", key),
        annotation(&keys, "spur-operator", key)
    );
}

#[tokio::test]
async fn a_new_hub_ca_rolls_the_agent() {
    let agent = |ca: &'static str| async move {
        helm_template(&[
            "--set",
            "agent.enabled=true",
            "--set",
            "agent.hub=hub.example:7443",
            "--set",
            ca,
        ])
        .await
        .unwrap()
    };
    let a = agent("agent.hubCA=first").await;
    let b = agent("agent.hubCA=second").await;
    assert_ne!(
        annotation(&a, "spur-agent", "checksum/hub-ca"),
        annotation(&b, "spur-agent", "checksum/hub-ca")
    );
}
