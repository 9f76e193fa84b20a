//! The admin server: `/live`, `/ready` (200 once a first configuration runs, 503 while
//! draining), `/metrics` (Prometheus text) and `/config_dump` (JSON, loopback clients only),
//! answered by `spur_runtime::admin` (shared with the sidecar's). It outlives the listeners'
//! drain, so probes and scrapes answer until the end.

use std::sync::Arc;

use prometheus_client::registry::Registry;
use spur_runtime::admin::{AdminSource, Readiness};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::Shared;

pub(crate) async fn serve<S: AdminSource>(
    listener: TcpListener,
    source: Arc<S>,
    stop: CancellationToken,
) {
    spur_runtime::admin::serve(listener, source, stop).await
}

impl AdminSource for Shared {
    fn readiness(&self) -> Readiness {
        if self.is_draining() {
            Readiness::Draining
        } else if self.is_ready() {
            Readiness::Ready
        } else {
            Readiness::Waiting("waiting for a first configuration from the route server")
        }
    }

    fn registry(&self) -> &Registry {
        &self.registry
    }

    async fn config_dump(&self) -> serde_json::Value {
        Shared::config_dump(self).await
    }
}
