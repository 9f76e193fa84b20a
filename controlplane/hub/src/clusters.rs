//! The hub's side of the agents' tunnels: authenticates each session against the registry,
//! keeps every live session of a cluster (one per agent replica; the newest preferred), opens
//! streams to an agent, falling back to another replica's session when one fails, and closes
//! the sessions of revoked (or rotated) clusters within a poll interval of the change.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

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

/// The most sessions the hub keeps per cluster: one per agent replica (the chart runs two),
/// plus the old session of an agent restarted before that one timed out. A session beyond it
/// closes the least preferred one, so a copied token cannot pile sessions up.
pub const MAX_SESSIONS_PER_CLUSTER: usize = 8;

/// One agent session of a connected cluster.
#[derive(Clone, Debug)]
pub struct Connected {
    pub session: SessionHandle,
    pub issued: Option<SystemTime>,
    pub since: SystemTime,
}

/// The sessions of connected clusters, by cluster name, each cluster's in the order streams
/// are tried: the newest first, one that failed an open last.
#[derive(Clone, Default)]
pub struct Clusters {
    inner: Arc<Mutex<BTreeMap<String, Vec<Connected>>>>,
    changed: Arc<watch::Sender<u64>>,
    metrics: Option<crate::metrics::Metrics>,
}

/// How one try to open a stream on one session ended.
enum Tried {
    Opened(Stream),
    /// The agent answered, refusing: its verdict (another replica would say the same).
    Refused(String),
    /// The session failed (closed, no listener, no answer): another session may work.
    Failed(String),
    /// The tunnel opened but the agent did not answer in time (a slow target): final.
    Slow,
}

