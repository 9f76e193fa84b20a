//! Finding an attempt's artifacts: the regular files at or under each declared path, never
//! through a symlink, and nothing under /proc, /sys or /dev (the executor's own memory and
//! descriptors are there, and a job must not be able to keep them as "artifacts").

use std::path::{Component, Path, PathBuf};

/// Where artifacts may not come from.
const FORBIDDEN_ROOTS: [&str; 3] = ["/proc", "/sys", "/dev"];
/// Most files one declared directory may yield.
pub const MAX_FILES_PER_PATH: usize = 10_000;

/// One file to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub path: PathBuf,
    pub size: u64,
    pub declared: String,
}

/// What a declared path yields: files, or the reason it yields none.
pub fn find(declared: &str) -> Result<Vec<Found>, String> {
    let path = Path::new(declared);
    if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
        return Err("not an absolute path without '..'".into());
    }
    // Resolve symlinks in the parents too (`/tmp/link/file`), then refuse the special trees.
    let parent_real = match path.parent() {
        Some(p) => std::fs::canonicalize(p).map_err(|e| format!("{}: {e}", p.display()))?,
        None => PathBuf::from("/"),
    };
    let real = match path.file_name() {
        Some(name) => parent_real.join(name),
        None => parent_real,
    };
    if FORBIDDEN_ROOTS.iter().any(|root| real.starts_with(root)) {
        return Err(format!("{} is under /proc, /sys or /dev", real.display()));
    }
    let meta = std::fs::symlink_metadata(&real).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "does not exist".to_owned(),
        _ => format!("{}: {e}", real.display()),
    })?;
    let mut out = Vec::new();
    if meta.file_type().is_symlink() {
        return Err("is a symlink (artifacts are never followed through symlinks)".into());
    } else if meta.is_file() {
        out.push(Found {
            path: real,
            size: meta.len(),
            declared: declared.to_owned(),
        });
    } else if meta.is_dir() {
        walk(&real, declared, &mut out)?;
        out.sort_by(|a, b| a.path.cmp(&b.path));
    } else {
        return Err("is not a regular file or a directory".into());
    }
    Ok(out)
}

fn walk(dir: &Path, declared: &str, out: &mut Vec<Found>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries.flatten() {
        let Ok(ft) = entry.file_type() else { continue };
        let path = entry.path();
        if ft.is_dir() {
            walk(&path, declared, out)?;
        } else if ft.is_file() {
            let size = entry.metadata().map(|m| m.len()).unwrap_or(0);
            out.push(Found {
                path,
                size,
                declared: declared.to_owned(),
            });
        }
        // Symlinks, sockets, devices and FIFOs inside a directory are left out.
        if out.len() > MAX_FILES_PER_PATH {
            return Err(format!("more than {MAX_FILES_PER_PATH} files"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_directories_and_refusals() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::write(root.join("a.txt"), b"hello").unwrap();
        std::fs::create_dir_all(root.join("d/e")).unwrap();
        std::fs::write(root.join("d/1"), b"1").unwrap();
        std::fs::write(root.join("d/e/2"), b"22").unwrap();
        std::os::unix::fs::symlink("/proc/self/environ", root.join("d/leak")).unwrap();
        std::os::unix::fs::symlink("/proc/self", root.join("proc")).unwrap();

        let one = find(root.join("a.txt").to_str().unwrap()).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].size, 5);

        let dir = find(root.join("d").to_str().unwrap()).unwrap();
        let names: Vec<_> = dir
            .iter()
            .map(|f| {
                f.path
                    .strip_prefix(root)
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(names, ["d/1", "d/e/2"], "the symlink inside is left out");

        assert!(
            find(root.join("d/leak").to_str().unwrap())
                .unwrap_err()
                .contains("symlink")
        );
        let through = find(root.join("proc/environ").to_str().unwrap()).unwrap_err();
        assert!(through.contains("/proc"), "{through}");
        assert!(find("/proc/self/mem").unwrap_err().contains("/proc"));
        assert!(find("/dev/zero").unwrap_err().contains("/dev"));
        assert!(find("relative").is_err());
        assert!(find("/tmp/../etc/passwd").is_err());
        assert_eq!(
            find(root.join("missing").to_str().unwrap()).unwrap_err(),
            "does not exist"
        );
    }
}
