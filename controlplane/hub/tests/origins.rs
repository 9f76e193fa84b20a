//! Issue 42, point 2: a preview never shares an origin (or a site) with the web view, cannot set
//! the hub's cookies, and a login code is no cookie and logs no one in on a GET.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use spur_hub::listener::ListenerLimits;

const HOSTILE: &str =
    "<html><script>fetch('/').then(r=>r.text()).then(t=>document.title=t)</script></html>";

/// A hub with one cluster whose sandbox `sb` has endpoint `web` served by a hostile app that
/// also tries to set the hub's cookies.
async fn hub_with_hostile_preview() -> (TestHub, FakeKube, String) {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    let app = html_app(
        HOSTILE,
        &[
            "__Host-spur_hub=spurs_attacker; Path=/; Secure",
            "__HOST-SPUR_HUB=spurs_attacker; Path=/; Secure",
            "spur_preview=spurs_attacker; Domain=preview.test; Path=/; Secure",
            "spur_hub=spurs_attacker; Path=/",
            "app=1; Path=/",
        ],
    )
    .await;
    let kube = FakeKube::start().await;
    kube.add_sandbox("sb", "web", &format!("http://localhost:{app}"), false);
    start_agent(&hub, "east", Some(kube.client()), local_scope(), None).await;
    let key = admin_key(&hub, "dev");
    // The catalog has the sandbox once a preview answers.
    let host = format!("web--sb.{DOMAIN}");
    until_preview_answers(&hub, &host, &key).await;
    (hub, kube, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_path_form_does_not_run_a_preview_on_the_web_views_origin() {
    let (hub, _kube, key) = hub_with_hostile_preview().await;
    let (status, _, body) = get(&hub, WEB_HOST, "/p/web--sb/", &[("x-spur-api-key", &key)]).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        !body.contains("<script>"),
        "the app's page on the web view's host: {body}"
    );
    // Nor on the bare preview domain (all previews on one origin) or any other name.
    let (status, _, body) = get(&hub, DOMAIN, "/p/web--sb/", &[("x-spur-api-key", &key)]).await;
    assert!(!body.contains("<script>"), "{status}: {body}");
    let (status, _, body) = get(&hub, "127.0.0.1", "/", &[("x-spur-api-key", &key)]).await;
    assert_eq!(status, 421, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preview_cannot_set_the_hubs_cookies() {
    let (hub, _kube, key) = hub_with_hostile_preview().await;
    let (status, headers, body) = get(
        &hub,
        &format!("web--sb.{DOMAIN}"),
        "/",
        &[("x-spur-api-key", &key)],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let cookies: Vec<&str> = headers
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(
        cookies,
        ["app=1; Path=/"],
        "the hub's cookies from a target"
    );
}

fn set_cookie(headers: &http::HeaderMap) -> String {
    headers
        .get("set-cookie")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_host_only_and_kept_apart() {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    let key = admin_key(&hub, "dev");
    let origin = format!("https://{WEB_HOST}:{}", hub.preview.port());
    let (status, headers, _) = post(
        &hub,
        WEB_HOST,
        "/login",
        &format!("key={key}"),
        &[("origin", &origin)],
    )
    .await;
    assert_eq!(status, 303);
    let web = set_cookie(&headers);
    assert!(web.starts_with("__Host-spur_hub=spurs_"), "{web}");
    assert!(web.contains("Path=/") && web.contains("Secure"), "{web}");
    assert!(!web.contains("Domain"), "{web}");
    let web_token = web.split(';').next().unwrap().to_owned();
    let (status, _, _) = get(&hub, WEB_HOST, "/", &[("cookie", &web_token)]).await;
    assert_eq!(status, 200);

    // The previews' login lives on its own host, and its session does not open the web view.
    let login_host = format!("login.{DOMAIN}");
    let login_origin = format!("https://{login_host}:{}", hub.preview.port());
    let (status, headers, _) = post(
        &hub,
        &login_host,
        "/",
        &format!("key={key}"),
        &[("origin", &login_origin)],
    )
    .await;
    assert_eq!(status, 200);
    let preview = set_cookie(&headers);
    assert!(
        preview.starts_with("spur_preview=spurs_") && preview.contains("Domain=preview.test"),
        "{preview}"
    );
    let token = preview
        .split(';')
        .next()
        .unwrap()
        .split_once('=')
        .unwrap()
        .1;
    let (status, ..) = get(
        &hub,
        WEB_HOST,
        "/",
        &[("cookie", &format!("__Host-spur_hub={token}"))],
    )
    .await;
    assert_eq!(status, 303, "a preview session opened the web view");

    // A login form posted from another site is refused.
    let (status, headers, _) = post(
        &hub,
        WEB_HOST,
        "/login",
        &format!("key={key}"),
        &[("origin", "https://web--sb.preview.test")],
    )
    .await;
    assert_eq!(status, 403);
    assert!(set_cookie(&headers).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_code_works_once_by_post_and_never_as_a_cookie() {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    admin_key(&hub, "dev");
    let code = hub
        .store
        .create_login_code("dev", Duration::from_secs(60))
        .unwrap();
    // A GET (a link any page can make a browser follow) logs no one in.
    let (status, headers, body) = get(&hub, WEB_HOST, &format!("/login?code={code}"), &[]).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        set_cookie(&headers).is_empty(),
        "a GET set {:?}",
        set_cookie(&headers)
    );
    assert!(
        body.contains("method=post") && body.contains("dev"),
        "{body}"
    );
    // Nor is the code a session.
    let (status, ..) = get(
        &hub,
        WEB_HOST,
        "/",
        &[("cookie", &format!("__Host-spur_hub={code}"))],
    )
    .await;
    assert_eq!(status, 303, "a login code opened the web view as a cookie");
    let origin = format!("https://{WEB_HOST}:{}", hub.preview.port());
    let (status, headers, _) = post(
        &hub,
        WEB_HOST,
        "/login",
        &format!("code={code}"),
        &[("origin", &origin)],
    )
    .await;
    assert_eq!(status, 303);
    assert!(set_cookie(&headers).starts_with("__Host-spur_hub=spurs_"));
    let (status, headers, _) = post(
        &hub,
        WEB_HOST,
        "/login",
        &format!("code={code}"),
        &[("origin", &origin)],
    )
    .await;
    assert_eq!(status, 401, "a code worked twice");
    assert!(set_cookie(&headers).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hub_page_carries_its_security_headers() {
    let hub = start_hub(settings(ListenerLimits::default())).await;
    let key = admin_key(&hub, "dev");
    let auth = [("x-spur-api-key", key.as_str())];
    let login = format!("login.{DOMAIN}");
    let pages = [
        (WEB_HOST, "/", &auth[..]),
        (WEB_HOST, "/", &[][..]),
        (WEB_HOST, "/login", &[][..]),
        (WEB_HOST, "/nothing", &auth[..]),
        (WEB_HOST, "/p/web--sb/", &auth[..]),
        (WEB_HOST, "/traffic", &auth[..]),
        (login.as_str(), "/", &[][..]),
        ("web--none.preview.test", "/", &[][..]),
        (
            "web--none.preview.test",
            "/",
            &[("accept", "text/html")][..],
        ),
        ("web--none.preview.test", "/", &auth[..]),
        ("elsewhere.test", "/", &[][..]),
    ];
    for (host, path, headers) in pages {
        let (status, h, _) = get(&hub, host, path, headers).await;
        let csp = h
            .get("content-security-policy")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        assert!(
            csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"),
            "{host}{path} ({status}): CSP {csp:?}"
        );
        assert_eq!(
            h.get("x-content-type-options").map(|v| v.to_str().unwrap()),
            Some("nosniff"),
            "{host}{path} ({status})"
        );
        assert_eq!(
            h.get("referrer-policy").map(|v| v.to_str().unwrap()),
            Some("same-origin"),
            "{host}{path} ({status})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_refuses_a_preview_domain_that_shares_the_web_views_site() {
    for (web, domain) in [
        ("hub.example.com", "preview.example.com"),
        ("example.com", "preview.example.com"),
        ("preview.example.com", "example.com"),
        ("hub.preview.test", "preview.test"),
        ("preview.test", "preview.test"),
        ("localhost", "preview.localhost"),
    ] {
        let mut s = settings(ListenerLimits::default());
        s.web_host = web.into();
        s.domain = domain.into();
        let store = spur_hub::Store::in_memory().unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        let started = spur_hub::server::Hub::start(
            spur_hub::server::HubConfig {
                tunnel_quic: None,
                tunnel_h2: Some("127.0.0.1:0".parse().unwrap()),
                tls: spur_hub::server::TlsSource::OwnCa {
                    names: vec![web.into()],
                },
                revocation_poll: Duration::from_millis(200),
                preview: Some(s),
            },
            store,
            &mut registry,
        )
        .await;
        let err = started.expect_err(&format!("{web} and {domain} were accepted"));
        assert!(err.to_string().contains("share a site"), "{err}");
    }
    assert!(spur_hub::preview::check_sites("hub.example.com", "example-preview.net").is_ok());
    assert!(spur_hub::preview::check_sites("10.0.0.1", "preview.test").is_ok());
}
