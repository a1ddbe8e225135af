//! The CUDA driver seen from the emulation, without a GPU: a stand-in libcuda.so.1
//! (`tests/cuda/fake_libcuda.c`) and a probe (`tests/cuda/probe.c`) that finds the driver as the
//! CUDA runtime does (dlopen, dlsym, cuGetProcAddress) and as a linked program does, under
//! `gpuverbs emu`. The preload must hand the probe its wrappers: an emulated UAR page asked
//! for as I/O memory in two parts (a doorbell register each, as NVSHMEM's IBGDA asks) reaches
//! the driver once, as mapped host memory, and goes back to it with the last part's
//! unregister; a plain page reaches it as asked; the emulation's counters must count the four
//! rewrites; and the program's own
//! `dlsym(RTLD_NEXT, …)` must still start after the program (the preload defines `dlsym`).
//! (The dma-buf records are tested in `uverbs::dmabuf`, and end to end on the GPU machine.)
//!
//! Needs cc and rdma-core's headers (libibverbs-dev); CI installs them.

mod emu_util;
use emu_util::*;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// `cc ARGS`, in `dir`.
fn cc(dir: &Path, args: &[&str], what: &str) {
    need("cc", "gcc");
    let mut c = Command::new("cc");
    c.current_dir(dir).args(args);
    run(c, Duration::from_secs(120), what);
}

/// The fake driver and the probe, built into a folder of this test's.
fn build() -> PathBuf {
    let dir = tmp("cuda");
    std::fs::create_dir_all(&dir).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda");
    let (fake, probe) = (src.join("fake_libcuda.c"), src.join("probe.c"));
    cc(
        &dir,
        &[
            "-shared",
            "-fPIC",
            "-Wall",
            "-Werror",
            "-o",
            "libcuda.so.1",
            fake.to_str().unwrap(),
        ],
        "cc fake_libcuda.c",
    );
    cc(
        &dir,
        &[
            "-O1",
            "-Wall",
            "-Werror",
            "-o",
            "probe",
            probe.to_str().unwrap(),
            "-libverbs",
            "-lmlx5",
            "-ldl",
        ],
        "cc probe.c",
    );
    dir
}

#[test]
fn an_emulated_uar_page_registers_as_mapped_host_memory_whichever_way_the_driver_is_found() {
    let dir = build();
    let counters = dir.join("counters");
    let probe = dir.join("probe");
    let mut c = emu("127.0.190.1", Some(&counters), &[probe.to_str().unwrap()]);
    c.env("LD_LIBRARY_PATH", &dir);
    let out = run(
        c,
        Duration::from_secs(120),
        "the CUDA probe under gpuverbs emu",
    );
    assert!(out.contains("probe ok"), "{out}");
    assert!(out.contains("finds the preload's open"), "{out}");
    assert_eq!(
        out.matches("uar page as mapped host memory").count(),
        2,
        "{out}"
    );
    assert_eq!(
        out.matches("uar page unregistered with its last register")
            .count(),
        2,
        "{out}"
    );
    let text = std::fs::read_to_string(&counters).unwrap();
    assert!(
        text.lines().any(|l| l.starts_with("cuda iomem_uar=4 ")),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
