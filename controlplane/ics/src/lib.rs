//! The io context server (`spur-ics serve`): keeps each io context (the values a sandbox
//! resource's workflow steps hand each other) in a Secret, and serves a step pod only its own
//! work unit's inputs and outputs (`proto/io.proto`, package `spur.io.v1`).
//!
//! ```text
//! step pod ──TLS, Bearer <projected token, audience spur-io>──► GetInputs / PutOutputs
//!                                   │ TokenReview: pod name + UID
//!                                   │ ObjectLifecycleMethods status: is that pod the unit's?
//!                                   ▼
//!                      Secret spur-io-<context> (this namespace), keys <unit>.<output>
//! ```
//!
//! Values are never logged and never written to a spec or status.

mod auth;
mod metrics;
mod service;

use std::net::SocketAddr;
use std::time::Duration;

use kube::Client;
use spur_serving::ServingTls;
use tokio_util::sync::CancellationToken;

pub use auth::{AUDIENCE, PodIdentity};
pub use metrics::Metrics;

/// Everything that can fail in the io context server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("serving: {0}")]
    Serve(String),
}

/// How the server runs (flags of `spur-ics serve`).
#[derive(Debug, Clone)]
pub struct Config {
    /// The namespace of the io context Secrets.
    pub namespace: String,
    pub listen: SocketAddr,
    /// The serving certificate; `None` serves plaintext (`--insecure-plaintext`, tests only).
    pub tls: Option<ServingTls>,
    /// The audience step pods' tokens must be issued for.
    pub audience: String,
}

impl Config {
    pub fn validate(&self) -> Result<(), Error> {
        if self.namespace.is_empty() {
            return Err(Error::Config("--namespace is required".into()));
        }
        if self.audience.is_empty() {
            return Err(Error::Config("--audience must not be empty".into()));
        }
        Ok(())
    }
}

/// A bound server: [`Server::run`] serves until the token is cancelled, then drains.
pub struct Server {
    listener: tokio::net::TcpListener,
    local: SocketAddr,
    cfg: Config,
    client: Client,
    metrics: Metrics,
}

impl Server {
    /// Binds the address (an error names it) and checks the configuration.
    pub async fn bind(cfg: Config, client: Client, metrics: Metrics) -> Result<Server, Error> {
        cfg.validate()?;
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| Error::Config(format!("cannot bind {}: {e}", cfg.listen)))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Config(e.to_string()))?;
        Ok(Server {
            listener,
            local,
            cfg,
            client,
            metrics,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Serves until `stop`; in-flight calls finish (bounded by the drain timeout).
    pub async fn run(self, stop: CancellationToken) -> Result<(), Error> {
        let tasks = spur_runtime::Drain::under(&stop);
        let inner_stop = tasks.token();
        let tls = match &self.cfg.tls {
            Some(files) => Some(
                spur_serving::tls::start(files, &tasks, inner_stop.clone())
                    .map_err(|e| Error::Tls(e.to_string()))?
                    .grpc,
            ),
            None => None,
        };
        let incoming =
            spur_serving::tls::incoming(self.listener, self.local, tls, &tasks, inner_stop.clone());
        let handler = service::Handler {
            auth: auth::Authenticator::new(self.client.clone(), self.cfg.audience.clone()),
            client: self.client,
            namespace: self.cfg.namespace,
            metrics: self.metrics,
        };
        let serve_stop = inner_stop.clone();
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .tcp_nodelay(true)
                .timeout(Duration::from_secs(30))
                .add_service(spur_proto::io::io_context_server::IoContextServer::new(
                    handler,
                ))
                .serve_with_incoming_shutdown(incoming.into_stream(), serve_stop.cancelled())
                .await
        });
        stop.cancelled().await;
        let served = tokio::time::timeout(Duration::from_secs(20), server).await;
        tasks.wait(Duration::from_secs(5)).await;
        match served {
            Ok(Ok(Ok(()))) | Err(_) => Ok(()),
            Ok(Ok(Err(e))) => Err(Error::Serve(e.to_string())),
            Ok(Err(e)) => Err(Error::Serve(format!("server task: {e}"))),
        }
    }
}
