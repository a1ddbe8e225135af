//! gpu_bench's `gpunetio` series runs NVIDIA GPUNetIO's own device code next to gpuverbs'
//! (`kernels/gpunetio_bench.cu`). With `GPUNETIO_SRC` set to a checkout of NVIDIA's GPUNetIO
//! (github.com/NVIDIA-DOCA/gpunetio; an input of the build, never part of this repository), as
//! for `crates/gpu-tests/build.rs`: that file is compiled against the gpuverbs device API, the
//! repository's `kernels/gpunetio/doca_qp.cuh` and GPUNetIO's device headers, with
//! `-DGPUVERBS_WITH_GPUNETIO`, into `$OUT_DIR/gpu_bench_gpunetio.fatbin`, which gpu_bench embeds
//! and loads into the context gpuverbs opened (nvcc is then required). Without it the file is
//! empty, nvcc is not run, and the series fails saying how to build it. The samples' other
//! kernels are the library's (`kernels/src`, embedded in the `gpuverbs` crate).

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=GPUNETIO_SRC");
    let gpunetio = std::env::var_os("GPUNETIO_SRC").filter(|s| !s.is_empty());
    println!(
        "cargo::rustc-env=GPU_BENCH_GPUNETIO={}",
        gpunetio
            .as_ref()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    );
    let k = gpuverbs_kernel_build::Kernels::new()
        .source("kernels/gpunetio_bench.cu")
        .include_gpuverbs()
        .out_name("gpu_bench_gpunetio");
    let Some(src) = gpunetio else {
        // No GPUNetIO: an empty fatbin, no nvcc.
        let out = k.fatbin_path().unwrap_or_else(|e| fail(&e.to_string()));
        std::fs::write(&out, b"").unwrap_or_else(|e| fail(&format!("{}: {e}", out.display())));
        return;
    };
    let inc = std::path::Path::new(&src).join("include");
    if !inc
        .join("device/doca_gpunetio_dev_verbs_onesided.cuh")
        .is_file()
    {
        fail(&format!(
            "GPUNETIO_SRC={}: no include/device/doca_gpunetio_dev_verbs_onesided.cuh",
            std::path::Path::new(&src).display()
        ));
    }
    let k = k
        .include(gpuverbs_kernel_build::gpuverbs_root().join("kernels/gpunetio"))
        .include(&inc)
        .include(inc.join("device"))
        .include(inc.join("common"))
        .nvcc_arg("-DGPUVERBS_WITH_GPUNETIO=1")
        // GPUNETIO_SRC asks for the kernel: no nvcc is an error, not an empty fatbin.
        .require_nvcc(true);
    if let Err(e) = k.build() {
        fail(&e.to_string());
    }
}

/// Fails the build with `msg` (cargo prints the script's stderr).
fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1)
}
