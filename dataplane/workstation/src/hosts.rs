//! The opt-in hosts-file block: the same name → loopback-address mappings the DNS responder
//! serves, between `# spur begin` and `# spur end`, so every program on the workstation resolves
//! cluster names without a resolver change. Everything outside the block is kept byte for byte.
//!
//! Writes are atomic (a temporary file in the same directory, then rename) where the file
//! system allows it; a hosts file that is a mount point (containers bind-mount `/etc/hosts`)
//! cannot be renamed over and is rewritten in place instead.

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::Path;

use crate::Error;

pub const BEGIN: &str = "# spur begin";
pub const END: &str = "# spur end";
const NOTE: &str = "# written by `spur local connect`; removed by `spur local disconnect`";

/// Replaces the block with `entries` (address, names), or adds it at the end.
pub fn write_block(path: &Path, entries: &[(Ipv4Addr, Vec<String>)]) -> Result<(), Error> {
    let current = read(path)?;
    let mut out = strip_block(path, &current)?;
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(BEGIN);
    out.push('\n');
    out.push_str(NOTE);
    out.push('\n');
    for (addr, names) in entries {
        out.push_str(&addr.to_string());
        for n in names {
            out.push('\t');
            out.push_str(n);
        }
        out.push('\n');
    }
    out.push_str(END);
    out.push('\n');
    if out != current {
        replace(path, &out)?;
    }
    Ok(())
}

/// Removes the block, if there is one.
pub fn remove_block(path: &Path) -> Result<(), Error> {
    let current = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(Error::File {
                what: "cannot read hosts file",
                path: path.to_owned(),
                source,
            });
        }
    };
    let out = strip_block(path, &current)?;
    if out != current {
        replace(path, &out)?;
    }
    Ok(())
}

fn read(path: &Path) -> Result<String, Error> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(source) => Err(Error::File {
            what: "cannot read hosts file",
            path: path.to_owned(),
            source,
        }),
    }
}

/// `text` without any spur block. A begin marker without an end is refused rather than
/// guessed at: removing up to the end of the file could delete the user's own lines.
fn strip_block(path: &Path, text: &str) -> Result<String, Error> {
    let mut out = String::with_capacity(text.len());
    let mut inside = false;
    for line in text.split_inclusive('\n') {
        let t = line.trim();
        if !inside && t == BEGIN {
            inside = true;
        } else if inside && t == END {
            inside = false;
        } else if !inside {
            out.push_str(line);
        }
    }
    if inside {
        return Err(Error::Invalid {
            path: path.to_owned(),
            reason: format!("`{BEGIN}` without `{END}`; fix the file by hand"),
        });
    }
    Ok(out)
}

fn replace(path: &Path, contents: &str) -> Result<(), Error> {
    let err = |what: &'static str| {
        move |source| Error::File {
            what,
            path: path.to_owned(),
            source,
        }
    };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "hosts".into());
    let tmp = dir
        .unwrap_or(Path::new("."))
        .join(format!(".{name}.spur-{}", std::process::id()));
    let permissions = std::fs::metadata(path).ok().map(|m| m.permissions());
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(contents.as_bytes())?;
        if let Some(p) = &permissions {
            f.set_permissions(p.clone())?;
        }
        f.sync_all()
    })();
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            // A bind-mounted file (EBUSY) or a directory we may not create files in: rewrite
            // the file itself (not atomic, but the block is small and rewritten on change).
            if std::fs::metadata(path).is_ok() {
                std::fs::write(path, contents).map_err(err("cannot write hosts file"))
            } else {
                Err(err("cannot write hosts file")(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn block_is_added_replaced_and_removed_keeping_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hosts");
        let original = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n# own comment";
        std::fs::write(&path, original).unwrap();
        let a = Ipv4Addr::new(127, 77, 0, 1);
        write_block(
            &path,
            &[(a, vec!["api.shop".into(), "api.shop.svc".into()])],
        )
        .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with(original));
        assert!(text.contains("# spur begin\n"));
        assert!(text.contains("127.77.0.1\tapi.shop\tapi.shop.svc\n"));
        assert!(text.ends_with("# spur end\n"));
        // Replaced, not appended twice.
        write_block(&path, &[(a, vec!["web.shop".into()])]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.matches(BEGIN).count(), 1);
        assert!(!text.contains("api.shop"));
        assert!(text.contains("web.shop"));
        remove_block(&path).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{original}\n")
        );
        // An unterminated block is refused, and the file left alone.
        std::fs::write(&path, "a\n# spur begin\nb\n").unwrap();
        assert!(remove_block(&path).is_err());
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "a\n# spur begin\nb\n"
        );
    }
}
