//! How big a source file is, in the lines that carry code: what `tests/sizes.rs` holds under a
//! bound, so that a file which has grown several jobs gets split before it is hard to read.
//!
//! Code lines are the lines with a token left after [`crate::lex::blank`] (comments and blank
//! lines do not count), up to the first top-level `#[cfg(test)]`: a file's unit tests sit at
//! its end by this workspace's convention and are not the code a reader has to hold.
//! Generated files (a `gen` directory, as `proto/src/gen`) are not counted; they are checked
//! against their generator elsewhere.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::lex;

/// The code lines of `src` (see the module's doc).
pub fn code_lines(src: &str) -> usize {
    let blanked = lex::blank(src);
    let mut n = 0;
    for line in blanked.lines() {
        // Only a column-0 attribute is the file's own test module; a nested `#[cfg(test)]`
        // item inside an impl or a function is indented.
        if line.starts_with("#[cfg(test)]") {
            break;
        }
        if !line.trim().is_empty() {
            n += 1;
        }
    }
    n
}

/// Every `.rs` file under `dir`, sorted, skipping `gen` directories.
pub fn rust_files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "gen") {
                    todo.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_blank_lines_and_the_test_module_do_not_count() {
        let src = "//! doc\n\nuse a::b;\n/* block\n   comment */\nfn f() {\n    let s = \"x\";\n}\n\
                   #[cfg(test)]\nmod tests {\n    fn t() {}\n}\n";
        assert_eq!(code_lines(src), 4);
    }

    #[test]
    fn an_indented_cfg_test_is_not_the_end() {
        let src = "impl A {\n    #[cfg(test)]\n    fn t() {}\n}\nfn g() {}\n";
        assert_eq!(code_lines(src), 5);
    }
}
