//! Workstation tokens: one Secret per workstation in the tunnel proxy's namespace, labelled
//! `spur.dev/workstation=<name>` and `spur.dev/credential=token`, with the token in `data.token`
//! and an optional expiry in the annotation `spur.dev/expires-at` (RFC 3339). A reflector keeps
//! them in memory. A lookup compares against every token in constant time and never logs one.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use spur_api::keys::labels;
use spur_api::tunnel::WORKSTATION_LABEL;
use tokio_util::sync::CancellationToken;

use crate::Error;

/// Label marking a Secret as a workstation credential; the value is its kind (`token`).
pub const CREDENTIAL_LABEL: &str = "spur.dev/credential";
/// Annotation: when the token stops being accepted (RFC 3339).
pub const EXPIRES_ANNOTATION: &str = "spur.dev/expires-at";
/// Tokens shorter than this are refused when created: they could be guessed.
const MIN_TOKEN_LEN: usize = 32;

/// A workstation a token belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workstation {
    pub name: String,
    pub expires_at: Option<SystemTime>,
}

/// Why a token was not accepted. Never carries the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("unknown token")]
    Unknown,
    #[error("the token of workstation {0} has expired")]
    Expired(String),
}

/// The workstation tokens, kept current by a watch.
#[derive(Clone)]
pub struct TokenStore {
    store: Store<Secret>,
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
                watcher::Config::default().labels(&format!("{CREDENTIAL_LABEL}=token")),
            ),
        )
        .default_backoff()
        .touched_objects();
        tokio::spawn(async move {
            let mut s = std::pin::pin!(stream.take_until(stop.cancelled_owned()));
            while let Some(ev) = s.next().await {
                if let Err(e) = ev {
                    tracing::warn!(error = %e, "workstation token watch failed; retrying");
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(30), store.wait_until_ready())
            .await
            .map_err(|_| Error::Kube("timed out listing workstation tokens".into()))?
            .map_err(|e| Error::Kube(e.to_string()))?;
        Ok(TokenStore { store })
    }

    /// The workstation `token` belongs to, if it is known and not expired at `now`.
    pub fn lookup(&self, token: &str, now: SystemTime) -> Result<Workstation, TokenError> {
        lookup(self.store.state().iter().map(|s| &**s), token, now)
    }
}

/// Looks `token` up among `secrets`, comparing with every one in constant time.
pub fn lookup<'a>(
    secrets: impl Iterator<Item = &'a Secret>,
    token: &str,
    now: SystemTime,
) -> Result<Workstation, TokenError> {
    let mut found = None;
    for secret in secrets {
        let Some(stored) = secret
            .data
            .as_ref()
            .and_then(|d| d.get("token"))
            .map(|b| b.0.as_slice())
        else {
            continue;
        };
        let stored = trim_ascii(stored);
        if constant_time_eq(stored, token.as_bytes()) && !stored.is_empty() {
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
    Ok(Workstation { name, expires_at })
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

/// A fresh random token (256 bits, URL-safe hex).
pub fn generate_token() -> Result<String, Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| Error::Config(format!("no randomness: {e}")))?;
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
        return Err(Error::Config(format!(
            "a workstation token must be at least {MIN_TOKEN_LEN} characters"
        )));
    }
    let annotations = match expires_at {
        None => None,
        Some(at) => {
            let secs = at
                .duration_since(UNIX_EPOCH)
                .map_err(|_| Error::Config("expiry before 1970".into()))?
                .as_secs();
            let t = k8s_openapi::jiff::Timestamp::from_second(
                i64::try_from(secs).map_err(|e| Error::Config(e.to_string()))?,
            )
            .map_err(|e| Error::Config(e.to_string()))?;
            Some(BTreeMap::from([(
                EXPIRES_ANNOTATION.to_string(),
                t.to_string(),
            )]))
        }
    };
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
            annotations,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
        assert_eq!(
            lookup(secrets.iter(), &t1, now).unwrap(),
            Workstation {
                name: "alice".into(),
                expires_at: None
            }
        );
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
    }
}
