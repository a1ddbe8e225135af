//! CUDA side of the host: the kernels embedded at build time, the driver (loaded at run time through
//! cudarc), and a pipeline self-test.
//!
//! `build.rs` compiles every `kernels/src/*.cu` into one fatbin (sm_80 and sm_90 SASS, compute_90
//! PTX) and this module embeds it. When the crate was built without nvcc the fatbin is absent and
//! every GPU entry point returns [`CudaError::KernelsNotBuilt`]; run `cargo xtask setup-cuda` and
//! rebuild to get it.
//!
//! The CUDA driver (`libcuda`) is loaded at run time: nothing here needs CUDA to build or to run the
//! CPU paths. cudarc's loader panics when `libcuda` is missing (or lacks a symbol), so every driver
//! use goes through a guard that first probes for the library ([`driver_available`]) and then runs
//! the driver calls under `catch_unwind`, turning both cases into typed errors
//! ([`CudaError::NoDriver`], [`CudaError::DriverPanicked`]).

use std::ffi::{c_void, CString};
use std::fmt;
use std::sync::Arc;

use cudarc::driver::result::DriverError;
use cudarc::driver::{sys, CudaContext, DevicePtrMut};

use crate::fatbin::{self, Fatbin, FatbinError, Target};

/// How to get the kernels when they were not built (part of [`CudaError::KernelsNotBuilt`]'s text).
pub const KERNELS_HINT: &str =
    "run `cargo xtask setup-cuda` (installs the pinned CUDA 13.0 nvcc into \
                                .cuda/) or set NVCC / CUDA_HOME, then rebuild gpuverbs";

/// Targets every build of the kernels carries.
pub const REQUIRED_TARGETS: [Target; 3] = [Target::elf(80), Target::elf(90), Target::ptx(90)];

/// The kernel [`pipeline_check`] launches (`kernels/src/selftest.cu`).
pub const SELFTEST_KERNEL: &str = "gpuverbs_selftest_fill";

/// Elements [`pipeline_check`] writes and verifies (4 MiB of `u32`).
pub const SELFTEST_ELEMENTS: u32 = 1 << 20;

/// Errors of the CUDA layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// gpuverbs was built without nvcc, so no kernels are embedded.
    #[error("gpuverbs' CUDA kernels were not built ({reason}); {KERNELS_HINT}")]
    KernelsNotBuilt {
        /// Why build.rs did not build them.
        reason: &'static str,
    },
    /// The embedded fatbin does not parse.
    #[error("the embedded kernel fatbin is malformed: {0}")]
    Fatbin(#[from] FatbinError),
    /// `libcuda` could not be loaded: no NVIDIA driver on this machine (or not on the loader path).
    #[error(
        "no CUDA driver: libcuda could not be loaded (is the NVIDIA driver installed, and is \
         libcuda.so.1 on the dynamic loader path / LD_LIBRARY_PATH?)"
    )]
    NoDriver,
    /// cudarc panicked while talking to the driver (typically a driver older than the CUDA 13.0 API
    /// the bindings were generated for, missing a symbol).
    #[error("the CUDA driver bindings panicked during {op}: {message} (is the driver at least CUDA 13.0?)")]
    DriverPanicked {
        /// What was being done.
        op: &'static str,
        /// The panic message.
        message: String,
    },
    /// A driver call failed.
    #[error("CUDA driver call failed: {op}: {source}")]
    Driver {
        /// What was being done.
        op: &'static str,
        /// The driver's error code.
        #[source]
        source: DriverError,
    },
    /// The requested device does not exist.
    #[error("no CUDA device with ordinal {ordinal} ({count} device(s) visible)")]
    NoDevice {
        /// The requested ordinal.
        ordinal: usize,
        /// Devices the driver sees.
        count: usize,
    },
    /// A kernel's output differed from what the host computed.
    #[error(
        "{kernel} produced wrong data: {mismatches} of {checked} elements differ; first at index \
         {first_index}: expected {expected:#010x}, got {got:#010x}"
    )]
    Mismatch {
        /// The kernel.
        kernel: &'static str,
        /// Elements checked.
        checked: usize,
        /// Elements that differ.
        mismatches: usize,
        /// The first differing index.
        first_index: usize,
        /// The value expected there.
        expected: u32,
        /// The value found there.
        got: u32,
    },
}

