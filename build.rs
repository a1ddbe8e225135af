//! Compiles every `kernels/src/*.cu` into one CUDA fatbin (sm_80 + sm_90 SASS, compute_90 PTX) that
//! `src/cuda.rs` embeds with `include_bytes!`. The work is done by `gpuverbs-kernel-build`
//! (`crates/kernel-build`), the same helper users' crates call for their own kernels.
//!
//! nvcc is looked up in this order (see `gpuverbs_kernel_build::NvccSearch`):
//! 1. `$NVCC` (a path to the nvcc executable);
//! 2. `$CUDA_HOME/bin/nvcc`, then `$CUDA_PATH/bin/nvcc`;
//! 3. `nvcc` on `$PATH`;
//! 4. the project-local venv that `cargo xtask setup-cuda` fills:
//!    `.cuda/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc`;
//! 5. `/usr/local/cuda/bin/nvcc` (the toolkit installer's default prefix).
//!
//! Without nvcc the crate still builds: the embedded fatbin is empty, a `cargo:warning` says how to get
//! the kernels, and the GPU entry points return `CudaError::KernelsNotBuilt`. With
//! `GPUVERBS_REQUIRE_NVCC=1` a missing nvcc fails the build. When nvcc exists, any nvcc failure always
//! fails the build (with nvcc's output): kernels never disappear silently.
//!
//! Outputs (read by `src/cuda.rs`):
//! - `$OUT_DIR/gpuverbs-kernels.fatbin`: the fatbin, or an empty file when the kernels were not built;
//! - env `GPUVERBS_KERNELS_STATUS`: `built` or the reason they were not built;
//! - env `GPUVERBS_NVCC_COMMAND`: the nvcc command line used (empty when not built).

use gpuverbs_kernel_build::{one_line, require_nvcc_from_env, Kernels, Outcome};
use std::env;
use std::path::PathBuf;

/// Fails the build with `msg` (no backtrace noise: cargo prints the script's stderr).
macro_rules! fail {
    ($($arg:tt)*) => {{
        eprintln!("error: {}", format_args!($($arg)*));
        std::process::exit(1)
    }};
}

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let kernels = manifest_dir.join("kernels");
    let kernels_src = kernels.join("src");

    println!("cargo::rerun-if-changed=build.rs");

    // `$OUT_DIR/gpuverbs-kernels.fatbin`. The include directory is given by its path in this
    // tree (not `include_gpuverbs()`, which names the same directory through
    // crates/kernel-build), and only this tree's `.cuda` venv is searched.
    let outcome = Kernels::new()
        .manifest_dir(&manifest_dir)
        .sources_from_dir(&kernels_src)
        .include(kernels.join("include"))
        .out_name("gpuverbs-kernels")
        .cuda_venv(manifest_dir.join(".cuda"))
        .compile();

    let require_nvcc = require_nvcc_from_env();
    let (status, command) = match outcome {
        Err(e) => fail!("gpuverbs: {e}"),
        Ok(Outcome::NvccNotFound { searched }) => {
            let reason = format!("nvcc not found (searched: {searched})");
            if require_nvcc {
                fail!(
                    "GPUVERBS_REQUIRE_NVCC is set but the CUDA kernels cannot be built: {reason}.\n\
                     Install the pinned CUDA 13.0 compiler with `cargo xtask setup-cuda`, or point \
                     NVCC / CUDA_HOME at an nvcc."
                );
            }
            println!(
                "cargo::warning=gpuverbs: CUDA kernels were NOT built: {reason}. GPU entry points will \
                 return CudaError::KernelsNotBuilt. To build them run `cargo xtask setup-cuda` (or set \
                 NVCC / CUDA_HOME) and rebuild (`touch build.rs` forces the rebuild if nvcc appeared \
                 without a PATH change)."
            );
            // Not watching `.cuda/` here: a missing path makes cargo rebuild gpuverbs (and all its
            // dependents) on every build. `cargo xtask setup-cuda` touches build.rs instead, and a new
            // nvcc on PATH usually comes with a PATH change (watched).
            (reason, String::new())
        }
        Ok(Outcome::NoSources { .. }) => {
            if require_nvcc {
                fail!(
                    "GPUVERBS_REQUIRE_NVCC is set but {} has no *.cu files",
                    kernels_src.display()
                );
            }
            ("no kernels/src/*.cu files".to_string(), String::new())
        }
        Ok(Outcome::Built { command, .. }) => ("built".to_string(), command),
    };

    println!(
        "cargo::rustc-env=GPUVERBS_KERNELS_STATUS={}",
        one_line(&status)
    );
    println!(
        "cargo::rustc-env=GPUVERBS_NVCC_COMMAND={}",
        one_line(&command)
    );
}
