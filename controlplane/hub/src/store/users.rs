//! Hub users, their scopes, and which user each API key belongs to. A key's user is what every
//! request made with it (or with a session it logged in) may see; a key of no user (made before
//! users existed) is refused until an admin binds it (`spur-hub apikey bind`).

use std::collections::BTreeMap;

use rusqlite::{OptionalExtension, params};

use super::{API_KEY_PREFIX, SESSION_PREFIX, SessionScope, Store, check_name, dbe, now_ms, sha256};
use crate::Error;
use crate::users::{ANY_CLUSTER, ClusterScope, HubUser, MAX_GROUPS, Namespaces, check_kube_name};

/// Users, their per-cluster scopes, and each key's user. Keys made before this version have no
/// user: they are refused (with a message naming `spur-hub apikey bind`) until an admin binds
/// them, rather than given a scope nobody chose. Sessions of such keys end with it.
pub(super) const USERS_V4: &str = "
CREATE TABLE users (
    name        TEXT PRIMARY KEY NOT NULL,
    created_ms  INTEGER NOT NULL
) STRICT;
CREATE TABLE user_scopes (
    user_name   TEXT NOT NULL REFERENCES users (name) ON DELETE CASCADE,
    -- A cluster's name, or '*' for every cluster not named on its own.
    cluster     TEXT NOT NULL,
    -- JSON: \"*\" (all) or an array of namespace names.
    namespaces  TEXT NOT NULL,
    -- NULL: the hub user's name.
    kube_user   TEXT,
    kube_groups TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (user_name, cluster)
) STRICT;
ALTER TABLE api_keys ADD COLUMN user_name TEXT;
DELETE FROM sessions;
DELETE FROM login_codes;
";

/// Who a presented credential is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// The API key (or the key behind the session).
    pub key: String,
    /// Its user; None for a key no user has been given yet.
    pub user: Option<HubUser>,
}

impl Principal {
    /// The refusal of a key that belongs to no user, saying what the admin runs.
    pub fn unbound_message(key: &str) -> String {
        format!(
            "API key {key:?} belongs to no hub user, so it may see nothing; an admin gives it \
             one with `spur-hub apikey bind {key} --user USER` (see `spur-hub user --help`)"
        )
    }
}

/// One cluster's scope, as given to [`Store::set_user_scope`].
#[derive(Clone, Debug)]
pub struct ScopeChange {
    pub cluster: String,
    pub namespaces: Namespaces,
    pub kube_user: Option<String>,
    pub kube_groups: Vec<String>,
}

impl Store {
    /// Adds hub user `name` (with no scope: it sees nothing until one is set).
    pub fn add_user(&self, name: &str) -> Result<(), Error> {
        check_name("user", name)?;
        let n = self
            .conn()
            .execute(
                "INSERT INTO users (name, created_ms) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                params![name, now_ms()],
            )
            .map_err(dbe)?;
        if n == 0 {
            return Err(Error::Conflict(format!("a hub user named {name:?} exists")));
        }
        Ok(())
    }

    /// Sets (adds or replaces) what `user` may see in one cluster.
    pub fn set_user_scope(&self, user: &str, change: &ScopeChange) -> Result<(), Error> {
        if change.cluster != ANY_CLUSTER {
            check_name("cluster", &change.cluster)?;
        }
        if let Some(u) = &change.kube_user {
            check_kube_name("user", u)?;
        }
        if change.kube_groups.len() > MAX_GROUPS {
            return Err(Error::Invalid(format!(
                "at most {MAX_GROUPS} Kubernetes groups per scope"
            )));
        }
        for g in &change.kube_groups {
            check_kube_name("group", g)?;
        }
        let namespaces =
            serde_json::to_string(&change.namespaces).map_err(|e| Error::Db(e.to_string()))?;
        let groups =
            serde_json::to_string(&change.kube_groups).map_err(|e| Error::Db(e.to_string()))?;
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(dbe)?;
        require_user(&tx, user)?;
        tx.execute(
            "INSERT INTO user_scopes (user_name, cluster, namespaces, kube_user, kube_groups) \
             VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (user_name, cluster) DO UPDATE SET \
             namespaces = excluded.namespaces, kube_user = excluded.kube_user, \
             kube_groups = excluded.kube_groups",
            params![user, change.cluster, namespaces, change.kube_user, groups],
        )
        .map_err(dbe)?;
        tx.commit().map_err(dbe)
    }

    /// Takes away `user`'s scope in `cluster`. Returns whether it had one.
    pub fn unset_user_scope(&self, user: &str, cluster: &str) -> Result<bool, Error> {
        let conn = self.conn();
        require_user(&conn, user)?;
        let n = conn
            .execute(
                "DELETE FROM user_scopes WHERE user_name = ?1 AND cluster = ?2",
                params![user, cluster],
            )
            .map_err(dbe)?;
        Ok(n > 0)
    }

