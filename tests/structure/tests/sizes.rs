//! No source file over [`BOUND`] code lines (comments, blank lines and the file's trailing unit
//! tests not counted; see `spur_structure::sizes`): past that a file has nearly always grown a
//! second or third job, and it is split by job, as ARCHITECTURE.md says. The files still over
//! it are listed in [`KNOWN_LARGE`] with what should come out of them; the list may only
//! shrink: a listed file that has come under the bound fails the test until it is struck off.

use std::path::Path;

use spur_structure::modules::workspace_members;
use spur_structure::sizes::{code_lines, rust_files};

/// Code lines a file may have.
const BOUND: usize = 800;

/// Files over the bound today (path from the workspace root), and the split each is waiting for.
const KNOWN_LARGE: &[(&str, &str)] = &[
    (
        "perf/benches/push_latency.rs",
        "the route-server process and its watchers apart from the phases and the report",
    ),
    (
        "perf/benches/tunnel_vs_ssh.rs",
        "the network namespaces and sshd fixtures apart from the measurements and the report",
    ),
];

#[test]
fn no_file_over_the_bound() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let workspace = workspace.canonicalize().unwrap();
    let members = workspace_members(&workspace).unwrap();
    assert!(members.len() > 20, "workspace members: {members:?}");
    let mut over = Vec::new();
    let mut files = 0;
    for member in &members {
        for dir in ["src", "benches"] {
            let dir = member.join(dir);
            if !dir.is_dir() {
                continue;
            }
            for file in rust_files(&dir).unwrap() {
                files += 1;
                let src = std::fs::read_to_string(&file).unwrap();
                let n = code_lines(&src);
                let label = file.strip_prefix(&workspace).unwrap().display().to_string();
                if n > BOUND {
                    over.push((label, n));
                }
            }
        }
    }
    assert!(files > 300, "source files read: {files}");
    let mut problems = Vec::new();
    for (file, n) in &over {
        if !KNOWN_LARGE.iter().any(|(known, _)| known == file) {
            problems.push(format!(
                "{file}: {n} code lines, over {BOUND}; split it by job (ARCHITECTURE.md)"
            ));
        }
    }
    for (known, _) in KNOWN_LARGE {
        if !over.iter().any(|(file, _)| file == known) {
            problems.push(format!(
                "{known} is listed in KNOWN_LARGE but is not over {BOUND} code lines (or is \
                 gone): strike it off"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
