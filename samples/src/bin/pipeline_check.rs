//! Checks the CUDA pipeline end to end: loads the embedded fatbin, launches the self-test
//! kernel on a GPU and verifies every element it wrote.
//!
//! `pipeline_check [--gpu N]`

use anyhow::Context;
use clap::Parser;

#[derive(Parser)]
#[command(about = "Load the gpuverbs kernels and verify a launch on a GPU")]
struct Args {
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let fatbin = gpuverbs::cuda::parsed_fatbin().context("kernels")?;
    let targets: Vec<String> = fatbin.targets().iter().map(|t| t.to_string()).collect();
    println!("fatbin: {}", targets.join(", "));
    let report = gpuverbs::cuda::pipeline_check(args.gpu).context("GPU pipeline check")?;
    println!("{report}");
    Ok(())
}
