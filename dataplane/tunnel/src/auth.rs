//! Server-side authentication of tunnel sessions: a trait the tunnel proxy implements (tokens,
//! TLS client certificates, or both) and a static implementation for simple deployments and tests.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use rustls::pki_types::CertificateDer;

use crate::Transport;
use crate::error::RefusalCode;
use crate::wire::Token;

/// Who is on the other end of a session, as decided by the [`Authenticator`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Stable name for logs, audit and authorization (user, service account, cert subject).
    pub name: String,
    /// How the identity was established.
    pub method: AuthMethod,
    /// When the credentials stop being valid. The server ends the session then (goaway, drain);
    /// the client's reconnect is then refused with `expired` unless it has new credentials.
    pub expires_at: Option<SystemTime>,
    /// When the credentials were issued (a certificate's `notBefore`, a token's creation), for
    /// revocations of everything issued before a point in time. None: unknown.
    pub issued_at: Option<SystemTime>,
    /// What the authenticator narrowed the session to, if anything. Opaque to the tunnel: the
    /// server that authenticated the session interprets it (the tunnel proxy: the namespace of
    /// a tunnel grant, the only one its streams may reach).
    pub scope: Option<String>,
}

impl Identity {
    pub fn new(name: impl Into<String>, method: AuthMethod) -> Self {
        Identity {
            name: name.into(),
            method,
            expires_at: None,
            issued_at: None,
            scope: None,
        }
    }

    pub fn expiring_at(mut self, at: SystemTime) -> Self {
        self.expires_at = Some(at);
        self
    }

    pub fn issued(mut self, at: SystemTime) -> Self {
        self.issued_at = Some(at);
        self
    }

    pub fn scoped(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthMethod {
    Token,
    ClientCert,
    /// The authenticator accepted the client without credentials.
    Anonymous,
}

/// Why authentication failed. Sent to the client as a `refused` message (code and reason, never
/// the credentials) and returned to the server's caller for logging and audit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    #[error("credentials expired: {0}")]
    Expired(String),
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// The decision cannot be made now (e.g. the token reviewer is down); the client retries.
    #[error("authentication unavailable: {0}")]
    Unavailable(String),
}

impl AuthError {
    pub fn code(&self) -> RefusalCode {
        match self {
            AuthError::Unauthenticated(_) => RefusalCode::Unauthenticated,
            AuthError::Expired(_) => RefusalCode::Expired,
            AuthError::Forbidden(_) => RefusalCode::Forbidden,
            AuthError::Unavailable(_) => RefusalCode::Unavailable,
        }
    }

    /// Whether the client should keep trying with the same credentials.
    pub fn retry(&self) -> bool {
        matches!(self, AuthError::Unavailable(_))
    }

    pub fn reason(&self) -> &str {
        match self {
            AuthError::Unauthenticated(r)
            | AuthError::Expired(r)
            | AuthError::Forbidden(r)
            | AuthError::Unavailable(r) => r,
        }
    }
}

/// What the server knows about a client when it decides.
#[derive(Clone, Copy)]
pub struct AuthRequest<'a> {
    /// The bearer token from the client's `hello`, if any.
    pub token: Option<&'a Token>,
    /// The end-entity certificate the client presented, already verified by rustls against
    /// the server's client CA (only when [`ServerTls::client_ca`](crate::ServerTls) is set).
    pub client_cert: Option<&'a CertificateDer<'static>>,
    pub peer: SocketAddr,
    /// The name the client gave itself (informational; never trust it for authorization).
    pub client_name: &'a str,
    pub transport: Transport,
}

impl fmt::Debug for AuthRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthRequest")
            .field("token", &self.token.map(|_| "<redacted>"))
            .field("client_cert", &self.client_cert.is_some())
            .field("peer", &self.peer)
            .field("client_name", &self.client_name)
            .field("transport", &self.transport)
            .finish()
    }
}

pub type AuthFuture<'a> = Pin<Box<dyn Future<Output = Result<Identity, AuthError>> + Send + 'a>>;

