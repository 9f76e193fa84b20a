//! The aggregated API (`jobs.spur.dev/v1alpha1`, APIService `v1alpha1.jobs.spur.dev`): job logs
//! and artifacts, served through the Kubernetes API server, which authenticates and authorizes
//! every request before it proxies it here. RBAC decides who reads what:
//!
//! ```text
//! GET /apis/jobs.spur.dev/v1alpha1/namespaces/NS/jobs/NAME/log[?attempt=N][&follow=true]   verb get, resource jobs/log
//! GET /apis/jobs.spur.dev/v1alpha1/namespaces/NS/jobs/NAME/artifacts                       verb get, resource jobs/artifacts (JSON list)
//! GET /apis/jobs.spur.dev/v1alpha1/namespaces/NS/jobs/NAME/artifacts?path=P[&attempt=N]    (the file)
//! ```
//!
//! Only the API server can call: connections must present a client certificate of the
//! front-proxy CA (`requestheader-client-ca-file` of ConfigMap
//! `kube-system/extension-apiserver-authentication`) with an allowed name.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use spur_api::Job;
use spur_api::jobs::JobPhase;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{Context, Error};

mod runner_log;

pub const GROUP: &str = "jobs.spur.dev";
pub const VERSION: &str = "v1alpha1";
/// The APIService the component keeps the `caBundle` of.
pub const API_SERVICE: &str = "v1alpha1.jobs.spur.dev";
const CHUNK: usize = 64 * 1024;

type Body = BoxBody<Bytes, Infallible>;

/// What the API server's front proxy presents (from the extension-apiserver-authentication
/// ConfigMap).
#[derive(Debug, Clone)]
pub struct FrontProxy {
    pub client_ca_pem: String,
    pub allowed_names: Vec<String>,
    pub username_headers: Vec<String>,
}

impl FrontProxy {
    /// Reads `kube-system/extension-apiserver-authentication`.
    pub async fn load(client: &kube::Client) -> Result<Self, Error> {
        let cm = Api::<ConfigMap>::namespaced(client.clone(), "kube-system")
            .get("extension-apiserver-authentication")
            .await?;
        let data = cm.data.unwrap_or_default();
        let ca = data
            .get("requestheader-client-ca-file")
            .filter(|s| !s.trim().is_empty())
            .cloned()
            .ok_or_else(|| {
                Error::Config(
                    "the API server has no front-proxy CA (requestheader-client-ca-file): it cannot call aggregated APIs".into(),
                )
            })?;
        let list = |k: &str| -> Vec<String> {
            data.get(k)
                .and_then(|v| serde_json::from_str(v).ok())
                .unwrap_or_default()
        };
        let mut username_headers = list("requestheader-username-headers");
        if username_headers.is_empty() {
            username_headers.push("X-Remote-User".into());
        }
        Ok(FrontProxy {
            client_ca_pem: ca,
            allowed_names: list("requestheader-allowed-names"),
            username_headers,
        })
    }
}

/// Serving certificate names: the Service in front of the component.
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// Puts the jobs CA into the APIService's `caBundle`, so the API server trusts this server.
pub async fn sync_api_service(client: &kube::Client, ca_pem: &str) -> Result<(), Error> {
    use k8s_openapi::ByteString;
    let api: Api<kube::api::DynamicObject> = Api::all_with(
        client.clone(),
        &kube::api::ApiResource {
            group: "apiregistration.k8s.io".into(),
            version: "v1".into(),
            api_version: "apiregistration.k8s.io/v1".into(),
            kind: "APIService".into(),
            plural: "apiservices".into(),
        },
    );
    let body = serde_json::json!({
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": API_SERVICE},
        "spec": {"caBundle": ByteString(ca_pem.as_bytes().to_vec())},
    });
    match api
        .patch(API_SERVICE, &PatchParams::default(), &Patch::Merge(&body))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => {
            tracing::warn!(
                apiservice = API_SERVICE,
                "no APIService: job logs are not reachable through the API server (install the chart's)"
            );
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// The TLS configuration: our serving certificate, the front proxy's client CA required.
pub fn tls_config(
    cert_pem: &str,
    key_pem: &str,
    fp: &FrontProxy,
) -> Result<Arc<rustls::ServerConfig>, Error> {
    let err = |e: &dyn std::fmt::Display| Error::Pki(e.to_string());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(fp.client_ca_pem.as_bytes()) {
        roots.add(c.map_err(|e| err(&e))?).map_err(|e| err(&e))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| err(&e))?;
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(&e))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| err(&e))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| err(&e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| err(&e))?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The common name of a DER certificate.
fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_owned)
}

