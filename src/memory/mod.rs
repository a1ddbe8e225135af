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
//!
//! # Lifetimes
//!
//! Every registration has a *generation* ([`Mr::generation`]), a process-wide serial number
//! that a [`crate::RemoteMemory`] made with [`crate::RemoteMemory::export_mr`] carries to the
//! peer: the same memory registered again has a new generation and a new rkey, and a peer that
//! still uses the old descriptor gets a REMOTE_ACCESS error completion (the old key is a bad
//! key), never the new region.
//!
//! A region cannot be freed under work in flight: it keeps its memory alive until it is
//! deregistered, and the device checks the key on every access, so a WQE that names a region
//! already gone completes with an error CQE instead of touching freed memory. To end a region
//! only once the WQEs posted before are done, call [`Mr::deregister`]: it waits, at most its
//! timeout, until every QP of the PD has executed the WQEs posted before the call, and otherwise
//! gives the region back in a [`DeregisterError`] that names the QPs still busy. A plain drop
//! waits too, at most 100 ms, then deregisters all the same, logging a warning that names the
//! QPs still busy (on the mlx5 backend, where the device's progress is not visible, it cannot
//! wait and deregisters at once).

mod buffer;
mod inflight;
mod region;

pub use buffer::HostBuffer;
pub(crate) use inflight::PdQps;
pub use inflight::{InFlight, QpInFlight};
use region::next_generation;
pub use region::{DeregisterError, Mr};
pub(crate) use region::{Keep, RegionPd};

use crate::backend::context::Context;
use crate::backend::seam::{PdOps, Registration};
use crate::gpu::DeviceMem;
use crate::Error;
use std::any::Any;
use std::sync::{Arc, OnceLock};

pub use verbs::{Access, MemKind};

/// A protection domain. Clones share it (and its registration cache, [`Pd::reg_cache`]).
#[derive(Clone)]
pub struct Pd {
    pub(crate) ctx: Context,
    pub(crate) dev: Arc<dyn PdOps>,
    /// The QPs of this PD (what [`Mr::deregister`] waits for).
    pub(crate) qps: Arc<PdQps>,
    /// The registration cache ([`Pd::register_cached`]), made on first use by
    /// `crate::regcache` (which stands on regions, above this module, so it is not named here).
    pub(crate) cache: Arc<OnceLock<Box<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pd({:?}, {:?})", self.ctx, self.dev)
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
        Ok(Pd {
            ctx: self.clone(),
            dev: self.inner.device.alloc_pd()?,
            qps: Arc::default(),
            cache: Arc::default(),
        })
    }
}

impl Pd {
    /// Registers a host buffer with local write access only.
    pub fn register(&self, buf: &HostBuffer) -> Result<Mr, Error> {
        self.register_with(buf, Access::LOCAL_WRITE)
    }

    /// Registers a host buffer with the given rights.
    pub fn register_with(&self, buf: &HostBuffer, access: Access) -> Result<Mr, Error> {
        self.register_host_range(buf, 0, buf.len() as u64, access)
    }

    /// Registers `off..off+len` of a host buffer (inside its allocation, which is whole
    /// pages) with the given rights; the region keeps the buffer alive.
    pub(crate) fn register_host_range(
        &self,
        buf: &HostBuffer,
        off: u64,
        len: u64,
        access: Access,
    ) -> Result<Mr, Error> {
        if off
            .checked_add(len)
            .is_none_or(|e| e > buf.buf.len() as u64)
        {
            return Err(Error::InvalidArgument(format!(
                "{off}+{len} is beyond the buffer's {} bytes",
                buf.buf.len()
            )));
        }
        // SAFETY: the range lies in the buffer's allocation, and the region keeps a clone of
        // the buffer, so the memory outlives the registration (which ends in `Mr::drop`).
        let mut mr = unsafe { self.register_raw(buf.addr() + off, len, access)? };
        mr._keep = Keep::Host(buf.clone());
        Ok(mr)
    }

