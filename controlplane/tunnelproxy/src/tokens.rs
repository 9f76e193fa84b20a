//! Workstation tokens: one Secret per workstation in the tunnel proxy's namespace, labelled
//! `spur.dev/workstation=<name>` and `spur.dev/credential=token`, with the token in `data.token`
//! and an optional expiry in the annotation `spur.dev/expires-at` (RFC 3339). A reflector keeps
//! them in memory. A lookup compares against every token in constant time and never logs one.
//!
//! Revocations live beside them: a Secret labelled `spur.dev/credential=revocation` and
//! `spur.dev/workstation=<name>`, annotated `spur.dev/revoked-before` (RFC 3339), revokes every
//! credential of that workstation issued before that instant: client certificates by their
//! `notBefore`, tokens by their Secret's creation. `spur local revoke` writes one; the tunnel
//! proxy refuses such credentials and closes the sessions they opened.
//!
//! A tunnel grant (docs/access.md, "Tunnel grants") is a token Secret the operator writes for a
//! TunnelAccessRequest: labelled `spur.dev/access-kind=tunnel`, holding only the token's
//! SHA-256, and annotated with the request's namespace. A namespace admin made that grant, so
//! its sessions reach only that namespace ([`Workstation::scope`], crate::scope).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use spur_api::tunnel::WORKSTATION_LABEL;
use tokio_util::sync::CancellationToken;

use crate::Error;

use spur_api::access::labels::ACCESS_KIND as GRANT_KIND_LABEL;
pub use spur_api::tunnel::credentials::{
    CREDENTIAL_LABEL, EXPIRES_ANNOTATION, GRANT_NAMESPACE_ANNOTATION, ISSUED_ANNOTATION,
    REVOKED_BEFORE_ANNOTATION, TOKEN_SHA256_KEY,
};
// The Secrets' format lives with the contract, so that `spur local` and `spur access` write
// them without linking the tunnel proxy.
pub use spur_api::tunnel::credentials::{
    generate_token, revocation_secret, token_secret, token_sha256,
};
/// The value of [`GRANT_KIND_LABEL`] the operator puts on a tunnel grant's token Secret.
const GRANT_KIND_TUNNEL: &str = "tunnel";

/// A workstation a token belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workstation {
    pub name: String,
    pub expires_at: Option<SystemTime>,
    /// When the token's Secret was created.
    pub issued_at: Option<SystemTime>,
    /// For a tunnel grant's token: the grant's namespace, the only one its sessions reach.
    /// `None`: a workstation token, under the proxy's destination rules alone.
    pub scope: Option<String>,
}

/// Why a token was not accepted. Never carries the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("unknown token")]
    Unknown,
    #[error("the token of workstation {0} has expired")]
    Expired(String),
    /// A grant whose namespace cannot be read is refused rather than given the unnarrowed
    /// rules of a workstation token.
    #[error(
        "the tunnel grant of workstation {0} names no valid namespace (annotation \
         spur.dev/access-request-namespace); ask for a new grant"
    )]
    GrantWithoutNamespace(String),
}

/// The workstation tokens and revocations, kept current by a watch.
#[derive(Clone)]
pub struct TokenStore {
    store: Store<Secret>,
    changes: tokio::sync::watch::Receiver<u64>,
}

