//! Compiles the suite's own kernels, `kernels/*.cu`, against the gpuverbs device API into
//! `$OUT_DIR/gpu_tests_kernels.fatbin`, which the `gpu-test` binary embeds and loads into the
//! context gpuverbs opened (`dataplane::launch_own`). They live here, not in the library's
//! fatbin, so that neither the library's users nor the `gpuverbs` command carry them. Without
//! nvcc the file is empty and the cases that need it fail saying so
//! (`GPUVERBS_REQUIRE_NVCC=1` makes that a build error, as `cargo xtask gpu-test` sets it).

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    if let Err(e) = gpuverbs_kernel_build::Kernels::new()
        .sources_from_dir("kernels")
        .include_gpuverbs()
        .out_name("gpu_tests_kernels")
        .build()
    {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
