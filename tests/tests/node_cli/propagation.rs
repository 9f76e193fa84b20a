//! `spur doctor propagation` on the node (issue 46): three injected services in a chain,
//! a → b → c, where b forwards the trace context but not `baggage` (the demo app's
//! `--no-propagate baggage`, as a framework that forwards trace headers and loses baggage). The
//! doctor, sending through the API server's service proxy with the admin's credentials, names b
//! as the service that dropped the key and traceparent as what it did forward; with b fixed, it
//! reports that the key reached every hop. Proven by the hops each pod's own sidecar recorded.

use std::time::Duration;

use spur_e2e::node::{Node, demo_app_with};

use super::{Ran, spur_with};

/// The chain's namespace; a tenant's try to reach through the doctor uses it too.
pub(crate) const CHAIN_NS: &str = "chain";
const KEY: &str = "dropcheck1";

/// The doctor, again while the chain answers 502: right after a rollout a caller's pooled
/// connection to the old pod fails a request or a few (the doctor then says so and exits 3
/// rather than call a chain that stopped short whole).
fn doctor(node: &Node) -> Ran {
    spur_e2e::node::eventually(
        "the doctor over a chain that answers",
        Duration::from_secs(60),
        || {
            let ran = doctor_once(node);
            if ran.code == Some(3) && ran.stdout.contains(": 502 Bad Gateway in ") {
                assert!(
                    ran.stdout.contains("but the answer was 502 Bad Gateway"),
                    "{}",
                    ran.stdout
                );
                return Ok(None);
            }
            Ok(Some(ran))
        },
    )
    .unwrap()
}

fn doctor_once(node: &Node) -> Ran {
    spur_with(
        &node.kubeconfig,
        &[
            "doctor",
            "propagation",
            "--key",
            KEY,
            &format!("svc/svc-a.{CHAIN_NS}:8080/hello"),
        ],
        "",
        Duration::from_secs(120),
    )
}

/// The hop line of `service` in the doctor's output.
fn hop<'a>(out: &'a str, service: &str) -> &'a str {
    out.lines()
        .find(|l| {
            l.contains(&format!(
                "Deployment {CHAIN_NS}/{service}  (pod {CHAIN_NS}/{service}-"
            ))
        })
        .unwrap_or_else(|| panic!("no hop of {service} in:\n{out}"))
}

pub(crate) fn propagation_doctor(node: &Node) {
    node.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {CHAIN_NS}\n  labels:\n    sidecar.spur.dev/inject: \"true\"\n    spur.dev/enabled: \"true\"\n"
    ))
    .unwrap();
    let call = |to: &str| format!("--call=http://{to}:8080");
    node.apply(&demo_app_with(CHAIN_NS, "svc-c", &[], &[]))
        .unwrap();
    node.apply(&demo_app_with(
        CHAIN_NS,
        "svc-b",
        &[call("svc-c"), "--no-propagate=baggage".into()],
        &[],
    ))
    .unwrap();
    node.apply(&demo_app_with(CHAIN_NS, "svc-a", &[call("svc-b")], &[]))
        .unwrap();
    for d in ["svc-a", "svc-b", "svc-c"] {
        node.rollout(CHAIN_NS, d).unwrap();
    }

    // b drops the key.
    let ran = doctor(node);
    assert_eq!(ran.code, Some(3), "{}{}", ran.stdout, ran.stderr);
    let out = &ran.stdout;
    assert!(out.contains(": 200 OK in "), "{out}");
    assert!(
        hop(out, "svc-a").contains(&format!("key {KEY} (baggage)")),
        "{out}"
    );
    assert!(
        hop(out, "svc-b").contains(&format!("key {KEY} (baggage)")),
        "{out}"
    );
    let c = hop(out, "svc-c");
    assert!(c.contains("NO KEY; trace via traceparent"), "{out}");
    assert!(
        out.contains(&format!(
            "The key was dropped by Deployment {CHAIN_NS}/svc-b: its call to Deployment {CHAIN_NS}/svc-c carried the trace (traceparent) but not the routing key."
        )),
        "{out}"
    );
    // In the order of the chain.
    let at = |s: &str| out.find(hop(out, s)).unwrap();
    assert!(
        at("svc-a") < at("svc-b") && at("svc-b") < at("svc-c"),
        "{out}"
    );

    // b fixed: its args without --no-propagate.
    node.kubectl(&[
        "-n",
        CHAIN_NS,
        "patch",
        "deployment",
        "svc-b",
        "--type=json",
        "-p",
        r#"[{"op":"replace","path":"/spec/template/spec/containers/0/args","value":["demo","app","--name=svc-b","--listen=0.0.0.0:8080","--call=http://svc-c:8080"]}]"#,
    ])
    .unwrap();
    node.rollout(CHAIN_NS, "svc-b").unwrap();
    let ran = doctor(node);
    assert_eq!(ran.code, Some(0), "{}{}", ran.stdout, ran.stderr);
    assert!(
        ran.stdout
            .contains("The key reached every recorded hop (3): propagation works along this path."),
        "{}",
        ran.stdout
    );
    assert!(
        hop(&ran.stdout, "svc-c").contains(&format!("key {KEY} (baggage)")),
        "{}",
        ran.stdout
    );
}