/// Wraps a `DriverError` with what was being done.
pub(crate) fn drv(op: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { op, source }
}

// ---------------------------------------------------------------------------------------------
// Embedded kernels
// ---------------------------------------------------------------------------------------------

/// Bytes with the alignment the driver wants for an in-memory fatbin image (8; 16 to be generous).
#[repr(C, align(16))]
struct Aligned<B: ?Sized>(B);

/// The fatbin build.rs produced (empty when the kernels were not built).
static EMBEDDED_FATBIN: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(
    env!("OUT_DIR"),
    "/gpuverbs-kernels.fatbin"
)));

/// `built`, or why build.rs did not build the kernels.
const KERNELS_STATUS: &str = env!("GPUVERBS_KERNELS_STATUS");

/// The nvcc command line build.rs ran (empty when the kernels were not built).
pub const NVCC_COMMAND: &str = env!("GPUVERBS_NVCC_COMMAND");

/// Whether this build of gpuverbs embeds its CUDA kernels.
pub fn kernels_built() -> bool {
    !EMBEDDED_FATBIN.0.is_empty()
}

/// The embedded kernel fatbin, or [`CudaError::KernelsNotBuilt`]. The slice is 16-byte aligned.
pub fn fatbin() -> Result<&'static [u8], CudaError> {
    if kernels_built() {
        Ok(&EMBEDDED_FATBIN.0)
    } else {
        Err(CudaError::KernelsNotBuilt {
            reason: KERNELS_STATUS,
        })
    }
}

/// The embedded fatbin, parsed.
pub fn parsed_fatbin() -> Result<Fatbin<'static>, CudaError> {
    Ok(fatbin::parse(fatbin()?)?)
}

// ---------------------------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------------------------

pub use softnic_cuda::driver_available;

/// Runs `f`, which uses the driver through cudarc, after checking the driver exists; a panic in
/// cudarc (missing library or symbol) becomes [`CudaError::DriverPanicked`].
pub(crate) fn with_driver<T>(
    op: &'static str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    if !driver_available() {
        return Err(CudaError::NoDriver);
    }
    catch_driver_panic(op, f)
}

/// Runs `f`, turning a panic into [`CudaError::DriverPanicked`]. (The panic hook still prints the
/// panic message to stderr.)
fn catch_driver_panic<T>(
    op: &'static str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    match softnic_cuda::catch_panic(f) {
        Ok(result) => result,
        Err(message) => Err(CudaError::DriverPanicked { op, message }),
    }
}

/// The CUDA driver version, e.g. 13.0 (from `cuDriverGetVersion`, which encodes 1000 * major + 10 *
/// minor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DriverVersion {
    /// The raw value, e.g. 13000.
    pub raw: i32,
}

impl DriverVersion {
    /// Major version (13 for 13000).
    pub fn major(self) -> i32 {
        self.raw / 1000
    }

    /// Minor version (0 for 13000).
    pub fn minor(self) -> i32 {
        (self.raw % 1000) / 10
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major(), self.minor())
    }
}

/// What the driver says about one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)`.
    pub compute_capability: (i32, i32),
    /// The CUDA version the installed driver supports.
    pub driver_version: DriverVersion,
    /// Devices the driver sees.
    pub device_count: usize,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "device {} {} (sm_{major}{minor}), driver CUDA {}",
            self.ordinal, self.name, self.driver_version
        )
    }
}

