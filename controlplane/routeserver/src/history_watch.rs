//! `spur.history.v1.RouteHistory`: one baseline's route history (see [`crate::history`]), the
//! complete set of spans first and whenever it changes, and a watermark at least every
//! [`HEARTBEAT`]. Who may watch: whoever may read that baseline's rules through the Routes API
//! (the same check, repeated as the watch lives).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use spur_proto::history::route_history_server::RouteHistory;
use spur_proto::history::{HistoryUpdate, SpanSet, WatchHistoryRequest};
use spur_routing::{BaselineWorkload, Span};
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::auth::{Authenticator, Scope};
use crate::history::History;
use crate::index::Filter;
use crate::metrics::Metrics;
use crate::watch::Reader;

/// Longest time between two updates of a stream: a relay holding records for a watermark waits
/// at most about this long while the server is healthy.
pub(crate) const HEARTBEAT: Duration = Duration::from_millis(500);

/// Updates queued per stream before its task waits for the reader.
const BUFFER: usize = 4;

pub(crate) struct HistoryHandler {
    pub(crate) history: History,
    pub(crate) metrics: Metrics,
    pub(crate) stop: CancellationToken,
    pub(crate) auth: Authenticator,
}

type UpdateStream = Pin<Box<dyn Stream<Item = Result<HistoryUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl RouteHistory for HistoryHandler {
    type WatchStream = UpdateStream;

    async fn watch(
        &self,
        request: Request<WatchHistoryRequest>,
    ) -> Result<Response<UpdateStream>, Status> {
        let b = request.get_ref().baseline.clone().unwrap_or_default();
        if b.kind.is_empty() || b.namespace.is_empty() || b.name.is_empty() {
            return Err(Status::invalid_argument(
                "baseline: kind, namespace and name are all required",
            ));
        }
        let filter = Filter {
            kind: b.kind.clone(),
            namespace: b.namespace.clone(),
            name: b.name.clone(),
            ..Filter::default()
        };
        let scope = Scope::Rules(&filter);
        let grant = crate::grpc::authorize(&self.auth, &self.metrics, &request, scope).await?;
        let baseline = BaselineWorkload {
            kind: b.kind,
            namespace: b.namespace,
            name: b.name,
        };
        let (tx, rx) = mpsc::channel(BUFFER);
        let history = self.history.clone();
        let metrics = self.metrics.clone();
        let stop = self.stop.clone();
        tokio::spawn(async move {
            metrics.history_watchers.inc();
            tokio::select! {
                () = run(&history, &baseline, &tx) => {}
                () = stop.cancelled() => {}
            }
            metrics.history_watchers.dec();
        });
        let reader = Reader {
            auth: self.auth.clone(),
            authorization: request
                .metadata()
                .get("authorization")
                .map(|v| v.as_bytes().to_vec()),
            filter,
            grant,
            metrics: self.metrics.clone(),
        };
        let updates = futures_util::StreamExt::map(
            crate::watch::guarded(tokio_stream::wrappers::ReceiverStream::new(rx), reader),
            |u| u.map_err(Status::from),
        );
        Ok(Response::new(Box::pin(updates)))
    }
}

/// Feeds one stream until its reader goes: an update whenever the history changes and at
/// least every [`HEARTBEAT`], each with the spans only when they differ from the last sent.
async fn run(history: &History, baseline: &BaselineWorkload, tx: &mpsc::Sender<HistoryUpdate>) {
    let mut changes = history.subscribe();
    let mut tick = tokio::time::interval(HEARTBEAT);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut sent: Option<Arc<Vec<Span>>> = None;
    loop {
        changes.borrow_and_update();
        let (snap, watermark_ms) = history.watermark();
        let spans = snap.spans(baseline);
        let set = match &sent {
            Some(old) if Arc::ptr_eq(old, &spans) || **old == *spans => None,
            _ => Some(SpanSet {
                spans: spans
                    .iter()
                    .map(spur_routing::wire::span_to_proto)
                    .collect(),
            }),
        };
        sent = Some(spans);
        if tx
            .send(HistoryUpdate {
                spans: set,
                watermark_ms,
            })
            .await
            .is_err()
        {
            return;
        }
        tokio::select! {
            _ = tick.tick() => {}
            r = changes.changed() => if r.is_err() { return },
            () = tx.closed() => return,
        }
    }
}
