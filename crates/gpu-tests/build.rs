//! Compiles the suite's own kernels, `kernels/*.cu`, against the gpuverbs device API into
//! `$OUT_DIR/gpu_tests_kernels.fatbin`, which the `gpu-test` binary embeds and loads into the
//! context gpuverbs opened (`dataplane::launch_own`). They live here, not in the library's
//! fatbin, so that neither the library's users nor the `gpuverbs` command carry them. Without
//! nvcc the file is empty and the cases that need it fail saying so
//! (`GPUVERBS_REQUIRE_NVCC=1` makes that a build error, as `cargo xtask gpu-test` sets it).
//!
//! With `GPUNETIO_SRC` set to a checkout of NVIDIA's GPUNetIO (github.com/NVIDIA-DOCA/gpunetio;
//! an input of the build, never part of this repository), its device headers are included too
//! and `-DGPUVERBS_WITH_GPUNETIO` is defined: the `gpunetio_counter` case then runs NVIDIA's
//! `put_counter` next to gpuverbs' (`kernels/gpunetio_counter.cu`, with the repository's
//! `kernels/gpunetio/doca_qp.cuh`); without it the case skips.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=GPUNETIO_SRC");
    let mut k = gpuverbs_kernel_build::Kernels::new()
        .sources_from_dir("kernels")
        .include_gpuverbs()
        .out_name("gpu_tests_kernels");
    let gpunetio = std::env::var_os("GPUNETIO_SRC").filter(|s| !s.is_empty());
    if let Some(src) = &gpunetio {
        let inc = std::path::Path::new(src).join("include");
        if !inc
            .join("device/doca_gpunetio_dev_verbs_counter.cuh")
            .is_file()
        {
            eprintln!(
                "error: GPUNETIO_SRC={}: no include/device/doca_gpunetio_dev_verbs_counter.cuh",
                inc.display()
            );
            std::process::exit(1);
        }
        // kernels/gpunetio/doca_qp.cuh: a gpuverbs QP in GPUNetIO's layout, shared with
        // gpu_bench's `gpunetio` series (samples/build.rs).
        k = k
            .include(gpuverbs_kernel_build::gpuverbs_root().join("kernels/gpunetio"))
            .include(&inc)
            .include(inc.join("device"))
            .include(inc.join("common"))
            .nvcc_arg("-DGPUVERBS_WITH_GPUNETIO=1");
    }
    println!(
        "cargo::rustc-env=GPU_TESTS_GPUNETIO={}",
        gpunetio
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    );
    if let Err(e) = k.build() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