/// Initialises the driver and opens the primary context of device `ordinal`.
pub(crate) fn open(ordinal: usize) -> Result<(Arc<CudaContext>, DeviceInfo), CudaError> {
    let count = match CudaContext::device_count() {
        Ok(n) => usize::try_from(n).unwrap_or(0),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => 0,
        Err(e) => return Err(drv("cuInit / cuDeviceGetCount")(e)),
    };
    if ordinal >= count {
        return Err(CudaError::NoDevice { ordinal, count });
    }
    let ctx = CudaContext::new(ordinal).map_err(drv("retain the primary context"))?;
    let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
    let compute_capability = ctx
        .compute_capability()
        .map_err(drv("compute capability"))?;
    let mut raw = 0i32;
    // SAFETY: cuDriverGetVersion writes one int through a valid pointer; the driver is loaded (we run
    // under `with_driver`) and initialised (`device_count` called cuInit).
    unsafe { sys::cuDriverGetVersion(&mut raw) }
        .result()
        .map_err(drv("cuDriverGetVersion"))?;
    let info = DeviceInfo {
        ordinal,
        name,
        compute_capability,
        driver_version: DriverVersion { raw },
        device_count: count,
    };
    Ok((ctx, info))
}

/// Queries device `ordinal` (name, compute capability, driver version).
pub fn device_info(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    with_driver("device query", || open(ordinal).map(|(_, info)| info))
}

/// A module loaded into a context from an in-memory image; unloaded on drop (errors ignored: drop
/// never panics).
pub(crate) struct Module {
    ctx: Arc<CudaContext>,
    raw: sys::CUmodule,
}

impl Module {
    /// Loads `image` (a fatbin, cubin or NUL-terminated PTX) into `ctx`.
    pub(crate) fn load(ctx: &Arc<CudaContext>, image: &'static [u8]) -> Result<Self, CudaError> {
        ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: `image` is a complete fatbin that `fatbin::parse` accepted (the driver validates it
        // too), 16-byte aligned, and 'static, so it outlives the call (the driver copies it anyway).
        let raw =
            unsafe { cudarc::driver::result::module::load_data(image.as_ptr().cast::<c_void>()) }
                .map_err(drv("cuModuleLoadData (embedded fatbin)"))?;
        Ok(Module {
            ctx: ctx.clone(),
            raw,
        })
    }

    pub(crate) fn function(&self, name: &str) -> Result<sys::CUfunction, CudaError> {
        let cname = CString::new(name).expect("kernel names have no NUL");
        // SAFETY: `self.raw` is a loaded module, unloaded only in `drop`.
        unsafe { cudarc::driver::result::module::get_function(self.raw, cname) }
            .map_err(drv("cuModuleGetFunction"))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `self.raw` was loaded by `Module::load` and is unloaded exactly once, here; no
            // function of it is used after the module is dropped (they do not escape this file).
            let _ = unsafe { cudarc::driver::result::module::unload(self.raw) };
        }
    }
}

/// What [`pipeline_check`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineReport {
    /// The device that ran the kernel.
    pub device: DeviceInfo,
    /// The kernel launched.
    pub kernel: &'static str,
    /// Elements written by the GPU and verified by the host (all of them, exactly).
    pub elements_checked: usize,
    /// The targets in the embedded fatbin.
    pub fatbin_targets: Vec<Target>,
    /// Size of the embedded fatbin.
    pub fatbin_bytes: usize,
}

impl fmt::Display for PipelineReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let targets: Vec<String> = self.fatbin_targets.iter().map(Target::to_string).collect();
        write!(
            f,
            "{}; {} verified {} elements; fatbin {} bytes [{}]",
            self.device,
            self.kernel,
            self.elements_checked,
            self.fatbin_bytes,
            targets.join(", ")
        )
    }
}

/// The value `gpuverbs_selftest_fill` writes at index `i` (mirrors `gpuverbs_selftest_value` in
/// `kernels/include/gpuverbs/gpuverbs.cuh`).
pub fn selftest_value(seed: u32, i: u32) -> u32 {
    seed ^ i.wrapping_mul(2_654_435_761)
}

