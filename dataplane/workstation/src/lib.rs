//! The workstation side of `spur local`: a tunnel session to the in-cluster tunnel proxy, reverse
//! binds that carry keyed cluster traffic to processes on the laptop, a local SOCKS5 / HTTP
//! CONNECT proxy and cluster service names on loopback (DNS responder, kubefwd-style listeners,
//! optional hosts-file block) without root, a TUN device or a resolver change, a state file for
//! `status`/`disconnect`, and the routing-key-injecting `local proxy`.
//!
//! ```text
//! laptop                                              cluster
//!  curl --socks5-hostname 127.0.0.1:1080 ─┐
//!  curl http://api.shop:8080 (DNS/hosts)  ├─ forward tunnel streams ─► tunnel proxy dials
//!  spur local proxy (key injected)       ─┘
//!  localhost:8080 (your process) ◄─────── reverse streams per bind_id ◄─ sandbox traffic
//!  tunnel API (gRPC on a tunnel stream): Hello, ListServices, WatchLocalWorkloads
//! ```
//!
//! No Kubernetes dependency: everything the workstation knows about the cluster comes through
//! the tunnel API. See `docs/local.md`.

mod api;
mod binds;
mod connect;
pub mod dns;
mod error;
pub mod hosts;
pub mod names;
mod opener;
pub mod proxy;
mod services;
mod shared;
pub mod state;

pub use api::connect as connect_api;
pub use connect::{ConnectConfig, Workstation};
pub use error::Error;
pub use opener::{BoxStream, ByteStream, OpenFuture, Opener, SocksOpener, TunnelOpener};
pub use shared::{Event, EventSink};
/// The tunnel library, for [`ConnectConfig::tunnel`].
pub use spur_tunnel as tunnel;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// Trust roots for the tunnel server: the CA certificates in a PEM file, or else the
/// operating system's store.
pub fn load_roots(
    ca_file: Option<&std::path::Path>,
) -> Result<Vec<CertificateDer<'static>>, Error> {
    match ca_file {
        Some(path) => {
            let pem = std::fs::read(path).map_err(|source| Error::File {
                what: "cannot read CA file",
                path: path.to_owned(),
                source,
            })?;
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<_, _>>()
                .map_err(|e| Error::Invalid {
                    path: path.to_owned(),
                    reason: e.to_string(),
                })?;
            if certs.is_empty() {
                return Err(Error::Invalid {
                    path: path.to_owned(),
                    reason: "no PEM certificate in it".into(),
                });
            }
            Ok(certs)
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            if found.certs.is_empty() {
                let why = found
                    .errors
                    .first()
                    .map(|e| e.to_string())
                    .unwrap_or_else(|| "none found".into());
                return Err(Error::Config(format!(
                    "no system CA certificates ({why}); pass --ca-file"
                )));
            }
            Ok(found.certs)
        }
    }
}

/// Raises the soft open-files limit to the hard limit: one listener per Service port plus
/// two descriptors per carried connection add up quickly. Returns the new soft limit.
pub fn raise_fd_limit() -> Option<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    // macOS refuses more than OPEN_MAX (10240) for the soft limit whatever the hard one says.
    let want = if cfg!(target_os = "macos") {
        hard.min(10240)
    } else {
        hard
    };
    if want > soft && setrlimit(Resource::RLIMIT_NOFILE, want, hard).is_ok() {
        return Some(want);
    }
    Some(soft)
}

/// This machine's host name (for the tunnel's client name), or an empty string.
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default()
}
