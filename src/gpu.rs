//! A GPU as gpuverbs uses it: a CUDA context with the embedded kernels loaded, host memory
//! mapped into it (rings, doorbell pages, payload buffers), device memory, launches, the
//! export of QP descriptors into GPU memory, and the soft NIC's access to this GPU's memory
//! ([`Gpu::device_memory`]: CUDA copies on a stream of their own).

use crate::cuda::{drv, open, with_driver, CudaError, DeviceInfo, Module};
use crate::export::{db_mode, QpDesc};
use crate::memory::{Access, HostBuffer, Mr};
use crate::queue::{CqDev, DoorbellMode, Poster, PosterClaim, Qp, QpDev, QueueState};
use crate::Error;
use cuda_mem::CudaMemory;
use cudarc::driver::result::DriverError;
use cudarc::driver::{sys, CudaContext};
use softnic::devmem::{same_memory, DeviceMemory};
use softnic::DmaBuf;
use std::any::Any;
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

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
        cuda_mem::device_allocation(dptr)
            .is_some_and(|a| a.ordinal == self.info.ordinal && a.covers(dptr, len))
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
    fn map_range(
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

    /// Maps a host buffer (payload, signal words) into the GPU; returns its device address.
    pub fn map_host(&self, buf: &HostBuffer) -> Result<u64, CudaError> {
        self.map_buf(&buf.buf, buf.buf.clone())
    }

    /// Allocates `len` bytes of device memory, zeroed.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<DeviceMem, CudaError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: plain allocation; freed when the last DeviceMem clone drops.
        let dptr = unsafe { cudarc::driver::result::malloc_sync(len.max(1)) }
            .map_err(drv("cuMemAlloc"))?;
        let mem = DeviceMem(Arc::new(Alloc {
            gpu: self.clone(),
            dptr,
            len,
            buffer_id: std::sync::OnceLock::new(),
        }));
        // SAFETY: dptr holds at least len bytes.
        unsafe { cudarc::driver::result::memset_d8_sync(dptr, 0, len.max(1)) }
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
    fn gpu_addr(&self, buf: &DmaBuf, keep: Arc<dyn Any + Send + Sync>) -> Result<u64, Error> {
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

    /// Exports `qp` for kernels: maps its rings, doorbell record, register page (or proxy word)
    /// and CQs into this GPU and writes a [`QpDesc`] into GPU memory. The export is the QP's
    /// poster ([`crate::queue::Poster`]) until it is dropped: while a CPU initiator or another
    /// export holds the QP this is [`Error::PosterBusy`]. The descriptor's counters start from
    /// the queue's state ([`resume_desc`]), so a kernel continues where an earlier poster
    /// stopped.
    pub fn export_qp(self: &Arc<Self>, qp: &Qp) -> Result<ExportedQp, Error> {
        let claim = qp.posters.claim(Poster::GpuExport)?;
        self.export_inner(qp, claim)
    }

    fn export_inner(self: &Arc<Self>, qp: &Qp, claim: PosterClaim) -> Result<ExportedQp, Error> {
        let (Some(s), Some(scq), Some(rcq)) = (qp.soft(), qp.send_cq().soft(), qp.recv_cq().soft())
        else {
            return self.export_mlx5(qp, claim);
        };
        let scratch = HostBuffer::new(64);
        let scratch_mr = qp.pd().register_with(&scratch, Access::LOCAL_WRITE)?;
        let keep_qp: Arc<dyn Any + Send + Sync> = s.clone();
        let map_qp = |b: &DmaBuf| self.gpu_addr(b, keep_qp.clone());
        let ctrl = map_qp(s.ctrl_page())?;
        let uar = map_qp(s.uar())?;
        let map_cq = |cq: &Arc<softnic::Cq>, b: &DmaBuf| self.gpu_addr(b, cq.clone());
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
            // The WQE release before the doorbell: system scope for a host-memory SQ, GPU
            // scope for one in this GPU's memory (read by the NIC only after the doorbell).
            ring_loc: u32::from(!s.sq_ring().is_host()),
            max_inline: s.max_inline(),
            scratch_lkey: scratch_mr.lkey().0,
            scq_collapsed: (scq.mode() == softnic::CqMode::Collapsed) as u32,
            rcq_collapsed: (rcq.mode() == softnic::CqMode::Collapsed) as u32,
            ..QpDesc::default()
        };
        let mut desc = desc;
        let state = QueueState::of(s);
        resume_desc(&mut desc, &state)?;
        if mode == DoorbellMode::CpuProxy {
            // The kernel's 64-bit producer continues from the queue's (a proxy target made
            // now starts there too).
            s.ctrl_page()
                .atomic_u64(s.proxy_offset())
                .store(state.sq_pi, Ordering::Release);
        }
        let mem = self.alloc(core::mem::size_of::<QpDesc>())?;
        mem.write(0, bytemuck::bytes_of(&desc))?;
        Ok(ExportedQp {
            mem,
            _scratch: (scratch, scratch_mr),
            _claim: claim,
        })
    }
}

