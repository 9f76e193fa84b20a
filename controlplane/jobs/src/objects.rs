//! Where the store keeps sealed logs and artifacts: a directory on the component's volume (the
//! default) or a bucket of S3 or an S3-compatible server, for installations that outgrow a
//! volume or want the objects off the node. Running attempts' spools stay on the volume either
//! way (they are rebuilt from the executor when lost, see `driver`).
//!
//! Credentials are never configuration: the S3 client reads them from the process' `AWS_*`
//! environment (static keys from a Secret, a web identity token, the container or instance
//! role), so nothing here or in a log holds a secret. Plain HTTP to the endpoint is refused
//! unless asked for.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::ClientOptions;
use object_store::ObjectStore;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::prefix::PrefixStore;

use crate::Error;

/// The environment variables the S3 client reads: the credential chain (static keys, a web
/// identity token, the container's credentials endpoint) and the region; nothing that changes
/// where requests go or how they are checked (the proxy's `AWS_PROXY_*` are read apart).
const ENV_KEYS: [&str; 12] = [
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_ENDPOINT_URL_STS",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
];

/// The object backend.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Objects {
    /// `<store dir>/objects` on the component's volume.
    #[default]
    Local,
    /// A bucket.
    S3(S3),
}

/// An S3 (or S3-compatible) bucket.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct S3 {
    /// The bucket, which must exist (the component never creates or deletes buckets).
    pub bucket: String,
    /// Keys go under this prefix (no leading or trailing `/`; empty: the bucket's root), so
    /// that several installations can share a bucket.
    pub prefix: String,
    /// The server's URL (`https://host[:port]`); `None`: AWS S3 of the region.
    pub endpoint: Option<String>,
    /// The region; `None`: `AWS_REGION`/`AWS_DEFAULT_REGION`, else `us-east-1`.
    pub region: Option<String>,
    /// Allow an `http://` endpoint: requests and the credentials' signatures in plaintext.
    pub allow_http: bool,
    /// Address the bucket as `https://<bucket>.<endpoint>` rather than `https://<endpoint>/<bucket>`
    /// (AWS wants virtual-hosted style; most self-hosted servers path style).
    pub virtual_hosted: bool,
    /// A PEM file of CA certificates the endpoint's certificate is checked against, besides the
    /// system's (a private CA).
    pub ca_file: Option<PathBuf>,
    /// Static credentials, for tests and embedding; `None`: from the environment. Never printed.
    pub credentials: Option<Credentials>,
}

/// An access key; its `Debug` leaves the secret out.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .finish_non_exhaustive()
    }
}

impl Objects {
    pub fn validate(&self) -> Result<(), Error> {
        match self {
            Objects::Local => Ok(()),
            Objects::S3(s3) => s3.validate(),
        }
    }

    /// Where the objects are, for logs and errors (never a credential).
    pub fn describe(&self, dir: &Path) -> String {
        match self {
            Objects::Local => dir.join("objects").display().to_string(),
            Objects::S3(s3) => s3.describe(),
        }
    }

    /// The backend (the local directory under `dir` is created).
    pub(crate) fn open(&self, dir: &Path) -> Result<Arc<dyn ObjectStore>, Error> {
        match self {
            Objects::Local => {
                let objects = dir.join("objects");
                std::fs::create_dir_all(&objects)
                    .map_err(|e| Error::Store(format!("{}: {e}", objects.display())))?;
                let fs = LocalFileSystem::new_with_prefix(&objects)
                    .map_err(|e| Error::Store(e.to_string()))?;
                Ok(Arc::new(fs))
            }
            Objects::S3(s3) => s3.open(),
        }
    }
}

