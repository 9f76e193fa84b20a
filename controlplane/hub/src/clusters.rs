//! The hub's side of the agents' tunnels: authenticates each session against the registry,
//! keeps the newest session per cluster, closes the sessions of revoked (or rotated) clusters
//! within a poll interval of the change, and opens streams to an agent.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use spur_tunnel::{
    AuthError, AuthFuture, AuthMethod, AuthRequest, Authenticator, Identity, SessionHandle, Stream,
    TunnelServer,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::protocol::{AGENT_BIND, Answer, MAX_FRAME, Open};
use crate::{Error, Store};

/// Checks cluster tokens against the registry.
pub struct RegistryAuthenticator {
    store: Store,
}

impl RegistryAuthenticator {
    pub fn new(store: Store) -> Self {
        RegistryAuthenticator { store }
    }
}

impl Authenticator for RegistryAuthenticator {
    fn authenticate<'a>(&'a self, req: AuthRequest<'a>) -> AuthFuture<'a> {
        Box::pin(async move {
            let Some(token) = req.token else {
                return Err(AuthError::Unauthenticated(
                    "a cluster token is required (spur-hub cluster add NAME)".into(),
                ));
            };
            let token = token.expose().to_owned();
            let store = self.store.clone();
            let found = tokio::task::spawn_blocking(move || store.cluster_for_token(&token))
                .await
                .map_err(|e| AuthError::Unavailable(format!("registry lookup: {e}")))?
                .map_err(|e| AuthError::Unavailable(format!("registry: {e}")))?;
            match found {
                Some(c) => Ok(Identity::new(c.name, AuthMethod::Token).issued(c.issued)),
                // The same answer for unknown, revoked and rotated tokens: nothing to probe.
                None => Err(AuthError::Unauthenticated(
                    "unknown or revoked cluster token".into(),
                )),
            }
        })
    }

    fn authorize_bind(&self, _: &Identity, bind: &str, _: &str) -> Result<(), AuthError> {
        if bind == AGENT_BIND {
            Ok(())
        } else {
            Err(AuthError::Forbidden(format!(
                "an agent may only bind {AGENT_BIND:?}"
            )))
        }
    }
}

/// A connected cluster.
#[derive(Clone, Debug)]
pub struct Connected {
    pub session: SessionHandle,
    pub issued: Option<SystemTime>,
    pub since: SystemTime,
}

/// The sessions of connected clusters, by cluster name.
#[derive(Clone, Default)]
pub struct Clusters {
    inner: Arc<Mutex<BTreeMap<String, Connected>>>,
    changed: Arc<watch::Sender<u64>>,
    metrics: Option<crate::metrics::Metrics>,
}

