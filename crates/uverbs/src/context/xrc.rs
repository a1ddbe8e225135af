//! XRC domains: OPEN_XRCD and CLOSE_XRCD. A domain opened with a file (`ibv_open_xrcd` with
//! `IBV_XRCD_INIT_ATTR_FD`) is the device's domain of that file's inode: every context of the
//! device that opens the same file shares it (O_CREAT makes one when none is open, O_EXCL
//! refuses an open one), as the kernel's inode table does. XRC SRQs (`srq.rs`, CREATE_XSRQ)
//! and XRC target QPs (`qp.rs`) hang off a domain; a domain in use cannot be closed (EBUSY).
//! OPEN_QP gives a context a handle on an XRC target of a domain it opened: the target lives
//! until its last handle, the creator's or an opened one, is destroyed (`xrc_target`).

use super::qp::QpObj;
use super::xrc_target::TgtShare;
use super::{Context, Created, Io};
use crate::abi;
use crate::uaccess::Errno;
use std::sync::Arc;

pub(super) struct XrcdObj {
    pub(super) soft: Arc<softnic::Xrcd>,
}

impl Context {
    /// OPEN_XRCD: `fd` -1 for a domain of its own, else the domain of the file's inode.
    pub(super) fn open_xrcd(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::OpenXrcd = io.core()?;
        let soft = self.soft()?;
        let inode = match r.fd as i32 {
            -1 => None,
            fd => Some(inode_of(fd)?),
        };
        let create = r.oflags & libc::O_CREAT as u32 != 0;
        let excl = r.oflags & libc::O_EXCL as u32 != 0;
        let xrcd = self.dev.xrcd_for(&soft, inode, create, excl)?;
        let mut o = self.objs.lock();
        let h = o.handle();
        io.reply(&abi::OpenXrcdResp { xrcd_handle: h })?;
        o.xrcds.insert(h, XrcdObj { soft: xrcd });
        Ok(Created::Nothing)
    }

    /// CLOSE_XRCD: EBUSY while an XRC SRQ or XRC target QP of this context uses the domain.
    pub(super) fn close_xrcd(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Handle = io.core()?;
        let mut o = self.objs.lock();
        let x = o.xrcds.get(&r.handle).ok_or(Errno::EINVAL)?.soft.clone();
        let on = |d: Option<&Arc<softnic::Xrcd>>| d.is_some_and(|d| Arc::ptr_eq(d, &x));
        let used = o
            .srqs
            .values()
            .any(|s| s.xrc.is_some_and(|(h, _)| h == r.handle))
            || o.qps.values().any(|q| on(q.soft.xrcd()));
        if used {
            return Err(Errno::EBUSY);
        }
        o.xrcds.remove(&r.handle);
        Ok(Created::Nothing)
    }
}

impl Context {
    /// OPEN_QP: a handle on the XRC target `qpn` of the domain `pd_handle` names (its
    /// type must be `IB_QPT_XRC_TGT`; a number no target of that domain has: EINVAL, as
    /// `ib_open_qp`).
    pub(super) fn open_qp(&self, io: &Io<'_>) -> Result<Created, Errno> {
        const IB_QPT_XRC_TGT: u8 = 10;
        let r: abi::OpenQp = io.core()?;
        if r.qp_type != IB_QPT_XRC_TGT {
            return Err(Errno::EINVAL);
        }
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let xrcd = o.xrcds.get(&r.pd_handle).ok_or(Errno::EINVAL)?.soft.clone();
        let share = TgtShare::find(&soft, &xrcd, r.qpn).ok_or(Errno::EINVAL)?;
        let h = o.handle();
        let q = QpObj::opened(share, r.pd_handle, h);
        io.reply(&abi::CreateQpResp {
            qp_handle: h,
            qpn: r.qpn,
            ..Default::default()
        })?;
        o.qps.insert(h, q);
        Ok(Created::Nothing)
    }
}

/// The (device, inode number) of the file open at `fd` in this process; EBADF when none is.
fn inode_of(fd: i32) -> Result<(u64, u64), Errno> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstat writes a `struct stat` into the buffer it is given (zeroed, the right
    // size) and reads nothing else of ours.
    let rc = unsafe { libc::fstat(fd, st.as_mut_ptr()) };
    if rc != 0 {
        return Err(Errno::EBADF);
    }
    // SAFETY: fstat succeeded: it filled the struct.
    let st = unsafe { st.assume_init() };
    Ok((st.st_dev, st.st_ino))
}
