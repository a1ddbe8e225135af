//! `cargo xtask gpu-test`: build the GPU test binary here (with the kernels required) and put it,
//! alone, into `.gpu-bundle/` (ignored by git), ready to be carried to the GPU machine, which has the
//! NVIDIA driver but no cargo.

use std::io::BufRead as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context as _, Result};

/// The bundle directory, relative to the workspace root.
pub const BUNDLE_DIR: &str = ".gpu-bundle";

/// Bundles travel to the GPU machine with a 64 MiB limit; stay well under it.
const MAX_BUNDLE_BYTES: u64 = 32 << 20;

const PACKAGE: &str = "gpuverbs-gpu-tests";
const BIN: &str = "gpu-test";

pub fn run() -> Result<()> {
    let root = crate::workspace_root();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());

    println!("gpu-test: building {BIN} (release, GPUVERBS_REQUIRE_NVCC=1)");
    let mut child = Command::new(cargo)
        .current_dir(&root)
        .args(["build", "--release", "--package", PACKAGE, "--bin", BIN])
        .args(["--message-format", "json-render-diagnostics"])
        .env("GPUVERBS_REQUIRE_NVCC", "1")
        .stdout(Stdio::piped())
        .spawn()
        .context("starting cargo build")?;

    // The executable's path, from cargo's artifact messages (honours CARGO_TARGET_DIR and config).
    let mut executable: Option<PathBuf> = None;
    let stdout = child.stdout.take().context("cargo stdout")?;
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.context("reading cargo output")?;
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if msg["reason"] == "compiler-artifact" && msg["target"]["name"] == BIN {
            if let Some(exe) = msg["executable"].as_str() {
                executable = Some(PathBuf::from(exe));
            }
        }
    }
    let status = child.wait().context("waiting for cargo build")?;
    if !status.success() {
        bail!("cargo build of {BIN} failed ({status}); see the errors above");
    }
    let executable = executable.with_context(|| format!("cargo built nothing named {BIN}"))?;

    let bundle = root.join(BUNDLE_DIR);
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle)
            .with_context(|| format!("clearing {}", bundle.display()))?;
    }
    std::fs::create_dir_all(&bundle).with_context(|| format!("creating {}", bundle.display()))?;
    let dest = bundle.join(BIN);
    std::fs::copy(&executable, &dest)
        .with_context(|| format!("copying {} to {}", executable.display(), dest.display()))?;

    let size = std::fs::metadata(&dest)?.len();
    if size > MAX_BUNDLE_BYTES {
        bail!(
            "{} is {:.1} MiB, over the {} MiB bundle budget (the carry limit is 64 MiB)",
            dest.display(),
            size as f64 / (1 << 20) as f64,
            MAX_BUNDLE_BYTES >> 20
        );
    }

    println!(
        "gpu-test: bundled {} ({:.1} MiB)",
        dest.display(),
        size as f64 / (1 << 20) as f64
    );
    println!(
        "gpu-test: on the GPU machine run, from the repository root, carrying `{BUNDLE_DIR}`:"
    );
    println!("    ./{BUNDLE_DIR}/{BIN}");
    println!("gpu-test: (device tool: command `./{BUNDLE_DIR}/{BIN}`, carry [\"{BUNDLE_DIR}\"])");
    println!("gpu-test: it prints `gpu-test: N passed, M failed` and exits non-zero on failure or without a GPU");
    Ok(())
}
