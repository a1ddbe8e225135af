//! DEVX umems (UMEM REG / DEREG): application memory registered for the rings and doorbell
//! records of DEVX objects, in host memory or in GPU memory of the process (resolved through
//! CUDA, as nvidia-peermem lets mlx5_ib pin it). A umem stays until its last object is gone.

use super::{refuse, syndrome, Refused};
use crate::abi::mlx5_ioctl::umem as a;
use crate::context::{user_buf, Context};
use crate::ioctl::Call;
use crate::peermem;
use crate::uaccess::{check_mapped, Errno};
use prm::cmd::status;
use softnic::buffer::DmaBuf;
use softnic::devmem::DeviceMemory;
use std::sync::Arc;

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
        if call.has(a::DMABUF_FD) {
            crate::complain(format_args!(
                "DEVX umems on a dma-buf are not served yet (EOPNOTSUPP); register the GPU \
                 address instead (the nvidia-peermem path)"
            ));
            return Err(Errno::EOPNOTSUPP);
        }
        let gpu = match check_mapped(addr, len) {
            Ok(()) => None,
            Err(e) => Some(peermem::resolve(addr, len).ok_or(e)?),
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
