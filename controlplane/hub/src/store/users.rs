//! Hub users, their scopes, and which user each API key belongs to. A key's user is what every
//! request made with it (or with a session it logged in) may see; a key of no user (made before
//! users existed) is refused until an admin binds it (`spur-hub apikey bind`).

use std::collections::BTreeMap;

use super::sql::{Row, Sql};
use super::{API_KEY_PREFIX, SESSION_PREFIX, SessionScope, Store, check_name, now_ms, sha256};
use crate::Error;
use crate::users::{ANY_CLUSTER, ClusterScope, HubUser, MAX_GROUPS, Namespaces, check_kube_name};

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
        let now = now_ms();
        let n = self.read(|c| {
            c.exec(
                "INSERT INTO users (name, created_ms) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                &[name.into(), now.into()],
            )
        })?;
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
        self.write(|tx| {
            require_user(tx, user)?;
            tx.exec(
                "INSERT INTO user_scopes (user_name, cluster, namespaces, kube_user, kube_groups) \
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (user_name, cluster) DO UPDATE SET \
                 namespaces = excluded.namespaces, kube_user = excluded.kube_user, \
                 kube_groups = excluded.kube_groups",
                &[
                    user.into(),
                    (&change.cluster).into(),
                    (&namespaces).into(),
                    change.kube_user.as_deref().into(),
                    (&groups).into(),
                ],
            )
        })?;
        Ok(())
    }

    /// Takes away `user`'s scope in `cluster`. Returns whether it had one.
    pub fn unset_user_scope(&self, user: &str, cluster: &str) -> Result<bool, Error> {
        let n = self.write(|tx| {
            require_user(tx, user)?;
            tx.exec(
                "DELETE FROM user_scopes WHERE user_name = ?1 AND cluster = ?2",
                &[user.into(), cluster.into()],
            )
        })?;
        Ok(n > 0)
    }

    /// Removes `user`: its scopes go, and its API keys are revoked (ending their sessions).
    /// Returns how many keys were revoked.
    pub fn remove_user(&self, user: &str) -> Result<usize, Error> {
        let now = now_ms();
        let revoked = self.write(|tx| {
            require_user(tx, user)?;
            let revoked = tx.exec(
                "UPDATE api_keys SET revoked_ms = ?2 WHERE user_name = ?1 AND revoked_ms IS NULL",
                &[user.into(), now.into()],
            )?;
            tx.exec("DELETE FROM users WHERE name = ?1", &[user.into()])?;
            Ok(revoked)
        })?;
        Ok(usize::try_from(revoked).unwrap_or(usize::MAX))
    }

    /// Every user with its scopes, by name.
    pub fn users(&self) -> Result<Vec<HubUser>, Error> {
        // One transaction: a user removed between the list and its scopes is not half-read.
        self.snapshot(|tx| {
            let names = tx.rows("SELECT name FROM users ORDER BY name", &[])?;
            let mut users = Vec::with_capacity(names.len());
            for n in names {
                if let Some(u) = load_user(tx, &n.text(0)?)? {
                    users.push(u);
                }
            }
            Ok(users)
        })
    }

    /// User `name` with its scopes, if it exists.
    pub fn user(&self, name: &str) -> Result<Option<HubUser>, Error> {
        self.snapshot(|tx| load_user(tx, name))
    }

    /// Gives API key `key_name` (active) to `user`: what it may see is then the user's scope.
    pub fn bind_api_key(&self, key_name: &str, user: &str) -> Result<(), Error> {
        self.write(|tx| {
            require_user(tx, user)?;
            let n = tx.exec(
                "UPDATE api_keys SET user_name = ?2 WHERE name = ?1 AND revoked_ms IS NULL",
                &[key_name.into(), user.into()],
            )?;
            if n == 0 {
                return Err(Error::NotFound(format!(
                    "no active API key named {key_name:?}"
                )));
            }
            Ok(())
        })
    }

    /// Who API key `key` is: its name and user (None when it is no active key).
    pub fn principal_for_key(&self, key: &str) -> Result<Option<Principal>, Error> {
        if !key.starts_with(API_KEY_PREFIX) {
            return Ok(None);
        }
        let hash = sha256(key);
        self.snapshot(|tx| {
            let found = tx.row(
                "SELECT name, user_name FROM api_keys WHERE key_hash = ?1 AND revoked_ms IS NULL",
                &[(&hash).into()],
            )?;
            principal(tx, found)
        })
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
        let hash = sha256(token);
        let now = now_ms();
        self.snapshot(|tx| {
            let found = tx.row(
                "SELECT k.name, k.user_name FROM sessions s JOIN api_keys k ON k.name = s.key_name \
                 WHERE s.token_hash = ?1 AND s.scope = ?2 AND s.expires_ms > ?3 \
                 AND k.revoked_ms IS NULL",
                &[(&hash).into(), scope.as_str().into(), now.into()],
            )?;
            principal(tx, found)
        })
    }

    /// Active keys that belong to no user (made before users existed).
    pub fn unbound_api_keys(&self) -> Result<Vec<String>, Error> {
        let rows = self.read(|c| {
            c.rows(
                "SELECT name FROM api_keys WHERE revoked_ms IS NULL AND (user_name IS NULL \
                 OR user_name NOT IN (SELECT name FROM users)) ORDER BY name",
                &[],
            )
        })?;
        rows.iter().map(|r| r.text(0)).collect()
    }
}

fn principal(c: &mut dyn Sql, found: Option<Row>) -> Result<Option<Principal>, Error> {
    let Some(found) = found else {
        return Ok(None);
    };
    let user = match found.opt_text(1)? {
        Some(u) => load_user(c, &u)?,
        None => None,
    };
    Ok(Some(Principal {
        key: found.text(0)?,
        user,
    }))
}

pub(super) fn require_user(c: &mut dyn Sql, user: &str) -> Result<(), Error> {
    if c.exists("SELECT 1 FROM users WHERE name = ?1", &[user.into()])? {
        Ok(())
    } else {
        Err(Error::NotFound(format!(
            "no hub user named {user:?} (spur-hub user add {user})"
        )))
    }
}

fn load_user(c: &mut dyn Sql, name: &str) -> Result<Option<HubUser>, Error> {
    if !c.exists("SELECT 1 FROM users WHERE name = ?1", &[name.into()])? {
        return Ok(None);
    }
    let rows = c.rows(
        "SELECT cluster, namespaces, kube_user, kube_groups FROM user_scopes \
         WHERE user_name = ?1",
        &[name.into()],
    )?;
    let mut clusters = BTreeMap::new();
    for row in rows {
        let (cluster, namespaces, kube_user, groups) =
            (row.text(0)?, row.text(1)?, row.opt_text(2)?, row.text(3)?);
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
