//! Workstation certificates on a real kube-apiserver, everyone under the chart's RBAC: the
//! operator (certificate manager and workstation signer), a developer filing
//! CertificateSigningRequests, an approver approving them.
//!
//! Checked: the tunnel proxy's serving certificate is issued with its names and the CA bundle;
//! the bundle is published in a ConfigMap; an approved request is signed for the workstation it
//! names, client-auth only, its lifetime capped; invalid approved requests are marked Failed
//! with the reason; unapproved, denied and other signers' requests are left alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use prometheus_client::registry::Registry;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde_json::json;
use spur_e2e::kube::{SYSTEM_NAMESPACE, chart_client, eventually, install_crds, operator_client};
use spur_kube_harness::KubeApi;
use spur_operator::{PkiConfig, ServingCert};
use tokio_util::sync::CancellationToken;

fn request_pem(cn: &str, sans: &[&str]) -> String {
    let mut p =
        rcgen::CertificateParams::new(sans.iter().map(|s| (*s).to_string()).collect::<Vec<_>>())
            .unwrap();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(rcgen::DnType::CommonName, cn);
    p.serialize_request(&rcgen::KeyPair::generate().unwrap())
        .unwrap()
        .pem()
        .unwrap()
}

fn csr(name: &str, signer: &str, pem: &str, expiration: i32) -> CertificateSigningRequest {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "request": ByteString(pem.as_bytes().to_vec()),
            "signerName": signer,
            "usages": ["client auth", "digital signature"],
            "expirationSeconds": expiration,
        },
    }))
    .unwrap()
}

/// What `kubectl certificate approve|deny` does.
async fn decide(api: &Api<CertificateSigningRequest>, name: &str, approve: bool) {
    let (t, reason) = if approve {
        ("Approved", "KubectlApprove")
    } else {
        ("Denied", "KubectlDeny")
    };
    api.patch_approval(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"conditions": [
            {"type": t, "status": "True", "reason": reason, "message": "test"}
        ]}})),
    )
    .await
    .unwrap();
}

fn condition(csr: &CertificateSigningRequest, t: &str) -> Option<String> {
    csr.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == t && c.status == "True")
        .map(|c| c.message.clone().unwrap_or_default())
}

