//! The descriptor set the decoder uses: `envoy-types`' `src/generated/types.bin` (the
//! `FileDescriptorSet` its Rust types are generated from, which the crate does not expose),
//! stripped of `source_code_info` by [`strip`]. Regenerated after an `envoy-types` upgrade with
//!
//! ```text
//! cargo test -p spur-envoy --lib descriptors::tests::regenerate -- --ignored
//! ```
//!
//! and `descriptors_match_the_locked_envoy_types` fails until that is done.

use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, Value};

/// `descriptors.bin`.
pub static DESCRIPTORS: &[u8] = include_bytes!("descriptors.bin");

/// `full` (a `google.protobuf.FileDescriptorSet`) without the files' `source_code_info`
/// (comments and source spans: four fifths of the size, and of the memory once loaded).
/// Everything else is kept, options included: it goes through a dynamic message, which keeps
/// the fields it does not know (the PGV `validate.rules` and `udpa` annotations are extensions
/// of the option messages), where `prost_types` would drop them.
pub fn strip(full: &[u8]) -> Result<Vec<u8>, String> {
    let pool = DescriptorPool::decode(full).map_err(|e| e.to_string())?;
    let set = pool
        .get_message_by_name("google.protobuf.FileDescriptorSet")
        .or_else(|| {
            DescriptorPool::global().get_message_by_name("google.protobuf.FileDescriptorSet")
        })
        .ok_or("no google.protobuf.FileDescriptorSet descriptor")?;
    let mut set = DynamicMessage::decode(set, full).map_err(|e| e.to_string())?;
    let Some(Value::List(files)) = set.get_field_by_name_mut("file") else {
        return Err("a FileDescriptorSet without files".into());
    };
    for f in files {
        if let Some(f) = f.as_message_mut() {
            f.clear_field_by_name("source_code_info");
        }
    }
    Ok(set.encode_to_vec())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// `src/generated/types.bin` of the `envoy-types` version in Cargo.lock, in cargo's
    /// registry sources (`$CARGO_HOME/registry/src/<index>/envoy-types-<version>/`, what cargo
    /// builds from); `None` if cargo has not unpacked it.
    fn locked_types_bin() -> Option<PathBuf> {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let lock = std::fs::read_to_string(root.join("Cargo.lock")).unwrap();
        let version = lock
            .split("[[package]]")
            .find(|p| p.contains("name = \"envoy-types\"\n"))
            .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = \"")))
            .and_then(|v| v.strip_suffix('"'))
            .expect("envoy-types is in Cargo.lock");
        let home = std::env::var_os("CARGO_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
        std::fs::read_dir(home.join("registry/src"))
            .ok()?
            .filter_map(Result::ok)
            .map(|index| {
                index
                    .path()
                    .join(format!("envoy-types-{version}/src/generated/types.bin"))
            })
            .find(|p| p.exists())
    }

    #[test]
    fn descriptors_match_the_locked_envoy_types() {
        let Some(bin) = locked_types_bin() else {
            eprintln!(
                "SKIPPED: cargo has no copy of the locked envoy-types' src/generated/types.bin to compare descriptors.bin with"
            );
            return;
        };
        let full = std::fs::read(&bin).unwrap();
        let want = strip(&full).unwrap();
        assert!(
            want == DESCRIPTORS,
            "controlplane/envoy/src/descriptors.bin is not {} stripped: regenerate it (see controlplane/envoy/README.md)",
            bin.display()
        );
    }

    #[test]
    #[ignore = "writes src/descriptors.bin from the locked envoy-types"]
    fn regenerate() {
        let bin = locked_types_bin().expect("the locked envoy-types is downloaded (cargo fetch)");
        let stripped = strip(&std::fs::read(&bin).unwrap()).unwrap();
        let to = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/descriptors.bin");
        std::fs::write(&to, &stripped).unwrap();
        eprintln!(
            "{} → {} ({} bytes)",
            bin.display(),
            to.display(),
            stripped.len()
        );
    }
}
