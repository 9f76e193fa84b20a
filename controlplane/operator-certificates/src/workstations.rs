//! The workstation certificate signer (runs on the leader only): Kubernetes
//! CertificateSigningRequests with signer name `spur.dev/workstation`, once approved, get a TLS
//! client certificate from the operator's CA, which the tunnel proxy accepts instead of a token.
//!
//! The request names the workstation in its subject's common name. Approval is the gate: an
//! administrator (or an approver they trust) runs `kubectl certificate approve` after checking
//! who asked (`spec.username`) and for which workstation. The signer then checks the request
//! itself: a DNS-label name, no extra names, client-auth usages. What it cannot sign it marks
//! `Failed` with the reason, so the requester learns why.
//!
//! The certificate carries only the requested key: subject, usages and lifetime are the
//! signer's. Its lifetime is the request's `expirationSeconds`, else a default, capped by the
//! configured maximum and by the CA's own expiry. There is no revocation: keep lifetimes short.
//!
//! Signing records the requester (`spec.username`) as the workstation's owner until the
//! certificate expires ([`spur_api::workstation`]): a request for a workstation another user
//! owns is marked `Failed` instead, whoever approved it, so an approval cannot hand one
//! developer's workstation (and the routing keys of their Sandboxes) to another.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use spur_operator_core::{Error, Metrics};

use crate::PkiConfig;
use spur_serving::pki::{self, Pair};

pub use spur_api::workstation::WORKSTATION_SIGNER;
/// The usages a workstation request may ask for; it must ask for `client auth`.
const ALLOWED_USAGES: [&str; 3] = ["client auth", "digital signature", "key encipherment"];

struct Signer {
    csrs: Api<CertificateSigningRequest>,
    secrets: Api<Secret>,
    /// Workstation owner records (the operator's namespace).
    owners: Api<ConfigMap>,
    cfg: PkiConfig,
    metrics: Metrics,
}

/// What to do with a request.
#[derive(Debug)]
enum Decision {
    /// Not (or no longer) ours to act on: unapproved, denied, failed, or already signed.
    Wait,
    /// Mark it `Failed` with this message.
    Fail(String),
    /// Sign this request (its signature checked) for this workstation, for this long.
    Sign {
        workstation: String,
        lifetime: Duration,
        request: Box<pki::ClientRequest>,
    },
}

/// Runs the signer until `stop`.
pub(crate) async fn run(client: Client, cfg: PkiConfig, metrics: Metrics, stop: CancellationToken) {
    let signer = Arc::new(Signer {
        csrs: Api::all(client.clone()),
        secrets: Api::namespaced(client.clone(), &cfg.namespace),
        owners: Api::namespaced(client, &cfg.namespace),
        cfg,
        metrics,
    });
    let requests =
        watcher::Config::default().fields(&format!("spec.signerName={WORKSTATION_SIGNER}"));
    Controller::new(signer.csrs.clone(), requests)
        .graceful_shutdown_on(stop.cancelled_owned())
        .run(reconcile, error_policy, signer)
        .for_each(|r| {
            if let Err(kube::runtime::controller::Error::ReconcilerFailed(e, obj)) = r {
                tracing::warn!(request = %obj.name, error = %e, "cannot sign a workstation certificate; retrying");
            }
            std::future::ready(())
        })
        .await;
}

async fn reconcile(
    csr: Arc<CertificateSigningRequest>,
    signer: Arc<Signer>,
) -> Result<Action, Error> {
    let name = csr.name_any();
    let (workstation, lifetime, request) = match decide(&csr, &signer.cfg) {
        Decision::Wait => return Ok(Action::await_change()),
        Decision::Fail(message) => {
            tracing::info!(request = %name, reason = %message, "workstation certificate request failed");
            signer.metrics.workstation_request_failed();
            signer.fail(&csr, &message).await?;
            return Ok(Action::await_change());
        }
        Decision::Sign {
            workstation,
            lifetime,
            request,
        } => (workstation, lifetime, request),
    };
    let ca = signer.signing_ca().await?;
    let cert = pki::issue_client(&ca, &request, &workstation, lifetime, pki::now_unix())?;
    let not_after = pki::info(&cert)?.validity.not_after;
    // The owner is recorded before the certificate is published: a certificate never exists
    // for a workstation whose owner is someone else.
    let requester = csr.spec.username.as_deref().unwrap_or_default();
    let until = k8s_openapi::jiff::Timestamp::from_second(not_after)
        .map_err(|e| Error::Pki(format!("certificate expiry: {e}")))?;
    if let Err(refused) = spur_operator_core::workstation_owner::claim(
        &signer.owners,
        &signer.cfg.namespace,
        &workstation,
        requester,
        Some(until),
    )
    .await?
    {
        let message = format!("workstation {workstation}: {refused}");
        tracing::info!(request = %name, reason = %message, "workstation certificate request failed");
        signer.metrics.workstation_request_failed();
        signer.fail(&csr, &message).await?;
        return Ok(Action::await_change());
    }
    let patch = serde_json::json!({"status": {"certificate": ByteString(cert.into_bytes())}});
    signer
        .csrs
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    signer.metrics.cert_issued("workstation");
    tracing::info!(
        request = %name,
        %workstation,
        requested_by = csr.spec.username.as_deref().unwrap_or("-"),
        not_after,
        "workstation certificate issued"
    );
    Ok(Action::await_change())
}