fn certificate(csr: &CertificateSigningRequest) -> Option<String> {
    let c = csr.status.as_ref()?.certificate.as_ref()?;
    (!c.0.is_empty()).then(|| String::from_utf8(c.0.clone()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approved_workstation_requests_are_signed_and_invalid_ones_fail() {
    spur_e2e::kube::capture_logs();
    let api = KubeApi::start().await.unwrap();
    install_crds(&api).await.unwrap();
    let operator = operator_client(&api).await.unwrap();
    let developer = chart_client(&api, "developer", "workstation-rules.yaml", None)
        .await
        .unwrap();
    let approver = chart_client(&api, "approver", "workstation-approver-rules.yaml", None)
        .await
        .unwrap();

    let mut registry = Registry::with_prefix("spur_operator");
    let metrics = spur_operator::Metrics::register(&mut registry);
    let mut pki = PkiConfig::new(SYSTEM_NAMESPACE, "spur-webhook");
    pki.tunnel_proxy = Some(ServingCert::tunnel_proxy(
        SYSTEM_NAMESPACE,
        &["tunnel.example.com".into(), "192.0.2.7".into()],
    ));
    pki.workstation_cert_lifetime = Duration::from_secs(3600);
    pki.workstation_cert_max_lifetime = Duration::from_secs(2 * 3600);
    pki.validate().unwrap();
    let ctx = Arc::new(
        spur_operator::Context::new(operator.clone(), Some("test".into()), metrics).with_pki(pki),
    );
    let stop = CancellationToken::new();
    let running = tokio::spawn(spur_operator::run(operator, ctx, stop.clone()));

    // The tunnel proxy's certificate and the published bundle.
    let admin = api.client();
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), SYSTEM_NAMESPACE);
    let tls = eventually("the tunnel proxy's Secret", || async {
        secrets.get_opt("spur-tunnel-proxy-tls").await.ok()??.data
    })
    .await;
    let text = |b: &ByteString| String::from_utf8(b.0.clone()).unwrap();
    let info = spur_serving::pki::info(&text(&tls["tls.crt"])).unwrap();
    assert_eq!(
        info.sans,
        [
            "spur-tunnel-proxy.spur-system.svc",
            "spur-tunnel-proxy.spur-system.svc.cluster.local",
            "tunnel.example.com",
            "192.0.2.7"
        ]
    );
    assert!(!info.is_ca);
    let ca = secrets.get("spur-ca").await.unwrap().data.unwrap();
    let bundle = text(&ca["bundle.crt"]);
    assert_eq!(text(&tls["ca.crt"]), bundle);
    let config_maps: Api<ConfigMap> = Api::namespaced(admin.clone(), SYSTEM_NAMESPACE);
    let published = eventually("the CA bundle ConfigMap", || async {
        config_maps
            .get_opt("spur-ca-bundle")
            .await
            .ok()??
            .data?
            .remove("ca.crt")
    })
    .await;
    assert_eq!(published, bundle);
    assert!(!published.contains("PRIVATE KEY"));

    // The developer files requests; only what is approved, valid and ours gets signed.
    let filed: Api<CertificateSigningRequest> = Api::all(developer);
    let approving: Api<CertificateSigningRequest> = Api::all(approver);
    let requests = [
        ("alice", "spur.dev/workstation", request_pem("alice", &[])),
        (
            "bad-name",
            "spur.dev/workstation",
            request_pem("Alice_Laptop", &[]),
        ),
        (
            "extra-names",
            "spur.dev/workstation",
            request_pem("bob", &["admin.example.com"]),
        ),
        ("denied", "spur.dev/workstation", request_pem("carol", &[])),
        ("pending", "spur.dev/workstation", request_pem("dave", &[])),
        (
            "other-signer",
            "example.com/other",
            request_pem("erin", &[]),
        ),
    ];
    for (name, signer, pem) in &requests {
        filed
            .create(&PostParams::default(), &csr(name, signer, pem, 86_400))
            .await
            .unwrap();
    }
    for name in ["alice", "bad-name", "extra-names"] {
        decide(&approving, name, true).await;
    }
    decide(&approving, "denied", false).await;
    // The approver may approve nothing but workstation requests.
    let refused = approving
        .patch_approval(
            "other-signer",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": [
                {"type": "Approved", "status": "True", "reason": "KubectlApprove", "message": "test"}
            ]}})),
        )
        .await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 403),
        "{refused:?}"
    );
    decide(&Api::all(admin.clone()), "other-signer", true).await;

    let pem = eventually("alice's certificate", || async {
        certificate(&filed.get("alice").await.ok()?)
    })
    .await;
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
    let identity = spur_tunnel::identity_from_cert(&der).unwrap();
    assert_eq!(identity.name, "alice");
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    let eku = cert.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.client_auth && !eku.server_auth);
    assert!(cert.subject_alternative_name().unwrap().is_none());
    // 24 h asked, 2 h granted.
    let lifetime = cert.validity().not_after.timestamp() - spur_serving::pki::now_unix();
    assert!((7000..=7200).contains(&lifetime), "{lifetime}");
    // Signed by the CA in the bundle the tunnel proxy trusts.
    let ca_der = CertificateDer::from_pem_slice(ca["ca.crt"].0.as_slice()).unwrap();
    let (_, ca_cert) = x509_parser::parse_x509_certificate(&ca_der).unwrap();
    cert.verify_signature(Some(ca_cert.public_key())).unwrap();

    for (name, why) in [
        ("bad-name", "not a workstation name"),
        ("extra-names", "subject alternative names"),
    ] {
        let message = eventually("a Failed condition", || async {
            condition(&filed.get(name).await.ok()?, "Failed")
        })
        .await;
        assert!(message.contains(why), "{name}: {message}");
        assert!(certificate(&filed.get(name).await.unwrap()).is_none());
    }
    // Give the signer time to (wrongly) act on the rest.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for name in ["denied", "pending", "other-signer"] {
        let r = filed.get(name).await.unwrap();
        assert!(certificate(&r).is_none(), "{name} was signed");
        assert!(condition(&r, "Failed").is_none(), "{name} was failed");
    }

    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
    assert!(
        out.contains("spur_operator_certificates_issued_total{certificate=\"workstation\"} 1"),
        "{out}"
    );
    assert!(
        out.contains("spur_operator_workstation_certificate_requests_failed_total 2"),
        "{out}"
    );
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), running)
        .await
        .expect("the operator stops")
        .unwrap();
}