/// Serves until `stop`.
pub async fn serve(
    ctx: Arc<Context>,
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    fp: FrontProxy,
    stop: CancellationToken,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let fp = Arc::new(fp);
    let tasks = tokio_util::task::TaskTracker::new();
    while let Some((tcp, peer)) =
        spur_runtime::accept(&listener, stop.cancelled(), "jobs API").await
    {
        let (acceptor, ctx, fp, stop) = (acceptor.clone(), ctx.clone(), fp.clone(), stop.clone());
        tasks.spawn(async move {
            let tls =
                match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "jobs API: TLS handshake refused");
                        return;
                    }
                    Err(_) => return,
                };
            let cn = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(|c| common_name(c));
            if !fp.allowed_names.is_empty()
                && !cn.as_ref().is_some_and(|n| fp.allowed_names.contains(n))
            {
                tracing::warn!(%peer, cn = ?cn, "jobs API: client certificate name not allowed");
                return;
            }
            let svc = hyper::service::service_fn(move |req| {
                let (ctx, fp) = (ctx.clone(), fp.clone());
                async move { Ok::<_, Infallible>(handle(ctx, &fp, peer, req).await) }
            });
            // Request heads, HTTP/2 keep-alive and a silent client all have deadlines.
            let io = hyper_util::rt::TokioIo::new(tls);
            spur_runtime::serve::serve_connection(io, svc, &stop, Duration::from_secs(5)).await;
        });
    }
    tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), tasks.wait()).await;
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

/// A Kubernetes `Status` error, as clients of the API server expect.
fn status_error(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    });
    full(code, "application/json", body.to_string())
}

fn discovery() -> Response<Body> {
    let resource = |name: &str, kind: &str| serde_json::json!({"name": name, "singularName": "", "namespaced": true, "kind": kind, "verbs": ["get"]});
    let body = serde_json::json!({
        "kind": "APIResourceList", "apiVersion": "v1",
        "groupVersion": format!("{GROUP}/{VERSION}"),
        "resources": [resource("jobs/log", "JobLog"), resource("jobs/artifacts", "JobArtifacts")],
    });
    full(StatusCode::OK, "application/json", body.to_string())
}

