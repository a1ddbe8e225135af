//! A GPU as gpuverbs uses it: a CUDA context with the embedded kernels loaded, host memory
//! mapped into it (rings, doorbell pages, payload buffers), device memory, launches, and the
//! soft NIC's access to this GPU's memory ([`Gpu::device_memory`]: CUDA copies on a stream of
//! their own). Mapping and memory only: exporting a QP into a GPU ([`Gpu::export_qp`]) is
//! `crate::export`'s job, mapping a host buffer ([`Gpu::map_host`]) `crate::memory`'s.

use crate::cuda::{drv, open, with_driver, CudaError, DeviceInfo, Module};
use crate::desc::QpDesc;
use crate::Error;
use cudarc::driver::result::DriverError;
use cudarc::driver::{sys, CudaContext};
use softnic_cuda::CudaMemory;
use std::any::Any;
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};
use verbs::devmem::same_memory;
pub use verbs::devmem::{DeviceMemory, DeviceMemoryError};
use verbs::DmaBuf;

/// `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP`.
const HOST_REGISTER_FLAGS: u32 = 0x01 | 0x02;

/// `CU_MEMHOSTREGISTER_IOMEMORY`: the range is device (MMIO) memory, such as a NIC's UAR.
const HOST_REGISTER_IOMEMORY: u32 = 0x04;

/// A host range registered with CUDA, and what keeps its memory alive.
struct Mapping {
    dptr: u64,
    host: *mut u8,
    len: usize,
    _keep: Arc<dyn Any + Send + Sync>,
}

// SAFETY: `host` is only passed back to cuMemHostUnregister; the memory is owned by `_keep`.
unsafe impl Send for Mapping {}

/// An open GPU with the gpuverbs kernels loaded.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    /// gpuverbs' own kernels (`None` when this build embeds none).
    kernels: Option<Module>,
    info: DeviceInfo,
    mapped: Mutex<HashMap<u64, Mapping>>,
    /// The soft NIC's access to this GPU's memory.
    memory: Arc<CudaMemory>,
}

/// Every `Gpu` opened in this process (for [`owner_of`]).
static OPEN: Mutex<Vec<Weak<Gpu>>> = Mutex::new(Vec::new());

// SAFETY: CUDA driver handles (the context and the module) may be used from any thread; every
// method binds the context to the calling thread before using them, and the mapping table is
// behind a Mutex.
unsafe impl Send for Gpu {}
// SAFETY: as above; no method hands out interior references without the Mutex.
unsafe impl Sync for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({})", self.info)
    }
}

impl Gpu {
    /// Opens GPU `ordinal` and loads the embedded kernels when this build has them (a build
    /// without nvcc can still map memory, export QPs and run users' own modules).
    pub fn open(ordinal: usize) -> Result<Arc<Self>, CudaError> {
        with_driver("open GPU", || {
            let (ctx, info) = open(ordinal)?;
            let kernels = match crate::cuda::fatbin() {
                Ok(image) => Some(Module::load(&ctx, image)?),
                Err(_) => None,
            };
            let memory = Arc::new(CudaMemory::new(&ctx).map_err(|e| CudaError::Driver {
                op: e.op,
                source: e.source,
            })?);
            let gpu = Arc::new(Self {
                ctx,
                kernels,
                info,
                mapped: Mutex::new(HashMap::new()),
                memory,
            });
            let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
            open.retain(|w| w.strong_count() > 0);
            open.push(Arc::downgrade(&gpu));
            Ok(gpu)
        })
    }

    /// How the soft NIC reaches this GPU's memory: regions registered with
    /// [`crate::Pd::register_gpu`] / [`crate::Pd::register_device_mem`] and rings placed with
    /// [`crate::RingPlacement::Gpu`] use it. Its copies run on a non-blocking stream of its
    /// own, each synchronised before it returns (so a kernel running on the default stream
    /// does not block them), staged through 1 MiB of pinned host memory.
    pub fn device_memory(&self) -> Arc<dyn DeviceMemory> {
        self.memory.clone()
    }

