//! The soft NIC's access to GPU memory through the CUDA driver: [`CudaMemory`], a
//! [`DeviceMemory`] made of CUDA copies, and [`device_allocation`], which tells whether an
//! address is GPU memory and which allocation holds it. The host API uses it for the regions
//! and rings it places in GPU memory; the uverbs emulation for GPU addresses an application
//! registers (as nvidia-peermem lets a kernel resolve them). The driver is loaded at run time:
//! without it, [`driver_available`] is false and nothing here calls into it.

use cudarc::driver::result::DriverError;
use cudarc::driver::{sys, CudaContext};
use std::ffi::c_void;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};
use verbs::devmem::{DeviceMemory, DeviceMemoryError};

/// A driver call that failed, with what was being done.
#[derive(Debug, thiserror::Error)]
#[error("CUDA driver call failed: {op}: {source}")]
pub struct CudaMemError {
    /// The call.
    pub op: &'static str,
    /// The driver's error code.
    #[source]
    pub source: DriverError,
}

fn drv(op: &'static str) -> impl FnOnce(DriverError) -> CudaMemError {
    move |source| CudaMemError { op, source }
}

/// Whether the CUDA driver library (`libcuda`) can be loaded. Probed once, then cached.
pub fn driver_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names of libcuda and
        // closes what it opened; loading libcuda runs its initialisers, which is what using
        // CUDA means.
        panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
    })
}

/// Runs `f`, which calls the driver through cudarc; a panic there (a missing symbol in an old
/// driver) comes back as its message.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".to_string())
    })
}

/// A device-memory allocation (`cuMemAlloc` and friends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// The GPU that holds it.
    pub ordinal: usize,
    /// First address.
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Allocation {
    /// Whether `addr..addr+len` lies inside.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.base + self.len)
    }
}

/// The device-memory allocation holding `addr`, or `None` when `addr` is not GPU device
/// memory (host memory, unknown to CUDA, or no driver).
pub fn device_allocation(addr: u64) -> Option<Allocation> {
    if !driver_available() {
        return None;
    }
    let query = || -> Option<Allocation> {
        // SAFETY: cuInit may be called any number of times.
        unsafe { sys::cuInit(0) }.result().ok()?;
        let attr = |a: sys::CUpointer_attribute, out: *mut c_void| {
            // SAFETY: `out` points at a value of the attribute's size (4 bytes for the memory
            // type and the ordinal, 8 for the range start and size); any address may be
            // queried (an unknown one is an error, not a fault).
            unsafe { sys::cuPointerGetAttribute(out, a, addr) }
                .result()
                .ok()
        };
        let mut kind: u32 = 0;
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            (&mut kind as *mut u32).cast(),
        )?;
        if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return None;
        }
        let mut ordinal: i32 = -1;
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            (&mut ordinal as *mut i32).cast(),
        )?;
        let (mut base, mut len): (u64, u64) = (0, 0);
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            (&mut base as *mut u64).cast(),
        )?;
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            (&mut len as *mut u64).cast(),
        )?;
        Some(Allocation {
            ordinal: usize::try_from(ordinal).ok()?,
            base,
            len,
        })
    };
    catch_panic(query).ok().flatten()
}

/// Bytes of pinned host memory a [`CudaMemory`] stages its copies through.
const STAGING: usize = 1 << 20;

/// The soft NIC's access to one GPU's memory: CUDA copies
/// (`cuMemcpy{DtoH,HtoD,DtoD}Async`, UVA addresses, so host-registered memory with a device
/// address works too), staged through pinned host memory, on a non-blocking stream (no
/// implicit synchronisation with the default stream, where kernels that wait for the very
/// copies may be running), each synchronised before it returns, as [`DeviceMemory`]
/// requires. The context is bound to whichever thread calls (the soft NIC's engine or wire
/// thread). One copy at a time per GPU (a mutex).
pub struct CudaMemory {
    ctx: Arc<CudaContext>,
    io: Mutex<Io>,
}

struct Io {
    stream: sys::CUstream,
    staging: *mut u8,
}

// SAFETY: the stream and the pinned buffer are used only under the mutex, with the context
// bound to the calling thread; CUDA handles may be used from any thread.
unsafe impl Send for Io {}

impl CudaMemory {
    /// Sets up copies for the GPU of `ctx`: a non-blocking stream and the staging buffer.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, CudaMemError> {
        use cudarc::driver::result::stream;
        ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let stream =
            stream::create(stream::StreamKind::NonBlocking).map_err(drv("cuStreamCreate"))?;
        // SAFETY: a plain pinned allocation, freed in `drop`.
        let staging = match unsafe { cudarc::driver::result::malloc_host(STAGING, 0) } {
            Ok(p) => p.cast::<u8>(),
            Err(e) => {
                // SAFETY: created above, destroyed once.
                let _ = unsafe { stream::destroy(stream) };
                return Err(drv("cuMemHostAlloc")(e));
            }
        };
        Ok(Self {
            ctx: ctx.clone(),
            io: Mutex::new(Io { stream, staging }),
        })
    }

    /// Runs `f` under the mutex with the context bound (driver panics caught); a failure
    /// names the call and the range.
    fn with_io(
        &self,
        what: &'static str,
        addr: u64,
        len: usize,
        f: impl FnOnce(&Io) -> Result<(), DriverError>,
    ) -> Result<(), DeviceMemoryError> {
        let io = self.io.lock().unwrap_or_else(|e| e.into_inner());
        let run = || {
            self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
            f(&io).map_err(drv(what))
        };
        let r = match catch_panic(run) {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(panic) => Err(format!(
                "the CUDA driver bindings panicked during {what}: {panic}"
            )),
        };
        r.map_err(|e| DeviceMemoryError(format!("{e} (GPU address {addr:#x}, {len} bytes)")))
    }
}