fn query(req: &Request<Incoming>, key: &str) -> Option<String> {
    let q = req.uri().query()?;
    form_urlencoded::parse(q.as_bytes())
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

async fn handle(
    ctx: Arc<Context>,
    fp: &FrontProxy,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Response<Body> {
    if req.method() != Method::GET {
        return status_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "only get is supported",
        );
    }
    let user = fp
        .username_headers
        .iter()
        .find_map(|h| req.headers().get(h.as_str()))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let path = req.uri().path().to_owned();
    let prefix = format!("/apis/{GROUP}/{VERSION}");
    if path == prefix || path == format!("{prefix}/") {
        return discovery();
    }
    if path == "/apis" || path == format!("/apis/{GROUP}") {
        let body = serde_json::json!({
            "kind": "APIGroup", "apiVersion": "v1", "name": GROUP,
            "versions": [{"groupVersion": format!("{GROUP}/{VERSION}"), "version": VERSION}],
            "preferredVersion": {"groupVersion": format!("{GROUP}/{VERSION}"), "version": VERSION},
        });
        return full(StatusCode::OK, "application/json", body.to_string());
    }
    let Some(rest) = path.strip_prefix(&format!("{prefix}/namespaces/")) else {
        return status_error(StatusCode::NOT_FOUND, "NotFound", "not found");
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let [ns, "jobs", name, sub] = parts.as_slice() else {
        return status_error(StatusCode::NOT_FOUND, "NotFound", "not found");
    };
    let (ns, name, sub) = (ns.to_string(), name.to_string(), sub.to_string());
    tracing::debug!(%peer, %user, %ns, %name, %sub, "jobs API request");
    let job = match Api::<Job>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&name)
        .await
    {
        Ok(Some(j)) => j,
        Ok(None) => {
            return status_error(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("jobs.spur.dev \"{name}\" not found"),
            );
        }
        Err(e) => {
            return status_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                &format!("reading the job: {e}"),
            );
        }
    };
    let attempts = job.status.as_ref().map(|s| s.attempts.len()).unwrap_or(0);
    let attempt = match query(&req, "attempt") {
        None => i32::try_from(attempts).unwrap_or(0),
        Some(a) => match a.parse::<i32>() {
            Ok(n) if n >= 1 && usize::try_from(n).is_ok_and(|n| n <= attempts) => n,
            _ => {
                return status_error(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &format!("attempt must be 1 to {attempts}"),
                );
            }
        },
    };
    match sub.as_str() {
        "log" => {
            if attempt == 0 {
                // Not started: nothing yet; a follower waits for the first attempt.
                if query(&req, "follow").as_deref() != Some("true") {
                    return full(StatusCode::OK, "text/plain; charset=utf-8", Bytes::new());
                }
            }
            let follow = query(&req, "follow").as_deref() == Some("true");
            log_response(ctx, job, attempt, follow)
        }
        "artifacts" => {
            artifacts(
                &ctx,
                &job,
                query(&req, "path"),
                query(&req, "attempt").map(|_| attempt),
            )
            .await
        }
        _ => status_error(StatusCode::NOT_FOUND, "NotFound", "not found"),
    }
}

async fn artifacts(
    ctx: &Context,
    job: &Job,
    path: Option<String>,
    attempt: Option<i32>,
) -> Response<Body> {
    let ns = job.namespace().unwrap_or_default();
    let uid = job.uid().unwrap_or_default();
    let list = match ctx.store.artifacts(&ns, &uid).await {
        Ok(l) => l,
        Err(e) => {
            return status_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                &e.to_string(),
            );
        }
    };
    let Some(path) = path else {
        let body = serde_json::json!({"kind": "JobArtifactList", "apiVersion": format!("{GROUP}/{VERSION}"), "items": list});
        return full(StatusCode::OK, "application/json", body.to_string());
    };
    // The latest attempt's copy unless one is named.
    let Some(item) = list
        .iter()
        .filter(|a| a.path == path && attempt.is_none_or(|n| a.attempt == n))
        .max_by_key(|a| a.attempt)
    else {
        return status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("no artifact {path}"),
        );
    };
    match ctx
        .store
        .artifact(&ns, &uid, item.attempt, &item.path)
        .await
    {
        Ok(Some(b)) => {
            let mut r = full(StatusCode::OK, "application/octet-stream", b);
            if let Ok(v) = http::HeaderValue::from_str(&item.sha256) {
                r.headers_mut().insert("x-spur-sha256", v);
            }
            r
        }
        Ok(None) => status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("artifact {path} is listed but missing from the store"),
        ),
        Err(e) => status_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            &e.to_string(),
        ),
    }
}

