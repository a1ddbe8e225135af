//! Protection domains, memory regions (host, GPU and dma-buf) and memory windows: ALLOC_PD,
//! DEALLOC_PD, REG_MR, REG_DMABUF_MR, REREG_MR, DEREG_MR, ALLOC_MW and DEALLOC_MW.

use super::{ib_access, unsupported, Context, Created, Io};
use crate::abi::{self, access};
use crate::dmabuf::{self, dmabuf_size, is_dmabuf};
use crate::peermem;
use crate::uaccess::{check_mapped, Errno};

pub(super) struct PdObj {
    pub(super) id: softnic::PdId,
}

pub(super) struct MrObj {
    pub(super) key: u32,
    pd: u32,
}

pub(super) struct MwObj {
    /// The key the window was allocated with (binds change its low byte).
    pub(super) key: u32,
    pd: u32,
}

impl Context {
    pub(super) fn alloc_pd(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let id = soft.alloc_pd();
        let h = o.handle();
        io.reply(&abi::AllocPdResp { pd_handle: h })?;
        io.ureply(&abi::Mlx5AllocPdResp { pdn: id.0 })?;
        o.pds.insert(h, PdObj { id });
        Ok(Created::Nothing)
    }

    pub(super) fn dealloc_pd(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Handle = io.core()?;
        let mut o = self.objs.lock();
        if !o.pds.contains_key(&r.handle) {
            return Err(Errno::EINVAL);
        }
        let used = o.mrs.values().any(|m| m.pd == r.handle)
            || o.mws.values().any(|m| m.pd == r.handle)
            || o.qps.values().any(|q| q.pd == r.handle)
            || o.ahs.values().any(|a| a.pd == r.handle)
            || o.srqs.values().any(|q| q.pd == r.handle)
            || o.pd_in_use_by_devx(r.handle);
        if used {
            return Err(Errno::EBUSY);
        }
        o.pds.remove(&r.handle);
        Ok(Created::Nothing)
    }

    fn check_mr(start: u64, length: u64, hca_va: u64, flags: u32) -> Result<verbs::Access, Errno> {
        let a = ib_access(flags)?;
        if (flags & (access::REMOTE_WRITE | access::REMOTE_ATOMIC)) != 0
            && flags & access::LOCAL_WRITE == 0
        {
            return Err(Errno::EINVAL);
        }
        if flags & access::ON_DEMAND != 0 {
            return Err(unsupported("REG_MR with IBV_ACCESS_ON_DEMAND (no ODP)"));
        }
        if flags & access::ZERO_BASED != 0 {
            return Err(Errno::EINVAL);
        }
        if length == 0 || start.checked_add(length).is_none() {
            return Err(Errno::EINVAL);
        }
        if hca_va != start {
            return Err(unsupported("REG_MR with an IOVA other than the address"));
        }
        Ok(a)
    }

    pub(super) fn reg_mr(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::RegMr = io.core()?;
        let a = Self::check_mr(r.start, r.length, r.hca_va, r.access_flags)?;
        // host memory, else GPU memory resolved as nvidia-peermem would, else EFAULT
        let gpu = match check_mapped(r.start, r.length) {
            Ok(()) => None,
            Err(e) => Some(peermem::resolve(r.start, r.length).ok_or(e)?),
        };
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let pd = o.pds.get(&r.pd_handle).ok_or(Errno::EINVAL)?.id;
        let info = match gpu {
            Some(mem) => soft.reg_device(pd, r.start, r.length, a, mem),
            // SAFETY: the range is mapped (checked); an application that unmaps registered
            // memory before deregistering it breaks the verbs contract (the kernel would keep
            // the pages pinned; here the device's accesses would fault in the application's
            // own process).
            None => unsafe { soft.reg_host(pd, r.start, r.length, a) },
        }
        .map_err(|_| Errno::EINVAL)?;
        let h = o.handle();
        if let Err(e) = io.reply(&abi::RegMrResp {
            mr_handle: h,
            lkey: info.key,
            rkey: info.key,
        }) {
            let _ = soft.dereg(info.key);
            return Err(e);
        }
        o.mrs.insert(
            h,
            MrObj {
                key: info.key,
                pd: r.pd_handle,
            },
        );
        Ok(Created::Nothing)
    }