    /// Exports the GPU pages holding `dptr..dptr+len` as a dma-buf
    /// (`cuMemGetHandleForAddressRange`, host-page aligned) when the device says it can
    /// (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`): the fd and the offset of `dptr` in it.
    pub(crate) fn dmabuf(&self, dptr: u64, len: u64) -> Result<(OwnedFd, u64), CudaError> {
        with_driver("dma-buf export", || {
            self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
            let supported = self
                .ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
                .map_err(drv("cuDeviceGetAttribute(DMA_BUF_SUPPORTED)"))?;
            if supported != 1 {
                return Err(CudaError::Driver {
                    op: "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0",
                    source: DriverError(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED),
                });
            }
            let page = host_page();
            let start = dptr & !(page - 1);
            let end = dptr
                .checked_add(len)
                .and_then(|e| e.checked_next_multiple_of(page))
                .ok_or(CudaError::Driver {
                    op: "dma-buf range",
                    source: DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE),
                })?;
            let mut fd: std::ffi::c_int = -1;
            // SAFETY: the driver writes one int (the fd) through a valid pointer; a range it
            // does not hold is an error.
            unsafe {
                sys::cuMemGetHandleForAddressRange(
                    (&mut fd as *mut std::ffi::c_int).cast(),
                    start,
                    (end - start) as usize,
                    sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                    0,
                )
            }
            .result()
            .map_err(drv("cuMemGetHandleForAddressRange(DMA_BUF_FD)"))?;
            // SAFETY: a new fd the driver handed over; owned (and closed) from here on.
            Ok((unsafe { OwnedFd::from_raw_fd(fd) }, dptr - start))
        })
    }

    /// Whether `dptr..dptr+len` lies in one allocation of this GPU's device memory.
    fn holds(&self, dptr: u64, len: u64) -> bool {
        softnic_cuda::device_allocation(dptr)
            .is_some_and(|a| a.ordinal == self.info.ordinal && a.covers(dptr, len))
    }

    /// Loads a user's fatbin (e.g. built with `gpuverbs-kernel-build`) into this GPU's context.
    pub fn load_module(&self, image: &'static [u8]) -> Result<GpuModule, CudaError> {
        with_driver("load module", || {
            Ok(GpuModule(Module::load(&self.ctx, image)?))
        })
    }

    fn own_kernels(&self) -> Result<&Module, CudaError> {
        match &self.kernels {
            Some(m) => Ok(m),
            // `open` loads the kernels whenever the build has them, so this names why not.
            None => Err(crate::cuda::fatbin().expect_err("Gpu::open loads embedded kernels")),
        }
    }

    /// Launches `name` of `module` on the default stream and waits; with `timed`, returns the
    /// GPU time between two events recorded around the launch.
    ///
    /// # Safety
    /// As [`Gpu::launch_sync`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch(
        &self,
        module: &Module,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        params: &mut [*mut c_void],
        timed: bool,
    ) -> Result<std::time::Duration, CudaError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let f = module.function(name)?;
        let stream = self.ctx.default_stream();
        let events = if timed {
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = self.ctx.new_event(flags).map_err(drv("cuEventCreate"))?;
            let end = self.ctx.new_event(flags).map_err(drv("cuEventCreate"))?;
            start.record(&stream).map_err(drv("cuEventRecord"))?;
            Some((start, end))
        } else {
            None
        };
        // SAFETY: forwarded contract; `f` belongs to `module`, which outlives the call.
        unsafe {
            cudarc::driver::result::launch_kernel(
                f,
                grid,
                block,
                shared_mem,
                stream.cu_stream(),
                params,
            )
        }
        .map_err(drv("cuLaunchKernel"))?;
        if let Some((_, end)) = &events {
            end.record(&stream).map_err(drv("cuEventRecord"))?;
        }
        stream.synchronize().map_err(drv("cuStreamSynchronize"))?;
        let ms = match &events {
            Some((start, end)) => start.elapsed_ms(end).map_err(drv("cuEventElapsedTime"))?,
            None => 0.0,
        };
        Ok(std::time::Duration::from_secs_f64(
            f64::from(ms.max(0.0)) / 1e3,
        ))
    }

    /// Launches `name` of a user's module on the default stream and waits for it.
    ///
    /// # Safety
    /// As [`Gpu::launch_sync`].
    pub unsafe fn launch_sync_in(
        &self,
        module: &GpuModule,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded contract.
        unsafe { self.launch(&module.0, name, grid, block, shared_mem, params, false) }.map(|_| ())
    }

    /// Device name, capability, driver.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Maps `buf` (owned by `keep`) into the GPU; returns its device address. Mapping the same
    /// buffer again returns the same address. Mappings live as long as this `Gpu`, and keep
    /// `keep` alive that long.
    pub(crate) fn map_buf(
        &self,
        buf: &DmaBuf,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Result<u64, CudaError> {
        let mut mapped = self.mapped.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = mapped.get(&buf.addr()) {
            return Ok(m.dptr);
        }
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the buffer is live, page-aligned host memory of `len` bytes (whole pages),
        // kept alive by `keep`, stored below until the mapping is undone in `drop`.
        unsafe { sys::cuMemHostRegister_v2(buf.as_ptr().cast(), buf.len(), HOST_REGISTER_FLAGS) }
            .result()
            .map_err(drv("cuMemHostRegister"))?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: the range was just registered with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, buf.as_ptr().cast(), 0) }
            .result()
            .map_err(drv("cuMemHostGetDevicePointer"))?;
        mapped.insert(
            buf.addr(),
            Mapping {
                dptr,
                host: buf.as_ptr(),
                len: buf.len(),
                _keep: keep,
            },
        );
        Ok(dptr)
    }

    /// Maps the pages holding `addr..addr+len` (memory a provider allocated, owned by `keep`)
    /// into the GPU and returns the device address of `addr`. A range inside pages mapped
    /// before (a doorbell-record page shared by several objects) reuses that mapping. With
    /// `iomem` the pages are registered as I/O memory (a UAR page).
    pub(crate) fn map_range(
        &self,
        addr: u64,
        len: usize,
        keep: Arc<dyn Any + Send + Sync>,
        iomem: bool,
    ) -> Result<u64, CudaError> {
        const PAGE: u64 = 4096;
        let start = addr & !(PAGE - 1);
        let end = (addr + len.max(1) as u64).next_multiple_of(PAGE);
        let mut mapped = self.mapped.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = mapped
            .values()
            .find(|m| m.host as u64 <= start && end <= m.host as u64 + m.len as u64)
        {
            return Ok(m.dptr + (addr - m.host as u64));
        }
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let flags = HOST_REGISTER_FLAGS | if iomem { HOST_REGISTER_IOMEMORY } else { 0 };
        let host = start as *mut u8;
        let n = (end - start) as usize;
        // SAFETY: whole pages of live host memory (the provider's allocation or its mapped UAR
        // page, alive as long as `keep`, which the mapping holds until `drop` unregisters it).
        unsafe { sys::cuMemHostRegister_v2(host.cast(), n, flags) }
            .result()
            .map_err(drv(if iomem {
                "cuMemHostRegister(IOMEMORY)"
            } else {
                "cuMemHostRegister"
            }))?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: the range was just registered with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, host.cast(), 0) }
            .result()
            .map_err(drv("cuMemHostGetDevicePointer"))?;
        mapped.insert(
            start,
            Mapping {
                dptr,
                host,
                len: n,
                _keep: keep,
            },
        );
        Ok(dptr + (addr - start))
    }

    /// Allocates `len` bytes of device memory, zeroed, starting on a host page and followed by
    /// the rest of its last page within the allocation: whole host pages, which a dma-buf
    /// export needs (`cuMemGetHandleForAddressRange` takes page-aligned ranges inside one
    /// allocation, and the driver's small allocations share pages), so a registration of any
    /// size goes through a dma-buf where the device offers one.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<DeviceMem, CudaError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let page = host_page() as usize;
        let bytes = len
            .max(1)
            .checked_next_multiple_of(page)
            .and_then(|n| n.checked_add(page))
            .ok_or(CudaError::Driver {
                op: "cuMemAlloc size",
                source: DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE),
            })?;
        // SAFETY: plain allocation; freed when the last DeviceMem clone drops.
        let base =
            unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(drv("cuMemAlloc"))?;
        let dptr = base.next_multiple_of(page as u64);
        let mem = DeviceMem(Arc::new(Alloc {
            gpu: self.clone(),
            base,
            dptr,
            len,
            buffer_id: std::sync::OnceLock::new(),
        }));
        // SAFETY: base holds `bytes` bytes.
        unsafe { cudarc::driver::result::memset_d8_sync(base, 0, bytes) }
            .map_err(drv("cuMemsetD8"))?;
        Ok(mem)
    }

    /// A buffer of `len` bytes of this GPU's memory for a queue's ring, reached by the soft
    /// NIC through [`Gpu::device_memory`]; the allocation lives as long as the buffer.
    pub(crate) fn ring_buffer(self: &Arc<Self>, len: usize) -> Result<DmaBuf, CudaError> {
        let mem = self.alloc(len)?;
        Ok(DmaBuf::from_device(
            mem.ptr(),
            len,
            self.device_memory(),
            Box::new(mem),
        ))
    }

    /// The device address kernels use for `buf`: its own address when it is in this GPU's
    /// memory, else its mapping into the GPU (registered on first use).
    pub(crate) fn gpu_addr(
        &self,
        buf: &DmaBuf,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Result<u64, Error> {
        match buf.device_memory() {
            None => Ok(self.map_buf(buf, keep)?),
            Some(m) if same_memory(m, &self.device_memory()) => Ok(buf.addr()),
            Some(_) => Err(Error::InvalidArgument(
                "a ring of this QP is in another GPU's memory: export it to that GPU".into(),
            )),
        }
    }

    /// Launches kernel `name` of the embedded fatbin on the default stream and waits for it.
    ///
    /// # Safety
    /// `params` must point to live values of exactly the kernel's parameter types, and every
    /// pointer among them must be valid for what the kernel does with it.
    pub unsafe fn launch_sync(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        let m = self.own_kernels()?;
        // SAFETY: forwarded contract.
        unsafe { self.launch(m, name, grid, block, shared_mem, params, false) }.map(|_| ())
    }

    /// Launches kernel `name` like [`Gpu::launch_sync`], between two CUDA events recorded on
    /// the same stream, waits for it, and returns the GPU time between the events (the kernel's
    /// run on the device, without the host's launch and synchronisation overhead).
    ///
    /// # Safety
    /// As [`Gpu::launch_sync`].
    pub unsafe fn launch_timed(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        params: &mut [*mut c_void],
    ) -> Result<std::time::Duration, CudaError> {
        let m = self.own_kernels()?;
        // SAFETY: forwarded contract.
        unsafe { self.launch(m, name, grid, block, shared_mem, params, true) }
    }
}

