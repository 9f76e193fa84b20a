//! Logging in and out, for the web view and for previews, kept apart so that no preview can
//! reach the web view's session or a typed API key:
//!
//! - The web view (its own host): `POST /login` with an API key, or with a one-time code from
//!   `spur-hub login-link` (its link opens a page that asks the user to confirm; a `GET` never
//!   logs anyone in, so no page elsewhere can log a browser in as someone else), and
//!   `POST /logout`. The session is the host-only cookie [`WEB_COOKIE`].
//! - Previews: the form lives on `login.<preview domain>`, a host no preview can have (a preview
//!   name holds `--`), so a preview's script, which runs on its own preview host, cannot read the
//!   key typed into it. The session is [`PREVIEW_COOKIE`] for the whole preview domain and is
//!   good for previews only.
//!
//! Every form post must come from a page of the same origin (`Origin`, `Sec-Fetch-Site`).

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::browser::{PREVIEW_COOKIE, SESSION_TTL, WEB_COOKIE, cookie};
use crate::html::esc;
use crate::preview::{Body, LOGIN_LABEL, Preview, PreviewName};
use crate::store::SessionScope;
use crate::web::{Chrome, form_value, full, page, redirect};

/// Longest login form body read.
const MAX_FORM: usize = 4096;
const HTML: &str = "text/html; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";

fn key_form(message: Option<&str>, action: &str, to: Option<&str>) -> String {
    let message = message
        .map(|m| format!("<p class=bad>{}</p>", esc(m)))
        .unwrap_or_default();
    let to = to
        .map(|t| format!("<input type=hidden name=to value=\"{}\">", esc(t)))
        .unwrap_or_default();
    page(
        "Spur hub: log in",
        Chrome::Login,
        &format!(
            "<form class=login method=post action=\"{}\"><h2>Log in</h2>{message}{to}\
             <label>API key (<code>spur-hub apikey add NAME --user USER</code>)\
             <input type=password name=key autocomplete=current-password autofocus></label>\
             <button type=submit>Log in</button></form>",
            esc(action)
        ),
    )
}

/// The page a login link opens: it names the key and logs in only when the user confirms.
fn code_form(code: &str, key_name: &str) -> String {
    page(
        "Spur hub: log in",
        Chrome::Login,
        &format!(
            "<form class=login method=post action=\"/login\"><h2>Log in</h2>\
             <p>This one-time link logs this browser in to the hub as API key <code>{}</code>.</p>\
             <input type=hidden name=code value=\"{}\">\
             <button type=submit>Log in as {}</button></form>",
            esc(key_name),
            esc(code),
            esc(key_name)
        ),
    )
}

/// `Set-Cookie` for a session of `scope`.
pub(crate) fn session_cookie(token: &str, scope: SessionScope, preview_domain: &str) -> String {
    let ttl = SESSION_TTL.as_secs();
    match scope {
        SessionScope::Web => {
            format!("{WEB_COOKIE}={token}; Path=/; HttpOnly; Secure; SameSite=Lax; Max-Age={ttl}")
        }
        SessionScope::Preview => format!(
            "{PREVIEW_COOKIE}={token}; Domain={preview_domain}; Path=/; HttpOnly; Secure; \
             SameSite=Lax; Max-Age={ttl}"
        ),
    }
}

/// Whether a form post comes from a page of `authority` itself: a browser names the page's
/// origin in `Origin` on every POST and says where the request comes from in `Sec-Fetch-Site`.
/// A client that sends neither (curl, a script) is no browser that another site could drive.
pub(crate) fn same_origin(headers: &http::HeaderMap, authority: &str) -> bool {
    if let Some(site) = headers.get("sec-fetch-site")
        && site != "same-origin"
        && site != "none"
    {
        return false;
    }
    match headers.get(header::ORIGIN).and_then(|o| o.to_str().ok()) {
        None => true,
        Some(origin) => origin
            .strip_prefix("https://")
            .is_some_and(|o| o.eq_ignore_ascii_case(authority)),
    }
}

/// The port suffix (`:8444`, or empty) of an authority.
fn port_of(authority: &str) -> &str {
    match authority.rfind(':') {
        Some(i) if authority[i + 1..].bytes().all(|b| b.is_ascii_digit()) => &authority[i..],
        _ => "",
    }
}

impl Preview {
    /// The preview domain's login host, with the port the browser used.
    fn login_authority(&self, authority: &str) -> String {
        format!("{LOGIN_LABEL}.{}{}", self.domain, port_of(authority))
    }