    /// REG_DMABUF_MR (the ioctl path): a region over a dma-buf, as mlx5_ib's `reg_user_mr_dmabuf`. The
    /// emulated kernel cannot map a dma-buf's pages; it checks that the fd is a dma-buf that
    /// holds `offset + length` bytes, and that the range at the IOVA (the address peers and
    /// WQEs name the region by) and the dma-buf's first byte (`iova - offset`) are device
    /// memory of one GPU allocation, whose bytes the soft NIC then moves with CUDA copies
    /// ([`peermem`]). Access flags as REG_MR; a bad PD or a missing attribute: EINVAL; not a
    /// dma-buf: EINVAL; a range it cannot resolve: EFAULT.
    pub(super) fn reg_dmabuf_mr(&self, call: &crate::ioctl::Call) -> Result<(), Errno> {
        use abi::ioctl::reg_dmabuf_mr as id;
        let (pd_h, offset, length, iova) = (
            call.handle(id::PD_HANDLE)?,
            call.need(id::OFFSET)?,
            call.need(id::LENGTH)?,
            call.need(id::IOVA)?,
        );
        let (fd, flags) = (
            call.handle(id::FD)? as i32,
            call.need(id::ACCESS_FLAGS)? as u32,
        );
        for out in [id::HANDLE, id::RESP_LKEY, id::RESP_RKEY] {
            if !call.has(out) {
                return Err(Errno::EINVAL);
            }
        }
        let a = Self::check_mr(iova, length, iova, flags)?;
        let end = offset.checked_add(length).ok_or(Errno::EINVAL)?;
        if !is_dmabuf(fd)? {
            return Err(Errno::EINVAL);
        }
        if dmabuf_size(fd).is_some_and(|size| end > size) {
            return Err(Errno::EINVAL);
        }
        // the dma-buf's first byte: what the CUDA driver exported it from (seen by the
        // preload), else the IOVA less the offset (the GPU address, as applications pass it)
        let first = match dmabuf::gpu_range(fd) {
            Some(r) if end > r.len => return Err(Errno::EINVAL),
            Some(r) => r.addr,
            None => iova.checked_sub(offset).ok_or(Errno::EINVAL)?,
        };
        if first.checked_add(offset) != Some(iova) {
            crate::complain(format_args!(
                "REG_DMABUF_MR with an IOVA ({iova:#x}) other than the GPU address of its bytes                  ({:#x}) is not emulated (EOPNOTSUPP)",
                first.wrapping_add(offset)
            ));
            return Err(Errno::EOPNOTSUPP);
        }
        let mem = peermem::resolve(first, end).ok_or(Errno::EFAULT)?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let pd = o.pds.get(&pd_h).ok_or(Errno::EINVAL)?.id;
        let info = soft
            .reg_device(pd, iova, length, a, mem)
            .map_err(|_| Errno::EINVAL)?;
        let h = o.handle();
        let out = || -> Result<(), Errno> {
            call.output(id::RESP_LKEY, &info.key.to_ne_bytes())?;
            call.output(id::RESP_RKEY, &info.key.to_ne_bytes())?;
            call.new_handle(id::HANDLE, h)
        };
        if let Err(e) = out() {
            let _ = soft.dereg(info.key);
            return Err(e);
        }
        o.mrs.insert(
            h,
            MrObj {
                key: info.key,
                pd: pd_h,
            },
        );
        crate::CUDA_SEEN
            .dmabuf_mrs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    pub(super) fn rereg_mr(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ReregMr = io.core()?;
        // IB_MR_REREG_TRANS 1, _PD 2, _ACCESS 4
        if r.flags == 0 || r.flags & !7 != 0 {
            return Err(Errno::EINVAL);
        }
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let mr = o.mrs.get(&r.mr_handle).ok_or(Errno::EINVAL)?;
        let old = soft.mr(mr.key).ok_or(Errno::EINVAL)?;
        let (start, len) = if r.flags & 1 != 0 {
            (r.start, r.length)
        } else {
            (old.addr, old.len)
        };
        let va = if r.flags & 1 != 0 { r.hca_va } else { start };
        let pd_handle = if r.flags & 2 != 0 { r.pd_handle } else { mr.pd };
        let pd = o.pds.get(&pd_handle).ok_or(Errno::EINVAL)?.id;
        if old.kind != verbs::MemKind::Host {
            return Err(unsupported("REREG_MR of GPU memory"));
        }
        let a = if r.flags & 4 != 0 {
            Self::check_mr(start, len, va, r.access_flags)?
        } else {
            Self::check_mr(start, len, va, 0)?;
            old.access
        };
        check_mapped(start, len)?;
        // The key stays (mlx5_ib modifies the mkey in place).
        // SAFETY: as in reg_mr, for the new range.
        let info =
            unsafe { soft.rereg_host(old.key, pd, start, len, a) }.map_err(|_| Errno::EINVAL)?;
        let h = r.mr_handle;
        io.reply(&abi::ReregMrResp {
            lkey: info.key,
            rkey: info.key,
        })?;
        o.mrs.insert(
            h,
            MrObj {
                key: info.key,
                pd: pd_handle,
            },
        );
        Ok(Created::Nothing)
    }

    pub(super) fn dereg_mr(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Handle = io.core()?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let mr = o.mrs.remove(&r.handle).ok_or(Errno::EINVAL)?;
        soft.dereg(mr.key).map_err(|_| Errno::EINVAL)?;
        Ok(Created::Nothing)
    }

    /// ALLOC_MW as mlx5_ib serves it: type 1 or 2 (else EINVAL), driver data with nothing
    /// set but the KLM count (else EOPNOTSUPP).
    pub(super) fn alloc_mw(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::AllocMw = io.core()?;
        let req: abi::Mlx5AllocMw = io.udata()?;
        if req.comp_mask != 0 || req.reserved1 != 0 || req.reserved2 != 0 {
            return Err(Errno::EOPNOTSUPP);
        }
        let kind = match r.mw_type {
            1 => softnic::MwType::One,
            2 => softnic::MwType::Two,
            _ => return Err(Errno::EINVAL),
        };
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let pd = o.pds.get(&r.pd_handle).ok_or(Errno::EINVAL)?.id;
        let key = soft.alloc_mw(pd, kind);
        let h = o.handle();
        if let Err(e) = io.reply(&abi::AllocMwResp {
            mw_handle: h,
            rkey: key,
        }) {
            let _ = soft.dealloc_mw(key);
            return Err(e);
        }
        o.mws.insert(
            h,
            MwObj {
                key,
                pd: r.pd_handle,
            },
        );
        Ok(Created::Nothing)
    }

    pub(super) fn dealloc_mw(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Handle = io.core()?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let mw = o.mws.remove(&r.handle).ok_or(Errno::EINVAL)?;
        soft.dealloc_mw(mw.key).map_err(|_| Errno::EINVAL)?;
        Ok(Created::Nothing)
    }
}
