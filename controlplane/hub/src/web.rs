//! The web view, served by the hub on its own host (`--web-host`, never a preview host): clusters
//! (connected or not, last seen), each cluster's sandboxes (forks, routing key, readiness, time
//! to live, preview links, smart-test verdict) and route groups; per sandbox, a traffic tab and
//! a test-results tab (`crate::smarttests`). Server-rendered HTML that reads fine with JavaScript
//! off; with it on, a small script (no external assets) listens to `/events` (server-sent events)
//! and swaps in the fresh table when anything changes. Login: an API key posted to `/login`, or a
//! one-time code from `spur-hub login-link` posted from the page its link opens; either sets the
//! host-only cookie [`WEB_COOKIE`]. Every page the hub writes carries [`hub_headers`]
//! (`crate::browser`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};

use crate::browser::hub_headers;
use crate::catalog::ClusterView;
use crate::html::{ago, esc, human};
use crate::preview::{Body, Caller, Preview, preview_url};
use crate::store::{Principal, SessionScope};
use crate::users::HubUser;

const CSS: &str = r#"
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 20px;display:flex;justify-content:space-between;align-items:center}
header h1{font-size:17px;margin:0} header a{color:#cfd6e4}
main{padding:12px 20px;max-width:1200px}
h2{font-size:15px;margin:18px 0 6px} h3{font-size:14px;margin:12px 0 4px;color:#445}
table{border-collapse:collapse;width:100%;background:#fff;margin-bottom:8px}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid #e3e6ec;vertical-align:top}
th{background:#eef0f4;font-weight:600;font-size:12px;text-transform:uppercase;color:#556}
code{font-size:12px;background:#eef0f4;padding:1px 4px;border-radius:3px}
.ok{color:#137333;font-weight:600} .bad{color:#b3261e;font-weight:600} .dim{color:#778}
.live{font-size:12px;color:#cfd6e4} form.login{background:#fff;padding:20px;max-width:420px}
input[type=password]{width:100%;padding:6px;margin:8px 0}
form.filter{background:#fff;padding:8px;margin-bottom:8px} form.filter input{padding:3px}
pre{white-space:pre-wrap;word-break:break-all;font-size:12px;background:#f6f7f9;padding:4px;margin:2px 0}
details summary{cursor:pointer} .detail h3{margin:8px 0 2px}
form.logout{display:inline} form.logout button{background:none;border:0;padding:0;color:#cfd6e4;text-decoration:underline;cursor:pointer;font:inherit}
"#;

const JS: &str = r#"
(function(){
  if(!window.EventSource) return;
  var live=document.getElementById('live'); var pending=false;
  var es=new EventSource('/events');
  es.addEventListener('update',function(){
    if(pending) return; pending=true;
    setTimeout(function(){
      fetch('/?fragment=1',{credentials:'same-origin'}).then(function(r){return r.text()}).then(function(h){
        document.getElementById('main').innerHTML=h; pending=false;
        if(live) live.textContent='live · updated '+new Date().toLocaleTimeString();
      }).catch(function(){pending=false});
    },150);
  });
  es.onopen=function(){ if(live) live.textContent='live'; };
  es.onerror=function(){ if(live) live.textContent='reconnecting…'; };
})();
"#;

pub(crate) fn full(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    hub_headers(h);
    r
}

pub(crate) fn redirect(to: &str, cookie: Option<String>) -> Response<Body> {
    let mut r = full(
        StatusCode::SEE_OTHER,
        "text/plain; charset=utf-8",
        String::new(),
    );
    if let Ok(v) = HeaderValue::try_from(to) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    if let Some(c) = cookie.and_then(|c| HeaderValue::try_from(c).ok()) {
        r.headers_mut().insert(header::SET_COOKIE, c);
    }
    r
}

/// Logging out is a POST (a cross-site link cannot end a session).
const LOGOUT: &str =
    "<form class=logout method=post action=\"/logout\"><button type=submit>log out</button></form>";

/// What surrounds a page's content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Chrome {
    /// The login form: no session, so no log-out link and no script.
    Login,
    /// A page that stays as rendered (the traffic tab): the overview's script would replace it.
    Static,
    /// The overview: its script follows `/events` and swaps in fresh tables.
    Live,
}

pub(crate) fn page(title: &str, chrome: Chrome, main: &str) -> String {
    let (header, script) = match chrome {
        Chrome::Login => ("", ""),
        Chrome::Static => (LOGOUT, ""),
        Chrome::Live => (
            "<span class=live id=live>static (JavaScript off)</span> <form class=logout method=post action=\"/logout\"><button type=submit>log out</button></form>",
            "<script src=\"/app.js\"></script>",
        ),
    };
    format!(
        "<!doctype html><html lang=en><head><meta charset=utf-8>\
         <meta name=viewport content=\"width=device-width,initial-scale=1\">\
         <title>{}</title><link rel=stylesheet href=\"/app.css\"></head><body>\
         <header><h1>Spur hub</h1><div>{header}</div></header><main id=main>{main}</main>\
         {script}</body></html>",
        esc(title)
    )
}

/// The stylesheet of every hub page.
pub(crate) fn css() -> Response<Body> {
    full(StatusCode::OK, "text/css; charset=utf-8", CSS.into())
}

impl Preview {
    /// The web view's routes (after authentication). `authority` is the request's host and port
    /// as the browser sent them (what its `Origin` must match).
    pub(crate) async fn web(&self, req: Request<Incoming>, authority: &str) -> Response<Body> {
        let req = match self.web_login(req, authority).await {
            Ok(resp) => return resp,
            Err(req) => req,
        };
        match (req.method(), req.uri().path()) {
            (&Method::GET, "/app.css") => return css(),
            (&Method::GET, "/app.js") => {
                return full(StatusCode::OK, "text/javascript; charset=utf-8", JS.into());
            }
            (&Method::GET, "/healthz") => {
                return full(StatusCode::OK, "text/plain; charset=utf-8", "ok\n".into());
            }
            _ => {}
        }
        let user = match self.authenticate(req.headers(), SessionScope::Web).await {
            Ok(Caller::User(user)) => user,
            Ok(Caller::Nobody) => return redirect("/login", None),
            Ok(Caller::Unbound(key)) => {
                return full(
                    StatusCode::FORBIDDEN,
                    "text/plain; charset=utf-8",
                    format!("{}\n", Principal::unbound_message(&key)),
                );
            }
            Err(_) => {
                return full(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain; charset=utf-8",
                    "cannot check credentials now\n".into(),
                );
            }
        };
        match (req.method(), req.uri().path()) {
            (&Method::GET, "/") => {
                let main = self.render(&user).await;
                if req.uri().query() == Some("fragment=1") {
                    full(StatusCode::OK, "text/html; charset=utf-8", main)
                } else {
                    full(
                        StatusCode::OK,
                        "text/html; charset=utf-8",
                        page("Spur hub", Chrome::Live, &main),
                    )
                }
            }
            (&Method::GET, "/events") => self.events(),
            (&Method::GET, "/traffic") => {
                let params =
                    crate::traffic::TrafficParams::parse(req.uri().query().unwrap_or_default());
                if params.cluster.is_empty() || params.sandbox.is_empty() {
                    return full(
                        StatusCode::BAD_REQUEST,
                        "text/plain; charset=utf-8",
                        "/traffic needs cluster and sandbox\n".into(),
                    );
                }
                let result = self.traffic_for(&user, &params).await;
                let main = crate::traffic::render(&params, &result, SystemTime::now());
                let title = format!("Traffic of {} · Spur hub", params.sandbox);
                full(
                    StatusCode::OK,
                    "text/html; charset=utf-8",
                    page(&title, Chrome::Static, &main),
                )
            }
            (&Method::GET, "/tests") => {
                let params =
                    crate::smarttests::TestsParams::parse(req.uri().query().unwrap_or_default());
                if params.cluster.is_empty() || params.sandbox.is_empty() {
                    return full(
                        StatusCode::BAD_REQUEST,
                        "text/plain; charset=utf-8",
                        "/tests needs cluster and sandbox\n".into(),
                    );
                }
                let main = self.tests_for(&user, &params).await;
                let title = format!("Tests of {} · Spur hub", params.sandbox);
                full(
                    StatusCode::OK,
                    "text/html; charset=utf-8",
                    page(&title, Chrome::Static, &main),
                )
            }
            _ => full(
                StatusCode::NOT_FOUND,
                "text/plain; charset=utf-8",
                "not found\n".into(),
            ),
        }
    }

    /// A sandbox's smart-test results for `user`: read as the user, like the overview (the
    /// sandbox must be in its view, the runs are those of its view), never from the hub's own
    /// catalog.
    async fn tests_for(&self, user: &HubUser, params: &crate::smarttests::TestsParams) -> String {
        let views = self.views_for(user).await;
        let found = match views.get(&params.cluster) {
            Some(Ok(view)) => view
                .sandboxes
                .get(&params.sandbox)
                .map(|sb| (sb, crate::smarttests::runs_of(sb, view.jobs.values())))
                .ok_or_else(|| {
                    format!(
                        "no sandbox {:?} that you may see in cluster {:?}",
                        params.sandbox, params.cluster
                    )
                }),
            Some(Err(e)) => Err(format!("cannot read cluster {:?}: {e}", params.cluster)),
            None => Err(format!(
                "no cluster {:?} that you may see is connected",
                params.cluster
            )),
        };
        crate::smarttests::render(params, found, SystemTime::now())
    }

    /// Server-sent events: `update` whenever a cluster connects or leaves or any object changes
    /// (bursts coalesced), and a comment every 15 s to keep proxies from closing the stream.
    fn events(&self) -> Response<Body> {
        let mut catalog = self.catalog.changes();
        let mut clusters = self.clusters.changes();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, hyper::Error>>(4);
        tokio::spawn(async move {
            let _ = tx
                .send(Ok(Frame::data(Bytes::from_static(b"retry: 2000\n\n"))))
                .await;
            loop {
                let frame = tokio::select! {
                    r = catalog.changed() => match r { Ok(()) => "event: update\ndata: catalog\n\n", Err(_) => return },
                    r = clusters.changed() => match r { Ok(()) => "event: update\ndata: clusters\n\n", Err(_) => return },
                    () = tokio::time::sleep(Duration::from_secs(15)) => ":\n\n",
                    () = tx.closed() => return,
                };
                if tx
                    .send(Ok(Frame::data(Bytes::from_static(frame.as_bytes()))))
                    .await
                    .is_err()
                {
                    return;
                }
                // Coalesce a burst of changes into one update.
                tokio::time::sleep(Duration::from_millis(100)).await;
                catalog.borrow_and_update();
                clusters.borrow_and_update();
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let mut r = Response::new(StreamBody::new(stream).boxed_unsync());
        let h = r.headers_mut();
        hub_headers(h);
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        r
    }

    /// Preview links to `endpoints` of `owner` in `cluster`, or `-` when it has none.
    fn links(
        &self,
        endpoints: &[spur_api::sandbox::Endpoint],
        owner: &str,
        cluster: &str,
    ) -> String {
        if endpoints.is_empty() {
            return "-".into();
        }
        let links: Vec<String> = endpoints
            .iter()
            .map(|e| {
                let url = preview_url(&self.domain, &e.name, owner, Some(cluster));
                format!("<a href=\"{}\">{}</a>", esc(&url), esc(&e.name))
            })
            .collect();
        links.join(" ")
    }

    /// A sandbox's traffic for `user`: refused unless the user may see the cluster and the
    /// sandbox (one the hub knows of in namespaces all in the user's scope, or any sandbox for
    /// a user who may see every namespace); then read through the agent as the user's
    /// Kubernetes identity, which the agent checks again.
    async fn traffic_for(
        &self,
        user: &HubUser,
        params: &crate::traffic::TrafficParams,
    ) -> Result<spur_proto::traffic::QueryReply, crate::Error> {
        let hidden = || {
            crate::Error::NotFound(format!(
                "no sandbox {:?} that you may see in cluster {:?}",
                params.sandbox, params.cluster
            ))
        };
        let (Some(scope), Some(as_user)) =
            (user.scope(&params.cluster), user.identity(&params.cluster))
        else {
            return Err(hidden());
        };
        let known = self
            .catalog
            .snapshot()
            .get(&params.cluster)
            .and_then(|v| v.sandboxes.get(&params.sandbox).cloned());
        let visible = match known {
            Some(sb) => scope
                .namespaces
                .cover(&crate::namespaces::sandbox_namespaces(&sb)),
            // A sandbox gone (its exchanges may remain): for users who may see everything.
            None => scope.namespaces.is_all(),
        };
        if !visible {
            return Err(hidden());
        }
        crate::traffic::read(&self.clusters, params, as_user).await
    }

    /// What `user` may see of every connected cluster in its scope, read through each agent as
    /// the user's Kubernetes identity (the agent checks it), then filtered by the user's hub
    /// scope too. Clusters outside the scope are never asked.
    async fn views_for(&self, user: &HubUser) -> BTreeMap<String, Result<ClusterView, String>> {
        let mut reads = tokio::task::JoinSet::new();
        for (cluster, _) in self.clusters.connected() {
            let Some(as_user) = user.identity(&cluster) else {
                continue;
            };
            let clusters = self.clusters.clone();
            reads.spawn(async move {
                let read = tokio::time::timeout(
                    USER_READ_TIMEOUT,
                    crate::catalog::read_as(&clusters, &cluster, &as_user),
                )
                .await;
                let view = match read {
                    Ok(Ok(v)) => Ok(v),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("no answer within {USER_READ_TIMEOUT:?}")),
                };
                (cluster, view)
            });
        }
        let mut views = BTreeMap::new();
        while let Some(done) = reads.join_next().await {
            if let Ok((cluster, view)) = done {
                let view = view.map(|v| user.filter(&cluster, &v));
                views.insert(cluster, view);
            }
        }
        views
    }

    /// The page's main content for `user`: only the clusters in its scope, and of each only
    /// what it may see.
    pub async fn render(&self, user: &HubUser) -> String {
        let store = self.store.clone();
        let registered = tokio::task::spawn_blocking(move || store.clusters())
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let connected = self.clusters.connected();
        let read = self.views_for(user).await;
        let now = SystemTime::now();
        let mut out = String::new();
        let _ = write!(
            out,
            "<p class=dim>Signed in as hub user <code>{}</code>.</p>",
            esc(&user.name)
        );
        if user.clusters.is_empty() {
            out.push_str(
                "<p class=bad>Your hub user may see no cluster yet: an admin gives it a scope \
                 with <code>spur-hub user set</code>.</p>",
            );
        }
        let mut views = BTreeMap::new();
        for (cluster, view) in &read {
            match view {
                Ok(v) => {
                    views.insert(cluster.clone(), v.clone());
                }
                Err(e) => {
                    let _ = write!(
                        out,
                        "<p class=bad>Cannot read cluster {}: {}</p>",
                        esc(cluster),
                        esc(e)
                    );
                }
            }
        }
        out.push_str("<h2>Clusters</h2><table><tr><th>Cluster</th><th>Status</th><th>Transport</th><th>Connected since</th><th>Last seen</th><th>Sandboxes</th></tr>");
        for c in registered.iter().filter(|c| user.scope(&c.name).is_some()) {
            let live = connected.iter().find(|(n, _)| *n == c.name).map(|(_, s)| s);
            let status = match (c.revoked.is_some(), live) {
                (true, _) => "<span class=bad>revoked</span>".to_owned(),
                (false, Some(_)) => match self.clusters.sessions(&c.name) {
                    n @ 2.. => format!("<span class=ok>connected</span> ({n} agents)"),
                    _ => "<span class=ok>connected</span>".to_owned(),
                },
                (false, None) => "<span class=dim>disconnected</span>".to_owned(),
            };
            let sandboxes = views.get(&c.name).map_or(0, |v| v.sandboxes.len());
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{status}</td><td>{}</td><td>{}</td><td>{}</td><td>{sandboxes}</td></tr>",
                esc(&c.name),
                live.map_or("-", |s| s.session.transport().as_str()),
                live.map_or_else(|| "-".into(), |s| ago(now, s.since)),
                c.last_seen.map_or_else(|| "never".into(), |t| ago(now, t)),
            );
        }
        out.push_str("</table>");
        for (cluster, view) in &views {
            let _ = write!(out, "<h2>Sandboxes in {}</h2>", esc(cluster));
            if !view.synced {
                out.push_str("<p class=dim>loading…</p>");
            }
            out.push_str("<table><tr><th>Sandbox</th><th>Routing key</th><th>Ready</th><th>Forks</th><th>TTL left</th><th>Previews</th><th>Traffic</th><th>Tests</th></tr>");
            if view.sandboxes.is_empty() {
                out.push_str("<tr><td colspan=8 class=dim>none</td></tr>");
            }
            for (name, sb) in &view.sandboxes {
                let status = sb.status.as_ref();
                let ready = status
                    .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
                    .map_or("<span class=dim>unknown</span>".to_owned(), |c| {
                        if c.status == "True" {
                            "<span class=ok>ready</span>".into()
                        } else {
                            format!(
                                "<span class=bad title=\"{}\">{}</span>",
                                esc(&c.message),
                                esc(&c.reason)
                            )
                        }
                    });
                let forks: Vec<String> = sb
                    .spec
                    .forks
                    .iter()
                    .map(|f| {
                        format!(
                            "<code>{}/{}</code>",
                            esc(&f.fork_of.namespace),
                            esc(&f.fork_of.name)
                        )
                    })
                    .collect();
                let ttl = status.and_then(|s| s.expires_at.as_ref()).map_or_else(
                    || "-".into(),
                    |t| match SystemTime::from(t.0).duration_since(now) {
                        Ok(left) if left.as_secs() > 0 => human(left),
                        _ => "expiring".into(),
                    },
                );
                let endpoints = sb
                    .spec
                    .default_route_group
                    .as_ref()
                    .map(|g| g.endpoints.as_slice())
                    .unwrap_or_default();
                // Captured exchanges may outlive a capture switched off: the link stays.
                let capturing = sb.spec.capture.as_ref().is_some_and(|c| c.enabled);
                let traffic_link = format!(
                    "<a href=\"/traffic?{}\">{}</a>",
                    esc(&form_urlencoded::Serializer::new(String::new())
                        .append_pair("cluster", cluster)
                        .append_pair("sandbox", name)
                        .finish()),
                    if capturing {
                        "capturing"
                    } else {
                        "capture off"
                    },
                );
                let (tests, class) = crate::smarttests::verdict(sb).unwrap_or(("none", "dim"));
                let tests_link = format!(
                    "<a class={class} href=\"{}\">{tests}</a>",
                    esc(&crate::smarttests::TestsParams::href(cluster, name))
                );
                let _ = write!(
                    out,
                    "<tr><td>{}</td><td><code>{}</code></td><td>{ready}</td><td>{}</td><td>{ttl}</td><td>{}</td><td>{traffic_link}</td><td>{tests_link}</td></tr>",
                    esc(name),
                    esc(status.and_then(|s| s.routing_key.as_deref()).unwrap_or("-")),
                    forks.join(" "),
                    self.links(endpoints, name, cluster),
                );
            }
            out.push_str("</table>");
            let routes: Vec<_> = view
                .routing_configs
                .values()
                .flat_map(|rc| {
                    let key = rc.spec.routing_key.as_str();
                    rc.status
                        .iter()
                        .filter_map(|st| st.route_server.as_ref())
                        .flat_map(|r| &r.routes)
                        .map(move |r| (key, r))
                })
                .collect();
            if !routes.is_empty() {
                let _ = write!(out, "<h3>Routes the sidecars in {} hold</h3>", esc(cluster));
                out.push_str("<table><tr><th>Baseline</th><th>Port</th><th>Routing key</th><th>To</th><th>Sandbox</th></tr>");
                for (key, r) in routes {
                    let _ = write!(
                        out,
                        "<tr><td><code>{}/{}</code></td><td>{}</td><td><code>{}</code></td><td><code>{}:{}</code></td><td>{}</td></tr>",
                        esc(&r.baseline.namespace),
                        esc(&r.baseline.name),
                        r.workload_port,
                        esc(key),
                        esc(&r.to_host),
                        r.to_port,
                        esc(&r.sandbox),
                    );
                }
                out.push_str("</table>");
            }
            if !view.jobs.is_empty() {
                let _ = write!(out, "<h3>Jobs in {}</h3>", esc(cluster));
                out.push_str("<table><tr><th>Job</th><th>Runner group</th><th>Routing context</th><th>Phase</th><th>Exit code</th><th>Attempts</th></tr>");
                // Newest first: the latest runs are what people look for.
                let mut jobs: Vec<(&String, &spur_api::Job)> = view.jobs.iter().collect();
                jobs.sort_by(|a, b| {
                    b.1.metadata
                        .creation_timestamp
                        .cmp(&a.1.metadata.creation_timestamp)
                        .then(a.0.cmp(b.0))
                });
                for (key, job) in jobs.into_iter().take(MAX_JOBS_SHOWN) {
                    let st = job.status.clone().unwrap_or_default();
                    let context = job
                        .spec
                        .routing_context
                        .as_ref()
                        .and_then(|rc| {
                            rc.sandbox
                                .as_ref()
                                .map(|s| format!("sandbox {s}"))
                                .or_else(|| {
                                    rc.route_group.as_ref().map(|g| format!("route group {g}"))
                                })
                        })
                        .unwrap_or_else(|| "baselines".into());
                    let _ = write!(
                        out,
                        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                        esc(key),
                        esc(&job.spec.runner_group),
                        esc(&context),
                        st.phase.map_or("Queued", spur_api::jobs::JobPhase::as_str),
                        st.exit_code
                            .map(|c| c.to_string())
                            .unwrap_or_else(|| "-".into()),
                        st.attempts.len(),
                    );
                }
                out.push_str("</table>");
            }
            if !view.route_groups.is_empty() {
                let _ = write!(out, "<h3>Route groups in {}</h3>", esc(cluster));
                out.push_str("<table><tr><th>Route group</th><th>Routing key</th><th>Sandboxes</th><th>Previews</th></tr>");
                for (name, rg) in &view.route_groups {
                    let status = rg.status.as_ref();
                    let _ = write!(
                        out,
                        "<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>",
                        esc(name),
                        esc(status.and_then(|s| s.routing_key.as_deref()).unwrap_or("-")),
                        esc(&status
                            .map(|s| s.matched_sandboxes.join(", "))
                            .unwrap_or_default()),
                        self.links(&rg.spec.endpoints, name, cluster),
                    );
                }
                out.push_str("</table>");
            }
        }
        out
    }
}

/// How long reading one cluster for a page may take.
const USER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Jobs listed per cluster (the newest); the rest are a `spur job list` away.
const MAX_JOBS_SHOWN: usize = 50;

/// Value of field `name` in an `application/x-www-form-urlencoded` body.
pub(crate) fn form_value(body: &[u8], name: &str) -> Option<String> {
    form_urlencoded::parse(body)
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::browser::{WEB_COOKIE, cookie};

    #[test]
    fn escaping_and_forms() {
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
        assert_eq!(
            form_value(b"a=1&key=spurk_ab%2Bc+d", "key").as_deref(),
            Some("spurk_ab+c d")
        );
        assert_eq!(form_value(b"key=%", "key").as_deref(), Some("%"));
        assert_eq!(form_value(b"key=%4", "key").as_deref(), Some("%4"));
        assert_eq!(form_value(b"key=%zz", "key").as_deref(), Some("%zz"));
        assert_eq!(form_value(b"x=1", "key"), None);
    }

    #[test]
    fn cookies() {
        let mut h = http::HeaderMap::new();
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; __Host-spur_hub=spurs_x"),
        );
        h.append(header::COOKIE, HeaderValue::from_static("b=2"));
        assert_eq!(cookie(&h, WEB_COOKIE), Some("spurs_x"));
        assert_eq!(cookie(&h, "b"), Some("2"));
        assert_eq!(cookie(&h, "c"), None);
    }
}
