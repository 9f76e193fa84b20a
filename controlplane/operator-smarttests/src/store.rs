//! The operator's client of the traffic store, for tests with `calls: true`: it starts a run's
//! capture for the test's creator (StartRunCapture with `run_for`, which the store allows the
//! operator through `delegate` on `sandboxes/capture`, then checks the creator's own rights),
//! and ends it when the run's Job ends. A connection per call: a few calls per run.

use std::path::PathBuf;
use std::time::Duration;

use spur_proto::traffic::traffic_client::TrafficClient;
use spur_proto::traffic::{EndRunCaptureRequest, RunCapture, RunFor, StartRunCaptureRequest};
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

/// Where the traffic store is and how the operator authenticates to it.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// `https://HOST:PORT` (or `http://`, when the store runs with its plaintext opt-in).
    pub server: String,
    /// The CA bundle (PEM) of an https store: read at every connection (rotations need no
    /// restart); its text also goes to the runs' Jobs.
    pub ca_file: Option<PathBuf>,
    /// The operator's token for the store's audience (a projected ServiceAccount token the
    /// kubelet renews): read at every call.
    pub token_file: PathBuf,
}

impl StoreConfig {
    /// Refuses a configuration that cannot work: checked once, at start.
    pub fn validate(&self) -> Result<(), String> {
        match self.server.split_once("://") {
            Some(("https", rest)) if !rest.is_empty() => {
                if self.ca_file.is_none() {
                    return Err(format!(
                        "the traffic store {} needs its CA bundle (the runs' Jobs are given it too)",
                        self.server
                    ));
                }
            }
            Some(("http", rest)) if !rest.is_empty() && self.ca_file.is_none() => {}
            Some(("http", _)) => return Err("a CA bundle is for an https:// store".into()),
            _ => {
                return Err(format!(
                    "the traffic store {:?} is not https://HOST:PORT or http://HOST:PORT",
                    self.server
                ));
            }
        }
        Ok(())
    }

    /// The CA bundle's text, if the store is https.
    pub fn ca_pem(&self) -> Result<Option<String>, StoreError> {
        let Some(path) = &self.ca_file else {
            return Ok(None);
        };
        let pem = std::fs::read_to_string(path).map_err(|e| {
            StoreError::Unavailable(format!("cannot read the CA bundle {}: {e}", path.display()))
        })?;
        if !pem.contains("-----BEGIN CERTIFICATE-----") {
            return Err(StoreError::Unavailable(format!(
                "the CA bundle {} holds no certificate (yet?)",
                path.display()
            )));
        }
        Ok(Some(pem))
    }
}

/// Why a call to the store did not do what was asked.
#[derive(Debug)]
pub enum StoreError {
    /// The store refused it for the user's rights (its message names the right).
    Refused(String),
    /// The run (or capture) is gone.
    NotFound,
    /// The store's bounds on runs capturing at once are reached (its message says which).
    Exhausted(String),
    /// Anything else: try again later.
    Unavailable(String),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Refused(m) | StoreError::Unavailable(m) | StoreError::Exhausted(m) => {
                f.write_str(m)
            }
            StoreError::NotFound => f.write_str("no such run capture"),
        }
    }
}

fn from_status(s: &tonic::Status) -> StoreError {
    match s.code() {
        tonic::Code::PermissionDenied | tonic::Code::InvalidArgument => {
            StoreError::Refused(s.message().to_owned())
        }
        tonic::Code::NotFound => StoreError::NotFound,
        tonic::Code::ResourceExhausted => StoreError::Exhausted(s.message().to_owned()),
        code => StoreError::Unavailable(format!("the traffic store: {code:?}: {}", s.message())),
    }
}

type Client = TrafficClient<tonic::transport::Channel>;

async fn connect(cfg: &StoreConfig) -> Result<Client, StoreError> {
    let unavailable = |what: String| StoreError::Unavailable(what);
    let mut endpoint = Endpoint::from_shared(cfg.server.clone())
        .map_err(|e| unavailable(format!("the traffic store {}: {e}", cfg.server)))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30));
    if let Some(pem) = cfg.ca_pem()? {
        let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem));
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| unavailable(format!("TLS for the traffic store: {e}")))?;
    }
    let channel = endpoint.connect().await.map_err(|e| {
        unavailable(format!(
            "cannot reach the traffic store {}: {e}",
            cfg.server
        ))
    })?;
    Ok(TrafficClient::new(channel))
}

/// `msg` with `authorization: Bearer <token>` (sensitive: never logged).
fn with<T>(msg: T, token: &str) -> Result<tonic::Request<T>, StoreError> {
    let mut value = MetadataValue::try_from(format!("Bearer {}", token.trim())).map_err(|_| {
        StoreError::Unavailable("the token has characters a header cannot carry".into())
    })?;
    value.set_sensitive(true);
    let mut req = tonic::Request::new(msg);
    req.metadata_mut().insert("authorization", value);
    Ok(req)
}

/// The operator's own token, from its file.
pub fn own_token(cfg: &StoreConfig) -> Result<String, StoreError> {
    let token = std::fs::read_to_string(&cfg.token_file).map_err(|e| {
        StoreError::Unavailable(format!(
            "cannot read the traffic store token {}: {e}",
            cfg.token_file.display()
        ))
    })?;
    if token.trim().is_empty() {
        return Err(StoreError::Unavailable(format!(
            "the traffic store token {} is empty",
            cfg.token_file.display()
        )));
    }
    Ok(token)
}

/// Starts a capture of `sandbox` for `seconds`, for `user` with `groups`, for the run's Job
/// `job` (`namespace/name`): asked again for the same Job while its capture lives, the store
/// gives that capture again, with a new token.
pub async fn start(
    cfg: &StoreConfig,
    sandbox: &str,
    seconds: u32,
    user: &str,
    groups: &[String],
    job: &str,
) -> Result<RunCapture, StoreError> {
    let token = own_token(cfg)?;
    let request = StartRunCaptureRequest {
        sandbox: sandbox.to_owned(),
        seconds,
        run_for: Some(RunFor {
            username: user.to_owned(),
            groups: groups.to_vec(),
            job: job.to_owned(),
        }),
    };
    connect(cfg)
        .await?
        .start_run_capture(with(request, &token)?)
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| from_status(&s))
}

/// Ends run capture `id`, started for the Job `job` (`namespace/name`), with `token`: the run's
/// own, or the operator's (`delegate`, which the store lets end only the capture of the Job
/// named).
pub async fn end(cfg: &StoreConfig, id: &str, token: &str, job: &str) -> Result<(), StoreError> {
    let request = EndRunCaptureRequest {
        id: id.to_owned(),
        job: job.to_owned(),
    };
    connect(cfg)
        .await?
        .end_run_capture(with(request, token)?)
        .await
        .map(|_| ())
        .map_err(|s| from_status(&s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_names_an_https_store_with_its_ca_or_a_plaintext_one() {
        let cfg = |server: &str, ca: Option<&str>| StoreConfig {
            server: server.into(),
            ca_file: ca.map(PathBuf::from),
            token_file: "/t".into(),
        };
        assert!(
            cfg("https://spur-traffic.spur-system.svc:7778", Some("/ca"))
                .validate()
                .is_ok()
        );
        assert!(cfg("http://127.0.0.1:7778", None).validate().is_ok());
        for (server, ca) in [
            ("https://spur-traffic:7778", None),
            ("http://spur-traffic:7778", Some("/ca")),
            ("spur-traffic:7778", None),
            ("https://", Some("/ca")),
        ] {
            assert!(cfg(server, ca).validate().is_err(), "{server} {ca:?}");
        }
    }
}