    /// `to` when it is a preview URL of this hub (where a login on the login host may send the
    /// browser back to), else None: the login host redirects nowhere else.
    fn preview_return(&self, to: &str) -> Option<String> {
        let uri: http::Uri = to.parse().ok()?;
        if uri.scheme_str() != Some("https") {
            return None;
        }
        let label = uri
            .host()?
            .to_ascii_lowercase()
            .strip_suffix(&format!(".{}", self.domain))?
            .to_owned();
        PreviewName::parse(&label)?;
        Some(uri.to_string())
    }

    /// The answer to a browser without a session on preview host `authority`: to the login
    /// host, which sends it back to `url` afterwards.
    pub(crate) fn login_required(&self, authority: &str, url: &str) -> Response<Body> {
        let to = form_urlencoded::Serializer::new(String::new())
            .append_pair("to", url)
            .finish();
        redirect(
            &format!("https://{}/?{to}", self.login_authority(authority)),
            None,
        )
    }

    /// The login host of the preview domain: its form (`GET /`) and `POST /`.
    pub(crate) async fn preview_login(
        &self,
        req: Request<Incoming>,
        authority: &str,
    ) -> Response<Body> {
        match (req.method(), req.uri().path()) {
            (&Method::GET, "/app.css") => crate::web::css(),
            (&Method::GET, "/") => {
                let to = req.uri().query().and_then(|q| {
                    form_urlencoded::parse(q.as_bytes())
                        .find(|(k, _)| k == "to")
                        .and_then(|(_, v)| self.preview_return(&v))
                });
                full(StatusCode::OK, HTML, key_form(None, "/", to.as_deref()))
            }
            (&Method::POST, "/") => {
                let body = match read_form(req, authority).await {
                    Ok(f) => f,
                    Err(resp) => return resp,
                };
                let to = form_value(&body, "to").and_then(|t| self.preview_return(&t));
                let key = form_value(&body, "key").unwrap_or_default();
                let store = self.store.clone();
                let made = tokio::task::spawn_blocking(move || {
                    login_with_key(&store, key.trim(), SessionScope::Preview)
                })
                .await;
                match made {
                    Ok(Ok(Ok(token))) => {
                        let cookie = session_cookie(&token, SessionScope::Preview, &self.domain);
                        match to {
                            Some(to) => redirect(&to, Some(cookie)),
                            None => {
                                let mut r = full(
                                    StatusCode::OK,
                                    HTML,
                                    page(
                                        "Spur hub: logged in",
                                        Chrome::Login,
                                        "<p>Logged in: this browser may open previews.</p>",
                                    ),
                                );
                                if let Ok(v) = HeaderValue::try_from(cookie) {
                                    r.headers_mut().insert(header::SET_COOKIE, v);
                                }
                                r
                            }
                        }
                    }
                    Ok(Ok(Err(refused))) => full(
                        StatusCode::UNAUTHORIZED,
                        HTML,
                        key_form(Some(&refused), "/", to.as_deref()),
                    ),
                    _ => unavailable(),
                }
            }
            _ => full(StatusCode::NOT_FOUND, TEXT, "not found\n".into()),
        }
    }

    /// The web view's `/login` and `/logout`; the request back for any other path.
    pub(crate) async fn web_login(
        &self,
        req: Request<Incoming>,
        authority: &str,
    ) -> Result<Response<Body>, Request<Incoming>> {
        match (req.method(), req.uri().path()) {
            (&Method::POST, "/logout") => {
                if !same_origin(req.headers(), authority) {
                    return Ok(cross_site());
                }
                if let Some(token) = cookie(req.headers(), WEB_COOKIE) {
                    let (store, token) = (self.store.clone(), token.to_owned());
                    let _ = tokio::task::spawn_blocking(move || store.end_session(&token)).await;
                }
                let clear =
                    format!("{WEB_COOKIE}=; Path=/; HttpOnly; Secure; SameSite=Lax; Max-Age=0");
                Ok(redirect("/login", Some(clear)))
            }
            (_, "/logout") => Ok(method_not_allowed("POST")),
            (&Method::GET, "/login") => {
                let code = req.uri().query().and_then(|q| {
                    form_urlencoded::parse(q.as_bytes())
                        .find(|(k, _)| k == "code")
                        .map(|(_, v)| v.into_owned())
                });
                let Some(code) = code else {
                    return Ok(full(StatusCode::OK, HTML, key_form(None, "/login", None)));
                };
                let (store, peek) = (self.store.clone(), code.clone());
                let key = tokio::task::spawn_blocking(move || store.login_code_key(&peek)).await;
                Ok(match key {
                    Ok(Ok(Some(name))) => full(StatusCode::OK, HTML, code_form(&code, &name)),
                    Ok(Ok(None)) => full(
                        StatusCode::UNAUTHORIZED,
                        HTML,
                        key_form(Some("That login link is used or expired."), "/login", None),
                    ),
                    _ => unavailable(),
                })
            }
            (&Method::POST, "/login") => {
                let body = match read_form(req, authority).await {
                    Ok(f) => f,
                    Err(resp) => return Ok(resp),
                };
                let store = self.store.clone();
                let made = if let Some(code) = form_value(&body, "code") {
                    tokio::task::spawn_blocking(move || {
                        Ok(store
                            .redeem_login_code(&code, SESSION_TTL)?
                            .ok_or_else(|| "That login link is used or expired.".to_owned()))
                    })
                    .await
                } else {
                    let key = form_value(&body, "key").unwrap_or_default();
                    tokio::task::spawn_blocking(move || {
                        login_with_key(&store, key.trim(), SessionScope::Web)
                    })
                    .await
                };
                Ok(match made {
                    Ok(Ok(Ok(token))) => redirect(
                        "/",
                        Some(session_cookie(&token, SessionScope::Web, &self.domain)),
                    ),
                    Ok(Ok(Err(refused))) => full(
                        StatusCode::UNAUTHORIZED,
                        HTML,
                        key_form(Some(&refused), "/login", None),
                    ),
                    _ => unavailable(),
                })
            }
            (_, "/login") => Ok(method_not_allowed("GET or POST")),
            _ => Err(req),
        }
    }
}

