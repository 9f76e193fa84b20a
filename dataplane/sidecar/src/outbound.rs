//! The outbound direction, for job runner pods (`--inject-key-file`): every HTTP/1, h2 and gRPC
//! request the pod's processes send (redirected here by the interception rules) gets the routing
//! key in the file added, in the redundant header set of
//! [`spur_routing::inject::inject_key`], and goes on to its original destination; the
//! destination's own sidecar routes it, and the app there finds it in whichever carrier it
//! propagates, the configured custom headers (`--routing-header`) included. An empty or missing
//! file adds nothing.
//!
//! The job executor writes the file before it starts a job that asked for injection and empties
//! it when the job ends. The file is checked (its size and modification time, one `stat`) on
//! every request, so the first request of a job already carries the job's key.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::SystemTime;

use spur_proxy::{ConnMeta, Route, Router};
use spur_routing::inject::inject_key;

/// Adds the key in a file to every request; see the module docs.
pub struct InjectRouter {
    path: PathBuf,
    /// Custom headers written besides the standard carriers.
    custom: Vec<http::HeaderName>,
    cached: Mutex<Cached>,
}

#[derive(Default)]
struct Cached {
    stamp: Option<(u64, Option<SystemTime>)>,
    key: Option<String>,
}

impl InjectRouter {
    pub fn new(path: PathBuf, custom: Vec<http::HeaderName>) -> Self {
        InjectRouter {
            path,
            custom,
            cached: Mutex::new(Cached::default()),
        }
    }

    /// The key now in the file (trimmed; `None` when empty, missing or not a valid key).
    pub fn current_key(&self) -> Option<String> {
        let meta = std::fs::metadata(&self.path).ok();
        let stamp = meta.as_ref().map(|m| (m.len(), m.modified().ok()));
        let mut c = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if c.stamp != stamp || stamp.is_none() {
            c.key = std::fs::read_to_string(&self.path)
                .ok()
                .map(|s| s.trim().to_owned())
                .filter(|k| spur_routing::extract::is_valid_key(k));
            c.stamp = stamp;
        }
        c.key.clone()
    }
}

impl Router for InjectRouter {
    fn route_http(&self, _conn: &ConnMeta, req: &mut http::request::Parts) -> Route {
        if let Some(key) = self.current_key() {
            inject_key(&mut req.headers, &key, &self.custom);
        }
        Route::Original
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_key_follows_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        let r = InjectRouter::new(path.clone(), Vec::new());
        assert_eq!(r.current_key(), None, "no file: nothing added");
        std::fs::write(&path, "k1\n").unwrap();
        assert_eq!(r.current_key().as_deref(), Some("k1"));
        std::fs::write(&path, "").unwrap();
        assert_eq!(r.current_key(), None);
        std::fs::write(&path, "key-two").unwrap();
        assert_eq!(r.current_key().as_deref(), Some("key-two"));
        std::fs::write(&path, "bad key!").unwrap();
        assert_eq!(r.current_key(), None, "an invalid key is never sent");
    }

    #[test]
    fn the_key_goes_out_in_the_custom_headers_too() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "k1").unwrap();
        let custom = vec![http::HeaderName::from_static("x-tenant-route")];
        let r = InjectRouter::new(path, custom);
        let meta = ConnMeta::new(
            "10.0.0.1:5555".parse().unwrap(),
            "127.0.0.1:15001".parse().unwrap(),
            "10.0.0.9:8080".parse().unwrap(),
            spur_proxy::Protocol::Http1,
        );
        let (mut parts, ()) = http::Request::get("http://api/")
            .body(())
            .unwrap()
            .into_parts();
        assert!(matches!(r.route_http(&meta, &mut parts), Route::Original));
        assert_eq!(parts.headers["x-tenant-route"], "k1");
        assert_eq!(parts.headers["baggage"], "sd-routing-key=k1,sd-sandbox=k1");
    }
}