/// A GPU's memory as the backends place rings in it and register it.
impl crate::backend::seam::GpuRings for Arc<Gpu> {
    fn ring_buffer(&self, len: usize) -> Result<DmaBuf, Error> {
        Ok(Gpu::ring_buffer(self, len)?)
    }
    fn dmabuf(&self, addr: u64, len: u64) -> Result<(OwnedFd, u64), String> {
        Gpu::dmabuf(self, addr, len).map_err(|e| e.to_string())
    }
    fn memory(&self) -> Arc<dyn DeviceMemory> {
        self.device_memory()
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let mapped = std::mem::take(self.mapped.get_mut().unwrap_or_else(|e| e.into_inner()));
        if self.ctx.bind_to_thread().is_ok() {
            for (_, m) in mapped {
                // SAFETY: registered in `map_buf`; unregistered once, here, before `m._keep`
                // (dropped at the end of this iteration) can free the memory.
                let _ = unsafe { sys::cuMemHostUnregister(m.host.cast()) };
            }
        }
    }
}

/// A user's CUDA module loaded into a [`Gpu`]'s context; unloaded on drop.
pub struct GpuModule(Module);

/// The open [`Gpu`] whose device memory holds `dptr..dptr+len` (one allocation), for
/// [`crate::Pd::register_gpu`]. `Error::Unsupported` when no `Gpu` is open in this process
/// (nothing could reach the memory), `Error::InvalidArgument` when none of them holds it.
pub(crate) fn owner_of(dptr: u64, len: u64) -> Result<Arc<Gpu>, Error> {
    let open: Vec<Arc<Gpu>> = OPEN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    if open.is_empty() {
        return Err(Error::Unsupported(
            "registering GPU memory needs the gpuverbs::gpu::Gpu it belongs to, and none is \
             open in this process (Gpu::open; or use Pd::register_device_mem)"
                .into(),
        ));
    }
    open.into_iter()
        .find(|g| g.holds(dptr, len))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{dptr:#x}+{len} is not inside one device-memory allocation of an open Gpu"
            ))
        })
}

