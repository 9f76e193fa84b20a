//! Every routing-key carrier in the cluster (issue 45, point 2; docs/routing-keys.md): a
//! namespace names its own custom header and query parameter (the annotations
//! `sidecar.spur.dev/routing-headers` and `sidecar.spur.dev/query-param`, layered over the chart's
//! `routingKeys` by the one reading the webhook, the mesh modes, the route server and the hub
//! share), and then
//!
//! - a request carrying the key only in that header, or only in that query parameter, reaches
//!   the fork through the injected sidecars (web's baseline calls api; api is forked; the app
//!   propagates the header, the sidecar turns the parameter into headers), while a header the
//!   namespace does not name does nothing;
//! - a preview URL of a sandbox there (through the hub and the cluster's agent) writes the
//!   preview's key into that header, over whatever the caller sent in it, so an app that
//!   propagates only its own header carries the preview's key on.

use std::time::Duration;

use spur_e2e::node::{Answer, Node, demo_app, demo_app_with, eventually};

use super::fork_pod;
use crate::sandbox_ready;

const SANDBOX: &str = "carriers";
const HEADER: &str = "x-team";
const PARAM: &str = "team-key";

/// `preview(host, headers)`: a GET of `https://<host>/` at the hub's preview port, from outside
/// the cluster (the hub step's own client).
pub(crate) fn configured_carriers_on_the_node(
    node: &Node,
    preview: &dyn Fn(&str, &[&str]) -> Answer,
    auth: &str,
) {
    let ns_guard = node
        .namespace(
            "carriers",
            &[
                ("sidecar.spur.dev/inject", "true"),
                ("spur.dev/enabled", "true"),
            ],
        )
        .unwrap();
    let ns = ns_guard.name.as_str();
    // Before the pods: the webhook reads the annotations when it injects them.
    node.kubectl(&[
        "annotate",
        "namespace",
        ns,
        &format!("sidecar.spur.dev/routing-headers={HEADER}"),
        &format!("sidecar.spur.dev/query-param={PARAM}"),
    ])
    .unwrap();
    node.apply(&demo_app(ns, "api", None)).unwrap();
    let call = format!("--call=http://api.{ns}.svc.cluster.local:8080");
    node.apply(&demo_app_with(
        ns,
        "web",
        &[call, format!("--propagate={HEADER}")],
        &[],
    ))
    .unwrap();
    node.rollout(ns, "web").unwrap();
    node.rollout(ns, "api").unwrap();
    let client = node.client_pod(ns).unwrap();
    let web = format!("http://web.{ns}.svc.cluster.local:8080/");

    node.apply(&format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata:
  name: {SANDBOX}
spec:
  description: the namespace's own carriers
  forks:
    - forkOf: {{kind: Deployment, namespace: {ns}, name: api}}
      customizations:
        env:
          - {{name: SPUR_APP_MARKER, value: carriers}}
  defaultRouteGroup:
    endpoints:
      - {{name: web, target: "http://web.{ns}.svc:8080"}}
"#
    ))
    .unwrap();
    let key = sandbox_ready(node, SANDBOX);
    let fork = fork_pod(node, ns, SANDBOX, "api");

    // The key only in the namespace's header, then only in its query parameter.
    let by_header = eventually(
        "the key in the namespace's header to reach the fork",
        Duration::from_secs(120),
        || {
            let a = node.curl(ns, &client, &web, &[(HEADER, key.as_str())])?;
            Ok((a.answered_by() == Some(fork.as_str())).then_some(a))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));
    assert_eq!(by_header.marker(), Some("carriers"), "{by_header:?}");
    let by_param = node
        .curl(ns, &client, &format!("{web}?a=1&{PARAM}={key}"), &[])
        .unwrap();
    assert_eq!(by_param.answered_by(), Some(fork.as_str()), "{by_param:?}");
    // A header nobody configured carries nothing; no key at all, the baseline.
    for headers in [vec![("x-route-to", key.as_str())], vec![]] {
        let a = node.curl(ns, &client, &web, &headers).unwrap();
        assert!(
            a.answered_by().is_some_and(|p| p.starts_with("api-")),
            "{headers:?}: {a:?}"
        );
    }

    // The preview: the hub learnt the namespace's header through the agent, and writes the
    // preview's key into it over the caller's value (another key, here).
    let host = format!("web--{SANDBOX}.preview.test");
    let through_preview = eventually(
        "the preview to answer from the fork",
        Duration::from_secs(90),
        || {
            let a = preview(&host, &[auth, &format!("{HEADER}: not-{key}")]);
            Ok((a.status == 200 && a.answered_by() == Some(fork.as_str())).then_some(a))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", node.describe(ns)));
    assert_eq!(
        through_preview.json["headers"][HEADER].as_str(),
        Some(key.as_str()),
        "{through_preview:?}"
    );

    node.kubectl(&[
        "delete",
        "sandbox",
        SANDBOX,
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
}
