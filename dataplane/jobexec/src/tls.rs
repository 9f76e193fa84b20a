//! The executor's TLS: its serving certificate, and the one CA whose client certificates
//! (clientAuth) may call it: the operator's jobs CA, which signs no other client certificate.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

use crate::Error;

/// File names in the TLS directory (what the operator's Secret holds).
pub const CA_FILE: &str = "ca.crt";
pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";

/// Reads `dir` and builds the server configuration. With `delete_key`, the key file is removed
/// once read: the job runs as the same user in the same container and must not be able to
/// read it.
pub fn server_config(dir: &Path, delete_key: bool) -> Result<Arc<rustls::ServerConfig>, Error> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|source| Error::Io { path, source })
    };
    let ca = read(CA_FILE)?;
    let cert = read(CERT_FILE)?;
    let key = read(KEY_FILE)?;
    if delete_key {
        let path = dir.join(KEY_FILE);
        std::fs::remove_file(&path).map_err(|source| Error::Io { path, source })?;
    }
    let tls_err = |what: &str, e: &dyn std::fmt::Display| Error::Tls(format!("{what}: {e}"));
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&ca) {
        let c = c.map_err(|e| tls_err(CA_FILE, &e))?;
        roots.add(c).map_err(|e| tls_err(CA_FILE, &e))?;
    }
    if roots.is_empty() {
        return Err(Error::Tls(format!("{CA_FILE}: no certificate")));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| tls_err("client verifier", &e))?;
    let chain = CertificateDer::pem_slice_iter(&cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_err(CERT_FILE, &e))?;
    let key = PrivateKeyDer::from_pem_slice(&key).map_err(|e| tls_err(KEY_FILE, &e))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_err("protocol versions", &e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| tls_err(CERT_FILE, &e))?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}
