//! Benchmarks: criterion micro-benchmarks live in `benches/`; this library holds the side-by-side
//! proxy benchmark: its runner ([`bench`], binary `spur-bench`), the load generator ([`load`],
//! binary `spur-load`) and the test upstream it drives traffic to ([`upstream`], binary
//! `spur-bench-upstream`).

pub mod bench;
pub mod load;
pub mod upstream;
