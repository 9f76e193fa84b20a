//! Standalone mode (`spur-gateway --config FILE`): the same `spur-l4` listeners from a local
//! `L4Config` file (YAML or JSON, the schema the route server sends), without a cluster.
//!
//! ```text
//! FILE ──parse, validate──► spur_l4::ListenerSet ─► endpoints (addresses)
//!   ▲ SIGHUP: read again; an invalid file is logged and counted, the last good one keeps running
//! ```
//!
//! - Start-up refuses a file that does not parse or validate, naming the file and the field.
//! - The admin endpoints are those of the cluster mode (`/live`, `/ready`, `/metrics`,
//!   `/config_dump`); `/ready` is 200 from start-up (a configuration runs) until the drain.
//! - Shutdown drains as in the cluster mode: listeners stop taking sessions, open ones run on
//!   for the configuration's `drainGrace`.
//! - Endpoints are addresses only: no DNS names, no route server, no health reports.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use spur_l4::{L4Config, ListenerSet, ValidConfig};
use spur_runtime::admin::{AdminSource, Readiness};
use tokio_util::sync::CancellationToken;

use crate::Error;

/// Largest configuration file read.
const MAX_FILE: u64 = 16 * 1024 * 1024;

/// How a standalone gateway runs.
#[derive(Debug, Clone)]
pub struct StandaloneConfig {
    /// The `L4Config` file: JSON when its name ends in `.json` or its text starts with `{`,
    /// YAML otherwise.
    pub file: PathBuf,
    /// `/live`, `/ready`, `/metrics`, `/config_dump`; None serves no admin port.
    pub admin_addr: Option<SocketAddr>,
}

/// Reads and validates an `L4Config` file. The error names the file and the field.
pub fn load_config_file(path: &Path) -> Result<ValidConfig, Error> {
    let refuse = |reason: String| Error::File {
        path: path.to_owned(),
        reason,
    };
    let text = read_text(path).map_err(refuse)?;
    let config = parse_config(path, &text).map_err(refuse)?;
    config.validate().map_err(|e| refuse(e.to_string()))
}

fn read_text(path: &Path) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    if meta.len() > MAX_FILE {
        return Err(format!(
            "is {} bytes, more than the {MAX_FILE} a configuration may have",
            meta.len()
        ));
    }
    std::fs::read_to_string(path).map_err(|e| format!("cannot read: {e}"))
}

/// Parses YAML or JSON, with the path of the offending field in the error (serde_yaml_ng's
/// messages carry it; serde_json's get it from serde_path_to_error).
fn parse_config(path: &Path, text: &str) -> Result<L4Config, String> {
    let json = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"))
        || text.trim_start().starts_with('{');
    if !json {
        return serde_yaml_ng::from_str(text).map_err(|e| e.to_string());
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let config = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let at = e.path().to_string();
        // "." when the error is about the document itself.
        if at == "." {
            e.into_inner().to_string()
        } else {
            format!("{at}: {}", e.into_inner())
        }
    })?;
    de.end().map_err(|e| e.to_string())?;
    Ok(config)
}

/// The standalone gateway's own metrics (`spur_gateway_*`, with the same names as the
/// cluster mode's for the same things).
struct Metrics {
    updates: Family<Vec<(String, String)>, Counter>,
    version: Gauge,
}

impl Metrics {
    fn register(registry: &mut Registry) -> Self {
        let m = Metrics {
            updates: Family::default(),
            version: Gauge::default(),
        };
        registry.register(
            "config_updates",
            "Configurations read from the file, by result (applied; rejected: invalid or not bindable, the last good one keeps running)",
            m.updates.clone(),
        );
        registry.register(
            "config_version",
            "How many configurations have been applied from the file (1: the one read at start-up)",
            m.version.clone(),
        );
        m
    }

    fn update(&self, result: &str) {
        self.updates
            .get_or_create(&vec![("result".to_owned(), result.to_owned())])
            .inc();
    }
}

/// A running standalone gateway.
pub struct Standalone {
    /// The bound admin address, if served.
    pub admin_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    l4_stop: CancellationToken,
    admin_stop: CancellationToken,
    /// SIGHUP, installed by `start` so that one arriving before `run` is not the default exit.
    #[cfg(unix)]
    hup: Option<tokio::signal::unix::Signal>,
}

