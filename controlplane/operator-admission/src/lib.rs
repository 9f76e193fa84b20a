//! The operator's admission webhooks, AdmissionReview v1 over TLS (the operator's admission
//! feature, with the sidecar injection it applies, [`inject`], and the exec audit, [`audit`]): sidecar injection on
//! `POST /mutate-v1-pod`, EnvoyConfig validation on
//! `POST /validate-spur-dev-v1alpha1-envoyconfig`, ListenerSet validation on
//! `POST /validate-spur-dev-v1alpha1-listenerset`, and for just-in-time access
//! (docs/access.md) the requester stamp on `POST /mutate-spur-dev-v1alpha1-accessrequest`
//! and the exec audit on `POST /validate-v1-pod-connect` ([`crate::audit`]); Sandboxes get
//! their creator stamped and their workstation checked ([`sandbox`]).
//!
//! Every operator replica serves it (not only the leader). The serving certificate comes from
//! the Secret the certificate manager maintains, through a watch, and is swapped into the TLS
//! acceptor without a restart: new handshakes get the new certificate, established
//! connections keep theirs.
//!
//! Before it injects into a namespace, it makes sure the namespace holds the CA bundle
//! ConfigMap the sidecar trusts the route server with (`routeserverCaConfigMap`); the
//! certificate manager keeps every such copy current. Dry runs change nothing
//! (`sideEffects: NoneOnDryRun`).
//!
//! On any internal fault (API unreachable, ReplicaSet gone) a pod is admitted unchanged with a
//! warning; the webhook configuration's `failurePolicy: Ignore` covers the faults this server
//! cannot answer at all. The exception is a sandbox fork's pod that relays Kafka
//! ([`inject::must_not_run_bare`]): it is refused, and its ReplicaSet retries; the chart's
//! `fork-sidecar.spur.dev` entry has `failurePolicy: Fail` for forks' pods.
//!
//! EnvoyConfig validation does deny: every resource is decoded into its Envoy v3 message
//! ([`spur_envoy`]), and the first that does not decode is refused with status 422 and
//! `spec.resources[i].value: <field path>: <what is wrong>`; so is a node id another
//! EnvoyConfig of the namespace uses ([`spur_operator_xds::envoyconfig::node_id`]). An update that leaves
//! the spec as it was is always allowed, so that a config stored before the webhook existed can
//! still get its finalizer removed. Its webhook configuration has `failurePolicy: Fail`: an
//! EnvoyConfig nobody checked would reach the clients.
//!
//! ListenerSet validation is `ListenerSetSpec::validate` (cheap, answered inline): every
//! problem is refused at once with status 422, each as `<field path>: <what is wrong>`. The
//! same rules as for EnvoyConfigs otherwise: an unchanged spec is allowed, `failurePolicy:
//! Fail`.

pub mod audit;
pub mod inject;
pub mod sandbox;

/// The operator's error, which the injection functions return.
pub use spur_operator_core::Error;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret};
use kube::api::{DynamicObject, PartialObjectMeta};
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use spur_api::envoyconfig::EnvoyConfigSpec;
use spur_api::listenerset::ListenerSetSpec;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use spur_operator_core::Metrics;

use crate::inject::{InjectionConfig, Screen};
use sandbox::{MUTATE_SANDBOX_PATH, VALIDATE_SANDBOX_PATH};

/// The admission path, as in the webhook configuration.
pub const MUTATE_POD_PATH: &str = "/mutate-v1-pod";
/// The EnvoyConfig validation path, as in the chart's ValidatingWebhookConfiguration.
pub const VALIDATE_ENVOYCONFIG_PATH: &str = "/validate-spur-dev-v1alpha1-envoyconfig";
/// The ListenerSet validation path, as in the chart's ValidatingWebhookConfiguration.
pub const VALIDATE_LISTENERSET_PATH: &str = "/validate-spur-dev-v1alpha1-listenerset";
/// Access requests get their requester stamped here (docs/access.md), as in the chart's
/// MutatingWebhookConfiguration.
pub const MUTATE_ACCESS_REQUEST_PATH: &str = "/mutate-spur-dev-v1alpha1-accessrequest";
/// Every exec, attach and port-forward is recorded here ([`crate::audit`]), as in the chart's
/// ValidatingWebhookConfiguration.
pub const VALIDATE_POD_CONNECT_PATH: &str = "/validate-v1-pod-connect";
/// EnvoyConfigs decoded at once (each on a blocking thread): decoding is CPU and memory, a
/// few times the size of the text.
const DECODES: usize = 2;
/// How long a review waits for a decoding slot before it is refused as an internal error.
const DECODE_WAIT: Duration = Duration::from_secs(5);
/// API server requests are at most 3 MiB; anything larger is not an AdmissionReview.
const MAX_BODY: usize = 8 << 20;
/// Each API call made while answering; the API server waits at most `timeoutSeconds` in all.
const API_TIMEOUT: Duration = Duration::from_secs(3);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long in-flight reviews get after `stop`.
const DRAIN: Duration = Duration::from_secs(10);

