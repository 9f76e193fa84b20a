//! The README's list of `spur` commands (the `controlplane/cli` row of its crate table) names
//! every command and subcommand that `spur --help` shows, in help order: a command added
//! without its line in the README fails here (issue 46, docs that match the code).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

/// The (visible) subcommands `spur <args> --help` lists, without `help`.
fn commands(args: &[&str]) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_spur"))
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "spur {args:?} --help: {out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    let Some((_, rest)) = help.split_once("Commands:\n") else {
        return Vec::new();
    };
    rest.lines()
        .take_while(|l| !l.trim().is_empty())
        // A command's line starts at column 2; its wrapped description further in.
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(String::from)
        .collect()
}

#[test]
fn the_readme_lists_every_command() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let row = readme
        .lines()
        .find(|l| l.starts_with("| `controlplane/cli` |"))
        .expect("README's crate table has a controlplane/cli row");
    // The list itself: from "what people run:" to the pointer at this test.
    let list = row
        .split_once("what people run: ")
        .and_then(|(_, rest)| rest.split_once(" (`controlplane/cli/tests/readme.rs`"))
        .map(|(list, _)| list)
        .expect("the row lists the commands after `what people run: `, then names this test");
    // What it names: each `spur <command> <a/b/c>` entry.
    let mut named: Vec<String> = list
        .split('`')
        .filter(|part| part.starts_with("spur "))
        .map(String::from)
        .collect();
    named.sort();
    let mut want = Vec::new();
    for c in commands(&[]) {
        let subs = commands(&[&c]);
        want.push(if subs.is_empty() {
            format!("spur {c}")
        } else {
            format!("spur {c} {}", subs.join("/"))
        });
    }
    want.sort();
    assert!(want.len() >= 9, "spur --help lists {want:?}");
    assert_eq!(
        named, want,
        "README.md's controlplane/cli list (left) against spur --help (right): {list}"
    );
}
