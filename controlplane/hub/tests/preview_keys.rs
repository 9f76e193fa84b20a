//! Issue 42, point 10: a preview caller (an authenticated one, or anyone on a public preview)
//! cannot pick another sandbox's routing key through a carrier the cluster's sidecars read
//! before `baggage`: a custom key header or the key query parameter. The target here reads the
//! request as such a sidecar would and answers with the keys it finds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use spur_hub::listener::ListenerLimits;
use spur_routing::{ExtractConfig, KeyExtractor};

/// What the clusters' sidecars are configured to read, and the hub told so.
fn carriers() -> ExtractConfig {
    ExtractConfig {
        custom_headers: vec!["x-route-to".into()],
        query_param: Some("sd-routing-key".into()),
    }
}

/// An app on loopback that answers with the routing keys a sidecar reading [`carriers`] finds
/// in the request (one per line, highest precedence first), then `uri <path-and-query>`.
async fn key_echo_app() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let extractor = KeyExtractor::new(&carriers()).unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let extractor = extractor.clone();
            let service = hyper::service::service_fn(move |req: http::Request<_>| {
                let found = extractor.extract(req.headers(), req.uri().query());
                let mut body: String = found.iter().map(|k| format!("key {k}\n")).collect();
                body.push_str(&format!("uri {}\n", req.uri()));
                async move { Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from(body)))) }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service),
            );
        }
    });
    port
}

/// A hub (public previews allowed) with one cluster: sandbox `sb` (key `key-sb`) has a public
/// endpoint `pub` and a private one `web`; sandbox `other` (key `key-other`) is someone else's.
async fn hub_with_two_sandboxes() -> (TestHub, FakeKube, String) {
    let mut preview = settings(ListenerLimits::default());
    preview.allow_public = true;
    preview.carriers = carriers();
    let hub = start_hub(preview).await;
    let app = key_echo_app().await;
    let target = format!("http://localhost:{app}");
    let kube = FakeKube::start().await;
    kube.sandboxes.lock().unwrap().push(serde_json::json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "sb", "resourceVersion": "1"},
        "spec": {
            "forks": [{"forkOf": {"kind": "Deployment", "namespace": "default", "name": "web"}}],
            "defaultRouteGroup": {"endpoints": [
                {"name": "pub", "target": target, "public": true},
                {"name": "web", "target": target}
            ]}
        },
        "status": {"routingKey": "key-sb"}
    }));
    kube.add_sandbox("other", "web", &target, false);
    start_agent(&hub, "east", Some(kube.client()), local_scope(), None).await;
    let key = admin_key(&hub, "dev");
    let host = format!("web--sb.{DOMAIN}");
    until_preview_answers(&hub, &host, &key).await;
    (hub, kube, key)
}

/// The keys the target found and the URI it was asked for.
fn seen(body: &str) -> (Vec<&str>, &str) {
    let keys = body
        .lines()
        .filter_map(|l| l.strip_prefix("key "))
        .collect();
    let uri = body
        .lines()
        .find_map(|l| l.strip_prefix("uri "))
        .unwrap_or_default();
    (keys, uri)
}