/// Where the webhook listens and what it injects.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub addr: SocketAddr,
    /// Namespace of the serving-certificate Secret (the operator's).
    pub namespace: String,
    pub serving_secret: String,
    pub injection: InjectionConfig,
}

/// A running webhook server.
pub struct Webhook {
    local_addr: SocketAddr,
    certs: Arc<Certs>,
    task: tokio::task::JoinHandle<()>,
}

impl Webhook {
    /// Binds the port and starts the certificate watch, the namespace cache and the server.
    pub async fn start(
        client: Client,
        cfg: WebhookConfig,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> Result<Webhook, Error> {
        cfg.injection.validate()?;
        let listener = TcpListener::bind(cfg.addr)
            .await
            .map_err(|e| Error::Webhook(format!("cannot bind {}: {e}", cfg.addr)))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::Webhook(e.to_string()))?;
        let certs = Arc::new(Certs::default());
        tokio::spawn(watch_certificate(
            Api::namespaced(client.clone(), &cfg.namespace),
            cfg.serving_secret.clone(),
            certs.clone(),
            metrics.clone(),
            stop.clone(),
        ));
        let (namespaces, writer) = reflector::store();
        let ns_stream = reflector::reflector(
            writer,
            watcher(
                Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff()
        .touched_objects();
        let ns_stop = stop.clone();
        tokio::spawn(async move {
            let mut s = std::pin::pin!(ns_stream.take_until(ns_stop.cancelled_owned()));
            while s.next().await.is_some() {}
        });

        let mut tls = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Webhook(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(certs.clone());
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let auditor = crate::audit::Auditor::start(client.clone(), metrics.clone());
        let state = Arc::new(State {
            auditor,
            client,
            injection: cfg.injection,
            owners_namespace: cfg.namespace.clone(),
            namespaces,
            metrics,
            certs: certs.clone(),
            bundles_checked: Mutex::new(HashMap::new()),
            decodes: Arc::new(Semaphore::new(DECODES)),
        });
        let task = tokio::spawn(serve(
            listener,
            tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
            state,
            stop,
        ));
        tracing::info!(addr = %local_addr, paths = ?[MUTATE_POD_PATH, MUTATE_ACCESS_REQUEST_PATH, VALIDATE_ENVOYCONFIG_PATH, VALIDATE_LISTENERSET_PATH, VALIDATE_POD_CONNECT_PATH, MUTATE_SANDBOX_PATH, VALIDATE_SANDBOX_PATH], "admission webhook listening");
        Ok(Webhook {
            local_addr,
            certs,
            task,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Whether a serving certificate has been loaded (the replica can answer the API server).
    pub fn ready(&self) -> bool {
        self.certs.current.load().is_some()
    }

    /// A handle that answers [`Webhook::ready`] after the server has been moved elsewhere.
    pub fn readiness(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        let certs = self.certs.clone();
        move || certs.current.load().is_some()
    }

    /// Waits for the server to finish after its stop token was cancelled.
    pub async fn stopped(self) {
        let _ = self.task.await;
    }
}

/// The serving certificate, swapped in place when the Secret changes, and the CA bundle
/// (the Secret's `ca.crt`).
#[derive(Debug, Default)]
struct Certs {
    current: ArcSwapOption<CertifiedKey>,
    bundle: ArcSwapOption<String>,
}

impl ResolvesServerCert for Certs {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.load_full()
    }
}

fn certified_key(secret: &Secret) -> Result<CertifiedKey, String> {
    let data = secret.data.as_ref().ok_or("the Secret has no data")?;
    let get = |k: &str| data.get(k).map(|b| b.0.as_slice()).ok_or(format!("no {k}"));
    let chain = CertificateDer::pem_slice_iter(get("tls.crt")?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("tls.crt: {e}"))?;
    if chain.is_empty() {
        return Err("tls.crt holds no certificate".into());
    }
    let key =
        PrivateKeyDer::from_pem_slice(get("tls.key")?).map_err(|e| format!("tls.key: {e}"))?;
    let key = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| format!("tls.key: {e}"))?;
    Ok(CertifiedKey::new(chain, key))
}

async fn watch_certificate(
    api: Api<Secret>,
    name: String,
    certs: Arc<Certs>,
    metrics: Metrics,
    stop: CancellationToken,
) {
    let stream = watcher(
        api,
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    )
    .default_backoff()
    .applied_objects();
    let mut stream = std::pin::pin!(stream.take_until(stop.cancelled_owned()));
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(secret) => match certified_key(&secret) {
                Ok(ck) => {
                    certs.current.store(Some(Arc::new(ck)));
                    let bundle = secret
                        .data
                        .as_ref()
                        .and_then(|d| d.get("ca.crt"))
                        .and_then(|b| String::from_utf8(b.0.clone()).ok())
                        .filter(|b| !b.trim().is_empty());
                    certs.bundle.store(bundle.map(Arc::new));
                    metrics.serving_cert_loaded(true);
                    tracing::info!(secret = %name, "serving certificate loaded");
                }
                // Keep serving with the previous certificate rather than none.
                Err(e) => {
                    tracing::warn!(secret = %name, error = %e, "unusable serving certificate; keeping the previous one")
                }
            },
            Err(e) => {
                tracing::warn!(secret = %name, error = %e, "serving certificate watch failed; retrying")
            }
        }
    }
}

struct State {
    auditor: crate::audit::Auditor,
    client: Client,
    injection: InjectionConfig,
    /// Where workstation owner records are (the operator's namespace).
    owners_namespace: String,
    namespaces: Store<PartialObjectMeta<Namespace>>,
    metrics: Metrics,
    certs: Arc<Certs>,
    /// Namespaces whose CA bundle ConfigMap was seen or created, and when.
    bundles_checked: Mutex<HashMap<String, Instant>>,
    /// EnvoyConfig decoding slots ([`DECODES`]).
    decodes: Arc<Semaphore>,
}

/// How long a namespace's CA bundle ConfigMap is taken to exist without looking again.
const BUNDLE_RECHECK: Duration = Duration::from_secs(60);

async fn serve(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    state: Arc<State>,
    stop: CancellationToken,
) {
    let drain = spur_runtime::Drain::under(&stop);
    while let Some((tcp, peer)) = spur_runtime::accept(&listener, stop.cancelled(), "webhook").await
    {
        let _ = tcp.set_nodelay(true);
        // The handshake runs in the connection's own task: a client that connects and stays
        // silent must not hold up the API server's admission calls behind it.
        let (acceptor, conn_drain, st) = (acceptor.clone(), drain.clone(), state.clone());
        drain.spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    st.metrics.tls_error();
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    st.metrics.tls_error();
                    return;
                }
            };
            let svc = hyper::service::service_fn(move |req| {
                let st = st.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(req, &st).await) }
            });
            // Request heads, HTTP/2 keep-alive and a silent client all have deadlines (hyper
            // enforces none without a timer).
            spur_runtime::serve::serve_connection(
                TokioIo::new(tls),
                svc,
                &conn_drain.token(),
                DRAIN,
            )
            .await;
        });
    }
    drop(listener);
    let left = drain.wait(DRAIN).await;
    if left > 0 {
        tracing::warn!(
            connections = left,
            "webhook connections still open after the drain period"
        );
    }
}

