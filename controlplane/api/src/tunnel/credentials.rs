//! Workstation credentials the tunnel proxy reads from its token namespace: the contract
//! between it, `spur local token|revoke`, `spur access` (tunnel grants) and the operator, and
//! the Secrets that carry them (a token, a revocation), written here once for all of them.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::WORKSTATION_LABEL;
use crate::Error;
use crate::keys::labels;

/// Label marking a Secret as a workstation credential; the value is its kind (`token` or
/// `revocation`).
pub const CREDENTIAL_LABEL: &str = "spur.dev/credential";
/// Annotation: when the token stops being accepted (RFC 3339).
pub const EXPIRES_ANNOTATION: &str = "spur.dev/expires-at";
/// Annotation of a token Secret: when this token was written (RFC 3339); a revocation
/// covers tokens written before it. Without it, the Secret's creation counts.
pub const ISSUED_ANNOTATION: &str = "spur.dev/issued-at";
/// Annotation of a revocation: credentials issued before this instant are revoked.
pub const REVOKED_BEFORE_ANNOTATION: &str = "spur.dev/revoked-before";
/// Annotation of a tunnel grant's token Secret (labelled `spur.dev/access-kind=tunnel`):
/// the namespace of its TunnelAccessRequest, the only one the grant's sessions reach.
pub const GRANT_NAMESPACE_ANNOTATION: &str = "spur.dev/access-request-namespace";
/// Key of a token Secret's data holding only the token's SHA-256 (lowercase hex) instead
/// of the token: what a tunnel grant writes, since only the workstation holds the token.
pub const TOKEN_SHA256_KEY: &str = "token-sha256";

/// Name of the revocation Secret of `workstation`.
pub fn revocation_secret_name(workstation: &str) -> String {
    format!("spur-workstation-revoked-{workstation}")
}

/// Tokens shorter than this are refused when created: they could be guessed.
pub const MIN_TOKEN_LEN: usize = 32;

/// `at` in RFC 3339, whole seconds.
fn timestamp(at: SystemTime) -> Result<String, Error> {
    let secs = at
        .duration_since(UNIX_EPOCH)
        .map_err(|_| Error::Credential("a time before 1970".into()))?
        .as_secs();
    let t = k8s_openapi::jiff::Timestamp::from_second(
        i64::try_from(secs).map_err(|e| Error::Credential(e.to_string()))?,
    )
    .map_err(|e| Error::Credential(e.to_string()))?;
    Ok(t.to_string())
}

/// The Secret revoking every credential of `workstation` issued before `before` (what
/// `spur local revoke` applies).
pub fn revocation_secret(
    namespace: &str,
    workstation: &str,
    before: SystemTime,
) -> Result<Secret, Error> {
    let t = timestamp(before)?;
    Ok(Secret {
        metadata: ObjectMeta {
            name: Some(revocation_secret_name(workstation)),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([
                (WORKSTATION_LABEL.to_string(), workstation.to_string()),
                (CREDENTIAL_LABEL.to_string(), "revocation".to_string()),
                (
                    labels::MANAGED_BY.to_string(),
                    labels::MANAGED_BY_VALUE.to_string(),
                ),
            ])),
            annotations: Some(BTreeMap::from([(REVOKED_BEFORE_ANNOTATION.to_string(), t)])),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        ..Default::default()
    })
}

/// SHA-256 of a token, lowercase hex (what a tunnel grant stores).
pub fn token_sha256(token: &str) -> String {
    crate::digest::sha256_hex(token.as_bytes())
}

/// A fresh random token (256 bits, URL-safe hex).
pub fn generate_token() -> Result<String, Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| Error::Credential(format!("no randomness: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The Secret holding `token` for `workstation` (what `spur local token create` applies).
pub fn token_secret(
    namespace: &str,
    workstation: &str,
    token: &str,
    expires_at: Option<SystemTime>,
) -> Result<Secret, Error> {
    if token.len() < MIN_TOKEN_LEN {
        return Err(Error::Credential(format!(
            "a workstation token must be at least {MIN_TOKEN_LEN} characters"
        )));
    }
    let mut annotations =
        BTreeMap::from([(ISSUED_ANNOTATION.to_string(), timestamp(SystemTime::now())?)]);
    if let Some(at) = expires_at {
        annotations.insert(EXPIRES_ANNOTATION.to_string(), timestamp(at)?);
    }
    Ok(Secret {
        metadata: ObjectMeta {
            name: Some(format!("spur-workstation-{workstation}")),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([
                (WORKSTATION_LABEL.to_string(), workstation.to_string()),
                (CREDENTIAL_LABEL.to_string(), "token".to_string()),
                (
                    labels::MANAGED_BY.to_string(),
                    labels::MANAGED_BY_VALUE.to_string(),
                ),
            ])),
            annotations: Some(annotations),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            "token".to_string(),
            ByteString(token.as_bytes().to_vec()),
        )])),
        ..Default::default()
    })
}
