//! `cargo xtask setup-cuda`: install the pinned CUDA 13.0 compiler wheels into `.cuda/` (a Python
//! venv, ignored by git), where gpuverbs' build.rs finds nvcc when no other CUDA is installed.
//!
//! The versions are pinned together: a newer nvvm emits PTX that the 13.0 ptxas rejects, and the GPU
//! machine's driver (580) is CUDA 13.0. Running it again is cheap: an existing venv is reused and pip
//! leaves satisfied pins alone.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context as _, Result};

/// The wheels, exactly.
pub const WHEELS: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
];

/// The venv directory, relative to the workspace root.
pub const VENV_DIR: &str = ".cuda";

pub fn setup_cuda() -> Result<()> {
    let root = crate::workspace_root();
    let venv = root.join(VENV_DIR);
    let python = venv.join("bin").join("python");

    if python.exists() {
        println!("setup-cuda: reusing the venv {}", venv.display());
    } else {
        println!("setup-cuda: creating a venv in {}", venv.display());
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv)).context(
            "creating the venv (needs python3 with the venv module; Debian: python3-venv)",
        )?;
    }

    println!("setup-cuda: pip install {}", WHEELS.join(" "));
    run(Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
        ])
        .args(WHEELS))
    .context("installing the CUDA wheels")?;

    let nvcc = find_venv_nvcc(&venv).with_context(|| {
        format!(
            "pip succeeded but no nvcc under {}/lib/python3.*/site-packages/nvidia/cu13/bin",
            venv.display()
        )
    })?;
    let out = Command::new(&nvcc)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", nvcc.display()))?;
    if !out.status.success() {
        bail!(
            "{} --version failed: {}{}",
            nvcc.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let version = String::from_utf8_lossy(&out.stdout);
    let release = version
        .lines()
        .find(|l| l.contains("release"))
        .unwrap_or("(no release line)")
        .trim();

    // build.rs does not watch `.cuda/` (a missing watched path would rebuild gpuverbs on every
    // build); bump build.rs's mtime so that the next build picks the new nvcc up.
    touch(&root.join("build.rs"))?;

    println!("setup-cuda: nvcc {}", nvcc.display());
    println!("setup-cuda: {release}");
    println!("setup-cuda: done; the next `cargo build` compiles the kernels with it");
    Ok(())
}

/// `<venv>/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc`: the very search build.rs does (both
/// use gpuverbs-kernel-build).
pub use gpuverbs_kernel_build::find_venv_nvcc;

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

fn touch(path: &Path) -> Result<()> {
    let file = std::fs::File::options()
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    file.set_modified(std::time::SystemTime::now())
        .with_context(|| format!("touching {}", path.display()))
}