/// What a request is for.
#[derive(Clone, Copy)]
enum Review {
    Pod,
    EnvoyConfig,
    ListenerSet,
    AccessRequest,
    Connect,
    SandboxStamp,
    SandboxOwner,
}

async fn handle(req: Request<Incoming>, st: &State) -> Response<Full<Bytes>> {
    let review = match (req.method(), req.uri().path()) {
        (&hyper::Method::POST, MUTATE_POD_PATH) => Review::Pod,
        (&hyper::Method::POST, VALIDATE_ENVOYCONFIG_PATH) => Review::EnvoyConfig,
        (&hyper::Method::POST, VALIDATE_LISTENERSET_PATH) => Review::ListenerSet,
        (&hyper::Method::POST, MUTATE_ACCESS_REQUEST_PATH) => Review::AccessRequest,
        (&hyper::Method::POST, VALIDATE_POD_CONNECT_PATH) => Review::Connect,
        (&hyper::Method::POST, MUTATE_SANDBOX_PATH) => Review::SandboxStamp,
        (&hyper::Method::POST, VALIDATE_SANDBOX_PATH) => Review::SandboxOwner,
        (
            _,
            MUTATE_POD_PATH
            | VALIDATE_ENVOYCONFIG_PATH
            | VALIDATE_LISTENERSET_PATH
            | MUTATE_ACCESS_REQUEST_PATH
            | VALIDATE_POD_CONNECT_PATH
            | MUTATE_SANDBOX_PATH
            | VALIDATE_SANDBOX_PATH,
        ) => {
            return text(StatusCode::METHOD_NOT_ALLOWED, "POST only\n");
        }
        _ => return text(StatusCode::NOT_FOUND, "not found\n"),
    };
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            match review {
                Review::Pod => st.metrics.admission("invalid"),
                Review::EnvoyConfig => st.metrics.envoyconfig_admission("invalid"),
                Review::ListenerSet => st.metrics.listenerset_admission("invalid"),
                Review::AccessRequest => st.metrics.access_admission("invalid"),
                Review::Connect => st.metrics.audit("invalid"),
                Review::SandboxStamp | Review::SandboxOwner => {
                    st.metrics.sandbox_admission("invalid")
                }
            }
            return text(StatusCode::BAD_REQUEST, &format!("cannot read body: {e}\n"));
        }
    };
    match review {
        Review::Pod => review_pod(&body, st).await,
        Review::EnvoyConfig => review_envoyconfig(&body, st).await,
        Review::ListenerSet => review_listenerset(&body, st),
        Review::AccessRequest => review_access_request(&body, st),
        Review::Connect => review_connect(&body, st),
        Review::SandboxStamp => sandbox::review_stamp(&body, &st.metrics),
        Review::SandboxOwner => {
            sandbox::review_owner(&body, &st.client, &st.owners_namespace, &st.metrics).await
        }
    }
}

