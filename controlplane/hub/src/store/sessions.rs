//! Browser sessions and one-time login codes. A session belongs to one cookie (the web view's or
//! the previews'), so a preview's session never opens the web view. A login code lives in a table
//! of its own: it is never a session, so it cannot be presented as a cookie, and it is consumed
//! by one `DELETE … RETURNING`, so two browsers racing with one code get one session between them.

use std::time::Duration;

use super::sql::Sql;
use super::{LOGIN_CODE_PREFIX, SESSION_PREFIX, Store, new_secret, now_ms, sha256};
use crate::Error;

/// Which cookie a session is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SessionScope {
    /// The web view's host-only cookie.
    Web,
    /// The cookie shared by every preview host (the preview domain).
    Preview,
}

impl SessionScope {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            SessionScope::Web => "web",
            SessionScope::Preview => "preview",
        }
    }
}

impl Store {
    /// Starts a session for API key `key_name`, valid for `ttl`; returns its token.
    pub fn create_session(
        &self,
        key_name: &str,
        ttl: Duration,
        scope: SessionScope,
    ) -> Result<String, Error> {
        let token = new_secret(SESSION_PREFIX)?;
        self.forget_expired_sessions()?;
        self.write(|tx| insert_session(tx, &token, key_name, ttl, scope))?;
        Ok(token)
    }

    /// The API key name behind a live session token of `scope` (not expired, key not revoked).
    pub fn session_key(&self, token: &str, scope: SessionScope) -> Result<Option<String>, Error> {
        if !token.starts_with(SESSION_PREFIX) {
            return Ok(None);
        }
        let hash = sha256(token);
        let now = now_ms();
        self.read(|c| {
            c.row(
                "SELECT s.key_name FROM sessions s JOIN api_keys k ON k.name = s.key_name \
                 WHERE s.token_hash = ?1 AND s.scope = ?2 AND s.expires_ms > ?3 \
                 AND k.revoked_ms IS NULL",
                &[(&hash).into(), scope.as_str().into(), now.into()],
            )
        })?
        .map(|r| r.text(0))
        .transpose()
    }

    /// Ends a session (logout). Returns whether it existed.
    pub fn end_session(&self, token: &str) -> Result<bool, Error> {
        let hash = sha256(token);
        let n = self.read(|c| {
            c.exec(
                "DELETE FROM sessions WHERE token_hash = ?1",
                &[(&hash).into()],
            )
        })?;
        Ok(n > 0)
    }

    /// Makes a one-time login code for API key `key_name`, valid for `ttl` (`spur hub
    /// login-link`); only its hash is kept.
    pub fn create_login_code(&self, key_name: &str, ttl: Duration) -> Result<String, Error> {
        let code = new_secret(LOGIN_CODE_PREFIX)?;
        let hash = sha256(&code);
        let now = now_ms();
        let ttl = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        // Expired codes go whenever a new one is made (the table stays small), on their own:
        // inside the insert's transaction the sweep of the whole table would make concurrent
        // writers on other replicas conflict.
        self.read(|c| {
            c.exec(
                "DELETE FROM login_codes WHERE expires_ms <= ?1",
                &[now.into()],
            )
        })?;
        self.write(|tx| {
            require_active_key(tx, key_name)?;
            tx.exec(
                "INSERT INTO login_codes (code_hash, key_name, created_ms, expires_ms) \
                 VALUES (?1, ?2, ?3, ?4)",
                &[
                    (&hash).into(),
                    key_name.into(),
                    now.into(),
                    now.saturating_add(ttl).into(),
                ],
            )
        })?;
        Ok(code)
    }

    /// The API key a live login code logs in as, without consuming it (for the page that asks
    /// the user to confirm).
    pub fn login_code_key(&self, code: &str) -> Result<Option<String>, Error> {
        if !code.starts_with(LOGIN_CODE_PREFIX) {
            return Ok(None);
        }
        let hash = sha256(code);
        let now = now_ms();
        self.read(|c| {
            c.row(
                "SELECT c.key_name FROM login_codes c JOIN api_keys k ON k.name = c.key_name \
                 WHERE c.code_hash = ?1 AND c.expires_ms > ?2 AND k.revoked_ms IS NULL",
                &[(&hash).into(), now.into()],
            )
        })?
        .map(|r| r.text(0))
        .transpose()
    }

    /// Consumes login code `code` and starts a web view session for its key, in one
    /// transaction: the code is gone whatever the outcome, and of several callers presenting it
    /// at once exactly one gets a session. None when the code is unknown, used, expired, or
    /// its key was revoked.
    pub fn redeem_login_code(&self, code: &str, ttl: Duration) -> Result<Option<String>, Error> {
        if !code.starts_with(LOGIN_CODE_PREFIX) {
            return Ok(None);
        }
        let hash = sha256(code);
        let token = new_secret(super::SESSION_PREFIX)?;
        self.forget_expired_sessions()?;
        self.write(|tx| {
            let found = tx.row(
                "DELETE FROM login_codes WHERE code_hash = ?1 RETURNING key_name, expires_ms",
                &[(&hash).into()],
            )?;
            let Some(found) = found else {
                return Ok(None);
            };
            let (name, expires) = (found.text(0)?, found.int(1)?);
            if expires <= now_ms() {
                return Ok(None);
            }
            match insert_session(tx, &token, &name, ttl, SessionScope::Web) {
                Ok(()) => Ok(Some(token.clone())),
                Err(Error::NotFound(_)) => Ok(None),
                Err(e) => Err(e),
            }
        })
    }
}