    /// Registers raw host memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid host memory until the returned region is dropped.
    pub unsafe fn register_raw(&self, addr: u64, len: u64, access: Access) -> Result<Mr, Error> {
        // SAFETY: forwarded contract (the region drops its registration before it returns).
        let r = unsafe { self.dev.reg_host(addr, len, access)? };
        Ok(self.new_mr(r, (addr, len, access, MemKind::Host), Keep::Nothing))
    }

    /// A region of this PD over `range` (address, length, rights, kind), with a new
    /// generation.
    fn new_mr(&self, r: Registration, range: (u64, u64, Access, MemKind), keep: Keep) -> Mr {
        let (addr, len, access, kind) = range;
        Mr {
            pd: RegionPd {
                ctx: self.ctx.clone(),
                _dev: self.dev.clone(),
                qps: self.qps.clone(),
            },
            lkey: r.lkey,
            rkey: r.rkey,
            addr,
            len,
            access,
            kind,
            gpu_path: r.gpu_path,
            generation: next_generation(),
            quiet: false,
            _registration: r.handle,
            _keep: keep,
        }
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
    pub(crate) fn register_on_gpu(
        &self,
        gpu: &Arc<crate::gpu::Gpu>,
        dptr: u64,
        len: u64,
        access: Access,
        keep: Keep,
    ) -> Result<Mr, Error> {
        let r = self.dev.reg_gpu(gpu, dptr, len, access)?;
        Ok(self.new_mr(r, (dptr, len, access, MemKind::Device), keep))
    }

    /// Registers device memory reached through `mem` (a software device only; the tests'
    /// simulated GPU memory).
    #[cfg(test)]
    pub(crate) fn register_device(
        &self,
        mem: Arc<dyn verbs::DeviceMemory>,
        dptr: u64,
        len: u64,
        access: Access,
        keep: Keep,
    ) -> Result<Mr, Error> {
        let r = self.dev.reg_device_memory(mem, dptr, len, access)?;
        Ok(self.new_mr(r, (dptr, len, access, MemKind::Device), keep))
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{soft_pair, SoftPair};
    use prm::wqe::{CtrlFlags, Local, Op};
    use std::time::Duration;
    use verbs::initiator::RingMode;
    use verbs::QpState;
    use verbs::SimDeviceMemory;

    const T: Duration = Duration::from_secs(10);
    const RIGHTS: Access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0);

    /// Whether key `k` is a live region of side A's device.
    fn a_has(t: &SoftPair, k: prm::Lkey) -> bool {
        t.a.soft_device().unwrap().mr(k.0).is_some()
    }

    /// A signaled WRITE of `len` bytes of `src` to `dst`, posted and rung.
    fn write(ini: &mut verbs::initiator::Initiator, src: prm::Sge, dst: prm::RemoteAddr) {
        let op = Op::Write {
            remote: dst,
            local: Local::Sges(&[src]),
            imm: None,
        };
        ini.post_and_ring(&op, CtrlFlags::SIGNALED).unwrap();
    }

    fn syndrome(c: &prm::Completion) -> Option<prm::Syndrome> {
        match c {
            prm::Completion::Error(e) => e.syndrome(),
            _ => None,
        }
    }

    #[test]
    fn a_region_registered_again_has_a_new_generation_and_rkey_and_the_old_descriptor_fails() {
        let t = soft_pair();
        t.connect(Access::REMOTE_WRITE);
        let dst = HostBuffer::new(4096);
        let old = t.pb.register_with(&dst, RIGHTS).unwrap();
        // what the peer holds: the descriptor, through its wire form
        let stale =
            crate::RemoteMemory::from_bytes(&crate::RemoteMemory::export_mr(&old).to_bytes())
                .unwrap();
        assert_eq!(
            (stale.addr(), stale.len(), stale.rkey(), stale.generation()),
            (old.addr(), old.len(), old.rkey().0, old.generation())
        );
        assert_ne!(stale.generation(), 0);
        old.deregister(T).unwrap();
        let new = t.pb.register_with(&dst, RIGHTS).unwrap();
        assert_eq!(
            new.addr(),
            stale.addr(),
            "the same memory, at the same address"
        );
        assert_ne!(new.generation(), stale.generation());
        assert_ne!(new.rkey().0, stale.rkey());
        let fresh = crate::RemoteMemory::export_mr(&new);
        assert_eq!(fresh.generation(), new.generation());

        let src = HostBuffer::new(4096);
        let smr = t.pa.register(&src).unwrap();
        let mut ini = t.qa.cpu_initiator(RingMode::Doca);
        src.write(0, b"fresh");
        let to = |m: &crate::RemoteMemory| prm::RemoteAddr {
            addr: m.addr(),
            rkey: prm::Rkey(m.rkey()),
        };
        write(&mut ini, smr.sge(0, 5), to(&fresh));
        let done = ini.wait_send(T).unwrap();
        assert!(matches!(done, prm::Completion::Req { .. }), "{done:?}");
        assert_eq!(&dst.to_vec()[..5], b"fresh");
        // the old descriptor names a dead key: REMOTE_ACCESS, and the bytes stay
        src.write(0, b"stale");
        write(&mut ini, smr.sge(0, 5), to(&stale));
        let failed = ini.wait_send(T).unwrap();
        assert_eq!(
            syndrome(&failed),
            Some(prm::Syndrome::RemoteAccess),
            "{failed:?}"
        );
        assert_eq!(&dst.to_vec()[..5], b"fresh");
    }

    #[test]
    fn deregister_waits_for_the_wqes_posted_before_and_gives_the_region_back_on_timeout() {
        let t = soft_pair();
        let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
        src.fill(0, 64, 0x5a);
        let smr = t.pa.register(&src).unwrap();
        let dmr = t.pb.register_with(&dst, RIGHTS).unwrap();
        // Posted below RTS: accepted, and it waits for RTS.
        let mut ini = t.qa.cpu_initiator(RingMode::RdmaCore);
        write(&mut ini, smr.sge(0, 64), dmr.remote(0));
        let lkey = smr.lkey();
        let err = smr.deregister(Duration::ZERO).unwrap_err();
        assert_eq!(
            err.report().qps,
            vec![QpInFlight {
                qpn: t.qa.qpn(),
                state: QpState::Reset,
                blocks: Some(1),
            }]
        );
        assert_eq!(err.report().lkey, lkey.0);
        assert!(
            err.to_string().contains("still has WQEs in flight"),
            "{err}"
        );
        let smr = err.into_mr();
        assert!(a_has(&t, lkey), "a region that timed out stays registered");
        // Nothing of B's PD is in flight: a region there goes at once.
        let other = t.pb.register(&HostBuffer::new(64)).unwrap();
        other.deregister(Duration::ZERO).unwrap();
        let waiter = std::thread::spawn(move || smr.deregister(Duration::from_secs(60)));
        t.connect(Access::REMOTE_WRITE);
        // The WQE ran with the region still registered: the wait held it.
        let c = ini.wait_send(T).unwrap();
        assert!(matches!(c, prm::Completion::Req { .. }), "{c:?}");
        waiter.join().unwrap().unwrap();
        assert!(!a_has(&t, lkey), "deregistered once the WQE was done");
        assert_eq!(dst.to_vec()[..64], [0x5a; 64]);
    }

    #[test]
    fn deregister_waits_for_every_wqe_posted_before() {
        let t = soft_pair();
        let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
        src.fill(0, 64, 0x5a);
        let smr = t.pa.register(&src).unwrap();
        let dmr = t.pb.register_with(&dst, RIGHTS).unwrap();
        let mut ini = t.qa.cpu_initiator(RingMode::Doca);
        write(&mut ini, smr.sge(0, 64), dmr.remote(0));
        write(&mut ini, smr.sge(0, 32), dmr.remote(64));
        let lkey = smr.lkey();
        let waiter = std::thread::spawn(move || smr.deregister(Duration::from_secs(60)));
        t.connect(Access::REMOTE_WRITE);
        // Both WQEs ran with the region still registered: the wait held it.
        for _ in 0..2 {
            let c = ini.wait_send(T).unwrap();
            assert!(matches!(c, prm::Completion::Req { .. }), "{c:?}");
        }
        waiter.join().unwrap().unwrap();
        assert!(!a_has(&t, lkey));
        assert_eq!(dst.to_vec()[..96], [0x5a; 96]);
    }

    #[test]
    fn a_reset_or_destroyed_qp_has_nothing_in_flight() {
        let t = soft_pair();
        let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
        let dmr = t.pb.register_with(&dst, RIGHTS).unwrap();
        let smr = t.pa.register(&src).unwrap();
        let mut ini = t.qa.cpu_initiator(RingMode::RdmaCore);
        write(&mut ini, smr.sge(0, 8), dmr.remote(0));
        let smr = smr.deregister(Duration::ZERO).unwrap_err().into_mr();
        let waiter = std::thread::spawn(move || smr.deregister(Duration::from_secs(60)));
        // RESET drops what was posted
        t.qa.modify(verbs::Modify::Reset).unwrap();
        waiter.join().unwrap().unwrap();

        let smr = t.pa.register(&src).unwrap();
        drop(ini);
        let mut ini = t.qa.cpu_initiator(RingMode::RdmaCore);
        write(&mut ini, smr.sge(0, 8), dmr.remote(0));
        let smr = smr.deregister(Duration::ZERO).unwrap_err().into_mr();
        // a destroyed QP runs nothing more (the initiator still holds the device QP)
        let SoftPair { qa, .. } = t;
        drop(qa);
        smr.deregister(Duration::ZERO).unwrap();
        drop(ini);
    }

    #[test]
    fn a_region_dropped_under_work_in_flight_fails_the_wqe_not_the_memory() {
        let t = soft_pair();
        let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
        src.fill(0, 64, 1);
        let smr = t.pa.register(&src).unwrap();
        let dmr = t.pb.register_with(&dst, RIGHTS).unwrap();
        let mut ini = t.qa.cpu_initiator(RingMode::RdmaCore);
        write(&mut ini, smr.sge(0, 64), dmr.remote(0));
        let lkey = smr.lkey();
        drop(smr); // logs a warning: the QP has a WQE in flight
        assert!(!a_has(&t, lkey));
        t.connect(Access::REMOTE_WRITE);
        let c = ini.wait_send(T).unwrap();
        assert_eq!(syndrome(&c), Some(prm::Syndrome::LocalProt), "{c:?}");
        assert_eq!(dst.to_vec()[..64], [0; 64]);
        // and into the crate's error, the report survives (the region is dropped)
        let again = t.pa.register(&src).unwrap();
        let mut ini2 = {
            drop(ini);
            t.qa.modify(verbs::Modify::Reset).unwrap();
            t.qa.cpu_initiator(RingMode::RdmaCore)
        };
        write(&mut ini2, again.sge(0, 8), dmr.remote(0));
        let lkey = again.lkey();
        let e = Error::from(again.deregister(Duration::ZERO).unwrap_err());
        assert!(matches!(&e, Error::InFlight(r) if r.lkey == lkey.0), "{e}");
        assert!(!a_has(&t, lkey));
    }

    #[test]
    fn device_memory_regions_through_the_host_api() {
        let t = soft_pair();
        t.connect(Access::REMOTE_WRITE | Access::REMOTE_READ);
        let SoftPair { pa, pb, qa, .. } = t;
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
