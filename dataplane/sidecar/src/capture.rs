//! Traffic capture in the sidecar (docs/traffic.md): which routing keys are captured (settings
//! watched from the traffic store, or read from a file), and the shipper that sends captured
//! exchanges to the store. Capture never holds traffic back: the proxy copies into a bounded
//! ring, the shipper drains it off the request path, and what cannot be shipped is dropped and
//! counted (`spur_capture_dropped_total`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use clap::Args;
use serde::Deserialize;
use spur_discovery::{Connector, RouteServerConn};
use spur_proto::traffic as pb;
use spur_proto::traffic::traffic_client::TrafficClient;
use spur_proxy::capture::{
    Capture, CaptureBounds, CaptureLimits, CaptureTag, CapturedBody, CapturedExchange,
    CapturedProtocol, DropReason,
};
use spur_routing::BaselineWorkload;
use spur_routing::extract::is_valid_key;
use tokio_util::sync::CancellationToken;

use crate::Error;

/// Exchanges per push (the store takes at most 1024).
const BATCH: usize = 512;
/// How long the shipper lets exchanges gather before a push, so a busy sidecar sends a few
/// large pushes instead of one per request.
const BATCH_WINDOW: Duration = Duration::from_millis(100);
const PUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Routing keys one baseline may capture (the store sends far fewer: one per sandbox).
const MAX_KEYS: usize = 4096;

/// Capture flags of `spur-sidecar` (each also settable through the `SPUR_*` variable shown).
#[derive(Debug, Clone, Args)]
pub struct CaptureArgs {
    /// Traffic store (host:port, or http://host:port) that sends this baseline's capture
    /// settings and receives captured exchanges. Without it nothing is captured.
    #[arg(long, env = "SPUR_TRAFFIC_SERVER")]
    pub traffic_server: Option<String>,
    /// CA bundle (PEM) the traffic store's certificate must chain to: TLS with it, plaintext
    /// without. Re-read on every connection.
    #[arg(long, env = "SPUR_TRAFFIC_SERVER_CA", requires = "traffic_server")]
    pub traffic_server_ca: Option<PathBuf>,
    /// File with the token presented to the traffic store (the pod's projected ServiceAccount
    /// token for the audience `spur-traffic`). Re-read on every connection.
    #[arg(
        long,
        env = "SPUR_TRAFFIC_SERVER_TOKEN_FILE",
        requires = "traffic_server"
    )]
    pub traffic_server_token_file: Option<PathBuf>,
    /// Capture settings from this file (YAML or JSON: `keys: [{routingKey, sandbox}]`,
    /// `redactHeaders`, `maxBodyBytes`), polled for changes, instead of the store's. Exchanges
    /// still go to --traffic-server.
    #[arg(long, env = "SPUR_CAPTURE_SETTINGS", requires = "traffic_server")]
    pub capture_settings: Option<PathBuf>,
    /// Bytes of captured exchanges held while waiting to be shipped; past it the oldest are
    /// dropped (and counted).
    #[arg(long, env = "SPUR_CAPTURE_RING_BYTES", default_value_t = CaptureBounds::default().ring_bytes)]
    pub capture_ring_bytes: usize,
    /// Exchanges held while waiting to be shipped.
    #[arg(long, env = "SPUR_CAPTURE_RING_EXCHANGES", default_value_t = CaptureBounds::default().ring_exchanges)]
    pub capture_ring_exchanges: usize,
    /// Exchanges captured at once; past it, new ones are not captured (and counted).
    #[arg(long, env = "SPUR_CAPTURE_MAX_IN_FLIGHT", default_value_t = CaptureBounds::default().max_in_flight)]
    pub capture_max_in_flight: usize,
    /// Name recorded with each exchange (the pod's, from the downward API); default: the host
    /// name. A store in a cluster records the pod its token names instead.
    #[arg(long, env = "SPUR_POD_NAME")]
    pub pod_name: Option<String>,
}