/// The host page size.
fn host_page() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// Device memory; freed when the last clone drops (a registered region holds one).
#[derive(Clone)]
pub struct DeviceMem(Arc<Alloc>);

pub(crate) struct Alloc {
    gpu: Arc<Gpu>,
    /// What cuMemAlloc returned (freed on drop).
    base: u64,
    /// The buffer's first byte: `base` rounded up to a host page.
    dptr: u64,
    len: usize,
    /// CUDA's buffer ID of the allocation, once asked ([`DeviceMem::buffer_id`]).
    buffer_id: std::sync::OnceLock<u64>,
}

impl DeviceMem {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.0.dptr
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.0.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }
    /// The GPU it belongs to.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.0.gpu
    }
    /// CUDA's identity of the allocation (`CU_POINTER_ATTRIBUTE_BUFFER_ID`): unique within the
    /// process for its whole life, so memory allocated again at a freed address has another
    /// one (the registration cache keys on it, [`crate::Pd::register_cached`]).
    pub fn buffer_id(&self) -> Result<u64, CudaError> {
        if let Some(&id) = self.0.buffer_id.get() {
            return Ok(id);
        }
        let id = with_driver("buffer ID query", || {
            self.0
                .gpu
                .ctx
                .bind_to_thread()
                .map_err(drv("cuCtxSetCurrent"))?;
            let mut id: u64 = 0;
            // SAFETY: the attribute is an unsigned long long written through a valid pointer;
            // the pointer is this live allocation's.
            unsafe {
                sys::cuPointerGetAttribute(
                    (&mut id as *mut u64).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                    self.0.dptr,
                )
            }
            .result()
            .map_err(drv("cuPointerGetAttribute(BUFFER_ID)"))?;
            Ok(id)
        })?;
        Ok(*self.0.buffer_id.get_or_init(|| id))
    }
    /// The allocation, weakly (whether anything but a region still holds it).
    pub(crate) fn downgrade(&self) -> Weak<Alloc> {
        Arc::downgrade(&self.0)
    }
    /// Copies host bytes in.
    pub fn write(&self, off: usize, src: &[u8]) -> Result<(), CudaError> {
        assert!(
            off + src.len() <= self.len(),
            "DeviceMem write out of range"
        );
        self.0
            .gpu
            .ctx
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the destination range is inside this allocation.
        unsafe { cudarc::driver::result::memcpy_htod_sync(self.ptr() + off as u64, src) }
            .map_err(drv("cuMemcpyHtoD"))
    }
    /// Copies bytes out.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        assert!(off + dst.len() <= self.len(), "DeviceMem read out of range");
        self.0
            .gpu
            .ctx
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the source range is inside this allocation.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, self.ptr() + off as u64) }
            .map_err(drv("cuMemcpyDtoH"))
    }
    /// Reads the 8-byte completion counter at `off` (a word the NIC moves with fetch-adds,
    /// `put_counter` and its kin, or the CQ poll path, `put_counted`): its value now, as the
    /// device last wrote it. `Err` when `off` is not 8-byte aligned inside the allocation.
    pub fn read_counter(&self, off: usize) -> Result<u64, crate::Error> {
        if off % 8 != 0 || off.checked_add(8).is_none_or(|end| end > self.len()) {
            return Err(crate::Error::InvalidArgument(format!(
                "a counter at offset {off} of {} bytes: 8-byte aligned, inside",
                self.len()
            )));
        }
        let mut b = [0u8; 8];
        self.read(off, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }
}