impl TokenStore {
    /// Starts watching token Secrets in `namespace`; resolves once the first list is in.
    pub async fn start(
        client: Client,
        namespace: &str,
        stop: CancellationToken,
    ) -> Result<TokenStore, Error> {
        let api: Api<Secret> = Api::namespaced(client, namespace);
        let (store, writer) = reflector::store();
        let stream = reflector::reflector(
            writer,
            watcher(
                api,
                watcher::Config::default()
                    .labels(&format!("{CREDENTIAL_LABEL} in (token,revocation)")),
            ),
        )
        .default_backoff()
        .touched_objects();
        let (tx, changes) = tokio::sync::watch::channel(0u64);
        tokio::spawn(async move {
            let mut s = std::pin::pin!(stream.take_until(stop.cancelled_owned()));
            while let Some(ev) = s.next().await {
                match ev {
                    Ok(_) => tx.send_modify(|n| *n = n.wrapping_add(1)),
                    Err(e) => {
                        tracing::warn!(error = %e, "workstation token watch failed; retrying")
                    }
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(30), store.wait_until_ready())
            .await
            .map_err(|_| Error::Kube("timed out listing workstation tokens".into()))?
            .map_err(|e| Error::Kube(e.to_string()))?;
        Ok(TokenStore { store, changes })
    }

    /// The workstation `token` belongs to, if it is known and not expired at `now`.
    pub fn lookup(&self, token: &str, now: SystemTime) -> Result<Workstation, TokenError> {
        lookup(self.store.state().iter().map(|s| &**s), token, now)
    }

    /// Credentials of `workstation` issued before this instant are revoked.
    pub fn revoked_before(&self, workstation: &str) -> Option<SystemTime> {
        revoked_before(self.store.state().iter().map(|s| &**s), workstation)
    }

    /// Whether credentials of `workstation` issued at `issued_at` are revoked (unknown issue
    /// time and a revocation: revoked). Both instants have whole seconds, so what was issued in
    /// the revocation's own second is revoked too.
    pub fn is_revoked(&self, workstation: &str, issued_at: Option<SystemTime>) -> bool {
        self.revoked_before(workstation)
            .is_some_and(|before| issued_at.is_none_or(|at| at <= before))
    }

    /// Ticks whenever a token or revocation Secret changes.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.clone()
    }
}

fn credential_kind(secret: &Secret) -> Option<&str> {
    secret.labels().get(CREDENTIAL_LABEL).map(String::as_str)
}

fn rfc3339(text: &str) -> Option<SystemTime> {
    text.parse::<k8s_openapi::jiff::Timestamp>()
        .ok()
        .and_then(|t| u64::try_from(t.as_second()).ok())
        .map(|s| UNIX_EPOCH + Duration::from_secs(s))
}

/// The latest revocation of `workstation` among `secrets`. An unreadable instant revokes
/// everything (fail closed).
pub fn revoked_before<'a>(
    secrets: impl Iterator<Item = &'a Secret>,
    workstation: &str,
) -> Option<SystemTime> {
    secrets
        .filter(|s| credential_kind(s) == Some("revocation"))
        .filter(|s| s.labels().get(WORKSTATION_LABEL).map(String::as_str) == Some(workstation))
        .map(|s| {
            s.annotations()
                .get(REVOKED_BEFORE_ANNOTATION)
                .and_then(|t| rfc3339(t))
                .unwrap_or_else(|| UNIX_EPOCH + Duration::from_secs(u64::from(u32::MAX) * 4))
        })
        .max()
}

/// Looks `token` up among `secrets`, comparing with every one in constant time.
pub fn lookup<'a>(
    secrets: impl Iterator<Item = &'a Secret>,
    token: &str,
    now: SystemTime,
) -> Result<Workstation, TokenError> {
    let mut found = None;
    let hashed = token_sha256(token);
    for secret in secrets {
        if credential_kind(secret) != Some("token") {
            continue;
        }
        let data = secret.data.as_ref();
        let (stored, presented) = match (
            data.and_then(|d| d.get("token")),
            data.and_then(|d| d.get(TOKEN_SHA256_KEY)),
        ) {
            (Some(t), _) => (t.0.as_slice(), token.as_bytes()),
            (None, Some(h)) => (h.0.as_slice(), hashed.as_bytes()),
            (None, None) => continue,
        };
        let stored = trim_ascii(stored);
        if constant_time_eq(stored, presented) && !stored.is_empty() {
            found = Some(secret);
        }
    }
    let secret = found.ok_or(TokenError::Unknown)?;
    let name = secret
        .labels()
        .get(WORKSTATION_LABEL)
        .cloned()
        .ok_or(TokenError::Unknown)?;
    let expires_at = match secret.annotations().get(EXPIRES_ANNOTATION) {
        None => None,
        // An unreadable expiry counts as expired: fail closed.
        Some(text) => Some(
            text.parse::<k8s_openapi::jiff::Timestamp>()
                .ok()
                .and_then(|t| u64::try_from(t.as_second()).ok())
                .map(|s| UNIX_EPOCH + Duration::from_secs(s))
                .ok_or_else(|| TokenError::Expired(name.clone()))?,
        ),
    };
    if expires_at.is_some_and(|at| now >= at) {
        return Err(TokenError::Expired(name));
    }
    let issued_at = match secret.annotations().get(ISSUED_ANNOTATION) {
        Some(text) => rfc3339(text),
        None => secret
            .metadata
            .creation_timestamp
            .as_ref()
            .and_then(|t| u64::try_from(t.0.as_second()).ok())
            .map(|s| UNIX_EPOCH + Duration::from_secs(s)),
    };
    let scope = if is_grant(secret) {
        match secret.annotations().get(GRANT_NAMESPACE_ANNOTATION) {
            // A namespace name is a DNS label.
            Some(ns) if spur_api::validation::is_dns_label(ns) => Some(ns.clone()),
            _ => return Err(TokenError::GrantWithoutNamespace(name)),
        }
    } else {
        None
    };
    Ok(Workstation {
        name,
        expires_at,
        issued_at,
        scope,
    })
}

