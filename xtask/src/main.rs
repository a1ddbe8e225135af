//! `cargo xtask`: project chores that are not part of any crate's build.
//!
//! - `setup`: install everything the tests need (Debian packages, then `setup-cuda`).
//! - `setup-cuda`: install the pinned CUDA 13.0 compiler wheels into `.cuda/`.
//! - `bindings [--check]`: regenerate (or check) the committed rdma-core bindings.
//! - `gpu-test`: build the GPU test bundle and print the `device` command that runs it.
//! - `fuzz [--seconds N] [--target T] [--seeds]`: run the fuzz targets (or rewrite their seeds).
//! - `sanitize [--full]`: tests under AddressSanitizer, the emulation under valgrind memcheck.
//! - `python`: build the Python package's wheel, run its tests, check its type stubs.
//! - `layers`: module circles in every crate, at folder and file level (none allowed).
//! - `loaded`: the AddressSanitizer subset and the soft NIC's timed suites beside a busy loop
//!   on every core.

mod bindings;
mod cuda;
mod fuzz;
mod gpu_test;
mod layers;
mod loaded;
mod python;
mod sanitize;
mod setup;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "gpuverbs project tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install everything the README's test command needs: the Debian packages (apt-get, as
    /// root, when missing), then the CUDA wheels.
    Setup,
    /// Install the pinned CUDA 13.0 wheels (nvcc, nvvm, crt, runtime, cccl) into `.cuda/`.
    SetupCuda,
    /// Regenerate `crates/rdma-core-sys/src/bindings.rs` from the installed rdma-core headers.
    Bindings {
        /// Fail instead of writing when the committed bindings are stale.
        #[arg(long)]
        check: bool,
    },
    /// Build the GPU test bundle into `.gpu-bundle/` and print the command for the GPU machine.
    GpuTest,
    /// Run every fuzz target of `fuzz/` (cargo-fuzz on nightly) from its seed corpus; fails on
    /// any finding.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u32,
        /// Only this target.
        #[arg(long)]
        target: Option<String>,
        /// Rewrite the seed corpora from the fixtures' traffic instead of fuzzing.
        #[arg(long)]
        seeds: bool,
    },
    /// The tests of prm, the soft NIC, the host API and the emulation under AddressSanitizer
    /// (nightly), and the emulation driven by libmlx5 under valgrind memcheck; fails on any
    /// report.
    Sanitize {
        /// Every test of those crates, not CI's subset.
        #[arg(long)]
        full: bool,
    },
    /// Build the Python package (`python/`) into a wheel, install it into `target/py-venv`,
    /// run its tests and check its type stubs.
    Python,
    Loaded,
    Layers,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup => setup::setup(),
        Cmd::SetupCuda => cuda::setup_cuda(),
        Cmd::Bindings { check } => bindings::run(check),
        Cmd::GpuTest => gpu_test::run(),
        Cmd::Fuzz {
            seconds,
            target,
            seeds,
        } => fuzz::run(seconds, target, seeds),
        Cmd::Sanitize { full } => sanitize::run(full),
        Cmd::Python => python::run_all(),
        Cmd::Loaded => loaded::run(),
        Cmd::Layers => layers::run(),
    }
}

/// The workspace root (the parent of this crate's manifest directory).
pub fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}