/// The attempt's log: the sealed copy, or the live spool (followed until it is sealed).
fn log_response(ctx: Arc<Context>, job: Job, attempt: i32, follow: bool) -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    tokio::spawn(async move {
        if let Err(e) = stream_log(&ctx, &job, attempt, follow, &tx).await {
            let _ = tx
                .send(Bytes::from(format!("\n[spur] log stream failed: {e}\n")))
                .await;
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx)
        .map(|b| Ok::<_, Infallible>(Frame::data(b)));
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

use futures_util::StreamExt as _;

async fn stream_log(
    ctx: &Context,
    job: &Job,
    mut attempt: i32,
    follow: bool,
    tx: &mpsc::Sender<Bytes>,
) -> Result<(), Error> {
    let ns = job.namespace().unwrap_or_default();
    let uid = job.uid().unwrap_or_default();
    let name = job.name_any();
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
    let mut offset: u64 = 0;
    let mut buf = vec![0u8; CHUNK];
    let mut opened = ctx.live.opened();
    // The Job as last read (its status names a running attempt's runner), and the attempt whose
    // runner said it has nothing more.
    let mut current = job.clone();
    let mut runner_ended: Option<i32> = None;
    loop {
        if attempt >= 1 {
            if let Some(sealed) = ctx.store.log(&ns, &uid, attempt).await? {
                let from = usize::try_from(offset)
                    .unwrap_or(usize::MAX)
                    .min(sealed.len());
                if from < sealed.len() {
                    let _ = tx.send(sealed.slice(from..)).await;
                }
                return Ok(());
            }
            if let Some(mut live) = ctx.live.watch(&uid, attempt) {
                let st = *live.borrow_and_update();
                if st.bytes > offset {
                    match tokio::fs::File::open(ctx.store.spool_path(&uid, attempt)).await {
                        Ok(mut f) => {
                            f.seek(std::io::SeekFrom::Start(offset))
                                .await
                                .map_err(|e| Error::Store(e.to_string()))?;
                            while offset < st.bytes {
                                let want = usize::try_from(st.bytes - offset)
                                    .unwrap_or(CHUNK)
                                    .min(CHUNK);
                                let n = f
                                    .read(&mut buf[..want])
                                    .await
                                    .map_err(|e| Error::Store(e.to_string()))?;
                                if n == 0 {
                                    break;
                                }
                                offset += n as u64;
                                if tx.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                                    return Ok(());
                                }
                            }
                        }
                        // Sealed meanwhile: the store has it on the next turn.
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                        Err(e) => return Err(Error::Store(e.to_string())),
                    }
                }
                if !follow {
                    return Ok(());
                }
                if !st.sealed {
                    tokio::select! {
                        _ = live.changed() => {}
                        () = tx.closed() => return Ok(()),
                        () = tokio::time::sleep(Duration::from_secs(2)) => {}
                    }
                }
                continue;
            }
            // Not driven here (another replica leads, or this one has not resumed it yet):
            // from the runner, until it has nothing more; the sealed log then has the rest.
            if runner_ended != Some(attempt) {
                match runner_log::read(ctx, &current, attempt, &mut offset, follow, tx).await {
                    Ok(runner_log::Read::Ended) => runner_ended = Some(attempt),
                    Ok(runner_log::Read::More) => {}
                    // Said in the log, as the driving replica's stream does: a reader is not
                    // left with a short log and no word why.
                    Err(e) if !follow => {
                        tracing::info!(%ns, job = %name, attempt, error = %e, "cannot read the attempt's log from its runner");
                        return Err(e);
                    }
                    // A follower goes on: the next turn asks the runner again, or finds the
                    // attempt sealed or lost.
                    Err(e) => {
                        tracing::debug!(%ns, job = %name, attempt, error = %e, "cannot read the attempt's log from its runner")
                    }
                }
                if tx.is_closed() {
                    return Ok(());
                }
            }
        }
        if !follow {
            return Ok(());
        }
        // Not being driven here (not started, or between a lost attempt and the next): look
        // at the job again when an attempt starts somewhere, or shortly.
        opened.borrow_and_update();
        tokio::select! {
            () = tx.closed() => return Ok(()),
            _ = opened.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
        let Some(now) = jobs.get_opt(&name).await? else {
            return Ok(());
        };
        if now.uid() != job.uid() {
            return Ok(());
        }
        let st = now.status.clone().unwrap_or_default();
        current = now;
        let latest = i32::try_from(st.attempts.len()).unwrap_or(0);
        if latest > attempt {
            // Started, or the followed attempt was lost without a log and another began.
            attempt = latest;
            offset = 0;
        } else if st.phase.is_some_and(JobPhase::is_terminal)
            && ctx.store.log(&ns, &uid, attempt).await?.is_none()
        {
            return Ok(());
        }
    }
}
