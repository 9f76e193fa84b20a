//! The gRPC service (`spur.traffic.v1.Traffic`): sidecars watch their settings and push what
//! they captured; readers query the store and tail what arrives.

use std::sync::Arc;

use spur_proto::traffic::traffic_server::{Traffic, TrafficServer};
use spur_proto::traffic::{
    CaptureSettings, Filter, PushReply, PushRequest, QueryReply, QueryRequest, StoredExchange,
    TailEvent, TailRequest, WatchSettingsRequest, tail_event,
};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::Error;
use crate::auth::Authorizer;
use crate::metrics::Metrics;
use crate::settings::{Baseline, SettingsIndex};
use crate::store::{self, Store};

/// Most exchanges one Push may carry.
pub const MAX_BATCH: usize = 1024;
/// Largest message the server decodes: a 16 MiB push and room for its framing.
pub const MAX_MESSAGE_BYTES: usize = 17 * 1024 * 1024;
/// Stored exchanges waiting for the slowest Tail reader; past it, that reader lags.
const TAIL_BUFFER: usize = 4096;
/// Messages queued per open stream before its task waits for the client.
const STREAM_BUFFER: usize = 16;

/// The `Traffic` service. Cheap to clone: clones share the store and the Tail feed.
#[derive(Clone)]
pub struct TrafficService {
    store: Store,
    settings: SettingsIndex,
    auth: Authorizer,
    metrics: Metrics,
    tail: broadcast::Sender<Arc<StoredExchange>>,
    /// Ends every open stream (WatchSettings, Tail) when the server drains.
    stop: CancellationToken,
}

