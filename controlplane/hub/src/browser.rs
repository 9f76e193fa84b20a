//! What the hub tells browsers on every host it serves (previews, their login host, the web
//! view): the names of its cookies and how long a login lasts, reading a cookie back, and the
//! headers of every response the hub writes itself.

use std::time::Duration;

use http::header::{self, HeaderValue};

/// The web view's session cookie. `__Host-`: the browser takes it only from the web view's own
/// host, Secure, with `Path=/` and no `Domain`, so no other host (a preview) can set or replace it.
pub const WEB_COOKIE: &str = "__Host-spur_hub";
/// The previews' session cookie, for the whole preview domain (one login covers every preview).
/// It never opens the web view: its session is of the preview scope.
pub const PREVIEW_COOKIE: &str = "spur_preview";
/// Cookie names only the hub may set: a target's `Set-Cookie` for one of them is dropped, and
/// a request's `Cookie` loses them before it goes to a target. (`spur_hub` is the web view's
/// cookie before `__Host-`.)
pub const HUB_COOKIES: [&str; 3] = [WEB_COOKIE, PREVIEW_COOKIE, "spur_hub"];
/// How long a login lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);

/// The value of cookie `name` in a request's `Cookie` headers.
pub fn cookie<'a>(headers: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The headers of every response the hub writes itself (pages, errors, redirects, events; not
/// a target's answers): everything is served by the hub, nothing may be framed or loaded from
/// elsewhere, no content type is guessed, no URL leaks to another origin in a `Referer`
/// (`same-origin`: with `no-referrer` a browser's form posts carry `Origin: null`, which the
/// login's same-origin check must refuse), nothing is cached.
pub fn hub_headers(h: &mut http::HeaderMap) {
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
             img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
}