/// End-to-end check of the CUDA pipeline on device `ordinal`: the kernels were built and embedded,
/// the driver loads, the fatbin loads as a module on this GPU, a kernel launches with arguments, and
/// every element it wrote is exactly what the host expects.
///
/// Errors: [`CudaError::KernelsNotBuilt`] (built without nvcc), [`CudaError::NoDriver`] (no libcuda,
/// e.g. a CPU-only machine), [`CudaError::NoDevice`], [`CudaError::Driver`],
/// [`CudaError::Mismatch`]. Never panics because the driver is missing.
pub fn pipeline_check(ordinal: usize) -> Result<PipelineReport, CudaError> {
    let image = fatbin()?;
    let parsed = fatbin::parse(image)?;
    with_driver("pipeline check", || {
        let (ctx, device) = open(ordinal)?;
        let module = Module::load(&ctx, image)?;
        let function = module.function(SELFTEST_KERNEL)?;

        let stream = ctx.default_stream();
        let n = SELFTEST_ELEMENTS;
        let seed: u32 = 0x9E37_79B9;
        // Poison first, so that a kernel that did not run (or skipped elements) cannot pass.
        let poison: Vec<u32> = (0..n).map(|i| !selftest_value(seed, i)).collect();
        let mut out = stream
            .clone_htod(&poison)
            .map_err(drv("allocate + copy to device"))?;
        {
            let (out_ptr, _record_write) = out.device_ptr_mut(&stream);
            let mut arg_out: sys::CUdeviceptr = out_ptr;
            let mut arg_n: u32 = n;
            let mut arg_seed: u32 = seed;
            let mut params: [*mut c_void; 3] = [
                (&mut arg_out as *mut sys::CUdeviceptr).cast(),
                (&mut arg_n as *mut u32).cast(),
                (&mut arg_seed as *mut u32).cast(),
            ];
            // Fewer blocks than elements / 256 so that the grid-stride loop runs several rounds.
            let block = 256u32;
            let grid = (n / block / 4).max(1);
            // SAFETY: `function` is `gpuverbs_selftest_fill(uint32_t *out, uint32_t n, uint32_t seed)`
            // from the loaded module (kept alive until after the synchronize below); `params` points to
            // three live locals of exactly those types; `out` holds `n` u32 on this context's device and
            // outlives the launch (we synchronize before it drops).
            unsafe {
                cudarc::driver::result::launch_kernel(
                    function,
                    (grid, 1, 1),
                    (block, 1, 1),
                    0,
                    stream.cu_stream(),
                    &mut params,
                )
            }
            .map_err(drv("cuLaunchKernel gpuverbs_selftest_fill"))?;
        }
        let host = stream.clone_dtoh(&out).map_err(drv("copy to host"))?;
        stream.synchronize().map_err(drv("cuStreamSynchronize"))?;
        drop(out);
        drop(module);

        verify(SELFTEST_KERNEL, &host, |i| selftest_value(seed, i))?;
        Ok(PipelineReport {
            device,
            kernel: SELFTEST_KERNEL,
            elements_checked: host.len(),
            fatbin_targets: parsed.targets(),
            fatbin_bytes: image.len(),
        })
    })
}