impl TrafficService {
    pub fn new(
        store: Store,
        settings: SettingsIndex,
        auth: Authorizer,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> Self {
        let (tail, _) = broadcast::channel(TAIL_BUFFER);
        TrafficService {
            store,
            settings,
            auth,
            metrics,
            tail,
            stop,
        }
    }

    /// The tonic service, accepting pushes up to [`MAX_MESSAGE_BYTES`].
    pub fn into_server(self) -> TrafficServer<Self> {
        TrafficServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    async fn push_inner(&self, req: Request<PushRequest>) -> Result<PushReply, Status> {
        let caller = self.auth.sidecar(req.metadata()).await?;
        let push = req.into_inner();
        if push.exchanges.len() > MAX_BATCH {
            return Err(Status::invalid_argument(format!(
                "{} exchanges in one push; at most {MAX_BATCH} (nothing stored)",
                push.exchanges.len()
            )));
        }
        for (i, e) in push.exchanges.iter().enumerate() {
            let baseline = e.baseline.as_ref().ok_or_else(|| {
                Status::invalid_argument(format!("exchanges[{i}]: no baseline (nothing stored)"))
            })?;
            Baseline::try_from(baseline).map_err(|e| {
                Status::invalid_argument(format!("exchanges[{i}]: {e} (nothing stored)"))
            })?;
        }
        // The whole batch or nothing: a sidecar never pushes for another namespace by mistake.
        for e in &push.exchanges {
            let namespace = e.baseline.as_ref().map_or("", |b| b.namespace.as_str());
            caller.may_use(namespace)?;
        }
        let stored = self.store.insert(push.exchanges).await.map_err(status)?;
        self.metrics.sidecar_dropped.inc_by(push.dropped);
        self.metrics.pushes.inc();
        self.metrics.exchanges_stored.inc_by(stored.len() as u64);
        let count = stored.len();
        for s in stored {
            // No reader: nothing to do.
            let _ = self.tail.send(Arc::new(s));
        }
        Ok(PushReply {
            stored: u32::try_from(count).unwrap_or(u32::MAX),
        })
    }

    async fn query_inner(&self, req: Request<QueryRequest>) -> Result<QueryReply, Status> {
        let filter = req.get_ref().filter.clone().unwrap_or_default();
        self.auth.reader(req.metadata(), &filter.sandbox).await?;
        store::validate_filter(&filter).map_err(status)?;
        let limit = req.get_ref().limit;
        let exchanges = self.store.query(filter, limit).await.map_err(status)?;
        Ok(QueryReply { exchanges })
    }

    async fn watch_inner(
        &self,
        req: Request<WatchSettingsRequest>,
    ) -> Result<ReceiverStream<Result<CaptureSettings, Status>>, Status> {
        let caller = self.auth.sidecar(req.metadata()).await?;
        let workload = req
            .get_ref()
            .baseline
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("baseline is required"))?;
        let baseline = Baseline::try_from(workload).map_err(status)?;
        caller.may_use(&baseline.namespace)?;
        let mut settings = self.settings.watch(&baseline);
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let stop = self.stop.clone();
        let watchers = self.metrics.settings_watchers.clone();
        tokio::spawn(async move {
            watchers.inc();
            let _open = Dec(watchers);
            // The current settings first, then each change.
            let mut current = settings.borrow_and_update().clone();
            loop {
                if tx.send(Ok(current)).await.is_err() {
                    return;
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tx.closed() => return,
                    changed = settings.changed() => if changed.is_err() {
                        // The index was dropped: the server is going away.
                        return;
                    },
                }
                current = settings.borrow_and_update().clone();
            }
        });
        Ok(ReceiverStream::new(rx))
    }

    async fn tail_inner(
        &self,
        req: Request<TailRequest>,
    ) -> Result<ReceiverStream<Result<TailEvent, Status>>, Status> {
        let filter = req.get_ref().filter.clone().unwrap_or_default();
        self.auth.reader(req.metadata(), &filter.sandbox).await?;
        store::validate_filter(&filter).map_err(status)?;
        // Subscribed before answering: nothing stored after the call is missed.
        let feed = self.tail.subscribe();
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let stop = self.stop.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(tail(feed, filter, tx, stop, metrics));
        Ok(ReceiverStream::new(rx))
    }
}

/// Feeds one Tail stream until the client goes away or the server drains. A client slower
/// than the store fills its queue, its place in the feed falls behind, and it is told how many
/// exchanges it missed (all exchanges, not only matching ones: the skipped ones are gone
/// before anyone could look at them).
async fn tail(
    mut feed: broadcast::Receiver<Arc<StoredExchange>>,
    filter: Filter,
    tx: mpsc::Sender<Result<TailEvent, Status>>,
    stop: CancellationToken,
    metrics: Metrics,
) {
    metrics.tail_subscribers.inc();
    let _open = Dec(metrics.tail_subscribers.clone());
    loop {
        let event = tokio::select! {
            () = stop.cancelled() => return,
            () = tx.closed() => return,
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

fn status(e: Error) -> Status {
    match e {
        Error::Invalid(m) => Status::invalid_argument(m),
        Error::Closed => Status::unavailable("the store is shutting down"),
        e => {
            // Logged where it happened; the client learns only that it failed.
            tracing::debug!(error = %e, "store call failed");
            Status::internal("the store failed; see its log")
        }
    }
}

fn code<T>(r: &Result<T, Status>) -> tonic::Code {
    match r {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    }
}

#[tonic::async_trait]
impl Traffic for TrafficService {
    type WatchSettingsStream = ReceiverStream<Result<CaptureSettings, Status>>;
    type TailStream = ReceiverStream<Result<TailEvent, Status>>;

    async fn watch_settings(
        &self,
        req: Request<WatchSettingsRequest>,
    ) -> Result<Response<Self::WatchSettingsStream>, Status> {
        let out = self.watch_inner(req).await;
        self.metrics.call("WatchSettings", code(&out));
        out.map(Response::new)
    }

    async fn push(&self, req: Request<PushRequest>) -> Result<Response<PushReply>, Status> {
        let out = self.push_inner(req).await;
        self.metrics.call("Push", code(&out));
        out.map(Response::new)
    }

    async fn query(&self, req: Request<QueryRequest>) -> Result<Response<QueryReply>, Status> {
        let out = self.query_inner(req).await;
        self.metrics.call("Query", code(&out));
        out.map(Response::new)
    }

    async fn tail(&self, req: Request<TailRequest>) -> Result<Response<Self::TailStream>, Status> {
        let out = self.tail_inner(req).await;
        self.metrics.call("Tail", code(&out));
        out.map(Response::new)
    }
}