/// A session of `scope` for API key `key`, or why not: unknown or revoked, or a key of no hub
/// user (made before users existed), which may see nothing until an admin binds it.
fn login_with_key(
    store: &crate::Store,
    key: &str,
    scope: SessionScope,
) -> Result<Result<String, String>, crate::Error> {
    match store.principal_for_key(key)? {
        None => Ok(Err("Unknown or revoked API key.".into())),
        Some(crate::store::Principal { key, user: None }) => {
            Ok(Err(crate::store::Principal::unbound_message(&key)))
        }
        Some(p) => store.create_session(&p.key, SESSION_TTL, scope).map(Ok),
    }
}

/// The body of a form post from a page of `authority`, or the answer that refuses it.
async fn read_form(
    req: Request<Incoming>,
    authority: &str,
) -> Result<bytes::Bytes, Response<Body>> {
    if !same_origin(req.headers(), authority) {
        return Err(cross_site());
    }
    match http_body_util::Limited::new(req.into_body(), MAX_FORM)
        .collect()
        .await
    {
        Ok(b) => Ok(b.to_bytes()),
        Err(_) => Err(full(
            StatusCode::PAYLOAD_TOO_LARGE,
            TEXT,
            "form too large\n".into(),
        )),
    }
}

fn cross_site() -> Response<Body> {
    full(
        StatusCode::FORBIDDEN,
        TEXT,
        "refused: this form may be posted only from the hub's own page\n".into(),
    )
}

fn method_not_allowed(allowed: &str) -> Response<Body> {
    full(
        StatusCode::METHOD_NOT_ALLOWED,
        TEXT,
        format!("{allowed} only\n"),
    )
}

fn unavailable() -> Response<Body> {
    full(
        StatusCode::SERVICE_UNAVAILABLE,
        TEXT,
        "cannot check credentials now\n".into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_are_scoped() {
        let web = session_cookie("t", SessionScope::Web, "preview.test");
        assert!(web.starts_with("__Host-spur_hub=t; Path=/;"), "{web}");
        assert!(web.contains("Secure") && web.contains("HttpOnly"), "{web}");
        assert!(!web.contains("Domain"), "{web}");
        let preview = session_cookie("t", SessionScope::Preview, "preview.test");
        assert!(
            preview.starts_with("spur_preview=t; Domain=preview.test;"),
            "{preview}"
        );
    }

    #[test]
    fn only_same_origin_posts() {
        let h = |pairs: &[(&'static str, &'static str)]| {
            let mut h = http::HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, HeaderValue::from_static(v));
            }
            h
        };
        assert!(same_origin(&h(&[]), "hub.test:8444"));
        assert!(same_origin(
            &h(&[
                ("origin", "https://hub.test:8444"),
                ("sec-fetch-site", "same-origin")
            ]),
            "hub.test:8444"
        ));
        for bad in [
            h(&[("origin", "https://evil.test")]),
            h(&[("origin", "null")]),
            h(&[("origin", "http://hub.test:8444")]),
            h(&[("sec-fetch-site", "same-site")]),
            h(&[("sec-fetch-site", "cross-site")]),
        ] {
            assert!(!same_origin(&bad, "hub.test:8444"), "{bad:?}");
        }
    }

    #[test]
    fn ports() {
        assert_eq!(port_of("a.test:8444"), ":8444");
        assert_eq!(port_of("a.test"), "");
    }
}
