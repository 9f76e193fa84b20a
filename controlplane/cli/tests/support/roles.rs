//! The server roles' binaries (`bin/`), for tests that run them beside `spur`. They live in
//! packages of their own, so cargo does not build them for `spur-cli`'s tests: the first call per
//! role builds it (`cargo build -p spur-<role>-bin`, into the target directory and profile `spur`
//! was built in; a no-op when it is up to date), so a test never runs a stale binary.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The path of role binary `name` (e.g. `spur-hub`), built up to date.
pub(crate) fn role_bin(name: &str) -> PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let spur = Path::new(env!("CARGO_BIN_EXE_spur"));
    let profile_dir = spur.parent().expect("spur has a directory");
    let path = profile_dir.join(name);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !built.iter().any(|b| b == name) {
        let mut cargo = std::process::Command::new(env!("CARGO"));
        cargo
            .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
            .args([
                "build",
                "--quiet",
                "-p",
                &format!("{name}-bin"),
                "--bin",
                name,
            ])
            .arg("--target-dir")
            .arg(profile_dir.parent().expect("a target directory"));
        if profile_dir.file_name().is_some_and(|p| p == "release") {
            cargo.arg("--release");
        }
        let status = cargo.status().expect("cargo runs");
        assert!(status.success(), "cargo build -p {name}-bin failed");
        built.push(name.to_owned());
    }
    path
}
