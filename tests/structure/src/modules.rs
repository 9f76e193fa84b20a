//! A crate's module graph and its cycles.
//!
//! The module tree comes from `mod x;` declarations (resolved to `x.rs` or `x/mod.rs` beside the
//! declaring file, as rustc does) and inline `mod x { … }` blocks, which are modules of their own
//! so that `super::` inside them names the right module. References are the paths that start
//! with `crate::`, `super::` or `self::`, in `use` lines (groups included) and in code; each is
//! resolved to the deepest module of the tree it names. A reference between a module and its
//! own ancestor or descendant is normal (a parent uses its child, the child uses `super::`
//! items) and is dropped; any other reference is collapsed to the two siblings under the lowest
//! common ancestor (`xds::model` → `xds::render` is model → render inside xds; `web::x` →
//! `preview` is web → preview at the root). A cycle is a strongly connected component of that
//! sibling graph with more than one module.
//!
//! Test code does not count: an item under a `#[cfg(test)]` attribute is skipped whole (its
//! `mod tests { … }` block, or a `mod tests;` file, which is then never read), and only `src/`
//! is read, not `tests/`, `benches/` or `examples/`.
//!
//! Limits (it reads tokens, it does not resolve names like rustc):
//! - Paths that do not start with `crate`, `super` or `self` are not followed: a module reaches
//!   a sibling only through one of those (or through a name it imported with one, and that
//!   `use` line is the edge), and a path through an extern crate is another crate's business.
//!   Child-relative paths (`child::x` from the parent) only ever point down, never a cycle.
//! - A re-export hides the module behind it: `use crate::Thing` where the root has
//!   `pub use a::Thing` is a reference to the root, an ancestor, so not an edge.
//! - Macros: `$crate::` is skipped; paths built inside macro bodies are read as written, and
//!   code a macro generates is not seen; `include!` and `#[path]` are not followed.
//! - `#[cfg(...)]` other than exactly `#[cfg(test)]` is ignored: all platforms' code counts.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::lex::{self, Tok, Token};

/// A module path below the crate root (`[]` is the root).
pub type ModPath = Vec<String>;

/// One reference from a module to a path, before it is resolved against the tree.
#[derive(Debug, Clone)]
pub struct Reference {
    pub from: ModPath,
    /// The named path, made absolute (from the crate root), item names included.
    pub path: Vec<String>,
    pub file: PathBuf,
    pub line: usize,
    /// The source line, trimmed, for the report.
    pub text: String,
}

/// A crate's modules and the references between them.
#[derive(Debug, Default)]
pub struct CrateGraph {
    pub modules: BTreeSet<ModPath>,
    pub references: Vec<Reference>,
    /// `mod x;` declarations whose file was not found (`path/x.rs`): reported, not guessed.
    pub missing: Vec<String>,
}

/// A cycle: its modules and, for each edge between them, the first reference that makes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cycle {
    /// Modules as `a::b`, sorted.
    pub modules: Vec<String>,
    /// (from, to, "file:line: source line").
    pub edges: Vec<(String, String, String)>,
}

fn display(path: &[String]) -> String {
    if path.is_empty() {
        "crate".to_owned()
    } else {
        path.join("::")
    }
}

impl CrateGraph {
    /// Reads the crate whose root file (lib.rs, main.rs, src/bin/x.rs) is `root`.
    pub fn read(root: &Path) -> io::Result<Self> {
        let mut graph = Self::default();
        graph.modules.insert(Vec::new());
        let dir = root.parent().unwrap_or(Path::new(".")).to_path_buf();
        let mut todo = vec![(root.to_path_buf(), Vec::new(), dir)];
        while let Some((file, module, dir)) = todo.pop() {
            let src = fs::read_to_string(&file)?;
            let lines: Vec<&str> = src.lines().collect();
            let toks = lex::tokens(&lex::blank(&src));
            let scan = scan(&toks, &module);
            for inline in scan.inline {
                graph.modules.insert(inline);
            }
            for (child, within) in scan.declared {
                let child_dir = within.iter().fold(dir.clone(), |d, m| d.join(m));
                let name = child.last().cloned().unwrap_or_default();
                let flat = child_dir.join(format!("{name}.rs"));
                let nested = child_dir.join(&name).join("mod.rs");
                let found = if flat.is_file() {
                    flat
                } else if nested.is_file() {
                    nested
                } else {
                    graph.missing.push(flat.display().to_string());
                    continue;
                };
                graph.modules.insert(child.clone());
                todo.push((found, child, child_dir.join(&name)));
            }
            for (from, path, line) in scan.references {
                let text = lines.get(line - 1).map_or("", |l| l.trim()).to_owned();
                graph.references.push(Reference {
                    from,
                    path,
                    file: file.clone(),
                    line,
                    text,
                });
            }
        }
        graph
            .references
            .sort_by(|a, b| (&a.file, a.line).cmp(&(&b.file, b.line)));
        Ok(graph)
    }