/// A tunnel grant's Secret: what the operator writes, the grant label and the token's hash
/// only. Other token Secrets (`spur local token create`, an admin's own) are not narrowed,
/// whatever annotations they carry.
fn is_grant(secret: &Secret) -> bool {
    secret.labels().get(GRANT_KIND_LABEL).map(String::as_str) == Some(GRANT_KIND_TUNNEL)
        && secret
            .data
            .as_ref()
            .is_some_and(|d| d.contains_key(TOKEN_SHA256_KEY))
}

fn trim_ascii(b: &[u8]) -> &[u8] {
    // `kubectl create secret --from-file` keeps a trailing newline.
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    &b[..end]
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::BTreeMap;

    use k8s_openapi::ByteString;

    #[test]
    fn lookup_finds_the_workstation_and_enforces_expiry() {
        let now = SystemTime::now();
        let t1 = generate_token().unwrap();
        let t2 = generate_token().unwrap();
        assert_eq!(t1.len(), 64);
        assert_ne!(t1, t2);
        let alice = token_secret("ns", "alice", &t1, None).unwrap();
        let mut bob = token_secret("ns", "bob", &t2, Some(now - Duration::from_secs(5))).unwrap();
        let secrets = [alice.clone(), bob.clone()];
        let found = lookup(secrets.iter(), &t1, now).unwrap();
        assert_eq!((found.name.as_str(), found.expires_at), ("alice", None));
        // Issued now (whole seconds).
        let issued = found.issued_at.unwrap();
        assert!(issued <= now && now.duration_since(issued).unwrap() < Duration::from_secs(2));
        assert_eq!(
            lookup(secrets.iter(), &t2, now),
            Err(TokenError::Expired("bob".into()))
        );
        assert_eq!(
            lookup(secrets.iter(), "nope", now),
            Err(TokenError::Unknown)
        );
        assert_eq!(lookup(secrets.iter(), "", now), Err(TokenError::Unknown));
        // A trailing newline in the stored token (kubectl --from-file) is fine.
        bob.data
            .as_mut()
            .unwrap()
            .insert("token".into(), ByteString(format!("{t2}\n").into_bytes()));
        bob.metadata.annotations = None;
        assert_eq!(lookup([bob].iter(), &t2, now).unwrap().name, "bob");
        // An unreadable expiry fails closed.
        let mut carol = token_secret("ns", "carol", &t1, None).unwrap();
        carol.metadata.annotations = Some(BTreeMap::from([(
            EXPIRES_ANNOTATION.into(),
            "someday".into(),
        )]));
        assert_eq!(
            lookup([carol].iter(), &t1, now),
            Err(TokenError::Expired("carol".into()))
        );
        assert!(token_secret("ns", "x", "short", None).is_err());
        // A grant's Secret holds only the token's hash.
        let mut dave = token_secret("ns", "dave", &t1, None).unwrap();
        dave.data = Some(BTreeMap::from([(
            TOKEN_SHA256_KEY.into(),
            ByteString(token_sha256(&t1).into_bytes()),
        )]));
        assert_eq!(
            lookup([dave.clone()].iter(), &t1, now).unwrap().name,
            "dave"
        );
        assert_eq!(
            lookup([dave.clone()].iter(), &token_sha256(&t1), now),
            Err(TokenError::Unknown),
            "the hash itself is not a token"
        );
        assert_eq!(lookup([dave].iter(), &t2, now), Err(TokenError::Unknown));
        assert_eq!(
            token_sha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    /// A grant as the operator writes it: the grant label, the token's hash, the request's
    /// namespace.
    fn grant(workstation: &str, token: &str, namespace: Option<&str>) -> Secret {
        let mut s = token_secret("ns", workstation, token, None).unwrap();
        s.data = Some(BTreeMap::from([(
            TOKEN_SHA256_KEY.into(),
            ByteString(token_sha256(token).into_bytes()),
        )]));
        s.metadata
            .labels
            .get_or_insert_default()
            .insert(GRANT_KIND_LABEL.into(), GRANT_KIND_TUNNEL.into());
        if let Some(ns) = namespace {
            s.metadata
                .annotations
                .get_or_insert_default()
                .insert(GRANT_NAMESPACE_ANNOTATION.into(), ns.into());
        }
        s
    }

    #[test]
    fn a_grants_token_is_scoped_to_its_namespace_and_fails_closed_without_one() {
        let now = SystemTime::now();
        let t = generate_token().unwrap();
        let w = lookup([grant("laptop", &t, Some("shop"))].iter(), &t, now).unwrap();
        assert_eq!(w.scope.as_deref(), Some("shop"));
        for bad in [None, Some(""), Some("Shop"), Some("a/b"), Some("-x")] {
            assert_eq!(
                lookup([grant("laptop", &t, bad)].iter(), &t, now),
                Err(TokenError::GrantWithoutNamespace("laptop".into())),
                "{bad:?}"
            );
        }
        // Not a grant (no grant label, or the token itself stored): the annotation is
        // somebody's note, not a scope.
        let mut unlabelled = grant("laptop", &t, Some("shop"));
        unlabelled.labels_mut().remove(GRANT_KIND_LABEL);
        assert_eq!(lookup([unlabelled].iter(), &t, now).unwrap().scope, None);
        let mut plain = token_secret("ns", "laptop", &t, None).unwrap();
        plain
            .annotations_mut()
            .insert(GRANT_NAMESPACE_ANNOTATION.into(), "shop".into());
        plain
            .labels_mut()
            .insert(GRANT_KIND_LABEL.into(), GRANT_KIND_TUNNEL.into());
        assert_eq!(lookup([plain].iter(), &t, now).unwrap().scope, None);
    }

    #[test]
    fn a_revocation_covers_what_was_issued_before_it() {
        let now = SystemTime::now();
        let t = generate_token().unwrap();
        let alice = token_secret("ns", "alice", &t, None).unwrap();
        let revoked = revocation_secret("ns", "alice", now + Duration::from_secs(5)).unwrap();
        let secrets = [alice, revoked];
        let before = revoked_before(secrets.iter(), "alice").unwrap();
        // The token is still found (it is not a token lookup's business) but it is revoked.
        let w = lookup(secrets.iter(), &t, now).unwrap();
        assert!(w.issued_at.unwrap() < before);
        assert_eq!(revoked_before(secrets.iter(), "bob"), None);
        // A revocation is not a token, whatever its data.
        let mut fake = revocation_secret("ns", "mallory", now).unwrap();
        fake.data = Some(BTreeMap::from([(
            "token".into(),
            ByteString(t.clone().into_bytes()),
        )]));
        assert_eq!(lookup([fake].iter(), &t, now), Err(TokenError::Unknown));
        // An unreadable instant revokes everything.
        let mut broken = revocation_secret("ns", "alice", now).unwrap();
        broken.metadata.annotations = Some(BTreeMap::from([(
            REVOKED_BEFORE_ANNOTATION.into(),
            "yesterday".into(),
        )]));
        assert!(
            revoked_before([broken].iter(), "alice").unwrap() > now + Duration::from_secs(3600)
        );
    }
}
