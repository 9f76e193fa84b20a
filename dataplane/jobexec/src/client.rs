//! The operator's side of the job-execution API: a TLS channel to one executor, with the
//! operator's client certificate, that accepts only the executor certificate of the runner
//! group's namespace.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use spur_proto::jobs::job_executor_client::JobExecutorClient;
use tonic::transport::{Channel, Endpoint};

/// The name an executor's certificate carries (one per namespace, so a runner of another
/// namespace cannot be mistaken for this one).
pub fn server_name(namespace: &str) -> String {
    format!("spur-job-executor.{namespace}")
}

/// A client of the executor at `addr`, checked against `server_name`. Connects lazily; calls
/// fail with UNAVAILABLE while it cannot be reached.
pub fn connect(
    addr: SocketAddr,
    server_name: &str,
    tls: Arc<rustls::ClientConfig>,
) -> Result<JobExecutorClient<Channel>, String> {
    let name = rustls::pki_types::ServerName::try_from(server_name.to_owned())
        .map_err(|e| format!("{server_name}: {e}"))?;
    let connector = tokio_rustls::TlsConnector::from(tls);
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(20));
    let channel = endpoint.connect_with_connector_lazy(tower::service_fn(move |_: http::Uri| {
        let connector = connector.clone();
        let name = name.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let tls = connector.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    }));
    Ok(JobExecutorClient::new(channel))
}

/// Reads attempt `attempt_uid`'s output from `*offset` as it comes, sending each piece on `out`,
/// until the process has exited and all of it was read, `until` bytes were, or `out`'s receiver
/// is gone. `*offset` follows what was sent, also when the read fails part-way (a reader that
/// goes on from it sends nothing twice). Returns whether the process has exited and all its
/// output was read. An attempt may have any number of readers at once: the replica of
/// `spur jobs` that drives it, and the others, which serve its log meanwhile (only the leader
/// drives attempts; every replica serves the API).
pub async fn read_log<T: From<Vec<u8>>>(
    client: &mut JobExecutorClient<Channel>,
    attempt_uid: &str,
    offset: &mut u64,
    until: u64,
    out: &tokio::sync::mpsc::Sender<T>,
) -> Result<bool, tonic::Status> {
    if *offset >= until {
        return Ok(false);
    }
    let mut stream = client
        .logs(spur_proto::jobs::LogsRequest {
            attempt_uid: attempt_uid.to_owned(),
            offset: *offset,
        })
        .await?
        .into_inner();
    while let Some(chunk) = stream.message().await? {
        if chunk.offset != *offset {
            return Err(tonic::Status::data_loss(format!(
                "log offset {} where {} was expected",
                chunk.offset, *offset
            )));
        }
        let sent = chunk.data.len();
        let mut data = chunk.data;
        data.truncate(usize::try_from(until - *offset).unwrap_or(usize::MAX));
        // The last message, and not cut short by `until`.
        let all = chunk.r#final.is_some() && data.len() == sent;
        if !data.is_empty() {
            let len = data.len() as u64;
            if out.send(T::from(data)).await.is_err() {
                return Ok(false);
            }
            *offset += len;
        }
        if all {
            return Ok(true);
        }
        if *offset >= until {
            break;
        }
    }
    Ok(false)
}

/// A client configuration: trust `ca_pem` only, present `cert_pem`/`key_pem`, speak h2.
pub fn client_config(
    ca_pem: &[u8],
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem) {
        roots
            .add(c.map_err(|e| format!("CA: {e}"))?)
            .map_err(|e| format!("CA: {e}"))?;
    }
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("client certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("client key: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| format!("client certificate: {e}"))?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}