impl S3 {
    /// Bucket names as S3 allows them (3 to 63 of a-z, 0-9, `.` and `-`, starting and ending
    /// with a letter or digit); the prefix as relative key segments; an endpoint URL with a
    /// scheme, and plain HTTP only when allowed.
    pub fn validate(&self) -> Result<(), Error> {
        let b = &self.bucket;
        let edge =
            |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
        if !(3..=63).contains(&b.len())
            || !b
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-')
            || !edge(b.chars().next())
            || !edge(b.chars().last())
        {
            return Err(Error::Config(format!(
                "--s3-bucket {b:?}: a bucket name is 3 to 63 lowercase letters, digits, '.' and \
                 '-', beginning and ending with a letter or digit"
            )));
        }
        if !self.prefix.is_empty()
            && (self.prefix.starts_with('/')
                || self.prefix.ends_with('/')
                || self
                    .prefix
                    .split('/')
                    .any(|s| s.is_empty() || s == "." || s == ".." || s == "jobs"))
        {
            // No segment `jobs`: the store's keys begin with it, so an installation at prefix P
            // would take one at P/jobs/... for its own jobs (count them, collect them).
            return Err(Error::Config(format!(
                "--s3-prefix {:?}: segments separated by single '/', none empty, '.', '..' or \
                 'jobs', no leading or trailing '/'",
                self.prefix
            )));
        }
        if let Some(e) = &self.endpoint {
            if e.contains('@') {
                // Never echoed: it may hold a user and password.
                return Err(Error::Config(
                    "--s3-endpoint: a URL, https://host[:port], without credentials (they come \
                     from the environment)"
                        .into(),
                ));
            }
            let Some((scheme, rest)) = e.split_once("://") else {
                return Err(Error::Config(format!(
                    "--s3-endpoint {e:?}: a URL, https://host[:port]"
                )));
            };
            if rest.is_empty() || rest.contains(['?', '#', '/']) {
                return Err(Error::Config(format!(
                    "--s3-endpoint {e:?}: a URL, https://host[:port] (no path, query or fragment)"
                )));
            }
            match scheme {
                "https" => {}
                "http" if self.allow_http => {}
                "http" => {
                    return Err(Error::Config(format!(
                        "--s3-endpoint {e:?} is plain HTTP: requests and their signatures would \
                         cross the network unencrypted; use https, or pass --s3-allow-http"
                    )));
                }
                _ => {
                    return Err(Error::Config(format!(
                        "--s3-endpoint {e:?}: the scheme must be https (or http with \
                         --s3-allow-http)"
                    )));
                }
            }
        }
        if let Some(r) = &self.region
            && (r.is_empty()
                || !r
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        {
            return Err(Error::Config(format!(
                "--s3-region {r:?}: letters, digits, '-' and '_'"
            )));
        }
        Ok(())
    }

    /// `s3://bucket/prefix at endpoint`.
    pub fn describe(&self) -> String {
        let at = self.endpoint.as_deref().unwrap_or("AWS");
        if self.prefix.is_empty() {
            format!("s3://{} at {at}", self.bucket)
        } else {
            format!("s3://{}/{} at {at}", self.bucket, self.prefix)
        }
    }

    fn open(&self) -> Result<Arc<dyn ObjectStore>, Error> {
        self.validate()?;
        // Only the credential chain's and the region's variables are read from the environment
        // (object_store's `from_env` takes every `AWS_*` one, so a stray
        // AWS_ALLOW_INVALID_CERTIFICATES, AWS_SKIP_SIGNATURE or AWS_ENDPOINT_URL_S3 in a
        // credentials Secret would undo what was validated here).
        let mut b = AmazonS3Builder::new();
        for (key, value) in std::env::vars() {
            if ENV_KEYS.contains(&key.as_str())
                && let Ok(k) = key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>()
            {
                b = b.with_config(k, value);
            }
        }
        b = b
            .with_bucket_name(&self.bucket)
            .with_allow_http(self.allow_http)
            .with_virtual_hosted_style_request(self.virtual_hosted);
        if let Some(e) = &self.endpoint {
            // Virtual-hosted style takes the endpoint as the bucket's own host.
            let e = match e.split_once("://") {
                Some((scheme, host)) if self.virtual_hosted => {
                    format!("{scheme}://{}.{host}", self.bucket)
                }
                _ => e.clone(),
            };
            b = b.with_endpoint(e);
        }
        if let Some(r) = &self.region {
            b = b.with_region(r);
        }
        if let Some(c) = &self.credentials {
            b = b
                .with_access_key_id(&c.access_key_id)
                .with_secret_access_key(&c.secret_access_key);
        }
        // The client's options are all set here: the builder's own would be replaced whole.
        let mut options = ClientOptions::new().with_allow_http(self.allow_http);
        if let Ok(v) = std::env::var("AWS_PROXY_URL") {
            options = options.with_proxy_url(v);
        }
        if let Ok(v) = std::env::var("AWS_PROXY_CA_CERTIFICATE") {
            options = options.with_proxy_ca_certificate(v);
        }
        if let Ok(v) = std::env::var("AWS_PROXY_EXCLUDES") {
            options = options.with_proxy_excludes(v);
        }
        if let Some(path) = &self.ca_file {
            let pem = std::fs::read(path)
                .map_err(|e| Error::Config(format!("--s3-ca-file {}: {e}", path.display())))?;
            let certs = object_store::Certificate::from_pem_bundle(&pem)
                .map_err(|e| Error::Config(format!("--s3-ca-file {}: {e}", path.display())))?;
            if certs.is_empty() {
                return Err(Error::Config(format!(
                    "--s3-ca-file {}: no PEM certificate in it",
                    path.display()
                )));
            }
            for c in certs {
                options = options.with_root_certificate(c);
            }
        }
        b = b.with_client_options(options);
        let s3 = b
            .build()
            .map_err(|e| Error::Store(format!("{}: {e}", self.describe())))?;
        Ok(if self.prefix.is_empty() {
            Arc::new(s3)
        } else {
            Arc::new(PrefixStore::new(s3, self.prefix.as_str()))
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn s3(bucket: &str) -> S3 {
        S3 {
            bucket: bucket.into(),
            ..S3::default()
        }
    }

    #[test]
    fn bucket_names_follow_s3s_rules() {
        for ok in ["abc", "spur-jobs", "a.b-c1", &"a".repeat(63)] {
            s3(ok).validate().unwrap();
        }
        for bad in [
            "ab",
            "Spur",
            "-abc",
            "abc-",
            "a_b",
            "a/b",
            &"a".repeat(64),
            "",
        ] {
            assert!(s3(bad).validate().is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn plain_http_needs_its_opt_in_and_endpoints_are_urls() {
        let mut c = s3("logs");
        c.endpoint = Some("https://s3.example:9000".into());
        c.validate().unwrap();
        c.endpoint = Some("http://s3.example:9000".into());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--s3-allow-http"), "{e}");
        c.allow_http = true;
        c.validate().unwrap();
        for bad in [
            "s3.example",
            "ftp://s3.example",
            "https://",
            "https://key:secret@s3.example",
            "https://s3.example/path",
        ] {
            c.endpoint = Some(bad.into());
            let e = c.validate().expect_err(bad).to_string();
            assert!(!e.contains("secret"), "{e}");
        }
    }

    #[test]
    fn prefixes_are_relative_key_segments() {
        let mut c = s3("logs");
        for ok in ["", "cluster-a", "a/b"] {
            c.prefix = ok.into();
            c.validate().unwrap();
        }
        for bad in ["/a", "a/", "a//b", "a/../b", ".", "jobs", "a/jobs/b"] {
            c.prefix = bad.into();
            assert!(c.validate().is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn the_secret_is_never_printed() {
        let mut c = s3("logs");
        c.credentials = Some(Credentials {
            access_key_id: "AKID".into(),
            secret_access_key: "very-secret".into(),
        });
        let printed = format!("{:?} {}", Objects::S3(c.clone()), c.describe());
        assert!(printed.contains("AKID"), "{printed}");
        assert!(!printed.contains("very-secret"), "{printed}");
    }
}