/// A validated capture configuration.
#[derive(Debug, Clone)]
pub struct CaptureConfig {
    pub server: RouteServerConn,
    pub settings_file: Option<PathBuf>,
    pub bounds: CaptureBounds,
    pub pod: String,
}

impl CaptureArgs {
    pub(crate) fn validate(self) -> Result<Option<CaptureConfig>, Error> {
        let Some(addr) = self.traffic_server else {
            return Ok(None);
        };
        if self.capture_ring_bytes < 64 << 10
            || self.capture_ring_exchanges == 0
            || self.capture_max_in_flight == 0
        {
            return Err(Error::Config(
                "--capture-ring-bytes must be at least 65536, --capture-ring-exchanges and --capture-max-in-flight at least 1".into(),
            ));
        }
        let pod = match self.pod_name.filter(|p| !p.is_empty()) {
            Some(p) => p,
            None => hostname(),
        };
        Ok(Some(CaptureConfig {
            server: RouteServerConn {
                addr,
                ca: self.traffic_server_ca,
                token: self.traffic_server_token_file,
            },
            settings_file: self.capture_settings,
            bounds: CaptureBounds {
                ring_exchanges: self.capture_ring_exchanges,
                ring_bytes: self.capture_ring_bytes,
                max_in_flight: self.capture_max_in_flight,
            },
            pod,
        }))
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The routing keys whose requests are captured, and their sandboxes. Read on the request path
/// (one atomic load); replaced whole when the settings change.
#[derive(Debug, Default)]
pub struct KeySet {
    by_key: HashMap<Box<str>, CaptureTag>,
}

impl KeySet {
    pub fn get(&self, key: &str) -> Option<CaptureTag> {
        self.by_key.get(key).cloned()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// A set holding `key`, captured under `sandbox` (for tests beside this module's).
    #[cfg(test)]
    pub(crate) fn of(key: &str, sandbox: &str) -> Self {
        let tag = CaptureTag {
            sandbox: sandbox.into(),
            routing_key: key.into(),
        };
        KeySet {
            by_key: HashMap::from([(Box::from(key), tag)]),
        }
    }
}

/// The shared handle the router reads and the settings source replaces.
pub type CaptureKeys = Arc<ArcSwap<KeySet>>;

/// Settings as a file holds them (the camelCase JSON form of the proto's `CaptureSettings`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SettingsFile {
    #[serde(default)]
    keys: Vec<KeyEntry>,
    #[serde(default)]
    redact_headers: Vec<String>,
    #[serde(default = "default_max_body")]
    max_body_bytes: u32,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct KeyEntry {
    routing_key: String,
    sandbox: String,
}

fn default_max_body() -> u32 {
    16 << 10
}

/// Checks settings and turns them into what the router and the proxy use. An invalid routing
/// key or sandbox fails the whole update: the previous settings stay.
fn compile(settings: &pb::CaptureSettings) -> Result<(KeySet, CaptureLimits), String> {
    if settings.keys.len() > MAX_KEYS {
        return Err(format!(
            "{} routing keys (at most {MAX_KEYS})",
            settings.keys.len()
        ));
    }
    let mut by_key = HashMap::with_capacity(settings.keys.len());
    for k in &settings.keys {
        if !is_valid_key(&k.routing_key) {
            return Err(format!("invalid routing key {:?}", k.routing_key));
        }
        if k.sandbox.is_empty() || k.sandbox.len() > 253 {
            return Err(format!("invalid sandbox name {:?}", k.sandbox));
        }
        by_key.insert(
            k.routing_key.as_str().into(),
            CaptureTag {
                sandbox: k.sandbox.as_str().into(),
                routing_key: k.routing_key.as_str().into(),
            },
        );
    }
    let max_body = usize::try_from(settings.max_body_bytes).unwrap_or(usize::MAX);
    Ok((
        KeySet { by_key },
        CaptureLimits::new(&settings.redact_headers, max_body),
    ))
}

/// Largest capture settings file read: a key list at its bound is far smaller.
const MAX_SETTINGS_FILE: u64 = 4 * 1024 * 1024;

/// The settings file's bytes, refused past [`MAX_SETTINGS_FILE`] (counted as read: a file that
/// grows between a size check and the read is bounded too).
async fn read_settings_bytes(path: &Path) -> Result<Vec<u8>, String> {
    use tokio::io::AsyncReadExt as _;
    let err = |e: std::io::Error| format!("cannot read {}: {e}", path.display());
    let file = tokio::fs::File::open(path).await.map_err(err)?;
    let mut bytes = Vec::new();
    file.take(MAX_SETTINGS_FILE + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(err)?;
    if bytes.len() as u64 > MAX_SETTINGS_FILE {
        return Err(format!(
            "{}: larger than {MAX_SETTINGS_FILE} bytes",
            path.display()
        ));
    }
    Ok(bytes)
}

fn parse_settings(path: &Path, bytes: &[u8]) -> Result<pb::CaptureSettings, String> {
    let f: SettingsFile = serde_yaml_ng::from_slice(bytes)
        .map_err(|e| format!("invalid capture settings {}: {e}", path.display()))?;
    Ok(pb::CaptureSettings {
        keys: f
            .keys
            .into_iter()
            .map(|k| pb::CaptureKey {
                routing_key: k.routing_key,
                sandbox: k.sandbox,
            })
            .collect(),
        redact_headers: f.redact_headers,
        max_body_bytes: f.max_body_bytes,
    })
}

/// The sidecar's capture: the proxy's sink, the key set, and the tasks that feed and drain them.
pub(crate) struct Capturer {
    pub(crate) sink: Arc<Capture>,
    pub(crate) keys: CaptureKeys,
    config: CaptureConfig,
    baseline: BaselineWorkload,
    connector: Connector,
}

impl Capturer {
    pub(crate) fn new(
        config: CaptureConfig,
        baseline: BaselineWorkload,
        registry: &mut prometheus_client::registry::Registry,
    ) -> Result<Self, Error> {
        let connector = Connector::named(config.server.clone(), "traffic store")
            .map_err(|e| Error::Config(format!("--traffic-server: {e}")))?;
        Ok(Capturer {
            sink: Capture::new(config.bounds, registry),
            keys: Arc::new(ArcSwap::from_pointee(KeySet::default())),
            config,
            baseline,
            connector,
        })
    }

    fn apply(&self, settings: &pb::CaptureSettings, from: &str) -> Result<(), String> {
        let (keys, limits) = compile(settings)?;
        tracing::info!(
            keys = keys.len(),
            max_body = limits.max_body(),
            from,
            "capture settings applied"
        );
        self.sink.set_limits(limits);
        self.keys.store(Arc::new(keys));
        Ok(())
    }

    /// Runs the settings source and the shipper until `stop`; then ships what is left (bounded
    /// by one push timeout).
    pub(crate) fn spawn(self, poll: Duration, stop: CancellationToken) {
        let this = Arc::new(self);
        let settings = this.clone();
        let settings_stop = stop.clone();
        tokio::spawn(async move {
            match settings.config.settings_file.clone() {
                Some(path) => settings.poll_file(path, poll, settings_stop).await,
                None => settings.watch(settings_stop).await,
            }
        });
        tokio::spawn(async move { this.ship(stop).await });
    }

    /// Applies the settings file at start and whenever its bytes change, checked every `poll`.
    /// Unchanged bytes are not parsed again: a parse costs tens of thousands of instructions,
    /// every second, for as long as the sidecar runs (perf/results/capture.md, 2026-12-06).
    async fn poll_file(&self, path: PathBuf, poll: Duration, stop: CancellationToken) {
        let mut last: Option<Result<Vec<u8>, String>> = None;
        loop {
            let now = read_settings_bytes(&path).await;
            if last.as_ref() != Some(&now) {
                // Parsed off the proxy's runtime threads: a file may be megabytes of YAML.
                let parsed = match now.clone() {
                    Ok(bytes) => {
                        let path = path.clone();
                        tokio::task::spawn_blocking(move || parse_settings(&path, &bytes))
                            .await
                            .unwrap_or_else(|e| Err(format!("parsing the capture settings: {e}")))
                    }
                    Err(e) => Err(e),
                };
                match parsed {
                    Ok(s) => {
                        if let Err(e) = self.apply(&s, "file") {
                            tracing::warn!(path = %path.display(), error = %e, "capture settings refused; the previous ones stay");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "capture settings unreadable; the previous ones stay")
                    }
                }
                last = Some(now);
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(poll) => {}
            }
        }
    }

    async fn watch(&self, stop: CancellationToken) {
        let mut backoff = Duration::from_millis(500);
        let mut last_error = String::new();
        loop {
            let res = tokio::select! {
                () = stop.cancelled() => return,
                res = self.watch_once() => res,
            };
            match res {
                Ok(()) => backoff = Duration::from_millis(500),
                Err(e) => {
                    // Once per distinct failure, not once per retry.
                    if e != last_error {
                        tracing::warn!(error = %e, "capture settings: traffic store unreachable; keeping the last settings");
                        last_error = e;
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(30));
        }
    }

    async fn watch_once(&self) -> Result<(), String> {
        let channel = self.connector.channel().await.map_err(|e| e.to_string())?;
        let mut client = TrafficClient::new(channel);
        let mut req = tonic::Request::new(pb::WatchSettingsRequest {
            baseline: Some(workload(&self.baseline)),
        });
        if let Some(auth) = self.connector.authorization().map_err(|e| e.to_string())? {
            req.metadata_mut().insert("authorization", auth);
        }
        let mut stream = client
            .watch_settings(req)
            .await
            .map_err(|s| format!("{}: {}", s.code(), s.message()))?
            .into_inner();
        loop {
            match stream.message().await {
                Ok(Some(settings)) => {
                    if let Err(e) = self.apply(&settings, "traffic store") {
                        tracing::warn!(error = %e, "capture settings refused; the previous ones stay");
                    }
                }
                Ok(None) => return Ok(()),
                Err(s) => return Err(format!("{}: {}", s.code(), s.message())),
            }
        }
    }

    async fn ship(&self, stop: CancellationToken) {
        let mut client: Option<TrafficClient<tonic::transport::Channel>> = None;
        let mut reported_dropped = 0u64;
        let mut last_error = String::new();
        loop {
            let stopping = tokio::select! {
                () = stop.cancelled() => true,
                () = self.sink.ready() => false,
            };
            if !stopping && self.sink.queued() < BATCH {
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = tokio::time::sleep(BATCH_WINDOW) => {}
                }
            }
            loop {
                let batch = self.sink.take(BATCH);
                if batch.is_empty() {
                    break;
                }
                let n = batch.len() as u64;
                let dropped_now = self.sink.dropped_total();
                let req = pb::PushRequest {
                    exchanges: batch
                        .into_iter()
                        .map(|r| exchange(r, &self.baseline, &self.config.pod))
                        .collect(),
                    dropped: dropped_now.saturating_sub(reported_dropped),
                };
                match tokio::time::timeout(PUSH_TIMEOUT, self.push(&mut client, req)).await {
                    Ok(Ok(())) => {
                        reported_dropped = dropped_now;
                        last_error.clear();
                    }
                    failed => {
                        let e = match failed {
                            Ok(Err(e)) => e,
                            _ => "push timed out".to_string(),
                        };
                        client = None;
                        self.sink.dropped(DropReason::ShipFailed, n);
                        if e != last_error {
                            tracing::warn!(error = %e, dropped = n, "captured exchanges not shipped: traffic store unreachable or refusing");
                            last_error = e;
                        }
                        if stopping {
                            return;
                        }
                        // Traffic keeps flowing meanwhile; the ring absorbs it up to its bound.
                        tokio::select! {
                            () = stop.cancelled() => {}
                            () = tokio::time::sleep(Duration::from_secs(1)) => {}
                        }
                        break;
                    }
                }
            }
            if stopping {
                return;
            }
        }
    }

    async fn push(
        &self,
        client: &mut Option<TrafficClient<tonic::transport::Channel>>,
        req: pb::PushRequest,
    ) -> Result<(), String> {
        let c = match client {
            Some(c) => c,
            None => {
                let channel = self.connector.channel().await.map_err(|e| e.to_string())?;
                client.insert(
                    TrafficClient::new(channel)
                        .max_encoding_message_size(32 << 20)
                        .max_decoding_message_size(1 << 20),
                )
            }
        };
        let mut req = tonic::Request::new(req);
        if let Some(auth) = self.connector.authorization().map_err(|e| e.to_string())? {
            req.metadata_mut().insert("authorization", auth);
        }
        c.push(req)
            .await
            .map(|_| ())
            .map_err(|s| format!("{}: {}", s.code(), s.message()))
    }
}

fn workload(b: &BaselineWorkload) -> pb::Workload {
    pb::Workload {
        kind: b.kind.clone(),
        namespace: b.namespace.clone(),
        name: b.name.clone(),
    }
}

/// The process start, so exchange ids stay unique across restarts of the same pod. The id only
/// lets the store ignore an exchange this sidecar pushes twice; stored exchanges get the store's.
fn process_start() -> u128 {
    static START: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
    *START.get_or_init(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros())
    })
}

fn exchange(r: CapturedExchange, baseline: &BaselineWorkload, pod: &str) -> pb::Exchange {
    let headers = |h: Vec<(http::HeaderName, bytes::Bytes)>| {
        h.into_iter()
            .map(|(n, v)| pb::Header {
                name: n.as_str().to_string(),
                value: v.to_vec(),
            })
            .collect()
    };
    let body = |b: CapturedBody| pb::Body {
        size: b.size,
        data: b.data,
        truncated: b.truncated,
    };
    let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    pb::Exchange {
        id: format!("{pod}/{}/{}", process_start(), r.seq),
        baseline: Some(workload(baseline)),
        pod: pod.to_string(),
        sandbox: r.tag.sandbox.to_string(),
        routing_key: r.tag.routing_key.to_string(),
        destination: r.destination.unwrap_or_default(),
        protocol: match r.protocol {
            CapturedProtocol::Http1 => pb::Protocol::Http1,
            CapturedProtocol::Http2 => pb::Protocol::Http2,
            CapturedProtocol::Grpc => pb::Protocol::Grpc,
            CapturedProtocol::WebSocket => pb::Protocol::Websocket,
        } as i32,
        method: r.method,
        path: r.path,
        authority: r.authority,
        status: u32::from(r.status),
        request_headers: headers(r.request_headers),
        response_headers: headers(r.response_headers),
        response_trailers: headers(r.response_trailers),
        request_body: Some(body(r.request_body)),
        response_body: Some(body(r.response_body)),
        start_unix_micros: r
            .start
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX)),
        response_micros: r.response_after.map_or(0, micros),
        duration_micros: micros(r.duration),
        error: r.error.unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(keys: &[(&str, &str)]) -> pb::CaptureSettings {
        pb::CaptureSettings {
            keys: keys
                .iter()
                .map(|(k, s)| pb::CaptureKey {
                    routing_key: k.to_string(),
                    sandbox: s.to_string(),
                })
                .collect(),
            redact_headers: vec!["x-api-key".into()],
            max_body_bytes: 2 << 20,
        }
    }

    #[test]
    fn settings_compile_and_bad_keys_refuse_the_update() {
        let (keys, limits) = compile(&settings(&[("k1", "sb1"), ("k2", "sb2")])).unwrap();
        assert_eq!(keys.get("k2").unwrap().sandbox.as_ref(), "sb2");
        assert!(keys.get("k3").is_none());
        // Capped by the proxy core.
        assert_eq!(limits.max_body(), spur_proxy::capture::MAX_BODY_LIMIT);
        assert!(limits.redacts(&http::HeaderName::from_static("x-api-key")));
        assert!(limits.redacts(&http::HeaderName::from_static("cookie")));
        assert!(compile(&settings(&[("bad key", "sb")])).is_err());
        assert!(compile(&settings(&[("k", "")])).is_err());
    }

    #[tokio::test]
    async fn a_settings_file_is_applied_when_its_bytes_change_and_a_bad_one_keeps_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, "keys: [{routingKey: k1, sandbox: sb1}]\n").unwrap();
        let config = CaptureConfig {
            server: RouteServerConn {
                addr: "127.0.0.1:1".into(),
                ca: None,
                token: None,
            },
            settings_file: Some(path.clone()),
            bounds: spur_proxy::capture::CaptureBounds::default(),
            pod: "p".into(),
        };
        let baseline = BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "t".into(),
            name: "base".into(),
        };
        let mut registry = prometheus_client::registry::Registry::default();
        let capturer = Arc::new(Capturer::new(config, baseline, &mut registry).unwrap());
        let stop = CancellationToken::new();
        let task = {
            let (c, path, stop) = (capturer.clone(), path.clone(), stop.clone());
            tokio::spawn(async move { c.poll_file(path, Duration::from_millis(20), stop).await })
        };
        let keys = |c: &Capturer| {
            let mut k: Vec<String> = c.keys.load().by_key.keys().map(|k| k.to_string()).collect();
            k.sort();
            k
        };
        let until = |want: &[&str]| {
            let capturer = capturer.clone();
            let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
            async move {
                for _ in 0..250 {
                    if keys(&capturer) == want {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                panic!("keys {:?}, not {want:?}", keys(&capturer));
            }
        };
        until(&["k1"]).await;
        let applied = capturer.keys.load_full();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            Arc::ptr_eq(&applied, &capturer.keys.load_full()),
            "unchanged: not applied again"
        );
        std::fs::write(
            &path,
            "keys: [{routingKey: k2, sandbox: sb1}, {routingKey: k3, sandbox: sb2}]\n",
        )
        .unwrap();
        until(&["k2", "k3"]).await;
        std::fs::write(&path, "keys: [{routingKey: 'bad key', sandbox: sb1}]\n").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            keys(&capturer),
            ["k2", "k3"],
            "a refused file keeps the last settings"
        );
        std::fs::remove_file(&path).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(keys(&capturer), ["k2", "k3"], "so does a missing one");
        std::fs::write(&path, "keys: []\n").unwrap();
        until(&[]).await;
        stop.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn settings_file_shape() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        let read = || async {
            let bytes = read_settings_bytes(&path).await?;
            parse_settings(&path, &bytes)
        };
        std::fs::write(
            &path,
            "keys: [{routingKey: k1, sandbox: sb1}]\nredactHeaders: [x-secret]\n",
        )
        .unwrap();
        let s = read().await.unwrap();
        assert_eq!(s.keys.len(), 1);
        assert_eq!(s.max_body_bytes, 16 << 10);
        std::fs::write(&path, "keys: []\nunknown: 1\n").unwrap();
        assert!(read().await.is_err());
        let big = std::fs::File::create(&path).unwrap();
        big.set_len(MAX_SETTINGS_FILE + 1).unwrap();
        let e = read().await.unwrap_err();
        assert!(e.contains("larger than"), "{e}");
    }
}