impl Clusters {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<Connected>>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A change counter: bumped on every connect and disconnect.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Reports into `metrics` (connected clusters, agent sessions, revocations).
    pub fn with_metrics(mut self, metrics: crate::metrics::Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn bump(&self) {
        if let Some(m) = &self.metrics {
            // Set under the lock: a connect and a disconnect racing cannot leave a stale count.
            let map = self.lock();
            let sessions = map.values().map(Vec::len).sum::<usize>();
            m.clusters_connected
                .set(i64::try_from(map.len()).unwrap_or(i64::MAX));
            m.agent_sessions
                .set(i64::try_from(sessions).unwrap_or(i64::MAX));
        }
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Connected clusters, each with its preferred session.
    pub fn connected(&self) -> Vec<(String, Connected)> {
        self.lock()
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), v.first()?.clone())))
            .collect()
    }

    /// How many agent sessions `cluster` has.
    pub fn sessions(&self, cluster: &str) -> usize {
        self.lock().get(cluster).map_or(0, Vec::len)
    }

    /// Every session of every cluster.
    fn all_sessions(&self) -> Vec<(String, Connected)> {
        self.lock()
            .iter()
            .flat_map(|(k, v)| v.iter().map(move |c| (k.clone(), c.clone())))
            .collect()
    }

    /// `cluster`'s preferred session.
    pub fn get(&self, cluster: &str) -> Option<SessionHandle> {
        self.lock()
            .get(cluster)
            .and_then(|v| v.first())
            .map(|c| c.session.clone())
    }

    /// Moves session `id` of `cluster` to the back: it failed an open, so the next ones try
    /// the other replicas first (until it is closed, or a newer session comes).
    fn demote(&self, cluster: &str, id: u64) {
        {
            let mut map = self.lock();
            let Some(v) = map.get_mut(cluster) else {
                return;
            };
            let Some(i) = v.iter().position(|c| c.session.id() == id) else {
                return;
            };
            if i + 1 == v.len() {
                return;
            }
            v[i..].rotate_left(1);
        }
        // No change is signalled: nothing that watches the clusters follows the order (the
        // catalog's watches reopen on whichever session is first when theirs ends).
        tracing::warn!(
            cluster,
            session = id,
            "an agent session failed an open: the cluster's other sessions are tried first"
        );
    }

    /// Opens a stream to `cluster`'s agent for `open`, and returns it once the agent said ok.
    /// The cluster's listening sessions are tried in order (one per agent replica), the tunnel
    /// open on each with an equal share of what is left of `timeout`: an agent gone without a
    /// goodbye (its session not timed out yet) costs a part of the time, not the request. The
    /// agent's answer, a refusal or none within `timeout`, is final.
    pub async fn open(
        &self,
        cluster: &str,
        open: &Open,
        timeout: Duration,
    ) -> Result<Stream, Error> {
        // Only sessions whose agent listens: one just connected has not bound its listener
        // yet, one whose agent is stopping has dropped it. Neither is a failure.
        let sessions: Vec<SessionHandle> = match self.lock().get(cluster) {
            None => {
                return Err(Error::Unavailable(format!(
                    "cluster {cluster:?} is not connected"
                )));
            }
            Some(v) => v
                .iter()
                .filter(|c| c.session.binds().borrow().contains_key(AGENT_BIND))
                .map(|c| c.session.clone())
                .collect(),
        };
        if sessions.is_empty() {
            return Err(Error::Unavailable(format!(
                "cluster {cluster:?}'s agents are connecting or stopping: none listens yet"
            )));
        }
        let deadline = Instant::now() + timeout;
        let mut failures = Vec::new();
        for (i, session) in sessions.iter().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            // The tunnel's open (the agent's stream accept) gets an equal share of what is
            // left: it costs one round trip, so a session that does not complete it is dead.
            let share = left / u32::try_from(sessions.len() - i).unwrap_or(u32::MAX);
            match Self::try_open(session, open, share, deadline).await {
                Tried::Opened(stream) => return Ok(stream),
                Tried::Refused(reason) => return Err(Error::Upstream(reason)),
                Tried::Slow => {
                    return Err(Error::Unavailable(format!(
                        "cluster {cluster:?}'s agent did not answer within {timeout:?}"
                    )));
                }
                Tried::Failed(why) => {
                    self.demote(cluster, session.id());
                    failures.push(why);
                }
            }
        }
        Err(Error::Unavailable(format!(
            "cluster {cluster:?}: no stream could be opened on its {} listening agent session{} \
             within {timeout:?} ({})",
            sessions.len(),
            if sessions.len() == 1 { "" } else { "s" },
            if failures.is_empty() {
                "none tried".to_owned()
            } else {
                failures.join("; ")
            }
        )))
    }

    /// Opens the tunnel stream within `share`, then waits until `deadline` for the agent's
    /// answer: that includes its checks and its connect to the target, which no other replica
    /// would do faster, so a slow answer is final rather than a reason to try another session.
    async fn try_open(
        session: &SessionHandle,
        open: &Open,
        share: Duration,
        deadline: Instant,
    ) -> Tried {
        let opened = tokio::time::timeout(share, async {
            let mut stream = session.open_reverse(AGENT_BIND).await?;
            spur_tunnel::write_frame(&mut stream, open, MAX_FRAME).await?;
            Ok::<_, spur_tunnel::Error>(stream)
        })
        .await;
        let mut stream = match opened {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Tried::Failed(e.to_string()),
            Err(_) => return Tried::Failed(format!("the tunnel did not open within {share:?}")),
        };
        let answer = tokio::time::timeout_at(
            deadline.into(),
            spur_tunnel::read_frame::<_, Answer>(&mut stream, MAX_FRAME),
        )
        .await;
        match answer {
            Err(_) => Tried::Slow,
            Ok(Ok(Some(Answer::Ok))) => Tried::Opened(stream),
            Ok(Ok(Some(Answer::Error { reason }))) => Tried::Refused(reason),
            Ok(Ok(None)) => Tried::Failed("the agent closed the stream".into()),
            Ok(Err(e)) => Tried::Failed(e.to_string()),
        }
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

    /// Takes sessions from `server` until `stop`: every session of a cluster is kept (one per
    /// agent replica), the newest first (an agent restarted before its old session timed out
    /// is used at once), at most [`MAX_SESSIONS_PER_CLUSTER`].
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
            let extra = {
                let mut map = self.lock();
                let sessions = map.entry(name.clone()).or_default();
                sessions.insert(0, connected);
                (sessions.len() > MAX_SESSIONS_PER_CLUSTER)
                    .then(|| sessions.pop())
                    .flatten()
            };
            if let Some(old) = extra {
                old.session.goaway(
                    &format!(
                        "replaced by a newer session of the same cluster (the hub keeps at \
                         most {MAX_SESSIONS_PER_CLUSTER} per cluster)"
                    ),
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
                let removed = {
                    let mut map = clusters.lock();
                    let removed = map.get_mut(&name).is_some_and(|v| {
                        let before = v.len();
                        v.retain(|c| c.session.id() != handle.id());
                        v.len() < before
                    });
                    if map.get(&name).is_some_and(Vec::is_empty) {
                        map.remove(&name);
                    }
                    removed
                };
                if removed {
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
            let connected = self.all_sessions();
            let s = store.clone();
            let checked = tokio::task::spawn_blocking(move || {
                let version = s.data_version()?;
                let mut revoked = Vec::new();
                // None (PostgreSQL): another replica may have changed anything; check always.
                if version.is_none() || version != seen {
                    let active = s.active_clusters()?;
                    for (name, c) in &connected {
                        let valid = c.issued.is_some_and(|i| active.get(name) == Some(&i));
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
                    seen = version;
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
