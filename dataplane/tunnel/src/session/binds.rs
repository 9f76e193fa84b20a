//! The client's reverse listeners (bind id → listener), which outlive sessions: the client
//! registers them, and each session re-sends them, acknowledges them and routes reverse streams
//! to them.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{mpsc, watch};
use tracing::warn;

use super::{Shared, lock};
use crate::error::Error;
use crate::stream::Incoming;
use crate::wire::Control;

/// Whether a reverse listener is registered with the current session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BindStatus {
    /// Waiting for a session (or for the server's answer).
    Pending,
    Active,
    /// The server refused it; the listener yields no more streams.
    Rejected(String),
}

struct BindEntry {
    meta: String,
    generation: u64,
    tx: mpsc::Sender<Incoming>,
    status: watch::Sender<BindStatus>,
}

/// The client's reverse listeners; outlives sessions.
#[derive(Default)]
pub(crate) struct BindRegistry {
    entries: Mutex<HashMap<String, BindEntry>>,
    generations: AtomicU64,
}

impl BindRegistry {
    pub(crate) fn add(
        &self,
        id: &str,
        meta: &str,
        tx: mpsc::Sender<Incoming>,
        status: watch::Sender<BindStatus>,
    ) -> Result<u64, Error> {
        let mut entries = lock(&self.entries);
        if entries.contains_key(id) {
            return Err(Error::Config(format!("bind {id:?} exists already")));
        }
        let generation = self.generations.fetch_add(1, Ordering::Relaxed);
        entries.insert(
            id.to_owned(),
            BindEntry {
                meta: meta.to_owned(),
                generation,
                tx,
                status,
            },
        );
        Ok(generation)
    }

    pub(crate) fn remove(&self, id: &str, generation: u64) -> bool {
        let mut entries = lock(&self.entries);
        if entries.get(id).is_some_and(|e| e.generation == generation) {
            entries.remove(id);
            true
        } else {
            false
        }
    }

    /// Routes a reverse stream to its listener, or rejects it.
    pub(crate) async fn dispatch(&self, bind: &str, incoming: Incoming) {
        let tx = lock(&self.entries).get(bind).map(|e| e.tx.clone());
        let Some(tx) = tx else {
            incoming
                .reject(&format!("no reverse listener {bind:?}"))
                .await;
            return;
        };
        match tx.try_send(incoming) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(i)) => {
                i.reject("busy: too many streams waiting to be accepted")
                    .await
            }
            Err(mpsc::error::TrySendError::Closed(i)) => i.reject("reverse listener closed").await,
        }
    }

    pub(crate) fn acked(&self, id: &str, error: Option<String>) {
        let mut entries = lock(&self.entries);
        match error {
            None => {
                if let Some(e) = entries.get(id) {
                    e.status.send_replace(BindStatus::Active);
                }
            }
            Some(reason) => {
                warn!(bind = id, %reason, "reverse bind refused by the server");
                if let Some(e) = entries.remove(id) {
                    e.status.send_replace(BindStatus::Rejected(reason));
                }
            }
        }
    }

    pub(crate) fn all_pending(&self) {
        for e in lock(&self.entries).values() {
            e.status.send_replace(BindStatus::Pending);
        }
    }

    /// Sends every bind to a new session.
    pub(crate) fn reregister(&self, session: &Shared) {
        let binds: Vec<(String, String)> = lock(&self.entries)
            .iter()
            .map(|(id, e)| (id.clone(), e.meta.clone()))
            .collect();
        for (id, meta) in binds {
            session.send_later(Control::Bind { id, meta });
        }
    }

    pub(crate) fn close_all(&self) {
        lock(&self.entries).clear();
    }
}
