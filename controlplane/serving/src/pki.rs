//! The operator's own small CA: self-signed roots and the serving certificates they sign
//! (ECDSA P-256 through rcgen), and the facts about a stored certificate that renewal needs.
//!
//! Certificates are renewed at 80 % of their lifetime, as MARIN3R does
//! (`research/xds_pki_access.md` §1.4), so a failed renewal has a fifth of the lifetime to be
//! retried before anything expires.

use std::net::IpAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, DnValue, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::Error;

/// Organization written into every subject.
const ORGANIZATION: &str = "spur.dev";

/// A certificate and its private key, both PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct Pair {
    pub cert: String,
    pub key: String,
}

impl std::fmt::Debug for Pair {
    // Never print a private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pair")
            .field("fingerprint", &fingerprint(&self.cert))
            .finish_non_exhaustive()
    }
}

/// Validity window of a certificate, in seconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    pub not_before: i64,
    pub not_after: i64,
}

impl Validity {
    /// When the certificate is due for renewal: 80 % into its lifetime.
    pub fn renew_at(&self) -> i64 {
        self.not_before + (self.not_after - self.not_before) * 4 / 5
    }

    /// When the certificate is due for renewal while `configured` is the lifetime new ones get:
    /// 80 % into its own lifetime, or into the configured one when that is shorter. So shortening
    /// the lifetime (say, after a suspected key leak) rotates at once instead of when the old,
    /// long-lived certificate reaches its own 80 %.
    pub fn renew_at_for(&self, configured: Duration) -> i64 {
        let life = lifetime_secs(configured);
        let span = life.saturating_add(backdate(life));
        self.renew_at()
            .min(self.not_before.saturating_add(span * 4 / 5))
    }

    /// When the certificate was made: `not_before` is backdated by [`backdate`] of its lifetime
    /// (to the second: the inverse of `lifetime + lifetime / 10` rounds).
    pub fn issued_at(&self) -> i64 {
        let total = self.not_after - self.not_before;
        self.not_before
            + if total >= 3300 {
                300
            } else {
                (total / 11).max(1)
            }
    }

    pub fn expired(&self, now: i64) -> bool {
        now >= self.not_after
    }
}

/// What renewal needs to know about a stored certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    pub validity: Validity,
    /// DNS names and IP addresses, as strings.
    pub sans: Vec<String>,
    pub is_ca: bool,
}

pub fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// A short, stable identifier of a certificate, for annotations and logs (FNV-1a of the DER:
/// it tells our own certificates apart, it is not a security check).
pub fn fingerprint(cert_pem: &str) -> String {
    let der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map(|d| d.to_vec())
        .unwrap_or_else(|_| cert_pem.trim().as_bytes().to_vec());
    fnv(&der)
}

/// A short fingerprint of a whole text (e.g. a bundle of several certificates): tells versions
/// apart, proves nothing.
pub fn fingerprint_text(text: &str) -> String {
    fnv(text.trim().as_bytes())
}