async fn review_pod(body: &[u8], st: &State) -> Response<Full<Bytes>> {
    let review: AdmissionReview<Pod> = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            st.metrics.admission("invalid");
            return text(
                StatusCode::BAD_REQUEST,
                &format!("not an AdmissionReview of a Pod: {e}\n"),
            );
        }
    };
    let request: AdmissionRequest<Pod> = match review.try_into() {
        Ok(r) => r,
        Err(_) => {
            st.metrics.admission("invalid");
            return text(
                StatusCode::BAD_REQUEST,
                "the AdmissionReview has no request\n",
            );
        }
    };
    let mut response = AdmissionResponse::from(&request);
    match decide(&request, st).await {
        Ok(Some((patch, result))) => match response.clone().with_patch(patch) {
            Ok(r) => {
                response = r;
                st.metrics.admission(result);
            }
            Err(e) => {
                st.metrics.admission("error");
                if (request.object.as_ref())
                    .is_some_and(|p| inject::must_not_run_bare(p, &st.injection))
                {
                    response = response.deny(format!(
                        "spur: a sandbox fork's pod is not created without its sidecar, and the injection failed: {e}; its ReplicaSet retries"
                    ));
                } else {
                    response.warnings = Some(vec![format!("spur: sidecar not injected: {e}")]);
                }
            }
        },
        Ok(None) => st.metrics.admission("ignored"),
        Err(e)
            if (request.object.as_ref())
                .is_some_and(|p| inject::must_not_run_bare(p, &st.injection)) =>
        {
            // A fork's pod without its sidecar would take a share of the baseline's Kafka
            // records with the fork's code: refused, and created again by its ReplicaSet.
            tracing::warn!(namespace = ?request.namespace, error = %e, "refusing a fork's pod after an internal error");
            st.metrics.admission("error");
            response = response.deny(format!(
                "spur: a sandbox fork's pod is not created without its sidecar, and the injection failed (internal error: {e}); its ReplicaSet retries"
            ));
        }
        Err(e) => {
            // Admit unchanged: a fault in Spur must never stop a pod from being created.
            tracing::warn!(namespace = ?request.namespace, error = %e, "admitting pod unchanged after an internal error");
            st.metrics.admission("error");
            response.warnings = Some(vec![format!(
                "spur: sidecar not injected (internal error: {e})"
            )]);
        }
    }
    reply(response)
}

pub(crate) fn reply(response: AdmissionResponse) -> Response<Full<Bytes>> {
    match serde_json::to_vec(&response.into_review()) {
        Ok(body) => Response::builder()
            .status(StatusCode::OK)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_else(|_| text(StatusCode::INTERNAL_SERVER_ERROR, "")),
        Err(_) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot encode response\n",
        ),
    }
}

// === EnvoyConfig validation ===

async fn review_envoyconfig(body: &[u8], st: &State) -> Response<Full<Bytes>> {
    // A dynamic object: a spec this operator's types do not read is denied with the reason
    // below, not answered with a 400 the API server reports as a webhook failure.
    let request = match dynamic_request(body) {
        Ok(r) => r,
        Err(e) => {
            st.metrics.envoyconfig_admission("invalid");
            return text(
                StatusCode::BAD_REQUEST,
                &format!("not an AdmissionReview with a request: {e}\n"),
            );
        }
    };
    let mut response = AdmissionResponse::from(&request);
    match validate_envoyconfig(&request, st).await {
        Ok(()) => st.metrics.envoyconfig_admission("allowed"),
        Err(Refusal::Invalid(message)) => {
            st.metrics.envoyconfig_admission("denied");
            tracing::debug!(namespace = ?request.namespace, name = %request.name, %message, "EnvoyConfig refused");
            response = response.deny(message);
            response.result.code = StatusCode::UNPROCESSABLE_ENTITY.as_u16();
            response.result.reason = "Invalid".into();
        }
        Err(Refusal::Internal(message)) => {
            st.metrics.envoyconfig_admission("error");
            tracing::warn!(namespace = ?request.namespace, name = %request.name, error = %message, "EnvoyConfig not validated");
            response = response.deny(format!(
                "spur: the EnvoyConfig could not be validated: {message}"
            ));
            response.result.code = StatusCode::INTERNAL_SERVER_ERROR.as_u16();
            response.result.reason = "InternalError".into();
        }
    }
    reply(response)
}