    /// The deepest module of the tree that `path` names.
    fn resolve(&self, path: &[String]) -> ModPath {
        let mut at = Vec::new();
        for segment in path {
            at.push(segment.clone());
            if !self.modules.contains(&at) {
                at.pop();
                break;
            }
        }
        at
    }

    /// The sibling edges (see the module docs), each with its first reference.
    pub fn edges(&self) -> BTreeMap<(ModPath, ModPath), &Reference> {
        let mut edges = BTreeMap::new();
        for reference in &self.references {
            let to = self.resolve(&reference.path);
            let from = &reference.from;
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == to.len() {
                continue; // same module, or ancestor and descendant
            }
            let key = (from[..=common].to_vec(), to[..=common].to_vec());
            edges.entry(key).or_insert(reference);
        }
        edges
    }

    /// Every strongly connected component of more than one module, sorted.
    pub fn cycles(&self, workspace: &Path) -> Vec<Cycle> {
        let edges = self.edges();
        let mut next: BTreeMap<&ModPath, Vec<&ModPath>> = BTreeMap::new();
        for (from, to) in edges.keys() {
            next.entry(from).or_default().push(to);
        }
        let mut cycles: Vec<Cycle> = strongly_connected(&next)
            .into_iter()
            .filter(|scc| scc.len() > 1)
            .map(|scc| {
                let members: BTreeSet<&ModPath> = scc.into_iter().collect();
                let edges = edges
                    .iter()
                    .filter(|((f, t), _)| members.contains(f) && members.contains(t))
                    .map(|((f, t), r)| {
                        let file = r.file.strip_prefix(workspace).unwrap_or(&r.file);
                        let at = format!("{}:{}: {}", file.display(), r.line, r.text);
                        (display(f), display(t), at)
                    })
                    .collect();
                Cycle {
                    modules: members.into_iter().map(|m| display(m)).collect(),
                    edges,
                }
            })
            .collect();
        cycles.sort_by(|a, b| a.modules.cmp(&b.modules));
        cycles
    }
}

/// Tarjan's algorithm over a small graph (recursion depth is at most the module count).
fn strongly_connected<'a>(next: &BTreeMap<&'a ModPath, Vec<&'a ModPath>>) -> Vec<Vec<&'a ModPath>> {
    struct State<'a> {
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on_stack: BTreeSet<&'a ModPath>,
        out: Vec<Vec<&'a ModPath>>,
    }
    fn visit<'a>(
        v: &'a ModPath,
        next: &BTreeMap<&'a ModPath, Vec<&'a ModPath>>,
        s: &mut State<'a>,
    ) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for &w in next.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(w, next, s);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                scc.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(scc);
        }
    }
    let mut s = State {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in next.keys() {
        if !s.index.contains_key(v) {
            visit(v, next, &mut s);
        }
    }
    s.out
}

/// What one file declares and refers to.
#[derive(Default)]
struct Scan {
    /// Inline `mod x { … }` modules.
    inline: Vec<ModPath>,
    /// `mod x;` modules, with the inline modules (names) they sit in inside the file.
    declared: Vec<(ModPath, Vec<String>)>,
    /// (from module, absolute path, line).
    references: Vec<(ModPath, Vec<String>, usize)>,
}

