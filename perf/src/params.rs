//! Benchmark parameters from the environment (`SPUR_BENCH_*`).

/// The variable `name` as a number, or `default` when it is unset or not one.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