/// Why an EnvoyConfig is not admitted.
enum Refusal {
    /// The user's to fix (422).
    Invalid(String),
    /// Spur's: no decoding slot, the descriptors did not load (500).
    Internal(String),
}

async fn validate_envoyconfig(
    req: &AdmissionRequest<DynamicObject>,
    st: &State,
) -> Result<(), Refusal> {
    if !matches!(req.operation, Operation::Create | Operation::Update) {
        return Ok(());
    }
    let spec_of = |o: &Option<DynamicObject>| o.as_ref().and_then(|o| o.data.get("spec").cloned());
    let Some(spec) = spec_of(&req.object) else {
        return Err(Refusal::Invalid("spec: required".into()));
    };
    if req.operation == Operation::Update && spec_of(&req.old_object).as_ref() == Some(&spec) {
        return Ok(());
    }
    let spec: EnvoyConfigSpec =
        serde_json::from_value(spec).map_err(|e| Refusal::Invalid(format!("spec: {e}")))?;
    match spur_operator_xds::envoyconfig::node_id::admission(&st.client, req, &spec.node_id).await {
        Ok(None) => {}
        Ok(Some(taken)) => return Err(Refusal::Invalid(taken)),
        Err(e) => return Err(Refusal::Internal(e)),
    }
    let permit = tokio::time::timeout(DECODE_WAIT, st.decodes.clone().acquire_owned())
        .await
        .map_err(|_| Refusal::Internal("every decoding slot is busy; retry".into()))?
        .map_err(|e| Refusal::Internal(e.to_string()))?;
    let decoded = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        spur_envoy::decoder().map(|d| d.decode_all(&spec).map(|_| ()))
    })
    .await
    .map_err(|e| Refusal::Internal(format!("decoding failed: {e}")))?
    .map_err(|e| Refusal::Internal(e.to_string()))?;
    decoded.map_err(|e| Refusal::Invalid(e.to_string()))
}

/// The request of an AdmissionReview read as a dynamic object: a spec these types do not read
/// is then refused with its reason, not answered with a 400 the API server reports as a
/// webhook failure.
pub(crate) fn dynamic_request(body: &[u8]) -> Result<AdmissionRequest<DynamicObject>, String> {
    serde_json::from_slice::<AdmissionReview<DynamicObject>>(body)
        .map_err(|e| e.to_string())
        .and_then(|r| {
            r.try_into()
                .map_err(|e: kube::core::admission::ConvertAdmissionReviewError| e.to_string())
        })
}

// === Exec audit ===

/// Records the connection and allows it: the audit trail never refuses.
fn review_connect(body: &[u8], st: &State) -> Response<Full<Bytes>> {
    let review: serde_json::Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            st.metrics.audit("invalid");
            return text(
                StatusCode::BAD_REQUEST,
                &format!("not an AdmissionReview: {e}\n"),
            );
        }
    };
    let connect = match crate::audit::Connect::from_review(&review) {
        Ok(c) => c,
        Err(e) => {
            st.metrics.audit("invalid");
            return text(StatusCode::BAD_REQUEST, &format!("{e}\n"));
        }
    };
    let uid = connect.uid.clone();
    st.auditor.record(connect);
    let answer = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": uid, "allowed": true},
    });
    match serde_json::to_vec(&answer) {
        Ok(body) => Response::builder()
            .status(StatusCode::OK)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_else(|_| text(StatusCode::INTERNAL_SERVER_ERROR, "")),
        Err(_) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot encode response\n",
        ),
    }
}

// === Access requests ===

fn review_access_request(body: &[u8], st: &State) -> Response<Full<Bytes>> {
    let request = match dynamic_request(body) {
        Ok(r) => r,
        Err(e) => {
            st.metrics.access_admission("invalid");
            return text(
                StatusCode::BAD_REQUEST,
                &format!("not an AdmissionReview with a request: {e}\n"),
            );
        }
    };
    let response = AdmissionResponse::from(&request);
    match requester_patch(&request) {
        Ok(None) => {
            st.metrics.access_admission("ignored");
            reply(response)
        }
        Ok(Some(patch)) => match response.clone().with_patch(patch) {
            Ok(r) => {
                st.metrics.access_admission("stamped");
                tracing::debug!(namespace = ?request.namespace, name = %request.name, user = %request.user_info.username.as_deref().unwrap_or_default(), "access request stamped");
                reply(r)
            }
            Err(e) => {
                st.metrics.access_admission("error");
                reply(response.deny(format!("spur: cannot stamp the requester: {e}")))
            }
        },
        Err(message) => {
            st.metrics.access_admission("denied");
            let mut response = response.deny(message);
            response.result.code = StatusCode::FORBIDDEN.as_u16();
            response.result.reason = "Forbidden".into();
            reply(response)
        }
    }
}

