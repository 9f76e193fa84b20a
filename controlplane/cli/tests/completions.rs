//! `spur completions SHELL` prints a script that knows the commands, and a reader that stops
//! early (`| head`) is no error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read as _;
use std::process::{Command, Stdio};

#[test]
fn completion_scripts_know_the_commands_and_survive_a_closed_pipe() {
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(env!("CARGO_BIN_EXE_spur"))
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}");
        let script = String::from_utf8(out.stdout).unwrap();
        for word in [
            "sandbox",
            "routegroup",
            "explain",
            "wait",
            "force-conflicts",
        ] {
            assert!(script.contains(word), "{shell}: {word}");
        }
    }
    // The reader takes one byte and goes away.
    let mut child = Command::new(env!("CARGO_BIN_EXE_spur"))
        .args(["completions", "zsh"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut one = [0u8; 1];
    stdout.read_exact(&mut one).unwrap();
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = Command::new(env!("CARGO_BIN_EXE_spur"))
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "a usage error");
}