    /// Removes `user`: its scopes go, and its API keys are revoked (ending their sessions).
    /// Returns how many keys were revoked.
    pub fn remove_user(&self, user: &str) -> Result<usize, Error> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(dbe)?;
        require_user(&tx, user)?;
        let revoked = tx
            .execute(
                "UPDATE api_keys SET revoked_ms = ?2 WHERE user_name = ?1 AND revoked_ms IS NULL",
                params![user, now_ms()],
            )
            .map_err(dbe)?;
        tx.execute("DELETE FROM users WHERE name = ?1", [user])
            .map_err(dbe)?;
        tx.commit().map_err(dbe)?;
        Ok(revoked)
    }

    /// Every user with its scopes, by name.
    pub fn users(&self) -> Result<Vec<HubUser>, Error> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT name FROM users ORDER BY name")
            .map_err(dbe)?;
        let names = stmt
            .query_map([], |r| r.get::<_, String>(0))
            .map_err(dbe)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(dbe)?;
        names
            .into_iter()
            .map(|n| load_user(&conn, &n))
            .collect::<Result<Option<Vec<_>>, _>>()
            .map(Option::unwrap_or_default)
    }

    /// User `name` with its scopes, if it exists.
    pub fn user(&self, name: &str) -> Result<Option<HubUser>, Error> {
        load_user(&self.conn(), name)
    }

    /// Gives API key `key_name` (active) to `user`: what it may see is then the user's scope.
    pub fn bind_api_key(&self, key_name: &str, user: &str) -> Result<(), Error> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(dbe)?;
        require_user(&tx, user)?;
        let n = tx
            .execute(
                "UPDATE api_keys SET user_name = ?2 WHERE name = ?1 AND revoked_ms IS NULL",
                params![key_name, user],
            )
            .map_err(dbe)?;
        if n == 0 {
            return Err(Error::NotFound(format!(
                "no active API key named {key_name:?}"
            )));
        }
        tx.commit().map_err(dbe)
    }

    /// Who API key `key` is: its name and user (None when it is no active key).
    pub fn principal_for_key(&self, key: &str) -> Result<Option<Principal>, Error> {
        if !key.starts_with(API_KEY_PREFIX) {
            return Ok(None);
        }
        let conn = self.conn();
        let found: Option<(String, Option<String>)> = conn
            .query_row(
                "SELECT name, user_name FROM api_keys WHERE key_hash = ?1 AND revoked_ms IS NULL",
                [sha256(key)],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(dbe)?;
        principal(&conn, found)
    }

    /// Who a live session token of `scope` is (not expired, key not revoked).
    pub fn principal_for_session(
        &self,
        token: &str,
        scope: SessionScope,
    ) -> Result<Option<Principal>, Error> {
        if !token.starts_with(SESSION_PREFIX) {
            return Ok(None);
        }
        let conn = self.conn();
        let found: Option<(String, Option<String>)> = conn
            .query_row(
                "SELECT k.name, k.user_name FROM sessions s JOIN api_keys k ON k.name = s.key_name \
                 WHERE s.token_hash = ?1 AND s.scope = ?2 AND s.expires_ms > ?3 \
                 AND k.revoked_ms IS NULL",
                params![sha256(token), scope.as_str(), now_ms()],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(dbe)?;
        principal(&conn, found)
    }

    /// Active keys that belong to no user (made before users existed).
    pub fn unbound_api_keys(&self) -> Result<Vec<String>, Error> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT name FROM api_keys WHERE revoked_ms IS NULL AND (user_name IS NULL \
                 OR user_name NOT IN (SELECT name FROM users)) ORDER BY name",
            )
            .map_err(dbe)?;
        let rows = stmt.query_map([], |r| r.get(0)).map_err(dbe)?;
        rows.collect::<Result<_, _>>().map_err(dbe)
    }
}

fn principal(
    conn: &rusqlite::Connection,
    found: Option<(String, Option<String>)>,
) -> Result<Option<Principal>, Error> {
    let Some((key, user)) = found else {
        return Ok(None);
    };
    let user = match user {
        Some(u) => load_user(conn, &u)?,
        None => None,
    };
    Ok(Some(Principal { key, user }))
}

pub(super) fn require_user(conn: &rusqlite::Connection, user: &str) -> Result<(), Error> {
    let found = conn
        .query_row("SELECT 1 FROM users WHERE name = ?1", [user], |_| Ok(()))
        .optional()
        .map_err(dbe)?;
    match found {
        Some(()) => Ok(()),
        None => Err(Error::NotFound(format!(
            "no hub user named {user:?} (spur-hub user add {user})"
        ))),
    }
}

