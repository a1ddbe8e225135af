//! Protection domains, host buffers and memory regions.
//!
//! Regions hold their PD (and so the device) alive; a region keeps its buffer alive, and its
//! drop deregisters it, waiting for any device copy in flight (the device never touches freed
//! memory). Access rights default to the minimum: local write only; remote rights only when
//! asked.
//!
//! Regions may be host memory ([`Pd::register`]) or GPU memory ([`Pd::register_device_mem`],
//! [`Pd::register_gpu`]); the soft NIC moves the bytes of GPU regions with CUDA copies
//! ([`crate::gpu::Gpu::device_memory`]); an rdma-core device gets them through a dma-buf of
//! the GPU pages, else through the GPU address (nvidia-peermem) ([`Mr::gpu_path`]).

use crate::device::{Backend, Context};
use crate::gpu::DeviceMem;
use crate::Error;
use softnic::devmem::DeviceMemory;
use softnic::DmaBuf;
use std::sync::Arc;

pub use softnic::{Access, MemKind};

/// A protection domain.
#[derive(Clone)]
pub struct Pd {
    pub(crate) ctx: Context,
    pub(crate) dev: PdDev,
}

/// The device's PD.
#[derive(Clone)]
pub(crate) enum PdDev {
    Soft(softnic::PdId),
    Mlx5(Arc<crate::mlx5::Pd>),
}

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.dev {
            PdDev::Soft(id) => write!(f, "Pd({:?}, {id:?})", self.ctx),
            PdDev::Mlx5(_) => write!(f, "Pd({:?})", self.ctx),
        }
    }
}

impl Context {
    /// Allocates a protection domain.
    ///
    /// # Panics
    /// When [`Context::try_alloc_pd`] fails (only an rdma-core device can refuse), with the
    /// device's error.
    pub fn alloc_pd(&self) -> Pd {
        match self.try_alloc_pd() {
            Ok(pd) => pd,
            Err(e) => panic!("Context::alloc_pd: {e}"),
        }
    }

    /// Allocates a protection domain, or the device's error.
    pub fn try_alloc_pd(&self) -> Result<Pd, Error> {
        let dev = match &self.inner.backend {
            Backend::Soft(d) => PdDev::Soft(d.alloc_pd()),
            Backend::Mlx5(d) => PdDev::Mlx5(d.alloc_pd()?),
        };
        Ok(Pd {
            ctx: self.clone(),
            dev,
        })
    }
}

/// Page-aligned host memory that the device (and, once mapped, a GPU) can address.
///
/// Its length is what was asked for; the allocation behind it is rounded up to whole pages
/// (at least one), so no two buffers share a page (each can be pinned or mapped on its own).
#[derive(Clone, Debug)]
pub struct HostBuffer {
    pub(crate) buf: Arc<DmaBuf>,
    len: usize,
}

/// A page-aligned, zeroed host allocation, freed when the buffer that wraps it is dropped.
struct PageAlloc {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the allocation is plain host memory owned by this value; it is only freed in `drop`
// and every access goes through the `DmaBuf` that wraps it.
unsafe impl Send for PageAlloc {}
// SAFETY: as above; `&PageAlloc` gives no access to the memory.
unsafe impl Sync for PageAlloc {}

impl Drop for PageAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `HostBuffer::try_new` with exactly this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes (`len()` is `len`; 0 is an empty buffer).
    ///
    /// # Panics
    /// When the allocator cannot serve `len` bytes (see [`HostBuffer::try_new`]), with a
    /// message that says so.
    pub fn new(len: usize) -> Self {
        match Self::try_new(len) {
            Ok(b) => b,
            Err(e) => panic!("HostBuffer::new({len}): {e}"),
        }
    }