fn error_policy(_: Arc<CertificateSigningRequest>, _: &Error, _: Arc<Signer>) -> Action {
    Action::requeue(Duration::from_secs(5))
}

/// Decides from the request alone (the CA is read only to sign).
fn decide(csr: &CertificateSigningRequest, cfg: &PkiConfig) -> Decision {
    let status = csr.status.as_ref();
    if status
        .and_then(|s| s.certificate.as_ref())
        .is_some_and(|c| !c.0.is_empty())
    {
        return Decision::Wait;
    }
    let conditions = status
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let holds = |t: &str| {
        conditions
            .iter()
            .any(|c| c.type_ == t && c.status == "True")
    };
    if holds("Denied") || holds("Failed") || !holds("Approved") {
        return Decision::Wait;
    }
    let usages = csr.spec.usages.as_deref().unwrap_or_default();
    if !usages.iter().any(|u| u == "client auth") {
        return Decision::Fail(
            "a workstation certificate must be requested with usage \"client auth\"".into(),
        );
    }
    if let Some(u) = usages
        .iter()
        .find(|u| !ALLOWED_USAGES.contains(&u.as_str()))
    {
        return Decision::Fail(format!(
            "usage {u:?} is not granted to workstations (allowed: {})",
            ALLOWED_USAGES.join(", ")
        ));
    }
    let request = match pem_request(csr).and_then(|pem| Ok(pki::read_request(&pem)?)) {
        Ok(r) => r,
        Err(e) => return Decision::Fail(e.to_string()),
    };
    let Some(workstation) = request.common_name.clone() else {
        return Decision::Fail(
            "the request has no subject common name: put the workstation's name there".into(),
        );
    };
    if !spur_api::validation::is_dns_label(&workstation) {
        return Decision::Fail(format!(
            "the common name {workstation:?} is not a workstation name (a DNS label: lower-case letters, digits and '-', at most 63)"
        ));
    }
    if request.asks_for_more {
        return Decision::Fail("workstation certificates name the workstation only: remove the subject alternative names and the CA flag".into());
    }
    let asked = csr
        .spec
        .expiration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map(Duration::from_secs);
    let lifetime = asked
        .unwrap_or(cfg.workstation_cert_lifetime)
        .min(cfg.workstation_cert_max_lifetime);
    Decision::Sign {
        workstation,
        lifetime,
        request: Box::new(request),
    }
}

fn pem_request(csr: &CertificateSigningRequest) -> Result<String, Error> {
    String::from_utf8(csr.spec.request.0.clone())
        .map_err(|_| Error::Pki("spec.request is not PEM text".into()))
}

impl Signer {
    /// The CA that signs now (the certificate manager's `ca.crt`/`ca.key`).
    async fn signing_ca(&self) -> Result<Pair, Error> {
        Ok(
            crate::pki_config::signing_ca(&self.secrets, &self.cfg.ca_secret)
                .await?
                .0,
        )
    }