fn load_user(conn: &rusqlite::Connection, name: &str) -> Result<Option<HubUser>, Error> {
    let exists = conn
        .query_row("SELECT 1 FROM users WHERE name = ?1", [name], |_| Ok(()))
        .optional()
        .map_err(dbe)?;
    if exists.is_none() {
        return Ok(None);
    }
    let mut stmt = conn
        .prepare(
            "SELECT cluster, namespaces, kube_user, kube_groups FROM user_scopes \
             WHERE user_name = ?1",
        )
        .map_err(dbe)?;
    let rows = stmt
        .query_map([name], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<String>>(2)?,
                r.get::<_, String>(3)?,
            ))
        })
        .map_err(dbe)?;
    let mut clusters = BTreeMap::new();
    for row in rows {
        let (cluster, namespaces, kube_user, groups) = row.map_err(dbe)?;
        let bad = |e: serde_json::Error| {
            Error::Db(format!(
                "user {name:?}, cluster {cluster:?}: a malformed scope: {e}"
            ))
        };
        clusters.insert(
            cluster.clone(),
            ClusterScope {
                namespaces: serde_json::from_str(&namespaces).map_err(bad)?,
                kube_user,
                kube_groups: serde_json::from_str(&groups).map_err(bad)?,
            },
        );
    }
    Ok(Some(HubUser {
        name: name.to_owned(),
        clusters,
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use super::*;

    fn scope(cluster: &str, namespaces: &[&str]) -> ScopeChange {
        ScopeChange {
            cluster: cluster.into(),
            namespaces: Namespaces::parse(
                &namespaces.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            )
            .unwrap(),
            kube_user: None,
            kube_groups: vec![],
        }
    }

    #[test]
    fn keys_and_sessions_carry_their_users_scope() {
        let s = Store::in_memory().unwrap();
        assert!(matches!(
            s.add_api_key("k", "alice"),
            Err(Error::NotFound(_))
        ));
        s.add_user("alice").unwrap();
        assert!(matches!(s.add_user("alice"), Err(Error::Conflict(_))));
        s.set_user_scope("alice", &scope("east", &["a"])).unwrap();
        let key = s.add_api_key("k", "alice").unwrap();
        let p = s.principal_for_key(&key).unwrap().unwrap();
        let user = p.user.unwrap();
        assert!(user.sees("east", &["a".to_string()].into()));
        assert!(!user.sees("east", &["b".to_string()].into()));
        assert!(!user.sees("west", &["a".to_string()].into()));
        // A changed scope is what the next lookup sees.
        s.set_user_scope("alice", &scope("east", &["b"])).unwrap();
        let session = s
            .create_session("k", Duration::from_secs(60), SessionScope::Web)
            .unwrap();
        let user = s
            .principal_for_session(&session, SessionScope::Web)
            .unwrap()
            .unwrap()
            .user
            .unwrap();
        assert!(user.sees("east", &["b".to_string()].into()));
        assert!(s.unset_user_scope("alice", "east").unwrap());
        assert!(!s.unset_user_scope("alice", "east").unwrap());
        // Removing the user revokes its keys, and their sessions end.
        assert_eq!(s.remove_user("alice").unwrap(), 1);
        assert_eq!(s.principal_for_key(&key).unwrap(), None);
        assert_eq!(
            s.principal_for_session(&session, SessionScope::Web)
                .unwrap(),
            None
        );
        assert!(matches!(s.remove_user("alice"), Err(Error::NotFound(_))));
    }

    #[test]
    fn scopes_are_checked() {
        let s = Store::in_memory().unwrap();
        s.add_user("bob").unwrap();
        let mut bad = scope("East", &["a"]);
        assert!(s.set_user_scope("bob", &bad).is_err());
        bad.cluster = "east".into();
        bad.kube_user = Some(String::new());
        assert!(s.set_user_scope("bob", &bad).is_err());
        bad.kube_user = None;
        bad.kube_groups = vec!["x".into(); MAX_GROUPS + 1];
        assert!(s.set_user_scope("bob", &bad).is_err());
        assert!(matches!(
            s.set_user_scope("nobody", &scope("east", &["a"])),
            Err(Error::NotFound(_))
        ));
        s.set_user_scope("bob", &scope("*", &["*"])).unwrap();
        let bob = s.user("bob").unwrap().unwrap();
        assert!(bob.sees("anywhere", &Default::default()));
        assert_eq!(s.users().unwrap().len(), 1);
    }
}