    /// Allocates `len` zeroed bytes, or [`Error::HostAlloc`] when `len` rounded up to whole
    /// pages does not fit in the address space or the allocator has no memory for it.
    pub fn try_new(len: usize) -> Result<Self, Error> {
        use softnic::buffer::PAGE;
        let refuse = |reason| Error::HostAlloc { len, reason };
        let bytes = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| refuse("larger than the address space"))?;
        let layout = std::alloc::Layout::from_size_align(bytes, PAGE)
            .map_err(|_| refuse("larger than the largest allocation (isize::MAX bytes)"))?;
        // SAFETY: the layout has a non-zero size (at least one page).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(nn) = std::ptr::NonNull::new(ptr) else {
            return Err(refuse("the allocator has no memory for it"));
        };
        let owner = PageAlloc { ptr, layout };
        // SAFETY: `ptr..ptr+bytes` is a fresh, page-aligned, zeroed allocation owned by
        // `owner`, which the buffer keeps until it is dropped; nothing else refers to it.
        let buf = unsafe { DmaBuf::from_external(nn, bytes, Box::new(owner)) };
        Ok(Self {
            buf: Arc::new(buf),
            len,
        })
    }

    /// Host address of the first byte.
    pub fn addr(&self) -> u64 {
        self.buf.addr()
    }
    /// Length in bytes (what was asked for).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    fn check(&self, what: &str, off: usize, n: usize) {
        assert!(
            off.checked_add(n).is_some_and(|e| e <= self.len),
            "HostBuffer::{what}: {off}+{n} is beyond its {} bytes",
            self.len
        );
    }
    /// Copies bytes out.
    ///
    /// # Panics
    /// When `off + dst.len()` is beyond `len()`.
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.check("read", off, dst.len());
        self.buf.read(off, dst)
    }
    /// Copies bytes in.
    ///
    /// # Panics
    /// When `off + src.len()` is beyond `len()`.
    pub fn write(&self, off: usize, src: &[u8]) {
        self.check("write", off, src.len());
        self.buf.write(off, src)
    }
    /// Fills a range with one byte.
    ///
    /// # Panics
    /// When `off + n` is beyond `len()`.
    pub fn fill(&self, off: usize, n: usize, byte: u8) {
        self.check("fill", off, n);
        self.buf.fill(off, n, byte)
    }
    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.read(0, &mut v);
        v
    }
    /// The 8-byte word at `off` as an atomic (for signal words).
    ///
    /// # Panics
    /// When the word is beyond `len()` or `off` is not 8-byte aligned.
    pub fn atomic_u64(&self, off: usize) -> &std::sync::atomic::AtomicU64 {
        self.check("atomic_u64", off, 8);
        self.buf.atomic_u64(off)
    }
}

/// What a region keeps alive.
#[derive(Debug)]
pub(crate) enum Keep {
    /// Nothing: the caller keeps the memory valid.
    Nothing,
    Host(#[allow(dead_code)] HostBuffer),
    Device(#[allow(dead_code)] DeviceMem),
}

/// A registered memory region.
#[derive(Debug)]
pub struct Mr {
    pd: Pd,
    /// Range, rights and kind; `key` is the lkey.
    info: softnic::MrInfo,
    rkey: u32,
    /// How GPU memory was registered on an rdma-core device.
    gpu_path: Option<crate::mlx5::GpuRegPath>,
    /// The rdma-core registration (deregistered on drop), on the mlx5 backend.
    _mlx5: Option<MlxMr>,
    _keep: Keep,
}

/// An rdma-core region owner (opaque in Debug output).
struct MlxMr(#[allow(dead_code)] crate::mlx5::Mr);

impl std::fmt::Debug for MlxMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("mlx5 MR")
    }
}

impl Mr {
    /// The local key.
    pub fn lkey(&self) -> prm::Lkey {
        prm::Lkey(self.info.key)
    }
    /// The remote key (a capability: hand it out only on purpose).
    pub fn rkey(&self) -> prm::Rkey {
        prm::Rkey(self.rkey)
    }
    /// First byte.
    pub fn addr(&self) -> u64 {
        self.info.addr
    }
    /// Length.
    pub fn len(&self) -> u64 {
        self.info.len
    }
    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.info.len == 0
    }
    /// Rights.
    pub fn access(&self) -> Access {
        self.info.access
    }
    /// Where its bytes live: host memory or GPU memory.
    pub fn kind(&self) -> MemKind {
        self.info.kind
    }
    /// For GPU memory on an rdma-core device: whether it was registered through a dma-buf or
    /// through nvidia-peermem (`None` elsewhere).
    pub fn gpu_path(&self) -> Option<crate::mlx5::GpuRegPath> {
        self.gpu_path
    }
    /// An SGE over `off..off+len` of this region.
    pub fn sge(&self, off: u64, len: u32) -> prm::Sge {
        prm::Sge {
            addr: self.info.addr + off,
            len,
            lkey: self.lkey(),
        }
    }
    /// The remote address of `off` in this region, with its rkey.
    pub fn remote(&self, off: u64) -> prm::RemoteAddr {
        prm::RemoteAddr {
            addr: self.info.addr + off,
            rkey: self.rkey(),
        }
    }
}