impl Clusters {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Connected>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A change counter: bumped on every connect and disconnect.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Reports into `metrics` (connected clusters, revocations).
    pub fn with_metrics(mut self, metrics: crate::metrics::Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn bump(&self) {
        if let Some(m) = &self.metrics {
            let n = self.lock().len();
            m.clusters_connected
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Connected clusters and their sessions.
    pub fn connected(&self) -> Vec<(String, Connected)> {
        self.lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    pub fn get(&self, cluster: &str) -> Option<SessionHandle> {
        self.lock().get(cluster).map(|c| c.session.clone())
    }

    /// Opens a stream to `cluster`'s agent for `open`, and returns it once the agent said ok.
    pub async fn open(
        &self,
        cluster: &str,
        open: &Open,
        timeout: Duration,
    ) -> Result<Stream, Error> {
        let session = self
            .get(cluster)
            .ok_or_else(|| Error::Unavailable(format!("cluster {cluster:?} is not connected")))?;
        let attempt = async {
            let mut stream = session.open_reverse(AGENT_BIND).await?;
            spur_tunnel::write_frame(&mut stream, open, MAX_FRAME).await?;
            match spur_tunnel::read_frame::<_, Answer>(&mut stream, MAX_FRAME).await? {
                Some(Answer::Ok) => Ok(stream),
                Some(Answer::Error { reason }) => Err(Error::Upstream(reason)),
                None => Err(Error::Upstream("the agent closed the stream".into())),
            }
        };
        tokio::time::timeout(timeout, attempt).await.map_err(|_| {
            Error::Unavailable(format!(
                "cluster {cluster:?}'s agent did not answer within {timeout:?}"
            ))
        })?
    }

    /// One HTTP/1.1 GET of `path` on a stream opened for `open` (the agent's Kubernetes proxy
    /// or traffic reader); the response, whatever its status.
    pub async fn http_get(
        &self,
        cluster: &str,
        open: &Open,
        path: &str,
        timeout: Duration,
    ) -> Result<http::Response<hyper::body::Incoming>, Error> {
        let stream = self.open(cluster, open, timeout).await?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| Error::Upstream(format!("agent stream: {e}")))?;
        tokio::spawn(conn);
        let req = http::Request::get(path)
            .header(http::header::HOST, "agent")
            .header(http::header::ACCEPT, "application/json")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .map_err(|e| Error::Invalid(e.to_string()))?;
        send.send_request(req)
            .await
            .map_err(|e| Error::Upstream(format!("GET {path}: {e}")))
    }

    /// Takes sessions from `server` until `stop`: one per cluster, the newest wins (an agent
    /// restarted before its old session timed out must not be shut out).
    pub async fn serve(&self, server: Arc<TunnelServer>, store: Store, stop: CancellationToken) {
        loop {
            let mut session = tokio::select! {
                s = server.accept() => match s { Some(s) => s, None => return },
                () = stop.cancelled() => return,
            };
            let handle = session.handle();
            let name = handle.identity().name.clone();
            let connected = Connected {
                session: handle.clone(),
                issued: handle.identity().issued_at,
                since: SystemTime::now(),
            };
            if let Some(old) = self.lock().insert(name.clone(), connected) {
                old.session.goaway(
                    "replaced by a newer session of the same cluster",
                    Duration::from_secs(5),
                );
            }
            self.bump();
            tracing::info!(cluster = %name, peer = %handle.peer(), transport = handle.transport().as_str(), "cluster connected");
            let touch = store.clone();
            let touched = name.clone();
            tokio::task::spawn_blocking(move || {
                if let Err(e) = touch.touch_cluster(&touched) {
                    tracing::warn!(cluster = %touched, "recording last-seen: {e}");
                }
            });
            let clusters = self.clone();
            tokio::spawn(async move {
                // An agent opens no streams of its own: refuse any it tries.
                let refuse = async {
                    while let Some(incoming) = session.accept().await {
                        incoming
                            .reject("the hub accepts no streams from agents")
                            .await;
                    }
                };
                let reason = tokio::select! {
                    r = handle.closed() => r,
                    () = refuse => handle.closed().await,
                };
                let mut map = clusters.lock();
                if map
                    .get(&name)
                    .is_some_and(|c| c.session.id() == handle.id())
                {
                    map.remove(&name);
                    drop(map);
                    clusters.bump();
                }
                tracing::info!(cluster = %name, ?reason, "cluster disconnected");
            });
        }
    }

    /// Every `poll`, if the registry changed, closes the sessions of clusters that were revoked
    /// or whose token was rotated.
    pub async fn enforce_revocations(&self, store: Store, poll: Duration, stop: CancellationToken) {
        let mut seen = None;
        loop {
            tokio::select! {
                () = tokio::time::sleep(poll) => {}
                () = stop.cancelled() => return,
            }
            let connected = self.connected();
            let s = store.clone();
            let checked = tokio::task::spawn_blocking(move || {
                let version = s.data_version()?;
                let mut revoked = Vec::new();
                if Some(version) != seen {
                    for (name, c) in &connected {
                        let valid = match c.issued {
                            Some(issued) => s.session_valid(name, issued)?,
                            None => false,
                        };
                        if !valid {
                            revoked.push((name.clone(), c.session.clone()));
                        }
                    }
                }
                Ok::<_, Error>((version, revoked))
            })
            .await;
            match checked {
                Ok(Ok((version, revoked))) => {
                    // Connections made during the check are checked at the next change; a
                    // revoked token cannot make one (the authenticator reads the same table).
                    seen = Some(version);
                    for (name, session) in revoked {
                        tracing::warn!(cluster = %name, "cluster revoked or token rotated: closing its session");
                        session.goaway("cluster token revoked", Duration::ZERO);
                        if let Some(m) = &self.metrics {
                            m.revocations.inc();
                        }
                    }
                }
                Ok(Err(e)) => tracing::warn!("checking revocations: {e}"),
                Err(e) => tracing::warn!("checking revocations: {e}"),
            }
        }
    }
}
