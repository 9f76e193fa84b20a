//! The analyzer over small synthetic crates written to a temporary directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// A crate written under the system temp directory, removed on drop.
struct Tree(PathBuf);

impl Tree {
    fn new(files: &[(&str, &str)]) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "spur-structure-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        for (path, text) in files {
            let file = dir.join(path);
            fs::create_dir_all(file.parent().unwrap()).unwrap();
            fs::write(file, text).unwrap();
        }
        Self(dir)
    }

    fn cycles(&self) -> Vec<Cycle> {
        let graph = CrateGraph::read(&self.0.join("src/lib.rs")).unwrap();
        assert!(graph.missing.is_empty(), "{:?}", graph.missing);
        graph.cycles(&self.0)
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn modules(cycles: &[Cycle]) -> Vec<Vec<&str>> {
    cycles
        .iter()
        .map(|c| c.modules.iter().map(String::as_str).collect())
        .collect()
}

const LIB: &str = "//! x\npub mod a;\nmod b;\npub(crate) mod c;\n";
const A: &str = "use crate::b::B;\nuse crate::c::d::D;\npub struct A;\n";
const B: &str = "pub struct B;\n";
/// Everything here that names `a` is a comment, a string or test code; `d` names `b`.
const C: &str = r#"mod d;
pub use self::d::D;
// use crate::a::A;
/* crate::a::A */
const S: &str = "crate::a::A";
mod inner {
    pub(crate) use super::d::D;
}
#[cfg(test)]
mod tests {
    use crate::a::A;
}
#[cfg(test)]
mod helper;
"#;
const D: &str = "pub struct D(super::super::b::B);\n";

fn files<'a>(b: &'a str, c: &'a str) -> Vec<(&'static str, &'a str)> {
    vec![
        ("src/lib.rs", LIB),
        ("src/a.rs", A),
        ("src/b.rs", b),
        ("src/c/mod.rs", c),
        ("src/c/d.rs", D),
    ]
}

#[test]
fn no_cycle_when_only_comments_strings_and_tests_point_back() {
    let tree = Tree::new(&files(B, C));
    let graph = CrateGraph::read(&tree.0.join("src/lib.rs")).unwrap();
    let edges: Vec<(String, String)> = graph
        .edges()
        .keys()
        .map(|(f, t)| (display(f), display(t)))
        .collect();
    let pairs = [("a", "b"), ("a", "c"), ("c", "b"), ("c::inner", "c::d")];
    let want: Vec<(String, String)> = pairs
        .iter()
        .map(|(f, t)| ((*f).to_owned(), (*t).to_owned()))
        .collect();
    assert_eq!(edges, want);
    assert_eq!(tree.cycles(), []);
}

#[test]
fn a_use_back_makes_a_cycle_with_its_line() {
    let b = "pub struct B;\nfn f() -> super::a::A {\n    super::a::A\n}\n";
    let mut tree = files(b, C);
    tree[4].1 = "pub struct D;\n"; // no c -> b, which would close a ring a -> c -> b -> a
    let tree = Tree::new(&tree);
    let cycles = tree.cycles();
    assert_eq!(modules(&cycles), [["a", "b"]]);
    let edges = &cycles[0].edges;
    assert_eq!(edges[0].0, "a");
    assert_eq!(edges[0].2, "src/a.rs:1: use crate::b::B;");
    assert_eq!(edges[1].0, "b");
    assert_eq!(edges[1].2, "src/b.rs:2: fn f() -> super::a::A {");
    assert!(report("x", &cycles).contains("x: cycle among a, b\n    a -> b: src/a.rs:1"));
}

#[test]
fn super_inside_an_inline_module_and_use_groups_resolve() {
    // c::inner's `super::super::a` is the root's a (c -> a); with a -> c that is a cycle.
    let c = C.replace(
        "pub(crate) use super::d::D;",
        "use super::super::{a::{self, A}};",
    );
    let tree = Tree::new(&files(B, &c));
    assert_eq!(modules(&tree.cycles()), [["a", "c"]]);
}

#[test]
fn three_modules_in_a_ring_are_one_cycle() {
    let b = "pub struct B(crate::c::d::D);\n";
    let d = "pub struct D;\nfn f() { let _ = crate::a::A; }\n";
    let mut tree = files(b, C);
    tree[4].1 = d;
    let tree = Tree::new(&tree);
    let cycles = tree.cycles();
    assert_eq!(modules(&cycles), [["a", "b", "c"]]);
    // a -> c and c -> a are both in it, besides a -> b and b -> c.
    assert_eq!(cycles[0].edges.len(), 4);
}

#[test]
fn workspace_members_are_read_from_the_manifest() {
    let tree = Tree::new(&[(
        "Cargo.toml",
        "[workspace]\nmembers = [\n    \"one\",\n    \"two/x\",\n]\n",
    )]);
    let members = workspace_members(&tree.0).unwrap();
    assert_eq!(members, [tree.0.join("one"), tree.0.join("two/x")]);
    assert_eq!(
        crate_roots(Path::new("/nonexistent")),
        Vec::<PathBuf>::new()
    );
}