impl Pd {
    /// Registers a host buffer with local write access only.
    pub fn register(&self, buf: &HostBuffer) -> Result<Mr, Error> {
        self.register_with(buf, Access::LOCAL_WRITE)
    }

    /// Registers a host buffer with the given rights.
    pub fn register_with(&self, buf: &HostBuffer, access: Access) -> Result<Mr, Error> {
        // SAFETY: the region keeps a clone of the buffer, so the memory outlives the
        // registration (which ends in `Mr::drop`).
        let mut mr = unsafe { self.register_raw(buf.addr(), buf.len() as u64, access)? };
        mr._keep = Keep::Host(buf.clone());
        Ok(mr)
    }

    /// Registers raw host memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid host memory until the returned region is dropped.
    pub unsafe fn register_raw(&self, addr: u64, len: u64, access: Access) -> Result<Mr, Error> {
        let (info, rkey, mlx5) = match (&self.ctx.inner.backend, &self.dev) {
            (Backend::Soft(d), PdDev::Soft(id)) => {
                // SAFETY: forwarded contract.
                let info = unsafe { d.reg_host(*id, addr, len, access)? };
                (info, info.key, None)
            }
            (Backend::Mlx5(_), PdDev::Mlx5(pd)) => {
                if len == 0 {
                    return Err(Error::InvalidArgument("an empty memory region".into()));
                }
                // SAFETY: forwarded contract.
                let mr = unsafe { pd.reg_host(addr, len, access)? };
                let info = softnic::MrInfo {
                    key: mr.lkey,
                    pd: softnic::PdId(0),
                    addr,
                    len,
                    access,
                    kind: MemKind::Host,
                };
                (info, mr.rkey, Some(MlxMr(mr)))
            }
            _ => unreachable!("a PD belongs to its context's backend"),
        };
        Ok(Mr {
            pd: self.clone(),
            info,
            rkey,
            gpu_path: None,
            _mlx5: mlx5,
            _keep: Keep::Nothing,
        })
    }

    /// Registers GPU memory: `dptr..dptr+len` must lie in one device-memory allocation
    /// (`cuMemAlloc`, [`crate::gpu::Gpu::alloc`]) of a [`crate::gpu::Gpu`] open in this
    /// process, which the caller keeps allocated while the region exists
    /// ([`Pd::register_device_mem`] keeps it for you). The device reads and writes the region
    /// only through that GPU's CUDA copies ([`crate::gpu::Gpu::device_memory`]), never with
    /// host loads and stores; if the memory is freed under the region, transfers fail with
    /// error CQEs (or land in whatever GPU memory reuses the addresses).
    ///
    /// Errors: `Error::Unsupported` when no `Gpu` is open, `Error::InvalidArgument` when the
    /// range is not device memory of an open one, the device's checks (empty range, remote
    /// write or atomic without local write).
    pub fn register_gpu(&self, dptr: u64, len: u64, access: Access) -> Result<Mr, Error> {
        let gpu = crate::gpu::owner_of(dptr, len)?;
        self.register_on_gpu(&gpu, dptr, len, access, Keep::Nothing)
    }

    /// Registers all of `mem` (GPU memory); the region keeps it allocated.
    pub fn register_device_mem(&self, mem: &DeviceMem, access: Access) -> Result<Mr, Error> {
        let keep = Keep::Device(mem.clone());
        self.register_on_gpu(mem.gpu(), mem.ptr(), mem.len() as u64, access, keep)
    }

