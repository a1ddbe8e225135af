//! DEVX umems (UMEM REG / DEREG): application memory registered for the rings and doorbell
//! records of DEVX objects, in host memory or in GPU memory of the process (resolved through
//! CUDA, as nvidia-peermem lets mlx5_ib pin it), named by its address or by a dma-buf of it
//! (whose GPU range the preload saw the CUDA driver export). A umem stays until its last object
//! is gone.

use super::{refuse, syndrome, Refused};
use crate::abi::mlx5_ioctl::umem as a;
use crate::context::{user_buf, Context};
use crate::dmabuf;
use crate::ioctl::Call;
use crate::peermem;
use crate::uaccess::{check_mapped, Errno};
use prm::cmd::status;
use std::sync::Arc;
use verbs::DeviceMemory;
use verbs::DmaBuf;

/// `IB_ACCESS_*` a umem may carry: LOCAL_WRITE, REMOTE_WRITE, REMOTE_READ, RELAXED_ORDERING.
const ACCESS_LOCAL_WRITE: u64 = 1;
const ACCESS_REMOTE_WRITE: u64 = 2;
const ACCESS_KNOWN: u64 = 1 | 2 | 4 | 1 << 20;

/// A registered umem.
pub(in crate::context) struct Umem {
    /// The umem id PRM commands name.
    pub id: u32,
    addr: u64,
    len: u64,
    /// The GPU memory behind it; host memory when `None`.
    gpu: Option<Arc<dyn DeviceMemory>>,
    /// Objects built on it.
    pub users: u32,
}

impl Umem {
    /// `len` bytes at `offset` into the umem, for an object's ring or doorbell record.
    pub fn slice(&self, offset: u64, len: usize) -> Result<DmaBuf, Refused> {
        let bad = || refuse(status::BAD_PARAM, syndrome::UMEM_RANGE);
        let fits = offset
            .checked_add(len as u64)
            .is_some_and(|e| e <= self.len);
        if !fits || len == 0 {
            return bad();
        }
        let addr = self.addr + offset;
        match &self.gpu {
            None => user_buf(addr, len).or_else(|_| bad()),
            Some(mem) => Ok(DmaBuf::from_device(addr, len, mem.clone(), Box::new(()))),
        }
    }
}

impl Context {
    /// UMEM REG.
    pub(in crate::context) fn umem_reg(&self, call: &Call) -> Result<(), Errno> {
        call.only(&[
            a::HANDLE,
            a::ADDR,
            a::LEN,
            a::ACCESS,
            a::OUT_ID,
            a::PGSZ_BITMAP,
            a::DMABUF_FD,
        ])?;
        if !self.objs.lock().devx {
            return Err(Errno::EINVAL);
        }
        let addr = call.need(a::ADDR)?;
        let len = call.need(a::LEN)?;
        let access = call.need(a::ACCESS)?;
        if access & !ACCESS_KNOWN != 0
            || (access & ACCESS_REMOTE_WRITE != 0 && access & ACCESS_LOCAL_WRITE == 0)
        {
            return Err(Errno::EINVAL);
        }
        // page sizes the device may map it with: 4 KiB or larger
        let pgsz = call.value(a::PGSZ_BITMAP)?.unwrap_or(!0xfff);
        if pgsz >> 12 == 0 {
            return Err(Errno::EINVAL);
        }
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(Errno::EINVAL);
        }
        // a umem on a dma-buf: ADDR is the offset into it (as mlx5_ib's
        // ib_umem_dmabuf_get_pinned takes it), its bytes GPU memory
        let fd = call.has(a::DMABUF_FD).then(|| call.handle(a::DMABUF_FD));
        let (addr, gpu) = match fd.transpose()? {
            Some(fd) => {
                let at = dmabuf_umem(fd as i32, addr, len)?;
                (at, Some(peermem::resolve(at, len).ok_or(Errno::EFAULT)?))
            }
            None => match check_mapped(addr, len) {
                Ok(()) => (addr, None),
                Err(e) => (addr, Some(peermem::resolve(addr, len).ok_or(e)?)),
            },
        };
        let mut o = self.objs.lock();
        o.last_umem_id += 1;
        let id = o.last_umem_id;
        let h = o.handle();
        call.output(a::OUT_ID, &id.to_ne_bytes())?;
        call.new_handle(a::HANDLE, h)?;
        o.umems.insert(
            h,
            Umem {
                id,
                addr,
                len,
                gpu,
                users: 0,
            },
        );
        if fd.is_some() {
            crate::CUDA_SEEN
                .dmabuf_umems
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// UMEM DEREG: refused (EBUSY) while an object is built on the umem.
    pub(in crate::context) fn umem_dereg(&self, call: &Call) -> Result<(), Errno> {
        call.only(&[a::HANDLE])?;
        let h = call.handle(a::HANDLE)?;
        let mut o = self.objs.lock();
        let u = o.umems.get(&h).ok_or(Errno::EINVAL)?;
        if u.users > 0 {
            return Err(Errno::EBUSY);
        }
        o.umems.remove(&h);
        Ok(())
    }
}

/// The GPU address of `offset..offset+len` of dma-buf `fd`: the range the CUDA driver exported
/// it from (the preload records it, [`dmabuf::gpu_range`]). Not a dma-buf: EINVAL; beyond it:
/// EINVAL; a dma-buf whose export this process did not see: EOPNOTSUPP, said on stderr.
fn dmabuf_umem(fd: i32, offset: u64, len: u64) -> Result<u64, Errno> {
    if !dmabuf::is_dmabuf(fd)? {
        return Err(Errno::EINVAL);
    }
    let Some(r) = dmabuf::gpu_range(fd) else {
        crate::complain(format_args!(
            "UMEM_REG on dma-buf fd {fd}: its GPU range is unknown (only dma-bufs that \
             cuMemGetHandleForAddressRange exported in this process are served; EOPNOTSUPP)"
        ));
        return Err(Errno::EOPNOTSUPP);
    };
    match offset.checked_add(len) {
        Some(end) if end <= r.len => Ok(r.addr + offset),
        _ => Err(Errno::EINVAL),
    }
}