    /// Adds a `Failed` condition (the conditions are replaced as a whole by a merge patch, so
    /// the existing ones are sent along).
    async fn fail(&self, csr: &CertificateSigningRequest, message: &str) -> Result<(), Error> {
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let mut conditions = csr
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        conditions.push(CertificateSigningRequestCondition {
            type_: "Failed".into(),
            status: "True".into(),
            reason: Some("SpurRejected".into()),
            message: Some(message.into()),
            last_transition_time: Some(now.clone()),
            last_update_time: Some(now),
        });
        let patch = serde_json::json!({"status": {"conditions": conditions}});
        self.csrs
            .patch_status(
                &csr.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use rustls::pki_types::pem::PemObject;

    fn request(cn: &str, sans: &[&str]) -> String {
        let mut p =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        if !cn.is_empty() {
            p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        }
        let key = rcgen::KeyPair::generate().unwrap();
        p.serialize_request(&key).unwrap().pem().unwrap()
    }

    fn csr(
        pem: &str,
        usages: &[&str],
        conditions: &[(&str, &str)],
        expiration: Option<i32>,
    ) -> CertificateSigningRequest {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "r"},
            "spec": {
                "request": ByteString(pem.as_bytes().to_vec()),
                "signerName": WORKSTATION_SIGNER,
                "usages": usages,
                "expirationSeconds": expiration,
            },
            "status": {"conditions": conditions.iter().map(|(t, s)| serde_json::json!({"type": t, "status": s})).collect::<Vec<_>>()},
        }))
        .unwrap()
    }

    #[test]
    fn only_approved_valid_requests_are_signed() {
        let cfg = PkiConfig::new("spur", "spur-webhook");
        let good = request("alice", &[]);
        let approved = [("Approved", "True")];
        let usages = ["client auth", "digital signature"];
        let Decision::Sign {
            workstation,
            lifetime,
            request: parsed,
        } = decide(&csr(&good, &usages, &approved, None), &cfg)
        else {
            panic!()
        };
        assert_eq!(workstation, "alice");
        assert_eq!(lifetime, cfg.workstation_cert_lifetime);
        assert_eq!(parsed.common_name.as_deref(), Some("alice"));
        // Asked-for lifetimes are honoured up to the maximum.
        let Decision::Sign { lifetime, .. } =
            decide(&csr(&good, &usages, &approved, Some(3600)), &cfg)
        else {
            panic!()
        };
        assert_eq!(lifetime, Duration::from_secs(3600));
        let Decision::Sign { lifetime, .. } =
            decide(&csr(&good, &usages, &approved, Some(i32::MAX)), &cfg)
        else {
            panic!()
        };
        assert_eq!(lifetime, cfg.workstation_cert_max_lifetime);
        // Not approved, denied, failed: nothing to do.
        for conditions in [
            &[][..],
            &[("Approved", "True"), ("Denied", "True")],
            &[("Approved", "True"), ("Failed", "True")],
        ] {
            let d = decide(&csr(&good, &usages, conditions, None), &cfg);
            assert!(matches!(d, Decision::Wait), "{d:?}");
        }
        // Approved but unsignable: each says why.
        let fails = [
            csr(&good, &["server auth", "client auth"], &approved, None),
            csr(&good, &["digital signature"], &approved, None),
            csr(&request("", &[]), &usages, &approved, None),
            csr(&request("Alice_Laptop", &[]), &usages, &approved, None),
            csr(
                &request("alice", &["admin.example.com"]),
                &usages,
                &approved,
                None,
            ),
            csr(
                "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
                &usages,
                &approved,
                None,
            ),
        ];
        let why: Vec<String> = fails
            .iter()
            .map(|c| match decide(c, &cfg) {
                Decision::Fail(m) => m,
                d => panic!("{d:?}"),
            })
            .collect();
        for (m, want) in why.iter().zip([
            "server auth",
            "client auth",
            "no subject common name",
            "not a workstation name",
            "subject alternative names",
            "certificate signing request",
        ]) {
            assert!(m.contains(want), "{m:?} lacks {want:?}");
        }
    }

    #[test]
    fn issued_certificate_names_the_workstation_for_client_auth_only() {
        let now = pki::now_unix();
        let ca = pki::new_ca("ca", Duration::from_secs(3600), now).unwrap();
        let req = pki::read_request(&request("alice", &[])).unwrap();
        let pem = pki::issue_client(&ca, &req, "alice", Duration::from_secs(600), now).unwrap();
        let der = rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        let cn: Vec<_> = cert
            .subject()
            .iter_common_name()
            .map(|c| c.as_str().unwrap().to_string())
            .collect();
        assert_eq!(cn, ["alice"]);
        let eku = cert.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.client_auth && !eku.server_auth);
        assert_eq!(cert.validity().not_after.timestamp(), now + 600);
        // Signed by the CA: it verifies with the CA's key.
        let ca_der = rustls::pki_types::CertificateDer::from_pem_slice(ca.cert.as_bytes()).unwrap();
        let (_, ca_cert) = x509_parser::parse_x509_certificate(&ca_der).unwrap();
        cert.verify_signature(Some(ca_cert.public_key())).unwrap();
        // Never past the CA's expiry.
        let long = pki::issue_client(&ca, &req, "alice", Duration::from_secs(86_400), now).unwrap();
        assert_eq!(pki::info(&long).unwrap().validity.not_after, now + 3600);
    }
}