impl Store {
    /// Expired sessions go whenever a new one starts (the table stays small), in a statement of
    /// their own: inside the insert's transaction the sweep of the whole table would make
    /// concurrent logins on other replicas conflict.
    fn forget_expired_sessions(&self) -> Result<(), Error> {
        let now = now_ms();
        self.read(|c| c.exec("DELETE FROM sessions WHERE expires_ms < ?1", &[now.into()]))?;
        Ok(())
    }
}

fn require_active_key(c: &mut dyn Sql, key_name: &str) -> Result<(), Error> {
    if c.exists(
        "SELECT 1 FROM api_keys WHERE name = ?1 AND revoked_ms IS NULL",
        &[key_name.into()],
    )? {
        Ok(())
    } else {
        Err(Error::NotFound(format!(
            "no active API key named {key_name:?}"
        )))
    }
}

fn insert_session(
    c: &mut dyn Sql,
    token: &str,
    key_name: &str,
    ttl: Duration,
    scope: SessionScope,
) -> Result<(), Error> {
    let now = now_ms();
    let ttl = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
    require_active_key(c, key_name)?;
    c.exec(
        "INSERT INTO sessions (token_hash, key_name, created_ms, expires_ms, scope) \
         VALUES (?1, ?2, ?3, ?4, ?5)",
        &[
            (&sha256(token)).into(),
            key_name.into(),
            now.into(),
            now.saturating_add(ttl).into(),
            scope.as_str().into(),
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn sessions_expire_end_and_die_with_their_key() {
        let s = Store::in_memory().unwrap();
        s.add_user("dev").unwrap();
        s.add_api_key("dev", "dev").unwrap();
        assert!(matches!(
            s.create_session("nobody", MINUTE, SessionScope::Web),
            Err(Error::NotFound(_))
        ));
        let t = s.create_session("dev", MINUTE, SessionScope::Web).unwrap();
        assert_eq!(
            s.session_key(&t, SessionScope::Web).unwrap().as_deref(),
            Some("dev")
        );
        let short = s
            .create_session("dev", Duration::ZERO, SessionScope::Web)
            .unwrap();
        assert_eq!(
            s.session_key(&short, SessionScope::Web).unwrap(),
            None,
            "an expired session works"
        );
        let other = s.create_session("dev", MINUTE, SessionScope::Web).unwrap();
        assert!(s.end_session(&other).unwrap());
        assert_eq!(s.session_key(&other, SessionScope::Web).unwrap(), None);
        s.revoke_api_key("dev").unwrap();
        assert_eq!(
            s.session_key(&t, SessionScope::Web).unwrap(),
            None,
            "a revoked key's session works"
        );
    }

    #[test]
    fn a_preview_session_does_not_open_the_web_view() {
        let s = Store::in_memory().unwrap();
        s.add_user("dev").unwrap();
        s.add_api_key("dev", "dev").unwrap();
        let p = s
            .create_session("dev", MINUTE, SessionScope::Preview)
            .unwrap();
        assert_eq!(
            s.session_key(&p, SessionScope::Preview).unwrap().as_deref(),
            Some("dev")
        );
        assert_eq!(s.session_key(&p, SessionScope::Web).unwrap(), None);
    }

    /// Issue 42, point 2: a login code was a session row, so it worked as a cookie, and it was
    /// looked up and deleted in two steps.
    #[test]
    fn a_login_code_is_not_a_session_and_works_once() {
        let s = Store::in_memory().unwrap();
        s.add_user("dev").unwrap();
        s.add_api_key("dev", "dev").unwrap();
        let code = s.create_login_code("dev", MINUTE).unwrap();
        assert!(code.starts_with(LOGIN_CODE_PREFIX), "{code}");
        for scope in [SessionScope::Web, SessionScope::Preview] {
            assert_eq!(
                s.session_key(&code, scope).unwrap(),
                None,
                "a login code works as a cookie"
            );
        }
        assert_eq!(s.login_code_key(&code).unwrap().as_deref(), Some("dev"));
        let session = s.redeem_login_code(&code, MINUTE).unwrap().unwrap();
        assert_eq!(s.login_code_key(&code).unwrap(), None);
        assert_eq!(
            s.session_key(&session, SessionScope::Web)
                .unwrap()
                .as_deref(),
            Some("dev")
        );
        assert_eq!(s.redeem_login_code(&code, MINUTE).unwrap(), None);
        // A session token is not a login code.
        assert_eq!(s.redeem_login_code(&session, MINUTE).unwrap(), None);
        let expired = s.create_login_code("dev", Duration::ZERO).unwrap();
        assert_eq!(s.redeem_login_code(&expired, MINUTE).unwrap(), None);
        let revoked = s.create_login_code("dev", MINUTE).unwrap();
        s.revoke_api_key("dev").unwrap();
        assert_eq!(s.redeem_login_code(&revoked, MINUTE).unwrap(), None);
        assert!(matches!(
            s.create_login_code("dev", MINUTE),
            Err(Error::NotFound(_))
        ));
    }

    /// Two processes (two connections to one file) redeem one code at the same moment: one
    /// session between them.
    #[test]
    fn a_login_code_raced_by_two_writers_gives_one_session() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub.db");
        let first = Store::open(&path).unwrap();
        first.add_user("dev").unwrap();
        first.add_api_key("dev", "dev").unwrap();
        for _ in 0..20 {
            let code = first.create_login_code("dev", MINUTE).unwrap();
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
            let racers: Vec<_> = (0..4)
                .map(|_| {
                    let store = Store::open(&path).unwrap();
                    let (code, barrier) = (code.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        store.redeem_login_code(&code, MINUTE).unwrap()
                    })
                })
                .collect();
            let won = racers.into_iter().filter_map(|r| r.join().unwrap()).count();
            assert_eq!(won, 1, "one code gave {won} sessions");
        }
    }
}