const ATTACK_PATH: &str = "/x?sd-routing-key=key-other&x=1&sd-routing-key=key-%6Fther";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_public_preview_caller_cannot_pick_another_sandboxs_key() {
    let (hub, _kube, _key) = hub_with_two_sandboxes().await;
    // Anyone: no key, no login.
    let (status, _, body) = get(
        &hub,
        &format!("pub--sb.{DOMAIN}"),
        ATTACK_PATH,
        &[
            ("x-route-to", "key-other"),
            ("baggage", "sd-routing-key=key-other"),
            ("uberctx-sd-routing-key", "key-other"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (keys, uri) = seen(&body);
    assert_eq!(keys, ["key-sb"], "the target was reached with: {body}");
    assert_eq!(uri, "/x?x=1", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preview_user_cannot_pick_another_sandboxs_key() {
    let (hub, _kube, key) = hub_with_two_sandboxes().await;
    let host = format!("web--sb.{DOMAIN}");
    // The custom header alone (twice), then the query parameter alone.
    let (status, _, body) = get(
        &hub,
        &host,
        "/y",
        &[
            ("x-spur-api-key", &key),
            ("x-route-to", "key-other"),
            ("X-Route-To", "key-third"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(seen(&body), (vec!["key-sb"], "/y"), "{body}");
    let (status, _, body) = get(&hub, &host, ATTACK_PATH, &[("x-spur-api-key", &key)]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(seen(&body), (vec!["key-sb"], "/x?x=1"), "{body}");
    // The other sandbox's own preview still carries its own key (the target is the same app).
    let (status, _, body) = get(
        &hub,
        &format!("web--other.{DOMAIN}"),
        "/?sd-routing-key=key-sb",
        &[("x-spur-api-key", &key), ("x-route-to", "key-sb")],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(seen(&body), (vec!["key-other"], "/"), "{body}");
}

/// The catalog reads the cluster's namespaces through the agent: a target anywhere in the
/// cluster resolves with every carrier any namespace names (the target's app may forward a
/// header a downstream namespace's sidecars read), each valid name on its own. A preview
/// overwrites them all (unit tests in preview/outgoing.rs and carriers.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_knows_every_namespaces_carriers() {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    let kube = FakeKube::start().await;
    kube.namespaces.lock().unwrap().extend([
        serde_json::json!({"metadata": {"name": "team", "annotations": {
            "sidecar.spur.dev/routing-headers": "x-team, not a header",
            "sidecar.spur.dev/query-param": "team-key",
            "owner": "not kept"}}}),
        serde_json::json!({"metadata": {"name": "payments", "annotations": {
            "sidecar.spur.dev/routing-headers": "x-pay"}}}),
        serde_json::json!({"metadata": {"name": "plain"}}),
    ]);
    kube.add_sandbox_in("sb", "plain", "web", "http://web.plain.svc:80");
    start_agent(&hub, "east", Some(kube.client()), local_scope(), None).await;
    let synced = || {
        hub.catalog
            .snapshot()
            .get("east")
            .is_some_and(|v| v.namespaces_synced && v.sandboxes.len() == 1)
    };
    wait_for(
        "the namespaces and sandboxes",
        Duration::from_secs(20),
        synced,
    )
    .await;
    let r = hub.catalog.resolve(Some("east"), "sb", "web").unwrap();
    let c = r.carriers.unwrap();
    let headers: Vec<String> = c.header_names().iter().map(|h| h.to_string()).collect();
    assert_eq!(headers, ["x-pay", "x-team"]);
    assert_eq!(c.params().collect::<Vec<_>>(), ["team-key"]);
    let kept = &hub.catalog.snapshot()["east"].namespaces["team"];
    assert_eq!(
        kept.metadata.annotations.as_ref().map(|a| a.len()),
        Some(2),
        "only the carrier annotations are kept: {kept:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_carriers_stop_the_hub_at_start() {
    for (bad, what) in [
        (
            ExtractConfig {
                custom_headers: vec!["bad header".into()],
                query_param: None,
            },
            "bad header",
        ),
        (
            ExtractConfig {
                custom_headers: vec![],
                query_param: Some("key=".into()),
            },
            "key=",
        ),
    ] {
        let mut preview = settings(ListenerLimits::default());
        preview.carriers = bad;
        let mut registry = prometheus_client::registry::Registry::default();
        let err = spur_hub::server::Hub::start(
            spur_hub::server::HubConfig {
                tunnel_quic: None,
                tunnel_h2: Some("127.0.0.1:0".parse().unwrap()),
                tls: spur_hub::server::TlsSource::OwnCa {
                    names: vec![WEB_HOST.into()],
                },
                revocation_poll: Duration::from_millis(200),
                preview: Some(preview),
            },
            spur_hub::Store::in_memory().unwrap(),
            &mut registry,
        )
        .await
        .expect_err("the hub started with invalid carriers");
        let msg = err.to_string();
        assert!(
            msg.contains(what) && msg.contains("--routing-header"),
            "{msg}"
        );
    }
}
