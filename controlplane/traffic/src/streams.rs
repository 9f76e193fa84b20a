//! The long-lived streams (WatchSettings, Tail): each runs in its own task until its client
//! goes, the server drains, or its caller's access lapses. The caller is checked again, without
//! the cache, every so often and when its token expires ([`Authorizer::next_recheck`]): a
//! deleted pod, a revoked binding or an expired token ends the stream with UNAUTHENTICATED or
//! PERMISSION_DENIED, as the route server's watches do. An API server that cannot answer never
//! ends a stream: the check is tried again later.

use std::sync::Arc;
use std::time::Duration;

use spur_proto::traffic::{CaptureSettings, Filter, StoredExchange, TailEvent, tail_event};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::auth::{Authorizer, Credentials};
use crate::metrics::Metrics;
use crate::settings::{Baseline, SettingsIndex};
use crate::store;

/// How soon a stream is checked again when the API server could not answer the last check.
const RECHECK_RETRY: Duration = Duration::from_secs(30);

/// What a stream's caller was allowed when it opened.
pub(crate) enum Access {
    /// The sidecar of this baseline.
    Sidecar(Baseline),
    /// A reader of this sandbox ("" for all).
    Reader(String),
}

/// An open stream's re-checks.
pub(crate) struct Recheck {
    auth: Authorizer,
    credentials: Credentials,
    access: Access,
    metrics: Metrics,
    next: Option<Instant>,
}

impl Recheck {
    pub(crate) fn new(
        auth: Authorizer,
        credentials: Credentials,
        access: Access,
        metrics: Metrics,
    ) -> Self {
        let next = auth.next_recheck(&credentials).map(|d| Instant::now() + d);
        Recheck {
            auth,
            credentials,
            access,
            metrics,
            next,
        }
    }

    /// Resolves when the next check is due (never, for the static token).
    async fn due(&self) {
        match self.next {
            Some(t) => tokio::time::sleep_until(t).await,
            None => std::future::pending().await,
        }
    }

    /// Checks the caller again; the refusal that ends the stream, if any.
    async fn check(&mut self) -> Option<Status> {
        let result = match &self.access {
            Access::Sidecar(baseline) => self
                .auth
                .sidecar_with(&self.credentials, true)
                .await
                .and_then(|caller| caller.may_use(baseline)),
            Access::Reader(sandbox) => {
                self.auth
                    .reader_with(&self.credentials, sandbox, true)
                    .await
            }
        };
        match result {
            Ok(()) => {
                self.next = self
                    .auth
                    .next_recheck(&self.credentials)
                    .map(|d| Instant::now() + d);
                None
            }
            Err(s) if s.code() == tonic::Code::Unavailable => {
                tracing::debug!(reason = %s.message(), "cannot check a stream's caller again now");
                self.next = Some(Instant::now() + RECHECK_RETRY);
                None
            }
            Err(s) => {
                self.metrics.streams_revoked.inc();
                tracing::info!(reason = %s.message(), "stream ended: its caller may no longer read it");
                Some(s)
            }
        }
    }
}

/// Feeds one WatchSettings stream: the current settings first, then each change. Nothing is
/// sent before `index` has loaded its settings: the defaults sent meanwhile would turn off a
/// capture the sidecar is running (a store restarting in a cluster whose sandboxes capture).
pub(crate) async fn settings(
    index: SettingsIndex,
    mut settings: watch::Receiver<CaptureSettings>,
    tx: mpsc::Sender<Result<CaptureSettings, Status>>,
    mut recheck: Recheck,
    stop: CancellationToken,
    metrics: Metrics,
) {
    metrics.settings_watchers.inc();
    let _open = Dec(metrics.settings_watchers.clone());
    let loaded = index.loaded();
    let mut loaded = std::pin::pin!(loaded);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tx.closed() => return,
            () = &mut loaded => break,
            () = recheck.due() => {
                if let Some(refused) = recheck.check().await {
                    let _ = tx.send(Err(refused)).await;
                    return;
                }
            }
        }
    }
    let mut current = settings.borrow_and_update().clone();
    loop {
        if tx.send(Ok(current)).await.is_err() {
            return;
        }
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tx.closed() => return,
                changed = settings.changed() => {
                    if changed.is_err() {
                        // The index was dropped: the server is going away.
                        return;
                    }
                    break;
                }
                () = recheck.due() => {
                    if let Some(refused) = recheck.check().await {
                        let _ = tx.send(Err(refused)).await;
                        return;
                    }
                }
            }
        }
        current = settings.borrow_and_update().clone();
    }
}

/// Feeds one Tail stream until the client goes away, the server drains or the reader's access
/// lapses. A client slower than the store fills its queue, its place in the feed falls behind,
/// and it is told how many exchanges it missed (all exchanges, not only matching ones: the
/// skipped ones are gone before anyone could look at them).
pub(crate) async fn tail(
    mut feed: broadcast::Receiver<Arc<StoredExchange>>,
    filter: Filter,
    tx: mpsc::Sender<Result<TailEvent, Status>>,
    mut recheck: Recheck,
    stop: CancellationToken,
    metrics: Metrics,
) {
    metrics.tail_subscribers.inc();
    let _open = Dec(metrics.tail_subscribers.clone());
    loop {
        let event = tokio::select! {
            () = stop.cancelled() => return,
            () = tx.closed() => return,
            () = recheck.due() => {
                if let Some(refused) = recheck.check().await {
                    let _ = tx.send(Err(refused)).await;
                    return;
                }
                continue;
            }
            next = feed.recv() => match next {
                Ok(s) => {
                    let matching = s.exchange.as_ref().is_some_and(|e| store::matches(&filter, e));
                    if !matching {
                        continue;
                    }
                    tail_event::Event::Exchange(StoredExchange::clone(&s))
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    metrics.tail_lagged.inc_by(n);
                    tail_event::Event::Lagged(n)
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
        };
        let sent = tokio::select! {
            () = stop.cancelled() => return,
            r = tx.send(Ok(TailEvent { event: Some(event) })) => r,
        };
        if sent.is_err() {
            return;
        }
    }
}

/// Decrements a gauge when an open stream's task ends, however it ends.
struct Dec(prometheus_client::metrics::gauge::Gauge);

impl Drop for Dec {
    fn drop(&mut self) {
        self.0.dec();
    }
}
