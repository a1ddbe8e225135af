//! `cargo xtask gpu-test`: build the GPU test binary here (with the kernels required) and put it
//! into `.gpu-bundle/` (ignored by git) with the emulation that runs it on the mlx5 backend (the
//! `gpuverbs` command and its preload library), ready to be carried to the GPU machine, which has
//! the NVIDIA driver and rdma-core's libraries but no cargo and no RDMA device.

use std::io::BufRead as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context as _, Result};

/// The bundle directory, relative to the workspace root.
pub const BUNDLE_DIR: &str = ".gpu-bundle";

/// Bundles travel to the GPU machine with a 64 MiB limit; stay well under it, with room for
/// the release samples beside it. (The kernels' fatbins for sm_80 and sm_90 are most of it:
/// 35 MiB in December 2026, with the GIN and scope cases; `tar -cJ` makes it about half.)
const MAX_BUNDLE_BYTES: u64 = 40 << 20;

const PACKAGE: &str = "gpuverbs-gpu-tests";
const BIN: &str = "gpu-test";
/// The emulation's pieces: (package, artifact target name, file name in the bundle).
const EMU: [(&str, &str, &str); 2] = [
    ("gpuverbs-command", "gpuverbs", "gpuverbs"),
    (
        "gpuverbs-uverbs-preload",
        "gpuverbs_uverbs_preload",
        "libgpuverbs_uverbs_preload.so",
    ),
];

pub fn run() -> Result<()> {
    let root = crate::workspace_root();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());

    println!("gpu-test: building {BIN} (release, GPUVERBS_REQUIRE_NVCC=1)");
    let mut child = Command::new(cargo)
        .current_dir(&root)
        .args(["build", "--release", "--package", PACKAGE, "--bin", BIN])
        .args(EMU.iter().flat_map(|(p, _, _)| ["--package", p]))
        .args(["--bin", EMU[0].1, "--lib"])
        .args(["--message-format", "json-render-diagnostics"])
        .env("GPUVERBS_REQUIRE_NVCC", "1")
        .stdout(Stdio::piped())
        .spawn()
        .context("starting cargo build")?;

    // The executable's path, from cargo's artifact messages (honours CARGO_TARGET_DIR and config).
    let mut executable: Option<PathBuf> = None;
    let mut emu: Vec<(PathBuf, &str)> = Vec::new();
    let stdout = child.stdout.take().context("cargo stdout")?;
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.context("reading cargo output")?;
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let name = msg["target"]["name"].as_str().unwrap_or("");
        if name == BIN {
            if let Some(exe) = msg["executable"].as_str() {
                executable = Some(PathBuf::from(exe));
            }
        }
        if let Some(&(_, _, file)) = EMU.iter().find(|(_, t, _)| *t == name) {
            let files = msg["filenames"].as_array().cloned().unwrap_or_default();
            if let Some(f) = files
                .iter()
                .filter_map(|f| f.as_str())
                .find(|f| f.ends_with(file) || (file == "gpuverbs" && f.ends_with("/gpuverbs")))
            {
                emu.push((PathBuf::from(f), file));
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
    strip(&dest)?;
    let mut size = std::fs::metadata(&dest)?.len();
    for (src, file) in &emu {
        let to = bundle.join(file);
        std::fs::copy(src, &to)
            .with_context(|| format!("copying {} to {}", src.display(), to.display()))?;
        strip(&to)?;
        size += std::fs::metadata(&to)?.len();
    }
    if emu.len() != EMU.len() {
        bail!("cargo did not report every emulation artifact: {emu:?}");
    }

    if size > MAX_BUNDLE_BYTES {
        bail!(
            "{} holds {:.1} MiB, over the {} MiB bundle budget (the carry limit is 64 MiB)",
            bundle.display(),
            size as f64 / (1 << 20) as f64,
            MAX_BUNDLE_BYTES >> 20
        );
    }

    println!(
        "gpu-test: bundled {} and the emulation ({:.1} MiB)",
        dest.display(),
        size as f64 / (1 << 20) as f64
    );
    println!(
        "gpu-test: on the GPU machine run, from the repository root, carrying `{BUNDLE_DIR}`:"
    );
    println!("    ./{BUNDLE_DIR}/{BIN}");
    println!(
        "    ./{BUNDLE_DIR}/gpuverbs emu --devices 2 -- ./{BUNDLE_DIR}/{BIN} --backend mlx5   \
         (the mlx5 backend through the real libibverbs + libmlx5 on emulated devices)"
    );
    println!("gpu-test: (device tool: command `./{BUNDLE_DIR}/{BIN}`, carry [\"{BUNDLE_DIR}\"])");
    println!("gpu-test: it prints `gpu-test: N passed, M failed` and exits non-zero on failure or without a GPU");
    Ok(())
}

/// Drops the symbol tables of a bundled binary (binutils' `strip`; what the GPU machine runs
/// needs none, and they are most of a release binary's size under the bundle budget).
fn strip(file: &std::path::Path) -> Result<()> {
    let status = Command::new("strip")
        .arg("--strip-unneeded")
        .arg(file)
        .status()
        .context("running strip (binutils) on the bundle")?;
    if !status.success() {
        bail!("strip {} failed ({status})", file.display());
    }
    Ok(())
}
