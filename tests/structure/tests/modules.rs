//! No module cycles: in every workspace crate (every root under `src/`: lib.rs, main.rs,
//! bin/*), the modules that are neither ancestor nor descendant of each other refer to each
//! other one way only. See `spur_structure::modules` for what counts as a reference and the
//! scanner's limits. A failure names each edge of the cycle with the first line that makes it:
//! move that item (or that `use`) to where it belongs.

use std::path::Path;

use spur_structure::modules::{CrateGraph, crate_roots, report, workspace_members};

#[test]
fn no_module_cycles() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let workspace = workspace.canonicalize().unwrap();
    let members = workspace_members(&workspace).unwrap();
    assert!(members.len() > 20, "workspace members: {members:?}");
    let mut reports = String::new();
    let mut missing = Vec::new();
    let mut roots = 0;
    for member in &members {
        for root in crate_roots(member) {
            roots += 1;
            let graph = CrateGraph::read(&root).unwrap();
            missing.extend(graph.missing.iter().cloned());
            let label = root.strip_prefix(&workspace).unwrap().display().to_string();
            let cycles = graph.cycles(&workspace);
            reports.push_str(&report(&label, &cycles));
        }
    }
    assert!(roots > members.len(), "crate roots read: {roots}");
    assert!(missing.is_empty(), "`mod x;` without a file: {missing:?}");
    assert!(reports.is_empty(), "module cycles:\n{reports}");
}