/// On create, `spec.requester` becomes the user the API server authenticated, whatever the
/// client wrote there. A request without an authenticated user is refused: it could never be
/// granted to anyone.
pub(crate) fn requester_patch(
    req: &AdmissionRequest<DynamicObject>,
) -> Result<Option<json_patch::Patch>, String> {
    if req.operation != Operation::Create {
        return Ok(None);
    }
    let user = &req.user_info;
    let Some(username) = user.username.clone().filter(|u| !u.is_empty()) else {
        return Err("an access request needs an authenticated user".into());
    };
    if username.len() > spur_api::access::IDENTITY_MAX {
        return Err(format!(
            "user names above {} bytes are not supported",
            spur_api::access::IDENTITY_MAX
        ));
    }
    let groups: Vec<String> = user
        .groups
        .iter()
        .flatten()
        .filter(|g| g.len() <= spur_api::access::IDENTITY_MAX)
        .take(spur_api::access::MAX_REQUESTER_GROUPS)
        .cloned()
        .collect();
    let requester = spur_api::access::Requester {
        username,
        uid: user.uid.clone().filter(|u| !u.is_empty()),
        groups,
    };
    let has_spec = req
        .object
        .as_ref()
        .is_some_and(|o| o.data.get("spec").is_some_and(serde_json::Value::is_object));
    let op = if has_spec {
        serde_json::json!([{"op": "add", "path": "/spec/requester", "value": requester}])
    } else {
        serde_json::json!([{"op": "add", "path": "/spec", "value": {"requester": requester}}])
    };
    serde_json::from_value(op)
        .map(Some)
        .map_err(|e| format!("cannot build the patch: {e}"))
}

// === ListenerSet validation ===

fn review_listenerset(body: &[u8], st: &State) -> Response<Full<Bytes>> {
    // A dynamic object, as for EnvoyConfigs: a spec these types do not read is denied with the
    // reason, not answered with a 400.
    let request = match dynamic_request(body) {
        Ok(r) => r,
        Err(e) => {
            st.metrics.listenerset_admission("invalid");
            return text(
                StatusCode::BAD_REQUEST,
                &format!("not an AdmissionReview with a request: {e}\n"),
            );
        }
    };
    let mut response = AdmissionResponse::from(&request);
    match validate_listenerset(&request) {
        Ok(()) => st.metrics.listenerset_admission("allowed"),
        Err(message) => {
            st.metrics.listenerset_admission("denied");
            tracing::debug!(namespace = ?request.namespace, name = %request.name, %message, "ListenerSet refused");
            response = response.deny(message);
            response.result.code = StatusCode::UNPROCESSABLE_ENTITY.as_u16();
            response.result.reason = "Invalid".into();
        }
    }
    reply(response)
}

/// `Err` with every problem, each with its field path.
fn validate_listenerset(req: &AdmissionRequest<DynamicObject>) -> Result<(), String> {
    if !matches!(req.operation, Operation::Create | Operation::Update) {
        return Ok(());
    }
    let spec_of = |o: &Option<DynamicObject>| o.as_ref().and_then(|o| o.data.get("spec").cloned());
    let Some(spec) = spec_of(&req.object) else {
        return Err("spec: required".into());
    };
    if req.operation == Operation::Update && spec_of(&req.old_object).as_ref() == Some(&spec) {
        return Ok(());
    }
    let spec: ListenerSetSpec = serde_path_to_error::deserialize(spec).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            format!("spec: {}", e.inner())
        } else {
            format!("spec.{path}: {}", e.inner())
        }
    })?;
    // The object's name (a generated one is set by now); the request's as a fallback.
    let name = req
        .object
        .as_ref()
        .and_then(|o| o.metadata.name.clone())
        .unwrap_or_else(|| req.name.clone());
    spec.validate(&name).map_err(|e| e.to_string())
}

