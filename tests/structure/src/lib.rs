//! Structure tests of the source tree: a small, std-only reader of the workspace's Rust sources
//! that builds each crate's module graph (`tests/modules.rs` asserts it has no cycles) and
//! counts the code lines of each file (`tests/sizes.rs` holds them under a bound), and finds
//! where the operator's controllers read the API server directly (`tests/reads.rs`).
//! `tests/docs.rs` holds docs/install.md's list of what the chart installs to the chart.
//!
//! It is a line-and-token scanner, not a Rust parser: [`lex`] blanks comments and literals and
//! cuts the rest into tokens, [`modules`] follows `mod` declarations and `crate::` / `super::` /
//! `self::` paths. Its limits are listed where they apply.

pub mod lex;
pub mod modules;
pub mod reads;
pub mod sizes;