/// Which way a copy goes. Every copy names its direction: an address the driver does not know
/// (device memory freed under a region) is then an error, never taken for a host pointer, as
/// the pointer-inferring `cuMemcpy` would (and copy from or to host memory).
#[derive(Clone, Copy)]
enum Dir {
    /// Device to the staging buffer.
    DtoH,
    /// The staging buffer to device.
    HtoD,
    /// Device to device.
    DtoD,
}

/// One asynchronous copy on the stream, then a synchronisation.
fn copy_sync(io: &Io, dir: Dir, dst: u64, src: u64, n: usize) -> Result<(), DriverError> {
    // SAFETY: the device side is an address the soft NIC checked against a region (a bad one
    // is an error), the host side the staging buffer, which holds at least `n` bytes.
    unsafe {
        match dir {
            Dir::DtoH => sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, n, io.stream),
            Dir::HtoD => sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, n, io.stream),
            Dir::DtoD => sys::cuMemcpyDtoDAsync_v2(dst, src, n, io.stream),
        }
    }
    .result()?;
    // SAFETY: the stream is live (destroyed only in drop).
    unsafe { sys::cuStreamSynchronize(io.stream) }.result()
}

impl DeviceMemory for CudaMemory {
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceMemoryError> {
        // SAFETY: `dst` is a live, exclusively borrowed slice of `dst.len()` bytes.
        unsafe { self.read_to_host(src, dst.as_mut_ptr(), dst.len()) }
    }

    fn write(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError> {
        // SAFETY: `src` is a live slice of `src.len()` bytes.
        unsafe { self.write_from_host(dst, src.as_ptr(), src.len()) }
    }

    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError> {
        self.with_io("cuMemcpyAsync (device to device)", dst, len, |io| {
            copy_sync(io, Dir::DtoD, dst, src, len)
        })
    }

    fn write_ordered(&self, parts: &[(u64, &[u8])]) -> Result<(), DeviceMemoryError> {
        let total: usize = parts.iter().map(|p| p.1.len()).sum();
        let Some(&(first, _)) = parts.first() else {
            return Ok(());
        };
        if total > STAGING {
            return parts
                .iter()
                .try_for_each(|&(dst, src)| self.write(dst, src));
        }
        // every part staged at its own place, copied in order on the one stream (a copy starts
        // after the one before it has completed), one wait for all
        self.with_io("cuMemcpyAsync (host to device)", first, total, |io| {
            let mut at = 0;
            for &(dst, src) in parts {
                // SAFETY: `at + src.len() <= total <= STAGING`, the staging buffer is ours
                // under the mutex and no queued copy reads this range yet.
                unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), io.staging.add(at), src.len())
                };
                // SAFETY: the device side is an address the soft NIC checked; the host side
                // `src.len()` staged bytes that stay put until the wait below.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        dst,
                        io.staging.add(at) as *const c_void,
                        src.len(),
                        io.stream,
                    )
                }
                .result()?;
                at += src.len();
            }
            // SAFETY: the stream is live (destroyed only in drop).
            unsafe { sys::cuStreamSynchronize(io.stream) }.result()
        })
    }

    unsafe fn read_to_host(
        &self,
        src: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), DeviceMemoryError> {
        self.with_io("cuMemcpyAsync (device to host)", src, len, |io| {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(STAGING);
                copy_sync(io, Dir::DtoH, io.staging as u64, src + done as u64, n)?;
                // SAFETY: the staging buffer holds `n` copied bytes; `dst + done .. + n` is
                // inside the caller's writable range.
                unsafe { std::ptr::copy_nonoverlapping(io.staging, dst.add(done), n) };
                done += n;
            }
            Ok(())
        })
    }

    unsafe fn write_from_host(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceMemoryError> {
        self.with_io("cuMemcpyAsync (host to device)", dst, len, |io| {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(STAGING);
                // SAFETY: `src + done .. + n` is inside the caller's readable range; the
                // staging buffer has STAGING bytes and is ours under the mutex.
                unsafe { std::ptr::copy_nonoverlapping(src.add(done), io.staging, n) };
                copy_sync(io, Dir::HtoD, dst + done as u64, io.staging as u64, n)?;
                done += n;
            }
            Ok(())
        })
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        let io = self.io.get_mut().unwrap_or_else(|e| e.into_inner());
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: created in `new`, each destroyed once, here; nothing uses them after.
            unsafe {
                let _ = cudarc::driver::result::stream::destroy(io.stream);
                let _ = cudarc::driver::result::free_host(io.staging.cast());
            }
        }
    }
}
