//! Reading an injected sidecar's admin port (`/config_dump`, `/traces`) the way `kubectl
//! port-forward` does, with the user's own credentials: the sidecar answers those paths for
//! loopback clients only, and a port-forward arrives on the pod's loopback. Shared by
//! `spur route explain` and `spur doctor propagation`.

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use spur_api::keys::injection::SIDECAR_CONTAINER;

/// Why a sidecar's admin port could not be read.
pub(crate) enum ViewError {
    /// The user may not port-forward: the command's error.
    Forbidden(String),
    /// Anything else: said on the pod's line.
    Other(String),
}

impl From<String> for ViewError {
    fn from(s: String) -> Self {
        ViewError::Other(s)
    }
}

/// A kube error in a few words: a refusal says it is the user's.
pub(crate) fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 403 => format!("forbidden to you: {}", s.message),
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        e => e.to_string(),
    }
}

/// The sidecar's admin port, from the injected container's `SPUR_ADMIN_ADDR`.
pub(crate) fn admin_port(pod: &Pod) -> Option<u16> {
    let spec = pod.spec.as_ref()?;
    let sidecar = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .find(|c| c.name == SIDECAR_CONTAINER)?;
    let addr = sidecar
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "SPUR_ADMIN_ADDR")?
        .value
        .as_deref()?;
    addr.rsplit_once(':')?.1.parse().ok()
}

/// Ends the port-forward and its HTTP connection however [`get_json`] returns.
struct Forwarding {
    forward: kube::api::Portforwarder,
    conn: Option<tokio::task::JoinHandle<Result<(), hyper::Error>>>,
}

impl Drop for Forwarding {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            conn.abort();
        }
        self.forward.abort();
    }
}

/// `GET path` on the pod's admin `port`, through a port-forward made with the user's rights: the
/// JSON answer, at most `limit` bytes of it.
pub(crate) async fn get_json(
    pods: &Api<Pod>,
    pod: &str,
    port: u16,
    path: &str,
    limit: usize,
) -> Result<serde_json::Value, ViewError> {
    use http_body_util::BodyExt as _;
    let forward = match pods.portforward(pod, &[port]).await {
        Ok(f) => f,
        Err(kube::Error::Api(s)) if s.code == 403 => {
            return Err(ViewError::Forbidden(format!("forbidden: {}", s.message)));
        }
        Err(e) => return Err(format!("cannot port-forward to it: {}", short(&e)).into()),
    };
    let mut guard = Forwarding {
        forward,
        conn: None,
    };
    let stream = guard
        .forward
        .take_stream(port)
        .ok_or_else(|| "the port-forward gave no stream".to_string())?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("its admin port: {e}"))?;
    guard.conn = Some(tokio::spawn(conn));
    let request = http::Request::get(path)
        .header(http::header::HOST, "localhost")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("its admin port: {e}"))?;
    let status = response.status();
    let body = http_body_util::Limited::new(response.into_body(), limit)
        .collect()
        .await
        .map_err(|e| format!("its {path}: {e}"))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!(
            "its admin port answered {status} to {path}: {}",
            String::from_utf8_lossy(&body).trim()
        )
        .into());
    }
    Ok(serde_json::from_slice(&body).map_err(|e| format!("its {path} is not JSON: {e}"))?)
}