/// The patch to return and the result to count, `None` to admit without one, or an internal
/// error (admitted unchanged).
async fn decide(
    req: &AdmissionRequest<Pod>,
    st: &State,
) -> Result<Option<(json_patch::Patch, &'static str)>, Error> {
    if req.operation != Operation::Create {
        return Ok(None);
    }
    let Some(pod) = &req.object else {
        return Ok(None);
    };
    let namespace = req
        .namespace
        .clone()
        .or_else(|| pod.metadata.namespace.clone())
        .unwrap_or_else(|| "default".into());
    let (labels, annotations) = namespace_meta(&namespace, st).await?;
    let owner = match inject::screen(pod, &namespace, labels.as_ref(), &st.injection) {
        Screen::Ignore => return Ok(None),
        Screen::Skip(reason) => return Ok(Some((inject::skip_patch(pod, &reason)?, "skipped"))),
        Screen::Resolve(owner) => owner,
    };
    let replicasets: Api<ReplicaSet> = Api::namespaced(st.client.clone(), &namespace);
    let rs = tokio::time::timeout(API_TIMEOUT, replicasets.get_opt(&owner.name))
        .await
        .map_err(|_| Error::Webhook(format!("timed out reading ReplicaSet {}", owner.name)))??
        .ok_or_else(|| {
            Error::Webhook(format!("ReplicaSet {namespace}/{} not found", owner.name))
        })?;
    let mut baseline = match inject::baseline_of_replicaset(&rs, &namespace) {
        Ok(b) => b,
        Err(reason) => return Ok(Some((inject::skip_patch(pod, &reason)?, "skipped"))),
    };
    if owner.fork {
        // A fork's pod with Kafka ports: its sidecar relays Kafka in fork mode, by the rules of
        // the baseline the fork's Deployment forks (docs/async.md).
        match fork_of(&baseline, st).await? {
            Ok(fork) => baseline = fork,
            Err(reason) => return Ok(Some((inject::skip_patch(pod, &reason)?, "skipped"))),
        }
    }
    let cfg = match inject::for_namespace(&st.injection, annotations.as_ref()) {
        Ok(cfg) => cfg,
        Err(Error::Config(reason)) => {
            return Ok(Some((inject::skip_patch(pod, &reason)?, "skipped")));
        }
        Err(e) => return Err(e),
    };
    match inject::inject_patch(pod, &baseline, &cfg) {
        Ok(p) => {
            tracing::debug!(baseline = ?baseline, "injecting sidecar");
            if req.dry_run {
                return Ok(Some((p, "injected")));
            }
            // Without the bundle the pod would wait in ContainerCreating for the ConfigMap:
            // a failure here is an internal error, and the pod is admitted unchanged.
            ensure_bundle(&namespace, st).await?;
            Ok(Some((p, "injected")))
        }
        // A malformed annotation is the user's to fix: say so on the pod.
        Err(Error::Config(reason)) => Ok(Some((inject::skip_patch(pod, &reason)?, "skipped"))),
        Err(e) => Err(e),
    }
}

/// The baseline a fork's Deployment (`deployment`, from its pod's ReplicaSet) forks, with the
/// fork's sandbox; `Ok(Err(reason))` when it is no fork a ForkedWorkload made.
async fn fork_of(
    deployment: &inject::Baseline,
    st: &State,
) -> Result<Result<inject::Baseline, String>, Error> {
    let api: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(st.client.clone(), &deployment.namespace);
    let found = tokio::time::timeout(API_TIMEOUT, api.get_opt(&deployment.name))
        .await
        .map_err(|_| {
            Error::Webhook(format!("timed out reading Deployment {}", deployment.name))
        })??;
    let fork = found.as_ref().and_then(spur_api::forkof::fork_of);
    Ok(match fork {
        Some(spur_api::forkof::ForkOf {
            kind,
            baseline,
            sandbox: Some(sandbox),
        }) if deployment.kind == "Deployment" => Ok(inject::Baseline {
            kind: kind.routes_api_kind(),
            namespace: deployment.namespace.clone(),
            name: baseline,
            fork_of_sandbox: Some(sandbox),
        }),
        _ => Err(format!(
            "forked pod (label spur.dev/fork), but {} {}/{} is not a fork a ForkedWorkload controls (with spur.dev/baseline and spur.dev/sandbox): no Kafka relay for it",
            deployment.kind, deployment.namespace, deployment.name
        )),
    })
}

