//! Finding what an attempt leaves behind: its artifacts (the regular files at or under each
//! declared path) and its result file, never through a symlink, and nothing under /proc, /sys or
//! /dev (the executor's own memory and descriptors are there, and a job must not be able to keep
//! them as "artifacts").

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

/// Most bytes of a result file (`StartRequest.result_path`).
pub const RESULT_MAX: u64 = 4096;

/// The declared path with its parents' symlinks resolved, unless it is relative, has `..` or
/// lies under /proc, /sys or /dev.
fn resolve(declared: &str) -> Result<PathBuf, String> {
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
    Ok(real)
}

fn metadata(real: &Path) -> Result<std::fs::Metadata, String> {
    std::fs::symlink_metadata(real).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "does not exist".to_owned(),
        _ => format!("{}: {e}", real.display()),
    })
}

/// The content of a result file: a regular file of at most [`RESULT_MAX`] bytes, not reached
/// through a symlink. Read once the job's processes are all gone, but a process that escaped the
/// kill (a daemon of its own session) could still swap the file between a check and a read, so
/// the file is opened first, without following a symlink and without blocking (a FIFO would wait
/// for a writer), and every check is of the opened file.
pub fn read_result(declared: &str) -> Result<Vec<u8>, String> {
    use nix::fcntl::OFlag;
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let real = resolve(declared)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY).bits())
        .open(&real)
        .map_err(|e| match (e.kind(), e.raw_os_error()) {
            (std::io::ErrorKind::NotFound, _) => "the job did not write it".to_owned(),
            (_, Some(code)) if code == nix::libc::ELOOP => {
                "is a symlink (a result is never read through one)".to_owned()
            }
            _ => format!("{}: {e}", real.display()),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| format!("{}: {e}", real.display()))?;
    if !meta.is_file() {
        return Err("is not a regular file".into());
    }
    // A bind mount or a link of the special trees elsewhere: the file system tells.
    let fs = nix::sys::statfs::fstatfs(&file).map_err(|e| format!("{}: {e}", real.display()))?;
    if [
        nix::sys::statfs::PROC_SUPER_MAGIC,
        nix::sys::statfs::SYSFS_MAGIC,
    ]
    .contains(&fs.filesystem_type())
    {
        return Err("is on procfs or sysfs".into());
    }
    if meta.len() > RESULT_MAX {
        return Err(format!(
            "{} bytes, more than the {RESULT_MAX} a result may have (keep larger output as an artifact)",
            meta.len()
        ));
    }
    let mut out = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(RESULT_MAX + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("{}: {e}", real.display()))?;
    // It may have grown since the check.
    if out.len() as u64 > RESULT_MAX {
        return Err(format!(
            "more than the {RESULT_MAX} bytes a result may have (keep larger output as an artifact)"
        ));
    }
    Ok(out)
}

/// What a declared path yields: files, or the reason it yields none.
pub fn find(declared: &str) -> Result<Vec<Found>, String> {
    let real = resolve(declared)?;
    let meta = metadata(&real)?;
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
    fn a_result_is_a_regular_file_opened_without_following_or_blocking() {
        let tmp = tempfile::tempdir().unwrap();
        let at = |name: &str| tmp.path().join(name).to_str().unwrap().to_owned();
        std::fs::write(at("r.json"), b"{}").unwrap();
        assert_eq!(read_result(&at("r.json")).unwrap(), b"{}");
        std::os::unix::fs::symlink(at("r.json"), at("link")).unwrap();
        let err = read_result(&at("link")).unwrap_err();
        assert!(err.contains("symlink"), "{err}");
        std::os::unix::fs::symlink("/proc/self/environ", at("leak")).unwrap();
        let err = read_result(&at("leak")).unwrap_err();
        assert!(err.contains("symlink"), "{err}");
        // A FIFO nobody writes: opened without waiting for a writer, then refused.
        nix::unistd::mkfifo(
            tmp.path().join("fifo").as_path(),
            nix::sys::stat::Mode::S_IRWXU,
        )
        .unwrap();
        assert_eq!(
            read_result(&at("fifo")).unwrap_err(),
            "is not a regular file"
        );
        std::fs::create_dir(at("dir")).unwrap();
        assert_eq!(
            read_result(&at("dir")).unwrap_err(),
            "is not a regular file"
        );
        assert_eq!(
            read_result(&at("none")).unwrap_err(),
            "the job did not write it"
        );
        std::fs::write(at("big"), vec![b'x'; RESULT_MAX as usize + 1]).unwrap();
        let err = read_result(&at("big")).unwrap_err();
        assert!(err.contains("more than the 4096"), "{err}");
        assert!(read_result("/proc/self/status").is_err());
    }

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

    #[test]
    fn a_result_is_a_small_regular_file() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let at = |name: &str| root.join(name).to_str().unwrap().to_owned();
        std::fs::write(root.join("r.json"), b"{\"ok\":true}").unwrap();
        assert_eq!(read_result(&at("r.json")).unwrap(), b"{\"ok\":true}");
        std::fs::write(root.join("empty"), b"").unwrap();
        assert_eq!(read_result(&at("empty")).unwrap(), b"");
        std::fs::write(root.join("full"), vec![b'x'; RESULT_MAX as usize]).unwrap();
        assert_eq!(read_result(&at("full")).unwrap().len(), RESULT_MAX as usize);

        std::fs::write(root.join("big"), vec![b'x'; RESULT_MAX as usize + 1]).unwrap();
        let big = read_result(&at("big")).unwrap_err();
        assert!(big.contains("4097 bytes, more than the 4096"), "{big}");
        assert_eq!(
            read_result(&at("missing")).unwrap_err(),
            "the job did not write it"
        );
        std::os::unix::fs::symlink(root.join("r.json"), root.join("link")).unwrap();
        assert!(read_result(&at("link")).unwrap_err().contains("symlink"));
        std::fs::create_dir(root.join("dir")).unwrap();
        assert!(
            read_result(&at("dir"))
                .unwrap_err()
                .contains("not a regular file")
        );
        // A FIFO would block a read with no writer: refused without opening it.
        nix::unistd::mkfifo(&root.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(
            read_result(&at("fifo"))
                .unwrap_err()
                .contains("not a regular file")
        );
        assert!(
            read_result("/proc/self/environ")
                .unwrap_err()
                .contains("/proc")
        );
        assert!(read_result("relative.json").is_err());
    }
}
