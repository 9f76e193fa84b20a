//! The syntax rules shared by the schemas and the Rust checks. Each `*_PATTERN` is the OpenAPI
//! `pattern` (RE2 syntax, evaluated by the apiserver) for the predicate next to it, so the two
//! cannot drift apart silently: `tests/cel.rs` runs both on the same inputs.

use crate::error::{Error, FieldError, FieldErrors};

/// DNS-1123 label: namespaces, container names, list-item names.
pub const DNS_LABEL_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
pub const DNS_LABEL_MAX: usize = 63;

/// DNS-1123 subdomain: names of Deployments, Rollouts and most other objects.
pub const DNS_SUBDOMAIN_PATTERN: &str =
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
pub const DNS_SUBDOMAIN_MAX: usize = 253;

/// Routing keys as stored in Spur's resources: the data plane's key alphabet
/// (`spur_routing::extract`), but at most 63 characters and starting and ending with a letter or
/// digit, so that every key is also a valid label value.
pub const ROUTING_KEY_PATTERN: &str = "^[A-Za-z0-9]([-A-Za-z0-9._]{0,61}[A-Za-z0-9])?$";
pub const ROUTING_KEY_MAX: usize = 63;

/// Environment variable names as Kubernetes has always accepted them.
pub const ENV_NAME_PATTERN: &str = "^[-._a-zA-Z][-._a-zA-Z0-9]*$";
pub const ENV_NAME_MAX: usize = 256;

/// Kubernetes label keys: an optional DNS-subdomain prefix and `/`, then a name of at most 63
/// characters. Used for the free-form labels of sandboxes and route groups.
/// (`[.]` rather than `\.` because the pattern is also embedded in a CEL string literal.)
pub const LABEL_KEY_PATTERN: &str = "^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$";
pub const LABEL_KEY_MAX: usize = 317;

/// `"<host>:<port>"` on a workstation: a DNS name, an IPv4 address or a bracketed IPv6 address.
pub const HOST_PORT_PATTERN: &str =
    r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?):[0-9]{1,5}$";
pub const HOST_PORT_MAX: usize = 261;

/// TTLs as Signadot writes them: a positive count of minutes, hours, days or weeks.
pub const TTL_PATTERN: &str = "^[1-9][0-9]{0,9}[mhdw]$";

/// Endpoint targets: `scheme://host[:port]`.
pub const ENDPOINT_TARGET_PATTERN: &str =
    r"^(http|https|grpc|tcp)://[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?(:[0-9]{1,5})?$";
pub const ENDPOINT_TARGET_MAX: usize = 300;

/// Resource plugins: `name` or `name@version`.
pub const PLUGIN_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(@[0-9A-Za-z][0-9A-Za-z.+-]*)?$";
pub const PLUGIN_MAX: usize = 128;

/// Container image references: no whitespace, bounded.
pub const IMAGE_PATTERN: &str = r"^\S+$";
pub const IMAGE_MAX: usize = 1024;

/// Longest value of the free-form labels of a sandbox (not Kubernetes labels, so not bound to
/// 63 characters).
pub const FREE_LABEL_VALUE_MAX: usize = 256;

/// Longest free-form description.
pub const DESCRIPTION_MAX: usize = 1024;
/// Longest plain environment value, label value or parameter value (they end up in pod specs,
/// so they are kept small; larger values belong in a ConfigMap or Secret).
pub const VALUE_MAX: usize = 4096;

pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= DNS_LABEL_MAX
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A DNS-1123 label that also starts with a letter (DNS-1035), as Service names must.
pub fn is_dns1035_label(s: &str) -> bool {
    is_dns_label(s) && s.starts_with(|c: char| c.is_ascii_lowercase())
}

pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= DNS_SUBDOMAIN_MAX && s.split('.').all(is_dns_label)
}

