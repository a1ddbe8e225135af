//! The CUDA driver as the doctor sees it: version, devices and the attributes GPUDirect RDMA
//! depends on, and two trial operations (an I/O-memory registration of a doorbell page, a
//! dma-buf export of device memory).
//!
//! The driver is loaded at run time through cudarc's bindings, whose loader panics when
//! `libcuda` or a symbol is missing: every entry point first asks
//! [`gpuverbs::cuda::driver_available`] and then runs its calls under `catch_unwind`, so a
//! machine without a driver, or with an old one, gives a [`CudaProbeError`], never a panic.

use crate::doctor::sysfs::Bdf;
use cudarc::driver::sys;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{self, AssertUnwindSafe};

/// Why a CUDA probe could not answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaProbeError {
    /// `libcuda` could not be loaded.
    #[error("no CUDA driver: libcuda.so.1 could not be loaded (no NVIDIA driver, or not on the loader path)")]
    NoDriver,
    /// The bindings panicked (a symbol the CUDA 13.0 bindings need is missing: an older driver).
    #[error("the CUDA driver bindings panicked during {op}: {message} (is the driver at least CUDA 13.0?)")]
    Panicked {
        /// What was being done.
        op: &'static str,
        /// The panic message.
        message: String,
    },
    /// A driver call returned an error.
    #[error("{op} returned {name} ({code})")]
    Call {
        /// The call.
        op: &'static str,
        /// The `CUresult` value.
        code: i32,
        /// Its name (`CUDA_ERROR_NOT_SUPPORTED`).
        name: String,
    },
}

impl CudaProbeError {
    /// The `CUresult` of a failed call.
    pub fn code(&self) -> Option<i32> {
        match self {
            Self::Call { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// `CUDA_ERROR_NOT_PERMITTED`.
pub const ERR_NOT_PERMITTED: i32 = 800;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const ERR_NOT_SUPPORTED: i32 = 801;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const ERR_INVALID_VALUE: i32 = 1;
/// `CUDA_ERROR_NO_DEVICE` (`cuInit` where the driver is installed but no GPU is there).
pub const ERR_NO_DEVICE: i32 = 100;

/// Runs `f` with the driver present, turning a panic of the bindings into an error.
fn guarded<T>(
    op: &'static str,
    f: impl FnOnce() -> Result<T, CudaProbeError>,
) -> Result<T, CudaProbeError> {
    if !gpuverbs::cuda::driver_available() {
        return Err(CudaProbeError::NoDriver);
    }
    catch(op, f)
}

/// Runs `f`, turning a panic into [`CudaProbeError::Panicked`].
fn catch<T>(
    op: &'static str,
    f: impl FnOnce() -> Result<T, CudaProbeError>,
) -> Result<T, CudaProbeError> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(CudaProbeError::Panicked {
            op,
            message: p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into()),
        }),
    }
}

/// The name of a `CUresult`.
fn error_name(r: sys::CUresult) -> String {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string (or leaves it null) for any
    // value; the driver is loaded (callers run under `guarded`).
    let rc = unsafe { sys::cuGetErrorName(r, &mut p) };
    if rc != sys::CUresult::CUDA_SUCCESS || p.is_null() {
        return format!("CUresult {}", r as i32);
    }
    // SAFETY: a NUL-terminated static string owned by the driver.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `Ok` for `CUDA_SUCCESS`, else the error with its name.
fn ck(op: &'static str, r: sys::CUresult) -> Result<(), CudaProbeError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaProbeError::Call {
            op,
            code: r as i32,
            name: error_name(r),
        })
    }
}