/// Decides who a client is. Async because real deployments ask someone else (a Kubernetes
/// TokenReview, an OIDC issuer); the handshake timeout bounds the wait.
pub trait Authenticator: Send + Sync + 'static {
    fn authenticate<'a>(&'a self, req: AuthRequest<'a>) -> AuthFuture<'a>;

    /// Called when a client's TLS handshake fails, before any credentials were read (a
    /// certificate the client CA does not vouch for, an expired one, a client that does not
    /// trust the server): for audit. A TCP connection closed before any TLS message (a load
    /// balancer's health check) is not reported. Default: nothing.
    fn handshake_failed(&self, peer: SocketAddr, transport: Transport, error: &str) {
        let _ = (peer, transport, error);
    }

    /// Whether `identity` may register reverse listener `bind` with `meta`. Default: yes.
    fn authorize_bind(&self, identity: &Identity, bind: &str, meta: &str) -> Result<(), AuthError> {
        let _ = (identity, bind, meta);
        Ok(())
    }
}

/// A fixed set of tokens, and optionally identities taken from verified client certificates.
/// A verified client certificate wins over a token.
#[derive(Default)]
pub struct StaticAuthenticator {
    tokens: Vec<(Token, Identity)>,
    client_certs: bool,
    anonymous: bool,
}

impl StaticAuthenticator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Accepts `token` as `identity` (whose `expires_at` is enforced).
    pub fn with_token(mut self, token: Token, identity: Identity) -> Self {
        self.tokens.push((token, identity));
        self
    }

    /// Accepts clients with a certificate verified against the server's client CA; the identity
    /// comes from the certificate ([`identity_from_cert`]).
    pub fn with_client_certs(mut self) -> Self {
        self.client_certs = true;
        self
    }

    /// Accepts clients without credentials as `anonymous` (development only).
    pub fn allow_anonymous(mut self) -> Self {
        self.anonymous = true;
        self
    }

    fn decide(&self, req: AuthRequest<'_>) -> Result<Identity, AuthError> {
        if self.client_certs
            && let Some(cert) = req.client_cert
        {
            let identity = identity_from_cert(cert)?;
            check_expiry(&identity)?;
            return Ok(identity);
        }
        if let Some(token) = req.token {
            // Compare against every configured token in constant time, so the time taken
            // does not tell how much of a guess was right.
            let mut found = None;
            for (t, identity) in &self.tokens {
                if constant_time_eq(t.expose().as_bytes(), token.expose().as_bytes()) {
                    found = Some(identity);
                }
            }
            return match found {
                Some(identity) => {
                    check_expiry(identity)?;
                    Ok(identity.clone())
                }
                None => Err(AuthError::Unauthenticated("unknown token".into())),
            };
        }
        if self.anonymous {
            return Ok(Identity::new("anonymous", AuthMethod::Anonymous));
        }
        Err(AuthError::Unauthenticated(
            "no token and no client certificate".into(),
        ))
    }
}

impl Authenticator for StaticAuthenticator {
    fn authenticate<'a>(&'a self, req: AuthRequest<'a>) -> AuthFuture<'a> {
        let result = self.decide(req);
        Box::pin(async move { result })
    }
}

fn check_expiry(identity: &Identity) -> Result<(), AuthError> {
    match identity.expires_at {
        Some(at) if at <= SystemTime::now() => Err(AuthError::Expired(format!(
            "{} expired {}s ago",
            identity.name,
            SystemTime::now()
                .duration_since(at)
                .unwrap_or(Duration::ZERO)
                .as_secs()
        ))),
        _ => Ok(()),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The identity in a (verified) client certificate: the first URI SAN (e.g. a SPIFFE id), else
/// the first DNS SAN, else the subject's common name. `expires_at` is the certificate's
/// `notAfter`, so a session never outlives its certificate.
pub fn identity_from_cert(cert: &CertificateDer<'_>) -> Result<Identity, AuthError> {
    use x509_parser::extensions::GeneralName;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| AuthError::Unauthenticated(format!("unreadable client certificate: {e}")))?;
    let mut uri = None;
    let mut dns = None;
    if let Ok(Some(san)) = parsed.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::URI(u) if uri.is_none() => uri = Some(u.to_string()),
                GeneralName::DNSName(d) if dns.is_none() => dns = Some(d.to_string()),
                _ => {}
            }
        }
    }
    let cn = parsed
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_owned);
    let name = uri
        .or(dns)
        .or(cn)
        .ok_or_else(|| AuthError::Unauthenticated("client certificate names nobody".into()))?;
    let at = |t: i64| {
        u64::try_from(t)
            .ok()
            .map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s))
    };
    Ok(Identity {
        name,
        method: AuthMethod::ClientCert,
        expires_at: at(parsed.validity().not_after.timestamp()),
        issued_at: at(parsed.validity().not_before.timestamp()),
        scope: None,
    })
}
