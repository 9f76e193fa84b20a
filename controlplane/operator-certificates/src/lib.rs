//! The operator's certificates: the certificate manager (its CA, the webhook's and the other
//! servers' serving certificates, the webhook configurations' `caBundle` and the CA bundle
//! copies; [`certs`]), the workstation CSR signer ([`workstations`]) and the xDS client
//! issuer ([`xds_clients`]), all configured by one [`PkiConfig`] ([`pki_config`]).

mod certs;
pub mod pki_config;
pub mod workstations;
pub mod xds_clients;

use kube::Client;
use spur_operator_core::Metrics;
use tokio_util::sync::CancellationToken;

pub use pki_config::{PKI_LABEL, PkiConfig, ServingCert, XdsClientConfig};

/// Runs the certificate manager, the workstation signer and (when configured) the xDS client
/// issuer until `stop`.
pub async fn run(client: Client, cfg: PkiConfig, metrics: Metrics, stop: CancellationToken) {
    let signer = spur_controller::drained(
        "workstation-signer",
        workstations::run(client.clone(), cfg.clone(), metrics.clone(), stop.clone()),
        stop.clone(),
    );
    let xds = cfg.xds_clients.clone().map(|x| {
        spur_controller::drained(
            "xds-client-issuer",
            xds_clients::run(
                client.clone(),
                cfg.clone(),
                x,
                metrics.clone(),
                stop.clone(),
            ),
            stop.clone(),
        )
    });
    let manager = certs::run(client.clone(), cfg, metrics, stop.clone());
    let xds = async move {
        if let Some(x) = xds {
            x.await;
        }
    };
    tokio::join!(manager, signer, xds);
}
