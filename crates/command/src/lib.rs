//! The library half of the `gpuverbs` command: what its subcommands compute, apart from
//! argument parsing and printing (`src/main.rs`).
//!
//! - [`doctor`]: `gpuverbs doctor [--json] [--gpu]`, what gpuverbs will do on this machine and why.
//! - [`plot`]: `gpuverbs plot`, the SVG plots of the samples' `--json` output.

pub mod doctor;
pub mod plot;
