//! SOCKS5 and HTTP CONNECT inside the cluster (`--socks-addr`): SOCKS5 username = workstation,
//! password = its token. A tunnel grant's token authenticates only as `<workstation>@<grant
//! namespace>`: the forward proxy hands the dial nothing but the username it checked, so the
//! username carries the narrowing ([`crate::scope`]) and the password check makes sure it is
//! the grant's own. HTTP CONNECT carries no credentials here, so it is refused.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use spur_forward::{ConnRecord, DialError, Dialer, Target};
use tokio::net::TcpStream;

use super::{Audit, Direction, Kind, Metrics, audit};
use crate::destinations::{Destinations, dial_cluster};
use crate::scope::Owners;
use crate::tokens::TokenStore;

pub(super) struct ClusterDialer {
    pub(super) tokens: TokenStore,
    pub(super) resolve: Arc<std::collections::HashMap<String, SocketAddr>>,
    pub(super) destinations: Arc<Destinations>,
    pub(super) owners: Owners,
    pub(super) dial_timeout: Duration,
    pub(super) metrics: Metrics,
}

/// A SOCKS5 username: the workstation and, for a tunnel grant, the grant's namespace.
/// Workstation names are DNS labels, so `@` cannot be part of one.
fn split_user(user: &str) -> (&str, Option<&str>) {
    match user.split_once('@') {
        Some((workstation, scope)) => (workstation, Some(scope)),
        None => (user, None),
    }
}

impl Dialer for ClusterDialer {
    type Stream = TcpStream;

    async fn dial(
        &self,
        target: &Target,
        _client: SocketAddr,
        user: Option<&str>,
    ) -> Result<TcpStream, DialError> {
        // `requires_auth` makes every SOCKS5 client authenticate; HTTP CONNECT reaches the dial
        // without any, and an unauthenticated dial into the cluster is what the token is for.
        let Some(user) = user else {
            return Err(DialError::NotAllowed(format!(
                "{target}: HTTP CONNECT carries no credentials on the tunnel proxy; use SOCKS5 \
                 with the workstation as username and its token as password"
            )));
        };
        let scope = split_user(user).1.map(|ns| (&self.owners, ns));
        let connect = async {
            match target {
                Target::Addr(a) => {
                    dial_cluster(
                        &self.resolve,
                        &self.destinations,
                        scope,
                        &a.ip().to_string(),
                        a.port(),
                    )
                    .await
                }
                Target::Host(h, p) => {
                    dial_cluster(&self.resolve, &self.destinations, scope, h, *p).await
                }
            }
        };
        match tokio::time::timeout(self.dial_timeout, connect).await {
            Ok(Ok(s)) => {
                self.metrics
                    .total
                    .get_or_create(&Kind { kind: "socks" })
                    .inc();
                Ok(s)
            }
            Ok(Err(e)) => Err(DialError::from_io(target, &e)),
            Err(_) => Err(DialError::TimedOut(target.to_string())),
        }
    }

    fn requires_auth(&self) -> bool {
        true
    }

    /// The token must be the workstation's, not revoked, and name the same grant namespace as
    /// the username (none for a workstation token): a grant's token used as plain
    /// `<workstation>` would dial unnarrowed.
    fn check_password(&self, user: &str, password: &str) -> Option<bool> {
        let (workstation, scope) = split_user(user);
        Some(
            self.tokens
                .lookup(password, SystemTime::now())
                .is_ok_and(|w| {
                    w.name == workstation
                        && w.scope.as_deref() == scope
                        && !self.tokens.is_revoked(&w.name, w.issued_at)
                }),
        )
    }

    fn finished(&self, r: &ConnRecord) {
        self.metrics
            .bytes
            .get_or_create(&Direction {
                direction: "to_cluster",
            })
            .inc_by(r.bytes_up);
        self.metrics
            .bytes
            .get_or_create(&Direction {
                direction: "to_workstation",
            })
            .inc_by(r.bytes_down);
        audit(Audit {
            kind: r.protocol,
            who: r.user.as_deref().unwrap_or("-"),
            from: &r.client.to_string(),
            to: &r.target.as_ref().map_or("-".to_string(), Target::to_string),
            to_cluster: r.bytes_up,
            to_workstation: r.bytes_down,
            took: r.duration,
            outcome: &r.outcome,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::split_user;

    #[test]
    fn a_username_names_the_workstation_and_the_grant_namespace() {
        assert_eq!(split_user("alice"), ("alice", None));
        assert_eq!(split_user("alice@shop"), ("alice", Some("shop")));
        // Not a workstation name and not a grant: check_password's lookup finds no match.
        assert_eq!(split_user("@"), ("", Some("")));
    }
}
