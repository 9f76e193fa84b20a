//! Writes the CRD manifests of Spur's API to `charts/spur/crds/` (or `--out DIR`); with
//! `--check`, writes nothing and exits 1 when the committed files are stale.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use spur_api::crdgen;

const USAGE: &str = "usage: spur-crdgen [--check] [--out DIR]";

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("spur-crdgen: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<ExitCode> {
    let mut check = false;
    let mut out = crdgen::default_dir();
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--check") => check = true,
            Some("--out") => out = PathBuf::from(args.next().context("--out needs a directory")?),
            Some("-h" | "--help") => {
                println!("{USAGE}");
                return Ok(ExitCode::SUCCESS);
            }
            _ => bail!("unexpected argument {arg:?}\n{USAGE}"),
        }
    }

    if check {
        let stale = crdgen::check(&out)?;
        if stale.is_empty() {
            return Ok(ExitCode::SUCCESS);
        }
        for s in &stale {
            eprintln!("{}: {s}", out.display());
        }
        eprintln!(
            "CRD manifests are stale; regenerate with `cargo run -p spur-api --bin spur-crdgen` and commit the result (see `git diff {}`)",
            out.display()
        );
        return Ok(ExitCode::FAILURE);
    }

    for path in crdgen::write_all(&out)? {
        println!("{}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}
