//! The generated code in `src/gen/` is committed (no protoc at build time) and must match what
//! the `.proto` files produce. This test regenerates it and fails on any difference; run it with
//! `SPUR_REGENERATE=1` to rewrite the committed files after changing a `.proto`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

#[test]
fn generated_code_is_up_to_date() {
    check("routes.proto", "routes.rs");
    check("tunnel.proto", "spur.tunnel.v1.rs");
    check("jobs.proto", "spur.jobs.v1.rs");
    check("io.proto", "spur.io.v1.rs");
    check("l4.proto", "spur.l4.v1.rs");
    check("traffic.proto", "spur.traffic.v1.rs");
    check("history.proto", "spur.history.v1.rs");
}

fn check(proto: &str, generated_file: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fds = protox::compile([root.join(proto)], [root]).expect("the .proto compiles");
    let out = tempfile::tempdir().unwrap();
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(out.path())
        .compile_fds(fds)
        .expect("code generation");
    let generated = std::fs::read_to_string(out.path().join(generated_file)).unwrap();
    let committed_path = root.join("src/gen").join(generated_file);
    if std::env::var_os("SPUR_REGENERATE").is_some() {
        std::fs::write(&committed_path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    assert!(
        committed == generated,
        "proto/src/gen/{generated_file} is stale: run `SPUR_REGENERATE=1 cargo test -p spur-proto --test codegen` and commit the result"
    );
}
