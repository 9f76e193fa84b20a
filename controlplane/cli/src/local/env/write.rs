//! The output of `spur local env`: the environment as text, the files on disk.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};

use super::File;

/// Writes `files` under `dir`, which must be the user's own directory that nobody else may
/// write to (created 0700 when missing). Nothing is written when a path passes through a
/// symbolic link, or a file would sit where another needs a directory. Each file is written
/// whole to a new, exclusively created name beside it (0600 for Secrets' files, 0644 for
/// others), then renamed over the final name; subdirectories are created 0700.
pub(super) fn write_files(dir: &Path, files: &[File]) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
    // Every check before the first write.
    let all: std::collections::HashSet<&str> = files.iter().map(|f| f.path.as_str()).collect();
    for f in files {
        let relative = Path::new(&f.path)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !relative {
            bail!("refusing to write {:?}: not a plain relative path", f.path);
        }
        for (i, _) in f.path.match_indices('/') {
            if all.contains(&f.path[..i]) {
                bail!("{} is both a file and a directory", &f.path[..i]);
            }
        }
    }
    if let Err(e) = std::fs::symlink_metadata(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            return Err(e).with_context(|| format!("cannot use {}", dir.display()));
        }
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        // The last component alone, not following a link someone put there meanwhile.
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("cannot create {}", dir.display())),
        }
    }
    let m =
        std::fs::symlink_metadata(dir).with_context(|| format!("cannot use {}", dir.display()))?;
    if m.file_type().is_symlink() || !m.is_dir() {
        bail!(
            "{} is not a directory (or is a symbolic link)",
            dir.display()
        );
    }
    // Another user who owns or may write here could plant links or names: not for Secrets.
    if m.uid() != nix::unistd::geteuid().as_raw() || m.mode() & 0o022 != 0 {
        bail!(
            "{} must be yours and writable by you alone (chmod go-w), as it will hold Secrets",
            dir.display()
        );
    }
    for f in files {
        let mut at = dir.to_path_buf();
        let parts: Vec<_> = Path::new(&f.path).iter().collect();
        for (i, part) in parts.iter().enumerate() {
            at.push(part);
            let Ok(m) = std::fs::symlink_metadata(&at) else {
                break;
            };
            if m.file_type().is_symlink() {
                bail!(
                    "refusing to write through the symbolic link {}",
                    at.display()
                );
            }
            let last = i + 1 == parts.len();
            if last == m.is_dir() {
                bail!(
                    "{} is in the way (a {} where a {} goes)",
                    at.display(),
                    if m.is_dir() { "directory" } else { "file" },
                    if last { "file" } else { "directory" }
                );
            }
        }
    }
    for (n, f) in files.iter().enumerate() {
        let to = dir.join(&f.path);
        let parent = to.parent().unwrap_or(dir);
        let mut at = dir.to_path_buf();
        for part in Path::new(&f.path).parent().into_iter().flat_map(Path::iter) {
            at.push(part);
            match std::fs::DirBuilder::new().mode(0o700).create(&at) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let m = std::fs::symlink_metadata(&at)?;
                    if m.file_type().is_symlink() || !m.is_dir() {
                        bail!("{} is not a directory", at.display());
                    }
                }
                Err(e) => return Err(e).with_context(|| format!("cannot create {}", at.display())),
            }
        }
        // A new name nobody else could have prepared: O_EXCL does not follow symbolic links.
        let tmp = parent.join(format!(".spur-local-env.{}.{n}.tmp", std::process::id()));
        let mode = if f.secret { 0o600 } else { 0o644 };
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("cannot create {}", tmp.display()))?;
        // From here the name is ours: removed again if anything fails.
        let written = (|| -> std::io::Result<()> {
            out.write_all(&f.content)?;
            out.set_permissions(std::fs::Permissions::from_mode(mode))?;
            out.sync_all()?;
            std::fs::rename(&tmp, &to)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e).with_context(|| format!("cannot write {}", to.display()));
        }
    }
    Ok(())
}

pub(super) fn dotenv(env: &[(String, String)]) -> String {
    env.iter()
        .map(|(k, v)| {
            let mut q = String::with_capacity(v.len() + 2);
            for ch in v.chars() {
                match ch {
                    '\\' => q.push_str("\\\\"),
                    '"' => q.push_str("\\\""),
                    '$' => q.push_str("\\$"),
                    '`' => q.push_str("\\`"),
                    '\n' => q.push_str("\\n"),
                    '\r' => q.push_str("\\r"),
                    c => q.push(c),
                }
            }
            format!("{k}=\"{q}\"\n")
        })
        .collect()
}

pub(super) fn shell(env: &[(String, String)]) -> String {
    env.iter()
        // A name with `-` or `.` is valid for Kubernetes but not for a shell: left out there.
        .filter(|(k, _)| k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .map(|(k, v)| format!("export {k}='{}'\n", v.replace('\'', "'\\''")))
        .collect()
}