impl Gpu {
    /// Maps an mlx5 QP's UAR page (its BlueFlame register) into the GPU: as I/O memory first
    /// (real UARs are MMIO), else as plain memory, else an error that says why.
    fn map_uar(
        &self,
        q: &crate::mlx5::Qp,
        keep: &Arc<dyn Any + Send + Sync>,
    ) -> Result<u64, Error> {
        let (addr, len) = (q.bf_reg as u64, 2 * prm::doorbell::BF_HALF_SIZE);
        let io_err = match self.map_range(addr, len, keep.clone(), true) {
            Ok(a) => return Ok(a),
            Err(e) => e,
        };
        match self.map_range(addr, len, keep.clone(), false) {
            Ok(a) => {
                tracing::info!(qpn = q.qpn, error = %io_err, "UAR page mapped as plain memory");
                Ok(a)
            }
            Err(e) => Err(Error::Unsupported(format!(
                "the GPU cannot map QP {:#x}'s doorbell page: {io_err}; as plain memory: {e} (on \
                 x86 hosts the NVIDIA driver needs NVreg_RegistryDwords=\"PeerMappingOverride=1;\"; \
                 or use the CPU-proxy doorbell mode)",
                q.qpn
            ))),
        }
    }

    /// Exports a QP of the ConnectX backend: the provider's rings, doorbell record and CQs are
    /// registered into the GPU (`cuMemHostRegister`, DEVICEMAP), the UAR page as I/O memory
    /// (real UARs are MMIO) or, when the driver refuses that, as plain memory; when neither
    /// works the export fails and says why. In the CPU-proxy mode the UAR is not mapped: the
    /// kernel publishes its producer in the QP's proxy word ([`crate::proxy::ProxyTarget::for_qp`]).
    fn export_mlx5(self: &Arc<Self>, qp: &Qp, claim: PosterClaim) -> Result<ExportedQp, Error> {
        let (QpDev::Mlx5(q), CqDev::Mlx5(scq), CqDev::Mlx5(rcq)) =
            (&qp.dev, &qp.send_cq().dev, &qp.recv_cq().dev)
        else {
            return Err(Error::InvalidArgument(
                "a QP on CQs of another device".into(),
            ));
        };
        let mode = qp.doorbell().0;
        if scq.ncqe < q.sq_blocks {
            // rdma-core CQs detect overrun, and the device API bounds the signaled WQEs in
            // flight by the SQ's size, not the CQ's
            return Err(Error::InvalidArgument(format!(
                "QP {:#x}: its send CQ has {} entries for an SQ of {} blocks; a kernel could \
                 overrun it (make the CQ at least as deep as the SQ)",
                q.qpn, scq.ncqe, q.sq_blocks
            )));
        }
        let scratch = HostBuffer::new(64);
        let scratch_mr = qp.pd().register_with(&scratch, Access::LOCAL_WRITE)?;
        let keep_qp: Arc<dyn Any + Send + Sync> = q.clone();
        let map = |addr: *mut u8, len: usize, keep: &Arc<dyn Any + Send + Sync>| {
            self.map_range(addr as u64, len, keep.clone(), false)
        };
        let keep_scq: Arc<dyn Any + Send + Sync> = scq.clone();
        let keep_rcq: Arc<dyn Any + Send + Sync> = rcq.clone();
        // the doorbell: the UAR page mapped into the GPU, or (CPU proxy) a host word the kernel
        // stores its producer into and a host thread rings for it
        let (uar, proxy_word) = if mode == DoorbellMode::CpuProxy {
            let word = qp
                .proxy_word
                .as_ref()
                .ok_or_else(|| Error::InvalidArgument("an mlx5 QP without a proxy word".into()))?;
            (0, self.map_host(word)?)
        } else {
            (self.map_uar(q, &keep_qp)?, 0)
        };
        let desc = QpDesc {
            sq_ring: map(q.sq_buf, q.sq_blocks as usize * prm::WQEBB, &keep_qp)?,
            rq_ring: if q.rq_wqes == 0 {
                0
            } else {
                map(q.rq_buf, (q.rq_wqes * q.rq_stride) as usize, &keep_qp)?
            },
            dbrec: map(q.dbrec, 8, &keep_qp)?,
            db_reg: uar,
            proxy_word,
            scq_ring: map(scq.ring, scq.ncqe as usize * prm::CQE_SIZE, &keep_scq)?,
            scq_dbrec: map(scq.dbrec, 8, &keep_scq)?,
            rcq_ring: map(rcq.ring, rcq.ncqe as usize * prm::CQE_SIZE, &keep_rcq)?,
            rcq_dbrec: map(rcq.dbrec, 8, &keep_rcq)?,
            scratch: self.map_host(&scratch)?,
            sq_blocks: q.sq_blocks,
            rq_wqes: q.rq_wqes,
            rq_stride: q.rq_stride,
            qpn: q.qpn,
            scq_ncqe: scq.ncqe,
            rcq_ncqe: rcq.ncqe,
            db_mode: match mode {
                DoorbellMode::BlueFlame => db_mode::BLUEFLAME,
                DoorbellMode::CpuProxy => db_mode::CPU_PROXY,
                _ => db_mode::GPU_DOORBELL,
            },
            // the provider's rings are host memory: system-scope release before the doorbell
            ring_loc: 0,
            max_inline: q.max_inline,
            scratch_lkey: scratch_mr.lkey().0,
            scq_collapsed: 0,
            rcq_collapsed: 0,
            ..QpDesc::default()
        };
        let mut desc = desc;
        let state = QueueState::of_mlx5(qp, q);
        resume_desc(&mut desc, &state)?;
        if let (DoorbellMode::CpuProxy, Some(word)) = (mode, &qp.proxy_word) {
            // the kernel's 64-bit producer continues from the queue's
            word.atomic_u64(0).store(state.sq_pi, Ordering::Release);
        }
        let mem = self.alloc(core::mem::size_of::<QpDesc>())?;
        mem.write(0, bytemuck::bytes_of(&desc))?;
        Ok(ExportedQp {
            mem,
            _scratch: (scratch, scratch_mr),
            _claim: claim,
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
            let _ = unsafe { cudarc::driver::result::free_sync(self.dptr) };
        }
    }
}

/// A QP's descriptor in GPU memory (pass [`ExportedQp::ptr`] to kernels).
pub struct ExportedQp {
    mem: DeviceMem,
    _scratch: (HostBuffer, Mr),
    _claim: PosterClaim,
}

/// Sets a new descriptor's device-API counters to continue from `st`: every counter of the
/// SQ at the producer last rung, less the blocks the device has not executed (still in flight,
/// so not retired); the CQ consumer indexes from their doorbell records (a collapsed send CQ:
/// its slot-0 word plus 1, the device API's convention, when a CQE was taken before). The
/// device API counts receive WQEs against receive completions, so the RQ continues only when
/// the receive CQ's consumer index is in step with the RQ (every consumed receive's CQE
/// taken, the receive CQ not shared with the send CQ or another QP), or the RQ was never
/// posted to (it starts fresh); otherwise `Error::InvalidArgument`.
pub(crate) fn resume_desc(d: &mut QpDesc, st: &QueueState) -> Result<(), Error> {
    let pi = st.sq_pi;
    d.sq_reserved = pi;
    d.sq_ready = pi;
    d.sq_rung = pi;
    d.sq_signaled_end = pi;
    d.sq_last_start = pi;
    d.sq_retired = pi.wrapping_sub(u64::from(st.sq_in_flight));
    d.scq_ci = if d.scq_collapsed != 0 {
        match st.scq_slot0 {
            Some(tail) if st.scq_ci != 0 => u64::from(tail) + 1,
            _ => 0,
        }
    } else {
        u64::from(st.scq_ci)
    };
    // An RQ never posted to starts fresh whatever the receive CQ holds (a send CQ shared
    // with it); otherwise its consumer index must be the receive CQ's.
    let rq_out = match st.rq_consumer {
        _ if d.rq_wqes == 0 => 0,
        _ if st.rq_head == 0 && st.rq_consumer.is_none_or(|c| c == 0) => 0,
        Some(c) if c as u16 == st.rcq_ci as u16 => st.rq_head.wrapping_sub(c as u16),
        other => {
            return Err(Error::InvalidArgument(format!(
                "the receive CQ's consumer index ({}) is not in step with the RQ ({}): take \
                 every receive completion before exporting the QP (and give the receives a CQ \
                 of their own)",
                st.rcq_ci,
                match other {
                    Some(c) => format!("{c} receives consumed"),
                    None => "receives consumed unknown: the receive CQ is the send CQ".into(),
                }
            )))
        }
    };
    d.rcq_ci = u64::from(st.rcq_ci);
    d.rq_posted = d.rcq_ci + u64::from(rq_out);
    Ok(())
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
