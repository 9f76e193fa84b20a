//! Graceful drain: one signal that stops listeners and asks connections to finish, and a tracker
//! that knows when they all have.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Cloned into every listener and connection task.
#[derive(Clone, Debug, Default)]
pub struct Drain {
    token: CancellationToken,
    tracker: TaskTracker,
}

impl Drain {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts draining: listeners stop accepting; HTTP connections finish in-flight requests and
    /// close (HTTP/2 with GOAWAY).
    pub fn start(&self) {
        self.token.cancel();
    }

    pub fn is_draining(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves when draining starts.
    pub async fn signaled(&self) {
        self.token.cancelled().await
    }

    /// Spawns a task that the drain waits for.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(fut)
    }

    /// Starts draining (if not yet) and waits up to `grace` for every tracked task to end.
    /// Returns the number of tasks still running when the grace period ran out (they are dropped
    /// with the runtime).
    pub async fn wait(&self, grace: Duration) -> usize {
        self.start();
        self.tracker.close();
        match tokio::time::timeout(grace, self.tracker.wait()).await {
            Ok(()) => 0,
            Err(_) => self.tracker.len(),
        }
    }

    /// Tasks currently tracked (connections, tunnels, listeners).
    pub fn in_flight(&self) -> usize {
        self.tracker.len()
    }
}