impl std::fmt::Debug for DeviceMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceMem({:#x}, {} bytes)", self.ptr(), self.len())
    }
}

impl Drop for Alloc {
    fn drop(&mut self) {
        if self.gpu.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `Gpu::alloc`, freed once, when the last clone is gone.
            let _ = unsafe { cudarc::driver::result::free_sync(self.base) };
        }
    }
}

/// A QP's descriptor in GPU memory (pass [`ExportedQp::ptr`] to kernels), made by
/// [`Gpu::export_qp`] (`crate::export`), with what keeps the export alive until it is dropped:
/// its scratch word's buffer and region, and the QP's poster claim.
pub struct ExportedQp {
    pub(crate) mem: DeviceMem,
    pub(crate) _keep: Box<dyn Any + Send + Sync>,
}

impl ExportedQp {
    /// Device address of the `gpuverbs_qp` descriptor.
    pub fn ptr(&self) -> u64 {
        self.mem.ptr()
    }
    /// A copy of the descriptor as it is now (counters included).
    pub fn read(&self) -> Result<QpDesc, CudaError> {
        let mut b = [0u8; core::mem::size_of::<QpDesc>()];
        self.mem.read(0, &mut b)?;
        Ok(bytemuck::pod_read_unaligned(&b))
    }
    /// Whether kernels found the send queue broken (a reservation never published, see
    /// `QpDesc::sq_broken`): the descriptor is done for; reset the QP
    /// (`Qp::modify(Modify::Reset)`), connect it again and export it again.
    pub fn is_broken(&self) -> Result<bool, CudaError> {
        Ok(self.read()?.sq_broken != 0)
    }
    /// Overwrites the descriptor (tests: e.g. a lock word held, to see a call time out).
    pub fn write(&self, desc: &QpDesc) -> Result<(), CudaError> {
        self.mem.write(0, bytemuck::bytes_of(desc))
    }
}