pub fn is_routing_key(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= ROUTING_KEY_MAX
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// Longest file path a Sandbox may name (`spec.local[].files[].path`).
pub const FILE_PATH_MAX: usize = 1024;

/// A path a file may be written to under a directory: relative once its leading `/` goes, no
/// `.`, `..` or empty components, at most [`FILE_PATH_MAX`] bytes, no NUL.
pub fn is_file_path(p: &str) -> bool {
    let rel = p.strip_prefix('/').unwrap_or(p);
    !rel.is_empty()
        && p.len() <= FILE_PATH_MAX
        && !p.contains('\0')
        && rel
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

pub fn is_env_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= ENV_NAME_MAX
        && !s.starts_with(|c: char| c.is_ascii_digit())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
}

/// A Kubernetes label value: empty, or up to 63 of `[A-Za-z0-9._-]` beginning and ending with
/// a letter or digit.
pub fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    b.is_empty()
        || (b.len() <= 63
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_'))
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric())
}

pub fn is_label_key(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    prefix.is_none_or(is_dns_subdomain) && !name.is_empty() && is_label_value(name)
}

/// Parses a port number written in decimal (1-65535).
pub fn parse_port(s: &str) -> Option<u16> {
    if s.is_empty() || s.len() > 5 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<u16>().ok().filter(|p| *p != 0)
}

/// `host:port` with a DNS name, IPv4 literal or bracketed IPv6 literal; see [`HOST_PORT_PATTERN`].
pub fn is_host_port(s: &str) -> bool {
    if s.len() > HOST_PORT_MAX {
        return false;
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    if parse_port(port).is_none() {
        return false;
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6.parse::<std::net::Ipv6Addr>().is_ok();
    }
    is_host(host)
}

/// A DNS name (letters, digits, `-`, dots between labels) or an IPv4 literal.
pub fn is_host(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= DNS_SUBDOMAIN_MAX
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= DNS_LABEL_MAX
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

pub fn is_image(s: &str) -> bool {
    !s.is_empty() && s.len() <= IMAGE_MAX && !s.chars().any(char::is_whitespace)
}

pub fn is_plugin(s: &str) -> bool {
    if s.len() > PLUGIN_MAX {
        return false;
    }
    let (name, version) = match s.split_once('@') {
        Some((n, v)) => (n, Some(v)),
        None => (s, None),
    };
    is_dns_label(name)
        && version.is_none_or(|v| {
            v.starts_with(|c: char| c.is_ascii_alphanumeric())
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'-'))
        })
}

/// `scheme://host[:port]` with scheme `http`, `https`, `grpc` or `tcp`.
pub fn is_endpoint_target(s: &str) -> bool {
    if s.len() > ENDPOINT_TARGET_MAX {
        return false;
    }
    let Some((scheme, rest)) = s.split_once("://") else {
        return false;
    };
    if !matches!(scheme, "http" | "https" | "grpc" | "tcp") {
        return false;
    }
    match rest.rsplit_once(':') {
        Some((host, port)) => is_host(host) && parse_port(port).is_some(),
        None => is_host(rest),
    }
}

/// Collects problems with their paths, so that one pass reports everything wrong at once.
#[derive(Default)]
pub(crate) struct Checker {
    problems: Vec<FieldError>,
}

impl Checker {
    pub(crate) fn fail(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.problems.push(FieldError {
            path: path.into(),
            message: message.into(),
        });
    }

    pub(crate) fn require(&mut self, ok: bool, path: impl FnOnce() -> String, message: &str) {
        if !ok {
            self.fail(path(), message);
        }
    }

    pub(crate) fn dns_label(&mut self, path: impl FnOnce() -> String, s: &str) {
        self.require(is_dns_label(s), path, "must be a DNS-1123 label (1-63 of [a-z0-9-], starting and ending with a letter or digit)");
    }

    pub(crate) fn dns_subdomain(&mut self, path: impl FnOnce() -> String, s: &str) {
        self.require(
            is_dns_subdomain(s),
            path,
            "must be a DNS-1123 subdomain (1-253 of [a-z0-9-.], dot-separated labels)",
        );
    }