/// Compares `got[i]` with `expected(i)` for every element.
fn verify(
    kernel: &'static str,
    got: &[u32],
    expected: impl Fn(u32) -> u32,
) -> Result<(), CudaError> {
    let mut first = None;
    let mut mismatches = 0;
    for (i, &g) in got.iter().enumerate() {
        let e = expected(i as u32);
        if g != e {
            mismatches += 1;
            first.get_or_insert((i, e, g));
        }
    }
    match first {
        None => Ok(()),
        Some((first_index, expected, got_value)) => Err(CudaError::Mismatch {
            kernel,
            checked: got.len(),
            mismatches,
            first_index,
            expected,
            got: got_value,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fatbin::EntryKind;

    fn require_nvcc() -> bool {
        std::env::var("GPUVERBS_REQUIRE_NVCC")
            .is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false" | "no" | "off"))
    }

    #[test]
    fn embedded_fatbin_has_required_targets() {
        match fatbin() {
            Ok(bytes) => {
                assert_eq!(
                    bytes.as_ptr() as usize % 16,
                    0,
                    "fatbin image must be aligned"
                );
                let fb = fatbin::parse(bytes).expect("embedded fatbin parses");
                for t in REQUIRED_TARGETS {
                    assert!(
                        fb.contains(t),
                        "embedded fatbin lacks {t}: has {:?}",
                        fb.targets()
                    );
                }
                // Nothing else sneaked in, and every payload has the right shape.
                assert_eq!(
                    fb.entries.len(),
                    REQUIRED_TARGETS.len(),
                    "{:?}",
                    fb.targets()
                );
                for e in &fb.entries {
                    if e.kind == EntryKind::Elf && !e.is_compressed() {
                        assert!(
                            e.payload.starts_with(b"\x7fELF"),
                            "{} payload is not ELF",
                            e.target()
                        );
                    }
                    // build.rs compiles with -lineinfo, so nvcc records the unity source's name.
                    let name = e.object_name().unwrap_or_default();
                    assert!(
                        name.ends_with("gpuverbs-kernels-unity.cu"),
                        "{}: {name:?}",
                        e.target()
                    );
                    if e.kind == EntryKind::Ptx {
                        let options = e.options().unwrap_or_default();
                        assert!(options.contains("--generate-line-info"), "{options:?}");
                    }
                }
                assert!(!NVCC_COMMAND.is_empty());
                assert_eq!(KERNELS_STATUS, "built");
            }
            Err(e) => {
                assert!(
                    !require_nvcc(),
                    "GPUVERBS_REQUIRE_NVCC is set but the kernels are not embedded: {e}"
                );
                let msg = e.to_string();
                assert!(matches!(e, CudaError::KernelsNotBuilt { .. }));
                assert!(msg.contains("cargo xtask setup-cuda"), "{msg}");
            }
        }
    }

    #[test]
    fn pipeline_check_fails_cleanly_without_driver() {
        if driver_available() {
            // A GPU machine: the real check runs in the gpu-test binary.
            return;
        }
        let err = pipeline_check(0).expect_err("no driver here");
        if kernels_built() {
            assert!(matches!(err, CudaError::NoDriver), "{err:?}");
            assert!(err.to_string().contains("no CUDA driver"));
        } else {
            assert!(matches!(err, CudaError::KernelsNotBuilt { .. }), "{err:?}");
        }
        assert!(matches!(device_info(0), Err(CudaError::NoDriver)));
    }

    #[test]
    fn driver_panics_become_errors() {
        let err = catch_driver_panic::<()>("test", || panic!("Missing symbol cuFoo")).unwrap_err();
        match err {
            CudaError::DriverPanicked {
                op: "test",
                message,
            } => {
                assert_eq!(message, "Missing symbol cuFoo")
            }
            other => panic!("{other:?}"),
        }
        let err =
            catch_driver_panic::<()>("test", || panic!("{}", String::from("owned"))).unwrap_err();
        assert!(err.to_string().contains("owned"), "{err}");
        assert_eq!(catch_driver_panic("test", || Ok(5)).unwrap(), 5);
    }

    #[test]
    fn verify_reports_first_mismatch() {
        let seed = 7;
        let mut v: Vec<u32> = (0..100).map(|i| selftest_value(seed, i)).collect();
        assert!(verify("k", &v, |i| selftest_value(seed, i)).is_ok());
        v[42] ^= 1;
        v[77] = 0;
        match verify("k", &v, |i| selftest_value(seed, i)) {
            Err(CudaError::Mismatch {
                mismatches: 2,
                first_index: 42,
                checked: 100,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn selftest_value_matches_kernel_formula() {
        assert_eq!(selftest_value(0, 0), 0);
        assert_eq!(selftest_value(0, 1), 2_654_435_761);
        assert_eq!(
            selftest_value(0xFFFF_FFFF, 2),
            !(2_654_435_761u32.wrapping_mul(2))
        );
        assert_eq!(DriverVersion { raw: 13000 }.to_string(), "13.0");
        assert_eq!(DriverVersion { raw: 12080 }.to_string(), "12.8");
    }
}
