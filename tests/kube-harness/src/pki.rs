//! The key material one API server needs, made fresh for every start.

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

pub(crate) struct Pki {
    pub(crate) ca_pem: String,
    pub(crate) serving_cert_pem: String,
    pub(crate) serving_key_pem: String,
    /// Signs and verifies service-account tokens (TokenRequest); kube-apiserver refuses to start
    /// without it.
    pub(crate) sa_key_pem: String,
    pub(crate) sa_public_pem: String,
}

impl Pki {
    pub(crate) fn generate() -> anyhow::Result<Self> {
        let ca_key = KeyPair::generate().context("generating the CA key")?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "spur-kube-harness CA");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca_params
            .self_signed(&ca_key)
            .context("self-signing the CA")?;
        let issuer = Issuer::new(ca_params, ca_key);

        // rustls matches the URL's host against SANs only (never the CN), and clients reach the
        // server both as 127.0.0.1 and as localhost.
        let serving_key = KeyPair::generate().context("generating the serving key")?;
        let mut serving_params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])?;
        serving_params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving_params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        serving_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert = serving_params
            .signed_by(&serving_key, &issuer)
            .context("signing the serving certificate")?;

        let sa_key = KeyPair::generate().context("generating the service-account key")?;

        Ok(Self {
            ca_pem: ca_cert.pem(),
            serving_cert_pem: serving_cert.pem(),
            serving_key_pem: serving_key.serialize_pem(),
            sa_key_pem: sa_key.serialize_pem(),
            sa_public_pem: sa_key.public_key_pem(),
        })
    }
}