struct Shared {
    file: PathBuf,
    set: ListenerSet,
    registry: Registry,
    metrics: Metrics,
    draining: AtomicBool,
    /// Serialises reloads.
    state: tokio::sync::Mutex<State>,
}

struct State {
    /// Configurations applied so far (1: the one read at start-up).
    version: u64,
    /// What runs.
    running: ValidConfig,
    /// Why the last file read did not run (empty: it runs).
    error: String,
}

impl Standalone {
    /// Reads and validates the file, opens its listeners and the admin port. Fails (naming the
    /// file and the field) when the file is invalid or a port cannot be bound.
    pub async fn start(config: StandaloneConfig) -> Result<Standalone, Error> {
        #[cfg(unix)]
        let hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot handle SIGHUP: the configuration is read at start-up only");
                None
            }
        };
        let valid = load_config_file(&config.file)?;
        let admin = crate::bind_admin(config.admin_addr).await?;
        let admin_addr = admin.as_ref().and_then(|l| l.local_addr().ok());
        let mut registry = Registry::default();
        let l4_stop = CancellationToken::new();
        let set = ListenerSet::new(registry.sub_registry_with_prefix("spur"), l4_stop.clone());
        let metrics = Metrics::register(registry.sub_registry_with_prefix("spur_gateway"));
        set.apply(valid.clone()).await.map_err(|e| Error::File {
            path: config.file.clone(),
            reason: e.to_string(),
        })?;
        metrics.update("applied");
        metrics.version.set(1);
        let shared = Arc::new(Shared {
            file: config.file.clone(),
            set,
            registry,
            metrics,
            draining: AtomicBool::new(false),
            state: tokio::sync::Mutex::new(State {
                version: 1,
                running: valid,
                error: String::new(),
            }),
        });
        let admin_stop = CancellationToken::new();
        if let Some(l) = admin {
            tokio::spawn(crate::admin::serve(l, shared.clone(), admin_stop.clone()));
        }
        tracing::info!(
            file = %config.file.display(),
            admin = ?admin_addr,
            listeners = shared.set.listeners().len(),
            "standalone gateway started"
        );
        Ok(Standalone {
            admin_addr,
            shared,
            l4_stop,
            admin_stop,
            #[cfg(unix)]
            hup,
        })
    }

    /// Reads the file again and applies it: listeners and endpoints that did not change keep
    /// their sockets, sessions and health state. An invalid file (or one whose new ports
    /// cannot be bound) is logged and counted, and the last good configuration keeps running.
    /// Returns the version running.
    pub async fn reload(&self) -> Result<u64, Error> {
        let shared = &self.shared;
        let mut state = shared.state.lock().await;
        let applied = match load_config_file(&shared.file) {
            Ok(valid) if valid == state.running => {
                tracing::info!(file = %shared.file.display(), "configuration unchanged");
                shared.metrics.update("unchanged");
                state.error.clear();
                return Ok(state.version);
            }
            Ok(valid) => match shared.set.apply(valid.clone()).await {
                Ok(()) => Ok(valid),
                Err(e) => Err(Error::File {
                    path: shared.file.clone(),
                    reason: e.to_string(),
                }),
            },
            Err(e) => Err(e),
        };
        match applied {
            Ok(valid) => {
                state.version += 1;
                state.running = valid;
                state.error.clear();
                shared.metrics.update("applied");
                shared
                    .metrics
                    .version
                    .set(i64::try_from(state.version).unwrap_or(i64::MAX));
                tracing::info!(file = %shared.file.display(), version = state.version, "configuration applied");
                Ok(state.version)
            }
            Err(e) => {
                shared.metrics.update("rejected");
                tracing::warn!(error = %e, "configuration refused; the last good one keeps running");
                state.error = e.to_string();
                Err(e)
            }
        }
    }

    /// Serves until `shutdown` resolves, reading the file again on every SIGHUP, then drains
    /// ([`Standalone::shutdown`]). Call `spur_runtime::shutdown_signal()` for `shutdown` before
    /// [`Standalone::start`], so a SIGTERM from then on is a clean shutdown.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        #[cfg(unix)]
        let hup = self.hup.take();
        #[cfg(not(unix))]
        let hup: Option<()> = None;
        match hup {
            #[cfg(unix)]
            Some(mut hup) => loop {
                tokio::select! {
                    () = &mut shutdown => break,
                    Some(()) = hup.recv() => {
                        tracing::info!("SIGHUP: reading the configuration again");
                        // Refusals are logged and counted by reload.
                        let _ = self.reload().await;
                    }
                }
            },
            _ => shutdown.await,
        }
        self.shutdown().await;
    }

    /// True until the drain starts.
    pub fn is_ready(&self) -> bool {
        !self.shared.draining.load(Ordering::SeqCst)
    }

    /// The running listeners (their bound addresses, their clusters' health).
    pub fn listeners(&self) -> &ListenerSet {
        &self.shared.set
    }

    /// Drains and stops: `/ready` turns 503, listeners stop taking sessions, open sessions run
    /// on for the configuration's `drainGrace`. Returns once everything ended.
    pub async fn shutdown(self) {
        self.shared.draining.store(true, Ordering::SeqCst);
        tracing::info!("gateway draining");
        self.l4_stop.cancel();
        self.shared.set.closed().await;
        self.admin_stop.cancel();
        tracing::info!("gateway stopped");
    }
}