fn ident(toks: &[Token], i: usize) -> Option<&str> {
    match toks.get(i).map(|t| &t.tok) {
        Some(Tok::Ident(s)) => Some(s),
        _ => None,
    }
}

fn punct(toks: &[Token], i: usize, c: char) -> bool {
    toks.get(i).is_some_and(|t| t.tok == Tok::Punct(c))
}

fn sep(toks: &[Token], i: usize) -> bool {
    toks.get(i).is_some_and(|t| t.tok == Tok::PathSep)
}

/// Scans one file's tokens; `module` is the file's module.
fn scan(toks: &[Token], module: &ModPath) -> Scan {
    let mut out = Scan::default();
    // Inline modules we are in: (name, brace depth inside it).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    let mut test_item = false;
    let mut i = 0;
    while i < toks.len() {
        let current = || {
            let mut m = module.clone();
            m.extend(inline.iter().map(|(n, _)| n.clone()));
            m
        };
        if punct(toks, i, '#') {
            // An attribute; `#![...]` (inner) applies to the enclosing item, never skips one.
            let inner = punct(toks, i + 1, '!');
            let open = if inner { i + 2 } else { i + 1 };
            if punct(toks, open, '[') {
                let close = matching(toks, open);
                let is_cfg_test = close == open + 5
                    && ident(toks, open + 1) == Some("cfg")
                    && punct(toks, open + 2, '(')
                    && ident(toks, open + 3) == Some("test")
                    && punct(toks, open + 4, ')');
                test_item |= is_cfg_test && !inner;
                i = close + 1;
                continue;
            }
        }
        if test_item {
            i = skip_item(toks, i);
            test_item = false;
            continue;
        }
        if ident(toks, i) == Some("mod")
            && let Some(name) = ident(toks, i + 1)
        {
            let mut child = current();
            child.push(name.to_owned());
            if punct(toks, i + 2, ';') {
                let within = inline.iter().map(|(n, _)| n.clone()).collect();
                out.declared.push((child, within));
                i += 3;
                continue;
            }
            if punct(toks, i + 2, '{') {
                depth += 1;
                inline.push((name.to_owned(), depth));
                out.inline.push(child);
                i += 3;
                continue;
            }
        }
        let starts_path = matches!(ident(toks, i), Some("crate" | "super" | "self"))
            && sep(toks, i + 1)
            && !(i > 0 && (sep(toks, i - 1) || punct(toks, i - 1, '$')));
        if starts_path {
            let from = current();
            let line = toks[i].line;
            let (paths, end) = use_tree(toks, i, Vec::new());
            for path in paths {
                if let Some(abs) = absolute(&from, &path) {
                    out.references.push((from.clone(), abs, line));
                }
            }
            i = end;
            continue;
        }
        if punct(toks, i, '{') {
            depth += 1;
        } else if punct(toks, i, '}') {
            if inline.last().is_some_and(|(_, d)| *d == depth) {
                inline.pop();
            }
            depth = depth.saturating_sub(1);
        }
        i += 1;
    }
    out
}

/// `crate::a::b` → `[a, b]`; `super::x` from `m::n` → `[m, x]`; `self::x` from `m` → `[m, x]`.
/// `None` for `super` above the root.
fn absolute(from: &ModPath, path: &[String]) -> Option<Vec<String>> {
    let (base, rest) = match path.first().map(String::as_str) {
        Some("crate") => (Vec::new(), &path[1..]),
        Some("self") => (from.clone(), &path[1..]),
        Some("super") => {
            let up = path.iter().take_while(|s| *s == "super").count();
            let keep = from.len().checked_sub(up)?;
            (from[..keep].to_vec(), &path[up..])
        }
        _ => return None,
    };
    let mut abs = base;
    // A `self` inside a use group names its prefix (`use crate::a::{self, B}`).
    abs.extend(rest.iter().filter(|s| *s != "self").cloned());
    Some(abs)
}