/// Creates the CA bundle ConfigMap in `namespace` if it is missing (never changes one: the
/// certificate manager does, on the leader).
async fn ensure_bundle(namespace: &str, st: &State) -> Result<(), Error> {
    let name = &st.injection.routeserver_ca_config_map;
    if name.is_empty() {
        return Ok(());
    }
    let fresh = |t: &Instant| t.elapsed() < BUNDLE_RECHECK;
    // Remembered per namespace object, not per name: a namespace deleted and created again
    // within the recheck period has no copy, and its pods would wait for one forever.
    let checked_key = st
        .namespaces
        .get(&ObjectRef::new(namespace))
        .and_then(|n| n.metadata.uid.clone())
        .map(|uid| format!("{namespace}/{uid}"));
    if let Some(k) = &checked_key
        && st
            .bundles_checked
            .lock()
            .ok()
            .and_then(|m| m.get(k).copied())
            .is_some_and(|t| fresh(&t))
    {
        return Ok(());
    }
    let api: Api<ConfigMap> = Api::namespaced(st.client.clone(), namespace);
    let existing = tokio::time::timeout(API_TIMEOUT, api.get_metadata_opt(name))
        .await
        .map_err(|_| Error::Webhook(format!("timed out reading ConfigMap {namespace}/{name}")))??;
    if existing.is_none() {
        let bundle = st.certs.bundle.load_full().ok_or_else(|| {
            Error::Webhook("no CA bundle yet for the route server's ConfigMap".into())
        })?;
        let cm = spur_operator_core::bundle::namespace_bundle(namespace, name, &bundle);
        match tokio::time::timeout(
            API_TIMEOUT,
            api.create(&kube::api::PostParams::default(), &cm),
        )
        .await
        .map_err(|_| Error::Webhook(format!("timed out creating ConfigMap {namespace}/{name}")))?
        {
            Ok(_) => {
                tracing::info!(%namespace, config_map = %name, "CA bundle copied for injected sidecars")
            }
            // Another replica was faster.
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(k) = checked_key
        && let Ok(mut m) = st.bundles_checked.lock()
    {
        m.retain(|_, t| fresh(t));
        m.insert(k, Instant::now());
    }
    Ok(())
}

/// The labels and annotations of a namespace.
type NamespaceMeta = (
    Option<BTreeMap<String, String>>,
    Option<BTreeMap<String, String>>,
);

async fn namespace_meta(namespace: &str, st: &State) -> Result<NamespaceMeta, Error> {
    if let Some(ns) = st.namespaces.get(&ObjectRef::new(namespace)) {
        return Ok((ns.metadata.labels.clone(), ns.metadata.annotations.clone()));
    }
    // Not in the cache yet (a namespace created a moment ago): ask.
    let api: Api<Namespace> = Api::all(st.client.clone());
    let ns = tokio::time::timeout(API_TIMEOUT, api.get_metadata_opt(namespace))
        .await
        .map_err(|_| Error::Webhook(format!("timed out reading namespace {namespace}")))??;
    Ok(ns.map_or((None, None), |n| {
        (n.metadata.labels, n.metadata.annotations)
    }))
}

pub(crate) fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::{Value, json};

    fn request(
        operation: &str,
        spec: Option<Value>,
        old: Option<Value>,
    ) -> AdmissionRequest<DynamicObject> {
        let object = |spec: Option<Value>| {
            let mut o = json!({"apiVersion": "spur.dev/v1alpha1", "kind": "ListenerSet",
                               "metadata": {"name": "media", "namespace": "voip"}});
            if let Some(s) = spec {
                o["spec"] = s;
            }
            o
        };
        let review: AdmissionReview<DynamicObject> = serde_json::from_value(json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u", "operation": operation, "name": "media", "namespace": "voip",
                "kind": {"group": "spur.dev", "version": "v1alpha1", "kind": "ListenerSet"},
                "resource": {"group": "spur.dev", "version": "v1alpha1", "resource": "listenersets"},
                "userInfo": {}, "object": object(spec),
                "oldObject": old.map(|o| object(Some(o))),
            }
        }))
        .unwrap();
        review.try_into().unwrap()
    }

    fn spec(port: Value) -> Value {
        json!({"selector": {"matchLabels": {"app": "gw"}}, "listeners": [
            {"name": "rtp", "protocol": "udp", "port": port, "cluster": {"name": "media",
                "endpoints": [{"address": "10.0.0.1", "port": 6000}]}}]})
    }

    #[test]
    fn listenerset_reviews() {
        assert_eq!(
            validate_listenerset(&request("CREATE", Some(spec(json!(5000))), None)),
            Ok(())
        );
        assert_eq!(
            validate_listenerset(&request("CREATE", None, None)),
            Err("spec: required".into())
        );
        // What the types cannot read is refused with its path, not answered with a 400.
        let err =
            validate_listenerset(&request("CREATE", Some(spec(json!("x"))), None)).unwrap_err();
        assert!(
            err.starts_with("spec.listeners[0].port: invalid type"),
            "{err}"
        );
        let err = validate_listenerset(&request("CREATE", Some(spec(json!(0))), None)).unwrap_err();
        assert!(
            err.contains("spec.listeners[0].port: must be between 1 and 65535"),
            "{err}"
        );
        // An update that leaves an (old, invalid) spec alone is allowed; one that changes it is
        // checked.
        let bad = spec(json!(0));
        assert_eq!(
            validate_listenerset(&request("UPDATE", Some(bad.clone()), Some(bad.clone()))),
            Ok(())
        );
        assert!(validate_listenerset(&request("UPDATE", Some(bad), Some(spec(json!(1))))).is_err());
        assert_eq!(validate_listenerset(&request("DELETE", None, None)), Ok(()));
    }
}