/// One device as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceGetPCIBusId`, as the driver wrote it.
    pub bus_id: String,
    /// The same, parsed.
    pub bdf: Option<Bdf>,
    /// Compute capability.
    pub cc: (i32, i32),
    /// Total memory, bytes.
    pub memory: usize,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf: Result<i32, CudaProbeError>,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gdr: Result<i32, CudaProbeError>,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` (0 none, 100 owner, 200 all
    /// devices).
    pub writes_ordering: Result<i32, CudaProbeError>,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS` (bit 0: `cuFlushGPUDirectRDMAWrites`).
    pub flush_options: Result<i32, CudaProbeError>,
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED`.
    pub host_register: Result<i32, CudaProbeError>,
}

/// What the driver says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    /// `cuDriverGetVersion` (1000 × major + 10 × minor).
    pub version: i32,
    /// The devices (`cuDeviceGetCount` of them; a device whose basic queries fail is an `Err`).
    pub gpus: Vec<Result<GpuInfo, CudaProbeError>>,
}

impl DriverInfo {
    /// `13.0` for 13000.
    pub fn version_text(&self) -> String {
        format!("{}.{}", self.version / 1000, (self.version % 1000) / 10)
    }
}

fn attribute(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32, CudaProbeError> {
    let mut v: c_int = 0;
    // SAFETY: writes one int; `dev` is a device handle from cuDeviceGet.
    ck("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, a, dev)
    })?;
    Ok(v)
}

fn device(ordinal: usize) -> Result<sys::CUdevice, CudaProbeError> {
    let mut dev: sys::CUdevice = 0;
    let o = c_int::try_from(ordinal).unwrap_or(c_int::MAX);
    // SAFETY: writes one device handle; the driver is initialised.
    ck("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, o) })?;
    Ok(dev)
}

fn gpu_info(ordinal: usize) -> Result<GpuInfo, CudaProbeError> {
    use sys::CUdevice_attribute as A;
    let dev = device(ordinal)?;
    let mut name = [0 as c_char; 256];
    // SAFETY: writes at most `len` bytes, NUL-terminated, into the buffer.
    ck("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)
    })?;
    let mut bus = [0 as c_char; 64];
    // SAFETY: as above.
    ck("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, dev)
    })?;
    let mut memory = 0usize;
    // SAFETY: writes one size_t.
    ck("cuDeviceTotalMem", unsafe {
        sys::cuDeviceTotalMem_v2(&mut memory, dev)
    })?;
    // SAFETY: the driver NUL-terminated both strings within their buffers.
    let text = |b: &[c_char]| {
        unsafe { CStr::from_ptr(b.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    };
    let bus_id = text(&bus);
    Ok(GpuInfo {
        ordinal,
        name: text(&name),
        bdf: Bdf::parse(&bus_id),
        bus_id,
        cc: (
            attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        memory,
        dma_buf: attribute(dev, A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED),
        gdr: attribute(dev, A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED),
        writes_ordering: attribute(dev, A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING),
        flush_options: attribute(
            dev,
            A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
        ),
        host_register: attribute(dev, A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED),
    })
}

/// Initialises the driver and reads its version and every device.
pub fn probe() -> Result<DriverInfo, CudaProbeError> {
    guarded("driver probe", || {
        // SAFETY: cuInit(0) is the documented first call; it may be called more than once.
        ck("cuInit", unsafe { sys::cuInit(0) })?;
        let mut version: c_int = 0;
        // SAFETY: writes one int.
        ck("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut version)
        })?;
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { sys::cuDeviceGetCount(&mut n) };
        if rc != sys::CUresult::CUDA_ERROR_NO_DEVICE {
            ck("cuDeviceGetCount", rc)?;
        }
        let gpus = (0..n.max(0) as usize).map(gpu_info).collect();
        Ok(DriverInfo { version, gpus })
    })
}

/// The primary context of a device, current on this thread while the value lives.
struct Primary {
    dev: sys::CUdevice,
}

impl Primary {
    fn retain(ordinal: usize) -> Result<Self, CudaProbeError> {
        let dev = device(ordinal)?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: retains the device's primary context (released in drop) and writes its
        // handle.
        ck("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        let p = Self { dev };
        // SAFETY: `ctx` is the live primary context just retained.
        ck("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })?;
        Ok(p)
    }
}

impl Drop for Primary {
    fn drop(&mut self) {
        // SAFETY: undoes the current binding and the retain of `retain`, once each; errors
        // are ignored (a drop never fails).
        unsafe {
            let _ = sys::cuCtxSetCurrent(std::ptr::null_mut());
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// How a trial registration of a doorbell page went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostRegisterTrial {
    /// `cuMemHostRegister(DEVICEMAP | PORTABLE | IOMEMORY)`: the GPU address it got.
    pub iomemory: Result<u64, CudaProbeError>,
    /// When that failed: the same page as plain memory (what gpuverbs' export falls back to).
    pub plain: Option<Result<u64, CudaProbeError>>,
}

/// `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP`, as gpuverbs' export uses.
const REGISTER_FLAGS: u32 = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;

/// Registers `len` bytes at `page` into GPU `ordinal`, gets the device address, unregisters.
fn register_once(page: *mut c_void, len: usize, flags: u32) -> Result<u64, CudaProbeError> {
    let op = if flags & sys::CU_MEMHOSTREGISTER_IOMEMORY != 0 {
        "cuMemHostRegister(IOMEMORY)"
    } else {
        "cuMemHostRegister"
    };
    // SAFETY: the caller of `trial_host_register` guarantees whole mapped pages; the
    // registration is undone below before returning.
    ck(op, unsafe { sys::cuMemHostRegister_v2(page, len, flags) })?;
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: the range was registered with DEVICEMAP just now.
    let got = ck("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut dptr, page, 0)
    });
    // SAFETY: registered above; unregistered once.
    let un = ck("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(page)
    });
    got?;
    un?;
    Ok(dptr)
}

/// Registers the doorbell page at `page` (`len` bytes, page aligned) into GPU `ordinal` as I/O
/// memory, and as plain memory when that fails; every registration is undone before return.
///
/// # Safety
/// `page..page+len` must be whole pages mapped in this process for the duration of the call
/// (a UAR page an rdma-core context mapped, kept open by the caller).
pub unsafe fn trial_host_register(
    ordinal: usize,
    page: *mut c_void,
    len: usize,
) -> Result<HostRegisterTrial, CudaProbeError> {
    guarded("doorbell registration", || {
        // SAFETY: cuInit(0) may be called more than once.
        ck("cuInit", unsafe { sys::cuInit(0) })?;
        let _ctx = Primary::retain(ordinal)?;
        let iomemory = register_once(page, len, REGISTER_FLAGS | sys::CU_MEMHOSTREGISTER_IOMEMORY);
        let plain = iomemory
            .is_err()
            .then(|| register_once(page, len, REGISTER_FLAGS));
        Ok(HostRegisterTrial { iomemory, plain })
    })
}

/// A successful dma-buf export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DmaBufTrial {
    /// Bytes exported.
    pub len: usize,
    /// What `/proc/self/fd/<fd>` links to (`anon_inode:dmabuf` or `/dmabuf:`).
    pub fd_target: String,
}

/// Allocates 2 MiB of device memory on GPU `ordinal`, exports it as a dma-buf
/// (`cuMemGetHandleForAddressRange`, `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`; the range is
/// aligned to the host page size as the driver requires), closes the fd and frees the memory.
pub fn trial_dmabuf(ordinal: usize) -> Result<DmaBufTrial, CudaProbeError> {
    const LEN: usize = 2 << 20;
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096);
    guarded("dma-buf export", || {
        // SAFETY: cuInit(0) may be called more than once.
        ck("cuInit", unsafe { sys::cuInit(0) })?;
        let _ctx = Primary::retain(ordinal)?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: allocates in the current (primary) context; freed below.
        ck("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut base, LEN + page)
        })?;
        let start = (base + page as u64 - 1) & !(page as u64 - 1);
        let mut fd: c_int = -1;
        // SAFETY: `start..start+LEN` lies in the allocation; the driver writes an int fd.
        let r = ck("cuMemGetHandleForAddressRange(DMA_BUF_FD)", unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut c_int).cast(),
                start,
                LEN,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        });
        let out = r.map(|()| {
            let fd_target = std::fs::read_link(format!("/proc/self/fd/{fd}"))
                .map(|p| p.display().to_string())
                .unwrap_or_else(|e| format!("unreadable: {e}"));
            DmaBufTrial {
                len: LEN,
                fd_target,
            }
        });
        if fd >= 0 {
            // SAFETY: the fd the driver just gave us, closed once.
            unsafe { libc::close(fd) };
        }
        // SAFETY: allocated above, freed once.
        let _ = unsafe { sys::cuMemFree_v2(base) };
        out
    })
}

/// Opens GPU `ordinal` through the host API (for its own export and registration paths).
pub fn host_api_gpu(ordinal: usize) -> Result<std::sync::Arc<gpuverbs::gpu::Gpu>, String> {
    if !gpuverbs::cuda::driver_available() {
        return Err(CudaProbeError::NoDriver.to_string());
    }
    gpuverbs::gpu::Gpu::open(ordinal).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        if gpuverbs::cuda::driver_available() {
            return; // a GPU machine: the real probe runs in `gpuverbs doctor`
        }
        assert_eq!(probe(), Err(CudaProbeError::NoDriver));
        assert_eq!(trial_dmabuf(0), Err(CudaProbeError::NoDriver));
        let mut page = vec![0u8; 8192];
        // SAFETY: a live buffer (not even touched: no driver).
        let r = unsafe { trial_host_register(0, page.as_mut_ptr().cast(), 4096) };
        assert_eq!(r, Err(CudaProbeError::NoDriver));
        assert!(host_api_gpu(0).unwrap_err().contains("no CUDA driver"));
    }

    #[test]
    fn panics_become_errors() {
        let r = catch::<()>("probe", || panic!("Missing symbol cuFoo"));
        assert_eq!(
            r,
            Err(CudaProbeError::Panicked {
                op: "probe",
                message: "Missing symbol cuFoo".into()
            })
        );
        assert_eq!(catch("probe", || Ok(3)), Ok(3));
        let e = CudaProbeError::Call {
            op: "cuMemHostRegister(IOMEMORY)",
            code: ERR_NOT_SUPPORTED,
            name: "CUDA_ERROR_NOT_SUPPORTED".into(),
        };
        assert_eq!(e.code(), Some(801));
        assert_eq!(
            e.to_string(),
            "cuMemHostRegister(IOMEMORY) returned CUDA_ERROR_NOT_SUPPORTED (801)"
        );
    }
}
