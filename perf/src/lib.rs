//! Benchmarks: criterion micro-benchmarks live in `benches/`; this library holds the side-by-side
//! proxy benchmark: its runner ([`bench`], binary `spur-bench`), the load generator ([`load`],
//! binary `spur-load`) and the test upstream it drives traffic to ([`upstream`], binary
//! `spur-bench-upstream`); and what benches share: the set-up of those on a real kube-apiserver
//! ([`kube_bench`]) and their parameters ([`params`]).

pub mod bench;
pub mod kube_bench;
pub mod load;
pub mod params;
pub mod upstream;