impl AdminSource for Shared {
    fn readiness(&self) -> Readiness {
        if self.draining.load(Ordering::SeqCst) {
            Readiness::Draining
        } else {
            Readiness::Ready
        }
    }

    fn registry(&self) -> &Registry {
        &self.registry
    }

    async fn config_dump(&self) -> serde_json::Value {
        let state = self.state.lock().await;
        serde_json::json!({
            "file": self.file.display().to_string(),
            "version": state.version,
            "error": state.error,
            "listeners": self.set.listeners(),
            "clusters": self.set.clusters(),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn parse(name: &str, text: &str) -> Result<L4Config, String> {
        parse_config(Path::new(name), text)
    }

    #[test]
    fn yaml_and_json_with_field_paths() {
        let yaml = "listeners:\n- name: u\n  protocol: udp\n  port: \"127.0.0.1:0\"\n  cluster:\n    name: c\n    endpoints: [{id: a, address: \"127.0.0.1:9\"}]\n";
        let c = parse("l4.yaml", yaml).unwrap();
        assert_eq!(c.listeners[0].name, "u");
        let json = r#"{"listeners": [{"name": "u", "protocol": "udp", "port": 0,
            "cluster": {"name": "c", "endpoints": [{"id": "a", "address": "127.0.0.1:9"}]}}]}"#;
        assert_eq!(parse("l4.conf", json).unwrap().listeners[0].name, "u");

        let e = parse(
            "l4.yaml",
            &yaml.replace("    name: c\n", "    name: c\n    lb: fastest\n"),
        )
        .unwrap_err();
        assert!(
            e.starts_with("listeners[0].cluster.lb: unknown variant `fastest`"),
            "{e}"
        );
        let e = parse("l4.yaml", &yaml.replace("protocol: udp", "protocl: udp")).unwrap_err();
        assert!(
            e.starts_with("listeners[0]: unknown field `protocl`"),
            "{e}"
        );
        let e = parse("l4.yaml", &yaml.replace("\"127.0.0.1:0\"", "70000")).unwrap_err();
        assert!(
            e.starts_with("listeners[0].port: port 70000 is out of range"),
            "{e}"
        );
        let e = parse("l4.json", &json.replace("\"protocol\"", "\"protocl\"")).unwrap_err();
        assert!(
            e.starts_with("listeners[0]") && e.contains("unknown field `protocl`"),
            "{e}"
        );
        let e = parse("l4.json", &json.replace("\"port\": 0", "\"port\": 70000")).unwrap_err();
        assert!(
            e.starts_with("listeners[0].port: port 70000 is out of range"),
            "{e}"
        );
        let e = parse("l4.json", &format!("{json} x")).unwrap_err();
        assert!(e.contains("trailing characters"), "{e}");
    }
}