fn fnv(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// Makes a new self-signed CA valid from (a little before) `now` for `lifetime`.
pub fn new_ca(common_name: &str, lifetime: Duration, now: i64) -> Result<Pair, Error> {
    let key = KeyPair::generate().map_err(pki)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = subject(common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    set_validity(&mut params, lifetime, now)?;
    let cert = params.self_signed(&key).map_err(pki)?;
    Ok(Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// Issues a TLS serving certificate for `names` (DNS names or IP addresses) signed by `ca`.
/// Its lifetime never reaches past the CA's own expiry, or clients would reject it early.
pub fn issue_serving(
    ca: &Pair,
    common_name: &str,
    names: &[String],
    lifetime: Duration,
    now: i64,
) -> Result<Pair, Error> {
    let subject_alt_names = names
        .iter()
        .map(|n| match n.parse::<IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => n.clone().try_into().map(SanType::DnsName).map_err(pki),
        })
        .collect::<Result<_, Error>>()?;
    issue_leaf(
        ca,
        common_name,
        subject_alt_names,
        ExtendedKeyUsagePurpose::ServerAuth,
        lifetime,
        now,
    )
}

/// Issues a TLS client certificate and its new key, naming `common_name`, signed by `ca`.
pub fn issue_client_pair(
    ca: &Pair,
    common_name: &str,
    lifetime: Duration,
    now: i64,
) -> Result<Pair, Error> {
    issue_leaf(
        ca,
        common_name,
        Vec::new(),
        ExtendedKeyUsagePurpose::ClientAuth,
        lifetime,
        now,
    )
}

/// A new key and a certificate for it with one extended usage, signed by `ca`.
fn issue_leaf(
    ca: &Pair,
    common_name: &str,
    subject_alt_names: Vec<SanType>,
    usage: ExtendedKeyUsagePurpose,
    lifetime: Duration,
    now: i64,
) -> Result<Pair, Error> {
    let (issuer, lifetime) = issuer(ca, lifetime, now)?;
    let key = KeyPair::generate().map_err(pki)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = subject(common_name);
    params.subject_alt_names = subject_alt_names;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    set_validity(&mut params, lifetime, now)?;
    let cert = params.signed_by(&key, &issuer).map_err(pki)?;
    Ok(Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// A certificate signing request whose signature checks out.
pub struct ClientRequest {
    /// The subject's common name, if the request has one.
    pub common_name: Option<String>,
    /// Whether it asks for subject alternative names or a CA certificate (workstation
    /// certificates name the workstation only, in the common name).
    pub asks_for_more: bool,
    csr: CertificateSigningRequestParams,
}

impl std::fmt::Debug for ClientRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientRequest")
            .field("common_name", &self.common_name)
            .field("asks_for_more", &self.asks_for_more)
            .finish_non_exhaustive()
    }
}

/// Reads a PEM certificate signing request (PKCS #10) and checks its self-signature, which
/// proves the requester holds the private key.
pub fn read_request(pem: &str) -> Result<ClientRequest, Error> {
    let csr = CertificateSigningRequestParams::from_pem(pem)
        .map_err(|e| Error::Pki(format!("not a usable certificate signing request: {e}")))?;
    let common_name = csr
        .params
        .distinguished_name
        .iter()
        .find(|(t, _)| **t == DnType::CommonName)
        .and_then(|(_, v)| dn_text(v));
    let asks_for_more =
        !csr.params.subject_alt_names.is_empty() || !matches!(csr.params.is_ca, IsCa::NoCa);
    Ok(ClientRequest {
        common_name,
        asks_for_more,
        csr,
    })
}

fn dn_text(v: &DnValue) -> Option<String> {
    match v {
        DnValue::Utf8String(s) => Some(s.clone()),
        DnValue::PrintableString(s) => Some(s.as_str().to_owned()),
        DnValue::Ia5String(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// Issues a TLS client certificate naming `common_name`, for the key of `request`, signed by
/// `ca`. Only the request's key is used: subject, usages and lifetime are the signer's.
pub fn issue_client(
    ca: &Pair,
    request: &ClientRequest,
    common_name: &str,
    lifetime: Duration,
    now: i64,
) -> Result<String, Error> {
    let (issuer, lifetime) = issuer(ca, lifetime, now)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = subject(common_name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    set_validity(&mut params, lifetime, now)?;
    let signed = CertificateSigningRequestParams {
        params,
        public_key: request.csr.public_key.clone(),
    }
    .signed_by(&issuer)
    .map_err(pki)?;
    Ok(signed.pem())
}

/// `ca` as an issuer, and `lifetime` cut so that nothing it signs outlives it.
fn issuer(
    ca: &Pair,
    lifetime: Duration,
    now: i64,
) -> Result<(Issuer<'static, KeyPair>, Duration), Error> {
    let ca_info = info(&ca.cert)?;
    let remaining = u64::try_from(ca_info.validity.not_after - now).unwrap_or(0);
    if remaining == 0 {
        return Err(Error::Pki("the CA has expired".into()));
    }
    let ca_key = KeyPair::from_pem(&ca.key).map_err(pki)?;
    let ca_der = CertificateDer::from_pem_slice(ca.cert.as_bytes())
        .map_err(|e| Error::Pki(format!("cannot read the CA certificate: {e}")))?;
    let issuer = Issuer::from_ca_cert_der(&ca_der, ca_key).map_err(pki)?;
    Ok((issuer, lifetime.min(Duration::from_secs(remaining))))
}

/// Reads the first certificate of a PEM text.
pub fn info(cert_pem: &str) -> Result<Info, Error> {
    let der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| Error::Pki(format!("not a PEM certificate: {e}")))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| Error::Pki(format!("cannot parse certificate: {e}")))?;
    let validity = Validity {
        not_before: cert.validity().not_before.timestamp(),
        not_after: cert.validity().not_after.timestamp(),
    };
    let mut sans = Vec::new();
    if let Ok(Some(ext)) = cert.subject_alternative_name() {
        for name in &ext.value.general_names {
            match name {
                x509_parser::extensions::GeneralName::DNSName(d) => sans.push((*d).to_string()),
                x509_parser::extensions::GeneralName::IPAddress(b) => {
                    let ip = match b.len() {
                        4 => <[u8; 4]>::try_from(*b).ok().map(IpAddr::from),
                        16 => <[u8; 16]>::try_from(*b).ok().map(IpAddr::from),
                        _ => None,
                    };
                    if let Some(ip) = ip {
                        sans.push(ip.to_string());
                    }
                }
                _ => {}
            }
        }
    }
    Ok(Info {
        validity,
        sans,
        is_ca: cert.is_ca(),
    })
}

/// Every certificate in a PEM bundle, as its own PEM block; anything that is not a readable
/// certificate is dropped.
pub fn split_bundle(bundle: &str) -> Vec<String> {
    const END: &str = "-----END CERTIFICATE-----";
    let mut out = Vec::new();
    let mut rest = bundle;
    while let Some(start) = rest.find("-----BEGIN CERTIFICATE-----") {
        let Some(len) = rest[start..].find(END) else {
            break;
        };
        let block = &rest[start..start + len + END.len()];
        if CertificateDer::from_pem_slice(block.as_bytes()).is_ok() {
            out.push(format!("{block}\n"));
        }
        rest = &rest[start + len + END.len()..];
    }
    out
}

fn subject(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, ORGANIZATION);
    dn.push(DnType::CommonName, common_name);
    dn
}

/// Valid from a little before `now` (a tenth of the lifetime, at most five minutes) so that a
/// verifier whose clock lags slightly does not reject a fresh certificate.
fn set_validity(params: &mut CertificateParams, lifetime: Duration, now: i64) -> Result<(), Error> {
    let life = lifetime_secs(lifetime);
    if life < 2 {
        return Err(Error::Pki(format!(
            "certificate lifetime {lifetime:?} is too short"
        )));
    }
    let backdate = backdate(life);
    let at = |t: i64| {
        time::OffsetDateTime::from_unix_timestamp(t)
            .map_err(|e| Error::Pki(format!("certificate time out of range: {e}")))
    };
    params.not_before = at(now - backdate)?;
    params.not_after = at(now + life)?;
    Ok(())
}

/// Seconds, bounded so that arithmetic on them cannot overflow.
fn lifetime_secs(lifetime: Duration) -> i64 {
    i64::try_from(lifetime.as_secs()).map_or(i64::MAX / 8, |s| s.min(i64::MAX / 8))
}

/// How far before issuance validity starts, for clock skew: a tenth of the lifetime, at most
/// 5 min.
fn backdate(life: i64) -> i64 {
    (life / 10).clamp(1, 300)
}

fn pki(e: rcgen::Error) -> Error {
    Error::Pki(e.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ca_and_serving_certificate_round_trip() {
        let now = now_unix();
        let ca = new_ca("spur test CA", Duration::from_secs(3600), now).unwrap();
        let ci = info(&ca.cert).unwrap();
        assert!(ci.is_ca);
        assert_eq!(ci.validity.not_after, now + 3600);
        assert!(ci.validity.not_before < now);
        let names = vec!["spur-webhook.spur.svc".to_string(), "127.0.0.1".to_string()];
        let leaf =
            issue_serving(&ca, "spur-webhook", &names, Duration::from_secs(600), now).unwrap();
        let li = info(&leaf.cert).unwrap();
        assert!(!li.is_ca);
        assert_eq!(li.sans, names);
        assert_eq!(li.validity.not_after, now + 600);
        // 80 %: 60 s backdate + 600 s lifetime → renew 528 s after not_before.
        assert_eq!(li.validity.renew_at(), li.validity.not_before + 528);
        // A longer configured lifetime changes nothing; a shorter one brings renewal forward
        // (300 s configured, backdated 30 s: 80 % of 330 s is 264 s).
        let longer = Duration::from_secs(6000);
        assert_eq!(li.validity.renew_at_for(longer), li.validity.renew_at());
        let shorter = Duration::from_secs(300);
        assert_eq!(
            li.validity.renew_at_for(shorter),
            li.validity.not_before + 264
        );
        assert_eq!(
            li.validity.renew_at_for(Duration::from_secs(600)),
            li.validity.renew_at()
        );
        assert_ne!(fingerprint(&ca.cert), fingerprint(&leaf.cert));
        for life in [2, 100, 600, 3000, 3299, 3600, 86400] {
            let c = new_ca("t", Duration::from_secs(life), now).unwrap();
            let at = info(&c.cert).unwrap().validity.issued_at();
            assert!(
                (at - now).abs() <= 1,
                "lifetime {life}: made at {now}, read {at}"
            );
        }
    }

    #[test]
    fn serving_certificate_never_outlives_its_ca() {
        let now = now_unix();
        let ca = new_ca("ca", Duration::from_secs(100), now).unwrap();
        let leaf =
            issue_serving(&ca, "x", &["x.svc".into()], Duration::from_secs(1000), now).unwrap();
        assert_eq!(info(&leaf.cert).unwrap().validity.not_after, now + 100);
        let expired = new_ca("old", Duration::from_secs(10), now - 100).unwrap();
        assert!(
            issue_serving(
                &expired,
                "x",
                &["x.svc".into()],
                Duration::from_secs(10),
                now
            )
            .is_err()
        );
    }

    #[test]
    fn bundles_split_into_certificates() {
        let now = now_unix();
        let a = new_ca("a", Duration::from_secs(100), now).unwrap();
        let b = new_ca("b", Duration::from_secs(100), now).unwrap();
        let bundle = format!("{}{}", a.cert, b.cert);
        let parts = split_bundle(&bundle);
        assert_eq!(parts.len(), 2);
        assert_eq!(fingerprint(&parts[0]), fingerprint(&a.cert));
        assert_eq!(fingerprint(&parts[1]), fingerprint(&b.cert));
        assert!(split_bundle("garbage").is_empty());
        assert!(info("garbage").is_err());
    }

    #[test]
    fn debug_never_shows_the_key() {
        let ca = new_ca("a", Duration::from_secs(100), now_unix()).unwrap();
        assert!(!format!("{ca:?}").contains("PRIVATE"));
    }
}
