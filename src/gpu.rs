//! A GPU as gpuverbs uses it: a CUDA context with the embedded kernels loaded, host memory
//! mapped into it (rings, doorbell pages, payload buffers), device memory, launches, and the
//! export of QP descriptors into GPU memory.

use crate::cuda::{drv, open, with_driver, CudaError, DeviceInfo, Module};
use crate::export::{db_mode, QpDesc};
use crate::memory::{Access, HostBuffer, Mr};
use crate::queue::{DoorbellMode, Qp};
use crate::Error;
use cudarc::driver::{sys, CudaContext};
use softnic::DmaBuf;
use std::any::Any;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP`.
const HOST_REGISTER_FLAGS: u32 = 0x01 | 0x02;

/// A host range registered with CUDA, and what keeps its memory alive.
struct Mapping {
    dptr: u64,
    host: *mut u8,
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
}

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
            Ok(Arc::new(Self {
                ctx,
                kernels,
                info,
                mapped: Mutex::new(HashMap::new()),
            }))
        })
    }

    /// Loads a user's fatbin (e.g. built with `gpuverbs-build`) into this GPU's context.
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
    fn map_buf(&self, buf: &DmaBuf, keep: Arc<dyn Any + Send + Sync>) -> Result<u64, CudaError> {
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
                _keep: keep,
            },
        );
        Ok(dptr)
    }

    /// Maps a host buffer (payload, signal words) into the GPU; returns its device address.
    pub fn map_host(&self, buf: &HostBuffer) -> Result<u64, CudaError> {
        self.map_buf(&buf.buf, buf.buf.clone())
    }

    /// Allocates `len` bytes of device memory, zeroed.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<DeviceMem, CudaError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: plain allocation; freed in DeviceMem::drop.
        let dptr = unsafe { cudarc::driver::result::malloc_sync(len.max(1)) }
            .map_err(drv("cuMemAlloc"))?;
        // SAFETY: dptr holds at least len bytes.
        unsafe { cudarc::driver::result::memset_d8_sync(dptr, 0, len.max(1)) }
            .map_err(drv("cuMemsetD8"))?;
        Ok(DeviceMem {
            gpu: self.clone(),
            dptr,
            len,
        })
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

    /// Exports `qp` for kernels: maps its rings, doorbell record, register page (or proxy word)
    /// and CQs into this GPU and writes a [`QpDesc`] into GPU memory. A QP has one descriptor
    /// (its owner); a second export is an error.
    pub fn export_qp(self: &Arc<Self>, qp: &Qp) -> Result<ExportedQp, Error> {
        if qp.exported.swap(true, Ordering::AcqRel) {
            return Err(Error::Busy("QP (already exported: one descriptor per QP)"));
        }
        let result = self.export_inner(qp);
        if result.is_err() {
            qp.exported.store(false, Ordering::Release);
        }
        result
    }

    fn export_inner(self: &Arc<Self>, qp: &Qp) -> Result<ExportedQp, Error> {
        let s = qp.soft();
        if s.sq_consumer() != 0 {
            return Err(Error::InvalidArgument(
                "export a QP before posting to it".into(),
            ));
        }
        let scratch = HostBuffer::new(64);
        let scratch_mr = qp.pd().register_with(&scratch, Access::LOCAL_WRITE)?;
        let keep_qp: Arc<dyn Any + Send + Sync> = s.clone();
        let map_qp = |b: &DmaBuf| self.map_buf(b, keep_qp.clone());
        let ctrl = map_qp(s.ctrl_page())?;
        let uar = map_qp(s.uar())?;
        let (scq, rcq) = (qp.send_cq().soft(), qp.recv_cq().soft());
        let map_cq = |cq: &Arc<softnic::Cq>, b: &DmaBuf| self.map_buf(b, cq.clone());
        let mode = qp.doorbell().0;
        let desc = QpDesc {
            sq_ring: map_qp(s.sq_ring())?,
            rq_ring: map_qp(s.rq_ring())?,
            dbrec: ctrl + s.dbrec_offset() as u64,
            db_reg: if mode == DoorbellMode::CpuProxy {
                0
            } else {
                uar + prm::doorbell::BF_OFFSET as u64
            },
            proxy_word: if mode == DoorbellMode::CpuProxy {
                ctrl + s.proxy_offset() as u64
            } else {
                0
            },
            scq_ring: map_cq(scq, scq.ring())?,
            scq_dbrec: map_cq(scq, scq.dbrec())?,
            rcq_ring: map_cq(rcq, rcq.ring())?,
            rcq_dbrec: map_cq(rcq, rcq.dbrec())?,
            scratch: self.map_host(&scratch)?,
            sq_blocks: s.sq_blocks(),
            rq_wqes: s.rq_wqes(),
            rq_stride: s.rq_stride(),
            qpn: s.qpn(),
            scq_ncqe: scq.ncqe(),
            rcq_ncqe: rcq.ncqe(),
            db_mode: match mode {
                DoorbellMode::Auto | DoorbellMode::GpuDoorbell => db_mode::GPU_DOORBELL,
                DoorbellMode::BlueFlame => db_mode::BLUEFLAME,
                DoorbellMode::CpuProxy => db_mode::CPU_PROXY,
            },
            ring_loc: 0,
            max_inline: s.max_inline(),
            scratch_lkey: scratch_mr.lkey().0,
            scq_collapsed: (scq.mode() == softnic::CqMode::Collapsed) as u32,
            rcq_collapsed: (rcq.mode() == softnic::CqMode::Collapsed) as u32,
            ..QpDesc::default()
        };
        let mem = self.alloc(core::mem::size_of::<QpDesc>())?;
        mem.write(0, bytemuck::bytes_of(&desc))?;
        Ok(ExportedQp {
            mem,
            _scratch: (scratch, scratch_mr),
        })
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

/// Device memory; freed on drop.
pub struct DeviceMem {
    gpu: Arc<Gpu>,
    dptr: u64,
    len: usize,
}

impl DeviceMem {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.dptr
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Copies host bytes in.
    pub fn write(&self, off: usize, src: &[u8]) -> Result<(), CudaError> {
        assert!(off + src.len() <= self.len, "DeviceMem write out of range");
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the destination range is inside this allocation.
        unsafe { cudarc::driver::result::memcpy_htod_sync(self.dptr + off as u64, src) }
            .map_err(drv("cuMemcpyHtoD"))
    }
    /// Copies bytes out.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        assert!(off + dst.len() <= self.len, "DeviceMem read out of range");
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the source range is inside this allocation.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, self.dptr + off as u64) }
            .map_err(drv("cuMemcpyDtoH"))
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.gpu.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `Gpu::alloc`, freed once.
            let _ = unsafe { cudarc::driver::result::free_sync(self.dptr) };
        }
    }
}

/// A QP's descriptor in GPU memory (pass [`ExportedQp::ptr`] to kernels).
pub struct ExportedQp {
    mem: DeviceMem,
    _scratch: (HostBuffer, Mr),
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
}