    /// Registers GPU memory of `gpu`: on the soft NIC through the GPU's copies; on an
    /// rdma-core device through a dma-buf of its pages (`ibv_reg_dmabuf_mr`), else the GPU
    /// address itself (`ibv_reg_mr`, nvidia-peermem).
    fn register_on_gpu(
        &self,
        gpu: &crate::gpu::Gpu,
        dptr: u64,
        len: u64,
        access: Access,
        keep: Keep,
    ) -> Result<Mr, Error> {
        let PdDev::Mlx5(pd) = &self.dev else {
            return self.register_device(gpu.device_memory(), dptr, len, access, keep);
        };
        if len == 0 {
            return Err(Error::InvalidArgument("an empty memory region".into()));
        }
        let dmabuf = gpu.dmabuf(dptr, len).map_err(|e| e.to_string());
        let (mr, path) = pd.reg_gpu(dptr, len, access, dmabuf)?;
        let info = softnic::MrInfo {
            key: mr.lkey,
            pd: softnic::PdId(0),
            addr: dptr,
            len,
            access,
            kind: MemKind::Device,
        };
        Ok(Mr {
            pd: self.clone(),
            info,
            rkey: mr.rkey,
            gpu_path: Some(path),
            _mlx5: Some(MlxMr(mr)),
            _keep: keep,
        })
    }

    /// Registers device memory reached through `mem` (the soft NIC only).
    pub(crate) fn register_device(
        &self,
        mem: Arc<dyn DeviceMemory>,
        dptr: u64,
        len: u64,
        access: Access,
        keep: Keep,
    ) -> Result<Mr, Error> {
        let info = match (&self.ctx.inner.backend, &self.dev) {
            (Backend::Soft(d), PdDev::Soft(id)) => d.reg_device(*id, dptr, len, access, mem)?,
            _ => {
                return Err(Error::Unsupported(
                    "a DeviceMemory region on an rdma-core device (register GPU memory with \
                     Pd::register_gpu or Pd::register_device_mem)"
                        .into(),
                ))
            }
        };
        Ok(Mr {
            pd: self.clone(),
            info,
            rkey: info.key,
            gpu_path: None,
            _mlx5: None,
            _keep: keep,
        })
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        match &self.pd.ctx.inner.backend {
            Backend::Soft(d) => {
                if let Err(e) = d.dereg(self.info.key) {
                    tracing::warn!(key = self.info.key, error = %e, "deregistration failed");
                }
            }
            // the rdma-core registration ends when `mlx5` drops
            Backend::Mlx5(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConnectOptions, CqOptions, DeviceRequest, QpOptions};
    use prm::wqe::{CtrlFlags, Local, Op};
    use softnic::initiator::RingMode;
    use softnic::SimDeviceMemory;
    use std::time::Duration;

    #[test]
    fn device_memory_regions_through_the_host_api() {
        let (a, b) = (
            Context::open(DeviceRequest::Soft).unwrap(),
            Context::open(DeviceRequest::Soft).unwrap(),
        );
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        let (ca, cb) = (
            a.create_cq(CqOptions::default()).unwrap(),
            b.create_cq(CqOptions::default()).unwrap(),
        );
        let qa = pa.create_qp(QpOptions::new(&ca, &ca)).unwrap();
        let qb = pb.create_qp(QpOptions::new(&cb, &cb)).unwrap();
        let conn = ConnectOptions {
            access: Access::REMOTE_WRITE | Access::REMOTE_READ,
            ..Default::default()
        };
        qa.connect(&qb.endpoint(), conn).unwrap();
        qb.connect(&qa.endpoint(), conn).unwrap();
        let gpu = SimDeviceMemory::new(1 << 16);
        let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let target = pb
            .register_device(gpu.clone(), gpu.base(), 4096, rights, Keep::Nothing)
            .unwrap();
        assert_eq!(target.kind(), MemKind::Device);
        let src = HostBuffer::new(4096);
        src.write(0, b"to the GPU");
        let src_mr = pa.register(&src).unwrap();
        assert_eq!(src_mr.kind(), MemKind::Host);
        let mut ini = qa.cpu_initiator(RingMode::Doca);
        let w = Op::Write {
            remote: target.remote(100),
            local: Local::Sges(&[src_mr.sge(0, 10)]),
            imm: None,
        };
        ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
        let done = ini.wait_send(Duration::from_secs(10)).unwrap();
        assert!(matches!(done, prm::Completion::Req { .. }), "{done:?}");
        assert_eq!(gpu.peek(gpu.base() + 100, 10), b"to the GPU");
        assert!(gpu.counts().writes >= 1);
        // without an open Gpu, a raw device pointer has nothing to reach it
        assert!(matches!(
            pb.register_gpu(gpu.base(), 64, Access::LOCAL_WRITE),
            Err(Error::Unsupported(_))
        ));
    }
}