    pub(crate) fn routing_key(&mut self, path: impl FnOnce() -> String, s: &str) {
        self.require(
            is_routing_key(s),
            path,
            "must be 1-63 of [A-Za-z0-9._-], starting and ending with a letter or digit",
        );
    }

    pub(crate) fn max_len(&mut self, path: impl FnOnce() -> String, s: &str, max: usize) {
        if s.len() > max {
            self.fail(path(), format!("must be at most {max} bytes"));
        }
    }

    pub(crate) fn max_items<T>(&mut self, path: impl FnOnce() -> String, items: &[T], max: usize) {
        if items.len() > max {
            self.fail(path(), format!("must have at most {max} items"));
        }
    }

    pub(crate) fn finish(self, kind: &'static str) -> Result<(), Error> {
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(Error::Invalid {
                kind,
                problems: FieldErrors(self.problems),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_names() {
        for ok in ["a", "a-b", "0", "abc123", &"a".repeat(63)] {
            assert!(is_dns_label(ok), "{ok}");
            assert!(is_dns_subdomain(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", &"a".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad}");
        }
        assert!(is_dns_subdomain("a.b-c.d"));
        assert!(!is_dns_subdomain("a..b"));
        assert!(!is_dns_subdomain(".a"));
        assert!(is_dns1035_label("a1"));
        assert!(!is_dns1035_label("1a"));
    }

    #[test]
    fn routing_keys_are_label_values() {
        for ok in ["k", "ltj9s8scupb86", "a.b_c-d", &"k".repeat(63)] {
            assert!(is_routing_key(ok), "{ok}");
            assert!(is_label_value(ok), "{ok}");
            assert!(spur_routing::extract::is_valid_key(ok), "{ok}");
        }
        for bad in ["", "-k", "k-", "a b", "k/1", &"k".repeat(64)] {
            assert!(!is_routing_key(bad), "{bad}");
        }
    }

    #[test]
    fn label_keys_and_env_names() {
        for ok in ["team", "spur.dev/owner", "a.b/C_d", "x-1"] {
            assert!(is_label_key(ok), "{ok}");
        }
        for bad in ["", "/a", "a/", "Spur.dev/x", "a b", "-a"] {
            assert!(!is_label_key(bad), "{bad}");
        }
        for ok in ["PATH", "_x", "a.b-c", "-x"] {
            assert!(is_env_name(ok), "{ok}");
        }
        for bad in ["", "1A", "A=B", "A B"] {
            assert!(!is_env_name(bad), "{bad}");
        }
    }

    #[test]
    fn hosts_ports_targets_plugins() {
        for ok in [
            "localhost:8080",
            "127.0.0.1:1",
            "[::1]:65535",
            "my-host.lan:80",
        ] {
            assert!(is_host_port(ok), "{ok}");
        }
        for bad in [
            "localhost",
            "localhost:0",
            "localhost:65536",
            ":80",
            "[zz]:80",
            "a b:1",
        ] {
            assert!(!is_host_port(bad), "{bad}");
        }
        for ok in [
            "http://route.hotrod.svc:8083",
            "grpc://api.ns.svc",
            "http://frontend.hotrod.deploy:8080",
        ] {
            assert!(is_endpoint_target(ok), "{ok}");
        }
        for bad in ["ftp://a:1", "http://", "http://a:0", "http://a/b", "a:1"] {
            assert!(!is_endpoint_target(bad), "{bad}");
        }
        for ok in ["postgres", "postgres@1.2.0", "x@latest"] {
            assert!(is_plugin(ok), "{ok}");
        }
        for bad in ["", "Pg", "pg@", "pg@@1", "pg@-1"] {
            assert!(!is_plugin(bad), "{bad}");
        }
        assert_eq!(parse_port("8080"), Some(8080));
        assert_eq!(parse_port("0"), None);
        assert_eq!(parse_port("+80"), None);
    }
}