/// NCCL GIN's default width of a counter comparison (its counters carry 56 bits): the device
/// API's `COUNTER_BITS`.
pub const COUNTER_BITS: u32 = 56;
/// GIN's default width of a signal comparison: the device API's `SIGNAL_BITS`.
pub const SIGNAL_BITS: u32 = 64;

/// The low `bits` bits set (`bits` 1..=64; 0 gives 0, more than 64 all): the device API's
/// `rolling_mask`, what `read_signal(sig, bits)` and `read_counter(counter, bits)` keep.
pub const fn rolling_mask(bits: u32) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

/// `a <= b` on a counter of `bits` bits that may wrap: `b` is at most 2^(bits-1) - 1 ahead of
/// `a` modulo 2^bits (bits above `bits` ignored). The host's copy of the device API's
/// `rolling_le` (`common.cuh`), the condition `wait_signal_rolling` and `wait_counter_rolling`
/// wait for (`rolling_le(least, word, bits)`); NCCL GIN's rolling comparison
/// (`nccl_device/utility.h` `rollingLessEq`, stated in `gin.h` above `readCounter`). Read a
/// counter from the host ([`DeviceMem::read_counter`]) and compare it with this.
pub const fn rolling_le(a: u64, b: u64, bits: u32) -> bool {
    let m = rolling_mask(bits);
    (b.wrapping_sub(a) & m) <= m >> 1
}

#[cfg(test)]
mod rolling_tests {
    use super::*;

    #[test]
    fn rolling_le_is_le_across_the_wrap() {
        let top56 = (1u64 << 56) - 1;
        // plain order away from the wrap, at every width
        for bits in [8, 32, 56, 64] {
            assert!(rolling_le(5, 5, bits));
            assert!(rolling_le(5, 6, bits));
            assert!(!rolling_le(6, 5, bits));
            assert!(
                rolling_le(0, rolling_mask(bits) >> 1, bits),
                "half the range ahead"
            );
            assert!(
                !rolling_le(0, (rolling_mask(bits) >> 1) + 1, bits),
                "one more is behind"
            );
        }
        // x <= x + 1 holds where x + 1 wraps to 0
        assert!(rolling_le(top56, 0, 56));
        assert!(rolling_le(top56 - 1, 3, 56));
        assert!(!rolling_le(3, top56 - 1, 56));
        assert!(rolling_le(u64::MAX - 1, 3, 64));
        assert!(!rolling_le(3, u64::MAX - 1, 64));
        // 56 bits: the bits above are ignored (a word with high bits set compares as its low 56)
        assert!(rolling_le(top56 - 1, 0xab00_0000_0000_0003, 56));
        assert!(!rolling_le(4, 0xab00_0000_0000_0003, 56));
        // with 64 bits the high bits count: that word is more than half the range past 2^64 - 2
        assert!(!rolling_le(u64::MAX - 1, 0xab00_0000_0000_0003, 64));
        // a plain >= says otherwise at the wrap: what the rolling form is for
        assert!(3 < u64::MAX - 1 && rolling_le(u64::MAX - 1, 3, 64));
    }

    #[test]
    fn rolling_le_matches_the_definition_on_every_pair_of_a_small_width() {
        // 4 bits: b is "at or after" a when (b - a) mod 16 is 0..=7
        for a in 0..16u64 {
            for b in 0..16u64 {
                let d = (b + 16 - a) % 16;
                assert_eq!(rolling_le(a, b, 4), d <= 7, "a {a} b {b}");
                // the high bits of either operand change nothing
                assert_eq!(rolling_le(a | 0x50, b | 0xa0, 4), d <= 7);
            }
        }
    }

    #[test]
    fn masks() {
        assert_eq!(rolling_mask(0), 0);
        assert_eq!(rolling_mask(1), 1);
        assert_eq!(rolling_mask(56), 0x00ff_ffff_ffff_ffff);
        assert_eq!(rolling_mask(64), u64::MAX);
        assert_eq!(rolling_mask(65), u64::MAX);
    }
}