/// Reads a path starting at `i` (`a::b::c`, `a::{b, c::{d, e}}`, `a::*`), each leaf prefixed by
/// `prefix`; returns the leaves and the index after the path. Stops at anything else (`<` of
/// generics, `as`, `(`), which the caller then scans as ordinary code.
fn use_tree(toks: &[Token], mut i: usize, mut prefix: Vec<String>) -> (Vec<Vec<String>>, usize) {
    while let Some(segment) = ident(toks, i) {
        prefix.push(segment.to_owned());
        if !sep(toks, i + 1) {
            return (vec![prefix], i + 1);
        }
        i += 2;
    }
    if punct(toks, i, '{') {
        let mut leaves = Vec::new();
        i += 1;
        loop {
            if punct(toks, i, '}') {
                return (leaves, i + 1);
            }
            if punct(toks, i, ',') {
                i += 1;
                continue;
            }
            if ident(toks, i) == Some("as") {
                i += 2; // `x as y`: the alias is not a path
                continue;
            }
            let (more, end) = use_tree(toks, i, prefix.clone());
            if end == i {
                // Not a path (`*` or something unexpected): step over it.
                i += 1;
            } else {
                i = end;
            }
            leaves.extend(more);
        }
    }
    // Ends with `::` then `*`, `<` or nothing readable: the prefix is what it names.
    if prefix.is_empty() {
        return (Vec::new(), i);
    }
    (vec![prefix], i)
}

/// The index of the bracket closing the one at `open` (or the last token).
fn matching(toks: &[Token], open: usize) -> usize {
    let mut depth = 0usize;
    for (k, t) in toks.iter().enumerate().skip(open) {
        match t.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    toks.len().saturating_sub(1)
}

/// The index after the item starting at `i`: after its `;` or its closing `}`, whichever comes
/// first outside brackets. Stops before a `}` that closes an enclosing block (an attribute on
/// the last field or statement of one).
fn skip_item(toks: &[Token], i: usize) -> usize {
    let mut depth = 0usize;
    for (k, t) in toks.iter().enumerate().skip(i) {
        match t.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(c @ (')' | ']' | '}')) => {
                if depth == 0 {
                    return k;
                }
                depth -= 1;
                if depth == 0 && c == '}' {
                    return k + 1;
                }
            }
            Tok::Punct(';') if depth == 0 => return k + 1,
            _ => {}
        }
    }
    toks.len()
}

/// The crate roots under a member's `src/`: lib.rs, main.rs, bin/x.rs and bin/x/main.rs.
pub fn crate_roots(member: &Path) -> Vec<PathBuf> {
    let src = member.join("src");
    let mut roots: Vec<PathBuf> = ["lib.rs", "main.rs"]
        .iter()
        .map(|f| src.join(f))
        .filter(|p| p.is_file())
        .collect();
    if let Ok(bins) = fs::read_dir(src.join("bin")) {
        let mut bins: Vec<PathBuf> = bins
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter_map(|p| {
                if p.extension().is_some_and(|e| e == "rs") {
                    Some(p)
                } else {
                    Some(p.join("main.rs")).filter(|m| m.is_file())
                }
            })
            .collect();
        bins.sort();
        roots.extend(bins);
    }
    roots
}

/// The `members` of the workspace manifest at `root` (one quoted path a line, as ours is kept).
pub fn workspace_members(root: &Path) -> io::Result<Vec<PathBuf>> {
    let manifest = fs::read_to_string(root.join("Cargo.toml"))?;
    let mut members = Vec::new();
    let mut inside = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with("members") {
            inside = true;
        } else if inside && line.starts_with(']') {
            break;
        } else if inside && let Some(path) = line.trim_end_matches(',').strip_prefix('"') {
            members.push(root.join(path.trim_end_matches('"')));
        }
    }
    Ok(members)
}

/// A report of one crate's cycles, one block per cycle, for a test failure.
pub fn report(label: &str, cycles: &[Cycle]) -> String {
    let mut out = String::new();
    for cycle in cycles {
        let _ = writeln!(out, "{label}: cycle among {}", cycle.modules.join(", "));
        for (from, to, at) in &cycle.edges {
            let _ = writeln!(out, "    {from} -> {to}: {at}");
        }
    }
    out
}

#[cfg(test)]
mod tests;
